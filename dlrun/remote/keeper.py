"""The job keeper: one host's supervisor of a detached job (``dlrun launch --detach``).

Shipped by ``dlrun.remote``'s loader with its JSON config on stdin after the source; standard
library only, Python >= 3.8. It makes ``~/.dlrun/jobs/<JOB-ID>/`` (0700), detaches
(double fork, ``setsid``), prints one JSON line (``{"pid", "port"}``) for the client and lives
on with no client. It starts an ordinary agent as the client would, writes each rank's output
to ``attempt-K/rank-N.log`` and keeps the agent's stdin open, so the agent's own watchdog stops
the ranks if the keeper dies. Host 0's keeper leads: the others connect to it over TLS 1.3
(pinned per-job certificate, token checked inside), report their ranks and heartbeats, and get
``stop`` and ``end``. The leader decides fail-fast, lost hosts and the result, written to
``state.json`` (while it runs) and ``result.json`` on every host. Mechanism: ``docs/detach.md``.
"""

from __future__ import annotations

import errno
import hmac
import json
import os
import queue
import select
import signal
import socket
import ssl
import struct
import subprocess
import sys
import tempfile
import threading
import time
import types
from typing import Any, Callable, Tuple

#: The agent's frames (``dlrun.remote.agent``: each host program is shipped alone, imports none).
HEADER = struct.Struct(">BiI")
STARTED, STDOUT, STDERR, EXIT, ERROR, DONE, GPU, STACKS, FILE = 2, 3, 4, 5, 6, 7, 11, 13, 14
#: The numbers the client uses too (the stop margin, the restart pause, gpu.csv's columns, the
#: hang's) and the restart decision are ``dlrun.remote.rankpolicy``'s, loaded from source (``policy``).
LEFT = "left"  # a digest's place for a dump too large to send back (a note says where it stayed)
RECORD_LINE = 4000  # characters of one tail line kept in the job's records
HANDSHAKE_TIMEOUT = 10.0  # a follower's wait for the leader's welcome, per try
AUTH_TIMEOUT = 1.0  # a stranger at the leader's door must be through TLS and the token by then, in all
CONNECT_TIMEOUT = 30.0  # a follower's tries to reach the leader
MAX_GREETINGS = 64  # unauthenticated connections the leader holds at once (each a thread, AUTH_TIMEOUT at most)
MAX_GREETINGS_PER_SOURCE = 8  # of them from one address: one flooding neighbour cannot take every slot
INDEX_EVERY = 1.0  # seconds between two lines of a rank log's time index
RENDEZVOUS_PORT = "HOROVOD_GLOO_RENDEZVOUS_PORT"
HANG_ANSWER = 60.0  # seconds every host has to send its stacks once the job hangs
FLIGHT_WAIT = 10.0  # seconds the leader waits for the hosts' flight recorder digests before the result
CKPT_ANSWER = 1800.0  # seconds every host (the leader's own too) has to answer one checkpoint request
RENDEZVOUS_ADDR = "HOROVOD_GLOO_RENDEZVOUS_ADDR"

Event = Tuple[Any, ...]


def gpu_rows(when: float, host: str, text: str) -> str:
    """``gpu.csv`` rows from nvidia-smi's ``index, uuid, util, mem used, mem total, power, temp``
    lines; what it could not say (``[N/A]``) is an empty cell."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) < 7:
            continue
        values = ["" if c.startswith("[") else c for c in (cells[0], *cells[2:7])]
        rows.append(",".join([f"{when:.3f}", host, *values]) + "\n")
    return "".join(rows)


def fill_rendezvous_port(specs: list[dict[str, Any]], port: int) -> None:
    """Horovod: every attempt's ranks get the port of the leader keeper's rendezvous server
    (the client rendered them before it was bound), in the port variable and in the address
    ``host:port/key`` (``dlrun.remote.rendezvous.client_address``)."""
    for spec in specs:
        for rank in spec["ranks"]:
            env = rank.get("env") or {}
            if RENDEZVOUS_PORT in env:
                env[RENDEZVOUS_PORT] = str(port)
            host, colon, rest = str(env.get(RENDEZVOUS_ADDR, "")).partition(":")
            if colon and "/" in rest:
                env[RENDEZVOUS_ADDR] = f"{host}:{port}/{rest.partition('/')[2]}"


def pin_working_folders(specs: list[dict[str, Any]]) -> None:
    """Every attempt's ranks start in the folder their working folder resolves to now: the code
    tree the push swapped in (``<workdir>/<project>`` is a link to it), so a later push, which
    swaps the link, never changes a restarted rank's code. The keeper runs in that folder too,
    which keeps the push from removing it while the job lives (docs/push.md)."""
    pinned = None
    for spec in specs:
        for rank in spec["ranks"]:
            if rank.get("cwd"):
                rank["cwd"] = os.path.realpath(os.path.expanduser(str(rank["cwd"])))
                pinned = pinned or rank["cwd"]
    if pinned:
        try:
            os.chdir(pinned)
        except OSError:
            pass


VERSIONS = ".dlrun-versions"  # as dlrun.remote.push_helper names it
PINS: list[tuple[str, int]] = []


def pin_tree(folder: str) -> tuple[str, int] | None:
    """Mark the pushed code tree holding ``folder`` as used: ``<version>.pin-<token>``, locked
    (flock, shared) for as long as this process lives. A push's collection
    (``push_helper.pinned``) leaves a version with a locked mark alone, and removes a mark whose
    lock is free; it works where the push cannot see this host's processes (a folder shared over
    NFS), and a killed process's lock goes with it. Also ``dlrun.remote.agent.pin_tree``."""
    import fcntl

    while os.path.dirname(folder) != folder:
        parent = os.path.dirname(folder)
        if os.path.basename(os.path.dirname(parent)) == VERSIONS:
            token = os.urandom(8).hex()  # what secrets.token_hex does, without importing it
            pin, temp = f"{folder}.pin-{token}", f"{folder}.pinning-{token}"
            try:  # locked before it bears the name a push looks at, which then never sees it unlocked
                fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                fcntl.flock(fd, fcntl.LOCK_SH)
                os.rename(temp, pin)
                return pin, fd
            except OSError:
                return None
        folder = parent
    return None


def pin_version() -> None:
    """The keeper keeps its job's code tree while it lives (between attempts too)."""
    pinned = pin_tree(os.getcwd())
    if pinned:
        PINS.append(pinned)


def unpin_version() -> None:
    for pin, fd in PINS:
        try:
            os.unlink(pin)
            os.close(fd)
        except OSError:
            pass


def load_module(source: str, name: str) -> Any:
    """A ``dlrun.remote`` module from its source (shipped in the config: the rendezvous, the rank
    lines): a module of this keeper's own, dlrun is not imported."""
    module = types.ModuleType("dlrun_" + name)
    sys.modules[module.__name__] = module  # what its classes' __module__ names
    cached = globals().get("_dlrun_code")  # the bootstrap loader's code cache (dlrun.remote.LOADER)
    where = "<dlrun-" + name + ">"
    exec(cached(source.encode("utf-8"), where) if cached else compile(source, where, "exec"), module.__dict__)
    return module


def load_rendezvous(source: str) -> Any:
    return load_module(source, "rendezvous")


def jobs_root() -> str:
    return os.path.join(os.path.expanduser("~"), ".dlrun", "jobs")


def host_folder(host: str) -> str:
    """The host's own folder name in the job's folder: hosts may share a home (NFS)."""
    name = "".join(c if c.isalnum() or c in "._-" else "_" for c in host)
    return "host-" + name


def boot_id() -> str:
    """This machine's boot (``/proc/sys/kernel/random/boot_id``): a pid means something only
    on the machine and boot that wrote it."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return os.uname().nodename


RESERVE = "reserve"  # a file of RESERVE_BYTES in the job's folder, given up for the final result
RESERVE_BYTES = 1 << 20
DISK_RETRY = 5.0  # seconds a keeper only counts log lines after a write failed, before it tries again


def write_json(path: str, document: dict[str, Any], use_reserve: bool = False) -> bool:
    """Atomically: a reader (``dlrun ps``) never sees half a file. On a full disk, with
    ``use_reserve`` (the final result), the folder's reserve is given up for it; whether it was
    written."""
    temp = path + ".tmp"
    for _ in range(2 if use_reserve else 1):
        try:
            with open(temp, "w", encoding="utf-8") as fh:
                json.dump(document, fh)
            os.replace(temp, path)
            return True
        except OSError:
            try:
                os.unlink(temp)
            except OSError:
                pass
            try:
                os.unlink(os.path.join(os.path.dirname(path), RESERVE))
            except OSError:
                return False
    return False


def make_reserve(folder: str) -> None:
    """Room kept for the records (``result.json``) should the ranks' logs fill the disk."""
    try:  # not zeros: a compressing filesystem (ZFS, btrfs) stores those as holes, reserving nothing
        with open(os.path.join(folder, RESERVE), "wb") as fh:
            fh.write(os.urandom(RESERVE_BYTES))
    except OSError:
        pass


