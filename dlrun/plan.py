"""The rank plan: which process runs where, with which rank numbers, roles and ports.

Pure: ``make_plan`` maps an ``Inventory`` (plus the network address each host is reached at)
to a ``Plan`` of ``RankSpec`` records. Ranks are assigned host by host in inventory order,
exactly as Horovod does it (``horovod/runner/common/util/hosts.py``):

- ``local_rank`` counts within a host, ``local_size`` is the host's process count;
- ``cross_rank`` is the host's position among the hosts that have that local rank, and
  ``cross_size`` is their number (so hosts with different slot counts work).

Ports: one per rank, ``base_port + local_rank``. Hosts on a loopback address all share this
machine, so there every rank gets ``base_port + rank`` instead, to avoid collisions. Where
dlrun picked free ports on the hosts (``choose_ports``: only the ranks that listen,
``listening_ranks``), ``ports`` gives them per rank.

Roles (ParameterServerStrategy): every slot of a host with a role is a task of that type,
indexed in rank order among tasks of its type. Without roles every rank is a ``worker``
and worker 0 is the chief; with a ``chief`` host, that host's rank is the chief.
"""

from __future__ import annotations

import ast
import ipaddress
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dlrun.errors import PlanError
from dlrun.inventory import Host, Inventory

FRAMEWORKS = ("tf", "tf-ps", "horovod", "torch", "none")
#: ``--framework auto`` (the default): the script's imports choose (``detect_framework``).
AUTO = "auto"
#: What ``--framework auto`` plans when a script's imports name no framework: both the TF and
#: the torch contracts, which do not collide (TF_CONFIG beside MASTER_ADDR, RANK …).
TF_AND_TORCH = "tf+torch"
#: Imports that name a framework (the top-level package), checked in this order.
FRAMEWORK_IMPORTS: tuple[tuple[str, frozenset[str]], ...] = (
    ("horovod", frozenset({"horovod"})),
    ("torch", frozenset({"torch", "lightning", "pytorch_lightning", "accelerate", "transformers"})),
    ("tf", frozenset({"tensorflow", "keras", "tf_keras"})),
)


@dataclass(frozen=True)
class Detected:
    """The framework ``--framework auto`` chose, and why (``import lightning in train.py``)."""

    framework: str
    reason: str
    imports: frozenset[str] = frozenset()  # the frameworks whose imports were found ("tf", "torch", …)


#: R code that loads a Python framework: ``library(tensorflow)``, ``require(keras)`` (R's
#: packages over TensorFlow), or reticulate's ``import("tensorflow")``.
_R_LIBRARY = re.compile(r"""\b(?:library|require|requireNamespace)\(\s*["']?([A-Za-z][\w.]*)["']?""")
_R_IMPORT = re.compile(r"""\bimport\(\s*["']([A-Za-z_][\w.]*)["']""")
#: R packages that run TensorFlow (through reticulate), as the Python module they load.
_R_PACKAGES = {"tensorflow": "tensorflow", "keras": "keras", "keras3": "keras", "tfdatasets": "tensorflow"}


