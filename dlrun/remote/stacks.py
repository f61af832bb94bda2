"""Takes ranks' Python stacks on one host with py-spy, and keeps py-spy in a per-user cache.

Shipped by ``dlrun.remote``'s loader; one JSON request on stdin after the source (``install``:
then the binary's bytes), one JSON answer on stdout. Standard library only, Python >= 3.8.
The agent runs it as its own child for ``take`` (so, under Yama's ``ptrace_scope=1``, py-spy
descends from the process each rank named with ``PR_SET_PTRACER``); the client runs it over
SSH for ``have`` and ``install``. Requests:

* ``{"op": "have", "sha256"}``: ``{"path", "machine", "system"}`` (path None: not cached);
* ``{"op": "install", "sha256", "size"}`` + bytes: the binary to
  ``~/.cache/dlrun/tools/py-spy-<sha256>``, checked and renamed into place: ``{"path"}``;
* ``{"op": "take", "pids": {rank: pid}, "sha256", "samples", "interval", "native", "outdir"}``:
  every rank's dump (``py-spy dump --json``, with ``--native`` where it works), all at once,
  ``samples`` times ``interval`` seconds apart: ``{"ranks": {rank: {"pid", "method",
  "samples": [{"time", "threads"} | {"time", "error"}]}}}``. With ``outdir``, each rank's
  stacks also go to ``outdir/rank-N.txt`` and the answer to ``outdir/stacks.json``. With
  ``ras`` (``host:port``, the job's ``NCCL_RAS_ADDR``), NCCL's RAS is asked once, after the
  first sample, for every communicator's progress (its text protocol, as ``ncclras -v``):
  ``"nccl_ras": {"addr", "text"} | {"addr", "error"}``, also to ``outdir/nccl-ras.txt``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from typing import Any

DUMP_TIMEOUT = 20.0  # seconds for one py-spy dump
OUTPUT_LIMIT = 4 << 20


def exec_allowed(folder: str) -> bool:
    """May programs run from ``folder`` (or where it would be made)? Not on a ``noexec`` mount, as
    NFS homes of HPC clusters often are."""
    path = folder
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return not os.statvfs(path).f_flag & getattr(os, "ST_NOEXEC", 0)
    except OSError:
        return True


def cache_dir() -> str:
    """``$XDG_CACHE_HOME/dlrun/tools`` (``~/.cache``), or ``$XDG_RUNTIME_DIR/dlrun/tools`` where the
    cache is on a ``noexec`` mount and the runtime folder is not."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    first = os.path.join(base, "dlrun", "tools")
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if not exec_allowed(first) and runtime and os.path.isdir(runtime) and exec_allowed(runtime):
        return os.path.join(runtime, "dlrun", "tools")
    return first


def cached(sha256: str) -> str:
    return os.path.join(cache_dir(), "py-spy-" + sha256)


def which(name: str) -> str | None:
    for folder in os.environ.get("PATH", os.defpath).split(os.pathsep):
        path = os.path.join(folder or ".", name)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def find_pyspy(sha256: str) -> str | None:
    """The cached binary the client shipped, else a py-spy on PATH."""
    path = cached(sha256) if sha256 else ""
    if path and os.access(path, os.X_OK):
        return path
    return which("py-spy")


def have(request: dict[str, Any]) -> dict[str, Any]:
    path = cached(str(request.get("sha256") or ""))
    there = bool(request.get("sha256")) and os.path.isfile(path)
    return {"path": path if there and os.access(path, os.X_OK) else None,
            "machine": os.uname().machine, "system": os.uname().sysname,
            "noexec": there and not exec_allowed(path)}  # sending it again would not help


def install(request: dict[str, Any], data: bytes) -> dict[str, Any]:
    sha256 = str(request["sha256"])
    if hashlib.sha256(data).hexdigest() != sha256 or len(data) != int(request["size"]):
        return {"error": f"py-spy arrived damaged ({len(data)} of {request['size']} bytes)"}
    os.makedirs(cache_dir(), mode=0o700, exist_ok=True)
    target = cached(sha256)
    temp = f"{target}.{os.urandom(8).hex()}.tmp"  # not the pid: agents in PID namespaces share pids
    with open(temp, "xb") as fh:
        fh.write(data)
    os.chmod(temp, 0o700)
    os.replace(temp, target)
    return {"path": target}


def ptrace_scope() -> str | None:
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as fh:
            return fh.read().strip()
    except OSError:
        return None


