"""The benchmarks in bench/ still run: each in its smallest mode (2 hosts, 1 repeat, a few lines)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest

from support.cli import REPO

pytestmark = [pytest.mark.ssh, pytest.mark.slow, pytest.mark.timeout(120)]


@pytest.fixture(autouse=True)
def _needs_sshd() -> None:
    from support.sshd_cluster import find_sshd

    if find_sshd() is None:
        pytest.skip("no sshd on this machine (install openssh-server; .ci/run does)")


def bench(script: str, *args: str) -> str:
    out = subprocess.run([sys.executable, str(REPO / "bench" / script), *args], cwd=REPO, capture_output=True,
                         text=True, timeout=110)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def test_launch_bench_smoke() -> None:
    tools = "dlrun,pdsh,ssh" if shutil.which("pdsh") else "dlrun,ssh"
    out = bench("launch.py", "--hosts", "2", "--repeat", "1", "--tools", tools, "--trace")
    assert re.search(r"^\| 2 \| \d+\.\d+ \|", out, re.M), out
    assert "| connect: all hosts (parallel) |" in out, out


def test_logs_bench_smoke() -> None:
    out = bench("logs.py", "--hosts", "2", "--lines", "500", "--repeat", "1", "--tools", "dlrun,raw")
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| (dlrun|raw) \|(.*)\|$", out, re.M)}
    assert set(rows) == {"dlrun", "raw"}, out
    for row in rows.values():
        assert row.rstrip().endswith("| 0 | 0"), out  # nothing lost, nothing reordered


def test_logs_read_bench_smoke() -> None:
    out = bench("logs_read.py", "--hosts", "2", "--mb", "10", "--repeat", "1")  # 10 MB a rank: the side channel
    for tool in ("dlrun", "ssh"):
        assert re.search(rf"^\| {tool} \| \d+\.\d+ \| \d+ \| \d+\.\d+ \| \d+\.\d+ \|", out, re.M), out
    assert "lines lost or out of order in dlrun's output: 0" in out, out


@pytest.mark.skipif(shutil.which("rsync") is None, reason="no rsync here (.ci/run installs it)")
def test_push_bench_smoke() -> None:
    out = bench("push.py", "--runs", "1", "--files", "4", "--mb", "1")
    for case in ("first push", "no-change re-push"):
        for tool in ("dlrun", "dlrun-cli", "rsync"):
            assert re.search(rf"^\| {case} \| {tool} \| \d+\.\d+ \| \d+\.\d+x \|", out, re.M), out


@pytest.mark.skipif(shutil.which("rsync") is None, reason="no rsync here (.ci/run installs it)")
def test_pull_bench_smoke() -> None:
    out = bench("pull.py", "--runs", "1", "--files", "4", "--mb", "1")
    for case in ("first pull", "no-change re-pull"):
        for tool in ("dlrun", "dlrun-cli", "rsync"):
            assert re.search(rf"^\| {case} \| {tool} \| \d+\.\d+ \| \d+\.\d+x \|", out, re.M), out
