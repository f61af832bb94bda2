"""The rank policy, written once for the attached supervisor and the detached keeper: a rank's
state from how it exited, the job's exit code, and what a rank's output means: lines (split on
``\n``, ``\r\n`` and ``\r``, one line capped at ``MAX_LINE`` bytes), the tail a root cause
shows, the Python exception a rank raised (also behind a prefix such as torch's ``[rank0]: ``),
what torch's ``@record`` wrote to ``TORCHELASTIC_ERROR_FILE``, the signal behind an exit code, the
hint for peers that left early, and whether a failed attempt runs again (``--max-restarts``): each
attempt's job id, the decision (``restart``) and the pause before it. The numbers both sides use
(the stop margin, the restart pause, the hang's exit code, the GPU table's columns) live here once.

Standard library only, Python >= 3.8: the supervisor imports it, the keeper on a host loads it from
the source it was shipped (as it loads the Horovod rendezvous). Pure.
"""

from __future__ import annotations

import re
import signal
from collections import deque
from typing import Any, Mapping, NamedTuple, Sequence

TAIL_LINES = 20  # a failed rank's last lines in its root cause
RESTART_PAUSE = 1.0  # seconds between a failed attempt and the next (the hosts' ports settle)
STOP_MARGIN = 15.0  # seconds past the grace an agent may take to report its ranks' end before it is killed
HANG_EXIT = 124  # the exit code of a job --hang-timeout stopped (as timeout(1))
DUMP_WAIT = 2.0  # seconds faulthandler's and the flight recorder's dumps get before a hung job's stop
RECORD_WAIT = 15.0  # seconds from asking for flight recorder dumps that an agent holds the stop for them, at most
HANG_BUSY_UTIL = 5.0  # a GPU at this utilization (%) or above is working: the job is not hung
GPU_CSV_COLUMNS = ("time", "host", "gpu", "util", "mem_used_mib", "mem_total_mib", "power_w", "temp_c")  # gpu.csv
FINAL_STATES = ("succeeded", "failed", "stopped", "lost")  # a rank's (and a detached job's) states that are an end
MAX_LINE = 1 << 20  # bytes: a longer line is cut into pieces of this size
TAIL_CHARS = 4000  # characters of one line of a root cause's tail (its head and its tail)
FRAMES_SHOWN = 3  # the innermost frames of a traceback shown in a root cause
EXCEPTION_CHARS = 400  # an exception line longer than this is cut (a tensor in the message)
TRACEBACK_START = "Traceback (most recent call last):"
#: What Python prints between chained tracebacks, and how the root cause names the first one's
#: exception, shown above the last one's frames (``raise … from``: its cause).
CHAINED = {"The above exception was the direct cause of the following exception:": "caused by",
           "During handling of the above exception, another exception occurred:": "while handling"}
LAST_OUTPUT = 5  # lines after a traceback (torch's teardown warnings) that still leave it the rank's last words
MAX_PREFIX = 80  # characters before TRACEBACK_START that still count as a prefix ([rank0]: , [1,0]<stderr>:)


def cut(text: str, limit: int = EXCEPTION_CHARS) -> str:
    """``text``, or its head and its tail around an ellipsis in ``limit`` characters: a long
    exception message (a tensor, a list of shapes) often says what matters at its end."""
    if len(text) <= limit:
        return text
    tail = limit // 3
    return text[: limit - tail - 1] + "…" + text[len(text) - tail:]


def _whole_characters(data: bytes) -> tuple[str, bytes]:
    """An over-long line's text so far, and the bytes of a UTF-8 character it cuts in two
    (kept for the next piece instead of becoming two replacement characters)."""
    end = len(data)
    for back in range(1, min(4, len(data)) + 1):  # a lead byte within the last 4 bytes
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # not a continuation byte
            need = 2 if byte >= 0xC0 else 1
            need = 3 if byte >= 0xE0 else need
            need = 4 if byte >= 0xF0 else need
            if back < need:
                end = len(data) - back
            break
    return data[:end].decode("utf-8", errors="replace"), data[end:]


