"""Modules and non-Python programs on real sshd hosts, launched from a project folder:
``-m pkg.train``, ``python -m pkg.train``, ``Rscript train.R`` (TensorFlow through reticulate)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from support.cli import REPO, run_dlrun
from support.ssh_jobs import hosts_toml
from support.sshd_cluster import SshdCluster

pytestmark = [pytest.mark.ssh]

TRAIN = """\
import os, sys
from pkg import model  # the package came with the push
if os.environ.get("NEVER_SET"):
    import torch  # read by --framework auto, never run
print("ran", model.NAME, os.environ["DLRUN_RANK"], os.environ["DLRUN_HOST"], sys.executable, os.getcwd(),
      " ".join(sys.argv[1:]), flush=True)
"""


def project(tmp_path: Path, name: str) -> Path:
    """A project folder: ``pkg/train.py`` (a module) beside ``pkg/model.py``, readable by the hosts' user."""
    root = tmp_path / name
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "model.py").write_text(f"NAME = {name!r}\n")
    (root / "pkg" / "train.py").write_text(TRAIN)
    for path in (tmp_path, root, root / "pkg"):
        path.chmod(0o755)
    return root


def launch(cluster: SshdCluster, root: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    hosts = hosts_toml(cluster, root.parent / "hosts.toml", 2)
    return run_dlrun("launch", "--plain", "--hosts", str(hosts), "--ssh-config", str(cluster.ssh_config), *args,
                     cwd=root, timeout=timeout)


def ran(stdout: str) -> list[list[str]]:
    """Each rank's ``ran`` line: [name, rank, host, python, cwd, args]."""
    return sorted(line.split(" ", 6)[1:] for line in re.findall(r"^\[\d host\d\] (ran .*)$", stdout, re.M))


@pytest.mark.parametrize("form", [["-m", "pkg.train"], ["python", "-m", "pkg.train"], ["python3", "-m", "pkg.train"]],
                         ids=["-m", "python -m", "python3 -m"])
def test_a_module_runs_with_the_inventorys_python_in_the_pushed_project(cluster: SshdCluster, tmp_path: Path,
                                                                        form: list[str]) -> None:
    root = project(tmp_path, "proj")
    out = launch(cluster, root, *form, "--lr", "1")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "dlrun: framework torch (import torch in train.py)" in out.stderr  # the module's source was read
    assert ran(out.stdout) == [
        ["proj", str(i), f"host{i}", cluster.python, os.path.realpath(cluster.hosts[i].workdir / "proj"), "--lr 1"]
        for i in range(2)]
    for host in cluster.hosts[:2]:  # pushed: the project's files, in the host's workdir
        assert (host.workdir / "proj" / "pkg" / "model.py").read_text() == "NAME = 'proj'\n"


@pytest.mark.slow
def test_a_command_naming_no_local_file_pushes_nothing_and_code_is_never_ignored(
        cluster: SshdCluster, tmp_path: Path) -> None:
    root = project(tmp_path, "bare")
    code = "import os, sys; print('ran', os.getcwd(), sys.executable, flush=True)"
    out = launch(cluster, root, "python3", "-c", code)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    lines = sorted(re.findall(r"^\[\d host\d\] ran (.*)$", out.stdout, re.M))
    assert lines == [f"{cluster.hosts[i].workdir} {cluster.python}" for i in range(2)]
    assert not any((h.workdir / "bare").exists() for h in cluster.hosts[:2])
    assert "push" not in out.stdout.lower()
    out = launch(cluster, root, "--code", ".", "python3", "-c", code)  # --code pushes, and the command runs there
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    lines = sorted(re.findall(r"^\[\d host\d\] ran (.*)$", out.stdout, re.M))
    assert lines == [f"{os.path.realpath(cluster.hosts[i].workdir / 'bare')} {cluster.python}" for i in range(2)]
    assert all((h.workdir / "bare" / "pkg" / "train.py").is_file() for h in cluster.hosts[:2])


@pytest.mark.slow
def test_dry_run_lists_modules_r_commands_and_what_is_pushed(cluster: SshdCluster, tmp_path: Path) -> None:
    root = project(tmp_path, "dry")
    (root / "train.R").write_text('library(reticulate)\ntf <- import("tensorflow")\n')
    (root / "run.sh").write_text("echo hi\n")

    def plan(*args: str) -> tuple[list[list[str]], list[str], dict[str, object]]:
        out = launch(cluster, root, "--dry-run", "--json", *args)
        assert out.returncode == 0, out.stderr
        document = json.loads(out.stdout)
        return [r["argv"] for r in document["ranks"]], [r["cwd"] for r in document["ranks"]], document

    remote = [str(h.workdir / "dry") for h in cluster.hosts[:2]]
    for form in (["-m", "pkg.train"], ["python", "-m", "pkg.train"]):
        argv, cwd, document = plan(*form, "--lr", "1")
        assert argv == [[cluster.python, "-m", "pkg.train", "--lr", "1"]] * 2 and cwd == remote
        push = document["push"]
        assert isinstance(push, dict) and [h["files_sent"] for h in push["hosts"]] == [5, 5]  # nothing written
    argv, cwd, document = plan("Rscript", "train.R", "3")
    assert argv == [["Rscript", "train.R", "3"]] * 2 and cwd == remote and "push" in document
    ranks = document["ranks"]
    assert isinstance(ranks, list) and ranks[0]["env"]["RETICULATE_PYTHON"] == cluster.python
    assert "TF_CONFIG" in ranks[0]["env"] and "MASTER_ADDR" not in ranks[0]["env"]  # import("tensorflow"): tf
    argv, cwd, _ = plan("train.R")
    assert argv == [["Rscript", "train.R"]] * 2 and cwd == remote
    argv, cwd, _ = plan("run.sh")
    assert argv == [["bash", "run.sh"]] * 2 and cwd == remote
    (root / "tool").write_text("#!/bin/sh\necho tool\n")
    (root / "tool").chmod(0o755)
    argv, cwd, _ = plan("./tool")  # the system runs it: in the pushed folder it stays ./tool, not a PATH lookup
    assert argv == [["./tool"]] * 2 and cwd == remote
    argv, cwd, _ = plan("--no-python", "python3", "-m", "pkg.train")
    assert argv == [["python3", "-m", "pkg.train"]] * 2 and cwd == remote
    argv, cwd, document = plan("bash", "-c", "nvidia-smi -L")
    assert argv == [["bash", "-c", "nvidia-smi -L"]] * 2 and "push" not in document
    assert cwd == [str(h.workdir) for h in cluster.hosts[:2]]
    assert not any((h.workdir / "dry").exists() for h in cluster.hosts[:2])


def r_with_reticulate() -> bool:
    if shutil.which("Rscript") is None:
        return False
    return subprocess.run(["Rscript", "-e", "library(reticulate)"], capture_output=True).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not r_with_reticulate(), reason="needs Rscript and reticulate (apt: r-base-core"
                    " r-cran-reticulate; .ci/run installs them)")
def test_rscript_trains_both_workers_in_one_multiworker_group(cluster: SshdCluster, tmp_path: Path) -> None:
    pytest.importorskip("tf_keras")
    root = project(tmp_path, "rproj")
    shutil.copy(REPO / "examples" / "train_iris.R", root / "train.R")
    (root / "train.R").chmod(0o644)
    out = launch(cluster, root, "Rscript", "train.R", "3", timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert 'dlrun: framework tf (import("tensorflow") in train.R)' in out.stderr
    assert sorted(re.findall(r"^\[(\d) host\d\] worker \d: 2 workers", out.stdout, re.M)) == ["0", "1"]
    final = re.findall(r"^\[\d host\d\] worker (\d) final loss ([0-9.]+) weight checksum (-?[0-9.]+)$",
                       out.stdout, re.M)
    assert sorted(rank for rank, _, _ in final) == ["0", "1"], out.stdout[-3000:]
    assert len({(loss, checksum) for _, loss, checksum in final}) == 1, final  # one group: the same model
    first = [float(x) for x in re.findall(r"^\[0 host0\] epoch 1/3: loss ([0-9.]+)$", out.stdout, re.M)]
    assert first and float(final[0][1]) < first[0]
