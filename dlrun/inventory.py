"""The hosts inventory: parsing and validating every format ``--hosts`` accepts.

Owns the ``Host`` and ``Inventory`` frozen dataclasses and four input formats:

- ``hosts.toml`` (``[defaults]`` and ``[[hosts]]``; every key in ``hosts.example.toml``);
- an inline list ``h1:2,h2:4`` (``[user@]host[:slots]`` separated by commas);
- an MPI/DeepSpeed hostfile: one ``[user@]host slots=N`` per line, ``#`` comments, blank lines;
- ranges in either of the last two: ``node[01-04,07]:8`` keeps the zero padding.

Pure: the only I/O is reading the file named by ``--hosts`` in ``load_inventory`` (and, when
there is none, listing its folder for a close name). Every
problem raises ``InventoryError`` naming the source, the line (where one exists) and the key.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlrun.errors import InventoryError

ROLES = ("chief", "worker", "ps", "evaluator")
LOCAL_ADDRESSES = frozenset({"localhost", "127.0.0.1", "::1"})

_DEFAULT_KEYS = frozenset({"user", "port", "identity_file", "python", "workdir", "iface", "env", "setup"})
_HOST_KEYS = frozenset(
    {"address", "name", "slots", "port", "user", "identity_file", "python", "workdir", "iface", "role", "env",
     "setup"}
)
_STR_KEYS = frozenset({"address", "name", "user", "identity_file", "python", "workdir", "iface", "role", "setup"})
# a Linux interface name: 1-15 bytes, no whitespace and no "/" (dev_valid_name in the kernel)
_IFACE_NAME = re.compile(r"[^\s/]{1,15}")
_INT_KEYS = frozenset({"port", "slots"})


@dataclass(frozen=True)
class Host:
    """One machine of the inventory, with ``[defaults]`` already applied.

    ``slots`` is None where the inventory left it unset: one process, or the GPU count
    once the preflight probe has seen the host (``effective_slots``).
    """

    address: str
    name: str
    slots: int | None = None
    port: int | None = None
    user: str | None = None
    identity_file: str | None = None
    python: str | None = None
    workdir: str | None = None
    role: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    iface: str | None = None  # this host's interface for Gloo/NCCL sockets (names may differ per host)
    setup: str | None = None  # run as `sh -c setup` in the pushed code folder before any rank (dlrun.push.setup)

    @property
    def is_local(self) -> bool:
        """True for localhost with no port or user: run as local processes, no sshd."""
        return self.address in LOCAL_ADDRESSES and self.port is None and self.user is None

    @property
    def effective_slots(self) -> int:
        return 1 if self.slots is None else self.slots


@dataclass(frozen=True)
class Inventory:
    """The validated hosts, in inventory order, and where they came from."""

    hosts: tuple[Host, ...]
    source: str = "<inline>"
    defaults_env: Mapping[str, str] = field(default_factory=dict)

    @property
    def total_slots(self) -> int:
        return sum(h.effective_slots for h in self.hosts)

    @property
    def all_local(self) -> bool:
        return all(h.is_local for h in self.hosts)

    def with_slots(self, slots: Mapping[str, int]) -> Inventory:
        """Fill unset slots from ``slots`` (host name → count, e.g. GPUs seen by the probe).
        A chief or evaluator host keeps one: a TensorFlow cluster has at most one of each."""
        hosts = tuple(
            Host(**{**_fields(h), "slots": slots[h.name]})
            if h.slots is None and slots.get(h.name) and h.role not in ("chief", "evaluator")
            else h
            for h in self.hosts
        )
        return Inventory(hosts=hosts, source=self.source, defaults_env=self.defaults_env)


def _fields(host: Host) -> dict[str, Any]:
    return {name: getattr(host, name) for name in Host.__dataclass_fields__}


def localhost_inventory(np: int) -> Inventory:
    """The inventory used when ``--hosts`` is not given: ``np`` slots on localhost."""
    return Inventory(hosts=(Host(address="localhost", name="localhost", slots=np),), source="<localhost>")


# --------------------------------------------------------------------------- entry points


def load_inventory(spec: str) -> Inventory:
    """Parse ``--hosts``: a TOML file, a hostfile, or an inline list (tried in that order)."""
    path = Path(spec)
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8-sig")  # a Windows editor's BOM is not part of the text
        except (OSError, UnicodeDecodeError) as exc:
            raise InventoryError(f"cannot read: {exc}", source=spec) from exc
        if path.suffix == ".toml" or _looks_like_toml(text):
            return parse_toml_inventory(text, source=spec)
        return parse_hostfile(text, source=spec)
    if spec.endswith(".toml") or "/" in spec or _file_like(spec):
        what = "no such file"
        if _file_like(path.name) and not spec.endswith(".toml"):
            what += f", and no host name ends in .{spec.rpartition('.')[2]}"
        near = _near_file(path)
        hint = f"did you mean {near}? " if near else ""
        raise InventoryError(what, source=spec, hint=f"{hint}--hosts takes a hosts.toml, a hostfile or 'h1:2,h2:4'")
    return parse_inline(spec)


#: Endings that name a file, never a host: no top-level domain is one of them.
_FILE_ENDINGS = frozenset({"toml", "tml", "tmol", "tom", "txt", "cfg", "conf", "ini", "yaml", "yml", "json",
                           "lst", "list", "hosts", "hostfile"})


def _file_like(spec: str) -> bool:
    """``--hosts hosts.tml``: one entry, no slots, ending like a file (a typo of hosts.toml)."""
    if "," in spec or ":" in spec or "." not in spec:
        return False
    return spec.rpartition(".")[2].lower() in _FILE_ENDINGS


def _near_file(path: Path) -> str | None:
    """A file beside ``path`` whose name is close to it (``hosts.toml`` for ``hosts.tml``)."""
    import difflib

    folder = path.parent
    try:
        names = sorted(p.name for p in folder.iterdir() if p.is_file())
    except OSError:
        return None
    close = difflib.get_close_matches(path.name, names, n=1, cutoff=0.75)
    return str(path.with_name(close[0])) if close else None


def _looks_like_toml(text: str) -> bool:
    return any(line.strip().startswith(("[[hosts]]", "[defaults]")) for line in text.splitlines())


# --------------------------------------------------------------------------- TOML


def parse_toml_inventory(text: str, *, source: str = "hosts.toml") -> Inventory:
    """Parse and validate a ``hosts.toml`` document."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        line = getattr(exc, "lineno", None) or _line_from_message(str(exc))
        raise InventoryError(f"not valid TOML: {exc}", source=source, line=line) from exc
    locate = _Locator(text)
    for key in doc:
        if key not in ("defaults", "hosts"):
            raise InventoryError(
                "unknown top-level key (expected [defaults] and [[hosts]])",
                source=source,
                line=locate.top(key),
                key=key,
            )
    defaults = doc.get("defaults", {})
    if not isinstance(defaults, dict):
        raise InventoryError("must be a table", source=source, line=locate.top("defaults"), key="defaults")
    _check_table(defaults, _DEFAULT_KEYS, source, lambda k: locate.defaults(k), "defaults")
    raw_hosts = doc.get("hosts", [])
    if not isinstance(raw_hosts, list) or not raw_hosts:
        raise InventoryError(
            "no hosts: add at least one [[hosts]] table with an address",
            source=source,
            line=locate.top("hosts"),
            key="hosts",
        )
    hosts = []
    for index, raw in enumerate(raw_hosts):
        where = f"hosts[{index}]"

        def line_of(key: str, index: int = index) -> int | None:
            return locate.host(index, key)

        if not isinstance(raw, dict):
            raise InventoryError("must be a table", source=source, line=line_of(""), key=where)
        _check_table(raw, _HOST_KEYS, source, line_of, where)
        if "address" not in raw:
            raise InventoryError("missing required key", source=source, line=line_of(""), key=f"{where}.address")
        merged = {k: v for k, v in defaults.items() if k != "env"} | {k: v for k, v in raw.items() if k != "env"}
        env = {**defaults.get("env", {}), **raw.get("env", {})}
        address = merged["address"]
        if "[" in address or "]" in address or re.fullmatch(r"[^:]+:[0-9]+", address):
            raise InventoryError("must be one host name or address: ranges ('node[01-04]') and ':N' slots are "
                                 "for --hosts and hostfiles", source=source, line=line_of("address"),
                                 key=f"{where}.address", hint="give each host its own [[hosts]] table and slots = N")
        _check_address(address, source, line_of("address"), key=f"{where}.address")
        role = merged.get("role")
        if role is not None and role not in ROLES:
            raise InventoryError(
                f"unknown role {role!r} (expected one of {', '.join(ROLES)})",
                source=source,
                line=line_of("role"),
                key=f"{where}.role",
            )
        hosts.append(
            Host(
                address=address,
                name=merged.get("name", address),
                slots=merged.get("slots"),
                port=merged.get("port"),
                user=merged.get("user"),
                identity_file=merged.get("identity_file"),
                python=merged.get("python"),
                workdir=merged.get("workdir"),
                role=role,
                env=env,
                iface=merged.get("iface"),
                setup=merged.get("setup"),
            )
        )
    inv = Inventory(hosts=tuple(hosts), source=source, defaults_env=dict(defaults.get("env", {})))
    _check_inventory(inv, lambda i, k: locate.host(i, k, fallback=False) or locate.host(i, ""))
    return inv