def server_context(cert_pem: str, key_pem: str) -> ssl.SSLContext:
    """The leader's side: TLS 1.3 with the job's certificate. ``load_cert_chain`` reads files
    only: the key goes to an anonymous memory file (``memfd_create``, read by its
    ``/proc/self/fd`` path), never to the job folder, which may be a home on NFS; without
    memfd, to a 0600 file in the local temp folder, removed at once."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    with tempfile.TemporaryDirectory(prefix="dlrun-keeper-") as private:  # 0700
        fds = [memory_file(text) for text in (cert_pem, key_pem)]
        try:
            paths = [f"/proc/self/fd/{fd}" if fd is not None else "" for fd in fds]
            for i, text in enumerate((cert_pem, key_pem)):
                if not paths[i]:
                    paths[i] = os.path.join(private, f"{i}.pem")
                    with os.fdopen(os.open(paths[i], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as fh:
                        fh.write(text)
            context.load_cert_chain(paths[0], paths[1])
        finally:
            for fd in fds:
                if fd is not None:
                    os.close(fd)
    return context


def memory_file(text: str) -> int | None:
    """A file descriptor of an anonymous memory file holding ``text`` (None: no memfd here)."""
    try:
        fd = os.memfd_create("dlrun-keeper", os.MFD_CLOEXEC)
    except (AttributeError, OSError):
        return None
    os.write(fd, text.encode())
    return fd


def client_context(cert_pem: str) -> ssl.SSLContext:
    """A follower's side: TLS 1.3, trusting exactly the job's certificate (pinned). The same as
    the Spark task's: each ships alone (by source here, pickled by value there), so neither can
    import the other."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_verify_locations(cadata=cert_pem)
    return context


class Peer:
    """One TLS connection carrying JSON lines; a thread reads it into the keeper's queue.

    OpenSSL allows one SSL object in one thread at a time, and CPython's ``recv`` and ``send``
    take no lock of their own: a read in the reader thread beside a send (the keeper's loop, the
    heartbeat) breaks the TLS stream, which the other side sees as a closed connection (a host
    wrongly lost). So every TLS call holds ``tls`` and none blocks under it: the socket is
    non-blocking, and a reader waits for bytes (``select``; ``pending`` for bytes TLS already
    decrypted) and a sender for room outside it. ``sending`` keeps one message's bytes together;
    a send that finds no room for ``timeout`` seconds (``--host-timeout``) closes the peer."""

    def __init__(self, sock: ssl.SSLSocket, name: str) -> None:
        self.sock = sock
        self.name = name
        self.timeout = sock.gettimeout()  # None: a send waits as long as it takes
        sock.setblocking(False)
        self.tls = threading.Lock()
        self.sending = threading.Lock()
        self.heard = time.monotonic()
        self.closed = False

    def send(self, message: dict[str, Any]) -> None:
        data = memoryview(json.dumps(message).encode() + b"\n")
        with self.sending:
            deadline = None if self.timeout is None else time.monotonic() + self.timeout
            sent = 0
            while sent < len(data):
                try:
                    with self.tls:
                        if self.closed:
                            return
                        try:  # after a want-write, the same bytes again (as OpenSSL requires)
                            sent += self.sock.send(data[sent:sent + 16384])
                            continue
                        except (ssl.SSLWantWriteError, BlockingIOError):
                            reads_first = False
                        except ssl.SSLWantReadError:  # TLS reads first: the reader thread does
                            reads_first = True
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise OSError(f"no room to send for {self.timeout:g} s")
                    pause = min(0.05 if reads_first else 1.0, 1.0 if left is None else left)
                    if reads_first:
                        time.sleep(pause)
                    else:
                        select.select([], [self.sock], [], pause)
                except (OSError, ValueError):  # gone, or a peer that stopped reading
                    with self.tls:
                        self.closed = True
                    return

    def receive(self, wait: float = 1.0) -> bytes | None:
        """What the peer sent next (b"" once the connection is over), or None if nothing came
        within ``wait`` seconds (silence: the keeper's clock, ``heard``, judges it)."""
        try:
            with self.tls:
                ready = self.sock.pending() > 0
            if not ready and not select.select([self.sock], [], [], wait)[0]:
                return None
            with self.tls:
                try:
                    return self.sock.recv(65536)
                except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError):
                    return None
        except (OSError, ValueError):  # closed, here or by the peer
            return b""

    def read_into(self, events: queue.Queue[Event], buffered: bytes = b"") -> None:
        buf = buffered
        while True:
            while b"\n" in buf:
                line, _, buf = buf.partition(b"\n")
                self.heard = time.monotonic()
                try:
                    events.put(("peer", self.name, json.loads(line)))
                except ValueError:
                    pass
            data = self.receive()
            if data is None:
                continue
            if not data:
                events.put(("peer-closed", self.name))
                return
            self.heard = time.monotonic()
            buf += data

    def close(self) -> None:
        with self.tls:
            self.closed = True
            try:
                self.sock.close()
            except OSError:
                pass


def read_line(sock: ssl.SSLSocket, limit: int = 65536) -> tuple[bytes, bytes]:
    """The first line from ``sock`` and what came after it (within the socket's timeout)."""
    buf = b""
    while b"\n" not in buf:
        data = sock.recv(4096)
        if not data or len(buf) > limit:
            raise OSError("connection closed before the hello")
        buf += data
    line, _, rest = buf.partition(b"\n")
    return line, rest


class Door:
    """The leader's listening socket, against strangers (any local user sees its port in
    ``/proc/net/tcp``): each connection must finish TLS and show the job's token within
    ``AUTH_TIMEOUT`` in all, or it is closed; at most ``MAX_GREETINGS`` wait at once, and
    ``MAX_GREETINGS_PER_SOURCE`` from one address. A keeper it lets in is sent ``welcome``
    (a follower that is not welcomed tries again)."""

    def __init__(self, token_ok: Callable[[str], bool]) -> None:
        self.token_ok = token_ok
        self.lock = threading.Lock()
        self.waiting: dict[str, int] = {}  # source address -> connections not yet through

    def serve(self, listener: socket.socket, context: ssl.SSLContext,
              joined: Callable[[ssl.SSLSocket, dict[str, Any], bytes], None]) -> None:
        while True:
            try:
                raw, source = listener.accept()
            except OSError:
                return
            where = str(source[0])
            with self.lock:
                full = (sum(self.waiting.values()) >= MAX_GREETINGS
                        or self.waiting.get(where, 0) >= MAX_GREETINGS_PER_SOURCE)
                if not full:
                    self.waiting[where] = self.waiting.get(where, 0) + 1
            if full:  # a flood: no thread each, closed at once
                raw.close()
                continue
            threading.Thread(target=self.greet, args=(raw, where, context, joined), daemon=True).start()

    def greet(self, raw: socket.socket, where: str, context: ssl.SSLContext,
              joined: Callable[[ssl.SSLSocket, dict[str, Any], bytes], None]) -> None:
        try:
            self.welcome(raw, context, joined)
        finally:
            with self.lock:
                self.waiting[where] -= 1
                if not self.waiting[where]:
                    del self.waiting[where]

    def welcome(self, raw: socket.socket, context: ssl.SSLContext,
                joined: Callable[[ssl.SSLSocket, dict[str, Any], bytes], None]) -> None:
        """One stranger: TLS, then the token within ``AUTH_TIMEOUT``; ``joined`` if it is in."""
        through = threading.Event()
        try:
            watch = raw.dup()  # wrap_socket takes raw's descriptor: the timer shuts the connection through its own
        except OSError:  # no descriptor left: no stranger is worth one
            raw.close()
            return

        def expire() -> None:  # the whole greeting, not each read: a trickle is no way around it
            if not through.is_set():
                try:
                    watch.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        timer = threading.Timer(AUTH_TIMEOUT, expire)
        timer.daemon = True
        timer.start()
        sock = None
        try:
            raw.settimeout(AUTH_TIMEOUT)
            sock = context.wrap_socket(raw, server_side=True)
            line, rest = read_line(sock, limit=4096)
            hello = json.loads(line)
            if not isinstance(hello, dict) or not self.token_ok(str(hello.get("token", ""))):
                raise ValueError("a wrong token")
            through.set()
            sock.sendall(b'{"op": "welcome"}\n')
        except (OSError, ValueError, AttributeError):
            (sock or raw).close()
            return
        finally:
            timer.cancel()
            watch.close()
        joined(sock, hello, rest)


