"""The agent-facing kernel tools on CPU: every cheating kernel in tests/cheating_kernels is rejected by the defense
aimed at it, honest kernels of every slot pass (plain torch, and Triton under the interpreter), compile_triton
reports syntax and kernel errors with their message (and, compiled for sm_90 without a GPU, what only the GPU's
compiler refuses), timing is refused on CPU with the reason, call_tool answers
bad arguments with a structured error, and tool_specs are valid JSON schemas matching the functions. On a CUDA
machine also: timing over rotated inputs, the GPU variants of the cheats, and compiled kernels' resources."""
from __future__ import annotations

import inspect
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import pytest
import torch

from specpilot.kernels.slots import CONTRACTS
from specpilot.tools.agent_tools import TOOLS, benchmark_kernel, call_tool, compile_triton, tool_specs

KERNELS = Path(__file__).parent / "cheating_kernels"
# Small shapes: the checks are the same at any size; the contract's own shapes take seconds per slot on 2 cores.
SMALL = {
    "rmsnorm": [{"lead": [2, 3], "d": 64},
                {"lead": [2, 3, 4], "d": 16, "fused_width": 128}],  # per-head q-norm: a strided view of fused qkv
    "linear": [{"batch": 2, "tokens": 3, "in": 64, "out": 48, "bias": True}, {"batch": 1, "tokens": 1, "in": 32,
                                                                               "out": 16}],
    "attention": [{"batch": 2, "kv_heads": 2, "rep": 2, "tokens": 3, "head_dim": 16, "cache": 32},  # verify
                  {"batch": 1, "kv_heads": 2, "rep": 3, "tokens": 1, "head_dim": 16, "cache": 40, "window": 8}],
    "accept": [{"batch": 8, "k": 3, "vocab": 50}],
}

CHEATS = {  # file -> (failure code, words the reason must contain)
    "writes_inputs": ("wrote_input", "modified its input x"),
    "caches_by_pointer": ("wrong_after_refill", "refilled in place"),
    "deferred_work": ("deferred", "changed after the call returned"),
    "lazy_tensor": ("bad_type", "LazyNorm, not a plain torch.Tensor"),
    "stale_memory": ("uninitialized", "never wrote"),
    "patches_checker": ("tampered", "torch.allclose"),
    "patches_timer": ("tampered", "time.perf_counter"),
    "skips_calls": ("reused_output", "call 1 of"),
    "forges_result": ("no_result", "the verdict is the verifier's"),
}
HONEST = {  # name -> (slot, source)
    "honest_rmsnorm_torch": ("rmsnorm", (KERNELS / "honest_rmsnorm_torch.py").read_text()),
    "honest_rmsnorm_triton": ("rmsnorm", (KERNELS / "honest_rmsnorm_triton.py").read_text()),
    "builtin_linear": ("linear", "from specpilot.kernels.builtin import linear_torch as linear\n"),
    "builtin_sdpa": ("attention", "from specpilot.kernels.builtin import attention_sdpa as attention\n"),
    "builtin_accept": ("accept", "from specpilot.kernels.builtin import accept_torch as accept\n"),
}
BROKEN = {  # name -> (slot, source, failure code): honest mistakes rather than cheats
    "nan": ("rmsnorm", "def rmsnorm(x, w, eps):\n    return x * float('nan')\n", "nonfinite"),
    "no_mask": ("attention", "import torch.nn.functional as F\n\ndef attention(q, k, v, mask):\n"
                             "    return F.scaled_dot_product_attention(q, k, v)\n", "wrong_values"),
    "ignores_valid": ("accept", "def accept(drafts, valid, logits):\n    t = logits.argmax(-1)\n"
                                "    return (drafts == t[:, :-1]).long().cumprod(1).sum(1), t\n", "wrong_values"),
    "no_function": ("rmsnorm", "def rms_norm(x, w, eps):\n    return x\n", "load_error"),
}
TRITON_GOOD = (KERNELS / "honest_rmsnorm_triton.py").read_text()
COMPILES = {  # name -> (source, entry)
    "good": (TRITON_GOOD, "rmsnorm_kernel"),
    "syntax": (TRITON_GOOD.replace("row = tl.program_id(0)", "row = tl.program_id(0"), "rmsnorm_kernel"),
    "kernel_error": (TRITON_GOOD.replace("tl.sqrt(", "tl.no_such_sqrt("), "rmsnorm_kernel"),
    # right in the interpreter, refused by the compiler: a float before a loop, a block inside it (loop-carried)
    "retyped": (TRITON_GOOD.replace("    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / d + eps)",
                                    "    acc = 0.0\n    for _ in range(0, d, BLOCK):\n        acc = x * x\n"
                                    "    rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / d + eps)"), "rmsnorm_kernel"),
}


def check_through_call_tool(slot: str, source: str) -> dict:
    # the agent's path: JSON arguments, validated, then the sandboxed harness
    args = {"slot": slot, "source": source, "device": "cpu", "dtype": "fp32", "shapes": SMALL[slot], "timeout_s": 120}
    return call_tool("benchmark_kernel", json.dumps(args))


