"""Programs that run on the hosts: the agent, the topology probe, the push helper, the
TensorFlow server entry point, a detached job's keeper and jobs program, the bench, and the Horovod
rendezvous (a module the leader keeper loads). Standard library only, Python >= 3.8, nothing
from dlrun: each is shipped as its source, never imported on the host.

One bootstrap ships them all (SSH hosts, localhost, Spark tasks): the command line is
``python3 -c <LOADER> dlrun-<name> [args]`` (over SSH it reaches ``/bin/sh`` on stdin, behind
the login shell's ``exec /bin/sh -s``: ``dlrun.transport.shell``), a few hundred bytes that ``ps`` shows whole, and
the program's source arrives on stdin first (10 ASCII digits of length, then the source).
The loader reads exactly that much with ``os.read``, so the program's own input that follows
is untouched, and runs it as ``__main__`` with ``sys.argv = ["dlrun-<name>", args...]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources

#: The host programs, by the name the controller ships them under.
PROGRAMS = ("agent", "probe", "push_helper", "tf_server", "keeper", "jobs", "bench")
#: Modules a host program loads from source it was given (keepers: the rank lines; the leader: the rendezvous).
MODULES = ("rendezvous", "rankpolicy")


def source_of(name: str) -> str:
    """The source of host program (or module) ``name``, read from the installed package (a wheel too)."""
    if name not in PROGRAMS and name not in MODULES:
        raise ValueError(f"no host program {name!r}")
    return resources.files(__name__).joinpath(f"{name}.py").read_text(encoding="utf-8")


#: Runs on the host (Python >= 3.8): read the program from fd 0, run it as __main__.
LOADER = """import linecache, os, sys
def _dlrun_read(n):
    b = b""
    while len(b) < n:
        c = os.read(0, n - len(b))
        if not c:
            sys.exit("dlrun: the program did not arrive on stdin")
        b += c
    return b
_dlrun_src = _dlrun_read(int(_dlrun_read(10))).decode("utf-8")
sys.argv = sys.argv[1:]
linecache.cache["<" + sys.argv[0] + ">"] = (len(_dlrun_src), None, _dlrun_src.splitlines(True), "<" + sys.argv[0] + ">")
exec(compile(_dlrun_src, "<" + sys.argv[0] + ">", "exec"))
"""


def boot_argv(python: Sequence[str], name: str, *args: str) -> list[str]:
    """The command line that starts host program ``name``: send :func:`boot_payload` first."""
    if name not in PROGRAMS:
        raise ValueError(f"no host program {name!r}")
    return [*python, "-c", LOADER, f"dlrun-{name}", *args]


def boot_payload(name: str) -> bytes:
    """What the loader reads from stdin before the program runs: length, then source."""
    source = source_of(name).encode("utf-8")
    return b"%010d" % len(source) + source
