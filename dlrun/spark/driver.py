"""``--backend spark``: the Spark engine places a job's ranks as the tasks of one barrier stage.

Everything above placing is the launch pipeline's (``dlrun.run.pipeline.run_job``): the ranks get
the same env (``worker_commands``), the same ``Supervisor`` runs them (live view, per-rank
logs, fail fast, root cause, exit codes, ``--max-restarts``); only the way a "host" is reached
differs. Each barrier task is one host with one slot. ``SparkEngine.session`` holds the Spark
context and the shipped script; each ``place`` is one stage:

1. The driver makes the job's TLS key and certificate (``dlrun.spark.tls``), listens on a TCP
   port on the interface facing the executors (``listen_addresses``: loopback for local
   masters) (``HelloServer``) and submits one barrier stage of N tasks
   (``rdd.barrier().mapPartitions``) from a background thread. The closure carries the
   driver's address, the certificate (public), the token and the agent's command line; never
   the env or the spec.
2. Each task (``dlrun.spark.task.task_main``, on an executor) connects to the driver and
   completes a TLS 1.3 handshake trusting only that certificate, picks a free port on its
   host, ``allGather``s ``host:port`` with the other tasks (the barrier: every task is
   running), reads its GPUs from ``TaskContext.resources()`` and sends one hello line inside
   TLS (JSON: token, partition, host, port, gpus, python, script). A connection that fails the
   handshake or says a wrong hello is closed and reported once; the job goes on. Then the task
   starts the host agent through the bootstrap's loader with a local socket as its stdin and
   stdout (``task.relay`` carries that socket's bytes over TLS, on both sides) and a
   parent-death signal, and waits for it.
3. Once all N hellos are in (within ``start_timeout``), the driver builds one ``Host`` per
   task, a ``Plan`` with the ports the tasks picked (rank = partition id) and renders the
   commands; the supervisor runs them over ``SparkTransport``, whose ``open`` returns a
   ``SparkChannel`` over that task's socket: the agent already runs there, reads its source
   (``boot_payload``) and then the spec.
4. After the agent exits, the task appends a ``TASK_END`` frame (the agent's exit code and
   stderr tail; the supervisor ignores it, the channel reads it) and half-closes; the driver
   answers every task with a verdict line once the job has ended, and a task raises when the
   job failed — so the Spark stage fails too. A restart is a fresh stage (new ports, new job
   id ``<job>-r<k>``).

A task that dies takes its agent and ranks along (parent-death signal) and its closed socket
makes it the lost host of the root cause; a stage that Spark ends mid-job for any other reason
drops the remaining tasks' connections, so no rank waits for peers that are gone. For
Horovod, tasks on one machine count as one Horovod host (``horovod_topology``).

Before submitting: dynamic allocation is refused (barrier mode needs it off), and N must fit
the free task slots — Spark itself would wait about ten minutes before failing.

The script's directory reaches the executors inside a zip archive, with the files a push
would send (``SparkContext.addArchive``; ``addFile`` refuses directories on non-local
masters), unpacked next to each task, where the ranks run: no shared filesystem is needed.
Only ``dlrun.spark`` imports pyspark, and only when it runs; the task side
(``dlrun.spark.task``) imports nothing from dlrun (it is pickled by value).
"""

from __future__ import annotations

import contextlib
import hmac
import importlib
import json
import logging
import os
import re
import secrets
import shutil
import socket
import ssl
import sys
import threading
import time
import urllib.request
import zipfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

from dlrun.errors import BackendError, BackendUnavailable, HostUnreachable, UsageError
from dlrun.inventory import Host, Inventory
from dlrun.plan import Plan, make_plan
from dlrun.remote import agent
from dlrun.render import Rendezvous, WorkerCommand, worker_argv, worker_commands
from dlrun.run.addresses import socket_ifaces
from dlrun.run.agents import agent_argv
from dlrun.run.checks import check_ranks_shown
from dlrun.run.config import LaunchConfig
from dlrun.run.engine import DryRun, Placement, Regrouped
from dlrun.run.pipeline import run_job
from dlrun.run.result import RankState, RunResult
from dlrun.run.supervisor import View
from dlrun.spark import task
from dlrun.spark.task import TASK_END, TlsLink, start_relay
from dlrun.spark.tls import JobTls, make_job_tls, server_context
from dlrun.transport.base import Channel, Transport

__all__ = [
    "SparkChannel",
    "SparkConfig",
    "SparkEngine",
    "SparkTransport",
    "TaskHello",
    "listen_addresses",
    "run_spark",
    "slots_message",
    "task_commands",
]

CONTEXT_MARK = "spark.dlrun.context"  # set with a fresh value in a context dlrun makes (spark_context)
SLOT_WAIT = 10.0  # seconds for executors to register before the slot check fails (count unknown)
MAX_HELLO = 1 << 20
VERDICT_WAIT = 5.0  # seconds for the tasks to report their end before the verdicts go out regardless
INSTALL_HINT = "pip install 'dlrun[spark]'"
JAVA_HINT = "apt-get install openjdk-17-jre-headless (or set JAVA_HOME to a Java 17+ runtime)"
_TRUE = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class SparkConfig:
    """Where and how big the barrier stage is (``dlrun launch --backend spark``)."""

    master: str
    num_workers: int
    cores_per_worker: int = 1
    gpus_per_worker: int = 0
    conf: Mapping[str, str] = field(default_factory=dict)
    start_timeout: float = 120.0


