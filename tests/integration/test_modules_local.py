"""``-m`` and ``python`` commands on localhost workers, and the usage errors of the script forms."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from support.cli import run_dlrun


def test_a_module_and_a_python_command_run_with_dlruns_python_here(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "train.py").write_text(
        "import os, sys\nprint('ran', os.environ['DLRUN_RANK'], sys.executable, ' '.join(sys.argv[1:]))\n")
    for form in (["-m", "pkg.train"], ["python", "-m", "pkg.train"], ["python3", "pkg/train.py"]):
        out = run_dlrun("launch", "--plain", "--framework", "none", *form, "--x", "1", cwd=tmp_path)
        assert out.returncode == 0, (form, out.stdout[-2000:], out.stderr[-2000:])
        assert sorted(re.findall(r"\] ran (.*)$", out.stdout, re.M)) == [f"{r} {sys.executable} --x 1" for r in "01"]


def test_script_forms_that_cannot_work_are_usage_errors(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("print(1)\n")
    for args, words in ((["-m", "train.py"], "-m takes a module name (pkg.train), not a file"),
                        (["nosuch.R"], "script not found: nosuch.R"),
                        (["-m", "--no-python", "pkg.train"], "-m and --no-python exclude each other"),
                        (["--backend", "spark", "--master", "local[2]", "-m", "pkg.train"],
                         "--module goes with the SSH backend")):
        out = run_dlrun("launch", "--plain", "--framework", "none", *args, cwd=tmp_path)
        assert out.returncode == 2 and words in out.stderr, (args, out.stderr)
