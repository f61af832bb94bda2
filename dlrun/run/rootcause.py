"""What a failed rank's root cause shows beside its last lines: the Python exception it raised
(even when its last lines are a tensor dump, and behind torch's ``[rank0]: `` prefix), what
torch's ``@record`` wrote to ``TORCHELASTIC_ERROR_FILE``, the signal behind an exit code, and the
hint for peers that left early. The rules live in ``dlrun.remote.rankpolicy``, which the detached
keeper loads on the hosts too, so attached and detached jobs find the same root cause. Pure.
"""

from __future__ import annotations

from dlrun.remote.rankpolicy import (
    EXCEPTION_CHARS,
    FRAMES_SHOWN,
    TRACEBACK_START,
    TracebackCatcher,
    early_exit_hint,
    error_file_lines,
    peer_gone,
    signal_text,
)

__all__ = ["EXCEPTION_CHARS", "FRAMES_SHOWN", "TRACEBACK_START", "TracebackCatcher", "early_exit_hint",
           "error_file_lines", "peer_gone", "signal_text"]
