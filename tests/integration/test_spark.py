"""``--backend spark``: real barrier stages on ``local[3]`` and ``local-cluster[2,1,1024]``.

One SparkContext per class (a local one starts in 10-27 s here); ``local-cluster`` needs its
own, with two executor JVMs, each given one fake GPU by a discovery script (no GPU needed:
Spark only passes the addresses on). The pure parts (rendering, messages, pickling) run
without a context.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from dlrun.errors import BackendError, UsageError
from dlrun.run.config import LaunchConfig
from dlrun.run.view import PlainView
from dlrun.spark.driver import (
    Slots,
    SparkConfig,
    TaskHello,
    import_pyspark,
    quiet_task_failures,
    run_spark,
    slots_message,
    task_commands,
)
from dlrun.spark.task import interface_holding, rank_environ, task_main

from support.cli import REPO, run_dlrun
from support.spark import spark_test_context
from support.sshd_cluster import count_job_processes as job_processes

pyspark = pytest.importorskip("pyspark", reason="pip install 'dlrun[spark]'")
needs_java = pytest.mark.skipif(shutil.which("java") is None and not os.environ.get("JAVA_HOME"),
                                reason="no Java (apt-get install openjdk-17-jre-headless)")

EXAMPLE = REPO / "examples" / "train_digits.py"

FAIL = """
import os, sys, time
rank = int(os.environ["DLRUN_RANK"])
print(f"rank {rank} up gpus={os.environ.get('CUDA_VISIBLE_DEVICES')}", flush=True)
if rank == 1:
    time.sleep(1)
    print("about to fail", flush=True)
    sys.exit(7)
time.sleep(600)
"""

TICKS = """
import os, time
rank = int(os.environ["DLRUN_RANK"])
for i in range(6):
    print(f"tick {i}", flush=True)
    time.sleep(0.4)
"""

READY = """
import time
import zipfile
print("ready", flush=True)
time.sleep(600)
"""

FLAKY = """
import os, sys
job = os.environ["DLRUN_JOB_ID"]
print("attempt of", job, flush=True)
sys.exit(0 if "-r1" in job else 3)
"""


class Recorder(io.StringIO):
    """A stream that notes when each line was written."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[tuple[float, str]] = []

    def write(self, text: str) -> int:
        now = time.monotonic()
        for line in text.splitlines():
            self.times.append((now, line))
        return super().write(text)


class ActOnReady(PlainView):
    """A PlainView that calls ``act(job_id)`` once every rank printed "ready"."""

    def __init__(self, out: Recorder, ranks: int, act: Any) -> None:
        super().__init__(out)
        self.recorder = out
        self.waiting = set(range(ranks))
        self.act = act

    def lines(self, rank: int, texts: Sequence[str], stream: str) -> None:
        for text in texts:  # one by one, so each line is checked
            self.line(rank, text, stream)

    def line(self, rank: int, text: str, stream: str) -> None:
        super().line(rank, text, stream)
        if text == "ready" and rank in self.waiting:
            self.waiting.discard(rank)
            if not self.waiting:
                self.act(job_id_of(self.recorder.getvalue()))


def task_process_of(pid: int) -> int:
    """The Spark task (a forked ``pyspark.daemon`` worker) that ``pid`` descends from."""
    while pid > 1:
        with open(f"/proc/{pid}/status") as fh:
            pid = int(next(line for line in fh if line.startswith("PPid:")).split()[1])
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            if b"pyspark.daemon" in fh.read():
                return pid
    raise AssertionError("no pyspark worker among the ancestors")


def run(tmp_path: Path, script: str | Path, *args: str, view: Any = None, pidns: bool = True,
        max_restarts: int = 0, **spark: Any) -> tuple[int, str, float]:
    """run_spark with a PlainView into a string; (exit code, output, seconds)."""
    out = Recorder()
    config = LaunchConfig(script=str(script), args=args, log_dir=str(tmp_path / "logs"), grace=2, plain=True,
                          pidns=pidns, max_restarts=max_restarts)
    started = time.monotonic()
    code = run_spark(config, SparkConfig(**spark), view=view or PlainView(out))
    return code, out.getvalue(), time.monotonic() - started


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def task_processes(job_id: str, tasks: int = 3) -> list[int]:
    """Every process of the job (with an agent that takes no sweep tag, ``<job>.task<p>``)."""
    return job_processes(job_id) + [pid for p in range(tasks) for pid in job_processes(f"{job_id}.task{p}")]


