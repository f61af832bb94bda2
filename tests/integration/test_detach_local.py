"""``dlrun launch --detach`` without ``--hosts``: the local transport runs the same keeper."""

from __future__ import annotations

from pathlib import Path

from conftest import run_dlrun
from support.sshd_cluster import wait_job_processes_gone

STEPS = """
import os, sys, time
rank = os.environ["DLRUN_RANK"]
for i in range(3):
    print("rank", rank, "step", i, flush=True)
    time.sleep(0.5)
sys.exit(4 if rank == "1" else 0)
"""


def test_a_local_detached_job_runs_and_is_followed(tmp_path: Path) -> None:
    script = tmp_path / "steps.py"
    script.write_text(STEPS)
    home = {"HOME": str(tmp_path / "home")}  # the job folder: ~/.dlrun/jobs/<job>/host-localhost/
    out = run_dlrun("launch", "--detach", "--framework", "none", "-n", "2", str(script), cwd=tmp_path,
                    timeout=120, env=home)
    assert out.returncode == 0, out.stdout + out.stderr
    job = out.stdout.strip().splitlines()[-1].removeprefix("dlrun: detached job ")
    attached = run_dlrun("attach", job, cwd=tmp_path, timeout=120, env=home)
    assert attached.returncode == 4, attached.stdout + attached.stderr
    assert "[1 localhost] rank 1 step 2\n" in attached.stdout, attached.stdout
    assert "dlrun: root cause: rank 1 on host localhost exited with code 4" in attached.stdout, attached.stdout
    assert wait_job_processes_gone(job, timeout=15) == []
    assert (tmp_path / "home" / ".dlrun" / "jobs" / job / "host-localhost" / "result.json").is_file()
    ps = run_dlrun("ps", cwd=tmp_path, timeout=60, env=home)
    assert f"{job}  failed" in ps.stdout, ps.stdout


def test_what_detach_cannot_do_yet_is_refused(tmp_path: Path) -> None:
    script = tmp_path / "t.py"
    script.write_text("print(1)\n")
    out = run_dlrun("launch", "--detach", "--framework", "horovod", str(script), cwd=tmp_path, timeout=60,
                    env={"HOME": str(tmp_path)})
    assert out.returncode == 2 and "--framework horovod" in out.stderr, out.stderr
