"""Third-party code that reads torchrun's contract, run unchanged under dlrun: a real
Lightning ``Trainer`` over sshd hosts, and accelerate's own distributed self-test."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from support.cli import run_dlrun
from support.ssh_jobs import hosts_toml, shared_script
from support.sshd_cluster import SshdCluster

pytestmark = pytest.mark.slow

LIGHTNING = """
import sys
import torch
import lightning as L


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 2)

    def training_step(self, batch, _index):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
trainer = L.Trainer(accelerator="cpu", strategy="ddp", devices=2, num_nodes=int(sys.argv[1]), max_steps=2,
                    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Model(), torch.utils.data.DataLoader(data, batch_size=8))
print(f"lightning global rank {trainer.global_rank} of {trainer.world_size}", flush=True)
"""


@pytest.mark.ssh
@pytest.mark.parametrize("num_nodes", [1, 2])
def test_lightning_on_two_hosts_checks_num_nodes_like_under_torchrun(
        cluster: SshdCluster, tmp_path: Path, num_nodes: int) -> None:
    """Without TORCHELASTIC_RUN_ID, a wrong num_nodes hung or 'succeeded' on one host; with
    torchrun's contract, Lightning's own check names devices and num_nodes."""
    pytest.importorskip("lightning")
    script = shared_script(cluster, "lightning_job.py", LIGHTNING)
    hosts = hosts_toml(cluster, tmp_path / "hosts.toml", 2, slots=2)
    out = run_dlrun("launch", "--plain", "--framework", "torch", "--hosts", str(hosts),
                    "--ssh-config", str(cluster.ssh_config), str(script), str(num_nodes), cwd=tmp_path, timeout=240)
    text = out.stdout + out.stderr
    if num_nodes == 1:
        assert out.returncode == 1, text
        assert "You set `devices=2` and `num_nodes=1` in Lightning" in text
        assert "does not match the world size (4)" in text
    else:
        assert out.returncode == 0, text
        ranks = sorted(int(m) for m in re.findall(r"lightning global rank (\d) of 4", out.stdout))
        assert ranks == [0, 1, 2, 3], text


def test_accelerates_own_distributed_self_test_passes(tmp_path: Path) -> None:
    accelerate = pytest.importorskip("accelerate")
    script = Path(accelerate.__file__).parent / "test_utils" / "scripts" / "test_script.py"
    for _attempt in range(2):  # ~1 run in 5 aborts in gloo's teardown, under torchrun too (upstream)
        out = run_dlrun("launch", "--plain", "--framework", "torch", "--np", "2", "--no-push", "-e",
                        "ACCELERATE_USE_CPU=1", str(script), cwd=tmp_path, timeout=400,
                        env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
        if out.returncode == 0:
            break
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    assert "Test DataLoader" in out.stdout or "**Test" in out.stdout, out.stdout[-3000:]
