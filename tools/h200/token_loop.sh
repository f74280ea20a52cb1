#!/usr/bin/env bash
# (Its kernels, a program running its tokens one after another on one weight tile, and step_timing's
# --tokens-per-program were reverted after this call: slower at every token count; docs/BENCHMARKS.md, sixth lease.)
# Issue #2, sixth lease, first call: the fused layer's FMA path with a program's tokens run one after another on
# its weight tile (FMA_TOKENS_PER_PROGRAM 16) against a program per token (1, the fifth lease's path):
# 1. GPU checks, then microseconds per layer at 1, 2, 3, 5 and 9 tokens (FMA_MAX_TOKENS 8 and 16), and whole steps;
# 2. token identity at B = 1: fp32 (every fused configuration = the modular AR) and bf16 (n-gram verification on the
#    FMA path = the fused AR);
# 3. the token-forcing gate at B = 1 for the adaptive n-gram recipe.
set -uo pipefail
T=/tmp/smollm2/model.gguf
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
timeout 240 python -m specpilot.tools.step_timing --target $T --batch-sizes 1 --layer-bench --no-attention-sweep \
  --layer-tokens 1,2,3,5,9 --fma-max-tokens 8,16 --tokens-per-program 1,16 --variants ar-fused,ngram-k4-fused 2>&1 \
  | grep --line-buffered -v "de-quantizing" | grep -v "^      " | tee $OUT/layer.log
timeout 180 python tools/h200/token_identity.py '{"ar-fused": {"layer": "fused"},
 "ngram-k4-fused": {"drafter": {"kind": "ngram"}, "k": 4, "layer": "fused"},
 "ngram-k4-adaptive-fused": {"drafter": {"kind": "ngram", "adaptive": true}, "k": 4, "layer": "fused"},
 "ngram-k2-fused": {"drafter": {"kind": "ngram"}, "k": 2, "layer": "fused"}}' 2>&1 \
  | grep --line-buffered -v "de-quantizing\|warn" | tee $OUT/tokens.log
echo '{"specpilot_recipe": 1, "name": "ngram2-k4-adaptive-fused-b1", "drafter": {"kind": "ngram", "adaptive": true,
 "min_ngram": 2, "max_ngram": 4}, "k": 4, "layer": "fused", "batch": {"max_batch_size": 1}}' > /tmp/adaptive-b1.json
SPECPILOT_GATE_LAUNCH=subprocess timeout 120 python -m specpilot.cli check --target $T --recipe /tmp/adaptive-b1.json \
  --workload code --limit 4 --max-new-tokens 128 --device cuda --dtype bf16 --out /tmp/gate_ad 2>&1 \
  | grep -v "de-quantizing" | tail -8 | tee $OUT/gate_adaptive_b1.log
