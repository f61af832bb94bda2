"""The supervisor: runs a job's ranks on their hosts and decides when and how it ends.

Mechanism sits below (``dlrun.remote.agent`` starts and kills processes on each host; a
``Transport`` carries the bytes); policy sits here:

* one agent per host, all started in parallel (``dlrun.run.agents.HostAgents``), each fed
  the spec of its host's ranks (agents started early, for the preflight and the push survey,
  are handed over);
* every output chunk is split into lines (on ``\\n`` and ``\\r``, so progress bars are lines),
  written to ``<log_dir>/rank-<N>.log`` and handed to the view;
* **fail fast**: the earliest rank to exit non-zero is the root cause; every agent is told to
  stop (SIGTERM, then SIGKILL after ``grace``); the job's exit code is that rank's;
* a dropped connection is a failure of every rank on that host (exit 255, host named);
* **heartbeat**: a thread of its own pings every agent every few seconds (``{"op": "ping"}``,
  answered by a PONG frame). A host from which nothing at all arrives for ``host_timeout``
  seconds is lost — powered off, cut off, frozen: cases where no TCP reset comes and the
  connection would hang for many minutes — and fails like a dropped connection. The agent
  keeps the same clock: without a ping for ``host_timeout`` it stops its ranks by itself, so
  the cut-off side leaves nothing running either. The pings do not wait for the screen or the
  log files, so a blocked terminal (``dlrun … | less``) does not starve them;
* ``interrupt(signum)`` (Ctrl-C, SIGTERM) stops every rank the same way; exit 128 + signum.
  A second interrupt kills at once;
* **GPUs**: with ``gpu_every``, each agent samples its host's GPUs (``dlrun.run.gpus``); the
  samples go to ``<log_dir>/gpu.csv``, the view, an idle-GPU watch and the summary (hosts
  that share an address and port, such as Spark tasks on one machine, sample once). A host whose
  sampling fails is named once; nothing about GPUs changes the exit code;
* **stacks and hangs** (``dlrun.run.hang``): ``dlrun stack JOB`` from another terminal asks
  through ``dlrun.run.control``'s socket; with ``hang_timeout``, no output and no busy GPU for
  that long takes every rank's stack, names the odd group as the root cause and stops the job
  (exit ``HANG_EXIT``).

Rank lifecycle: ``dlrun.run.result.RankState``.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any, Protocol

from dlrun.errors import DlrunError
from dlrun.plan import DEFAULT_HOST_TIMEOUT, heartbeat_interval
from dlrun.remote import agent
from dlrun.remote.rankpolicy import (
    DUMP_WAIT,
    GPU_CSV_COLUMNS,
    HANG_EXIT,
    MAX_LINE,
    RECORD_WAIT,
    STOP_MARGIN,
    TAIL_CHARS,
    TAIL_LINES,
    LineSplitter,
    TracebackCatcher,
    cut,
    early_exit_hint,
    error_file_lines,
    job_exit_code,
    raised_first,
)
from dlrun.render import WorkerCommand
from dlrun.run.agents import HostAgents, HostLink, close_aside, encode_message, with_agent_words
from dlrun.run.control import ControlServer
from dlrun.run.events import (
    Closed,
    Event,
    Frames,
    Interrupt,
    Notice,
    Silent,
    StackAnswer,
    StacksAsked,
    StacksReady,
    Tick,
    Wake,
)
from dlrun.run.gpus import GpuSample, GpuStats, IdleWatch, csv_rows, parse_sample, visible_gpus
from dlrun.run.hang import HangWatch, StackRequests, answer_json, hang_lines
from dlrun.run.result import RankResult, RankState, RunResult, rank_state
from dlrun.transport.base import Transport

__all__ = ["MAX_LINE", "TAIL_LINES", "LineSplitter", "Supervisor", "View", "agent_spec"]


class View(Protocol):
    """What the supervisor tells the screen (see ``dlrun.run.view``)."""

    def start(self, commands: Sequence[WorkerCommand], log_dir: Path | None) -> None: ...
    def line(self, rank: int, text: str, stream: str) -> None: ...
    def lines(self, rank: int, texts: Sequence[str], stream: str) -> None: ...
    def state(self, rank: int, state: RankState, exit_code: int | None) -> None: ...
    def notice(self, text: str) -> None: ...
    def gpus(self, host: str, samples: Sequence[GpuSample]) -> None: ...
    def flush(self) -> None: ...
    def finish(self, result: RunResult) -> None: ...


@dataclass
class _Rank:
    command: WorkerCommand
    state: RankState = RankState.PENDING
    exit_code: int | None = None
    started: float | None = None
    ended: float | None = None
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    splitters: dict[int, LineSplitter] = field(default_factory=dict)
    log: IO[str] | None = None
    error: str | None = None
    traceback: TracebackCatcher = field(default_factory=TracebackCatcher)  # the exception it raised
    error_file: tuple[str, ...] = ()  # its TORCHELASTIC_ERROR_FILE, from the EXIT frame
    unlogged: int = 0  # lines its log file could not take (a full disk): the screen had them
    unflushed: int = 0  # lines written to its log file's buffer since the last flush that worked
    raised_at: float | None = None  # when its last traceback ended (the clock's time)



def private_file(path: Path) -> IO[str]:
    """A new file of the job's logs, for writing: mode 0600, never through a link, never one that
    is there already. Where another user may write the folder above the job's (a shared
    ``dlrun-logs/``) and swaps the job's folder for a link to theirs, the lines stay unreadable
    to them, or the open fails, instead of landing in a file of theirs."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    return open(fd, "w", encoding="utf-8")


