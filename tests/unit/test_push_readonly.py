"""A push into a folder on a read-only mount is refused by name: "read-only file system", not
"permission denied", which sends a root user looking at modes (``push_helper.survey``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from dlrun.remote import push_helper


def test_a_read_only_mount_is_named_as_such(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True,
                             text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {mounted.stderr.strip()}")
    try:
        reply, _, _ = push_helper.survey({"root": str(ro / "proj"), "paths": []})
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=False)
    assert reply["error"] == f"read-only file system (cannot create {ro / 'proj'})"
