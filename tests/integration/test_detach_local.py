"""``dlrun launch --detach`` without ``--hosts``: the local transport runs the same keeper."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
from pathlib import Path

import pytest

from support.cli import REPO, dlrun_argv, run_dlrun
from support.scripts import RAISES_AND_LINGERS
from support.sshd_cluster import wait_job_processes_gone
from support.wait import wait_until

STEPS = """
import os, sys, time
rank = os.environ["DLRUN_RANK"]
for i in range(3):
    print("rank", rank, "step", i, flush=True)
    time.sleep(0.5)
sys.exit(4 if rank == "1" else 0)
"""


def detach_locally(tmp_path: Path, name: str, source: str) -> tuple[str, dict[str, str]]:
    """``dlrun launch --detach -n 2`` of ``source`` without hosts: the job id, and the HOME it
    ran under (its folder: ~/.dlrun/jobs/<job>/host-localhost/)."""
    script = tmp_path / name
    script.write_text(source)
    home = {"HOME": str(tmp_path / "home")}
    out = run_dlrun("launch", "--detach", "--framework", "none", "-n", "2", str(script), cwd=tmp_path,
                    timeout=120, env=home)
    assert out.returncode == 0, out.stdout + out.stderr
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("dlrun: detached job "), out.stdout
    return last.removeprefix("dlrun: detached job "), home


@pytest.mark.slow
def test_a_local_detached_job_runs_and_is_followed(tmp_path: Path) -> None:
    job, home = detach_locally(tmp_path, "steps.py", STEPS)
    attached = run_dlrun("attach", job, cwd=tmp_path, timeout=120, env=home)
    assert attached.returncode == 4, attached.stdout + attached.stderr
    assert "[1 localhost] rank 1 step 2\n" in attached.stdout, attached.stdout
    assert "dlrun: root cause: rank 1 on host localhost exited with code 4" in attached.stdout, attached.stdout
    assert wait_job_processes_gone(job, timeout=15) == []
    assert (tmp_path / "home" / ".dlrun" / "jobs" / job / "host-localhost" / "result.json").is_file()
    ps = run_dlrun("ps", cwd=tmp_path, timeout=60, env=home)
    assert f"{job}  failed" in ps.stdout, ps.stdout


def test_a_job_done_before_the_first_look_is_a_detached_success(tmp_path: Path) -> None:
    detach_locally(tmp_path, "quick.py", "print('done')\n")  # exits 0 with the detached line


def test_what_detach_cannot_do_yet_is_refused(tmp_path: Path) -> None:
    script = tmp_path / "t.py"
    script.write_text("print(1)\n")
    out = run_dlrun("launch", "--detach", "--max-restarts", "1", "--min-hosts", "1", str(script), cwd=tmp_path,
                    timeout=60, env={"HOME": str(tmp_path)})
    assert out.returncode == 2 and "--min-hosts" in out.stderr, out.stderr


@pytest.mark.slow
def test_ctrl_c_in_attach_detaches_and_the_job_goes_on(tmp_path: Path) -> None:
    job, home = detach_locally(tmp_path, "sleeper.py", "import time\nprint('ready', flush=True)\ntime.sleep(600)\n")
    try:
        attach = subprocess.Popen(dlrun_argv("attach", job), cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO), **home})
        assert attach.stdout is not None
        assert attach.stdout.readline() == "dlrun: starting 2 ranks on 1 host\n"
        assert "ready" in attach.stdout.readline()
        attach.send_signal(signal.SIGINT)
        rest, _ = attach.communicate(timeout=60)
        assert attach.returncode == 0, rest
        assert f"dlrun: detached from job {job}; it goes on" in rest, rest
        ps = run_dlrun("ps", cwd=tmp_path, timeout=60, env=home)
        assert f"{job}  running" in ps.stdout, ps.stdout
    finally:
        stopped = run_dlrun("stop", job, cwd=tmp_path, timeout=120, env=home)
    assert stopped.returncode == 143, stopped.stdout + stopped.stderr
    assert wait_job_processes_gone(job, timeout=15) == []


def test_a_detached_job_samples_its_gpus_into_gpu_csv(tmp_path: Path) -> None:
    tools = tmp_path / "bin"
    tools.mkdir()
    smi = tools / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho '0, GPU-a, 97, 71680, 81559, [N/A], 71'\n")
    smi.chmod(0o755)
    script = tmp_path / "nap.py"
    script.write_text("import time\ntime.sleep(1.5)\n")
    env = {"HOME": str(tmp_path / "home"), "PATH": f"{tools}:{os.environ['PATH']}"}
    out = run_dlrun("launch", "--detach", "--no-preflight", "--gpu-every", "0.2", "--framework", "none", "-n", "1",
                    str(script), cwd=tmp_path, timeout=120, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    job = out.stdout.strip().splitlines()[-1].removeprefix("dlrun: detached job ")
    attached = run_dlrun("attach", job, cwd=tmp_path, timeout=120, env=env)
    assert attached.returncode == 0, attached.stdout + attached.stderr
    # attach shows them as an attached job's view does: a status line, then the summary's
    assert "dlrun: gpu localhost util 97 % mem 70.0/80 GiB" in attached.stdout, attached.stdout
    assert re.search(r"gpu localhost: util 97 % \(mean\)", attached.stdout), attached.stdout
    rows = (tmp_path / "home" / ".dlrun" / "jobs" / job / "host-localhost" / "attempt-0" / "gpu.csv").read_text()
    lines = rows.splitlines()
    assert lines[0] == "time,host,gpu,util,mem_used_mib,mem_total_mib,power_w,temp_c"
    assert len(lines) >= 3 and all(line.split(",")[1:] == ["localhost", "0", "97", "71680", "81559", "", "71"]
                                   for line in lines[1:]), rows


# The same failure, attached and detached (issue 29: one rank policy): the exception a rank
# raised (lines after it), what torch's @record wrote, the signal that killed it.
FAILURES = {
    "exception": ("none", "import sys\nprint('epoch 1', flush=True)\n"
                  "def load(i):\n    raise ValueError(f'bad batch {i}: shape (3, 4) is not (3, 5)')\n"
                  "try:\n    load(7)\nfinally:\n    print('cleanup', file=sys.stderr, flush=True)\n"),
    "error_file": ("torch", "from torch.distributed.elastic.multiprocessing.errors import record\n"
                   "@record\ndef main() -> None:\n    raise RuntimeError('CUDA out of memory on rank 0 (recorded)')\n"
                   "main()\n"),
    "signal": ("none", "import os\nprint('about to abort', flush=True)\nos.abort()\n"),
    "caught": ("none", "import logging, os, signal\ntry:\n    raise ConnectionError('upload failed, retrying')\n"
               "except ConnectionError:\n    logging.exception('upload')\nfor i in range(30):\n"
               "    print(f'step {i}', flush=True)\nos.kill(os.getpid(), signal.SIGKILL)\n"),
    "hang": ("none", "import time\nprint('ready', flush=True)\ndef stuck_in_data_loading():\n    while True:\n"
                     "        time.sleep(1)\nstuck_in_data_loading()\n"),
}
EXTRA = {"hang": ["--hang-timeout", "5"]}  # --hang-timeout's stop: the hang's lines, then the closing line
EVIDENCE = {"exception": "ValueError: bad batch 7: shape (3, 4) is not (3, 5)",
            "error_file": "RuntimeError: CUDA out of memory on rank 0 (recorded)",
            "signal": "  killed by SIGABRT (134)",
            "caught": "  an earlier traceback of rank 0 (many lines came after it: it may have been caught):",
            "hang": "dlrun: root cause: job hung (no output for 5 s): the rank is in stuck_in_data_loading"}


def root_cause_block(stdout: str) -> list[str]:
    """From ``dlrun: root cause`` to the ranks' table; the command line and the stacks' folder
    left out (attached: the rank's argv, ``dlrun-logs/``; detached: the record's, the same but for
    the job's own paths, and the keepers' folders)."""
    assert "dlrun: root cause" in stdout, stdout[-3000:]
    block = stdout[stdout.index("dlrun: root cause"):].split("\nrank  host")[0].splitlines()
    # faulthandler's stack (PYTHONFAULTHANDLER) names the thread by its address: one per run
    return [re.sub(r"Thread 0x[0-9a-f]+|thread 0x[0-9a-f]+", "thread 0x…", line) for line in block
            if not line.startswith(("  command: ", "  full stacks: "))]


@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_the_same_failure_has_the_same_root_cause_attached_and_detached(tmp_path: Path, failure: str) -> None:
    framework, source = FAILURES[failure]
    if framework == "torch":
        pytest.importorskip("torch")
    script = tmp_path / f"fails_by_{failure}.py"  # not signal.py: dlrun, run from tmp_path, would import it
    script.write_text(source)
    home = {"HOME": str(tmp_path / "home")}
    common = ["--framework", framework, "--grace", "2", "-n", "1", *EXTRA.get(failure, []), str(script)]
    attached = run_dlrun("launch", "--plain", *common, cwd=tmp_path, timeout=180, env=home)
    launched = run_dlrun("launch", "--detach", *common, cwd=tmp_path, timeout=180, env=home)
    # a failure before the launch's look at the job ends it with the summary, job line last
    job = re.search(r"^dlrun: (?:detached job ([\w-]+)|job ([\w-]+) failed; exit code)", launched.stdout
                    + launched.stderr, re.M)
    assert job, launched.stdout + launched.stderr
    job_id = job.group(1) or job.group(2)
    detached = run_dlrun("attach", job_id, cwd=tmp_path, timeout=120, env=home)
    assert attached.returncode == detached.returncode != 0, attached.stdout[-2000:] + detached.stdout[-2000:]
    block = root_cause_block(attached.stdout)
    assert any(EVIDENCE[failure] in line for line in block), block
    assert root_cause_block(detached.stdout) == block
    closing = [line.split("; exit code")[0] for line in attached.stdout.splitlines() if "; exit code" in line]
    assert closing[0] in detached.stdout, (closing, detached.stdout[-2000:])  # "job failed (0/1 …)", "job hung; …"
    assert wait_job_processes_gone(job_id, timeout=15) == []


# a progress bar: \r, never a newline, until the test lets it finish (or 120 s pass)
PROGRESS = """
import os, sys, time
go = sys.argv[1]
i = 0
while not os.path.exists(go) and i < 600:
    print(f"progress {i}%", end="\\r", flush=True)
    i += 1
    time.sleep(0.2)
