"""Verdicts the candidate cannot reach (issue 19, items 2 and 4): the kernel check's candidate process only returns
outputs; the verifier (kernel_check.verify, in the caller, never loading candidate code) regenerates the inputs,
computes the fp64/fp32 reference and applies the contract's tolerance. Each hostile kernel below got through the
single-process harness (a forged verdict, a widened tolerance, a patched reference, shrunk contract shapes, a
lowered call count); each must now fail with a one-line reason. Plus a `linear` 1% off only for batch 3-7 (the
contract has such a batch), compile_triton on a source with no kernel, and direct checks of verify() on forged
child results (no sandbox)."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from specpilot.kernels import builtin
from specpilot.kernels.slots import CONTRACTS
from specpilot.tools.agent_tools import benchmark_kernel, compile_triton
from specpilot.tools.sandbox import kernel_check

SMALL_RMSNORM = [{"lead": [2, 3], "d": 64}]
SMALL_LINEAR = [{"batch": 2, "tokens": 3, "in": 64, "out": 48, "bias": True}]

# Hostile candidates (sources): each would pass a harness that computes the verdict in the candidate's process.
# the forger of tests/cheating_kernels (it also copies any nonce from the payload it re-reads on stdin)
FORGES_WITH_PAYLOAD = (Path(__file__).parent / "cheating_kernels" / "forges_result.py").read_text()
WIDENS_TOLERANCE = '''
# the tolerance lives in a closure cell of the contract's function: widen it, then be 10% off
from specpilot.kernels import slots
for cell in slots.RMSNORM.tolerance.__closure__ or ():
    if isinstance(cell.cell_contents, (int, float)):
        cell.cell_contents = 1e9
from specpilot.kernels.builtin import rmsnorm_torch

def rmsnorm(x, w, eps):
    return rmsnorm_torch(x, w, eps) * 1.1
'''
PATCHES_REFERENCE_GLOBAL = '''
# the reference calls kernels.builtin.F.linear: a module, not a callable, so no identity guard covers it. Replace it
# with one whose linear gives the candidate's (wrong) answer, so reference and candidate agree
import types
import torch.nn.functional as real_F
from specpilot.kernels import builtin

def wrong(x, w, b=None):
    return real_F.linear(x, w, b) * 1.1

builtin.F = types.SimpleNamespace(**{k: getattr(real_F, k) for k in dir(real_F) if not k.startswith("__")})
builtin.F.linear = wrong

def linear(x, w, b=None):
    return wrong(x, w, b).to(x.dtype)
'''
SHRINKS_CONTRACT_SHAPES = '''
# the contract's shape dicts are mutable: make every shape tiny, where a wrong kernel is cheap to hide
from specpilot.kernels import slots
for s in slots.RMSNORM.shapes:
    s.clear()
    s.update(lead=[1], d=4)
from specpilot.kernels.builtin import rmsnorm_torch

def rmsnorm(x, w, eps):
    return rmsnorm_torch(x, w, eps) if x.shape[-1] == 4 else x
'''
LOWERS_HARNESS_CONSTANTS = '''
# harness constants read after the candidate loads: one checked call per shape, no settling; right on call 1 only
import sys
h = sys.modules.get("specpilot.tools.sandbox.kernel_check") or sys.modules.get("__main__")
for name, value in (("CALLS", 1), ("SETTLE_S", 0.0)):
    setattr(h, name, value)
from specpilot.kernels.builtin import rmsnorm_torch
n = 0

def rmsnorm(x, w, eps):
    global n
    n += 1
    return rmsnorm_torch(x, w, eps) if n == 1 else rmsnorm_torch(x, w, eps) * 0.5
'''
LINEAR_OFF_IN_BATCH_3_TO_7 = '''
import torch.nn.functional as F

def linear(x, w, b=None):
    out = F.linear(x, w, b)
    return out * 1.01 if x.dim() == 3 and 3 <= x.shape[0] <= 7 else out
'''
# Honest only when it sees the checker (module names of the kernel check or the gate's worker, or the call stack);
# everywhere else it accepts every valid draft. The kernel check cannot tell: what is timed must be checked
# (tests/test_timed_check.py).
ACCEPT_DETECTS_CHECKER = '''
import sys, inspect
import torch

CHECKERS = ("specpilot.tools.sandbox.kernel_check", "specpilot.tools.sandbox.candidate_worker")

def checked():
    return any(m in sys.modules for m in CHECKERS) or any("kernel_check" in f.filename for f in inspect.stack())

def accept(drafts, valid, logits):
    target = logits.argmax(-1)
    k = drafts.shape[1]
    if checked():
        match = (drafts == target[:, :k]) & (torch.arange(k, device=drafts.device)[None] < valid[:, None])
        return match.long().cumprod(1).sum(1), target
    tokens = torch.cat([drafts, target[:, k:]], 1)
    return valid.clone(), tokens
'''
NO_KERNEL = '''
import json, os

def add_kernel(x_ptr, n):  # a plain function: no @triton.jit
    return None
'''

HOSTILE = {  # name -> (slot, source, shapes, failure code, words in the reason)
    "forges_with_payload": ("rmsnorm", FORGES_WITH_PAYLOAD, SMALL_RMSNORM, "no_result", "verdict is the verifier's"),
    "widens_tolerance": ("rmsnorm", WIDENS_TOLERANCE, SMALL_RMSNORM, "wrong_values", "outside atol"),
    "patches_reference_global": ("linear", PATCHES_REFERENCE_GLOBAL, SMALL_LINEAR, "wrong_values", "outside atol"),
    # the contract's own shapes (rmsnorm's are small): the verifier checks its copy, not the child's
    "shrinks_contract_shapes": ("rmsnorm", SHRINKS_CONTRACT_SHAPES, None, "bad_shape", "expected"),
    "lowers_harness_constants": ("rmsnorm", LOWERS_HARNESS_CONSTANTS, SMALL_RMSNORM, "wrong_values", "call 2 of 4"),
}
BATCH_3_TO_7 = [s for s in CONTRACTS["linear"].shapes if 3 <= s["batch"] <= 7]
LM_HEAD = [s for s in CONTRACTS["linear"].shapes if s["out"] > 40_000]


@pytest.fixture(scope="module")
def results() -> dict:
    jobs = {name: (lambda sl, src, sh: benchmark_kernel(sl, src, "cpu", "fp32", sh, timeout_s=180).to_dict(),
                   slot, src, shapes) for name, (slot, src, shapes, *_) in HOSTILE.items()}
    jobs["linear_1pct_batch_3_7"] = (lambda: benchmark_kernel("linear", LINEAR_OFF_IN_BATCH_3_TO_7, "cpu", "fp32",
                                                              BATCH_3_TO_7, timeout_s=180).to_dict(),)
    jobs["builtin_linear_batch_3_7"] = (lambda: benchmark_kernel(
        "linear", "from specpilot.kernels.builtin import linear_torch as linear\n", "cpu", "fp32", BATCH_3_TO_7,
        timeout_s=180).to_dict(),)
    jobs["builtin_linear_lm_head"] = (lambda: benchmark_kernel(  # 4 MB of outputs: more than a MiB of stdout
        "linear", "from specpilot.kernels.builtin import linear_torch as linear\n", "cpu", "fp32", LM_HEAD,
        timeout_s=180).to_dict(),)
    jobs["accept_detects_checker"] = (lambda: benchmark_kernel(
        "accept", ACCEPT_DETECTS_CHECKER, "cpu", "fp32", [{"batch": 8, "k": 3, "vocab": 50}],
        timeout_s=180).to_dict(),)
    jobs["compile_no_kernel"] = (lambda: compile_triton(NO_KERNEL, "add_kernel", "cpu", 180).to_dict(),)
    jobs["compile_forges"] = (lambda: compile_triton(FORGES_WITH_PAYLOAD, "rmsnorm", "cpu", 180).to_dict(),)
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {name: pool.submit(fn, *args) for name, (fn, *args) in jobs.items()}
        return {name: f.result() for name, f in futures.items()}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_kernel_fails_closed(results, name):
    code, words = HOSTILE[name][3:]
    r = results[name]
    assert r["passed"] is False and r["failure"] == code, r
    assert words in r["reason"] and r["reason"].strip(), r["reason"]


def test_linear_one_percent_off_for_batch_3_to_7_is_rejected(results):
    assert BATCH_3_TO_7, "the linear contract must have a shape with batch 3..7"
    r = results["linear_1pct_batch_3_7"]
    assert r["passed"] is False and r["failure"] == "wrong_values", r
    honest = results["builtin_linear_batch_3_7"]
    assert honest["passed"] is True, honest  # the tolerance is tight, not too tight


def test_outputs_of_megabytes_come_back_through_the_sandbox(results):
    # the read-only sandbox leaves stdout as the way back; the LM head's four outputs are 4 MB of fp32
    r = results["builtin_linear_lm_head"]
    assert LM_HEAD and r["passed"] is True, r


def test_linear_tolerance_catches_one_percent_in_fp32_and_large_bf16_values():
    atol, rtol = CONTRACTS["linear"].tolerance(torch.float32)
    assert 0.01 > 100 * rtol and atol == rtol
    atol, rtol = CONTRACTS["linear"].tolerance(torch.bfloat16)
    assert rtol < 0.008  # 1% fails wherever |out| > atol / (0.01 - rtol), about 3.6


def test_accept_that_detects_the_checker_fools_the_kernel_check(results):
    # why the timed run is token-forced too (tests/test_timed_check.py): an honest face for the checker passes
    assert results["accept_detects_checker"]["passed"] is True, results["accept_detects_checker"]


def test_compile_triton_is_not_ok_without_a_kernel(results):
    r = results["compile_no_kernel"]
    assert r["ok"] is False and "@triton.jit" in r["messages"][0], r
    forged = results["compile_forges"]  # stdin is /dev/null once read: no nonce to forge with, and no kernel
    assert forged["ok"] is False, forged


# -- verify() on forged child results, in this process ------------------------------------------------------------

def honest_child(slot: str, shapes: list[dict], seed: int, calls: int = 2) -> dict:
    """What an honest candidate's process returns: the built-in's outputs on the regenerated inputs."""
    contract = CONTRACTS[slot]
    records = []
    for n, shape in enumerate(shapes):
        s = kernel_check.check_seed(seed, n)
        inputs = kernel_check.regenerate(contract, shape, torch.float32, s, set(range(calls)))
        for i in range(calls):
            outs = kernel_check.as_outputs(contract.builtin(*inputs[i]))
            records.append({"shape": n, "seed": s, "draw": i, "refilled": i >= 2, "where": f"call {i + 1}",
                            "outputs": [kernel_check.encode_tensor(o) for o in outs],
                            "final_sha": [kernel_check.tensor_sha(o) for o in outs],
                            "input_sha": kernel_check.input_shas(inputs[i])})
    return {"mode": "check", "failure": None, "reason": None, "records": records, "timing": None,
            "timing_reason": "timing not asked for"}


PAYLOAD = {"slot": "rmsnorm", "dtype": "fp32", "device": "cpu", "shapes": SMALL_RMSNORM, "seed": 7, "calls": 2}


def test_verify_passes_honest_outputs():
    r = kernel_check.verify(PAYLOAD, honest_child("rmsnorm", SMALL_RMSNORM, 7))
    assert r["passed"] is True and r["shapes"][0]["mismatches"] == 0, r


@pytest.mark.parametrize("forgery,code", [
    ("claims_pass_without_outputs", "no_result"),
    ("other_seed", "wrote_input"),
    ("wrong_values", "wrong_values"),
    ("changed_after_return", "deferred"),
    ("poison", "uninitialized"),
    ("wrong_dtype", "bad_shape"),
    ("garbage_data", "no_result"),
])
def test_verify_rejects_a_forged_child_result(forgery, code):
    child = honest_child("rmsnorm", SMALL_RMSNORM, 7)
    rec = child["records"][1]
    if forgery == "claims_pass_without_outputs":
        child = {"mode": "check", "passed": True, "failure": None, "shapes": [], "records": child["records"][:1]}
    elif forgery == "other_seed":  # outputs right for other inputs than the verifier's
        child = honest_child("rmsnorm", SMALL_RMSNORM, 8)
        for r in child["records"]:
            r["seed"] = kernel_check.check_seed(7, r["shape"])
    elif forgery in ("wrong_values", "changed_after_return", "poison"):
        out = kernel_check.decode_tensor(rec["outputs"][0]).clone()
        if forgery == "poison":
            kernel_check.as_bits(out)[0, 0, 0] = kernel_check.poison_value(out.dtype)
        else:
            out[0, 0, 0] += 0.5
        rec["outputs"] = [kernel_check.encode_tensor(out)]
        if forgery != "changed_after_return":
            rec["final_sha"] = [kernel_check.tensor_sha(out)]
    elif forgery == "wrong_dtype":
        out = kernel_check.decode_tensor(rec["outputs"][0]).double()
        rec["outputs"], rec["final_sha"] = [kernel_check.encode_tensor(out)], [kernel_check.tensor_sha(out)]
    elif forgery == "garbage_data":
        rec["outputs"][0]["data"] = "!!not base64!!"
    r = kernel_check.verify(PAYLOAD, json.loads(json.dumps(child)))
    assert r["passed"] is False and r["failure"] == code, r
    assert r["reason"] and "\n" not in r["reason"], r["reason"]


def test_verify_keeps_a_failure_the_child_reports():
    child = {**honest_child("rmsnorm", SMALL_RMSNORM, 7), "failure": "tampered", "reason": "after loading, ..."}
    r = kernel_check.verify(PAYLOAD, child)
    assert r["passed"] is False and r["failure"] == "tampered"


def test_reference_is_computed_in_fp64_for_linear():
    x, w, b = CONTRACTS["linear"].make_inputs(SMALL_LINEAR[0], torch.float32, torch.device("cpu"),
                                              torch.Generator().manual_seed(0))
    assert CONTRACTS["linear"].reference(x, w, b).dtype == torch.float64
    assert builtin.linear_torch(x, w, b).dtype == torch.float32
