"""GPUs while the job runs: real ``dlrun launch`` runs whose hosts' ``nvidia-smi`` is a stub
script first on the agent's PATH (this machine: dlrun's own environment; an sshd host: its
``python`` runs through ``env PATH=…``), reporting 4 GPUs with GPU 0 busy and 1-3 idle.

Each rank waits on the stub's own record of its calls, not on a clock: a job ends once the
samples it needs were taken.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
from pathlib import Path

import pytest

from support.cli import run_dlrun
from support.gpu_stub import FOUR_GPUS, WAIT_FOR_SAMPLES, printing, stub
from support.ssh_jobs import shared_script
from support.sshd_cluster import SshdCluster


def job_dir(tmp_path: Path, out: str) -> Path:
    match = re.search(r"logs in (\S+)/", out)
    assert match, out
    return tmp_path / match.group(1)


def launch_here(tmp_path: Path, stub_dir: Path | None, *args: str, calls: Path, span: float = 0, n_calls: int = 1,
                code: int = 0) -> tuple[int, str]:
    script = tmp_path / "wait.py"
    script.write_text(WAIT_FOR_SAMPLES)
    path = os.environ["PATH"] if stub_dir is None else f"{stub_dir}{os.pathsep}{os.environ['PATH']}"
    out = run_dlrun("launch", "--plain", "--no-preflight", "--grace", "2", *args, str(script), str(calls),
                    str(span), str(n_calls), str(code), cwd=tmp_path, timeout=180, env={"PATH": path})
    return out.returncode, out.stdout + out.stderr


@pytest.mark.slow
def test_a_busy_gpu_beside_three_idle_ones_is_shown_recorded_and_warned_once(tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    stub_dir = stub(tmp_path / "bin", calls, printing(FOUR_GPUS))
    code, out = launch_here(tmp_path, stub_dir, "-n", "2", "--gpu-every", "0.5", "--gpu-idle-after", "10",
                            calls=calls, span=13)  # 3 s for the sample that makes it due, on a loaded machine
    assert code == 0, out
    assert "dlrun: gpu localhost util 97 0 0 0 % mem 70.0 0.0 0.0 0.0/80 GiB" in out
    warning = ("localhost: GPUs 1,2,3 are idle for 1")  # 10 to 13 s: the sample that made it due
    live = [line for line in out.splitlines() if line.startswith(f"dlrun: warning: {warning}")]
    assert len(live) == 2, out  # once while it runs, once more in the summary
    assert live[0].endswith("s while GPU 0 is busy: do all ranks use cuda:0? Call torch.cuda.set_device(LOCAL_RANK)")
    assert "gpu localhost: util 97 0 0 0 % (mean) · memory 70.0 0.0 0.0 0.0/80 GiB (peak)" in out
    with open(job_dir(tmp_path, out) / "gpu.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert {r["gpu"] for r in rows} == {"0", "1", "2", "3"} and {r["host"] for r in rows} == {"localhost"}
    assert {r["util"] for r in rows if r["gpu"] == "0"} == {"97"}
    assert rows[0].keys() == {"time", "host", "gpu", "util", "mem_used_mib", "mem_total_mib", "power_w", "temp_c"}


def test_the_api_result_carries_the_gpu_summary_and_warnings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import dlrun

    calls = tmp_path / "calls"
    stub_dir = stub(tmp_path / "bin", calls, printing(FOUR_GPUS))
    monkeypatch.setenv("PATH", f"{stub_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "wait.py"
    script.write_text(WAIT_FOR_SAMPLES)
    from io import StringIO

    from dlrun.run.view import PlainView

    shown = StringIO()
    result = dlrun.launch(script, [str(calls), "2", "1", "0"], np=1, job=dlrun.JobOptions(preflight=False),
                          output=dlrun.OutputOptions(gpu_every=0.3, gpu_idle_after=1), view=PlainView(shown))
    assert result.exit_code == 0, shown.getvalue()
    assert [(g["host"], g["gpu"], g["mean_util"], g["peak_mem_gib"], g["mem_total_gib"]) for g in result.gpu_summary] \
        == [("localhost", i, 97.0 if i == 0 else 0.0, 70.0 if i == 0 else 0.0, 79.6) for i in range(4)]
    assert len(result.gpu_warnings) == 1 and result.gpu_warnings[0].startswith("localhost: GPUs 1,2,3 are idle")


def test_no_nvidia_smi_no_sampling_and_no_word_of_it(tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    calls.write_text("0\n")
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                           if not (Path(p) / "nvidia-smi").exists())
    script = tmp_path / "wait.py"
    script.write_text(WAIT_FOR_SAMPLES)
    out = run_dlrun("launch", "--plain", "--no-preflight", "-n", "1", "--gpu-every", "0.2", str(script), str(calls),
                    "0", "1", "0", cwd=tmp_path, timeout=120, env={"PATH": path})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "gpu" not in (out.stdout + out.stderr).lower()
    assert not (job_dir(tmp_path, out.stdout) / "gpu.csv").exists()


@pytest.mark.slow
@pytest.mark.parametrize(("body", "message"), [
    ("echo 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver'; exit 9",
     "GPU sampling failed (nvidia-smi exited 9: NVIDIA-SMI has failed because it could not communicate with the"
     " NVIDIA driver); the job goes on"),
    ("exec sleep 60", "GPU sampling failed (nvidia-smi did not answer within 5 s); the job goes on"),
], ids=["fails", "hangs"])
@pytest.mark.parametrize("rank_code", [0, 3])
def test_a_failing_or_hung_nvidia_smi_is_named_once_and_leaves_the_exit_code(
        tmp_path: Path, body: str, message: str, rank_code: int) -> None:
    calls = tmp_path / "calls"
    stub_dir = stub(tmp_path / "bin", calls, body)
    # two calls: the first one's end (and its frame) came before the second started
    code, out = launch_here(tmp_path, stub_dir, "-n", "1", "--gpu-every", "0.2", calls=calls, n_calls=2,
                            code=rank_code)
    assert code == rank_code, out
    assert out.count(message) == 1, out
    assert f"dlrun: localhost: {message}" in out


@pytest.mark.slow
@pytest.mark.ssh
def test_an_ssh_host_with_gpus_and_one_without(cluster: SshdCluster, tmp_path: Path) -> None:
    calls = cluster.scripts / "gpu-calls"
    calls.write_text("")
    calls.chmod(0o666)
    stub_dir = cluster.scripts / "gpu-bin"
    stub(stub_dir, calls, printing(FOUR_GPUS))
    stub_dir.chmod(0o755)
    script = shared_script(cluster, "gpu_wait.py", WAIT_FOR_SAMPLES)
    # host0's agent (and ranks) find the stub first on PATH; host1 has no nvidia-smi at all
    python = json.dumps(f"env PATH={stub_dir}:/usr/local/bin:/usr/bin:/bin {cluster.python}")
    h0, h1 = cluster.hosts[:2]
    inventory = tmp_path / "hosts.toml"
    inventory.write_text(
        f'[[hosts]]\naddress = "{h0.name}"\nslots = 1\nworkdir = {json.dumps(str(h0.workdir))}\npython = {python}\n\n'
        f'[[hosts]]\naddress = "{h1.name}"\nslots = 1\nworkdir = {json.dumps(str(h1.workdir))}\n'
        f'python = {json.dumps(cluster.python)}\n')
    out = run_dlrun("launch", "--plain", "--no-preflight", "--no-push", "--grace", "2", "--hosts", str(inventory),
                    "--ssh-config", str(cluster.ssh_config), "--gpu-every", "0.5", "--gpu-idle-after", "10",
                    str(script), str(calls), "13", "1", "0", cwd=tmp_path, timeout=180)  # 10 s idle, and room
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert f"dlrun: gpu {h0.name} util 97 0 0 0 % mem 70.0 0.0 0.0 0.0/80 GiB" in text
    assert len([line for line in text.splitlines()
                if line.startswith(f"dlrun: warning: {h0.name}: GPUs 1,2,3 are idle for 1")]) == 2, text
    assert f"gpu {h0.name}: util 97 0 0 0 % (mean)" in text
    assert f"gpu {h1.name}" not in text and "GPU sampling failed" not in text
    with open(job_dir(tmp_path, out.stdout) / "gpu.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert {(r["host"], r["gpu"]) for r in rows} == {(h0.name, str(i)) for i in range(4)}


@pytest.mark.spark
@pytest.mark.skipif(shutil.which("java") is None and not os.environ.get("JAVA_HOME"), reason="no Java")
def test_spark_tasks_on_one_machine_sample_its_gpus_once(tmp_path: Path) -> None:
    pytest.importorskip("pyspark", reason="pip install 'dlrun[spark]'")
    calls = tmp_path / "calls"
    stub_dir = stub(tmp_path / "bin", calls, printing(FOUR_GPUS))
    script = tmp_path / "wait.py"
    script.write_text(WAIT_FOR_SAMPLES)
    # the tasks' Python workers (and so their agents) get the stub first on PATH from Spark
    out = run_dlrun("launch", "--plain", "--grace", "2", "--backend", "spark", "--master", "local[2]", "-n", "2",
                    "--conf", f"spark.executorEnv.PATH={stub_dir}{os.pathsep}{os.environ['PATH']}",
                    "--gpu-every", "0.3", "--gpu-idle-after", "1", str(script), str(calls), "2", "1", "0",
                    cwd=tmp_path, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    lines = [line for line in text.splitlines() if re.match(r"dlrun: gpu task\d@\S+ util ", line)]
    assert lines and all(line.startswith("dlrun: gpu task0@") for line in lines), text
    warned = [line for line in text.splitlines() if re.match(r"dlrun: warning: task0@\S+: GPUs 1,2,3 are idle", line)]
    assert len(warned) == 2, text  # while it ran, and in the summary
    with open(job_dir(tmp_path, out.stdout) / "gpu.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert {r["host"].split("@")[0] for r in rows} == {"task0"} and {r["gpu"] for r in rows} == {"0", "1", "2", "3"}
