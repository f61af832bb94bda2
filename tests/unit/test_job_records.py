"""A detached job's host record as ``dlrun ps`` reads it (``dlrun.remote.jobs.host_record``):
a keeper between making its folder and writing its pid is starting, not lost."""

from __future__ import annotations

import os
import time
from pathlib import Path

from dlrun.remote import jobs


def test_a_folder_without_the_keepers_pid_is_starting_then_lost(tmp_path: Path) -> None:
    hostdir = tmp_path / "job-1" / "host-a"
    hostdir.mkdir(parents=True)
    assert jobs.host_record("job-1", str(hostdir))["state"] == "starting"
    old = time.time() - jobs.START_GRACE - 5
    os.utime(hostdir, (old, old))  # no pid for longer than a keeper takes to fork: it died first
    record = jobs.host_record("job-1", str(hostdir))
    assert record["state"] == "lost" and record["root_cause"] == "the job's keeper on this host is gone"
    assert not jobs.removable(str(hostdir), "job-1")  # another machine's, maybe (a shared home): kept
