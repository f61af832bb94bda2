"""The login user's disk cache of ``ssh -G`` answers: OpenSSH still reads the config, once per
host and config, not once per host at every launch.

Owns what an answer depends on (the key: the config files' contents, found by following their
``Include`` lines, the ``ssh`` binary, the arguments, the local user, home and host name, the
environment variables the files name) and the entries' checks (owner, mode, links, header,
digest). A config whose answer depends on more than that (``Match exec``, ``localnetwork``,
``canonical``/``final``, host name canonicalisation, tokens in ``Include``) is never cached, nor
an answer for which OpenSSH read a file the key does not cover. docs/architecture.md, "The ssh -G
cache".
"""

from __future__ import annotations

import glob as globmod
import hashlib
import json
import os
import pwd
import re
import shlex
import socket
from collections.abc import Sequence
from dataclasses import dataclass

#: Where the answers live: ``$XDG_CACHE_HOME/dlrun/ssh-g`` or ``~/.cache/dlrun/ssh-g``.
CACHE_DIR = ("dlrun", "ssh-g")
HEADER = b"dlrun-ssh-g 1 "
KEEP = 4096  # entries kept when one is written (the oldest go)
MAX_DEPTH = 16  # Include nesting OpenSSH allows

_KEYWORD = re.compile(r"\s*([A-Za-z]+)\s*(?:=\s*|\s+)(.*)")
_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_DYNAMIC_MATCH = {"exec", "localnetwork", "canonical", "final", "!exec", "!localnetwork", "!canonical", "!final"}
_READING = re.compile(r"^debug1: Reading configuration data (.+)$", re.M)


@dataclass(frozen=True)
class ConfigFiles:
    """The config files ``ssh -G`` reads (absolute paths) and a digest of their contents; ``digest``
    None when an answer may depend on more than the files (``why`` says what)."""

    paths: frozenset[str]
    digest: str | None
    why: str = ""


class _Uncacheable(Exception):
    pass


def config_files(config_file: str | None) -> ConfigFiles:
    """The files OpenSSH reads for ``ssh -G [-F config_file]``: ``config_file`` alone, or the
    user's ``~/.ssh/config`` then ``/etc/ssh/ssh_config``; each with what it includes."""
    home = pwd.getpwuid(os.getuid()).pw_dir
    roots = [(config_file, True)] if config_file else [(os.path.join(home, ".ssh", "config"), True),
                                                       ("/etc/ssh/ssh_config", False)]
    digest = hashlib.sha256()
    paths: set[str] = set()
    names: set[str] = set()
    try:
        for path, user in roots:
            _walk(os.path.abspath(path), user, home, 0, digest, paths, names)
    except _Uncacheable as exc:
        return ConfigFiles(frozenset(paths), None, str(exc))
    for name in sorted(names):  # ${NAME} in an option is the environment's, at ssh -G's time
        digest.update(f"env {name}={os.environ.get(name)!r}\0".encode())
    return ConfigFiles(frozenset(paths), digest.hexdigest())


def _walk(path: str, user: bool, home: str, depth: int, digest: hashlib._Hash, paths: set[str],
          names: set[str]) -> None:
    if depth > MAX_DEPTH:
        raise _Uncacheable(f"{path}: Include nested more than {MAX_DEPTH} deep")
    paths.add(path)
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        digest.update(f"missing {path}\0".encode())
        return
    except OSError as exc:
        raise _Uncacheable(f"{path}: {exc.strerror or exc}") from exc
    digest.update(f"file {path} {len(data)}\0".encode() + data)
    text = data.decode("utf-8", errors="replace")
    names.update(_ENV.findall(text))
    for line in text.splitlines():
        match = _KEYWORD.match(line)
        if not match:
            continue
        keyword, rest = match[1].lower(), match[2]
        try:
            words = shlex.split(rest, comments=True)
        except ValueError as exc:  # OpenSSH will say what is wrong; nothing to cache
            raise _Uncacheable(f"{path}: {exc}") from exc
        if keyword == "match" and _DYNAMIC_MATCH & {w.lower() for w in words}:
            raise _Uncacheable(f"{path}: Match {rest.strip()}")
        if keyword == "canonicalizehostname" and words and words[0].lower() not in ("no", "false"):
            raise _Uncacheable(f"{path}: CanonicalizeHostname {words[0]}")
        if keyword != "include":
            continue
        for pattern in words:
            if "%" in pattern or "$" in pattern:
                raise _Uncacheable(f"{path}: Include {pattern}")
            if pattern.startswith("~"):
                pattern = home + pattern[1:] if pattern[1:2] in ("", "/") else os.path.expanduser(pattern)
            if not os.path.isabs(pattern):
                pattern = os.path.join(os.path.join(home, ".ssh") if user else "/etc/ssh", pattern)
            found = sorted(globmod.glob(pattern))
            digest.update(f"include {pattern} {json.dumps(found)}\0".encode())
            for name in found:
                _walk(name, user, home, depth + 1, digest, paths, names)


