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
from dlrun.remote import boot_argv, boot_payload, keeper, source_of
from dlrun.remote.rendezvous import scope_sizes
from dlrun.render import WorkerCommand, mask_argv, mask_text, printable
from dlrun.run.agents import agent_argv
from dlrun.run.gpus import GpuStats, IdleWatch, parse_csv
from dlrun.run.result import RankResult, RankState, RunResult
from dlrun.run.supervisor import View, agent_spec
from dlrun.transport.base import Transport, default_python

if TYPE_CHECKING:
    from dlrun.run.config import LaunchConfig

START_TIMEOUT = 120.0  # seconds for every rank of a detached job to start
POLL = 0.5  # seconds between two looks at the hosts (start, --follow, attach, stop)
FINAL = keeper.FINAL  # the job states that are an end
GPU_IDLE_AFTER = 60.0  # attach's idle-GPU warning: --gpu-idle-after's default (attach has no such option)


@dataclass(frozen=True)
class JobRecord:
    """A detached job as ``dlrun ps`` shows it: the leader's record where it answered."""

    job_id: str
    state: str
    ranks: int
    started_at: float
    script: str
    hosts: tuple[str, ...]
    exit_code: int | None = None
    root_cause: str | None = None
    root_tail: tuple[str, ...] = ()
    alive: bool = False
    rank_states: tuple[Mapping[str, Any], ...] = ()
    history: tuple[Mapping[str, Any], ...] = ()  # the failed attempts before the last
    root: Mapping[str, Any] = field(default_factory=dict)  # the root cause rank's exception, error file, hint
    notes: tuple[str, ...] = ()  # what the keepers recorded beside it (disk full on h2)

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
                   hang: Mapping[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """Each host's keeper config, host 0 (the leader) first; followers lack the leader's port
    (and, for Horovod, its rendezvous port). ``attempts``: each attempt's job id and ranks
    (``--max-restarts``: rendered ahead, each with its restart count), on the same hosts.
    ``rendezvous_source``: Horovod, the leader runs ``dlrun.remote.rendezvous``. ``ends_job``:
    the ranks whose end ends the job (tf-ps: the chief), the leader's ``enders``. ``hang``:
    ``--hang-timeout``'s ``{"timeout", "stacks", "groups_source"}`` (the leader alone gets the
    grouping's source)."""
    commands = attempts[0][1]
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
            "rankpolicy_source": source_of("rankpolicy"),
            "specs": specs[name],
        }
        if hang is not None:
            config["hang"] = {k: v for k, v in hang.items() if k != "groups_source" or name == leader}
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


def stream_logs(transport: Transport, host: Host, request: Mapping[str, Any],
                on_records: Callable[[list[dict[str, Any]]], None],
                on_piece: Callable[[str, Mapping[str, Any], bytes], None], timeout: float = 120.0) -> dict[str, Any]:
    """``dlrun-jobs``'s streamed ``logs`` answer (``dlrun.remote.jobs.stream_logs``): the host's
    records to ``on_records`` first, then each piece to ``on_piece(key, header, data)`` as it
    arrives, so memory stays bounded whatever the logs hold; the closing document (``jobs``,
    ``ends``). ``timeout``: seconds without a byte from the host (time spent showing what came,
    a paused pager, does not count; the transport's own silence clock covers a dead host)."""
    channel = transport.open(host, boot_argv(default_python(host), "jobs"))
    try:
        channel.send(boot_payload("jobs") + json.dumps({**request, "stream": True}).encode() + b"\n")
        channel.close_stdin()
        buf = bytearray()
        header: dict[str, Any] | None = None
        records: dict[str, Any] = {}
        while True:
            if header is not None:
                need = int(header["length"])
                if len(buf) >= need:
                    on_piece(str(header["key"]), header, bytes(buf[:need]))
                    del buf[:need]
                    header = None
                    continue
            else:
                end = buf.find(b"\n")
                if end >= 0:
                    line = bytes(buf[:end])
                    del buf[: end + 1]
                    if line.startswith(b"P "):
                        header = json.loads(line[2:])
                        continue
                    if line.startswith(b"R "):
                        records = json.loads(line[2:])
                        on_records(records.get("jobs") or [])
                        continue
                    if line.startswith(b"J "):
                        answer: dict[str, Any] = json.loads(line[2:])
                        return {**answer, **records}
                    raise DlrunError(f"dlrun-jobs answered {line[:200]!r}", host=host.name)
            data = recv_within(channel, timeout)
            if data is None:
                raise HostUnreachable(f"dlrun-jobs sent nothing for {timeout:g} s", host=host.name)
            if not data:
                code = channel.wait(5)
                detail = " / ".join(channel.stderr_text().strip().splitlines()[-3:])
                raise HostUnreachable(f"dlrun-jobs ended (exit {code}) before its answer was whole: {detail}",
                                      host=host.name)
            buf += data
    finally:
        channel.close()


