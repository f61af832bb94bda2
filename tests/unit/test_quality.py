"""mypy --strict over the package and its tests, and ruff, as part of the suite."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support.cli import REPO


def tool(name: str) -> list[str]:
    try:
        __import__(name)
    except ImportError:
        pytest.skip(f"{name} is not installed (pip install -e '.[test]')")
    return [sys.executable, "-m", name]


def test_mypy_strict_is_clean() -> None:
    out = subprocess.run([*tool("mypy"), "--strict", "dlrun"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-4000:]


def test_the_tests_type_check_under_the_same_rules() -> None:
    """tests/ under pyproject's [tool.mypy] (strict; an ignore names its error code)."""
    out = subprocess.run([*tool("mypy"), "tests"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-4000:]


def test_ruff_is_clean() -> None:
    if shutil.which("ruff") is None:
        tool("ruff")
    out = subprocess.run([*tool("ruff"), "check", "dlrun", "tests", "examples", "bench"], cwd=REPO,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-4000:]


def test_the_readmes_python_api_lines_pass_mypy_strict(tmp_path: Path) -> None:
    """Every ```python block of the README that imports dlrun type-checks as a user's code would."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "import dlrun" in b]
    assert blocks, "the README shows the Python API"
    for i, block in enumerate(blocks):
        (tmp_path / f"readme_{i}.py").write_text(block)
    files = [str(p) for p in sorted(tmp_path.glob("*.py"))]
    out = subprocess.run([*tool("mypy"), "--strict", "--no-incremental", *files], cwd=REPO, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout[-4000:]
