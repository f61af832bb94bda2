"""Train a small classifier on scikit-learn's digits with PyTorch DistributedDataParallel.

    dlrun launch --framework torch examples/train_torch_ddp.py --hosts h1:2,h2:2

dlrun sets MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and
GROUP_RANK, exactly what torchrun would, so ``init_process_group`` reads them from the
environment. With CUDA, each rank trains on ``cuda:LOCAL_RANK`` over NCCL; without it, on the
CPU over gloo: the same file serves a laptop's CI and a GPU cluster. Every rank prints its loss,
and at the end a checksum of its parameters (identical on every rank when DDP kept them in
sync) and the test accuracy.

Resuming (``dlrun launch --max-restarts N``): after each epoch rank 0 saves a checkpoint (model,
optimizer, epoch) in its working directory. On a restart (``DLRUN_RESTART_COUNT`` > 0) rank 0
loads it and sends it to every rank (the other hosts need not have the file), and training goes
on from the next epoch. ``--crash-after E`` makes the first attempt fail after epoch E, to try it.
"""

from __future__ import annotations

import argparse
import datetime
import os
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--checkpoint", default="checkpoint-torch-ddp.pt", help="rank 0's, in its working directory")
    parser.add_argument("--crash-after", type=int, default=0, help="the first attempt fails after this epoch")
    args = parser.parse_args()
    restart = int(os.environ.get("DLRUN_RESTART_COUNT", "0"))

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    # torch's default collective timeout is 30 minutes; a dead peer should fail the job sooner
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int64")
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    data = TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler)

    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)).to(device),
        device_ids=[device.index] if cuda else None,
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = torch.nn.CrossEntropyLoss()
    print(f"rank {rank}/{world} (local {os.environ.get('LOCAL_RANK')}, host group {os.environ.get('GROUP_RANK')})"
          f" on {device}")
    start = 0
    if restart == 0 and rank == 0 and os.path.exists(args.checkpoint):
        os.remove(args.checkpoint)  # an earlier job's: this job starts from scratch
    elif restart > 0:
        saved = load_checkpoint(args.checkpoint, rank)
        if saved is not None:
            model.module.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            start = saved["epoch"]
        print(f"restart {restart}: " + (f"resuming after epoch {start}" if start else "no checkpoint, from scratch"))
    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        total, rows = 0.0, 0
        for xb, yb in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(xb.to(device)), yb.to(device))
            loss.backward()
            optimizer.step()
            total += loss.item() * len(xb)
            rows += len(xb)
        print(f"epoch {epoch + 1}/{args.epochs}: loss {total / rows:.4f}")
        if rank == 0:  # written aside, then renamed: a crash mid-write leaves the last one whole
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch + 1}
            torch.save(state, args.checkpoint + ".tmp")
            os.replace(args.checkpoint + ".tmp", args.checkpoint)
        if restart == 0 and epoch + 1 == args.crash_after:
            raise SystemExit(f"--crash-after {args.crash_after}: failing on purpose (rank {rank})")

    with torch.no_grad():
        predicted = model(torch.from_numpy(x_test).to(device)).argmax(dim=1).cpu().numpy()
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    print(f"rank {rank} parameter checksum {checksum:.6f}")
    print(f"test accuracy: {float(np.mean(predicted == y_test)):.4f}")
    # every rank done before any tears its group down: gloo can abort a rank ("terminate called
    # without an active exception") that destroys its group while a peer still uses it
    dist.barrier()
    dist.destroy_process_group()


def load_checkpoint(path: str, rank: int) -> dict[str, Any] | None:
    """Rank 0's checkpoint, read by rank 0 and broadcast to every rank (None: there is none)."""
    box: list[Any] = [torch.load(path, map_location="cpu") if rank == 0 and os.path.exists(path) else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


if __name__ == "__main__":
    main()
