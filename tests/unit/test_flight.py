"""Reading flight recorder dumps recorded from real gloo ranks (``tests/fixtures/flight_recorder/
record.py``: rank 1 never enters the third collective), their digests (what a keeper sends its
leader), and refusing pickles that are not dumps."""

from __future__ import annotations

import json
import os
import pickle
import time
from pathlib import Path
from typing import Any

import pytest

from dlrun.remote import keeper, source_of
from dlrun.remote.stack_groups import (
    DIGEST_ENTRIES,
    dump_digest,
    lagging_lines,
    left_on_host,
    rank_of,
    read_dump,
    silent_lines,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "flight_recorder"


def dumps() -> dict[int, dict[str, object]]:
    found = {}
    for path in FIXTURES.glob("trace_rank_*"):
        rank, dump = rank_of(path.name), read_dump(path.read_bytes())
        assert rank is not None and dump is not None
        found[rank] = dump
    return found


def test_the_rank_behind_is_named_with_where_the_others_went() -> None:
    assert lagging_lines(dumps()) == ["flight recorder: rank 1 is behind in process group 0: last collective"
                                      " #2 gloo:all_reduce, while ranks 0,2 entered #3 gloo:broadcast"]


def test_ranks_that_agree_say_nothing() -> None:
    found = dumps()
    assert lagging_lines({0: found[0], 2: found[2]}) == []


def test_without_pg_status_the_entries_tell() -> None:
    found = {rank: {k: v for k, v in dump.items() if k != "pg_status"} for rank, dump in dumps().items()}
    assert lagging_lines(found)[0].startswith("flight recorder: rank 1 is behind in process group 0:")


def test_a_pickle_that_names_a_class_or_is_no_dump_is_not_read() -> None:
    assert read_dump(pickle.dumps(Path("x"))) is None  # would construct an object
    assert read_dump(pickle.dumps(os.system)) is None  # would name a function
    assert read_dump(b"not a pickle") is None
    assert read_dump(pickle.dumps([1, 2])) is None  # plain, but not a dump


def test_a_digest_says_what_the_whole_dump_says_and_survives_json() -> None:
    found = dumps()
    digests = {rank: json.loads(json.dumps(dump_digest(dump))) for rank, dump in found.items()}
    assert lagging_lines(digests) == lagging_lines(found)
    without_status = {rank: {k: v for k, v in d.items() if k != "pg_status"} for rank, d in digests.items()}
    assert lagging_lines(without_status) == lagging_lines(found)


def test_a_digest_keeps_each_groups_latest_collectives_only() -> None:
    entries = [{"pg_id": pg, "collective_seq_id": seq, "profiling_name": f"nccl:all_reduce{seq}", "is_p2p": False}
               for seq in range(1, 201) for pg in (0, 1)]
    entries.append({"pg_id": 0, "collective_seq_id": 0, "profiling_name": "nccl:send", "is_p2p": True})
    digest = dump_digest({"entries": entries, "pg_status": {"0": {"last_enqueued_collective": 200}}})
    kept = [(e["pg_id"], e["collective_seq_id"]) for e in digest["entries"]]
    assert len(kept) == 2 * DIGEST_ENTRIES and ("0", 200) in kept and ("1", 137) in kept and ("1", 136) not in kept
    assert digest["pg_status"] == {"0": {"last_enqueued_collective": 200}}


def test_ranks_asked_that_sent_nothing_are_named_only_beside_ranks_that_did() -> None:
    assert silent_lines([0, 1, 2, 3], [0, 2]) == [
        "flight recorder: ranks 1,3 sent no dump back when asked (ranks 0,2 did): no NCCL process group there"
        " yet, or stuck where torch's dump thread cannot run"]
    assert silent_lines([0, 1], []) == []  # none answered: gloo only, or none had a pipe: no clue in that
    assert silent_lines([0, 1], [0, 1]) == []
    assert silent_lines([], [0]) == []  # no hang asked: a dump on a watchdog timeout names nobody


def flight_leader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A torch job's leader keeper (rank 0 on h) with one follower (rank 1 on f), as loaded on a host."""
    env = {"TORCH_FR_DUMP_TEMP_FILE": "/tmp/x/trace_rank_", "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": "/tmp/x/pipe_rank_"}
    config = {"job_id": "j", "host": "h", "leader": True,
              "specs": [{"job_id": "j", "ranks": [{"rank": 0, "env": env}]}],
              "world": {"0": "h", "1": "f"}, "followers": ["f"], "rankpolicy_source": source_of("rankpolicy"),
              "groups_source": source_of("stack_groups")}
    one = keeper.Keeper(config, str(tmp_path), None, None)
    monkeypatch.setattr(one, "stop_own", lambda: setattr(one, "stopping", True))  # no agent here to stop
    return one


def test_the_leader_keeper_waits_for_the_followers_digests_then_says_what_an_attached_launch_says(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    one = flight_leader(tmp_path, monkeypatch)
    one.on_rank("h", 0, "exited", 3, {"stopped": False})
    one.on_rank("f", 1, "exited", 143, {"stopped": True})
    one.on_frame(keeper.FILE, -1, b"trace_rank_0\0" + (FIXTURES / "trace_rank_0").read_bytes())
    one.on_frame(keeper.DONE, -1, b"")
    assert not one.decide()  # f's digests are not in yet
    digest = dump_digest(read_dump((FIXTURES / "trace_rank_1").read_bytes()) or {})
    one.on_message("f", json.loads(json.dumps({"op": "flight", "attempt": 0, "digests": {"1": digest}})))
    assert one.decide() and one.exit_code == 3
    assert one.record()["flight_recorder"] == [
        "flight recorder: rank 1 is behind in process group 0: last collective #2 gloo:all_reduce, while rank 0"
        " entered #3 gloo:broadcast",
        "flight recorder dumps: ~/.dlrun/jobs/j/host-<host>/attempt-0/flight-recorder/ on each host (ranks 0-1)"]
    assert (tmp_path / "attempt-0" / "flight-recorder" / "trace_rank_0").is_file()


def test_the_leader_keeper_does_not_wait_for_a_lost_host_nor_for_ever(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    lost = flight_leader(tmp_path / "lost", monkeypatch)
    lost.on_frame(keeper.DONE, -1, b"")
    lost.lose_host("f", "silent for 30 s")
    lost.on_rank("h", 0, "exited", 143, {"stopped": True})
    assert lost.decide() and lost.exit_code == 255 and lost.record()["flight_recorder"] == []
    silent = flight_leader(tmp_path / "silent", monkeypatch)
    silent.on_frame(keeper.DONE, -1, b"")
    silent.on_rank("h", 0, "exited", 3, {"stopped": False})
    silent.on_rank("f", 1, "exited", 143, {"stopped": True})
    assert not silent.decide()
    later = time.monotonic() + keeper.FLIGHT_WAIT + 1
    monkeypatch.setattr(time, "monotonic", lambda: later)
    assert silent.decide() and silent.exit_code == 3  # FLIGHT_WAIT passed: the result without f's


def left_frame(name: str, size: int) -> bytes:
    """What an agent sends for a dump past its host's budget (``agent.send_recordings``)."""
    return b"\0" + json.dumps({"name": name, "path": f"/tmp/x/{name}", "size": size, "limit": 16 << 20}).encode()


def test_a_dump_too_large_to_send_is_named_with_its_host_and_path() -> None:
    assert left_on_host(left_frame("trace_rank_3", 40 << 20), "gpu7") == (
        3, "flight recorder: rank 3's dump (40.0 MiB, over the 16 MiB a host sends back) stayed on gpu7:"
           " /tmp/x/trace_rank_3")
    assert left_on_host(b"trace_rank_3\0" + b"\0data", "gpu7") is None  # a dump's own frame
    assert left_on_host(b"\0not json", "gpu7") is None


def test_a_keeper_notes_where_a_dump_too_large_to_send_stayed_and_counts_it_as_sent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    one = flight_leader(tmp_path, monkeypatch)
    one.record_asked = [0, 1]
    one.on_frame(keeper.FILE, -1, left_frame("trace_rank_0", 20 << 20))
    assert 0 in one.digests and not (tmp_path / "attempt-0" / "flight-recorder").exists()
    assert ("flight recorder: rank 0's dump (20.0 MiB, over the 16 MiB a host sends back) stayed on h:"
            " /tmp/x/trace_rank_0") in one.notes
    evidence = one.flight_evidence()
    assert not any("rank 0 sent no dump" in line for line in evidence)
    assert not any(line.startswith("flight recorder dumps:") for line in evidence), evidence  # not in ~/.dlrun
