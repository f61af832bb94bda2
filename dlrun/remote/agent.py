"""The host agent: starts one host's ranks, streams their output back, and is their watchdog.

Shipped by ``dlrun.remote``'s loader (over one SSH exec channel, as a local subprocess, or in a
Spark task), so it imports only the standard library and runs on Python >= 3.8. Its protocol
(JSON messages in, binary frames out), the watchdog, the PID namespace and the GPU sampler
are described in ``docs/architecture.md``.

Exit codes of ranks: killed by signal N reports 128 + N, as shells do; a command that cannot
be started reports 127 (not found) or 126 (not executable) with an ERROR frame naming it.
"""

from __future__ import annotations

import json
import os
import select
import selectors
import signal
import struct
import subprocess
import sys
import time

TYPE_CHECKING = False  # typing costs milliseconds on every host: annotations only
if TYPE_CHECKING:
    import socket
    from typing import IO, Any, Sequence

HEADER = struct.Struct(">BiI")
HELLO, STARTED, STDOUT, STDERR, EXIT, ERROR, DONE, PROBE, SURVEY, PONG, GPU, PORTS, STACKS, FILE = range(1, 15)
FILE_LIMIT = 16 << 20  # bytes of flight recorder dumps one host sends back
CHUNK = 65536
COALESCE_S = 0.005  # output frames wait at most this long for more output
SMALL_READ = 4096  # a read this small means a trickle: let it pile up for a moment
AGENT_RANK = -1


def frame(kind: int, rank: int, payload: bytes) -> bytes:
    return HEADER.pack(kind, rank, len(payload)) + payload



def read_child(proc: subprocess.Popen[bytes], sel: selectors.BaseSelector) -> bytes:
    """What a helper process (nvidia-smi, py-spy) wrote since the last look (b"" for none yet);
    at its end, its stdout leaves the selector and is closed."""
    assert proc.stdout is not None
    try:
        data = os.read(proc.stdout.fileno(), CHUNK)
    except BlockingIOError:
        return b""
    except OSError:
        data = b""
    if not data:
        sel.unregister(proc.stdout)
        proc.stdout.close()
    return data

class FrameDecoder:
    """Incremental decoder of the agent's output (used by the controller)."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, int, bytes]]:
        self._buf += data
        frames = []
        view = self._buf
        pos = 0
        size = HEADER.size
        while len(view) - pos >= size:
            kind, rank, length = HEADER.unpack_from(view, pos)
            if len(view) - pos - size < length:
                break
            start = pos + size
            frames.append((kind, rank, bytes(view[start : start + length])))
            pos = start + length
        del self._buf[:pos]
        return frames

    @property
    def pending(self) -> int:
        return len(self._buf)


# ----------------------------------------------------------------------------- GPU sampling

#: What one sample asks nvidia-smi, in this order (``nounits``: %, MiB, MiB, W, °C).
GPU_QUERY = "index,uuid,utilization.gpu,memory.used,memory.total,power.draw,temperature.gpu"
GPU_TIMEOUT = 5.0  # a sample that takes longer is killed and reported
GPU_GIVE_UP = 3  # consecutive failures after which a host stops sampling


def port_free(port: int) -> bool:
    import socket

    for family, address in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 here
            continue
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((address, port))
        except OSError as exc:
            if family == socket.AF_INET6 and exc.errno in (97, 99):  # IPv6 off: not a busy port
                continue
            return False
        finally:
            sock.close()
    return True


def claim_ports(ports: Sequence[int], keeper: bool = False) -> list[socket.socket] | None:
    """Claims ``ports`` for this launch, machine-wide and for every user, until the sockets
    returned close (the kernel closes them when the process ends): an abstract Unix socket
    ``dlrun-port-N`` each, so that two launches that found the same free ports before their
    ranks bound them do not both take them. None: another launch holds one of them. A detached
    job's leader keeper (``keeper``) claims them under ``dlrun-keeper-port-N`` while the launch
    still holds its own, which a launch also tries: the hand-over leaves no gap. Where abstract
    sockets do not exist (not Linux), nothing is claimed: the free check alone."""
    import errno
    import socket

    names = ("dlrun-keeper-port",) if keeper else ("dlrun-port", "dlrun-keeper-port")
    held: list[socket.socket] = []
    for port in ports:
        for name in names:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.bind(f"\0{name}-{port}")
            except OSError as exc:
                sock.close()
                for other in held:
                    other.close()
                return None if exc.errno == errno.EADDRINUSE else []
            if name == names[0]:
                held.append(sock)
            else:
                sock.close()  # only tried: no keeper holds it
    return held


def which(name: str) -> str | None:
    """``shutil.which`` for a bare name (nvidia-smi is found on PATH, as the probe finds it).
    The probe has the same function: each host program is shipped alone and imports no other."""
    for folder in os.environ.get("PATH", os.defpath).split(os.pathsep):
        path = os.path.join(folder or ".", name)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


class GpuSampler:
    """Runs ``nvidia-smi --query-gpu`` every ``every`` seconds without blocking the agent.

    The child's output is read through the agent's selector; a sample that outlives
    ``GPU_TIMEOUT`` is killed. Each finished sample becomes one GPU frame: ``{"time", "csv"}``,
    or ``{"time", "error"}``. A host without nvidia-smi samples nothing and says nothing.
    """

    def __init__(self, every: float) -> None:
        self.every = every
        self.path = which("nvidia-smi") if every > 0 else None
        self.next_at = time.monotonic()
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0.0
        self.wall = 0.0
        self.output = bytearray()
        self.failures = 0
        self.result: dict[str, Any] | None = None  # a sample that failed to start, to report

    @property
    def active(self) -> bool:
        return self.path is not None and self.failures < GPU_GIVE_UP

    def due(self, now: float) -> bool:
        return self.active and self.proc is None and now >= self.next_at

    def start(self, sel: selectors.BaseSelector, now: float) -> None:
        assert self.path is not None
        self.next_at = now + self.every
        self.output.clear()
        env = dict(os.environ)
        env["LC_ALL"] = "C"
        try:
            self.proc = subprocess.Popen([self.path, "--query-gpu=" + GPU_QUERY, "--format=csv,noheader,nounits"],
                                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, env=env)
        except OSError as exc:
            self.proc = None
            self.failures += 1
            self.result = {"time": time.time(), "error": f"cannot run nvidia-smi: {exc}"}
            return
        self.started, self.wall = now, time.time()
        assert self.proc.stdout is not None
        os.set_blocking(self.proc.stdout.fileno(), False)
        sel.register(self.proc.stdout, selectors.EVENT_READ, "gpu")

    def read(self, sel: selectors.BaseSelector) -> None:
        assert self.proc is not None
        self.output += read_child(self.proc, sel)[: max(0, (1 << 20) - len(self.output))]

    def finish(self, sel: selectors.BaseSelector, now: float) -> dict[str, Any] | None:
        """A finished (or overdue) sample's frame payload; None while it runs."""
        if self.result is not None:
            result, self.result = self.result, None
            return result
        proc = self.proc
        if proc is None:
            return None
        overdue = now - self.started > GPU_TIMEOUT
        if not overdue and (proc.poll() is None or (proc.stdout is not None and not proc.stdout.closed)):
            return None
        if overdue:
            proc.kill()
            proc.wait()
        if proc.stdout is not None and not proc.stdout.closed:
            sel.unregister(proc.stdout)
            proc.stdout.close()
        self.proc = None
        text = self.output.decode("utf-8", "replace")
        if overdue:
            self.failures += 1
            return {"time": self.wall, "error": f"nvidia-smi did not answer within {GPU_TIMEOUT:g} s"}
        if proc.returncode != 0:
            self.failures += 1
            last = text.strip().splitlines()[-1:] or [""]
            return {"time": self.wall, "error": f"nvidia-smi exited {proc.returncode}: {last[0]}"}
        self.failures = 0
        return {"time": self.wall, "csv": text}

    def stop(self, sel: selectors.BaseSelector) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            if self.proc.stdout is not None and not self.proc.stdout.closed:
                sel.unregister(self.proc.stdout)
                self.proc.stdout.close()
            self.proc = None
        self.path = None


