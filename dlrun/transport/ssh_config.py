"""OpenSSH client configuration for one host, read the way OpenSSH reads it.

Owns ``HostConfig`` (every ssh_config option dlrun uses, merged with the inventory) and how it
is found: ``ssh -G`` where an ``ssh`` binary is installed (OpenSSH's own parser answers, so
Match, Include, tokens and "first value wins" are exactly OpenSSH's), else paramiko's parser as
a fallback (README, section "SSH", lists where it differs). Inventory values win: they go to
``ssh -G`` as ``-p``, ``-l`` and ``-i``. Also here: token expansion (``%h`` … ``${VAR}``) for
the options ``ssh -G`` prints unexpanded, and OpenSSH's host-pattern matching for known_hosts.
Many hosts are looked up in parallel threads, and ``ssh -G``'s answers are kept on disk
(``ssh_g_cache``) while the config files, ``ssh`` and the arguments are unchanged; a config
OpenSSH rejects is a ``UsageError`` carrying OpenSSH's own message (file and line).
"""

from __future__ import annotations

import getpass
import glob as globmod
import hashlib
import os
import re
import shlex
import socket
import subprocess
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

# isort: split
import paramiko

from dlrun.errors import UsageError
from dlrun.transport import ssh_g_cache

DEFAULT_IDENTITIES = ("~/.ssh/id_rsa", "~/.ssh/id_ecdsa", "~/.ssh/id_ecdsa_sk", "~/.ssh/id_ed25519",
                      "~/.ssh/id_ed25519_sk", "~/.ssh/id_xmss", "~/.ssh/id_dsa")  # OpenSSH's, in its order
DEFAULT_USER_KNOWN_HOSTS = ("~/.ssh/known_hosts", "~/.ssh/known_hosts2")
DEFAULT_GLOBAL_KNOWN_HOSTS = ("/etc/ssh/ssh_known_hosts", "/etc/ssh/ssh_known_hosts2")
DEFAULT_CONNECT_TIMEOUT = 10.0  # seconds, where neither the command line nor ConnectTimeout sets one
SSH_G_TIMEOUT = 30.0  # seconds; ssh -G reads files only (unless the config has a Match exec)


@dataclass(frozen=True)
class Request:
    """One host to look up: the name given to ssh, and the inventory's own values (None: unset)."""

    alias: str
    port: int | None = None
    user: str | None = None
    identity_file: str | None = None


@dataclass(frozen=True)
class HostConfig:
    """The options dlrun uses for one host, expanded as OpenSSH expands them."""

    alias: str  # the name asked for (%n)
    hostname: str  # lower case, as OpenSSH has it
    port: int
    user: str
    identity_files: tuple[str, ...]  # in the order OpenSSH tries them (missing files included)
    identities_only: bool = False
    certificate_files: tuple[str, ...] = ()
    proxy_jump: str | None = None  # "hop1,user@hop2:2200"; never set together with proxy_command
    proxy_command: str | None = None  # tokens expanded; run as ``$SHELL -c "exec <command>"``
    user_known_hosts_files: tuple[str, ...] = ()
    global_known_hosts_files: tuple[str, ...] = ()
    host_key_alias: str | None = None
    connect_timeout: float | None = None  # None: not set
    server_alive_interval: float = 0.0  # 0: off
    server_alive_count_max: int = 3
    strict_host_key_checking: str = "ask"  # "yes", "ask", "accept-new" or "no"
    hash_known_hosts: bool = False  # HashKnownHosts: new known_hosts entries are hashed

    @property
    def known_hosts_name(self) -> str:
        """The name OpenSSH looks the host up by in known_hosts."""
        if self.host_key_alias:
            return self.host_key_alias
        return known_hosts_name(self.hostname, self.port)


def known_hosts_name(hostname: str, port: int) -> str:
    """How known_hosts (and ``ssh-keygen -R``) name a host: ``[host]:port`` off port 22."""
    return hostname if port == 22 else f"[{hostname}]:{port}"


