#!/usr/bin/env bash
# Issue #2, after the fused layer's FMA path became one program per (token, row block) with K as tile + tail
# (the tail was reverted after this call: it slowed the one-token layer; docs/BENCHMARKS.md, fifth lease,
# call D), and verification skips dead tokens (slots past the valid drafts) with an optional adaptive draft length:
# 1. GPU checks and microseconds per layer at 1, 5 and 9 tokens (FMA_MAX_TOKENS 8 and 16), whole steps;
# 2. token identity at B = 1: fp32 (every fused configuration = the modular AR) and bf16 (n-gram verification on the
#    FMA path = the fused AR: the same per-token kernels);
# 3. the token-forcing gate at B = 1 (the FMA path with dead tokens) for the adaptive n-gram recipe.
set -uo pipefail
T=/tmp/smollm2/model.gguf
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
timeout 150 python -m specpilot.tools.step_timing --target $T --batch-sizes 1 --layer-bench --no-attention-sweep \
  --layer-tokens 1,5,9 --fma-max-tokens 8,16 --variants ar-fused,ngram-k4-fused,ngram-k8-fused 2>&1 \
  | grep --line-buffered -v "de-quantizing" | grep -v "^      " | tee $OUT/layer.log
timeout 200 python tools/h200/token_identity.py '{"ar-fused": {"layer": "fused"},
 "ngram-k4-fused": {"drafter": {"kind": "ngram"}, "k": 4, "layer": "fused"},
 "ngram-k4-adaptive-fused": {"drafter": {"kind": "ngram", "adaptive": true}, "k": 4, "layer": "fused"},
 "ngram-k8-fused (tensor cores)": {"drafter": {"kind": "ngram"}, "k": 8, "layer": "fused"},
 "ngram-k8-adaptive-fused": {"drafter": {"kind": "ngram", "adaptive": true}, "k": 8, "layer": "fused"}}' 2>&1 \
  | grep --line-buffered -v "de-quantizing\|warn" | tee $OUT/tokens.log
echo '{"specpilot_recipe": 1, "name": "ngram-k4-adaptive-fused-b1", "drafter": {"kind": "ngram", "adaptive": true},
 "k": 4, "layer": "fused", "batch": {"max_batch_size": 1}}' > /tmp/adaptive-b1.json
SPECPILOT_GATE_LAUNCH=subprocess timeout 120 python -m specpilot.cli check --target $T --recipe /tmp/adaptive-b1.json \
  --workload code --limit 4 --max-new-tokens 128 --device cuda --dtype bf16 --out /tmp/gate_ad 2>&1 \
  | grep -v "de-quantizing" | tail -8 | tee $OUT/gate_adaptive_b1.log
