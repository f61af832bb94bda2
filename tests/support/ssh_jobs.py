"""Jobs on the sshd test cluster: inventories of its hosts, scripts its login user can read, a
launch left running."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from support.cli import REPO, dlrun_argv
from support.sshd_cluster import SshdCluster


def shared_script(cluster: SshdCluster, name: str, text: str) -> Path:
    """A script every test host's login user can read."""
    path = cluster.scripts / name
    path.write_text(text)
    path.chmod(0o644)
    return path


def example(cluster: SshdCluster, name: str) -> Path:
    """``examples/<name>``, where every test host can read it."""
    return shared_script(cluster, name, (REPO / "examples" / name).read_text())


def hosts_toml(cluster: SshdCluster, path: Path, n: int, slots: int = 1, extra: str = "",
               names: list[str] | None = None, python: str | None = None) -> Path:
    lines = [f'[defaults]\npython = "{python or cluster.python}"\n{extra}']
    for i, h in enumerate(cluster.hosts[:n]):
        name = f"\nname = {json.dumps(names[i])}" if names else ""
        workdir = json.dumps(str(h.workdir))
        lines.append(f'[[hosts]]\naddress = "{h.name}"{name}\nslots = {slots}\nworkdir = {workdir}\n')
    path.write_text("\n".join(lines))
    return path


def roles_toml(cluster: SshdCluster, path: Path, roles: list[tuple[str, int]]) -> Path:
    """A tf-ps inventory: host i of the cluster has ``roles[i]`` (role, slots)."""
    path.write_text(f'[defaults]\npython = "{cluster.python}"\n' + "".join(
        f'[[hosts]]\naddress = "{h.name}"\nrole = "{role}"\n' + (f"slots = {slots}\n" if slots != 1 else "")
        + f'workdir = "{h.workdir}"\n' for h, (role, slots) in zip(cluster.hosts, roles, strict=False)))
    return path


def start_ssh_job(cluster: SshdCluster, tmp_path: Path, n: int, *args: str,
                  ready: int) -> tuple[subprocess.Popen[str], list[str]]:
    """``dlrun launch --plain --grace 2`` on ``n`` sshd hosts, left running once ``ready`` ranks
    printed ``ready``; the process and the lines it printed so far."""
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", n)
    argv = dlrun_argv("launch", "--plain", "--grace", "2", "--hosts", str(hosts), "--ssh-config",
                      str(cluster.ssh_config), *args)
    proc = subprocess.Popen(argv, cwd=tmp_path, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout is not None
    seen, lines = 0, []
    deadline = time.monotonic() + 60
    while seen < ready and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        seen += "] ready" in line
    assert seen == ready, "".join(lines)
    time.sleep(0.5)
    return proc, lines


def host_programs(program: str, client_port: int) -> list[int]:
    """The pids of host program ``program`` (``dlrun-jobs``, ``dlrun-push_helper``, …) started
    over the SSH connection from ``client_port`` (its ``SSH_CONNECTION``)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry.name}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{entry.name}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        where = next((e.split(b"=", 1)[1].split() for e in environ if e.startswith(b"SSH_CONNECTION=")), [])
        if program.encode() in argv and len(where) == 4 and int(where[1]) == client_port:
            found.append(int(entry.name))
    return found
