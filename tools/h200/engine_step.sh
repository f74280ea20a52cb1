#!/usr/bin/env bash
# Issue #2: what a step costs under each compile scope/mode (residual carried across layers); issue #4: the
# cost-model validation table after the calibration rework (fresh machine: ceilings measured first).
# Ran at commit 056afea; its ar-step variants (compile_scope "step", the whole forward as one graph) were removed
# after this call measured them slower (528 kernels a step against 393).
set -uo pipefail
T=/tmp/smollm2/model.gguf
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
timeout 280 python -m specpilot.tools.step_timing --target $T --batch-sizes 1 \
  --variants ar,ar-step,ngram-k4,ngram-k4-step,ar-autotune,ar-step-autotune 2>&1 | tee $OUT/step_timing.log
timeout 200 python -m specpilot.tools.costmodel_validate --target $T --batch-sizes 1,8,32 --ks 0,1,4,16 \
  --out $OUT/costmodel_validate.json 2>&1 | tee $OUT/costmodel_validate.md
