"""dlrun's Horovod contract against the real horovodrun: the same script dumps its environment
under ``horovodrun --gloo`` and under dlrun, and every variable horovodrun sets, dlrun sets, to
the same value where the value is the contract."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support.cli import run_dlrun

pytestmark = pytest.mark.slow

DUMP = """
import json, os
print("ENV " + json.dumps(dict(os.environ)), flush=True)
"""
#: Differ by design: the rendezvous port is each launcher's free port, and HOROVOD_HOSTNAME only
#: names a host's local scope (``local_<it>``), so it must be one value per host, which both are:
#: horovodrun's is the -H name, dlrun's the address the ranks use.
# the rendezvous address is dlrun's host:port/key (its server wants the job's key in every request)
OWN_VALUES = {"HOROVOD_GLOO_RENDEZVOUS_PORT", "HOROVOD_HOSTNAME", "HOROVOD_GLOO_RENDEZVOUS_ADDR"}


def dumps(text: str) -> dict[str, dict[str, str]]:
    found = [json.loads(m.group(1)) for m in re.finditer(r"ENV (\{.*\})", text)]
    return {d["HOROVOD_RANK"]: d for d in found}


def test_dlrun_sets_what_horovodrun_sets(tmp_path: Path, horovod: None) -> None:
    script = tmp_path / "dump.py"
    script.write_text(DUMP)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "NCCL_", "GLOO_", "DLRUN_"))}
    horovodrun = Path(sys.executable).parent / "horovodrun"
    reference_run = subprocess.run([str(horovodrun), "--gloo", "-np", "2", "-H", "localhost:2", sys.executable,
                                    str(script)], capture_output=True, text=True, timeout=180, env=base, cwd=tmp_path)
    assert reference_run.returncode == 0, reference_run.stdout + reference_run.stderr
    ours = run_dlrun("launch", "--plain", "--framework", "horovod", "--np", "2", str(script), cwd=tmp_path,
                     env={}, timeout=180)
    assert ours.returncode == 0, ours.stdout + ours.stderr
    reference, dlrun = dumps(reference_run.stdout), dumps(ours.stdout)
    assert sorted(reference) == sorted(dlrun) == ["0", "1"]
    for rank in ("0", "1"):
        contract = {k: v for k, v in reference[rank].items() if k.startswith(("HOROVOD_", "NCCL_", "GLOO_"))}
        assert {"HOROVOD_RANK", "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_SIZE", "HOROVOD_CONTROLLER"} <= set(contract)
        missing = set(contract) - set(dlrun[rank])
        assert not missing, f"rank {rank}: horovodrun sets {sorted(missing)}, dlrun does not"
        differ = {k: (v, dlrun[rank][k]) for k, v in contract.items() if k not in OWN_VALUES and dlrun[rank][k] != v}
        assert not differ, f"rank {rank}: (horovodrun, dlrun): {differ}"
    assert len({d["HOROVOD_HOSTNAME"] for d in dlrun.values()}) == 1  # one local scope, as horovodrun's
    for rank in ("0", "1"):  # horovodrun's address, then the port and the key Horovod's client puts in each path
        address, port = reference[rank]["HOROVOD_GLOO_RENDEZVOUS_ADDR"], dlrun[rank]["HOROVOD_GLOO_RENDEZVOUS_PORT"]
        assert re.fullmatch(rf"{re.escape(address)}:{port}/[0-9a-f]{{64}}", dlrun[rank]["HOROVOD_GLOO_RENDEZVOUS_ADDR"])
