#!/usr/bin/env python3
"""One host's side of a launch, replayed: the hosts' CPU per host without sshd or the client.

``capture`` runs a real 1-host ``dlrun launch`` of ``trivial.py`` on a bench sshd host (as
``bench/launch.py`` does) with the SSH channel's ``send`` recorded, and writes what the client
sent to the agent's channel: the boot script, the loader's payload, the questions before the
spec (watch, survey, ports, probe) and the spec. ``replay`` then plays each capture as the login
user, the way sshd would start it (the login shell with ``-c 'exec /bin/sh -s'``, a clean
environment, the user's home), waiting where the client waits (the start marker, the answers
before the spec, DONE), and reports the CPU of everything the session ran (``RUSAGE_CHILDREN``)
and when each frame came. Captures are interleaved in a shuffled order in each repeat.

    python bench/host_session.py capture --tree /work/main --out /tmp/hs/main.json --dir /tmp/hs
    python bench/host_session.py replay /tmp/hs/main.json /tmp/hs/new.json --repeat 20

Run as root (the session runs as the bench cluster's login user). ``--dir`` keeps the cluster's
files (the pushed script, the log folder) that the spec names; the sshd listener is stopped
after the capture.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import pwd
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import launch as bench_launch

from dlrun.remote.agent import FrameDecoder

KINDS = {1: "hello", 2: "started", 5: "exit", 7: "done", 8: "probe", 9: "survey", 12: "ports"}
ANSWERS = {"probe": 8, "survey": 9, "ports": 12}

CAPTURE_HOOK = r"""
import json, sys, base64
import dlrun.transport.ssh as ssh
log = []
open_ = ssh.SSHTransport.open
send_ = ssh.SSHChannel.send
def opened(self, host, argv):
    ch = open_(self, host, argv)
    log.append({"argv": list(argv), "sends": []})
    ch._capture = log[-1]
    return ch
def send(self, data):
    rec = getattr(self, "_capture", None)
    if rec is not None:
        rec["sends"].append(base64.b64encode(bytes(data)).decode())
    return send_(self, data)
ssh.SSHTransport.open = opened
ssh.SSHChannel.send = send
orig_script = ssh.shell.boot_script
def boot_script(argv, token):
    out = orig_script(argv, token)
    log.append({"boot_script": base64.b64encode(out).decode(), "token": token})
    return out
ssh.shell.boot_script = boot_script
from dlrun.cli import main
try:
    main(sys.argv[2:])
finally:
    with open(sys.argv[1], "w") as fh:
        json.dump(log, fh)
