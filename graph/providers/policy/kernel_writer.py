"""The kernel writer agent's catalog (kernels, weights, layer): the fused layer, each slot's other built-in kernels,
and the weights' format (12-bit lossless or native bf16); priced by the cost model where it tells them apart, else
ranked by the measured gap they address."""
from __future__ import annotations

from dataclasses import replace

from ....engine.recipe import Recipe
from ....kernels import DEFAULTS as KERNEL_DEFAULTS, FUSED_LAYER_FMA_MAX_TOKENS, FUSED_LAYER_MAX_TOKENS, IMPLEMENTATIONS
from .catalog import MIN_GAIN, Option, Skips, _gap_text, _gaps_of, short_of_min_gain
from .costview import CostView, _phases, ms

# 12-bit weights: the lossless12 format reads 1.5 bytes a weight instead of bf16's 2 (docs/LOSSLESS12.md).
LOSSLESS12_BYTES_PER_PARAM = 1.5
# ... but not on the fused layer, which reads them itself in steps of up to FUSED_LAYER_FMA_MAX_TOKENS tokens and
# decodes them there arithmetic-bound: an AR step of synthetic Llama-3.1-8B, where the bytes would pay, ran 0.81x its
# bf16 step (H200, docs/benchmarks/2026-12-03-twenty-seventh-lease.md, D; the 12-bit modular layer 1.17x-1.21x bf16
# there). The cost model prices bytes only, so the policy proposes neither the one nor the other (the grid measures
# both).
FUSED_12BIT = ("its 12-bit steps are decode-bound (0.81x the bf16 fused AR step at Llama-3.1-8B's shapes, measured), "
               "which the bytes-only cost model does not price")


def needs_triton(slot: str, impl: str) -> bool:
    """Built-ins registered as "module:function" are the lazily imported Triton kernels (kernels/__init__.py): they
    run on CUDA (or under the interpreter, far too slow for a model; lossless12's CPU fallback decodes every call)."""
    return isinstance(IMPLEMENTATIONS[slot][impl], str)


