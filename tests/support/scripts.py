"""Small training scripts that tests run as ranks (the same job in several test modules)."""

from __future__ import annotations

#: torch >= 2.2 prefixes every traceback line with ``[rank0]: `` once a process group exists; the
#: exception's message holds a 40×12 tensor, so the last 20 lines are all tensor rows.
TORCH_LABELS = """
import datetime, torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
if dist.get_rank() == 0:
    raise ValueError(f"labels out of range: {torch.randint(0, 100, (40, 12))}")
dist.barrier()
"""

#: rank 1 raises, but a non-daemon thread keeps it alive; rank 0 then times out waiting for it
RAISES_AND_LINGERS = """
import os, sys, threading, time
marker = os.path.join(os.environ["MARKS"], "raised")
if os.environ["DLRUN_RANK"] == "1":
    threading.Thread(target=time.sleep, args=(60,)).start()
    open(marker, "w").close()
    raise RuntimeError("CUDA error: an illegal memory access was encountered")
while not os.path.exists(marker):
    time.sleep(0.05)
time.sleep(1)
raise TimeoutError("Timed out waiting 1000ms for recv operation to complete")
"""
