"""mypy --strict and ruff over the package, as part of the suite."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from conftest import REPO


def tool(name: str) -> list[str]:
    try:
        __import__(name)
    except ImportError:
        pytest.skip(f"{name} is not installed (pip install -e '.[test]')")
    return [sys.executable, "-m", name]


def test_mypy_strict_is_clean() -> None:
    out = subprocess.run([*tool("mypy"), "--strict", "dlrun"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-4000:]


def test_ruff_is_clean() -> None:
    if shutil.which("ruff") is None:
        tool("ruff")
    out = subprocess.run([*tool("ruff"), "check", "dlrun", "tests", "examples", "bench"], cwd=REPO,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-4000:]
