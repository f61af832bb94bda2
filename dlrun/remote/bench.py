"""The bench's host program: measures one host for ``dlrun topo --bench``.

Runs on the host (python >= 3.8, standard library only; torch where it is installed). Shipped by
the remote bootstrap; one process per host lives for the whole bench and answers the
controller's requests, one JSON line each way:

- first line ``{"address", "iface"}``: it listens for TCP test streams on ``address`` (the one
  the other hosts reach it at, on the interface NCCL and gloo would use), starts importing torch
  in the background where it is installed, and answers ``{"op": "hello", "address", "port",
  "iface", "speed_mbits", "cpu_count", "python", "torch"}`` (torch's version, or null);
- ``{"op": "tcp", "targets": [[addr, port], …], "seconds", "streams"}``: sends to each target
  for ``seconds`` (``streams`` connections each); the receiver counts bytes from the first to
  EOF and sends back its count and time, so each link's Gbit/s is the receiving side's;
- ``{"op": "compute", "seconds"}``: fp32 matmul GFLOP/s with torch on the CPU, else a pure
  Python loop's Mop/s; the best of 0.1 s windows;
- ``{"op": "gpu", "seconds"}``: per CUDA device bf16 GEMM TFLOP/s, device copy GB/s, pinned
  host→device and device→host GB/s, the PCIe link from sysfs; then the all-reduce bus bandwidth
  across the host's GPUs (NCCL, one process);
- ``{"op": "freeport"}``: a free port on ``address`` (the master of an all-reduce);
- ``{"op": "allreduce", "backend", "master": [addr, port], "rank", "world", "seconds", "mib"}``:
  one rank of an all-reduce across hosts (gloo on the CPU, NCCL on GPU 0): bus bandwidth.

Every answer carries ``"what"``: what was measured, in words. EOF on stdin ends it.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import threading
import time
from typing import Any

CHUNK = 256 * 1024
REPLY = struct.Struct("!Qd")  # bytes received, seconds from the first byte to EOF


def log(text: str) -> None:
    sys.stderr.write("dlrun-bench: " + text + "\n")
    sys.stderr.flush()


def answer(doc: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


def read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read().strip()
    except OSError:
        return None


def link_speed(iface: str | None) -> int | None:
    """The interface's speed in Mb/s from sysfs; None where the kernel does not know (lo)."""
    if not iface:
        return None
    value = read_text(f"/sys/class/net/{iface}/speed")
    try:
        speed = int(value) if value else None
    except ValueError:
        return None
    return speed if speed and speed > 0 else None


# --------------------------------------------------------------------------- TCP


class Sink:
    """Accepts test streams and counts what arrives; replies with the count at EOF."""

    def __init__(self, address: str) -> None:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((address, 0))
        self.sock.listen(128)
        self.port = int(self.sock.getsockname()[1])
        thread = threading.Thread(target=self.accept, daemon=True)
        thread.start()

    def accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self.count, args=(conn,), daemon=True).start()

    @staticmethod
    def count(conn: socket.socket) -> None:
        total = 0
        first: float | None = None
        buf = bytearray(CHUNK)
        try:
            conn.settimeout(600)
            while True:
                n = conn.recv_into(buf)
                if not n:
                    break
                if first is None:
                    first = time.monotonic()
                total += n
            seconds = time.monotonic() - first if first is not None else 0.0
            conn.sendall(REPLY.pack(total, seconds))
        except OSError:
            pass
        finally:
            conn.close()


def send_stream(address: str, port: int, seconds: float, out: list[Any], source: str | None = None) -> None:
    """One test stream from ``source`` (this host's own address, so the packets leave by the
    interface under test): send until ``seconds`` pass, then read the receiver's count."""
    data = memoryview(bytes(CHUNK))
    try:
        sock = socket.create_connection((address, port), timeout=30,
                                        source_address=(source, 0) if source else None)
        sock.settimeout(seconds + 60)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        reply = b""
        while len(reply) < REPLY.size:
            chunk = sock.recv(REPLY.size - len(reply))
            if not chunk:
                raise OSError("the receiver closed without a count")
            reply += chunk
        sock.close()
        out.append(REPLY.unpack(reply))
    except OSError as exc:
        out.append(str(exc) or type(exc).__name__)


