"""Hosts that share a code folder (an NFS home) find it out during the launch's survey: each
claims the folder for the launch, and the first claim names the host that pushes. Real
processes race here, as the hosts' agents do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from dlrun.run.agents import AgentAnswer
from dlrun.run.pushstep import claiming, sharing_hosts

from support.cli import REPO

HELPER = REPO / "dlrun" / "remote" / "push_helper.py"
CLAIM = """
import json, runpy, sys
helper = runpy.run_path(sys.argv[1], run_name="helper")
spec = json.loads(sys.argv[2])
print(json.dumps(helper["survey"](spec)[0].get("claimed_by")))
"""


def survey_in_processes(specs: list[dict[str, object]]) -> list[str | None]:
    procs = [subprocess.Popen([sys.executable, "-c", CLAIM, str(HELPER), json.dumps(spec)], stdout=subprocess.PIPE,
                              text=True) for spec in specs]
    return [json.loads(proc.communicate(timeout=60)[0]) for proc in procs]


def spec(root: Path, host: str, token: str = "job1") -> dict[str, object]:
    return {"root": str(root), "paths": ["train.py"], "claim": {"token": token, "host": host}}


def test_hosts_that_see_one_folder_name_one_claimant(tmp_path: Path) -> None:
    shared = tmp_path / "home" / "proj"  # not made yet: the claim goes to the nearest folder that exists
    (tmp_path / "home").mkdir()
    owners = survey_in_processes([spec(shared, f"host{i}") for i in range(4)])
    assert len(set(owners)) == 1 and owners[0] in {"host0", "host1", "host2", "host3"}, owners
    # hosts with folders of their own each claim their own
    own = survey_in_processes([spec(tmp_path / f"h{i}" / "proj", f"host{i}") for i in range(2)])
    assert own == ["host0", "host1"]
    # another launch claims afresh
    assert survey_in_processes([spec(shared, "host3", token="job2")]) == ["host3"]


def test_a_push_removes_the_claims_and_old_ones_go_by_themselves(tmp_path: Path) -> None:
    folder = tmp_path / "proj"
    folder.mkdir()
    survey_in_processes([spec(folder, "host0"), spec(folder, "host1")])
    old = folder / ".dlrun-claim-old"
    old.write_text("host9")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    survey_in_processes([spec(folder, "host0", token="job3")])
    assert sorted(p.name for p in folder.iterdir()) == [".dlrun-claim-job1", ".dlrun-claim-job3"]
    unclaim = "import runpy, sys\nrunpy.run_path(sys.argv[1], run_name='helper')['unclaim'](sys.argv[2])\n"
    subprocess.run([sys.executable, "-c", unclaim, str(HELPER), str(folder)], check=True, timeout=60)  # a push
    assert list(folder.iterdir()) == []


def test_followers_get_no_push_of_their_own(tmp_path: Path) -> None:
    from dlrun.push.session import PushTarget
    from dlrun.push.tree import Manifest

    request = claiming({"targets": [{"root": "~/proj", "paths": ["a.py"]}], "idle": 5}, "job1", "host1")
    assert request["targets"][0]["claim"] == {"token": "job1", "host": "host1"}
    manifest = Manifest()
    targets = {h: PushTarget("code", "~/proj", manifest) for h in ("host0", "host1", "host2")}

    def answer(host: str, owner: str) -> AgentAnswer:
        reply = {"root": "/home/u/proj", "claimed_by": owner}
        return AgentAnswer(host, "", survey={"targets": [reply]})

    answers = {"host0": answer("host0", "host0"), "host1": answer("host1", "host0"), "host2": answer("host2", "host2")}
    shared = sharing_hosts(targets, answers, {}, ["host0", "host1", "host2"])
    assert list(shared) == ["host1"] and shared["host1"].code_dir == "/home/u/proj"
    assert shared["host1"].files_sent == 0
    # an owner that is not part of the plan pushes nothing: its follower pushes itself
    assert sharing_hosts(targets, answers, {}, ["host1", "host2"]) == {}
