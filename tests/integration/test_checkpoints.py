"""``--checkpoint-dir`` and ``dlrun pull`` over real sshd hosts (no shared filesystem: each host
has its own working folder), and the pure rules that choose which copy wins."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from dlrun.inventory import Host
from dlrun.push.checkpoint import choose_copies, needs
from dlrun.push.pull import Listing, RemoteFile, plan_pull
from dlrun.transport.local import HostRouter

from support.cli import run_dlrun
from support.ssh_jobs import hosts_toml
from support.sshd_cluster import TEST_USER_HOME, SshdCluster, wait_job_processes_gone
from support.wait import wait_until

# attempt 0: rank 0 saves a checkpoint and fails, the others wait to be stopped; attempt 1: every
# rank needs the checkpoint
RESUME = """
import os, sys, time
rank, attempt = os.environ["DLRUN_RANK"], os.environ["DLRUN_RESTART_COUNT"]
if os.path.exists("ckpt/state.txt"):
    print("rank", rank, "resumes from", open("ckpt/state.txt").read().strip(), flush=True)
    sys.exit(0)
if attempt == "0" and rank == "0":
    os.makedirs("ckpt", exist_ok=True)
    with open("ckpt/state.txt", "w") as fh:
        fh.write("epoch 1\\n")
    sys.exit(3)
if attempt == "0":
    time.sleep(120)
print("rank", rank, "has no checkpoint", flush=True)
sys.exit(4)
"""

# every rank writes its own shard; the restart checks that it sees all of them
SHARDS = """
import os, sys, time
rank, size = int(os.environ["DLRUN_RANK"]), int(os.environ["DLRUN_WORLD_SIZE"])
if os.environ["DLRUN_RESTART_COUNT"] == "0":
    os.makedirs("ckpt/step-1", exist_ok=True)
    with open(f"ckpt/step-1/shard-{rank}.bin", "wb") as fh:
        fh.write(bytes([rank]) * (100000 + rank))
    if rank == 0:
        time.sleep(2)
        with open("ckpt/latest", "w") as fh:
            fh.write("step-1\\n")
        os.symlink("step-1", "ckpt/last")
        sys.exit(3)
    time.sleep(120)
step = open("ckpt/latest").read().strip()
have = sorted(os.listdir(f"ckpt/{step}"))
sizes = [os.path.getsize(f"ckpt/{step}/{n}") for n in have]
print("rank", rank, "sees", ",".join(have), sizes, os.readlink("ckpt/last"), flush=True)
"""

# rank 0 (host0) saves a complete model.bin and fails two seconds later; rank 1 (host1) is then
# writing its newer model.bin and ignores SIGTERM, so it is killed in the middle of it
TRUNCATED = """
import os, signal, sys, time, hashlib
rank = os.environ["DLRUN_RANK"]
if os.environ["DLRUN_RESTART_COUNT"] != "0":
    data = open("ckpt/model.bin", "rb").read()
    print("rank", rank, "model", len(data), hashlib.sha256(data).hexdigest(), flush=True)
    sys.exit(0)
os.makedirs("ckpt", exist_ok=True)
if rank == "0":
    with open("ckpt/model.bin", "wb") as fh:
        fh.write(b"A" * 200000)
    time.sleep(2)
    sys.exit(3)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
time.sleep(1)
with open("ckpt/model.bin", "wb") as fh:
    while True:
        fh.write(b"B" * 1000)
        fh.flush()
        time.sleep(0.02)
"""


# the PyTorch DDP tutorial's pattern (multinode.py): rank 0 saves a snapshot every epoch, every
# rank loads the snapshot it finds on its own host
DDP_TUTORIAL = """
import os, sys
from datetime import timedelta
import torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
epochs_run = 0
if os.path.exists("ckpt/snapshot.pt"):
    snapshot = torch.load("ckpt/snapshot.pt")
    model.module.load_state_dict(snapshot["MODEL_STATE"])
    epochs_run = snapshot["EPOCHS_RUN"]
print(f"rank {rank} starts at epoch {epochs_run}", flush=True)
x, y = torch.randn(16, 4), torch.randn(16, 1)
for epoch in range(epochs_run, int(sys.argv[1])):
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    if rank == 0:
        os.makedirs("ckpt", exist_ok=True)
        torch.save({"MODEL_STATE": model.module.state_dict(), "EPOCHS_RUN": epoch + 1}, "ckpt/snapshot.pt")