def tcp(request: dict[str, Any], source: str | None = None) -> dict[str, Any]:
    seconds = float(request.get("seconds") or 3)
    streams = max(1, int(request.get("streams") or 1))
    targets = [(str(a), int(p)) for a, p in request.get("targets") or []]
    results: list[list[Any]] = [[] for _ in targets]
    threads = []
    for (address, port), out in zip(targets, results):
        for _ in range(streams):
            thread = threading.Thread(target=send_stream, args=(address, port, seconds, out, source), daemon=True)
            thread.start()
            threads.append(thread)
    for thread in threads:
        thread.join()
    links = []
    for (address, port), out in zip(targets, results):
        errors = [r for r in out if isinstance(r, str)]
        counts = [r for r in out if not isinstance(r, str)]
        total = sum(c[0] for c in counts)
        span = max([c[1] for c in counts] or [0.0])
        link: dict[str, Any] = {"to": [address, port], "bytes": total, "seconds": span}
        if errors:
            link["error"] = errors[0]
        elif span > 0:
            link["gbits"] = total * 8 / span / 1e9
        else:
            link["error"] = "nothing arrived"
        links.append(link)
    return {"op": "tcp", "links": links,
            "what": f"TCP throughput, {streams} stream{'s' if streams > 1 else ''} per link, counted by the receiver"}


def freeport(address: str) -> dict[str, Any]:
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return {"op": "freeport", "port": int(sock.getsockname()[1])}


# --------------------------------------------------------------------------- torch


_TORCH: list[Any] = []
_TORCH_READY = threading.Event()
WINDOW = 0.1  # seconds: the compute check's windows span a CFS period, so a CPU quota shows


def import_torch() -> None:
    """Import torch (2-3 s of CPU) in the background while the controller starts the others."""
    try:
        import torch
    except Exception:  # no torch (or a broken one) means the TCP-only level
        _TORCH.append(None)
    else:
        _TORCH.append(torch)
    finally:
        _TORCH_READY.set()


def load_torch() -> Any:
    if not _TORCH_READY.is_set() and not _TORCH:
        started = [t for t in threading.enumerate() if t.name == "dlrun-torch-import"]
        if not started:
            import_torch()
    _TORCH_READY.wait()
    return _TORCH[0]


def torch_installed() -> str | None:
    """torch's version where it is installed, without importing it; None where it is not."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return None
    try:
        from importlib import metadata

        return metadata.version("torch")
    except Exception:
        return "unknown"


def torch_facts() -> dict[str, Any]:
    torch = load_torch()
    if torch is None:
        return {"torch": None, "cuda_devices": 0}
    try:
        devices = int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except Exception:
        devices = 0
    return {"torch": str(torch.__version__), "cuda_devices": devices}


def repeat(step: Any, seconds: float, sync: Any = None, least: int = 3) -> Any:
    """Run ``step`` until ``seconds`` pass (at least ``least`` times): (count, elapsed)."""
    count = 0
    start = time.perf_counter()
    while True:
        step()
        count += 1
        if sync is not None:
            sync()
        elapsed = time.perf_counter() - start
        if count >= least and elapsed >= seconds:
            return count, elapsed


def best_window(step: Any, work: float, seconds: float) -> float:
    """The best rate (``work`` per ``step``, per second) over windows of ``WINDOW`` seconds,
    run for ``seconds`` in all: a neighbour's burst costs a window, not the result, while a CPU
    quota (at most its share of every period) shows in every window."""
    best = 0.0
    end = time.perf_counter() + seconds
    while True:
        start = time.perf_counter()
        count = 0
        while True:
            step()
            count += 1
            elapsed = time.perf_counter() - start
            if elapsed >= WINDOW:
                break
        best = max(best, work * count / elapsed)
        if time.perf_counter() >= end:
            return best


def python_loop() -> None:
    x = 0
    for i in range(10000):
        x = (x + i * 7) & 0xFFFF


def compute(request: dict[str, Any]) -> dict[str, Any]:
    seconds = float(request.get("seconds") or 2)
    torch = load_torch()
    if torch is not None:
        # one thread: a multi-threaded matmul waits for its slowest thread, so a neighbour's load on
        # one core would count against this host; a CPU quota or a slow clock shows on one core too
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            n = 256
            a = torch.rand(n, n)
            b = torch.rand(n, n)
            torch.matmul(a, b)
            rate = best_window(lambda: torch.matmul(a, b), 2 * n ** 3 / 1e9, seconds)
        finally:
            torch.set_num_threads(threads)
        return {"op": "compute", "value": rate, "unit": "GFLOP/s",
                "what": f"fp32 matmul {n}×{n} on one CPU thread (torch), best {WINDOW:g} s window"}
    rate = best_window(python_loop, 10000 / 1e6, seconds)
    return {"op": "compute", "value": rate, "unit": "Mop/s",
            "what": f"a pure Python loop on one CPU (no torch here), best {WINDOW:g} s window"}


def pcie_link(pci_bus_id: str) -> dict[str, Any]:
    """The GPU's PCIe link from sysfs: generation and width, current and maximum."""
    bus = pci_bus_id.lower()
    if bus.count(":") == 2 and len(bus.split(":")[0]) > 4:
        bus = bus[-12:]  # 00000000:07:00.0 → 0000:07:00.0
    base = f"/sys/bus/pci/devices/{bus}/"
    out: dict[str, Any] = {}
    for key, name in (("speed", "current_link_speed"), ("max_speed", "max_link_speed"),
                      ("width", "current_link_width"), ("max_width", "max_link_width")):
        value = read_text(base + name)
        if value is None:
            continue
        if key.endswith("width"):
            try:
                out[key] = int(value)
            except ValueError:
                pass
        else:
            gts = value.split(" ")[0]
            gens = {"2.5": 1, "5.0": 2, "8.0": 3, "16.0": 4, "32.0": 5, "64.0": 6}
            if gts in gens:
                out["gen" if key == "speed" else "max_gen"] = gens[gts]
    return out


