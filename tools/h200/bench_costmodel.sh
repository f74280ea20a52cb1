#!/usr/bin/env bash
# Issue #3's five-workload bench, issue #4's profile of `stock` and the cost-model validation table.
set -uo pipefail
T=/tmp/smollm2/model.gguf
timeout 330 python -m specpilot.cli bench --target $T --recipe stock --workload code,chat,math,summarize,rag \
  --batch-sizes 1,8,32 --max-new-tokens 128 --limit 32 --cell-requests 8 --baselines hf --out $OUT/bench \
  2>&1 | tail -40
timeout 50 python -m specpilot.cli profile --target $T --recipe stock --workload code --limit 4 \
  --max-new-tokens 128 --out /tmp/profile 2>&1
cp /tmp/profile/profile.json $OUT/
timeout 130 python -m specpilot.tools.costmodel_validate --target $T --batch-sizes 1,8,32 --ks 0,1,4,16 \
  --out $OUT/costmodel_validate.json 2>&1 | tee $OUT/costmodel_validate.md
