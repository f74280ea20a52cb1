"""An agent that proposes nothing says why: the policy's reason names what kept each catalog entry out, and the
optimize trail's "proposed 0 candidate(s)" line carries it. On a profile shaped like the packaged SmolLM2's on a
CPU (fp32, stock recipe, a 236% verify gap routed to the kernel-writer), as in the run the issue quotes."""
from __future__ import annotations

from dataclasses import asdict

import pytest

from specpilot.engine.recipe import load_recipe
from specpilot.graph.candidates import AgentContext
from specpilot.graph.context import RunContext, propose
from specpilot.graph.providers.policy import PolicyProvider
from specpilot.tools.profile.costmodel import Deployment, DeviceCeilings, ModelShape, expected_tokens

SMOLLM2 = ModelShape(vocab=49152, hidden=576, intermediate=1536, layers=30, heads=9, kv_heads=3, head_dim=64)
CPU = DeviceCeilings("a 2-core CPU", 3.0e10, 3.2e11, 2e-6, 2e-6, 5e-6)


def cpu_profile(per_position=(0.5, 1.0, 1.0, 0.5)) -> dict:
    dep = Deployment(SMOLLM2, bytes_per_param=4, dtype_bytes=4, k=4, drafter_kind="ngram", cuda_graphs=False,
                     kernels_per_target_forward=1962, kernels_per_draft_forward=97, kernels_bookkeeping=28)
    gaps = [
        {"component": "verify", "measured_s": 0.064, "floor_s": 0.018, "gap_s": 0.046, "gain": 2.36,
         "agent": "kernel-writer", "reason": "at 28% of its memory floor"},
        {"component": "bookkeeping", "measured_s": 0.00076, "floor_s": 0.00003, "gap_s": 0.00073, "gain": 0.011,
         "agent": "kernel-writer", "reason": "at 4% of its memory floor"},
        {"component": "idle", "measured_s": 0.00008, "floor_s": 0.0, "gap_s": 0.00008, "gain": 0.001,
         "agent": "scheduler", "reason": "host work between steps"},
    ]
    tau = expected_tokens(4, list(per_position))
    return {"meta": {"device": "cpu", "dtype": "float32", "batch_size": 1, "target": "smollm2-135m"},
            "acceptance": {"k": 4, "per_position": list(per_position), "tau": tau},
            "ceilings": asdict(CPU),
            "prediction": {"deployment": asdict(dep) | {"model": asdict(SMOLLM2)}},
            "gaps": gaps}


def context(agent: str, prof: dict, tried=()) -> AgentContext:
    deployment = {"device": "cpu", "dtype": "fp32", "batch_size": 1, "ceilings": prof["ceilings"]}
    return AgentContext(agent, deployment, asdict(load_recipe("stock")), prof,
                        [g for g in prof["gaps"] if g["agent"].replace("-", "_") == agent], [], list(tried), 3)


def test_kernel_writer_on_cpu_says_why_it_proposes_nothing():
    policy = PolicyProvider()
    ctx = context("kernel_writer", cpu_profile())
    found, who, note, kept_out = propose(RunContext(policy, None), ctx)
    assert found == [] and who == "policy" and kept_out == []
    assert note.startswith("policy: nothing to propose: ")
    # what is actually true of the catalog on a CPU: the Triton kernels need CUDA, rmsnorm and accept have only
    # their torch implementation here, and the one CPU alternative (sdpa attention) is priced below 2%
    assert "Triton kernels need CUDA (this deployment runs on cpu)" in note
    assert "rmsnorm builtin:triton" in note and "accept builtin:triton" in note and "layer fused" in note
    assert "already at the only implementation that runs on cpu: " in note and "rmsnorm builtin:torch" in note
    assert "attention builtin:sdpa: the cost model predicts" in note and "(below 2%)" in note


def test_scheduler_on_cpu_says_its_switches_are_cuda_only():
    found, who, note, _ = propose(RunContext(PolicyProvider(), None), context("scheduler", cpu_profile()))
    assert found == []
    assert "proposed on CUDA only (this deployment runs on cpu)" in note
    assert "already covers the deployment's batch of 1" in note


