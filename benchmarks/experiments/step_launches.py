"""What a decoding step launches, kind by kind: Triton kernels, eager torch ops and compiled calls, counted on the CPU.

Why. SmolLM2-135M's step is launch-bound: our AR's step takes 0.45 ms at B = 1 on the H100 against a 63 µs
weight-read floor, about 160 kernels in its captured graph, each a few µs whatever it does. A head's draft forward
added ~0.1 ms to a step (fiftieth lease, L), some sixteen kernels of which six were its layer's. So the kernels a
kind of step launches are its floor, and glue left eager is a kernel per op: this counts them.

What it counts. Each system of `--systems` (the bench's, tools/bench/engine_bench.py) decodes two requests of a few
tokens on a seeded random model of SmolLM2's architecture, narrow (`SMALL_SHAPES`), with `--layers` layers (an EAGLE-3 head's drafter: a random head
of its shape, `random-eagle3`), then runs one step of every kind its decoder may run (`Decoder._step_kinds`: k, the
controller's shorter ones, AR, the blind AR), its state put back after each, under a torch dispatch mode that records
what runs outside the functions the decoder compiles on CUDA:

- Triton launches (the fused layer, under Triton's interpreter here: each one kernel on the GPU);
- eager torch ops that launch a kernel on a GPU (views, allocations and metadata ops launch none and are left out);
- calls of the functions the decoder and its drafter compile on CUDA (`compiled`: each one to a few kernels there,
  which inductor decides; run eagerly here, their ops are not counted one by one).

Per layer and fixed: each count is taken at `--layers` L and L + 1, so `per layer` is the difference and `fixed` the
rest (the 30-layer target launches fixed + 30 x per layer). A count, not a time: any machine gives the same figures.
CPU = True.

Backs docs/BENCHMARKS.md: none (the fifty-first session's step glue, docs/benchmarks/2026-12-08-fifty-first-session.md).

Device minutes: none (CPU: about a minute).
"""
from __future__ import annotations

import os
from collections import Counter

import harness

# The fused layer's kernels under Triton's interpreter (read when the kernels are defined: before any import of them)
os.environ.setdefault("TRITON_INTERPRET", "1")

MINUTES = 0
CPU = True
SYSTEMS = "ar-fused-overlap,ngram2-k4-cost-fused-overlap,eagle3-k3-cost-fused-overlap,eagle3-k3-lookup3-cost-fused-overlap"
# Ops that launch no kernel on a GPU: views, allocations, metadata
NO_KERNEL = {"view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "select", "slice", "expand", "t", "alias",
             "as_strided", "detach", "empty", "empty_like", "new_empty", "empty_strided", "lift_fresh", "permute",
             "transpose", "split", "split_with_sizes", "chunk", "unbind", "_reshape_alias", "sym_size", "sym_stride",
             "is_same_size", "result_type"}
# What the decoder and its drafters compile on CUDA (engine/decode.py's and the drafters' `prepare`)
DECODER_COMPILED = ("_finish", "_inputs", "_update_budget", "_pack", "_finish_packed", "_prologue")
DRAFTER_COMPILED = ("_first", "_next", "_nodes", "_absorb", "_pend", "_keep", "_first_inputs", "_next_inputs",
                    "_greedy_draft", "_copied", "_search")


def arguments(p) -> None:
    p.add_argument("--systems", default=SYSTEMS)
    p.add_argument("--layers", type=int, default=3,
                   help="the random model's layers L (also counted at L + 1; from 3 a random head's layers are all "
                        "stored by the layer after them, as the 30-layer target's)")
    p.add_argument("--batch", type=int, default=1, help="rows of the batch whose steps are counted")


def recording(decoder, log: list, depth: list) -> None:
    """Wrap the decoder's and its drafter's would-be-compiled functions (and the Triton launcher): each call logged
    once, its own ops and launches not."""
    import triton.runtime.interpreter as interpreter

    def wrapped(fn, name):
        def call(*args, **kwargs):
            log.append("<" + name + ">")
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        return call

    if getattr(decoder, "_prologue", False) is None:  # (eager on the CPU, compiled on CUDA)
        from specpilot.engine.model import token_inputs

        decoder._prologue = token_inputs
    for name in DECODER_COMPILED:
        if getattr(decoder, name, None) is not None:
            setattr(decoder, name, wrapped(getattr(decoder, name), name))
    drafters = [decoder.drafter, getattr(decoder.drafter, "lookup", None)]
    for drafter in (d for d in drafters if d is not None):
        for name in DRAFTER_COMPILED:
            if callable(getattr(drafter, name, None)):
                setattr(drafter, name, wrapped(getattr(drafter, name), name))
    if not getattr(interpreter.GridExecutor, "_counted", False):
        launch = interpreter.GridExecutor.__call__

        def counted(self, *args, **kwargs):
            if RECORD["depth"][0] == 0:
                RECORD["log"].append("[" + self.fn.__name__ + "]")
            RECORD["depth"][0] += 1
            try:
                return launch(self, *args, **kwargs)
            finally:
                RECORD["depth"][0] -= 1
        interpreter.GridExecutor.__call__ = counted
        interpreter.GridExecutor._counted = True


RECORD: dict = {"log": [], "depth": [0]}