class Keeper:
    def __init__(self, config: dict[str, Any], jobdir: str, listener: socket.socket | None,
                 context: ssl.SSLContext | None, rendezvous: Any = None) -> None:
        self.config = config
        self.job_id = str(config["job_id"])
        self.host = str(config["host"])
        self.leader = bool(config["leader"])
        self.jobdir = jobdir
        self.specs: list[dict[str, Any]] = list(config.get("specs") or [config["spec"]])
        self.attempt = 0  # which of ``specs`` runs (--max-restarts: one spec per attempt)
        self.history: list[dict[str, Any]] = []  # the failed attempts before this one
        self.generation = 0  # which agent the events come from (a restart starts a fresh one)
        self.grace = float(config.get("grace", 10.0))
        self.host_timeout = float(config.get("host_timeout") or 0) or None
        self.listener = listener  # closed (None) once every follower joined
        self.port = listener.getsockname()[1] if listener is not None else None
        self.context = context
        self.rendezvous = rendezvous  # the leader of a Horovod job: its gloo rendezvous server, bound
        self.enders = {int(r) for r in config.get("enders") or []}  # tf-ps: the chief's rank
        self.events: queue.Queue[Event] = queue.Queue()
        self.signals: list[int] = []
        self.door = Door(self.token_ok)  # the leader's strangers: TLS and the token, within AUTH_TIMEOUT
        self.peers: dict[str, Peer] = {}
        self.leader_peer: Peer | None = None
        self.logs: dict[int, Any] = {}
        self.indexes: dict[int, Any] = {}  # rank -> its log's index: when each offset was written
        self.indexed: dict[int, float] = {}  # rank -> when its index last got a line
        self.policy = load_module(str(config["rankpolicy_source"]), "rankpolicy")  # dlrun.remote.rankpolicy
        self.outputs: dict[int, Any] = {}  # rank -> its rankpolicy.RankLines (tail, traceback, splitters)
        self.raised_at: dict[int, float] = {}  # own rank -> when its last traceback ended (time.time)
        self.raised: dict[int, tuple[float, str, list[str]]] = {}  # the leader's: ranks whose last words were one
        self.dropped: dict[int, int] = {}  # rank -> log lines not written (the disk is full)
        self.written: dict[int, int] = {}  # rank -> bytes of its log written whole
        self.full_until = 0.0  # a log write failed: until then lines are only counted
        self.notes: list[str] = []  # what the job's record says beside the root cause (disk full on h2)
        self.agent: subprocess.Popen[bytes] | None = None
        self.agent_done = False
        self.stopping = False
        self.kill_at: float | None = None
        self.ended = False  # the job's result is known (leader: decided; follower: told or leader lost)
        self.port_claims: list[Any] = []  # this machine's ranks' ports, claimed (hold_ports)
        self.started_at = time.time()
        # the leader's view of the whole job: rank -> {"host", "state", "code"}
        world = config.get("world") or {}
        self.ranks: dict[int, dict[str, Any]] = {
            int(rank): {"rank": int(rank), "host": host, "state": "pending", "code": None}
            for rank, host in world.items()}
        self.own = [int(r["rank"]) for r in self.specs[0]["ranks"]]
        for rank in self.own:
            self.ranks.setdefault(rank, {"rank": rank, "host": self.host, "state": "pending", "code": None})
        for rank, argv in (config.get("argv") or {}).items():  # what the summary's root cause names
            if int(rank) in self.ranks:
                self.ranks[int(rank)]["argv"] = argv
        self.followers = [str(h) for h in config.get("followers", [])]
        self.root_cause: str | None = None
        self.root_tail: list[str] = []
        self.hang_cause = False  # the root cause is --hang-timeout's
        self.leader_gone = False  # a follower that lost its leader: the job is lost (exit 255)
        self.failed = False  # the job ended by a failure (also when a stop came after it)
        self.root: dict[str, Any] = {}  # the root cause rank's rank, host, exception, error file, hint
        self.exit_code: int | None = None
        self.interrupted_by: int | None = None
        self.failed_code = 0
        self.closed_generation = 0  # the last agent whose end was handled
        self.agent_lock = threading.Lock()
        self.held: list[Event] = []  # events wait_agent took that are not the agent's
        self.stacks_asked = False  # SIGUSR1 from ``dlrun-jobs``: stack-request.json waits (dlrun stack)
        # --hang-timeout (docs/stacks.md): own silence and GPU use; the leader also the followers'
        self.hang = dict(config.get("hang") or {})
        # torch jobs' flight recorder dumps: each keeper digests its own, the leader reads them all
        self.groups_source = config.get("groups_source")  # dlrun.remote.stack_groups, where needed
        self.groups_module: Any = None
        self.flight = self.groups_source is not None and any(  # every keeper of a torch job alike
            "TORCH_FR_DUMP_TEMP_FILE" in (r.get("env") or {}) for r in self.specs[0]["ranks"])
        self.flight_lines: list[str] = []  # what the dumps say, in the result (a failed job's)
        self.reset_hang_watch()
        # --checkpoint-dir: each keeper's ckptsync.Worker; the leader makes the folders the same
        checkpoint = config.get("checkpoint")
        self.ckpt = load_module(str(checkpoint["source"]), "ckptsync") if checkpoint else None
        self.ckpt_worker = self.ckpt.Worker(checkpoint) if self.ckpt is not None else None
        self.ckpt_asked = 0  # the leader's requests so far (each answer names its request)

    def reset_hang_watch(self) -> None:
        """The hang watch of a fresh attempt: no silence yet, no hang asked or answered, no stop
        pending (a restart after a hang must not inherit the last attempt's)."""
        self.last_output = time.monotonic()
        self.last_busy = float("-inf")
        self.quiet_of: dict[str, tuple[float, float, float]] = {}  # follower -> (quiet, idle, when told)
        self.hang_id: str | None = None
        self.hang_deadline = 0.0
        self.hang_answers: dict[str, Any] = {}
        self.hang_stop_at: float | None = None  # the dumps asked for: the stop follows then
        self.record_asked: list[int] = []  # the ranks running when the hang asked for dumps (leader)
        self.digests: dict[int, Any] = {}  # this attempt's dumps: rank -> digest (None: unreadable; LEFT)
        self.flight_from: set[str] = set()  # the hosts whose digests are in (the leader's)
        self.flight_sent = False  # this follower's digests went to the leader
        self.flight_until: float | None = None  # the leader's wait for them ends then

    # ---------------------------------------------------------------- records
    def record(self, final: bool = False) -> dict[str, Any]:
        document: dict[str, Any] = {
            "job_id": self.job_id, "host": self.host, "leader": self.leader, "pid": os.getpid(),
            "script": self.config.get("script", ""), "hosts": self.config.get("hosts", [self.host]),
            "state": self.job_state(), "started_at": self.started_at,
            "ranks": [self.ranks[r] for r in sorted(self.ranks)],
            "exit_code": self.exit_code, "root_cause": self.root_cause, "root_tail": self.root_tail,
            "hung": self.hang_cause, "flight_recorder": self.flight_lines,
            "root": self.root, "notes": self.notes,
            "attempts": self.attempt + 1, "history": self.history,
            "port": self.port,
        }
        if self.rendezvous is not None:
            document["rendezvous_port"] = self.rendezvous.address[1]
        if final:
            document["ended_at"] = time.time()
            write_json(os.path.join(self.jobdir, "result.json"), document, use_reserve=True)
        write_json(os.path.join(self.jobdir, "state.json"), document, use_reserve=final)
        return document

    def job_state(self) -> str:
        if self.leader_gone:
            return "lost"
        if self.exit_code is not None:
            if self.exit_code == 0:
                return "succeeded"
            return "stopped" if self.interrupted_by is not None and not self.failed else "failed"
        if all(r["state"] != "pending" for r in self.ranks.values()):
            return "stopping" if self.stopping else "running"
        return "starting"

    # ---------------------------------------------------------------- the agent
    @property
    def attempt_dir(self) -> str:
        return os.path.join(self.jobdir, f"attempt-{self.attempt}")

    def start_agent(self) -> None:
        """A fresh agent for this attempt's spec, its ranks' logs in ``attempt-K/``."""
        for log in [*self.logs.values(), *self.indexes.values()]:
            try:
                log.close()
            except OSError:
                pass
        self.generation += 1
        self.agent_done = False
        spec = self.specs[self.attempt]
        self.dropped.clear()
        self.written.clear()
        try:
            os.makedirs(self.attempt_dir, mode=0o700, exist_ok=True)
        except OSError as exc:
            self.note(f"cannot make {self.attempt_dir} on {self.host} ({exc}): its ranks' lines are not logged")
        for rank in self.own:
            self.logs[rank] = self.open_log(f"rank-{rank}.log", "wb", 0)
            self.indexes[rank] = self.open_log(f"rank-{rank}.idx", "w", -1)
            self.indexed[rank] = 0.0
            self.outputs[rank] = self.policy.RankLines()
        env = dict(os.environ)
        env["DLRUN_JOB_ID"] = str(spec["job_id"])  # the attempt's: what sweeps and tests look for
        with open(os.path.join(self.jobdir, "agent.log"), "ab") as stderr, self.agent_lock:
            self.agent = subprocess.Popen([str(a) for a in self.config["agent_argv"]], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=stderr, env=env, start_new_session=True)
            assert self.agent.stdin is not None
            payload = str(self.config["agent_source"]).encode("utf-8")
            stage = str(self.config.get("agent_stage") or "").encode("utf-8")  # the loader's code cache
            head = b"+%09d" % len(stage) + stage if stage else b""
            self.agent.stdin.write(head + b"%010d" % len(payload) + payload)
            self.agent.stdin.write(json.dumps(spec).encode() + b"\n")
            self.agent.stdin.flush()
        threading.Thread(target=self.read_agent, args=(self.agent, self.generation), daemon=True).start()

    def open_log(self, name: str, mode: str, buffering: int) -> Any:
        """A file of this attempt's folder, or the null device where it cannot be made (a full disk)."""
        try:
            return open(os.path.join(self.attempt_dir, name), mode, buffering)
        except OSError:
            self.full_until = time.monotonic() + DISK_RETRY
            return open(os.devnull, mode, buffering)

    def read_agent(self, agent: subprocess.Popen[bytes], generation: int) -> None:
        assert agent.stdout is not None
        buf = b""
        fd = agent.stdout.fileno()
        while True:
            try:
                data = os.read(fd, 65536)
            except OSError:
                data = b""
            if not data:
                break
            buf += data
            pos = 0
            while len(buf) - pos >= HEADER.size:
                kind, rank, length = HEADER.unpack_from(buf, pos)
                if len(buf) - pos - HEADER.size < length:
                    break
                start = pos + HEADER.size
                self.events.put(("frame", generation, kind, rank, buf[start:start + length]))
                pos = start + length
            buf = buf[pos:]
        self.events.put(("agent-closed", generation))

    def tell_agent(self, message: dict[str, Any]) -> None:
        with self.agent_lock:  # the main loop and the heartbeat thread both write
            agent = self.agent
            if agent is None or agent.stdin is None:
                return
            try:
                agent.stdin.write(json.dumps(message).encode() + b"\n")
                agent.stdin.flush()
            except (OSError, ValueError):
                pass

    def stop_own(self) -> None:
        if not self.stopping:
            self.stopping = True
            self.kill_at = time.monotonic() + self.grace + self.policy.STOP_MARGIN
            self.tell_agent({"op": "stop", "grace": self.grace})

    def write_log(self, rank: int, lines: list[str]) -> None:
        """Lines to the rank's log (unbuffered: what is in the file is whole lines); at most once a
        second, ``<time> <byte offset>`` to its index (``attach --since`` starts there). A disk that
        is full (or a log that cannot be written) loses lines, counted, never the job: the lines are
        only counted until ``DISK_RETRY`` seconds have passed and the disk has room again."""
        now = time.monotonic()
        if self.full_until and now < self.full_until:
            self.dropped[rank] = self.dropped.get(rank, 0) + len(lines)
            return
        if self.full_until and not self.has_room():
            self.full_until = now + DISK_RETRY
            self.dropped[rank] = self.dropped.get(rank, 0) + len(lines)
            return
        self.full_until = 0.0
        fd = self.logs[rank].fileno()
        data = ("\n".join(lines) + "\n").encode("utf-8", "replace")
        end = self.written.get(rank, 0)
        try:
            wall = time.time()
            if wall - self.indexed[rank] >= INDEX_EVERY:
                self.indexed[rank] = wall
                self.indexes[rank].write(f"{wall:.3f} {end}\n")
                self.indexes[rank].flush()
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            self.written[rank] = end + len(data)
        except (OSError, ValueError) as exc:
            first = not self.dropped
            self.dropped[rank] = self.dropped.get(rank, 0) + len(lines)
            self.full_until = now + DISK_RETRY
            try:  # a line written in part is taken back: the file holds whole lines only
                os.ftruncate(fd, end)
            except (OSError, ValueError):
                pass
            if first:
                why = "disk full" if getattr(exc, "errno", None) == errno.ENOSPC else f"cannot write logs ({exc})"
                self.note(f"{why} on {self.host}: its ranks' log lines are dropped and counted; the job goes on")

    def has_room(self) -> bool:
        """Is there room again for logs (beyond what the records need)?"""
        try:
            stat = os.statvfs(self.jobdir)
        except OSError:
            return False
        return stat.f_bavail * stat.f_frsize > 2 * RESERVE_BYTES

    def note(self, text: str) -> None:
        """A line for the job's record (the leader's, which every host gets at the end)."""
        if text in self.notes:
            return
        self.notes.append(text)  # a follower's own record too (and what it sends once it joins)
        if self.leader:
            self.record()
        elif self.leader_peer is not None:
            self.leader_peer.send({"op": "note", "text": text})

    def on_frame(self, kind: int, rank: int, payload: bytes) -> None:
        if kind in (STDOUT, STDERR):
            self.last_output = time.monotonic()
        if kind in (STDOUT, STDERR) and rank in self.logs:
            output = self.outputs[rank]
            before = output.traceback.last
            lines = output.feed(kind, payload)
            if lines:
                self.write_log(rank, lines)
            if output.traceback.last is not before:
                self.raised_at[rank] = time.time()
                self.tell_raised(rank, self.raised_at[rank], list(output.traceback.last))
            elif rank in self.raised_at and not output.traceback.final:  # it went on: not its last words
                del self.raised_at[rank]
                self.tell_raised(rank, None, [])
        elif kind == STARTED:
            self.report(rank, "running", None)
        elif kind == ERROR and rank in self.logs:
            message = f"dlrun: {payload.decode('utf-8', 'replace')}"
            self.outputs[rank].seen([message])
            self.write_log(rank, [message])
        elif kind == EXIT:
            output = self.outputs.get(rank)
            if output is not None and rank in self.logs:
                rest = [text for _stream, text in output.flush()]
                if rest:
                    self.write_log(rank, rest)
            try:
                info = json.loads(payload)
                code = int(info["code"])
            except (ValueError, KeyError, TypeError):
                info, code = {}, 255
            if self.dropped.get(rank):
                self.note(f"rank {rank} on {self.host}: {self.dropped[rank]} log lines dropped (disk full)")
            self.report(rank, "exit", code, info)
        elif kind == DONE:
            self.agent_done = True
            self.flight_report()  # its dumps came before DONE
        elif kind == GPU:
            self.gpu_sample(payload)
        elif kind == FILE:  # a flight recorder dump: kept with the attempt's logs
            groups = self.groups() if self.flight else None
            if payload.startswith(b"\0"):  # too large to send: where it stayed
                left = groups.left_on_host(payload, self.host) if groups is not None else None
                if left is not None:
                    self.digests[left[0]] = LEFT  # sent back none: it stayed on the host, named in a note
                    self.note(left[1])
                return
            raw, _, data = payload.partition(b"\0")
            folder = os.path.join(self.attempt_dir, "flight-recorder")
            name = os.path.basename(raw.decode("utf-8", "replace")).strip(".") or "dump"
            try:
                os.makedirs(folder, mode=0o700, exist_ok=True)
                with open(os.path.join(folder, name), "wb") as fh:
                    fh.write(data)
            except OSError as exc:  # a full disk loses the dump, not the job
                self.note(f"flight recorder dump {name} on {self.host} not written ({exc})")
            rank_no = groups.rank_of(name) if groups is not None else None
            if groups is not None and rank_no is not None:  # what the leader reads of it
                dump = groups.read_dump(data)
                self.digests[rank_no] = None if dump is None else groups.dump_digest(dump)
        elif kind == STACKS:  # dlrun-jobs waits for this file
            try:
                answer = dict(json.loads(payload))
            except (ValueError, TypeError):
                return
            folder = os.path.join(self.jobdir, "stacks-" + str(answer.get("id", "")))
            os.makedirs(folder, mode=0o700, exist_ok=True)
            write_json(os.path.join(folder, "answer.json"), answer)
            if self.hang_id is not None and answer.get("id") == self.hang_id:
                self.hang_answer(self.host, answer)
            elif not self.leader and str(answer.get("id", "")).startswith("hang-") and self.leader_peer is not None:
                self.leader_peer.send({"op": "stacks-answer", "answer": answer})

    def ask_stacks(self) -> None:
        """``dlrun stack``: hand the request ``dlrun-jobs`` left to the agent, which takes the stacks."""
        try:
            with open(os.path.join(self.jobdir, "stack-request.json")) as fh:
                message = json.load(fh)
            request_id = str(message["id"])
        except (OSError, ValueError, KeyError):
            return
        if "/" in request_id or request_id.startswith("."):
            return
        message.setdefault("request", {})["outdir"] = os.path.join(self.jobdir, "stacks-" + request_id)
        self.tell_agent(message)

    def gpu_sample(self, payload: bytes) -> None:
        """One nvidia-smi sample to ``attempt-K/gpu.csv`` (a failed one to ``keeper.log``)."""
        try:
            sample = json.loads(payload)
        except ValueError:
            return
        try:
            if "csv" not in sample:
                print(f"dlrun-keeper: GPU sample: {sample.get('error')}", flush=True)
                return
            for row in str(sample["csv"]).splitlines():  # index, uuid, utilization, …
                fields = [f.strip() for f in row.split(",")]
                try:
                    if len(fields) > 2 and float(fields[2]) >= self.policy.HANG_BUSY_UTIL:
                        self.last_busy = time.monotonic()
                except ValueError:
                    pass
            rows = gpu_rows(float(sample.get("time") or 0), self.host, str(sample["csv"]))
            path = os.path.join(self.attempt_dir, "gpu.csv")
            new = not os.path.exists(path)
            with open(path, "a", encoding="utf-8") as fh:
                fh.write((",".join(self.policy.GPU_CSV_COLUMNS) + "\n" if new else "") + rows)
        except OSError:  # a full disk: the samples are the first thing to give up
            pass

    def tell_raised(self, rank: int, at: float | None, lines: list[str]) -> None:
        """A rank's traceback ended (``at``) while it runs, or (None) it printed on after it: the
        leader keeps them, for the root cause's ``raised first`` (``rankpolicy.raised_first``)."""
        if self.leader:
            self.on_raised(self.host, rank, at, lines)
        elif self.leader_peer is not None:
            self.leader_peer.send({"op": "raised", "rank": rank, "at": at, "lines": lines})

    def on_raised(self, host: str, rank: int, at: float | None, lines: list[Any]) -> None:
        if at is None:
            self.raised.pop(rank, None)
        else:
            self.raised[rank] = (float(at), host, [str(t) for t in lines][-8:])

    def report(self, rank: int, what: str, code: int | None, info: dict[str, Any] | None = None) -> None:
        """A rank started or exited (``info``: the agent's EXIT frame); with a failure, what its
        root cause shows: the tail, the exception it raised and its error file."""
        info = info or {}
        evidence: dict[str, Any] = {"stopped": bool(info.get("stopped"))}
        if what == "lost":
            evidence["reason"] = str(info.get("reason", ""))
        output = self.outputs.get(rank)
        if code and output is not None:
            evidence["tail"] = [self.policy.cut(t, RECORD_LINE) for t in output.tail]  # records stay small
            evidence["exception"] = list(output.traceback.last)
            evidence["exception_final"] = output.traceback.final  # its last words, or an earlier traceback
            if output.traceback.final and rank in self.raised_at:
                evidence["raised_at"] = self.raised_at[rank]
            evidence["error_file"] = self.policy.error_file_lines(info.get("error_file"))
        if self.leader:
            self.on_rank(self.host, rank, what, code, evidence)  # which writes the record
            return
        entry = self.ranks[rank]  # a follower's own record (state.json) follows its ranks
        entry["state"] = ("running" if what == "running"
                          else self.policy.rank_state(code, self.stopping, evidence["stopped"]))
        if what == "lost":
            entry["state"] = "lost"
        entry["code"] = code
        if self.leader_peer is not None:
            self.leader_peer.send({"op": "rank", "rank": rank, "what": what, "code": code, **evidence})
        self.record()

    # ---------------------------------------------------------------- the leader's policy
    def on_rank(self, host: str, rank: int, what: str, code: int | None, evidence: dict[str, Any]) -> None:
        entry = self.ranks.setdefault(rank, {"rank": rank, "host": host, "state": "pending", "code": None})
        if entry["state"] in self.policy.FINAL_STATES:
            return
        if what == "running":
            entry["state"] = "running"
            entry["started"] = time.time()  # when the leader heard it: the summary's durations
        elif what == "lost":  # its agent is gone (killed): the same state an attached job gives
            entry.update(state="lost", code=255, ended=time.time())
            if not self.stopping:
                self.fail(f"host {host} lost: {evidence.get('reason') or 'its agent ended'}", 255, [])
        else:
            entry["ended"] = time.time()
            entry["code"] = code
            entry["state"] = self.policy.rank_state(code, self.stopping, bool(evidence.get("stopped")))
            if entry["state"] == "failed":
                if self.root_cause is None:
                    self.root = self.root_of(rank, host, evidence)
                self.fail(f"rank {rank} on {host} exited with code {code}", code or 1,
                          [str(t) for t in evidence.get("tail") or []])
            elif code == 0 and rank in self.enders and not self.stopping:
                self.stop_all()  # tf-ps: the chief's end is the job's; the servers never end by themselves
        self.record()

    def root_of(self, rank: int, host: str, evidence: dict[str, Any]) -> dict[str, Any]:
        """The root cause's evidence, as the attached supervisor keeps it (``RankResult``)."""
        exception = [str(t) for t in evidence.get("exception") or []]
        error_file = [str(t) for t in evidence.get("error_file") or []]
        tail = [str(t) for t in evidence.get("tail") or []]
        finished = [(r, str(e["host"])) for r, e in sorted(self.ranks.items()) if e["state"] == "succeeded"]
        hint = self.policy.early_exit_hint(rank, exception + error_file + tail, finished)
        running = {r: v for r, v in self.raised.items() if self.ranks.get(r, {}).get("state") == "running"}
        first = self.policy.raised_first(running, rank, float(evidence.get("raised_at") or time.time()))
        return {"rank": rank, "host": host, "exception": exception, "error_file": error_file, "hint": hint,
                "exception_final": evidence.get("exception_final", True) is not False, "raised_first": first}

    def fail(self, cause: str, code: int, tail: list[str]) -> None:
        """The first failure is the root cause: stop every rank everywhere."""
        if self.root_cause is None:
            self.root_cause, self.root_tail, self.failed_code = cause, tail[-self.policy.TAIL_LINES:], code
        self.stop_all()

    def stop_all(self) -> None:
        for peer in self.peers.values():
            peer.send({"op": "stop"})
        self.stop_own()

    def lose_host(self, host: str, why: str) -> None:
        for entry in self.ranks.values():
            if entry["host"] == host and entry["state"] not in self.policy.FINAL_STATES:
                entry["state"], entry["code"] = "lost", 255
        self.fail(f"host {host} lost: {why}", 255, [])
        self.record()

    def decide(self) -> bool:
        """The leader: once every rank has ended, the result goes to every host. True: ended."""
        if not all(r["state"] in self.policy.FINAL_STATES for r in self.ranks.values()):
            return False
        failed = self.root_cause is not None  # a rank's failure or a lost host: the root cause
        ranks = [self.ranks[r] for r in sorted(self.ranks)]
        code = self.policy.job_exit_code(
            self.failed_code if failed else None, self.interrupted_by, [e["code"] for e in ranks],
            [e["code"] for e in ranks if e["rank"] in self.enders] if self.enders else None)
        lost = list(dict.fromkeys(str(e["host"]) for e in ranks if e["state"] == "lost"))
        max_restarts = len(self.specs) - 1  # the client rendered one spec per attempt
        if self.policy.restart(self.attempt, max_restarts, code, self.interrupted_by, lost,
                               lost_hosts_return=False).again:
            print("dlrun-keeper: " + self.policy.restart_notice(self.attempt, max_restarts, code), flush=True)
            self.restart(self.attempt + 1)
            return False
        if code and self.flight_pending():
            return False  # the hosts' flight recorder digests first (FLIGHT_WAIT at most)
        if code and self.flight:
            self.flight_lines = self.flight_evidence()
        if self.interrupted_by is not None:
            for entry in self.ranks.values():
                if entry["state"] == "failed" and entry["code"] in (128 + signal.SIGTERM, 128 + signal.SIGKILL):
                    entry["state"] = "stopped"
            if self.root_cause is None:
                self.root_cause = f"stopped by signal {self.interrupted_by}"
        self.exit_code = code
        self.failed = failed
        self.ended = True
        result = self.record(final=True)
        for peer in self.peers.values():
            peer.send({"op": "end", "result": result})
        return True

    # ---------------------------------------------------------------- flight recorder dumps
    def groups(self) -> Any:
        """``dlrun.remote.stack_groups``, loaded once from the config's source (None without one)."""
        if self.groups_module is None and self.groups_source:
            self.groups_module = load_module(str(self.groups_source), "stack_groups")
        return self.groups_module

    def flight_report(self) -> None:
        """This host's agent has ended: a follower sends its dumps' digests to the leader (none
        is an answer too), once per attempt; the leader counts its own in."""
        if not self.flight or self.flight_sent:
            return
        self.flight_sent = True
        if self.leader:
            self.flight_from.add(self.host)
        elif self.leader_peer is not None:
            self.leader_peer.send({"op": "flight", "attempt": self.attempt,
                                   "digests": {str(rank): d for rank, d in self.digests.items()}})

    def flight_pending(self) -> bool:
        """The leader: whether a host that is still there has not sent its digests, within
        ``FLIGHT_WAIT`` of the first ask (its agent ends right after its ranks)."""
        if not self.flight:
            return False
        gone = {name for name, peer in self.peers.items() if peer.closed}
        gone |= {str(e["host"]) for e in self.ranks.values() if e["state"] == "lost"}
        waiting = {self.host, *self.followers} - self.flight_from - gone
        if not waiting:
            return False
        now = time.monotonic()
        if self.flight_until is None:
            self.flight_until = now + FLIGHT_WAIT
        return now < self.flight_until

    def flight_evidence(self) -> list[str]:
        """What the dumps say (``stack_groups``: who is behind, who sent none when asked) and
        where they are."""
        groups = self.groups()
        readable = {rank: d for rank, d in self.digests.items() if isinstance(d, dict)}
        lines = [*groups.lagging_lines(readable), *groups.silent_lines(self.record_asked, sorted(self.digests))]
        kept = sorted(rank for rank, d in self.digests.items() if d != LEFT)  # in the job's folders
        if kept and not self.hang_cause:  # a hang's lines name the folders already
            noun = "rank" if len(kept) == 1 else "ranks"
            lines.append(f"flight recorder dumps: ~/.dlrun/jobs/{self.job_id}/host-<host>/attempt-{self.attempt}/"
                         f"flight-recorder/ on each host ({noun} {groups.rank_list(kept)})")
        return lines

    def restart(self, attempt: int) -> None:
        """Run the job again with attempt K's spec (pre-rendered by the client, with its restart
        count); the leader tells every follower to do the same. A lost host is not restarted:
        its keeper is gone."""
        interrupted = self.wait_agent(self.grace + self.policy.STOP_MARGIN)
        self.end_agent()
        if self.leader and (interrupted or self.signals):
            return  # a stop came while the attempt ended: the loop handles it, and it ends the job
        failed_at = self.failure_time()
        if self.leader:
            self.history.append({"attempt": self.attempt, "job_id": self.specs[self.attempt]["job_id"],
                                 "exit_code": self.failed_code, "root_cause": self.root_cause})
        self.attempt = attempt
        self.raised.clear()  # the last attempt's ranks' tracebacks say nothing of the next one
        self.raised_at.clear()
        for entry in self.ranks.values():
            entry.update(state="pending", code=None, started=None, ended=None)
        self.root_cause, self.root_tail, self.failed_code, self.root = None, [], 0, {}
        self.hang_cause = False
        self.stopping, self.kill_at = False, None
        if self.leader:
            time.sleep(self.policy.RESTART_PAUSE)
            if self.rendezvous is not None:  # every rank of the failed attempt has ended: none writes again
                self.rendezvous.clear()
            self.sync_checkpoints(failed_at)
            for peer in self.peers.values():
                peer.send({"op": "restart", "attempt": attempt})
        self.reset_hang_watch()
        self.start_agent()
        self.record()

    # ---------------------------------------------------------------- --checkpoint-dir
    def failure_time(self) -> float | None:
        """When the leader heard the attempt's first failure (and began stopping the ranks)."""
        ended = [float(e["ended"]) for e in self.ranks.values() if e["state"] in ("failed", "lost") and e.get("ended")]
        return min(ended) if ended else None

    def sync_checkpoints(self, failed_at: float | None) -> None:
        """The leader, before a restarted attempt starts anywhere: each ``--checkpoint-dir`` the
        same on every host (``ckptsync``); its line goes to the failed attempt's history entry."""
        if self.ckpt is None or not self.leader:
            return
        checkpoint = self.config["checkpoint"]
        lines = []
        for folder in checkpoint["folders"]:
            if self.signals:  # dlrun stop: the loop stops the job; no copy is worth waiting for
                line = f"checkpoint {folder}: not made the same (stopped by signal {self.signals[0]})"
                print(f"dlrun-keeper: attempt {self.attempt + 1}: {line}", flush=True)
                lines.append(line)
                continue
            print(f"dlrun-keeper: attempt {self.attempt + 1}: making checkpoint {folder} the same on every host",
                  flush=True)
            try:
                line = self.ckpt.sync_folder(self.ask_hosts, [self.host, *self.followers], str(folder),
                                             dict(checkpoint["addresses"]), str(checkpoint["cert"]),
                                             str(checkpoint["key"]), failed_at)
            except Exception as exc:  # a malformed answer must not end the keeper: the restart goes on
                line = f"checkpoint {folder}: not made the same ({type(exc).__name__}: {exc})"
            print(f"dlrun-keeper: attempt {self.attempt + 1}: {line}", flush=True)
            lines.append(line)
        if self.history:
            self.history[-1]["checkpoint"] = lines
        self.record()

    def ask_hosts(self, requests: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """The leader: every host's ``ckptsync.Worker`` answers its request (this host's in a
        thread, the followers' over their connections); the loop's other events wait. A host
        whose keeper closes, goes silent (--host-timeout) or takes longer than ``CKPT_ANSWER``
        answers an error, and a signal (``dlrun stop``) gives up on every host that has not
        answered: the loop then handles it."""
        assert self.ckpt_worker is not None
        worker = self.ckpt_worker
        pending: dict[int, str] = {}
        answers: dict[str, dict[str, Any]] = {}
        for host, request in requests.items():
            self.ckpt_asked += 1
            ident = self.ckpt_asked
            pending[ident] = host
            if host == self.host:
                def work(request: dict[str, Any] = request, ident: int = ident) -> None:
                    try:
                        answer = worker.handle(request)
                    except Exception as exc:  # the wait below needs an answer, whatever happened
                        answer = {"error": f"{type(exc).__name__}: {exc}"}
                    self.events.put(("peer", self.host, {"op": "ckpt-answer", "id": ident, "answer": answer}))

                threading.Thread(target=work, daemon=True).start()
            elif host in self.peers and not self.peers[host].closed:
                self.peers[host].send({"op": "ckpt", "id": ident, "ask": request})
            else:
                answers[host] = {"error": "its keeper is not connected"}
        held: list[Event] = []
        deadline = time.monotonic() + CKPT_ANSWER
        stopped: str | None = None  # dlrun stop (here, or a follower's interrupt): no answer is worth waiting for
        while len(answers) < len(requests):
            waiting = set(pending.values()) - set(answers)
            if self.signals:
                stopped = f"signal {self.signals[0]}"
            if stopped is not None:
                for host in waiting:
                    answers[host] = {"error": f"stopped by {stopped} while it copied"}
                break
            try:
                event = self.events.get(timeout=0.25)
            except queue.Empty:
                event = ("tick",)
            message = event[2] if event[0] == "peer" else None
            if isinstance(message, dict) and message.get("op") == "ckpt-answer" and message.get("id") in pending:
                host = pending[int(message["id"])]
                if host not in answers:
                    answers[host] = dict(message.get("answer") or {})
                continue
            if event[0] != "tick":
                held.append(event)  # the loop handles it after the copy (a peer-closed loses the host then)
            if isinstance(message, dict) and message.get("op") == "interrupt":
                stopped = f"signal {message.get('signal') or signal.SIGTERM} on {event[1]}"
            if event[0] == "peer-closed" and str(event[1]) in waiting:
                answers[str(event[1])] = {"error": "its keeper's connection closed"}
            now = time.monotonic()
            for host in waiting - set(answers):
                peer = self.peers.get(host)
                if now > deadline:
                    answers[host] = {"error": f"no answer within {CKPT_ANSWER:g} s"}
                elif host == self.host:
                    continue
                elif peer is None or peer.closed or (self.host_timeout is not None
                                                     and now - peer.heard > self.host_timeout):
                    answers[host] = {"error": "its keeper's connection closed or went silent"}
        for event in held:
            self.events.put(event)
        return answers

    def ckpt_answer(self, message: dict[str, Any]) -> None:
        """A follower: the leader's request to this host's ``ckptsync.Worker``, answered from a
        thread (the loop goes on: heartbeats, a stop)."""
        worker = self.ckpt_worker

        def work() -> None:
            try:
                answer = (worker.handle(dict(message.get("ask") or {})) if worker is not None
                          else {"error": "this keeper has no checkpoint folders"})
            except Exception as exc:  # the leader waits for an answer, whatever happened
                answer = {"error": f"{type(exc).__name__}: {exc}"}
            if self.leader_peer is not None:
                self.leader_peer.send({"op": "ckpt-answer", "id": message.get("id"), "answer": answer})

        threading.Thread(target=work, daemon=True).start()

    # ---------------------------------------------------------------- --hang-timeout
    def take_stacks(self, request_id: str) -> None:
        """Have the agent take its ranks' stacks into ``stacks-<id>/`` (the config's message)."""
        if not self.hang.get("stacks") or "/" in request_id or request_id.startswith("."):
            return
        message = json.loads(json.dumps(self.hang["stacks"]))
        message["id"] = request_id
        message.setdefault("request", {})["outdir"] = os.path.join(self.jobdir, "stacks-" + request_id)
        self.tell_agent(message)

    def watch_hang(self, now: float) -> None:
        """The leader: no output on any host and no busy GPU for the limit: take every host's stacks."""
        if self.hang_stop_at is not None and now >= self.hang_stop_at:
            self.hang_stop_at = None
            self.stopping = False  # held only while the dumps were written: now the stop goes out
            self.stop_all()
        limit = float(self.hang.get("timeout") or 0)
        if not limit or self.stopping or self.ended:
            return
        if self.hang_id is not None:
            if now > self.hang_deadline:
                self.hung()
            return
        quiet, idle = now - self.last_output, now - self.last_busy
        for name in self.followers:
            told = self.quiet_of.get(name)
            if told is None:
                return  # not heard from yet: its silence is unknown
            quiet = min(quiet, told[0] + now - told[2])
            idle = min(idle, told[1] + now - told[2])
        if quiet >= limit and idle >= limit:
            self.hang_id = time.strftime("hang-%Y%m%d-%H%M%S")
            self.hang_deadline = now + HANG_ANSWER
            print(f"dlrun-keeper: no output for {quiet:.0f} s and no busy GPU: taking every rank's stack", flush=True)
            self.take_stacks(self.hang_id)
            for peer in self.peers.values():
                peer.send({"op": "stacks", "id": self.hang_id})

    def hang_answer(self, host: str, answer: dict[str, Any]) -> None:
        self.hang_answers[host] = answer
        if set(self.hang_answers) >= {self.host, *self.followers}:
            self.hung()

    def hung(self) -> None:
        """The stacks are in (or overdue): the odd group is the root cause; stop the job."""
        if self.stopping or self.ended:
            return
        groups_of = self.groups()
        stacks = [s for host, answer in sorted(self.hang_answers.items()) for s in groups_of.rank_stacks(host, answer)]
        asked = {s.rank for s in stacks}
        ended = []  # a rank that exited already (exit 0 early: a peer then waits for ever) is the clue
        for rank, entry in sorted(self.ranks.items()):
            if rank not in asked and entry.get("code") is not None:
                took = (f" after {float(entry['ended']) - float(entry['started']):.1f} s"
                        if entry.get("started") and entry.get("ended") else "")
                how = f"it exited {entry['code']}{took}, before the stacks were asked"
                ended.append(groups_of.RankStacks(rank, str(entry["host"]), None, "none", (), error=how))
        stacks += ended
        groups = groups_of.group_ranks(sorted(stacks, key=lambda s: s.rank))
        cause = groups_of.hang_cause(groups) if stacks else "no host sent its ranks' stacks"
        lines = list(groups_of.summary_lines(groups)) + groups_of.ras_lines(sorted(self.hang_answers.items()))
        missing = sorted({self.host, *self.followers} - set(self.hang_answers))
        if missing:
            lines.append(f"no stacks from {', '.join(missing)} within {HANG_ANSWER:g} s")
        lines.append(f"full stacks: ~/.dlrun/jobs/{self.job_id}/host-<host>/stacks-{self.hang_id}/ on each host")
        if self.flight:  # asked for below; each host's come back with its agent's end, after this record
            lines.append(f"flight recorder dumps: ~/.dlrun/jobs/{self.job_id}/host-<host>/attempt-{self.attempt}/"
                         "flight-recorder/ on each host (NCCL ranks)")
        unread = [s.rank for s in stacks if not s.taken and s not in ended]
        if unread:  # faulthandler (PYTHONFAULTHANDLER) prints those ranks' stacks to their logs
            lines.append(f"no stack by py-spy for ranks {unread}: SIGABRT, faulthandler's dump is in their logs")
        if self.root_cause is None:
            self.hang_cause = True  # the view words it as an attached launch's hang (dlrun.run.hang)
            self.root_cause = f"hung (no output for {float(self.hang['timeout']):g} s): {cause}"
            self.root_tail, self.failed_code = lines[-self.policy.TAIL_LINES:], self.policy.HANG_EXIT
        # the dumps first (a SIGTERM would cut them short); what ends meanwhile is stopped, not failed
        self.stopping = True
        if any("TORCH_NCCL_DEBUG_INFO_PIPE_FILE" in (r.get("env") or {}) for r in self.specs[self.attempt]["ranks"]):
            self.record_asked = sorted(r for r, e in self.ranks.items() if e["state"] == "running")
        for target in [None, *self.peers.values()]:
            for message in ({"op": "record", "wait": self.policy.RECORD_WAIT}, {"op": "dump", "ranks": unread}):
                if target is None:
                    self.tell_agent(message)
                else:
                    target.send({"op": "agent", "message": message})
        self.hang_stop_at = time.monotonic() + self.policy.DUMP_WAIT
        self.record()

    # ---------------------------------------------------------------- the network
    def token_ok(self, token: str) -> bool:
        return hmac.compare_digest(token.encode(), str(self.config["token"]).encode())

    def accept(self) -> None:
        listener = self.listener
        assert listener is not None and self.context is not None
        self.door.serve(listener, self.context, self.joined)

    def welcome(self, raw: socket.socket) -> None:
        """One connection at the door (``Door.welcome``): a peer once through."""
        assert self.context is not None
        self.door.welcome(raw, self.context, self.joined)

    def joined(self, sock: ssl.SSLSocket, hello: dict[str, Any], rest: bytes) -> None:
        sock.settimeout(self.host_timeout or None)  # a send to a peer that stopped reading fails
        peer = Peer(sock, str(hello.get("host", "")))
        self.events.put(("joined", peer))
        peer.read_into(self.events, rest)

    def connect_leader(self) -> None:
        address, port = self.config["leader_address"]
        context = client_context(str(self.config["cert_pem"]))
        deadline = time.monotonic() + CONNECT_TIMEOUT
        while True:
            try:
                raw = socket.create_connection((address, int(port)), timeout=HANDSHAKE_TIMEOUT)
                sock = context.wrap_socket(raw)
                sock.sendall(json.dumps({"token": self.config["token"], "host": self.host}).encode() + b"\n")
                line, rest = read_line(sock)  # in only once welcomed (the door may have closed on us: again)
                if json.loads(line).get("op") != "welcome":
                    raise OSError("the leader keeper did not welcome this keeper")
                sock.settimeout(self.host_timeout or None)  # a leader that stops reading is lost, not a hang
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise OSError(f"cannot reach the leader keeper at {address}:{port}: {exc}") from exc
                time.sleep(0.5)
        self.leader_peer = Peer(sock, "leader")
        threading.Thread(target=self.leader_peer.read_into, args=(self.events, rest), daemon=True).start()
        for text in self.notes:  # said before it could reach the leader
            self.leader_peer.send({"op": "note", "text": text})

    def beat(self) -> None:
        interval = min(2.0, (self.host_timeout or 8.0) / 4)
        while not self.ended:
            time.sleep(interval)
            targets = list(self.peers.values()) if self.leader else [p for p in (self.leader_peer,) if p]
            beat: dict[str, Any] = {"op": "beat"}
            if self.hang and not self.leader:  # the leader's hang watch needs every host's silence
                now = time.monotonic()
                beat.update(quiet=now - self.last_output, idle=min(now - self.last_busy, 1e9))
            for peer in targets:
                peer.send(beat)
            # the agent's silence clock (the spec's host_timeout): a frozen keeper's ranks stop too
            self.tell_agent({"op": "ping"})

    def hold_ports(self, ports: list[int]) -> None:
        """Claims this machine's ports that dlrun chose for the ranks (``claim_ports``, a keeper's
        names) for as long as the job lives: dlrun holds its own until the hand-over is done."""
        held = load_module(str(self.config["agent_source"]), "agent").claim_ports(ports, keeper=True)
        if held is None:
            self.note(f"ports {ports[0]}-{ports[-1]} are claimed by another job's keeper as well")
        self.port_claims = held or []  # closed by the kernel as this keeper ends

    # ---------------------------------------------------------------- the loop
    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, _frame: self.signals.append(signum))
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.signal(signal.SIGUSR1, lambda _signum, _frame: setattr(self, "stacks_asked", True))
        self.record()
        if self.leader:
            threading.Thread(target=self.accept, daemon=True).start()
            if self.rendezvous is not None:
                self.rendezvous.start()  # bound before the fork; its thread starts here
            if self.config.get("claim_ports"):
                self.hold_ports(list(self.config["claim_ports"]))
        else:
            try:
                self.connect_leader()
            except OSError as exc:
                self.root_cause, self.exit_code = str(exc), 255
                for rank in self.own:
                    self.ranks[rank].update(state="lost", code=255)
                self.record(final=True)
                return 1
        self.start_agent()
        threading.Thread(target=self.beat, daemon=True).start()
        joined_by = time.monotonic() + CONNECT_TIMEOUT + (self.host_timeout or 0)
        while True:
            while self.signals:
                signum = self.signals.pop(0)
                if self.leader:
                    if self.interrupted_by is None:
                        self.interrupted_by = signum
                    self.stop_all()
                else:
                    if self.leader_peer is not None:
                        self.leader_peer.send({"op": "interrupt", "signal": signum})
                    self.stop_own()
                self.record()
            if self.stacks_asked:
                self.stacks_asked = False
                self.ask_stacks()
            try:
                event = self.events.get(timeout=0.25)
            except queue.Empty:
                event = ("tick",)
            self.handle(event)
            now = time.monotonic()
            if self.kill_at is not None and now > self.kill_at:
                self.tell_agent({"op": "kill"})
                self.kill_at = None
            if self.leader:
                self.watch_followers(now, joined_by)
                self.watch_hang(now)
                if not self.ended:
                    self.decide()
            elif self.leader_peer is not None and not self.ended and self.host_timeout is not None \
                    and now - self.leader_peer.heard > self.host_timeout:
                self.leader_lost(f"silent for {self.host_timeout:g} s")
            if self.ended and self.agent_finished():
                # an agent that has exited may have frames on their way still (the last EXIT, its
                # flight recorder dumps and DONE leave in one write): read them to its channel's end
                self.wait_agent(5.0)
                break
        self.finish()
        return 0

    def handle(self, event: Event) -> None:
        kind = event[0]
        if kind in ("frame", "agent-closed") and event[1] != self.generation:
            return  # an earlier attempt's agent: everything it said was handled before the restart
        if kind == "frame":
            self.on_frame(int(event[2]), int(event[3]), bytes(event[4]))
        elif kind == "agent-closed":
            self.agent_done = True
            self.closed_generation = self.generation
            self.flight_report()
            if self.agent is not None and any(self.ranks[r]["state"] not in self.policy.FINAL_STATES for r in self.own):
                try:  # its guardian writes why once it has killed what the agent left
                    self.agent.wait(5)
                except subprocess.TimeoutExpired:
                    pass
            why = self.agent_words() or "the host's agent ended before its ranks did"
            for rank in self.own:  # ranks the agent never reported: it is gone, so are they
                if not self.reported_exit(rank) and rank in self.logs:
                    self.report(rank, "lost", 255, {"reason": why})
        elif kind == "joined":
            peer = event[1]
            old = self.peers.get(peer.name)
            if old is not None:
                old.close()
            self.peers[peer.name] = peer
            if self.stopping:
                peer.send({"op": "stop"})
            if self.listener is not None and set(self.peers) >= set(self.followers):
                try:  # every follower is in: nobody else needs the door
                    self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread (close alone does not)
                except OSError:
                    pass
                self.listener.close()
                self.listener = None
        elif kind == "peer":
            self.on_message(str(event[1]), event[2])
        elif kind == "peer-closed":
            name = str(event[1])
            if self.leader:
                peer = self.peers.get(name)
                if peer is not None and not self.ended:
                    peer.closed = True
                    if any(r["host"] == name and r["state"] not in self.policy.FINAL_STATES
                           for r in self.ranks.values()):
                        self.lose_host(name, "its keeper's connection closed")
            elif not self.ended:
                self.leader_lost("its connection closed")

    def agent_words(self) -> str:
        """The last line the agent (or its guardian) wrote to ``agent.log``: why it ended."""
        try:
            with open(os.path.join(self.jobdir, "agent.log"), "rb") as fh:
                fh.seek(max(0, os.fstat(fh.fileno()).st_size - 4096))
                lines = fh.read().decode("utf-8", "replace").strip().splitlines()
        except OSError:
            return ""
        return lines[-1][:500] if lines else ""

    def reported_exit(self, rank: int) -> bool:
        return self.ranks[rank]["state"] in self.policy.FINAL_STATES

    def on_message(self, name: str, message: dict[str, Any]) -> None:
        op = message.get("op")
        if self.leader:
            if op == "rank":
                self.on_rank(name, int(message["rank"]), str(message["what"]), message.get("code"), message)
            elif op == "raised":
                self.on_raised(name, int(message["rank"]), message.get("at"), list(message.get("lines") or []))
            elif op == "note":
                self.note(str(message.get("text", ""))[:500])
            elif op == "flight" and int(message.get("attempt", -1)) == self.attempt:
                self.digests.update({int(rank): d for rank, d in (message.get("digests") or {}).items()})
                self.flight_from.add(name)
            elif op == "beat" and "quiet" in message:
                self.quiet_of[name] = (float(message["quiet"]), float(message["idle"]), time.monotonic())
            elif op == "stacks-answer" and self.hang_id is not None:
                answer = message.get("answer") or {}
                if answer.get("id") == self.hang_id:
                    self.hang_answer(name, answer)
            elif op == "interrupt":
                if self.interrupted_by is None:
                    self.interrupted_by = int(message.get("signal") or signal.SIGTERM)
                self.stop_all()
                self.record()
        elif op == "stop":
            self.stop_own()
            self.record()
        elif op == "stacks":  # the leader's hang watch fired
            self.take_stacks(str(message.get("id", "")))
        elif op == "agent" and message.get("message", {}).get("op") in ("record", "dump"):
            self.tell_agent(dict(message["message"]))  # the hang's dumps, before the leader's stop
        elif op == "restart":
            self.restart(int(message["attempt"]))
        elif op == "ckpt":
            self.ckpt_answer(message)
        elif op == "end":
            result = message.get("result") or {}
            self.ended = True
            self.exit_code = result.get("exit_code")
            self.root_cause = result.get("root_cause")
            self.root_tail = result.get("root_tail") or []
            self.hang_cause = bool(result.get("hung"))
            self.flight_lines = list(result.get("flight_recorder") or [])
            self.root = result.get("root") or {}
            self.notes = list(result.get("notes") or [])
            self.history = list(result.get("history") or [])
            self.attempt = int(result.get("attempts") or 1) - 1
            for entry in result.get("ranks") or []:
                self.ranks[int(entry["rank"])] = entry
            self.interrupted_by = signal.SIGTERM if result.get("state") == "stopped" else None
            self.record(final=True)

    def leader_lost(self, why: str) -> None:
        """A follower without its leader stops its ranks and records why."""
        self.root_cause = f"lost the leader keeper ({self.config['leader_host']}): {why}"
        self.leader_gone = True
        self.stop_own()
        self.ended = True
        self.exit_code = 255
        self.wait_agent(self.grace + self.policy.STOP_MARGIN)
        for rank in self.own:
            if self.ranks[rank]["state"] not in self.policy.FINAL_STATES:
                self.ranks[rank].update(state="lost", code=255)
        self.record(final=True)

    def watch_followers(self, now: float, joined_by: float) -> None:
        if self.ended:
            return
        for name in self.followers:
            peer = self.peers.get(name)
            pending = any(r["host"] == name and r["state"] not in self.policy.FINAL_STATES for r in self.ranks.values())
            if not pending:
                continue
            if peer is None:
                if now > joined_by:
                    self.lose_host(name, "its keeper never connected")
            elif self.host_timeout is not None and now - peer.heard > self.host_timeout:
                self.lose_host(name, f"silent for {self.host_timeout:g} s")

    def agent_finished(self) -> bool:
        return self.agent is None or self.agent.poll() is not None or self.agent_done

    def end_agent(self) -> None:
        """An agent that outlived its stop: SIGTERM first (its handler stops and sweeps its
        ranks, which matters without a PID namespace), SIGKILL if that is not enough."""
        if self.agent is None or self.agent.poll() is not None:
            return
        self.agent.terminate()
        try:
            self.agent.wait(self.policy.STOP_MARGIN)
        except subprocess.TimeoutExpired:
            self.agent.kill()
            self.agent.wait()

    def wait_agent(self, seconds: float) -> bool:
        """Handle the agent's frames until it closes (or ``seconds`` pass), holding every other
        event for the loop; whether one held is a follower's interrupt."""
        if self.agent is None:
            return False
        deadline = time.monotonic() + seconds
        closed = self.closed_generation == self.generation
        while not closed and time.monotonic() < deadline:
            try:
                event = self.events.get(timeout=0.25)
            except queue.Empty:
                continue
            closed = event[0] == "agent-closed" and event[1] == self.generation
            if event[0] in ("frame", "agent-closed"):
                self.handle(event)
            else:
                self.held.append(event)
        interrupted = any(e[0] == "peer" and isinstance(e[2], dict) and e[2].get("op") == "interrupt"
                          for e in self.held)
        for event in self.held:
            self.events.put(event)
        self.held = []
        return interrupted

    def finish(self) -> None:
        if self.agent is not None:
            if self.agent.stdin is not None:
                try:
                    self.agent.stdin.close()
                except OSError:
                    pass
            try:
                self.agent.wait(self.grace + self.policy.STOP_MARGIN)
            except subprocess.TimeoutExpired:
                self.end_agent()
        for log in [*self.logs.values(), *self.indexes.values()]:
            try:
                log.close()
            except OSError:
                pass
        time.sleep(0.2)  # the last messages reach the followers before the connections close
        for peer in list(self.peers.values()):
            peer.close()
        if self.leader_peer is not None:
            self.leader_peer.close()
        if self.rendezvous is not None:
            self.rendezvous.stop()
        try:
            os.unlink(os.path.join(self.jobdir, "keeper.pid"))
        except OSError:
            pass