class LineSplitter:
    """Splits a byte stream into lines on ``\\n``, ``\\r\\n`` and ``\\r``; a line longer than
    ``max_line`` bytes comes out in pieces, so one endless line costs bounded memory."""

    _SEP = re.compile(rb"\r\n|\r|\n")

    def __init__(self, max_line: int = MAX_LINE) -> None:
        self.buf = b""
        self.max_line = max_line

    def feed(self, data: bytes) -> list[str]:
        buf = self.buf + data
        lines: list[str] = []
        if b"\r" not in buf:  # the common case: one decode and one split, both in C
            end = buf.rfind(b"\n")
            if end < 0:
                rest = buf
            else:
                lines = buf[:end].decode("utf-8", errors="replace").split("\n")
                rest = buf[end + 1:]
            while len(rest) > self.max_line:
                line, rest = self._piece(rest)
                lines.append(line)
            self.buf = rest
            return lines
        hold = b""
        if buf.endswith(b"\r"):  # maybe the first half of \r\n
            buf, hold = buf[:-1], b"\r"
        pos = 0
        for match in self._SEP.finditer(buf):
            piece = buf[pos: match.start()]
            if piece or match.group() != b"\r":
                lines.append(piece.decode("utf-8", errors="replace"))
            pos = match.end()
        rest = buf[pos:]
        while len(rest) > self.max_line:
            line, rest = self._piece(rest)
            lines.append(line)
        self.buf = rest + hold
        return lines

    def _piece(self, rest: bytes) -> tuple[str, bytes]:
        """The first ``max_line`` bytes of an over-long line as a line (whole characters), and the rest."""
        text, held = _whole_characters(rest[: self.max_line])
        return text, held + rest[self.max_line:]

    def flush(self) -> list[str]:
        rest, self.buf = self.buf.rstrip(b"\r"), b""
        return [rest.decode("utf-8", errors="replace")] if rest else []


class TracebackCatcher:
    """Fed a rank's lines in order; keeps the last complete Python traceback it saw: the
    innermost frames and the exception line. A traceback may stand behind a prefix that a
    framework puts before every line of it (torch >= 2.2: ``[rank0]: ``; torchrun --tee:
    ``[default0]:``; horovodrun: ``[1,0]<stderr>:``): the prefix is whatever stands before
    ``Traceback (most recent call last):``, and is taken off the lines that follow."""

    def __init__(self) -> None:
        self.last: tuple[str, ...] = ()
        self._cause: str | None = None  # a chained traceback's: the exception before it (raise … from)
        self.after = 0  # lines the rank printed since ``last`` ended: many, and it may have been caught
        self._frames: list[str] | None = None
        self._prefix = ""

    def skip(self, lines: int) -> None:
        """Lines of the rank that were not fed (no traceback in them): they count in ``after``."""
        self.after += lines

    @property
    def final(self) -> bool:
        """The last traceback was (about) the rank's last output: what it died of, not one it
        logged and went on from (``logging.exception``, a retried upload)."""
        return bool(self.last) and self.after <= LAST_OUTPUT

    @property
    def reading(self) -> bool:
        """Inside a traceback: every line counts (otherwise only a traceback's first line does)."""
        return self._frames is not None

    def wants(self, text: str) -> bool:
        """Must these lines (joined) be fed one by one: inside a traceback, a traceback's start, or
        the line between chained ones (which may come in a write of its own)? Else ``skip``."""
        return self._frames is not None or TRACEBACK_START in text or (
            bool(self.last) and any(mark in text for mark in CHAINED))

    def feed(self, line: str) -> None:
        where = line.find(TRACEBACK_START)
        if 0 <= where <= MAX_PREFIX:
            self._frames = []
            self._prefix = line[:where]
            return
        if self._frames is None:
            for mark, word in CHAINED.items():
                at = line.find(mark)
                if 0 <= at <= MAX_PREFIX and self.last:
                    first = self.last[0]  # a chain of three names its first exception
                    chained = first.startswith(tuple(f"{w}: " for w in CHAINED.values()))
                    self._cause = first if chained else f"{word}: {self.last[-1]}"
                    return
            self.after += 1
            return
        if self._prefix:
            if not line.startswith(self._prefix):
                stripped = self._prefix.rstrip()
                if not (stripped and line.startswith(stripped)):
                    return  # another writer's line between two of the traceback's
                line = line[len(stripped):]
            else:
                line = line[len(self._prefix):]
        if line.startswith((" ", "\t")):
            self._frames.append(line)
            if len(self._frames) > 8 * FRAMES_SHOWN:  # keep the innermost ones only
                del self._frames[: len(self._frames) - 8 * FRAMES_SHOWN]
            return
        if not line.strip():
            return
        self.last = (*([self._cause] if self._cause else []), *innermost(self._frames), cut(line))
        self._cause = None
        self.after = 0
        self._frames = None


