#!/usr/bin/env bash
# Issue #2, seventh lease: the token-forcing gate (bf16, B = 1, 4 questions x 128 tokens) for the adaptive min-2
# n-gram with ar_after_miss on the fused layer, code and summarization: every step kind it launches (verification
# with dead slots skipped, AR steps after a miss) against the stock AR reference.
set -uo pipefail
T=/tmp/smollm2/model.gguf
echo '{"specpilot_recipe": 1, "name": "ngram2-k4-adaptive-armiss-fused", "k": 4, "layer": "fused", "overlap": true,
 "drafter": {"kind": "ngram", "min_ngram": 2, "max_ngram": 4, "adaptive": true, "ar_after_miss": true},
 "batch": {"max_batch_size": 1}}' > /tmp/armiss.json
for wl in code summarize; do
  SPECPILOT_GATE_LAUNCH=subprocess timeout 150 python -m specpilot.cli check --target $T --recipe /tmp/armiss.json \
    --workload $wl --limit 4 --max-new-tokens 128 --device cuda --dtype bf16 --out /tmp/gate_$wl 2>&1 \
    | grep -v "de-quantizing" > /tmp/gate_$wl.log
  tail -12 /tmp/gate_$wl.log | tee $OUT/gate_$wl.log
  cp /tmp/gate_$wl/*.json $OUT/ 2>/dev/null
done
