"""dlrun over real sshd hosts (tests/support/sshd_cluster.py): start, fail fast, cleanup, hostile input, keys."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from dlrun.inventory import Host
from dlrun.transport.base import Transport

from support.cli import REPO, dlrun_argv, run_dlrun
from support.ssh_jobs import hosts_toml, shared_script, start_ssh_job
from support.sshd_cluster import SshdCluster, count_job_processes, wait_job_processes_gone

pytestmark = pytest.mark.ssh

SLEEPER = """
import os, subprocess, sys, time
if "--setsid" in sys.argv:
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
print("ready", flush=True)  # after the child: the test counts it at once
time.sleep(600)
"""


def ssh_args(cluster: SshdCluster) -> list[str]:
    return ["--ssh-config", str(cluster.ssh_config)]


def start_job(
        cluster: SshdCluster, tmp_path: Path, n: int, *script: str, ready: int) -> tuple[subprocess.Popen[str], str]:
    proc, lines = start_ssh_job(cluster, tmp_path, n, *script, ready=ready)
    job_id = next((m.group(1) for line in lines if (m := re.search(r"logs in dlrun-logs/([\w-]+)/", line))), None)
    assert job_id, "".join(lines)
    return proc, job_id


def test_hello_across_hosts_uses_each_hosts_env(cluster: SshdCluster, tmp_path: Path) -> None:
    script = shared_script(cluster, "env.py", "import json, os, socket\n"
                           "print(json.dumps({k: os.environ.get(k) for k in ('DLRUN_RANK', 'DLRUN_HOST', 'USER',"
                           " 'DLRUN_LOCAL_RANK', 'TF_CONFIG')}), os.getcwd())\n")
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 2, slots=2)
    out = run_dlrun("launch", "--plain", "--hosts", str(hosts), *ssh_args(cluster), str(script), cwd=tmp_path,
                    timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {}
    for line in out.stdout.splitlines():
        if m := re.match(r"\[(\d) (host\d)\] (\{.*\}) (.*)$", line):
            rows[int(m.group(1))] = (m.group(2), json.loads(m.group(3)), m.group(4))
    assert sorted(rows) == [0, 1, 2, 3]
    host, env, cwd = rows[3]
    assert host == "host1" and env["DLRUN_HOST"] == "host1" and env["DLRUN_LOCAL_RANK"] == "1"
    # the script's directory was pushed to <workdir>/<dir name> and the rank ran there
    # (the tree that folder links to: a later push never changes a running rank's folder)
    assert env["USER"] == cluster.user and cwd == os.path.realpath(cluster.hosts[1].workdir / "scripts")
    assert (cluster.hosts[1].workdir / "scripts" / "env.py").read_text() == script.read_text()
    tf = json.loads(env["TF_CONFIG"])
    # ssh_config aliases are resolved to their HostName for the other ranks
    assert tf["cluster"]["worker"][2].startswith(cluster.hosts[1].address + ":")


def test_each_hosts_ranks_get_its_socket_interface(cluster: SshdCluster, tmp_path: Path) -> None:
    script = shared_script(cluster, "ifname.py", "import os\nprint('ifname', os.environ.get('GLOO_SOCKET_IFNAME'))\n")
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 2)
    hosts.write_text(hosts.read_text().replace('address = "host1"', 'address = "host1"\niface = "lo:1"', 1))
    out = run_dlrun("launch", "--plain", "--framework", "torch", "--hosts", str(hosts), *ssh_args(cluster),
                    str(script), cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    # host0: every rank is on loopback, so lo; host1: the inventory's own name for it
    assert "[0 host0] ifname lo" in out.stdout and "[1 host1] ifname lo:1" in out.stdout, out.stdout


def test_failing_rank_stops_every_host(cluster: SshdCluster, tmp_path: Path) -> None:
    script = shared_script(cluster, "fail2.py", "import os, sys, time\nprint('ready', flush=True)\n"
                           "time.sleep(1.5)\nsys.exit(7) if os.environ['DLRUN_RANK'] == '2' else time.sleep(600)\n")
    proc, job_id = start_job(cluster, tmp_path, 4, str(script), ready=4)
    assert len(count_job_processes(job_id)) >= 4
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 7, out
    assert "root cause: rank 2 on host host2 exited with code 7" in out
    assert wait_job_processes_gone(job_id, timeout=5) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_dlrun_killed_leaves_nothing_on_any_host(cluster: SshdCluster, tmp_path: Path, sig: signal.Signals) -> None:
    script = shared_script(cluster, "sleep.py", SLEEPER)
    proc, job_id = start_job(cluster, tmp_path, 3, str(script), ready=3)
    assert len(count_job_processes(job_id)) >= 3
    proc.send_signal(sig)
    proc.communicate(timeout=60)
    if sig != signal.SIGKILL:
        assert proc.returncode == 128 + sig
    assert wait_job_processes_gone(job_id, timeout=10) == []


def test_dropped_ssh_session_kills_that_hosts_ranks_and_fails_the_job(cluster: SshdCluster, tmp_path: Path) -> None:
    script = shared_script(cluster, "sleep.py", SLEEPER)
    proc, job_id = start_job(cluster, tmp_path, 2, str(script), ready=2)
    cluster.kill_sessions(1)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 255, out
    assert "host host1 (rank 1)" in out and "connection to the host was lost" in out
    assert wait_job_processes_gone(job_id, timeout=10) == []


def test_silent_host_is_lost_within_the_host_timeout_and_both_sides_stop(cluster: SshdCluster, tmp_path: Path) -> None:
    script = shared_script(cluster, "sleep.py", SLEEPER)
    proc, job_id = start_job(cluster, tmp_path, 2, "--host-timeout", "3", str(script), ready=2)
    frozen = cluster.freeze_sessions(1)  # host1: no FIN, no reset, no byte either way
    try:
        out, _ = proc.communicate(timeout=60)  # without the heartbeat: TCP's ~15 min
        assert proc.returncode == 255, out
        # the agent heartbeat and the connection's own liveness check race; either names the silence
        assert "host host1 (rank 1)" in out and re.search(r"no (word|answer) from the host for \d+ s", out), out
        # host1's agent heard no ping either and stopped its rank, though its sshd is still frozen
        assert wait_job_processes_gone(job_id, timeout=15) == []
    finally:
        cluster.thaw(frozen)


def test_without_pid_namespaces_hosts_on_one_machine_do_not_kill_each_other(
        cluster: SshdCluster, tmp_path: Path) -> None:
    # every test host is this machine: one agent's final sweep must not touch another host's ranks
    script = shared_script(cluster, "staggered.py", "import os, time\n"
                           "time.sleep(0.2 + 1.0 * int(os.environ['DLRUN_RANK']))\nprint('finished')\n")
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 3)
    out = run_dlrun("launch", "--plain", "--no-pidns", "--hosts", str(hosts), *ssh_args(cluster), str(script),
                    cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("] finished") == 3


def test_workdir_with_tilde_is_expanded_on_the_host(cluster: SshdCluster, tmp_path: Path) -> None:
    script = shared_script(cluster, "cwd.py", "import os\nprint('CWD', os.getcwd())\n")
    hosts = tmp_path / "hosts.toml"
    hosts.write_text(f'[[hosts]]\naddress = "host0"\npython = "{cluster.python}"\nworkdir = "~"\n')
    out = run_dlrun("launch", "--plain", "--hosts", str(hosts), *ssh_args(cluster), str(script), cwd=tmp_path,
                    timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "CWD /" in out.stdout and "~" not in out.stdout.split("CWD", 1)[1].splitlines()[0]


def test_setsid_child_dies_in_pid_namespace(cluster: SshdCluster, tmp_path: Path) -> None:
    probe = cluster.run(0, "unshare --user --map-current-user --pid --fork --kill-child true")
    if probe.returncode != 0:
        pytest.skip(f"unprivileged PID namespaces are refused here: {probe.stderr.strip()}")
    script = shared_script(cluster, "sleep.py", SLEEPER)
    proc, job_id = start_job(cluster, tmp_path, 2, str(script), "--setsid", ready=2)
    assert len(count_job_processes(job_id)) >= 4
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert wait_job_processes_gone(job_id, timeout=10) == []


def test_hostile_values_arrive_verbatim(cluster: SshdCluster, tmp_path: Path) -> None:
    marker = Path("/tmp/pwned-by-dlrun-test")
    marker.unlink(missing_ok=True)
    spaced = cluster.scripts / "dir with spaces"
    spaced.mkdir(exist_ok=True)
    spaced.chmod(0o755)
    script = spaced / "show args.py"
    script.write_text("import json, os, sys\nprint('ARGS', json.dumps({'argv': sys.argv[1:], 'v': os.environ['EVIL'],"
                      " 'w': os.environ['WEIRD'], 'host': os.environ['DLRUN_HOST']}))\n")
    script.chmod(0o644)
    names = ["my host 'one' \"x\"", "$(touch /tmp/pwned-by-dlrun-test)"]
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 2, names=names,
                       extra='env = { WEIRD = "a; touch /tmp/pwned-by-dlrun-test #" }')
    value = "$(id) `id` \"dq\" 'sq' ; touch /tmp/pwned-by-dlrun-test\nline two"
    arg = "'; touch /tmp/pwned-by-dlrun-test"
    out = run_dlrun("launch", "--plain", "--hosts", str(hosts), *ssh_args(cluster), "-e", f"EVIL={value}",
                    str(script), arg, "two words", cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    got = [json.loads(line.split("ARGS ", 1)[1]) for line in out.stdout.splitlines() if "ARGS " in line]
    assert len(got) == 2
    for item in got:
        assert item["argv"] == [arg, "two words"]
        assert item["v"] == value and item["w"] == "a; touch /tmp/pwned-by-dlrun-test #"
    assert sorted(item["host"] for item in got) == sorted(names)
    assert not marker.exists()


def test_job_through_a_proxyjump_bastion(cluster: SshdCluster, tmp_path: Path) -> None:
    script = shared_script(cluster, "hi.py", "import os\nprint('hi from', os.environ['DLRUN_RANK'])\n")
    hosts = tmp_path / "hosts.toml"
    hosts.write_text(f'[defaults]\npython = "{cluster.python}"\n'
                     f'[[hosts]]\naddress = "{cluster.jump_alias(0)}"\n'
                     f'[[hosts]]\naddress = "{cluster.jump_alias(1)}"\n')
    out = run_dlrun("launch", "--plain", "--hosts", str(hosts), *ssh_args(cluster), str(script), cwd=tmp_path,
                    timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "hi from 0" in out.stdout and "hi from 1" in out.stdout


def test_unknown_host_key_refused_then_accepted_on_request(cluster: SshdCluster, tmp_path: Path) -> None:
    script = shared_script(cluster, "hi.py", "print('hi')\n")
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 1)
    base = ["launch", "--plain", "--hosts", str(hosts), *ssh_args(cluster), "--known-hosts", str(empty)]
    out = run_dlrun(*base, str(script), cwd=tmp_path, timeout=60)
    assert out.returncode == 255
    assert "host0: unknown host key" in out.stderr and "--accept-new-host-keys" in out.stderr
    assert "ssh-keyscan -p 2222" in out.stderr or "ssh-keyscan -p" in out.stderr
    out = run_dlrun(*base, "--accept-new-host-keys", str(script), cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    assert cluster.hosts[0].address in empty.read_text()
    out = run_dlrun(*base, str(script), cwd=tmp_path, timeout=60)  # now known
    assert out.returncode == 0, out.stderr


def test_changed_host_key_always_refused(cluster: SshdCluster, tmp_path: Path) -> None:
    known = tmp_path / "known_hosts"
    other = cluster.hosts[1].public_key
    known.write_text(f"{cluster.hosts[0].known_hosts_name} {other}\n")
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 1)
    script = shared_script(cluster, "hi.py", "print('hi')\n")
    for extra in ([], ["--accept-new-host-keys"]):
        out = run_dlrun("launch", "--plain", "--hosts", str(hosts), *ssh_args(cluster), "--known-hosts", str(known),
                        *extra, str(script), cwd=tmp_path, timeout=60)
        assert out.returncode == 255
        assert "HOST KEY CHANGED" in out.stderr


def test_unreachable_host_named_quickly_and_nothing_started(cluster: SshdCluster, tmp_path: Path) -> None:
    marker = cluster.hosts[0].workdir / "started-marker"
    script = shared_script(cluster, "mark.py", f"open({str(marker)!r}, 'w').write('x')\n")
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 1)
    with hosts.open("a") as fh:
        fh.write('[[hosts]]\naddress = "127.0.0.9"\nport = 2299\n'
                 '[[hosts]]\naddress = "no-such-host.invalid"\nport = 22\n')
    start = time.monotonic()
    out = run_dlrun("launch", "--plain", "--hosts", str(hosts), *ssh_args(cluster), "--connect-timeout", "10",
                    str(script), cwd=tmp_path, timeout=60)  # (both fail at once; the timeout also bounds host0's start)
    assert out.returncode == 255
    assert time.monotonic() - start < 30
    assert "2 hosts cannot be reached; no rank was started" in out.stderr
    assert "127.0.0.9: connection refused by 127.0.0.9:2299" in out.stderr
    assert "no-such-host.invalid: cannot resolve host name" in out.stderr
    assert not marker.exists()


def test_wrong_key_is_an_authentication_error(cluster: SshdCluster, tmp_path: Path) -> None:
    key = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 1, extra=f'identity_file = "{key}"')
    (tmp_path / "hi.py").write_text("print('hi')\n")
    out = run_dlrun("launch", "--plain", "--hosts", str(hosts), *ssh_args(cluster), "hi.py", cwd=tmp_path, timeout=60)
    assert out.returncode == 255
    assert "host0: authentication failed for user" in out.stderr


@pytest.mark.slow
def test_tf_example_across_two_ssh_hosts_resumes_after_a_restart(cluster: SshdCluster, tmp_path: Path) -> None:
    """The first attempt fails after epoch 1; the restart goes on from the chief's checkpoint on
    both hosts (host1 has none of its own: the all-reduce sent it) and trains to the end."""
    pytest.importorskip("tf_keras")
    script = shared_script(cluster, "train_digits.py", (REPO / "examples" / "train_digits.py").read_text())
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 2)
    out = run_dlrun("launch", "--plain", "--max-restarts", "1", "--hosts", str(hosts), *ssh_args(cluster),
                    str(script), "--epochs", "12", "--crash-after", "1", cwd=tmp_path, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert sorted(re.findall(r"^\[(\d) host\d\] restart 1: resuming after epoch 1$", out.stdout, re.M)) == ["0", "1"]
    after = out.stdout.split("relaunching")[1]
    assert "epoch 1/12" not in after and re.search(r"\[1 host1\] epoch 12/12: loss", after), out.stdout
    assert len(set(re.findall(r"weight checksum (-?[0-9.]+)", after))) == 1, out.stdout
    accuracies = [float(m) for m in re.findall(r"\] test accuracy: ([0-9.]+)", out.stdout)]
    assert len(accuracies) == 2 and min(accuracies) >= 0.90
    assert (cluster.hosts[0].workdir / "scripts" / "dlrun-model" / "digits.keras").exists()


def test_match_exec_in_ssh_config(tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.write_text('Match exec "test -n yes"\n  HostName 10.9.8.7\n  Port 2201\n')
    code = ("from dlrun.transport.ssh import SSHTransport; "
            f"t = SSHTransport(config_file={str(config)!r}).target('nodeX'); print(t.hostname, t.port)")
    out = subprocess.run([*dlrun_argv()[:1], "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["10.9.8.7", "2201"]


@pytest.mark.parametrize("how", ["close", "reset", "banner", "banner-reset"])
def test_a_port_that_is_no_ssh_server_is_named_without_a_traceback(tmp_path: Path, how: str) -> None:
    import socket
    import struct
    import threading

    listener = socket.create_server(("127.0.0.1", 0))  # accepts, then hangs up: no SSH banner
    port = listener.getsockname()[1]

    def hang_up() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            if how.endswith("reset"):  # RST, as a firewall or a closed socket with unread bytes answers
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            if how.startswith("banner"):  # an SSH server that drops the connection (MaxStartups) after its banner
                conn.sendall(b"SSH-2.0-OpenSSH_9.6 stand-in\r\n")
                got = conn.recv(256)  # the client's banner (and maybe more: then a plain close resets too)
                while how == "banner-reset" and not got.partition(b"\n")[2]:
                    more = conn.recv(4096)  # its key exchange too: the reset comes while it waits for ours
                    got += more
                    if not more:
                        break
            conn.close()

    threading.Thread(target=hang_up, daemon=True).start()
    hosts = tmp_path / "hosts.toml"
    hosts.write_text(f'[[hosts]]\naddress = "127.0.0.1"\nport = {port}\n')
    (tmp_path / "ssh_config").write_text("")
    (tmp_path / "job.py").write_text("print('never')\n")
    try:
        out = run_dlrun("launch", "--plain", "--hosts", str(hosts), "--ssh-config", str(tmp_path / "ssh_config"),
                        "--connect-timeout", "3", "--framework", "none", "job.py", cwd=tmp_path, timeout=60)
    finally:
        listener.close()
    assert out.returncode == 255, out.stdout + out.stderr
    if how.startswith("banner"):
        assert (f"127.0.0.1:{port} (SSH-2.0-OpenSSH_9.6 stand-in) closed the connection during the SSH handshake"
                in out.stderr), out.stderr
    else:
        assert f"127.0.0.1:{port} hung up before the SSH banner" in out.stderr
    assert "Traceback" not in out.stderr and "Exception (client)" not in out.stderr  # paramiko's own log


def test_stderr_from_the_hosts_python_wrapper_does_not_break_the_job(cluster: SshdCluster, tmp_path: Path) -> None:
    # a wrapper (or a login rc file) writing to stderr while the agent talks on stdout once made
    # dlrun's reader thread die on the second chunk, and a healthy host was declared lost
    wrapper = cluster.hosts[0].workdir / "py-wrapper.sh"
    wrapper.write_text("#!/bin/sh\necho 'py-wrapper: a first warning on stderr' >&2\n"
                       "(sleep 1; echo 'py-wrapper: a second warning on stderr' >&2) &\n"
                       f"exec {cluster.python} \"$@\"\n")
    wrapper.chmod(0o755)
    script = shared_script(cluster, "ticks.py", "import time\nfor i in range(3):\n"
                           "    print('tick', i, flush=True)\n    time.sleep(0.8)\n")
    hosts = tmp_path / "hosts.toml"
    hosts.write_text(f'[[hosts]]\naddress = "host0"\npython = "{wrapper}"\n')
    out = run_dlrun("launch", "--plain", "--no-preflight", "--hosts", str(hosts), *ssh_args(cluster), str(script),
                    cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "[0 host0] tick 2" in out.stdout


@pytest.mark.slow
def test_known_hosts_markers_odd_lines_and_a_missing_final_newline(cluster: SshdCluster, tmp_path: Path) -> None:
    h0, h1 = cluster.hosts[0], cluster.hosts[1]
    known = tmp_path / "known_hosts"
    known.write_text(f"# hosts\n@cert-authority *.example.org {h1.public_key}\nnot a key line\n"
                     f"{h0.known_hosts_line}\n{h1.known_hosts_line}\n@revoked\t* {h1.public_key}")  # no final \n
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 2)
    script = shared_script(cluster, "hi.py", "print('hi')\n")
    def launch(inventory: Path) -> subprocess.CompletedProcess[str]:
        return run_dlrun("launch", "--plain", "--framework", "none", "--hosts", str(inventory), *ssh_args(cluster),
                         "--known-hosts", str(known), str(script), cwd=tmp_path, timeout=60)

    out = launch(hosts)
    assert out.returncode == 255, out.stdout + out.stderr  # no traceback over the marker lines
    assert "host1: the host key of" in out.stderr and "marked @revoked" in out.stderr and "Traceback" not in out.stderr
    only0 = hosts_toml(cluster, tmp_path / "one.toml", 1)
    assert launch(only0).returncode == 0
    # a revoked key is refused before --accept-new-host-keys could save it as trusted
    known.write_text(f"@revoked * {h1.public_key}\n")
    second = tmp_path / "second.toml"
    second.write_text(f'[defaults]\npython = "{cluster.python}"\n[[hosts]]\naddress = "host1"\n')
    out = run_dlrun("launch", "--plain", "--framework", "none", "--hosts", str(second), *ssh_args(cluster),
                    "--known-hosts", str(known), "--accept-new-host-keys", str(script), cwd=tmp_path, timeout=60)
    assert out.returncode == 255 and "marked @revoked" in out.stderr, out.stdout + out.stderr
    assert known.read_text() == f"@revoked * {h1.public_key}\n"
    # --accept-new-host-keys appends on a line of its own to a file whose last line has no newline
    partial = tmp_path / "partial_known_hosts"
    partial.write_text("somehost ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIElQky63lZQRFBT5ndIt7842JawUOWS2goHj1rBFSSrp")
    out = run_dlrun("launch", "--plain", "--framework", "none", "--hosts", str(only0), *ssh_args(cluster),
                    "--known-hosts", str(partial), "--accept-new-host-keys", str(script), cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = partial.read_text().splitlines()
    assert lines[0].endswith("Srp") and lines[1].startswith(h0.known_hosts_name)
    created = tmp_path / "new" / "known_hosts"
    run_dlrun("launch", "--plain", "--framework", "none", "--hosts", str(only0), *ssh_args(cluster),
              "--known-hosts", str(created), "--accept-new-host-keys", str(script), cwd=tmp_path, timeout=60)
    assert oct(created.stat().st_mode & 0o777) == "0o600"


def test_hosts_behind_a_frozen_bastion_fail_together_each_named(cluster: SshdCluster, tmp_path: Path) -> None:
    assert cluster.bastion is not None and cluster.bastion.pid is not None
    hosts = tmp_path / "hosts.toml"
    hosts.write_text("".join(f'[[hosts]]\naddress = "{cluster.jump_alias(i)}"\n' for i in range(3)))
    (tmp_path / "job.py").write_text("print('never')\n")
    os.kill(cluster.bastion.pid, signal.SIGSTOP)  # accepts TCP (the kernel does), answers nothing
    try:
        out = run_dlrun("launch", "--plain", "--hosts", str(hosts), *ssh_args(cluster), "--connect-timeout", "2",
                        "job.py", cwd=tmp_path, timeout=120)
    finally:
        os.kill(cluster.bastion.pid, signal.SIGCONT)
    assert out.returncode == 255, out.stdout + out.stderr
    assert "3 hosts cannot be reached" in out.stderr
    for i in range(3):  # the host asked for, then the hop that failed
        assert f"{cluster.jump_alias(i)}: bastion bastion: no SSH answer" in out.stderr, out.stderr


def test_ssh_config_include_global_known_hosts_and_proxycommand(cluster: SshdCluster, tmp_path: Path) -> None:
    h0, h1 = cluster.hosts[0], cluster.hosts[1]
    known = tmp_path / "global_known_hosts"
    known.write_text(f"{h0.known_hosts_line}\n{h1.known_hosts_line}\n")
    key = next(line.split(None, 1)[1] for line in cluster.ssh_config.read_text().splitlines()
               if line.strip().startswith("IdentityFile"))
    included = tmp_path / "conf.d" / "cluster.conf"
    included.parent.mkdir()
    included.write_text(
        f"Host inc0\n    HostName {h0.address}\n    Port {h0.port}\n    User {h0.user}\n    IdentityFile {key}\n"
        f"    UserKnownHostsFile /dev/null\n    GlobalKnownHostsFile {known}\n"
        f"Host pc1\n    HostName {h1.address}\n    Port {h1.port}\n    User {h1.user}\n    IdentityFile {key}\n"
        f"    UserKnownHostsFile {known}\n"
        f"    ProxyCommand {cluster.ssh_path} -F {cluster.ssh_config} -W %h:%p bastion\n")
    config = tmp_path / "ssh_config"
    config.write_text(f"Include {tmp_path}/conf.d/*.conf\n")
    hosts = tmp_path / "hosts.toml"
    hosts.write_text(f'[defaults]\npython = "{cluster.python}"\n'
                     '[[hosts]]\naddress = "inc0"\n[[hosts]]\naddress = "pc1"\n')
    script = shared_script(cluster, "where.py", "import os\nprint('on', os.environ['DLRUN_HOST'])\n")
    out = run_dlrun("launch", "--plain", "--framework", "none", "--hosts", str(hosts), "--ssh-config", str(config),
                    str(script), cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "[0 inc0] on inc0" in out.stdout and "[1 pc1] on pc1" in out.stdout


@pytest.mark.parametrize(("spec", "parsed"), [
    ("bastion", (None, "bastion", None)), ("admin@bastion:2200", ("admin", "bastion", 2200)),
    ("ssh://admin@bastion:2200", ("admin", "bastion", 2200)), ("[::1]:2222", (None, "::1", 2222)),
    ("admin@::1", ("admin", "::1", None)), ("ops@[fe80::1%eth0]", ("ops", "fe80::1%eth0", None)),
])
def test_proxyjump_hops_are_parsed_as_openssh_writes_them(spec: str, parsed: tuple[object, ...]) -> None:
    from dlrun.transport.ssh import parse_jump

    assert parse_jump(spec) == parsed


def test_ssh_config_loops_and_include_scope_are_read_as_openssh_reads_them(tmp_path: Path) -> None:
    from dlrun.errors import UsageError
    from dlrun.inventory import Host
    from dlrun.transport.ssh import SSHTransport

    (tmp_path / "work.conf").write_text("Host work\n    HostName 10.0.0.7\n")
    config = tmp_path / "config"
    config.write_text(f"Include {tmp_path}/work.conf\nUser alice\n"  # after the Include: every host again
                      "Host bastion\n    HostName 10.0.0.1\n"
                      "Host *\n    ProxyJump bastion\n    ProxyCommand ssh -W %h:%p %r@jump\n")
    transport = SSHTransport(config_file=str(config), connect_timeout=1)
    assert transport.target("gpu1").user == "alice" and transport.target("work").hostname == "10.0.0.7"
    with pytest.raises(UsageError, match="ProxyJump loop: bastion"):  # Host * sends the bastion through itself
        transport.connect([Host(address="gpu1", name="gpu1")])
    # ProxyCommand gets the inventory's port and user, as every other use of them does
    config.write_text("Host *\n    ProxyCommand ssh -W %h:%p %r@jump\n")
    target = SSHTransport(config_file=str(config)).target(Host(address="gpu1", name="gpu1", port=2222, user="bob"))
    assert target.proxy_command == "ssh -W gpu1:2222 bob@jump"


def test_push_to_sshd_survives_rekeys_mid_stream(cluster: SshdCluster, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Each connection rekeys several times while the files stream (OpenSSH on the other end)."""
    from paramiko.packet import Packetizer

    from dlrun.inventory import Host
    from dlrun.push.session import push
    from dlrun.transport.local import HostRouter
    from dlrun.transport.ssh import SSHTransport

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(Packetizer, "REKEY_BYTES", 512 * 1024)  # paramiko's public rekey threshold
    keyed: dict[int, int] = {}  # packetizer -> outbound keys set (1 = the first key exchange only)
    set_keys = Packetizer.set_outbound_cipher

    def counted(self: Packetizer, *args: Any, **kwargs: Any) -> None:
        keyed[id(self)] = keyed.get(id(self), 0) + 1
        set_keys(self, *args, **kwargs)

    monkeypatch.setattr(Packetizer, "set_outbound_cipher", counted)
    src = tmp_path / "big"
    src.mkdir()
    blobs = {f"blob{i}.bin": os.urandom(size) for i, size in enumerate([6_000_000, 3_333_333, 1])}
    for name, data in blobs.items():
        (src / name).write_bytes(data)
    hosts = [Host(address=h.name, name=h.name, workdir=str(h.workdir / "rekey"), python=cluster.python)
             for h in cluster.hosts[:2]]
    router = HostRouter(remote=SSHTransport(config_file=str(cluster.ssh_config)))
    try:
        summaries = push(router, hosts, code_dir=src)
    finally:
        router.close()
    assert [s.files_sent for s in summaries] == [3, 3]
    assert len(keyed) == 2 and min(keyed.values()) >= 3, keyed
    for h in cluster.hosts[:2]:
        for name, data in blobs.items():
            assert (h.workdir / "rekey" / "big" / name).read_bytes() == data


