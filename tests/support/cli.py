"""The real ``dlrun`` CLI as a subprocess of the tests (this checkout's copy, whatever is installed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

#: The repository's root (the checkout under test).
REPO = Path(__file__).resolve().parents[2]


def dlrun_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "dlrun", *args]


def run_dlrun(*args: str, cwd: Path | None = None, timeout: float = 300, env: dict[str, str] | None = None,
              ) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(dlrun_argv(*args), cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=full_env)
