"""`dlrun launch` as a real subprocess with real local workers (no sshd needed)."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.cli import REPO, dlrun_argv, run_dlrun
from support.sshd_cluster import count_job_processes as job_processes

SLEEPER = """
import os, subprocess, sys, time
if "--fork" in sys.argv:
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("ready", os.getpid(), flush=True)  # after the children: the test counts them at once
time.sleep(600)
"""


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def start_job(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[str], str, list[int]]:
    """Start dlrun, wait until every rank printed 'ready', return the process, job id and job pids."""
    proc = subprocess.Popen(dlrun_argv("launch", "--plain", "--grace", "2", *args), cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout is not None
    job_id, ready, lines = None, 0, []
    deadline = time.monotonic() + 60
    while ready < 2 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        match = re.search(r"logs in dlrun-logs/([\w-]+)/", line)
        if match:
            job_id = match.group(1)
        if "] ready" in line:
            ready += 1
    assert job_id and ready == 2, "".join(lines)
    return proc, job_id, job_processes(job_id)


def wait_gone(pids: list[int], job_id: str, timeout: float = 10) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if os.path.exists(f"/proc/{p}")] + job_processes(job_id)
        if not left:
            return []
        time.sleep(0.1)
    return left


def test_rank_exit_code_is_dlruns_and_others_are_stopped(tmp_path: Path) -> None:
    script = write(tmp_path / "fail.py", "import os, sys, time\n"
                   "r = int(os.environ['DLRUN_RANK'])\nprint('rank', r, 'up', flush=True)\n"
                   "if r == 1:\n    print('about to fail', flush=True); sys.exit(7)\ntime.sleep(600)\n")
    out = run_dlrun("launch", "--plain", "--np", "3", "--grace", "2", str(script), cwd=tmp_path, timeout=60)
    assert out.returncode == 7, out.stdout + out.stderr
    assert "dlrun: root cause: rank 1 on host localhost exited with code 7" in out.stdout
    assert "    | about to fail" in out.stdout
    assert re.search(r"^\s+0\s+localhost\s+143\s+stopped", out.stdout, re.M)
    logs = list((tmp_path / "dlrun-logs").glob("*/rank-1.log"))
    assert logs and "about to fail" in logs[0].read_text()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_dlrun_leaves_no_process(tmp_path: Path, sig: signal.Signals) -> None:
    script = write(tmp_path / "sleep.py", SLEEPER)
    proc, job_id, pids = start_job(tmp_path, str(script))
    assert len(pids) >= 2
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 128 + sig, out
    assert wait_gone(pids, job_id) == []


def test_ctrl_z_is_refused_with_a_notice_and_the_job_goes_on(tmp_path: Path) -> None:
    # a stopped dlrun would stall the ranks' output, and its hosts would end the job
    script = write(tmp_path / "sleep.py", SLEEPER)
    proc, job_id, pids = start_job(tmp_path, str(script))
    proc.send_signal(signal.SIGTSTP)
    time.sleep(1)
    assert Path(f"/proc/{proc.pid}/stat").read_text().split(") ")[1][0] != "T"  # not stopped
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert "dlrun: Ctrl-Z ignored" in out, out
    assert proc.returncode == 130, out
    assert wait_gone(pids, job_id) == []


def test_grandchildren_and_setsid_children_die_with_the_job(tmp_path: Path) -> None:
    script = write(tmp_path / "fork.py", SLEEPER)
    proc, job_id, pids = start_job(tmp_path, str(script), "--fork")
    assert len(pids) >= 6  # 2 ranks + 2 children each
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=30)
    assert wait_gone(pids, job_id) == []


ESCAPER = """
import os, subprocess, sys
# a helper with an env of its own, in a session of its own (as daemon launchers start them)
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", sys.argv[1]],
                 env={"PATH": os.environ["PATH"]}, start_new_session=True)
