"""The host programs' code cache (``dlrun.remote.LOADER``), with real interpreters: the second
start runs the cached code, and an entry that was tampered with, is writable by others, is owned
by another user or is a link is ignored (the source is compiled and run); over real sshd, a launch
fills the login user's cache and the next launch uses it.

The sshd test logs in as a user of its own (``dlrun-codecache``), never ``dlrun-test``: it reads
and changes that user's cache."""

from __future__ import annotations

import marshal
import os
import pwd
import shutil
import subprocess
import sys
from binascii import crc32
from collections.abc import Sequence
from pathlib import Path

import pytest

from dlrun.remote import CACHE_STAGE, boot_argv, boot_payload, cache_entry, source_of

from support.cli import run_dlrun
from support.ssh_jobs import hosts_toml
from support.sshd_cluster import find_sshd, start_cluster
from support.wait import wait_until

PROGRAM = "print('from the source')\n"
FORGED = "print('from the cache')\n"


def payload(source: str, stage: bool = True) -> bytes:
    """What ``boot_payload`` sends, with ``source`` as the program (``stage`` False: no code cache)."""
    raw, cache = source.encode(), CACHE_STAGE.encode()
    return (b"+%09d" % len(cache) + cache if stage else b"") + b"%010d" % len(raw) + raw


def run_loader(cache: Path, source: str = PROGRAM, stage: bool = True, prefix: Sequence[str] = ()) -> str:
    """Start the loader as every transport does (``python -c LOADER dlrun-probe``), ``source`` on stdin."""
    out = subprocess.run([*prefix, *boot_argv([sys.executable], "probe")], input=payload(source, stage),
                         capture_output=True, env={**os.environ, "XDG_CACHE_HOME": str(cache)}, timeout=60)
    assert out.returncode == 0, out.stderr.decode()
    return out.stdout.decode().strip()


def entry(cache: Path, source: str = PROGRAM) -> Path:
    name, _head = cache_entry("probe", source.encode(), str(sys.implementation.cache_tag))
    return cache / "dlrun" / "code" / name


def forge(path: Path, code_source: str = FORGED, source: str = PROGRAM) -> None:
    """A valid entry (header, digest, code) for ``source`` whose code is ``code_source``'s."""
    _name, head = cache_entry("probe", source.encode(), str(sys.implementation.cache_tag))
    body = marshal.dumps(compile(code_source, "<dlrun-probe>", "exec"))
    path.write_bytes(head + b"%08x" % crc32(body) + body)
    path.chmod(0o600)


def test_the_second_start_runs_the_cached_code(tmp_path: Path) -> None:
    assert run_loader(tmp_path) == "from the source"
    path = entry(tmp_path)
    assert path.is_file(), list((tmp_path / "dlrun" / "code").iterdir())
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    before = path.stat()
    assert run_loader(tmp_path) == "from the source"
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)  # read, not rewritten
    forge(path)
    assert run_loader(tmp_path) == "from the cache"  # the proof that the entry is what runs
    assert run_loader(tmp_path, "print('another source')\n") == "another source"  # another key


def test_a_tampered_entry_is_ignored_and_replaced(tmp_path: Path) -> None:
    run_loader(tmp_path)
    path = entry(tmp_path)
    forge(path)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # the code, not its digest
    path.write_bytes(bytes(data))
    assert run_loader(tmp_path) == "from the source"
    assert run_loader(tmp_path) == "from the source"  # rewritten valid
    forge(path)
    path.write_bytes(path.read_bytes()[:-10])  # cut short
    assert run_loader(tmp_path) == "from the source"
    path.write_bytes(b"garbage")
    assert run_loader(tmp_path) == "from the source"


def test_an_entry_others_could_write_is_ignored(tmp_path: Path) -> None:
    run_loader(tmp_path)
    path = entry(tmp_path)
    forge(path)
    path.chmod(0o620)  # group-writable
    assert run_loader(tmp_path) == "from the source"
    forge(path)
    path.parent.chmod(0o777)  # a folder others may write into: not used, not written
    assert run_loader(tmp_path) == "from the source"
    assert path.read_bytes().startswith(cache_entry("probe", PROGRAM.encode(), str(sys.implementation.cache_tag))[1])
    path.parent.chmod(0o700)
    forged_elsewhere = tmp_path / "elsewhere"
    forge(forged_elsewhere)
    path.unlink()
    path.symlink_to(forged_elsewhere)  # a link is never followed
    assert run_loader(tmp_path) == "from the source"


