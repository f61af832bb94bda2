"""Answers ``dlrun ps``, ``logs``, ``attach``, ``stop`` on one host, from ``~/.dlrun/jobs/``.

Shipped by ``dlrun.remote``'s loader; one JSON request on stdin after the source, one JSON
answer on stdout. Standard library only, Python >= 3.8. A job's folder has one folder per host
(``host-<name>/``: hosts may share a home); a pid there counts only on the machine and boot
that wrote it. Requests: ``{"op": "ps"}``, ``{"op": "state", "job"}``, ``{"op": "logs", "job",
"offsets": {file: byte offset}, "whole"}`` (every byte from each offset, streamed in pieces:
``--follow`` polls cheaply and nothing is capped; a big answer goes over the TLS side channel
dlrun offers, ``side_channel``), ``{"op": "stop", "job"}`` (SIGTERM to the
job's keepers here, found by their pid files and checked in ``/proc/<pid>/cmdline``),
``{"op": "delete", "job", "read"}`` (only files read to their end) and ``{"op": "stacks", "job",
"message", "host"}`` (``dlrun stack``: the message goes to the keeper of ``host`` (hosts may share
a home) through ``stack-request.json`` and SIGUSR1; its agent takes the stacks, the keeper writes
them to ``stacks-<id>/``; the answer comes back). Every run
first removes job folders older than ``KEEP_DAYS`` that no keeper here runs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from typing import Any

KEEP_DAYS = 7
CHUNK = 1 << 20  # bytes of one piece of the streamed ``logs`` answer
SIDE_FROM = 8 << 20  # bytes of a ``logs`` answer from which it takes the TLS side channel dlrun offers
SIDE_WAIT = 20.0  # seconds the side channel waits for dlrun's connection before the answer goes on stdout
START_GRACE = 60.0  # seconds a job folder without its keeper's pid counts as starting, not lost
SIDE_AUTH = 1.0  # seconds a connection to the side channel has for TLS and the token, in all (as the keeper's)
SIDE_GREETINGS = 32  # connections to the side channel greeted at once (each a thread, SIDE_AUTH at most)
STACKS_TIMEOUT = 45.0  # seconds the keepers here have to answer a stack request


def jobs_root() -> str:
    return os.path.join(os.path.expanduser("~"), ".dlrun", "jobs")


def boot_id() -> str:
    """This machine's boot (the keeper writes it beside its pid; the same function is there)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return os.uname().nodename


def keeper_pid(hostdir: str, job_id: str) -> int | None:
    """The pid of the keeper that owns ``hostdir`` while it lives on this machine (its command
    line names the job), else None."""
    try:
        with open(os.path.join(hostdir, "keeper.pid")) as fh:
            pid_text, _, boot = fh.read().strip().partition(" ")
        if boot != boot_id():
            return None
        pid = int(pid_text)
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            argv = fh.read().split(b"\0")
    except (OSError, ValueError):
        return None
    if b"dlrun-keeper" in argv and job_id.encode() in argv:
        return pid
    return None


def owned_here(hostdir: str) -> bool:
    """Was ``hostdir``'s keeper started on this machine, this boot? (Hosts may share a home.)"""
    try:
        with open(os.path.join(hostdir, "keeper.pid")) as fh:
            return fh.read().strip().partition(" ")[2] == boot_id()
    except OSError:
        return False


def read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as fh:
            document: dict[str, Any] = json.load(fh)
    except (OSError, ValueError):
        return None
    return document


def host_dirs(job_id: str) -> list[str]:
    jobdir = os.path.join(jobs_root(), job_id)
    try:
        names = sorted(os.listdir(jobdir))
    except OSError:
        return []
    return [os.path.join(jobdir, n) for n in names if n.startswith("host-")]