def detect_framework(script: str, source: str | None) -> Detected:
    """Read a script's imports (``ast`` for Python, R's ``library()`` and reticulate's
    ``import()`` for a ``.R`` file; never running it) for the rank contract it needs.

    Horovod wins over torch and TF (``horovod.torch`` scripts import torch too); a script that
    imports both torch and TF, names none, is not Python or R, or cannot be parsed gets both
    contracts (:data:`TF_AND_TORCH`).
    """
    name = script.rsplit("/", 1)[-1]
    if source is None:
        return Detected(TF_AND_TORCH, f"{name} is not a Python script: both the tf and the torch contracts")
    imported: list[tuple[str, str]] = []  # (top-level Python module, as the source says it)
    if name.endswith((".R", ".r")):
        code = "\n".join(line.split("#", 1)[0] for line in source.splitlines())
        imported += [(_R_PACKAGES[m], f"library({m})") for m in _R_LIBRARY.findall(code) if m in _R_PACKAGES]
        imported += [(m.split(".")[0], f'import("{m}")') for m in _R_IMPORT.findall(code)]
    else:
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError) as exc:
            return Detected(TF_AND_TORCH,
                            f"could not read the imports of {name} ({type(exc).__name__}): both contracts")
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported += [(alias.name.split(".")[0],) * 2 for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.append((node.module.split(".")[0],) * 2)
        imported = [(module, f"import {said}") for module, said in imported]
    found = {framework: next(said for m, said in imported if m in modules)
             for framework, modules in FRAMEWORK_IMPORTS if any(m in modules for m, _ in imported)}
    imports = frozenset(found)
    if "horovod" in found:
        return Detected("horovod", f"{found['horovod']} in {name}", imports)
    if "torch" in found and "tf" in found:
        tf = found["tf"].removeprefix("import ") if found["torch"].startswith("import ") else found["tf"]
        both = f"{found['torch']} and {tf}"
        return Detected(TF_AND_TORCH, f"{both} in {name}: both contracts", imports)
    for framework in ("torch", "tf"):
        if framework in found:
            return Detected(framework, f"{found[framework]} in {name}", imports)
    return Detected(TF_AND_TORCH, f"no framework imported in {name}: both the tf and the torch contracts")


def is_torch(framework: str) -> bool:
    """Does the job get torch's contract (``torch``, or both contracts)?"""
    return framework in ("torch", TF_AND_TORCH)


def is_tf(framework: str) -> bool:
    """Does the job get a TF_CONFIG (``tf``, ``tf-ps``, or both contracts)?"""
    return framework in ("tf", "tf-ps", TF_AND_TORCH)

DEFAULT_BASE_PORT = 23456
DEFAULT_HOST_TIMEOUT = 30.0  # seconds of silence after which a host counts as lost


def heartbeat_interval(host_timeout: float) -> float:
    """How often a quiet host is pinged: a few pings fit in the timeout, never more than 1 per 5 s."""
    return max(0.1, min(5.0, host_timeout / 4))


@dataclass(frozen=True)
class RankSpec:
    """One process of the job."""

    rank: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    host_index: int  # position of the host among the hosts the job uses
    host: Host
    address: str  # where the other ranks reach this one
    port: int
    task_type: str  # chief | worker | ps | evaluator
    task_index: int

    @property
    def endpoint(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.port}"


@dataclass(frozen=True)
class Plan:
    """Every rank of a job, in rank order, and the job-wide facts renderers need."""

    job_id: str
    framework: str
    ranks: tuple[RankSpec, ...]
    uses_roles: bool
    restart_count: int = 0  # which attempt this is (0: the first)
    max_restarts: int = 0
    run_id: str = ""  # the job's id across its attempts (torchrun's run id); make_plan: job_id if not given

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def hosts(self) -> tuple[Host, ...]:
        seen: dict[str, Host] = {}
        for spec in self.ranks:
            seen.setdefault(spec.host.name, spec.host)
        return tuple(seen.values())

    @property
    def chief(self) -> RankSpec:
        for spec in self.ranks:
            if spec.task_type == "chief":
                return spec
        return self.ranks[0]


def is_loopback(address: str) -> bool:
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def listening_ranks(framework: str, ranks: Sequence[RankSpec]) -> tuple[RankSpec, ...]:
    """The ranks that listen on their ``port``: every rank of TF_CONFIG's cluster (each runs a
    server there) and, for torch, rank 0 (its ``MASTER_PORT`` is the store's). Horovod's ranks
    meet at dlrun's rendezvous server, ``none``'s at nothing: no port."""
    if is_tf(framework):
        return tuple(r for r in ranks if r.task_type != "evaluator")
    if is_torch(framework):
        return tuple(ranks[:1])
    return ()


def choose_ports(framework: str, ranks: Sequence[RankSpec], free: Mapping[str, Sequence[int]]) -> dict[int, int]:
    """rank → port for each listening rank: the first port its host reported free that no
    other rank of the job has (hosts may share a machine: 127.0.0.x, one port space). A host
    that did not answer keeps the port rule (its agent's failure is reported when the job starts)."""
    taken: set[int] = set()
    chosen: dict[int, int] = {}
    for spec in listening_ranks(framework, ranks):
        if spec.host.name not in free:
            continue
        port = next((p for p in free.get(spec.host.name, ()) if p not in taken), None)
        if port is None:
            raise PlanError(f"no free port for rank {spec.rank} on host {spec.host.name} among the"
                            f" {len(free.get(spec.host.name, ()))} free ones dlrun found there",
                            hint="pass --base-port PORT with a range that is free on every host")
        taken.add(port)
        chosen[spec.rank] = port
    return chosen


def make_plan(
    inventory: Inventory,
    *,
    job_id: str,
    np: int | None = None,
    base_port: int = DEFAULT_BASE_PORT,
    framework: str = "tf",
    addresses: Mapping[str, str] | None = None,
    ports: Mapping[int, int] | None = None,
    restart_count: int = 0,
    max_restarts: int = 0,
    run_id: str = "",
) -> Plan:
    """Assign ranks host by host. ``addresses`` maps host name → address the ranks use;
    ``ports`` (rank → port) overrides the port rule where the ranks picked their own (Spark);
    ``restart_count``: which attempt of the job this plan is (``--max-restarts``); ``run_id``: the
    job's id, the same for every attempt (``job_id`` is the attempt's)."""
    if framework not in (*FRAMEWORKS, TF_AND_TORCH):
        raise PlanError(f"unknown framework {framework!r} (expected one of {', '.join(FRAMEWORKS)})")
    total = inventory.total_slots
    if np is None:
        np = total
    if np < 1:
        raise PlanError(f"--np must be at least 1, not {np}")
    if np > total:
        raise PlanError(
            f"--np {np} needs {np} slots but the inventory ({inventory.source}) has {total}",
            hint="add hosts or slots, or lower --np",
        )
    addresses = addresses or {}
    # slots actually used per host: fill host by host
    used: list[tuple[Host, int]] = []
    left = np
    for host in inventory.hosts:
        if left == 0:
            break
        take = min(host.effective_slots, left)
        used.append((host, take))
        left -= take

    uses_roles = framework == "tf-ps" or any(h.role for h, _ in used)
    kinds = {h.role or "worker" for h, _ in used}
    if framework == "tf-ps":
        if not {"chief", "ps", "worker"} <= kinds:
            raise PlanError(
                "--framework tf-ps needs a host with role = 'chief', one or more with role = 'ps' and one or"
                f" more workers (roles used: {', '.join(sorted(kinds))})",
                hint="set role in hosts.toml (a host without one is a worker); see hosts.example.toml",
            )
    elif framework == "tf" and "ps" in kinds:  # MultiWorkerMirroredStrategy has no ps job
        raise PlanError("role = 'ps' needs --framework tf-ps, not tf",
                        hint="parameter servers belong to ParameterServerStrategy; drop the role otherwise")
    ranks: list[RankSpec] = []
    rank = 0
    type_counts: dict[str, int] = {}
    for host_index, (host, count) in enumerate(used):
        address = addresses.get(host.name, host.address)
        if host.is_local and address in ("localhost", "::1"):
            address = "127.0.0.1"
        task_type = host.role or "worker"
        for local_rank in range(count):
            hosts_with = [i for i, (_, c) in enumerate(used) if c > local_rank]
            port = base_port + (rank if is_loopback(address) else local_rank)
            if ports is not None and rank in ports:
                port = ports[rank]
            if port > 65535:
                raise PlanError(f"port {port} for rank {rank} is out of range; lower --base-port")
            index = type_counts.get(task_type, 0)
            type_counts[task_type] = index + 1
            ranks.append(
                RankSpec(
                    rank=rank,
                    local_rank=local_rank,
                    local_size=count,
                    cross_rank=hosts_with.index(host_index),
                    cross_size=len(hosts_with),
                    host_index=host_index,
                    host=host,
                    address=address,
                    port=port,
                    task_type=task_type,
                    task_index=index,
                )
            )
            rank += 1
    return Plan(job_id=job_id, framework=framework, ranks=tuple(ranks), uses_roles=uses_roles,
                restart_count=restart_count, max_restarts=max_restarts, run_id=run_id or job_id)
