"""GPU samples: parsing, the csv record, the plain line, idle warnings and the summary."""

from __future__ import annotations

import io

from rich.console import Console

from dlrun.inventory import parse_inline
from dlrun.plan import make_plan
from dlrun.render import WorkerCommand, worker_commands
from dlrun.run.gpus import (
    GpuStats,
    IdleWatch,
    PlainThrottle,
    bar,
    csv_rows,
    live_cell,
    parse_sample,
    plain_line,
    summary_lines,
    visible_gpus,
)
from dlrun.run.live import LiveView
from dlrun.run.result import RankResult, RankState, RunResult
from dlrun.run.view import PlainView, gpu_summary_lines

BUSY_ON_0 = ("0, GPU-a, 97, 71680, 81559, 650.5, 71\n"
             "1, GPU-b, 0, 4, 81559, 70.1, 30\n"
             "2, GPU-c, 0, 4, 81559, 69.8, 31\n"
             "3, GPU-d, 0, 4, 81559, [N/A], 30\n")


def test_a_sample_parses_and_becomes_csv_rows_and_a_plain_line() -> None:
    samples = parse_sample("h1", {"time": 100.0, "csv": BUSY_ON_0})
    assert [s.index for s in samples] == [0, 1, 2, 3] and samples[3].power_w is None
    assert csv_rows(samples[:2]) == ("100.000,h1,0,97,71680,81559,650.5,71\n"
                                     "100.000,h1,1,0,4,81559,70.1,30\n")
    assert plain_line("h1", samples) == "gpu h1 util 97 0 0 0 % mem 70.0 0.0 0.0 0.0/80 GiB"


def test_errors_and_odd_text_give_no_samples() -> None:
    assert parse_sample("h", {"time": 1, "error": "nvidia-smi exited 9"}) == ()
    assert parse_sample("h", {"time": 1, "csv": "No devices were found\n"}) == ()


def test_idle_gpus_beside_a_busy_one_are_named_once_after_the_delay() -> None:
    watch = IdleWatch(after=10)
    assert watch.update(parse_sample("h1", {"time": 100.0, "csv": BUSY_ON_0})) is None
    assert watch.update(parse_sample("h1", {"time": 105.0, "csv": BUSY_ON_0})) is None
    warning = watch.update(parse_sample("h1", {"time": 110.0, "csv": BUSY_ON_0}))
    assert warning == ("h1: GPUs 1,2,3 are idle for 10 s while GPU 0 is busy: do all ranks use cuda:0? "
                       "Call torch.cuda.set_device(LOCAL_RANK)")
    assert watch.update(parse_sample("h1", {"time": 130.0, "csv": BUSY_ON_0})) is None  # once per host


def test_only_gpus_the_job_can_see_count_and_a_busy_spell_resets_the_clock() -> None:
    watch = IdleWatch(after=10, visible={"h1": visible_gpus(["GPU-a,GPU-b"])})
    watch.update(parse_sample("h1", {"time": 0.0, "csv": BUSY_ON_0}))
    warning = watch.update(parse_sample("h1", {"time": 10.0, "csv": BUSY_ON_0}))
    assert warning is not None and warning.startswith("h1: GPU 1 is idle for 10 s")
    other = IdleWatch(after=10)
    other.update(parse_sample("h2", {"time": 0.0, "csv": BUSY_ON_0}))
    all_busy = BUSY_ON_0.replace(", 0, 4,", ", 90, 60000,")
    other.update(parse_sample("h2", {"time": 5.0, "csv": all_busy}))
    assert other.update(parse_sample("h2", {"time": 12.0, "csv": BUSY_ON_0})) is None


def test_no_busy_gpu_no_warning_and_no_visibility_means_every_gpu() -> None:
    idle = BUSY_ON_0.replace("0, GPU-a, 97,", "0, GPU-a, 0,")
    watch = IdleWatch(after=1)
    for t in range(5):
        assert watch.update(parse_sample("h", {"time": float(t), "csv": idle})) is None
    assert visible_gpus(["0", None]) is None and visible_gpus(["0,1", "2"]) == frozenset({"0", "1", "2"})


def test_summary_has_each_gpus_mean_utilization_and_peak_memory() -> None:
    stats = GpuStats()
    stats.add(parse_sample("h1", {"time": 0.0, "csv": BUSY_ON_0}))
    stats.add(parse_sample("h1", {"time": 2.0, "csv": BUSY_ON_0.replace("97, 71680", "95, 72704")}))
    rows = stats.summary()
    assert rows[0] == {"host": "h1", "gpu": 0, "mean_util": 96.0, "peak_mem_gib": 71.0, "mem_total_gib": 79.6}
    assert stats.summary_lines() == ["gpu h1: util 96 0 0 0 % (mean) · memory 71.0 0.0 0.0 0.0/80 GiB (peak)"]


def test_the_summary_lines_come_from_the_rows_a_result_keeps() -> None:
    stats = GpuStats()
    stats.add(parse_sample("h1", {"time": 0.0, "csv": BUSY_ON_0}))
    stats.add(parse_sample("h2", {"time": 0.0, "csv": "0, GPU-z, 40, [N/A], [N/A], [N/A], [N/A]\n"}))
    assert summary_lines(stats.summary()) == stats.summary_lines() == [
        "gpu h1: util 97 0 0 0 % (mean) · memory 70.0 0.0 0.0 0.0/80 GiB (peak)",
        "gpu h2: util 40 % (mean) · memory ? GiB (peak)"]
    assert summary_lines([]) == []


