#!/usr/bin/env python3
"""Log throughput: ``dlrun launch --plain`` against a raw paramiko reader, N hosts × M numbered lines.

Every fixture host (``tests/support/sshd_cluster.py``) runs ``<python> lines.py M``, which prints ``0`` …
``M-1``, one number a line. Two ways to bring the lines home, each a fresh process, each run
``--repeat`` times, interleaved:

* **dlrun**: ``dlrun launch --plain --hosts hosts.toml --ssh-config <cfg> --log-dir <dir>
  lines.py M`` with stdout to a file (``--out``; ``/dev/null`` skips the check of the screen
  output). dlrun frames the output on the host (agent), splits lines, writes ``rank-N.log`` and
  prints ``[rank host] N``.
* **raw**: a minimal paramiko program (``RAW_READER``): one connection per host (same ssh_config,
  key, known_hosts, TCP_NODELAY), one exec channel running the same command, 64 KiB
  ``recv`` chunks split into lines, one thread per host.

Both are also run with a 1-line job: its wall time is the tool's fixed cost (interpreter,
imports, connect, agent or exec start, teardown), so the table shows end-to-end lines/s and the
net rate ``lines / (wall − wall of the 1-line job)``, plus client CPU per line. Checks: every
rank's ``rank-N.log`` and its ``[rank host] N`` lines in the output file (and every raw stream)
must be exactly ``0`` … ``M-1`` in order: lines lost, duplicated or reordered are counted.

``--profile`` runs dlrun once more under py-spy (``--py-spy PATH``, all threads) and prints where
its CPU goes (self time by function and by thread).

    python bench/logs.py                        # --hosts 8 --lines 200000 --repeat 3
    python bench/logs.py --hosts 2 --lines 1000 --repeat 1
    python bench/logs.py --profile --py-spy /tmp/pyspy-venv/bin/py-spy
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from launch import (
    client_cpu,
    dlrun_env,
    host_cpu,
    load1,
    machine_info,
    make_base_dir,
    median,
    print_machine,
    scripts_dir,
    settle,
    start_bench_cluster,
    write_hosts_toml,
    write_script,
)

TARGET_RATIO = 0.9
LINES_SCRIPT = "import sys\nfor i in range(int(sys.argv[1])):\n    print(i)\n"

# The raw reader runs as `python -c RAW_READER T0 ssh_config host,host,… command N`: nothing but
# paramiko is imported; it prints JSON (times relative to the parent's T0, counts, check results).
RAW_READER = r"""
import json, socket, sys, threading, time
T0 = float(sys.argv[1])
CFG, HOSTS, COMMAND, N = sys.argv[2], sys.argv[3].split(","), sys.argv[4], int(sys.argv[5])
import paramiko
config = paramiko.SSHConfig.from_path(CFG)
results = {}