@dataclass(frozen=True)
class TaskHello:
    """What a barrier task told the driver about itself."""

    partition: int
    host: str  # this task's address on the route to the driver
    port: int  # the free port it picked for its rank
    gpus: tuple[str, ...] = ()
    python: str = "python3"
    script: str | None = None  # the shipped script, unpacked on the executor
    pid: int = 0
    iface: str | None = None  # the executor's interface holding ``host`` (for Gloo)

    @property
    def name(self) -> str:
        """The host name dlrun shows for this task (unique per task; no ``/``)."""
        return f"task{self.partition}@{self.host}"


# ============================================================================ entry point


class SparkEngine:
    """Places each attempt's ranks as the tasks of one Spark barrier stage (see the module's
    docstring); the session holds the Spark context and the shipped script."""

    restart_unit = "the barrier stage"
    detaches = False  # a Spark stage lives with its driver
    warnings: tuple[str, ...] = ()

    def __init__(self, spark: SparkConfig) -> None:
        self.spark = spark
        # the hosts are not known yet: one stand-in without env, so only config and script count
        self.inventory = Inventory(hosts=(Host(address="spark", name="spark"),))
        self.sc: Any = None
        self.shipped: tuple[str, str] | None = None
        self.stages = 0

    def prepare(self, config: LaunchConfig) -> LaunchConfig:
        check_request(config, self.spark)
        # nothing is pushed: the script ships with the stage; a script that is no file here
        # runs as given on the executors (the logs are written here)
        return replace(config, push=False)

    def probes(self, config: LaunchConfig) -> bool:
        return False  # the tasks' hosts are known once the stage runs

    def dry_run(self, config: LaunchConfig, job_id: str) -> DryRun:
        raise UsageError("--dry-run is not available with --backend spark: tasks pick hosts and ports when they run")

    def regroup(self, config: LaunchConfig, failed: RunResult) -> Regrouped:
        return Regrouped()  # the next stage runs wherever Spark places its tasks

    def detach(self, config: LaunchConfig, job_id: str, view: View) -> RunResult:
        raise UsageError("--detach goes with the SSH backend (a Spark stage lives with its driver)")

    @contextmanager
    def session(self, config: LaunchConfig, job_id: str) -> Iterator[LaunchConfig]:
        pyspark = import_pyspark()
        with spark_context(pyspark, self.spark, app_name=f"dlrun {Path(config.script).name}") as sc:
            check_context(sc, self.spark)
            wait_for_slots(sc, self.spark)
            # a registered file must outlive the job: executors fetch every one before any later task
            staging = Path(pyspark.SparkFiles.getRootDirectory()) / f"dlrun-staging-{job_id}"
            self.shipped = ship_script(sc, config.script, job_id, staging)
            pyspark.cloudpickle.register_pickle_by_value(task)
            self.sc = sc
            try:
                yield config
            finally:
                self.sc = None

    @contextmanager
    def place(self, config: LaunchConfig, job_id: str, view: View) -> Iterator[Placement]:
        """One barrier stage: hellos, plan, commands; after the job, the tasks' verdicts."""
        sc, spark = self.sc, self.spark
        assert sc is not None, "place() runs inside session()"
        if self.stages:
            wait_for_slots(sc, spark)
        self.stages += 1
        n = spark.num_workers
        token = secrets.token_hex(16)
        tls = make_job_tls(job_id)
        bind, driver_host = listen_addresses(sc.master, dict(sc.getConf().getAll()))
        server = HelloServer(token, job_id, n, tls, bind)
        if not server.on_bind:
            view.notice(f"spark: cannot listen on {bind} (spark.driver.bindAddress/host): listening on"
                        f" {server.bound} (the channel is TLS either way)")
        setup = {
            "driver": [driver_host, server.port],
            "cert": tls.cert_pem,  # pinned: the task trusts this certificate and nothing else
            "token": token,  # authenticates the task inside TLS; as private as Spark's own traffic
            "job_id": job_id,
            # the task may not import dlrun: it gets the agent's command line, the driver sends its source
            "agent_argv": agent_argv([task.EXECUTOR_PYTHON], pidns=config.pidns),
            "archive": self.shipped[0] if self.shipped else None,
            "script": self.shipped[1] if self.shipped else None,
        }
        job = _StageJob(sc, job_id, n, partial(task.task_main, setup))
        transport: SparkTransport | None = None
        view.notice(f"spark: submitting a barrier stage of {n} tasks to {sc.master} (job {job_id});"
                    f" they report to {driver_host}:{server.port} over TLS")
        job.start()
        try:
            links = server.wait(spark.start_timeout, job.failed,
                                report=lambda why: view.notice(f"spark: refused a connection: {why}"))
            server.close()  # every task is in: a retried or stray task finds no door
            hellos = [link.hello for link in links.values()]
            missing_gpus = [h.name for h in hellos if len(h.gpus) < spark.gpus_per_worker]
            if missing_gpus:
                raise BackendError(
                    f"--gpus-per-worker {spark.gpus_per_worker} but Spark gave {', '.join(missing_gpus)} fewer"
                    " GPUs",
                    hint="set spark.executor.resource.gpu.amount and spark.executor.resource.gpu.discoveryScript",
                )
            transport = SparkTransport(links)
            with ExitStack() as stack:
                rendezvous = None
                if config.framework == "horovod":
                    where = bind if server.on_bind else "0.0.0.0"
                    rendezvous = stack.enter_context(_horovod_rendezvous(hellos, driver_host, where))
                _, commands = task_commands(config, hellos, job_id, rendezvous=rendezvous)
                stage = transport

                def done(result: RunResult) -> None:
                    stage.finish(result)
                    job.end(timeout=10.0 if result.ok else 30.0)

                yield Placement(transport, commands, watch=partial(_watch_stage, job, transport), done=done)
        finally:
            server.close()
            if transport is not None:
                transport.close()
            for link in server.links.values():
                link.sock.close()
            if job.thread.is_alive():
                job.end(timeout=0)