print(f"rank {rank} checksum {sum(p.sum().item() for p in model.parameters()):.6f}", flush=True)
dist.destroy_process_group()
"""


def project(tmp_path: Path, script: str) -> Path:
    """A code folder of its own (its name is the project folder on the hosts)."""
    code = tmp_path / f"ck-{tmp_path.name}"
    code.mkdir()
    (code / "train.py").write_text(script)
    return code


def launch(cluster: SshdCluster, tmp_path: Path, code: Path, *args: str) -> subprocess.CompletedProcess[str]:
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 2)
    return run_dlrun("launch", "--plain", "--framework", "none", "--grace", "2", "--hosts", str(hosts),
                     "--ssh-config", str(cluster.ssh_config), *args, str(code / "train.py"), cwd=tmp_path, timeout=240)


def remote(cluster: SshdCluster, i: int, code: Path, rel: str) -> Path:
    return Path(cluster.hosts[i].workdir) / code.name / rel


@pytest.mark.ssh
def test_a_restart_finds_rank_0s_checkpoint_on_every_host(cluster: SshdCluster, tmp_path: Path) -> None:
    code = project(tmp_path, RESUME)
    out = launch(cluster, tmp_path, code, "--max-restarts", "1", "--checkpoint-dir", "ckpt")
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"^\[0 host0\] rank 0 resumes from epoch 1$", out.stdout, re.M), out.stdout
    assert re.search(r"^\[1 host1\] rank 1 resumes from epoch 1$", out.stdout, re.M), out.stdout
    # the restart's line says what moved, where and how long it took
    assert re.search(r"attempt 2 of 2 .*checkpoint ckpt: 1 file \(8 B\) from host0 to host1 in \d+\.\d s"
                     r" \(host to host\)", out.stdout), out.stdout
    assert remote(cluster, 1, code, "ckpt/state.txt").read_text() == "epoch 1\n"

    # without the option, host1's rank has none: today's failure
    code2 = tmp_path / "plain"
    code2.mkdir()
    code = project(code2, RESUME)
    out = launch(cluster, tmp_path, code, "--max-restarts", "1")
    assert out.returncode == 4, out.stdout + out.stderr
    assert re.search(r"^\[1 host1\] rank 1 has no checkpoint$", out.stdout, re.M), out.stdout


@pytest.mark.slow
@pytest.mark.ssh
def test_every_host_gets_every_ranks_shard_and_the_latest_file_and_link(cluster: SshdCluster, tmp_path: Path) -> None:
    code = project(tmp_path, SHARDS)
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 2, slots=2)
    out = run_dlrun("launch", "--plain", "--framework", "none", "--grace", "2", "--hosts", str(hosts),
                    "--ssh-config", str(cluster.ssh_config), "--max-restarts", "1", "--checkpoint-dir", "ckpt",
                    str(code / "train.py"), cwd=tmp_path, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    want = "sees shard-0.bin,shard-1.bin,shard-2.bin,shard-3.bin [100000, 100001, 100002, 100003] step-1"
    for rank in range(4):
        assert re.search(rf"^\[{rank} host\d\] rank {rank} {re.escape(want)}$", out.stdout, re.M), out.stdout
    # host0 had shards 0, 1, latest and last; host1 shards 2 and 3: 4 files each way
    assert re.search(r"checkpoint ckpt: 6 files \(.*\) from host0, host1 to host0, host1", out.stdout), out.stdout
    for i in (0, 1):
        assert remote(cluster, i, code, "ckpt/last").is_symlink()


@pytest.mark.slow
@pytest.mark.ssh
def test_a_file_truncated_by_a_killed_writer_never_wins(cluster: SshdCluster, tmp_path: Path) -> None:
    code = project(tmp_path, TRUNCATED)
    out = launch(cluster, tmp_path, code, "--max-restarts", "1", "--checkpoint-dir", "ckpt")
    assert out.returncode == 0, out.stdout + out.stderr
    complete = hashlib.sha256(b"A" * 200000).hexdigest()
    for rank in (0, 1):
        assert re.search(rf"^\[{rank} host{rank}\] rank {rank} model 200000 {complete}$", out.stdout, re.M), out.stdout
    assert "written as the job failed, not taken: host1:model.bin" in out.stdout, out.stdout


@pytest.mark.ssh
def test_a_new_launch_starts_from_the_newest_checkpoint_on_every_host(cluster: SshdCluster, tmp_path: Path) -> None:
    code = project(tmp_path, RESUME)
    out = launch(cluster, tmp_path, code)  # rank 0 saves and fails; no restart
    assert out.returncode == 3, out.stdout + out.stderr
    out = launch(cluster, tmp_path, code, "--checkpoint-dir", "ckpt")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "checkpoint ckpt: 1 file (8 B) from host0 to host1" in out.stdout + out.stderr
    assert re.search(r"^\[1 host1\] rank 1 resumes from epoch 1$", out.stdout, re.M), out.stdout


@pytest.mark.slow
@pytest.mark.ssh
def test_the_ddp_tutorials_second_run_resumes_at_the_same_epoch_on_every_host(
        cluster: SshdCluster, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    code = project(tmp_path, DDP_TUTORIAL)
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 2)

    def run(epochs: str) -> subprocess.CompletedProcess[str]:
        return run_dlrun("launch", "--plain", "--framework", "torch", "--hosts", str(hosts), "--ssh-config",
                         str(cluster.ssh_config), "--checkpoint-dir", "ckpt", str(code / "train.py"), epochs,
                         cwd=tmp_path, timeout=300)

    first = run("2")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "checkpoint ckpt: empty on every host" in first.stderr
    second = run("4")
    assert second.returncode == 0, second.stdout + second.stderr
    # host1 never wrote a snapshot: dlrun copied rank 0's before the second run started
    assert re.search(r"checkpoint ckpt: 1 file \(.*\) from host0 to host1", second.stderr), second.stderr
    assert sorted(re.findall(r"^\[\d host\d\] rank (\d) starts at epoch 2$", second.stdout, re.M)) == ["0", "1"]
    assert len(set(re.findall(r"rank \d checksum (-?[0-9.]+)", second.stdout))) == 1, second.stdout


@pytest.mark.slow
@pytest.mark.ssh
def test_a_detached_job_gets_the_checkpoint_before_its_first_attempt(cluster: SshdCluster, tmp_path: Path) -> None:
    code = project(tmp_path, RESUME)
    assert launch(cluster, tmp_path, code).returncode == 3  # rank 0 saved ckpt/state.txt on host0 only
    out = launch(cluster, tmp_path, code, "--detach", "--checkpoint-dir", "ckpt")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "checkpoint ckpt: 1 file (8 B) from host0 to host1" in out.stdout + out.stderr
    job = out.stdout.strip().splitlines()[-1].rsplit(" ", 1)[-1]
    assert remote(cluster, 1, code, "ckpt/state.txt").read_text() == "epoch 1\n"
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 2)
    attached = run_dlrun("attach", job, "--hosts", str(hosts), "--ssh-config", str(cluster.ssh_config), cwd=tmp_path,
                         timeout=120)
    assert attached.returncode == 0, attached.stdout + attached.stderr


@pytest.mark.ssh
def test_a_detached_restart_finds_rank_0s_checkpoint_on_every_host(cluster: SshdCluster, tmp_path: Path) -> None:
    # the keepers restart the job without dlrun: the leader keeper makes ckpt the same first
    code = project(tmp_path, RESUME)
    out = launch(cluster, tmp_path, code, "--detach", "--max-restarts", "1", "--checkpoint-dir", "ckpt")
    assert out.returncode == 0, out.stdout + out.stderr
    job = out.stdout.strip().splitlines()[-1].rsplit(" ", 1)[-1]
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 2)
    attached = run_dlrun("attach", job, "--hosts", str(hosts), "--ssh-config", str(cluster.ssh_config), cwd=tmp_path,
                         timeout=180)
    assert attached.returncode == 0, attached.stdout + attached.stderr
    assert re.search(r"^\[1 host1\] rank 1 resumes from epoch 1$", attached.stdout, re.M), attached.stdout
    assert "has no checkpoint" not in attached.stdout
    # the restarted attempt's line says what moved, where and how long it took
    assert re.search(r"attempt 2: checkpoint ckpt: 1 file \(8 B\) from host0 to host1 in \d+\.\d s \(host to host\)",
                     attached.stdout), attached.stdout
    assert remote(cluster, 1, code, "ckpt/state.txt").read_text() == "epoch 1\n"
    assert not [p for p in remote(cluster, 1, code, "ckpt").iterdir() if p.name.startswith(".dlrun-part")]


@pytest.mark.ssh
def test_a_detached_restart_never_takes_a_file_truncated_by_a_killed_writer(
        cluster: SshdCluster, tmp_path: Path) -> None:
    # the leader keeper's failure time: when it heard rank 0 fail, before host1's writer was killed
    code = project(tmp_path, TRUNCATED)
    out = launch(cluster, tmp_path, code, "--detach", "--max-restarts", "1", "--checkpoint-dir", "ckpt")
    assert out.returncode == 0, out.stdout + out.stderr
    job = out.stdout.strip().splitlines()[-1].rsplit(" ", 1)[-1]
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 2)
    attached = run_dlrun("attach", job, "--hosts", str(hosts), "--ssh-config", str(cluster.ssh_config), cwd=tmp_path,
                         timeout=180)
    assert attached.returncode == 0, attached.stdout + attached.stderr
    complete = hashlib.sha256(b"A" * 200000).hexdigest()
    for rank in (0, 1):
        assert re.search(rf"^\[{rank} host{rank}\] rank {rank} model 200000 {complete}$", attached.stdout, re.M), \
            attached.stdout
    assert "written as the job failed, not taken: host1:model.bin" in attached.stdout, attached.stdout


def host_folder(job: str, host: str) -> Path:
    return TEST_USER_HOME / ".dlrun" / "jobs" / job / f"host-{host}"


def running(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def detach_with_a_slow_copy(cluster: SshdCluster, tmp_path: Path, *args: str) -> str:
    """RESUME detached with one restart and ``--checkpoint-dir ckpt``, host1's listing held 300 s
    (the test hook ``DLRUN_TEST_CKPT_PAUSE``); the job's id, once the leader keeper has begun the
    restart's copy (and waits for host1)."""
    code = project(tmp_path, RESUME)
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 2)
    out = run_dlrun("launch", "--plain", "--framework", "none", "--grace", "2", "--hosts", str(hosts),
                    "--ssh-config", str(cluster.ssh_config), "--detach", "--max-restarts", "1",
                    "--checkpoint-dir", "ckpt", *args, str(code / "train.py"), cwd=tmp_path, timeout=240,
                    env={"DLRUN_TEST_CKPT_PAUSE": "300"})
    assert out.returncode == 0, out.stdout + out.stderr
    job = out.stdout.strip().splitlines()[-1].rsplit(" ", 1)[-1]

    def copying() -> bool:
        try:
            log = (host_folder(job, "host0") / "keeper.log").read_text()
        except OSError:
            return False
        return "attempt 2: making checkpoint ckpt the same on every host" in log

    assert wait_until(copying, timeout=120)
    return job