# ----------------------------------------------------------------------------- stacks

PR_SET_PTRACER = 0x59616D61  # Yama: name the process (and its descendants) that may ptrace us
STACKS_TIMEOUT = 120.0  # seconds a stack request may take before it is killed and answered


def ras_address() -> str | None:
    """A loopback address for NCCL's RAS socket (``NCCL_RAS_ADDR``) that no one listens on now:
    one per job on a host, so that ``dlrun stack`` asks this job's ranks and no other's (NCCL's
    default, ``localhost:28028``, is shared by every job of a user through ``SO_REUSEPORT``)."""
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", 0))
            return f"127.0.0.1:{probe.getsockname()[1]}"
    except OSError:
        return None


def ptrace_restricted(scope: str = "/proc/sys/kernel/yama/ptrace_scope") -> bool:
    """Does Yama hold ptrace to a process's descendants here (``kernel.yama.ptrace_scope`` 1)?
    Only then does a rank need to name its tracer: without Yama, or at scope 0, the agent's
    py-spy may read the rank anyway, and at 2 or 3 naming helps nothing. What cannot be read
    counts as restricted."""
    try:
        with open(scope, "rb") as fh:
            return fh.read().strip() not in (b"0", b"2", b"3")
    except FileNotFoundError:
        return False
    except OSError:
        return True


def ptracer_hook(tracer: int) -> Any:
    """A ``preexec_fn`` that names ``tracer`` (the agent) as the rank's tracer, so that under
    Yama's ``ptrace_scope=1`` the py-spy the agent starts may read the rank's stack. libc is
    loaded here, before the fork; a failure (no Yama, no prctl) changes nothing."""
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def hook() -> None:
        prctl(PR_SET_PTRACER, tracer, 0, 0, 0)

    return hook


class StackTaker:
    """Runs ``dlrun.remote.stacks`` as the agent's child (``{"op": "stacks"}``), reads its
    answer through the agent's selector and hands it over as one STACKS frame."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.request_id = ""
        self.output = bytearray()
        self.started = 0.0
        self.queued: list[dict[str, Any]] = []

    def start(self, sel: selectors.BaseSelector, message: dict[str, Any],
              pids: dict[int, int], ras: str | None = None) -> dict[str, Any] | None:
        """Start one request (or queue it behind the running one); an answer if it cannot start."""
        if self.proc is not None:
            self.queued.append(message)
            return None
        self.request_id = str(message.get("id", ""))
        request = dict(message.get("request") or {})
        request["op"] = "take"
        request["pids"] = {str(rank): pid for rank, pid in pids.items()}
        if ras:
            request["ras"] = ras
        source = str(message.get("source", "")).encode("utf-8")
        self.output.clear()
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", str(message.get("loader", "")), "dlrun-stacks"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            assert self.proc.stdin is not None and self.proc.stdout is not None
            self.proc.stdin.write(b"%010d" % len(source) + source + json.dumps(request).encode() + b"\n")
            self.proc.stdin.close()
        except OSError as exc:
            self.proc = None
            return {"id": self.request_id, "error": f"cannot take stacks: {exc}"}
        self.started = time.monotonic()
        os.set_blocking(self.proc.stdout.fileno(), False)
        sel.register(self.proc.stdout, selectors.EVENT_READ, "stacks")
        return None

    def read(self, sel: selectors.BaseSelector) -> None:
        assert self.proc is not None
        self.output += read_child(self.proc, sel)

    def finish(self, sel: selectors.BaseSelector, now: float) -> dict[str, Any] | None:
        """The finished (or overdue) request's answer; None while it runs."""
        proc = self.proc
        if proc is None or proc.stdout is None:
            return None
        overdue = now - self.started > STACKS_TIMEOUT
        if not proc.stdout.closed and not overdue:
            return None
        if not proc.stdout.closed:
            sel.unregister(proc.stdout)
            proc.stdout.close()
        if proc.poll() is None:
            proc.kill()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        self.proc = None
        text = self.output.decode("utf-8", "replace").strip()
        try:
            answer: dict[str, Any] = json.loads(text.splitlines()[-1])
        except (ValueError, IndexError):
            answer = {"error": f"the stack taker failed: {text[-500:] or 'no output'}"}
        answer["id"] = self.request_id
        return answer


