#!/usr/bin/env bash
# Issue #2: the fused layer's FMA path for several tokens as one program per (token, row block): GPU checks (PDL on
# and off), per-layer times at 1, 5 and 9 tokens for FMA_MAX_TOKENS 1, 5 and 16, whole steps, the token-forcing gate
# and whole n-gram runs beside our fastest AR, all with FMA_MAX_TOKENS = 16.
set -uo pipefail
T=/tmp/smollm2/model.gguf
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
export SPECPILOT_FMA_MAX_TOKENS=16
timeout 60 python -m specpilot.tools.step_timing --target $T --layer-check --variants "" 2>&1 \
  | grep --line-buffered -v "de-quantizing" | tee $OUT/check_fma16.log
SPECPILOT_PDL=0 timeout 60 python -m specpilot.tools.step_timing --target $T --layer-check --variants "" 2>&1 \
  | grep --line-buffered -v "de-quantizing" | tee $OUT/check_fma16_nopdl.log
if grep -q "FAILED" $OUT/check_fma16.log && ! grep -q "FAILED" $OUT/check_fma16_nopdl.log; then
  export SPECPILOT_PDL=0; echo "PDL off from here"; fi
timeout 120 python -m specpilot.tools.step_timing --target $T --batch-sizes 1 --layer-bench --no-attention-sweep \
  --layer-tokens 1,5,9 --fma-max-tokens 1,5,16 --variants ar-fused,ngram-k4-fused,ngram-k8-fused 2>&1 \
  | grep --line-buffered -v "de-quantizing" | grep -v "^      " | tee $OUT/fma_layer.log
echo '{"specpilot_recipe": 1, "name": "stock-fused", "drafter": {"kind": "ngram"}, "k": 4, "layer": "fused"}' \
  > /tmp/stock-fused.json
SPECPILOT_GATE_LAUNCH=subprocess timeout 80 python -m specpilot.cli check --target $T --recipe /tmp/stock-fused.json \
  --workload code --limit 4 --max-new-tokens 128 --device cuda --dtype bf16 --out /tmp/gate_stock 2>&1 \
  | grep -v "de-quantizing" | tail -8 | tee $OUT/gate_stock-fused.log
timeout 150 python -m specpilot.tools.engine_bench --target $T --device cuda --max-new-tokens 256 --limit 2 \
  --workloads code,summarize --hf "" --out /tmp/eb16 \
  --systems ar-fused-overlap,ngram-k4-fused,ngram-k4-fused-overlap,ngram-k8-fused-overlap 2>&1 \
  | grep --line-buffered -v "de-quantizing" | tail -12 | tee $OUT/engine_bench_fma16.log
cp /tmp/eb16/engine_bench.json $OUT/engine_bench_fma16.json
