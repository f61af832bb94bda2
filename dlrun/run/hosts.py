"""``HostsEngine``: the engine (``dlrun.run.engine``) that places ranks on the inventory's
hosts (SSH hosts, Slurm steps, this machine): inventory → connect → start agents (each runs
the preflight probe, answers the code push's survey and says which ports are free) → plan
(listening ranks on free ports) → push → render.

The agents start before the plan so that the probe and the survey cost no extra round trip or
interpreter per host: the ranks' spec goes to the same agents once the plan is known, and an
error finding closes them before anything starts. A host whose survey finds the code already
in place gets no push session; the others get the push helper (``dlrun.push.session.push``).
"""

from __future__ import annotations

import os
import secrets
import socket
import sys
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from dlrun.errors import DlrunError, RendezvousError, UsageError
from dlrun.inventory import Host, Inventory, localhost_inventory
from dlrun.plan import DEFAULT_BASE_PORT, Plan, choose_ports, is_tf, is_torch, make_plan
from dlrun.remote import rankpolicy
from dlrun.remote.tf_server import server_source
from dlrun.render import Rendezvous, WorkerCommand, worker_commands
from dlrun.run.addresses import facing_address, interfaces_at, local_base_port, reachable_addresses, socket_ifaces
from dlrun.run.agents import AgentAnswer, HostAgents
from dlrun.run.checks import check_ports_free, keras_warning
from dlrun.run.config import DEFAULT_LOG_DIR, LaunchConfig, in_place_folders, say_framework
from dlrun.run.engine import DryRun, Placement, Regrouped
from dlrun.run.pushstep import (
    claiming,
    code_dir_to_push,
    dry_run_push,
    planned_push,
    push_for_launch,
    push_limit,
    run_setup_step,
    settled_hosts,
    sharing_hosts,
    survey_code,
)
from dlrun.run.result import RunResult
from dlrun.run.supervisor import View
from dlrun.transport.base import Transport, default_python
from dlrun.transport.factory import default_hosts, make_transport, resolve_inventory

if TYPE_CHECKING:
    from dlrun.push.session import HostPushSummary, Manifest
    from dlrun.topo.records import HostReport


def job_plan(config: LaunchConfig, inventory: Inventory, job_id: str,
             addresses: Mapping[str, str] | None = None, ports: Mapping[int, int] | None = None) -> Plan:
    """The rank plan of this launch (``make_plan`` with the options that shape it); ``ports``:
    rank → port where dlrun chose them (free on the rank's host)."""
    return make_plan(inventory, job_id=job_id, np=config.np, base_port=config.base_port or DEFAULT_BASE_PORT,
                     framework=config.framework, addresses=addresses, ports=ports, restart_count=config.attempt,
                     max_restarts=config.max_restarts, run_id=config.run_id)


def render_commands(
    config: LaunchConfig,
    inventory: Inventory,
    job_id: str,
    addresses: Mapping[str, str] | None = None,
    cwd_for: Mapping[str, str | None] | None = None,
    rendezvous: Rendezvous | None = None,
    gpus_for: Mapping[str, Sequence[str]] | None = None,
    found_ifaces: Mapping[str, str] | None = None,
    ports: Mapping[int, int] | None = None,
    plan: Plan | None = None,
) -> tuple[Plan, tuple[WorkerCommand, ...]]:
    """Every rank's command: ``plan`` where the caller has it (made by ``job_plan`` with the
    same arguments), else planned here."""
    plan = plan or job_plan(config, inventory, job_id, addresses, ports)
    if cwd_for is None:
        cwd_for = {h.name: (os.getcwd() if h.is_local else h.workdir) for h in plan.hosts}
    commands = worker_commands(
        plan,
        config.script,
        config.args,
        python_for={h.name: default_python(h) for h in plan.hosts},
        cwd_for=cwd_for,
        extra_env=config.env,
        rendezvous=rendezvous or (("127.0.0.1", 0) if config.framework == "horovod" else None),
        ifaces=socket_ifaces(plan, config.iface, found_ifaces or {}),
        server_argv=["-c", server_source()] if config.framework == "tf-ps" else None,
        gpus_for=gpus_for,
        module=config.module,
        no_python=config.no_python,
    )
    return plan, commands


