"""Compiling the kernels for the H200 without a GPU (kernels/cross_compile.py): what the interpreter cannot catch.

The compiler needs the @triton.jit kernels that the interpreter (on in this process, conftest) replaces, so each check
runs in a child process with TRITON_INTERPRET unset."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
import triton
import triton.language as tl

from specpilot.kernels.cross_compile import signature

ROOT = Path(__file__).resolve().parents[2]  # the folder holding the `specpilot` checkout


def child(args: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout)


def test_every_fused_layer_kernel_compiles_for_hopper():
    """Every kind of step the engine runs on the fused layer (one token, a verification step of five with and without
    a dead-token mask, ragged batches on tensor cores), on SmolLM2's, Llama-3-8B's, a
    Qwen3-like (q/k norm) and a Qwen2-like (q/k/v bias) shape: each kernel compiles for sm_90, and reports its
    registers; SmolLM2's one-token kernels without a spill."""
    r = child(["-m", "specpilot.kernels.cross_compile"])
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    kernels = {x["kernel"] for x in report}
    assert kernels == {"_norm_pair_gemv", "_qk_norm_rope", "_decode_attention", "_gemv", "_add_rmsnorm"}
    assert all(0 < x["registers"] <= 255 for x in report)
    assert {x["constexprs"]["DOT"] for x in report if x["kernel"] == "_gemv"} == {False, True}  # both paths
    for kernel in ("_gemv", "_norm_pair_gemv"):  # split K too
        assert {x["constexprs"].get("SPLIT", 1) for x in report if x["kernel"] == kernel} >= {1, 2, 3}
    # the input residual stored into a slice as well (an EAGLE-3 head's capture): FMA, tensor cores, 12-bit weights
    stores = {(x["constexprs"]["DOT"], x["constexprs"].get("W12", False)) for x in report
              if x["kernel"] == "_norm_pair_gemv" and x["constexprs"].get("AUX")}
    assert stores >= {(False, False), (True, False), (False, True)}, stores
    # the attention's late PDL trigger (an A/B setting) on both attention paths
    late = [x for x in report if x["kernel"] == "_decode_attention" and x["constexprs"].get("LATE_TRIGGER")]
    assert {x["constexprs"]["BLOCK_S"] for x in late} == {32, 64}, late
    # ... as shipped, from LATE_TRIGGER_MIN_TOKENS tokens a step (8), at each program's start below it
    shipped = {(int(m[1]) * int(m[2]), bool(x["constexprs"].get("LATE_TRIGGER"))) for x in report
               if x["kernel"] == "_decode_attention" and "late trigger" not in x["case"]
               for m in [re.search(r"B=(\d+) T=(\d+)", x["case"])]}
    assert {late for _, late in shipped} == {False, True}
    assert all(late == (tokens >= 8) for tokens, late in shipped), sorted(shipped)
    # SmolLM2's one-token path (its AR steps and short verifications, the engine's hottest kernels) spills nothing;
    # the tensor-core path's attention and some of its GEMVs do (255 registers: docs/benchmarks, forty-seventh lease)
    fma = [x for x in report if x["case"].startswith("smollm2-135m B=1 T=1")]
    assert {x["kernel"] for x in fma} == kernels - {"_qk_norm_rope"}  # (Qwen3's alone)
    assert all(x["stack_bytes"] == 0 and x["local_bytes"] == 0 for x in fma), [x for x in fma if x["stack_bytes"]]


BAD_KERNEL = textwrap.dedent('''
    import sys
    import torch
    import triton
    import triton.language as tl
    from specpilot.kernels.cross_compile import compile_launch

    @triton.jit
    def retyped(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        acc = 0.0  # a float before the loop, a block inside it: loop-carried with two types
        for i in range(0, n, BLOCK):
            acc = tl.load(x_ptr + i + tl.arange(0, BLOCK))
        tl.store(out_ptr + tl.arange(0, BLOCK), acc)

    x = torch.zeros(64)
    if sys.argv[1] == "interpret":
        retyped[(1,)](x, torch.empty(16), 64, BLOCK=16)
        print("ran")
    else:
        try:
            compile_launch(retyped, (x, x, 64), {"BLOCK": 16})
            print("compiled")
        except Exception as e:
            print("refused:", type(e).__name__)
''')


def test_the_compiler_refuses_what_the_interpreter_runs(tmp_path):
    """A loop-carried value that changes type runs in the interpreter and fails to compile for the GPU: the check
    catches what CI's interpreted tests cannot."""
    script = tmp_path / "retyped.py"
    script.write_text(BAD_KERNEL)
    env_run = subprocess.run([sys.executable, str(script), "interpret"], capture_output=True, text=True,
                             env={**os.environ, "TRITON_INTERPRET": "1",
                                  "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
                             timeout=300)
    assert env_run.stdout.strip() == "ran", env_run.stderr[-2000:]
    compiled = child([str(script), "compile"], timeout=300)
    assert compiled.stdout.strip().startswith("refused:"), (compiled.stdout, compiled.stderr[-2000:])


def test_signature_follows_the_launch_arguments():
    """Tensors are pointers to their dtype, small ints i32, large ones i64, floats fp32, constexprs by value (the
    default where the launch gives none); num_warps is a compile option."""
    from specpilot.kernels import triton_fused_layer as F

    x = torch.empty(4, dtype=torch.bfloat16, device="meta")
    live = torch.empty(4, dtype=torch.int32, device="meta")
    fn = jit_function(F._gemv)
    args = (x, x, x, x, live, 3, 2 ** 40, 576)
    sig, constexprs, options = signature(fn, args, dict(HAS_BIAS=False, DOT=False, DOT_PRECISION="tf32", SINGLE=True,
                                                        PDL=True, SKIP_DEAD=True, BLOCK_M=1, BLOCK_N=2, BLOCK_K=1024,
                                                        num_warps=4))
    assert sig["x_ptr"] == "*bf16" and sig["live_ptr"] == "*i32"
    assert (sig["M"], sig["N"], sig["K"]) == ("i32", "i64", "i32")
    assert constexprs["BLOCK_K"] == 1024 and sig["BLOCK_K"] == "constexpr"
    assert options == {"num_warps": 4}
    _, constexprs, _ = signature(jit_function(_with_default), (x, 4), {})
    assert constexprs == {"SCALE": 2}  # the default, where the launch gives none


@triton.jit
def _with_default(x_ptr, n, SCALE: tl.constexpr = 2):
    offs = tl.arange(0, 4)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * SCALE, mask=offs < n)


def jit_function(kernel):
    """The JITFunction behind `kernel` (under the interpreter the kernel wraps the jit function)."""
    fn = getattr(kernel, "fn", kernel)
    if not hasattr(fn, "params"):
        from triton.runtime.jit import JITFunction
        fn = JITFunction(fn)
    return fn
