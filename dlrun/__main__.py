"""``python -m dlrun`` and the ``dlrun`` console script: the CLI, then a cheap interpreter exit.

At exit the interpreter's teardown runs the cyclic garbage collector over everything the run
imported and made (paramiko, cryptography, rich, click): 50–80 ms of CPU per run, about a
quarter of a 16-host launch's client CPU (docs/benchmarks.md, issue 35). Those objects are
moved out of the collector's reach first (``gc.freeze``); the exit is otherwise the ordinary
one: atexit handlers, threads joined, files closed, objects freed by their reference counts.
What it skips is ``__del__`` of objects caught in reference cycles: dlrun's own cleanup uses
context managers, atexit and ``weakref.finalize`` (which still run), never ``__del__``.
Only here, never inside ``cli.main`` (tests call that in their own process).

The terminal's encoding may not be UTF-8 (``LANG=en_US.ISO-8859-1``): what ranks print is
decoded as UTF-8 with replacement characters, which such a terminal cannot show, so stdout and
stderr write what they cannot encode as backslash escapes instead of failing the launch.
"""

import gc
import io
import sys

from dlrun.cli import main as cli_main


def main() -> None:
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper) and stream.errors == "strict":
            stream.reconfigure(errors="backslashreplace")
    try:
        cli_main()
    finally:
        gc.disable()
        gc.freeze()


if __name__ == "__main__":
    main()
