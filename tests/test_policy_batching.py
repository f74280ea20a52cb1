"""The scheduler's batching options: batch.controller cost where the cost model prices speculation at the deployment's
batch below AR or the best draft length below k, batch.ragged where the measured draft availability leaves draft slots
empty; each left out with its reason otherwise. On the packaged SmolLM2 in fp32 on the calibrated 2-core Xeon."""
from __future__ import annotations

from dataclasses import asdict, replace

from specpilot.engine.recipe import load_recipe
from specpilot.graph.candidates import AgentContext
from specpilot.graph.providers.policy import MIN_GAIN, CostView, PolicyProvider
from specpilot.tools.profile.costmodel import expected_tokens
from test_costmodel_batching import CPU_SMOLLM2, SMOLLM2, XEON

HIGH = (0.5, 1.0, 1.0, 0.5)  # speculation wins at B = 1 and 8, loses at B = 32 on this CPU
LOW = (0.3, 0.5, 0.5, 0.5)


def cpu_profile(per_position=HIGH, availability: float | None = None) -> dict:
    acceptance = {"k": 4, "per_position": list(per_position), "tau": expected_tokens(4, list(per_position))}
    if availability is not None:
        acceptance["draft_availability"] = availability
    return {"meta": {"device": "cpu", "dtype": "float32", "batch_size": 1, "target": "smollm2-135m"},
            "acceptance": acceptance, "ceilings": asdict(XEON),
            "prediction": {"deployment": asdict(CPU_SMOLLM2) | {"model": asdict(SMOLLM2)}}, "gaps": []}


def context(prof: dict, batch: int, recipe: dict | None = None) -> AgentContext:
    deployment = {"device": "cpu", "dtype": "fp32", "batch_size": batch, "ceilings": prof["ceilings"]}
    return AgentContext("scheduler", deployment, recipe or asdict(load_recipe("stock")), prof, [], [], [], 5)


def proposed(prof: dict, batch: int, recipe: dict | None = None) -> tuple[dict, str]:
    """{patch as text: reason} of the batching candidates, and the policy's note when it proposed nothing."""
    policy = PolicyProvider()
    cands = policy.propose(context(prof, batch, recipe))
    batching = {str(c.recipe_patch): c.reason for c in cands if "controller" in c.recipe_patch.get("batch", {})}
    return batching, (policy.trail[-1]["why"] if not cands else "")


def predictions(prof: dict, batch: int):
    view = CostView.from_context({"device": "cpu", "batch_size": batch}, prof)
    dep = replace(view.dep, batch=batch)
    acc = list(view.per_position)
    return (view.predict(dep, acc), view.predict(replace(dep, controller="cost"), acc),
            view.predict(replace(dep, controller="cost", ragged=True), acc))


CONTROLLER = str({"batch": {"controller": "cost"}})
RAGGED = str({"batch": {"controller": "cost", "ragged": True}})


def test_controller_where_speculation_loses_at_the_batch():
    plain, controlled, _ = predictions(cpu_profile(HIGH), 32)
    assert plain.tokens_per_s < plain.ar_tokens_per_s  # 306 against 314 tok/s: the premise, on the real ceilings
    assert 0 < controlled.drafts < 4 and controlled.tokens_per_s > (1 + MIN_GAIN) * plain.tokens_per_s
    found, _ = proposed(cpu_profile(HIGH), 32)
    assert CONTROLLER in found
    reason = found[CONTROLLER]
    assert f"below AR here ({plain.tokens_per_s:.0f} against {plain.ar_tokens_per_s:.0f} tok/s)" in reason
    assert f"runs k'={controlled.drafts} ({controlled.tokens_per_s:.0f} against {plain.tokens_per_s:.0f}" in reason
    assert f"k'=0 (AR) {controlled.rates[0]:.0f}" in reason and "0.50, 1.00, 1.00, 0.50" in reason


def test_controller_runs_ar_at_low_acceptance():
    plain, controlled, _ = predictions(cpu_profile(LOW), 32)
    assert controlled.drafts == 0
    found, _ = proposed(cpu_profile(LOW), 32)
    assert "runs k'=0" in found[CONTROLLER] and "probes k=4" in found[CONTROLLER]


def test_no_controller_where_k_wins_or_for_one_row():
    plain, controlled, _ = predictions(cpu_profile(HIGH), 8)
    assert plain.tokens_per_s > plain.ar_tokens_per_s and controlled.drafts == 4
    found, why = proposed(cpu_profile(HIGH), 8)
    assert CONTROLLER not in found and "the cost model picks k'=4, the recipe's k" in why
    plain, _, _ = predictions(cpu_profile(HIGH), 1)
    assert plain.tokens_per_s > plain.ar_tokens_per_s  # speculation wins at B = 1 (56 against 38 tok/s)
    found, why = proposed(cpu_profile(HIGH), 1)
    assert found == {} and "one request at a time (B = 1)" in why
    # a deployment of 32 split into batches of one by the recipe decodes one row at a time too
    recipe = asdict(load_recipe("stock")) | {"batch": {"max_batch_size": 1}}
    found, _ = proposed(cpu_profile(HIGH), 32, recipe)
    assert found == {}


