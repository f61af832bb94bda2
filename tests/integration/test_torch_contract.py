"""dlrun's torch contract against the real torchrun: the same script dumps its environment
under both, and what torchrun adds, dlrun adds too (values that must agree, agree)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from support.cli import run_dlrun

pytestmark = pytest.mark.slow  # 9-21 s each (2 loaded cores)

pytest.importorskip("torch")

DUMP = """
import json, os
import torch.distributed as dist
print("ENV " + json.dumps({"env": dict(os.environ), "elastic": dist.is_torchelastic_launched()}), flush=True)
"""
#: Set by torchrun for its own agent, not for the ranks: dlrun has no agent store, and its agent
#: handles signals itself.
TORCHRUN_AGENT_ONLY = {"TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_SIGNALS_TO_HANDLE"}
#: Must be equal under both launchers, rank by rank.
SAME_VALUES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
               "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT",
               "TORCHELASTIC_MAX_RESTARTS", "OMP_NUM_THREADS", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


def dumps(text: str) -> dict[str, dict[str, Any]]:
    found = [json.loads(m.group(1)) for m in re.finditer(r"ENV (\{.*\})", text)]
    return {d["env"]["RANK"]: d for d in found}


def test_dlrun_sets_what_torchrun_sets(tmp_path: Path) -> None:
    script = tmp_path / "dump.py"
    script.write_text(DUMP)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH", "OMP_", "DLRUN_"))}
    torchrun = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               str(script)], capture_output=True, text=True, timeout=180, env=base, cwd=tmp_path)
    assert torchrun.returncode == 0, torchrun.stdout + torchrun.stderr
    ours = run_dlrun("launch", "--plain", "--framework", "torch", "--np", "2", str(script), cwd=tmp_path,
                     env={}, timeout=180)
    assert ours.returncode == 0, ours.stdout + ours.stderr
    reference, dlrun = dumps(torchrun.stdout), dumps(ours.stdout)
    assert sorted(reference) == sorted(dlrun) == ["0", "1"]
    for rank in ("0", "1"):
        added_by_torchrun = set(reference[rank]["env"]) - set(base)
        missing = added_by_torchrun - set(dlrun[rank]["env"]) - TORCHRUN_AGENT_ONLY
        assert not missing, f"rank {rank}: torchrun sets {sorted(missing)}, dlrun does not"
        for name in SAME_VALUES:
            assert dlrun[rank]["env"].get(name) == reference[rank]["env"].get(name), name
        assert dlrun[rank]["elastic"] is True  # torch.distributed.is_torchelastic_launched()
        # added on purpose (docs/stacks.md): the flight recorder, dumped into the job's folder, and
        # NCCL's RAS socket at an address of the job's own on each host, and the interface the
        # hosts share (here loopback), as `dlrun topo` says launch sets it
        recorder = {k: v for k, v in dlrun[rank]["env"].items() if k not in reference[rank]["env"]
                    and k.startswith(("TORCH", "NCCL")) and k not in os.environ}  # not this process's own (inductor's)
        assert recorder == {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                            "TORCH_FR_DUMP_TEMP_FILE": recorder["TORCH_FR_DUMP_TEMP_FILE"],
                            "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": recorder["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"],
                            "NCCL_RAS_ADDR": recorder["NCCL_RAS_ADDR"], "NCCL_SOCKET_IFNAME": "lo"}
        assert recorder["TORCH_FR_DUMP_TEMP_FILE"].endswith("/flight-recorder/trace_rank_")
        assert re.fullmatch(r"127\.0\.0\.1:\d+", recorder["NCCL_RAS_ADDR"])
        assert recorder["NCCL_RAS_ADDR"] == dlrun["0"]["env"]["NCCL_RAS_ADDR"]  # one per host
        error_file = dlrun[rank]["env"]["TORCHELASTIC_ERROR_FILE"]
        assert error_file.endswith(f"/attempt_0/{rank}/error.json")
        assert not Path(error_file).exists()  # the agent took it away with its folder


RECORD = """
from torch.distributed.elastic.multiprocessing.errors import record

@record
def main():
    import os
    if os.environ["RANK"] == "1":
        raise ValueError("the exception torch's @record wrote down")

main()
"""


def test_an_exception_recorded_by_torch_reaches_dlrun(tmp_path: Path) -> None:
    """torch's ``@record`` writes to TORCHELASTIC_ERROR_FILE; the agent makes its folder and
    returns it with the rank's exit."""
    script = tmp_path / "record.py"
    script.write_text(RECORD)
    out = run_dlrun("launch", "--plain", "--framework", "torch", "--np", "2", str(script), cwd=tmp_path, timeout=180)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "the exception torch's @record wrote down" in out.stdout + out.stderr
