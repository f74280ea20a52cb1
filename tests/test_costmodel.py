"""Cost model against hand-computed examples; parameter counts against real models; calibration and its cache."""
from __future__ import annotations

import json
import math

import pytest

from specpilot.tools.profile import calibrate
from specpilot.tools.profile.costmodel import (Deployment, DeviceCeilings, ModelShape, bookkeeping_cost, draft_cost,
                                       expected_tokens, forward_cost, predict)

INF = 1e30
# A toy model small enough to count by hand: vocab 10, hidden 4, intermediate 8, 1 layer, 2 heads, 1 kv head of 2.
# qkv_out = (2 + 2*1) * 2 = 8. Matrices (out x in): qkv 8x4 = 32, o 4x4 = 16, gate+up 16x4 = 64, down 4x8 = 32
# -> 144 weights, + 2 norms of 4 = 152 per layer. Embedding 10x4 = 40, final norm 4.
TOY = ModelShape(vocab=10, hidden=4, intermediate=8, layers=1, heads=2, kv_heads=1, head_dim=2)


def toy(**kw) -> Deployment:
    base = dict(bytes_per_param=1, dtype_bytes=1, batch=1, context_len=4, attention="sdpa")
    return Deployment(TOY, **(base | kw))


def test_toy_parameter_count():
    assert TOY.layer_params == 152
    assert TOY.params == 152 + 40 + 4  # tied: the LM head is the embedding, counted once
    assert ModelShape(**{**TOY.__dict__, "tied_embeddings": False}).params == 196 + 40
    assert TOY.params_read() == 152 + 4 + 40  # a forward reads the layers, the final norm and the LM head


def test_memory_bound_forward():
    # Bandwidth 1000 B/s, no floors, infinite FLOP/s: every kernel costs its bytes / 1000, so the forward costs
    # all its bytes / 1000. One token (M = 1), 1-byte weights and activations, 4 cache slots.
    dev = DeviceCeilings("mem", 1000.0, INF, 0.0, 0.0, 0.0)
    c = forward_cost(dev, toy(), tokens=1)
    # GEMMs: weights + input + output: (32+4+8) + (16+4+4) + (64+4+16) + (32+8+4) = 44 + 24 + 84 + 44 = 196
    # fused attention: K and V, 1 x 4 slots x 1 kv head x 2 = 8 each; q and output 2 heads x 2 = 4 each -> 24
    # LM head: 40 weights + 4 input + 10 logits = 54
    # elementwise: 1 layer x 1 token x (6*4 + 2*8 + 3*8) = 64; its 22 - 6 = 16 kernels cost nothing here
    assert c.bytes == 196 + 24 + 54 + 64 == 338
    assert c.time_s == pytest.approx(0.338)
    assert c.kernels == 22  # 13 per layer + 9 per forward, estimated
    # memory floor: weights read (196) + K and V (16) + logits (10) = 222 bytes
    assert c.memory_s == pytest.approx(0.222)
    assert c.compute_s == pytest.approx(0.0)
    # bookkeeping reads the logits for the argmax: B x (k+1) x vocab x 1 byte = 10 bytes
    assert bookkeeping_cost(dev, toy()).time_s == pytest.approx(0.010)
    assert predict(toy(), dev).step_s == pytest.approx(0.348)


def test_compute_bound_verify():
    # 1000 FLOP/s, infinite bandwidth, no floors. Chain verification with k = 2: T = 3 tokens, M = 3.
    dev = DeviceCeilings("flops", INF, 1000.0, 0.0, 0.0, 0.0)
    dep = toy(k=2, drafter_kind="ngram")
    c = forward_cost(dev, dep, tokens=3)
    # GEMMs 2 x 3 x 144 = 864; attention 4 x scores x head_dim, scores = 3 tokens x 2 heads x 4 slots = 24,
    # -> 4 x 24 x 2 = 192; LM head 2 x 3 x 4 x 10 = 240. Total 1296 FLOP.
    assert c.flops == 1296
    assert c.time_s == pytest.approx(1.296)
    assert c.compute_s == pytest.approx(1.296) and c.floor_s == pytest.approx(1.296)
    p = predict(dep, dev, 1.0)
    assert p.verify.time_s == pytest.approx(1.296)
    assert p.draft.time_s == pytest.approx(0.0) and p.bookkeeping.time_s == pytest.approx(0.0)
    # the AR step is one token: 2*144 + 4*(1*2*4)*2 + 2*40 = 288 + 64 + 80 = 432 FLOP
    assert p.ar_step_s == pytest.approx(0.432)
    # every draft accepted: 3 tokens per step, 3/1.296 tok/s against AR's 1/0.432: speedup 1.0 exactly
    assert p.tokens_per_step == 3 and p.speedup == pytest.approx(1.0)