print("spawned", flush=True)
"""


@pytest.mark.parametrize("pidns", [True, False])
def test_a_child_without_the_jobs_env_or_session_dies_with_the_job(tmp_path: Path, pidns: bool) -> None:
    # no tag to find it by: a PID namespace catches it, and without one the agent is its subreaper
    marker = f"dlrun-escaper-{os.getpid()}-{pidns}"
    script = write(tmp_path / "escape.py", ESCAPER)
    out = run_dlrun("launch", "--plain", *([] if pidns else ["--no-pidns"]), str(script), marker, cwd=tmp_path)
    assert out.returncode == 0 and "spawned" in out.stdout, out.stdout + out.stderr

    def escaped() -> list[int]:
        found = []
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                if marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                pass
        return found

    deadline = time.monotonic() + 5
    while escaped() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = escaped()
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == []


@pytest.mark.parametrize("pidns", [True, False])
def test_sigkill_of_dlrun_leaves_no_process(tmp_path: Path, pidns: bool) -> None:
    script = write(tmp_path / "fork.py", SLEEPER)
    extra = [] if pidns else ["--no-pidns"]
    proc, job_id, pids = start_job(tmp_path, *extra, str(script), "--fork")
    proc.kill()
    proc.wait()
    assert wait_gone(pids, job_id) == []


def test_hostile_arguments_and_env_arrive_verbatim(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    script = write(tmp_path / "echo args.py", "import json, os, sys\n"
                   "print(json.dumps({'argv': sys.argv[1:], 'v': os.environ['HOSTILE']}))\n")
    hostile = f"'; touch {marker}; echo '"
    value = "$(id) `id` \"q\" 'q' ; \n second line"
    out = run_dlrun("launch", "--plain", "--np", "1", "-e", f"HOSTILE={value}", str(script), hostile, "a b",
                    cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("[0 localhost] {"))
    got = json.loads(line.removeprefix("[0 localhost] "))
    assert got == {"argv": [hostile, "a b"], "v": value}
    assert not marker.exists()


@pytest.mark.slow
def test_dry_run_text_and_json_mask_secrets(tmp_path: Path) -> None:
    hosts = write(tmp_path / "hosts.toml", '[defaults]\nenv = { HF_TOKEN = "hunter2" }\n'
                  '[[hosts]]\naddress = "gpu1"\nslots = 2\n[[hosts]]\naddress = "gpu2"\nslots = 1\n')
    out = run_dlrun("launch", "--dry-run", "--hosts", str(hosts), "train.py", "--lr", "1", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "rank 2: host gpu2" in out.stdout and "HF_TOKEN=****" in out.stdout and "hunter2" not in out.stdout
    out = run_dlrun("launch", "--dry-run", "--json", "--hosts", str(hosts), "train.py", cwd=tmp_path)
    doc = json.loads(out.stdout)
    assert doc["world_size"] == 3
    tf_config = json.loads(doc["ranks"][2]["env"]["TF_CONFIG"])
    assert tf_config == {"cluster": {"worker": ["gpu1:23456", "gpu1:23457", "gpu2:23456"]},
                         "task": {"type": "worker", "index": 2}}
    assert doc["ranks"][0]["env"]["HF_TOKEN"] == "****"
    assert "hunter2" not in out.stdout
    horovod = run_dlrun("launch", "--dry-run", "--framework", "horovod", "--np", "2", "train.py", cwd=tmp_path)
    assert "HOROVOD_GLOO_RENDEZVOUS_ADDR=127.0.0.1" in horovod.stdout  # not a port 0 to connect to
    assert "HOROVOD_GLOO_RENDEZVOUS_PORT=<a free port, chosen at launch>" in horovod.stdout


def test_a_linked_script_runs_as_its_target_in_the_pushed_directory(tmp_path: Path) -> None:
    (tmp_path / "proj" / "src").mkdir(parents=True)
    write(tmp_path / "proj" / "src" / "train_v2.py", "print(1)\n")
    (tmp_path / "proj" / "run.py").symlink_to("src/train_v2.py")
    out = run_dlrun("launch", "--dry-run", "--json", "--hosts", "gpu1:1", "proj/run.py", cwd=tmp_path)
    (rank,) = json.loads(out.stdout)["ranks"]
    assert rank["argv"][-1] == "train_v2.py" and rank["cwd"] == "src"  # what the push sends: src/


@pytest.mark.slow
def test_dlrun_options_may_follow_the_script_up_to_the_scripts_own(tmp_path: Path) -> None:
    # the mission's main command: dlrun launch train.py --hosts hosts.toml
    def plan(*args: str) -> tuple[list[str], list[str], str]:
        out = run_dlrun("launch", "--dry-run", "--json", *args, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        ranks = json.loads(out.stdout)["ranks"]
        said = "".join(line for line in out.stderr.splitlines(True) if line.startswith("dlrun: warning: --"))
        return sorted({r["host"] for r in ranks}), ranks[0]["argv"][2:], said

    assert plan("train.py", "--hosts", "gpu1:2,gpu2:2") == (["gpu1", "gpu2"], [], "")
    assert plan("train.py", "-H", "gpu1:1", "--np=1", "--epochs", "3", "--lr", "1") == (
        ["gpu1"], ["--epochs", "3", "--lr", "1"], "")
    assert plan("--np", "1", "train.py", "--plain", "--", "--hosts", "x") == (["localhost"], ["--hosts", "x"], "")
    hosts, args, err = plan("train.py", "--np", "1", "--epochs", "3", "--hosts", "gpu1:2")
    assert (hosts, args) == (["localhost"], ["--epochs", "3", "--hosts", "gpu1:2"])  # the script's, as written
    assert "dlrun: warning: --hosts after the script's own arguments goes to the script" in err


def test_missing_script_and_unwritable_log_dir_fail_before_anything_starts(tmp_path: Path) -> None:
    out = run_dlrun("launch", "--plain", "nosuch.py", cwd=tmp_path)
    assert out.returncode == 2 and "dlrun: error: script not found: nosuch.py" in out.stderr, out.stderr
    script = write(tmp_path / "ok.py", "print('ok')\n")
    out = run_dlrun("launch", "--plain", "--log-dir", "/dev/null/logs", str(script), cwd=tmp_path)
    assert out.returncode == 2 and "cannot create the log directory /dev/null/logs" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "[0 localhost]" not in out.stdout
    out = run_dlrun("launch", "-e", "API_KEY:hunter2", str(script), cwd=tmp_path)
    assert out.returncode == 2 and "expected NAME=VALUE" in out.stderr and "hunter2" not in out.stderr


@pytest.mark.slow
def test_option_values_that_cannot_work_are_usage_errors(tmp_path: Path) -> None:
    script = write(tmp_path / "ok.py", "print('ok')\n")
    for args, words in ((["--ranks", "7"], "--ranks 7: the job has ranks 0 to 1"),
                        (["--base-port", "-5"], "not in the range"), (["--grace", "-1"], "not in the range"),
                        (["--shard", "size"], "--shard goes with --data DIR"),
                        (["--conf", "a=b", "--master", "x"], "--master, --conf go with --backend spark"),
                        (["--start-timeout", "5"], "--start-timeout goes with --backend spark"),
                        # the SSH path's options and checks, refused or made before Spark starts
                        (["--backend", "spark", "--master", "local[2]", "--data", str(tmp_path)],
                         "--data goes with the SSH backend, not --backend spark"),
                        (["--backend", "spark", "--master", "local[2]", "--no-push", "--base-port", "3000"],
                         "--push/--no-push, --base-port go with the SSH backend"),
                        (["--backend", "spark", "--master", "local[2]", "--ranks", "7"],
                         "--ranks 7: the job has ranks 0 to 1"),
                        (["--backend", "spark", "--master", "local[2]", "--log-dir", "/dev/null/logs"],
                         "cannot create the log directory"),
                        (["--hosts", "gpu1:1", "--data", "."], "holds the script's directory")):
        out = run_dlrun("launch", "--plain", "--framework", "none", *args, str(script), cwd=tmp_path)
        assert out.returncode == 2 and words in out.stderr, (args, out.stderr)
        assert "[0 localhost] ok" not in out.stdout


def test_dry_run_shows_where_pushed_ranks_run_and_their_shards(tmp_path: Path) -> None:
    for rel, text in (("proj/train.py", "print(1)\n"), ("ds/a.csv", "a"), ("ds/b.csv", "b")):
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        write(tmp_path / rel, text)
    hosts = write(tmp_path / "hosts.toml", '[defaults]\nworkdir = "~/w"\n[[hosts]]\naddress = "g1"\n'
                  '[[hosts]]\naddress = "g2"\n')
    out = run_dlrun("launch", "--dry-run", "--json", "--framework", "none", "proj/train.py", "--hosts", str(hosts),
                    "--data", "ds", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    ranks = json.loads(out.stdout)["ranks"]
    assert [(r["argv"][1:], r["cwd"], r["env"]["DLRUN_DATA_DIR"], r["env"]["DLRUN_SHARD_INDEX"]) for r in ranks] == [
        (["train.py"], "~/w/proj", "~/w/data/g1", "0"), (["train.py"], "~/w/proj", "~/w/data/g2", "1")]


def test_env_that_dlrun_replaces_is_named_and_a_missing_ssh_config_is_a_usage_error(tmp_path: Path) -> None:
    out = run_dlrun("launch", "--dry-run", "--np", "1", "-e", "TF_CONFIG={}", "-e", "MINE=1", "t.py", cwd=tmp_path)
    assert out.returncode == 0 and "warning: --env TF_CONFIG is set by dlrun for each rank" in out.stderr
    assert "MINE" not in out.stderr
    write(tmp_path / "t.py", "pass\n")
    out = run_dlrun("launch", "--hosts", "h1:1", "--ssh-config", str(tmp_path / "nope"), "t.py", cwd=tmp_path)
    assert out.returncode == 2 and "ssh config file not found" in out.stderr


def test_bad_inventory_exits_2_without_traceback(tmp_path: Path) -> None:
    hosts = write(tmp_path / "hosts.toml", '[[hosts]]\naddress = "a"\nslots = -1\n')
    out = run_dlrun("launch", "--hosts", str(hosts), "train.py", cwd=tmp_path)
    assert out.returncode == 2
    assert f"{hosts}:3: key 'hosts[0].slots': must be at least 1" in out.stderr
    assert "Traceback" not in out.stderr
    out = run_dlrun("launch", "--hosts", "a:2", "--np", "5", "train.py", cwd=tmp_path)
    assert out.returncode == 2 and "--np 5 needs 5 slots" in out.stderr


def test_missing_script_is_reported_as_rank_failure(tmp_path: Path) -> None:
    out = run_dlrun("launch", "--plain", "--np", "1", "no-such-command-xyz", cwd=tmp_path, timeout=60)
    assert out.returncode == 127
    assert "command not found: no-such-command-xyz" in out.stdout


def test_help_does_not_import_heavy_modules() -> None:
    code = ("import sys; from click.testing import CliRunner; from dlrun.cli import main;"
            "r = CliRunner().invoke(main, ['launch', '--help']); assert r.exit_code == 0, r.output;"
            "print([m for m in ('tensorflow', 'paramiko', 'fabric', 'pyspark', 'torch') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.stdout.strip() == "[]", out.stderr


@pytest.mark.slow
def test_keras3_warning_only_when_needed(tmp_path: Path) -> None:
    pytest.importorskip("keras")
    plain = write(tmp_path / "plain.py", "def later():\n    import tensorflow\nprint('hi')\n")  # a TF job
    out = run_dlrun("launch", "--dry-run", str(plain), cwd=tmp_path)
    from importlib.metadata import version

    if version("keras").startswith("3."):
        assert "TF_USE_LEGACY_KERAS is unset" in out.stderr
    out = run_dlrun("launch", "--dry-run", "-e", "TF_USE_LEGACY_KERAS=1", str(plain), cwd=tmp_path)
    assert "TF_USE_LEGACY_KERAS" not in out.stderr
    out = run_dlrun("launch", "--dry-run", "--framework", "torch", str(plain), cwd=tmp_path)
    assert "TF_USE_LEGACY_KERAS" not in out.stderr
    no_tf = write(tmp_path / "no_tf.py", "print('hi')\n")  # both contracts, but no TensorFlow: no warning
    out = run_dlrun("launch", "--dry-run", str(no_tf), cwd=tmp_path)
    assert "TF_USE_LEGACY_KERAS" not in out.stderr


@pytest.mark.slow
def test_tf_example_trains_on_two_local_workers(tmp_path: Path) -> None:
    pytest.importorskip("tensorflow")
    pytest.importorskip("tf_keras")
    out = run_dlrun("launch", "--plain", str(REPO / "examples" / "train_digits.py"), "--epochs", "12",
                    cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    accuracies = [float(m) for m in re.findall(r"\] test accuracy: ([0-9.]+)", out.stdout)]
    assert len(accuracies) == 2 and min(accuracies) >= 0.90
    assert re.search(r"\[0 localhost\] epoch 1/12: loss", out.stdout)
    assert re.search(r"\[1 localhost\] epoch 12/12: loss", out.stdout)
    assert (tmp_path / "dlrun-model" / "digits.keras").exists()
    assert "all 2 ranks succeeded" in out.stdout


def test_an_agent_that_cannot_start_says_why_without_the_preflight_too(tmp_path: Path) -> None:
    script = write(tmp_path / "hi.py", "print('hi')\n")
    hosts = write(tmp_path / "hosts.toml", '[[hosts]]\naddress = "localhost"\npython = "/nope/python3"\n')
    out = run_dlrun("launch", "--plain", "--no-preflight", "--framework", "none", "--hosts", str(hosts), str(script),
                    cwd=tmp_path)
    assert out.returncode == 255, out.stdout + out.stderr
    cause = r"root cause: host localhost \(rank 0\): .*/nope/python3.*(No such file|not found)"
    assert re.search(cause, out.stdout), out.stdout


def test_local_jobs_side_by_side_take_free_ports(tmp_path: Path) -> None:
    import socket

    busy = socket.socket()  # another job (or anything) holds the default base port
    busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        busy.bind(("", 23456))
    except OSError:
        pass  # held already: so much the better
    busy.listen()
    try:
        script = write(tmp_path / "bind.py", "import json, os, socket\n"
                       "me = json.loads(os.environ['TF_CONFIG'])\n"
                       "port = int(me['cluster']['worker'][me['task']['index']].rsplit(':', 1)[1])\n"
                       "socket.socket().bind(('', port))\n"
                       "print('bound', port)\n")
        out = run_dlrun("launch", "--plain", "--np", "2", str(script), cwd=tmp_path)
        assert out.returncode == 0, out.stdout + out.stderr
        ports = sorted(int(p) for p in re.findall(r"\] bound (\d+)$", out.stdout, re.M))
        assert len(ports) == 2 and 23456 not in ports and ports[1] == ports[0] + 1, out.stdout
        taken = run_dlrun("launch", "--dry-run", "--json", "--np", "2", "--base-port", "23456", str(script),
                          cwd=tmp_path)  # a dry run checks what the launch would, here too
        assert taken.returncode == 1 and "localhost: port 23456 (rank 0) is in use" in taken.stderr, taken.stderr
    finally:
        busy.close()
    given = run_dlrun("launch", "--dry-run", "--json", "--np", "2", "--base-port", "23456", str(script),
                      cwd=tmp_path)  # a port the user names is used as named
    assert json.loads(given.stdout)["ranks"][0]["port"] == 23456


def test_push_options_that_would_do_nothing_are_usage_errors(tmp_path: Path) -> None:
    (tmp_path / "proj").mkdir()
    for args, words in ((["--code", "proj", "--split-lines"], "--split-lines goes with --data DIR"),
                        (["--code", "proj", "--shard", "size"], "--shard goes with --data DIR"),
                        (["--data", "proj", "--no-delete"], "--no-delete goes with --code DIR"),
                        (["--data", "proj", "--project", "p"], "--project goes with --code DIR"),
                        ([], "nothing to push")):
        out = run_dlrun("push", "--hosts", "gpu1:1", *args, cwd=tmp_path)
        assert out.returncode == 2 and words in out.stderr, (args, out.stderr)


def test_a_paused_reader_loses_no_line_and_no_host(tmp_path: Path) -> None:
    # the ranks are done in a moment while dlrun waits on a full pipe (a pager paused longer than
    # --host-timeout): the hosts said everything and must not be declared silent, nor lines dropped
    script = write(tmp_path / "flood.py", "import os, sys\nfor i in range(20000):\n"
                   "    sys.stdout.write(f\"rank {os.environ['DLRUN_RANK']} line {i}\\n\")\n")
    argv = dlrun_argv("launch", "--np", "2", "--framework", "none", "--host-timeout", "2", "--log-dir", "logs",
                      str(script))
    proc = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    time.sleep(5)  # nothing reads dlrun's output for 2.5 host timeouts
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()[-2000:]
    logs = sorted((tmp_path / "logs").glob("*/rank-*.log"))
    assert [len(p.read_text().splitlines()) for p in logs] == [20000, 20000]
    assert out.decode().count("] rank 1 line ") == 20000


AGENT_CMDLINE = """
import os
with open(f"/proc/{os.getppid()}/cmdline", "rb") as fh:  # the parent: this host's agent
    cmdline = fh.read()
