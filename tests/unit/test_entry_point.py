"""The ``dlrun`` entry point (``dlrun/__main__.py``): the CLI's exit code and an ordinary exit
(atexit handlers run, output flushed), with the run's objects frozen out of the collector."""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = """
import atexit, sys
atexit.register(lambda: print("atexit ran", flush=True))
sys.stdout.write("buffered, not flushed by the CLI\\n")
sys.argv = ["dlrun", *sys.argv[1:]]
from dlrun.__main__ import main
main()
"""


@pytest.mark.parametrize(("args", "code"), [(["--help"], 0), (["launch", "--no-such-option"], 2)])
def test_the_exit_keeps_the_code_atexit_and_buffered_output(args: list[str], code: int) -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True, cwd=REPO,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.returncode == code, out.stderr
    assert out.stdout.startswith("buffered, not flushed by the CLI\n")
    assert out.stdout.rstrip().endswith("atexit ran")


def test_the_runs_objects_are_frozen_out_of_the_collector(monkeypatch: pytest.MonkeyPatch) -> None:
    from dlrun.__main__ import main

    monkeypatch.setattr(sys, "argv", ["dlrun", "--help"])
    try:
        with pytest.raises(SystemExit):
            main()
        assert gc.get_freeze_count() > 0 and not gc.isenabled()
    finally:
        gc.unfreeze()
        gc.enable()