# SmolLM2's architecture at a width the interpreter runs in seconds (grouped-query attention, tied embeddings): what
# a step launches does not depend on the sizes, only on the layers and the kinds of step
SMALL_SHAPES = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                "vocab_size": 512, "tie_word_embeddings": True, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5,
                "rope_theta": 100000.0}


def small_smollm2(layers: int, path):
    """A seeded random model of SmolLM2's architecture (SMALL_SHAPES) with `layers` layers, fp32 on the CPU."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specpilot.engine import loader

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**SMALL_SHAPES, "num_hidden_layers": layers})).save_pretrained(path)
    return loader.load(str(path), "fp32", "cpu")


def count_steps(name: str, spec, layers: int, rows: int, scratch) -> dict:
    """{kind: Counter of what one step of that kind launched} for system `name` on a random model of `layers`."""
    from dataclasses import asdict

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from specpilot.engine.batch_controller import BLIND_AR
    from specpilot.engine.engine import Engine
    from specpilot.engine.recipe import load_recipe, parse
    from specpilot.engine.sampling import SamplingParams

    model = small_smollm2(layers, scratch / f"l{layers}")
    data = asdict(load_recipe(spec)) if isinstance(spec, str) else dict(spec)
    if (data.get("drafter") or {}).get("kind") == "eagle3":  # (a head of the random model's shape)
        data["drafter"] = {**data["drafter"], "model": "random-eagle3"}
    eng = Engine(model, parse({**data, "cuda_graphs": False}))
    if eng.decoder.controller is not None:  # (prices given: measured, each kind's replays under the interpreter
        # took minutes; what a step launches does not depend on the controller's choices)
        eng.decoder.prices = {b: {kind: 1.0 for kind in eng.decoder._step_kinds(b)} for b in range(1, rows + 1)}
    prompt = list(range(1, 40))  # (a history with repeats, so that a search finds drafts)
    eng.generate([prompt + prompt[:12]] * rows, 4, ignore_eos=True)
    dec = eng.decoder
    log, depth = RECORD["log"], RECORD["depth"]
    recording(dec, log, depth)

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if depth[0] == 0:
                log.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    st, found = dec._state, {}
    for kind in dec._step_kinds():
        if kind != BLIND_AR:
            dec.absorb_backlog(st)  # (what the loop does before a searching step)
        saved = [t.clone() for t in (st.lengths, st.budget, st.active, st.history, st.out)]
        state = dec.drafter.snapshot() if dec.drafter is not None else None
        log.clear()
        with Ops(), torch.inference_mode():
            dec._step(st, SamplingParams(), kind)
        for buf, value in zip((st.lengths, st.budget, st.active, st.history, st.out), saved):
            buf.copy_(value)
        if dec.drafter is not None:
            dec.drafter.restore(state)
        found[kind] = Counter(op for op in log if op not in NO_KERNEL)
    return found


def summary(counts: Counter) -> dict:
    triton = sum(n for op, n in counts.items() if op.startswith("["))
    compiled = sum(n for op, n in counts.items() if op.startswith("<"))
    return {"triton": triton, "compiled_calls": compiled, "eager": sum(counts.values()) - triton - compiled}


def run(out_dir, args):
    from specpilot.tools.bench.engine_bench import SYSTEMS as BENCH

    names = [n for n in args.systems.split(",") if n]
    unknown = [n for n in names if n not in BENCH]
    if unknown:
        raise SystemExit(f"--systems: {', '.join(unknown)}: not among the bench's systems")
    layers = args.layers
    found, rows = {}, []
    for name in names:
        at = [count_steps(name, BENCH[name], n, args.batch, args.ctx.scratch) for n in (layers, layers + 1)]
        found[name] = {}
        for kind in at[0]:
            low, high = summary(at[0][kind]), summary(at[1][kind])
            per_layer = {key: high[key] - low[key] for key in low}
            fixed = {key: low[key] - layers * per_layer[key] for key in low}
            eager = sorted((op, n) for op, n in at[0][kind].items() if not op.startswith(("[", "<")))
            calls = sorted((op, n) for op, n in at[0][kind].items() if op.startswith("<"))
            found[name][str(kind)] = {"per_layer": per_layer, "fixed": fixed, "eager_ops": dict(eager),
                                      "compiled_calls": dict(calls),
                                      "triton": dict(sorted((op, n) for op, n in at[0][kind].items()
                                                            if op.startswith("[")))}
            rows.append([name, kind, per_layer["triton"], per_layer["eager"], fixed["triton"], fixed["eager"],
                         fixed["compiled_calls"], ", ".join(f"{op} {n}" for op, n in eager) or "-",
                         ", ".join(f"{op[1:-1]} {n}" for op, n in calls) or "-"])
        print(f"step_launches: {name}: {len(at[0])} kinds", flush=True)
    table = (f"One step of each kind at B = {args.batch} (random weights, SmolLM2's architecture, the fused layer under Triton's "
             "interpreter, no graphs): what it launches outside the functions compiled on CUDA, per layer and "
             "fixed (a 30-layer target: fixed + 30 x per layer), and the fixed part's eager ops and compiled calls "
             f"(at {layers} layers):\n\n"
             + harness.md_table(["system", "kind", "Triton a layer", "eager a layer", "Triton fixed", "eager fixed",
                                 "compiled calls", "eager ops", "compiled calls by function"], rows))
    return {"layers": layers, "batch": args.batch, "systems": found}, table
