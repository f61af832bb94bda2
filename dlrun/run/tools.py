"""py-spy for the hosts: found beside this Python (the ``py-spy`` wheel is a dependency) and
shipped, by hash, into each host's per-user cache (``~/.cache/dlrun/tools/py-spy-<sha256>``)
by ``dlrun.remote.stacks``. A host of another machine type or OS gets nothing shipped and uses
a py-spy on its PATH, if any. Mechanism: ``docs/stacks.md``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import shutil
import sys
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlrun.errors import DlrunError
from dlrun.inventory import Host
from dlrun.remote import boot_argv, boot_payload
from dlrun.transport.base import Transport, default_python


@dataclass(frozen=True)
class Tool:
    path: Path
    sha256: str
    size: int
    machine: str
    system: str


@functools.cache
def pyspy() -> Tool | None:
    """This machine's py-spy: ``DLRUN_PY_SPY`` (a path; empty: none), else the one installed
    beside this Python, else PATH's; or None."""
    beside = Path(sys.executable).parent / "py-spy"
    found = str(beside) if beside.is_file() else shutil.which("py-spy")
    found = os.environ.get("DLRUN_PY_SPY", found) or None
    if found is None:
        return None
    data = Path(found).read_bytes()
    return Tool(Path(found), hashlib.sha256(data).hexdigest(), len(data), platform.machine(), platform.system())


_ready: set[tuple[str, int | None, str | None]] = set()  # hosts that have it (this process asked before)
_ready_lock = threading.Lock()


def _key(host: Host) -> tuple[str, int | None, str | None]:
    return (host.address, host.port, host.user)


def _run(transport: Transport, host: Host, request: Mapping[str, Any], data: bytes = b"",
         timeout: float = 60.0) -> dict[str, Any]:
    result = transport.run(host, boot_argv(default_python(host), "stacks"),
                           stdin=boot_payload("stacks") + json.dumps(request).encode() + b"\n" + data, timeout=timeout)
    if result.exit_code != 0:
        detail = " / ".join(result.stderr.decode("utf-8", "replace").strip().splitlines()[-3:])
        raise DlrunError(f"dlrun-stacks exited with code {result.exit_code}: {detail}", host=host.name)
    try:
        answer: dict[str, Any] = json.loads(result.stdout.decode("utf-8", "replace").strip().splitlines()[-1])
    except (ValueError, IndexError) as exc:
        raise DlrunError(f"dlrun-stacks answered no JSON: {result.stdout[-200:]!r}", host=host.name) from exc
    return answer


def ship_one(transport: Transport, host: Host, tool: Tool) -> str | None:
    """Make sure ``host`` has ``tool`` in its cache; a note when it cannot (then PATH's is used)."""
    if _key(host) in _ready:
        return None
    answer = _run(transport, host, {"op": "have", "sha256": tool.sha256})
    if answer.get("path") is None:
        if answer.get("noexec"):  # there, on a mount where it may not run: sending it again would not help
            return "py-spy is in the host's cache, on a noexec mount: set XDG_CACHE_HOME there (the inventory's env)"
        if (answer.get("machine"), answer.get("system")) != (tool.machine, tool.system):
            return (f"py-spy not shipped: the host is {answer.get('system')} {answer.get('machine')}, this machine "
                    f"{tool.system} {tool.machine} (a py-spy on the host's PATH is used)")
        answer = _run(transport, host, {"op": "install", "sha256": tool.sha256, "size": tool.size},
                      tool.path.read_bytes(), timeout=300)
        if answer.get("error"):
            return str(answer["error"])
    with _ready_lock:
        _ready.add(_key(host))
    return None


def ship_pyspy(transport: Transport, hosts: Sequence[Host]) -> tuple[str, dict[str, str]]:
    """py-spy to every host at once: its hash (empty without one here) and a note per host
    that did not get it."""
    tool = pyspy()
    if tool is None:
        return "", {}
    unique = list({_key(h): h for h in hosts}.values())

    def one(host: Host) -> str | None:
        try:
            return ship_one(transport, host, tool)
        except DlrunError as exc:
            return f"py-spy not shipped: {exc}"

    with ThreadPoolExecutor(max_workers=min(32, len(unique) or 1)) as pool:
        notes = dict(zip((_key(h) for h in unique), pool.map(one, unique), strict=True))
    return tool.sha256, {h.name: note for h in hosts if (note := notes[_key(h)]) is not None}
