"""Benchmark: dlrun push vs ``rsync -a`` — 200 files, 200 MB in all, to 4 loopback sshd hosts.

Measures, in the same run and interleaved, the first push (empty hosts, cold local hash
cache, dirty pages written back before it) and a no-change re-push, for dlrun
(``dlrun.push.session.push`` in this process, a fresh SSH connection per push), for "dlrun-cli" (the
``dlrun push`` command, interpreter start and imports included) and for four parallel
``rsync -a -e "ssh -F <ssh_config>"``. Median of 3; prints a markdown table with the ratios to
stdout. Uses tests/support/sshd_cluster.py (root: hosts on 127.0.0.2-5 as user dlrun-test).

Client and host CPU are reported next to the times (they do not change what is timed): client
= this process and its children (dlrun's threads; rsync and its ssh clients), hosts = the four
sshd listeners and everything they start (sshd sessions, dlrun's helper, rsync's receiver), from
a cpuacct cgroup the listeners are moved into ("n/a" where no cgroup can be made). Client and
hosts share the same cores here, so host CPU costs wall time too.

    python bench/push.py [--runs 3] [--files 200] [--mb 200]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dlrun.inventory import Host  # noqa: E402
from dlrun.push.session import push  # noqa: E402
from dlrun.transport.local import HostRouter  # noqa: E402
from dlrun.transport.ssh import SSHTransport  # noqa: E402


def load_cluster_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sshd_cluster", REPO / "tests" / "support" / "sshd_cluster.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["sshd_cluster"] = module
    spec.loader.exec_module(module)
    return module


def make_source(root: Path, files: int, total: int) -> None:
    size = total // files
    root.mkdir(parents=True)
    for i in range(files):
        (root / f"shard-{i:03d}.bin").write_bytes(os.urandom(size))


def timed(action: Callable[[], object]) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def client_cpu() -> float:
    """CPU seconds of this process and its waited-for children (rsync, ssh)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


