"""How long torch's flight recorder takes to write a dump asked for through its pipe, as dlrun's
agent asks when ``--hang-timeout`` fires (``scripts/gpu_smoke.sh``, part ``trouble``).

One rank, an NCCL process group, N all-reduces (default 3000: the 2000-entry ring is full),
then one byte to ``TORCH_NCCL_DEBUG_INFO_PIPE_FILE<rank>.pipe``: prints when the pipe was there,
when the dump appeared and when its size held still, its size and its number of entries.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time

folder = tempfile.mkdtemp(prefix="dlrun-fr-")
with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
os.environ.update({"TORCH_FR_DUMP_TEMP_FILE": f"{folder}/trace_rank_",
                   "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": f"{folder}/pipe_rank_", "TORCH_FR_BUFFER_SIZE": "2000",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dlrun.remote.stack_groups import read_dump  # noqa: E402

count = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
torch.cuda.set_device(0)
dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
t = torch.ones(1024, device="cuda")
for _ in range(count):
    dist.all_reduce(t)
torch.cuda.synchronize()
start = time.monotonic()
pipe, dump = f"{folder}/pipe_rank_0.pipe", f"{folder}/trace_rank_0"
while not os.path.exists(pipe) and time.monotonic() - start < 30:
    time.sleep(0.01)
piped = time.monotonic() - start
fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
os.write(fd, b"1")
os.close(fd)
asked = time.monotonic()
appeared = done = None
size, since = -1, asked
while time.monotonic() - asked < 60:
    now = time.monotonic()
    current = os.path.getsize(dump) if os.path.exists(dump) else -1
    if current >= 0 and appeared is None:
        appeared = now - asked
    if current != size:
        size, since = current, now
    elif size > 0 and now - since >= 0.5:
        done = since - asked
        break
    time.sleep(0.01)
entries = 0
if size > 0:
    with open(dump, "rb") as fh:
        entries = len((read_dump(fh.read()) or {}).get("entries") or [])
shown = {name: "never" if value is None else f"{value:.2f} s"
         for name, value in (("appeared", appeared), ("done", done))}
print(f"fr-dump: {count} all-reduces; pipe there after {piped:.2f} s; dump appeared after {shown['appeared']},"
      f" complete after {shown['done']}; {size} bytes, {entries} entries", flush=True)
dist.destroy_process_group()
