"""The probe program run for real, as its own program through the remote bootstrap (fake
``nvidia-smi``/``ibstat`` on PATH replaying captures, the sysfs root redirected to a capture tree),
and its pure output parser."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from binascii import crc32
from pathlib import Path
from typing import Any

import pytest

from dlrun.remote import CACHE_STAGE, boot_argv, boot_payload, source_of
from dlrun.topo.parse import QUERY_GPU_BASIC_FIELDS, QUERY_GPU_FIELDS
from dlrun.topo.probe import parse_probe_output, probe_local

from support.topo_fixtures import FIXTURES, env_with_path, write_fake_tool

SYSFS_H100 = FIXTURES / "sysfs-ib" / "gpud-h100-testdata"
SMI_REPLIES = {
    "--query-gpu=": "query-gpu-csv/h100-mig-enabled-all-fields-idle-drv590.csv.txt",
    "topo -m": "topo-m/dgx1-v100-hybrid-cube-mesh-nv1-nv2-4nic-raw-tabs.txt",
    "-L": "smi-L/h100-mig-4-instances-drv590.txt",
    "": "smi-header/h100-80gb-hbm3-vm-drv580.txt",  # plain `nvidia-smi`: has "CUDA Version"
}


def run_probe(
    env: dict[str, str], timeout: float = 60, python: str = sys.executable
) -> subprocess.CompletedProcess[str]:
    """The probe as ``dlrun topo`` starts it on a host: the loader, then the program on stdin."""
    proc = subprocess.run(
        boot_argv([python], "probe"), input=boot_payload("probe"), capture_output=True, env=env, timeout=timeout
    )
    return subprocess.CompletedProcess(
        proc.args, proc.returncode, proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace")
    )


def test_probe_source_is_python38_syntax() -> None:
    source = source_of("probe")
    ast.parse(source, feature_version=(3, 8))
    assert "import tensorflow" not in source


def test_probe_queries_the_fields_the_parser_expects() -> None:
    source = source_of("probe")
    assert f'QUERY = "{",".join(QUERY_GPU_FIELDS)}"' in source
    assert f'BASIC = "{",".join(QUERY_GPU_BASIC_FIELDS)}"' in source


def _python38() -> str | None:
    """A python3.8 on PATH, or one that pyenv installed (its shim needs PYENV_VERSION)."""
    candidates = [str(p) for p in sorted(Path.home().glob(".pyenv/versions/3.8*/bin/python3.8"))]
    for found in candidates:
        try:
            check = subprocess.run(
                [found, "-c", "import sys; print(sys.version_info[:2])"],
                capture_output=True,
                text=True,
                timeout=20,
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if check.returncode == 0 and "(3, 8)" in check.stdout:
            return found
    return None


def test_probe_runs_on_python38_when_one_is_installed(tmp_path: Path) -> None:
    python38 = _python38()
    if python38 is None:
        pytest.skip("no python3.8 installed by pyenv")
    env = env_with_path(None, PATH=str(tmp_path), DLRUN_SYSFS_ROOT=str(tmp_path))
    proc = run_probe(env, python=python38)
    report = parse_probe_output("old-python", proc.stdout)
    assert report.ok, (report.error, proc.stderr)
    assert report.python is not None and report.python.startswith("3.8.")


def test_the_probe_module_runs_as_a_plain_script(tmp_path: Path) -> None:
    import dlrun.remote.probe as module

    env = env_with_path(None, PATH=str(tmp_path), DLRUN_SYSFS_ROOT=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, str(module.__file__)], capture_output=True, text=True, env=env, timeout=60, check=False
    )
    assert parse_probe_output("h", proc.stdout).ok and os.path.basename(str(module.__file__)) == "probe.py"


def test_probe_replays_fixtures_end_to_end(tmp_path: Path) -> None:
    write_fake_tool(tmp_path, "nvidia-smi", SMI_REPLIES)
    proc = run_probe(env_with_path(tmp_path, DLRUN_SYSFS_ROOT=str(SYSFS_H100)))
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.strip().splitlines()) == 1  # one JSON document
    doc = json.loads(proc.stdout)
    assert doc["commands"]["query_gpu"]["rc"] == 0
    assert "ibstat" not in doc["commands"]  # sysfs had devices: no fallback needed

    report = parse_probe_output("node1", proc.stdout)
    assert report.ok and report.reachable and report.host == "node1"
    assert report.nvidia_smi == str(tmp_path / "nvidia-smi")
    (gpu,) = report.gpus
    assert (gpu.name, gpu.memory_mib, gpu.driver, gpu.pci_address) == (
        "NVIDIA H100 80GB HBM3",
        81559,
        "590.48.01",
        "0000:00:09.0",
    )
    assert gpu.mig is True
    assert [m.profile for m in gpu.mig_devices] == ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]
    assert report.gpu_slots == 4
    assert (report.cuda_version, report.driver_version) == ("13.0", "580.159.04")
    assert report.links["GPU0"]["GPU1"] == "NV1" and report.links["GPU0"]["GPU3"] == "NV2"
    assert report.links["GPU0"]["mlx5_0"] == "PIX"
    nics = {n.name: n for n in report.nics}
    assert len(nics) == 9
    assert (nics["mlx5_1"].state, nics["mlx5_1"].rate_gbps, nics["mlx5_1"].link_layer) == (
        "ACTIVE",
        400.0,
        "InfiniBand",
    )
    assert (nics["mlx5_1"].nearest_gpus, nics["mlx5_1"].nearest_link) == ((2, 3), "PIX")
    assert nics["mlx5_bond_0"].link_layer == "Ethernet" and nics["mlx5_bond_0"].rate_gbps == 200.0
    assert nics["mlx5_4"].nearest_gpus == ()  # not in that topo capture, no NUMA file
    assert report.python == ".".join(str(v) for v in sys.version_info[:3])
    assert report.cpu_count is not None and report.cpu_count >= 1
    assert not any("nvidia-smi" in n for n in report.notes)


def test_probe_retries_query_with_basic_fields_on_an_old_driver(tmp_path: Path) -> None:
    write_fake_tool(tmp_path, "nvidia-smi", SMI_REPLIES, refuse="compute_cap")
    proc = run_probe(env_with_path(tmp_path, DLRUN_SYSFS_ROOT=str(SYSFS_H100)))
    report = parse_probe_output("old", proc.stdout)
    assert [g.name for g in report.gpus] == ["NVIDIA H100 80GB HBM3"]
    assert any("exit 2" in n and "compute_cap" in n for n in report.notes)


def test_probe_with_a_broken_driver_reports_one_problem(tmp_path: Path) -> None:
    message = (
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
        "Make sure that the latest NVIDIA driver is installed and running."
    )
    write_fake_tool(tmp_path, "nvidia-smi", SMI_REPLIES, broken=message)
    proc = run_probe(env_with_path(tmp_path, DLRUN_SYSFS_ROOT=str(SYSFS_H100)))
    report = parse_probe_output("broken", proc.stdout)
    assert report.ok and report.gpus == () and report.links == {}
    assert report.problems == (f"nvidia-smi: exit 9: {message}",)
    assert len(report.nics) == 9  # the rest of the probe still ran


def test_probe_falls_back_to_ibstat_that_exits_255(tmp_path: Path) -> None:
    empty_root = tmp_path / "root"
    empty_root.mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    write_fake_tool(
        bin_dir,
        "ibstat",
        {"": "ibstat/gpud-a100-ibpanic-partial-output-exit255.txt"},
        default_rc=255,
    )
    proc = run_probe(env_with_path(bin_dir, DLRUN_SYSFS_ROOT=str(empty_root)))
    doc = json.loads(proc.stdout)
    assert doc["commands"]["ibstat"]["rc"] == 255
    report = parse_probe_output("azure", proc.stdout)
    assert [n.name for n in report.nics] == [f"mlx5_{i}" for i in range(8)]
    assert {n.source for n in report.nics} == {"ibstat"}
    assert report.ok  # exit 255 after valid output is a note, not an error
    assert any(n.startswith("ibstat: exit 255") for n in report.notes)


def test_probe_without_nvidia_smi_reports_facts_not_errors(tmp_path: Path) -> None:
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    env = env_with_path(None, PATH=str(empty_bin), DLRUN_SYSFS_ROOT=str(tmp_path))
    proc = run_probe(env)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["commands"]["query_gpu"]["missing"] is True
    assert "fatal" not in doc
    report = parse_probe_output("cpu-box", proc.stdout)
    assert report.ok and report.error is None
    assert report.gpus == () and report.nics == () and report.links == {}
    assert report.nvidia_smi is None and report.cuda_version is None
    assert "nvidia-smi: not found on PATH (no NVIDIA GPU facts)" in report.notes
    assert "no RDMA (InfiniBand/RoCE) device" in report.notes
    assert report.cpu_count is not None and report.python is not None
    assert report.numa_nodes is None  # the redirected root has no sys/devices/system/node


def test_probe_times_out_a_hung_nvidia_smi(tmp_path: Path) -> None:
    write_fake_tool(tmp_path, "nvidia-smi", SMI_REPLIES, sleep=30)
    env = env_with_path(tmp_path, DLRUN_SYSFS_ROOT=str(SYSFS_H100), DLRUN_PROBE_TIMEOUT="0.5")
    proc = run_probe(env, timeout=20)
    report = parse_probe_output("hung", proc.stdout)
    assert report.ok and report.gpus == ()
    assert any("timed out after 0.5 s" in p for p in report.problems)


def test_tensorflow_version_from_metadata_only(tmp_path: Path) -> None:
    from importlib import metadata

    expected = None
    for dist in (
        "tensorflow",
        "tensorflow-cpu",
        "tensorflow-gpu",
        "tensorflow-macos",
        "tensorflow-intel",
        "tf-nightly",
        "tf-nightly-cpu",
    ):
        try:
            expected = metadata.version(dist)
            break
        except metadata.PackageNotFoundError:
            continue
    env = env_with_path(None, PATH=str(tmp_path), DLRUN_SYSFS_ROOT=str(tmp_path))
    proc = run_probe(env)
    report = parse_probe_output("h", proc.stdout)
    assert report.tensorflow == expected


def test_tensorflow_version_is_the_first_on_sys_path(tmp_path: Path) -> None:
    site = tmp_path / "site"
    (site / "tensorflow_cpu-9.9.9.dist-info").mkdir(parents=True)
    (site / "tensorflow-8.8.8.dist-info").mkdir()
    (site / "tf_keras-9.9.9.dist-info").mkdir()
    env = env_with_path(None, PATH=str(tmp_path), DLRUN_SYSFS_ROOT=str(tmp_path), PYTHONPATH=str(site))
    report = parse_probe_output("h", run_probe(env).stdout)
    assert report.tensorflow == "8.8.8"  # "tensorflow" before "tensorflow-cpu", as importlib.metadata orders


def test_without_ip_the_interfaces_come_from_the_kernel(tmp_path: Path) -> None:
    env = env_with_path(None, PATH=str(tmp_path), DLRUN_SYSFS_ROOT=str(tmp_path))  # no `ip`, no nvidia-smi
    report = parse_probe_output("h", run_probe(env).stdout)
    assert report.ok
    assert any(i.name == "lo" and "127.0.0.1" in i.ipv4 for i in report.interfaces)


def test_probe_local_runs_without_ssh() -> None:
    report = probe_local()
    assert report.host == "localhost" and report.reachable
    assert report.error is None, report.error
    assert report.python is not None and report.cpu_count is not None


def test_probe_local_reports_a_missing_python() -> None:
    report = probe_local(python="/nonexistent/python3")
    assert report.error is not None and "could not start" in report.error


@pytest.mark.parametrize(
    ("stdout", "needle"),
    [
        ("", "empty output"),
        ("bash: python3: command not found\n", "command not found"),
        ("[1, 2]", "no JSON"),
    ],
)
def test_parse_probe_output_without_a_document(stdout: str, needle: str) -> None:
    report = parse_probe_output("h", stdout)
    assert report.reachable and report.error is not None and needle in report.error


def test_parse_probe_output_skips_login_noise_and_bad_types() -> None:
    doc = {
        "version": 1,
        "cpu_count": "many",  # wrong type: ignored
        "python": "3.8.18",
        "numa_nodes": [0, 1],
        "commands": {"query_gpu": {"missing": True}, "ip_addr": {"rc": 0, "stdout": 42}},
        "sysfs": {"sys/class/infiniband/mlx5_0/ports/1/state": "4: ACTIVE", "bad": 3},
        "interfaces_ioctl": [{"name": "eth0", "ipv4": ["10.1.2.3", 7]}, "junk"],
        "proc_net_route": "Iface\tDestination\tGateway\tFlags\tRefCnt\tUse\tMetric\tMask\n"
        "eth0\t00000000\t0102010A\t0003\t0\t0\t0\t00000000\n",
        "tensorflow": {"dist": "tensorflow", "version": "2.21.0"},
    }
    stdout = "Welcome to node7!\n" + json.dumps(doc) + "\n"
    report = parse_probe_output("node7", stdout)
    assert report.ok and report.cpu_count is None and report.numa_nodes == 2
    assert report.python == "3.8.18" and report.tensorflow == "2.21.0"
    assert [(n.name, n.state) for n in report.nics] == [("mlx5_0", "ACTIVE")]
    assert [(i.name, i.ipv4, i.default_route) for i in report.interfaces] == [
        ("eth0", ("10.1.2.3",), True)
    ]
    assert report.default_interface is not None and report.default_interface.name == "eth0"


def test_parse_probe_output_fatal_is_an_error() -> None:
    report = parse_probe_output(
        "h", json.dumps({"version": 1, "fatal": "OSError: boom\ntraceback"})
    )
    assert report.reachable and report.error == "the probe failed: OSError: boom"


def stub_torch_site(site: Path, version: str, cuda: str | None, nccl: str | None) -> Path:
    """A site folder whose metadata says torch ``version`` (built with ``cuda``) and NCCL."""
    (site / f"torch-{version}.dist-info").mkdir(parents=True)
    (site / "torch").mkdir()
    (site / "torch" / "version.py").write_text(
        f"from typing import Optional\n__version__ = '{version}'\ncuda: Optional[str] = {cuda!r}\n")
    if nccl:
        (site / f"nvidia_nccl_cu13-{nccl}.dist-info").mkdir()
    (site / "keras-3.9.9.dist-info").mkdir()
    return site


def test_torch_its_cuda_build_and_nccl_from_metadata_without_importing_torch(tmp_path: Path) -> None:
    site = stub_torch_site(tmp_path / "site", "2.11.0+cu130", "13.0", "2.28.9")
    (site / "torch" / "__init__.py").write_text("raise SystemExit('the probe must not import torch')\n")
    env = env_with_path(None, PATH=str(tmp_path), DLRUN_SYSFS_ROOT=str(tmp_path), PYTHONPATH=str(site))
    report = parse_probe_output("h", run_probe(env).stdout)
    assert (report.torch, report.torch_cuda, report.nccl, report.keras) == ("2.11.0+cu130", "13.0", "2.28.9", "3.9.9")
    cpu = stub_torch_site(tmp_path / "cpu", "2.13.0+cpu", None, None)
    env = env_with_path(None, PATH=str(tmp_path), DLRUN_SYSFS_ROOT=str(tmp_path), PYTHONPATH=str(cpu))
    report = parse_probe_output("h", run_probe(env).stdout)
    assert (report.torch, report.torch_cuda, report.nccl) == ("2.13.0+cpu", None, None)


# --------------------------------------------------------------------------- the GPU cache


def logged_smi(tmp_path: Path, **fake: Any) -> tuple[Path, Path]:
    """(bin folder, log): ``nvidia-smi`` replaying the captures and logging each call's argv."""
    real, bin_dir, log = tmp_path / "real", tmp_path / "bin", tmp_path / "calls.log"
    real.mkdir(exist_ok=True)
    bin_dir.mkdir(exist_ok=True)
    write_fake_tool(real, "nvidia-smi", SMI_REPLIES, **fake)
    wrapper = bin_dir / "nvidia-smi"
    wrapper.write_text(f"#!/bin/sh\necho \"$*\" >> {log}\nexec {real / 'nvidia-smi'} \"$@\"\n")
    wrapper.chmod(0o755)
    return bin_dir, log