@pytest.mark.skipif(os.geteuid() != 0, reason="another owner needs root")
def test_an_entry_owned_by_another_user_is_ignored(tmp_path: Path) -> None:
    run_loader(tmp_path)
    path = entry(tmp_path)
    forge(path)
    nobody = pwd.getpwnam("nobody")
    os.chown(path, nobody.pw_uid, nobody.pw_gid)
    assert run_loader(tmp_path) == "from the source"
    forge(path)
    os.chown(path, os.geteuid(), os.getegid())
    assert run_loader(tmp_path) == "from the cache"
    os.chown(path.parent, nobody.pw_uid, nobody.pw_gid)  # a folder of another user's
    assert run_loader(tmp_path) == "from the source"


#: A process that is pid 1, as every agent in a PID namespace of its own is (or pid 2).
AS_PID_1 = ("unshare", "--pid", "--fork", "--kill-child")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="a PID namespace needs root")
def test_writers_with_the_same_pid_leave_each_other_alone(tmp_path: Path) -> None:
    """Hosts sharing a home (one machine under two names, NFS) write one cache folder, and their
    agents, each in a PID namespace of its own, have the same pid: a temporary file named by the
    pid made the second writer fail and delete the first writer's file, so neither entry landed
    (a launch on two such hosts once left no probe entry)."""
    path = entry(tmp_path)
    path.parent.mkdir(parents=True, mode=0o700)
    others = [path.with_name(f"{path.name}.{pid}.tmp") for pid in (1, 2)]  # other hosts' agents, writing
    for other in others:
        other.write_bytes(b"half written")
        other.chmod(0o600)
    assert run_loader(tmp_path, prefix=AS_PID_1) == "from the source"
    assert path.is_file()
    assert [other.read_bytes() for other in others] == [b"half written"] * 2
    forge(path)
    assert run_loader(tmp_path, prefix=AS_PID_1) == "from the cache"


def test_the_payload_is_the_stage_then_the_program_and_a_plain_program_runs_without_the_cache(tmp_path: Path) -> None:
    assert boot_payload("probe") == payload(source_of("probe"))
    assert run_loader(tmp_path, stage=False) == "from the source"  # a payload without the stage
    assert not (tmp_path / "dlrun").exists()


