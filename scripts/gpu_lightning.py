"""GPU smoke workload: a Lightning ``Trainer(accelerator="gpu", strategy="ddp")`` on random data.

Lightning reads the rank environment that torchrun sets; ``scripts/gpu_smoke.sh`` starts this
under dlrun and under torchrun.
"""

from __future__ import annotations

import argparse
import os

import torch

try:
    import lightning as L
except ImportError:  # the older package name
    import pytorch_lightning as L  # type: ignore[no-redef]


class Model(L.LightningModule):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _index: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    parser.add_argument("--num-nodes", type=int, default=int(os.environ.get("GROUP_WORLD_SIZE", "1")))
    args = parser.parse_args()
    data = torch.utils.data.TensorDataset(torch.randn(4096, 256), torch.randint(0, 10, (4096,)))
    trainer = L.Trainer(accelerator="gpu", devices=args.devices, num_nodes=args.num_nodes, strategy="ddp",
                        max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Model(), torch.utils.data.DataLoader(data, batch_size=64))
    print(f"lightning global rank {trainer.global_rank}/{trainer.world_size} on "
          f"{torch.cuda.get_device_name(trainer.strategy.root_device)}: done", flush=True)


if __name__ == "__main__":
    main()