def recv_within(channel: Any, timeout: float) -> bytes | None:
    """``channel.recv`` that gives up (None) after ``timeout`` seconds without data."""
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(channel.recv(1 << 20)), daemon=True)
    reader.start()
    reader.join(timeout)
    return got[0] if got else None


def record_of(document: Mapping[str, Any]) -> JobRecord:
    return JobRecord(
        job_id=str(document.get("job_id", "")), state=str(document.get("state", "?")),
        ranks=len(document.get("ranks") or ()), started_at=float(document.get("started_at") or 0),
        script=str(document.get("script", "")), hosts=tuple(document.get("hosts") or ()),
        exit_code=document.get("exit_code"), root_cause=document.get("root_cause"),
        root_tail=tuple(document.get("root_tail") or ()), alive=bool(document.get("alive")),
        rank_states=tuple(document.get("ranks") or ()), history=tuple(document.get("history") or ()),
        root=dict(document.get("root") or {}), notes=tuple(str(n) for n in document.get("notes") or ()))


LEADER_LOST = "lost the leader keeper"  # how a follower's final record begins when its leader went


def merge_records(documents: Sequence[Mapping[str, Any]]) -> list[JobRecord]:
    """One record per job from every host's answer: the leader's where it answered; a job whose
    keeper lives on any host is alive. A leader that is frozen or gone cannot say so itself: when
    a follower's final record says it lost the leader, and the leader's record has not ended,
    the job is ``lost`` (exit 255), with the follower's reason and every rank not ended lost."""
    jobs: dict[str, Mapping[str, Any]] = {}
    alive: dict[str, bool] = {}
    orphaned: dict[str, Mapping[str, Any]] = {}  # job -> a follower's final record: its leader is gone
    finals: dict[str, dict[int, Mapping[str, Any]]] = {}  # job -> rank -> its host's own final entry
    for document in documents:
        job_id = str(document.get("job_id", ""))
        alive[job_id] = alive.get(job_id, False) or bool(document.get("alive"))
        if job_id not in jobs or (document.get("leader") and not jobs[job_id].get("leader")):
            jobs[job_id] = document
        if not document.get("leader") and str(document.get("root_cause") or "").startswith(LEADER_LOST):
            orphaned.setdefault(job_id, document)
        for entry in document.get("ranks") or ():
            if entry.get("host") == document.get("host") and entry.get("state") in FINAL:
                finals.setdefault(job_id, {})[int(entry["rank"])] = entry
    records = []
    for job_id, document in sorted(jobs.items()):
        if document.get("state") not in FINAL and job_id in orphaned:  # a frozen leader: its followers tell
            document = {**document, "state": "lost", "exit_code": 255,
                        "root_cause": orphaned[job_id].get("root_cause"), "root_tail": []}
        if document.get("state") in FINAL:
            document = ended_ranks(document, finals.get(job_id, {}))
        records.append(replace(record_of(document), alive=alive[job_id]))
    return records


