"""The srun transport's pure parts: the step command line, srun's environment, node addresses,
and which transport a launch picks."""

from __future__ import annotations

import pytest

from dlrun.allocation import allocation_inventory
from dlrun.errors import UsageError
from dlrun.inventory import parse_inline
from dlrun.transport.factory import SSHOptions, transport_kind
from dlrun.transport.srun import STEP_VARIABLES, SrunTransport, parse_node_addresses, srun_env, step_argv


def test_the_step_runs_the_command_unchanged_after_env_drops_the_step_variables() -> None:
    argv = step_argv("gpu-01", ["python3", "-c", "x; y", "dlrun-agent"], job_id="42", srun="/usr/bin/srun")
    assert argv[:6] == ["/usr/bin/srun", "--overlap", "--nodes=1", "--ntasks=1", "--nodelist=gpu-01", "--jobid=42"]
    assert "--unbuffered" in argv and "--het-group=0" not in argv
    command = argv[argv.index("--") + 1:]
    assert command[0] == "env" and command[-4:] == ["python3", "-c", "x; y", "dlrun-agent"]
    assert {command[i + 1] for i, word in enumerate(command) if word == "-u"} == set(STEP_VARIABLES)
    assert "--het-group=1" in step_argv("n1", ["true"], job_id="42", het_group=1)


def test_srun_gets_dlruns_environment_without_the_jobs_per_task_requests() -> None:
    env = srun_env({"PATH": "/venv/bin:/bin", "SLURM_JOB_ID": "42", "SLURM_CPUS_PER_TASK": "8",
                    "SLURM_GPUS_PER_TASK": "1", "SLURM_NTASKS_PER_NODE": "4", "SLURM_CONF": "/etc/slurm.conf"})
    assert env == {"PATH": "/venv/bin:/bin", "SLURM_JOB_ID": "42", "SLURM_CONF": "/etc/slurm.conf"}


def test_node_addresses_from_scontrol() -> None:
    text = ("NodeName=host0 Arch=x86_64 CoresPerSocket=1 NodeAddr=127.0.0.1 NodeHostName=vm Port=4\n"
            "NodeName=gpu-2 Arch=x86_64 NodeAddr=10.0.0.7 NodeHostName=gpu-2\n"
            "NodeName=odd Arch=x86_64\n")
    assert parse_node_addresses(text) == {"host0": "127.0.0.1", "gpu-2": "10.0.0.7", "odd": "odd"}


def test_srun_needs_an_allocation() -> None:
    with pytest.raises(UsageError, match="inside a Slurm allocation"):
        SrunTransport("", {}, srun="/usr/bin/srun")


def test_auto_is_srun_for_the_allocations_own_nodes_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("shutil.which", lambda name: f"/usr/bin/{name}")
    allocation = allocation_inventory({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n[1-2]"}).inventory
    assert transport_kind(allocation, SSHOptions()) == "srun"
    assert transport_kind(allocation, SSHOptions(transport="ssh")) == "ssh"
    assert transport_kind(parse_inline("n1,n2"), SSHOptions()) == "ssh"
    assert transport_kind(parse_inline("n1,n2"), SSHOptions(transport="srun")) == "srun"
    monkeypatch.setattr("shutil.which", lambda name: None)
    assert transport_kind(allocation, SSHOptions()) == "ssh"  # no srun here: SSH, as before
