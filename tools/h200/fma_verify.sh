#!/usr/bin/env bash
# Issue #2: verification steps (5 and 9 tokens) on the fused layer's FMA path (token by token over each weight tile,
# with PDL) against its tensor-core path: per layer, per captured step, and whole n-gram runs beside our fastest AR,
# once per FMA_MAX_TOKENS. Issue #5: the 12-bit GEMV with its first escape chunk loaded before the main loop, on the
# two MLP shapes at M = 1.
set -uo pipefail
T=/tmp/smollm2/model.gguf
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
timeout 150 python -m specpilot.tools.step_timing --target $T --batch-sizes 1 --layer-bench --no-attention-sweep \
  --layer-tokens 1,5,9 --fma-max-tokens 1,16 --variants ar-fused,ngram-k4-fused,ngram-k8-fused 2>&1 \
  | grep --line-buffered -v "de-quantizing" | tee $OUT/fma_layer.log
SPECPILOT_FMA_MAX_TOKENS=16 timeout 60 python -m specpilot.tools.step_timing --target $T --batch-sizes 1 \
  --variants ngram-k4-fused,ngram-k8-fused 2>&1 | grep --line-buffered -v "de-quantizing" | tee $OUT/fma_steps16.log
for fma in 1 16; do
  SPECPILOT_FMA_MAX_TOKENS=$fma timeout 130 python -m specpilot.tools.engine_bench --target $T --device cuda \
    --max-new-tokens 256 --limit 2 --workloads code,summarize --hf "" --out /tmp/eb$fma \
    --systems ar-fused-overlap,ngram-k4-fused,ngram-k4-fused-overlap,ngram-k8-fused-overlap 2>&1 \
    | grep --line-buffered -v "de-quantizing" | tail -12 | tee $OUT/engine_bench_fma$fma.log
  cp /tmp/eb$fma/engine_bench.json $OUT/engine_bench_fma$fma.json
done
timeout 100 python -m specpilot.kernels.lossless12_linear --budget 60 --ms 1 --shapes 14336x4096,4096x14336 \
  --out $OUT/l12_mlp.json 2>&1 | tail -12 | tee $OUT/l12_mlp.log