def kernel_writer_options(recipe: Recipe, view: CostView, gaps: list[dict], skipped: Skips | None = None) \
        -> list[Option]:
    """Alternative built-ins per slot: where the cost model distinguishes them (attention math vs fused, 12-bit
    weights) ranked by its predicted gain; the others by the measured gap they address."""
    skipped = Skips() if skipped is None else skipped
    out: list[Option] = []
    dep, acc = view.dep, list(view.per_position)
    cur = view.current()
    verify = _gaps_of(gaps, "verify")
    book = _gaps_of(gaps, "bookkeeping")
    verify_gain = max((g.get("gain", 0.0) for g in verify), default=0.0)
    shape = dep.model
    tokens = view.batch * (dep.k + 1)
    cuda_only: list[str] = []  # what exists but runs only on CUDA (Triton), named once in the reason
    only_choice: list[str] = []  # slots whose implementation in use is the only one that runs here
    if recipe.layer != "modular":
        skipped.add(f"layer already {recipe.layer}")
    elif not view.cuda:
        cuda_only.append("layer fused")
    elif recipe.weights.format != "native":
        skipped.add(f"layer fused with {recipe.weights.format} weights: {FUSED_12BIT}")
    elif tokens > FUSED_LAYER_MAX_TOKENS:
        skipped.add(f"layer fused: up to {FUSED_LAYER_MAX_TOKENS} tokens a step, this step has {tokens}")
    elif verify_gain < MIN_GAIN:
        skipped.add(f"layer fused: the verify gap is {verify_gain:.1%} (below {MIN_GAIN:.0%})")
    else:
        out.append(Option({"layer": "fused"}, (
            f"layer fused: each layer of the {tokens}-token step in five Triton kernels (norms, RoPE, cache "
            f"write, attention merge and SwiGLU folded into the GEMVs) instead of ~13; "
            + "; ".join(_gap_text(g) for g in verify)), (0, -verify_gain)))
    # The fused layer runs every decode step of up to FUSED_LAYER_MAX_TOKENS tokens in its own kernels, so the
    # attention, linear and rmsnorm slots serve prefill only there: a candidate changing them changes no step (on the
    # H200 two such candidates took a round's budget, 2026-12-02). The accept slot works outside the layer.
    layer_slots_idle = recipe.layer == "fused" and view.cuda and tokens <= FUSED_LAYER_MAX_TOKENS
    if layer_slots_idle:
        skipped.add(f"attention, linear and rmsnorm kernels: the fused layer runs each {tokens}-token step in its own "
                    f"kernels (those slots serve prefill only)")
    if layer_slots_idle and tokens <= FUSED_LAYER_FMA_MAX_TOKENS:
        skipped.add(f"12-bit weights on the fused layer: {FUSED_12BIT}")
    for slot in ("attention", "linear", "rmsnorm", "accept"):
        if layer_slots_idle and slot != "accept":
            continue
        now = recipe.kernels.get(slot, KERNEL_DEFAULTS[slot])
        runnable = [i for i in IMPLEMENTATIONS[slot] if view.cuda or not needs_triton(slot, i)]
        if runnable == [now]:
            only_choice.append(f"{slot} {now}")
        for impl in IMPLEMENTATIONS[slot]:
            if impl == now:
                continue
            if needs_triton(slot, impl) and not view.cuda:
                cuda_only.append(f"{slot} {impl}")
                continue
            patch: dict = {"kernels": {slot: impl}}
            if slot == "attention":
                fused = impl != "builtin:math"
                p = view.predict(replace(dep, attention="sdpa" if fused else "math"), acc)
                gain = p.tokens_per_s / cur.tokens_per_s - 1.0
                if short_of_min_gain(skipped, gain, f"attention {impl}: the cost model predicts {gain:+.1%} tok/s "
                                                    f"against {now}"):
                    continue
                how = "one fused kernel per layer" if fused else "scores, softmax, weighted sum (3 kernels)"
                model = " (modelled like sdpa)" if impl == "builtin:triton" else ""
                out.append(Option(patch, (
                    f"attention {impl}: {how}{model}; the calibrated cost model's {_phases(p)} against "
                    f"{ms(cur.step_s)} with {now} (+{gain:.0%} tok/s)"), (0, -gain)))
            elif slot == "linear":
                if impl == "builtin:lossless12":
                    if view.dtype != "bf16":
                        skipped.add(f"linear {impl}: re-encodes bf16 weights only (this deployment is {view.dtype})")
                        continue
                    patch = {"kernels": {slot: impl}, "weights": {"format": "lossless12"}}
                    p = view.predict(replace(dep, bytes_per_param=LOSSLESS12_BYTES_PER_PARAM), acc)
                    gain = p.tokens_per_s / cur.tokens_per_s - 1.0
                    if short_of_min_gain(skipped, gain, f"linear {impl}: the cost model predicts {gain:+.1%} tok/s"):
                        continue
                    out.append(Option(patch, (
                        f"12-bit lossless weights (linear {impl}, weights.format lossless12): "
                        f"{LOSSLESS12_BYTES_PER_PARAM} instead of {dep.bytes_per_param:g} bytes a weight; the "
                        f"calibrated cost model's memory floor {ms(cur.memory_floor_s)} -> {ms(p.memory_floor_s)}, "
                        f"{_phases(p)} against {ms(cur.step_s)} (+{gain:.0%} tok/s)"), (0, -gain)))
                elif recipe.weights.format == "native":
                    continue  # builtin:torch is what a native-weight recipe already reads its weights with
                else:
                    patch = {"kernels": {slot: impl}, "weights": {"format": "native"}}
                    p = view.predict(replace(dep, bytes_per_param=2.0), acc)
                    gain = p.tokens_per_s / cur.tokens_per_s - 1.0
                    if short_of_min_gain(skipped, gain, f"native weights (linear {impl}): the cost model predicts "
                                                        f"{gain:+.1%} tok/s"):
                        continue
                    out.append(Option(patch, (
                        f"native bf16 weights (linear {impl}): the calibrated cost model's {_phases(p)} against "
                        f"{ms(cur.step_s)} with 12-bit weights (+{gain:.0%} tok/s)"), (0, -gain)))
            elif impl == "builtin:torch":
                continue  # back to torch from a fused kernel is no speed mechanism
            elif slot == "rmsnorm":
                if verify_gain < MIN_GAIN:
                    skipped.add(f"rmsnorm {impl}: the verify gap is {verify_gain:.1%} (below {MIN_GAIN:.0%})")
                    continue
                norms = 2 * shape.layers + 1 + (2 * shape.layers if shape.qk_norm else 0)
                out.append(Option(patch, (
                    f"rmsnorm {impl}: one kernel per RMSNorm instead of torch's chain of elementwise ops, {norms} "
                    f"norms a forward; " + "; ".join(_gap_text(g) for g in verify)), (1, -verify_gain)))
            elif slot == "accept":
                gain = max((g.get("gain", 0.0) for g in book), default=0.0)
                if not dep.k:
                    skipped.add(f"accept {impl}: no drafts to accept (k = 0)")
                    continue
                if short_of_min_gain(skipped, gain, f"accept {impl}: the bookkeeping gap is {gain:.1%}"):
                    continue
                out.append(Option(patch, (
                    f"accept {impl}: argmax over the {dep.k + 1}x{shape.vocab} verify logits, prefix match and "
                    f"count in one kernel; " + "; ".join(_gap_text(g) for g in book)), (1, -gain)))
    if only_choice:
        skipped.add(f"already at the only implementation that runs on {view.device}: {', '.join(only_choice)}")
    if cuda_only:
        skipped.add(f"Triton kernels need CUDA (this deployment runs on {view.device}): {', '.join(cuda_only)}")
    return sorted(out, key=lambda o: o.rank)