def calls(log: Path) -> list[str]:
    """The calls since the last look (the log is emptied)."""
    lines = log.read_text().splitlines() if log.exists() else []
    log.write_text("")
    return sorted("header" if not line else line.split()[0] for line in lines)


def probed(env: dict[str, str], payload: bytes | None = None, prefix: tuple[str, ...] = ()) -> dict[str, Any]:
    proc = subprocess.run([*prefix, *boot_argv([sys.executable], "probe")], input=payload or boot_payload("probe"),
                          capture_output=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    doc: dict[str, Any] = json.loads(proc.stdout)
    return doc


FRESH = ["--query-gpu=index,uuid,name,pci.bus_id,memory.total,driver_version,compute_cap,mig.mode.current", "-L"]
EVERY = sorted([*FRESH, "topo", "header"])


def test_the_second_probe_takes_topology_and_header_from_the_cache(tmp_path: Path) -> None:
    bin_dir, log = logged_smi(tmp_path)
    env = env_with_path(bin_dir, DLRUN_SYSFS_ROOT=str(SYSFS_H100), XDG_CACHE_HOME=str(tmp_path / "xdg"))
    first = probed(env)
    assert calls(log) == EVERY
    entries = list((tmp_path / "xdg" / "dlrun" / "probe").iterdir())
    assert len(entries) == 1 and entries[0].stat().st_mode & 0o777 == 0o600
    second = probed(env)
    assert calls(log) == sorted(FRESH)  # the GPU list and MIG state are asked every time
    assert second["commands"]["topo"]["cached"] is True and "cached" not in second["commands"]["query_gpu"]
    for name in ("topo", "header"):
        assert {**second["commands"][name], "cached": None} == {**first["commands"][name], "cached": None}
    assert parse_probe_output("n", json.dumps(second)) == parse_probe_output("n", json.dumps(first))


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="a PID namespace needs root")
def test_probes_with_the_same_pid_leave_each_others_entries_alone(tmp_path: Path) -> None:
    """Agents in PID namespaces of their own share pids (1, 2), and hosts may share a home: a
    writer never takes, or deletes, another writer's temporary file."""
    bin_dir, log = logged_smi(tmp_path)
    env = env_with_path(bin_dir, DLRUN_SYSFS_ROOT=str(SYSFS_H100), XDG_CACHE_HOME=str(tmp_path / "xdg"))
    probed(env)
    [entry] = list((tmp_path / "xdg" / "dlrun" / "probe").iterdir())
    entry.unlink()
    others = [entry.with_name(f"{entry.name}.{pid}.tmp") for pid in (1, 2)]  # other hosts' probes, writing
    for other in others:
        other.write_bytes(b"half written")
        other.chmod(0o600)
    calls(log)
    probed(env, prefix=("unshare", "--pid", "--fork", "--kill-child"))
    assert entry.is_file() and [other.read_bytes() for other in others] == [b"half written"] * 2
    calls(log)
    probed(env)
    assert calls(log) == sorted(FRESH)  # the entry the pid-1 probe wrote is used