def gpu(request: dict[str, Any]) -> dict[str, Any]:
    seconds = float(request.get("seconds") or 4)
    torch = load_torch()
    if torch is None or not torch.cuda.is_available():
        return {"op": "gpu", "error": "no CUDA device visible to torch"}
    devices = int(torch.cuda.device_count())
    share = max(0.2, seconds / (devices * 4 + 1))  # GEMM, memory, H2D, D2H per GPU; then the all-reduce
    gpus = []
    for index in range(devices):
        try:
            gpus.append(one_gpu(torch, index, share))
        except Exception as exc:
            gpus.append({"index": index, "error": f"{type(exc).__name__}: {exc}"})
    doc: dict[str, Any] = {"op": "gpu", "gpus": gpus, "cuda_devices": devices,
                           "what": {"gemm": "bf16 GEMM 8192³ (torch.matmul), TFLOP/s",
                                    "memory": "device-to-device copy of 1 GiB, GB/s (read + write)",
                                    "h2d": "pinned host→device copy of 1 GiB, GB/s",
                                    "d2h": "device→pinned host copy of 1 GiB, GB/s"}}
    if devices > 1:
        try:
            doc["allreduce"] = host_allreduce(torch, devices, share)
        except Exception as exc:
            doc["allreduce"] = {"error": f"{type(exc).__name__}: {exc}"}
    return doc


def timed_cuda(torch: Any, step: Any, seconds: float) -> Any:
    """(count, elapsed seconds) of ``step`` repeated on the current device, timed by CUDA events."""
    step()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    count = 0
    wall = time.perf_counter()
    start.record()
    while True:
        step()
        count += 1
        if count >= 3 and count % 5 == 0:
            torch.cuda.synchronize()
            if time.perf_counter() - wall >= seconds:
                break
    end.record()
    torch.cuda.synchronize()
    return count, start.elapsed_time(end) / 1000.0