def host_record(job_id: str, hostdir: str) -> dict[str, Any]:
    """One host's record of the job: its result once ended, else its state. A keeper of this
    machine that died before the end (a kill -9, a reboot) leaves the job ``lost`` here."""
    alive = keeper_pid(hostdir, job_id) is not None
    record = read_json(os.path.join(hostdir, "result.json"))
    if record is None:
        record = read_json(os.path.join(hostdir, "state.json")) or {"job_id": job_id, "state": "starting"}
        gone = not alive and (owned_here(hostdir) or not_started(hostdir))
        if gone and record.get("state") not in ("succeeded", "failed", "stopped"):
            record["state"] = "lost"
            record["root_cause"] = record.get("root_cause") or "the job's keeper on this host is gone"
    record["alive"] = alive
    return record


def not_started(hostdir: str) -> bool:
    """A host folder whose keeper never wrote its pid: gone, once the folder is older than
    ``START_GRACE`` (until then it is a keeper between its folder and its fork: starting)."""
    if os.path.exists(os.path.join(hostdir, "keeper.pid")):
        return False
    try:
        return time.time() - os.stat(hostdir).st_mtime > START_GRACE
    except OSError:
        return True


def job_records(job_id: str) -> list[dict[str, Any]]:
    return [host_record(job_id, d) for d in host_dirs(job_id)]


def removable(hostdir: str, job_id: str) -> bool:
    """May this machine remove ``hostdir``? When its keeper ended the job there (a result), or
    was this machine's and is gone. Another machine's folder without a result (a shared home)
    may belong to a keeper that still runs there: only that machine can tell."""
    if os.path.exists(os.path.join(hostdir, "result.json")):
        return keeper_pid(hostdir, job_id) is None
    return owned_here(hostdir) and keeper_pid(hostdir, job_id) is None


def remove_job(job_id: str) -> bool:
    """Remove the host folders this machine may remove, then the job's folder once empty;
    whether it is gone."""
    jobdir = os.path.join(jobs_root(), job_id)
    for hostdir in host_dirs(job_id):
        if removable(hostdir, job_id):
            shutil.rmtree(hostdir, ignore_errors=True)
    if host_dirs(job_id):
        return False
    shutil.rmtree(jobdir, ignore_errors=True)
    return not os.path.exists(jobdir)


def prune(now: float) -> None:
    """Remove the job folders that did not change for ``KEEP_DAYS``, as far as ``removable``
    allows."""
    root = jobs_root()
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        newest = 0.0
        for folder, _dirs, files in os.walk(os.path.join(root, name)):
            for f in [".", *files]:
                try:
                    newest = max(newest, os.stat(os.path.join(folder, f)).st_mtime)
                except OSError:
                    pass
        if newest and now - newest > KEEP_DAYS * 86400:
            remove_job(name)


def offset_since(index_path: str, since: float) -> int:
    """The first offset of a rank log written at ``since`` or later, from its ``.idx`` file
    (``<time> <offset>`` lines); -1 when nothing that recent was written (start at the end)."""
    try:
        with open(index_path) as fh:
            for line in fh:
                when, _, where = line.partition(" ")
                if float(when) >= since:
                    return int(where)
    except (OSError, ValueError):
        return 0
    return -1


def log_files(job_id: str, offsets: dict[str, int], since: float | None,
              skip: frozenset[str] = frozenset()) -> list[tuple[str, str, str, int]]:
    """(key, path, host, offset to start from) of each rank log and ``gpu.csv`` of the job, but
    for the host folders in ``skip`` (hosts that share this home and send their own)."""
    found = []
    for hostdir in host_dirs(job_id):
        if os.path.basename(hostdir) in skip:
            continue
        host = (read_json(os.path.join(hostdir, "state.json")) or {}).get("host", "?")
        for attempt in sorted(os.listdir(hostdir)):
            folder = os.path.join(hostdir, attempt)
            if not attempt.startswith("attempt-") or not os.path.isdir(folder):
                continue
            for name in sorted(os.listdir(folder)):
                if not name.endswith(".log") and name != "gpu.csv":
                    continue
                key = "/".join((os.path.basename(hostdir), attempt, name))
                path = os.path.join(folder, name)
                if key in offsets:
                    offset = int(offsets[key])
                elif since is not None:
                    offset = offset_since(path[: -len(".log")] + ".idx", since)
                    offset = os.path.getsize(path) if offset < 0 else offset
                else:
                    offset = 0
                found.append((key, path, str(host), offset))
    return found