def left_behind(job_id: str, timeout: float = 10) -> list[int]:
    deadline = time.monotonic() + timeout
    while (pids := task_processes(job_id)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return pids


def _rank_of(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            env = dict(item.split(b"=", 1) for item in fh.read().split(b"\0") if b"=" in item)
    except OSError:
        return None
    return env.get(b"DLRUN_RANK", b"").decode() or None


def job_id_of(output: str) -> str:
    match = re.search(r"\(job ([\w-]+)\)", output)
    assert match, output
    return match.group(1)


def check_failing_rank(tmp_path: Path, master: str, n: int, gpus: int = 0) -> str:
    """Rank 1 exits 7: dlrun exits 7 with the SSH path's root cause; nothing is left running."""
    script = write(tmp_path / "fail.py", FAIL)
    code, out, _ = run(tmp_path, script, master=master, num_workers=n, gpus_per_worker=gpus)
    assert code == 7, out
    assert re.search(r"^dlrun: root cause: rank 1 on host task1@\S+ exited with code 7$", out, re.M), out
    assert "    | about to fail" in out
    assert re.search(r"^\s+0\s+task0@\S+\s+143\s+stopped", out, re.M), out
    assert f"dlrun: job failed (0/{n} ranks succeeded); exit code 7" in out
    job_id = job_id_of(out)
    log = tmp_path / "logs" / job_id / "rank-1.log"
    assert "about to fail" in log.read_text()
    assert left_behind(job_id) == []
    return out


def check_digits(tmp_path: Path, master: str) -> None:
    """The TF example on 2 barrier tasks: TF_CONFIG from the tasks' own ports, accuracy >= 0.90."""
    code, out, seconds = run(tmp_path, EXAMPLE, "--epochs", "12", "--model-dir", str(tmp_path / "model"),
                             master=master, num_workers=2)
    assert code == 0, out
    accuracies = [float(m) for m in re.findall(r"^\[\d task\d@\S+\] test accuracy: ([0-9.]+)$", out, re.M)]
    assert len(accuracies) == 2 and min(accuracies) >= 0.90, out
    assert "[0 task0@" in out and "[1 task1@" in out and "2 workers, global batch 64" in out
    assert (tmp_path / "model" / "digits.keras").exists()
    print(f"{master}: digits trained in {seconds:.1f} s, accuracies {accuracies}")


# ============================================================================ no context


def hello(partition: int, port: int, gpus: tuple[str, ...] = ()) -> TaskHello:
    return TaskHello(partition=partition, host=f"10.0.0.{partition + 1}", port=port, gpus=gpus,
                     python=f"/envs/p{partition}/bin/python", script=f"/exec{partition}/dlrun-j.zip/train.py")


def test_task_commands_use_the_tasks_ports_gpus_python_and_script() -> None:
    config = LaunchConfig(script="train.py", args=("--epochs", "3"), env={"A": "1"})
    _, commands = task_commands(config, [hello(1, 4001, ("2", "3")), hello(0, 4000)], "job")
    assert [c.rank for c in commands] == [0, 1]
    assert [c.host_name for c in commands] == ["task0@10.0.0.1", "task1@10.0.0.2"]
    tf = json.loads(commands[1].env["TF_CONFIG"])
    assert tf == {"cluster": {"worker": ["10.0.0.1:4000", "10.0.0.2:4001"]}, "task": {"type": "worker", "index": 1}}
    assert commands[1].env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert "CUDA_VISIBLE_DEVICES" not in commands[0].env
    assert commands[1].argv == ("/envs/p1/bin/python", "/exec1/dlrun-j.zip/train.py", "--epochs", "3")
    assert commands[0].env["A"] == "1" and commands[0].env["DLRUN_WORLD_SIZE"] == "2"
    assert commands[0].cwd == "/exec0/dlrun-j.zip"  # where the project was unpacked, as pushed over SSH
    torch = replace(config, framework="torch")
    _, commands = task_commands(torch, [hello(0, 4000), hello(1, 4001)], "job")
    assert commands[1].env["MASTER_ADDR"] == "10.0.0.1" and commands[1].env["MASTER_PORT"] == "4000"


def test_ranks_do_not_get_what_spark_set_up_for_its_python_worker() -> None:
    worker = {"PYTHONPATH": "/s/pyspark/python/lib/pyspark.zip:/s/py4j-0.10.9.9-src.zip:/mine", "PATH": "/bin",
              "PYTHON_WORKER_FACTORY_SECRET": "f01a", "PYTHON_UDF_BATCH_SIZE": "100", "PYTHONHASHSEED": "0",
              "SPARK_REUSE_WORKER": "1", "_PYSPARK_DRIVER_CONN_INFO_PATH": "/tmp/x", "SPARK_HOME": "/s",
              "OMP_NUM_THREADS": "1"}
    assert rank_environ(worker) == {"PYTHONPATH": "/mine", "PATH": "/bin", "SPARK_HOME": "/s", "OMP_NUM_THREADS": "1"}
    assert "PYTHONPATH" not in rank_environ({"PYTHONPATH": "/s/pyspark.zip"})
    assert rank_environ({"PYTHONHASHSEED": "7"}) == {"PYTHONHASHSEED": "7"}  # the user's own seed stays


def test_each_task_gets_the_interface_its_executor_reported() -> None:
    torch = LaunchConfig(script="train.py", framework="torch")
    tasks = [replace(hello(0, 4000), iface="eth0"), replace(hello(1, 4001), iface="enp65s0f1"), hello(2, 4002)]
    _, commands = task_commands(torch, tasks, "job")
    assert [c.env.get("GLOO_SOCKET_IFNAME") for c in commands] == ["eth0", "enp65s0f1", None]
    assert not any("NCCL_SOCKET_IFNAME" in c.env for c in commands)  # found, not named: NCCL chooses
    _, commands = task_commands(replace(torch, iface="bond0"), tasks, "job")
    assert {c.env["NCCL_SOCKET_IFNAME"] for c in commands} == {"bond0"}


def test_interface_holding_names_this_machines_interfaces() -> None:
    from dlrun.topo.probe import probe_local

    assert interface_holding("127.0.0.1") == "lo"
    assert interface_holding("192.0.2.77") is None  # TEST-NET: nobody holds it
    for iface in probe_local("here").interfaces:
        for ipv4 in iface.ipv4:
            assert interface_holding(ipv4) == iface.name


def test_horovod_counts_tasks_on_one_machine_as_one_host() -> None:
    config = LaunchConfig(script="train.py", framework="horovod")
    tasks = [replace(hello(p, 4000 + p), host=host) for p, host in enumerate(["10.0.0.1", "10.0.0.2", "10.0.0.1"])]
    _, commands = task_commands(config, tasks, "job", rendezvous=("10.0.0.9", 7777))
    got = [tuple(c.env[f"HOROVOD_{k}"] for k in ("HOSTNAME", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE"))
           for c in commands]
    assert got == [("10.0.0.1", "0", "2", "0", "2"), ("10.0.0.2", "0", "1", "1", "2"), ("10.0.0.1", "1", "2", "0", "1")]
    assert commands[1].env["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == "10.0.0.9"
    assert commands[1].env["HOROVOD_GLOO_RENDEZVOUS_PORT"] == "7777"


def test_slots_message_has_the_numbers() -> None:
    text = slots_message(4, Slots(total=3, busy=1, executors=3, task_cpus=1), "spark://m:7077")
    assert text == ("-n 4 needs 4 task slots at once (barrier mode) but spark://m:7077 has 2 free"
                    " (3 in all: 3 executors, spark.task.cpus=1; 1 busy)")


def test_dynamic_allocation_is_refused_before_spark_starts(tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(BackendError) as info:
        run(tmp_path, "x.py", master="local[2]", num_workers=2, conf={"spark.dynamicAllocation.enabled": "true"})
    assert time.monotonic() - started < 2
    assert "dynamic allocation" in str(info.value)
    assert "--conf spark.dynamicAllocation.enabled=false" in str(info.value)


def test_usage_errors() -> None:
    with pytest.raises(UsageError, match="tf-ps"):
        run_spark(LaunchConfig(script="x.py", framework="tf-ps"), SparkConfig(master="local[2]", num_workers=2))
    with pytest.raises(UsageError, match="--hosts"):
        run_spark(LaunchConfig(script="x.py", hosts="a,b"), SparkConfig(master="local[2]", num_workers=2))


def test_missing_pyspark_and_java_say_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pyspark", None)
    with pytest.raises(BackendError) as info:
        import_pyspark()
    assert "pip install 'dlrun[spark]'" in str(info.value)
    # the real pyspark, in a fresh interpreter (no context of other tests) that finds no java
    probe = ("import pyspark\nfrom dlrun.errors import BackendError\n"
             "from dlrun.spark.driver import SparkConfig, spark_context\n"
             "try:\n    with spark_context(pyspark, SparkConfig('local[2]', 2), app_name='x'):\n        pass\n"
             "except BackendError as exc:\n    print(type(exc).__name__, exc, exc.hint)\n")
    env = {k: v for k, v in os.environ.items() if k != "JAVA_HOME"}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=REPO,
                         env={**env, "PATH": "/nonexistent", "PYTHONPATH": str(REPO)})
    assert out.stdout.startswith("BackendError --backend spark needs Java 17 or newer (no java on PATH)"), out
    assert "openjdk-17-jre-headless" in out.stdout, out


@needs_java
def test_a_failed_job_logs_no_spark_traceback_per_task_but_the_root_cause(tmp_path: Path) -> None:
    # each task's verdict is an exception: Spark's Executor and TaskSetManager would log its
    # whole traceback, per task; dlrun layers its log4j2 file over Spark's defaults
    write(tmp_path / "fail.py", "import os, sys\nprint('rank', os.environ['RANK'], flush=True)\nsys.exit(3)\n")
    out = run_dlrun("launch", "--plain", "--backend", "spark", "--master", "local[2]", "--np", "2", "fail.py",
                    cwd=tmp_path, timeout=300)
    assert out.returncode == 3, out.stdout + out.stderr
    assert "root cause: rank 0" in out.stdout + out.stderr or "root cause: rank 1" in out.stdout + out.stderr, out
    assert not re.search(r"(ERROR|WARN) (Executor|TaskSetManager):", out.stdout + out.stderr), out.stderr
    assert "Traceback" not in out.stderr, out.stderr


def test_the_users_own_log4j2_settings_win(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pyspark

    monkeypatch.delenv("SPARK_HOME", raising=False)
    monkeypatch.setenv("SPARK_CONF_DIR", str(tmp_path))
    options = quiet_task_failures(pyspark, {"spark.driver.extraJavaOptions": "-Xss4m"})
    files = options["spark.driver.extraJavaOptions"].removeprefix("-Xss4m -Dlog4j2.configurationFile=").split(",")
    assert files[0] == "org/apache/spark/log4j2-defaults.properties"  # Spark's own first, in its jar
    assert "logger.dlrunexecutor.level = off" in Path(files[1]).read_text()
    assert quiet_task_failures(pyspark, {"spark.driver.extraJavaOptions": "-Dlog4j2.configurationFile=x"}) == {}
    (tmp_path / "log4j2.properties").write_text("rootLogger.level = info\n")
    assert quiet_task_failures(pyspark, {}) == {}


def test_importing_the_backend_does_not_import_pyspark() -> None:
    probe = ("import sys, dlrun.spark.driver, dlrun.spark.task, dlrun.cli;"
             " print('pyspark' in sys.modules, 'py4j' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.stdout.strip() == "False False", out.stderr


def test_the_task_function_needs_no_dlrun_on_the_executors() -> None:
    import dlrun.spark.task
    from dlrun.spark.tls import make_job_tls

    cloudpickle = pyspark.cloudpickle
    cloudpickle.register_pickle_by_value(dlrun.spark.task)
    cert = make_job_tls("j").cert_pem
    data = cloudpickle.dumps((partial(task_main, {"driver": ["h", 1], "cert": cert}), dlrun.spark.task.client_context))
    probe = ("import pickle, sys\n"
             "sys.modules['dlrun'] = None  # importing dlrun now fails\n"
             "sys.modules['cryptography'] = None  # and so does cryptography: the task's TLS is stdlib\n"
             "task, client_context = pickle.loads(sys.stdin.buffer.read())\n"
             "context = client_context(task.args[0]['cert'])\n"
             "print(task.func.__name__, task.args[0]['driver'], context.minimum_version.name)\n")
    env = {**os.environ, "PYTHONPATH": str(Path(pyspark.__file__).parent.parent)}
    out = subprocess.run([sys.executable, "-c", probe], input=data, capture_output=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr.decode()
    assert out.stdout.decode().strip() == "task_main ['h', 1] TLSv1_3"


# ============================================================================ local[3]


@pytest.fixture(scope="class")
def local_sc() -> Iterator[Any]:
    yield from spark_test_context(TestLocal.MASTER, {})


@needs_java
@pytest.mark.usefixtures("local_sc")
@pytest.mark.spark  # a Spark session (17-27 s to start) and stages
class TestLocal:
    MASTER = "local[3]"

    def test_failing_rank_is_the_root_cause_and_sets_the_exit_code(self, tmp_path: Path) -> None:
        check_failing_rank(tmp_path, self.MASTER, 3)

    def test_lines_stream_live_with_rank_prefixes(self, tmp_path: Path) -> None:
        stream = Recorder()
        script = write(tmp_path / "ticks.py", TICKS)
        code, _, _ = run(tmp_path, script, view=PlainView(stream), master=self.MASTER, num_workers=2)
        ended = time.monotonic()
        out = stream.getvalue()
        assert code == 0, out
        for rank in (0, 1):
            seen = [(t, line) for t, line in stream.times if re.fullmatch(rf"\[{rank} task{rank}@\S+\] tick \d", line)]
            assert [line[-1] for _, line in seen] == list("012345"), out
            first, last = seen[0][0], seen[-1][0]
            assert last - first >= 1.0, f"rank {rank}'s lines came in one burst: {seen}"
            assert ended - first >= 1.0
        assert (tmp_path / "logs" / job_id_of(out) / "rank-1.log").read_text().splitlines()[0] == "tick 0"

    def test_the_scripts_directory_goes_along_as_a_push_sends_it(self, tmp_path: Path) -> None:
        project = tmp_path / "proj"
        (project / "conf").mkdir(parents=True)
        write(project / "helper.py", "GREETING = 'hello from helper'\n")
        write(project / "conf" / "settings.txt", "lr=0.1\n")
        write(project / ".dlrunignore", "secret.txt\n")
        write(project / "secret.txt", "x\n")
        script = write(project / "train.py", "import os, helper\n"
                       "settings = open('conf/settings.txt').read().strip()\n"
                       "print(helper.GREETING, settings, os.path.exists('secret.txt'),\n"
                       "      'PYTHON_WORKER_FACTORY_SECRET' in os.environ)\n")
        code, out, _ = run(tmp_path, script, master=self.MASTER, num_workers=2)
        assert code == 0, out
        for rank in (0, 1):
            # the project went along, minus what .dlrunignore names; Spark's worker secret did not
            assert re.search(rf"^\[{rank} task{rank}@\S+\] hello from helper lr=0.1 False False$", out, re.M), out

    def test_a_successful_job_is_a_successful_stage(self, tmp_path: Path, local_sc: Any) -> None:
        # the driver once shut its side of a task's socket before the verdict went out: the
        # task raised 'the driver hung up' and Spark failed the stage of a job that succeeded
        for attempt in range(3):
            code, out, _ = run(tmp_path / str(attempt), write(tmp_path / "ok.py", "print('ok')\n"),
                               master=self.MASTER, num_workers=2)
            assert code == 0, out
            tracker = local_sc.statusTracker()
            jobs = [tracker.getJobInfo(j) for j in tracker.getJobIdsForGroup(job_id_of(out))]
            assert [j.status for j in jobs] == ["SUCCEEDED"], (attempt, out)

    def test_too_many_tasks_fail_fast_with_the_numbers(self, tmp_path: Path, local_sc: Any) -> None:
        stages_before = set(local_sc.statusTracker().getActiveStageIds())
        with pytest.raises(BackendError) as info:
            run(tmp_path, write(tmp_path / "t.py", TICKS), master=self.MASTER, num_workers=4)
        # refused before a stage was submitted: no rank ever logged, no stage of ours runs
        assert not list((tmp_path / "logs").rglob("*.log")), list((tmp_path / "logs").rglob("*"))
        assert set(local_sc.statusTracker().getActiveStageIds()) <= stages_before
        assert "-n 4 needs 4 task slots at once (barrier mode) but local[3] has 3 free (3 in all" in str(info.value)

    def test_tasks_that_do_not_report_in_time_are_cancelled(self, tmp_path: Path, local_sc: Any) -> None:
        with pytest.raises(BackendError) as info:
            run(tmp_path, write(tmp_path / "t.py", TICKS), master=self.MASTER, num_workers=2, start_timeout=0.01)
        assert re.match(r"only [01] of 2 Spark tasks reported within 0 s \(missing partitions ", str(info.value))
        assert info.value.exit_code == 255  # the cluster failed us, as an unreachable host does: not a usage error
        assert "--start-timeout" in str(info.value.hint)
        deadline = time.monotonic() + 10  # the status tracker follows Spark's listener bus, a little late
        while local_sc.statusTracker().getActiveJobsIds() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert local_sc.statusTracker().getActiveJobsIds() == [], "the stage still runs"

    def test_max_restarts_relaunches_the_stage(self, tmp_path: Path) -> None:
        code, out, _ = run(tmp_path, write(tmp_path / "flaky.py", FLAKY), master=self.MASTER, num_workers=2,
                           max_restarts=1)
        assert code == 0, out
        assert "attempt 1 failed (exit code 3): relaunching the barrier stage (1 of 1 restarts)" in out
        assert re.search(r"\] attempt of [\w-]+-r1(\.task[01])?$", out, re.M), out

    def test_the_python_api_runs_a_stage_and_returns_its_result(self, tmp_path: Path) -> None:
        import dlrun

        out = Recorder()
        result = dlrun.launch(write(tmp_path / "fail.py", FLAKY), spark=dlrun.SparkOptions(master=self.MASTER), np=2,
                              output=dlrun.OutputOptions(log_dir=tmp_path / "logs"), job=dlrun.JobOptions(grace=2),
                              view=PlainView(out))
        assert result.exit_code == 3 and result.attempts == 1, out.getvalue()
        assert result.root_cause is not None and result.root_cause.host.startswith("task")
        assert [r.host.split("@")[0] for r in result.ranks] == ["task0", "task1"]

    def test_ctrl_c_stops_every_rank_and_the_stage(self, tmp_path: Path) -> None:
        out = Recorder()
        seen: list[str] = []

        def interrupt(job_id: str) -> None:
            seen.append(job_id)
            os.kill(os.getpid(), signal.SIGINT)

        code, text, seconds = run(tmp_path, write(tmp_path / "ready.py", READY), view=ActOnReady(out, 2, interrupt),
                                  master=self.MASTER, num_workers=2)
        text = out.getvalue()
        assert code == 130, text
        assert "dlrun: interrupted by signal 2; every rank stopped; exit code 130" in text
        assert left_behind(seen[0]) == []
        assert seconds < 30

    @pytest.mark.parametrize("pidns", [True, False], ids=["pidns", "no-pidns"])
    def test_a_killed_task_takes_its_ranks_along_and_is_the_root_cause(self, tmp_path: Path, pidns: bool) -> None:
        out = Recorder()
        killed: list[int] = []

        def kill_task_0(job_id: str) -> None:
            rank0 = next(p for p in task_processes(job_id) if _rank_of(p) == "0")
            killed.append(task_process_of(rank0))
            os.kill(killed[0], signal.SIGKILL)

        code, _, seconds = run(tmp_path, write(tmp_path / "ready.py", READY), view=ActOnReady(out, 2, kill_task_0),
                               pidns=pidns, master=self.MASTER, num_workers=2)
        text = out.getvalue()
        assert code == 255, text
        assert re.search(r"^dlrun: root cause: host task0@\S+ \(rank 0\): connection to the host was lost", text,
                         re.M), text
        assert left_behind(job_id_of(text)) == []
        assert seconds < 30

    @pytest.mark.slow
    def test_tf_digits_on_two_tasks(self, tmp_path: Path) -> None:
        check_digits(tmp_path, self.MASTER)


# ============================================================================ local-cluster


@pytest.fixture(scope="class")
def cluster_sc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Two executor JVMs with one (fake) GPU each: a discovery script names GPU "0"."""
    gpus = tmp_path_factory.mktemp("gpus") / "gpus.sh"
    gpus.write_text('#!/bin/sh\necho \'{"name": "gpu", "addresses": ["0"]}\'\n')
    gpus.chmod(0o755)
    conf = {"spark.task.resource.gpu.amount": "1"}
    for who in ("worker", "executor"):
        conf[f"spark.{who}.resource.gpu.amount"] = "1"
        conf[f"spark.{who}.resource.gpu.discoveryScript"] = str(gpus)
    yield from spark_test_context(TestLocalCluster.MASTER, conf, executors=2)


@needs_java
@pytest.mark.usefixtures("cluster_sc")
@pytest.mark.spark  # a Spark session (17-27 s to start) and stages
class TestLocalCluster:
    MASTER = "local-cluster[2,1,1024]"

    def test_too_many_tasks_fail_fast_with_the_numbers(self, tmp_path: Path) -> None:
        started = time.monotonic()
        with pytest.raises(BackendError) as info:
            run(tmp_path, write(tmp_path / "t.py", TICKS), master=self.MASTER, num_workers=3)
        assert time.monotonic() - started < 5
        assert ("-n 3 needs 3 task slots at once (barrier mode) but local-cluster[2,1,1024] has 2 free"
                " (2 in all: 2 executors, spark.task.cpus=1; 0 busy)") in str(info.value)

    def test_failing_rank_with_gpus_from_task_resources(self, tmp_path: Path) -> None:
        out = check_failing_rank(tmp_path, self.MASTER, 2, gpus=1)
        assert re.search(r"^\[0 task0@\S+\] rank 0 up gpus=0$", out, re.M), out

    @pytest.mark.slow
    def test_tf_digits_on_two_executors(self, tmp_path: Path) -> None:
        check_digits(tmp_path, self.MASTER)


def test_a_linked_script_ships_with_its_targets_directory(tmp_path: Path) -> None:
    from dlrun.spark.driver import ship_script

    (tmp_path / "proj" / "src").mkdir(parents=True)
    write(tmp_path / "proj" / "src" / "train_v2.py", "import helper\n")
    write(tmp_path / "proj" / "src" / "helper.py", "")
    (tmp_path / "proj" / "run.py").symlink_to("src/train_v2.py")

    class Context:
        def __init__(self) -> None:
            self.archives: list[str] = []

        def addArchive(self, path: str) -> None:
            self.archives.append(path)

    context = Context()
    shipped = ship_script(context, str(tmp_path / "proj" / "run.py"), "job", tmp_path / "stage")
    assert shipped == ("dlrun-job.zip", "train_v2.py")  # the rank runs the target, beside its modules
    with zipfile.ZipFile(context.archives[0]) as zf:
        assert sorted(zf.namelist()) == ["helper.py", "train_v2.py"]


def test_a_script_only_on_the_executors_is_not_refused_here(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    class Checked(Exception):
        pass

    def stop_after_the_checks() -> None:
        raise Checked

    monkeypatch.setattr("dlrun.spark.driver.import_pyspark", stop_after_the_checks)
    with pytest.raises(Checked):  # a path on the executors runs as given there (not shipped)
        run_spark(LaunchConfig(script="/opt/jobs/train.py", log_dir=str(tmp_path)),
                  SparkConfig(master="spark://head:7077", num_workers=2))
