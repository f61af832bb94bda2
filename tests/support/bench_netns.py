"""Runs ``dlrun topo --bench`` over three sshd hosts inside a private network namespace.

Run as root under ``unshare --net`` (the test does): brings ``lo`` up, starts the hosts on
127.0.0.2-4, optionally holds one host's packets to 30 Mbit/s (an ``htb`` class with ``u32``
filters on its address as source and as destination; ``netem`` is missing here) or puts one
host's sshd (and so every session it forks) in a cgroup with a small CPU quota, then prints one
JSON line: ``{"rc", "doc", "stderr", "addresses"}``.

    unshare --net python bench_netns.py BASE_DIR --slow-link 1 --seconds 12
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for support.*

from support.sshd_cluster import start_cluster

REPO = Path(__file__).resolve().parents[2]
CGROUP_V1 = Path("/sys/fs/cgroup/cpu")


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


def throttle(address: str) -> None:
    sh("tc", "qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "20")
    sh("tc", "class", "add", "dev", "lo", "parent", "1:", "classid", "1:10", "htb", "rate", "30mbit")
    sh("tc", "class", "add", "dev", "lo", "parent", "1:", "classid", "1:20", "htb", "rate", "100gbit")
    for way in ("dst", "src"):
        sh("tc", "filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
           "match", "ip", way, f"{address}/32", "flowid", "1:10")


def limit_cpu(pid: int, name: str) -> Path:
    """Put ``pid`` (an sshd listener: its sessions inherit it) in a cgroup of 5% of one CPU."""
    v2 = Path("/sys/fs/cgroup/cgroup.controllers")
    group = (Path("/sys/fs/cgroup") if v2.exists() else CGROUP_V1) / name
    group.mkdir(exist_ok=True)
    if v2.exists():
        (group / "cpu.max").write_text("5000 100000")
    else:
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text("5000")
    (group / "cgroup.procs").write_text(str(pid))
    return group


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("base")
    parser.add_argument("--slow-link", type=int, default=None, help="index of the host to throttle")
    parser.add_argument("--slow-cpu", type=int, default=None, help="index of the host to hold to 5%% of a CPU")
    parser.add_argument("--seconds", default="12")
    parser.add_argument("--hosts", type=int, default=3, help="how many sshd hosts")
    parser.add_argument("--python", default=sys.executable, help="the hosts' python (/usr/bin/python3: no torch)")
    parser.add_argument("--launch", action="store_true",
                        help="run `dlrun launch --bench` of a script that leaves a marker file, not `dlrun topo`")
    args = parser.parse_args()
    sh("ip", "link", "set", "lo", "up")
    base = Path(args.base)
    group: Path | None = None
    with start_cluster(args.hosts, base, python=args.python) as cluster:
        try:
            if args.slow_link is not None:
                throttle(cluster.hosts[args.slow_link].address)
            if args.slow_cpu is not None:
                pid = cluster.hosts[args.slow_cpu].pid
                assert pid is not None
                group = limit_cpu(pid, f"dlrun-bench-test-{os.getpid()}")
            hosts = base / "hosts.toml"
            hosts.write_text(f'[defaults]\npython = "{cluster.python}"\n' + "".join(
                f'[[hosts]]\naddress = "{h.name}"\nslots = 1\n' for h in cluster.hosts))
            command = ["topo", "--bench", "--bench-seconds", args.seconds, "--json"]
            shared = cluster.root / "bench-launch"  # the login user reaches it (pytest's tmp_path is 0700)
            shared.mkdir(exist_ok=True)
            shared.chmod(0o755)  # the login user's own: a folder others may write fails the --no-push check
            if os.geteuid() == 0:
                login = pwd.getpwnam(cluster.user)
                os.chown(shared, login.pw_uid, login.pw_gid)
            marker = shared / "started"
            script = shared / "mark.py"
            if args.launch:
                script.write_text(f"open({str(marker)!r}, 'a').write('x')\n")
                script.chmod(0o644)
                command = ["launch", "--plain", "--framework", "none", "--no-push", "--bench", "--bench-seconds",
                           args.seconds]
            given = ["--hosts", str(hosts), "--ssh-config", str(cluster.ssh_config)]
            proc = subprocess.run(
                [sys.executable, "-m", "dlrun", *command, *given, *([str(script)] if args.launch else [])],
                capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(REPO)})
        finally:
            if group is not None:  # move everything left back to the root group, then drop ours
                for pid_text in (group / "cgroup.procs").read_text().split():
                    try:
                        (group.parent / "cgroup.procs").write_text(pid_text)
                    except OSError:
                        pass
        started = marker.exists()
    cluster.stop(remove=True)  # a fresh /tmp/dlrun-sshd-* where base_dir is 0700: leave none behind
    if group is not None:
        try:
            group.rmdir()
        except OSError:
            pass
    try:
        doc = json.loads(proc.stdout)
    except ValueError:
        doc = None
    print(json.dumps({"rc": proc.returncode, "doc": doc, "stdout": proc.stdout[-4000:] if doc is None else "",
                      "started": started,
                      "stderr": proc.stderr[-4000:],
                      "addresses": {h.name: h.address for h in cluster.hosts}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