def stream_logs(job_id: str, offsets: dict[str, int], since: float | None, whole: bool, out: Any,
                side: dict[str, Any] | None = None, skip: frozenset[str] = frozenset()) -> None:
    """The ``logs`` answer as a stream: first ``R {"jobs"}\n`` (the records: a job that has ended
    there wrote every line before), then every byte of each file to its end, in pieces of at most
    ``CHUNK`` that end at a line's end where one is within reach: ``P {"key", "host", "offset",
    "length"}\n`` and that many raw bytes; last ``J {"ends": {key: offset reached}}\n``. Without
    ``whole`` a file's unfinished last line waits for the next look (``--follow``); with it (the
    job ended, or a one-off look), it is sent as it is. ``side``: dlrun offers a TLS side channel
    (``side_channel``); with ``SIDE_FROM`` bytes or more to send, the stream goes there when dlrun
    reaches it, else on ``out`` as always. ``skip``: host folders not to send (``log_files``)."""
    files = log_files(job_id, offsets, since, skip)
    write = out.write
    tls = None
    if side is not None and sum(max(0, size_of(path) - offset) for _k, path, _h, offset in files) >= SIDE_FROM:
        tls = side_channel(side, out)
        if tls is not None:
            write = tls.sendall
    try:
        write(b"R " + json.dumps({"jobs": job_records(job_id)}).encode() + b"\n")
        ends: dict[str, int] = {}
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        for key, path, host, offset in files:
            try:
                fh = open(path, "rb")  # noqa: SIM115 - the with below owns it
            except OSError:
                continue
            with fh:
                size = os.fstat(fh.fileno()).st_size  # what is there now: a growing log is followed by the next look
                fh.seek(offset)
                pos = offset
                while pos < size:
                    got = fh.readinto(view[: min(CHUNK, size - pos)])
                    if not got:
                        break
                    if buf[got - 1] != 10:  # not at a line's end
                        cut = buf.rfind(b"\n", 0, got) + 1
                        last = pos + got >= size
                        if cut:  # whole lines now, the rest in the next piece
                            got = cut
                            fh.seek(pos + cut)
                        elif last and not whole and got < CHUNK:
                            break  # a line not finished yet: the next look
                    header = {"key": key, "host": host, "offset": pos, "length": got}
                    write(b"P " + json.dumps(header).encode() + b"\n")
                    write(view[:got])
                    pos += got
                ends[key] = pos
        write(b"J " + json.dumps({"ends": ends}).encode() + b"\n")
        out.flush()
    finally:
        if tls is not None:
            close_side(tls)