# --------------------------------------------------------------------------- tokens


def token_values(alias: str, hostname: str, port: int, user: str, host_key_alias: str | None) -> dict[str, str]:
    """OpenSSH's client tokens for a host (ssh_config(5), TOKENS)."""
    local = socket.gethostname()
    return {
        "h": hostname, "p": str(port), "r": user, "n": alias, "k": host_key_alias or alias,
        "u": getpass.getuser(), "d": os.path.expanduser("~"), "i": str(os.getuid()),
        "l": local, "L": local.split(".")[0],
        "C": hashlib.sha1(f"{local}{hostname}{port}{user}".encode()).hexdigest(),
    }


def expand_tokens(value: str, tokens: Mapping[str, str], *, option: str, env: bool = True) -> str:
    """``%x`` tokens (``%%`` is ``%``) and, with ``env``, ``${NAME}`` environment variables."""

    def one(match: re.Match[str]) -> str:
        text = match[0]
        if text == "%%":
            return "%"
        if text.startswith("$"):
            name = text[2:-1]
            if name not in os.environ:
                raise UsageError(f"ssh config {option} {value!r}: environment variable ${{{name}}} is not set")
            return os.environ[name]
        if text[1:] not in tokens:
            raise UsageError(f"ssh config {option} {value!r}: unknown token {text!r}")
        return tokens[text[1:]]

    return re.sub(r"%.?|\$\{[^}]*\}" if env else r"%.?", one, value)


def expand_path(value: str, tokens: Mapping[str, str], *, option: str) -> str:
    """A file option as OpenSSH expands it: ``~`` first, then tokens and ``${NAME}``."""
    return expand_tokens(os.path.expanduser(value), tokens, option=option)


def proxy_command_tokens(config: HostConfig) -> dict[str, str]:
    """The tokens OpenSSH puts in a ProxyCommand (sshconnect.c: %h %k %n %p %r)."""
    return {"h": config.hostname, "k": config.host_key_alias or config.alias, "n": config.alias,
            "p": str(config.port), "r": config.user}


# --------------------------------------------------------------------------- host patterns


def _pattern(pattern: str) -> re.Pattern[str]:
    """An OpenSSH host pattern: ``*`` and ``?`` are wildcards, every other character literal."""
    return re.compile("".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern.lower()))


def host_matches(name: str, patterns: Sequence[str]) -> bool:
    """OpenSSH's match_hostname: some pattern matches and no negated (``!``) one does."""
    found = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        if _pattern(pattern[1:] if negated else pattern).fullmatch(name.lower()):
            if negated:
                return False
            found = True
    return found


# --------------------------------------------------------------------------- building a HostConfig


def _number(value: str | None, option: str, alias: str) -> float | None:
    if value is None or value.lower() == "none":
        return None
    try:
        return float(value)
    except ValueError:
        raise UsageError(f"ssh config for {alias}: {option} {value!r} is not a number") from None


def _strict(value: str | None) -> str:
    text = (value or "ask").lower()
    return {"true": "yes", "yes": "yes", "false": "no", "no": "no", "off": "no", "accept-new": "accept-new"}.get(
        text, "ask")


