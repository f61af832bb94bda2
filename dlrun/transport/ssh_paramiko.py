"""paramiko, imported without ``invoke``.

Where invoke is installed (fabric brings it), ``import paramiko`` imports it, and with it
``unittest.mock``: 40–90 ms of CPU at every dlrun start on this project's machines, for one use,
``Match exec`` in paramiko's own config parser, which dlrun runs only where no OpenSSH client
is installed (``ssh_config.SSHConfigReader``; otherwise ``ssh -G`` reads the config). Importing
this module first imports paramiko with invoke hidden, then un-hides it, so that anything
importing invoke later gets it; ``match_exec`` gives it back to paramiko's parser.
"""

from __future__ import annotations

import sys


def _import_paramiko() -> None:
    if "paramiko" in sys.modules or "invoke" in sys.modules:
        return  # too late to spare it, or already paid for
    sys.modules["invoke"] = None  # type: ignore[assignment]  # `import invoke` raises ImportError
    try:
        import paramiko.config  # noqa: F401
    finally:
        del sys.modules["invoke"]


def match_exec() -> None:
    """Let paramiko's config parser run ``Match exec`` again (when invoke is installed)."""
    import paramiko.config

    if getattr(paramiko.config, "invoke", None) is None:
        try:
            import invoke
        except ImportError:
            return
        paramiko.config.invoke = invoke  # type: ignore[attr-defined]


_import_paramiko()
