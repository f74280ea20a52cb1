"""The scheduler agent's catalog (cuda_graphs, compile, compile_mode, overlap, batch): CUDA graphs, torch.compile and
its autotuned GEMMs, overlap, the batch size limit, and the batch's controller, ragged verification and fractions of a
draft a row."""
from __future__ import annotations

import math
from dataclasses import replace

from ....engine.recipe import Recipe
from ....kernels import FUSED_LAYER_FMA_MAX_TOKENS, FUSED_LAYER_MAX_TOKENS
from ....tools.profile.costmodel import Prediction, expected_tokens
from .catalog import MIN_GAIN, Option, Skips, _gap_text, _gaps_of
from .costview import CostView, ms, positions
from .recipes import _describe_current, agent_name

# Ragged verification is proposed only when at most this fraction of rows have drafts a step: above it few draft
# slots of a padded step are left empty, so there is little for packing to hand to other rows.
RAGGED_MAX_AVAILABILITY = 0.8


def scheduler_options(recipe: Recipe, view: CostView, gaps: list[dict], skipped: Skips | None = None) -> list[Option]:
    """CUDA graphs, compile (and its autotuning mode), overlap: CUDA-only switches, proposed only on CUDA; the batch
    size limit wherever the deployment's batch is split."""
    skipped = Skips() if skipped is None else skipped
    out: list[Option] = []
    dep = view.dep
    launch_gaps = [g for g in _gaps_of(gaps, "verify", "bookkeeping") if agent_name(g.get("agent", "")) == "scheduler"]
    launch_gain = max((g.get("gain", 0.0) for g in launch_gaps), default=0.0)
    if not view.cuda:
        skipped.add(f"CUDA graphs, torch.compile, autotuned GEMMs and overlap are proposed on CUDA only (this "
                    f"deployment runs on {view.device})")
    if view.cuda and not recipe.cuda_graphs:
        eager, graphed = view.predict(replace(dep, cuda_graphs=False), list(view.per_position)), \
            view.predict(replace(dep, cuda_graphs=True), list(view.per_position))
        gain = graphed.tokens_per_s / eager.tokens_per_s - 1.0
        kernels = eager.draft.kernels + eager.verify.kernels + eager.bookkeeping.kernels
        if gain >= MIN_GAIN:
            out.append(Option({"cuda_graphs": True}, (
                f"CUDA graphs: the calibrated cost model's step drops from {ms(eager.step_s)} eager to "
                f"{ms(graphed.step_s)} replayed (+{gain:.0%} tok/s): {kernels} kernels a step at "
                f"{view.dev.launch_s * 1e6:.1f} us launched against {view.dev.graph_node_s * 1e6:.1f} us as graph "
                f"nodes (calibrated)"), (-gain,)))
        else:
            skipped.add(f"CUDA graphs: the cost model predicts {gain:+.0%} tok/s (below {MIN_GAIN:.0%})")
    if view.cuda and not recipe.compile and launch_gain >= MIN_GAIN:
        out.append(Option({"compile": True}, (
            "torch.compile fuses each layer's elementwise kernels: the step is launch-bound, "
            + "; ".join(_gap_text(g) for g in launch_gaps)), (-launch_gain,)))
    elif view.cuda and not recipe.compile:
        skipped.add(f"torch.compile: no launch-bound gap of {MIN_GAIN:.0%} (largest {launch_gain:.1%})")
    if view.cuda and recipe.compile_mode == "default":
        # GEMMs below their memory or compute floor (the kernel-writer's gaps): what autotuned templates address
        gemm_gaps = [g for g in gaps or [] if agent_name(g.get("agent", "")) == "kernel_writer"
                     and (str(g.get("component", "")).startswith("kernel aten::") or g.get("component") == "verify")]
        gain = max((g.get("gain", 0.0) for g in gemm_gaps), default=0.0)
        if gain >= MIN_GAIN and launch_gain > gain:
            # A launch-bound step's small GEMMs take their launch's time, which no template shortens
            skipped.add(f"autotuned GEMMs: the step is launch-bound ({launch_gain:.0%} against the GEMMs' "
                        f"{gain:.0%}): a GEMM's time there is its launch")
        elif gain >= MIN_GAIN:
            out.append(Option({"compile": True, "compile_mode": "max-autotune-no-cudagraphs"}, (
                "autotuned GEMM templates (compile_mode max-autotune-no-cudagraphs) for the step's small GEMMs: "
                + "; ".join(_gap_text(g) for g in gemm_gaps[:3])), (1, -gain)))
            # (last of the scheduler's: its evaluation autotunes every GEMM shape first, 1 min 48 s of a 6.5-minute
            # budget on the H200 for SmolLM2's code run of 2026-12-02, where the other candidates took 45 s each)
        else:
            skipped.add(f"autotuned GEMMs: no GEMM gap of {MIN_GAIN:.0%} (largest {gain:.1%})")
    if view.cuda and not recipe.overlap:
        idle = _gaps_of(gaps, "idle", "host_sync")
        gain = max((g.get("gain", 0.0) for g in idle), default=0.0)
        if gain >= MIN_GAIN:
            out.append(Option({"overlap": True}, (
                "overlap: the host reads step i's tokens while the device runs step i+1, hiding "
                + "; ".join(_gap_text(g) for g in idle)), (-gain,)))
        else:
            skipped.add(f"overlap: idle and host-sync gaps below {MIN_GAIN:.0%} (largest {gain:.1%})")
    if view.cuda:
        on = [name for name, is_on in (("CUDA graphs", recipe.cuda_graphs), ("torch.compile", recipe.compile),
                                       ("overlap", recipe.overlap)) if is_on]
        if on:
            skipped.add(f"already on: {', '.join(on)}")
    if recipe.batch.max_batch_size < view.batch:
        n, b = recipe.batch.max_batch_size, view.batch
        split = view.predict(replace(dep, batch=n), list(view.per_position))
        whole = view.predict(replace(dep, batch=b), list(view.per_position))
        gain = whole.tokens_per_s / split.tokens_per_s - 1.0
        if gain >= MIN_GAIN:
            out.append(Option({"batch": {"max_batch_size": b}}, (
                f"batch.max_batch_size {n} splits the deployment's {b} requests into {math.ceil(b / n)} sequential "
                f"batches: the calibrated cost model predicts {whole.tokens_per_s:.0f} tok/s decoding all {b} "
                f"together against {split.tokens_per_s:.0f} tok/s at {n} (+{gain:.0%})"), (-gain,)))
        else:
            skipped.add(f"batch.max_batch_size: the cost model predicts {gain:+.0%} tok/s decoding all {b} requests "
                        f"together (below {MIN_GAIN:.0%})")
    else:
        skipped.add(f"batch.max_batch_size {recipe.batch.max_batch_size} already covers the deployment's batch of "
                    f"{view.batch}")
    out += batching_options(recipe, view, skipped)
    return sorted(out, key=lambda o: o.rank)


