"""Issue #2, seventh lease: the n-gram search as one Triton kernel (kernels/triton_ngram.py) against the compiled
torch search, which every step of the n-gram drafter runs, AR steps after a miss included.
1. µs of one search alone (CUDA graphs of 20 calls), B = 1, a 1024-slot history;
2. the two searches' proposals on a real decoding state (after 64 tokens of a code prompt): equal or not;
3. device ms of the adaptive min-2 n-gram's captured steps with ar_after_miss (fma_registers.step_ms, position
   300, a history repeating with period 50): the verification step with 1 and 2 live tokens, and the AR step after
   a miss; the fused AR step beside them. Writes $OUT/ngram_kernel.json."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fma_registers import step_ms  # noqa: E402

from specpilot.engine import loader  # noqa: E402
from specpilot.engine.drafters import NgramDrafter  # noqa: E402
from specpilot.engine.engine import Engine  # noqa: E402
from specpilot.engine.model import compiled  # noqa: E402
from specpilot.engine.recipe import parse  # noqa: E402
from specpilot.kernels import triton_ngram  # noqa: E402
from specpilot.tools.engine_bench import SYSTEMS  # noqa: E402

out = {}
search = compiled(NgramDrafter(4, 2)._search)
out["search_alone"] = triton_ngram.benchmark(search)
print("search alone", out["search_alone"], flush=True)
target = loader.load("/tmp/smollm2/model.gguf", "bf16", "cuda")
prompt = Engine(target, parse({"name": "ar"})).encode(
    "Write a Python function that checks whether a number is prime, with tests.")
ar = Engine(target, parse({**SYSTEMS["ar-fused-overlap"], "overlap": False}))
ar.generate([prompt], 16, ignore_eos=True)
out["ar_step_ms"] = round(step_ms(ar, None), 4)
del ar
for use_kernel in (False, True):
    NgramDrafter.use_kernel = use_kernel
    engine = Engine(target, parse({**SYSTEMS["ngram2-k4-adaptive-armiss-fused-overlap"], "overlap": False}))
    engine.generate([prompt], 64, ignore_eos=True)
    if use_kernel:
        st = engine.decoder._state
        a = triton_ngram.ngram_search(st.history, st.lengths, 4, 4, 2)
        b = search(st.history, st.lengths, 4)
        out["same_proposal_on_a_real_state"] = bool(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]))
    graphs = engine.decoder._graphs
    verify = next(g for key, g in graphs.items() if key[2])
    ar_step = next(g for key, g in graphs.items() if not key[2])
    row = {"live1": step_ms(engine, 0, verify), "live2": step_ms(engine, 1, verify), "ar_after_miss": step_ms(
        engine, None, ar_step)}
    out["triton" if use_kernel else "torch"] = {k: round(v, 4) for k, v in row.items()}
    print("kernel" if use_kernel else "torch", out["triton" if use_kernel else "torch"], flush=True)
    del engine
print(json.dumps(out), flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "ngram_kernel.json"), "w"), indent=1)
