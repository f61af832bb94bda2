"""The job's GPUs while it runs: samples from each host's agent, the ``gpu.csv`` record, the
plain status line, idle-GPU warnings and the per-GPU summary. Pure: no I/O, no clock.

A sample is what ``nvidia-smi --query-gpu=<dlrun.remote.agent.GPU_QUERY>`` printed on a host.
A GPU the job's ranks can see (their ``CUDA_VISIBLE_DEVICES``) that stays idle while another
GPU of the same host is busy is the commonest silent waste in multi-GPU training; ``IdleWatch``
names it once per host, with its likely cause.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dlrun.remote.rankpolicy import GPU_CSV_COLUMNS

CSV_COLUMNS = GPU_CSV_COLUMNS  # gpu.csv's: the detached keeper writes the same

IDLE_UTIL = 5.0  # % below which a GPU computes nothing
IDLE_MEM = 0.05  # share of its memory below which a GPU holds nothing
BUSY_UTIL = 50.0
PLAIN_EVERY = 30.0  # seconds between a host's plain GPU lines


@dataclass(frozen=True)
class GpuSample:
    """One GPU at one moment (``None``: nvidia-smi could not say)."""

    time: float
    host: str
    index: int
    uuid: str
    util: float | None
    mem_used_mib: float | None
    mem_total_mib: float | None
    power_w: float | None
    temp_c: float | None

    @property
    def idle(self) -> bool:
        return (self.util is not None and self.util < IDLE_UTIL and self.mem_used_mib is not None
                and bool(self.mem_total_mib) and self.mem_used_mib < IDLE_MEM * (self.mem_total_mib or 0))

    @property
    def busy(self) -> bool:
        return self.util is not None and self.util > BUSY_UTIL


def _number(text: str) -> float | None:
    try:
        return float(text.strip())
    except ValueError:  # [N/A], [Not Supported]
        return None


def parse_sample(host: str, payload: Mapping[str, Any]) -> tuple[GpuSample, ...]:
    """The GPUs of one GPU frame (``{"time", "csv"}``); empty for an error or odd text."""
    text = payload.get("csv")
    if not isinstance(text, str):
        return ()
    when = float(payload.get("time", 0.0))
    samples = []
    for row in csv.reader(io.StringIO(text)):
        if len(row) < 7 or not row[0].strip().isdigit():
            continue
        samples.append(GpuSample(when, host, int(row[0]), row[1].strip(), *(_number(v) for v in row[2:7])))
    return tuple(samples)


def parse_csv(text: str) -> list[tuple[GpuSample, ...]]:
    """``gpu.csv`` lines (``csv_rows``; a header is skipped) back into samples, one tuple per
    host and moment, in the file's order (no uuid: the file has none)."""
    groups: dict[tuple[float, str], list[GpuSample]] = {}
    for row in csv.reader(io.StringIO(text)):
        if len(row) < 8 or not row[2].strip().isdigit():
            continue
        try:
            when = float(row[0])
        except ValueError:
            continue
        groups.setdefault((when, row[1]), []).append(
            GpuSample(when, row[1], int(row[2]), "", *(_number(v) for v in row[3:8])))
    return [tuple(samples) for samples in groups.values()]


def _cell(value: float | None) -> str:
    return "" if value is None else f"{value:g}"


