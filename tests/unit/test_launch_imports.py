"""What a launch's client imports: the modules only some commands or failures use stay out.

Every ``dlrun launch`` pays for its imports (docs/benchmarks.md, "Client imports"); these are
imported where they are used: stacks (``dlrun stack``, ``--hang-timeout``), flight recorder dumps
(pickle), py-spy shipping, the frameworks, Spark, and SSH only where a host is reached over it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

LATER = ("dlrun.remote.stack_groups", "dlrun.run.tools", "dlrun.spark", "dlrun.transport.ssh", "paramiko",
         "invoke", "pyspark", "torch", "tensorflow", "rich.live", "pickle")


def test_the_launch_pipeline_imports_none_of_what_only_some_launches_use() -> None:
    code = ("import sys, dlrun.cli, dlrun.api, dlrun.run.pipeline, dlrun.run.hosts, dlrun.run.config;"
            f"print(sorted(m for m in {LATER!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