# ----------------------------------------------------------------------------- agent side


VERSIONS = ".dlrun-versions"  # as dlrun.remote.push_helper names it
COLLECTING = ".collecting"  # <version>.collecting: a push removes that version now (as push_helper names it)


def pin_tree(folder: str) -> tuple[str, int] | None:
    """Mark the pushed code tree holding ``folder`` as used: ``<version>.pin-<token>``, locked
    (flock, shared) for as long as this process lives. A push's collection
    (``push_helper.pinned``) leaves a version with a locked mark alone, and removes a mark whose
    lock is free; it works where the push cannot see this host's processes (a folder shared over
    NFS), and a killed process's lock goes with it. Also ``dlrun.remote.keeper.pin_tree``."""
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


def resolve_pinned(given: str) -> tuple[str, tuple[str, int] | None]:
    """``given`` resolved (``~``, the project link) and its pushed tree pinned (``pin_tree``). A
    push's collection marks a tree (``<tree>.collecting``) before it looks for pins one last
    time (``push_helper.collect_versions``): a tree so marked, or gone, once pinned is being
    collected, and the link names a newer one, resolved again."""
    for _ in range(5):
        folder = os.path.realpath(os.path.expanduser(given))
        pin = pin_tree(folder)
        tree = pin[0].rpartition(".pin-")[0] if pin else ""  # the version holding folder
        if pin is None or (os.path.isdir(folder) and not os.path.lexists(tree + COLLECTING)):
            return folder, pin
        try:
            os.unlink(pin[0])
        except OSError:
            pass
        os.close(pin[1])
    return folder, None


