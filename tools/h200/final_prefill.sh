#!/usr/bin/env bash
# Issue #2, sixth lease, last call: one engine_bench process with HF transformers (dynamic cache, static cache, prompt
# lookup), our AR (modular; fused with overlap) and chain decoding with each drafter (n-gram fixed and adaptive,
# layer-skip, fp16 self-draft), SmolLM2-135M bf16, B = 1, 256 new tokens, code and summarization, 3 prompts each;
# prefills now replayed as CUDA graphs.
set -uo pipefail
T=/tmp/smollm2/model.gguf
timeout 420 python -m specpilot.tools.engine_bench --target $T --device cuda --max-new-tokens 256 --limit 3 \
  --workloads code,summarize --out /tmp/engine_bench \
  --systems ar,ar-fused-overlap,ngram-k4,ngram-k4-fused-overlap,ngram-k4-adaptive-fused-overlap,ngram2-k4-adaptive-fused-overlap,layerskip8-k4-fused,selfdraft-fp16-k4-fused \
  2>&1 | grep --line-buffered -v "de-quantizing" | tee $OUT/engine_bench.log
cp /tmp/engine_bench/engine_bench.json $OUT/
