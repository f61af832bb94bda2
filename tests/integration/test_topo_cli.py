"""`dlrun topo` and the launch preflight, end to end: the real CLI, the real probe program,
fake `nvidia-smi` replaying real captures, locally and over sshd hosts."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from support.cli import run_dlrun
from support.ssh_jobs import hosts_toml, shared_script
from support.sshd_cluster import SshdCluster
from support.topo_fixtures import FIXTURES, env_with_path, write_fake_tool

SYSFS = FIXTURES / "sysfs-ib" / "gpud-h100-testdata"
LEGEND = {  # a matrix of 4 GPUs and 4 NICs named NIC0..NIC3 in its legend; plain GPUs, no MIG
    "--query-gpu=": "query-gpu-csv/h100-80gb-hbm3-all-fields-idle-drv590.csv.txt",
    "topo -m": "topo-m/asus-esc8000a-4x-rtx6000ada-4nic-cx7-node-sys-gpu-numa-id.txt",
    "-L": "smi-L/h100-mig-4-instances-drv590.txt",
    "": "smi-header/h100-80gb-hbm3-vm-drv580.txt",
}
MIG = {  # one H100 with MIG on and 4 instances: 4 slots, one MIG device each
    "--query-gpu=": "query-gpu-csv/h100-mig-enabled-all-fields-idle-drv590.csv.txt",
    "topo -m": "topo-m/h100-80gb-hbm3-single-gpu-raw-tabs-drv590.txt",
    "-L": "smi-L/h100-mig-4-instances-drv590.txt",
    "": "smi-header/h100-80gb-hbm3-vm-drv580.txt",
}
ONE_GPU = {  # one H100, no MIG
    "--query-gpu=": "query-gpu-csv/h100-80gb-hbm3-all-fields-idle-drv590.csv.txt",
    "topo -m": "topo-m/h100-80gb-hbm3-single-gpu-raw-tabs-drv590.txt",
    "": "smi-header/h100-80gb-hbm3-vm-drv580.txt",
}
HOST_KEYS = {"host", "reachable", "gpus", "cuda_version", "links", "nics", "findings"}
GPU_KEYS = {"index", "name", "uuid", "pci_bus_id", "memory_mib", "driver", "mig"}
NIC_KEYS = {"name", "port", "state", "rate_gbps", "link_layer", "netdev"}


def check_shape(doc: dict[str, Any]) -> None:
    assert set(doc) >= {"hosts", "findings"}
    for host in doc["hosts"]:
        assert set(host) >= HOST_KEYS
        for gpu in host["gpus"]:
            assert set(gpu) >= GPU_KEYS and isinstance(gpu["index"], int) and isinstance(gpu["mig"], bool)
        for nic in host["nics"]:
            assert set(nic) >= NIC_KEYS
        for finding in host["findings"]:
            assert finding["severity"] in ("error", "warning", "info") and isinstance(finding["message"], str)


def test_local_topo_json_with_replayed_nvidia_smi(tmp_path: Path) -> None:
    write_fake_tool(tmp_path, "nvidia-smi", LEGEND)
    env = env_with_path(tmp_path, DLRUN_SYSFS_ROOT=str(SYSFS))
    out = run_dlrun("topo", "--json", env=env, cwd=tmp_path)
    assert out.returncode in (0, 1), out.stderr
    doc = json.loads(out.stdout)
    check_shape(doc)
    (host,) = doc["hosts"]
    assert host["reachable"] and host["gpus"] and host["cuda_version"]
    assert "mlx5_1" in host["links"]["GPU0"] and "NIC0" not in host["links"]["GPU0"]
    assert {n["name"] for n in host["nics"]} >= {"mlx5_0", "mlx5_bond_0"}
    text = run_dlrun("topo", env=env, cwd=tmp_path)
    assert "GPU0" in text.stdout and "mlx5_0" in text.stdout


def test_the_default_job_on_a_one_gpu_machine_starts_one_rank(tmp_path: Path) -> None:
    # 'dlrun launch train.py' asks for nothing: its 2 ranks must not become a preflight error here
    write_fake_tool(tmp_path, "nvidia-smi", ONE_GPU)
    script = tmp_path / "gpus.py"
    script.write_text("import os\nprint('GPU', os.environ['DLRUN_RANK'], os.environ.get('CUDA_VISIBLE_DEVICES'))\n")
    env = env_with_path(tmp_path, DLRUN_SYSFS_ROOT=str(tmp_path))
    out = run_dlrun("launch", "--plain", "--framework", "none", str(script), env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.findall(r"\] GPU (\d) GPU-", out.stdout) == ["0"], out.stdout  # one rank, given the GPU
    assert "1 GPU here: starting 1 rank, not 2" in out.stderr
    asked = run_dlrun("launch", "--plain", "--framework", "none", "-n", "2", str(script), env=env, cwd=tmp_path)
    assert asked.returncode == 1 and "2 slots but only 1 GPUs" in asked.stderr  # asked for: still refused


def test_local_topo_without_gpus_is_clean(tmp_path: Path) -> None:
    out = run_dlrun("topo", "--json", env=env_with_path(None, PATH="/usr/bin:/bin", DLRUN_SYSFS_ROOT=str(tmp_path)),
                    cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    check_shape(doc)
    assert doc["hosts"][0]["gpus"] == [] and doc["hosts"][0]["nics"] == []
    names = [i["name"] for i in doc["hosts"][0]["interfaces"]]
    text = run_dlrun("topo", env=env_with_path(None, PATH="/usr/bin:/bin", DLRUN_SYSFS_ROOT=str(tmp_path)),
                     cwd=tmp_path)
    line = next(x for x in text.stdout.splitlines() if x.startswith("interfaces"))
    assert names and all(name in line for name in names)  # what --iface may name, shown per host


def fake_gpu_python(cluster: SshdCluster, tmp: Path, replies: dict[str, str]) -> str:
    """A host `python` that sees fake nvidia-smi and the fixture sysfs: what the probe and ranks run."""
    bin_dir = cluster.scripts / f"fake-bin-{tmp.name}"
    bin_dir.mkdir(exist_ok=True)
    bin_dir.chmod(0o755)
    write_fake_tool(bin_dir, "nvidia-smi", replies)
    return f"env PATH={bin_dir}:/usr/bin:/bin DLRUN_SYSFS_ROOT={SYSFS} {cluster.python}"


@pytest.mark.ssh
def test_topo_over_ssh_reports_each_host_and_unreachable_ones(cluster: SshdCluster, tmp_path: Path) -> None:
    python = fake_gpu_python(cluster, tmp_path, LEGEND)
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 2, python=python)
    with hosts.open("a") as fh:
        fh.write('[[hosts]]\naddress = "127.0.0.9"\nport = 2299\n')
    out = run_dlrun("topo", "--json", "--hosts", str(hosts), "--ssh-config", str(cluster.ssh_config),
                    "--connect-timeout", "10", cwd=tmp_path, timeout=120)  # refused at once; bounds the others too
    assert out.returncode == 1, out.stdout + out.stderr  # the unreachable host is an error finding
    doc = json.loads(out.stdout)
    check_shape(doc)
    by_host = {h["host"]: h for h in doc["hosts"]}
    assert by_host["host0"]["reachable"] and by_host["host1"]["reachable"] and len(by_host["host1"]["gpus"]) > 0
    assert by_host["127.0.0.9"]["reachable"] is False
    assert any(f["severity"] == "error" and "127.0.0.9" in (f.get("host") or f["message"]) for f in doc["findings"])


@pytest.mark.ssh
def test_preflight_sets_slots_and_cuda_visible_devices(cluster: SshdCluster, tmp_path: Path) -> None:
    python = fake_gpu_python(cluster, tmp_path, MIG)
    script = shared_script(cluster, "gpus.py", "import os\nprint('GPU', os.environ['DLRUN_LOCAL_RANK'], "
                           "os.environ.get('CUDA_VISIBLE_DEVICES'))\n")
    hosts = tmp_path / "hosts.toml"
    hosts.write_text(f'[[hosts]]\naddress = "host0"\npython = "{python}"\n')  # slots unset: from the GPUs
    out = run_dlrun("launch", "--plain", "--hosts", str(hosts), "--ssh-config", str(cluster.ssh_config), str(script),
                    cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    devices = dict(re.findall(r"\] GPU (\d+) (\S+)", out.stdout))
    assert len(devices) == 4, out.stdout  # slots unset → one rank per MIG instance
    assert devices["0"] == "MIG-00000000-0000-0000-0000-000000000000"
    assert devices["3"] == "MIG-00000003-0000-0000-0000-000000000003"


@pytest.mark.ssh
def test_preflight_error_stops_launch_before_anything_starts(cluster: SshdCluster, tmp_path: Path) -> None:
    python = fake_gpu_python(cluster, tmp_path, LEGEND)
    marker = cluster.hosts[0].workdir / "preflight-started"
    script = shared_script(cluster, "mark2.py", f"open({str(marker)!r}, 'w').write('x')\n")
    hosts = tmp_path / "hosts.toml"
    hosts.write_text(f'[[hosts]]\naddress = "host0"\nslots = 64\npython = "{python}"\n')
    out = run_dlrun("launch", "--plain", "--hosts", str(hosts), "--ssh-config", str(cluster.ssh_config), str(script),
                    cwd=tmp_path, timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "preflight found" in out.stderr and "nothing was started" in out.stderr
    assert not marker.exists()
    out = run_dlrun("launch", "--plain", "--no-preflight", "--np", "1", "--hosts", str(hosts), "--ssh-config",
                    str(cluster.ssh_config), str(script), cwd=tmp_path, timeout=120)
    assert out.returncode == 0 and marker.exists()
