#!/usr/bin/env bash
# Issue #2: our AR with the Triton GEMV linear slot beside the cuBLAS one, each drafter and HF transformers (one
# process, B = 1, 256 tokens); the GEMV's own benchmark on SmolLM2's shapes; issue #5: the redesigned 12-bit kernels'
# sweep against torch bf16 on Llama-3-8B shapes (timed from CUDA graphs).
set -uo pipefail
T=/tmp/smollm2/model.gguf
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
timeout 270 python -m specpilot.tools.engine_bench --target $T --device cuda --max-new-tokens 256 --limit 2 \
  --workloads code,summarize --out /tmp/engine_bench \
  --systems ar,ar-triton-linear,ngram-k4,ngram-k8,layerskip8-k4,selfdraft-fp16-k4 \
  2>&1 | grep --line-buffered -v "de-quantizing" | tee $OUT/engine_bench.log
cp /tmp/engine_bench/engine_bench.json $OUT/
timeout 60 python -m specpilot.kernels.triton_linear 2>&1 | tee $OUT/triton_linear.log
timeout 150 python -m specpilot.kernels.lossless12_linear --budget 100 --out $OUT/l12_kernel.json 2>&1 \
  | tail -30 | tee $OUT/l12_kernel.log
