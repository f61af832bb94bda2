"""A small tmpfs for a test (a full disk, a read-only or ``noexec`` mount), as root: skipped where
it cannot be mounted, unmounted (lazily) however the test ends."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def tmpfs(path: Path, options: str) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    umount = shutil.which("umount") or "umount"  # found now: a test may empty PATH
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True,
                             text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs ({options}) here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run([umount, "-l", str(path)], check=False)
