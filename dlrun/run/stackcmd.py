"""``dlrun stack JOB``: where every rank of a running job is, from any terminal.

An attached job running on this machine answers through its control socket
(``dlrun.run.control``); otherwise the job is a detached one on ``--hosts``: py-spy is shipped
to them (``dlrun.run.tools``), and each host's ``dlrun-jobs`` hands the request to the job's
keeper, whose agent takes the stacks (``docs/stacks.md``). The job keeps running.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from dlrun.errors import DlrunError, UsageError
from dlrun.inventory import Host
from dlrun.remote.stack_groups import RankStacks, rank_stacks, ras_lines
from dlrun.run import control
from dlrun.run.detach import JobHosts, run_program
from dlrun.run.hang import answer_json, stacks_message
from dlrun.run.tools import ship_pyspy


@dataclass(frozen=True)
class StackReport:
    """``dlrun stack``'s answer: the ranks grouped by their stacks, odd group first
    (``summary``), the odd group named (``cause``), where the full stacks went (``folders``),
    what a host could not do (``notes``, by host) and the tools that took them (``methods``)."""

    summary: tuple[str, ...] = ()
    cause: str | None = None
    folders: tuple[str, ...] = ()
    notes: Mapping[str, str] = field(default_factory=dict)
    methods: tuple[str, ...] = ()


def stack_report(document: Mapping[str, Any]) -> StackReport:
    """The control socket's or ``detached_stacks``' JSON answer (``hang.answer_json``) as a
    ``StackReport``: the one place it is read."""
    folder = document.get("folder")
    return StackReport(
        summary=tuple(str(line) for line in document.get("summary") or ()),
        cause=None if document.get("cause") is None else str(document["cause"]),
        folders=((str(folder),) if folder else ()) + tuple(str(f) for f in document.get("folders") or ()),
        notes={str(host): str(note) for host, note in (document.get("notes") or {}).items()},
        methods=tuple(str(m) for m in document.get("methods") or ()))


def attached_stacks(job_id: str, hosts: list[str] | None = None) -> dict[str, Any] | None:
    """The answer of an attached job on this machine, or None when there is none."""
    answer = control.ask(job_id, {"op": "stacks", "hosts": hosts})
    if answer is not None and answer.get("error"):
        raise DlrunError(f"job {job_id}: {answer['error']}")
    return answer


def detached_stacks(job_hosts: JobHosts, job_id: str) -> dict[str, Any]:
    """Every rank's stacks of detached job ``job_id`` (summary, cause, folders, notes)."""
    record = job_hosts.record(job_id)
    if record.ended:
        raise UsageError(f"job {job_id} is {record.state}: no rank runs (dlrun logs {job_id} shows its end)")
    sha256, notes = ship_pyspy(job_hosts.transport, job_hosts.hosts)
    message = stacks_message(time.strftime("%Y%m%d-%H%M%S"), sha256)
    stacks: list[RankStacks] = []
    folders: list[str] = []
    answered: list[tuple[str, dict[str, Any]]] = []

    def ask(host: Host) -> dict[str, Any] | DlrunError:
        try:
            return run_program(job_hosts.transport, host, "jobs",
                               {"op": "stacks", "job": job_id, "message": message, "host": host.name}, timeout=120)
        except DlrunError as exc:
            return exc

    with ThreadPoolExecutor(max_workers=min(32, len(job_hosts.hosts))) as pool:
        answers = list(pool.map(ask, job_hosts.hosts))
    for host, answer in zip(job_hosts.hosts, answers, strict=True):
        if isinstance(answer, DlrunError):
            notes[host.name] = str(answer)
            continue
        for item in answer.get("hosts") or []:
            if item.get("error") or (item.get("answer") or {}).get("error"):
                notes[str(item.get("host"))] = str(item.get("error") or item["answer"]["error"])
            if item.get("answer"):
                stacks += rank_stacks(str(item.get("host")), item["answer"])
                answered.append((str(item.get("host")), item["answer"]))
                folders.append(f"{host.name}:{item.get('folder')}")
    from dlrun.run.events import StackAnswer

    stacks.sort(key=lambda r: r.rank)
    document = answer_json(StackAnswer(tuple(stacks), None, notes, tuple(ras_lines(answered))))
    document["folders"] = folders
    return document
