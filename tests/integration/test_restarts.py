"""``--max-restarts`` and ``--min-hosts`` over real sshd hosts: a failed job runs again, a lost
host is reconnected or left out, an interrupt never restarts, and no process is left."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest

from support.cli import REPO, run_dlrun
from support.ssh_jobs import hosts_toml, shared_script, start_ssh_job
from support.sshd_cluster import SshdCluster, wait_job_processes_gone

pytestmark = pytest.mark.ssh

FLAKY = """
import os, sys
names = ("DLRUN_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "DLRUN_JOB_ID",
         "TORCHELASTIC_RUN_ID")
print("env", *(os.environ.get(n) for n in names), flush=True)
sys.exit(3 if os.environ["DLRUN_RESTART_COUNT"] == os.environ["DLRUN_RANK"] == "0" else 0)
"""

# attempt 0 waits (the test takes a host away); a restart reports its world and ends well
WAIT_THEN_REPORT = """
import os, time
if os.environ["DLRUN_RESTART_COUNT"] == "0":
    print("ready", flush=True)
    time.sleep(600)
print("world", os.environ["DLRUN_WORLD_SIZE"], "rank", os.environ["DLRUN_RANK"], flush=True)
"""

SLEEPER = "import time\nprint('ready', flush=True)\ntime.sleep(600)\n"


def ssh_args(cluster: SshdCluster) -> list[str]:
    return ["--ssh-config", str(cluster.ssh_config)]


def job_of(out: str) -> str:
    match = re.search(r"logs in (?:\S+/)?dlrun-logs/([\w-]+)/", out)
    assert match, out
    return match.group(1)


def no_process_left(job_id: str, attempts: int) -> None:
    for k in range(attempts):
        assert wait_job_processes_gone(job_id if k == 0 else f"{job_id}-r{k}", timeout=15) == []


@pytest.mark.slow
def test_a_failed_attempt_runs_again_with_its_restart_count(cluster: SshdCluster, tmp_path: Path) -> None:
    script = shared_script(cluster, "flaky.py", FLAKY)
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 2)
    out = run_dlrun("launch", "--plain", "--framework", "torch", "--max-restarts", "1", "--hosts", str(hosts),
                    *ssh_args(cluster), str(script), cwd=tmp_path, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    job = job_of(out.stdout)
    # each attempt has its own job id (the sweep's); torchrun's run id stays the job's
    assert re.search(rf"^\[1 host1\] env 0 0 1 {job} {job}$", out.stdout, re.M), out.stdout
    assert re.search(rf"^\[1 host1\] env 1 1 1 {job}-r1 {job}$", out.stdout, re.M), out.stdout
    assert "attempt 2 of 2 (restart 1" in out.stdout
    assert f"attempt 1 (job {job}, 2 hosts): rank 0 on host host0 exited with code 3" in out.stdout
    assert f"attempt 2 (job {job}-r1, 2 hosts): succeeded" in out.stdout
    for k in (0, 1):
        log = tmp_path / "dlrun-logs" / job / f"attempt-{k}" / "rank-1.log"
        assert log.read_text().startswith(f"env {k} {k} 1 "), log
    no_process_left(job, 2)

    out = run_dlrun("launch", "--plain", "--framework", "torch", "--hosts", str(hosts), *ssh_args(cluster),
                    str(script), cwd=tmp_path, timeout=180)
    assert out.returncode == 3 and "relaunching" not in out.stdout, out.stdout + out.stderr
    job = job_of(out.stdout)
    assert (tmp_path / "dlrun-logs" / job / "rank-0.log").read_text().startswith("env 0 0 0 ")
    no_process_left(job, 1)


@pytest.mark.slow
def test_a_lost_host_is_left_out_with_min_hosts(cluster: SshdCluster, tmp_path: Path) -> None:
    script = shared_script(cluster, "wait_then_report.py", WAIT_THEN_REPORT)
    proc, lines = start_ssh_job(cluster, tmp_path, 3, "--max-restarts", "1", "--min-hosts", "2", str(script), ready=3)
    try:
        cluster.stop_host(2)  # its sshd and everything under it: gone, and no reconnect
        out, _ = proc.communicate(timeout=120)
    finally:
        cluster.restart_host(2)
    out = "".join(lines) + out
    assert proc.returncode == 0, out
    assert "relaunching the job without host2 (lost)" in out, out
    assert sorted(re.findall(r"^\[(\d) (host\d)\] world (\d) rank \1$", out, re.M)) == [
        ("0", "host0", "2"), ("1", "host1", "2")], out
    job = job_of(out)
    assert re.search(rf"attempt 1 \(job {job}, 3 hosts\): host host2 lost \(rank 2\)", out), out
    assert f"attempt 2 (job {job}-r1, 2 hosts, without host2): succeeded" in out, out
    no_process_left(job, 2)


@pytest.mark.slow
def test_without_min_hosts_a_lost_host_is_reconnected(cluster: SshdCluster, tmp_path: Path) -> None:
    script = shared_script(cluster, "wait_then_report.py", WAIT_THEN_REPORT)
    proc, lines = start_ssh_job(cluster, tmp_path, 2, "--max-restarts", "1", str(script), ready=2)
    cluster.kill_sessions(1)  # the connection drops; the host can be reached again
    out, _ = proc.communicate(timeout=120)
    out = "".join(lines) + out
    assert proc.returncode == 0, out
    assert sorted(re.findall(r"^\[(\d) (host\d)\] world (\d) rank \1$", out, re.M)) == [
        ("0", "host0", "2"), ("1", "host1", "2")], out
    assert "host host1 lost (rank 1)" in out and "without" not in out, out
    no_process_left(job_of(out), 2)


def test_too_few_hosts_left_ends_the_job(cluster: SshdCluster, tmp_path: Path) -> None:
    script = shared_script(cluster, "wait_then_report.py", WAIT_THEN_REPORT)
    proc, lines = start_ssh_job(cluster, tmp_path, 2, "--max-restarts", "2", "--min-hosts", "2", str(script), ready=2)
    try:
        cluster.stop_host(1)
        out, _ = proc.communicate(timeout=120)
    finally:
        cluster.restart_host(1)
    out = "".join(lines) + out
    assert proc.returncode == 255, out
    assert "not restarting: 1 host left without host1, fewer than --min-hosts 2" in out, out
    no_process_left(job_of(out), 1)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupt_never_restarts(cluster: SshdCluster, tmp_path: Path, sig: signal.Signals) -> None:
    script = shared_script(cluster, "sleep.py", SLEEPER)
    proc, lines = start_ssh_job(cluster, tmp_path, 2, "--max-restarts", "3", str(script), ready=2)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    out = "".join(lines) + out
    assert proc.returncode == 128 + sig, out
    assert "relaunching" not in out and "attempt-1" not in out, out
    no_process_left(job_of(out), 1)


def test_dry_run_shows_the_restart_policy(tmp_path: Path) -> None:
    script = tmp_path / "t.py"
    script.write_text("print(1)\n")
    out = run_dlrun("launch", "--dry-run", "--max-restarts", "2", "--min-hosts", "1", str(script), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "restarts: up to 2 after a failed rank or a lost host" in out.stdout
    assert "at least 1 remain (--min-hosts)" in out.stdout
    out = run_dlrun("launch", "--dry-run", "--json", "--max-restarts", "2", str(script), cwd=tmp_path)
    assert json.loads(out.stdout)["restarts"] == {"max_restarts": 2, "min_hosts": None}
    out = run_dlrun("launch", "--dry-run", "--min-hosts", "1", str(script), cwd=tmp_path)
    assert out.returncode == 2 and "--min-hosts goes with --max-restarts" in out.stderr


@pytest.mark.slow
def test_the_torch_example_resumes_from_its_checkpoint(cluster: SshdCluster, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    script = shared_script(cluster, "train_torch_ddp.py", (REPO / "examples" / "train_torch_ddp.py").read_text())
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 2)
    out = run_dlrun("launch", "--plain", "--framework", "torch", "--max-restarts", "1", "--hosts", str(hosts),
                    *ssh_args(cluster), str(script), "--epochs", "3", "--crash-after", "1", cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    # host1 has no checkpoint of its own: rank 0 sent it
    assert sorted(re.findall(r"^\[(\d) host\d\] restart 1: resuming after epoch 1$", out.stdout, re.M)) == ["0", "1"]
    assert "epoch 1/3" not in out.stdout.split("relaunching")[1], out.stdout
    assert len(set(re.findall(r"rank \d parameter checksum (-?[0-9.]+)", out.stdout))) == 1, out.stdout
    no_process_left(job_of(out.stdout), 2)


def test_lost_hosts_and_each_attempts_line() -> None:
    from dlrun.run.result import Attempt, RankResult, RankState, RunResult
    from dlrun.run.view import attempt_lines

    lost = RankResult(2, "h2", RankState.LOST, 255, 1.0, error="connection to the host was lost\nmore")
    ranks = (RankResult(0, "h0", RankState.STOPPED, 143, 1.0), RankResult(1, "h1", RankState.STOPPED, 255, 1.0,
                                                                            error="connection lost"), lost)
    failed = RunResult(ranks, 255, root_cause=lost)
    assert failed.lost_hosts == ("h1", "h2")  # in rank order; h0 was stopped, not lost
    history = (Attempt(0, "J", ("h0", "h1", "h2"), 255, lost), Attempt(1, "J-r1", ("h0",), 0, dropped=("h1", "h2")))
    assert attempt_lines(RunResult((), 0, history=history)) == [
        "dlrun: 2 attempts:",
        "  attempt 1 (job J, 3 hosts): host h2 lost (rank 2): connection to the host was lost",
        "  attempt 2 (job J-r1, 1 host, without h1, h2): succeeded",
    ]
    assert attempt_lines(RunResult((), 0, history=history[:1])) == []
    hung = (Attempt(0, "J", ("h0",), 124, hang="hung (no output for 5 s): the rank is in stuck (t.py:3)"),
            Attempt(1, "J-r1", ("h0",), 0))
    assert attempt_lines(RunResult((), 0, history=hung))[1] == (
        "  attempt 1 (job J, 1 host): hung (no output for 5 s): the rank is in stuck (t.py:3)")
