"""Shared test helpers: run the real ``dlrun`` CLI as a subprocess, find job processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO.parent / "shared" / "fixtures" / "topology"


def dlrun_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "dlrun", *args]


def run_dlrun(*args: str, cwd: Path | None = None, timeout: float = 300, env: dict[str, str] | None = None,
              ) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(dlrun_argv(*args), cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=full_env)


def job_processes(job_id: str) -> list[int]:
    """Pids of every process on this machine whose environment carries DLRUN_JOB_ID=job_id."""
    tag = f"DLRUN_JOB_ID={job_id}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                if tag in fh.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path
