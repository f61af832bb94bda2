"""The Slurm allocation as the inventory: nodelist and tasks-per-node parsers (checked against
the real ``scontrol show hostnames``), slots, heterogeneous jobs, errors."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from dlrun.allocation import allocation_inventory, expand_nodelist, in_allocation, parse_tasks_per_node
from dlrun.errors import InventoryError, UsageError

from support.slurm_cluster import require_slurm

NODELISTS = [
    "host0",
    "host[0-1]",
    "h[01-03,07],gpu-a[1-2]",
    "h[1-10]",
    "h[08-10]",
    "h[1-010]",
    "h[001-10]",
    "h[01-3]",
    "h[0-1]",
    "h[7,1-2]",
    "a,b[3-4],c",
    "r[1-2]n[01-02]",
    "a[1-2]-b[3-4]-c[5,7]",
    "a[1-2]b[3-4]c[5-6]d[7-8]",
    "node-001,node-[003-004],login1",
    "x.y[1-2]",
]


@pytest.fixture(scope="module")
def scontrol_conf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A minimal slurm.conf: ``scontrol show hostnames`` needs one but no running controller."""
    require_slurm()
    conf = tmp_path_factory.mktemp("scontrol") / "slurm.conf"
    conf.write_text("ClusterName=x\nSlurmctldHost=localhost(127.0.0.1)\nAuthType=auth/none\n"
                    "CredType=cred/none\nNodeName=n1 NodeAddr=127.0.0.1\nPartitionName=p Nodes=ALL\n")
    return conf


def scontrol_hostnames(conf: Path, nodelist: str) -> list[str]:
    found = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                           env={"SLURM_CONF": str(conf), "PATH": "/usr/bin:/bin:/usr/sbin"}, timeout=30, check=True)
    return found.stdout.split()


@pytest.mark.parametrize("nodelist", NODELISTS)
def test_nodelists_expand_as_scontrol_expands_them(scontrol_conf: Path, nodelist: str) -> None:
    assert expand_nodelist(nodelist) == scontrol_hostnames(scontrol_conf, nodelist)


def test_odd_nodelists_expand_as_documented() -> None:
    assert expand_nodelist("h[01-03,07],gpu-a[1-2]") == ["h01", "h02", "h03", "h07", "gpu-a1", "gpu-a2"]
    assert expand_nodelist("h[08-10]") == ["h08", "h09", "h10"]
    assert expand_nodelist("h[1-010]")[-2:] == ["h9", "h10"]  # the lower bound sets the width
    assert expand_nodelist("r[1-2]n[01-02]") == ["r1n01", "r1n02", "r2n01", "r2n02"]
    assert expand_nodelist("a[1-2]b[3-4]c[5-6]")[:4] == ["a1b3c5", "a1b3c6", "a2b3c5", "a2b3c6"]


@pytest.mark.parametrize("bad", ["h[3-1]", "h[1-2", "h[1-2]x", "h[a-b]", "h[1-2],,x", "h[]"])
def test_malformed_nodelists_are_inventory_errors(bad: str) -> None:
    with pytest.raises(InventoryError, match=r"nodelist|range"):
        expand_nodelist(bad)


def test_a_nodelist_scontrol_refuses_is_refused_here_too(scontrol_conf: Path) -> None:
    found = subprocess.run(["scontrol", "show", "hostnames", "h[1-2]x"], capture_output=True, text=True,
                           env={"SLURM_CONF": str(scontrol_conf), "PATH": "/usr/bin:/bin"}, timeout=30)
    assert "Invalid hostlist" in found.stdout + found.stderr
    with pytest.raises(InventoryError):
        expand_nodelist("h[1-2]x")


@pytest.mark.parametrize(("text", "counts"), [
    ("2(x3),1", [2, 2, 2, 1]),
    ("4", [4]),
    ("2(x2)", [2, 2]),
    ("1,2,3", [1, 2, 3]),
    ("8(x2),4(x1),2", [8, 8, 4, 2]),
])
def test_tasks_per_node(text: str, counts: list[int]) -> None:
    assert parse_tasks_per_node(text) == counts


