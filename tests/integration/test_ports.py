"""Ports on shared hosts: without ``--base-port`` dlrun picks ports free on every host that
listens (two jobs at once do not collide); with it, a taken port stops the launch before
anything starts, naming the host and the port."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from dlrun.errors import PlanError
from dlrun.inventory import Host, Inventory
from dlrun.plan import choose_ports, listening_ranks, make_plan

from support.cli import REPO, dlrun_argv, run_dlrun
from support.ssh_jobs import hosts_toml, shared_script
from support.sshd_cluster import SshdCluster

TORCH_JOB = """
import os, time
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
time.sleep(3)  # the other job starts meanwhile
print(f"rank {dist.get_rank()} total {total.item():.0f} port {os.environ['MASTER_PORT']}", flush=True)
dist.destroy_process_group()
"""


def test_chosen_ports_are_free_on_each_listening_rank_host_and_distinct() -> None:
    hosts = tuple(Host(name=f"h{i}", address=f"10.0.0.{i + 1}", slots=2) for i in range(2))
    plan = make_plan(Inventory(hosts=hosts), job_id="j", framework="tf")
    free = {"h0": (30001, 30002, 30005), "h1": (30002, 30003, 30004)}
    assert choose_ports("tf", plan.ranks, free) == {0: 30001, 1: 30002, 2: 30003, 3: 30004}
    assert choose_ports("torch", plan.ranks, free) == {0: 30001}  # only the store listens
    assert listening_ranks("horovod", plan.ranks) == () and listening_ranks("none", plan.ranks) == ()
    with pytest.raises(PlanError, match="no free port for rank 1 on host h0"):
        choose_ports("tf", plan.ranks, {"h0": (30001,), "h1": (30002, 30003)})


@pytest.mark.slow
@pytest.mark.ssh
def test_two_torch_jobs_at_once_on_the_same_hosts_both_succeed(cluster: SshdCluster, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    script = shared_script(cluster, "two_jobs.py", TORCH_JOB)
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 2)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    jobs = [subprocess.Popen(dlrun_argv("launch", "--plain", "--no-push", "--hosts", str(hosts), "--ssh-config",
                                        str(cluster.ssh_config), "--log-dir", str(tmp_path / f"logs{i}"), str(script)),
                             cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
            for i in range(2)]
    outputs = [job.communicate(timeout=300)[0] for job in jobs]
    for job, out in zip(jobs, outputs, strict=True):
        assert job.returncode == 0, out[-3000:]
        assert "rank 1 total 3" in out
    ports = [{line.rsplit("port ", 1)[1] for line in out.splitlines() if " total 3 port " in line} for out in outputs]
    assert all(len(p) == 1 for p in ports) and ports[0] != ports[1]


@pytest.mark.ssh
def test_a_taken_base_port_stops_the_launch_naming_host_and_port(cluster: SshdCluster, tmp_path: Path) -> None:
    script = shared_script(cluster, "never_starts.py", "open('started', 'w').close()\n")
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 2)
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        port = held.getsockname()[1]
        out = run_dlrun("launch", "--plain", "--no-push", "--framework", "torch", "--base-port", str(port), "--hosts",
                        str(hosts), "--ssh-config", str(cluster.ssh_config), str(script), cwd=tmp_path, timeout=120)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"host0: port {port} (rank 0) is in use" in out.stderr
    assert "nothing was started" in out.stderr
    assert not any((h.workdir / "started").exists() for h in cluster.hosts[:2])
    assert "starting" not in out.stdout
