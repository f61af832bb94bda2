"""What a failed rank's root cause shows beside its last lines: the Python exception it raised
(even when its last lines are a tensor dump), what torch's ``@record`` wrote to
``TORCHELASTIC_ERROR_FILE``, and the signal behind an exit code. Pure.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

FRAMES_SHOWN = 3  # the innermost frames of a traceback shown in a root cause
EXCEPTION_CHARS = 400  # an exception line longer than this is cut (a tensor in the message)
TRACEBACK_START = "Traceback (most recent call last):"


def _cut(text: str, limit: int = EXCEPTION_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass
class TracebackCatcher:
    """Fed a rank's lines in order; keeps the last complete Python traceback it saw: the
    innermost frames and the exception line."""

    last: tuple[str, ...] = ()
    _frames: list[str] | None = None
    _buffer: list[str] = field(default_factory=list)

    @property
    def reading(self) -> bool:
        """Inside a traceback: every line counts (otherwise only a traceback's first line does)."""
        return self._frames is not None

    def feed(self, line: str) -> None:
        if line.startswith(TRACEBACK_START):
            self._frames = []
            return
        if self._frames is None:
            return
        if line.startswith((" ", "\t")):
            self._frames.append(line)
            if len(self._frames) > 8 * FRAMES_SHOWN:  # keep the innermost ones only
                del self._frames[: len(self._frames) - 8 * FRAMES_SHOWN]
            return
        if not line.strip():
            return
        self.last = (*_innermost(self._frames), _cut(line))
        self._frames = None


def _innermost(frame_lines: Sequence[str]) -> list[str]:
    """The last ``FRAMES_SHOWN`` frames (each a ``File …`` line and what follows it)."""
    starts = [i for i, text in enumerate(frame_lines) if text.lstrip().startswith("File ")]
    if not starts:
        return list(frame_lines[-2 * FRAMES_SHOWN:])
    return list(frame_lines[starts[-FRAMES_SHOWN:][0]:])


def signal_text(code: int | None) -> str | None:
    """``killed by SIGABRT (134)`` for exit codes 129–159 (128 + the signal's number)."""
    if code is None or not 128 < code < 160:
        return None
    try:
        name = signal.Signals(code - 128).name
    except ValueError:
        return None
    return f"killed by {name} ({code})"


def error_file_lines(recorded: Any) -> list[str]:
    """The lines worth showing of a ``TORCHELASTIC_ERROR_FILE`` (torch's ``@record`` JSON:
    ``{"message": {"message": "ValueError: …", "extraInfo": {"py_callstack": …}}}``)."""
    if isinstance(recorded, str):
        return [_cut(line) for line in recorded.strip().splitlines()[-FRAMES_SHOWN * 2 - 1:]]
    if not isinstance(recorded, dict):
        return []
    message = recorded.get("message")
    if isinstance(message, dict):
        text = str(message.get("message", "")).strip()
        extra = message.get("extraInfo")
        stack = str(extra.get("py_callstack", "")) if isinstance(extra, dict) else ""
        lines = [line for line in stack.strip().splitlines() if line.strip()]
        frames = _innermost([line for line in lines if line.startswith((" ", "\t"))])
        return [*frames, _cut(text)] if text else frames
    if isinstance(message, str):
        return [_cut(message.strip())]
    return []
