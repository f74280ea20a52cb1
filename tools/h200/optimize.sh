#!/usr/bin/env bash
# Issue #6 on the H200: one `specpilot optimize` run on SmolLM2-135M with the policy provider (workload code), then
# the recipe it found measured beside ar and stock on every workload (specpilot bench, B = 1), and the summary
# docs/BENCHMARKS.md takes: the found recipe's speedup over ar and over stock per workload, and the GPU minutes spent.
# Needs the staging of tools/h200/README.md ("optimize"): the graph's wheels (.gpu/whl-graph) with .gpu/whl in
# /tmp/site, the checkout as /tmp/pkg/specpilot, the model at /tmp/smollm2/model.gguf. About 8 minutes in all.
# Comes back from $OUT (7 files, no folders): env.txt, optimize.log, recipe.json, report.md, bench_report.md,
# summary.md (+ summary.json inside the tarball), optimize.tar.gz (run dir, bench dir, memory file).
set -uo pipefail
T=${T:-/tmp/smollm2/model.gguf}
OPT_WORKLOAD=${OPT_WORKLOAD:-code}
BENCH_WORKLOADS=${BENCH_WORKLOADS:-code,chat,math,summarize,rag}
DEVICE=${DEVICE:-cuda}
# 2 rounds at most, 4 minutes of work at most (an evaluation under way finishes), 4 prompts of 128 new tokens.
OPT_FLAGS=${OPT_FLAGS:---budget-rounds 2 --budget-minutes 4 --budget-gpu-minutes 4 --max-new-tokens 128 --limit 4 --max-candidates 2}
BENCH_FLAGS=${BENCH_FLAGS:---batch-sizes 1 --max-new-tokens 128 --limit 4}
# (a dry run on a CPU: DEVICE=cpu OPT_FLAGS="--budget-rounds 1 --max-new-tokens 16 --limit 2 --max-candidates 1
#  --dtype fp32" BENCH_FLAGS="--max-new-tokens 8 --limit 1" BENCH_WORKLOADS=code,chat OUT=DIR bash optimize.sh)
RUN=${RUN:-/tmp/optimize-$OPT_WORKLOAD} BENCH=${BENCH:-/tmp/optimize-bench} MEM=${MEM:-/tmp/mem.jsonl}
start=$(date +%s)
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || echo "no nvidia-smi"
  python3 -c "import sys, torch, triton, transformers, langgraph, pydantic; print(sys.version.split()[0], torch.__version__, triton.__version__, transformers.__version__, 'langgraph', __import__('importlib.metadata').metadata.version('langgraph'), 'pydantic', pydantic.VERSION)"
  python3 -c "import sys, specpilot.graph; print('specpilot.graph imported; chromadb loaded:', 'chromadb' in sys.modules, '; openai loaded:', 'openai' in sys.modules)"
} 2>&1 | tee $OUT/env.txt
rm -rf $RUN $BENCH
echo "== optimize $(date -u +%FT%TZ)" | tee $OUT/optimize.log
timeout 330 python3 -m specpilot.cli optimize --target $T --workload $OPT_WORKLOAD --device $DEVICE --provider policy \
  --memory $MEM $OPT_FLAGS --out $RUN >> $OUT/optimize.log 2>&1
rc=$?
tail -2 $OUT/optimize.log
echo "optimize exit $rc after $(( $(date +%s) - start )) s" | tee -a $OUT/optimize.log
recipe=$RUN/recipe.json
if [ ! -f $recipe ]; then  # stopped by the timeout: the best adopted so far, if any
  recipe=$(ls -t $RUN/recipes/best-r*.json 2>/dev/null | head -1)
  echo "no recipe.json (timed out?); benching ${recipe:-nothing}" | tee -a $OUT/optimize.log
fi
[ -f $RUN/report.md ] && cp $RUN/report.md $OUT/report.md
[ -f $RUN/recipe.json ] && cp $RUN/recipe.json $OUT/recipe.json
if [ -n "$recipe" ] && [ -f "$recipe" ]; then
  # The found recipe beside ar and stock on each workload, in one process, side by side per cell.
  echo "== bench $(date -u +%FT%TZ)" | tee -a $OUT/optimize.log
  timeout 170 python3 -m specpilot.cli bench --target $T --recipe $recipe --workload $BENCH_WORKLOADS \
    $BENCH_FLAGS --device $DEVICE --out $BENCH >> $OUT/optimize.log 2>&1
  echo "bench exit $? after $(( $(date +%s) - start )) s" | tee -a $OUT/optimize.log
  [ -f $BENCH/report.md ] && cp $BENCH/report.md $OUT/bench_report.md
  if [ -f $BENCH/results.json ]; then
    python3 -m specpilot.tools.optimize_summary $recipe $BENCH --json $BENCH/summary.json > $OUT/summary.md 2>&1
    cat $OUT/summary.md
  fi
fi
echo "total $(( $(date +%s) - start )) s on the device (this script)" | tee -a $OUT/optimize.log
cp $MEM $RUN/memory.jsonl 2>/dev/null
tar -czf $OUT/optimize.tar.gz -C /tmp $(basename $RUN) $(basename $BENCH) 2>/dev/null
if [ $(stat -c %s $OUT/optimize.tar.gz) -gt 15000000 ]; then  # 16 MiB a file comes back: drop the caches
  tar -czf $OUT/optimize.tar.gz -C /tmp --exclude=checkpoints.sqlite --exclude=evaluations $(basename $RUN) \
    $(basename $BENCH) 2>/dev/null
fi
ls -la $OUT