class Agent:
    def __init__(self, out: IO[bytes], in_namespace: bool, stdin_fd: int | None = None) -> None:
        self.out_fd = out.fileno()
        os.set_blocking(self.out_fd, False)  # a full pipe must not stop the silence check
        self.stdin_fd = stdin_fd
        self.control = bytearray()  # what the controller sent, not yet handled
        self.stdin_closed = False
        self.heard = time.monotonic()  # when the controller last sent anything
        self.silence_limit: float | None = None  # the spec's (or a watch's) host_timeout
        self.in_namespace = in_namespace
        # without a PID namespace: orphans of the job are re-parented to us (become_subreaper),
        # so the sweep finds even one that left its session and dropped its environment
        self.subreaper = False
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.open_streams: dict[int, int] = {}  # rank -> number of open pipes
        self.exited: dict[int, int] = {}
        self.error_files: dict[int, str] = {}  # rank -> its TORCHELASTIC_ERROR_FILE
        self.signalled: set[int] = set()  # ranks the agent signalled to stop while they ran
        self.recorders: dict[int, str] = {}  # rank -> its flight recorder dump prefix (TORCH_FR_DUMP_TEMP_FILE)
        self.pipes: dict[int, str] = {}  # rank -> its TORCH_NCCL_DEBUG_INFO_PIPE_FILE stem
        self.recording: dict[int, list[float]] = {}  # rank asked for a dump -> [its size, when last changed]
        self.record_until = 0.0  # a stop waits for the asked dumps until then at most
        self.held_grace: float | None = None  # a stop's grace, held while the asked dumps are written
        self.ras: dict[int, str] = {}  # rank -> its NCCL_RAS_ADDR (torch jobs)
        self.gpus = GpuSampler(0)
        self.stacks = StackTaker()
        self.kill_at: float | None = None
        self.job_id = ""
        self.tag = ""
        self.out_broken = False
        self.sel = selectors.DefaultSelector()
        self.pending = bytearray()
        self.urgent = False  # a lifecycle frame is pending: flush without waiting
        self.held_since: float | None = None  # when the oldest unflushed output arrived

    # output -------------------------------------------------------------------------
    def emit(self, kind: int, rank: int, payload: bytes) -> None:
        self.pending += frame(kind, rank, payload)
        if kind != STDOUT and kind != STDERR:
            self.urgent = True
        elif self.held_since is None:
            self.held_since = time.monotonic()

    def flush_due(self, now: float) -> float | None:
        """Flush if it is time; else how long the pending output may still wait (None: nothing pending)."""
        if not self.pending:
            return None
        if self.urgent or len(self.pending) >= CHUNK or self.held_since is None:
            self.flush()
            return None
        wait = self.held_since + COALESCE_S - now
        if wait <= 0:
            self.flush()
            return None
        return wait

    def flush(self) -> None:
        self.urgent = False
        self.held_since = None
        if self.out_broken:
            self.pending.clear()
            return
        data = bytes(self.pending)
        self.pending.clear()
        while data:
            try:
                written = os.write(self.out_fd, data)
            except BlockingIOError:
                if not self.wait_writable():
                    self.out_broken = True  # the controller went silent: nobody reads us
                    return
                continue
            except OSError:
                self.out_broken = True
                return
            data = data[written:]

    def wait_writable(self) -> bool:
        """Wait until stdout takes more, reading the controller meanwhile; False if it fell silent."""
        while not self.controller_silent(time.monotonic()):
            readers = [] if self.stdin_closed or self.stdin_fd is None else [self.stdin_fd]
            try:
                readable, writable, _ = select.select(readers, [self.out_fd], [], 0.2)
            except InterruptedError:
                continue
            if readable:
                self.read_control()
            if writable:
                return True
        return False

    # controller ---------------------------------------------------------------------
    def read_control(self) -> None:
        """Read what the controller sent (non-blocking) into ``control``; note EOF and when heard."""
        if self.stdin_closed or self.stdin_fd is None:
            return
        while True:
            try:
                data = os.read(self.stdin_fd, CHUNK)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self.stdin_closed = True
                return
            self.heard = time.monotonic()
            self.control += data

    def watch(self, message: dict[str, Any]) -> None:
        """Arm (or, with 0, disarm) the silence clock with the message's ``host_timeout``."""
        self.silence_limit = float(message.get("host_timeout") or 0) or None
        self.heard = time.monotonic()

    def controller_silent(self, now: float) -> bool:
        return self.silence_limit is not None and now - self.heard > self.silence_limit

    # ranks --------------------------------------------------------------------------
    def sample_gpus(self, now: float) -> None:
        """Start a GPU sample when one is due; send the one that finished."""
        result = self.gpus.finish(self.sel, now)
        if result is not None:
            self.emit(GPU, AGENT_RANK, json.dumps(result).encode())
        if self.gpus.due(now):
            self.gpus.start(self.sel, now)

    def dump(self, message: dict[str, Any]) -> None:
        """SIGABRT to the named ranks' processes: with faulthandler on, each prints every thread's
        stack to its stderr (its log) and ends."""
        for rank in message.get("ranks") or []:
            proc = self.procs.get(int(rank))
            if proc is not None and int(rank) not in self.exited:
                try:
                    os.kill(proc.pid, signal.SIGABRT)
                except OSError:
                    pass

    def record(self, wait: float) -> None:
        """Ask every rank's flight recorder for a dump: one byte to ``<pipe stem><rank>.pipe``
        (``TORCH_NCCL_DEBUG_INFO_PIPE_FILE``; NCCL process groups make the pipe). A pipe nobody
        reads, or none, is skipped. A stop in the next ``wait`` seconds waits for the dumps."""
        for rank, proc in self.procs.items():
            stem = self.pipes.get(rank)
            if not stem or rank in self.exited or proc.returncode is not None:
                continue
            try:
                fd = os.open(f"{stem}{rank}.pipe", os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
            except OSError:
                continue
            try:
                if (os.fstat(fd).st_mode & 0o170000) != 0o010000:  # a FIFO, as torch makes: no file
                    continue
                os.write(fd, b"1")
                if rank in self.recorders:
                    self.recording[rank] = [-1.0, time.monotonic()]
            except OSError:
                pass
            finally:
                os.close(fd)
        self.record_until = time.monotonic() + wait

    def dumps_written(self, now: float) -> bool:
        """Whether every asked dump is written (there, not empty, its size the same for 0.2 s), its
        rank ended, or the wait ran out. torch writes a dump from a thread of its own: a SIGTERM
        before it is done loses it."""
        for rank, seen in list(self.recording.items()):
            try:
                size = float(os.path.getsize(self.recorders[rank] + str(rank)))
            except OSError:
                size = -1.0
            if rank in self.exited or self.procs[rank].returncode is not None or (
                    size > 0 and size == seen[0] and now - seen[1] >= 0.2):
                del self.recording[rank]
            elif size != seen[0]:
                seen[0], seen[1] = size, now
        return not self.recording or now >= self.record_until

    def take_stacks(self, message: dict[str, Any]) -> None:
        """Start a stack request for the ranks still running (``StackTaker``)."""
        pids = {rank: proc.pid for rank, proc in self.procs.items() if rank not in self.exited}
        ras = self.ras.get(0)  # one host asks NCCL's RAS: its answer covers every rank of the job
        answer = self.stacks.start(self.sel, message, pids, ras if ras and 0 in pids else None)
        if answer is not None:
            self.emit(STACKS, AGENT_RANK, json.dumps(answer).encode())

    def stacks_done(self, now: float) -> None:
        answer = self.stacks.finish(self.sel, now)
        if answer is not None:
            self.emit(STACKS, AGENT_RANK, json.dumps(answer).encode())
            if self.stacks.queued:
                self.take_stacks(self.stacks.queued.pop(0))

    def start(self, spec: dict[str, Any]) -> None:
        resolved: dict[str, str] = {}  # each rank folder as given -> the pushed tree it runs in, pinned
        self.pins: list[tuple[str, int]] = []  # held until the agent ends
        for given in sorted({str(r["cwd"]) for r in spec["ranks"] if r.get("cwd")}):
            resolved[given], pin = resolve_pinned(given)
            if pin:
                self.pins.append(pin)
        self.job_id = str(spec.get("job_id", ""))
        self.gpus = GpuSampler(float(spec.get("gpu_every", 0) or 0))
        self.tag = str(spec.get("tag") or self.job_id)
        # only where Yama restricts: the hook costs ctypes, and a fork where Popen could vfork
        ptracer = ptracer_hook(os.getpid()) if ptrace_restricted() else None
        folders: dict[str, str | None] = {}  # /tmp/dlrun-<job> -> the private folder its rank files go to
        for item in spec["ranks"]:
            rank = int(item["rank"])
            env = dict(os.environ)
            env.update({str(k): str(v) for k, v in item.get("env", {}).items()})
            env["DLRUN_JOB_ID"] = self.job_id
            env["DLRUN_AGENT_TAG"] = self.tag
            private_rank_files(env, folders)
            argv = [str(a) for a in item["argv"]]
            # the folder as resolved above: the pushed code tree pinned there, whatever a push swaps in later
            cwd = resolved[str(item["cwd"])] if item.get("cwd") else None
            recorder = env.get("TORCH_FR_DUMP_TEMP_FILE")  # torch's flight recorder dumps there: a folder
            if env.get("TORCH_NCCL_DEBUG_INFO_PIPE_FILE"):  # a torch job: NCCL's RAS for dlrun stack
                self.pipes[rank] = env["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"]
                if "NCCL_RAS_ADDR" not in env:
                    ras = next(iter(self.ras.values()), None) or ras_address()
                    if ras:
                        env["NCCL_RAS_ADDR"] = ras
                if env.get("NCCL_RAS_ADDR"):
                    self.ras[rank] = env["NCCL_RAS_ADDR"]
            if recorder:
                self.recorders[rank] = recorder
                try:
                    os.makedirs(os.path.dirname(recorder), mode=0o700, exist_ok=True)
                except OSError:
                    pass
            error_file = env.get("TORCHELASTIC_ERROR_FILE")
            if error_file:
                self.error_files[rank] = error_file
                prepare_error_file(error_file)
            try:
                proc = subprocess.Popen(
                    argv,
                    env=env,
                    cwd=cwd,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                    preexec_fn=ptracer,
                )
            except FileNotFoundError as exc:
                missing = cwd if cwd and not os.path.isdir(cwd) else argv[0]
                what = "working directory" if missing == cwd else "command"
                self.emit(ERROR, rank, f"{what} not found: {missing} ({exc.strerror})".encode())
                self.emit(EXIT, rank, json.dumps({"code": 127}).encode())
                self.exited[rank] = 127
                continue
            except OSError as exc:
                self.emit(ERROR, rank, f"cannot start {argv[0]}: {exc}".encode())
                self.emit(EXIT, rank, json.dumps({"code": 126}).encode())
                self.exited[rank] = 126
                continue
            self.procs[rank] = proc
            self.open_streams[rank] = 2
            assert proc.stdout is not None and proc.stderr is not None
            for stream, kind in ((proc.stdout, STDOUT), (proc.stderr, STDERR)):
                os.set_blocking(stream.fileno(), False)
                self.sel.register(stream, selectors.EVENT_READ, (rank, kind))
            self.emit(STARTED, rank, json.dumps({"pid": proc.pid}).encode())
        self.flush()

    def signal_all(self, sig: int) -> None:
        for rank, proc in self.procs.items():
            if rank not in self.exited:
                if proc.returncode is None and proc.poll() is None:  # an exit not yet reaped is its own
                    self.signalled.add(rank)  # its EXIT says so: a rank that exits 0 on SIGTERM (Lightning) was stopped
                try:
                    os.killpg(proc.pid, sig)
                except OSError:
                    pass

    def stop(self, grace: float, hold: bool = False) -> None:
        """SIGTERM to every rank, SIGKILL after ``grace``; with ``hold``, once the flight recorder
        dumps asked for are written (``dumps_written``)."""
        if hold and not self.dumps_written(time.monotonic()):
            self.held_grace = grace if self.held_grace is None else min(self.held_grace, grace)
            return
        self.held_grace = None
        self.signal_all(signal.SIGTERM)
        deadline = time.monotonic() + max(grace, 0.0)
        self.kill_at = deadline if self.kill_at is None else min(self.kill_at, deadline)

    def read_ready(self, timeout: float) -> int:
        """Wait up to ``timeout`` for output or a wake-up; the number of output bytes read."""
        total = 0
        for key, _ in self.sel.select(timeout):
            if key.data == "control":
                continue
            if key.data == "gpu":
                self.gpus.read(self.sel)
                continue
            if key.data == "stacks":
                self.stacks.read(self.sel)
                continue
            if key.data == "wake":  # SIGCHLD: the caller reaps next
                try:
                    os.read(key.fd, 4096)
                except OSError:
                    pass
                continue
            rank, kind = key.data
            total += self.drain(key.fileobj, rank, kind)  # type: ignore[arg-type]
        return total

    def drain(self, stream: IO[bytes], rank: int, kind: int) -> int:
        try:
            data = os.read(stream.fileno(), CHUNK)
        except BlockingIOError:
            return 0
        except OSError:
            data = b""
        if data:
            self.emit(kind, rank, data)
        else:
            self.sel.unregister(stream)
            stream.close()
            self.open_streams[rank] -= 1
        return len(data)

    def probe(self, message: dict[str, Any]) -> None:
        """Run a probe program here (``dlrun/remote/probe.py``) and send what it printed."""
        import io

        captured = io.StringIO()
        source = str(message.get("source", ""))
        namespace = {"__name__": "__dlrun_probe__", "__dlrun_source__": source}  # its cache's key
        saved, sys.stdout = sys.stdout, captured
        try:
            exec(compiled(source, "<dlrun-probe>"), namespace)
        except BaseException as exc:  # the controller must get an answer, whatever the probe did
            captured.write(f"\nprobe failed in the agent: {type(exc).__name__}: {exc}\n")
        finally:
            sys.stdout = saved
        self.emit(PROBE, AGENT_RANK, captured.getvalue().encode("utf-8", "replace"))

    def ports(self, message: dict[str, Any]) -> None:
        """Which of the asked ports a rank could listen on (as torch's store and TF's servers do,
        with SO_REUSEADDR: a port held by a listener is busy, one in TIME_WAIT is not)."""
        free = [port for port in message.get("ports", []) if port_free(int(port))]
        self.emit(PORTS, AGENT_RANK, json.dumps({"free": free}).encode())

    def survey(self, message: dict[str, Any]) -> None:
        """Answer a push survey with the push helper's own code; an error is answered too."""
        namespace: dict[str, Any] = {"__name__": "__dlrun_push_survey__"}
        try:
            exec(compiled(str(message.get("source", "")), "<dlrun-push_helper>"), namespace)
            replies = [namespace["survey"](spec)[0] for spec in message["request"]["targets"]]
            answer: dict[str, Any] = {"targets": replies}
        except Exception as exc:  # the controller then runs the helper, which reports properly
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        self.emit(SURVEY, AGENT_RANK, json.dumps(answer).encode())

    def reap_orphans(self) -> None:
        """As PID 1, reap every exited child: orphans, and ranks (their status kept for ``reap``).

        A rank reaped here must keep its exit status: ``Popen.poll`` of an already reaped child
        would report 0 (subprocess's answer to ECHILD), which once turned a killed rank into
        "succeeded".
        """
        if not (self.in_namespace or self.subreaper):
            return
        children = [*self.procs.values(), *(p for p in (self.gpus.proc, self.stacks.proc) if p is not None)]
        ranks = {proc.pid: proc for proc in children if proc.returncode is None}
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            proc = ranks.get(pid)
            if proc is not None:
                proc.returncode = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)

    def reap(self) -> None:
        self.reap_orphans()
        for rank, proc in self.procs.items():
            if rank in self.exited:
                continue
            code = proc.poll()
            if code is None:
                continue
            # collect what the rank wrote before it exited (a grandchild may keep the pipe open)
            for stream, kind in ((proc.stdout, STDOUT), (proc.stderr, STDERR)):
                if stream is not None and not stream.closed:
                    for _ in range(64):
                        before = self.open_streams[rank]
                        self.drain(stream, rank, kind)
                        if stream.closed or self.open_streams[rank] != before:
                            break
                        if not self._readable(stream):
                            break
            code = 128 - code if code < 0 else code
            self.exited[rank] = code
            try:  # whatever the rank left in its group goes with it
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            for stream in (proc.stdout, proc.stderr):
                if stream is not None and not stream.closed:
                    self.sel.unregister(stream)
                    stream.close()
            exit_info: dict[str, Any] = {"code": code}
            if rank in self.signalled:
                exit_info["stopped"] = True
            if code != 0 and rank in self.error_files:
                recorded = read_error_file(self.error_files[rank])
                if recorded is not None:
                    exit_info["error_file"] = recorded
            self.emit(EXIT, rank, json.dumps(exit_info).encode())

    @staticmethod
    def _readable(stream: IO[bytes]) -> bool:
        sel = selectors.DefaultSelector()
        sel.register(stream, selectors.EVENT_READ)
        ready = bool(sel.select(0))
        sel.close()
        return ready

    def sweep(self) -> None:
        """Kill every process of this user tagged by this agent (catches setsid escapes), and
        as a subreaper every process left among our children (orphans re-parented to us).

        The tag is job id + host name: several inventory hosts may be one machine (aliases,
        loopback test hosts), and one agent must never kill another agent's ranks.
        """
        if not self.job_id or self.in_namespace:
            return
        tag = ("DLRUN_AGENT_TAG=" + self.tag).encode()
        me = os.getpid()
        uid = os.getuid()
        for _ in range(3):
            found = False
            for entry in os.listdir("/proc"):
                if not entry.isdigit() or int(entry) == me:
                    continue
                try:
                    if os.stat("/proc/" + entry).st_uid != uid:
                        continue
                    with open("/proc/" + entry + "/environ", "rb") as fh:
                        environ = fh.read().split(b"\0")
                    with open("/proc/" + entry + "/stat", "rb") as fh:
                        ppid = int(fh.read().rpartition(b")")[2].split()[1])
                except (OSError, ValueError, IndexError):
                    continue
                if tag in environ or (self.subreaper and ppid == me):
                    found = True
                    try:
                        os.kill(int(entry), signal.SIGKILL)
                    except OSError:
                        pass
            if not found:
                return
            time.sleep(0.05)

    def done(self) -> int:
        """Every rank has exited: sweep what they left, tidy up, say DONE; the exit status."""
        self.sweep()
        self.send_recordings()
        self.remove_error_files()
        self.emit(DONE, AGENT_RANK, b"")
        self.flush()
        return 0

    def send_recordings(self) -> None:
        """The flight recorder dumps this host's ranks left (``<prefix><rank>``, written by torch on
        a timeout or on demand): each as a FILE frame (name, NUL, bytes), then removed. One past
        what is left of ``FILE_LIMIT`` stays, and its frame says where (NUL, then JSON: name, path,
        size, limit). Only its own ranks': hosts of one machine share the folder."""
        budget = FILE_LIMIT
        for rank, prefix in sorted(self.recorders.items()):
            path = prefix + str(rank)
            try:
                if not os.path.isfile(path):
                    continue
                size = os.path.getsize(path)
                if size > budget:
                    left = {"name": os.path.basename(path), "path": os.path.abspath(path), "size": size,
                            "limit": FILE_LIMIT}
                    self.emit(FILE, AGENT_RANK, b"\0" + json.dumps(left).encode("utf-8"))
                    continue
                with open(path, "rb") as fh:
                    data = fh.read(budget)
                os.unlink(path)
            except OSError:
                continue
            budget -= len(data)
            self.emit(FILE, AGENT_RANK, os.path.basename(path).encode("utf-8", "replace") + b"\0" + data)

    def remove_error_files(self) -> None:
        """Take the ranks' error files and their folders away (read already, at each exit), and
        the flight recorder's pipes; its folder goes too where it holds no dump."""
        for rank, stem in self.pipes.items():
            try:
                os.unlink(f"{stem}{rank}.pipe")
            except OSError:
                pass
        for prefix in set(self.recorders.values()):
            try:
                os.removedirs(os.path.dirname(prefix))  # once no host of this machine has a file there
            except OSError:
                pass
        for path in self.error_files.values():
            try:
                os.unlink(path)
            except OSError:
                pass
            try:
                os.removedirs(os.path.dirname(path))  # up to the first folder that is not empty
            except OSError:
                pass

    def all_exited(self) -> bool:
        return all(rank in self.exited for rank in self.procs)


