"""A job in trouble, read: ranks' stacks grouped by where each rank is (what ``dlrun stack`` and
``--hang-timeout`` print), NCCL RAS's findings, and which rank PyTorch's flight recorder dumps
say is behind (pure functions). Standard library only, Python >= 3.8: the client imports it,
and a detached job's keepers load it from source (``--hang-timeout``, torch jobs' dumps).

The hosts answer with py-spy's JSON (``dlrun.remote.stacks``): two samples a few seconds
apart, each a list of threads, innermost frame first. A rank's *place* is its main thread's
Python frames; ranks at the same place in the last sample form a group, and a group says
whether its ranks were at the same place in both samples (hung) or moved (slow). The odd
group comes first: the smallest, and of equal ones the group that is not waiting in a
collective. Mechanism and methods: ``docs/stacks.md``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: Python frames from these places are library code: the summary names the user's frame below them.
LIBRARY_PARTS = ("site-packages/", "dist-packages/", "/lib/python", "<frozen ", "torch/", "<dlrun-")
#: A frame with one of these names, or in these files, waits for other ranks.
COLLECTIVES = frozenset((
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "broadcast",
    "barrier", "monitored_barrier", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single", "send", "recv",
    "wait", "synchronize", "allreduce", "allgather", "alltoall", "init_process_group", "_store_based_barrier",
    "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
))
COLLECTIVE_FILES = ("torch/distributed/", "horovod/", "tensorflow/python/distribute/")


@dataclass(frozen=True)
class Frame:
    name: str
    file: str  # short: as py-spy shortens it (``train.py``, ``torch/distributed/distributed_c10d.py``)
    line: int
    native: bool = False
    path: str = ""  # the whole file name, where known (tells library code from the user's)

    def text(self) -> str:
        if self.native:
            return f"{self.name} ({self.file})" if self.file else self.name
        return f"{self.name} ({self.file}:{self.line})"


@dataclass(frozen=True)
class Thread:
    ident: int  # the OS thread id
    name: str
    active: bool
    frames: tuple[Frame, ...]  # innermost first

    @property
    def python(self) -> tuple[Frame, ...]:
        return tuple(f for f in self.frames if not f.native)


@dataclass(frozen=True)
class Sample:
    time: float
    threads: tuple[Thread, ...] = ()
    error: str | None = None


@dataclass(frozen=True)
class RankStacks:
    """One rank's samples, and the method that took them (``py-spy``, ``py-spy --native``)."""

    rank: int
    host: str
    pid: int | None
    method: str
    samples: tuple[Sample, ...]
    error: str | None = None  # why no stack could be taken (no py-spy, ptrace refused, …)

    @property
    def taken(self) -> tuple[Sample, ...]:
        return tuple(s for s in self.samples if s.error is None and s.threads)


@dataclass(frozen=True)
class Group:
    """Ranks at the same place. ``same``: in both samples (None: one sample, or none)."""

    ranks: tuple[int, ...]
    hosts: tuple[str, ...]
    place: tuple[Frame, ...]  # the main thread's Python frames, innermost first
    where: str  # ``time.sleep ← stuck_in_data_loading (train.py:12)``
    same: bool | None
    waiting: bool  # in a collective: waits for other ranks
    error: str | None = None
    user: str = ""  # the user's frame alone: ``stuck_in_data_loading (train.py:12)``


# ----------------------------------------------------------------------------- parsing


def frame_of(item: Mapping[str, Any]) -> Frame:
    """One frame of py-spy's ``--json`` dump (a native one has ``module`` set and line 0)."""
    native = bool(item.get("module"))
    return Frame(name=str(item.get("name") or "?"), file=str(item.get("short_filename") or item.get("filename") or ""),
                 line=int(item.get("line") or 0), native=native, path=str(item.get("filename") or ""))


def threads_of(dump: Sequence[Mapping[str, Any]]) -> tuple[Thread, ...]:
    return tuple(Thread(ident=int(t.get("os_thread_id") or t.get("thread_id") or 0),
                        name=str(t.get("thread_name") or ""), active=bool(t.get("active")),
                        frames=tuple(frame_of(f) for f in t.get("frames") or ())) for t in dump)


def rank_stacks(host: str, answer: Mapping[str, Any]) -> list[RankStacks]:
    """A host's answer (``dlrun.remote.stacks``) as records; a host-wide error goes to each rank."""
    found = []
    for key, entry in sorted((answer.get("ranks") or {}).items(), key=lambda kv: int(kv[0])):
        samples = []
        for item in entry.get("samples") or ():
            dump = item.get("threads")
            if isinstance(dump, str):
                try:
                    dump = json.loads(dump)
                except ValueError:
                    dump = None
            samples.append(Sample(time=float(item.get("time") or 0),
                                  threads=threads_of(dump) if isinstance(dump, list) else (),
                                  error=item.get("error")))
        error = entry.get("error")
        if error is None and samples and all(s.error for s in samples):
            error = samples[-1].error
        found.append(RankStacks(rank=int(key), host=host, pid=entry.get("pid"), method=str(entry.get("method") or "?"),
                                samples=tuple(samples), error=error))
    return found