# --------------------------------------------------------------------------- ssh config read as OpenSSH reads it


def _common(cluster: SshdCluster, known: Path | str) -> str:
    """The options every cluster host needs, for a ``Host *`` (or Match) block."""
    return (f"    User {cluster.user}\n    IdentityFile {cluster.client_key}\n    IdentitiesOnly yes\n"
            f"    UserKnownHostsFile {known}\n    GlobalKnownHostsFile /dev/null\n")


def _hosts(cluster: SshdCluster, prefix: str, n: int = 2) -> str:
    return "".join(f"Host {prefix}{i}\n    HostName {h.address}\n    Port {h.port}\n"
                   for i, h in enumerate(cluster.hosts[:n]))


def _run(transport: Transport, host: Host, *argv: str) -> str:
    channel = transport.open(host, list(argv))
    out = b""
    while chunk := channel.recv():
        out += chunk
    assert channel.wait(30) == 0, channel.stderr_text()
    return out.decode()


def test_match_include_and_proxyjump_together_reach_hosts_through_the_bastion(
        cluster: SshdCluster, tmp_path: Path) -> None:
    from dlrun.inventory import Host
    from dlrun.transport.ssh import SSHTransport

    assert cluster.bastion is not None
    (tmp_path / "conf.d").mkdir()
    (tmp_path / "conf.d" / "hosts.conf").write_text(_hosts(cluster, "viab-"))
    (tmp_path / "jump.conf").write_text("ProxyJump jumper\n")
    config = tmp_path / "config"
    config.write_text(f"Include {tmp_path}/conf.d/*.conf\n"
                      f"Host jumper\n    HostName {cluster.bastion.address}\n    Port {cluster.bastion.port}\n"
                      "Match OriginalHost viab-*\n"  # capitalised, as many configs write it
                      f"    Include {tmp_path}/jump.conf\n"
                      f"Host *\n{_common(cluster, cluster.known_hosts)}")
    transport = SSHTransport(config_file=str(config), connect_timeout=10)
    hosts = [Host(address=f"viab-{i}", name=f"viab-{i}") for i in range(2)]
    try:
        assert transport.connect(hosts) == {"viab-0": cluster.hosts[0].address, "viab-1": cluster.hosts[1].address}
        assert [transport.targets[h.name].proxy_jump for h in hosts] == ["jumper", "jumper"]
        assert len(transport.jump_clients) == 1  # one bastion connection, shared
        for host in hosts:
            assert _run(transport, host, "echo", "it's me") == "it's me\n"
    finally:
        transport.close()


