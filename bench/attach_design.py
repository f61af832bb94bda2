#!/usr/bin/env python3
"""Attached launch against "attached = detached + attach" (TorchX's ``run``: submit, then follow).

Two designs of ``dlrun launch`` without ``--detach``, both run with today's dlrun:

* ``attached``: today's launch: the client holds one channel per host; each host's agent stops
  its ranks when that channel ends (``docs/architecture.md``, Watchdog).
* ``detach+attach``: ``dlrun launch --detach`` (the keepers own the job), then ``dlrun attach
  JOB`` (polls the hosts' logs every 0.5 s): what the launch would be if it were built that way.

Latency: on localhost (``-n 2``) and on 2 and 4 sshd hosts (``tests/support/sshd_cluster.py``,
one rank each), the rank prints ``hello``, sleeps 1 s and exits 0. Per run: seconds from spawn
to the first rank line on the client's stdout (``first line``) and to the client's exit
(``exit``). Runs are interleaved (each repeat visits every setting and both designs, shuffled);
medians and the ratio detach+attach / attached.

Orphans (``--orphans``): a rank that sleeps 600 s, then the client is killed (SIGKILL), interrupted
(SIGINT, Ctrl-C) or loses its hosts (the sshd sessions serving it are killed, as a dropped network
does; sshd hosts only). Per design and event: how many of the job's processes (ranks, agents,
keepers) are left 20 s later, and how long until none (each host's ``dlrun stop`` cleans up after).

    python bench/attach_design.py --repeat 5 --orphans
    python bench/attach_design.py --settings local --repeat 1   # smoke

Run as root (the hosts log in as ``dlrun-test``). Numbers: ``docs/architecture.md``.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launch import (
    REPO,
    dlrun_env,
    load1,
    make_base_dir,
    median,
    scripts_dir,
    start_bench_cluster,
    write_hosts_toml,
    write_script,
)

HELLO = "import time\nprint('hello', flush=True)\ntime.sleep(1)\n"
SLEEPER = "import time\nprint('ready', flush=True)\ntime.sleep(600)\n"
DESIGNS = ("attached", "detach+attach")
RANK_LINE = re.compile(r"^\[\d+ \S+\] ")


@dataclass(frozen=True)
class Sample:
    setting: str
    design: str
    first: float  # seconds from spawn to the first rank line
    exit: float  # seconds from spawn to the client's exit


class Bench:
    def __init__(self, base: Path, cluster: Any, python: str) -> None:
        self.base = base
        self.cluster = cluster
        self.python = python
        self.home = base / "home"  # localhost jobs' ~/.dlrun
        self.home.mkdir(exist_ok=True)
        self.env = {**dlrun_env(), "HOME": str(self.home)}
        scripts = scripts_dir(base)
        self.hello = write_script(scripts, "hello.py", HELLO)
        self.sleeper = write_script(scripts, "sleeper.py", SLEEPER)

    def where(self, setting: str) -> list[str]:
        """dlrun's options for a setting: ``local`` (-n 2) or ``sshN`` (N hosts, one rank each)."""
        if setting == "local":
            return ["-n", "2"]
        n = int(setting.removeprefix("ssh"))
        hosts = write_hosts_toml(self.cluster, self.base / f"hosts-{n}.toml", n, self.python)
        return ["--hosts", str(hosts), "--ssh-config", str(self.cluster.ssh_config)]

    def job_hosts(self, setting: str) -> list[str]:
        """``attach``, ``stop`` and ``logs``'s options for a detached job of that setting."""
        return [] if setting == "local" else self.where(setting)

    def dlrun(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "dlrun", *args]

    def timed(self, argv: Sequence[str], start: float) -> tuple[float | None, float, str]:
        """Run ``argv``: when its first rank line came (since ``start``), when it exited, its output."""
        proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=self.env, cwd=self.base)
        assert proc.stdout is not None
        first = None
        out = []
        for line in proc.stdout:
            if first is None and RANK_LINE.match(line):
                first = time.monotonic() - start
            out.append(line)
        proc.wait()
        return first, time.monotonic() - start, "".join(out)

    def run(self, setting: str, design: str) -> Sample:
        common = ["--framework", "none", "--grace", "2", *self.where(setting)]
        start = time.monotonic()
        if design == "attached":
            first, end, out = self.timed(self.dlrun("launch", "--plain", "--log-dir", str(self.base / "logs"),
                                                    *common, str(self.hello)), start)
        else:
            launched = subprocess.run(self.dlrun("launch", "--detach", *common, str(self.hello)), env=self.env,
                                      cwd=self.base, capture_output=True, text=True)
            job = job_of(launched.stdout + launched.stderr)
            first, end, out = self.timed(self.dlrun("attach", job, *self.job_hosts(setting)), start)
            subprocess.run(self.dlrun("logs", job, "--delete", *self.job_hosts(setting)), env=self.env,
                           cwd=self.base, capture_output=True)
        if first is None or "hello" not in out:
            raise RuntimeError(f"{design} on {setting}: no rank line\n{out[-2000:]}")
        return Sample(setting, design, first, end)

    # ------------------------------------------------------------------ orphans
    def orphans(self, setting: str, design: str, event: str) -> tuple[int, float | None, float | None]:
        """The job's processes left 20 s after ``event`` hit the client, seconds until none, and
        (when some were left) seconds from ``dlrun stop`` until none (what a design that stops
        the job on Ctrl-C would cost)."""
        opts = self.where(setting)
        common = ["--framework", "none", "--grace", "2", *opts]
        hosts = self.job_hosts(setting)
        if design == "attached":
            argv = self.dlrun("launch", "--plain", "--log-dir", str(self.base / "logs"), *common, str(self.sleeper))
            client = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env=self.env, cwd=self.base)
        else:
            launched = subprocess.run(self.dlrun("launch", "--detach", *common, str(self.sleeper)), env=self.env,
                                      cwd=self.base, capture_output=True, text=True)
            job = job_of(launched.stdout + launched.stderr)
            client = subprocess.Popen(self.dlrun("attach", job, *hosts), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, env=self.env, cwd=self.base)
        assert client.stdout is not None
        seen: list[str] = []
        ready = threading.Event()

        def read() -> None:
            assert client.stdout is not None
            for line in client.stdout:
                seen.append(line)
                if line.rstrip().endswith("] ready"):
                    ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(120):
            client.kill()
            raise RuntimeError(f"{design} on {setting}: never ready\n{''.join(seen)[-2000:]}")
        if design == "attached":
            job = next(m.group(1) for line in seen if (m := re.search(r"logs in \S+/([\w-]+)/", line)))
        if event == "SIGKILL":
            client.kill()
        elif event == "SIGINT":
            client.send_signal(signal.SIGINT)
        else:  # lost connection: every sshd session serving this machine's client ends
            for i in range(len(self.cluster.hosts)):
                self.cluster.kill_sessions(i)
        hit = time.monotonic()
        gone_at = None
        while time.monotonic() - hit < 20:
            if not job_processes(job):
                gone_at = time.monotonic() - hit
                break
            time.sleep(0.05)
        left = len(job_processes(job))
        try:
            client.wait(30)
        except subprocess.TimeoutExpired:
            client.kill()
        stop = time.monotonic()
        subprocess.run(self.dlrun("stop", job, *hosts), env=self.env, cwd=self.base, capture_output=True)
        while job_processes(job) and time.monotonic() - stop < 60:
            time.sleep(0.05)
        stopped = time.monotonic() - stop if left and not job_processes(job) else None
        subprocess.run(self.dlrun("logs", job, "--delete", *hosts), env=self.env, cwd=self.base,
                       capture_output=True)
        return left, gone_at, stopped


