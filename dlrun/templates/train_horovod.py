"""A Horovod (PyTorch, gloo) training script: `dlrun launch --framework horovod train.py --hosts hosts.toml`.

dlrun sets every rank's HOROVOD_* environment and runs the gloo rendezvous: no horovodrun, no
MPI. Replace the data and model with yours.
"""

import horovod.torch as hvd
import torch


def main() -> None:
    hvd.init()
    torch.manual_seed(hvd.rank())  # TODO: your data; each rank should read its own shard
    x = torch.randn(1024, 16)
    y = (x.sum(dim=1) > 0).long()
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01 * hvd.size())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    for epoch in range(3):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        average = hvd.allreduce(loss.detach(), name="loss")
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1}: loss {float(average):.4f}")


if __name__ == "__main__":
    main()