def run_spark(config: LaunchConfig, spark: SparkConfig, *, view: View | None = None) -> int:
    """Run ``config``'s script as ``spark.num_workers`` barrier tasks; return the exit code.

    ``view`` replaces the terminal view (tests); by default it is ``make_view``'s.
    """
    return run_job(config, SparkEngine(spark), view=view).exit_code


def check_request(config: LaunchConfig, spark: SparkConfig) -> None:
    """Refuse what cannot work, before pyspark is even imported."""
    if spark.num_workers < 1:
        raise UsageError(f"-n must be at least 1, not {spark.num_workers}")
    if spark.cores_per_worker < 1:
        raise UsageError(f"--cores-per-worker must be at least 1, not {spark.cores_per_worker}")
    if spark.gpus_per_worker < 0 or spark.start_timeout <= 0:
        raise UsageError("--gpus-per-worker must be >= 0 and the start timeout > 0")
    if config.np is not None and config.np != spark.num_workers:
        raise UsageError(f"--np {config.np} and -n {spark.num_workers} disagree; with --backend spark use -n")
    if config.hosts is not None:
        raise UsageError("--hosts does not go with --backend spark: Spark places the tasks")
    if config.dry_run:
        raise UsageError("--dry-run is not available with --backend spark: tasks pick hosts and ports when they run")
    if config.framework == "tf-ps":
        raise UsageError("--framework tf-ps is not supported with --backend spark (use tf, horovod, torch or none)")
    check_ranks_shown(config, spark.num_workers)
    if _dynamic_allocation(spark.conf):
        raise _dynamic_allocation_error()


def _dynamic_allocation(conf: Mapping[str, str]) -> bool:
    return str(conf.get("spark.dynamicAllocation.enabled", "false")).strip().lower() in _TRUE


def _dynamic_allocation_error() -> BackendError:
    return BackendError(
        "Spark dynamic allocation is enabled, and barrier execution cannot run with it"
        " (executors could come and go under a stage that needs every task at once)",
        hint="pass --conf spark.dynamicAllocation.enabled=false"
        " (or remove it from spark-defaults.conf / the cluster's configuration)",
    )


# ============================================================================ the session


def import_pyspark() -> ModuleType:
    """pyspark, or a BackendError saying how to install it."""
    try:
        pyspark = importlib.import_module("pyspark")
        importlib.import_module("pyspark.cloudpickle")
    except ImportError as exc:
        raise BackendError(f"--backend spark needs pyspark, which is not installed ({exc})", hint=INSTALL_HINT) from exc
    return pyspark


def java_command() -> str | None:
    """The java that pyspark will start, or None."""
    home = os.environ.get("JAVA_HOME")
    if home:
        candidate = Path(home) / "bin" / "java"
        return str(candidate) if os.access(candidate, os.X_OK) else None
    return shutil.which("java")


@contextmanager
def spark_context(pyspark: ModuleType, spark: SparkConfig, *, app_name: str) -> Iterator[Any]:
    """The SparkContext already running in this process (kept), or a new one (stopped after).

    ``SparkContext.getOrCreate`` decides (Spark's public way to share the one context of a
    process); a conf entry with a fresh value marks the context this call made."""
    mine = secrets.token_hex(8)
    settings = {
        "spark.task.cpus": str(spark.cores_per_worker),
        "spark.ui.showConsoleProgress": "false",  # its progress bar would tear the dlrun view
        **({"spark.task.resource.gpu.amount": str(spark.gpus_per_worker)} if spark.gpus_per_worker else {}),
        **spark.conf,
        CONTEXT_MARK: mine,
    }
    settings.update(quiet_task_failures(pyspark, settings))
    if spark.master.startswith("local"):  # executors on this machine: the driver's interpreter
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    try:
        conf = pyspark.SparkConf().setMaster(spark.master).setAppName(app_name)
        for key, value in settings.items():
            conf.set(key, value)
        logging.disable(logging.ERROR)  # py4j logs a traceback when Ctrl-C interrupts the JVM's start
        try:
            sc = pyspark.SparkContext.getOrCreate(conf)
        finally:
            logging.disable(logging.NOTSET)
    except Exception as exc:
        if java_command() is None:
            where = f"JAVA_HOME={os.environ['JAVA_HOME']} has no bin/java" if os.environ.get("JAVA_HOME") else "no java"
            raise BackendError(f"--backend spark needs Java 17 or newer ({where} on PATH)", hint=JAVA_HINT) from exc
        raise BackendUnavailable(f"cannot start Spark ({spark.master}): {spark_error_text(exc)}") from exc
    if sc.getConf().get(CONTEXT_MARK) != mine:  # the process's own context, made before: kept as it is
        if sc.master != spark.master:
            raise BackendError(
                f"a SparkContext for {sc.master} already runs in this process; cannot use {spark.master}"
            )
        yield sc
        return
    try:
        yield sc
    finally:
        sc.stop()