# ----------------------------------------------------------------------------- places


def main_thread(threads: Sequence[Thread], pid: int | None) -> Thread | None:
    """The thread that says where a rank is: Python's main thread, else the first with Python frames."""
    for thread in threads:
        if thread.name == "MainThread" or (pid is not None and thread.ident == pid):
            return thread
    return next((t for t in threads if t.python), threads[0] if threads else None)


def place_of(stacks: RankStacks, sample: Sample) -> tuple[Frame, ...]:
    thread = main_thread(sample.threads, stacks.pid)
    return thread.python if thread is not None else ()


def is_library(frame: Frame) -> bool:
    name = frame.path or frame.file
    return any(part in name for part in LIBRARY_PARTS) or name.startswith("/usr/lib/")


def waiting(place: Sequence[Frame]) -> bool:
    return any(f.name.rpartition(".")[2] in COLLECTIVES or any(p in f.file for p in COLLECTIVE_FILES)
               for f in place)


def user_frame(place: Sequence[Frame]) -> Frame | None:
    return next((f for f in place if not is_library(f)), place[-1] if place else None)


def where_text(place: Sequence[Frame], native: Sequence[Frame] = ()) -> str:
    """``inner ← user_frame (file:line)``: the innermost frame, and the user's frame it came
    from (the first that is not library code), where they differ."""
    if not place:
        return "no Python frames"
    user = user_frame(place)
    assert user is not None
    inner = place[0]
    if inner is user:
        named = [f for f in native if f.name and not f.name.startswith("0x")]
        head = named[0].name if named else None  # time_sleep: the C function the user's frame is in
        if head is None:
            return user.text()
        return f"{head} ← {user.text()}"
    return f"{inner.name} ← {user.text()}"


def native_above(thread: Thread | None) -> tuple[Frame, ...]:
    """The native frames inside the innermost Python frame (py-spy ``--native``)."""
    if thread is None:
        return ()
    above = []
    for frame in thread.frames:
        if not frame.native:
            break
        above.append(frame)
    return tuple(f for f in above if not f.file.startswith("libc.") and not f.file.startswith("libpthread"))


def group_ranks(stacks: Sequence[RankStacks]) -> list[Group]:
    """Ranks grouped by their place in the last sample, the odd group first."""
    buckets: dict[tuple[Any, ...], list[RankStacks]] = {}
    for rank in stacks:
        taken = rank.taken
        if not taken:
            key: tuple[Any, ...] = ("error", rank.error or "no stack taken")
        else:
            last = place_of(rank, taken[-1])
            same = None if len(taken) < 2 else place_of(rank, taken[0]) == last
            key = ("place", last, same)
        buckets.setdefault(key, []).append(rank)
    groups = []
    for key, members in buckets.items():
        ranks = tuple(sorted(r.rank for r in members))
        hosts = tuple(dict.fromkeys(r.host for r in sorted(members, key=lambda r: r.rank)))
        if key[0] == "error":
            groups.append(Group(ranks, hosts, (), "no stack", None, False, error=str(key[1])))
            continue
        place, same = key[1], key[2]
        first = min(members, key=lambda r: r.rank)
        thread = main_thread(first.taken[-1].threads, first.pid)
        user = user_frame(place)
        groups.append(Group(ranks, hosts, place, where_text(place, native_above(thread)), same, waiting(place),
                            user=user.text() if user is not None else ""))
    # the odd group first: fewest ranks; of equal size the one not waiting; errors last
    return sorted(groups, key=lambda g: (g.error is not None, len(g.ranks), g.waiting, g.ranks))


# ----------------------------------------------------------------------------- text


def rank_list(ranks: Sequence[int]) -> str:
    """``0,2-7``."""
    parts: list[str] = []
    ordered = sorted(ranks)
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def who(group: Group) -> str:
    noun = "rank" if len(group.ranks) == 1 else "ranks"
    hosts = ",".join(group.hosts) if len(group.hosts) <= 3 else f"{len(group.hosts)} hosts"
    return f"{noun} {rank_list(group.ranks)} ({hosts})"


