"""The disk cache of ``ssh -G`` answers (dlrun.transport.ssh_g_cache) with the real ``ssh``: a
second reader answers from it without starting ``ssh``; a change to any config file (an included
one, a new file an Include's glob matches), to an environment variable the config names, or to
the arguments asks OpenSSH again; configs whose answer depends on more are never cached; an
entry that is tampered with, too open, linked or someone else's is ignored."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from dlrun.transport import ssh_g_cache
from dlrun.transport.ssh_config import HostConfig, Request, SSHConfigReader

SSH = shutil.which("ssh")
pytestmark = pytest.mark.skipif(SSH is None, reason="no ssh binary (OpenSSH client)")


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "dlrun" / "ssh-g"


class Counter:
    """Counts the ``ssh`` processes the readers start."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.argvs: list[list[str]] = []
        real = subprocess.run

        def run(argv: list[str], *args: object, **kwargs: object) -> object:
            self.argvs.append(list(argv))
            return real(argv, *args, **kwargs)  # type: ignore[call-overload]

        monkeypatch.setattr(subprocess, "run", run)


def look(config: Path, request: Request) -> HostConfig:
    return SSHConfigReader(str(config), SSH).lookup(request)


def entries(cache: Path) -> list[Path]:
    return sorted(cache.iterdir()) if cache.is_dir() else []


