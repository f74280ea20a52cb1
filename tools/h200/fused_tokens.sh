#!/usr/bin/env bash
# Issue #2: do the fused layer's CUDA-graph steps decode the modular layer's tokens? B = 1, 160 new tokens, three
# prompts, fp32 (where both must agree token for token) and bf16, for AR and n-gram k = 4 on the tensor-core and FMA
# paths, PDL on and off, CUDA graphs on and off. Prints per configuration the prompts decoded identically to the
# modular AR, the first differing position, and tau.
set -uo pipefail
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
timeout 280 python - <<'PY' 2>&1 | grep --line-buffered -v "de-quantizing" | tee $OUT/fused_tokens.log
import torch
from specpilot.engine import loader
from specpilot.engine.engine import Engine
from specpilot.engine.recipe import parse
from specpilot.engine.workloads import load_workload
from specpilot.kernels import triton_fused_layer as F

NG = {"drafter": {"kind": "ngram"}, "k": 4}
CONFIGS = [  # name, recipe fields, FMA_MAX_TOKENS, PDL
    ("ar-fused pdl", {"layer": "fused"}, 1, True),
    ("ar-fused nopdl", {"layer": "fused"}, 1, False),
    ("ar-fused pdl eager", {"layer": "fused", "cuda_graphs": False}, 1, True),
    ("ngram modular", NG, 1, True),
    ("ngram-fused dot", {**NG, "layer": "fused"}, 1, True),
    ("ngram-fused fma16 pdl", {**NG, "layer": "fused"}, 16, True),
    ("ngram-fused fma16 nopdl", {**NG, "layer": "fused"}, 16, False),
    ("ngram-fused fma16 pdl eager", {**NG, "layer": "fused", "cuda_graphs": False}, 16, True),
]
for dtype in ("fp32", "bf16"):
    target = loader.load("/tmp/smollm2/model.gguf", dtype, "cuda")
    ref_engine = Engine(target, parse({"name": "ar"}))
    qs = load_workload("code", 2) + load_workload("summarize", 1)
    prompts = [ref_engine.encode(q.turns[0]) for q in qs]
    ref = [ref_engine.generate([p], 160, ignore_eos=True)[0].tokens for p in prompts]
    for name, fields, fma, pdl in CONFIGS:
        F.FMA_MAX_TOKENS, F.PDL = fma, pdl
        F._PDL_DEVICES.clear()
        eng = Engine(target, parse({"name": name.replace(" ", "-"), **fields}))
        rows = [eng.generate([p], 160, ignore_eos=True)[0] for p in prompts]
        same = [r.tokens == t for r, t in zip(rows, ref)]
        first = [next((i for i, (a, b) in enumerate(zip(r.tokens, t)) if a != b), None) for r, t in zip(rows, ref)]
        taus = [round(r.mean_accepted, 2) for r in rows]
        print(f"{dtype} {name:28s} identical {sum(same)}/{len(same)} first diff {first} tau {taus}", flush=True)
    F.FMA_MAX_TOKENS, F.PDL = 1, True
PY