print("done", flush=True)
"""


def test_a_detached_progress_bar_reaches_logs_follow_as_it_happens(tmp_path: Path) -> None:
    go = tmp_path / "go"
    script = tmp_path / "progress.py"
    script.write_text(PROGRESS)
    home = {"HOME": str(tmp_path / "home")}
    out = run_dlrun("launch", "--detach", "--framework", "none", "-n", "1", str(script), str(go), cwd=tmp_path,
                    timeout=120, env=home)
    assert out.returncode == 0, out.stdout + out.stderr
    job = out.stdout.strip().splitlines()[-1].removeprefix("dlrun: detached job ")
    follow = subprocess.Popen(dlrun_argv("logs", job, "--follow"), cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO), **home})
    watchdog = threading.Timer(120, follow.kill)  # a progress that never shows ends the test, not hangs it
    watchdog.start()
    try:
        assert follow.stdout is not None
        seen: list[str] = []
        while len(seen) < 3:  # the rank goes on only once the test saw its \r pieces: none may wait for its end
            line = follow.stdout.readline()
            assert line, "logs --follow ended before the progress showed"
            if line.startswith("[0 localhost] progress "):
                seen.append(line)
        go.write_text("")
        rest, _ = follow.communicate(timeout=120)
    finally:
        watchdog.cancel()
        go.write_text("")
        if follow.poll() is None:
            follow.kill()
    assert follow.returncode == 0, rest
    assert "[0 localhost] done\n" in rest, rest
    assert wait_job_processes_gone(job, timeout=15) == []


# attempt 0 hangs; attempt 1 works, a line a second, then ends well
HANG_THEN_WORK = """
import os, time
if os.environ["DLRUN_RESTART_COUNT"] == "0":
    print("ready", flush=True)
    while True:
        time.sleep(1)
