"""GPU smoke workload for ``dlrun stack`` and ``--hang-timeout`` (``scripts/gpu_smoke.sh``).

``cuda``: the rank is stuck in a CUDA op (a kernel that spins for years, then a synchronize):
the GPU is busy, so ``--hang-timeout`` must not fire, and ``dlrun stack`` must show
``stuck_in_cuda_op``. ``cpu``: the rank holds its GPU but waits in ``stuck_in_data_loading``
with the GPU idle: ``--hang-timeout`` stops it with exit code 124. ``nccl``: the rank joins an
NCCL process group and runs one all-reduce (NCCL's RAS then knows the communicator), then waits
in ``stuck_in_data_loading``: ``dlrun stack`` must add NCCL RAS's line.
"""

from __future__ import annotations

import os
import sys
import time

import torch


def stuck_in_cuda_op() -> None:
    torch.cuda._sleep(1 << 62)  # spins the GPU for ~1e19 cycles
    torch.cuda.synchronize()


def stuck_in_data_loading() -> None:
    while True:
        time.sleep(1)


def main() -> None:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.ones(1, device="cuda").sum().item()  # the CUDA context exists
    if sys.argv[1:] == ["nccl"]:
        import torch.distributed as dist

        dist.init_process_group("nccl")
        dist.all_reduce(torch.ones(1, device="cuda"))
        torch.cuda.synchronize()
    print("ready", flush=True)
    if sys.argv[1:] == ["cuda"]:
        stuck_in_cuda_op()
    else:
        stuck_in_data_loading()


if __name__ == "__main__":
    main()