@pytest.mark.parametrize("bad", ["", "2(x)", "x", "2(3)", "2(x3", "-1"])
def test_malformed_tasks_per_node(bad: str) -> None:
    with pytest.raises(InventoryError, match="SLURM_TASKS_PER_NODE"):
        parse_tasks_per_node(bad)


# --------------------------------------------------------------------------- the inventory

SALLOC_N2_TASKS2 = {  # what `salloc -N2 --ntasks-per-node=2` sets (the real one, trimmed)
    "SLURM_JOB_ID": "2", "SLURM_JOBID": "2", "SLURM_JOB_NODELIST": "host[0-1]", "SLURM_NODELIST": "host[0-1]",
    "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "4", "SLURM_NPROCS": "4", "SLURM_NTASKS_PER_NODE": "2",
    "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_CPUS_PER_NODE": "2(x2)",
}


def test_outside_an_allocation_there_is_none() -> None:
    assert not in_allocation({"PATH": "/bin"})
    with pytest.raises(UsageError, match="not inside a Slurm allocation") as caught:
        allocation_inventory({"PATH": "/bin"})
    assert "salloc" in str(caught.value.hint)


def test_tasks_per_node_gives_the_slots() -> None:
    found = allocation_inventory(SALLOC_N2_TASKS2)
    assert [(h.name, h.address, h.slots) for h in found.inventory.hosts] == [("host0", "host0", 2),
                                                                              ("host1", "host1", 2)]
    assert found.job_id == "2"
    assert found.describe() == "hosts from Slurm job 2: host[0-1] (2 nodes, slots 2,2 from SLURM_TASKS_PER_NODE)"


def test_uneven_tasks_per_node() -> None:
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "g[1-4]", "SLURM_NTASKS": "7",
           "SLURM_TASKS_PER_NODE": "2(x3),1"}
    assert [h.slots for h in allocation_inventory(env).inventory.hosts] == [2, 2, 2, 1]


def test_without_tasks_asked_slots_come_from_gpus_per_node_else_the_preflight() -> None:
    # salloc -N2 alone still sets SLURM_TASKS_PER_NODE=1(x2): it says nothing about the ranks wanted
    bare = {"SLURM_JOB_ID": "3", "SLURM_JOB_NODELIST": "host[0-1]", "SLURM_TASKS_PER_NODE": "1(x2)"}
    found = allocation_inventory(bare)
    assert [h.slots for h in found.inventory.hosts] == [None, None]
    assert "slots from each node's GPUs" in found.describe()
    gpus = allocation_inventory({**bare, "SLURM_GPUS_PER_NODE": "a100:4"})
    assert [h.slots for h in gpus.inventory.hosts] == [4, 4]
    assert gpus.slots_from == "SLURM_GPUS_PER_NODE"


def test_tasks_per_node_that_does_not_fit_the_nodes_is_an_error() -> None:
    with pytest.raises(InventoryError, match="3 counts for the 2 nodes"):
        allocation_inventory({**SALLOC_N2_TASKS2, "SLURM_TASKS_PER_NODE": "2(x3)"})


def test_heterogeneous_job_components_follow_each_other() -> None:
    # the real `salloc -N1 --ntasks-per-node=2 : -N2` (trimmed): no SLURM_JOB_NODELIST at all
    env = {"SLURM_JOB_ID": "1", "SLURM_HET_SIZE": "2",
           "SLURM_JOB_NODELIST_HET_GROUP_0": "host0", "SLURM_JOB_NODELIST_HET_GROUP_1": "host[1-2]",
           "SLURM_NTASKS_HET_GROUP_0": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NTASKS_PER_NODE_HET_GROUP_0": "2",
           "SLURM_TASKS_PER_NODE_HET_GROUP_0": "2", "SLURM_TASKS_PER_NODE_HET_GROUP_1": "1(x2)"}
    found = allocation_inventory(env)
    assert [(h.name, h.slots) for h in found.inventory.hosts] == [("host0", 2), ("host1", None), ("host2", None)]
    assert found.nodelist == "host0 + host[1-2]"


def test_a_node_name_that_could_inject_is_refused() -> None:
    with pytest.raises(InventoryError, match="invalid host name"):
        allocation_inventory({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "-oProxyCommand=x"})