def test_hostfile_and_inline_user_at_host_set_the_login_user(cluster: SshdCluster, tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.write_text(_hosts(cluster, "plain") + "Host *\n" + _common(cluster, cluster.known_hosts).replace(
        f"    User {cluster.user}\n", "    User nobody-such\n"))  # the config's user would fail
    script = shared_script(cluster, "whoami.py", "import getpass, os\nprint('login', getpass.getuser(), "
                           "os.environ['DLRUN_HOST'])\n")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"{cluster.user}@plain0 slots=1\n{cluster.user}@plain1:1  # a comment\n")
    for spec in (str(hostfile), f"{cluster.user}@plain0:1,{cluster.user}@plain1"):
        out = run_dlrun("launch", "--plain", "--framework", "none", "--hosts", spec,
                        "--ssh-config", str(config), str(script), cwd=tmp_path, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"login {cluster.user} plain0" in out.stdout and f"login {cluster.user} plain1" in out.stdout


def test_without_ssh_on_path_the_fallback_parser_is_used_and_ssh_g_errors_stop_dlrun(
        cluster: SshdCluster, tmp_path: Path) -> None:
    config = tmp_path / "config"
    (tmp_path / "hosts.conf").write_text(_hosts(cluster, "fb"))
    # OpenSSH refuses the unknown option (file and line named, exit 2); paramiko passes it by
    config.write_text(f"Include {tmp_path}/hosts.conf\nMatch Host 127.0.0.*\n    NoSuchOption yes\n"
                      f"Host *\n{_common(cluster, cluster.known_hosts)}")
    marker = cluster.hosts[0].workdir / "fallback-marker"
    marker.unlink(missing_ok=True)
    script = shared_script(cluster, "mark.py", f"open({str(marker)!r}, 'w').write('x')\nprint('marked')\n")
    hosts = tmp_path / "hosts.toml"
    hosts.write_text(f'[defaults]\npython = "{cluster.python}"\n[[hosts]]\naddress = "fb0"\n')
    argv = ["launch", "--plain", "--framework", "none", "--hosts", str(hosts), "--ssh-config", str(config), str(script)]
    out = run_dlrun(*argv, cwd=tmp_path, timeout=60)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"{config}: line 3: Bad configuration option: nosuchoption" in out.stderr
    assert not marker.exists()
    no_ssh = tmp_path / "bin"  # a PATH without ssh
    no_ssh.mkdir()
    out = run_dlrun(*argv, cwd=tmp_path, timeout=60, env={**os.environ, "PATH": str(no_ssh),
                                                          "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "marked" in out.stdout and marker.exists()


def test_known_hosts_by_alias_hashed_names_and_strict_host_key_checking(cluster: SshdCluster, tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    import paramiko

    from dlrun.errors import HostKeyError
    from dlrun.inventory import Host
    from dlrun.transport.ssh import SSHTransport

    h0, h1 = cluster.hosts[0], cluster.hosts[1]
    known = tmp_path / "known_hosts"
    hashed = paramiko.HostKeys.hash_host(h1.known_hosts_name)
    known.write_text(f"Node-Zero.Alias {h0.public_key}\n{hashed} {h1.public_key}\n"
                     f"@cert-authority [{h0.address}]:* {h1.public_key}\n")
    config = tmp_path / "config"
    config.write_text(_hosts(cluster, "k") + "Host k0\n    HostKeyAlias node-zero.alias\n"
                      f"Host ca0\n    HostName {h0.address}\n    Port {h0.port}\n"
                      f"Host new0 loose0\n    HostName {h0.address}\n    Port {h0.port}\n"
                      "    UserKnownHostsFile " + str(tmp_path / "new_known_hosts") + "\n"
                      "Host new0\n    StrictHostKeyChecking accept-new\n"
                      "Host loose0\n    StrictHostKeyChecking no\n"
                      f"Host *\n{_common(cluster, known)}")

    def connect(name: str) -> SSHTransport:
        transport = SSHTransport(config_file=str(config), connect_timeout=10)
        try:
            transport.connect([Host(address=name, name=name)])
        finally:
            transport.close()
        return transport

    connect("k0")  # found by its HostKeyAlias, written in another case
    connect("k1")  # found by the hashed [address]:port
    with pytest.raises(HostKeyError, match=r"known only through @cert-authority .* dlrun does not support host"
                       r" certificates") as caught:
        connect("ca0")
    assert "ssh-keyscan -p" in str(caught.value)
    connect("new0")  # accept-new for this host only: the key is written, under [address]:port
    assert (tmp_path / "new_known_hosts").read_text().startswith(h0.known_hosts_line)
    (tmp_path / "new_known_hosts").write_text(f"{h0.known_hosts_name} {h1.public_key}\n")  # now a changed key
    with pytest.raises(HostKeyError, match="HOST KEY CHANGED"):
        connect("new0")
    capsys.readouterr()
    connect("loose0")  # StrictHostKeyChecking no: accepted, with a warning naming the host
    assert "warning: loose0: StrictHostKeyChecking no" in capsys.readouterr().err


def test_a_connection_that_comes_after_close_is_closed_not_kept(cluster: SshdCluster,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # a Python API user's launch gave up (an interrupt) while one host's handshake ran: that
    # connection must not outlive the transport, with its keep-alive thread
    from dlrun.inventory import load_inventory
    from dlrun.transport.ssh import SSHTransport

    transport = SSHTransport(config_file=str(cluster.ssh_config))
    host = load_inventory(str(hosts_toml(cluster, cluster.scripts / "one-host.toml", 1))).hosts[0]
    made: list[Any] = []
    real_client = transport._client

    def closed_meanwhile(*args: Any, **kwargs: Any) -> Any:
        client = real_client(*args, **kwargs)
        made.append(client)
        transport.close()
        return client

    monkeypatch.setattr(transport, "_client", closed_meanwhile)
    transport.connect([host])
    assert made and transport.clients == {}
    assert made[0].get_transport() is None or not made[0].get_transport().is_active()
