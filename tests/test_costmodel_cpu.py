"""The CPU's GEMM curve: calibrated weight-streaming rates per number of activation rows, interpolated by the cost
model, kept through JSON, carried into the policy's view, and measured by `specpilot calibrate` on a CPU."""
from __future__ import annotations

import json
import math
from dataclasses import asdict, replace

import pytest

from specpilot.graph.providers.policy import CostView
from specpilot.tools.profile import calibrate
from specpilot.tools.profile.costmodel import Deployment, DeviceCeilings, ModelShape, forward_cost, predict

CURVE = ((1, 20e9), (4, 10e9), (16, 5e9))
CPU = DeviceCeilings("cpu", 30e9, 3e11, 2e-6, 2e-6, 5e-6, CURVE)
SMOLLM2 = ModelShape(vocab=49152, hidden=576, intermediate=1536, layers=30, heads=9, kv_heads=3, head_dim=64)


def test_rates_between_and_beyond_the_measured_rows():
    assert [CPU.gemm_bytes_per_s(r) for r, _ in CURVE] == [b for _, b in CURVE]
    assert CPU.gemm_bytes_per_s(0) == 20e9  # below the first row: the first rate
    # halfway from 4 to 16 rows: halfway in seconds per byte (0.1 ns and 0.2 ns a byte)
    assert CPU.gemm_bytes_per_s(10) == pytest.approx(1 / 0.15e-9)
    # past the last row the time per byte keeps growing along the last segment (compute-bound)
    assert CPU.gemm_bytes_per_s(28) == pytest.approx(1 / 0.3e-9)
    assert replace(CPU, gemm_curve=None).gemm_bytes_per_s(4) == 30e9  # no curve: copy bandwidth
    fast = replace(CPU, gemm_curve=((1, 90e9),))
    assert fast.gemm_bytes_per_s(1) == 90e9 and fast.gemm_bytes_per_s(8) == 90e9  # one point: that rate
    assert replace(CPU, gemm_curve=((1, 90e9), (2, 80e9))).gemm_bytes_per_s(1.5) == 30e9  # never above copy


def test_json_round_trip_keeps_the_curve():
    back = DeviceCeilings(**json.loads(json.dumps(asdict(CPU))))
    assert back == CPU and isinstance(back.gemm_curve, tuple) and hash(back) == hash(CPU)


def test_a_weight_gemm_streams_at_the_curve_and_the_floor_stays_at_copy_bandwidth():
    dep = Deployment(SMOLLM2, bytes_per_param=4, dtype_bytes=4, cuda_graphs=False)
    flat = replace(CPU, gemm_curve=None)
    for tokens in (1, 5):
        curved, copy = forward_cost(CPU, dep, tokens), forward_cost(flat, dep, tokens)
        assert curved.memory_s == copy.memory_s  # the physical floor: copy bandwidth
        # the weights dominate a decode forward: its time is close to their bytes at the curve's rate for its rows
        weights = SMOLLM2.params_read() * 4
        assert curved.time_s == pytest.approx(weights / CPU.gemm_bytes_per_s(tokens), rel=0.15)
        assert curved.time_s > 1.3 * copy.time_s
    # more rows, a slower stream: on the curve a 5-token verify costs about twice an AR step (20 GB/s at 1 row,
    # 9.2 at 5), as measured on CPUs; at copy bandwidth both would be the same weights' bytes
    spec = replace(dep, k=4, drafter_kind="ngram")
    curved, copy = predict(spec, CPU), predict(spec, flat)
    assert curved.verify.time_s / curved.ar_step_s > 1.8
    assert copy.verify.time_s / copy.ar_step_s < 1.2


def test_the_policy_view_takes_the_curve_from_the_profile():
    """Memory's deployment descriptor keeps only the scalar ceilings; the profile's carry the curve."""
    dep = Deployment(SMOLLM2, bytes_per_param=4, dtype_bytes=4, cuda_graphs=False)
    profile = {"meta": {"device": "cpu", "dtype": "float32", "batch_size": 1}, "acceptance": {},
               "ceilings": asdict(CPU), "prediction": {"deployment": asdict(dep) | {"model": asdict(SMOLLM2)}}}
    scalars = {k: v for k, v in asdict(CPU).items() if k not in ("name", "gemm_curve")}
    view = CostView.from_context({"device": "cpu", "ceilings": scalars}, profile)
    assert view.dev == CPU


def test_calibrate_measures_a_curve_on_the_cpu(monkeypatch):
    monkeypatch.setattr(calibrate, "GEMM_CURVE_ROWS", (1, 8))
    monkeypatch.setattr(calibrate, "last_level_cache_bytes", lambda: 0)  # the smallest span: 256 MiB
    curve = calibrate.gemm_curve_cpu()
    assert [r for r, _ in curve] == [1, 8]
    assert all(math.isfinite(b) and 1e8 < b < 1e13 for _, b in curve)
    assert calibrate.last_level_cache_bytes() >= 0