def _check_table(
    table: Mapping[str, Any],
    allowed: frozenset[str],
    source: str,
    line_of: Any,
    where: str,
) -> None:
    for key, value in table.items():
        if key not in allowed:
            raise InventoryError(
                f"unknown key (allowed: {', '.join(sorted(allowed))})",
                source=source,
                line=line_of(key),
                key=f"{where}.{key}",
            )
        if key in _STR_KEYS and not isinstance(value, str):
            raise InventoryError(
                f"must be a string, not {_type_name(value)}", source=source, line=line_of(key), key=f"{where}.{key}"
            )
        if key == "user" and not _USER.fullmatch(value):  # as user@host is checked: it reaches ssh's %r
            raise InventoryError(f"invalid user name {value!r}", source=source, line=line_of(key), key=f"{where}.{key}",
                                 hint="a login name: letters, digits and . _ - (DOMAIN\\name and name@realm too)")
        if key in _INT_KEYS and (not isinstance(value, int) or isinstance(value, bool)):
            raise InventoryError(
                f"must be an integer, not {_type_name(value)}", source=source, line=line_of(key), key=f"{where}.{key}"
            )
        if key == "name" and (not value.strip() or not value.isprintable()):
            # shown in every [rank host] prefix and table: a newline would forge output lines
            raise InventoryError("must be a printable name (no newlines or control characters)",
                                 source=source, line=line_of(key), key=f"{where}.{key}")
        if key == "iface" and not _IFACE_NAME.fullmatch(value):
            raise InventoryError("must be a network interface name (1-15 characters, no spaces or '/')",
                                 source=source, line=line_of(key), key=f"{where}.{key}")
        if key == "setup" and (not value.strip() or "\0" in value):
            raise InventoryError("must be a shell command (not empty, no NUL byte)", source=source,
                                 line=line_of(key), key=f"{where}.{key}")
        if key == "slots" and value < 1:
            raise InventoryError("must be at least 1", source=source, line=line_of(key), key=f"{where}.{key}")
        if key == "port" and not 0 < value < 65536:
            raise InventoryError("must be a TCP port (1-65535)", source=source, line=line_of(key), key=f"{where}.{key}")
        if key == "env":
            if not isinstance(value, dict):
                raise InventoryError("must be a table of strings", source=source, line=line_of(key), key=f"{where}.env")
            for name, val in value.items():
                if not isinstance(val, str):
                    problem = f"must be a string, not {_type_name(val)} (quote it)"
                elif "\0" in val:
                    problem = "contains a NUL byte, which no environment can hold"
                elif not ENV_NAME.fullmatch(name):
                    problem = "is not a valid environment variable name"
                else:
                    continue
                raise InventoryError(problem, source=source, line=line_of(f"env.{name}"), key=f"{where}.env.{name}")


ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _type_name(value: object) -> str:
    return {bool: "a boolean", int: "an integer", float: "a float", str: "a string", list: "an array",
            dict: "a table"}.get(type(value), type(value).__name__)