"""


def capture(tree: str, out: Path, base: Path) -> None:
    base.mkdir(parents=True, exist_ok=True)
    base.chmod(0o755)
    cluster = bench_launch.start_bench_cluster(1, base, "/usr/bin/python3")
    try:
        scripts = bench_launch.scripts_dir(base)
        trivial = bench_launch.write_script(scripts, "trivial.py", bench_launch.TRIVIAL)
        bench = bench_launch.Bench(cluster=cluster, base=base, python="/usr/bin/python3", trivial=trivial)
        argv = bench.dlrun_argv(1)[3:]  # after "python -m dlrun"
        hook = CAPTURE_HOOK
        for _ in range(2):  # the first run pushes the script and fills the host's caches
            raw = out.with_suffix(".raw")
            done = subprocess.run([sys.executable, "-c", hook, str(raw), *argv], capture_output=True, text=True,
                                  cwd=base, env=bench_launch.dlrun_env(tree), timeout=120)
            if done.returncode != 0:
                raise RuntimeError(f"capture failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
        log = json.loads(raw.read_text())
        raw.unlink()
    finally:
        cluster.stop()
    boot = next(entry for entry in log if "boot_script" in entry and b"dlrun-agent" in
                base64.b64decode(entry["boot_script"]))
    channel = next(entry for entry in log if "sends" in entry and any("dlrun-agent" in a for a in entry["argv"]))
    sends = [base64.b64decode(s) for s in channel["sends"]]
    script = base64.b64decode(boot["boot_script"])
    if sends[0] == script:
        sends = sends[1:]
    stream = b"".join(sends)
    out.write_text(json.dumps({"tree": tree, "user": cluster.user, "token": boot["token"],
                               "boot_script": base64.b64encode(script).decode(),
                               "stream": base64.b64encode(stream).decode()}))
    print(f"captured {len(stream)} bytes after the boot script into {out}")


def split_stream(stream: bytes) -> tuple[bytes, list[dict[str, Any]], bytes]:
    """(the loader's payload, the JSON messages before the spec, the spec line)."""
    pos = 0
    if stream[:1] == b"+":
        pos = 10 + int(stream[1:10])
    pos += 10 + int(stream[pos:pos + 10])
    payload, rest = stream[:pos], stream[pos:]
    questions, spec = [], b""
    for line in rest.splitlines(keepends=True):
        message = json.loads(line)
        op = message.get("op", "start")
        if op == "start":
            spec = line
            break
        if op != "ping":
            questions.append(message)
    return payload, questions, spec


def read_frames(fd: int, decoder: FrameDecoder, t0: float, marks: dict[str, float], until: set[int] | None,
                counts: dict[int, int], need: dict[int, int], data: bytes = b"") -> None:
    """Count the agent's frames (``agent.FrameDecoder``) until one of ``until`` or ``need``'s
    counts came; ``data``: bytes already read after the start marker."""
    while True:
        for kind, _rank, _payload in decoder.feed(data):
            counts[kind] = counts.get(kind, 0) + 1
            if kind in KINDS:
                marks.setdefault(KINDS[kind], time.perf_counter() - t0)
        if until is not None and any(k in until for k in counts):
            return
        if need and all(counts.get(k, 0) >= n for k, n in need.items()):
            return
        data = os.read(fd, 65536)
        if not data:
            raise RuntimeError("the session ended early")


def session_env(user: pwd.struct_passwd) -> dict[str, str]:
    return {"HOME": user.pw_dir, "USER": user.pw_name, "LOGNAME": user.pw_name, "SHELL": user.pw_shell,
            "PATH": "/usr/local/bin:/usr/bin:/bin:/usr/games", "LANG": "C.UTF-8"}


def replay_once(cap: dict[str, Any]) -> dict[str, float]:
    user = pwd.getpwnam(cap["user"])
    script = base64.b64decode(cap["boot_script"])
    payload, questions, spec = split_stream(base64.b64decode(cap["stream"]))
    mark = f"dlrun-start-{cap['token']}\n".encode()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.Popen([user.pw_shell, "-c", "exec /bin/sh -s"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, user=user.pw_uid, group=user.pw_gid, extra_groups=[],
                            env=session_env(user), cwd=user.pw_dir)
    assert proc.stdin is not None and proc.stdout is not None
    fd = proc.stdout.fileno()
    proc.stdin.write(script)
    proc.stdin.flush()
    got = b""
    while mark not in got:
        data = os.read(fd, 65536)
        if not data:
            raise RuntimeError("no start marker")
        got += data
    marks: dict[str, float] = {"marker": time.perf_counter() - t0}
    buf = FrameDecoder()
    proc.stdin.write(payload + b"".join(json.dumps(q).encode() + b"\n" for q in questions))
    proc.stdin.flush()
    counts: dict[int, int] = {}
    need = {ANSWERS[q["op"]]: 1 for q in questions if q.get("op") in ANSWERS}
    need[1] = 1
    read_frames(fd, buf, t0, marks, None, counts, need, got.partition(mark)[2])
    proc.stdin.write(spec)
    proc.stdin.flush()
    read_frames(fd, buf, t0, marks, {7}, counts, {})
    marks["done_at_client"] = time.perf_counter() - t0
    proc.stdin.close()  # the client hangs up after DONE
    proc.stdout.close()
    proc.wait()
    marks["wall"] = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    marks["cpu"] = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return marks


def replay(paths: list[Path], repeat: int, seed: int) -> dict[str, Any]:
    caps = {p.stem: json.loads(p.read_text()) for p in paths}
    rng = random.Random(seed)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in caps}
    loads = []
    for name in caps:  # warm each once: the code cache, the page cache
        replay_once(caps[name])
    for _ in range(repeat):
        order = list(caps)
        rng.shuffle(order)
        loads.append(os.getloadavg()[0])
        for name in order:
            runs[name].append(replay_once(caps[name]))
    table = {}
    for name, samples in runs.items():
        keys = sorted({k for s in samples for k in s})
        table[name] = {k: statistics.median(s[k] for s in samples if k in s) for k in keys}
    return {"load": [min(loads), statistics.median(loads), max(loads)], "median": table, "runs": runs}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("capture")
    c.add_argument("--tree", required=True, help="PYTHONPATH of the dlrun copy that launches")
    c.add_argument("--out", required=True, type=Path)
    c.add_argument("--dir", required=True, type=Path, help="the bench cluster's folder (kept)")
    r = sub.add_parser("replay")
    r.add_argument("captures", nargs="+", type=Path)
    r.add_argument("--repeat", type=int, default=15)
    r.add_argument("--seed", type=int, default=1)
    r.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.cmd == "capture":
        capture(args.tree, args.out, args.dir)
        return 0
    result = replay(args.captures, args.repeat, args.seed)
    load = result["load"]
    print(f"load {load[0]:.1f}-{load[2]:.1f} (median {load[1]:.1f}); medians in ms")
    cols = ["cpu", "wall", "marker", "hello", "survey", "ports", "probe", "started", "exit", "done", "done_at_client"]
    print("| capture | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for name, med in result["median"].items():
        print(f"| {name} | " + " | ".join(f"{med[c] * 1000:.1f}" if c in med else "" for c in cols) + " |")
    if args.json:
        args.json.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
