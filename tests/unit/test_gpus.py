"""GPU samples: parsing, the csv record, the plain line, idle warnings and the summary."""

from __future__ import annotations

from dlrun.run.gpus import GpuStats, IdleWatch, csv_rows, parse_sample, plain_line, visible_gpus

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