def test_a_changed_key_probes_afresh(tmp_path: Path) -> None:
    bin_dir, log = logged_smi(tmp_path)
    env = env_with_path(bin_dir, DLRUN_SYSFS_ROOT=str(SYSFS_H100), XDG_CACHE_HOME=str(tmp_path / "xdg"))
    probed(env)
    calls(log)
    os.utime(bin_dir / "nvidia-smi", ns=(1, 1))  # another nvidia-smi binary (a driver update)
    probed(env)
    assert calls(log) == EVERY
    probed(env)
    assert calls(log) == sorted(FRESH)
    changed = source_of("probe").encode() + b"\n# another version of the probe\n"
    stage = CACHE_STAGE.encode()
    probed(env, b"+%09d" % len(stage) + stage + b"%010d" % len(changed) + changed)
    assert calls(log) == EVERY


def test_an_answer_while_nvidia_smi_changes_is_not_cached(tmp_path: Path) -> None:
    bin_dir, log = logged_smi(tmp_path)
    wrapper = bin_dir / "nvidia-smi"
    wrapper.write_text(wrapper.read_text().replace("exec ", f"touch -d @1 {wrapper}\nexec ", 1))  # a driver update
    env = env_with_path(bin_dir, DLRUN_SYSFS_ROOT=str(SYSFS_H100), XDG_CACHE_HOME=str(tmp_path / "xdg"))
    probed(env)
    folder = tmp_path / "xdg" / "dlrun" / "probe"
    assert not folder.exists() or not any(folder.iterdir())
    assert calls(log) == EVERY