@pytest.fixture(scope="module")
def results() -> dict:
    """Every sandboxed run of this file, started together: each child spends most of its time importing torch, so
    two cores run several at once in little more than the time of one."""
    jobs = {name: (check_through_call_tool, "rmsnorm", (KERNELS / f"{name}.py").read_text()) for name in CHEATS}
    jobs |= {name: (check_through_call_tool, slot, src) for name, (slot, src) in HONEST.items()}
    jobs |= {name: (check_through_call_tool, slot, src) for name, (slot, src, _) in BROKEN.items()}
    jobs |= {f"compile_{name}": (lambda s, e: compile_triton(s, e, device="cpu", timeout_s=120).to_dict(), src, entry)
             for name, (src, entry) in COMPILES.items()}
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {name: pool.submit(fn, *args) for name, (fn, *args) in jobs.items()}
        return {name: f.result() for name, f in futures.items()}


def test_slot_contracts_verify_the_stock_recipes_draft_count():
    from specpilot.engine.recipe import BUILTIN
    from specpilot.kernels import slots

    assert slots.K == BUILTIN["stock"].k


@pytest.mark.parametrize("name", list(CHEATS))
def test_cheat_is_rejected_for_its_hack(results, name):
    code, words = CHEATS[name]
    r = results[name]
    assert r["passed"] is False and r["failure"] == code, r
    assert words in r["reason"], r["reason"]


@pytest.mark.parametrize("name", list(HONEST))
def test_honest_kernel_passes_within_tolerance(results, name):
    slot = HONEST[name][0]
    r = results[name]
    assert r["passed"] is True and r["failure"] is None, r
    assert [s["shape"] for s in r["shapes"]] == SMALL[slot]
    for s in r["shapes"]:
        assert s["ok"] and s["mismatches"] == 0 and s["calls"] >= 3  # fresh inputs twice, then refilled buffers
        assert s["worst_ratio"] <= 1 and (s["atol"], s["rtol"]) == pytest.approx(CONTRACTS[slot].tolerance(
            torch.float32))
    if slot == "accept":
        assert all(s["max_abs_err"] == 0 and s["atol"] == s["rtol"] == 0 for s in r["shapes"])  # exact


def test_triton_kernel_really_differs_from_the_builtin(results):
    # the interpreter's fp32 reduction order is not torch's: a nonzero error that stays inside the tolerance
    assert 0 < results["honest_rmsnorm_triton"]["shapes"][0]["worst_ratio"] <= 1


@pytest.mark.parametrize("name", list(BROKEN))
def test_broken_kernel_fails_with_its_reason(results, name):
    r = results[name]
    assert r["passed"] is False and r["failure"] == BROKEN[name][2], r


def test_timing_is_refused_on_cpu_with_the_reason(results):
    r = results["honest_rmsnorm_torch"]
    assert r["timing"] is None and r["device"] == "cpu"
    assert "CUDA" in r["timing_reason"] and "interpreter" in r["timing_reason"]


def test_compile_triton_good_kernel(results):
    """On CPU the launch runs in the interpreter, then the example's launch is compiled for the H200 (sm_90): the
    binary's registers and spills."""
    r = results["compile_good"]
    assert r["ok"] and r["launched"] and r["interpreted"] and r["stage"] is None and not r["messages"]
    assert "sm_90" in r["resources_reason"]
    assert [k["name"] for k in r["resources"]] == ["rmsnorm_kernel"]
    assert all(k["target"] == "sm_90" and 0 < k["n_regs"] <= 255 and k["n_spills"] == 0 for k in r["resources"])


def test_compile_triton_reports_what_only_the_gpu_compiler_refuses(results):
    r = results["compile_retyped"]
    assert not r["ok"] and r["stage"] == "compile", r
    assert "acc" in " ".join(r["messages"]), r["messages"]


def test_compile_triton_reports_a_syntax_error(results):
    r = results["compile_syntax"]
    assert not r["ok"] and r["stage"] == "import"
    assert "SyntaxError" in r["messages"][0] and "was never closed" in r["messages"][0]


def test_compile_triton_reports_a_kernel_error(results):
    r = results["compile_kernel_error"]
    assert not r["ok"] and r["stage"] == "interpret"
    assert "no_such_sqrt" in r["messages"][0]


