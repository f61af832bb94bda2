"""The executor side of the Spark engine: what each barrier task runs (``task_main``).

Standard library and pyspark only, nothing from dlrun: the driver pickles this module by
value (``cloudpickle.register_pickle_by_value``), so executors need pyspark and Python, not
dlrun. A task connects to the driver, picks a free port, waits at the barrier, says hello,
then starts the host agent through the bootstrap's loader (the driver sends the agent's
source on the socket first) and reports the agent's end (``TASK_END``) before the verdict.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import socket
import struct
import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

TASK_END = 100  # frame kind a task appends after its agent exited: {"code", "stderr"}
#: Stands for the executor's own python in the agent's argv the driver sends (it cannot know it).
EXECUTOR_PYTHON = "{executor python}"



def interface_holding(address: str) -> str | None:
    """The name of this machine's interface holding IPv4 ``address`` (Linux), else None."""
    try:
        import fcntl
    except ImportError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:  # SIOCGIFADDR: the interface's primary IPv4 address
                got = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(got[20:24]) == address:
                return name
    return None


_SPARK_WORKER_ENV = ("PYTHON_WORKER_", "PYTHON_UDF_", "PYTHON_DAEMON_", "_PYSPARK_", "SPARK_PYTHON_RUNTIME",
                     "SPARK_REUSE_WORKER", "SPARK_CONNECT_MODE", "SPARK_JOB_ARTIFACT_UUID", "SPARK_LOCAL_DIRS")


def rank_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """The task's environment without what Spark set up for its own Python worker: ranks get
    what an SSH host's would. Gone: the worker's secret (``PYTHON_WORKER_FACTORY_SECRET``, which
    authenticates it to the executor), Spark's worker settings, its default ``PYTHONHASHSEED=0``
    and pyspark's and py4j's entries in ``PYTHONPATH``. Kept: ``SPARK_HOME`` and the like, and
    ``OMP_NUM_THREADS`` (Spark sets it to the task's CPUs)."""
    env = {k: v for k, v in environ.items() if not k.startswith(_SPARK_WORKER_ENV)}
    if env.get("PYTHONHASHSEED") == "0":
        del env["PYTHONHASHSEED"]
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
             if p and not re.search(r"pyspark|py4j|spark-core", os.path.basename(p))]
    env.pop("PYTHONPATH", None)
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def task_main(setup: Mapping[str, Any], _rows: Iterable[Any]) -> Iterator[str]:
    import ctypes
    import signal
    import subprocess
    import tempfile

    pyspark = importlib.import_module("pyspark")
    ctx = pyspark.BarrierTaskContext.get()
    partition = int(ctx.partitionId())
    sock = socket.create_connection((setup["driver"][0], int(setup["driver"][1])), timeout=60)
    host = sock.getsockname()[0]  # the address on the route to the driver
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        port = int(probe.getsockname()[1])
    # the barrier: no task starts its agent before every task runs (and each learns the others)
    ctx.allGather(json.dumps({"host": host, "port": port}))
    resources = ctx.resources()
    gpus = [str(a) for a in resources["gpu"].addresses] if "gpu" in resources else []
    script = None
    if setup["archive"]:
        script = os.path.join(pyspark.SparkFiles.get(setup["archive"]), setup["script"])
    hello = {
        "token": setup["token"],
        "job_id": setup["job_id"],
        "partition": partition,
        "host": host,
        "port": port,
        "gpus": gpus,
        "python": sys.executable,
        "script": script,
        "pid": os.getpid(),
        "iface": interface_holding(host),
    }
    sock.settimeout(None)
    sock.sendall(json.dumps(hello).encode() + b"\n")

    # the agent: the socket is its stdin and stdout; its stderr goes to a file whose tail the
    # driver gets in TASK_END. It dies with this task: SIGHUP, not SIGTERM, because in a PID
    # namespace the child is `unshare --fork` (the wrapper execs it), which blocks SIGTERM and
    # SIGINT while it waits; SIGHUP ends unshare (whose --kill-child then ends the whole
    # namespace) or, without a namespace, makes the agent kill its ranks.
    parent = os.getpid()
    try:
        libc: Any = ctypes.CDLL(None, use_errno=True)
    except OSError:
        libc = None

    def die_with_parent() -> None:
        if libc is not None:
            libc.prctl(1, int(signal.SIGHUP), 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(1)

    # the bootstrap's loader (in the PID namespace wrapper): the agent's source comes on the socket
    argv = [sys.executable if arg == EXECUTOR_PYTHON else arg for arg in setup["agent_argv"]]
    with tempfile.TemporaryFile() as errors:
        try:
            proc = subprocess.Popen(argv, stdin=sock.fileno(), stdout=sock.fileno(), stderr=errors,
                                    env=rank_environ(os.environ), preexec_fn=die_with_parent)
            code = proc.wait()
            code = 128 - code if code < 0 else code
        except OSError as exc:
            code = 127
            errors.write(f"cannot start the dlrun agent with {sys.executable}: {exc}".encode())
        errors.seek(0)
        stderr = errors.read()[-8192:].decode(errors="replace")
    payload = json.dumps({"code": code, "stderr": stderr}).encode()
    sock.setblocking(True)  # the agent made the shared socket non-blocking
    verdict: dict[str, Any] | None = None
    try:
        sock.sendall(struct.pack(">BiI", TASK_END, -1, len(payload)) + payload)
        sock.shutdown(socket.SHUT_WR)
        buf = b""
        while verdict is None:
            data = sock.recv(65536)
            if not data:
                break
            buf += data
            while b"\n" in buf and verdict is None:
                line, _, buf = buf.partition(b"\n")
                try:
                    message = json.loads(line)
                except ValueError:
                    continue
                if isinstance(message, dict) and "verdict" in message:  # not a late "stop" for the agent
                    verdict = message
    except OSError:
        pass
    finally:
        sock.close()
    if verdict is None:
        raise RuntimeError(f"dlrun job {setup['job_id']}: the driver hung up before the job ended (agent exit {code})")
    if int(verdict["verdict"]) != 0:
        raise RuntimeError(f"dlrun job {setup['job_id']} failed: {verdict.get('message', '')}")
    yield json.dumps({"partition": partition, "host": host, "agent_exit": code})
