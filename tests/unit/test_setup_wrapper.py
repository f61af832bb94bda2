"""The setup step's shell wrapper (``dlrun.push.setup.WRAPPER``), run by a real ``sh``: one
setup at a time per stamp, so two jobs (or hosts sharing an NFS folder) do not install at once."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from dlrun.inventory import parse_inline
from dlrun.push.setup import setup_argv

SLOW_INSTALL = "echo start >> ../installs; sleep 1; echo end >> ../installs"


@pytest.mark.skipif(shutil.which("flock") is None, reason="no flock(1) here")
def test_two_setups_of_one_folder_at_once_run_the_command_once(tmp_path: Path) -> None:
    folder = tmp_path / "proj"
    folder.mkdir()
    host = parse_inline("localhost:1").hosts[0]
    argv = setup_argv(host, SLOW_INSTALL, str(folder), "key-1", always=False)
    both = [subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=60)[0] for p in both]
    assert [p.returncode for p in both] == [0, 0], outs
    assert (tmp_path / "installs").read_text() == "start\nend\n", outs  # once, not interleaved
    assert sorted("unchanged" in out for out in outs) == [False, True], outs
    assert (tmp_path / ".dlrun-cache" / "proj.setup").read_text() == "key-1\n"
    again = subprocess.run(setup_argv(host, SLOW_INSTALL, str(folder), "key-2", always=False), capture_output=True,
                           text=True, timeout=60)
    assert again.returncode == 0 and "running in" in again.stdout  # a new key runs it again, the lock let go
