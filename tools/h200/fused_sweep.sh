#!/usr/bin/env bash
# Issue #2: the fused layer's attention split settings swept per layer (T = 1 and 5, positions 100 and 300), whole
# fused steps; issue #5: the 12-bit GEMV sweep (with the evict-first weight loads) on the two MLP shapes at M = 1.
set -uo pipefail
T=/tmp/smollm2/model.gguf
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
timeout 200 python -m specpilot.tools.step_timing --target $T --batch-sizes 1 --layer-bench \
  --variants ar-fused,ngram-k4-fused 2>&1 | grep --line-buffered -v "de-quantizing" | tee $OUT/fused_sweep.log
timeout 150 python -m specpilot.kernels.lossless12_linear --budget 110 --ms 1 --shapes 14336x4096,4096x14336 \
  --out $OUT/l12_mlp.json 2>&1 | tail -12 | tee $OUT/l12_mlp.log