#: Starts ``"$@"`` (the agent's argv) as PID 1 of a new PID namespace with its own ``/proc``
#: when this login user may create one, else plainly. The test run checks, with shell builtins
#: only, that ``/proc/self`` in there is the process itself (PID 1): the CUDA driver reads its
#: own process through ``/proc`` and fails (error 304) under a namespace that shows the host's.
#: ``--propagation slave`` lets mounts the host makes later (an automounted NFS) reach the ranks.
#: A login user who does not own ``/`` (not root) tries the user namespace first: a PID namespace
#: alone needs CAP_SYS_ADMIN, and each refused try costs a process. Only root may fall back to
#: ``--map-root-user`` (util-linux before 2.38 has no ``--map-current-user``: Ubuntu 22.04, RHEL
#: 8 and 9): another user's ranks would run as uid 0 in there (``getpwuid`` says ``/root``, ssh
#: reads ``/root/.ssh``, ``mpirun`` refuses root), so they run plainly, with the sweep.
PIDNS_WRAPPER = """\
if [ -z "${DLRUN_NO_PIDNS:-}" ]; then
  a="--pid" b="--user --map-current-user --pid" c="--user --map-root-user --pid"
  [ -O / ] 2>/dev/null || { a=$b b="--pid" c=""; }
  for o in "$a" "$b" ${c:+"$c"}; do
    if unshare $o --mount-proc --propagation slave --fork --kill-child \\
        sh -c 'read -r p _ </proc/self/stat && [ "$p" = 1 ] && [ "$$" = 1 ]' </dev/null >/dev/null 2>&1; then
      exec unshare $o --mount-proc --propagation slave --fork --kill-child "$@" --in-pidns
    fi
  done
fi
exec "$@"
"""