@pytest.mark.slow
@pytest.mark.ssh
def test_a_follower_killed_during_a_detached_restarts_copy_does_not_hang_the_leader(
        cluster: SshdCluster, tmp_path: Path) -> None:
    # --host-timeout 600 (--detach refuses 0, "never"): no silence ends the leader's wait within
    # the test; only the closed connection can
    job = detach_with_a_slow_copy(cluster, tmp_path, "--host-timeout", "600")
    leader = int((host_folder(job, "host0") / "keeper.pid").read_text().split()[0])
    pid = int((host_folder(job, "host1") / "keeper.pid").read_text().split()[0])
    os.kill(pid, signal.SIGKILL)
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 2)
    attached = run_dlrun("attach", job, "--hosts", str(hosts), "--ssh-config", str(cluster.ssh_config), cwd=tmp_path,
                         timeout=180)  # well before host1's listing would have answered
    assert attached.returncode == 255, attached.stdout + attached.stderr
    assert re.search(r"attempt 2: checkpoint ckpt: not made the same \(host1: its keeper's connection closed\)",
                     attached.stdout), attached.stdout
    assert "host host1 lost: its keeper's connection closed" in attached.stdout, attached.stdout
    assert wait_until(lambda: not running(leader), timeout=60)  # the leader keeper ended, not hung
    assert wait_job_processes_gone(job, timeout=30) == []
    assert wait_job_processes_gone(f"{job}-r1", timeout=30) == []


