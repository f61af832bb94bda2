"""The root cause of a failed job names what went wrong in the failed rank: the exception it
raised (even when other lines came after it), what torch's ``@record`` wrote, the signal that
killed it, and the warning dlrun gave before the start."""

from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path

import pytest

import dlrun
from dlrun.run.view import PlainView, root_cause_lines

from support.cli import run_dlrun
from support.mounts import tmpfs
from support.scripts import RAISES_AND_LINGERS


def root_cause_block(stdout: str) -> str:
    """From ``dlrun: root cause`` to the summary table."""
    start = stdout.index("dlrun: root cause:")
    return stdout[start:stdout.index("\nrank ", start)]


RAISES_AFTER_200_LINES = """
import atexit, os, sys
def cleanup():  # what comes after the traceback: more lines than the tail shows
    for i in range(30):
        print(f"cleanup line {i}", file=sys.stderr, flush=True)
if os.environ["DLRUN_RANK"] == "1":
    atexit.register(cleanup)
    for i in range(200):
        print(f"batch {i}: loss {1 / (i + 1):.4f}", flush=True)
    def load(batch):
        raise ValueError(f"bad batch {batch}: shape (3, 4) is not (3, 5)")
    load(200)
"""


def test_the_exception_is_shown_even_when_lines_followed_it(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(RAISES_AFTER_200_LINES)
    out = run_dlrun("launch", "--plain", "--framework", "none", "-n", "2", str(script), cwd=tmp_path, timeout=120)
    assert out.returncode == 1, out.stdout[-3000:]
    block = root_cause_block(out.stdout)
    assert "dlrun: root cause: rank 1 on host localhost exited with code 1" in block
    exception = block[block.index("exception (last frames of rank 1's traceback):"):block.index("last 20 lines")]
    assert "ValueError: bad batch 200: shape (3, 4) is not (3, 5)" in exception
    assert "in load" in exception and 'raise ValueError(f"bad batch' in exception
    assert "cleanup line 29" in block.split("last 20 lines", 1)[1]  # the tail as before




def test_a_rank_that_raised_first_and_lingers_is_named_beside_the_one_that_timed_out(tmp_path: Path) -> None:
    (tmp_path / "linger.py").write_text(RAISES_AND_LINGERS)
    out = run_dlrun("launch", "--plain", "--framework", "none", "-n", "2", "--grace", "1", "linger.py",
                    cwd=tmp_path, timeout=120, env={"MARKS": str(tmp_path)})
    assert out.returncode == 1, out.stdout[-3000:]
    block = root_cause_block(out.stdout)
    assert block.startswith("dlrun: root cause: rank 0 on host localhost exited with code 1"), block
    # before: only rank 0's TimeoutError; the rank it waited for was nowhere in the root cause
    assert re.search(r"\n  rank 1 on localhost raised first, \d+\.\d s before, and printed little since", block), block
    assert "  | RuntimeError: CUDA error: an illegal memory access was encountered" in block, block


CAUGHT_THEN_KILLED = """
import logging, os, signal
try:
    raise ConnectionError("transient: upload failed, retrying")
except ConnectionError:
    logging.exception("upload")
for step in range(30):
    print(f"step {step}", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_traceback_the_rank_went_on_from_is_not_called_what_it_died_of(tmp_path: Path) -> None:
    (tmp_path / "caught.py").write_text(CAUGHT_THEN_KILLED)
    out = run_dlrun("launch", "--plain", "--framework", "none", "-n", "1", "caught.py", cwd=tmp_path, timeout=120)
    assert out.returncode == 137, out.stdout[-3000:]
    block = root_cause_block(out.stdout)
    assert "an earlier traceback of rank 0 (many lines came after it: it may have been caught):" in block, block
    assert "exception (last frames" not in block and "  killed by SIGKILL (137)" in block, block


def test_a_huge_exception_message_keeps_its_end_and_the_root_cause_stays_small(tmp_path: Path) -> None:
    script = tmp_path / "huge.py"
    script.write_text('raise RuntimeError("shape mismatch: " + "x" * 2_000_000 + " END_OF_MESSAGE")\n')
    out = run_dlrun("launch", "--plain", "--framework", "none", "-n", "1", str(script), cwd=tmp_path, timeout=120)
    assert out.returncode == 1
    block = root_cause_block(out.stdout)
    assert len(block) < 20_000, len(block)  # before: 2 MB of it, in lines of 1 MiB
    exception = block[block.index("exception ("):block.index("\n  last ")]
    assert "RuntimeError: shape mismatch: xxx" in exception and "END_OF_MESSAGE" in exception


def test_a_rank_killed_by_a_signal_names_it(tmp_path: Path) -> None:
    script = tmp_path / "abort.py"
    script.write_text("import os\nprint('about to abort', flush=True)\nos.abort()\n")
    out = run_dlrun("launch", "--plain", "--framework", "none", "-n", "1", str(script), cwd=tmp_path, timeout=120)
    assert out.returncode == 134, out.stdout[-3000:]
    block = root_cause_block(out.stdout)
    assert "  killed by SIGABRT (134)" in block and "about to abort" in block
    assert "exception (" not in block


def test_a_segfault_leaves_the_ranks_python_stack_in_the_root_cause(tmp_path: Path) -> None:
    script = tmp_path / "segv.py"
    script.write_text("import os, signal\ndef decode_batch():\n    os.kill(os.getpid(), signal.SIGSEGV)\n"
                      "decode_batch()\n")
    out = run_dlrun("launch", "--plain", "--framework", "none", "-n", "1", str(script), cwd=tmp_path, timeout=120)
    assert out.returncode == 139, out.stdout[-3000:]
    block = root_cause_block(out.stdout)
    # before: "killed by SIGSEGV (139)" and nothing else (faulthandler was on under --hang-timeout only)
    assert "  killed by SIGSEGV (139)" in block and "Fatal Python error: Segmentation fault" in block, block
    assert 'File "' + str(script) + '", line 3 in decode_batch' in block, block


RECORDED = """
from torch.distributed.elastic.multiprocessing.errors import record

@record
def main() -> None:
    raise RuntimeError("CUDA out of memory on rank 0 (recorded)")

main()
"""


def test_the_error_file_that_record_wrote_is_shown(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    script = tmp_path / "recorded.py"
    script.write_text(RECORDED)
    out = run_dlrun("launch", "--plain", "-n", "1", str(script), cwd=tmp_path, timeout=180)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-2000:]
    assert out.stderr.startswith("dlrun: framework torch (import torch in recorded.py)")
    block = root_cause_block(out.stdout)
    recorded = block[block.index("error file (TORCHELASTIC_ERROR_FILE of rank 0):"):]
    assert "RuntimeError: CUDA out of memory on rank 0 (recorded)" in recorded.split("last ", 1)[0]
    assert "exception (" not in block  # the traceback says the same: shown once


def test_a_warning_given_before_the_start_is_repeated_in_the_root_cause(tmp_path: Path) -> None:
    pytest.importorskip("keras")
    from importlib.metadata import version

    if not version("keras").startswith("3."):
        pytest.skip("the warning is about Keras 3")
    script = tmp_path / "fit.py"
    script.write_text("def later():\n    import tensorflow\nraise SystemExit(3)\n")
    if "TF_USE_LEGACY_KERAS" in os.environ:
        pytest.skip("this environment opts in to legacy Keras already")
    out = run_dlrun("launch", "--plain", "-n", "1", str(script), cwd=tmp_path, timeout=120)
    assert out.returncode == 3, out.stdout[-2000:] + out.stderr[-2000:]
    assert "dlrun: warning: Keras" in out.stderr
    assert "  warning before the start: Keras" in root_cause_block(out.stdout)


def test_the_api_result_carries_the_exception(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(RAISES_AFTER_200_LINES)
    result = dlrun.launch(script, np=2, framework="none", job=dlrun.JobOptions(grace=2),
                          output=dlrun.OutputOptions(plain=True, log_dir=tmp_path / "logs"),
                          view=PlainView(io.StringIO()))
    assert result.root_cause is not None and result.root_cause.rank == 1
    assert result.root_cause.exception[-1] == "ValueError: bad batch 200: shape (3, 4) is not (3, 5)"
    assert any("ValueError: bad batch 200" in line for line in root_cause_lines(result, result.commands))


def test_the_root_cause_block_in_order() -> None:
    from dlrun.run.result import RankResult, RankState, RunResult

    root = RankResult(rank=1, host="h1", state=RankState.FAILED, exit_code=134, duration=1.0, tail=("last",),
                      exception=('  File "t.py", line 3, in f', "ValueError: x"),
                      error_file=('  File "t.py", line 3, in f', "RuntimeError: recorded"))
    lines = root_cause_lines(RunResult(ranks=(root,), exit_code=134, root_cause=root, warnings=("Keras 3",)), ())
    assert lines == [
        "dlrun: root cause: rank 1 on host h1 exited with code 134",
        "  error file (TORCHELASTIC_ERROR_FILE of rank 1):",  # what the rank recorded comes first
        '    |   File "t.py", line 3, in f',
        "    | RuntimeError: recorded",
        "  exception (last frames of rank 1's traceback):",
        '    |   File "t.py", line 3, in f',
        "    | ValueError: x",
        "  killed by SIGABRT (134)",
        "  warning before the start: Keras 3",
        "  last 1 line of rank 1:",
        "    | last",
    ]


# Attempt 0 plays another user of the host: it makes the restart's folder (/tmp/dlrun-<job>-r1, an
# easy name to guess) theirs and open to all, with the attempt's rank folder in it. Attempt 1's
# rank records its exception as torch's @record does.
PLANTED = """
import json, os, sys
planted = "/tmp/dlrun-" + os.environ["DLRUN_JOB_ID"] + "-r1"
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    os.makedirs(planted + "/attempt_1/0")
    for folder in (planted, planted + "/attempt_1", planted + "/attempt_1/0"):
        os.chown(folder, 65534, 65534)
        os.chmod(folder, 0o777)
    sys.exit(3)
path = os.environ["TORCHELASTIC_ERROR_FILE"]
print("error file:", path, flush=True)
with open(path, "w") as fh:
    json.dump({"message": {"message": "RuntimeError: secret-laden failure", "extraInfo": {"py_callstack": ""}}}, fh)
sys.exit(1)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="plays another user with chown")
def test_a_restarts_rank_files_stay_out_of_a_folder_another_user_made_first(tmp_path: Path) -> None:
    (tmp_path / "planted.py").write_text(PLANTED)
    out = run_dlrun("launch", "--plain", "--framework", "torch", "-n", "1", "--max-restarts", "1", "planted.py",
                    cwd=tmp_path, timeout=120)
    job = out.stdout.split("logs in dlrun-logs/", 1)[1].split("/", 1)[0]
    planted = Path(f"/tmp/dlrun-{job}-r1")
    try:
        assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-2000:]
        used = out.stdout.split("error file: ", 1)[1].split("\n", 1)[0]
        assert used.startswith(f"{planted}-") and used.endswith("/attempt_1/0/error.json"), used
        assert not (planted / "attempt_1" / "0" / "error.json").exists()  # they read nothing
        last = out.stdout[out.stdout.rindex("dlrun: root cause:"):]
        assert "RuntimeError: secret-laden failure" in root_cause_block(last)  # the evidence is whole
        assert not Path(used).parents[2].exists()  # the private folder went with the job
    finally:
        for folder in (planted / "attempt_1" / "0", planted / "attempt_1", planted):
            folder.rmdir()


