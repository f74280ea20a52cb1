#!/usr/bin/env bash
# Issue #2, call B: fused steps with the chosen attention splits (replay, kernels); issue #5: the 12-bit GEMV sweep on
# the two MLP shapes at M = 1 with the evict-first tiles and the new default.
set -uo pipefail
T=/tmp/smollm2/model.gguf
timeout 120 python -m specpilot.tools.step_timing --target $T --batch-sizes 1 --variants ar,ar-fused,ngram-k4-fused \
  2>&1 | grep --line-buffered -v "de-quantizing" | tee $OUT/fused_steps.log
timeout 120 python -m specpilot.kernels.lossless12_linear --budget 80 --ms 1 --shapes 14336x4096,4096x14336 \
  --out $OUT/l12_mlp.json 2>&1 | tail -12 | tee $OUT/l12_mlp.log