@pytest.mark.slow
@pytest.mark.ssh
def test_dlrun_stop_during_a_detached_restarts_copy_stops_the_job(cluster: SshdCluster, tmp_path: Path) -> None:
    job = detach_with_a_slow_copy(cluster, tmp_path)
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 2)
    # dlrun stop waits 60 s for the end: the copy must give up, not wait for host1's answer
    stopped = run_dlrun("stop", job, "--hosts", str(hosts), "--ssh-config", str(cluster.ssh_config), cwd=tmp_path,
                        timeout=180)
    assert stopped.returncode == 143, stopped.stdout + stopped.stderr
    assert f"dlrun: job {job} stopped; exit code 143" in stopped.stdout, stopped.stdout
    result = json.loads((host_folder(job, "host0") / "result.json").read_text())
    lines = result["history"][-1]["checkpoint"]
    assert re.match(r"checkpoint ckpt: not made the same \(host1: stopped by signal 15", lines[0]), result
    assert wait_job_processes_gone(job, timeout=30) == []
    assert wait_job_processes_gone(f"{job}-r1", timeout=30) == []


def open_workdirs(cluster: SshdCluster, tmp_path: Path, n: int = 2) -> Path:
    """An inventory whose hosts' workdirs any user may write (0777, not sticky), owned by the login."""
    import secrets

    lines = [f'[defaults]\npython = "{cluster.python}"\n']
    for h in cluster.hosts[:n]:
        workdir = Path(h.workdir) / f"open-{secrets.token_hex(3)}"
        workdir.mkdir()
        os.chown(workdir, *login_ids(cluster))
        workdir.chmod(0o777)
        lines.append(f'[[hosts]]\naddress = "{h.name}"\nslots = 1\nworkdir = "{workdir}"\n')
    path = tmp_path / "open-hosts.toml"
    path.write_text("\n".join(lines))
    return path


@pytest.mark.ssh
def test_checkpoint_copies_check_the_folders_owner_as_the_push_does(
        cluster: SshdCluster, transport: HostRouter, tmp_path: Path) -> None:
    from dlrun.errors import SyncError
    from dlrun.push.checkpoint import sync_folder

    hosts, roots = two_folders(cluster, tmp_path)
    opened = Path(roots["host1"]).parent  # host1's job folder: any user may write it, so plant a checkpoint
    opened.chmod(0o777)
    addresses = {"host0": cluster.hosts[0].address, "host1": cluster.hosts[1].address}
    with pytest.raises(SyncError) as refused:
        sync_folder(transport, hosts, roots, "ckpt", addresses=addresses)
    assert refused.value.host == "host1", str(refused.value)
    assert f"{opened} is writable by every user (mode 0777): chmod o-w {opened}" in str(refused.value)
    assert "--insecure-workdir" in str(refused.value.hint)
    assert not (Path(roots["host1"]) / "model.bin").exists() and not (Path(roots["host0"]) / "shard-1.bin").exists()
    done = sync_folder(transport, hosts, roots, "ckpt", addresses=addresses, owner_check=False)  # --insecure-workdir
    assert done.files == 2, done.line()
    assert (Path(roots["host1"]) / "model.bin").read_bytes() == b"m" * 50000