def build(request: Request, options: Mapping[str, Sequence[str]], *, from_ssh_g: bool) -> HostConfig:
    """A HostConfig from option values (lower-case keys, one list entry per value): ``ssh -G``'s,
    whose known-hosts files OpenSSH has expanded, or the fallback's; the rest is expanded here."""

    def first(key: str) -> str | None:
        values = options.get(key)
        return values[0] if values else None

    alias = request.alias
    hostname = (first("hostname") or alias).lower()
    port_text = first("port") or "22"
    if not port_text.isdigit():
        raise UsageError(f"ssh config for {alias}: Port {port_text!r} is not a number")
    port = int(port_text)
    user = first("user") or getpass.getuser()
    host_key_alias = first("hostkeyalias")
    host_key_alias = None if host_key_alias in (None, "none") else host_key_alias.lower()
    tokens = token_values(alias, hostname, port, user, host_key_alias)
    if request.identity_file:  # the inventory's key replaces the config's (ssh -i would add one)
        identities: Sequence[str] = [request.identity_file]
    else:
        identities = options.get("identityfile") or DEFAULT_IDENTITIES
    proxy_jump = first("proxyjump")
    proxy_command = first("proxycommand")
    proxy_jump = None if proxy_jump is None or proxy_jump.lower() == "none" else proxy_jump
    proxy_command = None if proxy_command is None or proxy_command.lower() == "none" else proxy_command
    config = HostConfig(
        alias=alias,
        hostname=hostname,
        port=port,
        user=user,
        identity_files=tuple(dict.fromkeys(expand_path(i, tokens, option="IdentityFile") for i in identities)),
        identities_only=(first("identitiesonly") or "no").lower() in ("yes", "true"),
        certificate_files=tuple(expand_path(c, tokens, option="CertificateFile")
                                for c in options.get("certificatefile", ())),
        proxy_jump=proxy_jump,
        user_known_hosts_files=_files(options.get("userknownhostsfile"), DEFAULT_USER_KNOWN_HOSTS, tokens,
                                      "UserKnownHostsFile", from_ssh_g),
        global_known_hosts_files=_files(options.get("globalknownhostsfile"), DEFAULT_GLOBAL_KNOWN_HOSTS, tokens,
                                        "GlobalKnownHostsFile", from_ssh_g),
        host_key_alias=host_key_alias,
        connect_timeout=_number(first("connecttimeout"), "ConnectTimeout", alias),
        server_alive_interval=_number(first("serveraliveinterval"), "ServerAliveInterval", alias) or 0.0,
        server_alive_count_max=int(_number(first("serveralivecountmax"), "ServerAliveCountMax", alias) or 3),
        strict_host_key_checking=_strict(first("stricthostkeychecking")),
        hash_known_hosts=(first("hashknownhosts") or "no").lower() in ("yes", "true"),
    )
    if proxy_command is not None and proxy_jump is None:
        command = expand_tokens(proxy_command, {k: shlex.quote(v) for k, v in proxy_command_tokens(config).items()},
                                option="ProxyCommand", env=False)
        config = replace(config, proxy_command=command)
    return config


def _files(values: Sequence[str] | None, default: Sequence[str], tokens: Mapping[str, str], option: str,
           expanded: bool) -> tuple[str, ...]:
    """A known-hosts option: several files on one line ("none": none). ``expanded``: as ``ssh -G``
    prints it (tokens expanded, names separated by spaces)."""
    names: list[str] = []
    for value in values or [" ".join(default)]:
        whole = value if expanded else expand_path(value, tokens, option=option)
        if os.path.isfile(whole):  # one name with spaces in it
            names.append(whole)
            continue
        for part in value.split() if expanded else shlex.split(value):
            if part.lower() != "none":
                names.append(part if expanded else expand_path(part, tokens, option=option))
    return tuple(names)


def parse_ssh_g(text: str) -> dict[str, list[str]]:
    """``ssh -G`` output: one ``keyword value`` per line; keywords lower-cased, repeats kept."""
    options: dict[str, list[str]] = {}
    for line in text.splitlines():
        key, _, value = line.strip().partition(" ")
        if key:
            options.setdefault(key.lower(), []).append(value)
    return options


# --------------------------------------------------------------------------- the fallback


_PROTECTED = ("identityfile", "certificatefile", "proxycommand", "proxyjump", "userknownhostsfile",
              "globalknownhostsfile")
_PERCENT, _TILDE = "\uf8f0", "\uf8f1"  # stand-ins that paramiko's token expansion leaves alone
_KEYWORD = re.compile(r"\s*([A-Za-z]+)\s*(?:=\s*|\s+)(.*)")