def csv_rows(samples: Iterable[GpuSample]) -> str:
    """``gpu.csv`` lines (no header) for these samples."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for s in samples:
        writer.writerow([f"{s.time:.3f}", s.host, s.index, _cell(s.util), _cell(s.mem_used_mib),
                         _cell(s.mem_total_mib), _cell(s.power_w), _cell(s.temp_c)])
    return out.getvalue()


def _gib(mib: float | None) -> str:
    return "?" if mib is None else f"{mib / 1024:.1f}"


def plain_line(host: str, samples: Sequence[GpuSample]) -> str:
    """``gpu h1 util 98 97 99 0 % mem 71.2 70.8 70.9 0.0/80 GiB``."""
    util = " ".join("?" if s.util is None else f"{s.util:.0f}" for s in samples)
    mem = " ".join(_gib(s.mem_used_mib) for s in samples)
    totals = {s.mem_total_mib for s in samples if s.mem_total_mib}
    total = f"/{max(totals) / 1024:.0f}" if totals else ""
    return f"gpu {host} util {util} % mem {mem}{total} GiB"


def visible_gpus(cuda_visible_devices: Iterable[str | None]) -> frozenset[str] | None:
    """The devices a host's ranks may use (indices or UUIDs), from their CUDA_VISIBLE_DEVICES;
    None when a rank has no such variable (it sees every GPU)."""
    seen: set[str] = set()
    for value in cuda_visible_devices:
        if value is None:
            return None
        seen |= {part.strip() for part in value.split(",") if part.strip()}
    return frozenset(seen)


def _listed(indices: Sequence[int]) -> str:
    return ",".join(str(i) for i in sorted(indices))


@dataclass
class IdleWatch:
    """Per host: since when each visible GPU has been idle while another GPU was busy; one
    warning per host once that lasts ``after`` seconds."""

    after: float
    visible: Mapping[str, frozenset[str] | None] = field(default_factory=dict)
    _since: dict[tuple[str, int], float] = field(default_factory=dict)
    warned: dict[str, str] = field(default_factory=dict)  # host -> its warning

    def _counts(self, sample: GpuSample) -> bool:
        allowed = self.visible.get(sample.host)
        return allowed is None or str(sample.index) in allowed or sample.uuid in allowed

    def update(self, samples: Sequence[GpuSample]) -> str | None:
        """Feed one host's sample; the host's warning the first time it is due."""
        if not samples or self.after <= 0:
            return None
        host, now = samples[0].host, samples[0].time
        busy = [s.index for s in samples if s.busy]
        idle = [s for s in samples if s.idle and self._counts(s)] if busy else []
        idle_now = {s.index for s in idle}
        for key in [k for k in self._since if k[0] == host and k[1] not in idle_now]:
            del self._since[key]
        for s in idle:
            self._since.setdefault((host, s.index), now)
        due = sorted(i for i in idle_now if now - self._since[(host, i)] >= self.after)
        if not due or host in self.warned:
            return None
        lasted = min(now - self._since[(host, i)] for i in due)
        gpus = f"GPU {due[0]}" if len(due) == 1 else f"GPUs {_listed(due)}"
        verb = "is" if len(due) == 1 else "are"
        if len(busy) == 1:
            cause = f"do all ranks use cuda:{busy[0]}? Call torch.cuda.set_device(LOCAL_RANK)"
        else:
            cause = "do their ranks wait on data, or on a slower host? Check those ranks' logs"
        others = f"GPU {busy[0]} is" if len(busy) == 1 else f"GPUs {_listed(busy)} are"
        warning = f"{host}: {gpus} {verb} idle for {lasted:.0f} s while {others} busy: {cause}"
        self.warned[host] = warning
        return warning


@dataclass
class GpuStats:
    """Mean utilization and peak memory of every GPU over the job."""

    _util: dict[tuple[str, int], list[float]] = field(default_factory=dict)
    _peak: dict[tuple[str, int], float] = field(default_factory=dict)
    _total: dict[tuple[str, int], float] = field(default_factory=dict)

    def add(self, samples: Iterable[GpuSample]) -> None:
        for s in samples:
            key = (s.host, s.index)
            if s.util is not None:
                self._util.setdefault(key, []).append(s.util)
            if s.mem_used_mib is not None:
                self._peak[key] = max(self._peak.get(key, 0.0), s.mem_used_mib)
            if s.mem_total_mib:
                self._total[key] = s.mem_total_mib

    def summary(self) -> list[dict[str, Any]]:
        """One entry per GPU, host by host: ``{"host", "gpu", "mean_util", "peak_mem_gib", "mem_total_gib"}``."""
        keys = sorted(set(self._util) | set(self._peak), key=lambda k: (k[0], k[1]))
        rows = []
        for host, index in keys:
            utils = self._util.get((host, index), [])
            rows.append({"host": host, "gpu": index,
                         "mean_util": round(sum(utils) / len(utils), 1) if utils else None,
                         "peak_mem_gib": round(self._peak[(host, index)] / 1024, 1) if (host, index) in self._peak
                         else None,
                         "mem_total_gib": round(self._total[(host, index)] / 1024, 1) if (host, index) in self._total
                         else None})
        return rows

    def summary_lines(self) -> list[str]:
        """``gpu h1: util 97 0 0 0 % (mean) · memory 70.1 0.0 0.0 0.0/80 GiB (peak)`` per host."""
        return summary_lines(self.summary())


def summary_lines(summary: Iterable[Mapping[str, Any]]) -> list[str]:
    """``GpuStats.summary_lines`` from its ``summary()`` rows (a ``RunResult`` keeps only those)."""
    by_host: dict[str, list[Mapping[str, Any]]] = {}
    for row in summary:
        by_host.setdefault(row["host"], []).append(row)
    lines = []
    for host, rows in by_host.items():
        util = " ".join("?" if r["mean_util"] is None else f"{r['mean_util']:.0f}" for r in rows)
        peak = " ".join("?" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.1f}" for r in rows)
        totals = [r["mem_total_gib"] for r in rows if r["mem_total_gib"]]
        total = f"/{max(totals):.0f}" if totals else ""
        lines.append(f"gpu {host}: util {util} % (mean) · memory {peak}{total} GiB (peak)")
    return lines


BARS = "▁▂▃▄▅▆▇█"


def bar(util: float | None) -> str:
    """One character for a utilization: ``▁`` idle … ``█`` full, ``?`` unknown."""
    if util is None:
        return "?"
    return BARS[max(0, min(len(BARS) - 1, int(util / (100 / len(BARS)))))]


def live_cell(samples: Sequence[GpuSample]) -> str:
    """A host's GPUs in the live status table: ``0 █ 97% 70.0G  1 ▁ 0% 0.0G … /80 GiB``."""
    cells = []
    for s in samples:
        util = "?" if s.util is None else f"{s.util:.0f}"
        cells.append(f"{s.index} {bar(s.util)} {util}% {_gib(s.mem_used_mib)}G")
    totals = {s.mem_total_mib for s in samples if s.mem_total_mib}
    total = f"  /{max(totals) / 1024:.0f} GiB" if totals else ""
    return "  ".join(cells) + total


@dataclass
class PlainThrottle:
    """Whether a host's plain GPU line is due: its first sample, then one every ``every``
    seconds of that host's sample clock."""

    every: float = PLAIN_EVERY
    _shown: dict[str, float] = field(default_factory=dict)

    def due(self, samples: Sequence[GpuSample]) -> bool:
        if not samples:
            return False
        host, now = samples[0].host, samples[0].time
        last = self._shown.get(host)
        if last is not None and now - last < self.every:
            return False
        self._shown[host] = now
        return True
