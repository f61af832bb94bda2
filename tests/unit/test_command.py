"""What a launch runs: scripts, modules (``-m``), ``python …`` and R commands, as argv and as
the code whose imports pick the framework (pure: no process, no host)."""

from __future__ import annotations

import pytest

from dlrun.cli import SCRIPT_FORM_OPTIONS, _dlrun_options_first
from dlrun.command import EntryPoint, entry_point, module_paths, program_argv
from dlrun.inventory import parse_inline
from dlrun.plan import TF_AND_TORCH, detect_framework, make_plan
from dlrun.render import worker_commands

PY = ("/venv/bin/python",)


@pytest.mark.parametrize(("script", "args", "kwargs", "argv"), [
    ("train.py", ["--x"], {}, ("/venv/bin/python", "train.py", "--x")),
    ("pkg.train", ["--x"], {"module": True}, ("/venv/bin/python", "-m", "pkg.train", "--x")),
    ("python", ["-m", "pkg.train"], {}, ("/venv/bin/python", "-m", "pkg.train")),
    ("python3", ["-u", "train.py"], {}, ("/venv/bin/python", "-u", "train.py")),
    ("python3.11", ["train.py"], {}, ("/venv/bin/python", "train.py")),
    ("/usr/bin/python3", ["train.py"], {}, ("/usr/bin/python3", "train.py")),  # a path is explicit
    ("pythonista", [], {}, ("pythonista",)),
    ("train.R", ["3"], {}, ("Rscript", "train.R", "3")),
    ("sub/run.sh", [], {}, ("bash", "sub/run.sh")),
    ("Rscript", ["train.R"], {}, ("Rscript", "train.R")),
    ("python", ["-m", "pkg.train"], {"no_python": True}, ("python", "-m", "pkg.train")),
    ("./train.py", [], {"no_python": True}, ("./train.py",)),
    ("train.R", [], {"no_python": True}, ("train.R",)),
])
def test_each_kind_of_program_runs_with_its_interpreter(script: str, args: list[str], kwargs: dict[str, bool],
                                                        argv: tuple[str, ...]) -> None:
    assert program_argv(script, args, PY, **kwargs) == argv


@pytest.mark.parametrize(("script", "args", "module", "entry"), [
    ("pkg.train", ["--x", "a.py"], True, EntryPoint("module", "pkg.train")),
    ("python", ["-u", "-X", "dev", "-m", "pkg.train", "x.py"], False, EntryPoint("module", "pkg.train")),
    ("python3", ["-mpkg.train"], False, EntryPoint("module", "pkg.train")),
    ("python3", ["-W", "error", "train.py", "-m", "x"], False, EntryPoint("file", "train.py")),
    ("python3", ["-c", "import torch", "x.py"], False, EntryPoint("none")),
    ("python3", [], False, EntryPoint("none")),
    ("train.R", [], False, EntryPoint("file", "train.R")),
    ("Rscript", ["--vanilla", "r/train.R", "3"], False, EntryPoint("file", "r/train.R")),
    ("bash", ["-c", "nvidia-smi -L"], False, EntryPoint("none")),
])
def test_the_entry_point_is_the_module_or_file_the_command_runs(script: str, args: list[str], module: bool,
                                                                entry: EntryPoint) -> None:
    assert entry_point(script, args, module=module) == entry


def test_a_modules_source_is_its_file_or_its_packages_main() -> None:
    assert module_paths("pkg.train") == ("pkg/train.py", "pkg/train/__main__.py")


@pytest.mark.parametrize(("source", "framework", "reason"), [
    ("library(tensorflow)\n", "tf", "library(tensorflow) in train.R"),
    ("suppressMessages(library(keras3))\n", "tf", "library(keras3) in train.R"),
    ('library(reticulate)\ntf <- import("tensorflow")\n', "tf", 'import("tensorflow") in train.R'),
    ("require('tensorflow')\n", "tf", "library(tensorflow) in train.R"),
    ('torch <- reticulate::import("torch")\n', "torch", 'import("torch") in train.R'),
    ('# library(tensorflow)\nx <- 1\n', TF_AND_TORCH, "no framework imported in train.R"),
    ("library(torch)\n", TF_AND_TORCH, "no framework imported in train.R"),  # R's torch is not torch.distributed
])
def test_r_scripts_name_their_framework(source: str, framework: str, reason: str) -> None:
    detected = detect_framework("r/train.R", source)
    assert detected.framework == framework and detected.reason.startswith(reason)


def test_an_r_command_gets_the_hosts_python_for_reticulate_unless_set() -> None:
    plan = make_plan(parse_inline("a:1,b:1"), job_id="j", framework="tf")
    python = {"a": ["/venv/bin/python"], "b": ["python3"]}
    a, b = worker_commands(plan, "Rscript", ["train.R"], python_for=python)
    assert a.env["RETICULATE_PYTHON"] == "/venv/bin/python" and "RETICULATE_PYTHON" not in b.env  # not a path
    (mine, _) = worker_commands(plan, "train.R", [], python_for=python, extra_env={"RETICULATE_PYTHON": "/p"})
    assert mine.env["RETICULATE_PYTHON"] == "/p" and mine.argv == ("Rscript", "train.R")
    (py, _) = worker_commands(plan, "pkg.train", [], python_for=python, module=True)
    assert "RETICULATE_PYTHON" not in py.env and py.argv == ("/venv/bin/python", "-m", "pkg.train")


def test_script_form_options_are_dlruns_only_before_the_script() -> None:
    takes = {"-m": False, "--module": False, "--no-python": False, "--hosts": True, "-H": True}

    def order(*args: str) -> list[str]:
        return _dlrun_options_first(list(args), takes, before_script=SCRIPT_FORM_OPTIONS)

    assert order("-m", "pkg.train", "--hosts", "h", "--lr", "1") == ["-m", "--hosts", "h", "pkg.train", "--lr", "1"]
    assert order("python", "-m", "pkg.train", "-H", "h") == ["python", "-m", "pkg.train", "-H", "h"]
    assert order("python", "-H", "h", "-m", "pkg.train") == ["-H", "h", "python", "-m", "pkg.train"]
    assert order("train.py", "--no-python") == ["train.py", "--no-python"]
