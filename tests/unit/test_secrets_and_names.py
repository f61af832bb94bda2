"""Secrets kept off command lines and out of printouts (``-e NAME``, ``--env-file``, masked
script arguments), and names checked and escaped (issue 34, items 3 and 6)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dlrun.errors import UsageError
from dlrun.render import mask_argv, printable
from dlrun.userenv import parse_env_args, rank_env, read_env_file


def test_a_bare_name_takes_this_process_value_as_docker_does() -> None:
    assert parse_env_args(["DB_PASSWORD", "A=1"], {"DB_PASSWORD": "s3cret"}) == {"DB_PASSWORD": "s3cret", "A": "1"}


def test_a_bare_name_that_is_not_set_is_an_error_that_names_it() -> None:
    with pytest.raises(UsageError, match="DB_PASSWORD is not set"):
        parse_env_args(["DB_PASSWORD"], {})


@pytest.mark.parametrize("pair", ["A\nB=1", "A B=1", "1A=1", "=1", "A-B=1", "\x1b[31mX=1"])
def test_env_names_are_checked_as_the_inventory_checks_them(pair: str) -> None:
    with pytest.raises(UsageError, match=r"--env \(argument 2\): expected NAME=VALUE or NAME") as caught:
        parse_env_args(["OK=1", pair], {})
    assert "\x1b" not in str(caught.value) and "\n" not in caught.value.message and "=1" not in str(caught.value)


def test_an_env_file_gives_name_value_lines_and_the_command_line_wins(tmp_path: Path) -> None:
    path = tmp_path / "secrets.env"
    path.write_text("# the job's secrets\n\nDB_PASSWORD=p@ss word=x\nHF_TOKEN=hf_1\nFROM_HERE\n")
    path.chmod(0o600)
    os.environ["FROM_HERE"] = "here"
    try:
        assert read_env_file(path) == {"DB_PASSWORD": "p@ss word=x", "HF_TOKEN": "hf_1", "FROM_HERE": "here"}
        assert rank_env({"HF_TOKEN": "cli"}, [path])["HF_TOKEN"] == "cli"
    finally:
        del os.environ["FROM_HERE"]


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o644])
def test_an_env_file_others_may_read_or_change_is_refused(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "secrets.env"
    path.write_text("DB_PASSWORD=x\n")
    path.chmod(mode)
    with pytest.raises(UsageError, match=f"mode {mode:04o}") as caught:
        read_env_file(path)
    assert "chmod 600" in str(caught.value) and "DB_PASSWORD=x" not in str(caught.value)


def test_an_env_file_link_and_a_bad_line_are_refused(tmp_path: Path) -> None:
    real = tmp_path / "real.env"
    real.write_text("A=1\nnot a line\n")
    real.chmod(0o600)
    with pytest.raises(UsageError, match=r"real.env:2: expected NAME=VALUE"):
        read_env_file(real)
    link = tmp_path / "link.env"
    link.symlink_to(real)
    with pytest.raises(UsageError, match=r"link\.env"):
        read_env_file(link)


def test_the_script_arguments_are_masked_where_they_name_a_secret() -> None:
    argv = ["python", "train.py", "--db", "postgres://ml:hunter2@db/x", "--password", "hunter2",
            "--api-key=sk-1", "DB_PASS=pw", "--token", "--epochs", "3", "-v"]
    assert mask_argv(argv) == ["python", "train.py", "--db", "postgres://ml:****@db/x", "--password", "****",
                               "--api-key=****", "DB_PASS=****", "--token", "--epochs", "3", "-v"]


def test_control_characters_are_escaped_in_what_dlrun_prints() -> None:
    assert printable("gpu\x1b]0;owned\x07\nrank 0") == "gpu\\x1b]0;owned\\x07\\nrank 0"
    assert printable("plain: ünïcode ok") == "plain: ünïcode ok"
    assert printable("\x9b31m") == "\\x9b31m"
