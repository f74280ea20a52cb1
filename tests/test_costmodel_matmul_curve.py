"""CUDA's matmul curve: the FLOP rate a weight GEMM reaches at each number of activation rows, measured by the
calibration, interpolated by the cost model for compute-bound steps (an 8B target's verification of a few hundred
tokens), kept through JSON and the policy's view."""
from __future__ import annotations

import json
from dataclasses import asdict, replace

import pytest

from specpilot.graph.providers.policy import _ceilings
from specpilot.tools.profile.costmodel import Deployment, DeviceCeilings, ModelShape, forward_cost, predict

CURVE = ((16, 100e12), (256, 400e12), (1024, 600e12))
H200 = DeviceCeilings("NVIDIA H200", 4.17e12, 8.0e14, 7.2e-6, 1.08e-6, 4.7e-6, None, CURVE)
LLAMA_8B = ModelShape(vocab=128256, hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, head_dim=128,
                      tied_embeddings=False)


def test_rates_between_and_beyond_the_measured_rows():
    assert [H200.matmul_rate(r) for r, _ in CURVE] == pytest.approx([f for _, f in CURVE])
    assert H200.matmul_rate(1) == 100e12 and H200.matmul_rate(4096) == 600e12  # the end values outside
    # halfway from 256 to 1024 rows: halfway in seconds per FLOP (2.5 and 1.67 fs a FLOP)
    assert H200.matmul_rate(640) == pytest.approx(1 / ((1 / 400e12 + 1 / 600e12) / 2))
    assert replace(H200, matmul_curve=None).matmul_rate(640) == 8.0e14  # no curve: the square GEMM's rate


def test_json_round_trip_and_the_policy_view_keep_the_curve():
    data = json.loads(json.dumps(asdict(H200)))
    assert DeviceCeilings(**data) == H200 and hash(DeviceCeilings(**data)) == hash(H200)
    assert _ceilings(data) == H200
    older = {k: v for k, v in data.items() if k != "matmul_curve"}  # a calibration from before the curve
    assert _ceilings(older) == replace(H200, matmul_curve=None)


def test_a_compute_bound_verification_computes_at_the_curves_rate():
    """At 8B a verification of 5 tokens a row at B = 64 (320 rows) is compute-bound: its GEMMs take their FLOPs at
    the curve's rate for 320 rows, not at the square GEMM's; an AR step at B = 1 reads weights and is unchanged."""
    peak = replace(H200, matmul_curve=None)
    dep = Deployment(LLAMA_8B, bytes_per_param=2, dtype_bytes=2, batch=64, k=4, drafter_kind="ngram",
                     context_len=512, cuda_graphs=True)
    curved, flat = forward_cost(H200, dep, 5), forward_cost(peak, dep, 5)
    assert curved.compute_s == flat.compute_s  # the floor stays at the peak rate
    weights = sum(o * i for o, i in LLAMA_8B.matrices()) * LLAMA_8B.layers + LLAMA_8B.vocab * LLAMA_8B.hidden
    gemm_flops = 2.0 * 320 * weights  # the layers' GEMMs and the LM head
    assert curved.time_s - flat.time_s == pytest.approx(
        gemm_flops * (1 / H200.matmul_rate(320) - 1 / 8.0e14), rel=0.05)
    assert curved.time_s > 1.3 * flat.time_s
    ar = replace(dep, batch=1, k=0, drafter_kind="none")
    assert predict(ar, H200).step_s == pytest.approx(predict(ar, peak).step_s, rel=0.01)
