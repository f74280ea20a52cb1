#!/usr/bin/env bash
# Issue #2, sixth lease, fourth call: on the fused layer's FMA path, a dead verification slot's GEMV programs read
# their token's live flag first and end before loading a weight tile (SPECPILOT_DEAD_CHECK_FIRST=1), against after
# their constant loads (0, the fifth lease's kernels): engine_bench, our fastest AR and the n-gram drafters, code and
# summarization, 3 prompts each, once per setting.
set -uo pipefail
T=/tmp/smollm2/model.gguf
for first in 1 0; do
  SPECPILOT_DEAD_CHECK_FIRST=$first timeout 200 python -m specpilot.tools.engine_bench --target $T --device cuda \
    --max-new-tokens 256 --limit 3 --workloads code,summarize --hf "" --out /tmp/eb$first \
    --systems ar-fused-overlap,ngram2-k4-adaptive-fused-overlap,ngram-k4-adaptive-fused-overlap,ngram-k4-fused-overlap \
    2>&1 | grep --line-buffered -v "de-quantizing" | tail -9 | tee $OUT/engine_bench_first$first.log
  cp /tmp/eb$first/engine_bench.json $OUT/engine_bench_first$first.json
done
