"""A stub ``nvidia-smi`` that notes each call's time and reports 4 GPUs (GPU 0 busy, 1-3 idle), and a
rank that waits for the stub's calls rather than on a clock."""

from __future__ import annotations

from pathlib import Path

FOUR_GPUS = ("0, GPU-a, 97, 71680, 81559, 650.5, 71\n"
             "1, GPU-b, 0, 4, 81559, 70.1, 30\n"
             "2, GPU-c, 0, 4, 81559, 69.8, 31\n"
             "3, GPU-d, 0, 4, 81559, [N/A], 30\n")

#: a rank that ends once the stub was called over ``span`` seconds (its calls' wall times), or
#: ``calls`` times; it exits with ``code``
WAIT_FOR_SAMPLES = """
import sys, time
calls_file, span, calls, code = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
for _ in range(1200):
    try:
        times = [float(t) for t in open(calls_file).read().split()]
    except (OSError, ValueError):
        times = []
    if len(times) >= calls and (times[-1] - times[0] if times else 0) >= span:
        break
    time.sleep(0.1)
print("samples taken", len(times), flush=True)
sys.exit(code)
"""


def stub(folder: Path, calls: Path, body: str) -> Path:
    """``folder/nvidia-smi``: notes each call's time in ``calls``, then runs ``body`` (sh)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "nvidia-smi"
    path.write_text(f"#!/bin/sh\ndate +%s.%N >> {calls}\n{body}\n")
    path.chmod(0o755)
    return folder


def printing(text: str) -> str:
    return f"printf '%s' '{text}'"