def test_everything_already_tried_is_the_reason():
    """The algorithm agent, round after round, with every candidate it proposed before evaluated: once the catalog
    is used up it proposes nothing, and says that what is left was tried."""
    prof, tried, policy = cpu_profile(per_position=(0.9, 0.9, 0.9, 0.9)), [], PolicyProvider()
    for _ in range(40):
        found = policy.propose(context("algorithm", prof, tried=tried))
        if not found:
            break
        assert not {c.id for c in found} & set(tried)
        tried += [c.id for c in found]
    assert tried and not found
    note = policy.trail[-1]
    assert note["source"] == "policy" and "already tried in this run" in note["why"]


def test_a_profile_without_a_deployment_is_a_reason_too():
    prof = cpu_profile()
    del prof["prediction"]
    policy = PolicyProvider()
    assert policy.propose(context("kernel_writer", prof)) == []
    assert "no cost-model deployment or calibrated ceilings" in policy.trail[-1]["why"]


def test_proposing_something_adds_no_note():
    policy = PolicyProvider()
    assert policy.propose(context("algorithm", cpu_profile(per_position=(0.9, 0.9, 0.9, 0.9))))
    assert not [n for n in policy.trail if n["source"] == "policy"]


def test_the_algorithm_agent_drafts_with_a_head_the_deployment_has(tmp_path, tiny_model_dir):
    """With a head given (optimize --head DIR; the deployment's drafter_heads), the algorithm agent proposes an EAGLE-3
    chain of k = 3 with it first, its break-even acceptance from the head's own shape in the reason; without one, no
    EAGLE-3 candidate; a head directory without a config.json is named among what was left out."""
    import json

    from specpilot.graph.providers.policy import CostView, Skips, algorithm_options

    from eagle3_head import head_config
    from transformers import AutoConfig

    target_config = AutoConfig.from_pretrained(tiny_model_dir("llama"))
    cfg = head_config(target_config) | {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
                                        "num_key_value_heads": 3, "head_dim": 64, "draft_vocab_size": 8192}
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text(json.dumps(cfg))
    prof = cpu_profile()
    recipe = load_recipe("stock")
    deployment = {"device": "cpu", "dtype": "fp32", "batch_size": 1, "ceilings": prof["ceilings"]}
    plain = algorithm_options(recipe, CostView.from_context(deployment, prof))
    assert not [o for o in plain if o.patch.get("drafter", {}).get("kind") == "eagle3"]
    skipped = Skips()
    view = CostView.from_context(deployment | {"drafter_heads": [str(head), str(tmp_path / "none")]}, prof)
    options = sorted(algorithm_options(recipe, view, skipped), key=lambda o: o.rank)
    eagle = [o for o in options if o.patch.get("drafter", {}).get("kind") == "eagle3"]
    assert len(eagle) == 1 and eagle[0].patch["drafter"]["model"] == str(head) and eagle[0].patch["k"] == 3
    assert "per-token rate above" in eagle[0].reason
    untried = [o for o in options if o.rank[0] == 2]
    assert untried and untried[0] is eagle[0]  # the head the user gave first, before unmeasured n-gram settings
    assert any("no readable config.json" in why for why in skipped)


