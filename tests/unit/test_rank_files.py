"""A torch rank's files on a host (``@record``'s error file, the flight recorder's dumps and pipes)
go to ``/tmp/dlrun-<job>/`` only when that folder is the user's own and private: another user who
made the name first (a restart's ``<job>-r1``) gets nothing (``dlrun.remote.agent.private_folder``)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from dlrun.remote.agent import private_folder, private_rank_files

NOBODY = 65534


def mode(path: str | Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_new_folder_is_made_private(tmp_path: Path) -> None:
    top = str(tmp_path / "dlrun-j")
    assert private_folder(top) == top and mode(top) == 0o700


def test_the_users_own_folder_that_no_one_else_could_write_is_kept_and_made_private(tmp_path: Path) -> None:
    top = tmp_path / "dlrun-j"
    top.mkdir(mode=0o755)
    (top / "attempt_0").mkdir()  # another rank of the job on this machine, or another host of it
    assert private_folder(str(top)) == str(top) and mode(top) == 0o700


def test_another_users_folder_a_writable_one_or_a_link_is_passed_over_for_a_new_private_one(tmp_path: Path) -> None:
    theirs, writable, linked = tmp_path / "dlrun-a", tmp_path / "dlrun-b", tmp_path / "dlrun-c"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)  # as root here: what another user on the host would make
    theirs.chmod(0o777)
    writable.mkdir()
    writable.chmod(0o777)  # someone may have put an attempt_1 of theirs in it already
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    linked.symlink_to(tmp_path / "elsewhere")
    for top in (theirs, writable, linked):
        chosen = private_folder(str(top))
        assert chosen is not None and chosen.startswith(f"{top}-") and len(chosen) == len(str(top)) + 13
        assert os.lstat(chosen).st_uid == os.geteuid() and mode(chosen) == 0o700 and Path(chosen).is_dir()
    assert os.listdir(theirs) == [] and os.listdir(tmp_path / "elsewhere") == []


def test_the_rank_files_move_with_their_folder_and_a_path_the_job_set_stays() -> None:
    env = {"TORCHELASTIC_ERROR_FILE": "/tmp/dlrun-j-r1/attempt_1/0/error.json",
           "TORCH_FR_DUMP_TEMP_FILE": "/tmp/dlrun-j-r1/flight-recorder/trace_rank_",
           "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": "/scratch/mine/pipe_rank_", "OTHER": "/tmp/dlrun-j-r1/x"}
    private_rank_files(env, {"/tmp/dlrun-j-r1": "/tmp/dlrun-j-r1-0123456789ab"})
    assert env == {"TORCHELASTIC_ERROR_FILE": "/tmp/dlrun-j-r1-0123456789ab/attempt_1/0/error.json",
                   "TORCH_FR_DUMP_TEMP_FILE": "/tmp/dlrun-j-r1-0123456789ab/flight-recorder/trace_rank_",
                   "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": "/scratch/mine/pipe_rank_", "OTHER": "/tmp/dlrun-j-r1/x"}
    none = {"TORCHELASTIC_ERROR_FILE": "/tmp/dlrun-j/attempt_0/0/error.json"}
    private_rank_files(none, {"/tmp/dlrun-j": None})  # no private folder: no error file, not theirs
    assert none == {}
