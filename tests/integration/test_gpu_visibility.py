"""Which GPUs ranks see on a host whose nvidia-smi reports 4 GPUs: torch and Horovod ranks index
their own with ``cuda:LOCAL_RANK``; TF workers never share one."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from support.cli import run_dlrun
from support.topo_fixtures import env_with_path

UUIDS = [f"GPU-0000000{i}-1111-2222-3333-444444444444" for i in range(4)]
QUERY = "index, uuid, name, pci.bus_id, memory.total [MiB], driver_version, compute_cap, mig.mode.current\n" + "".join(
    f"{i}, {u}, NVIDIA H100 80GB HBM3, 00000000:0{i + 1}:00.0, 81559 MiB, 580.159.04, 9.0, Disabled\n"
    for i, u in enumerate(UUIDS))
SCRIPT = ("import json, os\nprint('SEEN ' + json.dumps({k: os.environ.get(k) for k in "
          "('DLRUN_LOCAL_RANK', 'CUDA_VISIBLE_DEVICES')}), flush=True)\n")


def four_gpu_host(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "query.csv").write_text(QUERY)
    tool = bin_dir / "nvidia-smi"
    tool.write_text('#!/bin/sh\ncase "$1" in --query-gpu=*) cat "$(dirname "$0")/query.csv";; '
                    "*) echo 'not in this stub'; exit 255;; esac\n")
    tool.chmod(0o755)
    return env_with_path(bin_dir, DLRUN_SYSFS_ROOT=str(tmp_path))


def seen(tmp_path: Path, framework: str) -> list[dict[str, str]]:
    script = tmp_path / "seen.py"
    script.write_text(SCRIPT)
    out = run_dlrun("launch", "--plain", "--framework", framework, "--np", "4", "--hosts", "localhost:4",
                    str(script), env=four_gpu_host(tmp_path), cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return [json.loads(m) for m in re.findall(r"SEEN (\{.*\})", out.stdout)]


@pytest.mark.parametrize("framework", ["torch", "horovod"])
def test_each_ranks_local_rank_indexes_a_gpu_it_sees(tmp_path: Path, framework: str) -> None:
    ranks = seen(tmp_path, framework)
    assert len(ranks) == 4
    for rank in ranks:
        visible = rank["CUDA_VISIBLE_DEVICES"].split(",")
        assert visible == UUIDS  # the host's GPUs for the job, in order: cuda:LOCAL_RANK is its own
        assert visible[int(rank["DLRUN_LOCAL_RANK"])] == UUIDS[int(rank["DLRUN_LOCAL_RANK"])]


def test_tf_workers_never_share_a_gpu(tmp_path: Path) -> None:
    ranks = seen(tmp_path, "tf")
    assert sorted(r["CUDA_VISIBLE_DEVICES"] for r in ranks) == UUIDS


def test_a_host_that_keeps_the_user_to_some_gpus_gets_ranks_on_those_only(tmp_path: Path) -> None:
    # a shared machine: `export CUDA_VISIBLE_DEVICES=2,3` (or a Slurm step); torchrun's ranks inherit it
    script = tmp_path / "seen.py"
    script.write_text(SCRIPT)
    host = four_gpu_host(tmp_path)
    out = run_dlrun("launch", "--plain", "--framework", "torch", str(script), cwd=tmp_path, timeout=120,
                    env={**host, "CUDA_VISIBLE_DEVICES": f"2,{UUIDS[3][:12]}"})
    assert out.returncode == 0, out.stdout + out.stderr
    ranks = [json.loads(m) for m in re.findall(r"SEEN (\{.*\})", out.stdout)]
    assert len(ranks) == 2  # one per GPU the user may use, not 4 (before: GPU-0 to GPU-3, others' too)
    assert {r["CUDA_VISIBLE_DEVICES"] for r in ranks} == {f"{UUIDS[2]},{UUIDS[3]}"}
    topo = run_dlrun("topo", cwd=tmp_path, timeout=120, env={**host, "CUDA_VISIBLE_DEVICES": "2,3"})
    assert "CUDA_VISIBLE_DEVICES='2,3' on this host: jobs use 2 of its GPUs" in topo.stdout, topo.stdout


def test_a_dry_run_here_shows_the_gpus_the_launch_gives(tmp_path: Path) -> None:
    (tmp_path / "seen.py").write_text(SCRIPT)
    out = run_dlrun("launch", "--dry-run", "--json", "--framework", "torch", "--hosts", "localhost", "seen.py",
                    env=four_gpu_host(tmp_path), cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    ranks = json.loads(out.stdout)["ranks"]
    # before: 1 rank without CUDA_VISIBLE_DEVICES, while the launch started 4 on the 4 GPUs
    assert len(ranks) == 4 and {r["env"]["CUDA_VISIBLE_DEVICES"] for r in ranks} == {",".join(UUIDS)}


@pytest.mark.parametrize("hidden", ["", "-1"])
def test_a_host_that_hides_every_gpu_runs_a_cpu_rank_not_an_error(tmp_path: Path, hidden: str) -> None:
    (tmp_path / "seen.py").write_text(SCRIPT)
    out = run_dlrun("launch", "--dry-run", "--json", "--framework", "torch", "--hosts", "localhost", "seen.py",
                    env={**four_gpu_host(tmp_path), "CUDA_VISIBLE_DEVICES": hidden}, cwd=tmp_path, timeout=120)
    # before the review's fix: "1 slots but only 0 GPU slots … ranks would have to share a GPU"
    assert out.returncode == 0, out.stdout + out.stderr
    ranks = json.loads(out.stdout)["ranks"]
    assert len(ranks) == 1 and "CUDA_VISIBLE_DEVICES" not in ranks[0]["env"]
