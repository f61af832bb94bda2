"""The leader keeper's wait for the hosts' answers in a detached restart's checkpoint copy
(``Keeper.ask_hosts``): it ends on a closed follower, a stop and its deadline, and every worker
answers whatever goes wrong (``ckptsync.Worker``). The copy itself: tests/integration/test_checkpoints.py."""

from __future__ import annotations

import signal
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from dlrun.remote import keeper, source_of


@pytest.fixture
def leader(tmp_path: Path) -> Iterator[keeper.Keeper]:
    """Host a's leader keeper with a checkpoint folder and one follower, b, connected over a
    socket pair (nothing answers there unless the test says so)."""
    config = {"job_id": "j", "host": "a", "leader": True, "world": {"0": "a", "1": "b"}, "followers": ["b"],
              "rankpolicy_source": source_of("rankpolicy"), "specs": [{"job_id": "j", "ranks": [{"rank": 0}]}],
              "checkpoint": {"source": source_of("ckptsync"), "root": str(tmp_path), "helper_argv": ["false"],
                             "helper_source": "", "folders": ["ckpt"]}}
    ours, theirs = socket.socketpair()
    lead = keeper.Keeper(config, str(tmp_path), None, None)
    lead.peers["b"] = keeper.Peer(cast(ssl.SSLSocket, ours), "b")
    yield lead
    ours.close()
    theirs.close()


def test_a_follower_whose_keeper_closes_answers_an_error_at_once(leader: keeper.Keeper) -> None:
    assert leader.host_timeout is None  # no silence would end the wait
    leader.events.put(("peer-closed", "b"))
    answers = leader.ask_hosts({"a": {"do": "end"}, "b": {"do": "end"}})
    assert answers == {"a": {}, "b": {"error": "its keeper's connection closed"}}
    assert leader.events.get_nowait() == ("peer-closed", "b")  # held for the loop: it loses the host


def test_a_stop_gives_up_on_every_host_that_has_not_answered(leader: keeper.Keeper) -> None:
    leader.signals.append(signal.SIGTERM)
    answers = leader.ask_hosts({"b": {"do": "list", "folder": "ckpt"}})
    assert answers == {"b": {"error": "stopped by signal 15 while it copied"}}
    assert leader.signals == [signal.SIGTERM]  # the loop handles it
    # a follower's interrupt (dlrun stop reached it first) does the same
    leader.signals.clear()
    leader.events.put(("peer", "b", {"op": "interrupt", "signal": 15}))
    answers = leader.ask_hosts({"b": {"do": "list", "folder": "ckpt"}})
    assert answers == {"b": {"error": "stopped by signal 15 on b while it copied"}}
    assert leader.events.get_nowait()[2] == {"op": "interrupt", "signal": 15}