def summary_lines(groups: Sequence[Group]) -> list[str]:
    """One line per group: who, where, and whether the place held over both samples."""
    rows = []
    for group in groups:
        if group.error is not None:
            rows.append((f"{who(group)}:", f"no stack: {group.error}", ""))
            continue
        mark = "" if group.same is None else "[same in both samples]" if group.same else "[changed]"
        rows.append((f"{who(group)}:", group.where, mark))
    width = max((len(a) + len(b) for a, b, _ in rows), default=0)
    return [f"{a} {b}{' ' * (width - len(a) - len(b))}    {c}".rstrip() for a, b, c in rows]


def hang_cause(groups: Sequence[Group]) -> str:
    """The root cause of a hang in a sentence: the odd group, and where the others wait."""
    found = [g for g in groups if g.error is None]
    if not found:
        return "no rank's stack could be taken: " + (groups[0].error or "?" if groups else "no ranks")
    odd = found[0]
    if len(found) > 1 and (len(found[1].ranks), found[1].waiting) == (len(odd.ranks), odd.waiting):
        # no odd one out (two ranks in two places, neither in a collective): say so, blame none
        return "the ranks disagree, none is the odd one: " + "; ".join(
            f"{'rank' if len(g.ranks) == 1 else 'ranks'} {rank_list(g.ranks)} on {','.join(g.hosts)}"
            f" {'is' if len(g.ranks) == 1 else 'are'} in {g.user or g.where}" for g in found)
    verb = "is" if len(odd.ranks) == 1 else "are"
    noun = "rank" if len(odd.ranks) == 1 else "ranks"
    hosts = ",".join(odd.hosts)
    text = f"{noun} {rank_list(odd.ranks)} on {hosts} {verb} in {odd.user or odd.where}"
    rest = found[1:]
    if not rest:
        return ("every rank is" if len(odd.ranks) > 1 else "the rank is") + f" in {odd.where}"
    others = sorted(r for g in rest for r in g.ranks)
    main = rest[-1]  # the largest group
    inner = main.place[0].name if main.place else main.where
    verb = "waits" if len(others) == 1 else "wait"
    noun = "rank" if len(others) == 1 else "ranks"
    return f"{text} while {noun} {rank_list(others)} {verb} in {inner}" if main.waiting else \
        f"{text} while {noun} {rank_list(others)} {'is' if len(others) == 1 else 'are'} in {main.where}"


def full_text(stacks: RankStacks) -> str:
    """A rank's whole stacks, every thread of every sample (the file in the job's log folder)."""
    lines = [f"rank {stacks.rank} on {stacks.host}, pid {stacks.pid}, taken by {stacks.method}"]
    if stacks.error:
        lines.append(f"no stack: {stacks.error}")
    for number, sample in enumerate(stacks.samples, 1):
        lines.append("")
        lines.append(f"sample {number} of {len(stacks.samples)} (time {sample.time:.3f})")
        if sample.error:
            lines.append(f"  failed: {sample.error}")
        for thread in sample.threads:
            state = "active" if thread.active else "idle"
            lines.append(f"  Thread {thread.ident} ({state}): {thread.name!r}")
            lines.extend(f"      {f.text()}" for f in thread.frames)
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- NCCL's RAS

_RAS_RANK = re.compile(r"^Rank (\d+) -- GPU \S+ managed by process \d+ on node (\S+)$")
#: The columns of the communicators table: ... Status Errors (NCCL 2.24 and later)
_RAS_ROW = re.compile(r"^\s*\d+(?:\s+\S+){5}\s+([A-Z]+)\s+([A-Z]+)\s*$")


def ras_lines(answers: Sequence[tuple[str, Mapping[str, Any]]]) -> list[str]:
    """What NCCL's RAS said (the first host answer with a ``nccl_ras`` text; ``dlrun.remote.stacks``),
    in a few lines: each block of its Errors and Warnings sections on one line, the ranks that
    an outlier block lists folded into a rank list; or that every communicator runs well."""
    for host, answer in answers:
        ras = answer.get("nccl_ras") or {}
        if ras.get("text"):
            return ["NCCL RAS (" + host + "): " + line for line in ras_findings(str(ras["text"]))]
    return []


def ras_findings(text: str) -> list[str]:
    """The Errors/Warnings blocks of ``ncclras``'s text output, one line each (pure)."""
    lines = text.splitlines()
    section = ""
    blocks: list[tuple[str, list[str]]] = []
    block: list[str] = []
    states: list[str] = []
    for number, line in enumerate(lines):
        following = lines[number + 1] if number + 1 < len(lines) else ""
        if following.strip() and set(following.strip()) == {"="}:  # a section's title
            if block:
                blocks.append((section, block))
            section, block = line.strip().split("...")[0].strip(), []
            continue
        if set(line.strip()) == {"="}:
            continue
        if section.startswith("Communicators"):
            row = _RAS_ROW.match(line)
            if row:
                states.append(" ".join(row.groups()))
        elif section in ("Errors", "Warnings"):
            if line.strip():
                block.append(line.strip())
            elif block:
                blocks.append((section, block))
                block = []
    if block:
        blocks.append((section, block))
    found = [f"{section.lower().rstrip('s')}: {' - '.join(_fold_ranks(block))}"
             for section, block in blocks if section in ("Errors", "Warnings")]
    if not found and states:
        found.append("every communicator " + ", ".join(sorted(set(states))))
    return found[:12]


