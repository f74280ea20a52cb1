"""Measure a device's ceilings for the cost model and cache them per device name.

    specpilot calibrate [--device cuda|cpu] [--force]

What is measured (docs/COSTMODEL.md):
- copy bandwidth: a large device copy, bytes read + written per second (fastest of 7 timed copies);
- matmul rate: a large square matmul, FLOP/s (bf16 on CUDA; fp32 on CPU, where bf16 has no fast path);
- launch: one tiny kernel launched eagerly, host-timed over many (CPU: the per-op overhead of a tiny torch op);
- graph node: one tiny kernel as a node of a replayed CUDA graph of many (CPU: = launch);
- GEMM node: one GEMV as a node of a replayed graph, its weights coming from DRAM (the chain's weights exceed L2, as
  a model's do), less its own transfer time at copy bandwidth: the latency a graphed GEMM pays on top of moving its
  bytes (CPU: a tiny matmul op);
- GEMM curve (CPU only): the weight bytes per second of an fp32 linear layer over DRAM-resident weights at 1, 2, 4
  ... 256 activation rows. A CPU BLAS runs a decode step's skinny GEMMs far below copy bandwidth and far below its
  square-matmul FLOP rate, and how far depends on the rows (tokens of the forward): without this curve the cost model
  put SmolLM2-135M's CPU step at a third of its measured time.
The cache is $SPECPILOT_CACHE/calibration/<device name slug>.json; the CPU calibration takes a few seconds.
"""
from __future__ import annotations

import itertools
import json
import os
import platform
import re
import time
from dataclasses import asdict, fields
from pathlib import Path

import torch
import torch.nn.functional as F

from ...engine.loader import cache_root
from .costmodel import DeviceCeilings

CALIBRATION_VERSION = 4  # 2: GEMM node on DRAM-resident weights, net of its transfer; 3: the CPU's GEMM curve;
# 4: CUDA's matmul curve


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} x{os.cpu_count()}"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine() or 'cpu'} x{os.cpu_count()}"


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def cache_path(name: str) -> Path:
    return cache_root() / "calibration" / f"{slug(name)}.json"


def _timer(device: str):
    """seconds(fn, n): mean time of fn() over n calls (CUDA: events; CPU: perf_counter), after one warm-up call."""
    cuda = device.startswith("cuda")

    def seconds(fn, n: int) -> float:
        fn()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(n):
                fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3 / n
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t) / n

    return seconds


def _best(seconds, fn, n: int, repeats: int) -> float:
    """The fastest of `repeats` timings: other work sharing the machine only ever adds time."""
    return min(seconds(fn, n) for _ in range(repeats))


def copy_bandwidth(device: str) -> float:
    n = 1 << 30 if device.startswith("cuda") else 1 << 26
    a = torch.empty(n, dtype=torch.uint8, device=device)
    a.random_() if device.startswith("cuda") else a.fill_(7)  # random_ is slow on a CPU; a copy ignores values
    b = torch.empty_like(a)
    return 2 * n / _best(_timer(device), lambda: b.copy_(a), 1, 7)


def matmul_rate(device: str) -> tuple[float, str]:
    cuda = device.startswith("cuda")
    n, dtype = (8192, torch.bfloat16) if cuda else (768, torch.float32)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    return 2 * n ** 3 / _best(_timer(device), lambda: a @ b, 3 if cuda else 2, 5), str(dtype).split(".")[-1]


def launch_overhead(device: str) -> float:
    """Host time per tiny kernel launched eagerly (the device cannot be the bottleneck: each does nothing)."""
    x = torch.zeros(1, device=device)
    n = 2000
    for _ in range(100):
        x.add_(1)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    times = []
    for _ in range(5):
        sync()
        t = time.perf_counter()
        for _ in range(n):
            x.add_(1)
        sync()
        times.append((time.perf_counter() - t) / n)
    return min(times)


GEMM_NODE_SHAPE = (1024, 512)  # bf16 weights of 1 MiB: the size of a small model's per-layer matrices


