#!/usr/bin/env bash
# (drafter.on_host was removed after the next call, final_seventh.sh: no faster than ar_after_miss, and slower when
# the host is busy; docs/BENCHMARKS.md, seventh lease, F and G.)
# Issue #2, seventh lease: the n-gram drafter on the host (drafter.on_host): between steps, with no step in flight,
# the host drafts from each row's tokens and the step verifies exactly what it found (one CUDA graph per draft
# count; an AR step when nothing was found), against ar_after_miss (call E) and our fastest AR; ar-fused (no overlap)
# measures what the host costs a step when no step is in flight.
# 1. engine_bench, 5 prompts of code and of summarization;
# 2. token identity: fp32 = our modular AR, bf16 = the fused AR, for the on-host n-gram, adaptive and not.
set -uo pipefail
T=/tmp/smollm2/model.gguf
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
timeout 330 python -m specpilot.tools.engine_bench --target $T --device cuda --max-new-tokens 256 --limit 5 \
  --workloads code,summarize --hf "" --out /tmp/eb --systems ar-fused-overlap,ar-fused,\
ngram2-k4-adaptive-armiss-fused-overlap,ngram2-k4-adaptive-host-fused,ngram2-k4-host-fused 2>&1 \
  | grep --line-buffered -v "de-quantizing" | tail -16 | tee $OUT/engine_bench.log
cp /tmp/eb/engine_bench.json $OUT/engine_bench.json
timeout 200 python tools/h200/token_identity.py '{"ar-fused": {"layer": "fused"},
 "ngram2-k4-adaptive-host-fused": {"drafter": {"kind": "ngram", "min_ngram": 2, "max_ngram": 4, "adaptive": true,
 "on_host": true}, "k": 4, "layer": "fused"},
 "ngram2-k4-host-fused": {"drafter": {"kind": "ngram", "min_ngram": 2, "max_ngram": 4, "on_host": true}, "k": 4,
 "layer": "fused"}}' 2>&1 | grep --line-buffered -v "de-quantizing\|warn" | tee $OUT/tokens.log
