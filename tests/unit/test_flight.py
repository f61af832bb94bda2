"""Reading flight recorder dumps recorded from real gloo ranks (``tests/fixtures/flight_recorder/
record.py``: rank 1 never enters the third collective), and refusing pickles that are not dumps."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

from dlrun.run.flight import lagging_lines, rank_of, read_dump

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
