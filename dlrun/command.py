"""What a launch runs on each rank: a script, a Python module or a command, and its argv.

Pure. ``dlrun launch`` names a script (``train.py``, ``train.R``), a module (``-m pkg.train``,
torchrun's ``-m``) or a command (``python -m pkg.train``, ``Rscript train.R``). ``program_argv``
renders it with a host's python; ``entry_point`` says which file or module holds the code the
job runs, whose source ``--framework auto`` reads and whose folder is pushed.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

#: A program that is the host's python: ``python``, ``python3``, ``python3.11`` (a bare name;
#: a path such as ``/usr/bin/python3`` is explicit and runs as given).
PYTHON_PROGRAM = re.compile(r"python(?:[23](?:\.\d+)?)?")
#: Scripts that run with their usual interpreter when given alone (``dlrun launch train.R``).
INTERPRETERS: dict[str, tuple[str, ...]] = {".R": ("Rscript",), ".r": ("Rscript",), ".sh": ("bash",)}
#: Source files whose imports ``--framework auto`` reads, by suffix.
SOURCE_SUFFIXES = (".py", ".R", ".r")
#: Programs that run R (reticulate, in them, runs the python of RETICULATE_PYTHON).
R_PROGRAMS = frozenset({"Rscript", "R"})
#: python's own options that take a value (``python -W error -X dev train.py``).
_PYTHON_VALUE_OPTIONS = frozenset({"-W", "-X", "-Q"})


@dataclass(frozen=True)
class EntryPoint:
    """The code a launch runs: ``kind`` is ``module`` (a dotted name), ``file`` (a path as
    named), or ``none`` (a program such as ``bash -c …``, inline code, a REPL)."""

    kind: str
    name: str = ""


def is_python_program(program: str) -> bool:
    """Is ``program`` a bare python name, which runs as the host's python?"""
    return PYTHON_PROGRAM.fullmatch(program) is not None


def interpreter_for(script: str) -> tuple[str, ...] | None:
    """The interpreter a script given alone runs with (``.R``: Rscript, ``.sh``: bash), or None."""
    for suffix, interpreter in INTERPRETERS.items():
        if script.endswith(suffix):
            return interpreter
    return None


def program_argv(script: str, args: Sequence[str], python: Sequence[str], *, module: bool = False,
                 no_python: bool = False) -> tuple[str, ...]:
    """The argv of a rank: a module runs as ``python -m``, a ``.py`` script and a ``python``
    command with the host's ``python`` prefix, ``.R`` and ``.sh`` scripts with their interpreter;
    anything else, and everything with ``no_python`` (torchrun's ``--no-python``), as given."""
    if no_python:
        return (script, *args)
    if module:
        return (*python, "-m", script, *args)
    if script.endswith(".py"):
        return (*python, script, *args)
    if is_python_program(script):
        return (*python, *args)
    interpreter = interpreter_for(script)
    if interpreter is not None:
        return (*interpreter, script, *args)
    return (script, *args)


def runs_directly(script: str, *, module: bool = False, no_python: bool = False) -> bool:
    """Does the system exec ``script`` itself (so a file in the run folder needs ``./``)?"""
    if module:
        return False
    return no_python or not (script.endswith(".py") or is_python_program(script) or interpreter_for(script))


def runs_r(script: str, args: Sequence[str], *, no_python: bool = False) -> bool:
    """Does the command run R (``Rscript …``, ``R …``, or a ``.R`` script given alone)?"""
    program = script.rsplit("/", 1)[-1]
    return program in R_PROGRAMS or (not no_python and interpreter_for(script) == ("Rscript",))


def python_entry(args: Sequence[str]) -> EntryPoint:
    """What ``python ARGS`` runs: ``-m MODULE``, a script file, or nothing to read (``-c``, stdin)."""
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "-m" or (arg.startswith("-m") and not arg.startswith("--")):
            name = arg[2:] or (args[i + 1] if i + 1 < len(args) else "")
            return EntryPoint("module", name) if name else EntryPoint("none")
        if arg == "-c" or (arg.startswith("-c") and not arg.startswith("--")) or arg in ("-", "--"):
            return EntryPoint("none")
        if arg in _PYTHON_VALUE_OPTIONS:
            i += 2
            continue
        if not arg.startswith("-"):
            return EntryPoint("file", arg)
        i += 1
    return EntryPoint("none")


def entry_point(script: str, args: Sequence[str], *, module: bool = False) -> EntryPoint:
    """The module or file whose source tells the framework and whose folder is the project:
    ``-m MODULE``; a script given alone; ``python …``'s module or script; else the first
    argument that names a source file (``Rscript train.R``); else none."""
    if module:
        return EntryPoint("module", script)
    if is_python_program(script):
        return python_entry(args)
    if script.endswith(SOURCE_SUFFIXES) or interpreter_for(script):
        return EntryPoint("file", script)
    for arg in args:
        if not arg.startswith("-") and arg.endswith(SOURCE_SUFFIXES):
            return EntryPoint("file", arg)
    return EntryPoint("none")


def module_paths(module: str) -> tuple[str, ...]:
    """Where a module's source lies under a project folder: ``pkg/train.py``, then
    ``pkg/train/__main__.py`` (a package run with ``-m``)."""
    base = module.replace(".", "/")
    return (f"{base}.py", f"{base}/__main__.py")
