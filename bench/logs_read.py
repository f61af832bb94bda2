#!/usr/bin/env python3
"""Reading a detached job's logs home: ``dlrun logs JOB`` against ``ssh host cat`` of the same files.

A detached job runs on N fixture hosts (``tests/support/sshd_cluster.py``) and ends; then each
rank's ``rank-N.log`` is grown to ``--mb`` MB of numbered lines on its host. Timed, interleaved,
``--repeat`` times, each a fresh process with its output to a file (lines of a training log
with random hex in them: zlib shrinks them about as much as real logs):

* **dlrun**: ``dlrun logs JOB --hosts hosts.toml --ssh-config <cfg>`` (every byte, prefixed
  ``[rank host] ``, streamed by ``dlrun-jobs`` in pieces);
* **ssh**: one ``ssh -F <cfg> host cat <rank log>`` per rank, all in parallel (OpenSSH, no prefix);
* ``--proto NAME=DIR``: ``dlrun logs`` of another copy of the package (``PYTHONPATH=DIR``, e.g. a
  worktree of ``main`` for the code before a change), as a column NAME.

The tools run in a shuffled order in every repeat, so that other load on the machine hits them
alike. The table gives MB/s of log read home (the file sizes over the median wall time), the
client's CPU seconds, and each tool's rate as a ratio of ssh's: the median of the ratios within
each repeat (the same load), with their range (goal ≥ 0.5). Every dlrun output is checked: every
line, in order, per rank.

    python bench/logs_read.py                   # --hosts 2 --mb 100 --repeat 3
    python bench/logs_read.py --hosts 2 --mb 2 --repeat 1
    python bench/logs_read.py --repeat 8 --proto main=/work/main
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from launch import (
    client_cpu,
    dlrun_env,
    make_base_dir,
    median,
    scripts_dir,
    start_bench_cluster,
    write_hosts_toml,
    write_script,
)


def line(i: int, noise: bytes) -> bytes:
    """100 bytes like a training log's line: a number, a few values and random hex (which keeps
    zlib from shrinking it more than real logs shrink, about 2-3 times)."""
    return b"%09d step loss=%.6f lr=%.3e grad=%.4f %s\n" % (i, 1 / (i + 1), 1e-3, i % 97 / 7, noise)


def grow(path: Path, mb: int, owner: tuple[int, int]) -> int:
    """Make ``path`` ``mb`` MB of numbered lines; its size."""
    lines = mb * 10_000
    with open(path, "wb") as fh:
        for start in range(0, lines, 10_000):
            noise = os.urandom(10_000 * 19).hex().encode()
            fh.write(b"".join(line(i, noise[38 * (i - start): 38 * (i - start) + 38])
                              for i in range(start, min(lines, start + 10_000))))
    os.chown(path, *owner)
    return path.stat().st_size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--mb", type=int, default=100, help="MB of log per rank")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--proto", action="append", default=[], metavar="NAME=DIR",
                        help="also time dlrun logs of the dlrun package in DIR, as column NAME")
    args = parser.parse_args()
    protos = dict(p.split("=", 1) for p in args.proto)
    base = make_base_dir()
    cluster = start_bench_cluster(args.hosts, base, args.python)
    jobs_dir = Path(os.path.expanduser(f"~{cluster.user}")) / ".dlrun" / "jobs"
    job = ""
    try:
        hosts = write_hosts_toml(cluster, base / "hosts.toml", args.hosts, args.python)
        script = write_script(scripts_dir(base), "quick.py", "print('started')\n")
        common = ["--hosts", str(hosts), "--ssh-config", str(cluster.ssh_config)]
        env = dlrun_env()
        out = subprocess.run([sys.executable, "-m", "dlrun", "launch", "--detach", "--framework", "none", *common,
                              str(script)], capture_output=True, text=True, env=env, cwd=base, timeout=120)
        match = re.search(r"detached job ([\w-]+)", out.stdout)
        if out.returncode != 0 or not match:
            print(out.stdout + out.stderr, file=sys.stderr)
            return 1
        job = match.group(1)
        home = Path(os.path.expanduser(f"~{cluster.user}"))
        for _ in range(100):  # the job ends at once; its result is written last
            if all((home / ".dlrun" / "jobs" / job / f"host-{h.name}" / "result.json").exists()
                   for h in cluster.hosts[: args.hosts]):
                break
            time.sleep(0.2)
        owner = (os.stat(home).st_uid, os.stat(home).st_gid)
        files = sorted((home / ".dlrun" / "jobs" / job).glob("host-*/attempt-0/rank-*.log"))
        total = sum(grow(f, args.mb, owner) for f in files)
        print(f"{len(files)} rank logs of {args.mb} MB on {args.hosts} hosts ({total / 1e6:.0f} MB in all)\n")
        tools = ["dlrun", *protos, "ssh"]
        rows: dict[str, list[float]] = {tool: [] for tool in tools}
        cpu: dict[str, list[float]] = {tool: [] for tool in tools}
        lost = 0
        for _ in range(args.repeat):
            for tool in random.sample(tools, len(tools)):
                before = client_cpu()
                started = time.monotonic()
                if tool == "ssh":
                    procs = []
                    for f in files:
                        host = f.parts[-3].removeprefix("host-")
                        sink = open(base / f"ssh-{host}-{f.name}", "wb")  # noqa: SIM115 - closed below
                        procs.append((sink, subprocess.Popen(["ssh", "-F", str(cluster.ssh_config), host, "cat",
                                                              str(f)], stdout=sink)))
                    for sink, proc in procs:
                        proc.wait(600)
                        sink.close()
                else:
                    tool_env = env if tool == "dlrun" else dlrun_env(protos[tool])
                    with open(base / "dlrun.out", "wb") as sink:
                        code = subprocess.run([sys.executable, "-m", "dlrun", "logs", job, *common], stdout=sink,
                                              env=tool_env, cwd=base, timeout=600).returncode
                    if code != 0:
                        print(f"{tool}: dlrun logs exited with {code}", file=sys.stderr)
                        return code
                rows[tool].append(time.monotonic() - started)
                cpu[tool].append(client_cpu() - before)
                if tool != "ssh":
                    lost += check(base / "dlrun.out", len(files), args.mb * 10_000)
        rate = {tool: total / 1e6 / median(times) for tool, times in rows.items()}
        print("| tool | wall s (median) | MB/s | client CPU s | × ssh (median of repeats) | range |")
        print("|---|---|---|---|---|---|")
        for tool in tools:
            ratios = sorted(s / d for s, d in zip(rows["ssh"], rows[tool], strict=True))
            print(f"| {tool} | {median(rows[tool]):.2f} | {rate[tool]:.0f} | {median(cpu[tool]):.2f} |"
                  f" {median(ratios):.2f} | {ratios[0]:.2f}–{ratios[-1]:.2f} |")
        print(f"\nlines lost or out of order in dlrun's output: {lost}")
        return 0 if lost == 0 else 1
    finally:
        cluster.stop(remove=True)
        if job:  # its logs are hundreds of MB, in the login user's home
            shutil.rmtree(jobs_dir / job, ignore_errors=True)


def check(output: Path, ranks: int, lines: int) -> int:
    """How many lines of ``dlrun logs``' output are missing or out of order (every rank: 0 … lines-1)."""
    seen: dict[str, int] = {}
    bad = 0
    with open(output, "rb") as fh:
        for text in fh:
            prefix, _, rest = text.partition(b"] ")
            number = int(rest[:9]) if rest[:9].isdigit() else -1
            if number < 0:
                continue
            key = prefix.decode()
            if number != seen.get(key, 0):
                bad += 1
            seen[key] = number + 1
    return bad + sum(lines - n for n in seen.values()) + (ranks - len(seen)) * lines


if __name__ == "__main__":
    sys.exit(main())