@contextmanager
def horovod_rendezvous(plan: Plan) -> Iterator[tuple[str, int, str]]:
    """dlrun's Horovod rendezvous server for this plan, stopped when the attempt ends; every
    request must carry a key of this attempt's own (``dlrun.remote.rendezvous``)."""
    from dlrun.remote.rendezvous import rendezvous_key
    from dlrun.run.rendezvous import RendezvousServer, scope_sizes

    key = rendezvous_key(secrets.token_hex(32))
    server = RendezvousServer(
        scope_sizes([(r.address, r.local_rank) for r in plan.ranks]),
        host=facing_address([r.address for r in plan.ranks]), key=key,
    )
    with server:
        address = server.address
        assert address is not None
        yield address[0], address[1], key


def default_ranks_for_gpus(inventory: Inventory, reports: Sequence[HostReport]) -> Inventory:
    """The default job (no --hosts, no --np: 2 ranks here) on a machine with one GPU: 1 rank,
    with a notice. Two would share the GPU, which the preflight refuses for a job that asks for
    it; the default asked for nothing (a CPU smoke test on a one-GPU laptop)."""
    (host,) = inventory.hosts
    gpus = next((r.gpu_slots for r in reports if r.host == host.name and r.reachable), 0)
    if not 0 < gpus < (host.slots or 1):
        return inventory
    print(f"dlrun: {gpus} GPU here: starting {gpus} rank, not {host.slots}, so that ranks do not share it"
          f" (-n {host.slots} --no-preflight starts {host.slots} that do)", file=sys.stderr)
    return localhost_inventory(gpus)


#: Where dlrun looks for free ports when no --base-port is given (below Linux's ephemeral
#: ports, 32768 up): a window at a random offset, so that jobs started at once differ.
PORT_RANGE = (20000, 32768)


def ports_to_ask(config: LaunchConfig, inventory: Inventory, hosts: Sequence[Host], *,
                 given: bool) -> dict[str, tuple[int, ...]]:
    """host → the ports its agent is asked about: those its ranks will listen on (``--base-port``
    and up, to be checked), or a window of candidates to choose from. None for a job whose ranks
    listen nowhere (Horovod, none); ``given``: the user chose ``--base-port`` (on this machine
    alone dlrun chose it otherwise, with ``local_base_port``)."""
    if not (is_tf(config.framework) or is_torch(config.framework)) or (inventory.all_local and not given):
        return {}
    most = config.np or (inventory.total_slots if all(h.slots for h in inventory.hosts) else 16 * len(inventory.hosts))
    if config.base_port is not None:
        start, count = config.base_port, min(most, 65536 - config.base_port)
    else:
        count = most + 32  # room for ports other programs hold
        start = PORT_RANGE[0] + secrets.randbelow(max(1, PORT_RANGE[1] - PORT_RANGE[0] - count))
    return {h.name: tuple(range(start, start + count)) for h in hosts}


def _probe_source() -> str:
    from dlrun.remote import source_of

    return source_of("probe")


@dataclass(frozen=True)
class Prepared:
    """What ``prepare`` settled before any connection: the options' inventory, the hosts the
    job may use (all, when the probe counts slots), whether ``--base-port`` was given, and
    whether dlrun chose the base port here (a restart then chooses again)."""

    inventory: Inventory
    used_hosts: tuple[Host, ...] = ()
    base_port_given: bool = False
    ports_chosen: bool = False


@dataclass(frozen=True)
class Found:
    """What the session found and did, which every attempt's render reads: the hosts as the job
    runs them (the preflight's slots, the data shards' env), each host's address, run folder,
    GPUs and socket interface, the ports dlrun chose (rank → port), what the preflight warned
    (repeated in a failed attempt's root cause) and, for ``--dry-run``, what the push would send."""

    inventory: Inventory
    addresses: Mapping[str, str] = field(default_factory=dict)
    cwd_for: Mapping[str, str | None] | None = None
    gpus: Mapping[str, Sequence[str]] = field(default_factory=dict)
    ifaces: Mapping[str, str] = field(default_factory=dict)
    ports: Mapping[int, int] | None = None
    warnings: tuple[str, ...] = ()
    pushes: tuple[HostPushSummary, ...] = ()


