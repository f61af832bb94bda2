"""Answers ``dlrun ps``, ``logs``, ``attach``, ``stop`` on one host, from ``~/.dlrun/jobs/``.

Shipped by ``dlrun.remote``'s loader; one JSON request on stdin after the source, one JSON
answer on stdout. Standard library only, Python >= 3.8. Requests: ``{"op": "ps"}``,
``{"op": "logs", "job", "offsets": {file: byte offset}}`` (whole lines from each offset, so
``--follow`` polls cheaply), ``{"op": "stop", "job"}`` (SIGTERM to the job's keeper, found by
its pid file and checked in ``/proc/<pid>/cmdline``) and ``{"op": "delete", "job"}``. Every
run first removes ended job folders older than ``KEEP_DAYS``.
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
READ_LIMIT = 1 << 20  # bytes of one log file per answer


def jobs_root() -> str:
    return os.path.join(os.path.expanduser("~"), ".dlrun", "jobs")


def keeper_pid(jobdir: str, job_id: str) -> int | None:
    """The pid of the job's keeper while it lives (its command line names the job), else None."""
    try:
        with open(os.path.join(jobdir, "keeper.pid")) as fh:
            pid = int(fh.read().strip())
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            argv = fh.read().split(b"\0")
    except (OSError, ValueError):
        return None
    if b"dlrun-keeper" in argv and job_id.encode() in argv:
        return pid
    return None


def read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as fh:
            document: dict[str, Any] = json.load(fh)
    except (OSError, ValueError):
        return None
    return document


def job_record(job_id: str) -> dict[str, Any] | None:
    """The job's record on this host: its result once ended, else its state; a keeper that died
    before the end (a reboot, a kill -9) leaves the job ``lost``."""
    jobdir = os.path.join(jobs_root(), job_id)
    if not os.path.isdir(jobdir):
        return None
    record = read_json(os.path.join(jobdir, "result.json"))
    alive = keeper_pid(jobdir, job_id) is not None
    if record is None:
        record = read_json(os.path.join(jobdir, "state.json")) or {"job_id": job_id, "state": "starting"}
        if not alive:
            record["state"] = "lost"
            record.setdefault("root_cause", None)
            record["root_cause"] = record["root_cause"] or "the job's keeper on this host is gone"
    record["alive"] = alive
    return record


def prune(now: float) -> None:
    """Remove job folders whose keeper is gone and that did not change for ``KEEP_DAYS``."""
    root = jobs_root()
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        jobdir = os.path.join(root, name)
        try:
            age = now - max(os.stat(os.path.join(jobdir, f)).st_mtime for f in os.listdir(jobdir) or ["."])
        except (OSError, ValueError):
            continue
        if age > KEEP_DAYS * 86400 and keeper_pid(jobdir, name) is None:
            shutil.rmtree(jobdir, ignore_errors=True)


def logs(job_id: str, offsets: dict[str, int]) -> dict[str, Any]:
    """Each rank log's whole lines from its offset; the job's record."""
    jobdir = os.path.join(jobs_root(), job_id)
    files: dict[str, Any] = {}
    for attempt in sorted(os.listdir(jobdir)) if os.path.isdir(jobdir) else []:
        folder = os.path.join(jobdir, attempt)
        if not attempt.startswith("attempt-") or not os.path.isdir(folder):
            continue
        for name in sorted(os.listdir(folder)):
            if not name.endswith(".log"):
                continue
            key = attempt + "/" + name
            offset = int(offsets.get(key, 0))
            with open(os.path.join(folder, name), "rb") as fh:
                fh.seek(offset)
                data = fh.read(READ_LIMIT)
            end = data.rfind(b"\n") + 1
            files[key] = {"offset": offset + end, "text": data[:end].decode("utf-8", "replace")}
    return {"files": files, "job": job_record(job_id)}


def stop(job_id: str) -> dict[str, Any]:
    pid = keeper_pid(os.path.join(jobs_root(), job_id), job_id)
    if pid is not None:
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pid = None
    return {"signalled": pid is not None, "job": job_record(job_id)}


def delete(job_id: str) -> dict[str, Any]:
    jobdir = os.path.join(jobs_root(), job_id)
    if keeper_pid(jobdir, job_id) is not None:
        return {"deleted": False, "error": "the job is running: dlrun stop it first"}
    if not os.path.isdir(jobdir):
        return {"deleted": False}
    shutil.rmtree(jobdir, ignore_errors=True)
    return {"deleted": True}


def answer(request: dict[str, Any]) -> dict[str, Any]:
    prune(time.time())
    op = request.get("op")
    job_id = str(request.get("job", ""))
    if op != "ps" and (not job_id or "/" in job_id or job_id.startswith(".")):
        return {"error": f"bad job id {job_id!r}"}
    if op == "ps":
        root = jobs_root()
        names = sorted(os.listdir(root)) if os.path.isdir(root) else []
        return {"jobs": [r for r in (job_record(n) for n in names) if r is not None]}
    if op == "state":
        return {"job": job_record(job_id)}
    if op == "logs":
        return logs(job_id, {str(k): int(v) for k, v in (request.get("offsets") or {}).items()})
    if op == "stop":
        return stop(job_id)
    if op == "delete":
        return delete(job_id)
    return {"error": f"unknown op {op!r}"}


def main() -> None:
    data = b""
    while True:
        chunk = os.read(0, 65536)
        if not chunk:
            break
        data += chunk
    sys.stdout.write(json.dumps(answer(json.loads(data))) + "\n")


if __name__ == "__main__":
    main()