print("agent", len(cmdline), b"dlrun-agent" in cmdline, flush=True)
"""


@pytest.mark.parametrize("pidns", [True, False], ids=["pidns", "no-pidns"])
def test_the_agents_command_line_is_short_while_a_job_runs(tmp_path: Path, pidns: bool) -> None:
    # the agent's source comes on its stdin (dlrun.remote.boot_payload): ps shows the whole line
    script = write(tmp_path / "cmdline.py", AGENT_CMDLINE)
    out = run_dlrun("launch", "--plain", "--framework", "none", *([] if pidns else ["--no-pidns"]), str(script),
                    cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    seen = re.findall(r"^\[(\d) localhost\] agent (\d+) (\w+)$", out.stdout, re.M)
    assert sorted(rank for rank, _, _ in seen) == ["0", "1"], out.stdout
    assert all(0 < int(size) < 1024 and named == "True" for _, size, named in seen), seen


def test_max_restarts_runs_a_failed_job_again_with_a_new_job_id(tmp_path: Path) -> None:
    script = write(tmp_path / "flaky.py", "import os, sys\njob = os.environ['DLRUN_JOB_ID']\n"
                   "print('attempt of', job, flush=True)\nsys.exit(0 if job.endswith('-r1') else 3)\n")
    out = run_dlrun("launch", "--plain", "--framework", "none", "--max-restarts", "2", str(script), cwd=tmp_path,
                    timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "dlrun: attempt 1 failed (exit code 3): relaunching the job (1 of 2 restarts)" in out.stdout
    assert re.search(r"^\[0 localhost\] attempt of [\w-]+-r1$", out.stdout, re.M), out.stdout
    assert out.stdout.count("relaunching") == 1 and out.stdout.rstrip().endswith("/attempt-1/")  # the last's
    out = run_dlrun("launch", "--plain", "--framework", "none", "--max-restarts", "0", str(script), cwd=tmp_path)
    assert out.returncode == 3 and "relaunching" not in out.stdout


def test_help_shows_the_options_in_sections() -> None:
    out = run_dlrun("launch", "--help")
    assert out.returncode == 0, out.stderr
    heads = [line for line in out.stdout.splitlines() if line.endswith("options:")]
    assert heads == ["Job options:", "Output options:", "SSH options:", "Push options:", "Spark options:",
                     "Other options:"]
    sections = out.stdout.split("options:\n")
    assert "--ssh-config" in sections[3] and "--shard" in sections[4] and "--master" in sections[5]
    assert out.stdout.count("--host-timeout") == 1
    for command, head in (("topo", "SSH options:"), ("push", "Push options:")):
        assert head in run_dlrun(command, "--help").stdout


def test_the_clis_shard_policies_are_the_pushs() -> None:
    from dlrun.cli import SHARD_POLICIES
    from dlrun.push.shard import SHARD_POLICIES as PUSHED

    assert SHARD_POLICIES == PUSHED


def test_import_dlrun_imports_no_pipeline() -> None:
    code = ("import sys, dlrun; print([m for m in ('dlrun.run.pipeline', 'dlrun.api', 'click', 'rich', 'paramiko')"
            " if m in sys.modules], callable(dlrun.push), callable(dlrun.topo))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.stdout.strip() == "[] True True", out.stderr


FAILS_ON_RANK_1 = "import os, sys\nr = int(os.environ['DLRUN_RANK'])\nprint('rank', r, flush=True)\nsys.exit(7 * r)\n"


def test_the_python_api_runs_a_real_job_and_returns_its_result(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import dlrun
    from dlrun.errors import UsageError
    from dlrun.run.result import RankState
    from dlrun.run.view import PlainView

    monkeypatch.chdir(tmp_path)
    script = write(tmp_path / "job.py", "import os\nprint('rank', os.environ['DLRUN_RANK'], flush=True)\n")
    out = io.StringIO()
    result = dlrun.launch(script, ["--flag"], np=2, framework="torch", env={"A": "1"},
                          output=dlrun.OutputOptions(log_dir=tmp_path / "logs"), view=PlainView(out))
    assert result.exit_code == 0 and result.root_cause is None and result.attempts == 1, out.getvalue()
    assert [(r.rank, r.host, r.state) for r in result.ranks] == [(0, "localhost", RankState.SUCCEEDED),
                                                                 (1, "localhost", RankState.SUCCEEDED)]
    assert result.ranks[1].tail == ("rank 1",)
    assert result.commands[0].argv[-1] == "--flag" and result.commands[0].env["A"] == "1"
    assert result.log_dir == tmp_path / "logs" / result.job_id

    failing = write(tmp_path / "fail.py", FAILS_ON_RANK_1)
    result = dlrun.launch(failing, np=2, framework="none", job=dlrun.JobOptions(grace=2),
                          output=dlrun.OutputOptions(plain=True), view=PlainView(io.StringIO()))
    assert result.exit_code == 7 and result.root_cause is not None
    assert (result.root_cause.rank, result.root_cause.exit_code, result.root_cause.tail) == (1, 7, ("rank 1",))

    planned = dlrun.launch(script, np=3, output=dlrun.OutputOptions(dry_run=True), framework="none")
    assert planned.exit_code == 0 and planned.ranks == () and len(planned.commands) == 3

    with pytest.raises(UsageError, match="--json goes with --dry-run"):
        dlrun.launch(script, output=dlrun.OutputOptions(json_output=True))


def test_the_python_api_probes_and_pushes(tmp_path: Path) -> None:
    import dlrun

    found = dlrun.topo()
    assert [r.host for r in found.reports] == ["localhost"] and found.exit_code in (0, 1)
    assert found.exit_code == (1 if any(f.severity == "error" for f in found.findings) else 0)
    (tmp_path / "proj").mkdir()
    write(tmp_path / "proj" / "train.py", "print(1)\n")
    hosts = write(tmp_path / "hosts.toml", f'[defaults]\nworkdir = "{tmp_path / "remote"}"\n'
                  '[[hosts]]\naddress = "localhost"\n')
    summaries = dlrun.push(str(hosts), code=tmp_path / "proj", live=False, summary=False)
    assert [(s.host, s.files_sent) for s in summaries] == [("localhost", 1)]
    assert (tmp_path / "remote" / "proj" / "train.py").read_text() == "print(1)\n"
    assert dlrun.push(str(hosts), code=tmp_path / "proj", live=False, summary=False)[0].files_unchanged == 1


def test_shell_completion_offers_every_group_of_options() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "_DLRUN_COMPLETE": "bash_complete", "COMP_CWORD": "2"}
    for word, expected in (("--ssh", "--ssh-config"), ("--spl", "--split-lines"), ("--mas", "--master")):
        out = subprocess.run([sys.executable, "-c", "from dlrun.cli import main; main(prog_name='dlrun')"],
                             env={**env, "COMP_WORDS": f"dlrun launch {word}"}, capture_output=True, text=True)
        assert f"plain,{expected}" in out.stdout.splitlines(), (word, out.stdout, out.stderr)


def test_the_python_api_runs_a_job_from_a_thread(tmp_path: Path) -> None:
    # only the main thread may set signal handlers: a job started from another one runs without
    from concurrent.futures import ThreadPoolExecutor

    import dlrun
    from dlrun.run.view import PlainView

    script = write(tmp_path / "job.py", "print('hello', flush=True)\n")
    with ThreadPoolExecutor(1) as pool:
        result = pool.submit(dlrun.launch, script, np=1, framework="none",
                             output=dlrun.OutputOptions(log_dir=tmp_path / "logs"),
                             view=PlainView(io.StringIO())).result(timeout=120)
    assert result.exit_code == 0 and result.ranks[0].tail == ("hello",)


@pytest.mark.parametrize("preflight", [True, False])
def test_a_local_python_that_fails_at_once_is_named_with_what_it_said(tmp_path: Path, preflight: bool) -> None:
    # whether dlrun's write to it fails (broken pipe) or it ends before answering: the same words
    (tmp_path / "t.py").write_text("print(1)\n")
    (tmp_path / "hosts.toml").write_text('[[hosts]]\naddress = "localhost"\nslots = 1\n'
                                         'python = "sh -c \\"echo this python is broken >&2; exit 3\\" --"\n')
    out = run_dlrun("launch", "--plain", "--hosts", "hosts.toml", *([] if preflight else ["--no-preflight"]), "t.py",
                    cwd=tmp_path, timeout=60)
    text = out.stdout + out.stderr
    assert out.returncode == (1 if preflight else 255), text
    assert "exit 3)" in text and ": this python is broken" in text, text
    assert "broken: this python is broken" not in text and " is gone" not in text, text


#: attempt 0 says its MASTER_PORT and fails; attempt 1 says which of its own and attempt 0's
#: ports are still claimed (by dlrun) while it runs
PORT_CLAIMS = """
import os, sys
from dlrun.remote.agent import claim_ports
port = int(os.environ["MASTER_PORT"])
if os.environ["DLRUN_RESTART_COUNT"] == "0":
    open("first-port", "w").write(str(port))
    sys.exit(3)
