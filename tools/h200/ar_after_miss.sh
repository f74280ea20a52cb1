#!/usr/bin/env bash
# Issue #2, seventh lease: an AR step after a step whose drafter found nothing (drafter.ar_after_miss). Calls B-D
# (fma_registers.py, spec_step_profile.py, grid_order.py) found a verification step with one live token of five at
# 0.524 ms against the AR step's 0.441: its dead slots cost ~1.7 µs a layer. Here:
# 1. engine_bench, 5 prompts of code and of summarization: our fastest AR, the adaptive min-2 n-gram as before, and
#    with ar_after_miss (min_ngram 2 and 1);
# 2. token identity: fp32 = our modular AR, bf16 = the fused AR, for the n-gram with ar_after_miss.
set -uo pipefail
T=/tmp/smollm2/model.gguf
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
timeout 330 python -m specpilot.tools.engine_bench --target $T --device cuda --max-new-tokens 256 --limit 5 \
  --workloads code,summarize --hf "" --out /tmp/eb --systems ar-fused-overlap,ngram2-k4-adaptive-fused-overlap,\
ngram2-k4-adaptive-armiss-fused-overlap,ngram-k4-adaptive-armiss-fused-overlap 2>&1 \
  | grep --line-buffered -v "de-quantizing" | tail -14 | tee $OUT/engine_bench.log
cp /tmp/eb/engine_bench.json $OUT/engine_bench.json
timeout 200 python tools/h200/token_identity.py '{"ar-fused": {"layer": "fused"},
 "ngram2-k4-adaptive-armiss-fused": {"drafter": {"kind": "ngram", "min_ngram": 2, "max_ngram": 4, "adaptive": true,
 "ar_after_miss": true}, "k": 4, "layer": "fused", "overlap": true}}' 2>&1 \
  | grep --line-buffered -v "de-quantizing\|warn" | tee $OUT/tokens.log