class HostCPU:
    """CPU seconds of the sshd listeners and all their descendants, via a cpuacct cgroup (root).

    cgroup v1 (``/sys/fs/cgroup/cpuacct``) or v2 (``/sys/fs/cgroup/cgroup.procs``); ``seconds()``
    is None where neither can be used.
    """

    def __init__(self, pids: list[int]) -> None:
        self.path: Path | None = None
        name = f"dlrun-bench-push-{os.getpid()}"
        for base, usage in ((Path("/sys/fs/cgroup/cpuacct"), "cpuacct.usage"), (Path("/sys/fs/cgroup"), "cpu.stat")):
            if not (base / "cgroup.procs").exists() or not os.access(base, os.W_OK):
                continue
            path = base / name
            try:
                path.mkdir(exist_ok=True)
                for pid in pids:
                    (path / "cgroup.procs").write_text(str(pid))
            except OSError:
                with contextlib.suppress(OSError):
                    path.rmdir()
                continue
            self.path, self.usage = path, usage
            return

    def seconds(self) -> float | None:
        if self.path is None:
            return None
        text = (self.path / self.usage).read_text()
        if self.usage == "cpuacct.usage":
            return int(text) / 1e9
        fields = dict(line.split() for line in text.splitlines())
        return int(fields["usage_usec"]) / 1e6

    def close(self) -> None:
        """Remove the cgroup (once the cluster has stopped, it is empty)."""
        if self.path is not None:
            with contextlib.suppress(OSError):
                self.path.rmdir()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--files", type=int, default=200)
    parser.add_argument("--mb", type=int, default=200)
    args = parser.parse_args()
    tools = ["dlrun", "dlrun-cli", "rsync"]
    rsync = shutil.which("rsync")
    if rsync is None:
        sys.exit("rsync is not installed")
    sshd_cluster = load_cluster_module()
    load_before = os.getloadavg()[0]
    base = Path(tempfile.mkdtemp(prefix="dlrun-bench-push-"))
    cluster = sshd_cluster.start_cluster(4, base / "cluster", python=sys.executable)
    host_cpu = HostCPU([h.pid for h in cluster.hosts if h.pid is not None])
    cpu: dict[str, list[tuple[float, float | None]]] = {}

    def measured(key: str, action: Callable[[], object]) -> float:
        """Wall seconds of ``action``; its client and host CPU go to ``cpu[key]``."""
        client0, hosts0 = client_cpu(), host_cpu.seconds()
        wall = timed(action)
        time.sleep(0.2)  # let sshd reap the sessions so that their CPU is counted
        hosts1 = host_cpu.seconds()
        hosts = None if hosts0 is None or hosts1 is None else hosts1 - hosts0
        cpu.setdefault(key, []).append((client_cpu() - client0, hosts))
        return wall

    try:
        src = base / "src" / "dataset"
        make_source(src, args.files, args.mb * 1_000_000)
        cache = base / "cache"
        os.environ["XDG_CACHE_HOME"] = str(cache)
        hosts = [Host(address=h.name, name=h.name, workdir=str(h.workdir / "dlrun"), python=cluster.python)
                 for h in cluster.hosts]

        def dlrun_push(expect_sent: int) -> None:
            transport = HostRouter(remote=SSHTransport(config_file=str(cluster.ssh_config)))
            try:
                summaries = push(transport, hosts, code_dir=src, limit=None)  # --mb may exceed the guard
            finally:
                transport.close()
            assert all(s.files_sent == expect_sent for s in summaries), summaries

        inventory = base / "hosts.toml"
        inventory.write_text("".join(
            f"[[hosts]]\naddress = {json.dumps(h.name)}\nworkdir = {json.dumps(str(h.workdir / 'dlrun'))}\n"
            f"python = {json.dumps(cluster.python)}\n" for h in cluster.hosts))

        def dlrun_cli(expect_sent: int) -> None:
            out = subprocess.run([sys.executable, "-m", "dlrun", "push", "--json", "--hosts", str(inventory),
                                  "--ssh-config", str(cluster.ssh_config), "--code", str(src),
                                  "--max-push-size", "none"],
                                 capture_output=True, text=True, check=True)
            sent = [h["files_sent"] for h in json.loads(out.stdout)["hosts"]]
            assert sent == [expect_sent] * len(hosts), out.stdout

        def rsync_push() -> None:
            procs = [subprocess.Popen([rsync, "-a", "-e", f"ssh -F {cluster.ssh_config}", f"{src}/",
                                       f"{h.name}:{h.workdir / 'rsync'}/"]) for h in cluster.hosts]
            codes = [p.wait() for p in procs]
            assert codes == [0] * len(procs), codes

        def wipe() -> None:
            for h in cluster.hosts:
                shutil.rmtree(h.workdir / "dlrun", ignore_errors=True)
                shutil.rmtree(h.workdir / "rsync", ignore_errors=True)
            shutil.rmtree(cache, ignore_errors=True)

        results: dict[str, list[float]] = {f"{t} {c}": [] for t in tools for c in ("first", "again")}
        for run in range(args.runs):
            order = tools[run % len(tools):] + tools[: run % len(tools)]
            for tool in order:
                # Each tool's first push starts from empty hosts, a cold hash cache and no dirty
                # pages: otherwise the second tool of a run pays for writing back the first one's
                # 800 MB, and with an odd number of runs one tool is second more often.
                wipe()
                os.sync()
                if tool == "dlrun-cli":
                    results[f"{tool} first"].append(measured(f"{tool} first", lambda: dlrun_cli(args.files)))
                    results[f"{tool} again"].append(measured(f"{tool} again", lambda: dlrun_cli(0)))
                elif tool == "dlrun":
                    results[f"{tool} first"].append(measured(f"{tool} first", lambda: dlrun_push(args.files)))
                    results[f"{tool} again"].append(measured(f"{tool} again", lambda: dlrun_push(0)))
                else:
                    results["rsync first"].append(measured("rsync first", rsync_push))
                    results["rsync again"].append(measured("rsync again", rsync_push))
        import_s = timed(lambda: subprocess.run(
            [sys.executable, "-c", "import dlrun.push.session, dlrun.transport.ssh"], cwd=REPO, check=True))
        load_after = os.getloadavg()[0]
    finally:
        cluster.stop(remove=True)
        host_cpu.close()
        shutil.rmtree(base, ignore_errors=True)

    print(f"## dlrun push vs rsync -a: {args.files} files, {args.mb} MB, to 4 loopback sshd hosts\n")
    print(f"{os.cpu_count()} CPUs, load average before: {load_before:.2f}, after: {load_after:.2f}; median of "
          f"{args.runs} runs, interleaved; each dlrun push opens its own SSH connections (dlrun: in-process, "
          "no interpreter start; dlrun-cli: the `dlrun push` command)\n")
    print_tables(results, cpu, tools, ("first push", "no-change re-push"))
    print(f"\n`python -c 'import dlrun.push.session, dlrun.transport.ssh'` (a CLI would pay it once): {import_s:.2f} s")


def print_tables(results: dict[str, list[float]], cpu: dict[str, list[tuple[float, float | None]]],
                 tools: Sequence[str], labels: tuple[str, str]) -> None:
    """The seconds table (each tool against rsync, every run) and the CPU table of a push or pull
    bench; ``labels``: what the first and the no-change case are called."""
    med = {k: statistics.median(v) for k, v in results.items()}
    print("| case | tool | seconds | / rsync | runs |")
    print("|---|---|---:|---:|---|")
    for case, label in zip(("first", "again"), labels, strict=True):
        for tool in tools:
            runs = results[f"{tool} {case}"]
            print(f"| {label} | {tool} | {med[f'{tool} {case}']:.2f} | "
                  f"{med[f'{tool} {case}'] / med[f'rsync {case}']:.2f}x | {', '.join(f'{x:.2f}' for x in runs)} |")

    def cpu_median(key: str, which: int) -> str:
        values = [v[which] for v in cpu[key]]
        known = [v for v in values if v is not None]
        return f"{statistics.median(known):.2f}" if len(known) == len(values) else "n/a"

    print("\nCPU seconds, median (client: this process and its children; hosts: sshd and what it starts)\n")
    print("| case | tool | client | hosts |")
    print("|---|---|---:|---:|")
    for case, label in zip(("first", "again"), labels, strict=True):
        for tool in tools:
            print(f"| {label} | {tool} | {cpu_median(f'{tool} {case}', 0)} | {cpu_median(f'{tool} {case}', 1)} |")


if __name__ == "__main__":
    main()

