"""Hosts that share their code folder (as an NFS home does) get it pushed once: real sshd
hosts whose workdirs are one folder."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from support.cli import run_dlrun
from support.ssh_jobs import hosts_toml
from support.sshd_cluster import SshdCluster

pytestmark = pytest.mark.ssh


def test_three_hosts_with_one_workdir_get_one_push(cluster: SshdCluster, tmp_path: Path) -> None:
    project = cluster.root / f"shared-{tmp_path.name}"  # readable by the hosts' login user
    project.mkdir()
    project.chmod(0o755)
    (project / "where.py").write_text("import os\nprint('cwd', os.getcwd())\n")
    (project / "where.py").chmod(0o644)
    workdir = cluster.hosts[0].workdir
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 3)
    text = hosts.read_text()
    for h in cluster.hosts[1:3]:
        text = text.replace(f'workdir = "{h.workdir}"', f'workdir = "{workdir}"')
    hosts.write_text(text)
    try:
        out = run_dlrun("launch", "--plain", "--framework", "none", "--hosts", str(hosts), "--ssh-config",
                        str(cluster.ssh_config), str(project / "where.py"), cwd=tmp_path, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        shared = re.search(r"dlrun: (host\d), (host\d) share (host\d)'s code folder \(.*\): pushed once, by \3",
                           out.stderr)
        assert shared and {shared[1], shared[2], shared[3]} == {"host0", "host1", "host2"}, out.stderr
        sent = dict(re.findall(r"^(host\d): (\d+) files sent", out.stderr, re.M))
        assert sent == {shared[3]: "1", shared[1]: "0", shared[2]: "0"}, out.stderr
        cwds = re.findall(r"\] cwd (\S+)", out.stdout)
        # the ranks run in the tree the push swapped in (the project folder is a link to it)
        assert cwds == [os.path.realpath(workdir / project.name)] * 3, out.stdout
        assert (workdir / project.name).is_symlink()
        assert not list((workdir / project.name).glob(".dlrun-claim-*"))  # the push removed the claim
    finally:
        (workdir / project.name).unlink(missing_ok=True)
        shutil.rmtree(workdir / ".dlrun-versions" / project.name, ignore_errors=True)
        shutil.rmtree(project, ignore_errors=True)
