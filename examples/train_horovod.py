"""Train a small classifier on scikit-learn's digits with Horovod (PyTorch, gloo).

    dlrun launch --framework horovod examples/train_horovod.py --hosts h1:2,h2:2

dlrun gives every rank its HOROVOD_* environment and runs the gloo rendezvous itself, so no
horovodrun, no MPI and no ssh between workers are needed. Each rank trains on its own shard;
``hvd.DistributedOptimizer`` averages gradients; rank 0 prints the test accuracy. With CUDA,
each rank trains on GPU ``hvd.local_rank()`` (Horovod's own pattern); without it, on the CPU.

Resuming (``dlrun launch --max-restarts N``): after each epoch rank 0 saves a checkpoint (model,
optimizer, epoch) in its working directory. On a restart (``DLRUN_RESTART_COUNT`` > 0) rank 0
loads it and ``hvd.broadcast_object`` sends it to every rank, so the other hosts need not have
the file. ``--crash-after E`` makes the first attempt fail after epoch E, to try it.
"""

from __future__ import annotations

import argparse
import os

import horovod.torch as hvd
import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--checkpoint", default="checkpoint-horovod.pt", help="rank 0's, in its working directory")
    parser.add_argument("--crash-after", type=int, default=0, help="the first attempt fails after this epoch")
    args = parser.parse_args()
    restart = int(os.environ.get("DLRUN_RESTART_COUNT", "0"))

    hvd.init()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(hvd.local_rank())
    device = torch.device("cuda", hvd.local_rank()) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int64")
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    # this rank's shard of the training set
    x_shard = torch.from_numpy(x_train[hvd.rank() :: hvd.size()]).to(device)
    y_shard = torch.from_numpy(y_train[hvd.rank() :: hvd.size()]).to(device)

    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * hvd.size())
    first = 0
    if restart == 0 and hvd.rank() == 0 and os.path.exists(args.checkpoint):
        os.remove(args.checkpoint)  # an earlier job's: this job starts from scratch
    elif restart > 0:
        saved = torch.load(args.checkpoint, map_location="cpu") if hvd.rank() == 0 and os.path.exists(
            args.checkpoint) else None
        # the same name on every rank: Horovod matches collectives by name, and its default is the
        # object's type (dict on rank 0, NoneType elsewhere), which never matches
        saved = hvd.broadcast_object(saved, root_rank=0, name="checkpoint")
        if saved is not None:
            model.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            first = saved["epoch"]
        print(f"restart {restart}: " + (f"resuming after epoch {first}" if first else "no checkpoint, from scratch"))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    loss_fn = torch.nn.CrossEntropyLoss()
    print(f"rank {hvd.rank()}/{hvd.size()} local {hvd.local_rank()}/{hvd.local_size()} "
          f"cross {hvd.cross_rank()}/{hvd.cross_size()}: {len(x_shard)} rows")

    for epoch in range(first, args.epochs):
        order = torch.randperm(len(x_shard), generator=torch.Generator().manual_seed(epoch))
        total = 0.0
        for start in range(0, len(order), args.batch):
            idx = order[start : start + args.batch].to(device)
            optimizer.zero_grad()
            loss = loss_fn(model(x_shard[idx]), y_shard[idx])
            loss.backward()
            optimizer.step()
            total += loss.item() * len(idx)
        mean = hvd.allreduce(torch.tensor(total / len(x_shard), device=device), name="epoch_loss")
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1}/{args.epochs}: loss {float(mean):.4f}")
            # written aside, then renamed: a crash mid-write leaves the last one whole
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch + 1}
            torch.save(state, args.checkpoint + ".tmp")
            os.replace(args.checkpoint + ".tmp", args.checkpoint)
        if restart == 0 and epoch + 1 == args.crash_after:
            raise SystemExit(f"--crash-after {args.crash_after}: failing on purpose (rank {hvd.rank()})")

    with torch.no_grad():
        predicted = model(torch.from_numpy(x_test).to(device)).argmax(dim=1).cpu().numpy()
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    print(f"rank {hvd.rank()} parameter checksum {checksum:.6f}")
    if hvd.rank() == 0:
        print(f"test accuracy: {float(np.mean(predicted == y_test)):.4f}")


if __name__ == "__main__":
    main()
