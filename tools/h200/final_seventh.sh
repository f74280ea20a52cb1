#!/usr/bin/env bash
# (The system ngram2-k4-adaptive-host-fused, drafter.on_host, was removed after this call: docs/BENCHMARKS.md,
# seventh lease, G.)
# Issue #2, seventh lease, last call: one engine_bench process with HF transformers (dynamic cache, static cache,
# prompt lookup), our AR (modular; fused with overlap) and chain decoding with each drafter (n-gram: stock, adaptive
# min-2, with ar_after_miss, on the host; layer-skip; fp16 self-draft), SmolLM2-135M bf16, B = 1, 256 new tokens,
# code and summarization, 5 prompts each. Tail of the log only (the per-prompt lines are in the JSON).
set -uo pipefail
T=/tmp/smollm2/model.gguf
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
timeout 560 python -m specpilot.tools.engine_bench --target $T --device cuda --max-new-tokens 256 --limit 5 \
  --workloads code,summarize --out /tmp/engine_bench --systems ar,ar-fused-overlap,ngram-k4,\
ngram2-k4-adaptive-fused-overlap,ngram2-k4-adaptive-armiss-fused-overlap,ngram2-k4-adaptive-host-fused,\
layerskip8-k4-fused,selfdraft-fp16-k4-fused 2>&1 | grep --line-buffered -v "de-quantizing" > /tmp/eb.log
tail -30 /tmp/eb.log | tee $OUT/engine_bench.log
cp /tmp/engine_bench/engine_bench.json $OUT/