def graph_node(device: str, gemm: bool, copy_bytes_per_s: float | None = None) -> float:
    """Per-node time of a replayed CUDA graph of tiny kernels; with `gemm`, of GEMVs over 1 MiB weights cycling
    through more memory than L2 holds, less each one's transfer time at `copy_bytes_per_s`."""
    n = 500
    y = torch.zeros(1, device=device)
    if gemm:
        out_f, in_f = GEMM_NODE_SHAPE
        l2 = torch.cuda.get_device_properties(torch.device(device)).L2_cache_size
        count = max(8, -(-4 * l2 // (out_f * in_f * 2)))  # 4x L2: every node reads its weights from DRAM
        x = torch.randn(1, in_f, device=device, dtype=torch.bfloat16)
        ws = [torch.randn(out_f, in_f, device=device, dtype=torch.bfloat16) for _ in range(count)]

    def body():
        for i in range(n):
            F.linear(x, ws[i % len(ws)]) if gemm else y.add_(1)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    per_node = _best(_timer(device), graph.replay, 10, 5) / n
    if gemm and copy_bytes_per_s:
        return max(0.0, per_node - GEMM_NODE_SHAPE[0] * GEMM_NODE_SHAPE[1] * 2 / copy_bytes_per_s)
    return per_node


def tiny_gemm_cpu() -> float:
    """One thread: a tiny matmul never gains from more, and a busy machine can stall a thread pool for ms."""
    x, w = torch.randn(1, 256), torch.randn(256, 256)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _best(_timer("cpu"), lambda: F.linear(x, w), 200, 5)
    finally:
        torch.set_num_threads(threads)


GEMM_CURVE_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # a decode step's tokens: B x (k + 1), from AR at B=1 up
CPU_GEMM_SHAPE = (2048, 1024)  # fp32 weights of 8 MiB: a small model's per-layer matrix (the curve barely moves with
# the shape: 3072x576 and 576x1536, SmolLM2's, were within 10% of it at every row count on the 2-core Xeon)


def last_level_cache_bytes() -> int:
    """The largest CPU cache Linux reports (0 when it reports none)."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip().upper()
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * unit)
        except ValueError:
            pass
    return max(sizes, default=0)


def gemm_curve_cpu() -> tuple[tuple[int, float], ...]:
    """(rows, weight bytes per second) of F.linear at each of GEMM_CURVE_ROWS rows, cycling through weight matrices
    that together exceed the last-level cache, so that each call reads its weights from DRAM as a model's do."""
    out_f, in_f = CPU_GEMM_SHAPE
    size = out_f * in_f * 4
    span = min(1 << 30, max(256 << 20, last_level_cache_bytes() * 5 // 4))
    weights = [torch.empty(out_f, in_f).fill_(0.5) for _ in range(-(-span // size))]  # values do not change the time
    curve = []
    for rows in GEMM_CURVE_ROWS:
        x, cycle = torch.ones(rows, in_f), itertools.cycle(weights)
        seconds = _best(_timer("cpu"), lambda: F.linear(x, next(cycle)), len(weights), 2)  # one pass over them
        curve.append((rows, size / seconds))
    return tuple(curve)


MATMUL_CURVE_ROWS = (16, 32, 64, 128, 256, 512, 1024, 2048)  # a verification step's tokens, B x (k + 1), and more
CUDA_GEMM_SHAPE = (14336, 4096)  # bf16 weights of 112 MiB: Llama-3-8B's gate (and up, and down transposed)


def matmul_curve_cuda(device: str = "cuda") -> tuple[tuple[int, float], ...]:
    """(rows, FLOP/s) of F.linear on bf16 weights of CUDA_GEMM_SHAPE at each of MATMUL_CURVE_ROWS rows, cycling
    through three weight matrices (336 MiB, past any GPU's L2) so that each call reads its weights from DRAM, as a
    model's GEMMs do."""
    out_f, in_f = CUDA_GEMM_SHAPE
    weights = [torch.empty(out_f, in_f, dtype=torch.bfloat16, device=device).normal_() for _ in range(3)]
    seconds, curve = _timer(device), []
    for rows in MATMUL_CURVE_ROWS:
        x, cycle = torch.randn(rows, in_f, dtype=torch.bfloat16, device=device), itertools.cycle(weights)
        t = _best(seconds, lambda: F.linear(x, next(cycle)), 3 * len(weights), 3)
        curve.append((rows, 2.0 * rows * out_f * in_f / t))
    del weights
    return tuple(curve)


def measure(device: str = "cpu") -> tuple[DeviceCeilings, dict]:
    """The ceilings of `device`, and notes on how they were measured."""
    name = device_name(device)
    bw = copy_bandwidth(device)
    rate, mm_dtype = matmul_rate(device)
    launch = launch_overhead(device)
    if device.startswith("cuda"):
        node, gemm, curve = graph_node(device, False), graph_node(device, True, bw), None
        matmuls = matmul_curve_cuda(device)
    else:
        node, gemm, curve, matmuls = launch, tiny_gemm_cpu(), gemm_curve_cpu(), None
    notes = {"device": device, "matmul_dtype": mm_dtype, "torch": torch.__version__,
             "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "version": CALIBRATION_VERSION,
             "graphs": device.startswith("cuda"), "threads": torch.get_num_threads()}
    if curve:
        notes["gemm_curve"] = f"fp32 {CPU_GEMM_SHAPE[0]}x{CPU_GEMM_SHAPE[1]} weights from DRAM, rows {GEMM_CURVE_ROWS}"
    if matmuls:
        notes["matmul_curve"] = (f"bf16 {CUDA_GEMM_SHAPE[0]}x{CUDA_GEMM_SHAPE[1]} weights from DRAM, rows "
                                 f"{MATMUL_CURVE_ROWS}")
    return DeviceCeilings(name, bw, rate, launch, node, gemm, curve, matmuls), notes


def load_or_measure(device: str = "cpu", force: bool = False) -> DeviceCeilings:
    """The cached ceilings of this device, measuring (and caching) them when absent, stale or forced."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        from ...engine.errors import SpecPilotError

        raise SpecPilotError(f"device {device!r} was asked for but CUDA is not available on this machine")
    path = cache_path(device_name(device))
    if path.is_file() and not force:
        try:
            data = json.loads(path.read_text())
            if data.get("notes", {}).get("version") == CALIBRATION_VERSION:
                return DeviceCeilings(**{f.name: data["ceilings"][f.name] for f in fields(DeviceCeilings)})
        except (json.JSONDecodeError, KeyError, TypeError):
            pass  # unreadable: measure again
    ceilings, notes = measure(device)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"ceilings": asdict(ceilings), "notes": notes}, indent=2) + "\n")
    os.replace(tmp, path)
    return ceilings


def describe(c: DeviceCeilings) -> str:
    return "\n".join([
        f"device            {c.name}",
        f"copy bandwidth    {c.copy_bytes_per_s / 1e9:,.1f} GB/s (read + write)",
        f"matmul rate       {c.matmul_flops_per_s / 1e12:,.2f} TFLOP/s",
        f"launch            {c.launch_s * 1e6:.2f} us per eager kernel",
        f"graph node        {c.graph_node_s * 1e6:.2f} us per node",
        f"GEMM node         {(c.gemm_node_s or c.graph_node_s) * 1e6:.2f} us per graphed GEMM, beyond its bytes",
    ] + ([_describe_curve(c.gemm_curve)] if c.gemm_curve else [])
      + ([_describe_matmul_curve(c.matmul_curve)] if c.matmul_curve else []))


def _describe_matmul_curve(curve) -> str:
    rates = ", ".join(f"{f / 1e12:.0f}" for _, f in curve)
    return f"GEMM rate         {rates} TFLOP/s at {', '.join(str(r) for r, _ in curve)} rows (bf16, from DRAM)"


def _describe_curve(curve) -> str:
    rates = ", ".join(f"{b / 1e9:.1f}" for _, b in curve)
    return f"GEMM weights      {rates} GB/s at {', '.join(str(r) for r, _ in curve)} rows (fp32, from DRAM)"