def read_config() -> dict[str, Any]:
    """The JSON line on stdin after the source (read with ``os.read``: nothing is buffered away)."""
    buf = b""
    while not buf.endswith(b"\n"):
        data = os.read(0, 65536)
        if not data:
            break
        buf += data
    config: dict[str, Any] = json.loads(buf)
    return config


def detach(jobdir: str) -> int | None:
    """Double fork and ``setsid``. In the first process: the keeper's pid (it then exits); in
    the keeper: None, with its stdio on ``keeper.log``."""
    read_end, write_end = os.pipe()
    first = os.fork()
    if first:
        os.close(write_end)
        data = b""
        while True:
            chunk = os.read(read_end, 64)
            if not chunk:
                break
            data += chunk
        os.waitpid(first, 0)
        return int(data or b"0")
    os.close(read_end)
    os.setsid()
    if os.fork():
        os._exit(0)
    to_keeper_log(jobdir)
    write_pid(jobdir)
    os.write(write_end, str(os.getpid()).encode())
    os.close(write_end)
    return None


def stay(jobdir: str, answer: dict[str, Any], port: int) -> None:
    """The keeper stays the process it was started as (a Slurm step's task: the step, and so
    the allocation, holds it): the answer goes out now, then its stdio moves to ``keeper.log``."""
    write_pid(jobdir)
    print(json.dumps({"pid": os.getpid(), "port": port, "jobdir": jobdir, **answer}), flush=True)
    to_keeper_log(jobdir)


