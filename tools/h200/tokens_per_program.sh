#!/usr/bin/env bash
# (Its kernels, each weight of a program's tile multiplied with 2 or 4 tokens at once (FMA_TOKENS_PER_PROGRAM), were
# reverted after this call: slower than one token a program at 2, 3 and 5 tokens; docs/BENCHMARKS.md, sixth lease, G.)
# Issue #2, sixth lease, last call: the fused layer's FMA path with a program multiplying each weight of its tile with
# several tokens' activations at once (FMA_TOKENS_PER_PROGRAM 2 and 4) against one token a program (1: calls A-E):
# 1. GPU checks and µs per layer at 1, 2, 3 and 5 tokens, and whole steps, per setting;
# 2. engine_bench, our fastest AR and the adaptive min-2 n-gram, code and summarization, 3 prompts, per setting 1, 2.
set -uo pipefail
T=/tmp/smollm2/model.gguf
for per in 2 4 1; do
  SPECPILOT_FMA_TOKENS_PER_PROGRAM=$per timeout 100 python -m specpilot.tools.step_timing --target $T --batch-sizes 1 \
    --layer-bench --no-attention-sweep --layer-tokens 1,2,3,5 --variants ar-fused,ngram-k4-fused 2>&1 \
    | grep --line-buffered -v "de-quantizing\|Warn\|warn" | grep -v "^      " | tee $OUT/layer_per$per.log
done
for per in 2 1; do
  SPECPILOT_FMA_TOKENS_PER_PROGRAM=$per timeout 100 python -m specpilot.tools.engine_bench --target $T --device cuda \
    --max-new-tokens 256 --limit 3 --workloads code,summarize --hf "" --out /tmp/eb$per \
    --systems ar-fused-overlap,ngram2-k4-adaptive-fused-overlap 2>&1 | grep --line-buffered -v "de-quantizing" \
    | tail -5 | tee $OUT/engine_bench_per$per.log
  cp /tmp/eb$per/engine_bench.json $OUT/engine_bench_per$per.json
done
