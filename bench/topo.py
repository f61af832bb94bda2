"""`dlrun topo` on N sshd fixture hosts against `dlrun launch` of a trivial script on the same hosts.

    python bench/topo.py [--hosts 16] [--repeat 5]

Each host's python sees a fake `nvidia-smi` replaying a real 8-GPU capture and the real sysfs
InfiniBand capture (tests/support/topo_fixtures.py), so the probe parses a full GPU/NIC topology.
Target (issue 4): topo ≤ 1.2× a trivial launch — one round trip per host. `launch` here runs
its own preflight probe too, so it is also shown with --no-preflight.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch import (
    REPO,
    TRIVIAL,
    dlrun_env,
    load1,
    make_base_dir,
    median,
    scripts_dir,
    start_bench_cluster,
    write_script,
)

sys.path.insert(0, str(REPO / "tests"))
from support.topo_fixtures import FIXTURES, write_fake_tool

REPLIES = {
    "--query-gpu=": "query-gpu-csv/h100-80gb-hbm3-all-fields-idle-drv590.csv.txt",
    "topo -m": "topo-m/dgx1-v100-hybrid-cube-mesh-nv1-nv2-4nic-raw-tabs.txt",
    "-L": "smi-L/h100-mig-4-instances-drv590.txt",
    "": "smi-header/h100-80gb-hbm3-vm-drv580.txt",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    base = make_base_dir()
    cluster = start_bench_cluster(args.hosts, base, sys.executable)
    try:
        scripts = scripts_dir(base)
        fake_bin = scripts / "fake-bin"
        fake_bin.mkdir()
        fake_bin.chmod(0o755)
        write_fake_tool(fake_bin, "nvidia-smi", REPLIES)
        sysfs = FIXTURES / "sysfs-ib" / "gpud-h100-testdata"
        python = f"env PATH={fake_bin}:/usr/bin:/bin DLRUN_SYSFS_ROOT={sysfs} {cluster.python}"
        trivial = write_script(scripts, "trivial.py", TRIVIAL)
        hosts = base / "hosts.toml"
        hosts.write_text("".join(f'[[hosts]]\naddress = "{h.name}"\nslots = 1\npython = "{python}"\n'
                                 for h in cluster.hosts))
        common = ["--hosts", str(hosts), "--ssh-config", str(cluster.ssh_config)]
        tools = {
            "dlrun topo": ["topo", "--json", *common],
            "dlrun launch": ["launch", "--plain", "--no-push", *common, str(trivial)],
            "dlrun launch --no-preflight": ["launch", "--plain", "--no-push", "--no-preflight", *common, str(trivial)],
        }
        walls: dict[str, list[float]] = {name: [] for name in tools}
        for _ in range(args.repeat):
            for name, argv in tools.items():  # interleaved, so load changes hit every tool alike
                start = time.perf_counter()
                out = subprocess.run([sys.executable, "-m", "dlrun", *argv], capture_output=True, text=True,
                                     env=dlrun_env(), cwd=base)
                walls[name].append(time.perf_counter() - start)
                if out.returncode not in (0, 1):
                    raise SystemExit(f"{name} failed ({out.returncode}):\n{out.stderr[-2000:]}")
        topo = median(walls["dlrun topo"])
        print(f"{args.hosts} hosts, median of {args.repeat}, load {load1():.2f}\n")
        print("| tool | median s | dlrun topo / tool |")
        print("|---|---:|---:|")
        for name, values in walls.items():
            print(f"| {name} | {median(values):.3f} | {topo / median(values):.2f}× |")
    finally:
        cluster.stop(remove=True)


if __name__ == "__main__":
    main()
