"""Compiling this package's Triton kernels for a GPU the machine does not have (CI: no GPU).

Triton's interpreter (TRITON_INTERPRET=1) runs a kernel's logic on the CPU, but it compiles nothing: a kernel that is
right there can still fail to compile for the GPU (a loop-carried value that changes type, a constexpr branch that
only the compiler checks, a tile that does not fit). Triton's wheel carries ptxas, so the compiler runs without a
GPU: `record` catches a function's kernel launches (the launch arguments as the kernel would see them, nothing run),
`compile_launch` compiles one for a target architecture (sm_90, the H200's, by default) and reports the registers,
spills and shared memory of the binary (from `cuobjdump -res-usage`, also in the wheel).

Run it with the interpreter off (the compiler needs @triton.jit functions, which the interpreter replaces):
`python -m specpilot.kernels.cross_compile` compiles the fused layer's kernels for every kind of step the engine
runs, on SmolLM2's and Llama-3-8B's shapes (on the `meta` device: no weights), and exits 1 on any failure.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch

HOPPER = 90


class _Launches:
    """Stands in for a kernel: `kernel[grid](*args, **kwargs)` records the call and runs nothing."""

    def __init__(self, fn, calls: list):
        self.fn, self.calls = fn, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.fn, args, kwargs))


@contextlib.contextmanager
def record(module, names: list[str]):
    """Within the block, the kernels `names` of `module` are recorded instead of launched; yields the list of
    (kernel, args, kwargs) the block launched."""
    calls: list = []
    saved = {name: getattr(module, name) for name in names}
    try:
        for name, fn in saved.items():
            setattr(module, name, _Launches(fn, calls))
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)


_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64",
           torch.int32: "i32", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1", torch.int16: "i16"}
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas")  # compile options among a launch's keywords


def signature(fn, args: tuple, kwargs: dict) -> tuple[dict, dict, dict]:
    """A launch's (signature, constexprs, options) as Triton specializes it: a tensor is a pointer to its dtype, an
    int i32 (i64 when it does not fit), a float fp32; constexprs by value, defaults where the launch gave none."""
    sig, constexprs = {}, {}
    for i, param in enumerate(fn.params):
        name = param.name
        value = args[i] if i < len(args) else kwargs.get(name, param.default)
        if param.is_constexpr or value is None:  # (Triton makes an argument given as None a constexpr None)
            sig[name] = "constexpr"
            constexprs[name] = getattr(value, "value", value)
        elif isinstance(value, torch.Tensor):
            sig[name] = "*" + _DTYPES[value.dtype]
        elif isinstance(value, bool):
            sig[name] = "i1"
        elif isinstance(value, int):
            sig[name] = "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
        elif isinstance(value, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: argument {name} of type {type(value).__name__}")
    options = {k: kwargs[k] for k in LAUNCH_OPTIONS if k in kwargs}
    return sig, constexprs, options


def resource_usage(cubin: bytes) -> dict:
    """Registers, spill stores and shared memory of a cubin's kernel, as cuobjdump -res-usage reports them."""
    from triton.backends.nvidia import compiler as nvidia

    tool = Path(nvidia.__file__).parent / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    found = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text))
    return {"registers": int(found.get("REG", 0)), "stack_bytes": int(found.get("STACK", 0)),
            "shared_bytes": int(found.get("SHARED", 0)), "local_bytes": int(found.get("LOCAL", 0))}


def compile_launch(fn, args: tuple, kwargs: dict, arch: int = HOPPER) -> dict:
    """Compile one recorded launch for CUDA `arch` (no GPU needed); its resources, or raise the compiler's error."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, constexprs, options = signature(fn, args, kwargs)
    kernel = triton.compile(ASTSource(fn, sig, constexprs=constexprs), target=GPUTarget("cuda", arch, 32),
                            options=options)
    return {"kernel": fn.__name__, **resource_usage(kernel.asm["cubin"])}


# -- the fused layer, every kind of step ------------------------------------------------------------------------
SHAPES = {  # hidden, heads, kv heads, head dim, intermediate, q/k norm, q/k/v bias
    "smollm2-135m": (576, 9, 3, 64, 1536, False, False),
    "llama-3-8b": (4096, 32, 8, 128, 14336, False, False),
    "qwen3-like": (1024, 16, 8, 128, 3072, True, False),
    "qwen2-like": (896, 14, 2, 64, 4864, False, True),
}


def _meta_block(hidden, heads, kv_heads, head_dim, inter, qk_norm, bias):
    """A layer with the fused layer's attributes, its weights on the meta device (shapes and dtype only)."""
    def w(*shape):
        return torch.empty(*shape, dtype=torch.bfloat16, device="meta")

    qkv = (heads + 2 * kv_heads) * head_dim
    cfg = SimpleNamespace(head_dim=head_dim, n_heads=heads, n_kv_heads=kv_heads, intermediate_size=inter,
                          qk_norm=qk_norm, rms_eps=1e-5)
    return SimpleNamespace(cfg=cfg, attn_norm=w(hidden), wqkv=w(qkv, hidden), bqkv=w(qkv) if bias else None,
                           wo=w(hidden, heads * head_dim), bo=None, mlp_norm=w(hidden), w13=w(2 * inter, hidden),
                           w2=w(hidden, inter), window=None, q_norm=w(head_dim), k_norm=w(head_dim))


