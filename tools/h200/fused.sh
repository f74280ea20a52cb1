#!/usr/bin/env bash
# Issue #2: the fused layer (five Triton kernels a layer) on the H200: its bf16 check and µs per layer against the
# compiled modular layer; whole steps (replay, kernel count) for AR and n-gram k = 4, modular and fused; the
# token-forcing gate on the fused recipes.
set -uo pipefail
T=/tmp/smollm2/model.gguf
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
timeout 200 python -m specpilot.tools.step_timing --target $T --batch-sizes 1 --layer-bench \
  --variants ar,ar-fused,ngram-k4,ngram-k4-fused 2>&1 | grep --line-buffered -v "de-quantizing" | tee $OUT/fused_step.log
echo '{"specpilot_recipe": 1, "name": "ar-fused", "layer": "fused"}' > /tmp/ar-fused.json
echo '{"specpilot_recipe": 1, "name": "stock-fused", "drafter": {"kind": "ngram"}, "k": 4, "layer": "fused"}' \
  > /tmp/stock-fused.json
for r in ar-fused stock-fused; do
  SPECPILOT_GATE_LAUNCH=subprocess timeout 100 python -m specpilot.cli check --target $T --recipe /tmp/$r.json \
    --workload code --limit 4 --max-new-tokens 128 --device cuda --dtype bf16 --out /tmp/gate_$r 2>&1 \
    | grep -v "de-quantizing" | tail -12 | tee $OUT/gate_$r.log
done