def read_ssh_config(path: str, depth: int = 0) -> str:
    """The text of an ssh_config for paramiko: ``Include`` lines replaced by the files they name
    (globs; relative names from ``~/.ssh``, as OpenSSH reads them; paramiko ignores Include),
    trailing comments removed, and ``%``/``~`` in the options dlrun expands itself hidden from
    paramiko's expansion."""
    if depth > 16:
        raise UsageError(f"ssh config {path}: Include nested more than 16 deep")
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise UsageError(f"cannot read ssh config {path}: {exc.strerror or exc}") from exc
    out: list[str] = []
    context = "Host *"  # the Host or Match block a line belongs to (top level: every host)
    for line in map(_strip_comment, text.splitlines()):
        match = _KEYWORD.match(line)
        keyword = match[1].lower() if match else ""
        if match and keyword == "include":
            for pattern in shlex.split(match[2], comments=True):
                pattern = os.path.expanduser(pattern)
                if not os.path.isabs(pattern):
                    pattern = os.path.expanduser(os.path.join("~/.ssh", pattern))
                out.extend(read_ssh_config(f, depth + 1) for f in sorted(globmod.glob(pattern)) if os.path.isfile(f))
            out.append(context)  # what follows the Include is back in the including block
            continue
        if keyword == "match" and match:
            line = "Match " + _match_criteria(match[2])
        if keyword in ("host", "match"):
            line = line.replace("[", "[[]")  # a literal "[" for paramiko's fnmatch, as in OpenSSH's patterns
            context = line.strip()
        if match and keyword in _PROTECTED:
            line = f"{match[1]} {match[2].replace('%', _PERCENT).replace('~', _TILDE)}"
        out.append(line)
    return "\n".join(out)


def _match_criteria(text: str) -> str:
    """A Match line's criteria in lower case (OpenSSH ignores their case, paramiko does not)."""
    words = shlex.split(text)
    out: list[str] = []
    while words:
        criterion = words.pop(0).lower()
        out.append(criterion)
        if criterion.lstrip("!") not in ("all", "canonical", "final") and words:
            out.append(words.pop(0))
    return shlex.join(out)


def _strip_comment(line: str) -> str:
    """The line without a trailing comment: a ``#`` that starts a word outside quotes (OpenSSH ≥ 8.7)."""
    quote = ""
    for index, char in enumerate(line):
        if quote:
            quote = "" if char == quote else quote
        elif char in "\"'":
            quote = char
        elif char == "#" and (index == 0 or line[index - 1] in " \t="):
            return line[:index].rstrip()
    return line


def _unprotect(value: str) -> str:
    return value.replace(_PERCENT, "%").replace(_TILDE, "~")


def fallback_options(config: paramiko.SSHConfig, request: Request) -> dict[str, list[str]]:
    """paramiko's answer for a host, in ``ssh -G``'s shape (inventory values put in as -p/-l would)."""
    found = config.lookup(request.alias)
    options: dict[str, list[str]] = {}
    for key, value in found.items():
        values = value if isinstance(value, list) else [value]
        options[key] = [_unprotect(str(v)) for v in values]
    if request.port is not None:
        options["port"] = [str(request.port)]
    if request.user is not None:
        options["user"] = [request.user]
    if "proxyjump" in options and "proxycommand" in options:  # which came first is not known here
        del options["proxycommand"]
    return options


# --------------------------------------------------------------------------- the reader


