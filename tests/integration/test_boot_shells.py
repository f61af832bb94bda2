"""The SSH bootstrap (``dlrun.transport.shell``) under real shells, as sshd runs it: ``<login
shell> -c "exec /bin/sh -s"``, the script on stdin, and the program's own bytes after the
marker. Fast (no sshd); tests/integration/test_login_shells.py runs the same over sshd."""

from __future__ import annotations

import hashlib
import json
import os
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dlrun.transport import shell

SHELLS = [s for s in ("sh", "dash", "bash", "zsh", "fish", "csh", "tcsh") if shutil.which(s)]
HOSTILE = ["it's", '"double"', "$(touch /tmp/dlrun-injected)", "`id`", "a\nb\n", "!!", "!$", "back\\slash",
           " spaced ", "", "-n", "*", "~", "%s\\n", "é ✓", "{a,b}", "a;b", "$HOME", "\\"]
#: Echoes its argv and a digest of all of its stdin.
PROGRAM = ("import hashlib, json, sys; data = sys.stdin.buffer.read(); "
           "print(json.dumps({'argv': sys.argv[1:], 'size': len(data), 'sha': hashlib.sha256(data).hexdigest()}))")


def read_until(proc: subprocess.Popen[bytes], mark: bytes, timeout: float = 30) -> bytes:
    """Read stdout until ``mark``; everything read (raw os.read: no buffered read-ahead)."""
    assert proc.stdout is not None
    out = b""
    deadline = time.monotonic() + timeout
    while mark not in out:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        assert ready, f"no marker within {timeout} s; got {out!r}"
        chunk = os.read(proc.stdout.fileno(), 65536)
        assert chunk, f"EOF before the marker; got {out!r}"
        out += chunk
    return out


def the_rest_arrives_whole(proc: subprocess.Popen[bytes], token: str) -> None:
    """300 KB sent after the marker reach PROGRAM whole, with HOSTILE as its argv; the shell
    printed nothing but the marker."""
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    payload = os.urandom(300_000) + b"\nthe end\n"
    proc.stdin.write(payload)
    proc.stdin.close()
    answer = json.loads(proc.stdout.read())
    stderr = proc.stderr.read()
    assert proc.wait(30) == 0, stderr
    assert answer == {"argv": HOSTILE, "size": len(payload), "sha": hashlib.sha256(payload).hexdigest()}
    assert stderr == shell.marker(token)