def test_on_a_synthetic_target_the_algorithm_agent_replays_the_given_acceptance():
    """A synthetic target (random weights) with optimize --acceptance: the algorithm agent proposes only replayed
    chains of k = 1..n at a_1..a_k, each a valid recipe drafted at a random head's cost and ranked by the cost model's
    tok/s from that acceptance; no drafter that reads the target's text (its text is noise), and it says so. Without
    --acceptance nothing drafts; at an acceptance too low to pay, nothing replays either, with the reason."""
    from specpilot.graph.providers.policy import CostView, Skips, algorithm_options, apply_patch

    # the current recipe, stock's n-gram drafter, found little in the synthetic target's text
    prof, recipe = cpu_profile(per_position=(0.1, 0.1, 0.1, 0.1)), load_recipe("stock")
    deployment = {"device": "cpu", "dtype": "fp32", "batch_size": 1, "ceilings": prof["ceilings"], "synthetic": True}
    bar = [0.82, 0.672, 0.551, 0.452]
    skipped = Skips()
    options = algorithm_options(recipe, CostView.from_context(deployment | {"replay_acceptance": bar}, prof), skipped)
    drafting = [o for o in options if o.patch.get("drafter", {}).get("kind") not in (None, "none")]
    assert drafting and {o.patch["drafter"]["kind"] for o in drafting} == {"replay"}
    for o in drafting:
        k = o.patch["k"]
        assert o.patch["drafter"]["acceptance"] == bar[:k] and o.patch["drafter"]["model"] == "random-eagle3"
        assert apply_patch(asdict(recipe), o.patch).drafter.kind == "replay"  # a recipe the engine takes
    gains = [-o.rank[1] for o in drafting]
    assert gains == sorted(gains, reverse=True) and gains[0] >= 0.02
    assert any("synthetic" in why and "noise" in why for why in skipped)

    none = Skips()
    assert not [o for o in algorithm_options(recipe, CostView.from_context(deployment, prof), none)
                if o.patch.get("drafter", {}).get("kind") not in (None, "none")]
    assert any("--acceptance" in why for why in none)

    low = Skips()
    poor = CostView.from_context(deployment | {"replay_acceptance": [0.02, 0.01]}, prof)
    assert not [o for o in algorithm_options(recipe, poor, low) if o.patch.get("drafter", {}).get("kind") == "replay"]
    assert any(why.startswith("replayed chains: 2 of k = 1-2") for why in low)


def test_cumulative_acceptance_becomes_per_position():
    from specpilot.graph.providers.policy import conditional

    assert conditional([0.8, 0.4, 0.2, 0.0]) == pytest.approx([0.8, 0.5, 0.5, 0.0])
    assert conditional([0.0, 0.0]) == [0.0, 0.0]


def test_the_packaged_target_brings_its_head_to_the_algorithm_agent(tmp_path):
    """optimize on smollm2-135m (its alias, or its GGUF anywhere: a staged copy is known by its sha256) hands the
    agents the head that ships with it (docs/TRAINING.md), which the algorithm agent proposes by its alias, its shape
    read from the package; another model brings none."""
    from specpilot.engine import packaged
    from specpilot.engine.loader import packaged_heads
    from specpilot.graph.nodes import _heads
    from specpilot.graph.providers.policy import CostView, algorithm_options, head_shape

    assert packaged_heads("smollm2-135m") == ["smollm2-135m-eagle3"]
    assert packaged_heads(str(packaged.path())) == ["smollm2-135m-eagle3"]
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF not the packaged one")
    assert packaged_heads(str(other)) == [] and packaged_heads(str(tmp_path)) == []
    assert _heads({"target": "smollm2-135m", "heads": None}) == ["smollm2-135m-eagle3"]
    assert _heads({"target": "smollm2-135m", "heads": ["smollm2-135m-eagle3"]}) == ["smollm2-135m-eagle3"]
    shape = head_shape("smollm2-135m-eagle3")
    assert (shape.vocab, shape.hidden, shape.layers) == (8192, 576, 1)
    prof = cpu_profile()
    deployment = {"device": "cpu", "dtype": "fp32", "batch_size": 1, "ceilings": prof["ceilings"],
                  "drafter_heads": ["smollm2-135m-eagle3"]}
    options = algorithm_options(load_recipe("stock"), CostView.from_context(deployment, prof))
    eagle = [o for o in options if o.patch.get("drafter", {}).get("kind") == "eagle3"]
    assert [o.patch["drafter"]["model"] for o in eagle] == ["smollm2-135m-eagle3"]


