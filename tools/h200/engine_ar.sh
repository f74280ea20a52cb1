#!/usr/bin/env bash
# Issue #2's single-request table with the step changes of the third lease (residual carried across layers, keys and
# values written with one scatter): our AR in both compile modes, with and without host/device overlap, each drafter,
# and HF transformers' AR (dynamic, static cache) and prompt lookup, side by side in one process; then the step's
# kernels by name for the two compile modes.
set -uo pipefail
T=/tmp/smollm2/model.gguf
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
timeout 330 python -m specpilot.tools.engine_bench --target $T --device cuda --max-new-tokens 256 --limit 2 \
  --workloads code,summarize --out /tmp/engine_bench \
  --systems ar,ar-overlap,ar-autotune,ar-autotune-overlap,ngram-k4,ngram-k4-autotune,ngram-k8,ngram-k8-autotune-overlap,layerskip8-k4,selfdraft-fp16-k4 \
  2>&1 | grep --line-buffered -v -E "AUTOTUNE|triton_|strides:|dtypes:|Autotune Choices|^\{|^  bmm|^  mm|de-quantizing" | tee $OUT/engine_bench.log
cp /tmp/engine_bench/engine_bench.json $OUT/
timeout 120 python -m specpilot.tools.step_timing --target $T --batch-sizes 1 --variants ar,ar-autotune 2>&1 \
  | grep --line-buffered -E "^B=|^     " | tee $OUT/step_timing.log