def _fold_ranks(block: Sequence[str]) -> list[str]:
    """``Rank N -- GPU g managed by process p on node h`` lines as one ``ranks N,… (on h, …)``."""
    out: list[str] = []
    ranks: list[int] = []
    nodes: list[str] = []
    for line in [*block, ""]:
        match = _RAS_RANK.match(line)
        if match:
            ranks.append(int(match.group(1)))
            if match.group(2) not in nodes:
                nodes.append(match.group(2))
            continue
        if ranks:
            noun = "rank" if len(ranks) == 1 else "ranks"
            out[-1 if out else 0:] = [(out[-1] + ": " if out else "") + f"{noun} {rank_list(sorted(ranks))} "
                                      f"(on {', '.join(nodes)})"]
            ranks, nodes = [], []
        if line:
            out.append(line)
    return out


# ----------------------------------------------------------------------------- flight recorder
# A dump (``TORCH_FR_DUMP_TEMP_FILE<rank>``, written by torch on an NCCL watchdog timeout or on
# demand) is a pickle of plain values, read with an unpickler that refuses every class: a dump can
# name no code to run. Each process group's ``pg_status`` says how far the rank got
# (``last_enqueued_collective``); a rank whose count is lower than the others' is behind, and the
# collective the others entered next is what it never reached.

DUMP_NAME = re.compile(r"(\d+)$")  # trace_rank_<N>
DIGEST_ENTRIES = 64  # collectives per process group a digest keeps, the latest


def read_dump(data: bytes) -> dict[str, Any] | None:
    """A dump's dict, or None for anything that is not one made of plain values."""
    import io
    import pickle  # here, not at the top: few jobs read a dump

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


def dump_digest(dump: Mapping[str, Any]) -> dict[str, Any]:
    """What ``lagging_lines`` reads of a dump, small enough for a keeper to send its leader as
    JSON: each process group's status and its latest ``DIGEST_ENTRIES`` collectives."""
    status = dump.get("pg_status")
    entries: list[dict[str, Any]] = []
    kept: dict[str, int] = {}
    for entry in reversed(list(dump.get("entries") or ())):
        if not isinstance(entry, dict) or entry.get("is_p2p"):
            continue
        pg = str(entry.get("pg_id"))
        if kept.get(pg, 0) < DIGEST_ENTRIES:
            kept[pg] = kept.get(pg, 0) + 1
            entries.append({"pg_id": pg, "collective_seq_id": entry.get("collective_seq_id"),
                            "profiling_name": str(entry.get("profiling_name"))})
    digest: dict[str, Any] = {"entries": entries[::-1]}
    if isinstance(status, dict) and status:
        digest["pg_status"] = {str(pg): {"last_enqueued_collective": s.get("last_enqueued_collective", -1)}
                               for pg, s in status.items() if isinstance(s, dict)}
    return digest


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
    """One line per process group where the ranks' dumps (or digests) disagree: who is behind, and where."""
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


def left_on_host(payload: bytes, host: str) -> tuple[int, str] | None:
    """(rank, line) of an agent's FILE frame that names a dump too large to send back (NUL, then
    JSON: name, path, size, limit): where it is, on which host; ``None`` for a dump's frame."""
    if not payload.startswith(b"\0"):
        return None
    try:
        left = json.loads(payload[1:])
        rank, size, limit = rank_of(str(left["name"])), int(left["size"]), int(left["limit"])
        path = str(left["path"])
    except (ValueError, KeyError, TypeError):
        return None
    if rank is None:
        return None
    return rank, (f"flight recorder: rank {rank}'s dump ({size / (1 << 20):.1f} MiB, over the"
                  f" {limit / (1 << 20):g} MiB a host sends back) stayed on {host}: {path}")


def silent_lines(asked: Sequence[int], came: Sequence[int]) -> list[str]:
    """The ranks a hang asked for a dump (running, with torch's pipe) that sent none back while
    others did: no NCCL process group there yet, or stuck where torch's dump thread cannot run."""
    silent = sorted(set(asked) - set(came))
    if not silent or not came:
        return []
    return [f"flight recorder: {'rank' if len(silent) == 1 else 'ranks'} {rank_list(silent)} sent no dump back"
            f" when asked ({'rank' if len(came) == 1 else 'ranks'} {rank_list(sorted(came))} did): no NCCL"
            " process group there yet, or stuck where torch's dump thread cannot run"]
