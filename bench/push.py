"""Benchmark: dlrun push vs ``rsync -a`` — 200 files, 200 MB in all, to 4 loopback sshd hosts.

Measures, in the same run and interleaved, the first push (empty hosts, cold local hash
cache) and a no-change re-push, for dlrun (``dlrun.sync.push`` in this process, a fresh SSH
connection per push) and for four parallel ``rsync -a -e "ssh -F <ssh_config>"``. Median of
3; prints a markdown table with the ratios to stdout. Uses tests/sshd_cluster.py (root: hosts
on 127.0.0.2-5 as user dlrun-test).

    python bench/push.py [--runs 3] [--files 200] [--mb 200]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
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

from dlrun.inventory import Host  # noqa: E402
from dlrun.ssh import SSHTransport  # noqa: E402
from dlrun.sync import push  # noqa: E402
from dlrun.transport import HostRouter  # noqa: E402


def load_cluster_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sshd_cluster", REPO / "tests" / "sshd_cluster.py")
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--files", type=int, default=200)
    parser.add_argument("--mb", type=int, default=200)
    args = parser.parse_args()
    rsync = shutil.which("rsync")
    if rsync is None:
        sys.exit("rsync is not installed")
    sshd_cluster = load_cluster_module()
    load_before = os.getloadavg()[0]
    base = Path(tempfile.mkdtemp(prefix="dlrun-bench-push-"))
    cluster = sshd_cluster.start_cluster(4, base / "cluster", python=sys.executable)
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
                summaries = push(transport, hosts, code_dir=src)
            finally:
                transport.close()
            assert all(s.files_sent == expect_sent for s in summaries), summaries

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

        results: dict[str, list[float]] = {k: [] for k in ("dlrun first", "dlrun again", "rsync first",
                                                            "rsync again")}
        for run in range(args.runs):
            wipe()
            order = ["dlrun", "rsync"] if run % 2 == 0 else ["rsync", "dlrun"]
            for tool in order:
                if tool == "dlrun":
                    results["dlrun first"].append(timed(lambda: dlrun_push(args.files)))
                    results["dlrun again"].append(timed(lambda: dlrun_push(0)))
                else:
                    results["rsync first"].append(timed(rsync_push))
                    results["rsync again"].append(timed(rsync_push))
        import_s = timed(lambda: subprocess.run([sys.executable, "-c", "import dlrun.sync, dlrun.ssh"],
                                                cwd=REPO, check=True))
    finally:
        cluster.stop(remove=True)
        shutil.rmtree(base, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"## dlrun push vs rsync -a: {args.files} files, {args.mb} MB, to 4 loopback sshd hosts\n")
    print(f"{os.cpu_count()} CPUs, load average before: {load_before:.2f}; median of {args.runs} "
          "runs, interleaved; each dlrun push opens its own SSH connections (in-process, no interpreter start)\n")
    print("| case | dlrun (s) | rsync (s) | dlrun / rsync | dlrun runs | rsync runs |")
    print("|---|---:|---:|---:|---|---|")
    for case in ("first", "again"):
        d, r = results[f"dlrun {case}"], results[f"rsync {case}"]
        label = "first push" if case == "first" else "no-change re-push"
        print(f"| {label} | {med[f'dlrun {case}']:.2f} | {med[f'rsync {case}']:.2f} | "
              f"{med[f'dlrun {case}'] / med[f'rsync {case}']:.2f}x | "
              f"{', '.join(f'{x:.2f}' for x in d)} | {', '.join(f'{x:.2f}' for x in r)} |")
    print(f"\n`python -c 'import dlrun.sync, dlrun.ssh'` (a CLI would pay it once): {import_s:.2f} s")


if __name__ == "__main__":
    main()
