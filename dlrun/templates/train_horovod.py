"""A Horovod (PyTorch, gloo) training script: `dlrun launch --framework horovod train.py --hosts hosts.toml`.

dlrun sets every rank's HOROVOD_* environment and runs the gloo rendezvous: no horovodrun, no
MPI. With CUDA each rank uses GPU hvd.local_rank(), else the CPU. Replace the data and model.
"""

import horovod.torch as hvd
import torch


def main() -> None:
    hvd.init()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(hvd.local_rank())
    device = torch.device("cuda", hvd.local_rank()) if cuda else torch.device("cpu")
    torch.manual_seed(hvd.rank())  # TODO: your data; each rank should read its own shard
    x = torch.randn(1024, 16, device=device)
    y = (x.sum(dim=1) > 0).long()
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2)).to(device)
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
