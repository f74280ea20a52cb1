"""The cost model's batching keys: batch.controller cost (the best kind of step k' in 0..k at the deployment's batch)
and batch.ragged (k' x B drafts a step packed to the rows that have drafts), against hand-computed examples and the
calibrated ceilings of the 2-core Xeon and the H200."""
from __future__ import annotations

from dataclasses import replace

import pytest

from specpilot.tools.profile.costmodel import (KERNELS_PACKING_PER_LAYER, KERNELS_PACKING_PER_STEP, Deployment,
                                       DeviceCeilings, ModelShape, ar_deployment, draft_cost, expected_tokens,
                                       forward_cost, packing_cost, predict, ragged_expected_tokens, step_prediction)

INF = 1e30
TOY = ModelShape(vocab=10, hidden=4, intermediate=8, layers=1, heads=2, kv_heads=1, head_dim=2)
SMOLLM2 = ModelShape(vocab=49152, hidden=576, intermediate=1536, layers=30, heads=9, kv_heads=3, head_dim=64)
# `specpilot calibrate --device cpu` on the idle 2-core Xeon, 2026-12-01 (docs/COSTMODEL.md), rounded
XEON = DeviceCeilings("Intel(R) Xeon(R) Processor x2", 4.2313e10, 3.2867e11, 1.9208e-6, 1.9208e-6, 5.4535e-6,
                      ((1, 2.4223e10), (2, 2.2037e10), (4, 1.3235e10), (8, 1.0142e10), (16, 7.6854e9),
                       (32, 7.3386e9), (64, 5.4698e9), (128, 3.4500e9), (256, 1.9121e9)))
# the H200's, 2026-11-29 (docs/benchmarks/raw/2026-11-29c/costmodel_validate.json), rounded
H200 = DeviceCeilings("NVIDIA H200", 4.1993e12, 8.1198e14, 6.1835e-6, 1.1082e-6, 4.6900e-6)
# the packaged SmolLM2 in fp32 on the CPU, n-gram k = 4, with the kernel counts the profiler measured there
CPU_SMOLLM2 = Deployment(SMOLLM2, bytes_per_param=4, dtype_bytes=4, k=4, drafter_kind="ngram", cuda_graphs=False,
                         kernels_per_target_forward=1962, kernels_per_draft_forward=97, kernels_bookkeeping=28)


def toy(**kw) -> Deployment:
    base = dict(bytes_per_param=1, dtype_bytes=1, batch=1, context_len=4, attention="sdpa", k=4,
                drafter_kind="ngram", cuda_graphs=False)
    return Deployment(TOY, **(base | kw))


# A device where the toy's forward costs 0.432 s a token (its FLOPs at 1000 FLOP/s: every GEMM-class kernel is
# above the 10 ms floor) plus its 16 other kernels at that floor, 0.16 s: forward(T) = 0.432 T + 0.16. Bookkeeping
# is 20 kernels (0.2 s) and the n-gram search 10 (0.1 s), bandwidth infinite. A step verifying k' drafts:
# t(k') = 0.1 + 0.432 (k'+1) + 0.16 + 0.2 = 0.892 + 0.432 k' (k' = 0 too: the drafter still searches); plain AR
# (no drafter) 0.432 + 0.16 + 0.2 = 0.792 s.
PRICED = DeviceCeilings("priced", INF, 1000.0, 0.01, 0.01, 0.01)
PRICED_DEP = toy(kernels_per_draft_forward=10)


def step_times(dep: Deployment, dev: DeviceCeilings) -> list[float]:
    return [step_prediction(dep, dev, 0.0, d).step_s for d in range(dep.k + 1)]


def test_priced_step_times_are_as_computed_by_hand():
    assert step_times(PRICED_DEP, PRICED) == pytest.approx([0.892 + 0.432 * d for d in range(5)])
    assert predict(PRICED_DEP, PRICED).ar_step_s == pytest.approx(0.792)


