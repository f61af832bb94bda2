"""dlrun inside a real Slurm allocation (tests/support/slurm_cluster.py): the allocation as the
inventory, over SSH and as srun steps, and no process left after dlrun is interrupted or killed
or a node freezes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.cli import REPO, dlrun_argv
from support.gpu_stub import FOUR_GPUS, WAIT_FOR_SAMPLES, printing, stub
from support.slurm_cluster import SlurmCluster
from support.ssh_jobs import shared_script
from support.sshd_cluster import SshdCluster, count_job_processes, wait_job_processes_gone

pytestmark = pytest.mark.slurm

REPORT = """
import json, os, socket
keys = ("DLRUN_RANK", "DLRUN_HOST", "DLRUN_LOCAL_RANK", "WORLD_SIZE", "SLURMD_NODENAME", "SLURM_PROCID",
        "SLURM_NTASKS", "SLURM_JOB_ID", "USER")
print("report", json.dumps({k: os.environ.get(k) for k in keys}), flush=True)
"""

SLEEPER = """
import os, subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)  # escapes
print("ready", os.environ["DLRUN_HOST"], flush=True)  # after the child: the test counts both at once
time.sleep(600)
"""

#: Holds the allocation after dlrun ends (as a batch script's next line would) until its stdin
#: closes; says dlrun's pid.
HOLDER = """
import subprocess, sys
proc = subprocess.Popen(sys.argv[1:], stdin=subprocess.DEVNULL)
print("dlrun-pid", proc.pid, flush=True)
print("dlrun-exit", proc.wait(), flush=True)
sys.stdin.read()
"""


#: Named nodes: a node still cleaning up after the last test's job would otherwise be skipped
TWO_BY_TWO = ["-N2", "-w", "host[0-1]", "--ntasks-per-node=2"]


def salloc_argv(*salloc: str) -> list[str]:
    return ["salloc", "--quiet", *salloc]


def job_env(slurm: SlurmCluster, tmp_path: Path) -> dict[str, str]:
    """dlrun's environment: this cluster's config, and ``tmp_path/home`` as HOME (the steps
    inherit it, so pushes go to ``home/<dir>``, never to root's home)."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return slurm.env({**os.environ, "PYTHONPATH": str(REPO), "HOME": str(home)})


def project(tmp_path: Path, name: str, text: str) -> Path:
    """``tmp_path/proj/name`` (a folder of its own: the push sends it to ``~/proj``)."""
    folder = tmp_path / "proj"
    folder.mkdir(exist_ok=True)
    (folder / name).write_text(text)
    return folder


def run_in_allocation(slurm: SlurmCluster, salloc: list[str], *args: str, cwd: Path,
                      timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = job_env(slurm, cwd.parent)
    return subprocess.run([*salloc_argv(*salloc), *dlrun_argv(*args)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def reports(stdout: str) -> dict[int, tuple[str, dict[str, str | None]]]:
    found = {}
    for line in stdout.splitlines():
        if m := re.match(r"\[(\d+) (\S+)\] report (\{.*\})$", line):
            found[int(m[1])] = (m[2], json.loads(m[3]))
    return dict(sorted(found.items()))


def test_the_allocation_is_the_inventory_and_srun_steps_the_default_transport(slurm: SlurmCluster,
                                                                                tmp_path: Path) -> None:
    out = run_in_allocation(slurm, TWO_BY_TWO, "launch", "--plain", "--framework", "torch",
                            "report.py", cwd=project(tmp_path, "report.py", REPORT))
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"dlrun: hosts from Slurm job \d+: host\[0-1\] \(2 nodes, slots 2,2 from"
                     r" SLURM_TASKS_PER_NODE\)", out.stderr), out.stderr
    rows = reports(out.stdout)
    assert sorted(rows) == [0, 1, 2, 3], out.stdout
    assert [(host, env["DLRUN_HOST"], env["DLRUN_LOCAL_RANK"], env["WORLD_SIZE"]) for host, env in rows.values()] \
        == [("host0", "host0", "0", "4"), ("host0", "host0", "1", "4"), ("host1", "host1", "0", "4"),
            ("host1", "host1", "1", "4")]
    for rank, (host, env) in rows.items():
        assert env["SLURMD_NODENAME"] == host, (rank, env)  # a step on that node, not a local process
        # the agent's one-task step is not the ranks' business: no SLURM_PROCID=0 for every rank
        assert env["SLURM_PROCID"] is None and env["SLURM_NTASKS"] is None, env
        assert env["SLURM_JOB_ID"] is not None


def test_over_ssh_inside_the_allocation(slurm: SlurmCluster, cluster: SshdCluster, tmp_path: Path) -> None:
    script = shared_script(cluster, "slurm_report.py", REPORT)
    out = run_in_allocation(slurm, TWO_BY_TWO, "launch", "--plain", "--framework", "torch",
                            "--transport", "ssh", "--ssh-config", str(cluster.ssh_config), str(script),
                            cwd=project(tmp_path, "unused", ""))
    assert out.returncode == 0, out.stdout + out.stderr
    rows = reports(out.stdout)
    assert [host for host, _ in rows.values()] == ["host0", "host0", "host1", "host1"], out.stdout
    for _, env in rows.values():
        assert env["USER"] == cluster.user and env["SLURMD_NODENAME"] is None  # an SSH login, not a step


def test_hosts_slurm_outside_an_allocation_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "t.py").write_text("print('never')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    out = subprocess.run(dlrun_argv("launch", "--hosts", "slurm", "t.py"), cwd=tmp_path, capture_output=True,
                         text=True, timeout=120, env={**env, "PYTHONPATH": str(REPO)})
    assert out.returncode == 2, out.stdout + out.stderr
    assert "not inside a Slurm allocation" in out.stderr and "salloc -N2" in out.stderr, out.stderr
    srun = subprocess.run(dlrun_argv("launch", "--transport", "srun", "--hosts", "h1,h2", "t.py"), cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env={**env, "PYTHONPATH": str(REPO)})
    assert srun.returncode == 2 and "inside a Slurm allocation" in srun.stderr, srun.stderr


def test_uneven_and_heterogeneous_allocations(slurm: SlurmCluster, tmp_path: Path) -> None:
    out = run_in_allocation(slurm, ["-N1", "-w", "host0", "--ntasks-per-node=2", ":", "-N2", "-w", "host[1-2]",
                             "--ntasks-per-node=1"],
                            "launch", "--plain", "--framework", "none", "report.py",
                            cwd=project(tmp_path, "report.py", REPORT))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "host0 + host[1-2]" in out.stderr, out.stderr
    rows = reports(out.stdout)
    assert [(host, env["SLURMD_NODENAME"]) for host, env in rows.values()] == [
        ("host0", "host0"), ("host0", "host0"), ("host1", "host1"), ("host2", "host2")], out.stdout


def test_a_failing_rank_stops_every_step(slurm: SlurmCluster, tmp_path: Path) -> None:
    fail = ("import os, sys, time\nprint('ready', flush=True)\ntime.sleep(1)\n"
            "sys.exit(7) if os.environ['DLRUN_RANK'] == '2' else time.sleep(600)\n")
    out = run_in_allocation(slurm, TWO_BY_TWO, "launch", "--plain", "--grace", "2",
                            "--framework", "none", "fail.py", cwd=project(tmp_path, "fail.py", fail))
    assert out.returncode == 7, out.stdout + out.stderr
    assert "root cause: rank 2 on host host1 exited with code 7" in out.stdout, out.stdout


# --------------------------------------------------------------------------- no process left


def start_held(slurm: SlurmCluster, tmp_path: Path, *args: str, ready: int,
               ) -> tuple[subprocess.Popen[str], int, str, list[str]]:
    """dlrun inside ``salloc -N2``, under a holder that keeps the allocation after dlrun ends;
    returns once ``ready`` ranks said so: salloc, dlrun's pid, the job id, the lines so far."""
    folder = project(tmp_path, "sleep.py", SLEEPER)
    env = job_env(slurm, tmp_path)
    argv = [*salloc_argv("-N2", "-w", "host[0-1]", "--ntasks-per-node=1"), sys.executable, "-c", HOLDER,
            *dlrun_argv("launch", "--plain", "--grace", "2", "--framework", "none", *args, "sleep.py")]
    proc = subprocess.Popen(argv, cwd=folder, env=env, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 120
    while sum("] ready" in line for line in lines) < ready and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
    text = "".join(lines)
    pid = re.search(r"dlrun-pid (\d+)", text)
    job = re.search(r"logs in dlrun-logs/([\w-]+)/", text)
    assert pid and job and text.count("] ready") == ready, text
    return proc, int(pid[1]), job[1], lines


def finish_held(slurm: SlurmCluster, proc: subprocess.Popen[str], lines: list[str]) -> str:
    """dlrun's exit code line, then the allocation ended (scancel)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + 90
    while not any("dlrun-exit" in line for line in lines) and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
    return "".join(lines)


@pytest.fixture
def ended(slurm: SlurmCluster) -> Iterator[list[subprocess.Popen[str]]]:
    """Ends every allocation a test left (the holders wait for their stdin to close)."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.stdin is not None:
            proc.stdin.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_dlrun_stopped_or_killed_leaves_no_process_in_the_allocation(
        slurm: SlurmCluster, tmp_path: Path, ended: list[subprocess.Popen[str]], sig: signal.Signals) -> None:
    proc, pid, job_id, lines = start_held(slurm, tmp_path, "--transport", "srun", ready=2)
    ended.append(proc)
    assert len(count_job_processes(job_id)) >= 4  # two ranks and two escaped children
    os.kill(pid, sig)
    text = finish_held(slurm, proc, lines)
    code = re.search(r"dlrun-exit (-?\d+)", text)
    assert code, text
    assert int(code[1]) == (-sig if sig == signal.SIGKILL else 128 + sig), text
    # the allocation goes on (its holder sleeps): the agents' own watchdogs ended everything
    assert slurm.jobs(), "the allocation ended early"
    assert wait_job_processes_gone(job_id, timeout=20) == []


def test_a_frozen_node_is_lost_and_its_agent_stops_its_ranks(slurm: SlurmCluster, tmp_path: Path,
                                                              ended: list[subprocess.Popen[str]]) -> None:
    proc, _pid, job_id, lines = start_held(slurm, tmp_path, "--host-timeout", "3", ready=2)
    ended.append(proc)
    rank_on_host1 = next(p for p in count_job_processes(job_id)
                         if b"DLRUN_HOST=host1" in Path(f"/proc/{p}/environ").read_bytes().split(b"\0"))
    stepd = slurm.step_daemon_of(rank_on_host1)
    assert stepd is not None
    os.kill(stepd, signal.SIGSTOP)  # host1's step: no byte moves either way, no EOF
    try:
        text = finish_held(slurm, proc, lines)
        assert "dlrun-exit 255" in text, text
        assert "host host1" in text and re.search(r"no (word|answer) from the host for \d+ s", text), text
        # host1's agent heard no ping either and stopped its ranks, though its step is still frozen
        assert wait_job_processes_gone(job_id, timeout=20) == []
    finally:
        os.kill(stepd, signal.SIGCONT)


@pytest.mark.slow
def test_the_sbatch_example_trains_ddp_on_two_nodes(slurm: SlurmCluster, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    folder = tmp_path / "proj"
    (folder / "examples").mkdir(parents=True)
    for name in ("train_torch_ddp.sbatch", "train_torch_ddp.py"):
        (folder / "examples" / name).write_text((REPO / "examples" / name).read_text())
    env = {**job_env(slurm, tmp_path), "DLRUN": f"{sys.executable} -m dlrun",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    out = subprocess.run(["sbatch", "--wait", "--output=ddp.out", "--nodelist=host[0-1]",
                          "examples/train_torch_ddp.sbatch", "--epochs", "2"],
                         cwd=folder, env=env, capture_output=True, text=True, timeout=600)
    log = (folder / "ddp.out").read_text() if (folder / "ddp.out").exists() else ""
    assert out.returncode == 0, out.stdout + out.stderr + log[-4000:]
    # no terminal: plain lines, 2 ranks on each node, the parameters in sync
    assert re.search(r"dlrun: hosts from Slurm job \d+: host\[0-1\] \(2 nodes, slots 2,2", log), log[-3000:]
    assert "\x1b[" not in log
    assert {m[0] for m in re.findall(r"^\[(\d) (host\d)\] epoch 2/2", log, re.M)} == {"0", "1", "2", "3"}, log[-3000:]
    assert re.findall(r"^\[\d (host\d)\] .*parameter checksum", log, re.M).count("host1") == 2
    assert len(set(re.findall(r"parameter checksum (-?[0-9.]+)", log))) == 1


#: Inside the allocation: a detached job that ps, logs and stop reach, then a second one left
#: running when the allocation ends.
DETACHED = """
import re, subprocess, sys
dlrun = [sys.executable, "-m", "dlrun"]
def run(*args):
    out = subprocess.run([*dlrun, *args], capture_output=True, text=True, timeout=180)
    print("$", *args, "->", out.returncode, flush=True)
    print(out.stdout + out.stderr, flush=True)
    return out
def detach():
    out = run("launch", "--detach", "--grace", "2", "--framework", "none", "sleep.py")
    return re.search(r"detached job (\\S+)", out.stdout).group(1)
first = detach()
run("ps")
subprocess.run(["sleep", "2"])
run("logs", first)
run("stop", first)
print("second", detach(), flush=True)
run("ps")
"""


def test_detached_jobs_live_in_steps_and_end_with_the_allocation(slurm: SlurmCluster, tmp_path: Path) -> None:
    folder = project(tmp_path, "sleep.py", SLEEPER)
    (tmp_path / "driver.py").write_text(DETACHED)
    out = subprocess.run([*salloc_argv("-N2", "-w", "host[0-1]", "--ntasks-per-node=1"), sys.executable,
                          str(tmp_path / "driver.py")],
                         cwd=folder, env=job_env(slurm, tmp_path), capture_output=True, text=True, timeout=600)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    jobs = re.findall(r"dlrun: detached job (\S+)", text)
    assert len(jobs) == 2, text
    job = jobs[0]
    assert re.search(rf"\$ ps -> 0\n(.*\n)*{job}\s+running\s+2", text), text
    assert re.search(r"\[1 host1\] ready host1", text), text  # dlrun logs, through host1's step
    assert re.search(rf"\$ stop {job} -> 143", text), text
    assert wait_job_processes_gone(job, timeout=20) == []
    assert re.search(rf"{jobs[1]}\s+running\s+2", text.rpartition("$ ps")[2]), text
    # salloc has ended, and the allocation with it: Slurm ended the keepers' steps, and their ranks
    assert wait_job_processes_gone(jobs[1], timeout=30) == []


def test_the_gpu_view_samples_every_node_through_its_step(slurm: SlurmCluster, tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    stub_dir = stub(tmp_path / "bin", calls, printing(FOUR_GPUS))  # srun hands PATH to each step
    folder = project(tmp_path, "wait.py", WAIT_FOR_SAMPLES)
    env = {**job_env(slurm, tmp_path), "PATH": f"{stub_dir}{os.pathsep}{os.environ['PATH']}"}
    out = subprocess.run([*salloc_argv("-N2", "-w", "host[0-1]"), *dlrun_argv(
        "launch", "--plain", "--no-preflight", "--framework", "none", "--gpu-every", "0.5", "wait.py", str(calls),
        "1", "6", "0")], cwd=folder, env=env, capture_output=True, text=True, timeout=240)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    for host in ("host0", "host1"):
        assert f"dlrun: gpu {host} util 97 0 0 0 % mem 70.0 0.0 0.0 0.0/80 GiB" in text, text
    assert "gpu host1: util 97 0 0 0 % (mean)" in text, text


def test_topo_probes_the_allocations_nodes_through_steps(slurm: SlurmCluster, tmp_path: Path) -> None:
    out = run_in_allocation(slurm, ["-N2", "-w", "host[0-1]"], "topo", cwd=project(tmp_path, "unused", ""))
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"dlrun: hosts from Slurm job \d+: host\[0-1\]", out.stderr), out.stderr
    assert "host0,host1" in out.stdout, out.stdout  # one section for the two alike nodes
