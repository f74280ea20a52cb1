#!/usr/bin/env bash
# Issue #5 kernel benchmark, #5 lossless12 through the gate on SmolLM2, and #2's single-request table.
set -uo pipefail
T=/tmp/smollm2/model.gguf
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a $OUT/env.txt
timeout 150 python -m specpilot.kernels.lossless12_linear --out $OUT/l12_kernel.json 2>&1 | tee $OUT/l12_kernel.log
cat > /tmp/stock-lossless12.json <<'J'
{"specpilot_recipe": 1, "name": "stock-lossless12", "drafter": {"kind": "ngram"}, "k": 4,
 "weights": {"format": "lossless12"}, "kernels": {"linear": "builtin:lossless12"}}
J
SPECPILOT_GATE_LAUNCH=subprocess timeout 100 python -m specpilot.cli check --target $T \
  --recipe /tmp/stock-lossless12.json --workload code --limit 4 --max-new-tokens 128 --device cuda --dtype bf16 \
  --out /tmp/gate_l12 2>&1 | tail -25
cp /tmp/gate_l12/report.json $OUT/gate_l12_report.json
timeout 270 python -m specpilot.tools.engine_bench --target $T --device cuda --max-new-tokens 256 --limit 2 \
  --workloads code,summarize --out /tmp/engine_bench \
  --systems ar,ngram-k4,ngram-k8,layerskip8-k4,selfdraft-fp16-k4,ar-overlap,ngram-k4-overlap,ar-triton,ngram-k4-triton,ar-lossless12,ngram-k4-lossless12 \
  2>&1 | tee $OUT/engine_bench.log
cp /tmp/engine_bench/engine_bench.json $OUT/
