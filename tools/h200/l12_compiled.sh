#!/usr/bin/env bash
# (Reverted after this call, docs/BENCHMARKS.md eighth lease K: with the layers compiled, torch 2.11 recompiled the
# layer past its limit of 64 and both 12-bit systems failed in warm-up; the ar-lossless12-graphs system is gone.)
# Issue #5, eighth lease: SmolLM2 end to end with the 12-bit recipe now that its layers compile (each weight's
# packed copy is an attribute of the parameter, the window's scales are run-time values): the token-forcing gate,
# then engine_bench beside ar, the same 12-bit recipe without torch.compile (ar-lossless12-graphs) and n-gram
# chains, B = 1, 256 tokens, 2 prompts a workload, one process.
set -uo pipefail
T=/tmp/smollm2/model.gguf
cat > /tmp/stock-lossless12.json <<'J'
{"specpilot_recipe": 1, "name": "stock-lossless12", "drafter": {"kind": "ngram"}, "k": 4,
 "weights": {"format": "lossless12"}, "kernels": {"linear": "builtin:lossless12"}}
J
SPECPILOT_GATE_LAUNCH=subprocess timeout 150 python -m specpilot.cli check --target $T \
  --recipe /tmp/stock-lossless12.json --workload code --limit 4 --max-new-tokens 128 --device cuda --dtype bf16 \
  --out /tmp/gate_l12 2>&1 | grep -v "de-quantizing" | tail -12 | tee $OUT/gate_l12.log
cp /tmp/gate_l12/report.json $OUT/gate_l12_report.json
timeout 300 python -m specpilot.tools.engine_bench --target $T --device cuda --max-new-tokens 256 --limit 2 \
  --workloads code,summarize --hf "" --out /tmp/engine_bench \
  --systems ar,ar-lossless12,ar-lossless12-graphs,ngram-k4,ngram-k4-lossless12 \
  2>&1 | grep --line-buffered -v "de-quantizing" > /tmp/eb.log
tail -16 /tmp/eb.log | tee $OUT/engine_bench.log
cp /tmp/engine_bench/engine_bench.json $OUT/
