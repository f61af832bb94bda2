"""Renderers: what each rank receives — its environment and its argv.

Pure functions named for what they return: ``tf_config`` (the TF_CONFIG dict),
``dlrun_env``, ``horovod_env``, ``torch_env``, ``framework_env``, ``socket_env`` (a host's
Gloo/NCCL interface variables: each host names its own, so hosts need not share NIC names),
``worker_argv`` and ``worker_commands`` (all ranks as ``WorkerCommand`` records). Also
``mask_env``, which every printed output goes through so that secrets are never shown.

Commands are argv lists, never shell strings: TF_CONFIG is JSON and travels byte-exact to the
agent that starts the rank (see ``dlrun.remote.agent``), so no shell ever sees it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dlrun.command import program_argv, runs_r
from dlrun.plan import TF_AND_TORCH, Plan, RankSpec

# names that hold secrets: HF_TOKEN, AWS_SECRET_ACCESS_KEY, DB_PASS, MYSQL_PWD, SMTP_PASSWD,
# GIT_CREDENTIALS, HTTP_AUTH, WANDB_API_KEY, SESSION_COOKIE, SSH_PRIVATE…
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASS|PWD|CREDENTIAL|AUTH|KEY|COOKIE|PRIVATE", re.IGNORECASE)
# scheme://user:password@host in any value; the password runs to the last '@' before the host
# (it may hold '@' or '/'), the host to the first '/', '?', '#' or space
URL_PASSWORD = re.compile(r"(://[^/:@\s]*):\S*@(?=[^@\s/]*(?:[/?#\s]|$))")
MASK = "****"
# HOROVOD_GLOO_RENDEZVOUS_ADDR=host:port/<key>: the key is the rendezvous credential
RENDEZVOUS_KEY = re.compile(r"^([^/]*/).+$", re.DOTALL)
# an option of the script that names a secret: --password, --api-key (its value follows, or after '=')
SECRET_OPTION = re.compile(r"-{1,2}[A-Za-z][\w.-]*")
# NAME=VALUE or --name=value among the script's arguments
ASSIGNMENT = re.compile(r"(-{0,2}[A-Za-z_][\w.-]*)=(.*)", re.DOTALL)
# C0 and C1 control characters and DEL: a terminal obeys them (colors, cursor moves, titles)
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


@dataclass(frozen=True)
class WorkerCommand:
    """Everything needed to start one rank: where, what, with which env (additions only)."""

    spec: RankSpec
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None

    @property
    def rank(self) -> int:
        return self.spec.rank

    @property
    def host_name(self) -> str:
        return self.spec.host.name


def tf_config(plan: Plan, spec: RankSpec) -> dict[str, Any]:
    """TF_CONFIG for MultiWorkerMirroredStrategy, or the ParameterServerStrategy layout.

    The evaluator stays out of ``cluster`` (its own TF_CONFIG names only its task, which TF
    allows for an evaluator): a ParameterServerStrategy chief connects to every task of the
    cluster, and would wait forever for a server at the evaluator's address, where the user's
    evaluation script runs instead.
    """
    cluster: dict[str, list[str]] = {}
    for other in plan.ranks:
        cluster.setdefault(other.task_type, []).append(other.endpoint)
    ordered = {kind: cluster[kind] for kind in ("chief", "worker", "ps") if kind in cluster}
    return {"cluster": ordered, "task": {"type": spec.task_type, "index": spec.task_index}}


def dlrun_env(plan: Plan, spec: RankSpec) -> dict[str, str]:
    """The DLRUN_* variables every rank gets, whatever the framework."""
    return {
        "DLRUN_RANK": str(spec.rank),
        "DLRUN_LOCAL_RANK": str(spec.local_rank),
        "DLRUN_WORLD_SIZE": str(plan.world_size),
        "DLRUN_LOCAL_WORLD_SIZE": str(spec.local_size),
        "DLRUN_HOST": spec.host.name,
        "DLRUN_JOB_ID": plan.job_id,
        "DLRUN_RESTART_COUNT": str(plan.restart_count),  # 0, then 1, 2 … for each restart (--max-restarts)
    }


@dataclass(frozen=True)
class SocketIface:
    """The network interface one host's ranks use for their Gloo (and NCCL socket) traffic.

    ``named``: the user named it (``--iface``, the inventory's ``iface``) or the job runs on
    loopback only; then NCCL gets it too. An interface dlrun found itself (the one holding the
    address the other ranks reach this host at) goes to Gloo only, which must bind exactly
    there; NCCL keeps its own choice, which prefers InfiniBand and fast NICs.
    """

    name: str
    named: bool = True


def socket_env(framework: str, iface: SocketIface | None) -> dict[str, str]:
    """The interface variables of a rank on a host using ``iface``: Gloo's (Horovod's
    ``HOROVOD_GLOO_IFACE``, torch's ``GLOO_SOCKET_IFNAME``) and, for a named one, NCCL's."""
    if iface is None or framework == "none":
        return {}
    gloo = {"horovod": "HOROVOD_GLOO_IFACE", "torch": "GLOO_SOCKET_IFNAME", TF_AND_TORCH: "GLOO_SOCKET_IFNAME"}.get(
        framework)
    env = {gloo: iface.name} if gloo else {}
    if iface.named:
        env["NCCL_SOCKET_IFNAME"] = iface.name
    return env


#: Where the ranks meet: (address, port), or (address, port, key) for a server that wants the
#: job's rendezvous key in every request (``dlrun.remote.rendezvous.client_address``)
Rendezvous = tuple[str, int] | tuple[str, int, str]


def horovod_env(plan: Plan, spec: RankSpec, *, rendezvous: Rendezvous) -> dict[str, str]:
    """Horovod's gloo rank environment, pointing at dlrun's rendezvous server."""
    key = rendezvous[2] if len(rendezvous) > 2 else None
    # with a key: host:port/key, which Horovod's client puts into every request's path
    # (dlrun.remote.rendezvous.client_address, the keeper's copy)
    address = f"{rendezvous[0]}:{rendezvous[1]}/{key}" if key else rendezvous[0]
    env = {
        "HOROVOD_RANK": str(spec.rank),
        "HOROVOD_SIZE": str(plan.world_size),
        "HOROVOD_LOCAL_RANK": str(spec.local_rank),
        "HOROVOD_LOCAL_SIZE": str(spec.local_size),
        "HOROVOD_CROSS_RANK": str(spec.cross_rank),
        "HOROVOD_CROSS_SIZE": str(spec.cross_size),
        # the rank's network address: gloo resolves it when no interface is named
        "HOROVOD_HOSTNAME": spec.address,
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": address,
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(rendezvous[1]),
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
    }
    return env


def error_file(plan: Plan, spec: RankSpec) -> str:
    """Where a rank's ``@record`` writes its exception: per job, attempt and rank, as torchrun's
    ``…/attempt_N/<rank>/error.json``. The host's agent makes the folder and sends the file back."""
    return f"/tmp/dlrun-{plan.job_id}/attempt_{plan.restart_count}/{spec.rank}/error.json"


def flight_recorder_env(plan: Plan) -> dict[str, str]:
    """PyTorch's flight recorder, on for every torch job (``docs/stacks.md``): the last 2000
    collectives per rank in a ring buffer, dumped on a watchdog timeout (``dump_on_timeout``) or
    when ``<pipe stem><rank>.pipe`` is written to, into the job's folder on the host, which the
    agent makes. Each is set only where the job did not set it."""
    folder = f"/tmp/dlrun-{plan.job_id}/flight-recorder"
    return {
        # torch >= 2.9's names: the older ones (TORCH_NCCL_TRACE_BUFFER_SIZE, …) make torch print
        # a deprecation warning in every rank
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": f"{folder}/trace_rank_",
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": f"{folder}/pipe_rank_",
    }


def torch_env(plan: Plan, spec: RankSpec, *, master_port: int | None = None) -> dict[str, str]:
    """What torchrun sets for each rank (torch's env:// rendezvous, the elastic contract that
    Lightning and accelerate read), less what only torchrun's own agent uses
    (``TORCHELASTIC_USE_AGENT_STORE``: there is no agent store; ``TORCHELASTIC_SIGNALS_TO_HANDLE``)."""
    master = plan.ranks[0]
    env = {
        "MASTER_ADDR": master.address,
        "MASTER_PORT": str(master_port if master_port is not None else master.port),
        "RANK": str(spec.rank),
        "WORLD_SIZE": str(plan.world_size),
        "LOCAL_RANK": str(spec.local_rank),
        "LOCAL_WORLD_SIZE": str(spec.local_size),
        "GROUP_RANK": str(spec.host_index),
        "GROUP_WORLD_SIZE": str(len(plan.hosts)),
        "ROLE_NAME": "default",
        "ROLE_RANK": str(spec.rank),
        "ROLE_WORLD_SIZE": str(plan.world_size),
        # is_torchelastic_launched() is this being set: Lightning then checks devices × num_nodes
        "TORCHELASTIC_RUN_ID": plan.run_id,  # torchrun keeps it across restarts
        "TORCHELASTIC_RESTART_COUNT": str(plan.restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(plan.max_restarts),
        "TORCHELASTIC_ERROR_FILE": error_file(plan, spec),
    }
    return env


def shares_host_gpus(framework: str, devices: Sequence[str]) -> bool:
    """Do a host's ranks all see the job's GPUs of that host (as torchrun and horovodrun leave
    them), so that ``cuda:LOCAL_RANK`` is each rank's GPU? For torch and Horovod, yes. TF workers
    get one GPU each (a TF process takes every visible GPU's memory), and MIG instances are
    pinned per rank (a CUDA process sees only one)."""
    return framework in ("torch", "horovod") and not any(d.startswith("MIG-") for d in devices)


def visible_devices(framework: str, devices: Sequence[str], spec: RankSpec) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` for one rank, from its host's GPUs for the job (or None)."""
    if shares_host_gpus(framework, devices):
        return ",".join(devices[: spec.local_size]) or None
    return devices[spec.local_rank] if spec.local_rank < len(devices) else None


def framework_env(
    plan: Plan,
    spec: RankSpec,
    *,
    rendezvous: Rendezvous | None = None,
) -> dict[str, str]:
    """The framework part of a rank's env (``plan.framework`` picks which)."""
    if plan.framework == TF_AND_TORCH:  # --framework auto found no framework: both contracts
        return {"TF_CONFIG": json.dumps(tf_config(plan, spec), separators=(",", ":")), **torch_env(plan, spec)}
    if plan.framework in ("tf", "tf-ps"):
        return {"TF_CONFIG": json.dumps(tf_config(plan, spec), separators=(",", ":"))}
    if plan.framework == "horovod":
        if rendezvous is None:
            raise ValueError("horovod_env needs the rendezvous address")
        return horovod_env(plan, spec, rendezvous=rendezvous)
    if plan.framework == "torch":
        return torch_env(plan, spec)
    return {}


def worker_argv(script: str, args: Sequence[str], python: Sequence[str], *, module: bool = False,
                no_python: bool = False) -> tuple[str, ...]:
    """A ``.py`` script, a module (``-m``) and a ``python …`` command run with the host's python;
    ``.R`` and ``.sh`` scripts with Rscript and bash; anything else runs as given
    (``dlrun.command.program_argv``)."""
    return program_argv(script, args, python, module=module, no_python=no_python)


def worker_commands(
    plan: Plan,
    script: str,
    args: Sequence[str],
    *,
    python_for: Mapping[str, Sequence[str]],
    cwd_for: Mapping[str, str | None] | None = None,
    extra_env: Mapping[str, str] | None = None,
    rendezvous: Rendezvous | None = None,
    ifaces: Mapping[str, SocketIface] | None = None,
    server_argv: Sequence[str] | None = None,
    gpus_for: Mapping[str, Sequence[str]] | None = None,
    module: bool = False,
    no_python: bool = False,
) -> tuple[WorkerCommand, ...]:
    """Render every rank: env = inventory env (host over defaults) < extra < dlrun < framework.

    ``python_for`` maps host name → the python argv prefix on that host. With ``tf-ps``,
    ps and worker ranks run ``server_argv`` after that prefix (dlrun's tf_server); the chief
    and the evaluator run the script. ``gpus_for`` maps host name → the GPUs (or MIG instances)
    of that host for the job, one per local rank, from the preflight probe; each rank's
    ``CUDA_VISIBLE_DEVICES`` follows :func:`visible_devices`, and a value the user set is kept. ``ifaces``
    maps host name → its socket interface (``socket_env``); interface variables the user set
    (inventory env, ``--env``) are kept too. ``module``: ``script`` is a module, run with
    ``python -m``; ``no_python``: the command runs exactly as given. An R command gets
    ``RETICULATE_PYTHON``, the host's python (when that is one path), unless it is set.
    """
    commands = []
    for spec in plan.ranks:
        # live logs, and faulthandler's stacks of every thread on a segfault (a CUDA extension, a data
        # loader's C code) and on --hang-timeout's SIGABRT; env tables may say otherwise
        env: dict[str, str] = {"PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
        env.update(spec.host.env)
        env.update(extra_env or {})
        env.update(dlrun_env(plan, spec))
        env.update(framework_env(plan, spec, rendezvous=rendezvous))
        for name, value in socket_env(plan.framework, (ifaces or {}).get(spec.host.name)).items():
            env.setdefault(name, value)
        visible = visible_devices(plan.framework, (gpus_for or {}).get(spec.host.name, ()), spec)
        if visible is not None and "CUDA_VISIBLE_DEVICES" not in env:
            env["CUDA_VISIBLE_DEVICES"] = visible
        if plan.framework in ("torch", TF_AND_TORCH):  # torchrun's defaults, where the job sets nothing
            if spec.local_size > 1:
                env.setdefault("OMP_NUM_THREADS", "1")
            env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # an NCCL error fails, not hangs
            for name, value in flight_recorder_env(plan).items():
                env.setdefault(name, value)
        python = python_for[spec.host.name]
        if len(python) == 1 and python[0].startswith("/") and runs_r(script, args, no_python=no_python):
            env.setdefault("RETICULATE_PYTHON", python[0])  # reticulate loads the inventory's python
        argv = worker_argv(script, args, python, module=module, no_python=no_python)
        if plan.framework == "tf-ps" and spec.task_type in ("ps", "worker") and server_argv is not None:
            argv = (*python_for[spec.host.name], *server_argv)
        commands.append(
            WorkerCommand(
                spec=spec,
                argv=argv,
                env=env,
                cwd=(cwd_for or {}).get(spec.host.name),
            )
        )
    return tuple(commands)


def mask_env(env: Mapping[str, str]) -> dict[str, str]:
    """Hide the values of variables whose names say they hold a secret (``SECRET_NAME``), and
    the password of a URL in any other value (``DATABASE_URL=postgres://u:****@db/x``)."""
    return {name: (MASK if SECRET_NAME.search(name) else RENDEZVOUS_KEY.sub(rf"\1{MASK}", value)
                   if name == "HOROVOD_GLOO_RENDEZVOUS_ADDR" else mask_text(value)) for name, value in env.items()}


def mask_text(value: str) -> str:
    """The password of every URL in ``value`` masked (``postgres://u:****@db``)."""
    return URL_PASSWORD.sub(rf"\1:{MASK}@", value)


def mask_argv(argv: Sequence[str]) -> list[str]:
    """The script's arguments as dlrun shows or stores them: URL passwords masked, and the value
    of an argument named for a secret (``--password X``, ``--api-key=X``, ``DB_PASS=X``; names
    as ``SECRET_NAME``). It may hide a value that is no secret (``--max-tokens 8``): masking
    too much in a printout is the cheaper mistake."""
    shown: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next and not arg.startswith("-"):
            shown.append(MASK)
            hide_next = False
            continue
        hide_next = False
        assignment = ASSIGNMENT.fullmatch(arg)
        if assignment and SECRET_NAME.search(assignment.group(1)):
            shown.append(f"{assignment.group(1)}={MASK}")
        elif SECRET_OPTION.fullmatch(arg) and SECRET_NAME.search(arg):
            shown.append(arg)
            hide_next = True
        else:
            shown.append(mask_text(arg))
    return shown


def printable(text: str) -> str:
    """``text`` with control characters escaped (``\\x1b``, ``\\n``), for anything dlrun prints
    that came from a user or a host: a name or argument cannot move the cursor, recolor the
    terminal or forge a line of dlrun's own."""
    return CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


def plan_to_json(commands: Sequence[WorkerCommand]) -> dict[str, Any]:
    """The ``--dry-run --json`` document (secrets masked)."""
    return {
        "world_size": len(commands),
        "job_id": commands[0].env.get("DLRUN_JOB_ID") if commands else None,
        "ranks": [
            {
                "rank": c.spec.rank,
                "host": c.spec.host.name,
                "address": c.spec.address,
                "local_rank": c.spec.local_rank,
                "local_size": c.spec.local_size,
                "cross_rank": c.spec.cross_rank,
                "cross_size": c.spec.cross_size,
                "task": {"type": c.spec.task_type, "index": c.spec.task_index},
                "port": c.spec.port,
                "argv": mask_argv(c.argv),
                "cwd": c.cwd,
                "env": mask_env(c.env),
            }
            for c in commands
        ],
    }
