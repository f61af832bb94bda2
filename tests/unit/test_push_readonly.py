"""A push into a folder on a read-only mount is refused by name: "read-only file system", not
"permission denied", which sends a root user looking at modes (``push_helper.survey``)."""

from __future__ import annotations

from pathlib import Path

from dlrun.remote import push_helper

from support.mounts import tmpfs


def test_a_read_only_mount_is_named_as_such(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "ro", "ro,size=1m") as ro:
        reply, _, _ = push_helper.survey({"root": str(ro / "proj"), "paths": []})
    assert reply["error"] == f"read-only file system (cannot create {ro / 'proj'})"