for step in range(int(os.environ["STEPS"])):
    print("step", step, flush=True)
    time.sleep(1)
"""


@pytest.mark.slow
@pytest.mark.parametrize("stacks", ["faulthandler", "py-spy"])
def test_a_detached_restart_after_a_hang_starts_a_fresh_hang_watch(tmp_path: Path, stacks: str) -> None:
    """Found in review: the leader keeper's restart kept the hang's pending stop (faulthandler's
    SIGABRT ended the ranks inside DUMP_WAIT: the next attempt was stopped at once) and its hang
    id (60 s after the hang, the healthy attempt was stopped as hung with the old stacks)."""
    script = tmp_path / "hang_then_work.py"
    script.write_text(HANG_THEN_WORK)
    steps = 8 if stacks == "faulthandler" else 70  # past HANG_ANSWER (60 s) after the hang
    env = {"HOME": str(tmp_path / "home"), "STEPS": str(steps)}
    if stacks == "faulthandler":
        env["DLRUN_PY_SPY"] = ""  # none shipped: the hang's stop sends SIGABRT for faulthandler's dump
    out = run_dlrun("launch", "--detach", "--framework", "none", "-n", "1", "--grace", "2", "--hang-timeout", "5",
                    "--max-restarts", "1", "--env", "STEPS", str(script), cwd=tmp_path, timeout=120, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    job = out.stdout.strip().splitlines()[-1].removeprefix("dlrun: detached job ")
    attached = run_dlrun("attach", job, cwd=tmp_path, timeout=240, env=env)
    assert attached.returncode == 0, attached.stdout[-3000:] + attached.stderr
    assert f"step {steps - 1}" in attached.stdout, attached.stdout[-3000:]
    assert re.search(r"attempt 1 \(job [\w-]+\) failed: hung \(no output for 5 s\)", attached.stdout), attached.stdout
    assert wait_job_processes_gone(job, timeout=15) == []


#: says its MASTER_PORT (a file in the folder given) and never binds it: only the claim protects it
PORT_SAYER = """
import os, sys, time
open(os.path.join(sys.argv[1], os.environ["MASTER_PORT"] + "-" + os.urandom(4).hex()), "w").close()  # pid: 2 in each
time.sleep(600)
"""


@pytest.mark.slow
def test_detached_jobs_launched_one_after_another_get_their_own_ports(tmp_path: Path) -> None:
    from dlrun.remote.agent import claim_ports

    script, said = tmp_path / "ports.py", tmp_path / "said"
    script.write_text(PORT_SAYER)
    said.mkdir()
    home = {"HOME": str(tmp_path / "home")}
    jobs = []
    try:
        for _ in range(2):  # a sweep: the first job's ranks have not bound their port when the second starts
            out = run_dlrun("launch", "--detach", "--framework", "torch", "-n", "1", str(script), str(said),
                            cwd=tmp_path, timeout=120, env=home)
            assert out.returncode == 0, out.stdout + out.stderr
            jobs.append(out.stdout.strip().splitlines()[-1].removeprefix("dlrun: detached job "))
        assert wait_until(lambda: len(list(said.iterdir())) == 2, 60)
        ports = sorted(int(p.name.split("-")[0]) for p in said.iterdir())
        assert ports[0] != ports[1], ports
        assert claim_ports(ports) is None  # held by the jobs' keepers, dlrun long gone
    finally:
        for job in jobs:
            run_dlrun("stop", job, cwd=tmp_path, timeout=120, env=home)
    for job in jobs:
        assert wait_job_processes_gone(job, timeout=30) == []


def test_a_detached_job_names_the_rank_that_raised_first_and_lingers(tmp_path: Path) -> None:
    (tmp_path / "linger.py").write_text(RAISES_AND_LINGERS)
    home = {"HOME": str(tmp_path / "home")}
    launched = run_dlrun("launch", "--detach", "--framework", "none", "--grace", "1", "-n", "2", "-e",
                         f"MARKS={tmp_path}", "linger.py", cwd=tmp_path, timeout=180, env=home)
    job = re.search(r"^dlrun: (?:detached job ([\w-]+)|job ([\w-]+) failed; exit code)", launched.stdout
                    + launched.stderr, re.M)
    assert job, launched.stdout + launched.stderr
    job_id = job.group(1) or job.group(2)
    detached = run_dlrun("attach", job_id, cwd=tmp_path, timeout=120, env=home)
    assert detached.returncode == 1, detached.stdout[-3000:]
    block = "\n".join(root_cause_block(detached.stdout))
    assert block.startswith("dlrun: root cause: rank 0 on host localhost exited with code 1"), block
    assert re.search(r"\n  rank 1 on localhost raised first, \d+\.\d s before, and printed little since", block), block
    assert "  | RuntimeError: CUDA error: an illegal memory access was encountered" in block, block
    assert wait_job_processes_gone(job_id, timeout=15) == []
