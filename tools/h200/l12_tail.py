"""Issue #5, eighth lease: where the 12-bit GEMV's fixed cost per call goes, and escapes added first.

At M = 1 the LM head streams its 12-bit weights at ~4.4 TB/s, but 14336 x 4096 takes ~4.7 us more than its bytes
at that rate: a one-wave grid pays its start and its tail in full. Timed, alternated three times in one process
with torch bf16 each time:
- "after loop": the committed kernel (escapes added after the main loop: a chain of dependent loads, CSR entries
  then x, that every program of a one-wave grid waits for at its end);
- "escapes first": the first tile's words requested, then the escapes added while they are in flight;
- "no escapes": the committed kernel on the same weights with the exception list emptied (a wrong result by a few
  ulps, so the check's tolerance still passes): what the escapes cost at all.
Shapes: the Llama-3-8B four, and 14336 x 2048 / 8192 (same grid, a quarter / twice the loop) for the intercept.
Then the launch floor: an empty Triton kernel of 896 and of 8016 programs, 256 calls in a CUDA graph.
Writes $OUT/l12_tail.json and $OUT/l12_launch.json.
(After this call, docs/BENCHMARKS.md eighth lease A: adding the escapes first was no faster; its ESCAPES_FIRST
switch was removed.)
"""
import dataclasses
import json
import os

import torch
import triton
import triton.language as tl

from l12_ab import alternate
from specpilot.kernels import lossless12_linear as L

committed_planes = L.to_linear_planes


def no_escapes(wb, device):
    p = committed_planes(wb, device)
    return dataclasses.replace(p, row_ptr=torch.zeros_like(p.row_ptr))


def before(label):
    L.to_linear_planes = no_escapes if label == "no escapes" else committed_planes


VARIANTS = {"after loop": dict(ESCAPES_FIRST=0), "escapes first": dict(ESCAPES_FIRST=1),
            "no escapes": dict(ESCAPES_FIRST=0)}
alternate("l12_tail", {label: lambda n, k, cfg, change=change: {**cfg, **change} for label, change in VARIANTS.items()},
          ((14336, 4096), (4096, 14336), (4096, 4096), (128256, 4096), (14336, 2048), (14336, 8192)), before=before)
L.to_linear_planes = committed_planes


@triton.jit
def _empty(out_ptr):
    if tl.program_id(0) < 0:
        tl.store(out_ptr, 1)


out = torch.zeros(1, device="cuda")
launch = {}
for programs in (896, 8016):
    us = L._graph_time(lambda i: _empty[(programs,)](out, num_warps=4), 1, 256) * 1e6
    launch[programs] = us
    print(f"empty kernel, {programs} programs of 4 warps: {us:.2f} us a launch in a CUDA graph", flush=True)
json.dump(launch, open(os.path.join(os.environ.get("OUT", "."), "l12_launch.json"), "w"))
