"""paramiko is imported without invoke (and its unittest.mock), invoke stays importable, and the
fallback config parser gets it back for ``Match exec``. A fresh interpreter each: the import order
is what is tested."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(importlib.util.find_spec("invoke") is None, reason="invoke is not installed")


def run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_ssh_transport_imports_paramiko_without_invoke_and_invoke_still_imports() -> None:
    assert run("import dlrun.transport.ssh, sys; print('invoke' in sys.modules, 'unittest.mock' in sys.modules)"
               ) == "False False"
    assert run("import dlrun.transport.ssh, invoke; print(invoke.__name__)") == "invoke"


def test_the_fallback_parser_runs_match_exec(tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.write_text("Match exec \"true\"\n  Port 2345\nHost *\n  User someone\n")
    code = ("from dlrun.transport.ssh_config import SSHConfigReader, Request\n"
            f"reader = SSHConfigReader({str(config)!r}, None)\n"
            "print(reader.lookup(Request('somehost')).port)")
    assert run(code) == "2345"
