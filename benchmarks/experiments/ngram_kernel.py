"""The n-gram search as one Triton kernel against the torch search: alone and in captured steps.

What it measures (kernels/triton_ngram.py, which every step of the n-gram drafter runs, AR steps after a miss
included): (1) µs of one search alone, B = 1, a 1,024-slot history, CUDA graphs of 20 calls; (2) whether the two
searches propose the same drafts on a real decoding state (after 64 tokens of a code prompt); (3) device ms of the
adaptive min-2 n-gram's captured steps with ar_after_miss at position 300 (a history repeating with period 50):
verification with 1 and 2 live tokens and the AR step after a miss, with each search, and the fused AR step beside
them (median of 15 replays).

Backs docs/BENCHMARKS.md, "Speculative vs AR" (the search it ships with): the seventh lease's call L (then
ngram_kernel.py), docs/benchmarks/2026-11-29-seventh-lease.md.

Device minutes: about 2.
"""
from __future__ import annotations

import statistics

import harness

MINUTES = 2
CUDA_ONLY = True
POSITION, PERIOD = 300, 50
PROMPT = "Write a Python function that checks whether a number is prime, with tests."


def step_ms(engine, budget: int | None, graph=None) -> float:
    """Median device ms of the engine's captured step (or `graph`, another of its steps) at POSITION, with the
    draft budget set before each replay (None: left alone)."""
    import torch

    st = engine.decoder._state
    pattern = torch.arange(1000, 1000 + PERIOD, device=st.history.device).repeat(POSITION // PERIOD + 1)
    graph = graph or next(iter(engine.decoder._graphs.values()))
    times = []
    for _ in range(15):
        st.history[:, :POSITION] = pattern[:POSITION]
        st.lengths.fill_(POSITION)
        st.active.fill_(True)
        if budget is not None:
            st.budget.fill_(budget)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def run(out_dir, args):
    import torch

    from specpilot.engine import loader
    from specpilot.engine.drafters import NgramDrafter
    from specpilot.engine.engine import Engine
    from specpilot.engine.model import compiled
    from specpilot.engine.recipe import parse
    from specpilot.kernels import triton_ngram
    from specpilot.tools.bench.engine_bench import SYSTEMS

    out = {}
    search = compiled(NgramDrafter(4, 2)._search)
    out["search_alone"] = triton_ngram.benchmark(search)
    print("search alone", out["search_alone"], flush=True)
    target = loader.load(args.ctx.target, "bf16", "cuda")
    prompt = Engine(target, parse({"name": "ar"})).encode(PROMPT)
    ar = Engine(target, parse({**SYSTEMS["ar-fused-overlap"], "overlap": False}))
    ar.generate([prompt], 16, ignore_eos=True)
    out["ar_step_ms"] = round(step_ms(ar, None), 4)
    del ar

    def steps(use_kernel: bool):
        def measure():
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
            row = {"live1": step_ms(engine, 0, verify), "live2": step_ms(engine, 1, verify),
                   "ar_after_miss": step_ms(engine, None, ar_step)}
            return [{k: round(v, 4) for k, v in row.items()}]
        return measure

    out["steps"] = harness.alternate({"torch": steps(False), "triton": steps(True)}, reps=1)
    NgramDrafter.use_kernel = True
    s = out["search_alone"]
    table = harness.md_table(["search", "search alone µs", "verification, 1 live", "verification, 2 live",
                              "AR step after a miss"],
                             [[r["variant"], f"{s['triton_us' if r['variant'] == 'triton' else 'reference_us']:.2f}",
                               r["live1"], r["live2"], r["ar_after_miss"]] for r in out["steps"]])
    return out, (table + f"\n\nms a captured step at position {POSITION}; the fused AR step: {out['ar_step_ms']} ms. "
                 f"Same proposals on a real state: {out.get('same_proposal_on_a_real_state')}.")
