"""``dlrun topo --bench`` over three real sshd hosts in a private network namespace: a host held
to 30 Mbit/s (tc htb) is named, and only it; the same hosts without the limit pass; a host held
to 5% of a CPU (a cgroup around its sshd) is named by the compute check."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from support.cli import run_dlrun
from support.ssh_jobs import hosts_toml
from support.sshd_cluster import SshdCluster

pytestmark = pytest.mark.slow  # 13-38 s each: sshd hosts in a network namespace, measured

HELPER = Path(__file__).resolve().parents[1] / "support" / "bench_netns.py"

needs_netns = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(t) for t in ("unshare", "tc", "ip", "sshd")),
    reason="needs root, unshare, tc, ip and sshd (.ci/run installs them)")


def bench(tmp_path: Path, *args: str, launch: bool = False) -> dict[str, Any]:
    argv = [sys.executable, str(HELPER), str(tmp_path), "--seconds", "10", *args, *(["--launch"] if launch else [])]
    proc = subprocess.run(["unshare", "--net", *argv],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert launch or out["doc"] is not None, out
    return out


def errors(out: dict[str, Any]) -> list[dict[str, Any]]:
    return [f for f in out["doc"]["bench"]["findings"] if f["severity"] == "error"]


@needs_netns
def test_a_host_held_to_30_mbit_is_named_and_no_other(tmp_path: Path) -> None:
    out = bench(tmp_path, "--slow-link", "1")
    assert out["rc"] == 1, out["stderr"]
    tcp = [f for f in errors(out) if f["message"].startswith("TCP")]
    assert [f["host"] for f in tcp] == ["host1"], errors(out)
    assert "cable" in tcp[0]["message"]
    named = {f["host"] for f in errors(out)}
    assert named == {"host1"}, errors(out)
    doc = out["doc"]["bench"]
    assert doc["level"] in ("torch-cpu", "torch-cuda") and doc["level_text"]
    slow = [m for m in doc["measures"] if m["kind"] == "tcp" and "host1" in m["hosts"]]
    assert slow and all(m["value"] is not None and m["value"] < 0.1 for m in slow)  # 30 Mbit/s, shared
    assert all(m["what"] for m in doc["measures"])


@needs_netns
def test_the_same_hosts_without_the_limit_pass(tmp_path: Path) -> None:
    out = bench(tmp_path)
    assert errors(out) == [] and out["rc"] == 0, out["stderr"]
    kinds = {m["kind"] for m in out["doc"]["bench"]["measures"]}
    assert {"tcp", "compute", "allreduce"} <= kinds  # TCP, the CPU check and gloo across hosts


@needs_netns
@pytest.mark.skipif(not Path("/sys/fs/cgroup/cpu").is_dir() and not Path("/sys/fs/cgroup/cgroup.controllers").exists(),
                    reason="no cgroup cpu controller")
def test_a_host_held_to_a_sliver_of_cpu_is_named_by_the_compute_check(tmp_path: Path) -> None:
    out = bench(tmp_path, "--slow-cpu", "2")
    assert out["rc"] == 1, out["stderr"]
    cpu = [f for f in errors(out) if f["message"].startswith("CPU on")]
    assert [f["host"] for f in cpu] == ["host2"], errors(out)
    assert "CPU limit" in cpu[0]["message"]


@needs_netns
def test_launch_bench_stops_before_any_rank_starts_on_a_slow_host(tmp_path: Path) -> None:
    out = bench(tmp_path, "--slow-link", "0", launch=True)
    assert out["rc"] == 1, out["stderr"]
    assert "the bench found" in out["stderr"] and "host0" in out["stderr"], out["stderr"]
    assert "nothing was started" in out["stderr"] and not out["started"]


@needs_netns
def test_launch_bench_on_healthy_hosts_runs_the_job(tmp_path: Path) -> None:
    out = bench(tmp_path, launch=True)
    assert out["rc"] == 0 and out["started"], out["stderr"]
    assert "bench: no host or link far below" in out["stderr"]


def test_without_torch_the_bench_measures_tcp_and_a_python_loop(cluster: SshdCluster, tmp_path: Path) -> None:
    """The first level: hosts whose python has no torch (the system python here)."""
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 2, python="/usr/bin/python3")
    out = run_dlrun("topo", "--bench", "--bench-seconds", "6", "--json", "--hosts", str(hosts),
                    "--ssh-config", str(cluster.ssh_config), timeout=600)
    doc = json.loads(out.stdout)["bench"]
    assert doc["level"] == "tcp" and "TCP only" in doc["level_text"], out.stderr
    kinds = {m["kind"] for m in doc["measures"]}
    assert kinds == {"tcp", "compute"}, doc["measures"]
    compute = [m for m in doc["measures"] if m["kind"] == "compute"]
    assert all(m["unit"] == "Mop/s" and "pure Python" in m["what"] and m["value"] > 0 for m in compute)
    tcp = [m for m in doc["measures"] if m["kind"] == "tcp"]
    assert len(tcp) == 2 and all(m["value"] > 0 for m in tcp)  # both ways of the two-host ring
    assert any("no torch" in n for n in doc["notes"])
