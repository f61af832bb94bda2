"""The bench host program's CUDA path, run against a stand-in ``torch`` that has the API it
calls (no GPU here): every step runs, every number and "what" comes back, and the controller's
side turns the answer into measures with expected values. The real run is scripts/gpu_smoke.sh
on a GPU machine (docs/gpu.md); this test only keeps the path free of typos and shape mistakes."""

from __future__ import annotations

import importlib.util
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest

from dlrun.topo.bench import gpu_measures
from dlrun.topo.records import Gpu, HostReport

SOURCE = Path(__file__).resolve().parents[2] / "dlrun" / "remote" / "bench.py"


class Tensor:
    def __init__(self, *shape: Any, **kwargs: Any) -> None:
        self.shape = shape

    def copy_(self, other: Tensor, non_blocking: bool = False) -> Tensor:
        time.sleep(0.001)
        return self

    def fill_(self, value: int) -> Tensor:
        return self


class Event:
    def __init__(self, enable_timing: bool = False) -> None:
        self.at = 0.0

    def record(self) -> None:
        self.at = time.perf_counter()

    def elapsed_time(self, end: Event) -> float:
        return (end.at - self.at) * 1000


def fake_module(name: str, **attrs: object) -> types.ModuleType:
    """A module named ``name`` holding ``attrs``."""
    made = types.ModuleType(name)
    vars(made).update(attrs)
    return made


def fake_torch(devices: int) -> dict[str, types.ModuleType]:
    calls: list[str] = []

    def all_reduce(tensors: list[Tensor]) -> None:
        assert len(tensors) == devices
        calls.append("nccl")
        time.sleep(0.001)

    def matmul(a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
        time.sleep(0.001)
        return out or Tensor()

    nccl = fake_module("torch.cuda.nccl", all_reduce=all_reduce)
    cuda = fake_module(
        "torch.cuda", nccl=nccl, is_available=lambda: True, device_count=lambda: devices,
        set_device=lambda index: None, Event=Event, synchronize=lambda *device: None, empty_cache=lambda: None,
        get_device_properties=lambda index: types.SimpleNamespace(
            name="NVIDIA H100 80GB HBM3", pci_bus_id=0x18 + index, pci_device_id=0, pci_domain_id=0))
    torch = fake_module(
        "torch", cuda=cuda, __version__="2.11.0+cu130", randn=Tensor, empty=Tensor, ones=Tensor, zeros=Tensor,
        matmul=matmul, calls=calls, **{name: name for name in ("bfloat16", "uint8", "float32", "int32")})
    return {"torch": torch, "torch.cuda": cuda, "torch.cuda.nccl": nccl}


def host_program() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("dlrun_bench_host", SOURCE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_request_runs_every_step_and_says_what_it_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    modules = fake_torch(devices=2)
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    program = host_program()
    assert program.torch_facts() == {"torch": "2.11.0+cu130", "cuda_devices": 2}
    doc = program.gpu({"seconds": 0.2})
    assert "error" not in doc, doc
    assert [g["index"] for g in doc["gpus"]] == [0, 1]
    for g in doc["gpus"]:
        assert all(g[k] > 0 for k in ("gemm", "memory", "h2d", "d2h")), g
        assert g["pci_bus_id"] == f"0000:{0x18 + g['index']:02x}:00.0" and isinstance(g["pcie"], dict)
    assert set(doc["what"]) == {"gemm", "memory", "h2d", "d2h"}
    assert doc["allreduce"]["busbw"] > 0 and doc["allreduce"]["ranks"] == 2 and "NCCL" in doc["allreduce"]["what"]
    assert "nccl" in modules["torch"].calls

    # the controller's side: expected values from the model's peaks and the host's NVLinks
    labels = ["GPU0", "GPU1"]
    report = HostReport("gpu1", gpus=(Gpu(0, "NVIDIA H100 80GB HBM3"), Gpu(1, "NVIDIA H100 80GB HBM3")),
                        links={a: {b: "NV18" for b in labels if b != a} for a in labels})
    doc["gpus"][1]["pcie"] = {"gen": 5, "max_gen": 5, "width": 8, "max_width": 16}
    measures, findings = gpu_measures("gpu1", doc, report)
    kinds = [m.kind for m in measures]
    assert kinds.count("gemm") == 2 and kinds.count("h2d") == 2 and kinds[-1] == "host_allreduce"
    gemm = next(m for m in measures if m.kind == "gemm")
    assert gemm.expected is not None and gemm.expected.value == 741.8 and gemm.what.startswith("bf16 GEMM")
    h2d = [m for m in measures if m.kind == "h2d"]
    assert h2d[1].expected is not None and h2d[1].expected.basis == "80% of PCIe Gen5 x16"
    assert measures[-1].expected is not None and measures[-1].expected.value == 369
    assert [f.message.split(":")[0] for f in findings] == ["GPU1's PCIe link runs at x8 of x16"]


def test_no_cuda_is_an_answer_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    modules = fake_torch(devices=0)
    vars(modules["torch.cuda"])["is_available"] = lambda: False
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    program = host_program()
    assert program.gpu({"seconds": 0.1}) == {"op": "gpu", "error": "no CUDA device visible to torch"}
    measures, _ = gpu_measures("h", {"op": "gpu", "error": "no CUDA device visible to torch"}, None)
    assert measures[0].error == "no CUDA device visible to torch"
