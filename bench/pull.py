"""Benchmark: dlrun pull vs ``rsync -a`` — 200 MB in all (50 files of 1 MB per host, different
on each host) from 4 loopback sshd hosts.

Measures, in the same run and interleaved, the first pull (empty local folder, cold local hash
cache, dirty pages written back before it) and a no-change re-pull, for dlrun
(``dlrun.push.pull.pull`` in this process, a fresh SSH connection per pull), for "dlrun-cli" (the
``dlrun pull`` command, interpreter start and imports included) and for four parallel
``rsync -a -e "ssh -F <ssh_config>" host:out/ <local>/<host>/``. Median of 3; prints a markdown
table with the ratios to stdout, and client and host CPU as ``bench/push.py`` does. Uses
tests/support/sshd_cluster.py (root: hosts on 127.0.0.2-5 as user dlrun-test).

    python bench/pull.py [--runs 3] [--files 200] [--mb 200]
    python bench/pull.py --checkpoint [--runs 3] [--files 20] [--mb 200]   # host to host vs relay
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pwd
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from push import print_tables  # noqa: E402 - bench/push.py, beside this file

from dlrun.inventory import Host  # noqa: E402
from dlrun.push.pull import pull  # noqa: E402
from dlrun.transport.local import HostRouter  # noqa: E402
from dlrun.transport.ssh import SSHTransport  # noqa: E402


def load_push_bench() -> ModuleType:
    """bench/push.py: its cluster loader, CPU meters and timer."""
    spec = importlib.util.spec_from_file_location("bench_push", REPO / "bench" / "push.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PROJECT = "proj"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--files", type=int, default=200, help="files in all (a quarter on each host)")
    parser.add_argument("--mb", type=int, default=200, help="MB in all")
    parser.add_argument("--checkpoint", action="store_true",
                        help="instead: a --checkpoint-dir copy of host0's MB to the 3 other hosts, host to host"
                        " against through this machine")
    args = parser.parse_args()
    if args.checkpoint:
        checkpoint_copy(args)
        return
    tools = ["dlrun", "dlrun-cli", "rsync"]
    rsync = shutil.which("rsync")
    if rsync is None:
        sys.exit("rsync is not installed")
    bench = load_push_bench()
    sshd_cluster = bench.load_cluster_module()
    # the command reads dlrun's bytecode as an installed package does (pip compiles on install),
    # also where PYTHONDONTWRITEBYTECODE keeps it from being written (50 ms of compiling a run)
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(REPO / "dlrun")], check=True)
    load_before = os.getloadavg()[0]
    base = Path(tempfile.mkdtemp(prefix="dlrun-bench-pull-"))
    cluster = sshd_cluster.start_cluster(4, base / "cluster", python=sys.executable)
    host_cpu = bench.HostCPU([h.pid for h in cluster.hosts if h.pid is not None])
    cpu: dict[str, list[tuple[float, float | None]]] = {}

    def measured(key: str, action: Callable[[], object]) -> float:
        client0, hosts0 = bench.client_cpu(), host_cpu.seconds()
        wall = float(bench.timed(action))
        time.sleep(0.2)  # let sshd reap the sessions so that their CPU is counted
        hosts1 = host_cpu.seconds()
        cpu.setdefault(key, []).append((bench.client_cpu() - client0,
                                        None if hosts0 is None or hosts1 is None else hosts1 - hosts0))
        return wall

    try:
        login = pwd.getpwnam(cluster.user)
        per_host = max(1, args.files // len(cluster.hosts))
        size = args.mb * 1_000_000 // (per_host * len(cluster.hosts))
        for i, h in enumerate(cluster.hosts):  # the helper's hash cache goes beside out/: the login user's
            out = h.workdir / PROJECT / "out"
            out.mkdir(parents=True)
            for j in range(per_host):
                (out / f"shard-{i}-{j:03d}.bin").write_bytes(os.urandom(size))
            for path in (h.workdir / PROJECT, out, *out.iterdir()):
                os.chown(path, login.pw_uid, login.pw_gid)
        local = base / "local"
        cache = base / "cache"
        os.environ["XDG_CACHE_HOME"] = str(cache)
        hosts = [Host(address=h.name, name=h.name, workdir=str(h.workdir), python=cluster.python)
                 for h in cluster.hosts]

        def dlrun_pull(expect: int) -> None:
            transport = HostRouter(remote=SSHTransport(config_file=str(cluster.ssh_config)))
            try:
                summaries = pull(transport, hosts, "out", local / "dlrun", project=PROJECT, limit=None)
            finally:
                transport.close()
            assert all(s.files_received == expect for s in summaries), summaries

        inventory = base / "hosts.toml"
        inventory.write_text("".join(
            f"[[hosts]]\naddress = {json.dumps(h.name)}\nworkdir = {json.dumps(str(h.workdir))}\n"
            f"python = {json.dumps(cluster.python)}\n" for h in cluster.hosts))

        def dlrun_cli(expect: int) -> None:
            out = subprocess.run([sys.executable, "-m", "dlrun", "pull", "--json", "--hosts", str(inventory),
                                  "--ssh-config", str(cluster.ssh_config), "--project", PROJECT,
                                  "--max-size", "none", "out", str(local / "cli")],
                                 capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
            if out.returncode != 0:
                raise SystemExit(f"dlrun pull exited {out.returncode}: {out.stderr[-2000:]}")
            got = [h["files_received"] for h in json.loads(out.stdout)["hosts"]]
            assert got == [expect] * len(hosts), out.stdout

        def rsync_pull() -> None:
            procs = [subprocess.Popen([rsync, "-a", "-e", f"ssh -F {cluster.ssh_config}",
                                       f"{h.name}:{h.workdir / PROJECT / 'out'}/", f"{local / 'rsync' / h.name}/"])
                     for h in cluster.hosts]
            codes = [p.wait() for p in procs]
            assert codes == [0] * len(procs), codes

        def wipe() -> None:
            shutil.rmtree(local, ignore_errors=True)
            (local / "rsync").mkdir(parents=True)
            shutil.rmtree(cache, ignore_errors=True)
            for h in cluster.hosts:  # the hosts' hash caches: a first pull hashes every file
                shutil.rmtree(h.workdir / PROJECT / ".dlrun-cache", ignore_errors=True)

        results: dict[str, list[float]] = {f"{t} {c}": [] for t in tools for c in ("first", "again")}
        for run in range(args.runs):
            order = tools[run % len(tools):] + tools[: run % len(tools)]
            for tool in order:
                wipe()
                os.sync()
                if tool == "dlrun-cli":
                    results[f"{tool} first"].append(measured(f"{tool} first", lambda: dlrun_cli(per_host)))
                    results[f"{tool} again"].append(measured(f"{tool} again", lambda: dlrun_cli(0)))
                elif tool == "dlrun":
                    results[f"{tool} first"].append(measured(f"{tool} first", lambda: dlrun_pull(per_host)))
                    results[f"{tool} again"].append(measured(f"{tool} again", lambda: dlrun_pull(0)))
                else:
                    results["rsync first"].append(measured("rsync first", rsync_pull))
                    results["rsync again"].append(measured("rsync again", rsync_pull))
        load_after = os.getloadavg()[0]
    finally:
        cluster.stop(remove=True)
        host_cpu.close()
        shutil.rmtree(base, ignore_errors=True)

    print(f"## dlrun pull vs rsync -a: {per_host * 4} files, {args.mb} MB in all, from 4 loopback sshd hosts\n")
    print(f"{os.cpu_count()} CPUs, load average before: {load_before:.2f}, after: {load_after:.2f}; median of "
          f"{args.runs} runs, interleaved; each pull opens its own SSH connections (dlrun: in-process; "
          "dlrun-cli: the `dlrun pull` command)\n")
    print_tables(results, cpu, tools, ("first pull", "no-change re-pull"))


def checkpoint_copy(args: argparse.Namespace) -> None:
    """``dlrun.push.checkpoint.sync_folder``: host0's ``ckpt/`` (``--files`` files, ``--mb`` MB)
    to 3 empty hosts, host to host and through this machine, interleaved; median seconds."""
    from dlrun.push.checkpoint import sync_folder

    bench = load_push_bench()
    sshd_cluster = bench.load_cluster_module()
    load_before = os.getloadavg()[0]
    base = Path(tempfile.mkdtemp(prefix="dlrun-bench-ckpt-"))
    cluster = sshd_cluster.start_cluster(4, base / "cluster", python=sys.executable)
    times: dict[str, list[float]] = {"host to host": [], "through this machine": []}
    try:
        login = pwd.getpwnam(cluster.user)
        size = args.mb * 1_000_000 // args.files
        hosts = [Host(address=h.name, name=h.name, workdir=str(h.workdir), python=cluster.python)
                 for h in cluster.hosts]
        roots = {h.name: str(h.workdir / PROJECT / "ckpt") for h in cluster.hosts}
        for h in cluster.hosts:
            (h.workdir / PROJECT / "ckpt").mkdir(parents=True)
            for path in (h.workdir / PROJECT, h.workdir / PROJECT / "ckpt"):
                os.chown(path, login.pw_uid, login.pw_gid)
        source = Path(roots[cluster.hosts[0].name])
        for j in range(args.files):
            (source / f"shard-{j:03d}.pt").write_bytes(os.urandom(size))
        addresses = {h.name: h.address for h in cluster.hosts}
        for run in range(args.runs):
            for way in (list(times) if run % 2 == 0 else list(times)[::-1]):
                for h in cluster.hosts[1:]:
                    shutil.rmtree(roots[h.name], ignore_errors=True)
                    shutil.rmtree(h.workdir / PROJECT / ".dlrun-cache", ignore_errors=True)
                os.sync()
                transport = HostRouter(remote=SSHTransport(config_file=str(cluster.ssh_config)))
                try:
                    transport.connect(hosts)
                    start = time.perf_counter()
                    done = sync_folder(transport, hosts, roots, "ckpt",
                                       addresses=addresses if way == "host to host" else None)
                    times[way].append(time.perf_counter() - start)
                finally:
                    transport.close()
                assert done.files == 3 * args.files and done.relayed == (0 if way == "host to host" else done.files)
        load_after = os.getloadavg()[0]
    finally:
        cluster.stop(remove=True)
        shutil.rmtree(base, ignore_errors=True)
    print(f"## --checkpoint-dir copy: host0's {args.files} files, {args.mb} MB, to 3 other loopback sshd hosts\n")
    print(f"{os.cpu_count()} CPUs, load average before: {load_before:.2f}, after: {load_after:.2f}; median of"
          f" {args.runs} runs, interleaved; connections made before the clock starts\n")
    print("| way | seconds | runs |")
    print("|---|---:|---|")
    for way, runs in times.items():
        print(f"| {way} | {statistics.median(runs):.2f} | {', '.join(f'{x:.2f}' for x in runs)} |")


if __name__ == "__main__":
    main()
