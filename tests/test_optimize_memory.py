"""Memory across `specpilot optimize` runs (issue #7): a second run on a similar deployment reaches the first run's
recipe in fewer rounds, because round 1 tries first what worked there and skips what failed there, and its report
says so.

Two runs on test_optimize.py's tiny model share one Chroma memory: the first on the code workload, the second on
chat (the same model, device, dtype and batch: a similar deployment, not the same one). Everything is the real
graph: profiler, router, the policy provider's memory handling, the token-forcing gate, the bench, the memory store,
the report. Two things are fixed so that the rounds do not depend on a shared CPU's clock:

- the catalog. The policy ranks its catalog by the cost model on the profile's measured timings; here it is a fixed
  list, in the order a provider without memory proposes it, one a round: the target's first layer as a self-draft
  with 1 draft, then with 8 drafts;
- the speed. Each bench system's tok/s is replaced by its tokens per target forward (tau, the bench's own
  mean_accepted from the real decode: deterministic under greedy decoding). On the tiny model a 1-draft self-draft
  gets fewer tokens a forward than stock's n-gram (code 1.20 vs 1.48, chat 1.25 vs 1.25): not faster; 8 drafts get
  more (code 1.68, chat 1.42): a win on both workloads. Two measurements of one recipe agree exactly, so the noise
  a win must beat is 0.
"""
from __future__ import annotations

import io
import json
from dataclasses import asdict

import pytest

from test_optimize import SMALL, tiny  # noqa: F401 (tiny: the module's tiny-model fixture)
from specpilot.engine.recipe import load_recipe
from specpilot.graph.candidates import AgentContext, Candidate
from specpilot.graph.providers.policy import Option, PolicyProvider, recipe_effect
from specpilot.graph.run import load_state, optimize
from specpilot.memory import open_memory

ONE_DRAFT = {"drafter": {"kind": "layerskip", "layers": 1}, "k": 1}
EIGHT_DRAFTS = {"drafter": {"kind": "layerskip", "layers": 1}, "k": 8}


class FixedCatalogPolicy(PolicyProvider):
    """The policy provider (its routing, memory first, failures skipped) with a fixed algorithm catalog."""

    name = "policy-fixed-catalog"

    @staticmethod
    def catalog(agent, recipe, view, gaps, skipped=None):
        if agent != "algorithm":
            return []
        return [Option(ONE_DRAFT, "self-draft with the first layer, 1 draft a step", (0,)),
                Option(EIGHT_DRAFTS, "self-draft with the first layer, 8 drafts a step", (1,))]


@pytest.fixture
def tau_clock(monkeypatch):
    """Every bench the graph makes (start, candidates) timed in target forwards: tok/s := tau (module docstring)."""
    from specpilot.graph import evaluate, measure, nodes

    def bench(settings, recipes, out_dir):
        result, seconds = measure.bench(settings, recipes, out_dir)
        if result["ok"]:
            systems = result["systems"]
            ar, stock = systems["ar"]["mean_accepted"], systems["stock"]["mean_accepted"]
            for run in systems.values():
                tau = run["mean_accepted"]
                run.update(tokens_per_s=tau, speedup_vs_ar=tau / ar, speedup_vs_stock=tau / stock)
        return result, seconds

    monkeypatch.setattr(nodes, "bench", bench)
    monkeypatch.setattr(evaluate, "bench", bench)


def engine_of(path) -> str:
    """What an engine runs with a recipe file (drafter, k, kernels, weights, switches), not its name or numbers."""
    return recipe_effect(load_recipe(path))


def test_second_run_on_a_similar_deployment_reaches_the_recipe_sooner(tiny, tmp_path, tau_clock):
    one, eight = Candidate("algorithm", "x", ONE_DRAFT).id, Candidate("algorithm", "x", EIGHT_DRAFTS).id
    memory_path = tmp_path / "memory"
    runs = {}
    for name, workload in (("first", "code"), ("second", "chat")):
        out = tmp_path / name
        s = dict(SMALL, target=tiny, out_dir=str(out), workload=workload, budget_rounds=2, max_candidates=1)
        with open_memory(memory_path) as mem:
            err = io.StringIO()
            assert optimize(s, stderr=err, provider=FixedCatalogPolicy(), memory=mem) == 0, err.getvalue()[-3000:]
        runs[name] = (out, load_state(out), (out / "report.md").read_text())

    # run 1, no memory: the 1-draft self-draft in round 1 (not faster), the 8-draft one in round 2 (the recipe)
    out1, state1, report1 = runs["first"]
    recipe1 = load_recipe(out1 / "recipe.json").measured
    assert [(c["round"], c["id"], c["origin"]) for c in sorted(state1["candidates"].values(),
                                                               key=lambda c: c["round"])] == \
        [(1, one, FixedCatalogPolicy.name), (2, eight, FixedCatalogPolicy.name)]
    assert state1["evaluations"][one]["failure"].startswith("not faster")
    assert recipe1["source"] == eight and recipe1["round"] == 2 and recipe1["gate"]["passed"] is True
    assert recipe1["speedup_vs_stock"] > 1.02
    assert "Memory (outcomes on similar deployments)" not in report1

    # run 2, a similar deployment: memory's win is proposed first in round 1 and is the recipe from round 1 on
    out2, state2, report2 = runs["second"]
    recipe2 = load_recipe(out2 / "recipe.json").measured
    assert engine_of(out2 / "recipe.json") == engine_of(out1 / "recipe.json")  # the same engine
    assert recipe2["source"] == eight and recipe2["gate"]["passed"] is True
    assert recipe2["round"] == 1 < recipe1["round"]  # reached in fewer rounds
    round1 = json.loads((out2 / "rounds" / "1" / "proposals-algorithm-0.json").read_text())
    [first] = round1["candidates"]
    assert first["id"] == eight and first["origin"] == "memory"
    assert first["reason"].startswith("memory: passed on llama fp32") and "code workload" in first["reason"]
    # what failed in run 1 is never proposed in run 2, and each round says why it was left out
    assert one not in state2["candidates"]
    for n in (1, 2):
        [skipped] = [t for t in state2["trail"] if t["round"] == n and t["who"] == "memory"]
        assert skipped["node"] == "algorithm" and skipped["decision"].startswith(f"{one} not proposed")
        assert skipped["why"].startswith("failed on llama fp32") and "code workload: not faster" in skipped["why"]
    # the report says both
    assert f"- tried first: {eight} (algorithm), because it passed on llama fp32" in report2
    assert f"- algorithm: {one} not proposed: " in report2 and "code workload: not faster" in report2

    # memory is what made the difference: the same provider on run 2's first profile, from stock, proposes the
    # 1-draft self-draft first without memory, and the 8-draft one (only) with memory's hits
    profile = json.loads((out2 / "rounds" / "1" / "profile" / "profile.json").read_text())
    stock = asdict(load_recipe("stock"))
    with open_memory(memory_path) as mem:
        hits = [h.to_dict() for h in mem.similar(state2["deployment"], k=10)]
        # run 1's two outcomes and its best as one change of stock, run 2's one and its best
        assert mem.count() == 5
        wholes = [o for _, o in mem.records() if (o.extra or {}).get("status") == "best"]
        assert [o.candidate["recipe_patch"] for o in wholes] == [EIGHT_DRAFTS, EIGHT_DRAFTS]
    ctx = lambda hits: AgentContext("algorithm", state2["deployment"], stock, profile, profile["gaps"], hits, [], 1)
    assert [c.id for c in FixedCatalogPolicy().propose(ctx([]))] == [one]
    assert [c.id for c in FixedCatalogPolicy().propose(ctx(hits))] == [eight]
