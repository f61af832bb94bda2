"""Real OpenSSH servers on loopback, for tests and benchmarks.

``start_cluster(n, base_dir)`` starts ``n`` ``sshd -D -e -f <config>`` processes, each with its own
ed25519 host key and working directory, all authorising one client key, and writes an OpenSSH
``ssh_config`` (``Host host0`` … ``Host host<n-1>``) and a ``known_hosts`` for them::

    with start_cluster(4, tmp_path) as cluster:
        cluster.run(0, "echo $USER; pwd")  # OpenSSH client, BatchMode, output captured
        subprocess.run(cluster.ssh_argv(1, "uname"))  # ssh -F <ssh_config> -o BatchMode=yes …
        cluster.hosts[2].workdir  # writable by the login user on that "host"

As root the hosts listen on ``127.0.0.2:2222`` … ``127.0.0.<n+1>:2222`` and the login user is a
clean account ``dlrun-test`` (``/bin/sh``, no rc files), created on first use. As any other user
they listen on ``127.0.0.1`` with distinct free ports and serve only that user. See
``SshdCluster`` for every attribute.

One cluster per ``base_dir``. Listeners get ``PR_SET_PDEATHSIG`` (via ``setpriv``): they die
with the thread that started them, so call ``start()`` from a thread that outlives the cluster
(pytest's main thread). As root, if the login user cannot traverse ``base_dir`` (pytest's
``/tmp/pytest-of-root`` is 0700), the files go to a fresh ``/tmp/dlrun-sshd-*`` instead, linked
from ``base_dir/sshd-cluster``; ``stop(remove=True)`` deletes it. The same happens with a bastion
when ``base_dir`` has spaces or shell characters (OpenSSH's ProxyJump passes ``-F`` unquoted).

Killing a listener does not end the sessions it forked (each calls ``setsid``), so ``stop()`` and
``kill_sessions()`` walk the listener's process tree in ``/proc``. ``count_job_processes()`` finds
the processes of a dlrun job on this machine by their ``DLRUN_JOB_ID`` environment variable.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import pwd
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

TEST_USER = "dlrun-test"
TEST_USER_HOME = Path("/var/lib/dlrun-test")
TEST_USER_SHELL = "/bin/sh"
ROOT_PORT = 2222
PRIVSEP_DIR = Path("/run/sshd")
CLIENT_KEX = "curve25519-sha256"  # sntrup761 (OpenSSH 9.2's default) costs ~230 ms client CPU
BASTION_NAME = "bastion"
JOB_ID_VAR = "DLRUN_JOB_ID"
# Process names of sshd's per-connection processes: OpenSSH < 9.8 re-executes ``sshd`` itself,
# 9.8+ runs ``sshd-session`` (and 10.x ``sshd-auth``).
SSHD_COMMS = frozenset({"sshd", "sshd-session", "sshd-auth"})
_BIND_ERRORS = ("Address already in use", "Cannot bind any address")
_USER_LOCK = Path(tempfile.gettempdir()) / ".dlrun-sshd-cluster-user.lock"


class SshdClusterError(RuntimeError):
    """The cluster could not be started (the message includes sshd's stderr where it has one)."""


# --------------------------------------------------------------------------- sshd discovery


def find_sshd() -> str | None:
    """Absolute path of sshd (it re-executes itself, so a relative path breaks it), or None."""
    found = shutil.which("sshd")
    if found:
        return os.path.abspath(found)
    for candidate in ("/usr/sbin/sshd", "/usr/local/sbin/sshd", "/sbin/sshd"):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


@functools.cache
def sshd_version(sshd: str) -> tuple[int, int] | None:
    """(major, minor) of OpenSSH from ``sshd -V`` (older sshd print it in their usage text)."""
    try:
        proc = subprocess.run(
            [sshd, "-V"],
            check=False,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"OpenSSH_(\d+)\.(\d+)", proc.stdout + proc.stderr)
    return (int(match.group(1)), int(match.group(2))) if match else None


@functools.cache
def _sshd_accepts(sshd: str, option: str, config: str) -> bool:
    """Whether ``sshd -t`` accepts ``-o option`` on top of an otherwise valid config file."""
    proc = subprocess.run(
        [sshd, "-t", "-f", config, "-o", option],
        check=False,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=10,
    )
    return proc.returncode == 0


def _supports_per_source_penalties(sshd: str, probe_config: Path) -> bool:
    version = sshd_version(sshd)
    if version is not None:
        return version >= (9, 8)
    return _sshd_accepts(sshd, "PerSourcePenalties=no", str(probe_config))


# --------------------------------------------------------------------------- /proc helpers


def _proc_table() -> tuple[dict[int, list[int]], dict[int, str]]:
    """(children by parent pid, comm by pid) for every process visible in /proc."""
    children: dict[int, list[int]] = {}
    comms: dict[int, str] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may contain spaces and parentheses.
        open_paren, close_paren = data.find(b"("), data.rfind(b")")
        fields = data[close_paren + 2 :].split()
        if open_paren < 0 or close_paren < 0 or len(fields) < 2:
            continue
        pid = int(entry.name)
        comms[pid] = data[open_paren + 1 : close_paren].decode(errors="replace")
        children.setdefault(int(fields[1]), []).append(pid)
    return children, comms


def _descendants(pid: int, children: dict[int, list[int]]) -> list[int]:
    out: list[int] = []
    stack = list(children.get(pid, ()))
    while stack:
        child = stack.pop()
        out.append(child)
        stack.extend(children.get(child, ()))
    return out


def _is_dead(pid: int) -> bool:
    """Gone, or a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return True
    return data[data.rfind(b")") + 2 :][:1] in (b"Z", b"X")


def _kill(pids: list[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _wait_dead(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    alive = [p for p in pids if not _is_dead(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.01)
        alive = [p for p in alive if not _is_dead(p)]
    return alive


def count_job_processes(job_id: str) -> list[int]:
    """Pids of every process on this machine whose environment has ``DLRUN_JOB_ID=<job_id>``.

    Exact match (job ``a`` does not match ``ab``). Processes whose environ cannot be read (other
    users' when not root, vanished, zombies) are skipped.
    """
    needle = f"{JOB_ID_VAR}={job_id}".encode()
    pids: list[int] = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue
        if needle in environ and needle in environ.split(b"\0"):
            pids.append(int(entry.name))
    return sorted(pids)


def wait_job_processes_gone(job_id: str, timeout: float = 5.0) -> list[int]:
    """Poll ``count_job_processes`` until empty or ``timeout`` passes; return what is left."""
    deadline = time.monotonic() + timeout
    left = count_job_processes(job_id)
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = count_job_processes(job_id)
    return left


# --------------------------------------------------------------------------- users and paths


@contextlib.contextmanager
def _user_lock() -> Iterator[None]:
    with open(_USER_LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _shadow_password(user: str) -> str | None:
    try:
        with open("/etc/shadow") as f:
            for line in f:
                fields = line.split(":")
                if fields[0] == user and len(fields) > 1:
                    return fields[1]
    except OSError:
        return None
    return None


def ensure_test_user(
    name: str = TEST_USER, home: Path = TEST_USER_HOME, shell: str = TEST_USER_SHELL
) -> pwd.struct_passwd:
    """Create (idempotently, as root) a clean login user for pubkey auth without PAM.

    Shell ``/bin/sh`` (dash reads no rc file for ``ssh host cmd``), password field ``*`` (sshd
    with ``UsePAM no`` refuses a locked ``!`` account), home ``/var/lib/dlrun-test`` (mode 0755).
    Another ``name`` (with its own ``home`` and ``shell``) gives a test a login user whose shell
    and startup files it may change; never change ``dlrun-test``'s, which other tests share.
    """
    with _user_lock():
        try:
            pw = pwd.getpwnam(name)
        except KeyError:
            proc = subprocess.run(
                [
                    "useradd",
                    "--system",
                    "--user-group",
                    "--no-create-home",
                    "--home-dir",
                    str(home),
                    "--shell",
                    shell,
                    "--password",
                    "*",
                    name,
                ],
                check=False,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
            )
            try:
                pw = pwd.getpwnam(name)
            except KeyError:
                raise SshdClusterError(
                    f"could not create test user {name!r}: useradd exited {proc.returncode}: "
                    f"{proc.stderr.strip()}"
                ) from None
        fixes: list[str] = []
        if pw.pw_shell != shell:
            fixes += ["--shell", shell]
        if _shadow_password(name) != "*":
            fixes += ["--password", "*"]
        if fixes:
            proc = subprocess.run(
                ["usermod", *fixes, name],
                check=False,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
            )
            if proc.returncode != 0:
                raise SshdClusterError(f"usermod {name}: {proc.stderr.strip()}")
            pw = pwd.getpwnam(name)
        home_dir = Path(pw.pw_dir)
        if home_dir == home or not home_dir.exists():
            home_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
            os.chown(home_dir, pw.pw_uid, pw.pw_gid)
            home_dir.chmod(0o755)
        return pw


def _can_traverse(path: Path, pw: pwd.struct_passwd) -> bool:
    """Whether user ``pw`` can reach ``path`` (x on it and every ancestor; ACLs ignored)."""
    if pw.pw_uid == 0:
        return True
    gids = set(os.getgrouplist(pw.pw_name, pw.pw_gid))
    for p in (path, *path.parents):
        st = p.stat()
        if st.st_uid == pw.pw_uid:
            bit = stat.S_IXUSR
        elif st.st_gid in gids:
            bit = stat.S_IXGRP
        else:
            bit = stat.S_IXOTH
        if not st.st_mode & bit:
            return False
    return True


def _port_free(address: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as sshd does
        try:
            s.bind((address, port))
        except OSError:
            return False
    return True


def _free_ports(address: str, count: int) -> list[int]:
    """``count`` distinct ports that were free on ``address`` a moment ago."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((address, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _read_pid(path: Path) -> int | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    return int(text) if text.strip().isdigit() and text.endswith("\n") else None


@functools.cache
def _pdeathsig_prefix() -> tuple[str, ...]:
    """``setpriv --pdeathsig TERM`` so a listener dies with the test process (if setpriv has it)."""
    setpriv = shutil.which("setpriv") or (
        "/usr/bin/setpriv" if os.path.exists("/usr/bin/setpriv") else None
    )
    if setpriv is None:
        return ()
    try:
        proc = subprocess.run(
            [setpriv, "--pdeathsig", "TERM", "true"],
            check=False,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return ()
    return (setpriv, "--pdeathsig", "TERM") if proc.returncode == 0 else ()


def _q(path: Path) -> str:
    """A path for sshd_config / ssh_config: double-quoted if it has whitespace."""
    text = str(path)
    return f'"{text}"' if any(c.isspace() for c in text) else text


def _pub(private_key: Path) -> Path:
    return private_key.with_name(private_key.name + ".pub")


def _known_hosts_name(address: str, port: int) -> str:
    return address if port == 22 else f"[{address}]:{port}"


def _split_extra_config(extra: str) -> tuple[str, str]:
    """(global part, ``Match`` part): sshd keeps the FIRST value of a keyword, so the caller's
    global lines go before the fixture's defaults; ``Match`` blocks must come last."""
    lines = extra.splitlines()
    for i, line in enumerate(lines):
        if line.strip().lower().startswith("match ") or line.strip().lower() == "match":
            return "\n".join(lines[:i]), "\n".join(lines[i:])
    return extra, ""


# --------------------------------------------------------------------------- the cluster


@dataclass
class SshdHost:
    """One sshd "host". ``pid`` is the listener's pid (from its PidFile) while it runs."""

    index: int
    name: str  # alias in ssh_config: host<i>, or "bastion"
    address: str  # 127.0.0.<i+2> as root, 127.0.0.1 otherwise
    port: int  # 2222 as root (unless taken), a free port otherwise
    user: str  # login user
    dir: Path  # <root>/<name>: config, keys, pid file, log
    workdir: Path  # <root>/<name>/work, owned by and writable for the login user
    host_key_path: Path  # private ed25519 host key (public: .pub next to it)
    config_path: Path
    pid_path: Path
    log_path: Path  # sshd's stderr (LogLevel ERROR)
    public_key: str = ""  # "ssh-ed25519 AAAA…" (the current host key)
    pid: int | None = None
    process: subprocess.Popen[bytes] | None = None

    @property
    def known_hosts_name(self) -> str:
        """How OpenSSH names this host in known_hosts: ``[127.0.0.2]:2222``."""
        return _known_hosts_name(self.address, self.port)

    @property
    def known_hosts_line(self) -> str:
        """``[127.0.0.2]:2222 ssh-ed25519 AAAA…`` for the host's current key."""
        return f"{self.known_hosts_name} {self.public_key}"

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


class SshdCluster:
    """``n`` real sshd processes on loopback; a context manager (``start()`` / ``stop()``).

    Attributes after ``start()``:
      hosts: list[SshdHost] (host0 … host<n-1>); bastion: SshdHost | None (with ``bastion=True``)
      base_dir: the directory the caller gave; root: where everything lives (``base_dir``, or a
        fresh ``/tmp/dlrun-sshd-*`` when the login user cannot traverse ``base_dir``)
      ssh_config, known_hosts, client_key (private; ``client_public_key``), authorized_keys: Path
      user: login user of every host; python: interpreter that user can run (``sys.executable``
        by default); is_root: started as root; sshd_path; notes: list[str] of fallbacks taken;
      startup_seconds: wall time of ``start()``
    """

    def __init__(
        self,
        n: int,
        base_dir: Path | str,
        *,
        extra_sshd_config: str = "",
        bastion: bool = False,
        python: str | None = None,
        start_timeout: float = 15.0,
        login_user: str = TEST_USER,
        login_shell: str = TEST_USER_SHELL,
    ) -> None:
        if not 0 <= n + bastion <= 253:
            raise ValueError("a cluster has 0 to 253 hosts (127.0.0.2 … 127.0.0.254)")
        self.n = n
        self.base_dir = Path(base_dir).absolute()
        self.extra_sshd_config = extra_sshd_config
        self.with_bastion = bastion
        self.python = python or sys.executable
        self.start_timeout = start_timeout
        self.login_user = login_user
        self.login_shell = login_shell
        self.is_root = os.geteuid() == 0
        self.sshd_path = find_sshd() or ""
        self.ssh_path = shutil.which("ssh") or "/usr/bin/ssh"
        self.notes: list[str] = []
        self.hosts: list[SshdHost] = []
        self.bastion: SshdHost | None = None
        self.root = self.base_dir
        self.user = pwd.getpwuid(os.geteuid()).pw_name
        self.ssh_config = self.root / "ssh_config"
        self.known_hosts = self.root / "known_hosts"
        self.client_key = self.root / "client_ed25519"
        self.client_public_key = self.root / "client_ed25519.pub"
        self.authorized_keys = self.root / "authorized_keys"
        self.started = False
        self.startup_seconds = 0.0
        self._made_root = False
        self._login_pw: pwd.struct_passwd | None = None
        self._penalties = False

    # ---- context manager

    def __enter__(self) -> Self:
        if not self.started:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def login_home(self) -> Path:
        """The login user's home directory (where its startup files go)."""
        assert self._login_pw is not None, "start() first"
        return Path(self._login_pw.pw_dir)

    @property
    def scripts(self) -> Path:
        """``<root>/scripts``: where tests put scripts every host's login user can read."""
        return self.root / "scripts"

    @property
    def all_hosts(self) -> list[SshdHost]:
        """The hosts plus the bastion, if any."""
        return self.hosts + ([self.bastion] if self.bastion else [])

    # ---- start

    def start(self) -> SshdCluster:
        if self.started:
            return self
        t0 = time.monotonic()
        if not self.sshd_path:
            raise SshdClusterError(
                "no sshd: shutil.which('sshd') found none, /usr/sbin/sshd missing"
            )
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        self.started = True
        self.startup_seconds = time.monotonic() - t0
        return self

    def _start(self) -> None:
        self.base_dir.mkdir(parents=True, exist_ok=True)
        if self.is_root:
            PRIVSEP_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
            home = TEST_USER_HOME
            if self.login_user != TEST_USER:  # a test's own user: an empty home, no startup files
                home = Path("/var/lib") / self.login_user
                shutil.rmtree(home, ignore_errors=True)
            self._login_pw = ensure_test_user(self.login_user, home, self.login_shell)
        else:
            self._login_pw = pwd.getpwuid(os.geteuid())
        pw = self._login_pw
        self.user = pw.pw_name
        self.root = self.base_dir
        why = None
        if not _can_traverse(self.base_dir, pw):
            why = f"{self.base_dir} is not reachable by {pw.pw_name}"
        elif self.with_bastion and not re.fullmatch(r"[\w./+-]+", str(self.base_dir)):
            # OpenSSH turns ProxyJump into a shell command with an unquoted "-F <ssh_config>".
            why = f"'{self.base_dir}' would break ProxyJump (OpenSSH does not quote -F)"
        if why:
            self.root = Path(tempfile.mkdtemp(prefix="dlrun-sshd-", dir="/tmp"))
            self.root.chmod(0o755)
            self._made_root = True
            link = self.base_dir / "sshd-cluster"
            with contextlib.suppress(OSError):
                link.symlink_to(self.root)
            self.notes.append(f"{why}; cluster files are in {self.root}")
        self.ssh_config = self.root / "ssh_config"
        self.known_hosts = self.root / "known_hosts"
        self.client_key = self.root / "client_ed25519"
        self.client_public_key = self.root / "client_ed25519.pub"
        self.authorized_keys = self.root / "authorized_keys"

        names = [f"host{i}" for i in range(self.n)]
        if self.with_bastion:
            names.append(BASTION_NAME)
        hosts = [self._new_host(i, name) for i, name in enumerate(names)]
        self.hosts = hosts[: self.n]
        self.bastion = hosts[self.n] if self.with_bastion else None

        self._keygen([self.client_key] + [h.host_key_path for h in hosts])
        pub = self.client_public_key.read_text().strip()
        self.authorized_keys.write_text(pub + "\n")
        self.authorized_keys.chmod(0o644)
        for h in hosts:
            h.public_key = " ".join(_pub(h.host_key_path).read_text().split()[:2])

        self._assign_ports(hosts)
        if hosts:  # the probe config (written without the option) is only used by `sshd -t`
            probe = self._write_config(hosts[0])
            self._penalties = _supports_per_source_penalties(self.sshd_path, probe)
        for h in hosts:
            self._write_config(h)
            self._launch(h)
        self._wait_ready(hosts)

        self._write_known_hosts()
        self._write_ssh_config()
        if self.is_root and self.user != "root" and hosts:
            self._check_python(hosts[0])

    def _new_host(self, index: int, name: str) -> SshdHost:
        d = self.root / name
        work = d / "work"
        work.mkdir(parents=True, exist_ok=True)
        d.chmod(0o755)
        assert self._login_pw is not None
        if self.is_root:
            os.chown(work, self._login_pw.pw_uid, self._login_pw.pw_gid)
        work.chmod(0o755)
        return SshdHost(
            index=index,
            name=name,
            address=f"127.0.0.{index + 2}" if self.is_root else "127.0.0.1",
            port=ROOT_PORT if self.is_root else 0,
            user=self.user,
            dir=d,
            workdir=work,
            host_key_path=d / "ssh_host_ed25519_key",
            config_path=d / "sshd_config",
            pid_path=d / "sshd.pid",
            log_path=d / "sshd.log",
        )

    def _keygen(self, paths: list[Path]) -> None:
        """Generate ed25519 keys without passphrase, all in parallel."""
        procs: list[tuple[Path, subprocess.Popen[bytes]]] = []
        try:
            for path in paths:
                for p in (path, _pub(path)):
                    p.unlink(missing_ok=True)
                argv = ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)]
                argv += ["-C", f"dlrun-{path.parent.name}"]
                proc = subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
                )
                procs.append((path, proc))
        finally:
            errors = []
            for path, proc in procs:
                out, _ = proc.communicate()
                if proc.returncode != 0:
                    errors.append(f"ssh-keygen {path}: {out.decode(errors='replace').strip()}")
        if errors:
            raise SshdClusterError("; ".join(errors))

    def _assign_ports(self, hosts: list[SshdHost]) -> None:
        if self.is_root:
            for h in hosts:
                if not _port_free(h.address, h.port):
                    h.port = _free_ports(h.address, 1)[0]
                    self.notes.append(f"{h.address}:{ROOT_PORT} busy; {h.name} uses port {h.port}")
        else:
            for h, port in zip(hosts, _free_ports("127.0.0.1", len(hosts)), strict=True):
                h.port = port

    def _write_config(self, h: SshdHost) -> Path:
        head, tail = _split_extra_config(self.extra_sshd_config)
        lines = [
            "# Generated by tests/support/sshd_cluster.py (throwaway test host).",
            head,
            f"ListenAddress {h.address}:{h.port}",
            f"HostKey {_q(h.host_key_path)}",
            f"PidFile {_q(h.pid_path)}",
            f"AuthorizedKeysFile {_q(self.authorized_keys)}",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "StrictModes no",
            "PermitRootLogin prohibit-password",
            "AllowTcpForwarding yes",
            "PrintMotd no",
            "Subsystem sftp internal-sftp",
            "LogLevel ERROR",
        ]
        if self._penalties:
            lines.append("PerSourcePenalties no")
        lines.append(tail)
        h.config_path.write_text("\n".join(line for line in lines if line) + "\n")
        return h.config_path

    def _launch(self, h: SshdHost) -> None:
        h.pid_path.unlink(missing_ok=True)
        h.pid = None
        with open(h.log_path, "ab") as log:
            h.process = subprocess.Popen(
                [*_pdeathsig_prefix(), self.sshd_path, "-D", "-e", "-f", str(h.config_path)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )

    def _wait_ready(self, hosts: list[SshdHost]) -> None:
        """Wait for every PidFile (written after bind); relaunch on a new port if bind failed."""
        pending = list(hosts)
        attempts = dict.fromkeys((h.name for h in hosts), 1)
        deadline = time.monotonic() + self.start_timeout
        while pending:
            for h in list(pending):
                assert h.process is not None
                pid = _read_pid(h.pid_path)
                if pid is not None:
                    h.pid = pid
                    pending.remove(h)
                    continue
                rc = h.process.poll()
                if rc is None:
                    continue
                log = h.log_text()
                if any(e in log for e in _BIND_ERRORS) and attempts[h.name] < 5:
                    attempts[h.name] += 1
                    old = h.port
                    h.port = _free_ports(h.address, 1)[0]
                    self.notes.append(f"{h.name}: {h.address}:{old} taken; retried on {h.port}")
                    self._write_config(h)
                    self._launch(h)
                    continue
                raise SshdClusterError(
                    f"sshd for {h.name} ({h.address}:{h.port}) exited with {rc} before writing "
                    f"{h.pid_path}; config {h.config_path}; stderr:\n{log.strip()}"
                )
            if not pending:
                break
            if time.monotonic() > deadline:
                details = "\n".join(f"{h.name}: {h.log_text().strip()}" for h in pending)
                raise SshdClusterError(
                    f"sshd not ready after {self.start_timeout:.0f}s (no PidFile) for "
                    f"{', '.join(h.name for h in pending)}; stderr:\n{details}"
                )
            time.sleep(0.005)

    def _write_known_hosts(self) -> None:
        self.known_hosts.write_text("".join(h.known_hosts_line + "\n" for h in self.all_hosts))
        self.known_hosts.chmod(0o644)

    def _host_block(self, alias: str, h: SshdHost, proxy_jump: str | None = None) -> str:
        lines = [
            f"Host {alias}",
            f"    HostName {h.address}",
            f"    Port {h.port}",
            f"    User {h.user}",
            f"    IdentityFile {_q(self.client_key)}",
            "    IdentitiesOnly yes",
            "    PreferredAuthentications publickey",
            f"    UserKnownHostsFile {_q(self.known_hosts)}",
            "    GlobalKnownHostsFile /dev/null",
            "    StrictHostKeyChecking yes",
            "    UpdateHostKeys no",
            f"    KexAlgorithms {CLIENT_KEX}",
            "    LogLevel ERROR",
        ]
        if proxy_jump:
            lines.append(f"    ProxyJump {proxy_jump}")
        return "\n".join(lines) + "\n"

    def _write_ssh_config(self) -> None:
        blocks = ["# Generated by tests/support/sshd_cluster.py: use with ssh -F <this file>.\n"]
        blocks += [self._host_block(h.name, h) for h in self.all_hosts]
        if self.bastion is not None:
            blocks += [
                self._host_block(self.jump_alias(h.index), h, self.bastion.name) for h in self.hosts
            ]
        self.ssh_config.write_text("\n".join(blocks))
        self.ssh_config.chmod(0o644)

    def _check_python(self, h: SshdHost) -> None:
        """Can the login user run ``self.python`` and read its site-packages? Else use root."""
        code = (
            "import os, sys, sysconfig; os.listdir(sysconfig.get_paths()['purelib']); "
            "print(sys.prefix)"
        )
        proc = self.run(h.index, shlex.join([self.python, "-c", code]), timeout=30)
        if proc.returncode == 0:
            return
        if proc.returncode == 255:  # ssh itself failed: not a Python problem
            raise SshdClusterError(
                f"ssh to {h.name} as {self.user} failed: {proc.stderr.strip()}; "
                f"sshd stderr:\n{h.log_text().strip()}"
            )
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        why = lines[-1] if lines else f"rc {proc.returncode}"
        self.notes.append(
            f"{self.user} cannot run {self.python} ({why}); "
            "hosts log in as root instead (root's shell rc files may add latency per command)"
        )
        self.user = "root"
        for host in self.all_hosts:
            host.user = "root"
        self._write_ssh_config()

    # ---- addressing

    def host(self, which: int | str) -> SshdHost:
        """Host by index (0 … n-1) or by name (``host<i>``, ``bastion``)."""
        if isinstance(which, int):
            return self.hosts[which]
        for h in self.all_hosts:
            if h.name == which:
                return h
        raise KeyError(which)

    def jump_alias(self, i: int) -> str:
        """ssh_config alias that reaches host ``i`` through the bastion (``ProxyJump bastion``)."""
        return f"host{i}-via-{BASTION_NAME}"

    def ssh_argv(self, i: int | str, *remote_cmd: str) -> list[str]:
        """``ssh -F <ssh_config> -o BatchMode=yes -- <alias> <remote_cmd…>``.

        ``i`` is a host index or any alias of ssh_config (``bastion``, ``host1-via-bastion``).
        Like OpenSSH itself, the remote words are joined with spaces and run by the remote shell:
        use ``shlex.join`` for exact argv semantics.
        """
        alias = self.hosts[i].name if isinstance(i, int) else i
        return [
            self.ssh_path,
            "-F",
            str(self.ssh_config),
            "-o",
            "BatchMode=yes",
            "--",
            alias,
            *remote_cmd,
        ]

    def run(
        self, i: int | str, cmd: str, timeout: float = 30, *, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run shell command ``cmd`` on host ``i`` with the OpenSSH client (output captured)."""
        return subprocess.run(
            self.ssh_argv(i, cmd),
            check=False,
            input=input,
            stdin=None if input is not None else subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    # ---- sessions and shutdown

    def session_pids(self, i: int | str) -> list[int]:
        """Pids of the sshd session processes (not the listener, not user commands) of host i."""
        h = self.host(i)
        if h.pid is None:
            return []
        children, comms = _proc_table()
        return [p for p in _descendants(h.pid, children) if comms.get(p) in SSHD_COMMS]

    def kill_sessions(self, i: int | str, timeout: float = 5.0) -> list[int]:
        """SIGKILL host i's sshd session processes, keep its listener; returns the killed pids.

        The user's commands are not signalled: they see their connection vanish (EOF on stdin,
        EPIPE on output), as when a network drops. Waits until the killed pids are dead.
        """
        pids = self.session_pids(i)
        _kill(pids)
        _wait_dead(pids, timeout)
        return pids

    def freeze_sessions(self, i: int | str) -> list[int]:
        """SIGSTOP host i's sshd session processes; returns their pids (for ``thaw``).

        The connection stays open but no byte moves either way, as when a cable is cut or the
        machine hangs: no EOF, no reset. The user's commands keep running.
        """
        pids: list[int] = []
        for _ in range(50):  # a session may be forking its post-auth child right now: until none is new
            new = [p for p in self.session_pids(i) if p not in pids]
            if not new and pids:
                break
            _kill(new, signal.SIGSTOP)
            pids += new
            time.sleep(0.05)
        return pids

    @staticmethod
    def thaw(pids: list[int]) -> None:
        """SIGCONT what ``freeze_sessions`` stopped."""
        _kill(pids, signal.SIGCONT)

    def restart_host(self, i: int | str, *, new_host_key: bool = False) -> None:
        """Restart host i's sshd on the same address and port, killing its sessions.

        With ``new_host_key`` it gets a fresh host key and ``known_hosts`` is NOT updated, so
        clients see a changed host key (``host.public_key`` holds the new one).
        """
        h = self.host(i)
        self._stop_host(h)
        if new_host_key:
            self._keygen([h.host_key_path])
            h.public_key = " ".join(_pub(h.host_key_path).read_text().split()[:2])
        self._write_config(h)
        self._launch(h)
        self._wait_ready([h])

    def stop_host(self, i: int | str) -> None:
        """SIGKILL host i's listener and everything under it (sessions and their commands): the
        host is gone and cannot be reached again until ``restart_host(i)``."""
        self._stop_host(self.host(i))

    def _stop_host(self, h: SshdHost) -> None:
        listeners: set[int] = set()
        if h.process is not None and h.process.poll() is None:  # not reaped: pid not reused
            listeners.add(h.process.pid)
        if h.pid is not None and h.pid not in listeners and not _is_dead(h.pid):
            _, comms = _proc_table()
            if comms.get(h.pid) in SSHD_COMMS:
                listeners.add(h.pid)
        # Freeze the listeners so they fork no new session while the tree is collected.
        _kill(list(listeners), signal.SIGSTOP)
        children, _ = _proc_table()
        tree = [p for pid in listeners for p in _descendants(pid, children)]
        _kill(tree)
        _kill(list(listeners))
        if h.process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                h.process.wait(timeout=5)
        _wait_dead(tree, 5.0)
        h.pid = None

    def stop(self, *, remove: bool = False) -> None:
        """SIGKILL every listener and everything it forked (sessions and their commands).

        Safe after a failed or partial ``start()`` and when called twice. Files stay for
        inspection unless ``remove`` (then the cluster files are deleted; a caller's ``base_dir``
        itself stays).
        """
        for h in self.all_hosts:
            self._stop_host(h)
        self.started = False
        if remove:
            self._remove_files()

    def _remove_files(self) -> None:
        if self._made_root:
            shutil.rmtree(self.root, ignore_errors=True)
            link = self.base_dir / "sshd-cluster"
            if link.is_symlink() and Path(os.readlink(link)) == self.root:
                link.unlink()
            return
        for h in self.all_hosts:
            shutil.rmtree(h.dir, ignore_errors=True)
        for p in (
            self.ssh_config,
            self.known_hosts,
            self.client_key,
            self.client_public_key,
            self.authorized_keys,
        ):
            p.unlink(missing_ok=True)


def start_cluster(
    n: int,
    base_dir: Path | str,
    *,
    extra_sshd_config: str = "",
    bastion: bool = False,
    python: str | None = None,
    start_timeout: float = 15.0,
    login_user: str = TEST_USER,
    login_shell: str = TEST_USER_SHELL,
) -> SshdCluster:
    """Start ``n`` sshd hosts (plus a ``bastion`` host if asked) and return the running cluster.

    ``extra_sshd_config`` goes into every sshd_config, before the fixture's defaults so that it
    wins (sshd keeps a keyword's first value); ``Match`` blocks go at the end. ``login_user`` and
    ``login_shell`` (as root only) log in as another user, created with that shell and the home
    ``/var/lib/<login_user>`` (``SshdCluster.login_home``, emptied at each start), for tests of
    login shells and their startup files.
    """
    cluster = SshdCluster(
        n,
        base_dir,
        extra_sshd_config=extra_sshd_config,
        bastion=bastion,
        python=python,
        start_timeout=start_timeout,
        login_user=login_user,
        login_shell=login_shell,
    )
    return cluster.start()