def _meta_planes(w: torch.Tensor):
    """A [N, K] weight's 12-bit planes (kernels/lossless12_format.Packed12Linear) on the meta device, a few escapes."""
    from .lossless12_format import Packed12Linear

    n, k = w.shape
    k8, e = -(-k // 8), 64
    return Packed12Linear(q=torch.empty(n, 3 * k8, dtype=torch.int32, device="meta"),
                          exc_row=torch.empty(e, dtype=torch.int32, device="meta"),
                          exc_col=torch.empty(e, dtype=torch.int32, device="meta"),
                          exc_val=torch.empty(e, dtype=torch.float32, device="meta"),
                          row_ptr=torch.empty(n + 1, dtype=torch.int32, device="meta"), shape=(n, k), base=112)


def fused_layer_launches(steps=((1, 1), (1, 5), (4, 2), (8, 2))) -> list[tuple[str, tuple]]:
    """The launches of a fused layer for each shape, (B, T) step and dead-token mask or none, as on the GPU (PDL on,
    the GPU's program counts), and with 12-bit weights for the steps that read them (FMA_MAX_TOKENS tokens at most):
    [(what, (kernel, args, kwargs))]."""
    from . import triton_fused_layer as F

    out = []
    names = ["_norm_pair_gemv", "_qk_norm_rope", "_decode_attention", "_gemv", "_add_rmsnorm"]
    saved, tiles, late = F._pdl, F.DOT_TILES, F.ATTENTION_LATE_TRIGGER
    try:
        F._pdl = lambda device: True
        for shape, dims in SHAPES.items():
            block = _meta_block(*dims)
            hidden, head_dim = dims[0], dims[3]
            for B, T in steps:
                for live in (False, True):
                    x = torch.empty(B, T, hidden, dtype=torch.bfloat16, device="meta")
                    cos = torch.empty(B, T, 1, head_dim, dtype=torch.bfloat16, device="meta")
                    cache = torch.empty(2, B, dims[2], 512, head_dim, dtype=torch.bfloat16, device="meta")
                    rows = torch.empty(B, T, dtype=torch.long, device="meta")
                    mask = torch.empty(B * T, dtype=torch.int32, device="meta") if live else None
                    # with the mask, as an EAGLE-3 head's target steps run: the input residual into a slice too
                    wide = torch.empty(B, T, 3 * hidden, dtype=torch.bfloat16, device="meta")
                    resid_out = wide[..., hidden: 2 * hidden] if live else None
                    with record(F, names) as calls:
                        _gpu_programs(F, lambda: F.fused_layer(block, x, x, cos, cos, cache, rows, rows, {}, None,
                                                               live=mask, resid_out=resid_out))
                        F.final_norm(x, x, block.attn_norm, 1e-5, mask)
                    what = f"{shape} B={B} T={T}{' live mask' if live else ''}"
                    out += [(what, call) for call in calls]
                    if B * T <= F.FMA_MAX_TOKENS:
                        planes = tuple(_meta_planes(w) for w in (block.wqkv, block.wo, block.w13, block.w2))
                        with record(F, names) as calls:
                            _gpu_programs(F, lambda: F.fused_layer(block, x, x, cos, cos, cache, rows, rows, {}, None,
                                                                   live=mask, weights12=planes, resid_out=resid_out))
                        out += [(what + " 12-bit", call) for call in calls]
                    if live:
                        continue
                    # an EAGLE-3 head's chain step at this shape (draft_layer: q/k/v of its given [embedding;
                    # hidden] pair, no norm; its LM head in the pair kernel's PLAIN mode)
                    pair = torch.empty(B, T, 2 * hidden, dtype=torch.bfloat16, device="meta")
                    lm_head = torch.empty(8192, hidden, dtype=torch.bfloat16, device="meta")
                    with record(F, names) as calls:
                        _gpu_programs(F, lambda: (
                            F.fused_layer(block, x, x, cos, cos, cache, rows, rows, None, None, qkv_input=pair),
                            F.draft_logits(x, x, block.attn_norm, lm_head, 1e-5)))
                    out += [(what + " draft head", call) for call in calls]
        # K split over programs on the tensor-core path (DOT_TILES' "split"), every GEMV, at SmolLM2's shape
        block, dims = _meta_block(*SHAPES["smollm2-135m"]), SHAPES["smollm2-135m"]
        F.DOT_TILES = {role: {**tiles.get(role, {}), "split": n} for role, n in (("qkv", 2), ("o", 2), ("mlp", 3),
                                                                                   ("down", 3))}
        x = torch.empty(8, 2, dims[0], dtype=torch.bfloat16, device="meta")
        cos = torch.empty(8, 2, 1, dims[3], dtype=torch.bfloat16, device="meta")
        cache = torch.empty(2, 8, dims[2], 512, dims[3], dtype=torch.bfloat16, device="meta")
        rows = torch.empty(8, 2, dtype=torch.long, device="meta")
        with record(F, names) as calls:
            _gpu_programs(F, lambda: F.fused_layer(block, x, x, cos, cos, cache, rows, rows, {}, None))
        out += [("smollm2-135m B=8 T=2 split K", call) for call in calls]
        # the attention letting the o projection launch late at any size (ATTENTION_LATE_TRIGGER forced), one
        # token and eight
        F.DOT_TILES, F.ATTENTION_LATE_TRIGGER = tiles, True
        for B in (1, 8):
            x = torch.empty(B, 1, dims[0], dtype=torch.bfloat16, device="meta")
            cos = torch.empty(B, 1, 1, dims[3], dtype=torch.bfloat16, device="meta")
            cache = torch.empty(2, B, dims[2], 512, dims[3], dtype=torch.bfloat16, device="meta")
            rows = torch.empty(B, 1, dtype=torch.long, device="meta")
            with record(F, names) as calls:
                _gpu_programs(F, lambda: F.fused_layer(block, x, x, cos, cos, cache, rows, rows, {}, None))
            out += [(f"smollm2-135m B={B} T=1 late trigger", call) for call in calls
                    if call[0].__name__ == "_decode_attention"]
    finally:
        F._pdl, F.DOT_TILES, F.ATTENTION_LATE_TRIGGER = saved, tiles, late
    return out


def _gpu_programs(F, run):
    """Run `run` as if on a GPU: the GPU's least program count and attention splits (fused_layer picks the
    interpreter's off the GPU)."""
    blocks, splits = F.gemv_blocks, F.attention_splits
    F.gemv_blocks = lambda n_rows, k, n_tokens, min_programs=F.MIN_PROGRAMS, pairs=False, role=None, w12=False: (
        blocks(n_rows, k, n_tokens, F.MIN_PROGRAMS, pairs, role, w12))
    F.attention_splits = lambda n_slots, n_tokens, device: splits(n_slots, n_tokens, torch.device("cuda"))
    try:
        run()
    finally:
        F.gemv_blocks, F.attention_splits = blocks, splits


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("cross_compile: unset TRITON_INTERPRET (the compiler needs @triton.jit kernels)", file=sys.stderr)
        return 2
    seen, failures, report = set(), 0, []
    for what, (fn, args, kwargs) in fused_layer_launches():
        sig, constexprs, options = signature(fn, args, kwargs)
        key = (fn.__name__, tuple(sorted(sig.items())), tuple(sorted(constexprs.items())),
               tuple(sorted(options.items())))
        if key in seen:
            continue
        seen.add(key)
        try:
            usage = compile_launch(fn, args, kwargs)
            report.append({"case": what, **usage, "constexprs": constexprs})
            if usage["local_bytes"] or usage["stack_bytes"]:
                print(f"spills: {what} {fn.__name__} {usage}", file=sys.stderr)
        except Exception as e:  # one line per failing kernel, then the next
            failures += 1
            message = str(e).strip().splitlines()
            report.append({"case": what, "kernel": fn.__name__, "error": message[-1] if message else repr(e),
                           "constexprs": constexprs})
            print(f"FAILED {what} {fn.__name__}: {message[-1] if message else e!r}", file=sys.stderr)
    print(json.dumps(report, indent=1, default=str))
    print(f"cross_compile: {len(report)} kernels compiled for sm_{HOPPER}, {failures} failed", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