def check_context(sc: Any, spark: SparkConfig) -> None:
    """The running context must allow barrier mode and give each task what was asked."""
    conf = sc.getConf()
    if _dynamic_allocation({"spark.dynamicAllocation.enabled": conf.get("spark.dynamicAllocation.enabled", "false")}):
        raise _dynamic_allocation_error()
    task_cpus = int(conf.get("spark.task.cpus", "1"))
    if task_cpus != spark.cores_per_worker:
        raise BackendError(
            f"--cores-per-worker {spark.cores_per_worker} but the Spark context has spark.task.cpus={task_cpus}",
            hint="use the same value for both (a running context keeps its spark.task.cpus)",
        )
    gpus = float(conf.get("spark.task.resource.gpu.amount", "0"))
    if spark.gpus_per_worker and gpus < spark.gpus_per_worker:
        raise BackendError(
            f"--gpus-per-worker {spark.gpus_per_worker} but the Spark context has"
            f" spark.task.resource.gpu.amount={gpus:g}",
            hint="executors need spark.executor.resource.gpu.amount and a discovery script"
            " (spark.executor.resource.gpu.discoveryScript)",
        )
    if spark.gpus_per_worker and _is_local(sc.master):
        raise BackendError(
            f"{sc.master} does not schedule tasks that ask for GPUs (the stage would wait forever)",
            hint="use a cluster master, or local-cluster[...] with spark.worker.resource.gpu.* set",
        )


def ship_script(sc: Any, script: str, job_id: str, staging: Path) -> tuple[str, str] | None:
    """Send the script's directory to the executors in ``dlrun-<job>.zip``, as ``dlrun push``
    would send it (``.gitignore``, ``.dlrunignore``, no ``.git`` or ``__pycache__``): the
    script's own modules and files go along. (archive, script's name in it) or None.

    ``staging`` must live as long as the SparkContext (it is under Spark's own driver temp
    directory): executors fetch every registered file before running any later task.

    A ``script`` that is no file here (a command on the executors' PATH) is not shipped.
    """
    from dlrun.push.session import scan_code

    if not Path(script).is_file():
        return None
    path = Path(script).resolve()  # a link to the script: its directory is the target's, as a push sends it
    root = path.parent
    staging.mkdir(parents=True, exist_ok=True)
    archive = staging / f"dlrun-{job_id}.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as zf:
        names = {e.path for e in scan_code(root).entries if not e.is_link or (root / e.path).is_file()}
        for name in sorted(names | {path.name}):  # a link to a file goes as that file's bytes
            zf.write(root / name, name)
    try:
        sc.addArchive(str(archive))
    except Exception as exc:
        raise BackendUnavailable(f"cannot ship {script} to the executors: {spark_error_text(exc)}") from exc
    return archive.name, path.name


# ============================================================================ task slots


@dataclass(frozen=True)
class Slots:
    """How many barrier tasks the cluster can run at once right now."""

    total: int
    busy: int
    executors: int
    task_cpus: int

    @property
    def free(self) -> int:
        return max(self.total - self.busy, 0)


def count_slots(sc: Any) -> Slots:
    """The executors' task slots (Spark's monitoring REST API: ``maxTasks`` per active
    executor, which is what its barrier check counts) minus busy tasks. Without the UI
    (``spark.ui.enabled=false``, a filter in the way): ``defaultParallelism`` / task cpus."""
    task_cpus = int(sc.getConf().get("spark.task.cpus", "1"))
    local = _is_local(sc.master)
    try:
        found = executor_summaries(sc)
        total = sum(int(e.get("maxTasks") or 0) for e in found)
        executors = sum(1 for e in found if local or e.get("id") != "driver")
    except (OSError, ValueError, TypeError):
        total, executors = int(sc.defaultParallelism) // task_cpus, 0
    tracker = sc.statusTracker()
    busy = 0
    for stage_id in tracker.getActiveStageIds():
        info = tracker.getStageInfo(stage_id)
        busy += int(info.numActiveTasks) if info is not None else 0
    return Slots(total=total, busy=busy, executors=executors, task_cpus=task_cpus)


def executor_summaries(sc: Any) -> list[dict[str, Any]]:
    """The active executors (``/api/v1/applications/<app>/executors`` of the driver's UI; the
    driver is one, with no slots but in local mode). Raises OSError where there is no UI."""
    url = sc.uiWebUrl
    if not url:
        raise OSError("the Spark UI is off")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the driver's own UI: no proxy
    with opener.open(f"{url}/api/v1/applications/{sc.applicationId}/executors", timeout=5) as answer:
        found = json.loads(answer.read(1 << 22))
    if not isinstance(found, list):
        raise ValueError("not a list of executors")
    return [e for e in found if isinstance(e, dict) and e.get("isActive", True)]


def _is_local(master: str) -> bool:
    return re.fullmatch(r"local(\[.*\])?", master) is not None


