"""Exponent statistics of a model's bf16 weights and what the lossless 12-bit format (kernels/lossless12_format.py) costs.

    python -m specpilot.tools.profile.weight_stats --target smollm2-135m [--per-tensor] [--no-random]

Prints, per tensor kind (layers.N.wqkv -> wqkv) and overall: element count, distinct exponents (max over tensors),
fraction covered by the 15/16 most frequent exponents of each tensor, the fraction of exact zeros (free: code 15),
the escape rate of the format's contiguous exponent window ("esc win", what the fused kernel decodes) and of a
top-15 table for comparison ("esc top15"), the window's base (min..max over tensors), bits/weight of the window
encoding including the exponent table, the exception list (int64 index + int16 bits) and the per-row exception
offsets; and whether every tensor round-trips bit-exactly (both encodings). Then the same for seeded Llama-like
random tensors (normal, std 0.02, bf16).
"""
from __future__ import annotations

import argparse
import re
import time
from collections import defaultdict

import torch

from ...kernels.lossless12_format import exponent_histogram, tensor_stats
from ..argtypes import add_target_argument

RANDOM_SHAPES = ((4096, 4096), (11008, 4096), (4096, 11008), (1024, 4096))
HEADER = f"{'tensor':<24}{'count':>6}{'weights':>12}{'distinct':>9}{'top15':>10}{'top16':>10}{'zeros':>10}" \
         f"{'escapes':>9}{'esc win':>10}{'esc top15':>10}{'base':>8}{'bits/w':>8}{'exact':>6}"


def _row(label: str, rows: list[dict]) -> str:
    n = sum(r["numel"] for r in rows)
    cov = lambda k: sum(r[k] * r["numel"] for r in rows) / n
    esc = sum(r["escapes"] for r in rows)
    esc15 = sum(r["escapes_top15"] for r in rows)
    zeros = sum(r["zeros"] for r in rows)
    bits = 8.0 * sum(r["nbytes"] for r in rows) / n
    lo, hi = min(r["base"] for r in rows), max(r["base"] for r in rows)
    base = f"{lo}" if lo == hi else f"{lo}-{hi}"
    return (f"{label:<24}{len(rows):>6}{n:>12}{max(r['distinct'] for r in rows):>9}{cov('top15'):>10.6f}"
            f"{cov('top16'):>10.6f}{zeros / n:>10.2e}{esc:>9}{esc / n:>10.2e}{esc15 / n:>10.2e}{base:>8}{bits:>8.3f}"
            f"{str(all(r['exact'] for r in rows)):>6}")


def model_tensors(target: str):
    """(name, bf16 tensor) of every parameter of the target loaded in bf16, the tied embedding once."""
    from ...engine.loader import load
    model = load(target, "bf16", "cpu").model
    seen = set()
    for name, p in model.named_parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        yield name, p.detach()


def random_tensors(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    for shape in RANDOM_SHAPES:
        yield f"randn*0.02 {shape[0]}x{shape[1]}", (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)


def report(tensors, title: str, per_tensor: bool) -> list[dict]:
    rows, hist = [], torch.zeros(256, dtype=torch.int64)
    print(f"\n## {title}\n{HEADER}")
    for name, w in tensors:
        r = tensor_stats(name, w)
        hist += exponent_histogram(w)
        rows.append(r)
        if per_tensor:
            print(_row(name[-24:], [r]))
    groups = defaultdict(list)
    for r in rows:
        groups[re.sub(r"^layers\.\d+\.", "", r["name"])].append(r)
    if not per_tensor:
        for kind, rs in groups.items():
            print(_row(kind[:24], rs))
    print(_row("ALL", rows))
    worst = max(rows, key=lambda r: r["escape_rate"])
    print(f"worst window escape rate: {worst['name']} {worst['escape_rate']:.2e}; "
          f"max bits/w: {max(r['bits_per_weight'] for r in rows):.3f}")
    frac = hist.double() / hist.sum()
    top = frac.sort(descending=True)
    print("pooled exponent histogram (biased exponent: fraction), 20 most frequent:")
    print("  " + ", ".join(f"{int(e)}: {float(f):.2e}" for e, f in zip(top.indices[:20], top.values[:20])))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_target_argument(ap, default="smollm2-135m")
    ap.add_argument("--per-tensor", action="store_true", help="one row per tensor instead of per tensor kind")
    ap.add_argument("--no-random", action="store_true", help="skip the Llama-like random tensors")
    a = ap.parse_args(argv)
    t0 = time.time()
    report(model_tensors(a.target), f"{a.target} (bf16)", a.per_tensor)
    if not a.no_random:
        report(random_tensors(), "Llama-like random tensors: normal(0, 0.02) in bf16, seed 0", True)
    print(f"\n({time.time() - t0:.1f} s, torch {torch.__version__})")


if __name__ == "__main__":
    main()