def test_launch_bound_step():
    # Infinite bandwidth and FLOP/s: only the per-kernel floors count. Graph node 1 us, GEMM node 3 us, eager
    # launch 10 us. 30 kernels per target forward (math attention), 5 bookkeeping kernels, n-gram drafter of 10.
    dev = DeviceCeilings("launch", INF, INF, 10e-6, 1e-6, 3e-6)
    dep = Deployment(TOY, batch=1, k=4, drafter_kind="ngram", context_len=4, kernels_per_target_forward=30,
                     kernels_per_draft_forward=10, kernels_bookkeeping=5, cuda_graphs=True, attention="math")
    p = predict(dep, dev, 0.5)
    # GEMM-class: 4 layer GEMMs + 2 attention bmm + LM head = 7 x 3 us = 21 us;
    # others: softmax + (30 - 8) fused kernels = 23 x 1 us = 23 us. Forward 44 us, any T.
    assert p.verify.time_s == pytest.approx(44e-6)
    assert p.verify.launch_s == pytest.approx(44e-6) and p.verify.kernels == 30
    assert p.draft.time_s == pytest.approx(10e-6)
    assert p.bookkeeping.time_s == pytest.approx(5e-6)
    assert p.step_s == pytest.approx(59e-6)
    assert p.ar_step_s == pytest.approx(49e-6)
    # alpha 0.5, k 4: E = (1 - 0.5^5) / 0.5 = 1.9375; speedup 1.9375 x 49 / 59
    assert p.tokens_per_step == pytest.approx(1.9375)
    assert p.speedup == pytest.approx(1.9375 * 49 / 59)
    # perfect acceptance: 5 tokens at the same 59 us step
    assert p.perfect_tokens_per_s == pytest.approx(5 / 59e-6)
    assert p.perfect_speedup == pytest.approx(5 * 49 / 59)
    # floors are zero here (infinite ceilings), so each gap is the whole predicted time
    assert p.gaps["verify"] == pytest.approx(44e-6) and p.gaps["acceptance"] == pytest.approx(5 - 1.9375)
    assert p.launch_floor_s == pytest.approx(59e-6)
    # launched eagerly, every kernel costs the 10 us launch: (30 + 10 + 5) x 10 us
    from dataclasses import replace
    assert predict(replace(dep, cuda_graphs=False), dev, 0.5).step_s == pytest.approx(450e-6)


def test_per_kernel_costs_eager_max_graphed_sum():
    # A forward costs the sum of per-kernel costs, not one max over the forward. Bandwidth 1000 B/s, 1-byte weights
    # and activations, the 6 kernels a fused-attention toy forward has (no further elementwise kernels); GEMM-class:
    # 4 GEMMs of 44, 24, 84, 44 bytes, attention 24, head 54. The other kernels' 64 activation bytes cost 0.064.
    from dataclasses import replace
    dev = DeviceCeilings("mix", 1000.0, INF, 0.0, 0.01, 0.01)
    eager = toy(kernels_per_target_forward=6, cuda_graphs=False)
    # launched eagerly each costs max(floor, bytes/BW): all above the 0.01 s floor -> .044+.024+.084+.044+.024+.054
    # + .064 = 0.338 s, where a single max over the forward would give max(0.338, 0.06)
    assert forward_cost(dev, eager, tokens=1).time_s == pytest.approx(0.338)
    slow = DeviceCeilings("mix", 1000.0, INF, 0.0, 0.05, 0.05)
    # floors 0.05: max(.05,.044)=.05, max(.05,.024)=.05, .084, .05; attention .05; head .054; activations .064
    assert forward_cost(slow, eager, tokens=1).time_s == pytest.approx(
        0.05 + 0.05 + 0.084 + 0.05 + 0.05 + 0.054 + 0.064)
    # in a CUDA graph a GEMM-class kernel pays its node latency and then its bytes: 6 x 0.01 more than eagerly
    graphed = replace(eager, cuda_graphs=True)
    assert forward_cost(dev, graphed, tokens=1).time_s == pytest.approx(0.338 + 6 * 0.01)
    assert forward_cost(slow, graphed, tokens=1).time_s == pytest.approx(
        0.094 + 0.074 + 0.134 + 0.094 + 0.074 + 0.104 + 0.064)


