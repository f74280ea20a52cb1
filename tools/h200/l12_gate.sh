#!/usr/bin/env bash
# Issue #5: SmolLM2 end to end with the redesigned 12-bit kernels through the token-forcing gate, and in the engine
# beside ar and the Triton GEMV (LM head now left to cuBLAS), B = 1, 256 tokens, one process.
set -uo pipefail
T=/tmp/smollm2/model.gguf
cat > /tmp/stock-lossless12.json <<'J'
{"specpilot_recipe": 1, "name": "stock-lossless12", "drafter": {"kind": "ngram"}, "k": 4,
 "weights": {"format": "lossless12"}, "kernels": {"linear": "builtin:lossless12"}}
J
SPECPILOT_GATE_LAUNCH=subprocess timeout 110 python -m specpilot.cli check --target $T \
  --recipe /tmp/stock-lossless12.json --workload code --limit 4 --max-new-tokens 128 --device cuda --dtype bf16 \
  --out /tmp/gate_l12 2>&1 | tail -25 | tee $OUT/gate_l12.log
cp /tmp/gate_l12/report.json $OUT/gate_l12_report.json
timeout 150 python -m specpilot.tools.engine_bench --target $T --device cuda --max-new-tokens 256 --limit 2 \
  --workloads code,summarize --hf "" --out /tmp/engine_bench \
  --systems ar,ar-triton-linear,ar-lossless12,ngram-k4,ngram-k4-lossless12 \
  2>&1 | grep --line-buffered -v "de-quantizing" | tee $OUT/engine_bench.log
cp /tmp/engine_bench/engine_bench.json $OUT/