def _line_from_message(message: str) -> int | None:
    match = re.search(r"line (\d+)", message)
    return int(match.group(1)) if match else None


class _Locator:
    """Finds the line of a key in the TOML text (tomllib keeps no positions)."""

    _HEADER = re.compile(r"^\s*\[\[?\s*([A-Za-z0-9_.\"-]+)\s*\]\]?")

    def __init__(self, text: str) -> None:
        self.lines = text.splitlines()
        self.sections: list[tuple[str, int]] = []  # (header name, 0-based line) in order
        for number, line in enumerate(self.lines):
            match = self._HEADER.match(line)
            if match:
                self.sections.append((match.group(1), number))

    def _key_in(self, start: int, end: int, key: str, *, dotted: bool = False) -> int | None:
        """The first ``key = …`` line, or with ``dotted`` ``key.name = …`` (``env.A = "1"``).
        ``key`` may itself be dotted (``env.A``): its parts may be quoted and spaced."""
        parts = r"\s*\.\s*".join(rf"\"?{re.escape(part)}\"?" for part in key.split("."))
        pattern = re.compile(rf"^\s*{parts}\s*" + (r"\." if dotted else "="))
        for number in range(start, end):
            if pattern.match(self.lines[number]):
                return number + 1
        return None

    def _span(self, section_index: int) -> tuple[int, int]:
        start = self.sections[section_index][1]
        end = self.sections[section_index + 1][1] if section_index + 1 < len(self.sections) else len(self.lines)
        return start, end

    def top(self, key: str) -> int | None:
        first = self.sections[0][1] if self.sections else len(self.lines)
        found = self._key_in(0, first, key)
        if found:
            return found
        for name, number in self.sections:
            if name == key or name.startswith(key + "."):
                return number + 1
        return None

    def defaults(self, key: str) -> int | None:
        table, _, inner = key.partition(".")
        for i, (name, _) in enumerate(self.sections):  # [defaults.env] may stand anywhere, even first
            if name == f"defaults.{table}":
                start, end = self._span(i)
                return (self._key_in(start, end, inner) if inner else None) or start + 1
        return self._table("defaults", 0, key, fallback=True)

    def host(self, index: int, key: str, *, fallback: bool = True) -> int | None:
        return self._table("hosts", index, key, fallback=fallback)

    def _table(self, header: str, index: int, key: str, *, fallback: bool) -> int | None:
        """The line of ``key`` in the ``index``-th ``[header]`` table (or ``[[header]]``).

        ``key`` may be ``""`` (the table's header line), a key of the table (``slots``), or of a
        sub-table (``env.NAME``), which TOML lets a file write three ways: under ``[header.env]``,
        as a dotted ``env.NAME = …`` or inline in ``env = {…}`` (then the ``env`` line).
        """
        seen = -1
        for i, (name, _) in enumerate(self.sections):
            if name != header:
                continue
            seen += 1
            if seen != index:
                continue
            start, end = self._span(i)
            subs: dict[str, tuple[int, int]] = {}  # [header.sub] tables that follow belong to it
            j = i + 1
            while j < len(self.sections) and self.sections[j][0].startswith(header + "."):
                subs[self.sections[j][0][len(header) + 1:]] = self._span(j)
                j += 1
            if not key:
                return start + 1 if fallback else None
            table, _, inner = key.partition(".")
            found: int | None = None
            if table in subs:
                sub_start, sub_end = subs[table]
                found = (self._key_in(sub_start, sub_end, inner) if inner else None) or sub_start + 1
            else:
                found = (self._key_in(start, end, key) or self._key_in(start, end, key, dotted=True)
                         or (self._key_in(start, end, table) if inner else None))
            return found or (start + 1 if fallback else None)
        return None