FILLS_THE_LOG_DISK = """
import os, sys
for i in range(40000):
    print(f"step {i}: " + "x" * 60)
sys.stdout.flush()
if os.environ["DLRUN_RANK"] == "1":
    raise RuntimeError("out of patience at the end")
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs")
def test_a_full_disk_under_the_logs_loses_the_log_not_the_job_or_its_root_cause(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "small", "size=1m") as small:
        (tmp_path / "fill.py").write_text(FILLS_THE_LOG_DISK)
        out = run_dlrun("launch", "--plain", "--framework", "none", "-n", "2", "--log-dir", str(small), "fill.py",
                        cwd=tmp_path, timeout=180)
    # before: dlrun itself died with OSError: [Errno 28] (exit 1, no root cause, no summary)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert "No space left on device; its last lines and those from here on are shown only" in out.stdout, \
        out.stdout[-3000:]
    assert "RuntimeError: out of patience at the end" in root_cause_block(out.stdout)
    assert re.search(r"rank 1's log lacks \d+ of its lines", out.stdout), out.stdout[-3000:]


def test_result_json_tells_ci_a_ranks_own_exit_130_from_an_interrupt(tmp_path: Path) -> None:
    (tmp_path / "ki.py").write_text("raise KeyboardInterrupt\n")  # exits 130, as dlrun does on Ctrl-C
    out = run_dlrun("launch", "--plain", "--framework", "none", "-n", "1", "ki.py", cwd=tmp_path, timeout=120)
    assert out.returncode == 130, out.stdout[-2000:]
    logs = next((tmp_path / "dlrun-logs").iterdir())
    doc = json.loads((logs / "result.json").read_text())
    assert doc["outcome"] == "failed" and doc["exit_code"] == 130 and doc["attempts"] == 1
    assert doc["root_cause"] == {"rank": 0, "host": "localhost", "exit_code": 130, "signal": "SIGINT",
                                 "exception": "KeyboardInterrupt", "error": None}
    assert [(r["rank"], r["state"]) for r in doc["ranks"]] == [(0, "failed")]