def test_controller_picks_ar_when_verification_is_priced_out():
    dep = replace(PRICED_DEP, controller="cost")
    acc = [0.3] * 4  # E(k') = 1, 1.3, 1.39, 1.417, 1.4251
    p = predict(dep, PRICED, acc)
    assert p.drafts == 0 and p.tokens_per_step == 1.0
    expected = [1 / 0.892, 1.3 / 1.324, 1.39 / 1.756, 1.417 / 2.188, 1.4251 / 2.62]
    assert [p.rates[d] for d in range(5)] == pytest.approx(expected)
    assert p.tokens_per_s == pytest.approx(1 / 0.892)
    # verifying k = 4 every step (no controller) is predicted at the slowest of the five
    assert predict(PRICED_DEP, PRICED, acc).tokens_per_s == pytest.approx(1.4251 / 2.62)


def test_controller_picks_an_intermediate_length():
    dep = replace(PRICED_DEP, controller="cost")
    acc = [0.9, 0.8, 0.3, 0.1]  # E(k') = 1, 1.9, 2.62, 2.836, 2.8576
    p = predict(dep, PRICED, acc)
    assert [p.rates[d] for d in range(5)] == pytest.approx(
        [1 / 0.892, 1.9 / 1.324, 2.62 / 1.756, 2.836 / 2.188, 2.8576 / 2.62])
    assert p.drafts == 2 and p.tokens_per_step == pytest.approx(2.62)
    assert p.step_s == pytest.approx(1.756) and p.verify.time_s == pytest.approx(0.432 * 3 + 0.16)
    assert p.perfect_tokens_per_s == pytest.approx(3 / 1.756)  # k'+1 tokens at the picked step's time
    assert p.gaps["acceptance"] == pytest.approx(3 - 2.62)
    assert p.tokens_per_s > p.ar_tokens_per_s  # 1.492 against plain AR's 1 / 0.792 = 1.263


def test_controller_picks_k_when_verification_is_cheap():
    # launch-bound: every forward costs its 44 us of floors whatever its tokens, the drafter 10, bookkeeping 5
    dev = DeviceCeilings("launch", INF, INF, 10e-6, 1e-6, 3e-6)
    dep = Deployment(TOY, batch=1, k=4, drafter_kind="ngram", context_len=4, kernels_per_target_forward=30,
                     kernels_per_draft_forward=10, kernels_bookkeeping=5, cuda_graphs=True, attention="math",
                     controller="cost")
    p = predict(dep, dev, 0.5)
    assert p.drafts == 4
    assert [p.rates[d] for d in range(5)] == pytest.approx([expected_tokens(d, 0.5) / 59e-6 for d in range(5)])
    assert p.tokens_per_s == pytest.approx(1.9375 / 59e-6)
    uncontrolled = predict(replace(dep, controller="none"), dev, 0.5)
    assert p.tokens_per_s == pytest.approx(uncontrolled.tokens_per_s)


def test_ties_go_to_the_shorter_step():
    # every draft accepted on the compute-bound toy: each kind emits k'+1 tokens in (k'+1) x 0.432 s, all one rate
    dev = DeviceCeilings("flops", INF, 1000.0, 0.0, 0.0, 0.0)
    p = predict(toy(controller="cost", attention="sdpa"), dev, 1.0)
    assert max(p.rates.values()) / min(p.rates.values()) - 1 < 1e-12
    assert p.drafts == 0


@pytest.mark.parametrize("dev", [XEON, H200, PRICED], ids=lambda d: d.name)
@pytest.mark.parametrize("batch", [1, 8, 64])
@pytest.mark.parametrize("acc", [[0.05] * 4, [0.3, 0.5, 0.5, 0.5], [0.5, 1.0, 1.0, 0.5], [0.95] * 4])
def test_controlled_is_the_best_kind_and_never_below_its_ar_step(dev, batch, acc):
    dep = replace(CPU_SMOLLM2, batch=batch, cuda_graphs=dev is H200)
    p = predict(replace(dep, controller="cost"), dev, acc)
    assert p.tokens_per_s == pytest.approx(max(p.rates.values()))
    assert p.tokens_per_s >= p.rates[0] and p.tokens_per_s >= predict(dep, dev, acc).tokens_per_s * (1 - 1e-12)
    # its AR step is plain AR plus the drafter's search (the engine's drafter still searches in an AR step)
    assert batch / p.rates[0] == pytest.approx(p.ar_step_s + draft_cost(dev, dep).time_s)