def write_pid(jobdir: str) -> None:
    """``keeper.pid``: this process and this machine's boot (``dlrun-jobs`` checks both)."""
    with open(os.path.join(jobdir, "keeper.pid"), "w") as fh:
        fh.write(f"{os.getpid()} {boot_id()}")


def to_keeper_log(jobdir: str) -> None:
    """stdin from the null device, stdout and stderr to ``keeper.log``."""
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(os.path.join(jobdir, "keeper.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)


def bindable(address: str) -> str:
    """``address`` if this host holds it (the one the peers use), else every interface (a NAT
    or a forwarded port: the peers' address is not the host's own; the token still guards)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((address, 0))
        return address
    except OSError:
        return "0.0.0.0"


def listen_at(address: str, port: int) -> socket.socket:
    """The leader's door, on the address the followers reach this host at (not every interface)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((bindable(address), port))
    listener.listen(64)
    return listener


def main() -> None:
    config = read_config()
    job_id = str(config["job_id"])
    if not job_id or "/" in job_id or job_id.startswith("."):
        sys.exit(f"dlrun-keeper: bad job id {job_id!r}")
    jobdir = os.path.join(jobs_root(), job_id, host_folder(str(config["host"])))
    try:
        os.makedirs(jobs_root(), mode=0o700, exist_ok=True)
        os.makedirs(jobdir, mode=0o700, exist_ok=True)
        os.chmod(os.path.dirname(jobdir), 0o700)
    except OSError as exc:  # a read-only or full home: say which folder, and why, not a traceback
        why = "the file system is read-only" if exc.errno == errno.EROFS else exc.strerror or str(exc)
        sys.exit(f"dlrun-keeper: cannot make the job's folder {exc.filename or jobdir}: {why} (a detached job keeps"
                 " its logs and state under ~/.dlrun/jobs on each host; run attached, or give the login user a"
                 " writable home)")
    make_reserve(jobdir)
    listener = None
    context = None
    rendezvous = None
    port = 0
    answer: dict[str, Any] = {}
    if config["leader"]:
        context = server_context(str(config["cert_pem"]), str(config["key_pem"]))
        config["key_pem"] = ""
        listener = listen_at(str(config.get("bind") or "0.0.0.0"), int(config.get("port") or 0))
        port = listener.getsockname()[1]
        if config.get("rendezvous"):  # Horovod: the job's gloo rendezvous, for the job's lifetime
            module = load_rendezvous(str(config["rendezvous"]["source"]))
            # the address the ranks use, with the key of the job's token (every request shows it)
            rendezvous = module.RendezvousServer(
                config["rendezvous"]["scopes"], host=bindable(str(config["rendezvous"].get("host") or "0.0.0.0")),
                key=module.rendezvous_key(str(config["token"])))
            try:
                answer["rendezvous_port"] = rendezvous.bind()[1]
            except module.RendezvousServerError as exc:
                sys.exit(f"dlrun-keeper: {exc}")
            config["rendezvous"]["source"] = ""
    if config.get("rendezvous_port"):
        answer.setdefault("rendezvous_port", int(config["rendezvous_port"]))
    if "rendezvous_port" in answer:
        fill_rendezvous_port(config.get("specs") or [config["spec"]], int(answer["rendezvous_port"]))
    pin_working_folders(config.get("specs") or [config["spec"]])
    sys.stdout.flush()
    if config.get("stay"):
        stay(jobdir, answer, port)
        pid = None
    else:
        pid = detach(jobdir)
    if pid is not None:
        if not pid:
            sys.exit(f"dlrun-keeper: the keeper did not start (see {jobdir}/keeper.log)")
        print(json.dumps({"pid": pid, "port": port, "jobdir": jobdir, **answer}), flush=True)
        os._exit(0)
    code = 1
    pin_version()
    try:
        code = Keeper(config, jobdir, listener, context, rendezvous).run()
    except BaseException:
        import traceback

        globals().get("_dlrun_lines", lambda: None)()  # the loader's source, for the lines shown
        traceback.print_exc()
    finally:
        unpin_version()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