def _rates(p: Prediction) -> str:
    """The controller's predicted tokens/s per kind of step."""
    return ", ".join(f"k'={d}{' (AR)' if d == 0 else ''} {r:.0f}" for d, r in sorted(p.rates.items()))


# The batch controller's kinds below one draft a row that the scheduler proposes (batch.fractions)
BATCH_FRACTIONS = (0.25, 0.5)


def batching_options(recipe: Recipe, view: CostView, skipped: Skips) -> list[Option]:
    """The batch-level controller (batch.controller cost) and ragged verification (batch.ragged), priced by the cost
    model at the deployment's batch with the measured per-position acceptance (and, for ragged, the measured draft
    availability). Both concern a batch: at B = 1 the algorithm agent's k and AR options cover the one row. B is what
    the engine decodes together: the deployment's batch, or batch.max_batch_size where that splits it."""
    dep, b = view.dep, min(view.batch, recipe.batch.max_batch_size)
    if recipe.drafter.kind == "none" or dep.drafter_kind == "none":
        skipped.add("batch.controller and batch.ragged choose among draft lengths: the recipe has no drafter")
        return []
    if b <= 1:
        skipped.add("batch.controller and batch.ragged: the recipe decodes one request at a time (B = 1); the "
                    "algorithm agent's k and AR options cover a single row")
        return []
    if not view.per_position:
        skipped.add("batch.controller and batch.ragged: no acceptance measured per position to price them")
        return []
    acc = list(view.per_position)
    at_batch = replace(dep, batch=b)
    now_controller, now_ragged = recipe.batch.controller, recipe.batch.ragged
    cur = view.predict(replace(at_batch, controller=now_controller, ragged=now_ragged), acc)
    plain = view.predict(replace(at_batch, controller="none", ragged=False), acc)
    controlled = view.predict(replace(at_batch, controller="cost", ragged=False), acc)
    now = f"{_describe_current(recipe)} at B={b}"
    out: list[Option] = []

    if now_controller == "cost":
        skipped.add("batch.controller already cost")
    else:
        gain = controlled.tokens_per_s / cur.tokens_per_s - 1.0
        losing = plain.tokens_per_s < plain.ar_tokens_per_s
        if controlled.drafts == dep.k:
            skipped.add(f"batch.controller cost: at B={b} the cost model picks k'={dep.k}, the recipe's k, for every "
                        f"step ({_rates(controlled)} tok/s)")
        elif gain < MIN_GAIN:
            skipped.add(f"batch.controller cost: the cost model predicts {gain:+.1%} tok/s at B={b} (k'="
                        f"{controlled.drafts}; below {MIN_GAIN:.0%})")
        else:
            verdict = (f"speculation at k={dep.k} is predicted below AR here ({plain.tokens_per_s:.0f} against "
                       f"{plain.ar_tokens_per_s:.0f} tok/s)" if losing else
                       f"k={dep.k} is not the best draft length here")
            probe = (f"; after {recipe.batch.probe_every} AR steps in a row it probes k={dep.k}, to notice when "
                     f"acceptance comes back (less often while probes do not pay)" if controlled.drafts == 0 else "")
            out.append(Option({"batch": {"controller": "cost"}}, (
                f"batch.controller cost for {now}: {verdict}; with the measured per-position acceptance "
                f"{positions(acc)} the calibrated cost model's rate per kind of step is {_rates(controlled)} tok/s, "
                f"so the controller runs k'={controlled.drafts} ({controlled.tokens_per_s:.0f} against "
                f"{cur.tokens_per_s:.0f} tok/s now, +{gain:.0%}){probe}"), (-gain,)))

    if now_ragged:
        skipped.add("batch.ragged already on")
    elif view.availability is None:
        skipped.add(f"batch.ragged: the profile does not measure draft availability (acceptance.draft_availability); "
                    f"the first position's acceptance {acc[0]:.2f} only bounds it below")
    elif view.availability >= RAGGED_MAX_AVAILABILITY:
        skipped.add(f"batch.ragged: the measured draft availability {view.availability:.2f} (rows with at least one "
                    f"draft a step) is at least {RAGGED_MAX_AVAILABILITY}: few draft slots are left empty to hand on")
    else:
        ragged = view.predict(replace(at_batch, controller="cost", ragged=True), acc)
        gain = ragged.tokens_per_s / cur.tokens_per_s - 1.0
        if gain < MIN_GAIN:
            skipped.add(f"batch.ragged: the cost model predicts {gain:+.1%} tok/s at B={b} with a measured draft "
                        f"availability of {view.availability:.2f} (below {MIN_GAIN:.0%})")
        else:
            # the rows with drafts split the step's drafts: about k'/p each (p at least a_1, as the cost model takes it)
            share = min(dep.k, ragged.drafts / max(view.availability, acc[0]))
            out.append(Option({"batch": {"controller": "cost", "ragged": True}}, (
                f"batch.ragged with the cost controller for {now}: only {view.availability:.0%} of rows have a "
                f"draft a step (measured), so a padded step leaves the others' draft slots empty; packed, a step of "
                f"k'={ragged.drafts} gives its {ragged.drafts}x{b} drafts to those rows (about {share:.1f} each, up "
                f"to {dep.k}): {ragged.tokens_per_step:.2f} tokens a row-step from the measured per-position "
                f"acceptance {positions(acc)}, against {expected_tokens(ragged.drafts, acc):.2f} padded at the same "
                f"k'; the calibrated cost model predicts {ragged.tokens_per_s:.0f} tok/s "
                f"({_rates(ragged)}) against {controlled.tokens_per_s:.0f} with the controller alone and "
                f"{cur.tokens_per_s:.0f} now (+{gain:.0%})"), (-gain,)))
    return out + _fraction_options(recipe, view, b, now, skipped)