def test_no_usable_cache_still_runs(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert run_loader(blocker) == "from the source"  # the cache folder cannot be made


FAILING = """import sys
def hook(*info):
    import traceback
    sys.stderr.write("".join(traceback.format_exception(*info)))
sys.excepthook = hook
def fail():
    raise ValueError("shown")  # the line a traceback must show
if sys.argv[1:] == ["caught"]:
    try:
        fail()
    except ValueError:
        import traceback
        _dlrun_lines()
        print(traceback.format_exc())
elif sys.argv[1:] == ["exit"]:
    import atexit
    atexit.register(lambda: print("linecache" in sys.modules))
    sys.exit(3)
else:
    print("linecache" in sys.modules, flush=True)
    fail()
"""


@pytest.mark.parametrize("stage", [True, False])
def test_tracebacks_show_the_programs_lines_and_a_clean_run_imports_no_linecache(tmp_path: Path, stage: bool) -> None:
    """The loader gives linecache the program's source only when it is needed: an exception that
    leaves the program (here a traceback-module excepthook, as Python 3.13's default is) or a
    program that prints one itself after ``_dlrun_lines()``; a run that ends well imports no
    ``linecache`` (``tokenize`` with it: a millisecond of CPU per host per launch)."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(boot_argv([sys.executable], "probe", *args), input=payload(FAILING, stage),
                             capture_output=True, env=env, timeout=60)
        return subprocess.CompletedProcess(out.args, out.returncode, out.stdout.decode(), out.stderr.decode())

    uncaught = run()
    assert uncaught.returncode == 1 and uncaught.stdout.strip() == "False"  # not imported before it failed
    assert 'raise ValueError("shown")  # the line a traceback must show' in uncaught.stderr, uncaught.stderr
    assert 'File "<dlrun-probe>", line 7, in fail' in uncaught.stderr
    caught = run("caught")
    assert caught.returncode == 0 and 'raise ValueError("shown")' in caught.stdout, caught
    exited = run("exit")
    assert exited.returncode == 3 and exited.stdout.strip() == "False", exited  # sys.exit is no failure


def test_a_detached_jobs_agent_runs_the_cached_code(tmp_path: Path) -> None:
    """The keeper starts each attempt's agent through the same stage: the agent's entry is what
    runs (a forged entry that leaves a mark where the keeper started it, then is the agent; the
    launch's own agent, which answers its questions, runs it too but leaves no mark)."""
    from support.sshd_cluster import wait_job_processes_gone

    cache, mark = tmp_path / "cache", tmp_path / "mark"
    source = source_of("agent")
    name, head = cache_entry("agent", source.encode(), str(sys.implementation.cache_tag))
    future = "from __future__ import annotations\n"
    mark_it = "import os as _os\nif 'DLRUN_JOB_ID' in _os.environ:  # the keeper's agent, not the launch's\n" \
        "    open(_os.environ['DLRUN_TEST_MARK'], 'a').close()\n"
    marked = source.replace(future, future + mark_it, 1)
    body = marshal.dumps(compile(marked, "<dlrun-agent>", "exec"))
    folder = cache / "dlrun" / "code"
    folder.mkdir(parents=True, mode=0o700)
    folder.chmod(0o700)
    (folder / name).write_bytes(head + b"%08x" % crc32(body) + body)
    (folder / name).chmod(0o600)
    (tmp_path / "quick.py").write_text("print('done')\n")
    env = {"HOME": str(tmp_path / "home"), "XDG_CACHE_HOME": str(cache), "DLRUN_TEST_MARK": str(mark)}
    out = run_dlrun("launch", "--detach", "--no-preflight", "--framework", "none", "-n", "1", "quick.py",
                    cwd=tmp_path, timeout=120, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    job = out.stdout.strip().splitlines()[-1].split()[-1]
    assert wait_until(mark.exists, timeout=60), "the keeper's agent compiled its source instead"
    assert wait_job_processes_gone(job, timeout=30) == []


@pytest.mark.slow
@pytest.mark.ssh
def test_a_launch_fills_the_login_users_cache_and_the_next_uses_it(tmp_path: Path) -> None:
    if find_sshd() is None:
        pytest.skip("no sshd on this machine (install openssh-server; .ci/run does)")
    if os.geteuid() != 0:
        pytest.skip("another login user needs root")
    python = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable
    cluster = start_cluster(2, tmp_path / "cluster", login_user="dlrun-codecache", python=python)
    try:
        assert cluster.user == "dlrun-codecache", cluster.notes
        code = tmp_path / "proj"
        code.mkdir()
        (code / "train.py").write_text("import os\nprint('rank', os.environ['DLRUN_RANK'], flush=True)\n")
        for p in (tmp_path, code):
            p.chmod(0o755)
        ssh = ("--hosts", str(hosts_toml(cluster, tmp_path / "hosts.toml", 2)), "--ssh-config", str(cluster.ssh_config))

        def launch() -> None:
            out = run_dlrun("launch", "--plain", "--framework", "none", *ssh, "train.py", cwd=code, timeout=180)
            assert out.returncode == 0, out.stdout + out.stderr
            assert "rank 0" in out.stdout and "rank 1" in out.stdout, out.stdout

        launch()
        tag = subprocess.run([python, "-c", "import sys; print(sys.implementation.cache_tag)"], capture_output=True,
                             text=True, check=True).stdout.strip()
        folder = Path(pwd.getpwnam(cluster.user).pw_dir) / ".cache" / "dlrun" / "code"
        agent = folder / cache_entry("agent", source_of("agent").encode(), tag)[0]
        probe = folder / cache_entry("probe", source_of("probe").encode(), tag)[0]
        assert agent.is_file() and probe.is_file(), sorted(p.name for p in folder.iterdir())
        uid = pwd.getpwnam(cluster.user).pw_uid
        for p, mode in ((folder, 0o700), (agent, 0o600), (probe, 0o600)):
            assert (p.stat().st_uid, p.stat().st_mode & 0o777) == (uid, mode), p
        before = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (agent, probe)}
        launch()
        assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (agent, probe)} == before  # read, not rewritten
        agent.write_bytes(agent.read_bytes()[:-100])  # broken: the agent compiles its source again
        os.chown(agent, uid, uid)
        launch()
        head = cache_entry("agent", source_of("agent").encode(), tag)[1]
        data = agent.read_bytes()  # replaced by a valid entry (two hosts' agents may both write it)
        digest, body = data[len(head):len(head) + 8], data[len(head) + 8:]
        assert data.startswith(head) and b"%08x" % crc32(body) == digest
    finally:
        cluster.stop(remove=True)
