"""What a new user trips on (issue 36): the real ``dlrun`` CLI as a subprocess, local ranks here,
real sshd hosts in the tests marked ``ssh``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_dlrun

MARKER = "import pathlib, sys; pathlib.Path(sys.argv[0] + '.ran').touch(); print('RAN')\n"


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize(("typo", "meant"), [(("--nproc", "2"), "--np"), (("--framwork", "torch"), "--framework"),
                                             (("--nproc=2",), "--np"), (("--dryrun",), "--dry-run")])
def test_a_misspelled_option_before_the_script_is_a_usage_error_that_starts_nothing(
        tmp_path: Path, typo: tuple[str, ...], meant: str) -> None:
    script = write(tmp_path / "train.py", MARKER)
    out = run_dlrun("launch", "--plain", *typo, "train.py", cwd=tmp_path, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    name = typo[0].partition("=")[0]
    assert f"No such option '{name}'. Did you mean '{meant}'?" in out.stderr, out.stderr
    assert "RAN" not in out.stdout and not Path(f"{script}.ran").exists()
    assert "dlrun: framework" not in out.stderr and "command not found" not in out.stdout + out.stderr
    assert not (tmp_path / "dlrun-logs").exists()  # nothing started, nothing written


def test_only_options_dlrun_lacks_are_refused_and_the_scripts_own_stay_its(tmp_path: Path) -> None:
    write(tmp_path / "train.py", "import sys; print('ARGV', sys.argv[1:])\n")
    # dlrun's own options in click's short forms, before the script; the script's options after it
    out = run_dlrun("launch", "--plain", "-n1", "--framework=none", "train.py", "--nproc", "2", "-x",
                    cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ARGV ['--nproc', '2', '-x']" in out.stdout
    # after --, an argument that starts with '-' is still no command
    out = run_dlrun("launch", "--plain", "--np", "1", "--", "--nproc", "train.py", cwd=tmp_path, timeout=120)
    assert out.returncode == 2 and "--nproc: a script or command never starts with '-'" in out.stderr, out.stderr
    assert "ARGV" not in out.stdout


def test_usage_errors_come_alone_without_the_framework_line(tmp_path: Path) -> None:
    write(tmp_path / "ok.py", "import torch\n")
    for args, words in ((["nosuch.py"], "dlrun: error: script not found: nosuch.py"),
                        (["--log-dir", "/dev/null/logs", "ok.py"], "cannot create the log directory"),
                        (["--hosts", "a:1", "--np", "3", "ok.py"], "--np 3 needs 3 slots")):
        out = run_dlrun("launch", "--plain", *args, cwd=tmp_path, timeout=120)
        assert out.returncode == 2 and out.stderr.startswith("dlrun: error: ") and words in out.stderr, out.stderr
    out = run_dlrun("launch", "--dry-run", "--json", "ok.py", cwd=tmp_path, timeout=120)
    assert out.returncode == 0 and out.stderr.splitlines()[0] == "dlrun: framework torch (import torch in ok.py)"
    assert json.loads(out.stdout)["world_size"] == 2
