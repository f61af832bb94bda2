"""``--framework auto``: a script's imports pick its rank contract, read with ast, never run."""

from __future__ import annotations

import json

import pytest

from dlrun.inventory import parse_inline
from dlrun.plan import TF_AND_TORCH, detect_framework, make_plan
from dlrun.render import worker_commands


@pytest.mark.parametrize(("source", "framework", "reason"), [
    ("import torch\n", "torch", "import torch in train.py"),
    ("import lightning as L\n", "torch", "import lightning in train.py"),
    ("from pytorch_lightning import Trainer\n", "torch", "import pytorch_lightning in train.py"),
    ("from accelerate import Accelerator\n", "torch", "import accelerate in train.py"),
    ("def main():\n    import transformers\n", "torch", "import transformers in train.py"),
    ("import horovod.torch as hvd\nimport torch\n", "horovod", "import horovod in train.py"),
    ("import tensorflow as tf\n", "tf", "import tensorflow in train.py"),
    ("import keras\n", "tf", "import keras in train.py"),
    ("from tf_keras import layers\n", "tf", "import tf_keras in train.py"),
])
def test_imports_name_the_framework(source: str, framework: str, reason: str) -> None:
    detected = detect_framework("jobs/train.py", source)
    assert (detected.framework, detected.reason) == (framework, reason)


@pytest.mark.parametrize("source", ["import numpy\n", "import torch\nimport tensorflow\n", "def (:\n"])
def test_nothing_or_both_or_unreadable_get_both_contracts(source: str) -> None:
    assert detect_framework("train.py", source).framework == TF_AND_TORCH


def test_a_script_that_is_not_python_gets_both_contracts() -> None:
    detected = detect_framework("./run.sh", None)
    assert detected.framework == TF_AND_TORCH and "run.sh is not a Python script" in detected.reason


def test_both_contracts_do_not_collide() -> None:
    plan = make_plan(parse_inline("a:2,b:2"), job_id="j", framework=TF_AND_TORCH)
    env = worker_commands(plan, "run.sh", [], python_for={"a": ["p"], "b": ["p"]})[3].env
    assert json.loads(env["TF_CONFIG"])["task"] == {"type": "worker", "index": 3}
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["TORCHELASTIC_RUN_ID"]) == ("3", "1", "4", "j")