def why(text: str) -> str:
    """py-spy's complaint, with what Yama allows where it is the cause."""
    last = [line for line in text.strip().splitlines() if line.strip()][-3:]
    said = " / ".join(last) or "no output"
    scope = ptrace_scope()
    if ("ermission" in said or "ptrace" in said.lower()) and scope is not None:
        said += f" (kernel.yama.ptrace_scope={scope})"
    return said


def dump_all(pyspy: str, pids: dict[str, int], native: dict[str, bool]) -> dict[str, dict[str, Any]]:
    """One dump of every pid, all at once: rank -> ``{"time", "threads"}`` or ``{"time", "error"}``."""
    procs: dict[str, subprocess.Popen[bytes]] = {}
    results: dict[str, dict[str, Any]] = {}
    started = time.time()
    for rank, pid in pids.items():
        argv = [pyspy, "dump", "--pid", str(pid), "--json"] + (["--native"] if native[rank] else [])
        try:
            procs[rank] = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE)
        except OSError as exc:
            results[rank] = {"time": started, "error": f"cannot run {pyspy}: {exc}"}
    deadline = time.monotonic() + DUMP_TIMEOUT
    for rank, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            results[rank] = {"time": started, "error": f"py-spy did not answer within {DUMP_TIMEOUT:g} s"}
            continue
        if proc.returncode == 0:
            try:
                results[rank] = {"time": started, "threads": json.loads(out[:OUTPUT_LIMIT])}
                continue
            except ValueError:
                pass
        results[rank] = {"time": started, "error": why((err or out).decode("utf-8", "replace")),
                         "native": native[rank]}
    return results


RAS_PROTOCOL = 2  # NCCL's RAS client protocol (src/ras/ras_internal.h, NCCL_RAS_CLIENT_PROTOCOL)
RAS_TIMEOUT = 5  # seconds NCCL's RAS gives its peers to answer (ncclras's default -t)
RAS_LIMIT = 1 << 20  # bytes of a RAS answer kept


def ask_ras(addr: str, *, timeout: float = RAS_TIMEOUT) -> dict[str, Any]:
    """NCCL's RAS status (``VERBOSE STATUS``) from the job's RAS socket at ``addr``: every
    communicator's state and collective counts, as the ``ncclras`` client prints them."""
    import socket

    host, _, port = addr.rpartition(":")
    host = host.strip("[]") or "localhost"
    found: dict[str, Any] = {"addr": addr}
    try:
        with socket.create_connection((host, int(port)), timeout=2.0) as sock:
            reader = sock.makefile("rb")
            sock.sendall(b"CLIENT PROTOCOL %d\n" % RAS_PROTOCOL)
            hello = reader.readline(200).decode("ascii", "replace")
            if not hello.upper().startswith("SERVER PROTOCOL "):
                return dict(found, error=f"not NCCL's RAS at {addr}: it said {hello.strip()[:80]!r}")
            sock.sendall(b"TIMEOUT %d\n" % timeout)
            if reader.readline(200).strip().upper() != b"OK":
                return dict(found, error=f"NCCL's RAS at {addr} refused TIMEOUT")
            sock.settimeout(timeout + 10.0)  # RAS gathers from every process of the job first
            sock.sendall(b"VERBOSE STATUS\n")
            text = reader.read(RAS_LIMIT)
    except (OSError, ValueError) as exc:
        refused = isinstance(exc, ConnectionRefusedError)
        return dict(found, error=("nothing listens there (NCCL older than 2.24, NCCL_RAS_ENABLE=0, "
                                  "or no NCCL communicator yet)") if refused else f"{type(exc).__name__}: {exc}")
    return dict(found, text=text.decode("utf-8", "replace"))


def take(request: dict[str, Any]) -> dict[str, Any]:
    pids = {str(k): int(v) for k, v in (request.get("pids") or {}).items()}
    pyspy = find_pyspy(str(request.get("sha256") or ""))
    answer: dict[str, Any] = {"ranks": {}}
    if pyspy is None:
        why = "no py-spy on this host (none shipped for its machine, none on PATH)"
        if request.get("sha256") and not exec_allowed(cache_dir()):
            why = (f"py-spy was shipped to {cache_dir()}, on a mount where programs may not run (noexec):"
                   " set XDG_CACHE_HOME for this host (its env in the inventory) to a folder where they may")
        for rank, pid in pids.items():
            answer["ranks"][rank] = {"pid": pid, "method": "py-spy", "samples": [], "error": why}
    else:
        answer = sample_all(pyspy, pids, request)
    if request.get("ras") and "nccl_ras" not in answer:  # without py-spy, RAS is what there is
        answer["nccl_ras"] = ask_ras(str(request["ras"]))
    if request.get("outdir"):
        write_out(str(request["outdir"]), answer)
    return answer


