"""The layout's import rules, read from the source with ``ast`` (every import, nested ones too)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "dlrun"

#: Pure modules: functions over frozen dataclasses, no process, network or live terminal.
PURE = ("inventory.py", "allocation.py", "plan.py", "render.py", "command.py",
        "topo/records.py", "topo/parse.py", "topo/findings.py", "topo/report.py",
        "topo/expect.py", "topo/bench.py",
        "push/tree.py", "push/shard.py", "run/gpus.py", "run/rootcause.py", "run/result.py",
        "remote/stack_groups.py", "run/flight.py")
PURE_MAY_NOT = ("dlrun.transport", "subprocess", "socket", "paramiko", "rich.live", "multiprocessing", "asyncio")


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports, absolute, at any depth of the file."""
    names: set[str] = set()
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names.add(base)
            names |= {f"{base}.{alias.name}" for alias in node.names}  # `from dlrun import agent`
    return names


def modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "templates" not in p.parts)


def under(name: str, *prefixes: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def rel(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def test_the_listed_pure_modules_exist() -> None:
    assert all((PACKAGE / name).is_file() for name in PURE)


@pytest.mark.parametrize("path", [p for p in modules() if rel(p).startswith("remote/")], ids=rel)
def test_remote_programs_use_only_the_standard_library(path: Path) -> None:
    # tf_server serves a TF job: TF is there; the bench measures torch where torch is installed
    job_framework = {"tf_server.py": {"tensorflow"}, "bench.py": {"torch"}}.get(path.name, set())
    outside = {n.split(".")[0] for n in imports_of(path)} - set(sys.stdlib_module_names) - {"__future__"}
    outside -= job_framework
    assert not outside, f"{rel(path)} imports {outside}: it runs on hosts that have only Python"


@pytest.mark.parametrize("name", PURE)
def test_pure_modules_touch_no_outside_world(name: str) -> None:
    bad = {n for n in imports_of(PACKAGE / name) if under(n, *PURE_MAY_NOT)}
    assert not bad, f"{name} imports {bad}"


def test_only_the_ssh_transport_imports_paramiko_and_only_spark_imports_pyspark() -> None:
    for path in modules():
        names = imports_of(path)
        if any(under(n, "paramiko") for n in names):
            assert rel(path).startswith("transport/ssh"), rel(path)
        if any(under(n, "pyspark", "py4j") for n in names):
            assert rel(path).startswith("spark/"), rel(path)


def test_transport_imports_nothing_from_the_stages_above_it() -> None:
    for path in modules():
        if rel(path).startswith("transport/"):
            bad = {n for n in imports_of(path) if under(n, "dlrun.topo", "dlrun.push", "dlrun.run", "dlrun.spark")}
            assert not bad, f"{rel(path)} imports {bad}"


def test_test_modules_have_unique_names() -> None:
    """pytest imports test modules by basename (rootdir-relative, no packages): two
    ``test_x.py`` in different folders stop the whole run at collection."""
    tests = Path(__file__).resolve().parents[1]
    names = [p.name for p in tests.rglob("test_*.py")]
    assert sorted(n for n in set(names) if names.count(n) > 1) == []
