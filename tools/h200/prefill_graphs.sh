#!/usr/bin/env bash
# Issue #2, sixth lease, second call (after the token-loop call, whose kernels were reverted):
# 1. token identity at B = 1 over 4 prompts: fp32, each configuration with CUDA graphs (prefill graphs, prompts padded
#    to a multiple of 64) against itself without; bf16, n-gram verification on the fused FMA path against the fused AR
#    (each token's program takes a one-token step's tile);
# 2. microseconds per layer at 1, 2, 3 and 5 tokens, with a one-token step's tiles for every token (1) and with fewer,
#    wider programs for more tokens (0, the fifth lease's engine); whole steps;
# 3. the token-forcing gate at B = 1 for the adaptive n-gram recipe (min_ngram 2, max_ngram 4).
set -uo pipefail
T=/tmp/smollm2/model.gguf
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
timeout 200 python - <<'PY' 2>&1 | grep --line-buffered -v "de-quantizing\|warn" | tee $OUT/tokens.log
import time
from specpilot.engine import loader
from specpilot.engine.engine import Engine
from specpilot.engine.recipe import parse
from specpilot.engine.workloads import load_workload

NG2 = {"kind": "ngram", "adaptive": True, "min_ngram": 2, "max_ngram": 4}
CONFIGS = {"ar": {}, "ar-fused-overlap": {"layer": "fused", "overlap": True},
           "ngram-k4": {"drafter": {"kind": "ngram"}, "k": 4},
           "ngram-k4-fused": {"drafter": {"kind": "ngram"}, "k": 4, "layer": "fused"},
           "ngram2-k4-adaptive-fused-overlap": {"drafter": NG2, "k": 4, "layer": "fused", "overlap": True}}
for dtype in ("fp32", "bf16"):
    target = loader.load("/tmp/smollm2/model.gguf", dtype, "cuda")
    qs = load_workload("code", 2) + load_workload("summarize", 2)
    out = {}
    for graphs in (True, False) if dtype == "fp32" else (True,):
        for n, f in CONFIGS.items():
            eng = Engine(target, parse({"name": n, **f, "cuda_graphs": graphs}))
            prompts = [eng.encode(q.turns[0]) for q in qs]
            rows = [eng.generate([p], 128, ignore_eos=True)[0] for p in prompts]  # captures
            t = time.perf_counter()
            rows = [eng.generate([p], 128, ignore_eos=True)[0] for p in prompts]
            pre = [round(r.token_times[0] * 1e3, 1) for r in rows]
            out[n, graphs] = [r.tokens for r in rows]
            print(f"{dtype} {n:34s} graphs={graphs!s:5s} first token ms {pre}", flush=True)
    ref = "ar-fused-overlap" if dtype == "bf16" else None
    for (n, graphs), toks in out.items():
        want = out[n, False] if ref is None else out[ref, True]
        same = sum(a == b for a, b in zip(toks, want))
        print(f"{dtype} {n:34s} graphs={graphs!s:5s} = {'itself without graphs' if ref is None else ref}: "
              f"{same}/{len(toks)}", flush=True)
PY
for tiles in 1 0; do
  SPECPILOT_FMA_TILES_AS_ONE_TOKEN=$tiles timeout 120 python -m specpilot.tools.step_timing --target $T --batch-sizes 1 \
    --layer-bench --no-attention-sweep --layer-tokens 1,2,3,5 --variants ar-fused,ngram-k4-fused 2>&1 \
    | grep --line-buffered -v "de-quantizing\|Warn\|warn" | grep -v "^      " | tee $OUT/layer_tiles$tiles.log
done
echo '{"specpilot_recipe": 1, "name": "ngram2-k4-adaptive-fused-b1", "drafter": {"kind": "ngram", "adaptive": true,
 "min_ngram": 2, "max_ngram": 4}, "k": 4, "layer": "fused", "batch": {"max_batch_size": 1}}' > /tmp/adaptive-b1.json
SPECPILOT_GATE_LAUNCH=subprocess timeout 120 python -m specpilot.cli check --target $T --recipe /tmp/adaptive-b1.json \
  --workload code --limit 4 --max-new-tokens 128 --device cuda --dtype bf16 --out /tmp/gate_ad 2>&1 \
  | grep -v "de-quantizing" | tail -8 | tee $OUT/gate_adaptive_b1.log