class HostsEngine:
    """The inventory's hosts (SSH hosts, this machine) over a transport.

    Each host's agent starts before the plan: it runs the preflight probe and answers the code
    push's survey on its own channel, and an error finding closes it before anything starts.
    Then the plan, the push (``push_for_launch``) and, for each attempt, the render; the first
    attempt's ranks go to the agents started early, a restart's to fresh ones.
    """

    restart_unit = "the job"
    detaches = True

    def __init__(self) -> None:
        self.prepared = Prepared(Inventory(hosts=()))
        self.found = Found(Inventory(hosts=()))
        self.transport: Transport | None = None  # the session's
        self.agents: HostAgents | None = None  # started early; handed to the first attempt
        self.reconnect: tuple[Host, ...] = ()  # hosts lost in the last attempt: reconnected, probed again
        self.job_secret = secrets.token_hex(32)  # a detached job's keepers' token (and rendezvous key's root)
        self.failed_at: float | None = None  # when the last attempt failed (its copies then may be half written)
        self.port_claims: dict[int, socket.socket] = {}  # ports here chosen for local ranks, until the session ends

    @property
    def inventory(self) -> Inventory:
        """The hosts as the job runs them: the options' until the session found more."""
        return self.found.inventory

    @property
    def warnings(self) -> tuple[str, ...]:
        return self.found.warnings

    def prepare(self, config: LaunchConfig) -> LaunchConfig:
        config = replace(config, hosts=default_hosts(config.hosts))
        if config.hosts is None and config.np is not None and config.np < 1:
            raise UsageError("--np must be at least 1")
        inventory = resolve_inventory(config.hosts, config.np)
        base_port_given, ports_chosen = config.base_port is not None, False
        if config.base_port is None and inventory.all_local:
            ports_chosen = True
            claims = None if config.dry_run else self.port_claims  # a dry run starts nothing: no claim
            config = replace(config, base_port=local_base_port(inventory, config.np, claims))
        try:
            used_hosts = self._used_hosts(config, inventory)
        except BaseException:
            self.release_ports()
            raise
        self.prepared = Prepared(inventory, used_hosts, base_port_given, ports_chosen)
        self.found = Found(inventory)
        return config

    @staticmethod
    def _used_hosts(config: LaunchConfig, inventory: Inventory) -> tuple[Host, ...]:
        slots_from_gpus = config.preflight and any(h.slots is None for h in inventory.hosts)
        if slots_from_gpus:  # slots come from the probe: every host may be used
            used_hosts = inventory.hosts
        else:  # validate the plan before any connection
            _, trial = render_commands(config, inventory, "plan-check")
            used_hosts = tuple({c.spec.host.name: c.spec.host for c in trial}.values())
        if config.min_hosts is not None and config.min_hosts > len(used_hosts):
            raise UsageError(f"--min-hosts {config.min_hosts}: the job has {len(used_hosts)} hosts")
        return used_hosts

    def release_ports(self, ports: Sequence[int] | None = None) -> None:
        """Lets go of these claimed ports of this machine (``local_base_port``; None: all)."""
        for port in list(self.port_claims) if ports is None else ports:
            self.port_claims.pop(port).close()

    def probes(self, config: LaunchConfig) -> bool:
        """The preflight probes the hosts (a dry run's too: this machine's GPUs decide its slots,
        and its ranks' ``CUDA_VISIBLE_DEVICES``, as they do for any host)."""
        return config.preflight

    def dry_run(self, config: LaunchConfig, job_id: str) -> DryRun:
        """``--dry-run``: the one usage check before it reaches the hosts (it writes nothing),
        then the commands (``dry_commands``), what the push would send and whether dlrun chose
        the ports."""
        code_dir = code_dir_to_push(config, strict=not self.inventory.all_local)
        say_framework(config)
        commands = self.dry_commands(config, job_id, code_dir)
        return DryRun(commands, self.found.pushes, ports_chosen=self.found.ports is not None)

    def dry_commands(self, config: LaunchConfig, job_id: str, code_dir: Path | None) -> tuple[WorkerCommand, ...]:
        """Each rank's command as the launch would start it, nothing started or written. With a
        host to reach over the network, the launch's own ``session`` runs (connect, agents with
        the probe, the push survey and the free ports, the preflight, a push that writes
        nothing), so the dry run shows the addresses, interfaces, GPUs and ports the ranks get;
        where a host cannot be reached, the plan as written, with a warning. Ranks on this
        machine alone go through the same session where the preflight probes it (its GPUs give
        the slots and each rank's ``CUDA_VISIBLE_DEVICES``); without the preflight, the plan."""
        if not self.inventory.all_local or config.preflight:
            from dlrun.errors import TransportError

            try:
                with self.session(config, job_id) as placed:
                    return self._render_dry(placed, job_id)
            except TransportError as exc:
                print("dlrun: warning: showing the plan as written, without the addresses, interfaces, GPUs and"
                      f" free ports the hosts would give: {exc}", file=sys.stderr)
                self.found = Found(self.inventory)  # nothing found
                warning = keras_warning(config, self.inventory)
                if warning and not config.json_output:
                    print(f"dlrun: warning: {warning}", file=sys.stderr)
                planned_hosts = job_plan(config, self.inventory, job_id).hosts
                pushed = planned_push(config, planned_hosts, code_dir=code_dir)
        else:
            planned_hosts = job_plan(config, self.inventory, job_id).hosts
            pushed = dry_run_push(config, self.inventory, planned_hosts, code_dir=code_dir)
        self.found = Found(pushed.apply(self.inventory), reachable_addresses(planned_hosts, {}), pushed.cwd_for,
                           pushes=pushed.summaries)
        return self._render_dry(replace(config, script=pushed.script) if pushed.script is not None else config,
                                  job_id)

    def _render_dry(self, config: LaunchConfig, job_id: str) -> tuple[WorkerCommand, ...]:
        """``--dry-run``'s commands, rendered as ``place`` renders them (``render``); Horovod's
        rendezvous server is not started: its port is named, not chosen."""
        plan, commands = self.render(config, job_id)
        if config.framework == "horovod":  # dlrun's rendezvous server binds a free port when the job starts
            server = {"HOROVOD_GLOO_RENDEZVOUS_ADDR": facing_address([r.address for r in plan.ranks]),
                      "HOROVOD_GLOO_RENDEZVOUS_PORT": "<a free port, chosen at launch>"}
            commands = tuple(replace(c, env={**c.env, **server}) for c in commands)
        return commands

    @contextmanager
    def session(self, config: LaunchConfig, job_id: str) -> Iterator[LaunchConfig]:
        """Connect, start the agents (probe and survey first), check the preflight, plan, push.
        With ``config.dry_run`` (``dry_run``): the push surveys and writes nothing, no setup runs,
        and the agents are closed before they get any rank."""
        inventory, used_hosts = self.inventory, self.prepared.used_hosts
        transport = make_transport(inventory, config.ssh)
        agents = HostAgents(transport, used_hosts, pidns=config.pidns, host_timeout=config.ssh.host_timeout)
        code_dir = code_dir_to_push(config)
        pusher = ThreadPoolExecutor(1, thread_name_prefix="dlrun-scan")
        manifest: Future[Manifest] | None = None
        if code_dir is not None and any(not h.is_local for h in used_hosts):
            from dlrun.push.session import scan_code

            leave_out = Path(config.data) if config.data else None  # sent as shards, not with the code
            # hashes (or reads the cache) while we connect; over the size limit it raises before hashing
            manifest = pusher.submit(scan_code, code_dir, leave_out, log_dir=config.log_dir or DEFAULT_LOG_DIR,
                                     limit=push_limit(config), save_cache=not config.dry_run)
        try:
            addresses = reachable_addresses(used_hosts, transport.connect(used_hosts))
            if not config.push and not config.insecure_workdir:  # in place: the same folder check as a push
                from dlrun.push.session import check_in_place

                check_in_place(transport, used_hosts, in_place_folders(config, used_hosts))
            targets = survey_code(code_dir, used_hosts, manifest.result()) if code_dir and manifest is not None else {}
            surveys = None
            if targets:
                from dlrun.push.session import survey_request

                checked = not config.insecure_workdir  # a dry run writes nothing, so claims nothing
                surveys = {name: survey_request([target], owner_check=checked) if config.dry_run
                           else claiming(survey_request([target], owner_check=checked), job_id, name)
                           for name, target in targets.items()}
            # the agents start while we plan; each runs the probe, answers the push survey and
            # says which ports are free first
            ports_asked = ports_to_ask(config, inventory, used_hosts, given=self.prepared.base_port_given)
            agents.start(probe=_probe_source() if config.preflight else None, surveys=surveys, ports=ports_asked)
            answers: Mapping[str, AgentAnswer] = {}
            gpus: Mapping[str, Sequence[str]] = {}
            ifaces: Mapping[str, str] = {}
            warned: list[str] = []  # repeated in the root cause of a job that then fails
            ports: Mapping[int, int] | None = None  # rank -> port, where dlrun chose free ones
            if config.preflight or targets or ports_asked:
                from dlrun.topo.preflight import PROBE_TIMEOUT  # the agents' answers wait as long as a probe

                answers = agents.answers(PROBE_TIMEOUT)
            if config.preflight:
                from dlrun.topo.preflight import check_preflight, report_from_answer

                reports = [report_from_answer(a.host, a.stdout, a.error) for a in answers.values()]
                if config.hosts is None and config.np is None:
                    inventory = default_ranks_for_gpus(inventory, reports)
                # an error finding raises here
                preflight = check_preflight(inventory, used_hosts, reports, framework=config.framework)
                for finding in preflight.findings:
                    if finding.severity == "warning":
                        where = f"{finding.host}: " if finding.host else ""
                        print(f"dlrun: preflight warning: {where}{finding.message}", file=sys.stderr)
                        warned.append(f"preflight: {where}{finding.message}")
                inventory = inventory.with_slots(preflight.gpu_slots())
                gpus = preflight.devices()
                ifaces = interfaces_at(reports, addresses)
                warning = keras_warning(config, inventory, reports)
                if warning:
                    print(f"dlrun: warning: {warning}", file=sys.stderr)
                    warned.append(warning)
                if config.bench and config.attempt == 0:  # a restart does not measure again
                    from dlrun.topo.benchrun import check_bench

                    check_bench(transport, used_hosts, reports, config.bench, config.iface)
            plan = job_plan(config, inventory, job_id, addresses)
            if ports_asked:
                free = {name: a.free_ports for name, a in answers.items()
                        if name in ports_asked and a.free_ports is not None}
                if config.base_port is None:  # dlrun picks: free on each host that listens
                    ports = choose_ports(config.framework, plan.ranks, free)
                    plan = job_plan(config, inventory, job_id, addresses, ports)
                else:
                    check_ports_free(plan, free)
            settled = settled_hosts(targets, answers)
            settled.update(sharing_hosts(targets, answers, settled, [h.name for h in plan.hosts]))
            if config.dry_run:  # what a push would do: survey only, nothing written
                settled = {name: replace(summary, dry_run=True) for name, summary in settled.items()}
            pushed = push_for_launch(config, transport, plan.hosts, settled, code_dir=code_dir,
                                     dry_run=config.dry_run)
            if not config.dry_run:
                run_setup_step(config, transport, plan.hosts, pushed, job_id,
                               manifest.result() if manifest is not None else None, code_dir=code_dir)
            self.transport, self.agents = transport, agents
            self.found = Found(pushed.apply(inventory), addresses, pushed.cwd_for, gpus, ifaces, ports, tuple(warned),
                               pushed.summaries if config.dry_run else ())
            yield config if pushed.script is None else replace(config, script=pushed.script)
        finally:
            pusher.shutdown(wait=False, cancel_futures=True)
            agents.close()
            transport.close()
            self.release_ports()

    def regroup(self, config: LaunchConfig, failed: RunResult) -> Regrouped:
        """After a failed attempt: the hosts it lost are reconnected (and probed) by the next
        ``place``, or with ``--min-hosts`` left out while enough remain."""
        self.failed_at = failed.stopped_at  # copies modified since then may be half written
        lost = [h for h in self.inventory.hosts if h.name in failed.lost_hosts]
        if not lost:
            return Regrouped()
        if config.min_hosts is None:
            self.reconnect = tuple(lost)
            return Regrouped()
        names = {h.name for h in lost}
        remaining = replace(self.inventory, hosts=tuple(h for h in self.inventory.hosts if h.name not in names))
        try:
            hosts = job_plan(self.shrunk(config, remaining), remaining, "regroup").hosts if remaining.hosts else ()
        except DlrunError as exc:
            return Regrouped(f"without {', '.join(sorted(names))} the job cannot be planned: {exc}")
        if len(hosts) < config.min_hosts:
            return Regrouped(f"{len(hosts)} host{'s' if len(hosts) != 1 else ''} left without"
                             f" {', '.join(sorted(names))}, fewer than --min-hosts {config.min_hosts}")
        self.found = replace(self.found, inventory=remaining)
        return Regrouped(dropped=tuple(sorted(names)))

    @staticmethod
    def shrunk(config: LaunchConfig, inventory: Inventory) -> LaunchConfig:
        """``--np`` capped at the slots left after dropping hosts (fewer ranks, not a plan error)."""
        if config.np is None or config.np <= inventory.total_slots:
            return config
        return replace(config, np=inventory.total_slots)

    def rejoin(self, config: LaunchConfig) -> HostAgents | None:
        """Reconnect the hosts lost in the last attempt; with the preflight, their agents start
        now and run the probe again (the other hosts' agents start with the ranks)."""
        hosts, self.reconnect = self.reconnect, ()
        assert self.transport is not None
        reached = reachable_addresses(hosts, self.transport.reconnect(hosts))
        self.found = replace(self.found, addresses={**self.found.addresses, **reached})
        if not config.preflight:
            return None
        from dlrun.topo.preflight import PROBE_TIMEOUT, check_preflight, report_from_answer

        agents = HostAgents(self.transport, hosts, pidns=config.pidns, host_timeout=config.ssh.host_timeout)
        try:
            agents.start(probe=_probe_source())
            answers = agents.answers(PROBE_TIMEOUT)
            check_preflight(self.inventory, hosts, [report_from_answer(a.host, a.stdout, a.error)
                                                   for a in answers.values()])
        except BaseException:
            agents.close()
            raise
        return agents

    def render(self, config: LaunchConfig, job_id: str, rendezvous: Rendezvous | None = None,
               plan: Plan | None = None) -> tuple[Plan, tuple[WorkerCommand, ...]]:
        """Every rank's command from what the session found: addresses, run folders, GPUs,
        interfaces and ports (``place`` and ``--dry-run`` alike); ``plan``: the attempt's, made
        from the same (else made here)."""
        found = self.found
        return render_commands(config, found.inventory, job_id, addresses=found.addresses, cwd_for=found.cwd_for,
                               rendezvous=rendezvous, gpus_for=found.gpus, found_ifaces=found.ifaces,
                               ports=found.ports, plan=plan)

    def place(self, config: LaunchConfig, job_id: str, view: View) -> AbstractContextManager[Placement]:
        """One attempt's ranks: planned, their checkpoints synced, rendered (Horovod's
        rendezvous server started); the first attempt's go to the agents started early."""
        return self._place(config, job_id, detached=False)

    def detach(self, config: LaunchConfig, job_id: str, view: View) -> RunResult:
        """``launch --detach``: every attempt's ranks rendered now (restart count, ports), then
        handed to the hosts' keepers (``dlrun.run.detach.start_detached``)."""
        from dlrun.run.detach import Handover, start_detached

        attempts: list[tuple[str, tuple[WorkerCommand, ...]]] = []
        ends_job = None
        for k in range(config.max_restarts + 1):
            attempt_id = rankpolicy.attempt_job_id(job_id, k)
            with self._place(replace(config, attempt=k, run_id=job_id), attempt_id, detached=True) as placement:
                if placement.agents is not None:
                    placement.agents.close()  # the keepers start their own agents
                attempts.append((attempt_id, placement.commands))
                ends_job = placement.ends_job
        assert self.transport is not None
        return start_detached(config, Handover(self.transport, tuple(attempts), self.job_secret, self.found.addresses,
                                               ends_job, tuple(self.port_claims)), job_id)

    @contextmanager
    def _place(self, config: LaunchConfig, job_id: str, *, detached: bool) -> Iterator[Placement]:
        """``detached``: Horovod's rendezvous is the leader keeper's, on host 0: the ranks get its
        address and the port ``0``, which the keepers fill in (``docs/detach.md``)."""
        assert self.transport is not None, "place() runs inside session()"
        agents, self.agents = self.agents, None  # a restart's ranks get fresh agents
        if config.attempt:
            config = self.shrunk(config, self.inventory)
            if self.prepared.ports_chosen:  # a fresh run of free ports (the last attempt's may still be held)
                earlier = list(self.port_claims)
                config = replace(config, base_port=local_base_port(self.inventory, config.np, self.port_claims))
                if not detached:  # the last attempt's ranks have ended (a detached job's run later)
                    self.release_ports(earlier)
            if self.reconnect:
                agents = self.rejoin(config)
        with ExitStack() as stack:
            plan = job_plan(config, self.inventory, job_id, self.found.addresses, self.found.ports)
            synced: tuple[str, ...] = ()
            if config.checkpoint_dirs and not (detached and config.attempt):  # keepers restart on their own
                synced = self.sync_checkpoints(config, plan.hosts)
                if not config.attempt:  # before anything starts, as the launch's other first lines
                    for line in synced:
                        print(f"dlrun: {line}", file=sys.stderr, flush=True)
            rendezvous: Rendezvous | None = None
            if config.framework == "horovod" and detached:
                from dlrun.remote.rendezvous import rendezvous_key

                rendezvous = (plan.ranks[0].address, 0, rendezvous_key(self.job_secret))
                if ":" in rendezvous[0]:
                    raise RendezvousError(
                        f"host {plan.ranks[0].host.name}'s address {rendezvous[0]} is IPv6; Horovod's rendezvous"
                        " client is IPv4-only", host=plan.ranks[0].host.name,
                        hint="give host 0 an IPv4 address in --hosts")
            elif config.framework == "horovod":
                rendezvous = stack.enter_context(horovod_rendezvous(plan))
            _, commands = self.render(config, job_id, rendezvous, plan)  # one plan per attempt
            yield Placement(self.transport, commands, agents,
                            ends_job=(lambda c: c.spec.task_type == "chief") if config.framework == "tf-ps" else None,
                            notes=synced)

    def sync_checkpoints(self, config: LaunchConfig, hosts: Sequence[Host]) -> tuple[str, ...]:
        """Make each ``--checkpoint-dir`` the same on ``hosts`` (``dlrun.push.checkpoint``); a
        line per folder with what moved and how long it took."""
        from dlrun.push.checkpoint import sync_folders

        assert self.transport is not None
        cwd_for = self.found.cwd_for or {}

        def cwd_of(host: Host) -> str:
            return cwd_for.get(host.name) or (os.getcwd() if host.is_local else host.workdir or "")

        done = sync_folders(self.transport, hosts, cwd_of, config.checkpoint_dirs,
                            failed_at=self.failed_at if config.attempt else None,
                            addresses=self.found.addresses if len(hosts) > 1 else None,
                            owner_check=not config.insecure_workdir)
        return tuple(d.line() for d in done)
