"""Processes of a dlrun job on this machine, found in ``/proc``: its agents, their guardians."""

from __future__ import annotations

from pathlib import Path

from support.sshd_cluster import count_job_processes


def agents_of(job_id: str) -> list[int]:
    """The job's agents: the parents of its ranks, each the child of a ``dlrun-guard``."""
    parents = {parent(pid) for pid in count_job_processes(job_id)}
    return sorted(pid for pid in parents if comm(pid) != "dlrun-guard" and comm(parent(pid)) == "dlrun-guard")


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_bytes().rpartition(b")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return 0