def gemm_tflops(torch: Any, seconds: float, n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    count, elapsed = timed_cuda(torch, lambda: torch.matmul(a, b, out=c), seconds)
    return float(2 * n ** 3 * count / elapsed / 1e12)


def copy_gbps(torch: Any, seconds: float, size: int = 1 << 30) -> dict[str, float]:
    """Device copy (read + write counted), pinned host→device and device→host, GB/s."""
    src = torch.empty(size, dtype=torch.uint8, device="cuda")
    dst = torch.empty(size, dtype=torch.uint8, device="cuda")
    count, elapsed = timed_cuda(torch, lambda: dst.copy_(src), seconds)
    out = {"memory": 2 * size * count / elapsed / 1e9}
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    count, elapsed = timed_cuda(torch, lambda: src.copy_(host, non_blocking=True), seconds)
    out["h2d"] = size * count / elapsed / 1e9
    count, elapsed = timed_cuda(torch, lambda: host.copy_(src, non_blocking=True), seconds)
    out["d2h"] = size * count / elapsed / 1e9
    return out


def one_gpu(torch: Any, index: int, seconds: float) -> dict[str, Any]:
    torch.cuda.set_device(index)
    props = torch.cuda.get_device_properties(index)
    out: dict[str, Any] = {"index": index, "name": str(props.name)}
    if hasattr(props, "pci_bus_id") and hasattr(props, "pci_device_id"):
        domain, bus_no = int(getattr(props, "pci_domain_id", 0)), int(props.pci_bus_id)
        bus = f"{domain:04x}:{bus_no:02x}:{int(props.pci_device_id):02x}.0"
        out["pci_bus_id"] = bus
        out["pcie"] = pcie_link(bus)
    out["gemm"] = gemm_tflops(torch, seconds)
    torch.cuda.empty_cache()
    out.update(copy_gbps(torch, seconds))
    torch.cuda.empty_cache()
    return out


def host_allreduce(torch: Any, devices: int, seconds: float) -> dict[str, Any]:
    """All-reduce bus bandwidth across this host's GPUs: NCCL from one process (one tensor per
    device, ``torch.cuda.nccl.all_reduce``)."""
    from torch.cuda import nccl

    size = 256 << 20
    tensors = [torch.ones(size // 4, dtype=torch.float32, device=f"cuda:{i}") for i in range(devices)]

    def sync() -> None:
        for i in range(devices):
            torch.cuda.synchronize(i)

    nccl.all_reduce(tensors)  # type: ignore[no-untyped-call]
    sync()
    count, elapsed = repeat(lambda: nccl.all_reduce(tensors), seconds, sync)  # type: ignore[no-untyped-call]
    algbw = size * count / elapsed / 1e9
    return {"busbw": algbw * 2 * (devices - 1) / devices, "algbw": algbw, "ranks": devices, "mib": size >> 20,
            "what": f"NCCL all-reduce of {size >> 20} MiB across {devices} GPUs (one process), bus bandwidth GB/s"}


def allreduce(request: dict[str, Any], iface: str | None) -> dict[str, Any]:
    torch = load_torch()
    if torch is None:
        return {"op": "allreduce", "error": "no torch on this host"}
    import datetime

    import torch.distributed as dist

    backend = str(request.get("backend") or "gloo")
    rank, world = int(request["rank"]), int(request["world"])
    address, port = request["master"]
    seconds = float(request.get("seconds") or 3)
    mib = int(request.get("mib") or 64)
    if iface:
        os.environ["GLOO_SOCKET_IFNAME"] = iface
        os.environ["NCCL_SOCKET_IFNAME"] = iface
    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(0)
        device = "cuda:0"
    host = f"[{address}]" if ":" in str(address) else str(address)
    dist.init_process_group(backend, init_method=f"tcp://{host}:{int(port)}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=max(60.0, seconds * 4)))
    try:
        tensor = torch.ones((mib << 20) // 4, dtype=torch.float32, device=device)

        def sync() -> None:
            if backend == "nccl":
                torch.cuda.synchronize()

        dist.all_reduce(tensor)  # the warm-up also lines the ranks up
        sync()
        # every rank must run the same number of steps: rank 0 decides, by time, in rounds of 5
        count = 0
        start = time.perf_counter()
        flag = torch.zeros(1, dtype=torch.int32, device=device)
        while True:
            for _ in range(5):
                dist.all_reduce(tensor)
            count += 5
            sync()
            flag.fill_(1 if (rank == 0 and time.perf_counter() - start >= seconds) else 0)
            dist.broadcast(flag, 0)
            if int(flag.item()):
                break
        elapsed = time.perf_counter() - start
    finally:
        dist.destroy_process_group()
    algbw = (mib << 20) * count / elapsed / 1e9
    name, where = ("NCCL", "GPU 0") if backend == "nccl" else ("gloo", "CPU")
    what = f"{name} all-reduce of {mib} MiB, {world} ranks (one per host, {where}), bus bandwidth GB/s"
    return {"op": "allreduce", "busbw": algbw * 2 * (world - 1) / world, "algbw": algbw, "ranks": world, "what": what}


# --------------------------------------------------------------------------- main


def main() -> None:
    stdin = sys.stdin.buffer
    first = stdin.readline()
    if not first:
        return
    hello = json.loads(first.decode("utf-8"))
    address = str(hello.get("address") or "0.0.0.0")
    iface = hello.get("iface")
    sink = Sink(address)
    version = torch_installed()
    if version is not None:
        threading.Thread(target=import_torch, name="dlrun-torch-import", daemon=True).start()
    answer({"op": "hello", "address": address, "port": sink.port, "iface": iface, "speed_mbits": link_speed(iface),
            "cpu_count": os.cpu_count(), "python": sys.version.split()[0], "torch": version})
    while True:
        line = stdin.readline()
        if not line:
            return
        request = json.loads(line.decode("utf-8"))
        op = request.get("op")
        try:
            if op == "tcp":
                answer(tcp(request, None if address in ("0.0.0.0", "::") else address))
            elif op == "compute":
                answer(compute(request))
            elif op == "gpu":
                answer(gpu(request))
            elif op == "freeport":
                answer(freeport(address))
            elif op == "allreduce":
                answer(allreduce(request, iface))
            else:
                answer({"op": op, "error": f"unknown request {op!r}"})
        except Exception as exc:
            answer({"op": op, "error": f"{type(exc).__name__}: {exc}"})


if __name__ == "__main__":
    main()