def test_every_host_the_leaders_own_too_has_one_deadline(leader: keeper.Keeper,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    assert leader.ckpt_worker is not None
    release = threading.Event()

    def stuck(_ask: dict[str, Any]) -> dict[str, Any]:
        release.wait(60)
        return {}

    monkeypatch.setattr(leader.ckpt_worker, "handle", stuck)
    monkeypatch.setattr(keeper, "CKPT_ANSWER", 0.5)
    try:
        answers = leader.ask_hosts({"a": {"do": "end"}, "b": {"do": "end"}})
    finally:
        release.set()
    assert answers == {"a": {"error": "no answer within 0.5 s"}, "b": {"error": "no answer within 0.5 s"}}


def test_a_worker_that_fails_unexpectedly_still_answers(leader: keeper.Keeper,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    worker = leader.ckpt_worker
    assert worker is not None

    def broken(_folder: str) -> dict[str, Any]:
        raise RuntimeError("dictionary changed size during iteration")

    monkeypatch.setattr(worker, "listing", broken)
    leader.peers["b"].closed = True
    answers = leader.ask_hosts({"a": {"do": "list", "folder": "ckpt"}, "b": {"do": "list", "folder": "ckpt"}})
    assert answers["a"] == {"error": "RuntimeError: dictionary changed size during iteration"}
    assert answers["b"] == {"error": "its keeper is not connected"}


def test_end_and_a_late_listing_share_the_workers_helpers_safely(leader: keeper.Keeper) -> None:
    """``end`` (the leader gave up) while a listing still registers its helper: no error, and
    whatever was registered is closed by the next ``end``."""
    worker = leader.ckpt_worker
    assert worker is not None
    answers: list[dict[str, Any]] = []

    def lister() -> None:
        for _ in range(20):
            answers.append(worker.handle({"do": "list", "folder": "ckpt"}))

    thread = threading.Thread(target=lister)
    thread.start()
    deadline = time.monotonic() + 60
    while thread.is_alive() and time.monotonic() < deadline:
        assert worker.handle({"do": "end"}) == {}
    thread.join(60)
    assert worker.handle({"do": "end"}) == {} and worker.listers == {}
    # ``false`` lists nothing: each listing is an error answer about the helper, never a crash
    assert len(answers) == 20 and all("error" in a and "RuntimeError" not in a["error"] for a in answers), answers


def test_a_staged_plan_renames_every_file_into_place_or_none(tmp_path: Path) -> None:
    """A checkpoint copy's receive (``"stage"``): a file that fails its check keeps the one that
    arrived whole from replacing its old copy, so no host mixes new files with old ones."""
    import hashlib
    import io
    import json
    import subprocess
    import sys
    import tarfile

    from support.cli import REPO

    def receive(root: Path, stage: bool, bad: bool = True) -> list[dict[str, Any]]:
        root.mkdir()
        (root / "model.pt").write_bytes(b"old model")
        (root / "optimizer.pt").write_bytes(b"old opt")
        files = {"model.pt": b"new model", "optimizer.pt": b"new opt"}
        digests = {n: hashlib.sha256(data).hexdigest() for n, data in files.items()}
        if bad:
            digests["optimizer.pt"] = "0" * 64  # its copy fails the check
        stream = io.BytesIO()
        with tarfile.open(fileobj=stream, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for name, data in files.items():
                info = tarfile.TarInfo(f"0/{name}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        proc = subprocess.Popen([sys.executable, str(REPO / "dlrun" / "remote" / "push_helper.py")],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps({"targets": [{"root": str(root), "paths": list(files),
                                                  "owner_check": False}]}).encode() + b"\n")
        proc.stdin.flush()
        assert "targets" in json.loads(proc.stdout.readline())
        plan = {"files": [[0, n, digests[n], 0o644, 1000] for n in files], "delete": [], "keep": [[]], "stage": stage}
        proc.stdin.write(json.dumps(plan).encode() + b"\n" + stream.getvalue() + bytes(1024))
        proc.stdin.close()
        said = [json.loads(line) for line in proc.stdout]
        assert proc.wait(60) == 0
        return said

    said = receive(tmp_path / "staged", stage=True)
    assert [m for m in said if "ok" in m] == [] and said[-1]["done"]["failed"] == 1, said
    assert (tmp_path / "staged" / "model.pt").read_bytes() == b"old model"  # not beside the old optimizer.pt
    assert sorted(p.name for p in (tmp_path / "staged").iterdir()) == ["model.pt", "optimizer.pt"]  # no temp left
    # every file whole: all in place
    said = receive(tmp_path / "whole", stage=True, bad=False)
    assert [m for m in said if "ok" in m] == [{"ok": "0/model.pt"}, {"ok": "0/optimizer.pt"}], said
    assert (tmp_path / "whole" / "optimizer.pt").read_bytes() == b"new opt"
    assert sorted(p.name for p in (tmp_path / "whole").iterdir()) == ["model.pt", "optimizer.pt"]
    # a push (not staged) renames each file as it arrives, as before
    said = receive(tmp_path / "push", stage=False)
    assert [m for m in said if "ok" in m] == [{"ok": "0/model.pt"}], said
    assert (tmp_path / "push" / "model.pt").read_bytes() == b"new model"
