"""Detached jobs from the client's side: ``launch --detach``, ``ps``, ``logs``, ``attach``, ``stop``.

``start_detached`` runs inside the engine's session (``HostsEngine.detach``: inventory,
preflight, push, setup and ports are a launch's, and every attempt's ranks are rendered there,
the early agents closed) and hands each host's ranks to a keeper (``dlrun.remote.keeper``): host
0's first (the leader: it listens for the others over TLS with the job's pinned certificate),
then the rest in parallel. It returns once the leader says every rank started. The other
commands run ``dlrun.remote.jobs`` on each host and merge the answers. Mechanism and files:
``docs/detach.md``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import shlex
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TextIO

from dlrun.errors import DlrunError, HostUnreachable, JobStartError, TransportError, UsageError
from dlrun.inventory import Host
from dlrun.plan import RankSpec
from dlrun.remote import CACHE_STAGE, boot_argv, boot_payload, keeper, rankpolicy, source_of
from dlrun.remote.rendezvous import scope_sizes
from dlrun.render import WorkerCommand, mask_argv, mask_text, printable
from dlrun.run.agents import agent_argv
from dlrun.run.gpus import GpuStats, IdleWatch, parse_csv
from dlrun.run.logstream import SideChannel, side_enabled, stream_logs
from dlrun.run.result import RankResult, RankState, RunResult
from dlrun.run.supervisor import View, agent_spec
from dlrun.run.view import root_cause_lines
from dlrun.run.view import summary_lines as view_summary
from dlrun.transport.base import Transport, default_python

if TYPE_CHECKING:
    from dlrun.run.config import LaunchConfig

START_TIMEOUT = 120.0  # seconds for every rank of a detached job to start
POLL = 0.5  # seconds between two looks at the hosts (start, --follow, attach, stop)
FINAL = rankpolicy.FINAL_STATES  # the job states that are an end
GPU_IDLE_AFTER = 60.0  # attach's idle-GPU warning: --gpu-idle-after's default (attach has no such option)


@dataclass(frozen=True)
class RankEntry:
    """One rank in a keeper's record: its host, state (``RankState``'s values, ``pending``)
    and exit code; when the leader heard it start and end; its argv (the root cause's)."""

    rank: int
    host: str = "?"
    state: str = "?"
    code: int | None = None
    started: float | None = None
    ended: float | None = None
    argv: tuple[str, ...] = ()


@dataclass(frozen=True)
class FailedAttempt:
    """An attempt of a detached job that failed before the last one (``--max-restarts``)."""

    attempt: int  # 0: the first
    job_id: str
    exit_code: int | None = None
    root_cause: str | None = None
    checkpoint: tuple[str, ...] = ()  # what the keepers copied before the next attempt (--checkpoint-dir)


@dataclass(frozen=True)
class RootEvidence:
    """What the root cause rank left: its exception's last frames, torch's error file, hints
    (the keeper's ``root``; empty when it named none)."""

    rank: int | None = None
    host: str | None = None
    exception: tuple[str, ...] = ()
    error_file: tuple[str, ...] = ()
    hint: tuple[str, ...] = ()
    exception_final: bool = True  # the exception was the rank's last output (else an earlier traceback)
    raised_first: tuple[str, ...] = ()  # a rank still running that raised before it (rankpolicy.raised_first)


@dataclass(frozen=True)
class JobRecord:
    """A detached job as ``dlrun ps`` shows it: the leader's record where it answered
    (``record_of`` reads one host's JSON document; ``merge_records`` merges the hosts')."""

    job_id: str
    state: str
    ranks: int
    started_at: float
    script: str
    hosts: tuple[str, ...]
    exit_code: int | None = None
    root_cause: str | None = None
    root_tail: tuple[str, ...] = ()
    hung: bool = False  # --hang-timeout stopped it: root_cause and root_tail are the hang's lines
    flight_recorder: tuple[str, ...] = ()  # what the ranks' flight recorder dumps say (a failed torch job)
    alive: bool = False
    rank_states: tuple[RankEntry, ...] = ()
    history: tuple[FailedAttempt, ...] = ()  # the failed attempts before the last
    root: RootEvidence = field(default_factory=RootEvidence)  # the root cause rank's exception, error file, hint
    notes: tuple[str, ...] = ()  # what the keepers recorded beside it (disk full on h2)
    host: str = ""  # the host whose keeper wrote the record
    leader: bool = False  # written by the leader keeper (host 0), which decides the job's state

    @property
    def ended(self) -> bool:
        """The leader decided the end (a frozen follower's keeper may still be alive: the
        result does not wait for it; every other host's lines were written before)."""
        return self.state in FINAL


def check_detach(config: LaunchConfig, hosts_engine: bool) -> None:
    """What ``--detach`` does not support (yet) is a usage error before anything starts."""
    if not hosts_engine:
        raise UsageError("--detach goes with the SSH backend (a Spark stage lives with its driver)")
    if config.min_hosts is not None:
        raise UsageError("--detach: --min-hosts is not supported yet (a restart runs on the same hosts)")
    if config.dry_run:
        raise UsageError("--detach starts a job: drop --dry-run")
    if config.ssh.host_timeout <= 0:  # with no client watching, silence is the only sign of a frozen keeper
        raise UsageError("--detach needs a --host-timeout above 0: the keepers find a silent host by it")


def keeper_configs(job_id: str, attempts: Sequence[tuple[str, Sequence[WorkerCommand]]], *,
                   agent_argv_of: Callable[[Host], list[str]], token: str, cert_pem: str, key_pem: str,
                   grace: float, host_timeout: float, script: str, pidns_source: str,
                   gpu_every: float = 0.0, rendezvous_source: str | None = None,
                   ends_job: Callable[[WorkerCommand], bool] | None = None,
                   hang: Mapping[str, Any] | None = None,
                   groups_source: str | None = None) -> dict[str, dict[str, Any]]:
    """Each host's keeper config, host 0 (the leader) first; followers lack the leader's port
    (and, for Horovod, its rendezvous port). ``attempts``: each attempt's job id and ranks
    (``--max-restarts``: rendered ahead, each with its restart count), on the same hosts.
    ``rendezvous_source``: Horovod, the leader runs ``dlrun.remote.rendezvous``. ``ends_job``:
    the ranks whose end ends the job (tf-ps: the chief), the leader's ``enders``. ``hang``:
    ``--hang-timeout``'s ``{"timeout", "stacks"}``. ``groups_source``: ``dlrun.remote.stack_groups``,
    for the leader's hang and every keeper of a job with torch's flight recorder (each digests
    its host's dumps, the leader reads them all)."""
    commands = attempts[0][1]
    flight = any("TORCH_FR_DUMP_TEMP_FILE" in c.env for c in commands)
    by_host: dict[str, list[WorkerCommand]] = {}
    for command in commands:
        by_host.setdefault(command.host_name, []).append(command)
    names = list(by_host)
    specs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for attempt_id, ranks_of_attempt in attempts:
        for name in names:
            mine = [c for c in ranks_of_attempt if c.host_name == name]
            if [c.rank for c in mine] != [c.rank for c in by_host[name]]:
                raise UsageError(f"--detach: attempt {attempt_id} places other ranks on {name}")
            specs[name].append(agent_spec(attempt_id, name, mine, grace=grace, host_timeout=host_timeout,
                                          gpu_every=gpu_every))
    leader = names[0]
    configs: dict[str, dict[str, Any]] = {}
    for name, ranks in by_host.items():
        host = ranks[0].spec.host
        config: dict[str, Any] = {
            "job_id": job_id, "host": name, "leader": name == leader, "leader_host": leader,
            "token": token, "cert_pem": cert_pem, "grace": grace, "host_timeout": host_timeout,
            "script": script, "hosts": names,
            "agent_argv": agent_argv_of(host), "agent_source": pidns_source,
            "agent_stage": CACHE_STAGE,  # the keeper's agents run the code cache's copy of that source
            "rankpolicy_source": source_of("rankpolicy"),
            "specs": specs[name],
        }
        if hang is not None:
            config["hang"] = dict(hang)
        if groups_source is not None and (flight or (hang is not None and name == leader)):
            config["groups_source"] = groups_source
        if name == leader:
            config["key_pem"] = key_pem
            config["world"] = {str(c.rank): c.host_name for c in commands}
            config["argv"] = {str(c.rank): mask_argv(c.argv) for c in commands}  # shown and stored: masked
            config["followers"] = names[1:]
            config["enders"] = [c.rank for c in commands if ends_job is not None and ends_job(c)]
            if rendezvous_source is not None:
                config["rendezvous"] = {"source": rendezvous_source, "host": commands[0].spec.address,
                                        "scopes": scope_sizes([(c.spec.address, c.spec.local_rank) for c in commands])}
        configs[name] = config
    return configs


def run_program(transport: Transport, host: Host, name: str, request: Mapping[str, Any], *args: str,
                timeout: float = 60.0, lasting: bool = False) -> dict[str, Any]:
    """Run host program ``name`` with one JSON request; its one JSON answer. ``lasting``: the
    program outlives dlrun (a keeper: ``Transport.start``)."""
    run = transport.start if lasting else transport.run
    result = run(host, boot_argv(default_python(host), name, *args),
                 stdin=boot_payload(name) + json.dumps(request).encode() + b"\n", timeout=timeout)
    if result.exit_code != 0:
        detail = " / ".join(result.stderr.decode("utf-8", "replace").strip().splitlines()[-3:])
        error = JobStartError if name == "keeper" else DlrunError
        raise error(f"dlrun-{name} exited with code {result.exit_code}: {detail}", host=host.name)
    try:
        answer: dict[str, Any] = json.loads(result.stdout.decode("utf-8", "replace").strip().splitlines()[-1])
    except (ValueError, IndexError) as exc:
        raise DlrunError(f"dlrun-{name} answered no JSON: {result.stdout[-200:]!r}", host=host.name) from exc
    if "error" in answer and name == "jobs" and len(answer) == 1:
        raise DlrunError(f"dlrun-jobs: {answer['error']}", host=host.name)
    return answer


def record_of(document: Mapping[str, Any]) -> JobRecord:
    """One host's keeper record (``dlrun.remote.keeper``'s ``record``, JSON) as a ``JobRecord``:
    the one place its fields are read."""

    def strings(value: Any) -> tuple[str, ...]:
        return tuple(str(v) for v in value or ())

    def number(value: Any) -> float | None:
        return None if value is None else float(value)

    def code(value: Any) -> int | None:
        return None if value is None else int(value)

    ranks = tuple(RankEntry(rank=int(e["rank"]), host=str(e.get("host", "?")), state=str(e.get("state", "?")),
                            code=code(e.get("code")), started=number(e.get("started")), ended=number(e.get("ended")),
                            argv=strings(e.get("argv")))
                  for e in document.get("ranks") or ())
    history = tuple(FailedAttempt(attempt=int(h.get("attempt", 0)), job_id=str(h.get("job_id")),
                                  exit_code=code(h.get("exit_code")),
                                  root_cause=None if h.get("root_cause") is None else str(h["root_cause"]),
                                  checkpoint=strings(h.get("checkpoint")))
                    for h in document.get("history") or ())
    root = document.get("root") or {}
    evidence = RootEvidence(rank=code(root.get("rank")), host=None if root.get("host") is None else str(root["host"]),
                            exception=strings(root.get("exception")), error_file=strings(root.get("error_file")),
                            hint=strings(root.get("hint")), exception_final=root.get("exception_final") is not False,
                            raised_first=strings(root.get("raised_first")))
    cause = document.get("root_cause")
    return JobRecord(
        job_id=str(document.get("job_id", "")), state=str(document.get("state", "?")), ranks=len(ranks),
        started_at=float(document.get("started_at") or 0), script=str(document.get("script", "")),
        hosts=strings(document.get("hosts")), exit_code=code(document.get("exit_code")),
        root_cause=None if cause is None else str(cause), root_tail=strings(document.get("root_tail")),
        hung=bool(document.get("hung")), flight_recorder=strings(document.get("flight_recorder")),
        alive=bool(document.get("alive")), rank_states=ranks, history=history,
        root=evidence,
        notes=strings(document.get("notes")), host=str(document.get("host", "")), leader=bool(document.get("leader")))


LEADER_LOST = "lost the leader keeper"  # how a follower's final record begins when its leader went


def merge_records(documents: Sequence[Mapping[str, Any]]) -> list[JobRecord]:
    """One record per job from every host's answer (JSON documents, read by ``record_of``)."""
    return merge([record_of(document) for document in documents])


def merge(found: Sequence[JobRecord]) -> list[JobRecord]:
    """One record per job from every host's: the leader's where it answered; a job whose
    keeper lives on any host is alive. A leader that is frozen or gone cannot say so itself: when
    a follower's final record says it lost the leader, and the leader's record has not ended,
    the job is ``lost`` (exit 255), with the follower's reason and every rank not ended lost."""
    jobs: dict[str, JobRecord] = {}
    alive: dict[str, bool] = {}
    orphaned: dict[str, JobRecord] = {}  # job -> a follower's final record: its leader is gone
    finals: dict[str, dict[int, RankEntry]] = {}  # job -> rank -> its host's own final entry
    for record in found:
        job_id = record.job_id
        alive[job_id] = alive.get(job_id, False) or record.alive
        if job_id not in jobs or (record.leader and not jobs[job_id].leader):
            jobs[job_id] = record
        if not record.leader and (record.root_cause or "").startswith(LEADER_LOST):
            orphaned.setdefault(job_id, record)
        for entry in record.rank_states:
            if entry.host == record.host and entry.state in FINAL:
                finals.setdefault(job_id, {})[entry.rank] = entry
    records = []
    for job_id, record in sorted(jobs.items()):
        if record.state not in FINAL and job_id in orphaned:  # a frozen leader: its followers tell
            record = replace(record, state="lost", exit_code=255, root_cause=orphaned[job_id].root_cause, root_tail=(),
                             hung=False, flight_recorder=())
        if record.state in FINAL:
            record = ended_ranks(record, finals.get(job_id, {}))
        records.append(replace(record, alive=alive[job_id]))
    return records


def ended_ranks(record: JobRecord, finals: Mapping[int, RankEntry]) -> JobRecord:
    """A job that has ended has no rank still running: a rank its record left running (a leader
    frozen or killed before it heard the end) takes its own host's final entry, else it is lost
    (255); a lost job without an exit code exits 255."""
    ranks = tuple(entry if entry.state in FINAL else finals.get(entry.rank) or replace(entry, state="lost", code=255)
                  for entry in record.rank_states)
    code = 255 if record.exit_code is None and record.state == "lost" else record.exit_code
    return replace(record, rank_states=ranks, exit_code=code)


def age_text(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    if seconds < 86400:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def ps_lines(records: Sequence[JobRecord], now: float) -> list[str]:
    """``dlrun ps``'s table."""
    width = max([len("job"), *(len(r.job_id) for r in records)])
    lines = [f"{'job':<{width}}  {'state':<10}  {'ranks':>5}  {'age':>5}  {'exit':>4}  script"]
    for r in records:
        code = "" if r.exit_code is None else str(r.exit_code)
        lines.append(f"{printable(r.job_id):<{width}}  {printable(r.state):<10}  {r.ranks:>5}"
                     f"  {age_text(now - r.started_at):>5}  {code:>4}  {printable(mask_text(r.script))}")
    return lines


def closing_notices(record: JobRecord, result: RunResult) -> list[str]:
    """What a detached job's end says before the launch view's summary: each failed attempt
    (and the checkpoint copy before the next), the keepers' notes, and a root cause no rank
    stands for (a lost leader; a hang's are the view's, as attached)."""
    notices = []
    for h in record.history:
        notices.append(f"attempt {h.attempt + 1} (job {h.job_id}) failed: {h.root_cause}")
        notices.extend(f"attempt {h.attempt + 2}: {printable(line)}" for line in h.checkpoint)
    notices.extend(record.notes)
    if record.root_cause and result.root_cause is None and not result.hang and record.state != "stopped":
        notices.append(f"root cause: {record.root_cause}")
    return notices


def job_line(record: JobRecord) -> str:
    """A detached job's last line: its id, state and exit code."""
    return f"dlrun: job {record.job_id} {record.state}; exit code {1 if record.exit_code is None else record.exit_code}"


def summary_lines(record: JobRecord, result: RunResult | None = None) -> list[str]:
    """A detached job's end as text (``dlrun stop``, a detached launch that failed at once), as
    ``attach`` shows it: the notices, then the attached launch's root cause and table
    (``dlrun.run.view``: one format for both), then the job's line."""
    result = run_result(record) if result is None else result
    return [*(f"dlrun: {text}" for text in closing_notices(record, result)),
            *root_cause_lines(result, view_commands(record)), *view_summary(result), job_line(record)]


@dataclass(frozen=True)
class Handover:
    """What the engine hands the keepers: the transport that reaches the hosts, every attempt's
    id and rendered ranks (restart count and ports in their env), the job's secret (the keepers'
    token and the rendezvous key's root), the hosts' addresses as the session found them, and
    which rank's end ends the job, and the ports of this machine the launch claimed for its
    ranks (``local_base_port``): the leader keeper claims them in turn."""

    transport: Transport
    attempts: tuple[tuple[str, tuple[WorkerCommand, ...]], ...]
    secret: str
    addresses: Mapping[str, str]
    ends_job: Callable[[WorkerCommand], bool] | None = None
    claimed_ports: tuple[int, ...] = ()


def start_detached(config: LaunchConfig, job: Handover, job_id: str) -> RunResult:
    """Hand the job to the hosts' keepers; return once every rank started (exit code 0) or the
    job already failed (its exit code)."""
    from dlrun.tls import make_job_tls

    transport, commands = job.transport, job.attempts[-1][1]
    tls = make_job_tls(job_id)
    hosts = {c.host_name: c.spec.host for c in commands}
    configs = keeper_configs(
        job_id, list(job.attempts), agent_argv_of=lambda h: agent_argv(default_python(h), pidns=config.pidns),
        token=job.secret, cert_pem=tls.cert_pem, key_pem=tls.key_pem, grace=config.grace,
        host_timeout=config.ssh.host_timeout,
        script=" ".join(mask_argv(["-m"] * config.module + [config.script, *config.args]))[:200],
        pidns_source=source_of("agent"), gpu_every=config.gpu_every,
        rendezvous_source=source_of("rendezvous") if config.framework == "horovod" else None,
        ends_job=job.ends_job, hang=hang_config(config, transport, list(hosts.values())),
        groups_source=source_of("stack_groups"))
    names = list(configs)
    for name, checkpoint in checkpoint_configs(config, job.addresses, commands).items():
        configs[name]["checkpoint"] = checkpoint
    for name in names:  # a Slurm step holds its keeper: one that detached would leave the job
        configs[name]["stay"] = transport.holds_programs(hosts[name])
    leader = hosts[names[0]]
    address = job.addresses.get(leader.name, leader.address)
    configs[names[0]]["bind"] = address  # the leader listens where its followers reach it, not everywhere
    if job.claimed_ports:  # every rank is on this machine: the leader holds the claim once dlrun has gone
        configs[names[0]]["claim_ports"] = list(job.claimed_ports)
    try:
        answer = run_program(transport, leader, "keeper", configs[names[0]], job_id, lasting=True)
        for name in names[1:]:
            configs[name]["leader_address"] = [address, int(answer["port"])]
            if "rendezvous_port" in answer:
                configs[name]["rendezvous_port"] = int(answer["rendezvous_port"])
        with ThreadPoolExecutor(max_workers=min(32, max(1, len(names) - 1))) as pool:
            list(pool.map(lambda n: run_program(transport, hosts[n], "keeper", configs[n], job_id, lasting=True),
                          names[1:]))
        record = wait_started(transport, leader, job_id)
    except BaseException:  # an interrupt, a keeper that did not start, ranks that never started:
        # the keepers that started stop the job (else the leader would end it as lost, later)
        with contextlib.suppress(DlrunError):
            JobHosts(transport, list(hosts.values())).ask({"op": "stop", "job": job_id})
        raise
    if record.state in FINAL and record.exit_code != 0:  # it failed before this look (a quick success is fine)
        for line in summary_lines(record):
            print(line, file=sys.stderr)
        return RunResult(ranks=(), exit_code=1 if record.exit_code is None else record.exit_code, job_id=job_id)
    hosts_option = f" --hosts {shlex.quote(config.hosts)}" if config.hosts else ""
    print(f"dlrun: {record.ranks} ranks started on {len(names)} host{'s' if len(names) != 1 else ''};"
          f" dlrun attach|logs|stop {job_id}{hosts_option}")
    print(f"dlrun: detached job {job_id}", flush=True)
    return RunResult(ranks=(), exit_code=0, job_id=job_id)


def checkpoint_configs(config: LaunchConfig, addresses: Mapping[str, str],
                       commands: Sequence[WorkerCommand]) -> dict[str, dict[str, Any]]:
    """``--checkpoint-dir`` with restarts: each keeper's ``checkpoint`` (``dlrun.remote.ckptsync``):
    its job folder and push helper; the leader's also every host's address and a certificate
    made for the copies (``docs/checkpoints.md``). None without restarts: the first attempt's
    copy is the client's."""
    if not config.checkpoint_dirs or not config.max_restarts:
        return {}
    import os

    from dlrun.push.session import HELPER_FLAGS
    from dlrun.tls import make_job_tls

    hosts = {c.host_name: (c.spec.host, c.cwd) for c in commands}
    tls = make_job_tls("checkpoint copy")
    out: dict[str, dict[str, Any]] = {}
    for i, (name, (host, cwd)) in enumerate(hosts.items()):
        out[name] = {"source": source_of("ckptsync"), "folders": list(config.checkpoint_dirs),
                     "root": cwd or (os.getcwd() if host.is_local else host.workdir or ""),
                     "helper_argv": boot_argv([*default_python(host), *HELPER_FLAGS], "push_helper"),
                     "helper_source": source_of("push_helper"), "owner_check": not config.insecure_workdir}
        if i and os.environ.get("DLRUN_TEST_CKPT_PAUSE"):  # tests: a follower's listing waits (docs/checkpoints.md)
            out[name]["test_pause"] = float(os.environ["DLRUN_TEST_CKPT_PAUSE"])
        if i == 0:  # the leader
            out[name].update(cert=tls.cert_pem, key=tls.key_pem,
                             addresses={n: addresses.get(n, h.address) for n, (h, _) in hosts.items()})
    return out


def hang_config(config: LaunchConfig, transport: Transport, hosts: Sequence[Host]) -> dict[str, Any] | None:
    """``--hang-timeout`` for the keepers: py-spy shipped to the hosts now and the agents' stack
    message (``docs/stacks.md``)."""
    if not config.hang_timeout:
        return None
    from dlrun.run.hang import stacks_message
    from dlrun.run.tools import ship_pyspy

    sha256, _notes = ship_pyspy(transport, hosts)  # a host without it: its ranks say so in the stacks
    return {"timeout": config.hang_timeout, "stacks": stacks_message("", sha256)}


def wait_started(transport: Transport, leader: Host, job_id: str) -> JobRecord:
    """Poll the leader's record until every rank started (or the job ended)."""
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        documents = run_program(transport, leader, "jobs", {"op": "state", "job": job_id}).get("jobs") or []
        leaders = [d for d in documents if d.get("leader")]
        if leaders:
            record = merge_records(leaders)[0]
            if record.state != "starting":
                return record
        if time.monotonic() > deadline:
            raise JobStartError(f"the ranks of detached job {job_id} did not all start within {START_TIMEOUT:g} s;"
                             f" the job is stopped (dlrun logs {job_id} shows what they printed)", host=leader.name)
        time.sleep(POLL)


# --------------------------------------------------------------------------- ps, logs, attach, stop


class JobHosts:
    """The hosts given to ``ps``/``logs``/``attach``/``stop`` and the transport that reaches them.
    A host that cannot be reached (or whose answer fails) is named once on ``warn`` and left out:
    the others still answer. ``unreachable``: such hosts, with the reason."""

    def __init__(self, transport: Transport, hosts: Sequence[Host], *,
                 unreachable: Mapping[str, str] | None = None, warn: TextIO | None = None) -> None:
        self.transport = transport
        self.hosts = tuple(hosts)
        self.unreachable: dict[str, str] = {}
        self.hints: dict[str, None] = {}  # each host's hint once (a login shell's startup file, a key)
        self.warn = warn if warn is not None else sys.stderr
        for name, why in (unreachable or {}).items():
            self.left_out(name, why)

    def left_out(self, name: str, why: str, hint: str | None = None) -> None:
        if hint:
            self.hints.setdefault(hint)
        if name not in self.unreachable:
            self.unreachable[name] = why
            self.warn.write(f"dlrun: warning: {name} cannot be reached ({why.splitlines()[0][:200]});"
                            " what it holds is not shown\n")
            self.warn.flush()

    def none_reached(self) -> HostUnreachable:
        """The error when no host answers: each host with its reason, each hint once."""
        return HostUnreachable(f"none of the {len(self.hosts)} hosts answered:\n" + "\n".join(
            f"  {name}: {why.splitlines()[0][:200]}" for name, why in self.unreachable.items()),
            hint="; ".join(self.hints) or None)

    def ask(self, request: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        """Every reachable host's answer (in parallel), by host name."""
        hosts = [h for h in self.hosts if h.name not in self.unreachable]
        if not hosts:
            raise self.none_reached()

        def one(host: Host) -> dict[str, Any] | DlrunError:
            try:
                return run_program(self.transport, host, "jobs", request)
            except (HostUnreachable, TransportError) as exc:
                return exc

        with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
            answers = list(pool.map(one, hosts))
        out: dict[str, dict[str, Any]] = {}
        for host, answer in zip(hosts, answers, strict=True):
            if isinstance(answer, DlrunError):
                self.left_out(host.name, str(answer.message), answer.hint)
            else:
                out[host.name] = answer
        if not out:
            raise self.none_reached()
        return out

    def ps(self) -> list[JobRecord]:
        return merge_records([d for a in self.ask({"op": "ps"}).values() for d in a.get("jobs", [])])

    def record(self, job_id: str) -> JobRecord:
        documents = [d for a in self.ask({"op": "state", "job": job_id}).values() for d in a.get("jobs") or []]
        if not documents:
            names = ", ".join(h.name for h in self.hosts)
            raise UsageError(f"no job {job_id} on {names} (dlrun ps lists the jobs; --hosts names the hosts)")
        return merge_records(documents)[0]

    def stop(self, job_id: str, timeout: float) -> JobRecord:
        self.record(job_id)  # a job that is not there is an error
        self.ask({"op": "stop", "job": job_id})
        deadline = time.monotonic() + timeout
        while True:
            record = self.record(job_id)
            if record.ended or time.monotonic() > deadline:
                return record
            time.sleep(POLL)

    def delete(self, job_id: str, read: Mapping[str, int]) -> None:
        """Remove the job's folders, where every file was ``read`` to its end; a host that does not
        answer keeps its copy (named), and nothing is deleted anywhere."""
        if self.unreachable:
            raise UsageError(f"--delete: {', '.join(self.unreachable)} cannot be reached, so their logs were not"
                             " read: nothing was deleted")
        for name, answer in self.ask({"op": "delete", "job": job_id, "read": dict(read)}).items():
            if answer.get("error"):
                raise UsageError(f"{name}: {answer['error']}")

    def each(self, work: Callable[[Host], None]) -> None:
        """``work`` on every reachable host, in parallel; a host whose connection fails is left out
        (named once); an error of dlrun's programs there is raised."""
        hosts = [h for h in self.hosts if h.name not in self.unreachable]

        def one(host: Host) -> DlrunError | None:
            try:
                work(host)
            except (HostUnreachable, TransportError) as exc:
                return exc
            return None

        with ThreadPoolExecutor(max_workers=min(32, max(1, len(hosts)))) as pool:
            errors = list(pool.map(one, hosts))
        for host, error in zip(hosts, errors, strict=True):
            if error is not None:
                self.left_out(host.name, str(error.message), error.hint)
        if len(self.unreachable) == len(self.hosts):
            raise self.none_reached()


class LogFollower:
    """Each host's rank logs from where the last look ended, in ``[<rank> <host>] <text>`` lines."""

    def __init__(self, hosts: JobHosts, job_id: str, out: TextIO, since: float | None = None,
                 view: View | None = None) -> None:
        self.hosts = hosts
        self.job_id = job_id
        self.out = out
        self.view = view  # attach: lines and states go to the launch's view instead of ``out``
        self.shown: dict[int, tuple[str, int | None]] = {}  # rank -> (state, code) the view has
        self.started = False  # the view was started (the ranks are known)
        self.since = since  # seconds: the first look starts each log this long ago (its host's clock)
        self.offsets: dict[str, int] = {}  # host-<name>/attempt-K/rank-N.log (or gpu.csv) -> bytes read
        self.gpu_stats = GpuStats()  # attach: the summary's GPU lines, as an attached job's
        self.gpu_idle = IdleWatch(GPU_IDLE_AFTER)
        # big answers come over TLS where the hosts' ports can be reached (DLRUN_SIDE_CHANNEL=0: never)
        self.side = SideChannel() if side_enabled() else None
        self.covered: set[str] = set()  # hosts out of reach whose folders a host sharing their home sent

    def poll(self, whole: bool = False) -> JobRecord | None:
        """Print what is new, every byte of it (``whole``: a file's unfinished last line too);
        the merged record of the job (None: no host has it). Each host streams its answer in
        parallel; hosts that share a home hold the same files, and each file is shown from one."""
        request: dict[str, Any] = {"op": "logs", "job": self.job_id, "offsets": dict(self.offsets), "whole": whole}
        if self.since is not None:
            request["since_ago"], self.since = self.since, None  # files that appear later start at 0
        if self.view is not None and not self.started:  # attach: the view needs every rank first, from every host
            self.start_view([d for a in self.hosts.ask({"op": "state", "job": self.job_id}).values()
                             for d in a.get("jobs") or []])
        lock = threading.Lock()
        claimed: dict[str, str] = {}  # file -> the host it is shown from, in this look
        documents: list[Mapping[str, Any]] = []

        def records(found: list[dict[str, Any]]) -> None:
            with lock:
                documents.extend(found)

        def piece(host: str, key: str, header: Mapping[str, Any], data: bytearray) -> None:
            with lock:
                if self.view is not None and not self.started:
                    return  # not shown, so not read: the next look sends it again
                if claimed.setdefault(key, host) != host or int(header["offset"]) < self.offsets.get(key, 0):
                    return
                self.offsets[key] = int(header["offset"]) + len(data)  # data: as the file holds it
                self.show(key, str(header.get("host", "?")), data)

        reachable = [h.name for h in self.hosts.hosts if h.name not in self.hosts.unreachable]
        asked_at = time.monotonic()
        sent_by: dict[str, set[str]] = {}  # host -> the hosts whose folders it sent (a shared home)

        out_of_reach = frozenset(self.hosts.unreachable)  # before this look: their folders come from a shared home

        def ask(host: Host) -> None:
            # hosts that share a home (NFS) see each other's folders: each sends its own, and
            # those of hosts that cannot be reached
            own = keeper.host_folder(host.name)
            skip = sorted({keeper.host_folder(n) for n in reachable} - {own})
            seen: set[str] = set()  # the hosts whose folders this host sees (its home)

            def found(documents: list[dict[str, Any]]) -> None:
                seen.update(str(d.get("host", "")) for d in documents)
                records(documents)

            def got(key: str, header: Mapping[str, Any], data: bytearray) -> None:
                if str(header.get("host", "?")) in out_of_reach:
                    with lock:
                        sent_by.setdefault(host.name, set()).add(str(header.get("host", "?")))
                piece(host.name, key, header, data)

            stream_logs(self.hosts.transport, host, {**request, "skip": skip}, found, got, side=self.side)
            with lock:  # its whole answer came: what the hosts out of reach hold was read through it
                self.covered.update(seen & out_of_reach)

        self.hosts.each(ask)

        def ask_again(again: Mapping[str, Any], failed: frozenset[str], host: Host) -> None:
            seen: set[str] = set()  # the hosts whose folders this host sees (its home)

            def found(documents: list[dict[str, Any]]) -> None:
                seen.update(str(d.get("host", "")) for d in documents)
                records(documents)

            def got(key: str, header: Mapping[str, Any], data: bytearray) -> None:
                with lock:
                    sent_by.setdefault(host.name, set()).add(str(header.get("host", "?")))
                piece(host.name, key, header, data)

            stream_logs(self.hosts.transport, host, again, found, got, side=self.side)
            with lock:  # its whole answer came: what those hosts hold was read through it
                self.covered.update(seen & failed)

        failed = [n for n in reachable if n in self.hosts.unreachable]
        while failed:  # their folders were skipped by the hosts that share their home: ask those again
            lost = {keeper.host_folder(n) for n in failed}
            with lock:
                for stale in [k for k, h in claimed.items() if h in failed]:
                    lost.add(stale.split("/", 1)[0])  # also a folder it sent for a host out of reach
                    del claimed[stale]  # from where it broke off (``self.offsets``), by another host
            again = {**request, "offsets": dict(self.offsets),
                     "skip": sorted({keeper.host_folder(h.name) for h in self.hosts.hosts} - lost)}
            if "since_ago" in again:  # the same moment on the host's clock as the first ask
                again["since_ago"] = float(again["since_ago"]) + time.monotonic() - asked_at
            before = set(self.hosts.unreachable)
            self.hosts.each(functools.partial(ask_again, again, frozenset(failed)))
            failed = [n for n in self.hosts.unreachable if n not in before]
        for by, whose in sorted(sent_by.items()):
            self.hosts.warn.write(f"dlrun: note: the logs of {', '.join(sorted(whose))} came through {by}"
                                  " (a home they share)\n")
            self.hosts.warn.flush()
        record = merge_records(documents)[0] if documents else None
        if self.view is not None and record is not None:
            self.start_view(documents)
            for entry in record.rank_states:
                now = (entry.state, entry.code)
                if self.shown.get(entry.rank) != now:
                    self.shown[entry.rank] = now
                    self.view.state(entry.rank, STATES.get(entry.state, RankState.FAILED), entry.code)
            self.view.flush()
        self.out.flush()
        return record

    def start_view(self, documents: Sequence[Mapping[str, Any]]) -> None:
        """attach: the view starts once the ranks are known (the merged records of every host)."""
        if self.view is None or self.started or not documents:
            return
        self.view.start(view_commands(merge_records(documents)[0]), None)
        self.started = True

    def show(self, key: str, host: str, data: bytes | bytearray) -> None:
        """One piece of a file (whole lines, but for an over-long one) to the view or ``out``."""
        raw = getattr(self.out, "buffer", None)
        if self.view is None and raw is not None and not key.endswith("/gpu.csv"):  # bytes as they are: no decode
            head = f"[{rank_of(key)} {host}] ".encode()
            body = data.replace(b"\n", b"\n" + head)  # the one copy: every line's prefix
            self.out.flush()
            raw.write(head)
            if data.endswith(b"\n"):
                raw.write(memoryview(body)[: len(body) - len(head)])
            else:
                raw.write(body)
                raw.write(b"\n")
            return
        text = data.decode("utf-8", "replace")
        if text.endswith("\n"):
            text = text[:-1]
        if key.endswith("/gpu.csv"):
            if self.view is not None and self.started:
                self.gpus(text + "\n")
            return
        if self.view is not None:
            if self.started:
                self.view.lines(rank_of(key), text.split("\n"), "stdout")
            return
        prefix = f"[{rank_of(key)} {host}] "
        self.out.write(prefix + text.replace("\n", "\n" + prefix) + "\n")

    def gpus(self, text: str) -> None:
        """New ``gpu.csv`` lines to the view, the idle watch and the summary's statistics."""
        for samples in parse_csv(text):
            self.gpu_stats.add(samples)
            warning = self.gpu_idle.update(samples)
            assert self.view is not None
            self.view.gpus(samples[0].host, samples)
            if warning is not None:
                self.view.notice(f"warning: {warning}")

    def result(self, record: JobRecord) -> RunResult:
        """The job's summary as the view takes it, with what attach saw of its GPUs."""
        return replace(run_result(record), gpu_summary=tuple(self.gpu_stats.summary()),
                       gpu_warnings=tuple(self.gpu_idle.warned.values()))

    def follow(self) -> JobRecord:
        """Poll until the job has ended everywhere; its record, once every line was shown."""
        while True:
            record = self.poll()
            if record is None:
                raise UsageError(f"no job {self.job_id} on {', '.join(h.name for h in self.hosts.hosts)}")
            if record.ended:
                self.poll(whole=True)  # the last lines, written before the end, to the last byte
                return record
            time.sleep(POLL)


STATES = {state.value: state for state in RankState}


def view_commands(record: JobRecord) -> tuple[WorkerCommand, ...]:
    """Stand-ins for the ranks' commands, enough for the view (rank, host)."""
    hosts: dict[str, Host] = {}
    commands = []
    for entry in sorted(record.rank_states, key=lambda e: e.rank):
        name = entry.host
        host = hosts.setdefault(name, Host(address=name, name=name))
        spec = RankSpec(rank=entry.rank, local_rank=0, local_size=1, cross_rank=0, cross_size=1,
                        host_index=list(hosts).index(name), host=host, address=name, port=0,
                        task_type="worker", task_index=entry.rank)
        commands.append(WorkerCommand(spec=spec, argv=entry.argv))
    return tuple(commands)


def run_result(record: JobRecord) -> RunResult:
    """The record as the view's summary takes it (the root cause: the failed or lost rank)."""
    ranks = tuple(RankResult(rank=e.rank, host=e.host, state=STATES.get(e.state, RankState.FAILED), exit_code=e.code,
                             duration=e.ended - e.started if e.ended and e.started else None)
                  for e in sorted(record.rank_states, key=lambda e: e.rank))
    root = None
    if record.root_cause and record.state != "stopped":
        evidence = record.root
        for r in ranks:
            if evidence.rank is not None and r.rank != evidence.rank:
                continue
            if r.state == RankState.LOST or (r.state == RankState.FAILED and r.exit_code == record.exit_code):
                root = replace(r, tail=record.root_tail, error=record.root_cause if r.state == RankState.LOST else None,
                               exception=evidence.exception, error_file=evidence.error_file, hint=evidence.hint,
                               exception_final=evidence.exception_final)
                break
    code = 1 if record.exit_code is None else record.exit_code
    hang = (record.root_cause, *(f"  {text}" for text in record.root_tail)) if record.hung and record.root_cause else ()
    return RunResult(ranks=ranks, exit_code=code, root_cause=root, job_id=record.job_id, hang=hang,
                     flight_recorder=record.flight_recorder, raised_first=record.root.raised_first if root else (),
                     interrupted_by=code - 128 if record.state == "stopped" and code > 128 else None,
                     attempts=len(record.history) + 1)


def parse_duration(text: str) -> float:
    """``--since``: ``90``, ``30s``, ``10m``, ``2h`` or ``1d``, in seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    number, unit = (text[:-1], text[-1]) if text[-1:] in units else (text, "s")
    try:
        seconds = float(number) * units[unit]
    except ValueError:
        raise UsageError(f"--since {text}: expected a duration such as 90, 30s, 10m, 2h or 1d") from None
    if seconds < 0:
        raise UsageError(f"--since {text}: a duration is not negative")
    return seconds


def rank_of(key: str) -> int:
    """``host-a/attempt-0/rank-3.log`` → 3."""
    name = key.rpartition("/")[2]
    try:
        return int(name.removeprefix("rank-").removesuffix(".log"))
    except ValueError:
        return -1
