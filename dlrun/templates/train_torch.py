"""A PyTorch DDP training script: `dlrun launch --framework torch train.py --hosts hosts.toml`.

dlrun sets MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and the
rest of torchrun's contract. With CUDA each rank uses cuda:LOCAL_RANK over NCCL, else the CPU.
"""

import datetime
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(minutes=2))
    torch.manual_seed(dist.get_rank())  # TODO: your data; DistributedSampler shards a Dataset
    x = torch.randn(1024, 16, device=device)
    y = (x.sum(dim=1) > 0).long()
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2)).to(device)
    model = DistributedDataParallel(net, device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for epoch in range(3):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        if dist.get_rank() == 0:
            print(f"epoch {epoch + 1}: loss {loss.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