#: What the controller takes of a rank's TORCHELASTIC_ERROR_FILE (torch's ``@record`` output).
ERROR_FILE_LIMIT = 256 * 1024


#: Where dlrun.render puts a torch job's rank files on a host (``/tmp/dlrun-<job>/``), and those files:
#: torch's ``@record`` error file, the flight recorder's dumps and its pipes.
JOB_TMP = "/tmp/dlrun-"
RANK_FILES = ("TORCHELASTIC_ERROR_FILE", "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_PIPE_FILE")


def private_folder(top: str) -> str | None:
    """``top`` (``/tmp/dlrun-<job>``) when it is this user's own folder that no one else could write
    to (made now, or by another host or rank of the job on this machine), made private; else a new
    private folder beside it (``<top>-<random>``), as torchrun's ``mkdtemp``. Another user may make
    the name first (a restart's ``<job>-r1`` is easy to guess) and then read a rank's error file,
    plant one, or link it to the user's files. None when no folder could be made."""
    uid = os.geteuid()
    name = top
    for _ in range(8):
        try:
            os.mkdir(name, 0o700)
            return name
        except FileExistsError:
            pass
        except OSError:
            return None
        try:
            st = os.lstat(name)
            if st.st_uid == uid and (st.st_mode & 0o170000) == 0o040000 and not st.st_mode & 0o022:
                if st.st_mode & 0o077:
                    os.chmod(name, 0o700)
                return name
        except OSError:
            pass
        name = top + "-" + os.urandom(6).hex()
    return None