def test_a_recipe_drafting_with_a_head_is_tuned_by_length_and_tree():
    """Once the recipe drafts with an EAGLE-3 head, the algorithm agent tries its draft length one shorter and one
    longer and an EAGLE-2 tree of its depth. On a CPU (modular layer) the lengths are priced with the head's measured
    acceptance; on the fused layer (CUDA) the cost model cannot price the FMA path's per-token verify, so the shorter
    length comes first, unpriced; the tree keeps a step within the fused layer's tokens. Every patch is a recipe the
    engine takes."""
    from specpilot.graph.providers.policy import CostView, HEAD_TREE_TOPK, Skips, algorithm_options, apply_patch

    head = ModelShape(vocab=8192, hidden=576, intermediate=1536, layers=1, heads=9, kv_heads=3, head_dim=64,
                      tied_embeddings=False)
    dep = Deployment(SMOLLM2, bytes_per_param=2, dtype_bytes=2, k=3, drafter_kind="eagle3", drafter_model=head,
                     cuda_graphs=True)
    per_position = [0.7, 0.55, 0.45]
    prof = {"meta": {"device": "cuda", "dtype": "bfloat16", "batch_size": 1, "target": "smollm2-135m"},
            "acceptance": {"k": 3, "per_position": per_position, "tau": expected_tokens(3, per_position)},
            "ceilings": asdict(CPU), "prediction": {"deployment": asdict(dep) | {"model": asdict(SMOLLM2)}},
            "gaps": []}
    base = {"drafter": {"kind": "eagle3", "model": "smollm2-135m-eagle3"}, "k": 3}
    for device, layer in (("cpu", "modular"), ("cuda", "fused")):
        recipe = apply_patch(asdict(load_recipe("stock")), base | {"layer": layer})
        deployment = {"device": device, "dtype": "bf16", "batch_size": 1, "ceilings": prof["ceilings"]}
        skipped = Skips()
        options = algorithm_options(recipe, CostView.from_context(deployment, prof), skipped)
        lengths = [o for o in options if set(o.patch) == {"k"}]
        trees = [o for o in options if o.patch.get("verification") == "tree"]
        for o in lengths + trees:
            assert apply_patch(asdict(recipe), o.patch).drafter.kind == "eagle3"
        if layer == "fused":
            assert [o.patch["k"] for o in sorted(lengths, key=lambda o: o.rank)] == [2, 4]
            assert all("FMA path" in o.reason for o in lengths)
        else:
            assert all(o.rank[1] < 0 for o in lengths)  # priced: a gain, or left out with the cost model's figure
            left_out = {k for k in (2, 4) if any(f"k={k}: the cost model predicts" in why for why in skipped)}
            assert {o.patch["k"] for o in lengths} | left_out == {2, 4}
        for o in trees:
            tree = apply_patch(asdict(recipe), o.patch).tree
            assert tree.kind == "dynamic" and tree.depth == 3 and tree.topk == HEAD_TREE_TOPK
            assert 3 + 1 < tree.tokens <= 16
        assert trees or any("EAGLE-2 dynamic tree" in why for why in skipped)
        # prompt lookup beside the chain: priced (one search more a step), its acceptance left to the evaluation
        [lookup] = [o for o in options if o.patch.get("drafter", {}).get("lookup")]
        looked = apply_patch(asdict(recipe), lookup.patch)
        assert looked.drafter.kind == "eagle3" and looked.drafter.model == "smollm2-135m-eagle3"
        assert looked.drafter.lookup == 3 and "+" in lookup.reason and "evaluation's to measure" in lookup.reason
        with_lookup = apply_patch(asdict(recipe), {"drafter": {"lookup": 3}})
        skipped = Skips()
        again = algorithm_options(with_lookup, CostView.from_context(deployment, prof), skipped)
        assert not [o for o in again if "lookup" in o.patch.get("drafter", {})]  # (proposed once)
        # ... then its copied chain deeper than the head's: up to 5 where lookup matched, the head's 3 (a step of 6
        # tokens, the FMA path's), priced; no tree beside lookup (a tree's drafts are the head's)
        [deeper] = [o for o in again if "head_k" in o.patch.get("drafter", {})]
        deep = apply_patch(asdict(with_lookup), deeper.patch)
        assert (deep.k, deep.drafter.head_k, deep.drafter.lookup) == (5, 3, 3) and "evaluation" in deeper.reason
        assert not [o for o in again if o.patch.get("verification") == "tree"]
        assert any("prompt lookup (drafter.lookup) replaces" in why for why in skipped)
        assert not [o for o in algorithm_options(deep, CostView.from_context(deployment, prof), Skips())
                    if "head_k" in o.patch.get("drafter", {}) or set(o.patch) == {"k"} and o.patch["k"] < 3]