def wait_for_slots(sc: Any, spark: SparkConfig, *, clock: Callable[[], float] = time.monotonic) -> Slots:
    """Wait for executors to register, then check that N tasks fit, or raise with the numbers.

    Where the executor count is known (``local-cluster[n,...]``, ``spark.executor.instances``)
    the check waits for all of them (up to the start timeout), then judges at once; elsewhere
    it gives executors ``SLOT_WAIT`` seconds to appear.
    """
    started = clock()
    expected = _expected_executors(sc)
    wait = 0.0 if _is_local(sc.master) else spark.start_timeout if expected is not None else SLOT_WAIT
    while True:
        slots = count_slots(sc)
        if slots.free >= spark.num_workers:
            return slots
        registered = expected is not None and slots.executors >= expected
        if registered or clock() - started >= wait:
            message = slots_message(spark.num_workers, slots, sc.master)
            if expected is not None and not registered:
                message += f"; {slots.executors} of {expected} executors registered after {wait:.0f} s"
            raise BackendError(message, hint=_slots_hint(spark))
        time.sleep(0.25)


def _expected_executors(sc: Any) -> int | None:
    """How many executors will register, where the master or the conf says so."""
    match = re.fullmatch(r"local-cluster\[\s*(\d+)\s*,.*\]", sc.master)
    if match:
        return int(match.group(1))
    instances = sc.getConf().get("spark.executor.instances")
    return int(instances) if instances and instances.isdigit() else None


def slots_message(n: int, slots: Slots, master: str) -> str:
    where = f"{slots.executors} executor{'s' if slots.executors != 1 else ''}, " if slots.executors else ""
    return (
        f"-n {n} needs {n} task slots at once (barrier mode) but {master} has {slots.free} free"
        f" ({slots.total} in all: {where}spark.task.cpus={slots.task_cpus}; {slots.busy} busy)"
    )


def _slots_hint(spark: SparkConfig) -> str:
    return "lower -n, add executors or cores" + (
        ", or lower --cores-per-worker" if spark.cores_per_worker > 1 else ""
    ) + " (Spark itself would wait about ten minutes before failing)"


# ============================================================================ driver: hellos


@dataclass
class TaskLink:
    """One task's connection to the driver, with the bytes read past its hello line."""

    hello: TaskHello
    sock: socket.socket
    leftover: bytes = b""


def listen_addresses(master: str, conf: Mapping[str, str]) -> tuple[str, str]:
    """(where the driver's task listener binds, where the tasks connect to it).

    A local master's executors run here: loopback. Otherwise Spark's own choice for its driver:
    ``spark.driver.bindAddress`` (default ``spark.driver.host``) to bind, ``spark.driver.host``
    (default this machine's name) to connect.
    """
    if _is_local(master) or master.startswith("local-cluster"):
        return "127.0.0.1", "127.0.0.1"
    host = str(conf.get("spark.driver.host") or socket.gethostname())
    return str(conf.get("spark.driver.bindAddress") or host), host


def _listen(bind: str, backlog: int) -> tuple[socket.socket, bool]:
    """A listener on ``bind`` (an address or a name), else on every interface; (it, whether on ``bind``)."""
    try:
        family = socket.getaddrinfo(bind, 0, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((bind, 0), family=family, backlog=backlog), True
    except OSError:
        return socket.create_server(("0.0.0.0", 0), backlog=backlog), False


class HelloServer:
    """Accepts the barrier tasks' connections over TLS; keeps each one that says the right hello."""

    def __init__(self, token: str, job_id: str, size: int, tls: JobTls, bind: str = "127.0.0.1") -> None:
        self.token = token
        self.job_id = job_id
        self.size = size
        self.links: dict[int, TaskLink] = {}
        self.rejected: list[str] = []
        self._context = server_context(tls)
        self._cond = threading.Condition()
        self._closed = False
        self._listener, self.on_bind = _listen(bind, max(128, size))
        self._listener.settimeout(0.2)
        self.bound = str(self._listener.getsockname()[0])
        self.port = int(self._listener.getsockname()[1])
        self._thread = threading.Thread(target=self._accept_loop, name="dlrun-spark-hello", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._greet, args=(conn, peer), daemon=True).start()

    def _greet(self, tcp: socket.socket, peer: tuple[Any, ...]) -> None:
        link = TlsLink(tcp, self._context, server_side=True)
        try:
            link.handshake()
        except (OSError, ssl.SSLError) as exc:
            self._reject(tcp, f"{peer[0]}: no TLS handshake ({exc})")
            return
        conn, _ = start_relay(link, f"dlrun-relay-{peer[0]}:{peer[1]}")
        conn.settimeout(30)
        buf = b""
        try:
            while b"\n" not in buf and len(buf) < MAX_HELLO:
                data = conn.recv(65536)
                if not data:
                    break
                buf += data
        except OSError:
            pass
        line, sep, leftover = buf.partition(b"\n")
        try:
            hello = json.loads(line) if sep else None
        except ValueError:
            hello = None
        if (
            not isinstance(hello, dict)
            or not hmac.compare_digest(str(hello.get("token", "")), self.token)
            or hello.get("job_id") != self.job_id
        ):
            self._reject(conn, f"{peer[0]}: connection without this job's hello", tcp)
            return
        try:
            task = TaskHello(
                partition=int(hello["partition"]),
                host=str(hello["host"]),
                port=int(hello["port"]),
                gpus=tuple(str(g) for g in hello.get("gpus", ())),
                python=str(hello.get("python") or "python3"),
                script=hello.get("script"),
                pid=int(hello.get("pid", 0)),
                iface=str(hello["iface"]) if hello.get("iface") else None,
            )
        except (KeyError, TypeError, ValueError):
            self._reject(conn, f"{peer[0]}: malformed hello", tcp)
            return
        conn.settimeout(None)
        with self._cond:
            if self._closed or task.partition in self.links or not 0 <= task.partition < self.size:
                self._reject(conn, f"{task.name}: duplicate or late hello", tcp)
                return
            self.links[task.partition] = TaskLink(task, conn, leftover)
            self._cond.notify_all()

    def _reject(self, conn: socket.socket, why: str, tcp: socket.socket | None = None) -> None:
        """Note why, to be reported once, and close a connection (and its relay: ``tcp``)."""
        with self._cond:
            self.rejected.append(why)
            self._cond.notify_all()
        if tcp is not None:  # the relay sees its peer gone and ends at once
            with contextlib.suppress(OSError):
                tcp.shutdown(socket.SHUT_RDWR)
        conn.close()

    def wait(self, timeout: float, failed: Callable[[], str | None],
             report: Callable[[str], None] = lambda why: None) -> dict[int, TaskLink]:
        """Every task's link, in partition order; BackendUnavailable if the stage fails or is slow.
        Each refused connection is ``report``ed once, from the calling thread."""
        deadline = time.monotonic() + timeout
        reported = 0
        with self._cond:
            while True:
                for why in self.rejected[reported:]:
                    report(why)
                reported = len(self.rejected)
                if len(self.links) >= self.size:
                    break
                error = failed()
                if error is not None:
                    raise BackendUnavailable(
                        f"the Spark stage failed before every task reported ({len(self.links)} of {self.size}):"
                        f" {error}"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(self.size)) - set(self.links))
                    raise BackendUnavailable(
                        f"only {len(self.links)} of {self.size} Spark tasks reported within {timeout:.0f} s"
                        f" (missing partitions {', '.join(map(str, missing))})",
                        hint="are the slots taken by another job? can the executors reach the driver"
                        " (spark.driver.host)? raise --start-timeout for slow clusters",
                    )
                self._cond.wait(min(left, 0.2))
            return dict(sorted(self.links.items()))

    def close(self) -> None:
        with self._cond:
            self._closed = True
        self._listener.close()
        self._thread.join(2)