class SSHConfigReader:
    """Looks hosts up with ``ssh -G`` (``ssh``: the binary) or, without one, paramiko's parser.

    ``config_file`` None: OpenSSH's own files (``~/.ssh/config``, then ``/etc/ssh/ssh_config``;
    the fallback reads ``~/.ssh/config`` only). Answers are cached per request, and ``ssh -G``'s
    also on disk (``ssh_g_cache``) unless ``disk_cache`` is False.
    """

    def __init__(self, config_file: str | None, ssh: str | None, *, disk_cache: bool = True) -> None:
        self.config_file = os.path.expanduser(config_file) if config_file else None
        if self.config_file and not os.path.isfile(self.config_file):
            raise UsageError(f"ssh config file not found: {config_file}")
        self.ssh = ssh
        self.fallback: paramiko.SSHConfig | None = None
        if ssh is None:
            path = self.config_file or os.path.expanduser("~/.ssh/config")
            self.fallback = paramiko.SSHConfig()
            if os.path.isfile(path):
                self.fallback = paramiko.SSHConfig.from_text(read_ssh_config(path))
        self._cache: dict[Request, HostConfig] = {}
        self._lock = threading.Lock()
        self.disk_cache = disk_cache and ssh is not None
        self._files: ssh_g_cache.ConfigFiles | None = None  # read once, at the first lookup

    def lookup(self, request: Request) -> HostConfig:
        with self._lock:
            known = self._cache.get(request)
        if known is not None:
            return known
        if self.fallback is not None:
            config = build(request, fallback_options(self.fallback, request), from_ssh_g=False)
        else:
            config = build(request, parse_ssh_g(self._ssh_g(request)), from_ssh_g=True)
        with self._lock:
            self._cache[request] = config
        return config

    def lookup_all(self, requests: Sequence[Request]) -> list[HostConfig]:
        """Every request's answer, looked up in parallel; the first error (OpenSSH's message) raised."""
        if len(requests) <= 1 or self.fallback is not None:
            return [self.lookup(r) for r in requests]
        self._config_files()
        with ThreadPoolExecutor(max_workers=min(16, len(requests))) as pool:
            return list(pool.map(self.lookup, requests))

    def ssh_g_argv(self, request: Request) -> list[str]:
        assert self.ssh is not None
        argv = [self.ssh, "-G"]
        if self.config_file:
            argv += ["-F", self.config_file]
        if request.port is not None:
            argv += ["-p", str(request.port)]
        if request.user is not None:
            argv += ["-l", request.user]
        if request.identity_file is not None:
            argv += ["-i", request.identity_file]
        return [*argv, "--", request.alias]

    def _config_files(self) -> ssh_g_cache.ConfigFiles | None:
        if not self.disk_cache:
            return None
        with self._lock:
            if self._files is None:
                self._files = ssh_g_cache.config_files(self.config_file)
            return self._files

    def _ssh_g(self, request: Request) -> str:
        argv = self.ssh_g_argv(request)
        files = self._config_files()
        key = ssh_g_cache.cache_key(argv[0], files, argv) if files is not None else None
        if key is not None:
            known = ssh_g_cache.read(key)
            if known is not None:
                return known
        run = [argv[0], "-v", *argv[1:]] if key is not None else argv  # -v: the files it read
        try:
            proc = subprocess.run(run, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=SSH_G_TIMEOUT, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise UsageError(f"cannot read the ssh config for {request.alias}: {shlex.join(argv)}: {exc}") from exc
        if proc.returncode != 0:
            message = "\n  ".join(line for line in proc.stderr.strip().splitlines()
                                  if line.strip() and not line.startswith(("debug1:", "OpenSSH_")))
            raise UsageError(f"OpenSSH rejects the ssh config for {request.alias} ({shlex.join(argv)}):\n  {message}",
                             hint="fix the file and line OpenSSH names")
        if (key is not None and files is not None and ssh_g_cache.files_read(proc.stderr) <= files.paths
                and parse_ssh_g(proc.stdout).get("canonicalizehostname", ["false"])[0] == "false"
                and ssh_g_cache.config_files(self.config_file).digest == files.digest):  # not edited meanwhile
            ssh_g_cache.write(key, proc.stdout)
        return proc.stdout