def test_ragged_with_low_measured_availability():
    prof = cpu_profile(HIGH, availability=0.6)
    _, controlled, ragged = predictions(prof, 8)
    # each kind of step short of k verifies more when packed; at k' = k every row already has k (the packing costs)
    assert all(ragged.rates[d] > 1.05 * controlled.rates[d] for d in (1, 2, 3))
    assert ragged.rates[4] < controlled.rates[4]
    assert ragged.tokens_per_s > (1 + MIN_GAIN) * controlled.tokens_per_s
    found, _ = proposed(prof, 8)
    reason = found[RAGGED]
    assert "only 60% of rows have a draft" in reason
    assert f"predicts {ragged.tokens_per_s:.0f} tok/s" in reason and f"{ragged.tokens_per_step:.2f} tokens" in reason
    assert f"against {expected_tokens(ragged.drafts, list(HIGH)):.2f} padded at the same k'" in reason
    # already controlled: ragged is still proposed, and priced against the controller alone
    recipe = asdict(load_recipe("stock")) | {"batch": {"controller": "cost"}}
    found, _ = proposed(prof, 8, recipe)
    assert list(found) == [RAGGED]
    assert f"(+{ragged.tokens_per_s / controlled.tokens_per_s - 1:.0%})" in found[RAGGED]


def test_no_ragged_when_every_row_has_drafts_or_availability_is_unmeasured():
    found, why = proposed(cpu_profile(HIGH, availability=1.0), 8)
    assert RAGGED not in found and "measured draft availability 1.00" in why and "at least 0.8" in why
    found, why = proposed(cpu_profile(HIGH), 8)
    assert RAGGED not in found and "does not measure draft availability" in why
    found, why = proposed(cpu_profile(HIGH, availability=0.6), 1)
    assert found == {}  # one row has no other row to hand its drafts to


FRACTIONS = str({"batch": {"controller": "cost", "fractions": [0.25, 0.5]}})


def fraction_options(batch: int, **recipe_keys) -> tuple[dict, list[str]]:
    """The scheduler's batch.fractions options for the stock recipe with `recipe_keys` at `batch`, deployed on CUDA
    (the Xeon's ceilings stand in: the option is unpriced): {patch: reason}, and the policy's skips."""
    from specpilot.engine.recipe import parse
    from specpilot.graph.providers.policy import Skips, _fraction_options

    prof = cpu_profile(HIGH)
    view = CostView.from_context({"device": "cuda:0", "batch_size": batch, "ceilings": prof["ceilings"]}, prof)
    recipe = parse(asdict(load_recipe("stock")) | recipe_keys)
    skipped = Skips()
    found = {str(o.patch): o.reason for o in _fraction_options(recipe, view, batch, "now", skipped)}
    return found, [str(s) for s in skipped]


def test_fractions_where_one_draft_a_row_crosses_a_threshold_of_the_fused_layer(monkeypatch):
    """On the fused layer (its FMA path up to 6 tokens, itself up to 32): at B = 4 one draft a row is 8 tokens (the
    tensor-core path) where a quarter or half a draft, 5-6 tokens, stays on the FMA path: proposed, unpriced, with the
    tokens of each fraction that fits, and among the scheduler's candidates. At B = 16 one draft a row (32 tokens)
    stays fused, at B = 8 too, and a fraction would not reach the FMA path; at B = 2, 32 and 64 no fraction fits. With
    the fused layer's limit at 24 (SPECPILOT_FUSED_MAX_TOKENS), B = 16's one draft a row (32 tokens) runs the modular
    layer and half a draft, 24 tokens, stays fused: proposed; on the modular layer none is."""
    from specpilot.graph.providers.policy import scheduler
    from specpilot.kernels import FUSED_LAYER_FMA_MAX_TOKENS, FUSED_LAYER_MAX_TOKENS

    assert (FUSED_LAYER_FMA_MAX_TOKENS, FUSED_LAYER_MAX_TOKENS) == (6, 32)  # (the premise)
    found, _ = fraction_options(4, layer="fused")
    reason = found[FRACTIONS]
    assert "8 tokens, past the FMA path's 6" in reason and "0.25 (1 draft, 5 tokens), 0.5 (2 drafts, 6 tokens)" in reason
    prof = cpu_profile(HIGH)
    deployment = {"device": "cuda:0", "dtype": "bf16", "batch_size": 4, "ceilings": prof["ceilings"]}
    recipe = asdict(load_recipe("stock")) | {"layer": "fused"}
    cands = PolicyProvider().propose(AgentContext("scheduler", deployment, recipe, prof, [], [], [], 5))
    assert FRACTIONS in {str(c.recipe_patch) for c in cands}
    for batch in (2, 8, 16, 32, 64):
        found, skipped = fraction_options(batch, layer="fused")
        assert not found and any("crosses none of the fused layer's thresholds (6, 32 tokens)" in s for s in skipped)
    monkeypatch.setattr(scheduler, "FUSED_LAYER_MAX_TOKENS", 24)
    found, _ = fraction_options(16, layer="fused")
    reason = found[FRACTIONS]
    assert "32 tokens, past the fused layer's 24" in reason
    assert "0.25 (4 drafts, 20 tokens), 0.5 (8 drafts, 24 tokens)" in reason and "evaluation measures it" in reason
    found, skipped = fraction_options(16, layer="modular")
    assert not found and any("which this recipe does not run" in s for s in skipped)