def job_of(output: str) -> str:
    match = re.search(r"^dlrun: detached job ([\w-]+)$", output, re.M)
    if match is None:
        raise RuntimeError(f"no detached job:\n{output[-2000:]}")
    return match.group(1)


def job_processes(job: str) -> list[int]:
    """The job's ranks and agents (``DLRUN_JOB_ID``, an attempt's id starts with the job's) and keepers."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry.name}/environ").read_bytes().split(b"\0")
            argv = Path(f"/proc/{entry.name}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(v == f"DLRUN_JOB_ID={job}".encode() or v.startswith(f"DLRUN_JOB_ID={job}-r".encode())
               for v in environ) or (b"dlrun-keeper" in argv and job.encode() in argv):
            found.append(int(entry.name))
    return found


def latency_table(samples: Sequence[Sample], settings: Sequence[str], loads: Sequence[float], repeat: int) -> None:
    print(f"# attached vs detach+attach, median of {repeat} (dlrun {REPO})\n")
    print("| setting | attached: first line | attached: exit | detach+attach: first line | detach+attach: exit"
          " | ratio first line | ratio exit |")
    print("|---|---|---|---|---|---|---|")
    for setting in settings:
        def med(design: str, what: str, setting: str = setting) -> float:
            return median([getattr(s, what) for s in samples if s.setting == setting and s.design == design])

        a_first, a_exit = med("attached", "first"), med("attached", "exit")
        b_first, b_exit = med("detach+attach", "first"), med("detach+attach", "exit")
        print(f"| {setting} | {a_first:.2f} s | {a_exit:.2f} s | {b_first:.2f} s | {b_exit:.2f} s"
              f" | {b_first / a_first:.2f}× | {b_exit / a_exit:.2f}× |")
    print(f"\n1-min load during the runs: min {min(loads):.2f}, median {median(loads):.2f}, max {max(loads):.2f}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--settings", default="local,ssh2,ssh4", help="local and sshN, comma-separated")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--orphans", action="store_true", help="also the orphan table")
    p.add_argument("--orphans-only", action="store_true", help="only the orphan table")
    p.add_argument("--python", default=shutil.which("python3", path="/usr/bin:/bin") or "python3")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    settings = [s for s in args.settings.split(",") if s]
    hosts = max([int(s.removeprefix("ssh")) for s in settings if s.startswith("ssh")] or [0])
    base = make_base_dir()
    cluster = start_bench_cluster(hosts, base, args.python) if hosts else None
    try:
        bench = Bench(base, cluster, args.python)
        args.orphans = args.orphans or args.orphans_only
        for setting in settings if not args.orphans_only else ():  # warm-up (page cache, .pyc, code cache), not counted
            for design in DESIGNS:
                bench.run(setting, design)
        rng = random.Random(args.seed)
        samples: list[Sample] = []
        loads = []
        for rep in range(args.repeat if not args.orphans_only else 0):
            order = [(s, d) for s in settings for d in DESIGNS]
            rng.shuffle(order)
            for setting, design in order:
                samples.append(bench.run(setting, design))
                loads.append(load1())
            print(f"repeat {rep + 1}/{args.repeat}, load {load1():.2f}", file=sys.stderr)
        if samples:
            latency_table(samples, settings, loads, args.repeat)
        if args.orphans:
            print("\n| setting | design | event | job processes left after 20 s | all gone after"
                  " | dlrun stop until none |")
            print("|---|---|---|---|---|---|")
            for setting in settings:
                events = ["SIGKILL", "SIGINT"] + (["lost connection"] if setting != "local" else [])
                for design in DESIGNS:
                    for event in events:
                        left, gone, stopped = bench.orphans(setting, design, event)
                        print(f"| {setting} | {design} | {event} | {left} | "
                              f"{'-' if gone is None else f'{gone:.2f} s'} | "
                              f"{'-' if stopped is None else f'{stopped:.2f} s'} |", flush=True)
    finally:
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
