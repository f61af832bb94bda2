"""The hosts the options name and the transport that reaches them: ``SSHOptions`` (the SSH
settings every command shares), ``resolve_inventory`` (``--hosts``, a Slurm allocation, or
this machine) and ``make_transport`` (this machine's subprocesses, SSH, or Slurm steps).
``launch``, ``topo``, ``push``, ``pull``, ``ps`` and ``logs`` all get their transport here.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass

from dlrun.allocation import SLURM_HOSTS, allocation_inventory, in_allocation
from dlrun.allocation import SOURCE as ALLOCATION_SOURCE
from dlrun.inventory import Inventory, load_inventory, localhost_inventory
from dlrun.plan import DEFAULT_HOST_TIMEOUT
from dlrun.transport.base import Transport
from dlrun.transport.local import HostRouter


@dataclass(frozen=True)
class SSHOptions:
    config_file: str | None = None
    accept_new_host_keys: bool = False
    connect_timeout: float | None = None  # None: the ssh config's ConnectTimeout, else 10 s
    known_hosts: str | None = None
    host_timeout: float = DEFAULT_HOST_TIMEOUT  # seconds of silence before a host is lost (0: never)
    host_timeout_given: bool = False  # on dlrun's command line: else SSH liveness follows the ssh config
    transport: str = "auto"  # ssh, srun (Slurm steps) or auto: srun for the allocation's own nodes (make_transport)


def default_hosts(hosts: str | None) -> str | None:
    """``--hosts`` as given; when not given, ``slurm`` inside a Slurm allocation (its nodes are
    the inventory), else None (this machine)."""
    if hosts is None and in_allocation(os.environ):
        return SLURM_HOSTS
    return hosts


def resolve_inventory(hosts: str | None, np: int | None) -> Inventory:
    if hosts is None:
        return localhost_inventory(2 if np is None else np)
    if hosts == SLURM_HOSTS:
        allocation = allocation_inventory(os.environ)
        print(f"dlrun: {allocation.describe()}", file=sys.stderr)
        return allocation.inventory
    return load_inventory(hosts)



def transport_kind(inventory: Inventory, ssh: SSHOptions) -> str:
    """``ssh`` or ``srun``: ``auto`` is srun for the allocation's own nodes where ``srun`` is on
    PATH (docs/slurm.md says why), else ssh."""
    if ssh.transport != "auto":
        return ssh.transport
    return "srun" if inventory.source == ALLOCATION_SOURCE and shutil.which("srun") else "ssh"


def make_transport(inventory: Inventory, ssh: SSHOptions) -> Transport:
    """Local hosts need no SSH (and dlrun does not import paramiko for them); ``srun`` runs
    every other host's commands as steps of the Slurm job dlrun runs in."""
    if transport_kind(inventory, ssh) == "srun":
        from dlrun.transport.srun import SrunTransport

        environ = os.environ
        groups = allocation_inventory(environ).het_groups if in_allocation(environ) else {}
        job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID", "")
        return HostRouter(remote=SrunTransport(job_id, environ, het_groups=groups))
    if inventory.all_local:
        return HostRouter(remote=None)
    from dlrun.transport.ssh import SSHTransport

    return HostRouter(
        remote=SSHTransport(
            config_file=ssh.config_file,
            accept_new_host_keys=ssh.accept_new_host_keys,
            connect_timeout=ssh.connect_timeout,
            known_hosts=ssh.known_hosts,
            host_timeout=ssh.host_timeout if ssh.host_timeout_given else None,
        )
    )