def test_calibrated_xeon_goes_from_k_to_ar_as_the_batch_grows():
    """On the calibrated Xeon a CPU BLAS streams weights ever slower as rows grow (its gemm_curve), so at B = 64 a
    5-token verify of 64 rows (320 rows) is priced out, while at B = 1 and 8 verifying all four drafts pays."""
    acc = [0.5, 1.0, 1.0, 0.5]
    dep = replace(CPU_SMOLLM2, controller="cost")
    picks = {b: predict(replace(dep, batch=b), XEON, acc) for b in (1, 8, 32, 64)}
    assert picks[1].drafts == 4 and picks[8].drafts == 4
    assert 0 < picks[32].drafts < 4
    assert picks[64].drafts == 0
    plain64 = predict(replace(CPU_SMOLLM2, batch=64), XEON, acc)
    assert plain64.tokens_per_s < plain64.ar_tokens_per_s  # speculation loses at B = 64 ...
    assert picks[64].tokens_per_s > plain64.tokens_per_s  # ... and the controller runs AR instead


def test_uncontrolled_predictions_report_k_and_no_rates():
    p = predict(CPU_SMOLLM2, XEON, [0.5, 1.0, 1.0, 0.5])
    assert p.drafts == 4 and p.rates == {}
    assert p.to_dict()["draft_length"] == 4 and p.to_dict()["rates"] == {}


def test_attention_in_the_padded_layout():
    # compute-bound toy, 2 tokens a row through the GEMMs and the head, 5 query slots through the (sdpa) attention:
    # GEMMs 2 x 2 x 144 = 576, head 2 x 2 x 40 = 160, attention 4 x (5 x 2 heads x 4 slots) x 2 = 320 FLOP
    dev = DeviceCeilings("flops", INF, 1000.0, 0.0, 0.0, 0.0)
    assert forward_cost(dev, toy(), 2, attention_tokens=5).time_s == pytest.approx(1.056)
    assert forward_cost(dev, toy(), 2).time_s == pytest.approx(0.864)  # 576 + 160 + 4 x 16 x 2


def test_deployment_checks_the_batching_keys():
    with pytest.raises(ValueError, match="controller"):
        toy(ragged=True)  # ragged needs the controller
    with pytest.raises(ValueError, match="drafter"):
        Deployment(TOY, controller="cost")
    with pytest.raises(ValueError, match="one of"):
        toy(controller="fast")
    ar = ar_deployment(toy(controller="cost", ragged=True))
    assert ar.controller == "none" and not ar.ragged and ar.k == 0


# ------------------------------------------------------------------------------------------------------- ragged

# Measured over all rows: draft 1 there and accepted 0.4 of row-steps; then 0.8, 0.5, 0.5. With availability 0.5 a
# row with drafts accepts draft 1 at 0.8: C(n) = 1, 1.8, 2.44, 2.76, 2.92 for n = 0..4 drafts.
ACC = [0.4, 0.8, 0.5, 0.5]


def test_ragged_tokens_by_hand():
    # B = 2, k' = 1: two drafts a step. Both rows with drafts (1/4): one each, 1.8 tokens; one row (1/2): both drafts
    # to it, 2.44 tokens, the other 1; none (1/4): 1 each. E = 1 + (1/2 x 1.44 + 1/4 x 2 x 0.8) / 2 = 1.56
    assert ragged_expected_tokens(4, 1, ACC, 0.5, 2) == pytest.approx(1.56)
    assert expected_tokens(1, ACC) == pytest.approx(1.4)  # padded: each row its one draft slot
    # B = 3, k' = 1: three drafts. One row with drafts (3/8): 3 drafts, 2.76; two (3/8): 1.5 each, one row 1 and the
    # other 2 drafts, 1.8 + 0.5 x 0.64 = 2.12 on average; three (1/8): 1.8 each.
    # E = 1 + (3/8 x 1.76 + 3/8 x 2 x 1.12 + 1/8 x 3 x 0.8) / 3 = 1.6
    assert ragged_expected_tokens(4, 1, ACC, 0.5, 3) == pytest.approx(1.6)
    # a share is capped at k: B = 2, k' = 3, one row with drafts would get 6, verifies 4: C(4) = 2.92
    # E = 1 + (1/2 x 1.92 + 1/4 x 2 x (C(3) - 1)) / 2 = 1 + (0.96 + 0.88) / 2 = 1.92
    assert ragged_expected_tokens(4, 3, ACC, 0.5, 2) == pytest.approx(1.92)