@pytest.mark.parametrize("name,arguments,words", [
    ("no_such_tool", {}, "no tool named 'no_such_tool'"),
    ("benchmark_kernel", "{not json", "not valid JSON"),
    ("benchmark_kernel", {"source": "def rmsnorm(x, w, eps): return x"}, "'slot' is a required property"),
    ("benchmark_kernel", {"slot": "softmax", "source": "x"}, "slot: 'softmax' is not one of"),
    ("benchmark_kernel", {"slot": "rmsnorm", "source": "x", "dtype": "int8"}, "dtype: 'int8' is not one of"),
    ("benchmark_kernel", {"slot": "rmsnorm", "source": "x", "timing": "yes"}, "timing: 'yes' is not of type"),
    ("benchmark_kernel", {"slot": "rmsnorm", "source": "x", "shapes": []}, "shapes: [] should be non-empty"),
    ("compile_triton", {"source": "x", "entry": "not an identifier"}, "entry: 'not an identifier' does not match"),
    ("compile_triton", {"source": "x", "entry": "k", "flags": "-O3"}, "'flags' was unexpected"),
    ("benchmark_recipe", {"recipe": "stock", "batch_sizes": [0]}, "batch_sizes/0: 0 is less than the minimum"),
    ("token_force_check", ["stock"], "is not of type 'object'"),
])
def test_call_tool_rejects_bad_arguments(name, arguments, words):
    r = call_tool(name, arguments)
    assert set(r) == {"error"} and r["error"]["type"] in ("unknown_tool", "bad_arguments"), r
    assert words in r["error"]["message"], r["error"]["message"]


@pytest.mark.parametrize("name,arguments,words", [
    ("benchmark_recipe", {"recipe": "/no/such/recipe.json", "device": "cpu"}, "no/such/recipe.json"),
    ("token_force_check", {"recipe": "stock", "workload": "no-such-workload", "device": "cpu"}, "no-such-workload"),
    ("profile", {"target": "/no/such/model", "device": "cpu"}, "/no/such/model"),
])
def test_wrapped_tool_reports_bad_input_as_a_result(name, arguments, words):
    r = call_tool(name, arguments)
    assert r["ok"] is False and words in r["error"], r


def test_tool_specs_are_openai_tools_with_valid_schemas():
    specs = tool_specs()
    assert [s["function"]["name"] for s in specs] == list(TOOLS)
    assert set(TOOLS) == {"compile_triton", "benchmark_kernel", "benchmark_recipe", "token_force_check", "profile"}
    for spec in specs:
        assert spec["type"] == "function" and set(spec["function"]) == {"name", "description", "parameters"}
        schema = spec["function"]["parameters"]
        jsonschema.Draft202012Validator.check_schema(schema)
        assert schema["type"] == "object" and schema["additionalProperties"] is False
        json.dumps(spec)  # serializable as sent to a model


@pytest.mark.parametrize("name", list(TOOLS))
def test_schema_matches_the_function_signature(name):
    tool = TOOLS[name]
    params = inspect.signature(tool.function).parameters
    schema = tool.parameters
    assert set(schema["properties"]) == set(params)
    assert set(schema["required"]) == {p for p, v in params.items() if v.default is inspect.Parameter.empty}
    for p, prop in schema["properties"].items():
        if "default" in prop:
            assert prop["default"] == (list(params[p].default) if isinstance(params[p].default, tuple)
                                       else params[p].default), p


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="timing and the GPU paths need a CUDA device")
CUDA_CHEATS = {  # file -> (failure codes, words the reason must contain)
    "deferred_work": ({"deferred"}, "changed after the call returned"),  # a side stream the caller never waits on
    "stale_memory": ({"uninitialized"}, "never wrote"),  # the caching allocator's freed block, poisoned
    # caught among the outputs kept from the timing loop: a skipped call hands back the previous call's output,
    # which is wrong for its inputs, or the very object of a kept earlier output
    "skips_when_timed": ({"wrong_values", "reused_output"}, "timed call"),
    "patches_timer": ({"tampered"}, "torch.cuda.Event"),
}


@cuda
def test_cuda_honest_kernel_is_timed_over_inputs_larger_than_l2():
    r = benchmark_kernel("rmsnorm", HONEST["honest_rmsnorm_torch"][1], device="cuda", dtype="bf16",
                         shapes=SMALL["rmsnorm"][:1])
    assert r.passed, r.reason
    [t] = r.timing
    assert t["median_us"] > 0 and t["builtin_median_us"] > 0 and t["runs"] > t["warmup"]
    # small inputs: each call gets its own set, and L2 is overwritten before each timed call
    assert t["input_sets"] == t["warmup"] + t["runs"] and t["l2_overwritten_between_calls"] and t["l2_bytes"] > 0


@cuda
@pytest.mark.parametrize("name", list(CUDA_CHEATS))
def test_cuda_cheat_is_rejected(name):
    codes, words = CUDA_CHEATS[name]
    r = benchmark_kernel("rmsnorm", (KERNELS / f"{name}.py").read_text(), device="cuda", dtype="bf16",
                         shapes=SMALL["rmsnorm"][:1])
    assert not r.passed and r.failure in codes, r
    assert words in r.reason, r.reason


@cuda
def test_cuda_compile_reports_registers_and_shared_memory():
    r = compile_triton(TRITON_GOOD, "rmsnorm_kernel", device="cuda")
    assert r.ok and r.launched and not r.interpreted, r
    assert r.resources and all(k["n_regs"] > 0 and k["n_spills"] >= 0 and k["shared_bytes"] >= 0
                               for k in r.resources)
