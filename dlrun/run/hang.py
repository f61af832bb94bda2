"""An attached job's stacks and hang watch: what the supervisor does for ``dlrun stack`` (asked
through ``dlrun.run.control``) and for ``--hang-timeout``.

``StackRequests`` ships py-spy to the hosts (a thread: the supervisor's loop never waits on
SSH), then has the supervisor send ``{"op": "stacks"}`` to each host's agent and gathers the
STACKS frames; a host that does not answer within ``ANSWER_TIMEOUT`` is named in the answer.
Each request's stacks go to ``<log_dir>/stacks-<time>/`` (``rank-N.txt``, ``summary.txt``).
``HangWatch`` says when no rank has written for ``--hang-timeout`` seconds while no sampled GPU
was busy. Mechanism and numbers: ``docs/stacks.md``.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dlrun.inventory import Host
from dlrun.remote import LOADER, source_of
from dlrun.remote.rankpolicy import HANG_BUSY_UTIL as BUSY_UTIL  # the detached keeper's too
from dlrun.run.events import EventQueue, StackAnswer, StacksReady
from dlrun.transport.base import Transport

if TYPE_CHECKING:
    from dlrun.remote.stack_groups import RankStacks

# dlrun.remote.stack_groups (its records and patterns) and dlrun.run.tools are imported where
# stacks are taken or shown: every launch imports this module, few take stacks (docs/benchmarks.md)

SAMPLES = 2
INTERVAL = 3.0  # seconds between a request's two samples: "hung" (same place) or "slow" (moved)
ANSWER_TIMEOUT = 90.0  # seconds for every host's answer, shipping py-spy included


def stacks_message(request_id: str, sha256: str, *, samples: int = SAMPLES,
                   interval: float = INTERVAL, outdir: str | None = None) -> dict[str, Any]:
    """What an agent is sent to take its ranks' stacks (``dlrun.remote.agent``'s ``stacks`` op)."""
    request: dict[str, Any] = {"sha256": sha256, "samples": samples, "interval": interval, "native": True}
    if outdir is not None:
        request["outdir"] = outdir
    return {"op": "stacks", "id": request_id, "loader": LOADER, "source": source_of("stacks"), "request": request}


def write_stacks(folder: Path, stacks: Sequence[RankStacks], notes: Mapping[str, str],
                 answers: Mapping[str, Mapping[str, Any]]) -> None:
    from dlrun.remote.stack_groups import full_text, group_ranks, ras_lines, summary_lines

    folder.mkdir(parents=True, exist_ok=True)
    for rank in stacks:
        (folder / f"rank-{rank.rank}.txt").write_text(full_text(rank), encoding="utf-8")
    for host, answer in answers.items():
        ras = answer.get("nccl_ras")
        if ras:
            text = ras.get("text") or f"not asked: {ras.get('error')}\n"
            (folder / "nccl-ras.txt").write_text(f"NCCL RAS at {ras.get('addr')} on {host}\n\n{text}", encoding="utf-8")
    lines = summary_lines(group_ranks(stacks)) + ras_lines(list(answers.items()))
    lines += [f"{host}: {note}" for host, note in notes.items()]
    (folder / "summary.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")


@dataclass
class _Pending:
    hosts: dict[str, Host]
    ranks: dict[str, list[int]]  # host -> its ranks (a host that never answers: they say so)
    reply: Callable[[StackAnswer], None]
    deadline: float
    answers: dict[str, Mapping[str, Any]] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    waiting: set[str] = field(default_factory=set)
    ended: dict[int, tuple[str, str]] = field(default_factory=dict)  # rank -> (host, how it ended): no stack


class StackRequests:
    """Stack requests of one attached job, driven by the supervisor's loop (not thread-safe
    but for ``ask``'s shipping thread, which only puts an event)."""

    def __init__(self, transport: Transport, events: EventQueue, log_dir: Path | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.transport = transport
        self.events = events
        self.log_dir = log_dir
        self.clock = clock
        self.pending: dict[str, _Pending] = {}
        self.ids = itertools.count(1)

    def ask(self, hosts: Mapping[str, Host], ranks: Mapping[str, Sequence[int]],
            reply: Callable[[StackAnswer], None], ended: Mapping[int, tuple[str, str]] | None = None) -> None:
        """Ship py-spy (a thread), then ``StacksReady(id, sha256, notes)`` comes back as an event.
        ``ended``: ranks of those hosts that exited already, and how (the answer and its files say it)."""
        request_id = f"s{next(self.ids)}"
        self.pending[request_id] = _Pending(dict(hosts), {h: list(r) for h, r in ranks.items()}, reply,
                                            self.clock() + ANSWER_TIMEOUT, ended=dict(ended or {}))

        def ship() -> None:
            from dlrun.run.tools import ship_pyspy

            try:
                sha256, notes = ship_pyspy(self.transport, list(hosts.values()))
            except Exception as exc:  # the stacks are taken all the same, with a py-spy on the host's PATH
                sha256, notes = "", {name: f"py-spy not shipped: {exc}" for name in hosts}
            self.events.put(StacksReady(request_id, sha256, notes))

        threading.Thread(target=ship, name="dlrun-ship-py-spy", daemon=True).start()

    def ready(self, request_id: str, sha256: str, notes: Mapping[str, str]) -> list[tuple[str, dict[str, Any]]]:
        """py-spy is on the hosts: the (host, message) pairs to send."""
        pending = self.pending.get(request_id)
        if pending is None:
            return []
        pending.notes.update(notes)
        pending.waiting = set(pending.hosts)
        message = stacks_message(request_id, sha256)
        return [(name, message) for name in pending.hosts]

    def unreachable(self, request_id: str, host: str, why: str) -> None:
        pending = self.pending.get(request_id)
        if pending is not None:
            pending.notes[host] = why
            pending.waiting.discard(host)
            self._maybe_done(request_id)

    def answer(self, host: str, answer: Mapping[str, Any]) -> None:
        """A host's STACKS frame."""
        request_id = str(answer.get("id", ""))
        pending = self.pending.get(request_id)
        if pending is None or host not in pending.waiting:
            return
        pending.waiting.discard(host)
        pending.answers[host] = answer
        if answer.get("error"):
            pending.notes[host] = str(answer["error"])
        self._maybe_done(request_id)

    def tick(self) -> None:
        now = self.clock()
        for request_id, pending in list(self.pending.items()):
            if now > pending.deadline:
                for host in pending.waiting:
                    pending.notes[host] = f"no answer within {ANSWER_TIMEOUT:g} s"
                pending.waiting.clear()
                self._maybe_done(request_id)

    def _maybe_done(self, request_id: str) -> None:
        pending = self.pending[request_id]
        if pending.waiting or (not pending.answers and not pending.notes):
            return
        del self.pending[request_id]
        from dlrun.remote.stack_groups import RankStacks, rank_stacks, ras_lines

        stacks: list[RankStacks] = []
        for host in pending.hosts:
            found = rank_stacks(host, pending.answers.get(host) or {})
            seen = {r.rank for r in found}
            why = pending.notes.get(host, "the host's agent had no such rank running")
            found += [RankStacks(rank, host, None, "none", (), error=why) for rank in pending.ranks.get(host, ())
                      if rank not in seen]
            stacks += found
        stacks += [RankStacks(rank, host, None, "none", (), error=how) for rank, (host, how) in pending.ended.items()]
        stacks.sort(key=lambda r: r.rank)
        folder = None
        if self.log_dir is not None:
            folder = self.log_dir / time.strftime("stacks-%Y%m%d-%H%M%S")
            folder = folder.with_name(f"{folder.name}-{request_id}")
            write_stacks(folder, stacks, pending.notes, pending.answers)
        ras = tuple(ras_lines([(host, pending.answers[host]) for host in pending.hosts if host in pending.answers]))
        pending.reply(StackAnswer(tuple(stacks), folder, dict(pending.notes), ras))


class HangWatch:
    """No rank output and no busy GPU for ``limit`` seconds: the job hangs. ``notice_after``:
    when the live view starts saying "no output for N s"."""

    def __init__(self, limit: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self.clock = clock
        self.last_output = clock()
        self.last_busy = float("-inf")
        self.noticed = 0.0  # the silence last announced, in seconds (0: none yet)
        self.fired = False

    @property
    def on(self) -> bool:
        return self.limit > 0

    def output(self) -> None:
        self.last_output = self.clock()
        self.noticed = 0.0

    def gpu(self, utils: Sequence[float | None]) -> None:
        if any(u is not None and u >= BUSY_UTIL for u in utils):
            self.last_busy = self.clock()

    def silence(self) -> float:
        return self.clock() - self.last_output

    def notice(self) -> str | None:
        """A line for the view each time the silence passes another half of the limit (and 10 s)."""
        if not self.on or self.fired:
            return None
        quiet = self.silence()
        step = max(10.0, self.limit / 2)
        if quiet >= step and quiet - self.noticed >= step:
            self.noticed = quiet
            if self.clock() - self.last_busy < self.limit:  # a long kernel, a silent eval: working
                return (f"no output for {quiet:.0f} s, but a GPU is busy: not a hang while one is"
                        f" (--hang-timeout {self.limit:g} s counts once every GPU is idle)")
            return (f"no output for {quiet:.0f} s; --hang-timeout {self.limit:g} s takes every rank's "
                    "stack and stops the job")
        return None

    def hung(self) -> bool:
        """Once: the job has hung now."""
        if not self.on or self.fired:
            return False
        now = self.clock()
        if now - self.last_output >= self.limit and now - self.last_busy >= self.limit:
            self.fired = True
            return True
        return False


def hang_lines(answer: StackAnswer, limit: float) -> list[str]:
    """A hang's root cause in a sentence, the groups, and where the full stacks are (the first
    line as a detached job's keeper words it: ``dlrun.remote.keeper``)."""
    from dlrun.remote.stack_groups import group_ranks, hang_cause, summary_lines

    groups = group_ranks(answer.stacks)
    lines = [f"hung (no output for {limit:g} s): {hang_cause(groups)}",
             *("  " + line for line in summary_lines(groups) + list(answer.ras))]
    lines += [f"  {host}: {note}" for host, note in answer.notes.items()]
    if answer.folder is not None:
        lines.append(f"  full stacks: {answer.folder}")
    return lines


def answer_json(answer: StackAnswer) -> dict[str, Any]:
    """What the control socket sends back to ``dlrun stack``."""
    from dlrun.remote.stack_groups import group_ranks, hang_cause, summary_lines

    groups = group_ranks(answer.stacks)
    return {"summary": summary_lines(groups) + list(answer.ras), "cause": hang_cause(groups) if answer.stacks else None,
            # absolute: dlrun stack runs in another terminal, maybe in another folder
            "folder": str(answer.folder.resolve()) if answer.folder is not None else None, "notes": dict(answer.notes),
            "methods": sorted({r.method for r in answer.stacks if r.taken}) + (["NCCL RAS"] if answer.ras else [])}