def test_a_replayed_profile_with_ranks_brings_the_best_static_trees():
    """optimize --acceptance FILE with ranks (where the target's token is the drafter's 2nd, 3rd, ... candidate) on
    a synthetic 8B target on a CUDA device: beside the replayed chains, the best static trees of 15 and 31 drafts for
    that profile (`best_static_tree`), each a recipe the engine takes, its reason giving the tree's expected tau; the
    same profile without ranks brings chains only, and a recipe under the batch controller no tree (with the reason).
    The profile is the packaged head's, measured (twenty-seventh lease, A); the device an H200's ceilings."""
    from specpilot.engine.recipe import parse
    from specpilot.engine.replay import best_static_tree, expected_accepted
    from specpilot.engine.synthetic import CONFIGS
    from specpilot.graph.providers.policy import CostView, Skips, algorithm_options, apply_patch

    c = CONFIGS["llama-3.1-8b"]
    llama = ModelShape(c["vocab_size"], c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"],
                       c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], tied_embeddings=False)
    h200 = DeviceCeilings("NVIDIA H200", 4.0e12, 7.0e14, 5e-6, 2.5e-6, 4e-6)
    dep = Deployment(llama, k=4, drafter_kind="ngram", cuda_graphs=True)
    prof = {"meta": {"device": "cuda", "dtype": "bfloat16", "batch_size": 1, "target": "synthetic:llama-3.1-8b"},
            "acceptance": {"k": 4, "per_position": [0.0] * 4, "tau": 1.0}, "ceilings": asdict(h200),
            "prediction": {"deployment": asdict(dep) | {"model": asdict(llama)}}, "gaps": []}
    acceptance = [0.564, 0.316, 0.199, 0.133]
    ranks = [[0.116, 0.035, 0.019], [0.149, 0.048, 0.0], [0.135, 0.036, 0.003], [0.147, 0.079, 0.0]]
    deployment = {"device": "cuda", "dtype": "bf16", "batch_size": 1, "ceilings": prof["ceilings"], "synthetic": True,
                  "replay_acceptance": acceptance}
    recipe = load_recipe("stock")

    def trees(options):
        return [o for o in options if o.patch.get("verification") == "tree"]

    options = algorithm_options(recipe, CostView.from_context(deployment | {"replay_ranks": ranks}, prof), Skips())
    found = trees(options)
    assert sorted(len(o.patch["tree"]["paths"]) for o in found) == [15, 31]
    for o in found:
        paths = o.patch["tree"]["paths"]
        assert paths == best_static_tree(acceptance, ranks, len(paths))
        tau = 1 + expected_accepted(acceptance, ranks, paths)
        assert f"tau {tau:.2f}" in o.reason
        made = apply_patch(asdict(recipe), o.patch)  # a recipe the engine takes, ranks and all
        assert made.verification == "tree" and made.drafter.ranks == ranks[:made.k]
    chains = [o for o in options if o.patch.get("drafter", {}).get("kind") == "replay" and o not in found]
    assert chains and all(o.patch["verification"] == "chain" and o.patch["drafter"]["ranks"] == [] for o in chains)

    assert not trees(algorithm_options(recipe, CostView.from_context(deployment, prof), Skips()))
    controlled = parse({**asdict(recipe), "batch": {"controller": "cost"}})
    skipped = Skips()
    view = CostView.from_context(deployment | {"replay_ranks": ranks}, prof)
    assert not trees(algorithm_options(controlled, view, skipped))
    assert any(why.startswith("replayed trees: ") for why in skipped)

    # two depths of two candidates hold only 6 paths: one tree of 6 drafts, proposed once, priced as 7 tokens
    short = deployment | {"replay_acceptance": [0.8, 0.6], "replay_ranks": [[0.1], [0.2]]}
    [small] = trees(algorithm_options(recipe, CostView.from_context(short, prof), Skips()))
    assert len(small.patch["tree"]["paths"]) == 6 and "a step of 7 tokens a row" in small.reason
