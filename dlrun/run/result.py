"""How a job ended: each rank's state and result, and the job's (pure records).

Rank lifecycle (``RankState``): PENDING → RUNNING → SUCCEEDED | FAILED | STOPPED | LOST
(NOT_STARTED when dlrun stopped the job before the rank's process was started).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlrun.remote import rankpolicy
from dlrun.render import WorkerCommand


class RankState(enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"  # ended because dlrun stopped it
    NOT_STARTED = "not started"  # dlrun stopped the job before this rank's process was started
    LOST = "lost"  # its host's connection dropped before it reported an exit


@dataclass(frozen=True)
class RankResult:
    rank: int
    host: str
    state: RankState
    exit_code: int | None
    duration: float | None
    tail: tuple[str, ...] = ()
    error: str | None = None  # agent's words when the rank could not start
    exception: tuple[str, ...] = ()  # its output's last Python traceback: innermost frames, exception line
    exception_final: bool = True  # that traceback was its last output (else many lines followed: maybe caught)
    error_file: tuple[str, ...] = ()  # what torch's @record wrote to TORCHELASTIC_ERROR_FILE (lines shown)
    hint: tuple[str, ...] = ()  # the root cause's: what the failure more likely comes from (peers that left early)


def rank_state(code: int | None, *, stopping: bool, signalled: bool = False) -> RankState:
    """A rank's state from how it exited (``dlrun.remote.rankpolicy.rank_state``, the keeper's rule
    too): ended by dlrun's stop is STOPPED whatever its exit code (Lightning exits 0 on SIGTERM)."""
    return RankState(rankpolicy.rank_state(code, stopping, signalled))


@dataclass(frozen=True)
class Attempt:
    """One run of the job (``--max-restarts``): its number (0: the first), job id, hosts, how
    it ended, and the hosts dropped before it (lost in an earlier attempt, ``--min-hosts``)."""

    number: int
    job_id: str
    hosts: tuple[str, ...]
    exit_code: int
    root_cause: RankResult | None = None
    interrupted_by: int | None = None
    dropped: tuple[str, ...] = ()
    hang: str = ""  # --hang-timeout stopped it: the hang's first line (``hung (no output for S s): …``)


@dataclass(frozen=True)
class RunResult:
    """How a job ended: per-rank results, the root cause and the exit code for the shell.

    ``commands``: what the ranks ran (a dry run's result has only these); ``attempts``: how
    many times the job ran (``max_restarts``), ``history`` each attempt's end; ``job_id``: the
    first attempt's id (a restart's is ``<job_id>-r<k>``). ``gpu_summary``: each GPU's mean
    utilization and peak memory (``dlrun.run.gpus.GpuStats.summary``); ``gpu_warnings``: its
    idle-GPU warnings.
    """

    ranks: tuple[RankResult, ...]
    exit_code: int
    root_cause: RankResult | None = None
    interrupted_by: int | None = None
    log_dir: Path | None = None
    commands: tuple[WorkerCommand, ...] = ()
    job_id: str = ""
    attempts: int = 1
    gpu_summary: tuple[dict[str, Any], ...] = ()
    gpu_warnings: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()  # what dlrun warned before the start (repeated in a failure's root cause)
    history: tuple[Attempt, ...] = ()
    stopped_at: float | None = None  # wall clock (time.time) when dlrun began stopping the ranks: a failure's time
    hang: tuple[str, ...] = ()  # --hang-timeout stopped the job: the cause, then the ranks' groups (dlrun.run.hang)
    flight_recorder: tuple[str, ...] = ()  # who the ranks' flight recorder dumps say is behind (stack_groups)
    raised_first: tuple[str, ...] = ()  # a rank still running that raised before the root cause did

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @property
    def lost_hosts(self) -> tuple[str, ...]:
        """Hosts whose connection dropped or went silent: a rank of theirs is LOST, or was
        stopping when its host's link failed (exit 255 with the reason)."""
        lost = [r.host for r in self.ranks if r.state == RankState.LOST or (
            r.state in (RankState.STOPPED, RankState.NOT_STARTED) and r.exit_code == 255 and r.error)]
        return tuple(dict.fromkeys(lost))

