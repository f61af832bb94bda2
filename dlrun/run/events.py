"""The events of an attached job's supervisor loop, one frozen record per kind.

The host agents' readers (``run/agents``), the silence watch, the signal handlers, the control
socket and the stack requests (``run/hang``) put them on one queue (``EventQueue``); the
supervisor's loop (``run/supervisor``) alone takes them off and acts, in order.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where stacks are shown: every launch imports this module, few take stacks
    from dlrun.remote.stack_groups import RankStacks


@dataclass(frozen=True)
class StackAnswer:
    """Every rank's stacks (host answers parsed), the folder they went to, notes per host, and
    what NCCL's RAS said of the job's communicators (``ras_lines``)."""

    stacks: tuple[RankStacks, ...]
    folder: Path | None
    notes: Mapping[str, str] = field(default_factory=dict)
    ras: tuple[str, ...] = ()

    def summary(self) -> list[str]:
        from dlrun.remote.stack_groups import group_ranks, summary_lines

        return summary_lines(group_ranks(self.stacks)) + list(self.ras)


@dataclass(frozen=True)
class Frames:
    """An agent's frames, as read from its channel: (frame kind, rank, payload) each."""

    host: str
    frames: Sequence[tuple[int, int, bytes]]


@dataclass(frozen=True)
class Closed:
    """An agent's channel ended: its exit code (None: unknown) and what it wrote on stderr."""

    host: str
    code: int | None
    stderr: str


@dataclass(frozen=True)
class Silent:
    """A host sent nothing for ``seconds``, past the host timeout: it counts as lost."""

    host: str
    seconds: float


@dataclass(frozen=True)
class Notice:
    """A line to show between the job's lines."""

    text: str


@dataclass(frozen=True)
class Wake:
    """Nothing to do but look again (a signal was recorded: it is taken before any event)."""


@dataclass(frozen=True)
class Tick:
    """No event came within the loop's wait."""


@dataclass(frozen=True)
class Interrupt:
    """A signal (Ctrl-C, SIGTERM): stop every rank, at once the second time."""

    signum: int


@dataclass(frozen=True)
class StacksAsked:
    """``dlrun stack`` through the control socket: every rank's stack (of ``hosts``, None: all)
    goes to ``reply``."""

    hosts: Sequence[str] | None
    reply: Callable[[StackAnswer], None]


@dataclass(frozen=True)
class StacksReady:
    """py-spy is on the hosts for stack request ``request_id`` (``notes``: per host, what failed)."""

    request_id: str
    sha256: str
    notes: Mapping[str, str]


Event = Frames | Closed | Silent | Notice | Wake | Tick | Interrupt | StacksAsked | StacksReady

#: The supervisor's queue of events.
EventQueue = queue.Queue[Event]
