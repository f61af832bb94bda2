"""A no-op NCCL job for launch timing: init the process group on cuda:LOCAL_RANK, one barrier, exit.

Run by scripts/gpu_smoke.sh under dlrun, torchrun and bare python (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set by hand); rank 0 prints the seconds from its start to the barrier's end.
"""

import os
import time

start = time.monotonic()
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

local = int(os.environ.get("LOCAL_RANK", "0"))
torch.cuda.set_device(local)
dist.init_process_group("nccl", device_id=torch.device("cuda", local))
dist.barrier()
torch.cuda.synchronize()
if dist.get_rank() == 0:
    print(f"noop: {dist.get_world_size()} rank(s), import+init+barrier {time.monotonic() - start:.2f} s", flush=True)
dist.destroy_process_group()