def private_rank_files(env: dict[str, str], folders: dict[str, str | None]) -> None:
    """Move the rank files ``env`` names under ``/tmp/dlrun-<job>/`` into the folder
    ``private_folder`` chose for it (``folders``: the choices so far); without one, the rank
    runs without them (no error file, no flight recorder) rather than in another user's folder."""
    for key in RANK_FILES:
        value = env.get(key, "")
        if not value.startswith(JOB_TMP):
            continue
        top = "/".join(value.split("/")[:3])
        if top not in folders:
            folders[top] = private_folder(top)
        chosen = folders[top]
        if chosen is None:
            del env[key]
        else:
            env[key] = chosen + value[len(top):]


def prepare_error_file(path: str) -> None:
    """torch's ``@record`` writes the rank's exception to ``path`` but makes no folder (torchrun
    does): make it, private, and drop a file an earlier attempt left there."""
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        os.unlink(path)
    except OSError:
        pass


def read_error_file(path: str) -> Any:
    """The JSON a failed rank's ``@record`` wrote (or its text), or None."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(ERROR_FILE_LIMIT)
    except OSError:
        return None
    try:
        return json.loads(data)
    except ValueError:
        return data.decode("utf-8", "replace")


def compiled(source: str, name: str) -> Any:
    """``source`` compiled, through the bootstrap loader's code cache when this program was started
    by it (``dlrun.remote.LOADER`` defines ``_dlrun_code`` in these globals)."""
    cached = globals().get("_dlrun_code")
    if cached is not None:
        return cached(source.encode("utf-8"), name)
    return compile(source, name, "exec")


def become_subreaper() -> bool:
    """``prctl(PR_SET_CHILD_SUBREAPER)``: orphaned descendants come to this process, not init."""
    try:
        import ctypes

        return int(ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def own_proc() -> bool:
    """Does ``/proc/self`` name this process? CUDA needs it; a PID namespace without its own
    ``/proc`` breaks it."""
    try:
        return os.readlink("/proc/self") == str(os.getpid())
    except OSError:
        return False


def pidns_argv(agent_argv: list[str]) -> list[str]:
    """``agent_argv`` wrapped so that it runs in a PID namespace where one can be made."""
    return ["sh", "-c", PIDNS_WRAPPER, "dlrun-agent", *agent_argv]


def guard() -> None:
    """Without a PID namespace nothing kills the ranks when the agent itself dies (kill -9, the
    OOM killer): fork, and let the agent run in the child while this process, a child subreaper,
    waits for it. Its orphans (the ranks, what they started, ``setsid`` escapes included) are
    re-parented here, and are killed once the agent is gone; then this process exits with the
    agent's status, saying why on stderr if the agent did not end by itself."""
    guardian = os.getpid()
    child = os.fork()
    if child == 0:
        # the guardian's end is the agent's: whoever ends the process it started (the keeper, the
        # local transport, Spark's parent-death signal) ends the agent too, whose handler stops its ranks
        try:
            import ctypes

            ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
        if os.getppid() != guardian:  # it died before the line above
            os.kill(os.getpid(), signal.SIGTERM)
        return
    try:  # the guardian takes no part in the protocol: the channel's stdout is the agent's alone
        os.close(1)
        os.close(0)
    except OSError:
        pass
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # the agent's to handle; this process outlives it
        signal.signal(sig, lambda signum, _frame: _forward(child, signum))
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, b"dlrun-guard", 0, 0, 0)  # PR_SET_NAME: tell it from the agent in ps
    except (OSError, AttributeError):
        pass
    subreaper = become_subreaper()
    while True:
        try:
            _pid, status = os.waitpid(child, 0)
            break
        except ChildProcessError:
            status = 0
            break
        except InterruptedError:
            continue
    killed = os.WIFSIGNALED(status)
    code = 128 + os.WTERMSIG(status) if killed else os.WEXITSTATUS(status)
    left = kill_descendants() if subreaper else 0
    if killed:
        try:
            name = signal.Signals(os.WTERMSIG(status)).name
        except ValueError:
            name = str(os.WTERMSIG(status))
        try:  # stderr may be gone (a closed channel, a full disk): the exit status still says it
            sys.stderr.write(f"dlrun-agent (pid {child}) was killed by {name}; {left} process(es) of its job"
                             " were left and are killed\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _forward(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except OSError:
        pass


def kill_descendants() -> int:
    """Kill every child of this subreaper until none is left (orphans keep arriving as their
    parents die); how many were killed."""
    killed = 0
    for _ in range(200):
        children = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open("/proc/" + entry + "/stat", "rb") as fh:
                    ppid = int(fh.read().rpartition(b")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == os.getpid():
                children.append(int(entry))
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except OSError:
                pass
        while True:  # reap what died, so it leaves /proc
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        if not children:
            return killed
        time.sleep(0.02)
    return killed


#: The main loop's tick before the ranks start (seconds); 0.05 once they run.
IDLE_TICK = 0.5


def _run_agent(argv: list[str]) -> int:
    in_namespace = "--in-pidns" in argv  # set by PIDNS_WRAPPER
    if not in_namespace:
        guard()  # returns in the child, which is the agent
    stdin_fd = sys.stdin.fileno()
    os.set_blocking(stdin_fd, False)
    agent = Agent(sys.stdout.buffer, in_namespace, stdin_fd)
    agent.subreaper = not in_namespace and become_subreaper()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: _on_signal(agent, signum))
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda _signum, _frame: None)
    agent.sel.register(wake_r, selectors.EVENT_READ, "wake")
    agent.emit(
        HELLO,
        AGENT_RANK,
        json.dumps(
            {
                "hostname": os.uname().nodename,
                "pid": os.getpid(),
                "pidns": in_namespace,
                "own_proc": own_proc(),
                "python": sys.version.split()[0],
            }
        ).encode(),
    )
    agent.flush()
    agent.sel.register(stdin_fd, selectors.EVENT_READ, "control")
    started = False
    eof_grace = 2.0
    timeout = 0.05
    while True:
        got = agent.read_ready(timeout)
        if 0 < got < SMALL_READ and not agent.urgent:
            time.sleep(0.002)  # a trickle of tiny writes: let it pile up into one frame
        agent.read_control()
        control = agent.control
        while b"\n" in control:
            line, _, rest = bytes(control).partition(b"\n")
            control[:] = rest
            if not line.strip():
                continue
            message = json.loads(line)
            op = message.get("op", "start")
            if op == "ping":
                agent.emit(PONG, AGENT_RANK, b"")
            elif op == "probe":
                agent.probe(message)
            elif op == "survey":
                agent.survey(message)
            elif op == "ports":
                agent.ports(message)
            elif op == "watch":
                agent.watch(message)
            elif op == "stacks":
                agent.take_stacks(message)
            elif op == "dump":  # faulthandler's dump (PYTHONFAULTHANDLER) of ranks py-spy could not read
                agent.dump(message)
            elif op == "record":  # torch's flight recorder: dump now, through its pipe
                agent.record(float(message.get("wait", 15)))
            elif op == "start" and not started:
                started = True
                eof_grace = float(message.get("eof_grace", eof_grace))
                agent.watch(message)
                agent.start(message)
            elif message.get("op") == "stop":  # after the dumps asked for, if any
                agent.stop(float(message.get("grace", 10)), hold=True)
            elif message.get("op") == "kill":
                agent.stop(0)
        now = time.monotonic()
        if not agent.stdin_closed and agent.controller_silent(now):
            agent.read_control()  # a long probe or survey kept us from reading: what waits was heard
            now = time.monotonic()
        if agent.stdin_closed or agent.controller_silent(now):
            # the controller is gone (EOF), or silent too long (its machine or the network is
            # down): nobody will read us any more
            agent.sel.unregister(stdin_fd)
            agent.gpus.stop(agent.sel)
            agent.stop(eof_grace)
            return _finish(agent)
        agent.reap()
        if agent.held_grace is not None and agent.dumps_written(now):
            agent.stop(agent.held_grace)
        agent.stacks_done(now)
        if started:
            agent.sample_gpus(now)
        if agent.kill_at is not None and now >= agent.kill_at:
            agent.signal_all(signal.SIGKILL)
        if started and agent.all_exited():
            # the last EXIT goes out with DONE in one write: one packet, one wake-up of the
            # client's reader (two writes cost a loaded client tens of ms per host)
            agent.gpus.stop(agent.sel)
            return agent.done()
        wait = agent.flush_due(now)
        timeout = 0.05 if wait is None else min(wait, 0.05)
        if not started and wait is None and agent.kill_at is None:
            # before the spec only the silence check (seconds) runs on a clock; messages, EOF and
            # signals wake the select: no 20 wake-ups a second while the client starts other hosts
            timeout = IDLE_TICK


def _finish(agent: Agent) -> int:
    """stdin closed: stop every rank (TERM, grace, KILL), sweep, report what we can, exit."""
    give_up = time.monotonic() + 60
    while not agent.all_exited() and time.monotonic() < give_up:
        agent.read_ready(0.02)
        agent.reap()
        if agent.kill_at is not None and time.monotonic() >= agent.kill_at:
            agent.signal_all(signal.SIGKILL)
        agent.flush()
    return agent.done()


def _on_signal(agent: Agent, signum: int) -> None:
    agent.signal_all(signal.SIGKILL)
    agent.sweep()
    agent.remove_error_files()  # sshd's SIGHUP when the client went: no empty /tmp/dlrun-<job>/ left behind
    # Not for speed: a SystemExit raised here could land inside a probe or survey run by exec
    # (which answer any BaseException) and the agent would go on without its ranks.
    os._exit(128 + signum)


def main() -> None:
    code = _run_agent(sys.argv[1:])
    # DONE is written (os.write, nothing buffered); the agent has no thread and no atexit
    # handler: the interpreter's teardown (modules, objects, the collector) would only cost every
    # host 1-2 ms of CPU after the job's end. The standard streams are flushed; the kernel closes
    # the rest (docs/benchmarks.md, issue 35's fifth pass).
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed channel
            pass
    os._exit(code)


if __name__ == "__main__":
    main()