def test_the_second_reader_answers_from_the_cache(tmp_path: Path, cache: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "config"
    config.write_text("Host a*\n    Port 2022\n    User alice\n")
    calls = Counter(monkeypatch)
    first = SSHConfigReader(str(config), SSH).lookup_all([Request("a1"), Request("a2"), Request("b")])
    assert len(calls.argvs) == 3 and all("-v" in argv for argv in calls.argvs)
    assert len(entries(cache)) == 3
    assert all(entry.stat().st_mode & 0o777 == 0o600 for entry in entries(cache))
    assert cache.stat().st_mode & 0o777 == 0o700
    again = SSHConfigReader(str(config), SSH).lookup_all([Request("a1"), Request("a2"), Request("b")])
    assert len(calls.argvs) == 3 and again == first
    assert (again[0].port, again[0].user, again[2].port) == (2022, "alice", 22)
    look(config, Request("a1", port=2300))  # other arguments: another answer
    assert len(calls.argvs) == 4 and look(config, Request("a1", port=2300)).port == 2300


def test_a_changed_config_is_read_again(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "d").mkdir()
    config = tmp_path / "config"
    config.write_text(f"Include {tmp_path}/d/*.conf\nHost *\n    Include {tmp_path}/port.conf\n")
    (tmp_path / "port.conf").write_text("Port 2022\n")
    assert look(config, Request("h")).port == 2022
    calls = Counter(monkeypatch)
    assert look(config, Request("h")).port == 2022 and not calls.argvs
    (tmp_path / "port.conf").write_text("Port 2023\n")  # an included file, same size
    assert look(config, Request("h")).port == 2023 and len(calls.argvs) == 1
    (tmp_path / "d" / "user.conf").write_text("Host h\n    User globbed\n")  # a new file for a glob
    assert look(config, Request("h")).user == "globbed" and len(calls.argvs) == 2
    (tmp_path / "d" / "user.conf").unlink()  # back to the files of an answer already cached
    assert look(config, Request("h")).user != "globbed" and len(calls.argvs) == 2
    (tmp_path / "port.conf").write_text("Port 2025\n")
    assert look(config, Request("h")).port == 2025 and len(calls.argvs) == 3


def test_an_environment_variable_the_config_names_is_part_of_the_key(tmp_path: Path, cache: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "config"
    config.write_text("Host *\n    UserKnownHostsFile ${DLRUN_TEST_KH}/known\n")
    monkeypatch.setenv("DLRUN_TEST_KH", str(tmp_path / "one"))
    assert look(config, Request("h")).user_known_hosts_files == (f"{tmp_path}/one/known",)
    monkeypatch.setenv("DLRUN_TEST_KH", str(tmp_path / "two"))
    assert look(config, Request("h")).user_known_hosts_files == (f"{tmp_path}/two/known",)


@pytest.mark.parametrize("line", ["Match exec \"test -e {dir}/flag\"\n    Port 2024",
                                  "Match final\n    Port 2024",
                                  "CanonicalizeHostname yes",
                                  "Include {dir}/%u.conf"])
def test_a_config_that_depends_on_more_than_its_files_is_never_cached(line: str, tmp_path: Path, cache: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "config"
    config.write_text(line.replace("{dir}", str(tmp_path)) + "\n")
    look(config, Request("h"))
    assert entries(cache) == []
    assert ssh_g_cache.config_files(str(config)).digest is None


def test_match_exec_is_asked_every_time(tmp_path: Path, cache: Path) -> None:
    config = tmp_path / "config"
    config.write_text(f"Match exec \"test -e {tmp_path}/flag\"\n    Port 2024\n")
    assert look(config, Request("h")).port == 22
    (tmp_path / "flag").touch()
    assert look(config, Request("h")).port == 2024


def _filled(tmp_path: Path, cache: Path) -> tuple[Path, Path]:
    config = tmp_path / "config"
    config.write_text("Host h\n    Port 2022\n")
    assert look(config, Request("h")).port == 2022
    [entry] = entries(cache)
    return config, entry


def _forged(entry: Path) -> None:
    """The entry's answer says port 2999 (header and digest made to fit where the test wants)."""
    data = entry.read_bytes()
    entry.write_bytes(data.replace(b"port 2022", b"port 2999"))


@pytest.mark.parametrize("how", ["tampered", "truncated", "group-readable", "symlink", "hard link",
                                 "foreign owner", "open folder"])
def test_a_bad_entry_is_ignored(how: str, tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config, entry = _filled(tmp_path, cache)
    key = entry.name
    forged = ssh_g_cache.HEADER + key.encode() + b"\n"
    body = entry.read_bytes()[len(forged) + 32:].replace(b"port 2022", b"port 2999")
    good_forgery = forged + hashlib.sha256(body).digest() + body  # digest fits: only the file's
    if how == "tampered":                                                      # place and mode may reject it
        _forged(entry)
    elif how == "truncated":
        entry.write_bytes(entry.read_bytes()[:-10])
    elif how == "group-readable":
        entry.write_bytes(good_forgery)
        entry.chmod(0o640)
    elif how == "symlink":
        other = tmp_path / "elsewhere"
        other.write_bytes(good_forgery)
        other.chmod(0o600)
        entry.unlink()
        entry.symlink_to(other)
    elif how == "hard link":
        entry.write_bytes(good_forgery)
        os.link(entry, tmp_path / "second-name")
    elif how == "foreign owner":
        if os.geteuid() != 0:
            pytest.skip("needs root to give the entry away")
        entry.write_bytes(good_forgery)
        os.chown(entry, 65534, 65534)
    elif how == "open folder":
        entry.write_bytes(good_forgery)
        cache.chmod(0o777)
    calls = Counter(monkeypatch)
    assert look(config, Request("h")).port == 2022
    assert len(calls.argvs) == 1


def test_a_well_formed_entry_is_what_is_read(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The control for the test above: the same forgery, left as the cache writes entries, is
    used (so the checks, not a stale key, are what reject the bad ones)."""
    config, entry = _filled(tmp_path, cache)
    head = ssh_g_cache.HEADER + entry.name.encode() + b"\n"
    body = entry.read_bytes()[len(head) + 32:].replace(b"port 2022", b"port 2999")
    entry.write_bytes(head + hashlib.sha256(body).digest() + body)
    calls = Counter(monkeypatch)
    assert look(config, Request("h")).port == 2999 and not calls.argvs


def test_without_the_disk_cache_nothing_is_written(tmp_path: Path, cache: Path) -> None:
    config = tmp_path / "config"
    config.write_text("Host h\n    Port 2022\n")
    assert SSHConfigReader(str(config), SSH, disk_cache=False).lookup(Request("h")).port == 2022
    assert entries(cache) == []


def test_a_config_edited_while_ssh_reads_it_is_not_cached(tmp_path: Path, cache: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The key is the files before ``ssh -G``; an answer read from other contents is not kept
    under it (the files going back to the old contents would find the new answer)."""
    config = tmp_path / "config"
    config.write_text("Host h\n    Port 2022\n")
    real = subprocess.run

    def run_then_edit(argv: list[str], *args: object, **kwargs: object) -> object:
        out = real(argv, *args, **kwargs)  # type: ignore[call-overload]
        config.write_text("Host h\n    Port 2023\n")
        return out

    monkeypatch.setattr(subprocess, "run", run_then_edit)
    assert look(config, Request("h")).port == 2022
    assert entries(cache) == []