first = int(open("first-port").read())
print("claimed", "first", claim_ports([first]) is None, "mine", claim_ports([port]) is None, flush=True)
"""


def test_a_restart_takes_new_ports_and_lets_go_of_the_last_attempts(tmp_path: Path) -> None:
    script = write(tmp_path / "claims.py", PORT_CLAIMS)
    out = run_dlrun("launch", "--plain", "--framework", "torch", "-n", "1", "--max-restarts", "1", str(script),
                    cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "] claimed first False mine True\n" in out.stdout, out.stdout


def test_a_terminal_that_is_not_utf8_gets_every_line_and_the_summary(tmp_path: Path) -> None:
    # LANG=en_US.ISO-8859-1 as PYTHONIOENCODING says it; the ranks write bytes, so it binds only dlrun
    (tmp_path / "s.py").write_text('import sys\nsys.stdout.buffer.write("caf\\u00e9 \\u2713 ".encode() + b"\\xe9\\n")\n'
                                   'sys.stdout.flush()\nprint("done", flush=True)\n')
    out = subprocess.run(dlrun_argv("launch", "--plain", "--np", "2", "--framework", "none", "s.py"), cwd=tmp_path,
                         capture_output=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONIOENCODING": "latin-1"})
    shown = out.stdout.decode("latin-1")
    assert out.returncode == 0, shown + out.stderr.decode("latin-1")  # before: UnicodeEncodeError, exit 1
    assert "[1 localhost] caf\u00e9 \\u2713 \\ufffd\n" in shown and "all 2 ranks succeeded" in shown
    logs = next((tmp_path / "dlrun-logs").iterdir())
    assert (logs / "rank-0.log").read_text(encoding="utf-8") == "caf\u00e9 \u2713 \ufffd\ndone\n"


def test_the_jobs_log_folder_and_files_are_the_users_alone(tmp_path: Path) -> None:
    (tmp_path / "s.py").write_text("print('secret', flush=True)\n")
    out = run_dlrun("launch", "--plain", "--np", "1", "--framework", "none", "s.py", cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    logs = next((tmp_path / "dlrun-logs").iterdir())
    assert oct(logs.stat().st_mode & 0o777) == oct(0o700)
    assert oct((logs / "rank-0.log").stat().st_mode & 0o777) == oct(0o600)


def test_a_reader_that_goes_away_leaves_the_job_running_to_its_end(tmp_path: Path) -> None:
    (tmp_path / "spam.py").write_text("import time\nfor i in range(200):\n    print(f'line {i}', flush=True)\n"
                                      "    time.sleep(0.005)\n")
    proc = subprocess.Popen(dlrun_argv("launch", "--plain", "--np", "2", "--framework", "none", "spam.py"),
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout is not None and proc.stderr is not None
    for _ in range(3):  # dlrun launch … | head -3
        proc.stdout.readline()
    proc.stdout.close()
    code = proc.wait(timeout=120)
    err = proc.stderr.read().decode()
    assert code == 0, err  # before: every rank stopped, exit 1, not a word
    assert "the output was closed (a pager or | head ended): the job goes on" in err
    logs = next((tmp_path / "dlrun-logs").iterdir())
    assert len((logs / "rank-1.log").read_text().splitlines()) == 200