def _fraction_options(recipe: Recipe, view: CostView, b: int, now: str, skipped: Skips) -> list[Option]:
    """batch.fractions (the controller's kinds below one draft a row, packed), unpriced: where a step of one draft a
    row (2B tokens) crosses one of the fused layer's thresholds (its FMA path's FUSED_LAYER_FMA_MAX_TOKENS, its own
    FUSED_LAYER_MAX_TOKENS) and a fraction's B(1 + f) tokens stay below it. The cost model prices every width on one
    roofline, so the evaluation measures it."""
    if recipe.batch.fractions:
        skipped.add("batch.fractions already set")
        return []
    if recipe.verification != "chain":
        skipped.add("batch.fractions: they pack a chain's drafts; this recipe verifies a tree")
        return []
    if recipe.layer != "fused" or not view.cuda:
        skipped.add("batch.fractions: they keep a verifying step on the fused layer's cheaper path (CUDA), which "
                    "this recipe does not run")
        return []
    # (threshold, what a step past it runs, and what that cost, measured)
    thresholds = ((FUSED_LAYER_FMA_MAX_TOKENS, "the FMA path", "the tensor-core path (at B = 4, 8 tokens cost 1.6 AR "
                   "steps on the H200; thirty-fourth lease)"),
                  (FUSED_LAYER_MAX_TOKENS, "the fused layer", "the modular layer (at B = 16, 48 and 64 tokens 1.38 "
                   "and 1.56 ms in the loop against AR's 0.87 on the H100; forty-second lease)"))
    for limit, kept, past in thresholds:
        fit = [f for f in BATCH_FRACTIONS if 1 <= round(f * b) and b < limit < 2 * b and b + round(f * b) <= limit]
        if fit:
            break
    else:
        skipped.add(f"batch.fractions: at B={b} a step of one draft a row ({2 * b} tokens) crosses none of the fused "
                    f"layer's thresholds ({FUSED_LAYER_FMA_MAX_TOKENS}, {FUSED_LAYER_MAX_TOKENS} tokens) that a "
                    f"fraction of a draft a row stays below")
        return []
    steps = ", ".join(f"{f} ({round(f * b)} draft{'s' if round(f * b) > 1 else ''}, {b + round(f * b)} tokens)"
                      for f in fit)
    return [Option({"batch": {"controller": "cost", "fractions": list(BATCH_FRACTIONS)}}, (
        f"batch.fractions {list(BATCH_FRACTIONS)} with the cost controller for {now}: a step verifying one draft a "
        f"row has {2 * b} tokens, past {kept}'s {limit}, so it runs {past}, where {steps} stay on {kept}; the "
        f"cost model prices every width on one roofline, so the evaluation measures it"), (1, 0.0, 0, False))]
