#!/usr/bin/env bash
# Issue #2, call A: our AR (modular and fused layers) and chain decoding with each drafter beside HF transformers,
# SmolLM2-135M bf16, B = 1, 256 new tokens, code and summarization prompts, one process (PDL as pdl_check.sh left it).
set -uo pipefail
T=/tmp/smollm2/model.gguf
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
test -f /tmp/pdl_off && export SPECPILOT_PDL=0
timeout 400 python -m specpilot.tools.engine_bench --target $T --device cuda --max-new-tokens 256 --limit 2 \
  --workloads code,summarize --out /tmp/engine_bench \
  --systems ar,ar-fused,ar-fused-overlap,ngram-k4,ngram-k4-fused,ngram-k8-fused,layerskip8-k4-fused,selfdraft-fp16-k4-fused \
  2>&1 | grep --line-buffered -v "de-quantizing" | tee $OUT/engine_bench.log
cp /tmp/engine_bench/engine_bench.json $OUT/
