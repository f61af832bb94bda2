"""Real trainings of every framework across sshd hosts: torch DDP, Horovod (gloo), tf-ps."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from support.cli import run_dlrun
from support.ssh_jobs import example, hosts_toml, roles_toml
from support.sshd_cluster import SshdCluster, wait_job_processes_gone

pytestmark = [pytest.mark.ssh, pytest.mark.slow]


def test_torch_ddp_two_hosts_two_slots(cluster: SshdCluster, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    script = example(cluster, "train_torch_ddp.py")
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 2, slots=2)
    out = run_dlrun("launch", "--plain", "--framework", "torch", "--hosts", str(hosts), "--ssh-config",
                    str(cluster.ssh_config), str(script), "--epochs", "6", cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    checksums = set(re.findall(r"rank \d parameter checksum (-?[0-9.]+)", out.stdout))
    assert len(re.findall(r"parameter checksum", out.stdout)) == 4
    assert len(checksums) == 1, checksums
    first = [float(x) for x in re.findall(r"\[0 host0\] epoch 1/6: loss ([0-9.]+)", out.stdout)]
    last = [float(x) for x in re.findall(r"\[0 host0\] epoch 6/6: loss ([0-9.]+)", out.stdout)]
    assert first and last and last[0] < first[0]
    assert "(local 1, host group 1)" in out.stdout


def test_horovod_two_hosts_two_slots(cluster: SshdCluster, tmp_path: Path, horovod: None) -> None:
    script = example(cluster, "train_horovod.py")
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 2, slots=2)
    out = run_dlrun("launch", "--plain", "--framework", "horovod", "--hosts", str(hosts), "--ssh-config",
                    str(cluster.ssh_config), str(script), "--epochs", "10", cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "rank 3/4 local 1/2 cross 1/2" in out.stdout
    assert len(set(re.findall(r"parameter checksum (-?[0-9.]+)", out.stdout))) == 1
    accuracy = float(re.findall(r"\[0 host0\] test accuracy: ([0-9.]+)", out.stdout)[0])
    assert accuracy >= 0.90


def test_the_horovod_example_resumes_after_a_restart(cluster: SshdCluster, tmp_path: Path, horovod: None) -> None:
    """Attempt 0 fails after epoch 1; attempt 1 gets a fresh gloo rendezvous, and both ranks go on
    from rank 0's checkpoint (host1 has none of its own: hvd.broadcast_object sent it)."""
    script = example(cluster, "train_horovod.py")
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 2)
    out = run_dlrun("launch", "--plain", "--framework", "horovod", "--max-restarts", "1", "--hosts", str(hosts),
                    "--ssh-config", str(cluster.ssh_config), str(script), "--epochs", "3", "--crash-after", "1",
                    cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert sorted(re.findall(r"^\[(\d) host\d\] restart 1: resuming after epoch 1$", out.stdout, re.M)) == ["0", "1"]
    after = out.stdout.split("relaunching")[1]
    assert "epoch 1/3" not in after and "epoch 3/3" in after, out.stdout
    assert len(set(re.findall(r"parameter checksum (-?[0-9.]+)", after))) == 1, out.stdout
    job = re.search(r"logs in (?:\S+/)?dlrun-logs/([\w-]+)/", out.stdout)
    assert job, out.stdout
    assert wait_job_processes_gone(job.group(1), timeout=15) == []
    assert wait_job_processes_gone(f"{job.group(1)}-r1", timeout=15) == []


def test_parameter_server_strategy_chief_workers_ps(cluster: SshdCluster, tmp_path: Path) -> None:
    pytest.importorskip("tf_keras")
    script = example(cluster, "train_ps.py")
    # an evaluator runs the script, not a server: a cluster listing it made the chief wait forever
    hosts = roles_toml(cluster, tmp_path / "hosts.toml", [("chief", 1), ("worker", 2), ("ps", 1), ("evaluator", 1)])
    # the first attempt fails after epoch 2; the restart goes on from the chief's checkpoint
    out = run_dlrun("launch", "--plain", "--framework", "tf-ps", "--grace", "3", "--max-restarts", "1", "--hosts",
                    str(hosts), "--ssh-config", str(cluster.ssh_config), str(script), "--epochs", "6",
                    "--crash-after", "2", cwd=tmp_path, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    after = out.stdout.split("relaunching")[1]
    assert "[0 host0] restart 1: resuming after epoch 2" in after
    assert "epoch 2/6" not in after and "[0 host0] epoch 6/6" in after, out.stdout
    assert "chief: 2 workers, 1 ps" in out.stdout
    assert "[4 host3] evaluator: beside 2 workers" in out.stdout
    assert "dlrun.remote.tf_server: ps 0 serving" in out.stdout
    accuracy = float(re.findall(r"\[0 host0\] test accuracy: ([0-9.]+)", out.stdout)[0])
    assert accuracy >= 0.85
    assert re.search(r"^\s+3\s+host2\s+\d+\s+stopped", out.stdout, re.M)  # the ps was stopped by dlrun
