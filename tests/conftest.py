"""The suite's shared fixtures: real sshd and Slurm clusters, and Horovod. Helpers that tests
import live in ``tests/support/``."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from dlrun.transport.local import HostRouter
from dlrun.transport.ssh import SSHTransport

from support.cli import REPO
from support.slurm_cluster import SlurmCluster, require_slurm, start_slurm
from support.sshd_cluster import SshdCluster, find_sshd, start_cluster


@pytest.fixture(scope="module")
def transport(cluster: SshdCluster) -> Iterator[HostRouter]:
    """One SSH transport to the cluster's hosts for a module's tests (push, pull, checkpoints)."""
    router = HostRouter(remote=SSHTransport(config_file=str(cluster.ssh_config)))
    yield router
    router.close()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshdCluster]:
    """Four real sshd hosts (host0..host3 on 127.0.0.2..5) and a bastion, for the session."""
    if find_sshd() is None:
        pytest.skip("no sshd on this machine (install openssh-server; .ci/run does)")
    base = tmp_path_factory.mktemp("cluster")
    c = start_cluster(4, base, bastion=True, python=sys.executable)
    c.scripts.mkdir(exist_ok=True)
    c.scripts.chmod(0o755)
    try:
        yield c
    finally:
        c.stop(remove=True)


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """A real Slurm cluster for the session: nodes host0..host2, named as the sshd cluster's hosts
    (tests/support/slurm_cluster.py). Skipped where Slurm is missing, except on CI."""
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
