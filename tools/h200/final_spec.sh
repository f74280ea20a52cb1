#!/usr/bin/env bash
# Issue #2, final call of the fifth lease: the fused layer (FMA path for up to 8 tokens, a program per token and row
# block; dead verification slots skipped) per layer and per step; then one engine_bench process with HF transformers
# (dynamic cache, static cache, prompt lookup), our AR (modular; fused with overlap) and chain decoding with each
# drafter (n-gram fixed and adaptive, layer-skip, fp16 self-draft), SmolLM2-135M bf16, B = 1, 256 new tokens, code and
# summarization, 3 prompts each; last the token-forcing gate at B = 1 for the adaptive n-gram recipe.
set -uo pipefail
T=/tmp/smollm2/model.gguf
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
timeout 90 python -m specpilot.tools.step_timing --target $T --batch-sizes 1 --layer-bench --no-attention-sweep \
  --layer-tokens 1,5,9 --variants ar-fused,ngram-k4-fused,ngram-k8-fused 2>&1 \
  | grep --line-buffered -v "de-quantizing" | grep -v "^      " | tee $OUT/layer.log
timeout 380 python -m specpilot.tools.engine_bench --target $T --device cuda --max-new-tokens 256 --limit 3 \
  --workloads code,summarize --out /tmp/engine_bench \
  --systems ar,ar-fused-overlap,ngram-k4,ngram-k4-fused-overlap,ngram-k4-adaptive-fused-overlap,ngram-k8-adaptive-fused-overlap,ngram2-k4-adaptive-fused-overlap,layerskip8-k4-fused,selfdraft-fp16-k4-fused \
  2>&1 | grep --line-buffered -v "de-quantizing" | tee $OUT/engine_bench.log
cp /tmp/engine_bench/engine_bench.json $OUT/
echo '{"specpilot_recipe": 1, "name": "ngram-k4-adaptive-fused-b1", "drafter": {"kind": "ngram", "adaptive": true},
 "k": 4, "layer": "fused", "batch": {"max_batch_size": 1}}' > /tmp/adaptive-b1.json
SPECPILOT_GATE_LAUNCH=subprocess timeout 90 python -m specpilot.cli check --target $T --recipe /tmp/adaptive-b1.json \
  --workload code --limit 4 --max-new-tokens 128 --device cuda --dtype bf16 --out /tmp/gate_ad 2>&1 \
  | grep -v "de-quantizing" | tail -8 | tee $OUT/gate_adaptive_b1.log
