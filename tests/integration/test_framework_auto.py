"""``--framework auto`` (the default): the script's imports choose its rank contract, the choice
is dlrun's first line, and the preflight and the Keras warning follow the chosen framework."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from support.cli import REPO, dlrun_argv, run_dlrun
from support.ssh_jobs import hosts_toml, shared_script
from support.sshd_cluster import SshdCluster

ENV_PRINTER = """
import json, os
def never_called():
    {imports}
print("CONTRACT " + json.dumps({{k: v for k, v in os.environ.items()
                                 if k in ("RANK", "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG", "HOROVOD_RANK")}}),
      flush=True)
"""


def script(folder: Path, name: str, imports: str) -> Path:
    path = folder / name
    path.write_text(ENV_PRINTER.format(imports=imports))
    return path


def dry_run(cwd: Path, *args: str) -> tuple[str, list[dict[str, str]]]:
    out = run_dlrun("launch", "--dry-run", "--json", "-n", "2", *args, cwd=cwd)
    assert out.returncode == 0, out.stderr
    return out.stderr.splitlines()[0], [r["env"] for r in json.loads(out.stdout)["ranks"]]


def test_each_script_gets_the_contract_its_imports_name(tmp_path: Path) -> None:
    first, env = dry_run(tmp_path, str(script(tmp_path, "t.py", "import lightning")))
    assert first == "dlrun: framework torch (import lightning in t.py)"
    assert env[1]["RANK"] == "1" and env[0]["MASTER_PORT"] and "TF_CONFIG" not in env[0]
    # horovod inside a function that never runs: detection reads, never executes
    first, env = dry_run(tmp_path, str(script(tmp_path, "h.py", "import horovod.torch as hvd\n    import torch")))
    assert first == "dlrun: framework horovod (import horovod in h.py)"
    assert env[1]["HOROVOD_RANK"] == "1" and "MASTER_ADDR" not in env[1]
    first, env = dry_run(tmp_path, str(script(tmp_path, "k.py", "from tensorflow import keras")))
    assert first == "dlrun: framework tf (import tensorflow in k.py)"
    assert json.loads(env[1]["TF_CONFIG"])["task"] == {"type": "worker", "index": 1} and "RANK" not in env[1]


def test_a_shell_script_gets_both_contracts_and_an_explicit_framework_is_kept(tmp_path: Path) -> None:
    shell = tmp_path / "run.sh"
    shell.write_text("#!/bin/sh\nenv\n")
    shell.chmod(0o755)
    first, env = dry_run(tmp_path, str(shell))
    assert first == "dlrun: framework tf+torch (run.sh is not a Python script: both the tf and the torch contracts)"
    assert "TF_CONFIG" in env[0] and env[0]["MASTER_ADDR"] == "127.0.0.1" and env[1]["RANK"] == "1"
    keras_script = script(tmp_path, "k.py", "import keras")
    out = run_dlrun("launch", "--dry-run", "--json", "--framework", "torch", str(keras_script), cwd=tmp_path)
    assert "dlrun: framework" not in out.stderr
    assert "TF_CONFIG" not in json.loads(out.stdout)["ranks"][0]["env"]


@pytest.mark.ssh
def test_ranks_on_hosts_get_the_detected_contract(cluster: SshdCluster, tmp_path: Path) -> None:
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 2)
    ssh = ("--hosts", str(hosts), "--ssh-config", str(cluster.ssh_config), "--plain", "--no-push")
    torch_job = shared_script(cluster, "auto_torch.py", ENV_PRINTER.format(imports="import torch"))
    out = run_dlrun("launch", *ssh, str(torch_job), cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stderr.startswith("dlrun: framework torch (import torch in auto_torch.py)")
    contracts = {line.split("]")[0]: json.loads(line.split("CONTRACT ", 1)[1])
                 for line in out.stdout.splitlines() if "CONTRACT " in line}
    assert contracts["[1 host1"]["RANK"] == "1" and contracts["[1 host1"]["MASTER_ADDR"] == cluster.hosts[0].address
    tf_job = shared_script(cluster, "auto_tf.py", ENV_PRINTER.format(imports="import tensorflow as tf"))
    out = run_dlrun("launch", *ssh, str(tf_job), cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stderr.startswith("dlrun: framework tf (import tensorflow in auto_tf.py)")
    tf_config = [json.loads(json.loads(line.split("CONTRACT ", 1)[1])["TF_CONFIG"]) for line in out.stdout.splitlines()
                 if "CONTRACT " in line]
    assert sorted(c["task"]["index"] for c in tf_config) == [0, 1] and "RANK" not in out.stdout


def stub_site(root: Path, *dists: str) -> Path:
    """A site folder whose metadata names these distributions (``torch-2.0.0``, ``keras-3.9.9``)."""
    root.mkdir(parents=True)
    for dist in dists:
        (root / f"{dist}.dist-info").mkdir()
        if dist.startswith("torch-"):
            (root / "torch").mkdir()
            (root / "torch" / "version.py").write_text(f"__version__ = '{dist[6:]}'\ncuda = None\n")
    for path in (root, *root.rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return root


def python_with(cluster: SshdCluster, name: str, site: Path) -> Path:
    """A ``python`` for a host's inventory entry that puts ``site`` first on the path."""
    wrapper = cluster.scripts / name
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={site}${{PYTHONPATH:+:$PYTHONPATH}} exec {cluster.python} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def two_hosts(cluster: SshdCluster, path: Path, pythons: tuple[str, str]) -> Path:
    lines = []
    for h, python in zip(cluster.hosts[:2], pythons, strict=True):
        lines.append(f'[[hosts]]\naddress = "{h.name}"\nslots = 1\nworkdir = "{h.workdir}"\npython = "{python}"\n')
    path.write_text("\n".join(lines))
    return path