def test_ragged_is_padded_when_every_row_has_drafts_or_there_is_one_row():
    for drafts in range(5):
        for batch in (1, 2, 8, 32):
            assert ragged_expected_tokens(4, drafts, ACC, 1.0, batch) == pytest.approx(expected_tokens(drafts, ACC))
        # one row has nobody to hand its drafts to
        assert ragged_expected_tokens(4, drafts, ACC, 0.5, 1) == pytest.approx(expected_tokens(drafts, ACC))
    # a row accepts a draft only if it had one: availability is taken as at least a_1
    assert ragged_expected_tokens(4, 1, ACC, 0.1, 8) == ragged_expected_tokens(4, 1, ACC, 0.4, 8)
    assert ragged_expected_tokens(4, 2, 0.6, 1.0, 8) == pytest.approx(expected_tokens(2, 0.6))  # one rate for all


def test_ragged_step_verifies_more_at_the_price_of_a_padded_step():
    dep = replace(CPU_SMOLLM2, batch=8, controller="cost")
    ragged = replace(dep, ragged=True)
    for drafts in (1, 2):
        padded_step = step_prediction(dep, XEON, ACC, drafts)
        low = step_prediction(ragged, XEON, ACC, drafts, availability=0.5)
        full = step_prediction(ragged, XEON, ACC, drafts, availability=1.0)
        assert low.tokens_per_step > padded_step.tokens_per_step + 0.1
        assert full.tokens_per_step == pytest.approx(padded_step.tokens_per_step)
        # the same B x (k'+1) tokens through the GEMMs, the attention over the padded k+1 slots a row, plus the
        # packing; the drafter proposes k (a row may get up to k)
        packed_forward = forward_cost(XEON, ragged, drafts + 1, kernels=1962, attention_tokens=5)
        assert low.verify.time_s == pytest.approx(packed_forward.time_s + packing_cost(XEON, ragged).time_s)
        assert padded_step.verify.time_s < low.verify.time_s < step_prediction(dep, XEON, ACC, 4).verify.time_s
        assert packing_cost(XEON, ragged).kernels == KERNELS_PACKING_PER_STEP + 30 * KERNELS_PACKING_PER_LAYER
        assert low.draft.time_s == pytest.approx(draft_cost(XEON, ragged).time_s)
    # a ragged k'=1 step verifies about what a padded k = 2 step does at B = 8, p = 0.5 (each row with drafts gets 2)
    assert step_prediction(ragged, XEON, ACC, 1, availability=0.5).tokens_per_step == pytest.approx(
        expected_tokens(2, ACC), rel=0.05)


def test_ragged_controller_beats_padded_only_with_rows_left_without_drafts():
    dep = replace(CPU_SMOLLM2, batch=32, controller="cost")
    padded = predict(dep, XEON, ACC)
    low = predict(replace(dep, ragged=True), XEON, ACC, availability=0.5)
    full = predict(replace(dep, ragged=True), XEON, ACC, availability=1.0)
    assert low.tokens_per_s > 1.1 * padded.tokens_per_s
    # every row has drafts: the same tokens at each k', at the price of the packing and of attention over k+1 slots
    for drafts in range(1, 5):
        assert step_prediction(replace(dep, ragged=True), XEON, ACC, drafts, 1.0).tokens_per_step == pytest.approx(
            step_prediction(dep, XEON, ACC, drafts).tokens_per_step)
        assert full.rates[drafts] < padded.rates[drafts]
    assert full.rates[0] == padded.rates[0]  # an AR step packs nothing
    assert 0.9 * padded.tokens_per_s < full.tokens_per_s < padded.tokens_per_s
    # without a measured availability every row is taken to have drafts: ragged gains nothing
    assert predict(replace(dep, ragged=True), XEON, ACC).tokens_per_s == full.tokens_per_s


