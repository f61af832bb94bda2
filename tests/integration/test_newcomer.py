"""What a new user trips on (issue 36): the real ``dlrun`` CLI as a subprocess, local ranks here,
real sshd hosts in the tests marked ``ssh``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from support.cli import REPO, run_dlrun
from support.ssh_jobs import hosts_toml, shared_script
from support.sshd_cluster import SshdCluster

MARKER = "import pathlib, sys; pathlib.Path(sys.argv[0] + '.ran').touch(); print('RAN')\n"


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize(("typo", "meant"), [(("--nproc", "2"), "--np"), (("--framwork", "torch"), "--framework"),
                                             (("--nproc=2",), "--np"), (("--dryrun",), "--dry-run")])
def test_a_misspelled_option_before_the_script_is_a_usage_error_that_starts_nothing(
        tmp_path: Path, typo: tuple[str, ...], meant: str) -> None:
    script = write(tmp_path / "train.py", MARKER)
    out = run_dlrun("launch", "--plain", *typo, "train.py", cwd=tmp_path, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    name = typo[0].partition("=")[0]
    assert f"No such option '{name}'. Did you mean '{meant}'?" in out.stderr, out.stderr
    assert "RAN" not in out.stdout and not Path(f"{script}.ran").exists()
    assert "dlrun: framework" not in out.stderr and "command not found" not in out.stdout + out.stderr
    assert not (tmp_path / "dlrun-logs").exists()  # nothing started, nothing written


def test_only_options_dlrun_lacks_are_refused_and_the_scripts_own_stay_its(tmp_path: Path) -> None:
    write(tmp_path / "train.py", "import sys; print('ARGV', sys.argv[1:])\n")
    # dlrun's own options in click's short forms, before the script; the script's options after it
    out = run_dlrun("launch", "--plain", "-n1", "--framework=none", "train.py", "--nproc", "2", "-x",
                    cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ARGV ['--nproc', '2', '-x']" in out.stdout
    # after --, an argument that starts with '-' is still no command
    out = run_dlrun("launch", "--plain", "--np", "1", "--", "--nproc", "train.py", cwd=tmp_path, timeout=120)
    assert out.returncode == 2 and "--nproc: a script or command never starts with '-'" in out.stderr, out.stderr
    assert "ARGV" not in out.stdout


def test_usage_errors_come_alone_without_the_framework_line(tmp_path: Path) -> None:
    write(tmp_path / "ok.py", "import torch\n")
    for args, words in ((["nosuch.py"], "dlrun: error: script not found: nosuch.py"),
                        (["--log-dir", "/dev/null/logs", "ok.py"], "cannot create the log directory"),
                        (["--hosts", "a:1", "--np", "3", "ok.py"], "--np 3 needs 3 slots")):
        out = run_dlrun("launch", "--plain", *args, cwd=tmp_path, timeout=120)
        assert out.returncode == 2 and out.stderr.startswith("dlrun: error: ") and words in out.stderr, out.stderr
    out = run_dlrun("launch", "--dry-run", "--json", "ok.py", cwd=tmp_path, timeout=120)
    assert out.returncode == 0 and out.stderr.splitlines()[0] == "dlrun: framework torch (import torch in ok.py)"
    assert json.loads(out.stdout)["world_size"] == 2


def test_a_hosts_file_name_with_a_typo_is_no_host_name(tmp_path: Path) -> None:
    write(tmp_path / "train.py", MARKER)
    write(tmp_path / "hosts.toml", '[[hosts]]\naddress = "localhost"\nslots = 1\n')
    out = run_dlrun("launch", "--plain", "--hosts", "hosts.tml", "train.py", cwd=tmp_path, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "hosts.tml: no such file, and no host name ends in .tml" in out.stderr
    assert "did you mean hosts.toml?" in out.stderr and "cannot resolve" not in out.stderr
    assert "RAN" not in out.stdout


def test_shard_has_help_and_inits_inventory_says_what_it_is(tmp_path: Path) -> None:
    for command in ("launch", "push"):
        text = " ".join(run_dlrun(command, "--help").stdout.split())
        assert "--shard [files|contiguous|size|replicate] How --data is split among the hosts" in text, text
    assert run_dlrun("init", str(tmp_path), cwd=tmp_path).returncode == 0
    head = (tmp_path / "hosts.toml").read_text().split("\n\n")[0]
    assert "copy to" not in head and "Edit the hosts below, then: `dlrun launch train.py --hosts hosts.toml`" in head


@pytest.mark.slow
def test_the_quickstart_example_resumes_and_leaves_only_its_logs_and_model(tmp_path: Path) -> None:
    """README's train command, in a fresh folder, with a restart: the checkpoint lives beside the
    model in dlrun-model/ (git-ignored), not loose in the folder the job ran in."""
    pytest.importorskip("tf_keras")
    out = run_dlrun("launch", "--plain", "--max-restarts", "1", str(REPO / "examples" / "train_digits.py"),
                    "--epochs", "4", "--crash-after", "2", cwd=tmp_path, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "[0 localhost] restart 1: resuming after epoch 2" in out.stdout, out.stdout[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dlrun-logs", "dlrun-model"]
    assert sorted(p.name for p in (tmp_path / "dlrun-model").iterdir()) == ["checkpoint-digits.npz", "digits.keras"]


CUSTOM_LOOP = """import tensorflow as tf
strategy = tf.distribute.MultiWorkerMirroredStrategy()
loss = tf.keras.metrics.Mean()
for epoch in range(2):
    loss.reset_states()  # Keras 2's name: Keras 3 has reset_state() only
