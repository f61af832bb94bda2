"""Helpers for the topology tests: where the real captures live, how to read them.

The captures are in ``tests/fixtures/topology/`` (their sources and licences in its SOURCES.md).
A missing capture is an error, never a skip.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "topology"


def fixture(rel: str) -> str:
    """The text of one capture, e.g. ``fixture("topo-m/consumer-dual-gpu-nv2-bridge.txt")``."""
    return (FIXTURES / rel).read_text(encoding="utf-8")


def all_fixture_files() -> list[Path]:
    """Every capture: the files in the fixture directory's folders (not SOURCES.md, LICENSES.md,
    nor ``report/``, the expected ``dlrun topo`` output)."""
    depth = len(FIXTURES.parts)
    found = sorted(
        p for p in FIXTURES.rglob("*") if p.is_file() and p.parent != FIXTURES and p.parts[depth] != "report"
    )
    if not found:
        raise FileNotFoundError(f"no topology captures under {FIXTURES}")
    return found


def sysfs_tree(rel: str) -> dict[str, str]:
    """A sysfs fixture tree as the probe would report it: ``{relative path: content}``."""
    root = FIXTURES / rel
    return {
        p.relative_to(root).as_posix(): p.read_text(encoding="utf-8", errors="replace")
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def sysfs_root_of(path: Path) -> Path:
    """For a file of a sysfs fixture, the directory that holds its ``sys/`` tree."""
    for parent in path.parents:
        if (parent / "sys").is_dir() and parent.parent.name == "sysfs-ib":
            return parent
    raise ValueError(f"{path} is not inside a sysfs-ib tree")


def write_fake_tool(
    bin_dir: Path,
    name: str,
    replies: dict[str, str],
    *,
    default_rc: int = 0,
    sleep: float = 0.0,
    refuse: str | None = None,
    broken: str | None = None,
) -> Path:
    """Put an executable ``name`` in ``bin_dir`` that replays fixture files by its argv.

    ``replies`` maps the argv joined by spaces to a fixture path (relative to the fixtures);
    the first key that the joined argv starts with wins (``""`` is the plain call). Unknown
    argv: exit 255 with an nvidia-smi-like error. ``refuse``: a substring of the argv that is
    refused with exit 2, as an older driver refuses an unknown ``--query-gpu`` field.
    ``broken``: every call prints this and exits 9, as nvidia-smi does without its driver.
    """
    script = bin_dir / name
    lines = [
        f"#!{sys.executable}",
        "import sys, time",
        f"time.sleep({sleep!r})",
        "args = ' '.join(sys.argv[1:])",
        f"broken = {broken!r}",
        "if broken:",
        "    print(broken)",
        "    sys.exit(9)",
        f"refuse = {refuse!r}",
        "if refuse and refuse in args:",
        "    print('Field \"%s\" is not a valid field to query.' % refuse)",
        "    sys.exit(2)",
        f"replies = {dict(sorted(replies.items(), key=lambda kv: -len(kv[0])))!r}",
        f"root = {str(FIXTURES)!r}",
        "for key, rel in replies.items():",
        "    if (args == key) if key == '' else args.startswith(key):",
        "        with open(root + '/' + rel, encoding='utf-8') as fh:",
        "            sys.stdout.write(fh.read())",
        f"        sys.exit({default_rc})",
        "print('Invalid combination of input arguments. Please run \\'nvidia-smi -h\\' for help.')",
        "sys.exit(255)",
    ]
    script.write_text("\n".join(lines) + "\n", encoding="utf-8")
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return script


def env_with_path(bin_dir: Path | None, **extra: str) -> dict[str, str]:
    """The current environment with ``bin_dir`` first on PATH (or PATH limited to the system's
    own directories, without ``bin_dir``) and ``extra`` set."""
    env = dict(os.environ)
    base = env.get("PATH", "/usr/bin:/bin")
    env["PATH"] = f"{bin_dir}{os.pathsep}{base}" if bin_dir else base
    env.pop("DLRUN_SYSFS_ROOT", None)
    env.pop("DLRUN_PROBE_TIMEOUT", None)
    env.update(extra)
    return env