# --------------------------------------------------------------------------- hostfile and inline


_RANGE = re.compile(r"\[([^\]]*)\]")
_DIGITS = re.compile(r"[0-9]+")  # not str.isdigit: it takes '²' and '١', which int() refuses or reads
MAX_HOSTS = 10_000  # what a range may name: more is a typo ('node[1-1000000]'), not a cluster


def expand_range(pattern: str, *, source: str = "<inline>", line: int | None = None) -> list[str]:
    """Expand ``node[01-04,07]`` into names, keeping zero padding; no brackets → itself."""
    match = _RANGE.search(pattern)
    if not match:
        if "[" in pattern or "]" in pattern:
            raise InventoryError(f"unbalanced brackets in {pattern!r}", source=source, line=line, key="hosts")
        return [pattern]
    prefix, suffix = pattern[: match.start()], pattern[match.end() :]
    names: list[str] = []
    for part in match.group(1).split(","):
        part = part.strip()
        bounds = part.split("-")
        if len(bounds) == 1 and _DIGITS.fullmatch(bounds[0]):
            items = [bounds[0]]
        elif len(bounds) == 2 and _DIGITS.fullmatch(bounds[0]) and _DIGITS.fullmatch(bounds[1]):
            lo, hi = int(bounds[0]), int(bounds[1])
            if lo > hi:
                raise InventoryError(f"range {part!r} runs backwards", source=source, line=line, key="hosts")
            if hi - lo >= MAX_HOSTS:
                raise InventoryError(f"range {part!r} names more than {MAX_HOSTS} hosts", source=source, line=line,
                                     key="hosts")
            width = len(bounds[0]) if bounds[0].startswith("0") else 0
            items = [str(n).zfill(width) for n in range(lo, hi + 1)]
        else:
            raise InventoryError(
                f"bad range {part!r} in {pattern!r} (expected N, N-M or a list of them)",
                source=source,
                line=line,
                key="hosts",
            )
        for item in items:
            names.extend(expand_range(prefix + item + suffix, source=source, line=line))
            if len(names) > MAX_HOSTS:
                raise InventoryError(f"{pattern!r} names more than {MAX_HOSTS} hosts", source=source, line=line,
                                     key="hosts")
    return names


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside ``[...]``."""
    parts: list[str] = []
    current: list[str] = []
    depth = 0
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    parts.append("".join(current))
    return parts


def parse_inline(spec: str) -> Inventory:
    """Parse ``h1:2,h2:4,node[01-03]:8`` (slots default to unset, i.e. 1 or the GPU count)."""
    hosts: list[Host] = []
    for item in _split_top_level(spec):
        item = item.strip()
        if not item:
            raise InventoryError("empty host entry", source="--hosts", key="hosts", hint="use 'h1:2,h2:4'")
        user, name = _split_user(item, source="--hosts", line=None)
        slots = None
        if _has_slots_suffix(name):
            name, _, count = name.rpartition(":")
            slots = _parse_slots(count, source="--hosts", line=None, item=item)
        for address in expand_range(name, source="--hosts"):
            _check_address(address, "--hosts", None)
            hosts.append(Host(address=address, name=address, slots=slots, user=user))
    inv = Inventory(hosts=tuple(hosts), source="--hosts")
    _check_inventory(inv, lambda i, k: None)
    return inv


def parse_hostfile(text: str, *, source: str = "hostfile") -> Inventory:
    """Parse an MPI/DeepSpeed hostfile: ``host slots=N`` (or ``host:N``) per line."""
    hosts: list[Host] = []
    lines: list[int] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        words = line.split()
        user, name = _split_user(words[0], source=source, line=number)
        slots = None
        if _has_slots_suffix(name):
            name, _, count = name.rpartition(":")
            slots = _parse_slots(count, source=source, line=number, item=line)
        given: set[str] = set()
        for word in words[1:]:
            key, sep, value = word.partition("=")
            key = key.replace("-", "_")
            if key not in ("slots", "max_slots") or not sep:
                raise InventoryError(f"unexpected {word!r} (expected 'host slots=N')", source=source,
                                     line=number, key="slots")
            if key in given or (key == "slots" and slots is not None):
                raise InventoryError(f"slots given twice in {line!r}", source=source, line=number, key=key)
            given.add(key)
            number_of = _parse_slots(value, source=source, line=number, item=line)  # max_slots: checked, not used
            if key == "slots":
                slots = number_of
        for address in expand_range(name, source=source, line=number):
            _check_address(address, source, number)
            hosts.append(Host(address=address, name=address, slots=slots, user=user))
            lines.append(number)
    if not hosts:
        raise InventoryError("no hosts in hostfile", source=source, key="hosts")
    inv = Inventory(hosts=tuple(hosts), source=source)
    _check_inventory(inv, lambda i, k: lines[i])
    return inv


_USER = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_.@\\$-]*")  # a login name (or DOMAIN\name, name@realm)


def _split_user(item: str, *, source: str, line: int | None) -> tuple[str | None, str]:
    """``user@host[:N]`` → (user, ``host[:N]``), split at the last ``@`` as OpenSSH splits it."""
    user, at, rest = item.rpartition("@")
    if not at:
        return None, item
    if not _USER.fullmatch(user):
        raise InventoryError(f"invalid user name {user!r} in {item!r}", source=source, line=line, key="user",
                             hint="write user@host, e.g. alice@node1:4")
    return user, rest


def _has_slots_suffix(item: str) -> bool:
    """``host:N``, but not an IPv6 address (``::1``, ``2001:db8::10``), whose last group is no slot count."""
    name, colon, _ = item.rpartition(":")
    return bool(colon) and ":" not in name and not item.startswith("[")


def _parse_slots(value: str, *, source: str, line: int | None, item: str) -> int:
    if not _DIGITS.fullmatch(value):
        raise InventoryError(f"slots must be an integer in {item!r}", source=source, line=line, key="slots")
    slots = int(value)
    if slots < 1:
        raise InventoryError(f"slots must be at least 1 in {item!r}", source=source, line=line, key="slots")
    return slots


def _check_address(address: str, source: str, line: int | None, key: str = "address") -> None:
    # what OpenSSH accepts too (CVE-2023-51385): an ssh_config 'Match exec "… %h"' hands the
    # name to a shell, and a leading '-' would read as an option there
    if not re.fullmatch(r"[A-Za-z0-9_.:%@\-]+", address) or address.startswith("-"):
        raise InventoryError(f"invalid host name {address!r}", source=source, line=line, key=key,
                             hint="a host name, an IPv4 or IPv6 address (letters, digits, '.', '-', '_', ':', '%')")


def _check_inventory(inv: Inventory, line_of: Any) -> None:
    """Checks across hosts: duplicates, more than one chief or evaluator."""
    seen_names: dict[str, int] = {}
    seen_targets: dict[tuple[str, int | None, str | None], int] = {}
    for index, host in enumerate(inv.hosts):
        if host.name in seen_names:
            key = "name" if host.name != host.address else "address"
            raise InventoryError(
                f"duplicate host {host.name!r} (also hosts[{seen_names[host.name]}])",
                source=inv.source,
                line=line_of(index, key),
                key=f"hosts[{index}].{key}",
                hint="list a host once and give it slots = N",
            )
        seen_names[host.name] = index
        target = (host.address.lower(), host.port, host.user)  # host names are not case-sensitive
        if target in seen_targets:
            raise InventoryError(
                f"duplicate host {host.address!r} (also hosts[{seen_targets[target]}])",
                source=inv.source,
                line=line_of(index, "address"),
                key=f"hosts[{index}].address",
                hint="list a host once and give it slots = N",
            )
        seen_targets[target] = index
    # one machine's ranks share its GPUs, local ranks and rendezvous scope; only TensorFlow roles
    # (a chief, a ps and workers, each an entry of its own) may list this machine more than once
    local = [i for i, h in enumerate(inv.hosts) if h.is_local]
    if len(local) > 1 and not all(inv.hosts[i].role for i in local):
        first, again = inv.hosts[local[0]], inv.hosts[local[1]]
        raise InventoryError(
            f"{again.address!r} is this machine, as {first.address!r} (hosts[{local[0]}]) is",
            source=inv.source,
            line=line_of(local[1], "address"),
            key=f"hosts[{local[1]}].address",
            hint="list this machine once and give it slots = N",
        )
    for role in ("chief", "evaluator"):
        holders = [i for i, h in enumerate(inv.hosts) if h.role == role]
        slots = sum(inv.hosts[i].effective_slots for i in holders)
        if len(holders) > 1 or slots > 1:
            index = holders[1] if len(holders) > 1 else holders[0]
            raise InventoryError(
                f"more than one {role} (a TensorFlow cluster has at most one)",
                source=inv.source,
                line=line_of(index, "role"),
                key=f"hosts[{index}].role",
                hint=f"give role = {role!r} to one host with slots = 1",
            )