def agent_spec(job_id: str, host: str, commands: Sequence[WorkerCommand], *, grace: float,
               host_timeout: float, gpu_every: float) -> dict[str, Any]:
    """The spec that starts one host's ranks (``dlrun.remote.agent``'s protocol)."""
    return {
        "job_id": job_id,
        "tag": f"{job_id}:{host}",
        "eof_grace": min(grace, 2.0),
        "host_timeout": host_timeout,
        "gpu_every": gpu_every,
        "ranks": [{"rank": c.rank, "argv": list(c.argv), "env": dict(c.env), "cwd": c.cwd} for c in commands],
    }


class Supervisor:
    """Runs ``commands`` (already rendered) through ``transport`` and returns a RunResult."""

    def __init__(
        self,
        transport: Transport,
        commands: Sequence[WorkerCommand],
        view: View,
        *,
        log_dir: Path | None,
        grace: float = 10.0,
        pidns: bool = True,
        ends_job: Callable[[WorkerCommand], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
        stop_margin: float = STOP_MARGIN,
        agents: HostAgents | None = None,
        host_timeout: float | None = DEFAULT_HOST_TIMEOUT,
        gpu_every: float = 0.0,
        gpu_idle_after: float = 60.0,
        hang_timeout: float = 0.0,
        control_id: str | None = None,
    ) -> None:
        self.view = view
        self.log_dir = log_dir
        self.grace = grace
        # tf-ps: the chief's exit ends the job; by default every rank must finish
        self.ends_job = ends_job
        self.clock = clock
        self.stop_margin = stop_margin  # how long past grace an agent may take to report
        self.host_timeout = host_timeout or None  # 0 / None: no heartbeat
        self.ranks = {c.rank: _Rank(c) for c in commands}
        hosts = {c.host_name: c.spec.host for c in commands}
        if agents is None:
            agents = HostAgents(transport, tuple(hosts.values()), pidns=pidns, host_timeout=host_timeout)
        agents.assign([(c.spec.host, c.rank) for c in commands])  # agents started early: unused hosts end
        self.agents = agents
        self.links = agents.links
        self.events = agents.events
        self.stopping = False
        self.stop_deadline: float | None = None
        self.root_cause: int | None = None
        self.stopped_at: float | None = None  # wall clock when dlrun began stopping the ranks
        self.finished_before: tuple[tuple[int, str], ...] = ()  # ranks that exited 0 before the root cause
        self.raised_first: tuple[str, ...] = ()  # a running rank that raised before the root cause (lines)
        self.lost_host: str | None = None
        self.interrupted_by: int | None = None
        self.signals: list[int] = []  # interrupt()'s, handled before any queued event
        self.hurry = False  # a second Ctrl-C: output still queued goes to the log files only
        self._lock = threading.Lock()
        self.gpu_every = gpu_every  # seconds between each host's GPU samples (0: none)
        self.gpu_stats = GpuStats()
        # one sampler per machine: Spark tasks on one executor machine share its GPUs (and address)
        machines: dict[tuple[str, int | None], list[str]] = {}
        for name, host in hosts.items():
            machines.setdefault((host.address, host.port), []).append(name)
        self.gpu_hosts = {names[0] for names in machines.values()}
        self.gpu_idle = IdleWatch(gpu_idle_after, {
            names[0]: visible_gpus(c.env.get("CUDA_VISIBLE_DEVICES") for c in commands if c.host_name in names)
            for names in machines.values()})
        self.gpu_failed: set[str] = set()  # hosts whose sampling failure was reported
        self.gpu_csv: IO[str] | None = None
        self.stack_requests = StackRequests(transport, self.events, log_dir, clock)
        self.hang = HangWatch(hang_timeout, clock)
        self.hang_lines: tuple[str, ...] = ()  # the hang's root cause and groups, once it stopped the job
        self.hang_stop_at: float | None = None  # faulthandler dumps asked for: the stop waits for them
        self.recordings: dict[int, dict[str, Any]] = {}  # rank -> its flight recorder dump (stack_groups)
        self.dumped: set[int] = set()  # ranks whose dumps are in <log_dir>/flight-recorder/
        self.dump_came: set[int] = set()  # ranks whose agent sent a dump back, kept or not
        self.dumps_left: list[str] = []  # dumps too large to send back: where each stayed
        self.recorded_at: float | None = None  # when the hang asked for flight recorder dumps
        self.record_asked: set[int] = set()  # the ranks running then, with torch's dump pipe
        self.control = ControlServer(control_id or self._job_id(), self._control)  # dlrun stack JOB

    # --------------------------------------------------------------------- public
    def interrupt(self, signum: int) -> None:
        """Thread- and signal-safe: ask the job to stop (Ctrl-C / SIGTERM). The signal jumps the
        queue: behind a fast rank's output it would wait for every frame read before it."""
        self.signals.append(signum)
        self.events.put(Wake())

    def notify(self, text: str) -> None:
        """Thread- and signal-safe: show a notice between the job's lines."""
        self.events.put(Notice(text))

    def run(self) -> RunResult:
        """Supervise the ranks until the job ends, then show its summary (``view.finish``)."""
        result = self.supervise()
        self.view.finish(result)
        return result

    def supervise(self) -> RunResult:
        """Supervise the ranks until the job ends; the summary is the caller's to show (the
        launch pipeline shows it once the engine cleaned up, and once for all attempts)."""
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            for number, rank in self.ranks.items():
                rank.log = private_file(self.log_dir / f"rank-{number}.log")
        self.view.start([r.command for r in self.ranks.values()], self.log_dir)
        stop_beating = threading.Event()
        self.control.start()
        try:
            self._start_all()
            if self.host_timeout is not None:
                threading.Thread(target=self._heartbeat, args=(self.host_timeout, stop_beating),
                                 name="dlrun-heartbeat", daemon=True).start()
            self._loop()
        finally:
            self.control.close()
            stop_beating.set()
            self.agents.hang_up()
            for number, rank in self.ranks.items():
                if rank.log is not None:
                    with contextlib.suppress(OSError):
                        rank.log.close()
                if rank.unlogged:
                    self.view.notice(f"rank {number}'s log lacks {rank.unlogged} of its lines (they were shown"
                                     " here; the disk was full)")
            if self.gpu_csv is not None:
                self.gpu_csv.close()
        return self._result()

    # --------------------------------------------------------------------- start
    def _start_all(self) -> None:
        self.agents.start()  # the agents not started yet: now, in parallel
        for name, link in self.links.items():
            error = link.error if link.channel is None else self._send_spec(link)
            if error is not None:
                self._host_failed(name, error)

    def _send_spec(self, link: HostLink) -> str | None:
        assert link.channel is not None
        spec = agent_spec(self._job_id(), link.host.name, [self.ranks[r].command for r in link.ranks],
                          grace=self.grace, host_timeout=self.host_timeout or 0,
                          gpu_every=self.gpu_every if link.host.name in self.gpu_hosts else 0)
        try:
            link.channel.send(encode_message(spec))
        except DlrunError as exc:  # the agent is gone: what it said last is the reason
            code = link.channel.wait(2)
            return with_agent_words(str(exc.message), link.channel.stderr_text(), code)
        # the silence clock starts now: an agent started early (dlrun launch) waited quietly
        # through the preflight and the push, which may take longer than host_timeout
        self.agents.heard_now(link.host.name)
        return None

    def _job_id(self) -> str:
        first = next(iter(self.ranks.values()))
        return first.command.env.get("DLRUN_JOB_ID", "")

    # --------------------------------------------------------------------- heartbeat
    def _heartbeat(self, limit: float, stop: threading.Event) -> None:
        """Report a host that has sent nothing for ``limit`` seconds (``HostAgents.keep_alive``
        pings every agent)."""
        interval = heartbeat_interval(limit)
        self.agents.keep_alive(limit)
        while not stop.wait(interval):
            for name, seconds in self.agents.fell_silent(limit):
                self.events.put(Silent(name, seconds))

    # --------------------------------------------------------------------- loop
    def _loop(self) -> None:
        # an agent's DONE is its last word: no need to wait for its channel to close
        while not all(link.closed or link.done for link in self.links.values()):
            try:
                event = self.events.get(timeout=0.2)
            except queue.Empty:
                event = Tick()
            self._take_signals()
            self._handle(event)
            # drain what is queued before touching files and screen again (a bounded batch: a
            # rank that never stops printing must not keep the logs unflushed)
            for _ in range(1000):
                self._take_signals()
                try:
                    self._handle(self.events.get_nowait())
                except queue.Empty:
                    break
            for number, rank in self.ranks.items():
                self._log(number, rank, None, 0)
            self.view.flush()
            self._watch()
            if self.stop_deadline is not None and self.clock() > self.stop_deadline:
                # agents did not finish in time: drop the channels, their watchdogs kill all
                for link in self.links.values():
                    if link.channel is not None and not link.closed:
                        close_aside(link.channel)
                self.stop_deadline = self.clock() + 30

    def _take_signals(self) -> None:
        while self.signals:
            self._handle(Interrupt(self.signals.pop(0)))

    def _handle(self, event: Event) -> None:
        if isinstance(event, (Frames, Closed, Silent)) and event.host not in self.links:
            return  # an agent released before the start (its host is not in the plan)
        if isinstance(event, (Frames, Closed)) and self.links[event.host].silent:
            return  # declared lost already: what comes late changes nothing
        if isinstance(event, Frames):
            for frame_kind, rank, payload in event.frames:
                self._frame(event.host, frame_kind, rank, payload)
        elif isinstance(event, Closed):
            self._closed(event.host, event.code, event.stderr)
        elif isinstance(event, Silent):
            self._silent(event.host, event.seconds)
        elif isinstance(event, Notice):
            self.view.notice(event.text)
        elif isinstance(event, StacksAsked):  # dlrun stack JOB, through the control socket
            self._ask_stacks(event.hosts, event.reply)
        elif isinstance(event, StacksReady):  # py-spy is on the hosts
            for name, message in self.stack_requests.ready(event.request_id, event.sha256, event.notes):
                channel = self.links[name].channel
                try:
                    if channel is None:
                        raise DlrunError("it never started", host=name)
                    channel.send(encode_message(message))
                except DlrunError as exc:
                    self.stack_requests.unreachable(event.request_id, name, f"cannot ask the agent: {exc}")
        elif isinstance(event, Interrupt):
            signum = event.signum
            if self.interrupted_by is None:
                self.interrupted_by = signum
                self.view.notice(f"signal {signum}: stopping every rank (again to kill at once)")
                self._stop_all(self.grace)
            else:
                self.hurry = True  # what a fast rank wrote before may take long to draw: logs only
                self._stop_all(0, kill=True)

    def _frame(self, host: str, kind: int, rank_no: int, payload: bytes) -> None:
        if kind == agent.DONE:
            self.agents.finished(host)
            return
        if kind == agent.HELLO or kind == agent.PONG:
            return
        if kind == agent.GPU:
            self._gpu(host, payload)
            return
        if kind == agent.FILE:
            self._recording(host, payload)
            return
        if kind == agent.STACKS:
            with contextlib.suppress(ValueError, AttributeError):
                self.stack_requests.answer(host, json.loads(payload))
            return
        rank = self.ranks.get(rank_no)
        if rank is None:
            return
        if kind in (agent.STDOUT, agent.STDERR):
            self.hang.output()
            stream = "stdout" if kind == agent.STDOUT else "stderr"
            splitter = rank.splitters.setdefault(kind, LineSplitter())
            texts = splitter.feed(payload)
            if texts:  # a chunk's lines go to the tail, the file and the screen in one step each
                rank.tail.extend(texts[-TAIL_LINES:])
                joined = "\n".join(texts)
                self._log(rank_no, rank, joined, len(texts))
                if rank.traceback.wants(joined):  # a line at a time only there
                    before = rank.traceback.last
                    for text in texts:
                        rank.traceback.feed(text)
                    if rank.traceback.last is not before:
                        rank.raised_at = self.clock()
                else:
                    rank.traceback.skip(len(texts))
                if not self.hurry:
                    self.view.lines(rank_no, texts, stream)
        elif kind == agent.STARTED:
            rank.state = RankState.RUNNING
            rank.started = self.clock()
            self.view.state(rank_no, rank.state, None)
        elif kind == agent.ERROR:
            rank.error = payload.decode(errors="replace")
            self._line(rank_no, rank, f"dlrun: {rank.error}", "stderr")
        elif kind == agent.EXIT:
            info = json.loads(payload)
            code = int(info["code"])
            if info.get("error_file") is not None:
                rank.error_file = tuple(error_file_lines(info["error_file"]))
            for kind_, splitter in rank.splitters.items():
                for text in splitter.flush():
                    self._line(rank_no, rank, text, "stdout" if kind_ == agent.STDOUT else "stderr")
            self._exited(rank_no, rank, code, stopped=bool(info.get("stopped")))

    def _gpu(self, host: str, payload: bytes) -> None:
        """One GPU sample of ``host``: to gpu.csv, the stats, the idle watch and the view."""
        try:
            message = json.loads(payload)
        except ValueError:
            return
        if not isinstance(message, dict):
            return
        if "error" in message:
            if host not in self.gpu_failed:
                self.gpu_failed.add(host)
                self.view.notice(f"{host}: GPU sampling failed ({message['error']}); the job goes on")
            return
        samples = parse_sample(host, message)
        if not samples:
            return
        if self.gpu_csv is None and self.log_dir is not None:
            self.gpu_csv = private_file(self.log_dir / "gpu.csv")
            self.gpu_csv.write(",".join(GPU_CSV_COLUMNS) + "\n")
        if self.gpu_csv is not None:
            self.gpu_csv.write(csv_rows(samples))
            self.gpu_csv.flush()
        self.gpu_stats.add(samples)
        self.hang.gpu([s.util for s in samples])
        warning = self.gpu_idle.update(samples)
        if not self.hurry:
            self.view.gpus(host, samples)
            if warning is not None:
                self.view.notice(f"warning: {warning}")

    def _log(self, rank_no: int, rank: _Rank, text: str | None, lines: int) -> None:
        """``text`` (``lines`` lines) to the rank's log file, or (None) a flush. A full disk (or
        any write error) stops that file, not the job: its lines are counted and still shown,
        and the root cause still has them, as a keeper counts what it drops."""
        if rank.log is None:
            rank.unlogged += lines if self.log_dir is not None else 0
            return
        try:
            if text is None:
                rank.log.flush()
                rank.unflushed = 0
            else:
                rank.log.write(text + "\n")
                rank.unflushed += lines
        except OSError as exc:  # what the buffer held is lost too (a write that failed counts once)
            with contextlib.suppress(OSError):
                rank.log.close()
            rank.log = None
            rank.unlogged += rank.unflushed + (lines if text is not None else 0)
            rank.unflushed = 0
            self.view.notice(f"warning: rank {rank_no}'s log {self.log_dir}/rank-{rank_no}.log: {exc.strerror or exc};"
                             " its last lines and those from here on are shown only")

    def _line(self, rank_no: int, rank: _Rank, text: str, stream: str) -> None:
        rank.tail.append(text)
        before = rank.traceback.last
        rank.traceback.feed(text)
        if rank.traceback.last is not before:
            rank.raised_at = self.clock()
        self._log(rank_no, rank, text, 1)
        if not self.hurry:
            self.view.line(rank_no, text, stream)

    def _exited(self, rank_no: int, rank: _Rank, code: int, *, stopped: bool = False) -> None:
        """``stopped``: the agent had signalled the rank to stop before it exited (a rank that
        exits 0 on SIGTERM, as Lightning does, was stopped all the same)."""
        rank.exit_code = code
        rank.ended = self.clock()
        if rank.started is None:
            rank.started = rank.ended
        rank.state = rank_state(code, stopping=self.stopping, signalled=stopped)
        self.view.state(rank_no, rank.state, code)
        if self.stopping:
            return
        if code != 0:
            self.root_cause = rank_no
            self.raised_first = self._raised_first(rank_no, rank)
            self.finished_before = tuple((n, r.command.host_name) for n, r in sorted(self.ranks.items())
                                         if r.state == RankState.SUCCEEDED)
            self.view.notice(
                f"rank {rank_no} on {rank.command.host_name} exited with code {code}: stopping every rank"
            )
            self._stop_all(self.grace)
        elif self.ends_job is not None and self.ends_job(rank.command):
            self.view.notice(f"rank {rank_no} ({rank.command.spec.task_type}) finished: stopping the servers")
            self._stop_all(self.grace)

    def _raised_first(self, rank_no: int, rank: _Rank) -> tuple[str, ...]:
        """``rankpolicy.raised_first``: a rank still running that raised before this one failed."""
        mine = rank.raised_at if rank.traceback.final and rank.raised_at is not None else self.clock()
        raised = {n: (other.raised_at, other.command.host_name, other.traceback.last) for n, other in self.ranks.items()
                  if other.exit_code is None and other.raised_at is not None and other.traceback.final}
        return tuple(raised_first(raised, rank_no, mine))

    def _closed(self, host: str, code: int | None, stderr: str) -> None:
        link = self.agents.lost(host)
        missing = [r for r in link.ranks if self.ranks[r].exit_code is None]
        if self.stopping:  # ranks the agent never started: nothing was lost with the channel
            for rank_no in [r for r in missing if self.ranks[r].started is None]:
                self.ranks[rank_no].state = RankState.NOT_STARTED
                self.ranks[rank_no].ended = self.clock()
                self.view.state(rank_no, RankState.NOT_STARTED, None)
                missing.remove(rank_no)
        if not missing:
            return
        if link.channel is None:
            reason = "could not start"
        else:
            ended = "the host's agent ended before its ranks did"
            reason = link.channel.lost_reason() or (ended if code else "connection to the host was lost")
        self._host_failed(host, with_agent_words(reason, stderr, code))

    def _silent(self, host: str, seconds: float) -> None:
        link = self.links[host]
        if link.closed or link.done:
            return
        self._host_failed(host, f"no word from the host for {seconds:.0f} s (host timeout {self.host_timeout:g} s):"
                          " it is down, cut off from the network or frozen; its agent stops its ranks by"
                          " itself when it hears nothing either")
        if link.channel is not None:
            close_aside(link.channel)

    def _host_failed(self, host: str, message: str) -> None:
        link = self.agents.lost(host)
        self.view.notice(f"{host}: {message}")
        for rank_no in link.ranks:
            rank = self.ranks[rank_no]
            if rank.exit_code is not None:
                continue
            rank.exit_code = 255
            rank.error = message
            rank.ended = self.clock()
            if not self.stopping:
                rank.state = RankState.LOST
            else:
                rank.state = RankState.NOT_STARTED if rank.started is None else RankState.STOPPED
            self.view.state(rank_no, rank.state, 255)
            if not self.stopping and self.root_cause is None:
                self.root_cause = rank_no
                self.lost_host = host
        if not self.stopping:
            self._stop_all(self.grace)

    def _recording(self, host: str, payload: bytes) -> None:
        """A flight recorder dump a host sent back: to ``<log_dir>/flight-recorder/``, and read;
        or where one too large to send stayed."""
        from dlrun.remote.stack_groups import left_on_host, rank_of, read_dump  # few jobs send one

        if payload.startswith(b"\0"):  # not a dump: where one too large to send stayed
            left = left_on_host(payload, host)
            if left is not None:
                self.dump_came.add(left[0])
                self.dumps_left.append(left[1])
            return
        raw, _, data = payload.partition(b"\0")
        name = os.path.basename(raw.decode("utf-8", "replace")).strip(".") or "dump"
        if self.log_dir is not None:
            folder = self.log_dir / "flight-recorder"
            folder.mkdir(exist_ok=True)
            (folder / name).write_bytes(data)
        rank, dump = rank_of(name), read_dump(data)
        if rank is not None:
            self.dump_came.add(rank)
        if rank is not None and self.log_dir is not None:
            self.dumped.add(rank)
        if rank is not None and dump is not None:
            self.recordings[rank] = dump

    def _flight_lines(self) -> list[str]:
        """Which rank the dumps say is behind, and where the dumps are."""
        from dlrun.remote.stack_groups import lagging_lines, rank_list, silent_lines

        lines = lagging_lines(self.recordings) + silent_lines(sorted(self.record_asked), sorted(self.dump_came))
        lines += self.dumps_left
        if self.dumped and self.log_dir is not None:
            noun = "rank" if len(self.dumped) == 1 else "ranks"
            ranks = rank_list(sorted(self.dumped))
            lines.append(f"flight recorder dumps: {self.log_dir / 'flight-recorder'}/ ({noun} {ranks})")
        return lines

    # --------------------------------------------------------------------- stacks and hangs
    def _control(self, request: Any) -> dict[str, Any]:
        """The control socket's thread: a request, answered once the loop gathered the stacks."""
        if request.get("op") != "stacks":
            return {"error": f"unknown op {request.get('op')!r}"}
        answers: queue.Queue[StackAnswer] = queue.Queue(maxsize=1)
        self.events.put(StacksAsked(request.get("hosts"), answers.put))
        try:
            return answer_json(answers.get(timeout=240))
        except queue.Empty:
            return {"error": "the job's client gathered no stacks in time"}

    def _ask_stacks(self, only: Sequence[str] | None, reply: Callable[[StackAnswer], None]) -> None:
        running = {name: link for name, link in self.links.items()
                   if link.channel is not None and not link.closed and not link.done and (not only or name in only)}
        if not running:
            reply(StackAnswer((), None, {"*": "no host of the job runs ranks now"}))
            return
        # a rank that ended already (exit 0 early: a peer then waits for ever) is the clue, not "no stack"
        ended: dict[int, tuple[str, str]] = {}
        for name, link in running.items():
            for number in link.ranks:
                rank = self.ranks[number]
                if rank.exit_code is not None:
                    took = "" if rank.started is None or rank.ended is None else \
                        f" after {rank.ended - rank.started:.1f} s"
                    ended[number] = (name, f"it exited {rank.exit_code}{took}, before the stacks were asked")
        self.stack_requests.ask({n: link.host for n, link in running.items()},
                                {n: [r for r in link.ranks if r not in ended] for n, link in running.items()},
                                reply, ended)

    def _watch(self) -> None:
        """Each turn of the loop: overdue stack requests, and the hang watch."""
        self.stack_requests.tick()
        if self.hang_stop_at is not None and self.clock() >= self.hang_stop_at:
            self.hang_stop_at = None
            self._stop_all(self.grace)
        if self.stopping:
            return
        text = self.hang.notice()
        if text is not None:
            self.view.notice(text)
        if self.hang.hung():
            self.view.notice(f"no rank wrote anything for {self.hang.silence():.0f} s and no GPU was busy"
                             f" (--hang-timeout {self.hang.limit:g}): taking every rank's stack")
            self._ask_stacks(None, self._hung)

    def _hung(self, answer: StackAnswer) -> None:
        if self.stopping:
            return
        self.hang_lines = tuple(hang_lines(answer, self.hang.limit))
        for text in self.hang_lines:
            self.view.notice(text)
        unread = {r.rank for r in answer.stacks if not r.taken}
        for link in self.links.values():  # torch's flight recorder (NCCL) dumps through its pipe too
            if link.channel is not None and not link.closed:
                with contextlib.suppress(DlrunError):
                    link.channel.send(encode_message({"op": "record", "wait": RECORD_WAIT}))
        for name, link in self.links.items():  # faulthandler's dump instead (docs/stacks.md)
            mine = [r for r in link.ranks if r in unread and self.ranks[r].exit_code is None
                    and self.ranks[r].command.env.get("PYTHONFAULTHANDLER")]
            if mine and link.channel is not None and not link.closed:
                self.view.notice(f"{name}: SIGABRT to rank{'s' if len(mine) > 1 else ''} {mine}: faulthandler"
                                 " prints their stacks to their logs")
                with contextlib.suppress(DlrunError):
                    link.channel.send(encode_message({"op": "dump", "ranks": mine}))
        self.recorded_at = self.clock()
        self.record_asked = {n for n, rank in self.ranks.items() if rank.started is not None and rank.exit_code is None
                             and rank.command.env.get("TORCH_NCCL_DEBUG_INFO_PIPE_FILE")}
        self.view.notice("stopping every rank (--hang-timeout)")
        # a SIGTERM would cut the dumps short: stop once they are written
        self.stopping = True  # what ends now is stopped, not failed
        self.hang_stop_at = self.clock() + DUMP_WAIT

    def _stop_all(self, grace: float, *, kill: bool = False) -> None:
        self.stopping = True
        if self.stopped_at is None:
            self.stopped_at = time.time()
        message = encode_message({"op": "kill"} if kill else {"op": "stop", "grace": grace})
        for link in self.links.values():
            if link.channel is not None and not link.closed:
                try:
                    link.channel.send(message)
                except DlrunError:
                    pass
        deadline = self.clock() + grace + self.stop_margin
        if self.recorded_at is not None:  # an agent may hold this stop for the dumps up to RECORD_WAIT
            deadline = max(deadline, self.recorded_at + RECORD_WAIT + grace + self.stop_margin)
        self.stop_deadline = deadline if self.stop_deadline is None else min(self.stop_deadline, deadline)

    # --------------------------------------------------------------------- result
    def _result(self) -> RunResult:
        results = []
        for number, rank in sorted(self.ranks.items()):
            duration = None
            if rank.started is not None and rank.ended is not None:
                duration = rank.ended - rank.started
            state = rank.state
            if state == RankState.PENDING and self.stopping:
                state = RankState.NOT_STARTED
            elif state in (RankState.PENDING, RankState.RUNNING):
                state = RankState.STOPPED if self.stopping else RankState.LOST
            results.append(
                RankResult(
                    rank=number,
                    host=rank.command.host_name,
                    state=state,
                    exit_code=rank.exit_code,
                    duration=duration,
                    tail=tuple(cut(text, TAIL_CHARS) for text in rank.tail),
                    error=rank.error,
                    exception=rank.traceback.last,
                    exception_final=rank.traceback.final,
                    error_file=rank.error_file,
                )
            )
        root = None
        if self.root_cause is not None:
            root = results[self.root_cause]
            hint = early_exit_hint(root.rank, [*root.exception, *root.error_file, *root.tail], self.finished_before)
            root = results[self.root_cause] = replace(root, hint=tuple(hint))
        enders = None
        if self.ends_job is not None:  # tf-ps: the job's end was decided by the ranks that end it
            enders = [r.exit_code for r, c in zip(results, self.ranks.values(), strict=True)
                      if self.ends_job(c.command)]
        exit_code = job_exit_code(None if root is None else root.exit_code, self.interrupted_by,
                                  [r.exit_code for r in results], enders)
        if root is None and self.hang_lines:  # --hang-timeout stopped it: its own exit code
            exit_code = HANG_EXIT
        return RunResult(
            ranks=tuple(results),
            exit_code=exit_code,
            root_cause=root,
            interrupted_by=self.interrupted_by,
            stopped_at=self.stopped_at,
            log_dir=self.log_dir,
            commands=tuple(r.command for r in self.ranks.values()),
            job_id=self._job_id(),
            gpu_summary=tuple(self.gpu_stats.summary()),
            gpu_warnings=tuple(self.gpu_idle.warned.values()),
            hang=self.hang_lines,
            flight_recorder=tuple(self._flight_lines()) if exit_code else (),
            raised_first=self.raised_first if root is not None else (),
        )