"""


@pytest.mark.slow  # imports keras: 2-10 s
def test_the_keras_warning_speaks_to_fit_and_to_custom_loops_alike(tmp_path: Path) -> None:
    pytest.importorskip("keras")
    from importlib.metadata import version

    if not version("keras").startswith("3."):
        pytest.skip("the warning is for Keras 3")
    if "TF_USE_LEGACY_KERAS" in os.environ:
        pytest.skip("TF_USE_LEGACY_KERAS is set here: no warning")
    script = write(tmp_path / "loop.py", CUSTOM_LOOP)
    out = run_dlrun("launch", "--dry-run", "--no-preflight", str(script), cwd=tmp_path, timeout=120)
    warning = next(line for line in out.stderr.splitlines() if "TF_USE_LEGACY_KERAS is unset" in line)
    assert "cannot model.fit" in warning and "a custom training loop written for tf.keras" in warning
    assert "Legacy Keras runs both" in warning and "--env TF_USE_LEGACY_KERAS=1" in warning
    assert "use a custom training loop" not in warning  # the script already does


def test_the_keras_warning_names_the_hosts_that_need_tf_keras() -> None:
    from dlrun.inventory import Host, Inventory
    from dlrun.run.checks import keras_warning
    from dlrun.run.config import LaunchConfig
    from dlrun.topo.records import HostReport

    inventory = Inventory(hosts=(Host(name="a", address="10.0.0.1"), Host(name="b", address="10.0.0.2")))
    reports = [HostReport(host="a", keras="3.9.9"), HostReport(host="b", keras="3.9.9", tf_keras="2.19.0")]
    text = keras_warning(LaunchConfig(script="/nonexistent/loop.py", framework="tf"), inventory, reports) or ""
    assert "model.fit" in text and "custom training loop" in text
    assert "Install tf_keras (a lacks it) and pass --env TF_USE_LEGACY_KERAS=1" in text


SHOWN = ("MASTER_ADDR", "MASTER_PORT", "TF_CONFIG", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "RANK", "WORLD_SIZE",
         "CUDA_VISIBLE_DEVICES", "DLRUN_HOST")
ENV_PRINTER = ("import json, os\n"
               f"print('ENV', json.dumps({{k: os.environ.get(k) for k in {SHOWN!r}}}, sort_keys=True))\n")


@pytest.mark.slow
@pytest.mark.ssh
def test_a_dry_run_on_ssh_hosts_shows_what_each_rank_then_gets(cluster: SshdCluster, tmp_path: Path) -> None:
    script = shared_script(cluster, "newcomer_env.py", ENV_PRINTER)  # no imports: both contracts (TF_CONFIG too)
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 2)
    hosts.write_text(hosts.read_text().replace('address = "host1"', 'address = "host1"\niface = "lo:1"', 1))
    ssh = ("--hosts", str(hosts), "--ssh-config", str(cluster.ssh_config), "--no-push", "--base-port", "24123")
    dry = run_dlrun("launch", "--dry-run", "--json", *ssh, str(script), cwd=tmp_path, timeout=120)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    planned = [{k: r["env"].get(k) for k in SHOWN} for r in json.loads(dry.stdout)["ranks"]]
    assert [p["MASTER_ADDR"] for p in planned] == [cluster.hosts[0].address] * 2  # where host0 is, not "host0"
    workers = json.loads(planned[1]["TF_CONFIG"])["cluster"]["worker"]
    assert [w.rpartition(":")[0] for w in workers] == [cluster.hosts[0].address, cluster.hosts[1].address]
    assert [p["GLOO_SOCKET_IFNAME"] for p in planned] == ["lo", "lo:1"]  # found by the probe / the inventory's
    assert not (tmp_path / "dlrun-logs").exists()  # a dry run writes nothing
    out = run_dlrun("launch", "--plain", *ssh, str(script), cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    got = {int(line.split("]")[0].strip("[").split()[0]): json.loads(line.split(" ENV ", 1)[1])
           for line in out.stdout.splitlines() if " ENV " in line}
    assert [got[0], got[1]] == planned
    # without --base-port the hosts' free ports are shown, and said to be chosen again at launch
    text = run_dlrun("launch", "--dry-run", *ssh[:-2], str(script), cwd=tmp_path, timeout=120)
    assert text.returncode == 0, text.stderr
    assert f"env:  MASTER_ADDR={cluster.hosts[0].address}" in text.stdout and "GLOO_SOCKET_IFNAME=lo:1" in text.stdout
    assert "ports: free on each host now; a launch asks again" in text.stdout


@pytest.mark.slow
@pytest.mark.ssh
def test_topo_suggests_the_interface_launch_gives_and_says_so(cluster: SshdCluster, tmp_path: Path) -> None:
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 2)
    ssh = ("--hosts", str(hosts), "--ssh-config", str(cluster.ssh_config))
    doc = json.loads(run_dlrun("topo", "--json", *ssh, cwd=tmp_path, timeout=120).stdout)
    assert doc["launch_ifaces"] == {"host0": "lo", "host1": "lo"}  # every rank on this machine: lo
    text = " ".join(run_dlrun("topo", *ssh, cwd=tmp_path, timeout=120).stdout.split())
    assert "export GLOO_SOCKET_IFNAME=lo" in text
    assert "dlrun launch sets GLOO_SOCKET_IFNAME=lo itself on every host" in text
    script = shared_script(cluster, "newcomer_env.py", ENV_PRINTER)
    out = run_dlrun("launch", "--plain", "--no-push", *ssh, str(script), cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    ifaces = [json.loads(line.split(" ENV ", 1)[1])["GLOO_SOCKET_IFNAME"] for line in out.stdout.splitlines()
              if " ENV " in line]
    assert ifaces == [doc["env"]["GLOO_SOCKET_IFNAME"]] * 2
    # an inventory iface on one host: launch's choice per host, in topo as in the ranks
    hosts.write_text(hosts.read_text().replace('address = "host1"', 'address = "host1"\niface = "lo:1"', 1))
    doc = json.loads(run_dlrun("topo", "--json", *ssh, cwd=tmp_path, timeout=120).stdout)
    assert doc["launch_ifaces"] == {"host0": "lo", "host1": "lo:1"} and "GLOO_SOCKET_IFNAME" not in doc["env"]
    assert "lo on host0; lo:1 on host1" in doc["launch_note"]


def test_a_dry_run_on_hosts_it_cannot_reach_shows_the_plan_with_a_warning(tmp_path: Path) -> None:
    hosts = write(tmp_path / "hosts.toml", '[[hosts]]\naddress = "127.0.0.9"\nport = 1\nslots = 2\n')
    out = run_dlrun("launch", "--dry-run", "--framework", "torch", "--hosts", str(hosts), "--connect-timeout", "5",
                    "train.py", cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "dlrun: warning: showing the plan as written" in out.stderr and "connection refused" in out.stderr
    assert "MASTER_ADDR=127.0.0.9" in out.stdout


@pytest.mark.ssh
def test_a_misspelled_option_starts_nothing_on_ssh_hosts_either(cluster: SshdCluster, tmp_path: Path) -> None:
    script = shared_script(cluster, "newcomer_marker.py", MARKER)
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 2)
    out = run_dlrun("launch", "--plain", "--hosts", str(hosts), "--ssh-config", str(cluster.ssh_config), "--no-push",
                    "--nproc", "2", str(script), cwd=tmp_path, timeout=120)
    assert out.returncode == 2 and "No such option '--nproc'. Did you mean '--np'?" in out.stderr, out.stderr
    assert "RAN" not in out.stdout and not Path(f"{script}.ran").exists() and "command not found" not in out.stdout