def sample_all(pyspy: str, pids: dict[str, int], request: dict[str, Any]) -> dict[str, Any]:
    """``samples`` dumps of every rank, ``interval`` seconds apart; NCCL's RAS (``ras``) is asked
    right after the first, while the ranks are where that sample found them."""
    native = {rank: bool(request.get("native", True)) for rank in pids}
    samples = max(1, int(request.get("samples") or 2))
    interval = float(request.get("interval") or 3.0)
    ranks: dict[str, dict[str, Any]] = {rank: {"pid": pid, "method": "py-spy", "samples": []}
                                        for rank, pid in pids.items()}
    answer: dict[str, Any] = {"ranks": ranks, "pyspy": pyspy, "ptrace_scope": ptrace_scope()}
    for number in range(samples):
        if number:
            time.sleep(interval)
        got = dump_all(pyspy, pids, native)
        if number == 0 and request.get("ras"):
            answer["nccl_ras"] = ask_ras(str(request["ras"]))
        retry = {r: pids[r] for r, g in got.items() if "error" in g and g.get("native")}
        if retry:  # --native is not supported everywhere (a machine, a build): without it
            for rank in retry:
                native[rank] = False
            got.update(dump_all(pyspy, retry, native))
        for rank, sample in got.items():
            sample.pop("native", None)
            ranks[rank]["samples"].append(sample)
            if "threads" in sample:
                ranks[rank]["method"] = "py-spy --native" if native[rank] else "py-spy"
    return answer


def frame_text(frame: dict[str, Any]) -> str:
    short = frame.get("short_filename") or frame.get("filename") or ""
    if frame.get("module"):
        return f"{frame.get('name')} ({short})"
    return f"{frame.get('name')} ({short}:{frame.get('line')})"


def write_out(outdir: str, answer: dict[str, Any]) -> None:
    """Each rank's stacks as text, and the whole answer (the host side of a detached job)."""
    os.makedirs(outdir, mode=0o700, exist_ok=True)
    with open(os.path.join(outdir, "stacks.json"), "w") as fh:
        json.dump(answer, fh)
    ras = answer.get("nccl_ras")
    if ras:
        with open(os.path.join(outdir, "nccl-ras.txt"), "w") as fh:
            fh.write(f"NCCL RAS at {ras.get('addr')}\n\n" + (ras.get("text") or f"not asked: {ras.get('error')}\n"))
    for rank, entry in answer["ranks"].items():
        lines = [f"rank {rank}, pid {entry.get('pid')}, taken by {entry.get('method')}"]
        if entry.get("error"):
            lines.append(f"no stack: {entry['error']}")
        for number, sample in enumerate(entry.get("samples") or [], 1):
            lines.append(f"\nsample {number} (time {sample.get('time', 0):.3f})")
            if sample.get("error"):
                lines.append(f"  failed: {sample['error']}")
            for thread in sample.get("threads") or []:
                state = "active" if thread.get("active") else "idle"
                lines.append(f"  Thread {thread.get('os_thread_id')} ({state}): {thread.get('thread_name')!r}")
                lines.extend("      " + frame_text(f) for f in thread.get("frames") or [])
        with open(os.path.join(outdir, f"rank-{rank}.txt"), "w") as fh:
            fh.write("\n".join(lines) + "\n")


def read_stdin() -> tuple[dict[str, Any], bytes]:
    """The JSON line, and whatever follows it (``install``'s bytes)."""
    data = b""
    while b"\n" not in data:
        chunk = os.read(0, 65536)
        if not chunk:
            break
        data += chunk
    line, _, rest = data.partition(b"\n")
    request: dict[str, Any] = json.loads(line)
    if request.get("op") == "install":
        size = int(request["size"])
        parts = [rest]
        got = len(rest)
        while got < size:
            chunk = os.read(0, min(1 << 20, size - got))
            if not chunk:
                break
            parts.append(chunk)
            got += len(chunk)
        rest = b"".join(parts)
    return request, rest


def answer(request: dict[str, Any], data: bytes) -> dict[str, Any]:
    op = request.get("op")
    if op == "have":
        return have(request)
    if op == "install":
        return install(request, data)
    if op == "take":
        return take(request)
    return {"error": f"unknown op {op!r}"}


def main() -> None:
    request, data = read_stdin()
    sys.stdout.write(json.dumps(answer(request, data)) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
