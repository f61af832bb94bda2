"""Shared test helpers: run the real ``dlrun`` CLI as a subprocess, find job processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO.parent / "shared" / "fixtures" / "topology"


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` seconds pass; its last answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return bool(predicate())


def dlrun_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "dlrun", *args]


def run_dlrun(*args: str, cwd: Path | None = None, timeout: float = 300, env: dict[str, str] | None = None,
              ) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(dlrun_argv(*args), cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=full_env)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path


# --------------------------------------------------------------------------- sshd cluster


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """Four real sshd hosts (host0..host3 on 127.0.0.2..5) and a bastion, for the session."""
    from support.sshd_cluster import find_sshd, start_cluster

    if find_sshd() is None:
        pytest.skip("no sshd on this machine (install openssh-server; .ci/run does)")
    base = tmp_path_factory.mktemp("cluster")
    c = start_cluster(4, base, bastion=True, python=sys.executable)
    scripts = c.root / "scripts"
    scripts.mkdir(exist_ok=True)
    scripts.chmod(0o755)
    c.scripts = scripts  # type: ignore[attr-defined]
    try:
        yield c
    finally:
        c.stop(remove=True)


def shared_script(cluster, name: str, text: str) -> Path:  # type: ignore[no-untyped-def]
    """A script every test host's login user can read."""
    path = cluster.scripts / name
    path.write_text(text)
    path.chmod(0o644)
    return path


def example(cluster, name: str) -> Path:  # type: ignore[no-untyped-def]
    """``examples/<name>``, where every test host can read it."""
    return shared_script(cluster, name, (REPO / "examples" / name).read_text())


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A real Slurm cluster for the session: nodes host0..host2, named as the sshd cluster's hosts
    (tests/support/slurm_cluster.py). Skipped where Slurm is missing, except on CI."""
    from support.slurm_cluster import require_slurm, start_slurm

    require_slurm()
    with start_slurm(["host0", "host1", "host2"], tmp_path_factory.mktemp("slurm")) as c:
        yield c


@pytest.fixture(scope="session")
def horovod() -> None:
    """Horovod 0.28.1 built by scripts/build_horovod.sh (cached wheel). A failed build fails loudly."""
    probe = subprocess.run([sys.executable, "-c", "import horovod.torch"], capture_output=True, text=True)
    if probe.returncode == 0:
        return
    build = subprocess.run(["bash", str(REPO / "scripts" / "build_horovod.sh"), sys.executable],
                           capture_output=True, text=True, timeout=1800)
    if build.returncode != 0:
        pytest.fail(f"Horovod build failed (scripts/build_horovod.sh):\n{build.stderr[-4000:]}")
    wheel = build.stdout.strip().splitlines()[-1]
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", wheel], capture_output=True, text=True)
    if install.returncode != 0:
        pytest.fail(f"installing {wheel} failed:\n{install.stderr[-4000:]}")


def hosts_toml(cluster, path: Path, n: int, slots: int = 1, extra: str = "",  # type: ignore[no-untyped-def]
               names: list[str] | None = None, python: str | None = None) -> Path:
    lines = [f'[defaults]\npython = "{python or cluster.python}"\n{extra}']
    for i, h in enumerate(cluster.hosts[:n]):
        name = f"\nname = {json.dumps(names[i])}" if names else ""
        workdir = json.dumps(str(h.workdir))
        lines.append(f'[[hosts]]\naddress = "{h.name}"{name}\nslots = {slots}\nworkdir = {workdir}\n')
    path.write_text("\n".join(lines))
    return path


def roles_toml(cluster, path: Path, roles: list[tuple[str, int]]) -> Path:  # type: ignore[no-untyped-def]
    """A tf-ps inventory: host i of the cluster has ``roles[i]`` (role, slots)."""
    path.write_text(f'[defaults]\npython = "{cluster.python}"\n' + "".join(
        f'[[hosts]]\naddress = "{h.name}"\nrole = "{role}"\n' + (f"slots = {slots}\n" if slots != 1 else "")
        + f'workdir = "{h.workdir}"\n' for h, (role, slots) in zip(cluster.hosts, roles, strict=False)))
    return path


def start_ssh_job(cluster, tmp_path: Path, n: int, *args: str,  # type: ignore[no-untyped-def]
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
