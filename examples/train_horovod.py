"""Train a small classifier on scikit-learn's digits with Horovod (PyTorch, gloo).

    dlrun launch --framework horovod examples/train_horovod.py --hosts h1:2,h2:2

dlrun gives every rank its HOROVOD_* environment and runs the gloo rendezvous itself, so no
horovodrun, no MPI and no ssh between workers are needed. Each rank trains on its own shard;
``hvd.DistributedOptimizer`` averages gradients; rank 0 prints the test accuracy. With CUDA,
each rank trains on GPU ``hvd.local_rank()`` (Horovod's own pattern); without it, on the CPU.
"""

from __future__ import annotations

import argparse

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
    args = parser.parse_args()

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
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    loss_fn = torch.nn.CrossEntropyLoss()
    print(f"rank {hvd.rank()}/{hvd.size()} local {hvd.local_rank()}/{hvd.local_size()} "
          f"cross {hvd.cross_rank()}/{hvd.cross_size()}: {len(x_shard)} rows")

    for epoch in range(args.epochs):
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

    with torch.no_grad():
        predicted = model(torch.from_numpy(x_test).to(device)).argmax(dim=1).cpu().numpy()
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    print(f"rank {hvd.rank()} parameter checksum {checksum:.6f}")
    if hvd.rank() == 0:
        print(f"test accuracy: {float(np.mean(predicted == y_test)):.4f}")


if __name__ == "__main__":
    main()