def one(host):
    c = config.lookup(host)
    sock = socket.create_connection((c["hostname"], int(c.get("port", 22))), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    client = paramiko.SSHClient()
    client.load_host_keys(c["userknownhostsfile"].split()[0])
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    client.connect(c["hostname"], port=int(c.get("port", 22)), username=c["user"], key_filename=c["identityfile"],
                   look_for_keys=False, allow_agent=False, sock=sock, timeout=10)
    connected = time.time() - T0
    chan = client.get_transport().open_session()
    chan.exec_command(COMMAND)
    chunks, carry, count = [], b"", 0
    while True:
        data = chan.recv(65536)
        if not data:
            break
        chunks.append(data)
        lines = (carry + data).split(b"\n")
        carry = lines.pop()
        count += len(lines)
    status = chan.recv_exit_status()
    results[host] = {"connected": connected, "done": time.time() - T0, "lines": count, "status": status,
                     "data": b"".join(chunks)}
    client.close()

threads = [threading.Thread(target=one, args=(h,)) for h in HOSTS]
for t in threads:
    t.start()
for t in threads:
    t.join()
end = time.time() - T0
expected = "".join("%d\n" % i for i in range(N)).encode()
out = {"end": end, "hosts": {}}
for host, r in results.items():
    data = r.pop("data")
    r["exact"] = data == expected
    if not r["exact"]:
        got = [int(x) for x in data.split()]
        r["lost"] = len(set(range(N)) - set(got))
        r["reordered"] = sum(1 for a, b in zip(got, got[1:]) if b < a)
    out["hosts"][host] = r
print(json.dumps(out))
"""


@dataclass
class Run:
    tool: str
    lines_per_host: int
    hosts: int
    wall: float
    client_cpu: float
    host_cpu: float
    lost: int
    reordered: int
    load1: float


def check_sequence(got: Sequence[str], n: int) -> tuple[int, int]:
    """Against 0 … n-1: (lines lost, lines out of place: order going backwards, duplicates, garbage)."""
    if len(got) == n and all(x == str(i) for i, x in enumerate(got)):
        return 0, 0
    nums = [int(x) for x in got if x.isdigit()]
    lost = len(set(range(n)) - set(nums))
    backwards = sum(1 for a, b in itertools.pairwise(nums) if b < a)
    return lost, backwards + (len(nums) - len(set(nums))) + (len(got) - len(nums))


def check_dlrun(log_root: Path, out_file: Path | None, ranks: int, n: int) -> tuple[int, int, list[str]]:
    """Check the newest job's rank-N.log files and the plain output; (lost, reordered, notes)."""
    job = max(log_root.iterdir(), key=lambda p: p.stat().st_mtime)
    lost = reordered = 0
    notes = []
    for rank in range(ranks):
        path = job / f"rank-{rank}.log"
        got = path.read_text().splitlines() if path.exists() else []
        a, b = check_sequence(got, n)
        lost, reordered = lost + a, reordered + b
        if a or b:
            notes.append(f"{path.name}: {a} lost, {b} out of order")
    if out_file is not None:
        groups: dict[str, list[str]] = {}
        for line in out_file.read_text().splitlines():
            if line.startswith("["):
                head, _, tail = line.partition("] ")
                groups.setdefault(head, []).append(tail)
        for rank in range(ranks):
            got = groups.get(f"[{rank} host{rank}", [])
            a, b = check_sequence(got, n)
            lost, reordered = lost + a, reordered + b
            if a or b:
                notes.append(f"output of rank {rank}: {a} lost, {b} out of order")
    return lost, reordered, notes


class LogBench:
    def __init__(self, cluster: Any, base: Path, python: str, out: str, protos: dict[str, str]) -> None:
        self.cluster = cluster
        self.base = base
        self.python = python
        self.out = out
        self.protos = protos
        self.script = write_script(scripts_dir(base), "lines.py", LINES_SCRIPT)
        self.log_root = base / "dlrun-logs"
        self.tomls: dict[int, Path] = {}

    def toml(self, hosts: int) -> Path:
        if hosts not in self.tomls:
            self.tomls[hosts] = write_hosts_toml(self.cluster, self.base / f"hosts-{hosts}.toml", hosts, self.python)
        return self.tomls[hosts]

    def dlrun_variant(self, tool: str) -> tuple[str | None, list[str]] | None:
        base, *flags = tool.split("+")
        if base == "dlrun":
            return None, flags
        if base in self.protos:
            return self.protos[base], flags
        return None

    def dlrun_argv(self, hosts: int, n: int, flags: Sequence[str]) -> list[str]:
        return [sys.executable, "-m", "dlrun", "launch", "--plain", "--hosts", str(self.toml(hosts)), "--ssh-config",
                str(self.cluster.ssh_config), "--log-dir", str(self.log_root), *flags, str(self.script), str(n)]

    def run(self, tool: str, hosts: int, n: int, check: bool = True) -> Run:
        settle(self.cluster)
        load = load1()
        cpu0, hcpu0 = client_cpu(), host_cpu(self.cluster)
        if tool.split("+")[0] == "raw":
            wall, lost, reordered = self._raw(hosts, n, unbuffered="+unbuffered" in tool)
        else:
            wall, lost, reordered = self._dlrun(tool, hosts, n, check)
        cpu1 = client_cpu()
        settle(self.cluster)
        return Run(tool, n, hosts, wall, cpu1 - cpu0, host_cpu(self.cluster) - hcpu0, lost, reordered, load)

    def _dlrun(self, tool: str, hosts: int, n: int, check: bool) -> tuple[float, int, int]:
        variant = self.dlrun_variant(tool)
        assert variant is not None
        path, flags = variant
        out_path = Path(self.out) if self.out == os.devnull else self.base / "dlrun-out.txt"
        with open(out_path, "w") as out:
            t0 = time.perf_counter()
            proc = subprocess.run(self.dlrun_argv(hosts, n, flags), stdout=out, stderr=subprocess.PIPE, text=True,
                                  cwd=self.base, env=dlrun_env(path), timeout=600)
            wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"{tool} failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
        if not check:
            return wall, 0, 0
        lost, reordered, notes = check_dlrun(self.log_root, None if self.out == os.devnull else out_path, hosts, n)
        for note in notes[:8]:
            print(f"  {tool}: {note}", file=sys.stderr)
        return wall, lost, reordered

    def _raw(self, hosts: int, n: int, unbuffered: bool) -> tuple[float, int, int]:
        names = ",".join(h.name for h in self.cluster.hosts[:hosts])
        command = f"{'env PYTHONUNBUFFERED=1 ' if unbuffered else ''}{self.python} {self.script} {n}"
        t0 = time.time()
        proc = subprocess.run([sys.executable, "-c", RAW_READER, repr(t0), str(self.cluster.ssh_config), names,
                               command, str(n)], capture_output=True, text=True, timeout=600, env=dlrun_env())
        if proc.returncode != 0:
            raise RuntimeError(f"raw reader failed: {proc.stderr[-2000:]}")
        result = json.loads(proc.stdout)
        lost = reordered = 0
        for host, r in result["hosts"].items():
            if r["status"] != 0 or r["lines"] != n:
                print(f"  raw: {host}: exit {r['status']}, {r['lines']} lines", file=sys.stderr)
            lost += r.get("lost", 0) if not r["exact"] else 0
            reordered += r.get("reordered", 0)
        lost += n * (hosts - len(result["hosts"]))
        return float(result["end"]), lost, reordered


def summary(runs: Sequence[Run], tools: Sequence[str], hosts: int, n: int) -> tuple[str, dict[str, dict[str, float]]]:
    stats: dict[str, dict[str, float]] = {}
    for tool in tools:
        big = [r for r in runs if r.tool == tool and r.lines_per_host == n]
        small = [r for r in runs if r.tool == tool and r.lines_per_host == 1]
        wall, fixed = median([r.wall for r in big]), median([r.wall for r in small])
        total = n * hosts
        cpu_line = (median([r.client_cpu for r in big]) - median([r.client_cpu for r in small])) / total
        stats[tool] = {
            "wall": wall,
            "fixed": fixed,
            "rate": total / wall,
            "net_rate": total / (wall - fixed) if wall > fixed else float("nan"),
            "client_cpu": median([r.client_cpu for r in big]),
            "host_cpu": median([r.host_cpu for r in big]),
            "us_per_line": cpu_line * 1e6,
            "lost": sum(r.lost for r in big),
            "reordered": sum(r.reordered for r in big),
            "runs": len(big),
        }
    rows = ["| tool | wall s | lines/s end-to-end | 1-line job s | net lines/s | client CPU s | client CPU µs/line | "
            "hosts CPU s | lost | reordered |", "|---|---|---|---|---|---|---|---|---|---|"]
    for tool, s in stats.items():
        rows.append(f"| {tool} | {s['wall']:.2f} | {s['rate']:,.0f} | {s['fixed']:.2f} | {s['net_rate']:,.0f} | "
                    f"{s['client_cpu']:.2f} | {s['us_per_line']:.2f} | {s['host_cpu']:.2f} | {s['lost']:.0f} | "
                    f"{s['reordered']:.0f} |")
    return "\n".join(rows), stats


# --------------------------------------------------------------------------- --profile (py-spy)


def profile(bench: LogBench, hosts: int, n: int, py_spy: str, tool: str) -> str:
    raw = bench.base / "profile.txt"
    variant = bench.dlrun_variant(tool)
    assert variant is not None
    path, flags = variant
    argv = [py_spy, "record", "--threads", "--format", "raw", "--rate", "250", "--nonblocking", "-o", str(raw), "--",
            *bench.dlrun_argv(hosts, n, flags)]
    settle(bench.cluster)
    with open(os.devnull, "w") as devnull:
        proc = subprocess.run(argv, stdout=devnull, stderr=subprocess.PIPE, text=True, cwd=bench.base,
                              env=dlrun_env(path), timeout=600)
    if proc.returncode != 0 or not raw.exists():
        return f"py-spy failed (exit {proc.returncode}): {proc.stderr[-1000:]}"
    by_func: Counter[str] = Counter()
    by_thread: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        total += count
        name = frames[0].split("): ", 1)[1] if "): " in frames[0] else "(no name)"
        by_thread[re.sub(r"\d+", "N", name)[:50]] += count
        leaf = frames[-1] if len(frames) > 1 else "(native / idle)"
        leaf = re.sub(r":\d+\)$", ")", leaf)  # per function, not per line
        by_func[re.sub(r"\(/.*/", "(", leaf)[:110]] += count
    lines = [f"py-spy: {total} samples at 250/s of on-CPU time in dlrun's process ({total / 250:.2f} s), "
             f"{hosts} hosts × {n} lines", "", "| thread | share |", "|---|---|"]
    lines += [f"| {k} | {v / total:.0%} |" for k, v in by_thread.most_common(8)]
    lines += ["", "| function (self time) | share |", "|---|---|"]
    lines += [f"| `{k}` | {v / total:.1%} |" for k, v in by_func.most_common(25)]
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hosts", type=int, default=8, help="hosts, one rank each (default 8)")
    p.add_argument("--lines", type=int, default=200_000, help="lines per rank (default 200000)")
    p.add_argument("--repeat", type=int, default=3, help="runs per tool (median; default 3)")
    p.add_argument("--tools", default="dlrun,raw,raw+unbuffered",
                   help="dlrun, raw, raw+unbuffered (the command under PYTHONUNBUFFERED=1, as dlrun starts ranks),\n"
                        "dlrun+OPTION e.g. dlrun+--env=PYTHONUNBUFFERED= (default dlrun,raw,raw+unbuffered)")
    p.add_argument("--proto", action="append", default=[], metavar="NAME=DIR",
                   help="a prototype copy of dlrun (PYTHONPATH=DIR) as an extra tool NAME (repeatable)")
    p.add_argument("--python", default=shutil.which("python3", path="/usr/bin:/bin") or "python3",
                   help="interpreter on the hosts (default /usr/bin/python3)")
    p.add_argument("--out", default="file", help="dlrun's stdout: 'file' (checked) or /dev/null")
    p.add_argument("--profile", action="store_true", help="one extra dlrun run under py-spy")
    p.add_argument("--profile-tool", default="dlrun", help="which dlrun variant --profile runs (default dlrun)")
    p.add_argument("--py-spy", default=shutil.which("py-spy") or "/tmp/pyspy-venv/bin/py-spy")
    p.add_argument("--json", help="write every run to this file")
    p.add_argument("--keep", action="store_true", help="keep the /tmp/dlrun-bench-* directory")
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    protos = dict(item.split("=", 1) for item in args.proto)
    tools = [t for t in args.tools.split(",") if t] + [p for p in protos if p not in args.tools.split(",")]
    base = make_base_dir()
    cluster = None
    try:
        cluster = start_bench_cluster(args.hosts, base, args.python)
        bench = LogBench(cluster, base, args.python, args.out, protos)
        info = machine_info(cluster, args.python)
        print(f"# log throughput: {', '.join(tools)}; {args.hosts} hosts × {args.lines:,} lines, median of "
              f"{args.repeat}\n")
        print_machine(info)
        for tool in tools:  # warm-up, not counted
            bench.run(tool, args.hosts, min(args.lines, 1000))
        rng = random.Random(args.seed)
        runs: list[Run] = []
        for rep in range(args.repeat):
            order = [(t, n) for t in tools for n in (1, args.lines)]
            rng.shuffle(order)
            for tool, n in order:
                runs.append(bench.run(tool, args.hosts, n))
            print(f"repeat {rep + 1}/{args.repeat} done, load {load1():.2f}", file=sys.stderr)
        table, stats = summary(runs, tools, args.hosts, args.lines)
        print(table)
        loads = [r.load1 for r in runs]
        print(f"\nnet lines/s = lines / (wall − wall of the same tool's 1-line job); client CPU µs/line = (CPU of "
              f"the big job − CPU of the 1-line job) / lines. dlrun's stdout: "
              f"{'/dev/null' if args.out == os.devnull else 'a file (checked)'}. 1-min load average during the "
              f"runs: min {min(loads):.2f}, median {median(loads):.2f}, max {max(loads):.2f}.")
        if "dlrun" in stats and "raw" in stats:
            d, r = stats["dlrun"], stats["raw"]
            ratio, net = d["rate"] / r["rate"], d["net_rate"] / r["net_rate"]
            lost = d["lost"] + d["reordered"]
            verdict = "met" if net >= TARGET_RATIO and lost == 0 else "NOT met"
            print(f"dlrun/raw lines/s: {ratio:.2f}× end-to-end, {net:.2f}× net; lost or reordered lines: "
                  f"{lost:.0f} — target ≥ {TARGET_RATIO}× and 0 lost: {verdict}")
        prof = ""
        if args.profile:
            if not os.path.exists(args.py_spy):
                prof = f"py-spy not found at {args.py_spy}: pip install py-spy (into any venv) and pass --py-spy"
            else:
                prof = profile(bench, args.hosts, args.lines, args.py_spy, args.profile_tool)
            print(f"\n## where dlrun's CPU goes ({args.profile_tool})\n\n{prof}")
        if args.json:
            Path(args.json).write_text(json.dumps({"machine": info, "runs": [asdict(r) for r in runs],
                                                   "stats": stats, "profile": prof}, indent=1))
        return 0
    finally:
        if cluster is not None:
            cluster.stop(remove=True)
        if args.keep:
            print(f"kept {base}", file=sys.stderr)
        else:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