def test_a_utilization_bar_and_the_live_table_cell() -> None:
    assert [bar(u) for u in (0, 12.4, 12.5, 50, 97, 100, 130, None)] == ["▁", "▁", "▂", "▅", "█", "█", "█", "?"]
    samples = parse_sample("h1", {"time": 0.0, "csv": BUSY_ON_0})
    assert live_cell(samples) == "0 █ 97% 70.0G  1 ▁ 0% 0.0G  2 ▁ 0% 0.0G  3 ▁ 0% 0.0G  /80 GiB"
    unknown = parse_sample("h1", {"time": 0.0, "csv": "0, GPU-z, [N/A], [N/A], [N/A], [N/A], [N/A]\n"})
    assert live_cell(unknown) == "0 ? ?% ?G"


def test_a_hosts_plain_line_is_due_at_its_first_sample_then_every_30_s_of_its_clock() -> None:
    throttle = PlainThrottle()
    at = {t: parse_sample(h, {"time": t, "csv": BUSY_ON_0}) for h in ("h1",) for t in (100.0, 110.0, 129.9, 130.0)}
    assert [throttle.due(at[t]) for t in (100.0, 110.0, 129.9, 130.0)] == [True, False, False, True]
    assert throttle.due(parse_sample("h2", {"time": 111.0, "csv": BUSY_ON_0}))  # each host on its own
    assert not throttle.due(())


def _commands() -> tuple[WorkerCommand, ...]:
    plan = make_plan(parse_inline("h1:1"), job_id="j")
    return worker_commands(plan, "train.py", [], python_for={"h1": ["python3"]})


WARNING = ("h1: GPUs 1,2,3 are idle for 60 s while GPU 0 is busy: do all ranks use cuda:0? "
           "Call torch.cuda.set_device(LOCAL_RANK)")
DONE = RunResult(ranks=(RankResult(0, "h1", RankState.SUCCEEDED, 0, 61.0),), exit_code=0,
                 gpu_summary=({"host": "h1", "gpu": 0, "mean_util": 97.0, "peak_mem_gib": 70.0, "mem_total_gib": 79.6},
                              {"host": "h1", "gpu": 1, "mean_util": 0.0, "peak_mem_gib": 0.0, "mem_total_gib": 79.6}),
                 gpu_warnings=(WARNING,))


def test_the_plain_view_shows_gpu_lines_and_the_summary_repeats_the_warning() -> None:
    out = io.StringIO()
    view = PlainView(out, ranks=[])  # --ranks hides ranks' lines, not the GPUs
    view.start(_commands(), None)
    for t in (0.0, 2.0, 30.0):
        view.gpus("h1", parse_sample("h1", {"time": t, "csv": BUSY_ON_0}))
    view.finish(DONE)
    lines = out.getvalue().splitlines()
    assert lines[1:3] == ["dlrun: gpu h1 util 97 0 0 0 % mem 70.0 0.0 0.0 0.0/80 GiB"] * 2
    assert gpu_summary_lines(DONE) == ["gpu h1: util 97 0 % (mean) · memory 70.0 0.0/80 GiB (peak)",
                                       f"dlrun: warning: {WARNING}"]
    assert lines[-5:] == ["rank  host  exit  state        duration", "   0  h1       0  succeeded    1m01s",
                          *gpu_summary_lines(DONE), "dlrun: all 1 ranks succeeded; exit code 0"]


def test_the_live_table_has_a_line_per_host_with_its_gpus() -> None:
    out = io.StringIO()
    console = Console(file=out, width=120, color_system=None)
    view = LiveView(console)
    view.start(_commands(), None)
    view.gpus("h1", parse_sample("h1", {"time": 0.0, "csv": BUSY_ON_0}))
    with console.capture() as cap:
        console.print(view.status_table())
    view.finish(DONE)
    table = cap.get().splitlines()
    assert table[2].split()[:2] == ["gpu", "h1"]
    assert table[2].rstrip().endswith("  0 █ 97% 70.0G  1 ▁ 0% 0.0G  2 ▁ 0% 0.0G  3 ▁ 0% 0.0G  /80 GiB")
    shown = " ".join(out.getvalue().split())
    assert f"dlrun: warning: {WARNING}" in shown and "gpu h1: util 97 0 % (mean)" in shown


def test_gpu_csv_reads_back_into_samples_per_host_and_moment() -> None:
    """attach (a detached job) feeds the view from the hosts' gpu.csv: what csv_rows wrote."""
    from dlrun.run.gpus import CSV_COLUMNS, csv_rows, parse_csv, parse_sample

    rows = "0, GPU-a, 97, 71680, 81559, [N/A], 71\n1, GPU-b, 0, 3, 81559, 60, 30\n"
    first = parse_sample("h1", {"time": 1.5, "csv": rows})
    second = parse_sample("h2", {"time": 1.5, "csv": "0, GPU-c, 50, 100, 81559, 200, 40\n"})
    text = ",".join(CSV_COLUMNS) + "\n" + csv_rows(first) + csv_rows(second)
    back = parse_csv(text)
    assert [[(s.host, s.index, s.util, s.mem_used_mib, s.power_w, s.temp_c) for s in group] for group in back] == [
        [("h1", 0, 97.0, 71680.0, None, 71.0), ("h1", 1, 0.0, 3.0, 60.0, 30.0)], [("h2", 0, 50.0, 100.0, 200.0, 40.0)]]
