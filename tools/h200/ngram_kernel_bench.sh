#!/usr/bin/env bash
# Eighth lease, the measurement #2's closing note left undone: the adaptive min-2 n-gram drafter with ar_after_miss
# beside our fastest AR, now that the n-gram search is one Triton kernel on CUDA (kernels/triton_ngram.py), and the
# same engine_bench in a second process with the drafter's torch search (NgramDrafter.use_kernel = False).
# SmolLM2-135M bf16, B = 1, 256 new tokens, code and summarization, 5 prompts each, no HF. Tails of the logs only.
set -uo pipefail
T=/tmp/smollm2/model.gguf
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
ARGS=(--target $T --device cuda --max-new-tokens 256 --limit 5 --workloads code,summarize --hf ""
  --systems ar-fused-overlap,ngram2-k4-adaptive-fused-overlap,ngram2-k4-adaptive-armiss-fused-overlap)
for search in kernel torch; do
  timeout 270 python -c "
import sys
from specpilot.engine.drafters import NgramDrafter
NgramDrafter.use_kernel = sys.argv[1] == 'kernel'
from specpilot.tools import engine_bench
engine_bench.main(sys.argv[2:])" $search "${ARGS[@]}" --out /tmp/eb_$search 2>&1 | grep --line-buffered -v "de-quantizing" \
    > /tmp/eb_$search.log
  tail -12 /tmp/eb_$search.log | tee $OUT/engine_bench_$search.log
  cp /tmp/eb_$search/engine_bench.json $OUT/engine_bench_$search.json
done
