"""PyTorch flight recorder dumps, read: which rank is behind in its collectives (pure).

A dump (``TORCH_FR_DUMP_TEMP_FILE<rank>``, written by torch on an NCCL watchdog timeout or on
demand) is a pickle of plain values: it is read with an unpickler that refuses every class, so
a dump can name no code to run. Each process group's ``pg_status`` says how far the rank got
(``last_enqueued_collective``); a rank whose count is lower than the others' is behind, and the
collective the others entered next is what it never reached. Mechanism: ``docs/stacks.md``.
"""

from __future__ import annotations

import io
import re
from collections.abc import Mapping
from typing import Any

DUMP_NAME = re.compile(r"(\d+)$")  # trace_rank_<N>


def read_dump(data: bytes) -> dict[str, Any] | None:
    """A dump's dict, or None for anything that is not one made of plain values."""
    import pickle  # here, not at the top: every launch imports this module, few read a dump

    class _PlainValues(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            raise pickle.UnpicklingError(f"a flight recorder dump names {module}.{name}: not read")

    try:
        found = _PlainValues(io.BytesIO(data)).load()
    except Exception:
        return None
    return found if isinstance(found, dict) else None


def rank_of(name: str) -> int | None:
    match = DUMP_NAME.search(name)
    return int(match.group(1)) if match else None


def _progress(dump: Mapping[str, Any]) -> dict[str, int]:
    """Process group id -> the last collective this rank enqueued there."""
    status = dump.get("pg_status")
    if isinstance(status, dict) and status:
        return {str(pg): int(s.get("last_enqueued_collective", -1)) for pg, s in status.items() if isinstance(s, dict)}
    found: dict[str, int] = {}
    for entry in dump.get("entries") or ():
        if not entry.get("is_p2p"):
            pg = str(entry.get("pg_id"))
            found[pg] = max(found.get(pg, -1), int(entry.get("collective_seq_id") or -1))
    return found


def _op(dump: Mapping[str, Any], pg: str, seq: int) -> str:
    for entry in dump.get("entries") or ():
        if str(entry.get("pg_id")) == pg and entry.get("collective_seq_id") == seq and not entry.get("is_p2p"):
            return f"#{seq} {entry.get('profiling_name')}"
    return f"#{seq}"


def lagging_lines(dumps: Mapping[int, Mapping[str, Any]]) -> list[str]:
    """One line per process group where the ranks' dumps disagree: who is behind, and where."""
    from dlrun.remote.stack_groups import rank_list  # only when a dump is read: launches import this module

    progress = {rank: _progress(dump) for rank, dump in dumps.items()}
    lines = []
    for pg in sorted({pg for p in progress.values() for pg in p}, key=lambda p: (len(p), p)):
        reached = {rank: p[pg] for rank, p in progress.items() if pg in p}
        if len(set(reached.values())) < 2:
            continue
        low = min(reached.values())
        behind = sorted(r for r, n in reached.items() if n == low)
        ahead = sorted(r for r, n in reached.items() if n > low)
        noun = "rank" if len(behind) == 1 else "ranks"
        verb = "is" if len(behind) == 1 else "are"
        last = _op(dumps[behind[0]], pg, low) if low >= 0 else "none"
        nxt = _op(dumps[ahead[0]], pg, low + 1)
        lines.append(f"flight recorder: {noun} {rank_list(behind)} {verb} behind in process group {pg}: "
                     f"last collective {last}, while {'rank' if len(ahead) == 1 else 'ranks'} "
                     f"{rank_list(ahead)} entered {nxt}")
    return lines
