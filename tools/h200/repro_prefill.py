import traceback, torch
from specpilot.engine import loader
from specpilot.engine.engine import Engine
from specpilot.tools.engine_bench import SYSTEMS
from specpilot.engine.recipe import parse
from specpilot.engine.workloads import load_workload
target = loader.load("/tmp/smollm2/model.gguf", "bf16", "cuda")
engs = {n: Engine(target, parse(SYSTEMS[n])) for n in ("ar-fused-overlap", "ngram2-k4-adaptive-fused-overlap")}
for wl in ("code", "summarize"):
    qs = load_workload(wl, 3)
    for n, e in engs.items():
        prompts = [e.encode(q.turns[0]) for q in qs]
        try:
            e.generate([prompts[0]], 256, ignore_eos=True)
            for p in prompts[1:]:
                e.generate([p], 1, ignore_eos=True)
            print(wl, n, "ok", [len(p) for p in prompts], flush=True)
        except Exception:
            print(wl, n, "FAILED", [len(p) for p in prompts], flush=True)
            traceback.print_exc()
