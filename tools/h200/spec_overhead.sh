#!/usr/bin/env bash
# Issue #2, last call of the fifth lease: after compiling the step's small bookkeeping (inputs, positions, live mask;
# the adaptive draft budget), our fastest AR beside the adaptive n-gram recipes on 4 code and 4 summarization
# prompts (B = 1, 256 tokens, one process), then the gate at B = 1.
set -uo pipefail
T=/tmp/smollm2/model.gguf
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
timeout 170 python -m specpilot.tools.engine_bench --target $T --device cuda --max-new-tokens 256 --limit 4 \
  --workloads code,summarize --hf "" --out /tmp/engine_bench \
  --systems ar-fused-overlap,ngram2-k4-adaptive-fused-overlap,ngram-k4-adaptive-fused-overlap 2>&1 \
  | grep --line-buffered -v "de-quantizing" | tee $OUT/engine_bench.log
cp /tmp/engine_bench/engine_bench.json $OUT/
echo '{"specpilot_recipe": 1, "name": "ngram2-k4-adaptive-fused-b1", "drafter": {"kind": "ngram", "min_ngram": 2,
 "max_ngram": 4, "adaptive": true}, "k": 4, "layer": "fused", "batch": {"max_batch_size": 1}}' > /tmp/ad2-b1.json
SPECPILOT_GATE_LAUNCH=subprocess timeout 75 python -m specpilot.cli check --target $T --recipe /tmp/ad2-b1.json \
  --workload code --limit 4 --max-new-tokens 128 --device cuda --dtype bf16 --out /tmp/gate_ad2 2>&1 \
  | grep -v "de-quantizing" | tail -8 | tee $OUT/gate_ngram2_adaptive_b1.log
