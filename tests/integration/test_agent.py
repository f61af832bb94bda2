"""The host agent's protocol, run for real as a local subprocess: probe, start, PID namespace, output.

These talk to ``python -c <agent source>`` exactly as the controller does (JSON lines in,
frames out); the SSH tests run the same program over sshd.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

import pytest

from dlrun.inventory import Host
from dlrun.push.session import helper_source
from dlrun.remote import LOADER, agent, boot_argv, boot_payload, source_of
from dlrun.run.config import LaunchConfig
from dlrun.run.pipeline import launch
from dlrun.topo.probe import parse_probe_output
from dlrun.transport.base import Channel
from dlrun.transport.local import HostRouter, LocalTransport

from support.sshd_cluster import ensure_test_user
from support.wait import wait_until


def talk(argv: Sequence[str], messages: Sequence[Mapping[str, object]], env: dict[str, str] | None = None,
         timeout: float = 60) -> list[tuple[int, int, bytes]]:
    """Send the messages, close stdin once the agent is done, return every frame it sent."""
    proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    assert proc.stdin is not None and proc.stdout is not None
    boot = boot_payload("agent") if LOADER in argv else b""  # the loader reads the agent first
    proc.stdin.write(boot + b"".join(json.dumps(m).encode() + b"\n" for m in messages))
    proc.stdin.flush()
    decoder = agent.FrameDecoder()
    frames: list[tuple[int, int, bytes]] = []
    starts = any(m.get("op", "start") == "start" for m in messages)
    questions = sum(m.get("op") in ("probe", "survey", "ports") for m in messages)
    while True:
        data = read_some(proc.stdout)
        if not data:
            break
        frames += decoder.feed(data)
        answers = sum(k in (agent.PROBE, agent.SURVEY, agent.PORTS) for k, _, _ in frames)
        done = any(k == agent.DONE for k, _, _ in frames) or (not starts and answers >= questions)
        if done and not proc.stdin.closed:
            proc.stdin.close()
    proc.wait(timeout)
    return frames


def read_some(stream: IO[bytes]) -> bytes:
    """What the agent sent so far, at most 64 KiB: no more than one read of the pipe."""
    assert isinstance(stream, io.BufferedReader)  # Popen's stdout with its default buffering
    return stream.read1(65536)


def agent_cmd(*extra: str) -> list[str]:
    return boot_argv([sys.executable], "agent", *extra)


def start_agent() -> subprocess.Popen[bytes]:
    """An agent started as the controller starts one: the loader, then its source on stdin."""
    proc = subprocess.Popen(agent_cmd(), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdin is not None
    proc.stdin.write(boot_payload("agent"))
    proc.stdin.flush()
    return proc


def hello(frames: list[tuple[int, int, bytes]]) -> dict[str, object]:
    return dict(json.loads(next(p for k, _, p in frames if k == agent.HELLO)))


def test_probe_runs_inside_the_agent_before_the_spec() -> None:
    spec = {"job_id": "j1", "ranks": [{"rank": 0, "argv": [sys.executable, "-c", "print('hi')"], "env": {}}]}
    frames = talk(agent_cmd(), [{"op": "probe", "source": source_of("probe")}, spec])
    kinds = [k for k, _, _ in frames]
    assert kinds.index(agent.PROBE) < kinds.index(agent.STARTED)
    report = parse_probe_output("here", next(p for k, _, p in frames if k == agent.PROBE).decode())
    assert report.ok and report.error is None and report.cpu_count == os.cpu_count()
    assert b"".join(p for k, r, p in frames if k == agent.STDOUT and r == 0) == b"hi\n"
    assert json.loads(next(p for k, _, p in frames if k == agent.EXIT)) == {"code": 0}


def test_a_broken_probe_still_gets_an_answer() -> None:
    frames = talk(agent_cmd(), [{"op": "probe", "source": "raise SystemExit(3)"}])
    answer = next(p for k, _, p in frames if k == agent.PROBE).decode()
    assert "probe failed in the agent: SystemExit" in answer
    assert parse_probe_output("h", answer).error


def test_survey_answers_what_the_push_helper_would_before_the_probe(tmp_path: Path) -> None:
    root = tmp_path / "code"
    root.mkdir()
    (root / "a.py").write_text("A = 1\n")
    request = {"targets": [{"root": str(root), "paths": ["a.py", "gone.py"]}]}
    frames = talk(agent_cmd(), [{"op": "survey", "source": helper_source(), "request": request},
                                {"op": "probe", "source": "print('{}')"}])
    kinds = [k for k, _, _ in frames]
    assert kinds.index(agent.SURVEY) < kinds.index(agent.PROBE)
    answer = json.loads(next(p for k, _, p in frames if k == agent.SURVEY))
    helper = subprocess.run([sys.executable, "-c", helper_source()], input=json.dumps(request) + "\n",
                            capture_output=True, text=True, timeout=60)
    alone = json.loads(helper.stdout.splitlines()[0])
    for reply in (answer, alone):  # free space moves with whatever else writes to that disk
        reply["targets"][0].pop("free")
    assert answer == alone
    (entry,) = answer["targets"]
    assert entry["entries"] == {"a.py": ["file", 6, 0o644, hashlib.sha256(b"A = 1\n").hexdigest(), False]}
    assert entry["settled"] is False  # a.py is there but no push recorded it


def test_a_broken_survey_is_answered_with_its_error() -> None:
    frames = talk(agent_cmd(), [{"op": "survey", "source": "def survey(spec):\n    raise OSError('no')\n",
                                 "request": {"targets": [{"root": "/", "paths": []}]}}])
    assert json.loads(next(p for k, _, p in frames if k == agent.SURVEY)) == {"error": "OSError: no"}


def test_tiny_unbuffered_writes_arrive_whole_in_fewer_frames() -> None:
    script = "import sys\nfor i in range(3000):\n    sys.stdout.write(f'{i}\\n'); sys.stdout.flush()\n"
    spec = {"job_id": "j2", "ranks": [{"rank": 0, "argv": [sys.executable, "-c", script], "env": {}}]}
    frames = talk(agent_cmd(), [spec])
    out = [p for k, _, p in frames if k == agent.STDOUT]
    assert b"".join(out).decode().split() == [str(i) for i in range(3000)]
    assert len(out) < 1500  # coalesced: never a frame per write


def unshare_works() -> bool:
    probe = subprocess.run(agent.pidns_argv(["sh", "-c", 'case "$*" in *--in-pidns*) exit 0;; esac; exit 1', "x"]),
                           capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not shutil.which("unshare"), reason="no unshare(1) here")
def test_wrapper_runs_the_agent_as_pid_1_of_a_namespace() -> None:
    if not unshare_works():
        pytest.skip("this user may not create PID namespaces here")
    frames = talk(agent.pidns_argv(agent_cmd()), [{"op": "probe", "source": "print('{}')"}])
    facts = hello(frames)
    assert facts["pidns"] is True and facts["pid"] == 1


def test_wrapper_falls_back_without_unshare_and_on_request(tmp_path: Path) -> None:
    fake = tmp_path / "unshare"
    fake.write_text("#!/bin/sh\necho 'unshare: operation not permitted' >&2\nexit 1\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    probe = [{"op": "probe", "source": "print('{}')"}]
    assert hello(talk(agent.pidns_argv(agent_cmd()), probe, env=env))["pidns"] is False
    env = {**os.environ, "DLRUN_NO_PIDNS": "1"}
    assert hello(talk(agent.pidns_argv(agent_cmd()), probe, env=env))["pidns"] is False


# util-linux before 2.38 (Ubuntu 22.04, RHEL 8 and 9): no --map-current-user; the rest goes to the real one
OLD_UNSHARE = """#!/bin/sh
case " $* " in *" --map-current-user "*) echo "unshare: unrecognized option '--map-current-user'" >&2; exit 1;; esac
exec REAL "$@"
"""


@pytest.mark.skipif(not shutil.which("unshare") or os.geteuid() != 0, reason="needs unshare(1), and root to be a user")
def test_a_login_user_whose_unshare_cannot_map_them_runs_as_themselves_not_as_namespace_root() -> None:
    user = ensure_test_user()
    folder = Path(tempfile.mkdtemp(prefix="dlrun-old-unshare-"))  # where the login user may run it
    try:
        folder.chmod(0o755)
        fake = folder / "unshare"
        fake.write_text(OLD_UNSHARE.replace("REAL", shutil.which("unshare") or "unshare"))
        fake.chmod(0o755)
        report = "import os, pwd; print(os.getuid(), pwd.getpwuid(os.getuid()).pw_dir)"
        argv = ["runuser", "-u", user.pw_name, "--", "env", f"PATH={folder}:{os.environ['PATH']}",
                *agent.pidns_argv([sys.executable, "-c", report])]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd="/")
    finally:
        shutil.rmtree(folder)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(user.pw_uid), user.pw_dir], out.stdout  # before: "0 /root"


@pytest.mark.skipif(not shutil.which("unshare"), reason="no unshare(1) here")
def test_wrapper_refuses_a_namespace_that_shows_the_hosts_proc(tmp_path: Path) -> None:
    """An unshare that makes the PID namespace but not its /proc (CUDA's error 304): run plainly."""
    if not unshare_works():
        pytest.skip("this user may not create PID namespaces here")
    real = shutil.which("unshare")
    fake = tmp_path / "unshare"
    fake.write_text("#!/bin/sh\nargs=''\nfor a in \"$@\"; do case $a in --mount-proc|--propagation|slave) ;; "
                    f"*) set -- \"$@\" \"$a\";; esac; shift; done\nexec {real} \"$@\"\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    facts = hello(talk(agent.pidns_argv(agent_cmd()), [{"op": "probe", "source": "print('{}')"}], env=env))
    assert facts["pidns"] is False and facts["own_proc"] is True


def test_hello_says_whether_proc_self_is_the_agent() -> None:
    facts = hello(talk(agent.pidns_argv(agent_cmd()), [{"op": "probe", "source": "print('{}')"}]))
    assert facts["own_proc"] is True


class CountingTransport(LocalTransport):
    def __init__(self) -> None:
        self.opened: list[tuple[str, ...]] = []

    def open(self, host: Host, argv: Sequence[str]) -> Channel:
        self.opened.append(tuple(argv))
        return super().open(host, argv)


def test_launch_preflight_costs_no_extra_process_per_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "job.py"
    script.write_text("import os\nprint('rank', os.environ['DLRUN_RANK'])\n")
    counting = CountingTransport()
    monkeypatch.setattr("dlrun.run.hosts.make_transport", lambda inventory, ssh: HostRouter(None, counting))
    monkeypatch.chdir(tmp_path)
    code = launch(LaunchConfig(script=str(script), hosts="localhost:2", plain=True, framework="torch"))
    assert code == 0
    assert len(counting.opened) == 1  # one agent for the host's ranks, which also ran the probe; nothing else
    assert all("-c" in argv and LOADER in argv and "dlrun-agent" in argv for argv in counting.opened)  # the bootstrap


REAPED_FIRST = r"""
import json, os, sys, time
from dlrun.remote import agent
r, w = os.pipe()
out = os.fdopen(w, "wb")  # kept: the agent only holds its fd
a = agent.Agent(out, in_namespace=True)
a.start({"job_id": "j", "ranks": [{"rank": 0, "argv": [sys.executable, "-c", "raise SystemExit(7)"], "env": {}}]})
pid = a.procs[0].pid
while open(f"/proc/{pid}/stat").read().split(") ")[1][0] != "Z":
    time.sleep(0.01)
a.reap_orphans()  # as PID 1 does for orphans: this reaps the rank too
a.reap()
a.flush()
frames = agent.FrameDecoder().feed(os.read(r, 65536))
print(json.dumps([json.loads(p) for k, _, p in frames if k == agent.EXIT]))
"""


def test_a_rank_reaped_with_the_orphans_keeps_its_exit_code() -> None:
    out = subprocess.run([sys.executable, "-c", REAPED_FIRST], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [{"code": 7}]  # not 0: Popen.poll's answer for a child reaped elsewhere


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


SLEEPING_RANK = "import time\nprint('up', flush=True)\ntime.sleep(600)\n"


def start_silent_job(script: str, host_timeout: float) -> tuple[subprocess.Popen[bytes], int]:
    """An agent (no PID namespace) whose controller sends the spec, then nothing: returns the
    agent and its rank's pid. stdin stays open, as over a connection whose far end vanished."""
    spec = {"job_id": "silent", "eof_grace": 0.5, "host_timeout": host_timeout,
            "ranks": [{"rank": 0, "argv": [sys.executable, "-c", script], "env": {}}]}
    return start_spec(spec)


def start_spec(spec: Mapping[str, object]) -> tuple[subprocess.Popen[bytes], int]:
    """An agent given ``spec`` (one rank), once it says the rank started: the agent, the rank's pid."""
    proc = start_agent()
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps(spec).encode() + b"\n")
    proc.stdin.flush()
    decoder = agent.FrameDecoder()
    frames: list[tuple[int, int, bytes]] = []
    while not any(k == agent.STARTED for k, _, _ in frames):
        frames += decoder.feed(read_some(proc.stdout))
    pid = int(json.loads(next(p for k, _, p in frames if k == agent.STARTED))["pid"])
    return proc, pid


def test_pings_are_answered_and_keep_a_quiet_job_alive() -> None:
    proc, pid = start_silent_job(SLEEPING_RANK, host_timeout=1.0)
    assert proc.stdin is not None and proc.stdout is not None
    decoder, pongs = agent.FrameDecoder(), 0
    for _ in range(8):  # 2.4 s of pings, well past the 1 s limit
        proc.stdin.write(b'{"op": "ping"}\n')
        proc.stdin.flush()
        while not pongs:
            pongs += sum(k == agent.PONG for k, _, _ in decoder.feed(read_some(proc.stdout)))
        pongs = 0
        time.sleep(0.3)
    assert _alive(pid) and proc.poll() is None
    proc.stdin.close()  # then the usual EOF path ends it
    assert proc.wait(30) == 0 and wait_until(lambda: not _alive(pid), 5)


FLOOD_RANK = "import sys\nprint('up', flush=True)\nwhile True:\n    sys.stdout.write('x' * 65535 + '\\n')\n"


# quiet: no EOF ever comes (stdin stays open), silence alone must end the job. flood: the rank
# fills a pipe nobody reads, and the agent's writes must not hold the silence check back.
@pytest.mark.parametrize("rank", [SLEEPING_RANK, FLOOD_RANK], ids=["quiet", "flood"])
def test_a_silent_controller_makes_the_agent_stop_its_ranks(rank: str) -> None:
    proc, pid = start_silent_job(rank, host_timeout=1.0)
    try:
        assert wait_until(lambda: proc.poll() is not None, 15), "agent still running after 15 s of silence"
        assert wait_until(lambda: not _alive(pid), 5)
    finally:
        proc.kill()
        proc.wait()


def test_a_watch_arms_the_silence_clock_before_the_spec() -> None:
    # an agent started early (probe, push survey) whose controller then vanishes: it ends by itself
    proc = start_agent()
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(b'{"op": "watch", "host_timeout": 1.0}\n')
        proc.stdin.flush()
        for _ in range(6):  # pings keep it waiting well past the limit
            time.sleep(0.3)
            proc.stdin.write(b'{"op": "ping"}\n')
            proc.stdin.flush()
        assert proc.poll() is None
        assert wait_until(lambda: proc.poll() is not None, 15), "agent still waiting after 15 s of silence"
        assert proc.returncode == 0
    finally:
        proc.kill()
        proc.wait()


def test_a_probe_longer_than_the_host_timeout_does_not_end_a_pinged_agent() -> None:
    # the pings wait unread while the probe runs; they count as heard once it returns
    proc = start_agent()
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(b'{"op": "watch", "host_timeout": 1.0}\n'
                         b'{"op": "probe", "source": "import time; time.sleep(1.5); print(1)"}\n')
        proc.stdin.flush()
        for _ in range(10):
            time.sleep(0.25)
            proc.stdin.write(b'{"op": "ping"}\n')
            proc.stdin.flush()
        decoder, kinds = agent.FrameDecoder(), []
        while agent.PONG not in kinds:
            kinds += [k for k, _, _ in decoder.feed(read_some(proc.stdout))]
        assert agent.PROBE in kinds and agent.DONE not in kinds and proc.poll() is None
        proc.stdin.close()
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        proc.wait()


def test_a_failed_ranks_error_file_comes_back_with_its_exit(tmp_path: Path) -> None:
    """torch's ``@record`` contract: the agent makes the file's folder, returns what the rank
    wrote there with the EXIT frame, and takes the folder away at the end."""
    error_file = tmp_path / "dlrun-j3" / "attempt_0" / "0" / "error.json"
    write = ("import json, os; open(os.environ['TORCHELASTIC_ERROR_FILE'], 'w').write("
             "json.dumps({'message': {'message': 'ValueError: bad batch'}})); raise SystemExit(1)")
    spec = {"job_id": "j3", "ranks": [
        {"rank": 0, "argv": [sys.executable, "-c", write], "env": {"TORCHELASTIC_ERROR_FILE": str(error_file)}},
        {"rank": 1, "argv": [sys.executable, "-c", "pass"], "env": {"TORCHELASTIC_ERROR_FILE": str(error_file)[:-6]}},
    ]}
    frames = talk(agent_cmd(), [spec])
    exits = {r: json.loads(p) for k, r, p in frames if k == agent.EXIT}
    assert exits[0] == {"code": 1, "error_file": {"message": {"message": "ValueError: bad batch"}}}
    assert exits[1] == {"code": 0}
    assert not (tmp_path / "dlrun-j3").exists()


def test_an_agent_ended_by_a_signal_leaves_no_rank_folder_behind(tmp_path: Path) -> None:
    """sshd sends SIGHUP when the client's connection goes: the agent kills its ranks and takes
    their folders away too (empty ``/tmp/dlrun-<job>/attempt_0/<rank>/`` piled up in /tmp)."""
    error_file = tmp_path / "dlrun-j4" / "attempt_0" / "0" / "error.json"
    spec = {"job_id": "j4", "ranks": [{"rank": 0, "argv": [sys.executable, "-c", "import time; time.sleep(60)"],
                                       "env": {"TORCHELASTIC_ERROR_FILE": str(error_file)}}]}
    proc, _pid = start_spec(spec)
    assert error_file.parent.is_dir()
    proc.send_signal(signal.SIGHUP)
    assert proc.wait(timeout=30) == 128 + signal.SIGHUP
    assert not (tmp_path / "dlrun-j4").exists()


def fake_nvidia_smi(folder: Path, body: str) -> dict[str, str]:
    tool = folder / "nvidia-smi"
    tool.write_text("#!/bin/sh\n" + body)
    tool.chmod(0o755)
    return {**os.environ, "PATH": f"{folder}:{os.environ['PATH']}"}


def gpu_frames(frames: list[tuple[int, int, bytes]]) -> list[dict[str, object]]:
    return [json.loads(p) for k, _, p in frames if k == agent.GPU]


def sleeper(seconds: float) -> dict[str, object]:
    return {"job_id": "jg", "gpu_every": 0.2, "ranks": [
        {"rank": 0, "argv": [sys.executable, "-c", f"import time; time.sleep({seconds})"], "env": {}}]}


def test_the_agent_samples_the_hosts_gpus_while_ranks_run(tmp_path: Path) -> None:
    env = fake_nvidia_smi(tmp_path, 'echo "$@" >> "$(dirname "$0")/args"\n'
                                    "echo '0, GPU-a, 97, 71680, 81559, 650.5, 71'\n"
                                    "echo '1, GPU-b, 0, 4, 81559, 70, 30'\n")
    frames = talk(agent_cmd(), [sleeper(1.2)], env=env)
    samples = gpu_frames(frames)
    assert len(samples) >= 3 and all("csv" in s and str(s["csv"]).startswith("0, GPU-a, 97") for s in samples)
    expected = ["--query-gpu=" + agent.GPU_QUERY, "--format=csv,noheader,nounits"]
    # one line a sample (the last may be cut short: the agent kills a sample still running at the end)
    assert (tmp_path / "args").read_text().splitlines()[0].split() == expected
    assert json.loads(next(p for k, _, p in frames if k == agent.EXIT)) == {"code": 0}


def test_no_nvidia_smi_no_samples_and_no_error(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"}
    frames = talk(agent_cmd(), [sleeper(0.6)], env=env)
    assert gpu_frames(frames) == [] and not [p for k, _, p in frames if k == agent.ERROR]


@pytest.mark.slow
def test_a_failing_or_hanging_nvidia_smi_is_reported_and_the_job_goes_on(tmp_path: Path) -> None:
    env = fake_nvidia_smi(tmp_path, "echo 'NVIDIA-SMI has failed because it could not communicate' >&2\nexit 9\n")
    frames = talk(agent_cmd(), [sleeper(1.5)], env=env)
    errors = [s["error"] for s in gpu_frames(frames)]
    assert errors and len(errors) <= agent.GPU_GIVE_UP
    assert errors[0] == "nvidia-smi exited 9: NVIDIA-SMI has failed because it could not communicate"
    assert json.loads(next(p for k, _, p in frames if k == agent.EXIT)) == {"code": 0}
    env = fake_nvidia_smi(tmp_path, "exec sleep 60\n")
    frames = talk(agent_cmd(), [sleeper(agent.GPU_TIMEOUT + 1.5)], env=env)
    assert gpu_frames(frames)[0]["error"] == f"nvidia-smi did not answer within {agent.GPU_TIMEOUT:g} s"
    assert json.loads(next(p for k, _, p in frames if k == agent.EXIT)) == {"code": 0}


def test_the_agent_says_which_ports_are_free() -> None:
    import socket

    busy = socket.create_server(("127.0.0.1", 0))
    try:
        taken = busy.getsockname()[1]
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            idle = probe.getsockname()[1]
        frames = talk(agent_cmd(), [{"op": "ports", "ports": [taken, idle]}])
    finally:
        busy.close()
    assert json.loads(next(p for k, _, p in frames if k == agent.PORTS)) == {"free": [idle]}


def test_the_last_exit_and_done_go_out_in_one_write() -> None:
    """A host's last EXIT and its DONE travel in one write, so one packet: a loaded client's
    reader then wakes once for the host's end, not twice. stdout is a SOCK_SEQPACKET socket,
    where every write arrives as one record."""
    import socket

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    spec = {"job_id": "one-write", "ranks": [
        {"rank": r, "argv": [sys.executable, "-c", f"import time; time.sleep({r} * 0.3); print({r})"], "env": {}}
        for r in (0, 1)]}
    with theirs:
        proc = subprocess.Popen(agent_cmd(), stdin=subprocess.PIPE, stdout=theirs.fileno())
    assert proc.stdin is not None
    proc.stdin.write(boot_payload("agent") + json.dumps(spec).encode() + b"\n")
    proc.stdin.flush()
    writes: list[list[tuple[int, int, bytes]]] = []
    ours.settimeout(60)
    with ours:
        while not any(k == agent.DONE for write in writes for k, _, _ in write):
            record = ours.recv(1 << 20)
            assert record, "the agent ended without DONE"
            writes.append(agent.FrameDecoder().feed(record))  # a frame never spans two writes
    proc.stdin.close()
    assert proc.wait(60) == 0
    last = [(kind, rank) for kind, rank, _ in writes[-1]]
    assert (agent.EXIT, 1) in last and last[-1] == (agent.DONE, agent.AGENT_RANK)
    assert not any((agent.EXIT, 1) in [(k, r) for k, r, _ in write] for write in writes[:-1])
    assert any((agent.EXIT, 0) in [(k, r) for k, r, _ in write] for write in writes[:-1])  # not held back


def test_before_the_spec_the_agent_imports_no_typing_ctypes_secrets_or_hashlib(tmp_path: Path) -> None:
    """What a launch asks before the spec (watch, survey, ports, probe) loads none of the modules
    a host's start does not need: ``typing`` (the push helper's annotations), ``ctypes`` (only
    outside a PID namespace, or for a rank's tracer), ``secrets``, and ``hashlib`` where no file
    changed (it loads libcrypto: the code cache, the probe and the claim use CRC-32)."""
    root = tmp_path / "code"
    root.mkdir()
    request = {"targets": [{"root": str(root), "paths": ["a.py"], "claim": {"token": "t1", "host": "h1"}}]}
    report = "import sys\nprint(' '.join(sorted(sys.modules)))\n"
    argv = agent.pidns_argv(agent_cmd()) if shutil.which("unshare") and unshare_works() else agent_cmd("--in-pidns")
    frames = talk(argv, [{"op": "watch", "host_timeout": 30},
                         {"op": "survey", "source": helper_source(), "request": request},
                         {"op": "ports", "ports": [1]}, {"op": "probe", "source": source_of("probe")},
                         {"op": "probe", "source": report}])
    [reply] = json.loads(next(p for k, _, p in frames if k == agent.SURVEY))["targets"]
    assert reply["claimed_by"] == "h1"
    loaded = set([p for k, _, p in frames if k == agent.PROBE][-1].decode().split())
    assert {"json", "subprocess", "binascii"} <= loaded  # the report saw the agent's modules
    assert not loaded & {"typing", "ctypes", "secrets", "asyncio", "unittest", "hashlib", "_hashlib"}


@pytest.mark.parametrize(("content", "restricted"), [
    (b"1\n", True), (b"0\n", False), (b"2\n", False), (b"3\n", False), (b"bogus\n", True), (None, False)])
def test_ranks_name_their_tracer_only_where_yama_restricts_ptrace(tmp_path: Path, content: bytes | None,
                                                                 restricted: bool) -> None:
    """Yama's scope 1 is the only one where a rank's ``PR_SET_PTRACER`` lets the agent's py-spy
    in (docs/stacks.md); no Yama (no file) needs nothing, and a file that cannot be read counts
    as restricted."""
    scope = tmp_path / "ptrace_scope"
    if content is not None:
        scope.write_bytes(content)
    assert agent.ptrace_restricted(str(scope)) is restricted
    assert agent.ptrace_restricted(str(tmp_path)) is True  # a directory: unreadable as a file