def files_read(ssh_stderr: str) -> set[str]:
    """The files ``ssh -v -G`` says it read (its "Reading configuration data" lines), absolute."""
    return {os.path.abspath(name.strip()) for name in _READING.findall(ssh_stderr)}


def cache_key(ssh: str, files: ConfigFiles, argv: Sequence[str]) -> str | None:
    """The key of ``argv``'s answer (``argv``: the ``ssh -G`` command line without ``-v``), or
    None when it is not cached."""
    if files.digest is None:
        return None
    try:
        real = os.path.realpath(ssh)
        st = os.stat(real)
    except OSError:
        return None
    entry = pwd.getpwuid(os.getuid())
    parts = [HEADER.decode(), real, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, os.getuid(),
             entry.pw_name, entry.pw_dir, os.environ.get("HOME"), socket.gethostname(), files.digest, list(argv)]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def cache_dir() -> str:
    top = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(top, *CACHE_DIR)


def _open_dir(create: bool) -> int | None:
    """The cache folder, opened, when it is the user's own and no one else may write to it."""
    path = cache_dir()
    try:
        if create:
            os.makedirs(path, 0o700, exist_ok=True)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        os.close(fd)
        return None
    return fd


def read(key: str) -> str | None:
    """The cached answer for ``key``: only from a regular file of the user's own, mode 0600 or
    less, one link, whose header names ``key`` and whose digest checks out; else None."""
    d = _open_dir(create=False)
    if d is None:
        return None
    try:
        fd = os.open(key, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=d)
        with os.fdopen(fd, "rb") as fh:
            st = os.fstat(fh.fileno())
            data = fh.read(1 << 20)
    except OSError:
        return None
    finally:
        os.close(d)
    head = HEADER + key.encode() + b"\n"
    body = data[len(head) + 32:]
    if (st.st_uid != os.geteuid() or st.st_mode & 0o077 or (st.st_mode & 0o170000) != 0o100000
            or st.st_nlink != 1 or not data.startswith(head)
            or hashlib.sha256(body).digest() != data[len(head):len(head) + 32]):
        return None
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        return None


def write(key: str, answer: str) -> None:
    """Stores ``answer`` under ``key`` (atomically, mode 0600); any failure leaves no entry."""
    d = _open_dir(create=True)
    if d is None:
        return
    body = answer.encode("utf-8")
    tmp = f"{key}.{os.getpid()}.{os.urandom(4).hex()}.tmp"  # one of its own: threads look the same name up at once
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=d)
        with os.fdopen(fd, "wb") as fh:
            fh.write(HEADER + key.encode() + b"\n" + hashlib.sha256(body).digest() + body)
        os.replace(tmp, key, src_dir_fd=d, dst_dir_fd=d)
        _prune(d)
    except OSError:
        try:
            os.unlink(tmp, dir_fd=d)
        except OSError:
            pass
    finally:
        os.close(d)


def _prune(d: int) -> None:
    """Keeps the newest ``KEEP`` entries (a changed config leaves its old answers behind)."""
    names = os.listdir(d)
    if len(names) <= KEEP:
        return
    aged = []
    for name in names:
        try:
            aged.append((os.stat(name, dir_fd=d, follow_symlinks=False).st_mtime_ns, name))
        except OSError:
            pass
    for _, name in sorted(aged)[: len(aged) - KEEP]:
        try:
            os.unlink(name, dir_fd=d)
        except OSError:
            pass