def test_eagle3_head_is_priced_as_its_layer_plus_fc_and_the_wider_qkv():
    """An EAGLE-3 head costs what a one-layer draft model over its draft vocabulary costs, plus fc's 3H x H weights
    once and q/k/v's second H of inputs at every draft: exactly those bytes more."""
    from dataclasses import replace

    from specpilot.engine.eagle3 import Eagle3Config
    from specpilot.tools.profile.costmodel import DeviceCeilings, Deployment, ModelShape, draft_cost, eagle3_shape

    head = eagle3_shape(Eagle3Config(hidden_size=64, target_hidden_size=64, intermediate_size=128, n_heads=4,
                                     n_kv_heads=2, head_dim=16, rms_eps=1e-6, vocab_size=256, draft_vocab_size=160,
                                     aux_layers=(0, 1, 2), norm_before_residual=False))
    assert (head.vocab, head.layers, head.hidden) == (160, 1, 64)
    target = ModelShape(256, 64, 128, 4, 4, 2, 16)
    dev = DeviceCeilings(name="toy", copy_bytes_per_s=1e9, matmul_flops_per_s=1e12, launch_s=1e-6, graph_node_s=1e-6)
    for k in (1, 4):
        dep = Deployment(target, bytes_per_param=4, dtype_bytes=4, batch=2, k=k, drafter_kind="model",
                         drafter_model=head)
        plain, eagle = draft_cost(dev, dep), draft_cost(dev, replace(dep, drafter_kind="eagle3"))
        assert eagle.bytes - plain.bytes == 4 * (3 * 64 * 64 + k * 64 * head.qkv_out)
        assert eagle.kernels == plain.kernels + 1 + k and eagle.time_s > plain.time_s
        # with prompt lookup beside the head (drafter.lookup 3: tails of 3-6 tokens, four orders): one search
        # kernel more, reading the history three times an order (int64 tokens, 512 slots a row)
        looked = draft_cost(dev, replace(dep, drafter_kind="eagle3", lookup_orders=4))
        assert looked.kernels == eagle.kernels + 1 and looked.bytes - eagle.bytes == 3 * 2 * 512 * 8 * 4
        assert looked.time_s > eagle.time_s
        # a copied chain deeper than the head's (drafter.head_k): the head's forwards are its k, not the step's
        deep = replace(dep, drafter_kind="eagle3", lookup_orders=4, k=k + 2, head_k=k)
        assert draft_cost(dev, deep) == looked and draft_cost(dev, deep, k + 1) == looked
        assert draft_cost(dev, replace(deep, head_k=None)).time_s > looked.time_s


def test_tree_step_is_priced_as_a_forward_over_its_nodes():
    """A tree of N nodes and depth k: its verify forward is a forward of N tokens a row, its bookkeeping reads N
    logits a row, and its tokens follow the measured per-position acceptance over depth k, as a chain's."""
    from dataclasses import replace

    from specpilot.tools.profile.costmodel import (DeviceCeilings, Deployment, ModelShape, bookkeeping_cost,
                                                   expected_tokens, forward_cost, predict)

    dev = DeviceCeilings(name="toy", copy_bytes_per_s=1e9, matmul_flops_per_s=1e12, launch_s=1e-6, graph_node_s=1e-6)
    chain = Deployment(ModelShape(256, 64, 128, 4, 4, 2, 16), bytes_per_param=4, dtype_bytes=4, batch=2, k=4,
                       drafter_kind="ngram")
    tree = replace(chain, tree_nodes=13)
    acc = [0.6, 0.5, 0.4, 0.3]
    p = predict(tree, dev, acc)
    assert p.verify.time_s == pytest.approx(forward_cost(dev, tree, 13).time_s)
    assert p.bookkeeping.time_s == pytest.approx(bookkeeping_cost(dev, tree, 12).time_s)
    assert p.tokens_per_step == pytest.approx(expected_tokens(4, acc))
    assert p.verify.time_s > predict(chain, dev, acc).verify.time_s
    for bad in (dict(tree_nodes=4), dict(tree_nodes=13, controller="cost")):
        with pytest.raises(ValueError, match="tree"):
            replace(chain, **bad)


