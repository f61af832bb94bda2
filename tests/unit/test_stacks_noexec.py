"""The py-spy cache on a host whose home is mounted ``noexec`` (NFS homes of HPC clusters): the
runtime folder instead, or a message that says why, never "no py-spy" (``dlrun.remote.stacks``)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from dlrun.remote import stacks

from support.mounts import tmpfs


@pytest.fixture
def noexec_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    with tmpfs(tmp_path / "cache", "size=1m,noexec") as cache:
        monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
        yield cache


def test_a_noexec_cache_moves_to_the_runtime_folder(noexec_cache: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    assert not stacks.exec_allowed(str(noexec_cache / "dlrun" / "tools")) and stacks.exec_allowed(str(tmp_path))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert stacks.cache_dir() == str(tmp_path / "dlrun" / "tools")


def test_without_a_runtime_folder_the_answer_says_noexec_not_no_pyspy(noexec_cache: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("PATH", str(noexec_cache))  # no py-spy of the machine's own
    data = b"#!/bin/sh\nexit 0\n"
    sha = hashlib.sha256(data).hexdigest()
    assert stacks.install({"sha256": sha, "size": len(data)}, data)["path"].startswith(str(noexec_cache))
    assert stacks.have({"sha256": sha})["noexec"] is True  # the client does not send it again
    answer = stacks.take({"sha256": sha, "pids": {"0": os.getpid()}})
    assert "on a mount where programs may not run (noexec)" in answer["ranks"]["0"]["error"]