def ended_ranks(document: Mapping[str, Any], finals: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """A job that has ended has no rank still running: a rank its record left running (a leader
    frozen or killed before it heard the end) takes its own host's final entry, else it is lost
    (255); a lost job without an exit code exits 255."""
    ranks = []
    for entry in document.get("ranks") or ():
        if entry.get("state") in FINAL:
            ranks.append(entry)
        else:
            ranks.append(finals.get(int(entry["rank"])) or {**entry, "state": "lost", "code": 255})
    code = document.get("exit_code")
    return {**document, "ranks": ranks, "exit_code": 255 if code is None and document.get("state") == "lost" else code}


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


def summary_lines(record: JobRecord) -> list[str]:
    """The end of ``attach`` (and of a detached launch that failed): root cause, ranks, verdict."""
    lines: list[str] = []
    if record.history:
        lines.append(f"dlrun: {len(record.history) + 1} attempts:")
        lines.extend(f"  attempt {int(h.get('attempt', 0)) + 1} (job {h.get('job_id')}): {h.get('root_cause')}"
                     for h in record.history)
    lines.extend(f"dlrun: {note}" for note in record.notes)
    if record.root_cause:
        lines.append(f"dlrun: root cause: {record.root_cause}")
        exception = [str(t) for t in record.root.get("exception") or ()]
        if exception:
            lines.append("  exception (last frames of its traceback):")
            lines.extend(f"    | {text}" for text in exception)
        lines.extend(f"  hint: {text}" for text in record.root.get("hint") or ())
        lines.extend(f"    | {text}" for text in record.root_tail[-10:])
    for entry in sorted(record.rank_states, key=lambda e: int(e.get("rank", 0))):
        code = "" if entry.get("code") is None else str(entry.get("code"))
        lines.append(f"{entry.get('rank', '?'):>4}  {entry.get('host', '?')}  {code:>4}  {entry.get('state', '?')}")
    lines.append(f"dlrun: job {record.job_id} {record.state}; exit code "
                 f"{'?' if record.exit_code is None else record.exit_code}")
    return lines


@dataclass(frozen=True)
class Handover:
    """What the engine hands the keepers: the transport that reaches the hosts, every attempt's
    id and rendered ranks (restart count and ports in their env), the job's secret (the keepers'
    token and the rendezvous key's root), the hosts' addresses as the session found them, and
    which rank's end ends the job."""

    transport: Transport
    attempts: tuple[tuple[str, tuple[WorkerCommand, ...]], ...]
    secret: str
    addresses: Mapping[str, str]
    ends_job: Callable[[WorkerCommand], bool] | None = None


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
        ends_job=job.ends_job, hang=hang_config(config, transport, list(hosts.values())))
    names = list(configs)
    for name in names:  # a Slurm step holds its keeper: one that detached would leave the job
        configs[name]["stay"] = transport.holds_programs(hosts[name])
    leader = hosts[names[0]]
    address = job.addresses.get(leader.name, leader.address)
    configs[names[0]]["bind"] = address  # the leader listens where its followers reach it, not everywhere
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