def test_an_eagle3_tree_is_drafted_at_each_levels_width():
    """An EAGLE-3 head drafts a tree one forward a depth: the first over the newly verified tokens, then one over each
    level's nodes that have children (static) or its beam of topk (dynamic). Priced at those widths: a chain's widths
    (all 1) price exactly as a chain; a dynamic tree's beam of 4 moves 4 times a chain's activations and FLOPs in
    those forwards, and on a launch-bound device costs nearly what a chain does."""
    from dataclasses import replace

    from specpilot.engine.eagle3 import Eagle3Config
    from specpilot.engine.tree import DynamicTree, tree_from_paths
    from specpilot.tools.profile.costmodel import (DeviceCeilings, Deployment, ModelShape, draft_cost, eagle3_shape,
                                                   tree_draft_widths)

    assert tree_draft_widths(DynamicTree(depth=5, topk=4, tokens=32)) == (4, 4, 4, 4)
    static = tree_from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    assert tree_draft_widths(static) == (2, 1)  # depth 1: [0] and [1] have children; depth 2: [0, 0]
    head = eagle3_shape(Eagle3Config(hidden_size=64, target_hidden_size=64, intermediate_size=128, n_heads=4,
                                     n_kv_heads=2, head_dim=16, rms_eps=1e-6, vocab_size=256, draft_vocab_size=160,
                                     aux_layers=(0, 1, 2), norm_before_residual=False))
    target = ModelShape(256, 64, 128, 4, 4, 2, 16)
    chain = Deployment(target, bytes_per_param=4, dtype_bytes=4, batch=8, k=4, drafter_kind="eagle3",
                       drafter_model=head, tree_nodes=13)
    bandwidth = DeviceCeilings(name="wide", copy_bytes_per_s=1e9, matmul_flops_per_s=1e10, launch_s=1e-9,
                               graph_node_s=1e-9)
    launch = DeviceCeilings(name="launch", copy_bytes_per_s=1e13, matmul_flops_per_s=1e15, launch_s=1e-5,
                            graph_node_s=1e-5)
    for dev in (bandwidth, launch):
        same = draft_cost(dev, replace(chain, draft_widths=(1, 1, 1)))
        assert same == draft_cost(dev, chain)
    beam, one = draft_cost(bandwidth, replace(chain, draft_widths=(4, 4, 4))), draft_cost(bandwidth, chain)
    assert beam.kernels == one.kernels and beam.flops > 3 * (one.flops - draft_cost(
        bandwidth, replace(chain, k=1, tree_nodes=None)).flops)
    assert beam.time_s > one.time_s and beam.bytes > one.bytes
    wide, narrow = draft_cost(launch, replace(chain, draft_widths=(4, 4, 4))), draft_cost(launch, chain)
    assert narrow.time_s <= wide.time_s < 1.1 * narrow.time_s
    for bad in (dict(draft_widths=(4, 4)), dict(draft_widths=(4, 0, 4)), dict(draft_widths=(4, 4, 4), tree_nodes=None),
                dict(draft_widths=(4, 4, 4), drafter_kind="model")):
        with pytest.raises(ValueError, match="draft_widths"):
            replace(chain, **bad)


def test_a_fraction_is_priced_as_a_packed_step_of_b_plus_fb_tokens():
    """batch.fractions: a kind f < 1 is a packed step of B x (f + 1) tokens through the GEMMs, whose drafts go to
    the rows that have them (f x B across the batch); the controller's rates include it, and a bucket too small for
    one draft has none. At B = 4 with every row having drafts, 0.5 verifies 2 drafts in a step of 6 tokens (AR: 4),
    its attention in the padded layout of k + 1 slots a row, as a ragged step's."""
    dep = replace(PRICED_DEP, batch=4, controller="cost", fractions=(0.5,))
    half, ar = (step_prediction(dep, PRICED, ACC, d, availability=1.0) for d in (0.5, 0))
    packed = forward_cost(PRICED, dep, 1.5, attention_tokens=5)
    assert half.verify.time_s == pytest.approx(packed.time_s + packing_cost(PRICED, dep).time_s)
    assert packed.flops == pytest.approx(forward_cost(PRICED, dep, 1.5, attention_tokens=1.5).flops
                                         + forward_cost(PRICED, dep, 1, attention_tokens=5).flops
                                         - forward_cost(PRICED, dep, 1, attention_tokens=1.5).flops)
    assert ar.verify.time_s < half.verify.time_s
    # two of the four rows verify one draft each (rows emit 1 + a_1 or 1)
    assert half.tokens_per_step == pytest.approx(1 + ACC[0] / 2)
    rates = predict(dep, PRICED, ACC, availability=1.0).rates
    assert set(rates) == {0, 0.5, 1, 2, 3, 4} and rates[0.5] == pytest.approx(half.tokens_per_s)
    assert set(predict(replace(dep, batch=1), PRICED, ACC).rates) == {0, 1, 2, 3, 4}
    with pytest.raises(ValueError, match="fractions"):
        replace(dep, controller="none")
