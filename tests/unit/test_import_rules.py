"""The layout's import rules, read from the source with ``ast`` (every import, nested ones too)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "dlrun"

#: Pure modules: functions over frozen dataclasses, no process, network or live terminal.
PURE = ("inventory.py", "allocation.py", "plan.py", "render.py", "command.py",
        "topo/records.py", "topo/parse.py", "topo/findings.py", "topo/report.py",
        "topo/expect.py", "topo/bench.py",
        "push/tree.py", "push/shard.py", "run/gpus.py", "run/rootcause.py", "run/result.py",
        "remote/stack_groups.py")
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
def test_remote_programs_use_only_the_standard_library_and_python38(path: Path) -> None:
    # tf_server serves a TF job: TF is there; the bench measures torch where torch is installed
    job_framework = {"tf_server.py": {"tensorflow"}, "bench.py": {"torch"}}.get(path.name, set())
    outside = {n.split(".")[0] for n in imports_of(path)} - set(sys.stdlib_module_names) - {"__future__"}
    outside -= job_framework
    assert not outside, f"{rel(path)} imports {outside}: it runs on hosts that have only Python"
    ast.parse(path.read_text(encoding="utf-8"), feature_version=(3, 8))  # and Python 3.8 or later


def test_host_programs_call_nothing_newer_than_python38(tmp_path: Path) -> None:
    """``ast.parse(feature_version=...)`` checks syntax only; vermin knows when each standard
    library name arrived (``os.waitstatus_to_exitcode``, ``str.removeprefix``: 3.9)."""
    from dlrun.remote import CACHE_STAGE, LOADER

    (tmp_path / "loader.py").write_text(LOADER + CACHE_STAGE, encoding="utf-8")
    paths = [str(p) for p in modules() if rel(p).startswith("remote/") and p.name != "__init__.py"]
    run = subprocess.run([sys.executable, "-c", "import sys; from vermin import main; sys.exit(main())",
                          "--target=3.8-", "--violations", "--no-tips", "-q", *paths, str(tmp_path / "loader.py")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr


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


def test_push_and_topo_reach_hosts_without_the_launch_pipeline() -> None:
    """``push/`` and ``topo/`` come before ``run/`` in the data flow: they get their transport
    from ``transport/factory``; the one rule they share with the launch is which interface and
    address a host's ranks use (``run/addresses``)."""
    for path in modules():
        if rel(path).startswith(("push/", "topo/", "transport/")):
            bad = {n for n in imports_of(path) if under(n, "dlrun.run") and not under(n, "dlrun.run.addresses")}
            assert not bad, f"{rel(path)} imports {bad}"


def test_test_modules_have_unique_names() -> None:
    """pytest imports test modules by basename (rootdir-relative, no packages): two
    ``test_x.py`` in different folders stop the whole run at collection."""
    tests = Path(__file__).resolve().parents[1]
    names = [p.name for p in tests.rglob("test_*.py")]
    assert sorted(n for n in set(names) if names.count(n) > 1) == []


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """dlrun's modules → the dlrun modules each imports (nested and ``TYPE_CHECKING`` imports
    too: a cycle there is still two modules that need each other). ``from a import b`` is an
    edge to ``a.b`` where that is a module, else to ``a``; a module's own packages are no edges."""
    paths = {module_name(p): p for p in modules()}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        edges = set()
        for imported in imports_of(path):
            while imported and imported not in paths:  # `a.b.func` → `a.b`
                imported = imported.rpartition(".")[0]
            if imported and imported != name and not name.startswith(imported + "."):
                edges.add(imported)
        graph[name] = edges
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of more than one module (or a module importing itself), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def cycle_in(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One import cycle through the component's first module, as ``a → b → a``."""
    members, start = set(component), component[0]
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for nxt in sorted(graph[node] & members):
            if nxt == start:
                return [*paths[node], start]
            if nxt not in paths:
                paths[nxt] = [*paths[node], nxt]
                queue.append(nxt)
    return component


def test_the_cycle_finder_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert strongly_connected(graph) == [["a", "b", "c"], ["e"]]
    assert cycle_in(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]


def test_no_import_cycles() -> None:
    """No two dlrun modules import each other, directly or through others, at any depth of the
    file (``TYPE_CHECKING`` blocks and imports inside functions included): the layers stay a
    one-way flow, and each module can be read and tested with only what is below it."""
    graph = import_graph()
    cycles = [" → ".join(cycle_in(graph, c)) for c in strongly_connected(graph)]
    assert not cycles, "import cycles:\n  " + "\n  ".join(cycles)
