"""GPU smoke workload: DDP on NCCL over ``cuda:LOCAL_RANK``, synthetic data, prints img/s.

Started by ``scripts/gpu_smoke.sh`` under ``dlrun launch --framework torch`` and under
``torchrun`` alike; every rank first prints what CUDA needs from its process (its own
``/proc``, its visible GPUs).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import torch
import torch.distributed as dist


def model_for(name: str) -> torch.nn.Module:
    if name == "resnet50":
        try:
            import torchvision

            return torchvision.models.resnet50()
        except Exception:  # torchvision is optional: fall back to a plain CNN
            pass
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 64, 7, stride=2, padding=3), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(64, 128, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(), torch.nn.Linear(128, 1000))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--model", default="resnet50")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    facts = {"rank": os.environ.get("RANK"), "pid": os.getpid(), "proc_self": os.readlink("/proc/self"),
             "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
             "TORCHELASTIC_RUN_ID": os.environ.get("TORCHELASTIC_RUN_ID")}
    print("facts " + json.dumps(facts), flush=True)
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=120))
    device = torch.device("cuda", local_rank)
    model = torch.nn.parallel.DistributedDataParallel(model_for(args.model).to(device), device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(args.batch, 3, 224, 224, device=device)
    y = torch.randint(0, 1000, (args.batch,), device=device)
    loss_fn = torch.nn.CrossEntropyLoss()
    start = 0.0
    for step in range(args.steps):
        if step == 10:  # warm-up done
            torch.cuda.synchronize()
            start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    torch.cuda.synchronize()
    rate = torch.tensor([args.batch * (args.steps - 10) / (time.perf_counter() - start)], device=device)
    dist.all_reduce(rate)
    if dist.get_rank() == 0:
        print(f"ddp {torch.cuda.get_device_name(device)} world {dist.get_world_size()}: "
              f"{rate.item():.0f} img/s, loss {loss.item():.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