def raised_first(raised: Mapping[int, tuple[float, str, Sequence[str]]], failed: int, failed_at: float) -> list[str]:
    """The root cause's note of a rank still running whose last words were a traceback that came
    before the failed rank's own (``raised``: rank -> when its traceback ended, its host, the
    traceback's lines; ``failed_at``: when the failed rank's ended, or its exit): it raised first,
    and what the failed rank died of (a collective's timeout, a peer gone) may only follow from
    it. A non-daemon thread or a stuck teardown keeps such a rank alive; on 64 GPUs, 63 ranks
    time out waiting for it. The times are the hosts' clocks."""
    first = min(((at, rank) for rank, (at, _host, _lines) in raised.items() if rank != failed and at < failed_at),
                default=None)
    if first is None:
        return []
    at, rank = first
    _at, host, lines = raised[rank]
    return [f"rank {rank} on {host} raised first, {failed_at - at:.1f} s before, and printed little since (still"
            " running then):", *(f"  | {text}" for text in lines)]


def innermost(frame_lines: Sequence[str]) -> list[str]:
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
        return [cut(line) for line in recorded.strip().splitlines()[-FRAMES_SHOWN * 2 - 1:]]
    if not isinstance(recorded, dict):
        return []
    message = recorded.get("message")
    if isinstance(message, dict):
        text = str(message.get("message", "")).strip()
        extra = message.get("extraInfo")
        stack = str(extra.get("py_callstack", "")) if isinstance(extra, dict) else ""
        lines = [line for line in stack.strip().splitlines() if line.strip()]
        frames = innermost([line for line in lines if line.startswith((" ", "\t"))])
        return [*frames, cut(text)] if text else frames
    if isinstance(message, str):
        return [cut(message.strip())]
    return []


class RankLines:
    """One rank's output as the root cause needs it: the line splitters (one per stream), the
    last ``TAIL_LINES`` lines and the last traceback."""

    def __init__(self) -> None:
        self.splitters: dict[int, LineSplitter] = {}
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.traceback = TracebackCatcher()

    def feed(self, stream: int, data: bytes) -> list[str]:
        """Bytes of one stream; the whole lines they complete."""
        splitter = self.splitters.get(stream)
        if splitter is None:
            splitter = self.splitters[stream] = LineSplitter()
        texts = splitter.feed(data)
        if texts:
            self.seen(texts)
        return texts

    def seen(self, texts: Sequence[str]) -> None:
        """Lines of the rank (from a splitter, or dlrun's own about it) for the tail and the traceback."""
        self.tail.extend(texts[-TAIL_LINES:])
        if self.traceback.wants("\n".join(texts)):  # a line at a time only there
            for text in texts:
                self.traceback.feed(text)
        else:
            self.traceback.skip(len(texts))

    def flush(self) -> list[tuple[int, str]]:
        """What the streams hold without a line end (the rank exited): (stream, line) pairs."""
        out = []
        for stream, splitter in self.splitters.items():
            for text in splitter.flush():
                self.seen([text])
                out.append((stream, text))
        return out


def rank_state(code: int | None, stopping: bool, signalled: bool = False) -> str:
    """A rank's state from how it exited: one the agent signalled to stop (its signal's 128 + N,
    or 0 from a framework that exits cleanly on SIGTERM, as Lightning does), or that a signal
    ended while the job was being stopped, was stopped, not a new failure. One that exited
    non-zero by itself meanwhile failed: every rank of a bad node that crashes at once is
    shown, not the first alone."""
    if signalled or (stopping and (code is None or code > 128 or code < 0)):
        return "stopped"
    return "succeeded" if code == 0 else "failed"