# ============================================================================ driver: transport


class SparkChannel(Channel):
    """A task's channel (the local end of its TLS relay): the agent's stdin and stdout, then
    the task's end frame and verdict."""

    def __init__(self, link: TaskLink) -> None:
        self.host = link.hello.name
        self.partition = link.hello.partition
        self._sock = link.sock
        self._pending = link.leftover
        self._decoder = agent.FrameDecoder()
        self._send_lock = threading.Lock()
        self._eof = threading.Event()
        self._closes = 0
        self._agent_done = False  # the agent sent DONE: its ranks are over and it exits by itself
        self.end: dict[str, Any] | None = None  # the task's TASK_END payload
        self.reason = "the Spark task ended without a word (executor lost or task killed?)"

    def send(self, data: bytes | memoryview) -> None:
        with self._send_lock:
            try:
                self._sock.sendall(data)
            except OSError as exc:
                raise HostUnreachable(f"the Spark task is gone ({exc.strerror or exc})", host=self.host) from exc

    def recv(self, max_bytes: int = 65536) -> bytes:
        if self._pending:
            data, self._pending = self._pending, b""
        else:
            try:
                data = self._sock.recv(max_bytes)
            except OSError:
                data = b""
        if not data:
            self._eof.set()
            return b""
        for kind, _rank, payload in self._decoder.feed(data):
            if kind == agent.DONE:
                self._agent_done = True
            elif kind == TASK_END:
                try:
                    self.end = json.loads(payload)
                except ValueError:
                    self.end = {"code": None, "stderr": payload.decode(errors="replace")}
        return data

    def close_stdin(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def wait(self, timeout: float | None = None) -> int | None:
        if not self._eof.wait(timeout):
            return None
        code = (self.end or {}).get("code")
        return int(code) if code is not None else None

    def stderr_text(self) -> str:
        if self.end is None:
            return self.reason if self._eof.is_set() else ""
        return str(self.end.get("stderr", ""))

    def close(self) -> None:
        """First: EOF to the agent (its watchdog stops the ranks); again: drop the connection.

        Once the agent said DONE, or the task has half-closed (its agent exited), the socket
        stays open: the task waits on it for the verdict, and a write side shut here would
        leave it none (its stage would fail although every rank succeeded).
        """
        if self._eof.is_set() or (self._agent_done and self._closes == 0):
            return
        self._closes += 1
        try:
            self._sock.shutdown(socket.SHUT_WR if self._closes == 1 else socket.SHUT_RDWR)
        except OSError:
            pass

    def abandon(self, reason: str) -> None:
        """Drop a task that Spark no longer runs: its agent sees EOF, the supervisor a lost host."""
        if self._eof.is_set():
            return
        self.reason = reason
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def finish(self, verdict: bytes, deadline: float) -> None:
        """Tell the task how the job ended, and hang up.

        First the task's own end is read (until ``deadline``, ``time.monotonic()``): closing a
        socket with unread bytes (the ``TASK_END`` frame) sends a reset, which can discard the
        verdict before the task reads it (its stage would fail although every rank succeeded).
        """
        self._eof.wait(max(0.0, deadline - time.monotonic()))
        with self._send_lock:
            try:
                self._sock.sendall(verdict)
            except OSError:
                pass
            self._sock.close()


class SparkTransport(Transport):
    """Hosts are barrier tasks whose agents already run: ``open`` hands out their sockets."""

    def __init__(self, links: Mapping[int, TaskLink]) -> None:
        self.links = {link.hello.name: link for link in links.values()}
        self.channels: dict[str, SparkChannel] = {}

    def connect(self, hosts: Sequence[Host]) -> Mapping[str, str]:
        return {h.name: self.links[h.name].hello.host for h in hosts}

    def open(self, host: Host, argv: Sequence[str]) -> Channel:
        link = self.links.get(host.name)
        if link is None or host.name in self.channels:
            raise HostUnreachable("no Spark task (or its channel is already open)", host=host.name)
        channel = SparkChannel(link)
        self.channels[host.name] = channel
        return channel

    def finish(self, result: RunResult) -> None:
        """Send every task the verdict (its stage fails unless the job succeeded)."""
        verdict = json.dumps({"verdict": result.exit_code, "message": verdict_message(result)}).encode() + b"\n"
        deadline = time.monotonic() + VERDICT_WAIT
        for name, link in self.links.items():
            channel = self.channels.get(name)
            if channel is not None:
                channel.finish(verdict, deadline)
            else:
                link.sock.close()

    def abandon(self, reason: str) -> None:
        for channel in self.channels.values():
            channel.abandon(reason)

    def close(self) -> None:
        for link in self.links.values():
            link.sock.close()


def verdict_message(result: RunResult) -> str:
    root = result.root_cause
    if result.ok:
        return "every rank succeeded"
    if root is not None:
        if root.state == RankState.LOST:
            return f"host {root.host} (rank {root.rank}) was lost: {root.error}"
        return f"rank {root.rank} on {root.host} exited with code {root.exit_code}"
    if result.interrupted_by is not None:
        return f"dlrun was interrupted by signal {result.interrupted_by}"
    return f"the job failed with exit code {result.exit_code}"


# ============================================================================ rendering


def task_commands(
    config: LaunchConfig,
    hellos: Sequence[TaskHello],
    job_id: str,
    *,
    rendezvous: Rendezvous | None = None,
) -> tuple[Plan, tuple[WorkerCommand, ...]]:
    """One host per task (rank = partition id), the ports the tasks picked, the SSH path's env.

    Each rank runs the script as unpacked on its executor, with that executor's python, and
    sees the GPUs Spark gave its task as ``CUDA_VISIBLE_DEVICES``.
    """
    ordered = sorted(hellos, key=lambda h: h.partition)
    if [h.partition for h in ordered] != list(range(len(ordered))):
        raise BackendError(f"Spark tasks reported partitions {[h.partition for h in ordered]}, not 0..N-1")
    inventory = Inventory(
        hosts=tuple(Host(address=h.host, name=h.name, slots=1, python=h.python) for h in ordered),
        source="<spark barrier stage>",
    )
    plan = make_plan(
        inventory,
        job_id=job_id,
        np=len(ordered),
        framework=config.framework,
        ports={h.partition: h.port for h in ordered},
        restart_count=config.attempt,
        max_restarts=config.max_restarts,
        run_id=config.run_id,
    )
    commands = worker_commands(
        plan,
        config.script,
        config.args,
        python_for={h.name: [h.python] for h in ordered},
        # as pushed over SSH: a rank runs in its unpacked project directory
        cwd_for={h.name: os.path.dirname(h.script) if h.script else None for h in ordered},
        extra_env=config.env,
        rendezvous=rendezvous or (("127.0.0.1", 0) if config.framework == "horovod" else None),
        ifaces=socket_ifaces(plan, config.iface, {h.name: h.iface for h in ordered if h.iface}),
        gpus_for={h.name: [",".join(h.gpus)] for h in ordered if h.gpus},
        no_python=config.no_python,
    )
    by_name = {h.name: h for h in ordered}
    topology = horovod_topology(ordered) if config.framework == "horovod" else {}
    rendered = []
    for c in commands:
        task = by_name[c.host_name]
        env = dict(c.env)
        if task.partition in topology:  # Horovod's hosts are machines, not tasks
            local_rank, local_size, cross_rank, cross_size = topology[task.partition]
            env.update({
                "HOROVOD_LOCAL_RANK": str(local_rank),
                "HOROVOD_LOCAL_SIZE": str(local_size),
                "HOROVOD_CROSS_RANK": str(cross_rank),
                "HOROVOD_CROSS_SIZE": str(cross_size),
            })
        argv = worker_argv(task.script or config.script, config.args, [task.python], no_python=config.no_python)
        rendered.append(replace(c, argv=argv, env=env))
    return plan, tuple(rendered)


def horovod_topology(hellos: Sequence[TaskHello]) -> dict[int, tuple[int, int, int, int]]:
    """partition → (local_rank, local_size, cross_rank, cross_size), grouping tasks by address.

    Each task is its own dlrun host, but gloo groups ranks by ``HOROVOD_HOSTNAME`` (the
    address), so tasks that share an executor machine must count as one Horovod host — as
    ``make_plan`` counts slots. (Spark's CUDA_VISIBLE_DEVICES holds only a task's own GPUs, so
    pin device 0 there, not ``hvd.local_rank()``.)
    """
    ordered = sorted(hellos, key=lambda h: h.partition)
    local: dict[int, int] = {}
    per_host: dict[str, list[int]] = {}
    for h in ordered:
        local[h.partition] = len(per_host.setdefault(h.host, []))
        per_host[h.host].append(h.partition)
    hosts = list(per_host)
    topology = {}
    for h in ordered:
        with_rank = [host for host in hosts if len(per_host[host]) > local[h.partition]]
        topology[h.partition] = (local[h.partition], len(per_host[h.host]), with_rank.index(h.host), len(with_rank))
    return topology


# ============================================================================ one stage


class _StageJob:
    """The barrier stage, submitted from a thread (``collect`` blocks until it ends)."""

    def __init__(self, sc: Any, group: str, size: int, task: Callable[[Iterable[Any]], Iterator[str]]) -> None:
        self.sc = sc
        self.group = group
        self.size = size
        self.task = task
        self.error: BaseException | None = None
        self.results: list[str] = []
        self.thread = threading.Thread(target=self._run, name=f"dlrun-spark-{group}", daemon=True)

    def _run(self) -> None:
        try:
            self.sc.setJobGroup(self.group, f"dlrun job {self.group}", interruptOnCancel=True)
            rdd = self.sc.parallelize(range(self.size), self.size)
            self.results = list(rdd.barrier().mapPartitions(self.task).collect())
        except BaseException as exc:  # reported through failed() / after the supervisor
            self.error = exc

    def start(self) -> None:
        self.thread.start()

    def failed(self) -> str | None:
        if self.thread.is_alive():
            return None
        return spark_error_text(self.error) if self.error is not None else "the stage ended without starting"

    def end(self, timeout: float) -> None:
        """Wait for the stage to finish (the tasks got their verdicts); cancel it if it does not."""
        self.thread.join(timeout)
        if self.thread.is_alive():
            try:
                self.sc.cancelJobGroup(self.group)
            except Exception:
                pass
            self.thread.join(15)


#: Spark's defaults, then dlrun's layer: failed tasks' tracebacks (the root cause has their news) off.
QUIET_LOG4J2 = ("org/apache/spark/log4j2-defaults.properties", str(Path(__file__).with_name("log4j2-quiet.properties")))
LOG4J2_FILES = ("log4j2.properties", "log4j2.xml", "log4j2.yaml", "log4j2.yml", "log4j2.json")


def quiet_task_failures(pyspark: ModuleType, conf: Mapping[str, str]) -> dict[str, str]:
    """The driver JVM's options that layer ``log4j2-quiet.properties`` over Spark's defaults,
    or nothing where the user configured log4j2 (a file in Spark's conf folder, or
    ``log4j2.configurationFile`` in ``spark.driver.extraJavaOptions``): theirs wins."""
    options = conf.get("spark.driver.extraJavaOptions", "")
    if "log4j2.configurationFile" in options or "log4j.configurationFile" in options:
        return {}
    folders = [os.environ.get("SPARK_CONF_DIR"),
               os.path.join(os.environ["SPARK_HOME"], "conf") if os.environ.get("SPARK_HOME") else None,
               os.path.join(os.path.dirname(pyspark.__file__ or ""), "conf")]
    if any(folder and os.path.exists(os.path.join(folder, name)) for folder in folders for name in LOG4J2_FILES):
        return {}
    if re.search(r"[\s,'\"\\]", QUIET_LOG4J2[1]):  # Spark splits the options on blanks; log4j2 the files on commas
        return {}
    quiet = "-Dlog4j2.configurationFile=" + ",".join(QUIET_LOG4J2)
    return {"spark.driver.extraJavaOptions": f"{options} {quiet}".strip()}


@contextmanager
def _watch_stage(job: _StageJob, transport: SparkTransport, grace: float = 3.0) -> Iterator[None]:
    """While the job runs, a stage that Spark ended (task or executor lost) ends the job too.

    A task that dies takes its agent along (parent-death signal), and its closed socket makes
    it the root cause; ``grace`` lets that happen first. Then every task still connected is
    dropped, so no rank waits for peers that are gone.
    """
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            if not job.thread.is_alive():
                if not done.wait(grace):
                    transport.abandon(f"the Spark stage ended: {job.failed()}")
                return
            done.wait(0.5)

    watcher = threading.Thread(target=watch, name=f"dlrun-spark-watch-{job.group}", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join(2)


@contextmanager
def _horovod_rendezvous(hellos: Sequence[TaskHello], driver_host: str,
                        bind: str) -> Iterator[tuple[str, int, str]]:
    """dlrun's gloo rendezvous on the driver, its scopes sized as ``horovod_topology`` counts;
    every request must carry the stage's own key (``dlrun.remote.rendezvous``)."""
    from dlrun.remote.rendezvous import rendezvous_key
    from dlrun.run.rendezvous import RendezvousServer, scope_sizes

    try:
        address = socket.gethostbyname(driver_host)
    except OSError:
        address = driver_host
    topology = horovod_topology(hellos)
    ranks = [(h.host, topology[h.partition][0]) for h in sorted(hellos, key=lambda h: h.partition)]
    key = rendezvous_key(secrets.token_hex(32))
    with RendezvousServer(scope_sizes(ranks), host=bind, key=key) as server:
        bound = server.address
        assert bound is not None
        yield address, bound[1], key


def spark_error_text(exc: BaseException | None) -> str:
    """The useful part of a (Py4J) Spark error: the stage failure and the task's Python error."""
    if exc is None:
        return "unknown error"
    text = str(exc)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    summary = next((line for line in lines if "Job aborted" in line or "Exception:" in line), lines[0] if lines else "")
    summary = re.sub(r"^:\s*", "", summary)[:300]
    python = [line for line in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)\b: ", line)]
    if python and python[-1] not in summary:
        summary += f" | {python[-1][:300]}"
    return summary or type(exc).__name__
