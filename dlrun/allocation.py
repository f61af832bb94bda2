"""A Slurm allocation as the inventory: its nodes and slots, read from the job's environment.

Owns the parsers of Slurm's compressed lists (``SLURM_JOB_NODELIST``: ``h[01-03,07],gpu-a[1-2]``,
expanded as ``scontrol show hostnames`` does; ``SLURM_TASKS_PER_NODE``: ``2(x3),1``) and
``allocation_inventory``, which turns an environment mapping into an ``Inventory``. Pure: the
caller passes ``os.environ``; nothing here runs Slurm. How slots are chosen is in
``docs/slurm.md``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import product

from dlrun.errors import InventoryError, UsageError
from dlrun.inventory import MAX_HOSTS, Host, Inventory, _check_address, _check_inventory

#: ``--hosts`` value that asks for the allocation explicitly.
SLURM_HOSTS = "slurm"
SOURCE = "the Slurm allocation"
_DIGITS = re.compile(r"[0-9]+")
_REPEAT = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?")
_GPU_COUNT = re.compile(r"(?:[^:,]+:)?([0-9]+)")  # "4" or "a100:4" (--gpus-per-node)


@dataclass(frozen=True)
class Allocation:
    """The allocation dlrun read: its job id, the inventory, and where the slots came from."""

    job_id: str
    nodelist: str
    inventory: Inventory
    slots_from: str  # "SLURM_TASKS_PER_NODE", "SLURM_GPUS_PER_NODE" or "" (the preflight's GPUs, else 1)
    het_groups: Mapping[str, int] = field(default_factory=dict)  # a heterogeneous job's node -> component

    def describe(self) -> str:
        """The one line dlrun prints when it uses the allocation."""
        hosts = self.inventory.hosts
        slots = ",".join(str(h.slots) if h.slots is not None else "?" for h in hosts)
        where = (f"slots {slots} from {self.slots_from}" if self.slots_from
                 else "slots from each node's GPUs (1 without)")
        return (f"hosts from Slurm job {self.job_id}: {self.nodelist} ({len(hosts)} node"
                f"{'s' if len(hosts) != 1 else ''}, {where})")


def in_allocation(environ: Mapping[str, str]) -> bool:
    """Whether dlrun runs inside a Slurm allocation (``salloc``, ``sbatch``, ``srun``)."""
    return bool(environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID"))


# --------------------------------------------------------------------------- Slurm's lists


def expand_nodelist(text: str) -> list[str]:
    """``h[01-03,07],gpu-a[1-2]`` → every node name, in ``scontrol show hostnames`` order.

    Items are split on commas outside brackets. A range keeps the width of its lower bound
    (``[08-10]``: ``08 09 10``; ``[1-010]``: ``1 … 10``). With several brackets in one item the
    last varies fastest, then the first, second …, as Slurm's hostlist does
    (``a[1-2]b[3-4]c[5-6]``: ``a1b3c5 a1b3c6 a2b3c5 …``). Text after the last bracket is an
    error, as in Slurm.
    """
    names: list[str] = []
    for item in _split_items(text):
        if not item:
            raise InventoryError(f"empty entry in nodelist {text!r}", source=SOURCE, key="SLURM_JOB_NODELIST")
        names.extend(_expand_item(item, text))
        if len(names) > MAX_HOSTS:
            raise InventoryError(f"nodelist {text!r} names more than {MAX_HOSTS} nodes", source=SOURCE,
                                 key="SLURM_JOB_NODELIST")
    return names


def _split_items(text: str) -> list[str]:
    items, current, depth = [], "", 0
    for char in text.strip():
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    items.append(current)
    return items


def _expand_item(item: str, whole: str) -> list[str]:
    parts = re.split(r"\[([^\[\]]*)\]", item)  # literal, range, literal, range, …, literal
    literals, ranges = parts[0::2], parts[1::2]
    if any("[" in p or "]" in p for p in literals) or (ranges and literals[-1]):
        raise InventoryError(f"invalid nodelist {whole!r} at {item!r}", source=SOURCE, key="SLURM_JOB_NODELIST")
    if not ranges:
        return [item]
    values = [_expand_range(r, whole) for r in ranges]
    # Slurm's order: the last bracket fastest; the others with the first fastest, the one
    # before the last slowest
    order = [*reversed(range(len(values) - 1)), len(values) - 1]
    names = []
    for combo in product(*(values[i] for i in order)):
        chosen = dict(zip(order, combo, strict=True))
        names.append("".join(literals[i] + chosen[i] for i in range(len(values))))
    return names


def _expand_range(text: str, whole: str) -> list[str]:
    out: list[str] = []
    for part in text.split(","):
        lo, dash, hi = part.partition("-")
        if not _DIGITS.fullmatch(lo) or (dash and not _DIGITS.fullmatch(hi)):
            raise InventoryError(f"bad range {part!r} in nodelist {whole!r}", source=SOURCE, key="SLURM_JOB_NODELIST")
        first, last = int(lo), int(hi) if dash else int(lo)
        if first > last:
            raise InventoryError(f"range {part!r} runs backwards in nodelist {whole!r}", source=SOURCE,
                                 key="SLURM_JOB_NODELIST")
        if last - first >= MAX_HOSTS:
            raise InventoryError(f"range {part!r} names more than {MAX_HOSTS} nodes", source=SOURCE,
                                 key="SLURM_JOB_NODELIST")
        out.extend(str(n).zfill(len(lo)) for n in range(first, last + 1))
    return out


def parse_tasks_per_node(text: str, *, key: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """``2(x3),1`` → ``[2, 2, 2, 1]`` (also ``SLURM_JOB_CPUS_PER_NODE``'s form)."""
    counts: list[int] = []
    for part in text.strip().split(","):
        match = _REPEAT.fullmatch(part.strip())
        if match is None:
            raise InventoryError(f"cannot read {text!r} (expected e.g. '2(x3),1')", source=SOURCE, key=key)
        repeat = int(match[2]) if match[2] else 1
        if repeat > MAX_HOSTS:
            raise InventoryError(f"{text!r} names more than {MAX_HOSTS} nodes", source=SOURCE, key=key)
        counts.extend([int(match[1])] * repeat)
    return counts


# --------------------------------------------------------------------------- the inventory


def _components(environ: Mapping[str, str]) -> list[str]:
    """The suffixes of a heterogeneous job's components (``_HET_GROUP_0`` …), or ``[""]``."""
    size = environ.get("SLURM_HET_SIZE", "")
    if _DIGITS.fullmatch(size) and int(size) > 1 and "SLURM_JOB_NODELIST_HET_GROUP_0" in environ:
        return [f"_HET_GROUP_{i}" for i in range(int(size))]
    return [""]


def _tasks_given(environ: Mapping[str, str], suffix: str) -> bool:
    """``-n``/``--ntasks-per-node`` was given: Slurm sets SLURM_TASKS_PER_NODE always (1 per node
    without them), so only these say that its counts were asked for."""
    return any(environ.get(name + suffix) for name in ("SLURM_NTASKS", "SLURM_NPROCS", "SLURM_NTASKS_PER_NODE"))


def allocation_inventory(environ: Mapping[str, str]) -> Allocation:
    """The allocation's nodes as hosts (named as Slurm names them), with slots from the tasks
    asked for per node, else from ``--gpus-per-node``, else unset (the preflight's GPU count,
    else 1). A heterogeneous job's components follow each other in order."""
    if not in_allocation(environ):
        raise UsageError(
            "--hosts slurm: not inside a Slurm allocation (SLURM_JOB_ID is not set)",
            hint="run it inside one: salloc -N2 --ntasks-per-node=4 dlrun launch train.py, or"
                 " 'dlrun launch' in an sbatch script; or pass --hosts hosts.toml")
    job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID", "")
    hosts: list[Host] = []
    lists: list[str] = []
    sources: set[str] = set()
    groups: dict[str, int] = {}
    components = _components(environ)
    for group, suffix in enumerate(components):
        nodelist = environ.get("SLURM_JOB_NODELIST" + suffix) or environ.get("SLURM_NODELIST" + suffix)
        if not nodelist:
            raise InventoryError(f"SLURM_JOB_ID is {job_id} but SLURM_JOB_NODELIST{suffix} is not set",
                                 source=SOURCE, key="SLURM_JOB_NODELIST" + suffix)
        names = expand_nodelist(nodelist)
        lists.append(nodelist)
        slots: list[int | None] = [None] * len(names)
        tasks = environ.get("SLURM_TASKS_PER_NODE" + suffix)
        gpus = _GPU_COUNT.fullmatch(environ.get("SLURM_GPUS_PER_NODE" + suffix, "") or "-")
        if tasks and _tasks_given(environ, suffix):
            counts = parse_tasks_per_node(tasks, key="SLURM_TASKS_PER_NODE" + suffix)
            if len(counts) != len(names):
                raise InventoryError(f"{tasks!r} gives {len(counts)} counts for the {len(names)} nodes of"
                                     f" {nodelist!r}", source=SOURCE, key="SLURM_TASKS_PER_NODE" + suffix)
            slots = [c or None for c in counts]
            sources.add("SLURM_TASKS_PER_NODE")
        elif gpus is not None and int(gpus[1]) > 0:
            slots = [int(gpus[1])] * len(names)
            sources.add("SLURM_GPUS_PER_NODE")
        for name, count in zip(names, slots, strict=True):
            _check_address(name, SOURCE, None, key="SLURM_JOB_NODELIST" + suffix)
            if suffix:
                groups.setdefault(name, group)
            index = next((i for i, h in enumerate(hosts) if h.name == name), None)
            if index is not None:  # one node in two components: its slots add up
                before = hosts[index].slots
                hosts[index] = Host(address=name, name=name,
                                    slots=None if before is None or count is None else before + count)
                continue
            hosts.append(Host(address=name, name=name, slots=count))
    inventory = Inventory(hosts=tuple(hosts), source=SOURCE)
    _check_inventory(inventory, lambda i, k: None)
    return Allocation(job_id=job_id, nodelist=" + ".join(lists), inventory=inventory,
                      slots_from=" and ".join(sorted(sources)), het_groups=groups)
