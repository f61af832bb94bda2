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
    restarting: bool = False  # an attempt that --max-restarts runs again: not the job's end

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



def result_document(result: RunResult) -> dict[str, Any]:
    """What ``dlrun-logs/<job>/result.json`` says of an attached job, for CI and scripts: how it
    ended (``outcome``: succeeded, failed, lost, hung, interrupted), the exit code, the root
    cause (rank, host, code, the signal, the exception's line) and every rank's end. A rank's own
    exit code may be one dlrun also uses (2, 124, 130, 255): ``outcome`` tells them apart."""
    root = result.root_cause
    if result.exit_code == 0:
        outcome = "succeeded"
    elif result.interrupted_by is not None and root is None:  # as the summary's verdict: a failure first
        outcome = "interrupted"
    elif root is None and result.hang:
        outcome = "hung"
    elif root is not None and root.state == RankState.LOST:
        outcome = "lost"
    else:
        outcome = "failed"
    cause = None
    if root is not None:
        killed = rankpolicy.signal_text(root.exit_code) if root.state != RankState.LOST else None
        cause = {"rank": root.rank, "host": root.host, "exit_code": root.exit_code,
                 "signal": killed.split()[2] if killed else None,
                 "exception": (root.error_file or root.exception or (None,))[-1], "error": root.error}
    return {"job_id": result.job_id, "outcome": outcome, "exit_code": result.exit_code, "attempts": result.attempts,
            "root_cause": cause, "raised_first": list(result.raised_first),
            "hang": result.hang[0] if result.hang else None,
            "ranks": [{"rank": r.rank, "host": r.host, "state": r.state.value, "exit_code": r.exit_code,
                       "seconds": None if r.duration is None else round(r.duration, 3)} for r in result.ranks]}
