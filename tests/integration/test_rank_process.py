"""What CUDA and NCCL need from a rank's process, held on a machine without a GPU.

On a real H100, every CUDA rank failed with error 304 exactly where a rank's ``/proc/self``
was not the rank itself (a PID namespace showing the host's ``/proc``). These tests start real
ranks, on localhost and on sshd hosts (as the clean login user there), and compare what each
rank sees of itself, its devices, ``/dev/shm``, its limits and its mounts with what the same
script sees when started plainly on that host.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from support.cli import REPO, dlrun_argv, run_dlrun
from support.ssh_jobs import hosts_toml, shared_script
from support.sshd_cluster import SshdCluster

FACTS = r"""
import json, os, resource, stat, sys
pid = os.getpid()
with open("/proc/%d/cmdline" % pid, "rb") as fh:
    cmdline = [a.decode() for a in fh.read().split(b"\0")[:-1]]
with open("/proc/self/status") as fh:
    status_pid = next(int(line.split()[1]) for line in fh if line.startswith("Pid:"))
devices = {}
for name in sorted(os.listdir("/dev")):
    path = "/dev/" + name
    try:
        if stat.S_ISCHR(os.lstat(path).st_mode):  # not the links to fd 0-2
            devices[name] = os.access(path, os.R_OK | os.W_OK)
    except OSError:
        pass
with open("/proc/self/mountinfo") as fh:
    mounts = sorted({line.split()[4] for line in fh})
shm = os.stat("/dev/shm")
limits = {n: resource.getrlimit(getattr(resource, n)) for n in
          ("RLIMIT_MEMLOCK", "RLIMIT_NOFILE", "RLIMIT_STACK", "RLIMIT_NPROC", "RLIMIT_CORE", "RLIMIT_AS")}
print("FACTS " + json.dumps({
    "pid": pid, "proc_self": os.readlink("/proc/self"), "status_pid": status_pid, "cmdline": cmdline,
    "argv": sys.argv, "pidns": os.readlink("/proc/self/ns/pid"), "devices": devices, "mounts": mounts,
    "shm": [shm.st_dev, shm.st_ino], "shm_writable": os.access("/dev/shm", os.W_OK), "limits": limits,
    "rank": os.environ.get("DLRUN_RANK"), "env": dict(os.environ)}), flush=True)
"""


#: What differs between two starts of the same program by nature: the connection, the folder.
VOLATILE = {"SSH_CLIENT", "SSH_CONNECTION", "PWD", "OLDPWD", "SHLVL", "_", "SSH_TTY", "DLRUN_AGENT_TAG"}


def inherited_env(env: dict[str, str]) -> dict[str, str]:
    """A rank's env less what dlrun adds on purpose and what differs by nature."""
    return {k: v for k, v in env.items() if k not in VOLATILE and not k.startswith("DLRUN_")
            and k not in ("PYTHONUNBUFFERED", "PYTHONFAULTHANDLER")}


def facts_of(text: str) -> list[dict[str, Any]]:
    return [json.loads(m.group(1)) for m in re.finditer(r"FACTS (\{.*\})", text)]


def assert_own_process(rank: dict[str, Any], plain: dict[str, Any]) -> None:
    """The rank is itself in its /proc, and sees what a plainly started process sees."""
    assert rank["proc_self"] == str(rank["pid"]), rank  # CUDA's error 304 when not
    assert rank["status_pid"] == rank["pid"]
    assert rank["cmdline"][1:] == rank["argv"] and Path(rank["cmdline"][0]).name.startswith("python")
    assert rank["devices"] == plain["devices"]  # every device node, and whether it may be opened
    assert rank["shm"] == plain["shm"] and rank["shm_writable"] and plain["shm_writable"]
    assert rank["limits"] == plain["limits"]
    assert rank["mounts"] == plain["mounts"]
    # PATH, LD_LIBRARY_PATH, CUDA_HOME …: the rank inherits the login's environment untouched
    assert inherited_env(rank["env"]) == inherited_env(plain["env"])


def unshare_works() -> bool:
    if not shutil.which("unshare"):
        return False
    from dlrun.remote import agent

    probe = subprocess.run(agent.pidns_argv(["sh", "-c", 'case "$*" in *--in-pidns*) exit 0;; esac; exit 1', "x"]),
                           capture_output=True)
    return probe.returncode == 0


@pytest.mark.slow
@pytest.mark.parametrize("pidns", [True, False], ids=["pidns", "no-pidns"])
def test_localhost_ranks_see_their_own_proc_devices_shm_and_limits(tmp_path: Path, pidns: bool) -> None:
    script = tmp_path / "facts.py"
    script.write_text(FACTS)
    plain = facts_of(subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True,
                                    env={**os.environ, "PYTHONPATH": str(REPO)}).stdout)[0]
    out = run_dlrun("launch", "--plain", "--framework", "none", *([] if pidns else ["--no-pidns"]), str(script),
                    cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    ranks = facts_of(out.stdout)
    assert sorted(r["rank"] for r in ranks) == ["0", "1"]
    for rank in ranks:
        assert_own_process(rank, plain)
        if pidns and unshare_works():
            assert rank["pidns"] != plain["pidns"], "the rank should run in a PID namespace here"


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting needs root")
def test_a_mount_made_after_the_start_reaches_the_ranks(tmp_path: Path) -> None:
    """An automounted NFS dataset that appears mid-job must be seen: slave propagation, not private."""
    if not unshare_works():
        pytest.skip("no PID namespace here")
    shared = tmp_path / "shared"
    (shared / "data").mkdir(parents=True)
    subprocess.run(["mount", "--bind", str(shared), str(shared)], check=True)
    try:
        subprocess.run(["mount", "--make-shared", str(shared)], check=True)
        script = tmp_path / "wait_mount.py"
        script.write_text(
            "import os, sys, time\n"
            "print('ready', flush=True)\n"
            "deadline = time.time() + 30\n"
            f"while not os.path.exists({str(shared / 'data' / 'flag')!r}) and time.time() < deadline:\n"
            "    time.sleep(0.05)\n"
            f"sys.exit(0 if os.path.exists({str(shared / 'data' / 'flag')!r}) else 7)\n")
        proc = subprocess.Popen(dlrun_argv("launch", "--plain", "--framework", "none", "--np", "1", str(script)),
                                cwd=tmp_path, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "] ready" in line:
                break
        subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(shared / "data")], check=True)
        try:
            (shared / "data" / "flag").write_text("x")
            rest, _ = proc.communicate(timeout=60)
        finally:
            subprocess.run(["umount", str(shared / "data")], check=False)
        assert proc.returncode == 0, "".join(lines) + rest
    finally:
        time.sleep(0.1)
        subprocess.run(["umount", "-l", str(shared)], check=False)


@pytest.mark.ssh
def test_ssh_ranks_see_their_own_proc_as_the_login_user(cluster: SshdCluster, tmp_path: Path) -> None:
    script = shared_script(cluster, "facts.py", FACTS)
    plain_run = cluster.run(0, f"{cluster.python} {script}")
    assert plain_run.returncode == 0, plain_run.stderr
    plain = facts_of(plain_run.stdout)[0]
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 1, slots=2)
    out = run_dlrun("launch", "--plain", "--framework", "none", "--no-push", "--hosts", str(hosts),
                    "--ssh-config", str(cluster.ssh_config), str(script), cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    ranks = facts_of(out.stdout)
    assert sorted(r["rank"] for r in ranks) == ["0", "1"]
    for rank in ranks:
        assert_own_process(rank, plain)
        assert rank["pidns"] != plain["pidns"], "the login user's ranks should run in a PID namespace here"
