#!/usr/bin/env bash
# Issue #2: the fused layer with programmatic dependent launch (PDL), its hoisted loads and the one-kernel final norm:
# fp32 and bf16 checks on the GPU, whole steps with PDL on and off (A/B), the token-forcing gate on both fused recipes.
# A failed check turns PDL off for this call and the next (/tmp/pdl_off).
set -uo pipefail
T=/tmp/smollm2/model.gguf
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
timeout 120 python -m specpilot.tools.step_timing --target $T --batch-sizes 1 --layer-check \
  --variants ar-fused,ngram-k4-fused 2>&1 | grep --line-buffered -v "de-quantizing" | tee $OUT/pdl_on.log
if grep -q "FAILED\|failed:" $OUT/pdl_on.log; then touch /tmp/pdl_off; echo "PDL off from here"; fi
SPECPILOT_PDL=0 timeout 60 python -m specpilot.tools.step_timing --target $T --batch-sizes 1 \
  --variants ar-fused,ngram-k4-fused 2>&1 | grep --line-buffered -v "de-quantizing" | grep "^B=" | tee $OUT/pdl_off.log
test -f /tmp/pdl_off && export SPECPILOT_PDL=0
echo '{"specpilot_recipe": 1, "name": "ar-fused", "layer": "fused"}' > /tmp/ar-fused.json
echo '{"specpilot_recipe": 1, "name": "stock-fused", "drafter": {"kind": "ngram"}, "k": 4, "layer": "fused"}' \
  > /tmp/stock-fused.json
for r in ar-fused stock-fused; do
  SPECPILOT_GATE_LAUNCH=subprocess timeout 80 python -m specpilot.cli check --target $T --recipe /tmp/$r.json \
    --workload code --limit 4 --max-new-tokens 128 --device cuda --dtype bf16 --out /tmp/gate_$r 2>&1 \
    | grep -v "de-quantizing" | tail -8 | tee $OUT/gate_$r.log
done