def hang_config(config: LaunchConfig, transport: Transport, hosts: Sequence[Host]) -> dict[str, Any] | None:
    """``--hang-timeout`` for the keepers: py-spy shipped to the hosts now, the agents' stack
    message, and the grouping the leader loads (``docs/stacks.md``)."""
    if not config.hang_timeout:
        return None
    from dlrun.run.hang import stacks_message
    from dlrun.run.tools import ship_pyspy

    sha256, _notes = ship_pyspy(transport, hosts)  # a host without it: its ranks say so in the stacks
    return {"timeout": config.hang_timeout, "stacks": stacks_message("", sha256),
            "groups_source": source_of("stack_groups")}


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
        self.shown: dict[int, tuple[str, Any]] = {}  # rank -> (state, code) the view has
        self.started = False  # the view was started (the ranks are known)
        self.since = since  # seconds: the first look starts each log this long ago (its host's clock)
        self.offsets: dict[str, int] = {}  # host-<name>/attempt-K/rank-N.log (or gpu.csv) -> bytes read
        self.gpu_stats = GpuStats()  # attach: the summary's GPU lines, as an attached job's
        self.gpu_idle = IdleWatch(GPU_IDLE_AFTER)

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

        def piece(host: str, key: str, header: Mapping[str, Any], data: bytes) -> None:
            with lock:
                if self.view is not None and not self.started:
                    return  # not shown, so not read: the next look sends it again
                if claimed.setdefault(key, host) != host or int(header["offset"]) < self.offsets.get(key, 0):
                    return
                self.offsets[key] = int(header["offset"]) + len(data)  # data: as the file holds it
                self.show(key, str(header.get("host", "?")), data)

        def ask(host: Host) -> None:
            stream_logs(self.hosts.transport, host, request, records,
                        lambda key, header, data: piece(host.name, key, header, data))

        self.hosts.each(ask)
        record = merge_records(documents)[0] if documents else None
        if self.view is not None and record is not None:
            self.start_view(documents)
            for entry in record.rank_states:
                now = (str(entry.get("state")), entry.get("code"))
                if self.shown.get(int(entry["rank"])) != now:
                    self.shown[int(entry["rank"])] = now
                    self.view.state(int(entry["rank"]), STATES.get(now[0], RankState.FAILED), now[1])
            self.view.flush()
        self.out.flush()
        return record

    def start_view(self, documents: Sequence[Mapping[str, Any]]) -> None:
        """attach: the view starts once the ranks are known (the merged records of every host)."""
        if self.view is None or self.started or not documents:
            return
        self.view.start(view_commands(merge_records(documents)[0]), None)
        self.started = True

    def show(self, key: str, host: str, data: bytes) -> None:
        """One piece of a file (whole lines, but for an over-long one) to the view or ``out``."""
        raw = getattr(self.out, "buffer", None)
        if self.view is None and raw is not None and not key.endswith("/gpu.csv"):  # bytes as they are: no decode
            head = f"[{rank_of(key)} {host}] ".encode()
            body = data[:-1] if data.endswith(b"\n") else data
            self.out.flush()
            raw.write(head + body.replace(b"\n", b"\n" + head) + b"\n")
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
    for entry in sorted(record.rank_states, key=lambda e: int(e["rank"])):
        name = str(entry.get("host", "?"))
        host = hosts.setdefault(name, Host(address=name, name=name))
        spec = RankSpec(rank=int(entry["rank"]), local_rank=0, local_size=1, cross_rank=0, cross_size=1,
                        host_index=list(hosts).index(name), host=host, address=name, port=0,
                        task_type="worker", task_index=int(entry["rank"]))
        commands.append(WorkerCommand(spec=spec, argv=tuple(str(a) for a in entry.get("argv") or ())))
    return tuple(commands)


def run_result(record: JobRecord) -> RunResult:
    """The record as the view's summary takes it (the root cause: the failed or lost rank)."""
    ranks = tuple(RankResult(rank=int(e["rank"]), host=str(e.get("host", "?")),
                             state=STATES.get(str(e.get("state")), RankState.FAILED), exit_code=e.get("code"),
                             duration=e["ended"] - e["started"] if e.get("ended") and e.get("started") else None)
                  for e in sorted(record.rank_states, key=lambda e: int(e["rank"])))
    root = None
    if record.root_cause and record.state != "stopped":
        evidence = record.root
        for r in ranks:
            if evidence and r.rank != evidence.get("rank"):
                continue
            if r.state == RankState.LOST or (r.state == RankState.FAILED and r.exit_code == record.exit_code):
                root = replace(r, tail=record.root_tail, error=record.root_cause if r.state == RankState.LOST else None,
                               exception=tuple(str(t) for t in evidence.get("exception") or ()),
                               error_file=tuple(str(t) for t in evidence.get("error_file") or ()),
                               hint=tuple(str(t) for t in evidence.get("hint") or ()))
                break
    code = 1 if record.exit_code is None else record.exit_code
    return RunResult(ranks=ranks, exit_code=code, root_cause=root, job_id=record.job_id,
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