@pytest.mark.parametrize("login", SHELLS)
def test_argv_arrives_verbatim_and_the_programs_stdin_is_whole(login: str) -> None:
    """Payload bytes sent after the marker all reach the program, even from a ``/bin/sh`` that
    reads its script in blocks (dash)."""
    token = shell.new_token()
    proc = subprocess.Popen([login, "-c", shell.BOOT_COMMAND], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    proc.stdin.write(shell.boot_script([sys.executable, "-c", PROGRAM, *HOSTILE], token))
    proc.stdin.flush()
    head = read_until(proc, shell.marker(token))
    assert head == shell.marker(token)  # a clean shell printed nothing before it
    the_rest_arrives_whole(proc, token)
    assert not os.path.exists("/tmp/dlrun-injected")


#: A multi-line ``sh -c`` script, as the agent's PID-namespace wrapper is: it ends in an exec.
WRAPPED = 'if [ -z "${NOT_SET:-}" ]; then\n  x=1\nfi\nexec "$@"\n'


@pytest.mark.parametrize("login", SHELLS)
def test_an_sh_c_argv_runs_in_the_boot_shell_with_its_args_and_stdin_whole(login: str) -> None:
    """``sh -c SCRIPT NAME ARGS...`` is run by the boot shell itself (one exec fewer): the args
    arrive verbatim, and bytes sent after the marker all reach what SCRIPT execs."""
    token = shell.new_token()
    script = shell.boot_script(["sh", "-c", WRAPPED, "dlrun-agent", sys.executable, "-c", PROGRAM, *HOSTILE], token)
    assert b"exec sh -c" not in script
    proc = subprocess.Popen([login, "-c", shell.BOOT_COMMAND], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    proc.stdin.write(script)
    proc.stdin.flush()
    assert read_until(proc, shell.marker(token)) == shell.marker(token)
    the_rest_arrives_whole(proc, token)


def test_an_sh_c_script_that_does_not_exec_ends_the_shell_with_its_status(tmp_path: Path) -> None:
    """Where SCRIPT ends without an exec, the boot shell exits with its status: what the client
    sends after the marker is never read as commands."""
    token = shell.new_token()
    touched = tmp_path / "touched"
    proc = subprocess.Popen(["sh", "-c", shell.BOOT_COMMAND], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(shell.boot_script(["sh", "-c", 'echo "got $1"\n(exit 7)', "name", "it's"], token))
    proc.stdin.flush()
    head = read_until(proc, shell.marker(token))
    try:
        proc.stdin.write(f"touch {touched}\n".encode())
        proc.stdin.close()
    except BrokenPipeError:
        pass
    out = head + proc.stdout.read()
    assert proc.wait(30) == 7
    assert out.endswith(b"got it's\n") and not touched.exists()


def test_what_a_startup_file_prints_comes_before_the_marker() -> None:
    token = shell.new_token()
    noisy = "echo 'Welcome to h2'; echo 'module: loaded' >&2; " + shell.BOOT_COMMAND
    proc = subprocess.run(["sh", "-c", noisy], input=shell.boot_script(["echo", "ran"], token),
                          capture_output=True, timeout=30, check=True)
    out = shell.split_at_marker(proc.stdout, shell.marker(token))
    err = shell.split_at_marker(proc.stderr, shell.marker(token))
    assert out == (b"Welcome to h2\n", b"ran\n")
    assert err == (b"module: loaded\n", b"")
    assert shell.noise_note("h2", out[0], err[0]) == (
        "h2's login shell printed 2 lines before dlrun's program started: 'Welcome to h2' … (ignored)")


def test_the_script_never_holds_the_marker_whole() -> None:
    token = shell.new_token()
    script = shell.boot_script(["python3", "-c", "pass"], token)
    assert shell.marker(token).strip() not in script
    assert script.count(b"\n") == 1 and script.endswith(b"\n")
    wrapped = shell.boot_script(["sh", "-c", WRAPPED, "dlrun-agent", "python3"], token)
    assert shell.marker(token).strip() not in wrapped


def test_notes_and_errors_name_what_the_shell_printed() -> None:
    assert shell.noise_note("h1", b"", b"") is None
    assert shell.noise_note("h1", b"Hi\n\n", b"") == (
        "h1's login shell printed 1 line before dlrun's program started: 'Hi' (ignored)")
    screen = b"".join(b"line %d\x1b[0m\n" % i for i in range(40))
    assert shell.noise_note("h1", b"", screen) == (
        "h1's login shell printed 40 lines before dlrun's program started: 'line 0\\x1b[0m' … (ignored)")
    ended = shell.not_started("h1", b"", b"This account is currently not available.\n", exit_code=1, timeout=None)
    assert ended.host == "h1" and ended.exit_code == 255
    assert ended.message == ("the login shell ended (exit 1) before starting dlrun's program; it printed 1 line:"
                             " 'This account is currently not available.'")
    waited = shell.not_started("h1", b"", b"", exit_code=None, timeout=5)
    assert waited.message == "the login shell did not start dlrun's program within 5 s (--connect-timeout);" \
                             " it printed nothing"
    long = shell.not_started("h1", screen, b"", exit_code=None, timeout=5)
    assert long.message.endswith("it printed 40 lines, the last: 'line 35\\x1b[0m' / 'line 36\\x1b[0m' /"
                                 " 'line 37\\x1b[0m' / 'line 38\\x1b[0m' / 'line 39\\x1b[0m'")
    assert "~/.bashrc" in (long.hint or "")