def job_exit_code(root_code: int | None, interrupted_by: int | None, codes: Sequence[int | None],
                  ender_codes: Sequence[int | None] | None = None) -> int:
    """The job's exit code: the root cause's (the first failure, or 255 for a lost host), else
    128 + the signal that stopped it, else 0 when every rank succeeded, else (tf-ps) the code of
    the ranks whose end ends the job, else the first non-zero code."""
    if root_code is not None:
        return root_code or 1
    if interrupted_by is not None:
        return 128 + interrupted_by
    if all(code == 0 for code in codes):
        return 0
    if ender_codes is not None:
        return int(next((code or 0 for code in ender_codes), 0))
    return next((code for code in codes if code), 1) or 1


#: What a rank prints when a peer went away under it (gloo, NCCL, TF's gRPC, Horovod).
PEER_GONE = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|remote process exited|"
    r"ProcessGroupGloo.*(?:Timed out|closed)|NCCL communicator was aborted|peer .* (?:closed|disconnected)|"
    r"Socket closed|UNAVAILABLE: .*(?:Connection|failed to connect)|Horovod has been shut down",
    re.IGNORECASE)


def peer_gone(lines: Sequence[str]) -> bool:
    """Do a failed rank's exception or last lines say that a peer left under it?"""
    return any(PEER_GONE.search(line) for line in lines)


def early_exit_hint(root_rank: int, root_lines: Sequence[str],
                    finished_before: Sequence[tuple[int, str]]) -> list[str]:
    """When ranks exited 0 while others still ran and the first failure is a peer's connection
    going away, the failure is the symptom: say so, and what usually causes it.
    ``finished_before``: (rank, host) of the ranks that exited 0 before the root cause failed."""
    if not finished_before or not peer_gone(root_lines):
        return []
    ranks = ", ".join(f"{rank} ({host})" for rank, host in finished_before[:8])
    more = f" and {len(finished_before) - 8} more" if len(finished_before) > 8 else ""
    plural = "s" if len(finished_before) != 1 else ""
    return [
        f"rank{plural} {ranks}{more} exited 0 while the others still ran, and rank {root_rank} then lost"
        " its connection to a peer:",
        "the early exit is the likely cause, not this rank. Usual reasons: a resume checkpoint that only some"
        " hosts have (they start at a later step), a different number of steps or batches per rank"
        " (unequal data shards), or a rank that skips the last collective",
    ]


def attempt_job_id(job_id: str, attempt: int) -> str:
    """Attempt ``attempt``'s job id (0: the first): ``<job>``, then ``<job>-r1``, ``<job>-r2``, …"""
    return job_id if attempt == 0 else f"{job_id}-r{attempt}"


class Restart(NamedTuple):
    """Whether a job runs again after attempt ``attempt`` (0: the first) ended, and why (or why not)."""

    again: bool
    why: str  # "succeeded", "interrupted by signal 2", "no restart left (2 of 2 used)", …


def restart(attempt: int, max_restarts: int, exit_code: int, interrupted_by: int | None,
            lost_hosts: Sequence[str] = (), *, lost_hosts_return: bool = True) -> Restart:
    """The restart decision, the same attached and detached: a failed attempt (any non-zero exit:
    a rank's failure, a lost host, a hang) runs again while restarts are left; never after
    success or an interrupt (Ctrl-C, SIGTERM, ``dlrun stop``). ``lost_hosts_return``: whether
    a lost host can take part again (attached: it is reconnected, or ``--min-hosts`` leaves it
    out; detached: its keeper is gone with it, so the job ends)."""
    if exit_code == 0:
        return Restart(False, "succeeded")
    if interrupted_by is not None:
        return Restart(False, f"interrupted by signal {interrupted_by}")
    if attempt >= max_restarts:
        return Restart(False, f"no restart left ({max_restarts} of {max_restarts} used)" if max_restarts
                       else "no restarts (--max-restarts 0)")
    if lost_hosts and not lost_hosts_return:
        plural = "s" if len(lost_hosts) != 1 else ""
        return Restart(False, f"host{plural} {', '.join(lost_hosts)} lost, and a detached job restarts"
                              " only on the hosts it started on")
    return Restart(True, f"attempt {attempt + 1} failed (exit code {exit_code})")


def restart_notice(attempt: int, max_restarts: int, exit_code: int, unit: str = "the job", where: str = "") -> str:
    """What is said when attempt ``attempt`` (0: the first) failed and the next one starts."""
    return (f"attempt {attempt + 1} failed (exit code {exit_code}): relaunching {unit}{where}"
            f" ({attempt + 1} of {max_restarts} restarts)")
