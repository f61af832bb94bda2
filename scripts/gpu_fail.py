"""GPU smoke workload for a rank that fails on the GPU (``scripts/gpu_smoke.sh``, part ``trouble``).

``assert``: an index out of range on the GPU, a device-side assert that surfaces at the next
synchronize as ``CUDA error: device-side assert triggered``. ``oom``: an allocation of 1 TiB,
``torch.OutOfMemoryError``. dlrun's root cause must name each exception, as torchrun's would.
"""

from __future__ import annotations

import os
import sys

import torch


def out_of_range_index() -> None:
    table = torch.zeros(4, device="cuda")
    index = torch.tensor([10], device="cuda")
    print("picked", table[index].sum().item())


def out_of_memory() -> None:
    block = torch.empty(1 << 40, dtype=torch.uint8, device="cuda")
    print("allocated", block.numel())


def main() -> None:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.ones(1, device="cuda").sum().item()  # the CUDA context exists
    print("ready", flush=True)
    {"assert": out_of_range_index, "oom": out_of_memory}[sys.argv[1]]()


if __name__ == "__main__":
    main()
