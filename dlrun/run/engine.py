"""What an engine is to the launch pipeline: the part that places a job's ranks.

``dlrun.run.pipeline.run_job`` checks the options, shows the view, supervises every attempt,
restarts and turns the result into an exit code, once for every engine. An engine decides
where the ranks run and how their hosts' agents are reached: the hosts engine
(``dlrun.run.hosts.HostsEngine``: the inventory's hosts over SSH or on this machine) or the
Spark engine (``dlrun.spark.driver.SparkEngine``: the tasks of a barrier stage). Each attempt
is one ``place``: the engine yields a ``Placement``, the pipeline supervises it, and the
placement hears how it ended (``done``) before the engine cleans up. A restart is the next
``place`` with ``config.attempt`` one higher; the hosts engine first hears which hosts the failed
attempt lost (``HostsEngine.regroup``: reconnect them, or leave them out with ``--min-hosts``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from dlrun.inventory import Inventory
from dlrun.render import WorkerCommand
from dlrun.run.result import RunResult

if TYPE_CHECKING:
    from dlrun.push.session import HostPushSummary
    from dlrun.run.agents import HostAgents
    from dlrun.run.config import LaunchConfig
    from dlrun.run.supervisor import View
    from dlrun.transport.base import Transport


def _nothing(_result: RunResult) -> None:
    return None


@dataclass(frozen=True)
class Placement:
    """One attempt's ranks, placed: their commands, the transport that reaches their agents
    (``agents``: started already, e.g. for the preflight), which rank's end ends the job, what
    runs beside the supervisor (``watch``) and who hears how it ended (``done``)."""

    transport: Transport
    commands: tuple[WorkerCommand, ...]
    agents: HostAgents | None = None
    ends_job: Callable[[WorkerCommand], bool] | None = None
    watch: Callable[[], AbstractContextManager[None]] = nullcontext
    done: Callable[[RunResult], None] = _nothing
    notes: tuple[str, ...] = ()  # said on the attempt's line (a restart's checkpoint copies: time and bytes)


@dataclass(frozen=True)
class DryRun:
    """What ``--dry-run`` shows: each rank's command, what the code push would send and delete
    (``pushes``: none where nothing is pushed), and whether the ports are free ones dlrun chose
    now (``ports_chosen``: a launch asks the hosts again and may get others)."""

    commands: tuple[WorkerCommand, ...]
    pushes: tuple[HostPushSummary, ...] = ()
    ports_chosen: bool = False


@dataclass(frozen=True)
class Regrouped:
    """How the engine met a failed attempt's lost hosts: ``refused`` says why the job cannot
    restart (None: it goes on); ``dropped``: hosts left out from the next attempt on."""

    refused: str | None = None
    dropped: tuple[str, ...] = ()


class Engine(Protocol):
    """Places the ranks; everything above placing is the pipeline's."""

    #: what a restart relaunches, in the notice ("the job", "the barrier stage")
    restart_unit: str
    #: whether ``detach`` can hand the job to its hosts (``launch --detach``)
    detaches: bool

    @property
    def inventory(self) -> Inventory:
        """The hosts known before anything starts (options' checks and warnings; Spark: a stand-in)."""
        ...

    @property
    def warnings(self) -> tuple[str, ...]:
        """What the session warned about before the start, repeated in a failed attempt's root cause."""
        ...

    def prepare(self, config: LaunchConfig) -> LaunchConfig:
        """Refuse what cannot work before anything starts; the config as this engine runs it."""
        ...

    def probes(self, config: LaunchConfig) -> bool:
        """Does the session probe the hosts (and so warn about their own Keras, not this machine's)?"""
        ...

    def dry_run(self, config: LaunchConfig, job_id: str) -> DryRun:
        """The commands a launch would run, started nowhere."""
        ...

    def regroup(self, config: LaunchConfig, failed: RunResult) -> Regrouped:
        """After a failed attempt that will be restarted: where the next one runs."""
        ...

    def detach(self, config: LaunchConfig, job_id: str, view: View) -> RunResult:
        """Inside ``session``: hand every attempt's ranks to the hosts and return once they run."""
        ...

    def session(self, config: LaunchConfig, job_id: str) -> AbstractContextManager[LaunchConfig]:
        """Everything every attempt shares (connections, a Spark context, the pushed code);
        yields the config the attempts run (a pushed script is named as on the hosts)."""
        ...

    def place(self, config: LaunchConfig, job_id: str, view: View) -> AbstractContextManager[Placement]:
        """One attempt's ranks, placed and rendered; cleaned up when the attempt ends."""
        ...