def test_layerskip_and_model_drafters():
    dev = DeviceCeilings("flops", INF, 1000.0, 0.0, 0.0, 0.0)
    # layer-skip of the toy's one layer, k = 2: a 2-token catch-up forward and one 1-token forward.
    # 2 tokens: GEMMs 2*2*144 = 576, attention 4*(2*2*4)*2 = 128, head 2*2*40 = 160 -> 864; 1 token: 432.
    dep = toy(k=2, drafter_kind="layerskip", drafter_layers=1)
    assert draft_cost(dev, dep).time_s == pytest.approx(1.296)
    # a separate draft model of the same shape costs the same
    dep = toy(k=2, drafter_kind="model", drafter_model=TOY)
    assert draft_cost(dev, dep).time_s == pytest.approx(1.296)
    with pytest.raises(ValueError):
        toy(k=0, drafter_kind="ngram")


def test_expected_tokens():
    assert expected_tokens(4, 0.5) == pytest.approx(1.9375)  # (1 - 0.5^5) / (1 - 0.5)
    assert expected_tokens(4, 1.0) == 5
    assert expected_tokens(4, 0.0) == 1
    # profile: 1 + 0.8 + 0.8*0.5 + 0.8*0.5*0.25 = 1 + 0.8 + 0.4 + 0.1 = 2.3
    assert expected_tokens(3, [0.8, 0.5, 0.25]) == pytest.approx(2.3)
    assert expected_tokens(3, [0.5]) == pytest.approx(1.5)  # positions not measured count as never accepted
    assert expected_tokens(6, [0.7] * 6) == pytest.approx(expected_tokens(6, 0.7))
    assert expected_tokens(0, 0.9) == 1


def test_h200_like_step_is_launch_bound():
    # Shape of the H200 measurements (docs/BENCHMARKS.md), not a result: with graph-node floors of a few us, a
    # SmolLM2 AR step of ~400 kernels sits far above its ~65 us weight-read floor.
    smol = ModelShape(49152, 576, 1536, 30, 9, 3, 64)
    dev = DeviceCeilings("h200-like", 4.11e12, 7.9e14, 5e-6, 2e-6, 3.5e-6)
    p = predict(Deployment(smol, context_len=512), dev)
    assert smol.params_read() * 2 / 4.11e12 == pytest.approx(65.5e-6, rel=0.01)
    assert p.step_s > 10 * p.memory_floor_s
    assert p.launch_floor_s / p.step_s > 0.9


def test_smollm2_parameter_count(smollm2):
    loaded, _ = smollm2
    shape = ModelShape.from_config(loaded.model.cfg)
    assert shape.params == 134_515_008
    assert shape.params == sum(p.numel() for p in loaded.model.parameters())  # tied head: counted once


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_parameter_count_matches_model(tiny_model_dir, family):
    from specpilot.engine.loader import load

    model = load(str(tiny_model_dir(family)), "fp32", "cpu").model
    assert ModelShape.from_config(model.cfg).params == sum(p.numel() for p in model.parameters())


def test_calibrate_cpu_writes_and_reuses_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECPILOT_CACHE", str(tmp_path))
    first = calibrate.load_or_measure("cpu")
    path = calibrate.cache_path(first.name)
    assert path.is_file() and path.parent == tmp_path / "calibration"
    data = json.loads(path.read_text())
    assert data["notes"]["matmul_dtype"] == "float32"
    for value in (first.copy_bytes_per_s, first.matmul_flops_per_s, first.launch_s, first.graph_node_s):
        assert math.isfinite(value) and value > 0

    def boom(device):
        raise AssertionError("measured again despite the cache")

    monkeypatch.setattr(calibrate, "measure", boom)
    assert calibrate.load_or_measure("cpu") == first
    from specpilot.cli import main

    assert main(["calibrate", "--device", "cpu"]) == 0
    assert "copy bandwidth" in capsys.readouterr().out
    with pytest.raises(AssertionError):
        calibrate.load_or_measure("cpu", force=True)
