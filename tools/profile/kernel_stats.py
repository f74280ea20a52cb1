"""What torch.profiler saw during profiled decoding steps: kernels per phase range and the top kernels by time,
with the achieved bandwidth and FLOP rate of each GEMM from its recorded input shapes (record_shapes=True).

On CUDA a kernel belongs to the innermost op that launched it and its time is device time; on CPU the unit is the
top-level aten op (what a Python-level call dispatches, the unit of per-op overhead) and its time is self CPU time.
"""
from __future__ import annotations

import torch

from .costmodel import DeviceCeilings

GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def _gemm_work(name: str, shapes, elem: int) -> tuple[float, float] | None:
    """(bytes, flops) of a matmul op from its input shapes: inputs read once, output written once."""
    try:
        a, b = (shapes[1], shapes[2]) if name in ("aten::addmm", "aten::baddbmm") else (shapes[0], shapes[1])
        batch = a[0] if len(a) == 3 else 1
        m, kk, n = a[-2], a[-1], b[-1]
    except (IndexError, TypeError):
        return None
    return float((batch * (m * kk + kk * n + m * n)) * elem), 2.0 * batch * m * n * kk


def _descendants(e):
    for c in e.cpu_children:
        yield c
        yield from _descendants(c)


def phase_events(events, cuda: bool, steps: int) -> tuple[dict, dict, list]:
    """Kernels per step in each phase range (CPU: top-level aten ops, the unit of per-op overhead), their device
    time per step (CUDA only), and the ops inside the step ranges (prefill and all else outside a step left out)."""
    counts, times, inside = {}, {}, []
    for e in events:
        if e.name.startswith("specpilot::") and e.device_type == torch.autograd.DeviceType.CPU:
            ops = list(_descendants(e))
            inside += [e] + ops  # a kernel belongs to the innermost op that launched it: the range itself too
            if cuda:
                n = sum(len(d.kernels) for d in [e] + ops)
                us = sum(kk.duration for d in [e] + ops for kk in d.kernels)
                times[e.name[11:]] = times.get(e.name[11:], 0.0) + us / 1e6 / max(1, steps)
            else:
                n = sum(1 for d in ops if d.name.startswith("aten::")
                        and not (d.cpu_parent and d.cpu_parent.name.startswith("aten::")))
            counts[e.name[11:]] = counts.get(e.name[11:], 0) + n
    return {p: round(n / max(1, steps), 1) for p, n in counts.items()}, times, inside


def top_kernels(events, cuda: bool, steps: int, elem: int, dev: DeviceCeilings, n: int = 10) -> list:
    groups: dict = {}
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CPU or e.is_async:
            continue
        gemm = e.name in GEMM_OPS
        if cuda:
            items = [(k.name, k.duration) for k in e.kernels]
        elif e.name.startswith("aten::") and e.self_cpu_time_total > 0:
            items = [(e.name, e.self_cpu_time_total)]
        else:
            continue
        for name, us in items:
            g = groups.setdefault((name, str(e.input_shapes) if gemm else ""), {
                "name": name, "op": e.name, "shapes": e.input_shapes if gemm else None, "count": 0, "total_s": 0.0,
                "bytes": 0.0 if gemm else None, "flops": 0.0 if gemm else None})
            g["count"] += 1
            g["total_s"] += us / 1e6
            work = _gemm_work(e.name, e.input_shapes, elem) if gemm else None
            if work:
                g["bytes"] += work[0]
                g["flops"] += work[1]
    total = sum(g["total_s"] for g in groups.values()) or 1.0
    out = sorted(groups.values(), key=lambda g: -g["total_s"])[:n]
    for g in out:
        g["per_step_s"], g["share"] = g["total_s"] / max(1, steps), g["total_s"] / total
        ok = g["bytes"] is not None and g["total_s"] > 0
        g["achieved_bytes_per_s"] = g["bytes"] / g["total_s"] if ok else None
        g["achieved_flops_per_s"] = g["flops"] / g["total_s"] if ok else None
        g["bandwidth_fraction"] = g["achieved_bytes_per_s"] / dev.copy_bytes_per_s if ok else None
        g["floor_s"] = max(g["bytes"] / dev.copy_bytes_per_s, g["flops"] / dev.matmul_flops_per_s) if ok else None
    return out