@pytest.mark.ssh
def test_torch_versions_that_differ_across_hosts_stop_a_torch_job(cluster: SshdCluster, tmp_path: Path) -> None:
    old = python_with(cluster, "python-torch-2.0.0", stub_site(cluster.scripts / "site-torch-2.0.0", "torch-2.0.0"))
    hosts = two_hosts(cluster, tmp_path / "hosts.toml", (str(old), cluster.python))
    job = shared_script(cluster, "versions.py", "open('started', 'w').close()\n")
    out = run_dlrun("launch", "--plain", "--no-push", "--framework", "torch", "--hosts", str(hosts), "--ssh-config",
                    str(cluster.ssh_config), str(job), cwd=tmp_path, timeout=120)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    from importlib.metadata import version

    here = version("torch")
    assert "torch versions differ across hosts" in out.stderr
    assert "2.0.0" in out.stderr and here in out.stderr and "host0" in out.stderr and "host1" in out.stderr
    assert not any((h.workdir / "started").exists() for h in cluster.hosts[:2])
    # a job that is not torch's runs: the difference is a warning, repeated when the job fails
    failing = shared_script(cluster, "fails.py", "raise SystemExit(4)\n")
    out = run_dlrun("launch", "--plain", "--no-push", "--framework", "none", "--hosts", str(hosts), "--ssh-config",
                    str(cluster.ssh_config), str(failing), cwd=tmp_path, timeout=120)
    assert out.returncode == 4, out.stdout[-2000:] + out.stderr[-2000:]
    assert "dlrun: preflight warning: torch versions differ across hosts" in out.stderr
    assert "  warning before the start: preflight: torch versions differ across hosts" in out.stdout


@pytest.mark.slow
@pytest.mark.ssh
def test_the_keras_warning_follows_the_hosts_keras(cluster: SshdCluster, tmp_path: Path) -> None:
    keras3 = python_with(cluster, "python-keras-3.9.9", stub_site(cluster.scripts / "site-keras-3", "keras-3.9.9"))
    keras2 = python_with(cluster, "python-keras-2.15.0", stub_site(cluster.scripts / "site-keras-2", "keras-2.15.0"))
    job = shared_script(cluster, "uses_tf.py", "def never():\n    import tensorflow\nprint('done')\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("TF_USE_LEGACY_KERAS", None)

    def launch(pythons: tuple[str, str], *extra: str) -> subprocess.CompletedProcess[str]:
        hosts = two_hosts(cluster, tmp_path / "hosts.toml", pythons)
        return subprocess.run(dlrun_argv("launch", "--plain", "--no-push", *extra, "--hosts", str(hosts),
                                         "--ssh-config", str(cluster.ssh_config), str(job)),
                              cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)

    out = launch((str(keras3), str(keras2)))
    assert out.returncode == 0, out.stderr
    # the hosts' Keras, not this machine's (whatever it has)
    assert "dlrun: warning: Keras 3.9.9 is installed on host0 and TF_USE_LEGACY_KERAS is unset" in out.stderr
    assert "Pass --env TF_USE_LEGACY_KERAS=1" in out.stderr  # tf_keras is there (the venv's)
    out = launch((str(keras2), str(keras2)))
    assert out.returncode == 0 and "TF_USE_LEGACY_KERAS" not in out.stderr, out.stderr
    out = launch((str(keras3), str(keras3)), "-e", "TF_USE_LEGACY_KERAS=1")
    assert "TF_USE_LEGACY_KERAS is unset" not in out.stderr


def test_the_keras_warning_reads_the_reports_of_a_tf_job_only() -> None:
    from dlrun.inventory import Host, Inventory
    from dlrun.plan import detect_framework
    from dlrun.run.checks import keras_warning
    from dlrun.run.config import LaunchConfig
    from dlrun.topo.records import HostReport

    inventory = Inventory(hosts=(Host(name="a", address="10.0.0.1"), Host(name="b", address="10.0.0.2")))
    reports = [HostReport(host="a", keras="3.9.9"), HostReport(host="b", keras="3.9.9", tf_keras="2.19.0")]
    tf = LaunchConfig(script="/nonexistent/train.py", framework="tf")
    text = keras_warning(tf, inventory, reports) or ""
    assert text.startswith("Keras 3.9.9 is installed on a, b and TF_USE_LEGACY_KERAS is unset")
    assert "Install tf_keras (a lacks it) and pass --env TF_USE_LEGACY_KERAS=1" in text
    assert keras_warning(tf, inventory, [HostReport(host="a", keras="2.15.0"), HostReport(host="b")]) is None
    opted = LaunchConfig(script="/nonexistent/train.py", framework="tf", env={"TF_USE_LEGACY_KERAS": "1"})
    assert keras_warning(opted, inventory, reports) is None
    both = "import torch\nimport tensorflow\n"
    with_tf = LaunchConfig(script="x.py", framework="tf+torch", detected=detect_framework("x.py", both))
    assert keras_warning(with_tf, inventory, reports) is not None
    shell = LaunchConfig(script="run.sh", framework="tf+torch", detected=detect_framework("run.sh", None))
    assert keras_warning(shell, inventory, reports) is None
    assert keras_warning(LaunchConfig(script="x.py", framework="torch"), inventory, reports) is None
