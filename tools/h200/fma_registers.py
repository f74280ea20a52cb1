"""(Reverted after this call, docs/BENCHMARKS.md, seventh lease, B: neither variant was faster, the tail much slower
at one token; the module attributes K_TAIL and MAX_REGISTERS it sets no longer exist.)
Issue #2, seventh lease: does a multi-token step's extra cost come from programs that no longer fit one wave?

The fused layer's FMA path runs one program per (token, row block); each holds its row block's whole weight tile in
registers, so a 2-token step needs twice the register file of a 1-token step. Compiled offline for sm_90, SmolLM2's
q/k/v program takes 72 registers (924 slots on 132 SMs for the 960 programs of a 2-token step) and gate/up 128
(528 slots for 768). Variants, each over the same loaded model in this one process:

- base: as committed before this lease;
- caps: q/k/v and down capped at 64 registers (ptxas maxnreg; no spill offline): 1,056 slots each;
- tail: K = 576 as a 512 tile and a 64 tail instead of one tile padded to 1024 (q/k/v 64, gate/up 80 registers),
  at the cost of a second set of block reductions.

For each: µs a layer at 1, 2, 3 and 5 tokens (all layers in one CUDA graph, position 300), and device ms of one
captured decoding step (median of 15 replays, position 300): the fused AR step, and the adaptive min-2 n-gram step
with its draft budget forced to 0, 1, 2 and 4 (a history that repeats with period 50, so the drafter always finds 4),
i.e. 1, 2, 3 and 5 live tokens of the 5-token step. Writes $OUT/fma_registers.json.
"""
from __future__ import annotations

import json
import os
import statistics

import torch

from specpilot.engine import loader
from specpilot.engine.engine import Engine
from specpilot.engine.model import Block, compiled
from specpilot.engine.recipe import parse
from specpilot.kernels import triton_fused_layer as F
from specpilot.tools.engine_bench import SYSTEMS

VARIANTS = {"base": dict(K_TAIL=False, MAX_REGISTERS={}),
            "caps": dict(K_TAIL=False, MAX_REGISTERS={"qkv": 64, "down": 64}),
            "tail": dict(K_TAIL=True, MAX_REGISTERS={})}
POSITION, PERIOD = 300, 50


def step_ms(engine: Engine, budget: int | None, graph=None) -> float:
    """Median device ms of the engine's captured step (or `graph`, another of its steps) at POSITION, with the draft
    budget set before each replay."""
    dec = engine.decoder
    st = dec._state
    pattern = torch.arange(1000, 1000 + PERIOD, device=st.history.device).repeat(POSITION // PERIOD + 1)
    graph = graph or next(iter(dec._graphs.values()))
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


def step_times(target, prompt: list[int]) -> dict:
    """step_ms of the fused AR step and of the adaptive min-2 n-gram step with 1, 2, 3 and 5 live tokens."""
    row = {}
    for system, budgets in (("ar-fused-overlap", (None,)), ("ngram2-k4-adaptive-fused-overlap", (0, 1, 2, 4))):
        engine = Engine(target, parse({**SYSTEMS[system], "overlap": False}))
        engine.generate([prompt], 16, ignore_eos=True)  # compiles and captures the step
        for b in budgets:
            row[f"step_ms_{'ar' if b is None else f'live{b + 1}'}"] = round(step_ms(engine, b), 4)
        del engine
    return row


def run_variants(name: str, variants: dict, layer_row) -> None:
    """For each variant (module attributes of the fused layer to set): layer_row(model) (µs a layer, by label)
    and step_times; printed a line a variant and written to $OUT/NAME.json."""
    target = loader.load("/tmp/smollm2/model.gguf", "bf16", "cuda")
    target.model._ensure_rope(512)
    prompt = Engine(target, parse({"name": "ar"})).encode(
        "Write a Python function that checks whether a number is prime, with tests.")
    out = {}
    for label, settings in variants.items():
        for key, value in settings.items():
            setattr(F, key, value)
        with torch.inference_mode():
            row = layer_row(target.model)
        row.update(step_times(target, prompt))
        out[label] = row
        print(label, json.dumps(row), flush=True)
    json.dump(out, open(os.path.join(os.environ.get("OUT", "."), f"{name}.json"), "w"), indent=1)


def main() -> None:
    modular = compiled(Block.forward)
    run_variants("fma_registers", VARIANTS, lambda model: {
        f"layer_us_T{r['tokens']}": round(r["fused_us"], 2)
        for r in F.benchmark(model, modular, tokens=(1, 2, 3, 5), filled=POSITION)})


if __name__ == "__main__":
    main()