@pytest.mark.ssh
def test_insecure_workdir_reaches_the_checkpoint_copy(cluster: SshdCluster, tmp_path: Path) -> None:
    code = project(tmp_path, RESUME)
    hosts = open_workdirs(cluster, tmp_path)
    out = run_dlrun("launch", "--plain", "--framework", "none", "--grace", "2", "--hosts", str(hosts),
                    "--ssh-config", str(cluster.ssh_config), "--insecure-workdir", "--max-restarts", "1",
                    "--checkpoint-dir", "ckpt", str(code / "train.py"), cwd=tmp_path, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"attempt 2 of 2 .*checkpoint ckpt: 1 file \(8 B\) from host0 to host1", out.stdout), out.stdout
    assert re.search(r"^\[1 host1\] rank 1 resumes from epoch 1$", out.stdout, re.M), out.stdout
    # and to the keepers' copy of a detached job's restart
    (tmp_path / "detached").mkdir()
    code = project(tmp_path / "detached", RESUME)
    out = run_dlrun("launch", "--plain", "--framework", "none", "--grace", "2", "--hosts", str(hosts),
                    "--ssh-config", str(cluster.ssh_config), "--insecure-workdir", "--max-restarts", "1",
                    "--checkpoint-dir", "ckpt", "--detach", str(code / "train.py"), cwd=tmp_path, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    job = out.stdout.strip().splitlines()[-1].rsplit(" ", 1)[-1]
    attached = run_dlrun("attach", job, "--hosts", str(hosts), "--ssh-config", str(cluster.ssh_config), cwd=tmp_path,
                         timeout=180)
    assert attached.returncode == 0, attached.stdout + attached.stderr
    assert "attempt 2: checkpoint ckpt: 1 file (8 B) from host0 to host1" in attached.stdout, attached.stdout


def test_a_checkpoint_dir_must_lie_inside_the_jobs_folder(tmp_path: Path) -> None:
    script = tmp_path / "t.py"
    script.write_text("print(1)\n")
    for bad in ("/abs", "../up", "~/x", "."):
        out = run_dlrun("launch", "--dry-run", "--checkpoint-dir", bad, str(script), cwd=tmp_path)
        assert out.returncode == 2 and "expected a folder inside the job's working folder" in out.stderr, out.stderr
    out = run_dlrun("launch", "--dry-run", "--json", "--checkpoint-dir", "ckpt", "--checkpoint-dir", "out/shards",
                    str(script), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["restarts"]["checkpoint_dirs"] == ["ckpt", "out/shards"]
    out = run_dlrun("launch", "--backend", "spark", "--master", "local[2]", "--checkpoint-dir", "ckpt", str(script),
                    cwd=tmp_path)
    assert out.returncode == 2 and "--checkpoint-dir go" in out.stderr, out.stderr


@pytest.mark.slow
@pytest.mark.ssh
def test_pull_brings_every_hosts_out_folder_home(cluster: SshdCluster, tmp_path: Path) -> None:
    name = f"pull-{tmp_path.name}"
    big = bytes(range(256)) * 4000
    for i in (0, 1, 2):
        out_dir = Path(cluster.hosts[i].workdir) / name / "out"
        (out_dir / "sub").mkdir(parents=True)
        (out_dir / "config.json").write_text('{"lr": 0.1}\n')
        (out_dir / "sub" / "weights.bin").write_bytes(big)
        (out_dir / "metrics.csv").write_text(f"host,{i}\n")
        if i < 2:
            (out_dir / "only-0-1.txt").write_text("x")
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 3)
    dest = tmp_path / "home"
    dest.mkdir()
    (dest / "mine.txt").write_text("a local file")
    args = ("--hosts", str(hosts), "--ssh-config", str(cluster.ssh_config), "--project", name)
    dry = run_dlrun("pull", *args, "--dry-run", "out", str(dest), cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr
    assert sorted(p.name for p in dest.iterdir()) == ["mine.txt"]
    assert "would receive" in dry.stderr
    got = run_dlrun("pull", *args, "--json", "out", str(dest), cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    files = {p.relative_to(dest).as_posix(): p.read_bytes() for p in dest.rglob("*") if p.is_file()}
    assert files == {
        "mine.txt": b"a local file",  # never deleted
        "out/config.json": b'{"lr": 0.1}\n',  # the same everywhere: once
        "out/sub/weights.bin": big,
        **{f"host{i}/out/metrics.csv": f"host,{i}\n".encode() for i in (0, 1, 2)},
        "host0/out/only-0-1.txt": b"x",  # not on every host: per host
        "host1/out/only-0-1.txt": b"x",
    }
    document = json.loads(got.stdout)
    assert document["total"]["files_received"] == 7
    assert document["total"]["bytes_received"] == sum(len(v) for k, v in files.items() if k != "mine.txt")
    # the shared 1 MB came from one host only
    assert sorted(h["bytes_received"] for h in document["hosts"])[-1] < len(big) + 100
    again = run_dlrun("pull", *args, "--json", "out", str(dest), cwd=tmp_path)
    assert json.loads(again.stdout)["total"] == {"files_received": 0, "bytes_received": 0, "files_unchanged": 7}
    # a folder on some hosts only: named, and pulled from the others
    (Path(cluster.hosts[2].workdir) / name / "extra").mkdir()
    (Path(cluster.hosts[2].workdir) / name / "extra" / "e.txt").write_text("e")
    some = run_dlrun("pull", *args, "extra/", str(tmp_path / "extra"), cwd=tmp_path)
    assert some.returncode == 0, some.stderr
    assert "extra/ is not on host0, host1: pulling from host2" in some.stderr
    assert (tmp_path / "extra" / "e.txt").read_text() == "e"
    none = run_dlrun("pull", *args, "nowhere", cwd=tmp_path)
    assert none.returncode != 0 and "nowhere is on none of the hosts" in none.stderr


@pytest.mark.ssh
def test_pull_refuses_over_the_size_limit_and_never_writes_through_a_link(cluster: SshdCluster, tmp_path: Path) -> None:
    name = f"pull-{tmp_path.name}"
    out_dir = Path(cluster.hosts[0].workdir) / name / "out"
    out_dir.mkdir(parents=True)
    (out_dir / "big.bin").write_bytes(b"z" * 300000)
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 1)
    args = ("--hosts", str(hosts), "--ssh-config", str(cluster.ssh_config), "--project", name)
    over = run_dlrun("pull", *args, "--max-size", "100K", "out", str(tmp_path / "home"), cwd=tmp_path)
    assert over.returncode == 2 and "over the 100.0 KiB limit; nothing was written" in over.stderr, over.stderr
    assert not (tmp_path / "home").exists()
    # a link where a folder belongs is never followed
    (tmp_path / "home").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "home" / "out").symlink_to(tmp_path / "elsewhere")
    linked = run_dlrun("pull", *args, "out", str(tmp_path / "home"), cwd=tmp_path)
    assert linked.returncode != 0, linked.stderr
    assert "host0: out/big.bin: a link is in the way (not followed)" in linked.stderr, linked.stderr
    assert list((tmp_path / "elsewhere").iterdir()) == []


@pytest.mark.ssh
def test_a_file_that_changes_between_listing_and_sending_is_named_and_not_written(
        cluster: SshdCluster, tmp_path: Path) -> None:
    from dlrun.inventory import Host
    from dlrun.push.pull import HostSender
    from dlrun.transport.local import HostRouter
    from dlrun.transport.ssh import SSHTransport

    folder = Path(cluster.hosts[0].workdir) / f"pull-{tmp_path.name}"
    folder.mkdir()
    (folder / "log.txt").write_text("line 1\n")
    (folder / "done.txt").write_text("done\n")
    host = Host(address=cluster.hosts[0].name, name="host0", workdir=str(cluster.hosts[0].workdir),
                python=cluster.python)
    transport = HostRouter(remote=SSHTransport(config_file=str(cluster.ssh_config)))
    try:
        sender = HostSender(transport, host, str(folder))
        listed = sender.listing()
        (folder / "log.txt").write_text("LINE 1\n")  # the job rewrites it
        local = tmp_path / "home"
        local.mkdir()
        (local / "log.txt").write_text("old copy\n")
        written, failures = sender.fetch([(listed.entries[p], local / p) for p in ("done.txt", "log.txt")], local)
    finally:
        transport.close()
    assert [(f.path, f.message) for f in failures] == [
        ("log.txt", "content does not match its sha256 (changed on the host while pulling?)")]
    assert written == 5 and (local / "done.txt").read_text() == "done\n"
    assert (local / "log.txt").read_text() == "old copy\n"
    assert sorted(p.name for p in local.iterdir()) == ["done.txt", "log.txt"]  # no temporary file left


@pytest.fixture
def transport(cluster: SshdCluster) -> Iterator[HostRouter]:
    from dlrun.transport.ssh import SSHTransport

    router = HostRouter(remote=SSHTransport(config_file=str(cluster.ssh_config)))
    yield router
    router.close()


def two_folders(cluster: SshdCluster, tmp_path: Path) -> tuple[list[Host], dict[str, str]]:
    hosts = [Host(address=h.name, name=f"host{i}", workdir=str(h.workdir), python=cluster.python)
             for i, h in enumerate(cluster.hosts[:2])]
    roots: dict[str, str] = {}
    for i, h in enumerate(cluster.hosts[:2]):
        root = Path(h.workdir) / f"sync-{tmp_path.name}"
        (root / "ckpt").mkdir(parents=True)
        os.chown(root, *login_ids(cluster))
        os.chown(root / "ckpt", *login_ids(cluster))
        roots[f"host{i}"] = str(root / "ckpt")
    (Path(roots["host0"]) / "model.bin").write_bytes(b"m" * 50000)
    (Path(roots["host1"]) / "shard-1.bin").write_bytes(b"s" * 30000)
    return hosts, roots


def login_ids(cluster: SshdCluster) -> tuple[int, int]:
    import pwd

    pw = pwd.getpwnam(cluster.user)
    return pw.pw_uid, pw.pw_gid


@pytest.mark.ssh
def test_host_to_host_where_the_hosts_listen_else_through_this_machine(
        cluster: SshdCluster, transport: HostRouter, tmp_path: Path) -> None:
    from dlrun.push.checkpoint import sync_folder

    hosts, roots = two_folders(cluster, tmp_path)
    addresses = {"host0": cluster.hosts[0].address, "host1": cluster.hosts[1].address}
    direct = sync_folder(transport, hosts, roots, "ckpt", addresses=addresses)
    assert (direct.files, direct.relayed) == (2, 0) and direct.line().endswith("(host to host)"), direct.line()
    for root in roots.values():
        assert (Path(root) / "model.bin").read_bytes() == b"m" * 50000
        assert (Path(root) / "shard-1.bin").read_bytes() == b"s" * 30000
    again = sync_folder(transport, hosts, roots, "ckpt", addresses=addresses)
    assert again.files == 0 and "the same on every host (2 files)" in again.line()
    # host0 cannot listen at an address that is not its own: its file goes through this machine
    (Path(roots["host0"]) / "model.bin").write_bytes(b"n" * 40000)
    (Path(roots["host1"]) / "shard-1.bin").write_bytes(b"t" * 20000)
    mixed = sync_folder(transport, hosts, roots, "ckpt", addresses={**addresses, "host0": "192.0.2.1"})
    assert (mixed.files, mixed.relayed) == (2, 1) and "(1 through this machine)" in mixed.line(), mixed.line()
    for root in roots.values():
        assert (Path(root) / "model.bin").read_bytes() == b"n" * 40000
        assert (Path(root) / "shard-1.bin").read_bytes() == b"t" * 20000
    leftovers = [p.name for root in roots.values() for p in Path(root).iterdir() if p.name.startswith(".dlrun-part")]
    assert leftovers == []


@pytest.mark.ssh
def test_a_serving_host_gives_nothing_without_the_token_or_tls(
        cluster: SshdCluster, transport: HostRouter, tmp_path: Path) -> None:
    import socket
    import ssl

    from dlrun.push.pull import HostSender
    from dlrun.tls import make_job_tls

    hosts, roots = two_folders(cluster, tmp_path)
    tls = make_job_tls("test")
    sender = HostSender(transport, hosts[0], roots["host0"])
    sender.listing()
    port = sender.serve(["model.bin"], cluster.hosts[0].address, "right-token", tls.cert_pem, tls.key_pem)
    try:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.load_verify_locations(cadata=tls.cert_pem)

        def ask(token: str) -> bytes:
            with socket.create_connection((cluster.hosts[0].address, port), timeout=10) as raw, \
                    context.wrap_socket(raw) as conn:
                conn.sendall(token.encode() + b"\n" + json.dumps(["model.bin"]).encode() + b"\n")
                data = b""
                while chunk := conn.recv(65536):
                    data += chunk
                return data

        assert ask("wrong-token") == b""
        given = ask("right-token")  # a tar stream: the header, the bytes, the end
        assert given.startswith(b"model.bin\0") and b"m" * 50000 in given and given.endswith(bytes(1024))
        with socket.create_connection((cluster.hosts[0].address, port), timeout=10) as plain:
            plain.sendall(b"right-token\n[\"model.bin\"]\n")
            plain.settimeout(10)
            try:
                assert b"m" * 100 not in plain.recv(65536)
            except (ConnectionResetError, TimeoutError):
                pass
    finally:
        sender.close()


# --------------------------------------------------------------------------- the rules (pure)


def entry(path: str, content: bytes, mtime: float, kind: str = "file") -> RemoteFile:
    return RemoteFile(path, kind, len(content), 0o644, hashlib.sha256(content).hexdigest(), int(mtime * 1e9))


def listing(host: str, *entries: RemoteFile, offset: float = 0.0, missing: bool = False) -> Listing:
    return Listing(host, f"/w/{host}", {e.path: e for e in entries}, offset=offset, missing=missing)


def test_the_newest_copy_wins_and_host_clocks_are_put_on_ours() -> None:
    old, new = entry("m", b"old", 100.0), entry("m", b"new", 200.0)
    choices = choose_copies([listing("h0", old), listing("h1", new)], failed_at=None)
    assert choices["m"].host == "h1"
    # h1's clock runs 150 s ahead: its copy was written at 50 on ours
    choices = choose_copies([listing("h0", old), listing("h1", new, offset=150.0)], failed_at=None)
    assert choices["m"].host == "h0"


def test_a_copy_written_as_the_attempt_failed_loses_to_a_complete_one() -> None:
    complete, partial = entry("m", b"A" * 10, 100.0), entry("m", b"B" * 3, 105.5)
    listings = [listing("h0", complete), listing("h1", partial)]
    choices = choose_copies(listings, failed_at=105.0)
    assert choices["m"].host == "h0" and choices["m"].passed_over == ("h1",) and not choices["m"].suspect
    assert needs(listings, choices) == {"h0": [], "h1": [choices["m"]]}
    # as late as 1 s before the failure is seen still counts as written as it failed
    assert choose_copies([listing("h0", complete), listing("h1", entry("m", b"B", 104.2))], 105.0)["m"].host == "h0"
    # the only copy is taken, and said to be suspect
    only = choose_copies([listing("h0"), listing("h1", partial)], failed_at=105.0)
    assert only["m"].host == "h1" and only["m"].suspect
    # a new launch knows no failure: the newest wins
    assert choose_copies(listings, failed_at=None)["m"].host == "h1"


def test_shards_of_every_rank_reach_every_host_and_equal_copies_stay() -> None:
    s0, s1, same = entry("s0", b"0", 10.0), entry("s1", b"1", 11.0), entry("meta", b"m", 5.0)
    same_later = entry("meta", b"m", 9.0)
    listings = [listing("h0", s0, same), listing("h1", s1, same_later)]
    wanted = needs(listings, choose_copies(listings, failed_at=None))
    assert [c.path for c in wanted["h0"]] == ["s1"] and [c.path for c in wanted["h1"]] == ["s0"]


def test_only_paths_below_the_root_are_taken_from_a_listing() -> None:
    from dlrun.errors import SyncError
    from dlrun.push.pull import _parse_listing, host_folder, safe_path

    assert safe_path("a/b.txt") and safe_path(".hidden")
    assert not any(safe_path(p) for p in ("", "/etc/passwd", "../x", "a/../../x", "a//b", "./a", "a/."))
    with pytest.raises(SyncError, match="not a file below"):
        _parse_listing("h0", {"root": "/r", "entries": {"../x": ["file", 1, 420, "00", 0]}}, 0.0)
    assert host_folder("..") == "_.." and host_folder("a/b") == "a_b"
    import dlrun
    from dlrun import api

    assert dlrun.pull is api.pull


def test_plan_pull_writes_shared_files_once_and_the_rest_per_host() -> None:
    shared, a, b = entry("w", b"w" * 10, 1.0), entry("m", b"a", 1.0), entry("m", b"b", 1.0)
    plan = plan_pull([listing("h0", shared, a), listing("h1", shared, b), listing("h2", missing=True)],
                     lambda dest: ("file", a.sha256) if dest == "h0/out/m" else None, prefix="out/")
    assert [(i.host, i.dest) for i in plan.fetch] == [("h1", "h1/out/m"), ("h0", "out/w")]
    assert [(i.host, i.dest) for i in plan.unchanged] == [("h0", "h0/out/m")]
    assert plan.missing == ("h2",) and plan.shared == 1 and plan.per_host == 1


def test_the_keepers_choose_as_the_client_does() -> None:
    # dlrun.remote.ckptsync (a detached job's restarts) carries its own copy of the rule
    import itertools

    from dlrun.remote import ckptsync

    copies = [entry("m", b"A" * 10, 100.0), entry("m", b"B" * 3, 105.5), entry("m", b"C" * 7, 104.2),
              entry("m", b"D", 100.0), entry("l", b"", 103.0, kind="link")]
    for chosen in itertools.permutations(copies, 3):
        for offsets, failed_at in itertools.product([(0.0, 0.0, 0.0), (0.0, 5.0, -3.0)], [None, 105.0, 101.0]):
            listings = [listing(f"h{i}", *([c] if c.path == "m" else [c, entry("m", b"A" * 10, 99.0)]),
                                offset=offsets[i]) for i, c in enumerate(chosen)]
            client = choose_copies(listings, failed_at)
            keepers = ckptsync.choose([(li.host, {p: [e.kind, e.size, e.mode, e.sha256 if e.kind == "file" else e.link,
                                                     e.mtime_ns] for p, e in li.entries.items()}, li.offset)
                                       for li in listings], failed_at)
            assert {p: (c.host, c.suspect, list(c.passed_over)) for p, c in client.items()} == \
                {p: (c[0], c[2], c[3]) for p, c in keepers.items()}
            wanted = needs(listings, client)
            assert {h: [c.path for c in cs] for h, cs in wanted.items()} == ckptsync.needs(
                [(li.host, {p: [e.kind, e.size, e.mode, e.sha256 if e.kind == "file" else e.link, e.mtime_ns]
                            for p, e in li.entries.items()}, li.offset) for li in listings], keepers)


def test_a_failed_keepers_copy_names_the_files_it_left_mixed() -> None:
    # a host whose renames failed part way (or that was cut off) may hold new files beside old
    # ones, and the restart goes on, so the attempt's line says which
    from typing import Any

    from dlrun.remote import ckptsync

    def e(data: bytes, mtime: float) -> list[Any]:
        return ["file", len(data), 0o644, hashlib.sha256(data).hexdigest(), int(mtime * 1e9)]

    host0 = {"model.pt": e(b"new model", 200.0), "optimizer.pt": e(b"new opt", 200.0), "extra.pt": e(b"x", 200.0)}
    host1 = {"model.pt": e(b"old model", 100.0), "optimizer.pt": e(b"old opt", 100.0)}

    def run(receive: dict[str, Any]) -> tuple[str, list[dict[str, dict[str, Any]]]]:
        asked: list[dict[str, dict[str, Any]]] = []

        def ask(requests: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
            asked.append(requests)
            do = next(iter(requests.values()))["do"]
            if do == "list":
                return {"h0": {"entries": host0, "now": 0.0}, "h1": {"entries": host1, "now": 0.0}}
            if do == "serve":
                return {"h0": {"port": 1234}}
            if do == "receive":
                return {"h1": receive}
            return {h: {} for h in requests}

        line = ckptsync.sync_folder(ask, ["h0", "h1"], "ckpt", {"h0": "a0", "h1": "a1"}, "C", "K", None)
        return line, asked

    line, asked = run({"written": 1, "failed": ["/w/ckpt/optimizer.pt: connection reset"], "replaced": ["model.pt"]})
    assert asked[-1] == {"h0": {"do": "end"}, "h1": {"do": "end"}}
    assert line.startswith("checkpoint ckpt: not made the same (h1: /w/ckpt/optimizer.pt: connection reset) after ")
    assert line.endswith("; mixed files: h1 has new model.pt beside old optimizer.pt and no extra.pt"), line
    # cut off (the keeper's connection closed): which arrived is unknown
    line, _ = run({"error": "its keeper's connection closed"})
    assert line.endswith("; mixed files: h1 may have new files beside old ones (of extra.pt, model.pt,"
                         " optimizer.pt)"), line
    # every file replaced before a later failure: nothing mixed
    line, _ = run({"written": 3, "failed": ["x: y"], "replaced": ["extra.pt", "model.pt", "optimizer.pt"]})
    assert "mixed" not in line, line