def test_a_failed_answer_is_not_cached(tmp_path: Path) -> None:
    bin_dir, log = logged_smi(tmp_path, broken="NVIDIA-SMI has failed because it couldn't communicate with the driver")
    env = env_with_path(bin_dir, DLRUN_SYSFS_ROOT=str(SYSFS_H100), XDG_CACHE_HOME=str(tmp_path / "xdg"))
    probed(env)
    probed(env)
    assert calls(log).count("topo") == 2
    folder = tmp_path / "xdg" / "dlrun" / "probe"
    assert not folder.exists() or not any(folder.iterdir())


def forge(entry: bytes) -> bytes:
    """``entry`` (header and key, CRC-32 of the answers in 8 hex digits, the answers) with the
    link matrix's NV1 made NV9 and a checksum that fits."""
    at = entry.index(b"\n", entry.index(b"\nprobe ") + 1) + 1  # the key's last line names the probe
    head, body = entry[:at], entry[at + 8:].replace(b"NV1", b"NV9")
    return head + b"%08x" % crc32(body) + body


@pytest.mark.parametrize("how", ["tampered", "group-readable", "symlink", "foreign owner", "open folder"])
def test_a_bad_cache_entry_is_ignored(how: str, tmp_path: Path) -> None:
    bin_dir, log = logged_smi(tmp_path)
    env = env_with_path(bin_dir, DLRUN_SYSFS_ROOT=str(SYSFS_H100), XDG_CACHE_HOME=str(tmp_path / "xdg"))
    probed(env)
    folder = tmp_path / "xdg" / "dlrun" / "probe"
    [entry] = list(folder.iterdir())
    forged = forge(entry.read_bytes())  # a checksum that fits: only place and mode reject it
    if how == "tampered":
        entry.write_bytes(entry.read_bytes().replace(b"NV1", b"NV9"))
    elif how == "group-readable":
        entry.write_bytes(forged)
        entry.chmod(0o640)
    elif how == "symlink":
        (tmp_path / "elsewhere").write_bytes(forged)
        (tmp_path / "elsewhere").chmod(0o600)
        entry.unlink()
        entry.symlink_to(tmp_path / "elsewhere")
    elif how == "foreign owner":
        if os.geteuid() != 0:
            pytest.skip("needs root to give the entry away")
        entry.write_bytes(forged)
        os.chown(entry, 65534, 65534)
    elif how == "open folder":
        entry.write_bytes(forged)
        folder.chmod(0o777)
    calls(log)
    doc = probed(env)
    assert calls(log) == EVERY
    assert "cached" not in doc["commands"]["topo"]
    assert parse_probe_output("n", json.dumps(doc)).links["GPU0"]["GPU1"] == "NV1"


def test_a_well_formed_forgery_would_be_read(tmp_path: Path) -> None:
    """The control for the test above: the checks, not a stale key, reject those entries."""
    bin_dir, _log = logged_smi(tmp_path)
    env = env_with_path(bin_dir, DLRUN_SYSFS_ROOT=str(SYSFS_H100), XDG_CACHE_HOME=str(tmp_path / "xdg"))
    probed(env)
    [entry] = list((tmp_path / "xdg" / "dlrun" / "probe").iterdir())
    assert entry.read_bytes().startswith(b"dlrun-probe 2 " + entry.name.encode() + b"\nboot ")  # the key, whole
    entry.write_bytes(forge(entry.read_bytes()))
    doc = probed(env)
    assert doc["commands"]["topo"]["cached"] is True
    assert parse_probe_output("n", json.dumps(doc)).links["GPU0"]["GPU1"] == "NV9"