def size_of(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def load_pair(context: Any, cert_pem: str, key_pem: str) -> None:
    """Load a certificate and its key into ``context``: the key goes to an anonymous memory file
    (or a 0600 temporary file, removed at once), as the keeper's and the push helper's do."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="dlrun-jobs-") as private:
        paths = []
        fds = []
        for i, text in enumerate((cert_pem, key_pem)):
            try:
                fd = os.memfd_create("dlrun-jobs", os.MFD_CLOEXEC)  # type: ignore[attr-defined,unused-ignore]
                os.write(fd, text.encode())
                fds.append(fd)
                paths.append(f"/proc/self/fd/{fd}")
            except (AttributeError, OSError):
                path = os.path.join(private, f"{i}.pem")
                with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as fh:
                    fh.write(text)
                paths.append(path)
        try:
            context.load_cert_chain(paths[0], paths[1])
        finally:
            for fd in fds:
                os.close(fd)


def server_context(cert_pem: str, key_pem: str) -> Any:
    """TLS 1.3 with the certificate dlrun made for this look (``load_pair``), and mutual: the
    client must show that same certificate (dlrun holds its key), so a stranger fails at the
    handshake."""
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_verify_locations(cadata=cert_pem)
    load_pair(context, cert_pem, key_pem)
    return context


def side_greet(conn: Any, context: Any, token: bytes, won: Any) -> None:
    """One connection to the side channel: TLS and the token within ``SIDE_AUTH`` in all (a
    timer shuts it down then, whatever it trickles), else it is closed; ``won(tls)`` if it is
    dlrun (True: taken)."""
    import hmac
    import socket
    import threading

    through = threading.Event()
    try:
        watch = conn.dup()  # wrap_socket takes conn's descriptor: the timer shuts the connection through its own
    except OSError:  # no descriptor left: no stranger is worth one
        conn.close()
        return

    def expire() -> None:
        if not through.is_set():
            try:
                watch.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    deadline = time.monotonic() + SIDE_AUTH
    timer = threading.Timer(SIDE_AUTH, expire)
    timer.daemon = True
    timer.start()
    tls = None
    try:
        conn.settimeout(SIDE_AUTH)
        tls = context.wrap_socket(conn, server_side=True)
        shown = b""
        while not shown.endswith(b"\n") and len(shown) <= len(token):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            tls.settimeout(left)  # what is left of the deadline, not a fresh timeout per read
            got = tls.recv(len(token) + 1 - len(shown))
            if not got:
                break
            shown += got
        if hmac.compare_digest(shown, token + b"\n"):
            through.set()
            if won(tls):
                return
        tls.close()
    except (OSError, ValueError):
        (tls or conn).close()
    finally:
        timer.cancel()
        watch.close()


def side_channel(side: dict[str, Any], out: Any) -> Any:
    """The TLS side channel of a big ``logs`` answer, or None: listen on the address dlrun's SSH
    connection came to (``SSH_CONNECTION``), say ``T {"port"}\n`` on ``out``, and take the first
    connection that completes the handshake with dlrun's certificate (both ways) and shows the
    token. A connection from any address but the one dlrun's SSH connection came from is closed
    at once. Any local user sees the port: each connection is greeted in its own thread within
    ``SIDE_AUTH`` in all (``side_greet``), at most ``SIDE_GREETINGS`` at once, while this loop
    goes on accepting. dlrun closes stdin when it cannot connect (a firewall, a NAT): then, or
    after ``SIDE_WAIT`` seconds, None and the answer goes on ``out``. Once taken, a thread
    shuts the socket down when stdin ends (dlrun gone), so a send never blocks on a vanished
    client (``watch_stdin``)."""
    import select
    import socket
    import threading

    where = os.environ.get("SSH_CONNECTION", "").split()
    if len(where) != 4:
        return None
    try:
        context = server_context(str(side["cert"]), str(side["key"]))
        token = str(side["token"]).encode()
        listener = socket.socket(socket.AF_INET6 if ":" in where[2] else socket.AF_INET, socket.SOCK_STREAM)
    except (ImportError, OSError, ValueError, KeyError):  # a Python without ssl: the answer goes on stdout
        return None
    lock = threading.Lock()
    taken: list[Any] = []
    greeting = [0]
    done = threading.Event()
    wake_r, wake_w = os.pipe()

    def won(tls: Any) -> bool:
        with lock:  # the wake pipe closes under the same lock: never written once closed
            if taken or done.is_set():
                return False
            taken.append(tls)
            os.write(wake_w, b"x")
        return True

    def greet(conn: Any) -> None:
        try:
            side_greet(conn, context, token, won)
        finally:
            with lock:
                greeting[0] -= 1

    try:
        with listener:
            try:
                listener.bind((where[2], 0))
                listener.listen(16)
            except OSError:
                return None
            out.write(b"T " + json.dumps({"port": listener.getsockname()[1]}).encode() + b"\n")
            out.flush()
            deadline = time.monotonic() + SIDE_WAIT
            while True:
                with lock:
                    if taken:
                        done.set()
                        tls = taken.pop(0)
                        tls.settimeout(None)  # a paused pager holds the sender; dlrun's end closes the socket
                        watch_stdin(tls)
                        return tls
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                ready = select.select([listener.fileno(), 0, wake_r], [], [], left)[0]
                if 0 in ready:  # dlrun could not connect (or is gone): the answer goes on stdout
                    return None
                if listener.fileno() not in ready:
                    continue
                try:
                    conn, peer = listener.accept()
                except OSError:
                    continue
                if not same_address(str(peer[0]), where[0]):
                    # not from where dlrun's SSH connection came (a local user, another machine):
                    # closed at once, without a greeting slot or a thread
                    conn.close()
                    continue
                with lock:
                    full = greeting[0] >= SIDE_GREETINGS
                    if not full:
                        greeting[0] += 1
                if full:  # a flood: closed at once
                    conn.close()
                    continue
                threading.Thread(target=greet, args=(conn,), name="dlrun-side-greet", daemon=True).start()
    finally:
        with lock:  # a connection that won after the wait ended is closed, not left open
            done.set()
            late = list(taken)
            os.close(wake_r)
            os.close(wake_w)
        for tls in late:
            tls.close()


def same_address(a: str, b: str) -> bool:
    """Whether two numeric addresses (IPv4 or IPv6, an IPv6 zone ignored) are the same."""
    import socket

    a, b = a.split("%", 1)[0], b.split("%", 1)[0]
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            return socket.inet_pton(family, a) == socket.inet_pton(family, b)
        except OSError:
            continue
    return a == b


def watch_stdin(tls: Any) -> None:
    """Shut ``tls`` down once stdin ends (dlrun closed the SSH channel, or is gone), in a thread:
    a send blocked on a vanished client ends then, not after TCP's own retries (~15 min)."""
    import select
    import socket
    import threading

    def watch() -> None:
        try:
            while True:
                select.select([0], [], [])
                if not os.read(0, 4096):
                    break
        except OSError:
            pass
        try:
            tls.shutdown(socket.SHUT_RDWR)
        except (OSError, ValueError):
            pass

    threading.Thread(target=watch, name="dlrun-side-stdin", daemon=True).start()


def close_side(tls: Any) -> None:
    """End the side channel once the answer is out (dlrun reads to ``J`` and closes its end)."""
    try:
        tls.settimeout(10)
        tls.unwrap()
    except (OSError, ValueError):
        pass
    tls.close()


def stop(job_id: str) -> dict[str, Any]:
    """SIGTERM every keeper of the job on this machine."""
    signalled = 0
    for hostdir in host_dirs(job_id):
        pid = keeper_pid(hostdir, job_id)
        if pid is not None:
            try:
                os.kill(pid, signal.SIGTERM)
                signalled += 1
            except OSError:
                pass
    return {"signalled": signalled, "jobs": job_records(job_id)}


def catches(pid: int, signum: int) -> bool:
    """Does process ``pid`` handle ``signum`` (``SigCgt`` in its status)? A keeper of an older
    dlrun does not handle SIGUSR1, which would kill it."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def stacks(job_id: str, message: dict[str, Any], host_name: str) -> dict[str, Any]:
    """Ask host ``host_name``'s live keeper of the job for its ranks' stacks; its answer."""
    request_id = str(message.get("id", ""))
    if not request_id or "/" in request_id or request_id.startswith("."):
        return {"error": f"bad request id {request_id!r}"}
    asked: dict[str, str] = {}
    answers: list[dict[str, Any]] = []
    for hostdir in host_dirs(job_id):
        pid = keeper_pid(hostdir, job_id)
        if pid is None:
            continue
        host = (read_json(os.path.join(hostdir, "state.json")) or {}).get("host", "?")
        if host != host_name:
            continue
        if not catches(pid, signal.SIGUSR1):
            answers.append({"host": host, "error": "the job's keeper is from an older dlrun: it takes no stacks"})
            continue
        path = os.path.join(hostdir, "stack-request.json")
        with open(path + ".tmp", "w") as fh:
            json.dump(message, fh)
        os.replace(path + ".tmp", path)
        try:
            os.kill(pid, signal.SIGUSR1)
        except OSError as exc:
            answers.append({"host": host, "error": f"cannot reach the keeper: {exc}"})
            continue
        asked[hostdir] = host
    deadline = time.monotonic() + STACKS_TIMEOUT
    while asked and time.monotonic() < deadline:
        for hostdir, host in list(asked.items()):
            folder = os.path.join(hostdir, "stacks-" + request_id)
            answer = read_json(os.path.join(folder, "answer.json"))
            if answer is not None:
                answers.append({"host": host, "answer": answer, "folder": folder})
                del asked[hostdir]
        time.sleep(0.2)
    answers += [{"host": host, "error": f"no answer within {STACKS_TIMEOUT:g} s"} for host in asked.values()]
    return {"hosts": answers, "jobs": job_records(job_id)}


def delete(job_id: str, read: dict[str, int] | None = None) -> dict[str, Any]:
    """Remove the job's folders here. ``read``: how far the client read each file; a file
    that holds more than that is not deleted (its end was not read out)."""
    if any(keeper_pid(d, job_id) is not None for d in host_dirs(job_id)):
        return {"deleted": False, "error": "the job is running: dlrun stop it first"}
    if read is not None:
        for key, path, _host, _offset in log_files(job_id, {}, None):
            try:
                size = os.path.getsize(path)
            except OSError:
                continue
            if int(read.get(key, 0)) < size:
                return {"deleted": False, "error": f"{key} was not read to its end ({read.get(key, 0)} of"
                        f" {size} bytes): nothing was deleted"}
    if not os.path.isdir(os.path.join(jobs_root(), job_id)):
        return {"deleted": False}
    return {"deleted": remove_job(job_id)}


def answer(request: dict[str, Any]) -> dict[str, Any]:
    op = request.get("op")
    if op != "logs":  # not on every poll of --follow and attach
        prune(time.time())
    job_id = str(request.get("job", ""))
    if op != "ps" and (not job_id or "/" in job_id or job_id.startswith(".")):
        return {"error": f"bad job id {job_id!r}"}
    if op == "ps":
        root = jobs_root()
        names = sorted(os.listdir(root)) if os.path.isdir(root) else []
        return {"jobs": [r for n in names for r in job_records(n)]}
    if op == "state":
        return {"jobs": job_records(job_id)}
    if op == "logs":  # streamed: every byte, however much (``stream_logs``)
        ago = request.get("since_ago")  # seconds before now on this host's clock (no clock skew)
        stream_logs(job_id, {str(k): int(v) for k, v in (request.get("offsets") or {}).items()},
                    None if ago is None else time.time() - float(ago), bool(request.get("whole")),
                    sys.stdout.buffer, request.get("side"), frozenset(str(n) for n in request.get("skip") or ()))
        return {}
    if op == "stop":
        return stop(job_id)
    if op == "delete":
        read = request.get("read")
        return delete(job_id, None if read is None else {str(k): int(v) for k, v in read.items()})
    if op == "stacks":
        return stacks(job_id, dict(request.get("message") or {}), str(request.get("host", "")))
    return {"error": f"unknown op {op!r}"}


def main() -> None:
    data = b""
    while not data.endswith(b"\n"):  # one line: dlrun may keep stdin open (``side_channel``)
        chunk = os.read(0, 65536)
        if not chunk:
            break
        data += chunk
    reply = answer(json.loads(data))
    if reply:  # a streamed answer wrote itself
        sys.stdout.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
