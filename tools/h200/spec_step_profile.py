"""Issue #2, seventh lease: what a speculative step costs beyond an AR step when it verifies no draft.

Call B (fma_registers.py) found the adaptive min-2 n-gram's captured step with its budget forced to 0 (one live token
of five) at 0.524 ms against the fused AR step's 0.437. This profiles one replay of each captured step (torch.profiler,
CUDA activity: the graph's kernels with their device durations), at position 300 over a history that repeats with
period 50, and prints per kernel name its count and total µs, largest first, with each step's kernel sum and span
(first kernel start to last kernel end). Writes $OUT/spec_step_profile.json.
"""
from __future__ import annotations

import json
import os
from collections import defaultdict

import torch

from specpilot.engine import loader
from specpilot.engine.engine import Engine
from specpilot.engine.recipe import parse
from specpilot.tools.engine_bench import SYSTEMS

POSITION, PERIOD = 300, 50


def prepare(engine: Engine, budget: int | None) -> None:
    st = engine.decoder._state
    pattern = torch.arange(1000, 1000 + PERIOD, device=st.history.device).repeat(POSITION // PERIOD + 1)
    st.history[:, :POSITION] = pattern[:POSITION]
    st.lengths.fill_(POSITION)
    st.active.fill_(True)
    if budget is not None:
        st.budget.fill_(budget)
    torch.cuda.synchronize()


def profile(engine: Engine, budget: int | None) -> dict:
    graph = next(iter(engine.decoder._graphs.values()))
    for _ in range(3):
        prepare(engine, budget)
        graph.replay()
    prepare(engine, budget)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        by_name[e.name[:90]][0] += 1
        by_name[e.name[:90]][1] += e.device_time
    starts = [e.time_range.start for e in kernels]
    ends = [e.time_range.end for e in kernels]
    rows = sorted(([n, c, round(t, 2)] for n, (c, t) in by_name.items()), key=lambda r: -r[2])
    return dict(kernels=len(kernels), kernel_us=round(sum(r[2] for r in rows), 1),
                span_us=round(max(ends) - min(starts), 1) if kernels else 0.0, by_name=rows)


def main() -> None:
    target = loader.load("/tmp/smollm2/model.gguf", "bf16", "cuda")
    prompt_engine = Engine(target, parse({"name": "ar"}))
    prompt = prompt_engine.encode("Write a Python function that checks whether a number is prime, with tests.")
    out = {}
    for system, budgets in (("ar-fused-overlap", (None,)), ("ngram2-k4-adaptive-fused-overlap", (0, 1))):
        engine = Engine(target, parse({**SYSTEMS[system], "overlap": False}))
        engine.generate([prompt], 16, ignore_eos=True)  # compiles and captures the step
        for b in budgets:
            name = f"{system} live {1 if b is None else b + 1}"
            out[name] = r = profile(engine, b)
            print(f"== {name}: {r['kernels']} kernels, {r['kernel_us']} us in kernels, span {r['span_us']} us",
                  flush=True)
            for n, c, t in r["by_name"][:28]:
                print(f"  {t:8.1f} us {c:4d}x  {n}", flush=True)
        del engine
    json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "spec_step_profile.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
