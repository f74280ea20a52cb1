"""GPU time of one captured decoding step, against the whole loop, per attention kernel and batch size.

    python -m specpilot.tools.profile.step_timing --target T [--batch-sizes 1,8] [--variants ar,ar-sdpa,...] [--layer-bench]

For each (batch size, variant) it decodes N tokens twice (the first run compiles and
captures), then replays the step's CUDA graph 40 times between CUDA events (`replay` = device time of one step),
and counts the kernels one replay launches with torch.profiler. `loop` is the decode time per step of the real
loop, host work included; loop - replay is the host's share. CUDA only.
"""
from __future__ import annotations

import argparse
import time

import torch

from ...engine import loader
from ...engine.engine import Engine
from ...engine.recipe import parse
from ..argtypes import add_target_argument
from .native_stderr import quiet_profile

_L12 = {"weights": {"format": "lossless12"}, "kernels": {"linear": "builtin:lossless12"}}
_NGRAM = {"drafter": {"kind": "ngram"}, "k": 4}
VARIANTS = {  # recipe fields over the defaults; each a lever on the AR or n-gram step
    "ar": {},
    "ar-sdpa": {"kernels": {"attention": "builtin:sdpa"}},
    "ar-triton": {"kernels": {"rmsnorm": "builtin:triton", "attention": "builtin:triton"}},
    "ar-overlap": {"overlap": True},
    "ar-autotune": {"compile_mode": "max-autotune-no-cudagraphs"},
    "ar-triton-linear": {"kernels": {"linear": "builtin:triton"}},
    "ar-lossless12": _L12,
    "ngram-k4": _NGRAM,
    "ngram-k4-overlap": {**_NGRAM, "overlap": True},
    "ngram-k4-triton": {**_NGRAM, "kernels": {"rmsnorm": "builtin:triton", "attention": "builtin:triton",
                                              "accept": "builtin:triton"}},
    "ngram-k4-lossless12": {**_NGRAM, **_L12},
    "ar-fused": {"layer": "fused"},
    "ngram-k4-fused": {**_NGRAM, "layer": "fused"},
    "ngram-k8-fused": {**_NGRAM, "k": 8, "layer": "fused"},
}
PROMPT = "Write a Python function that checks whether a number is prime, with tests."


def measure(engine: Engine, name: str, B: int, max_new_tokens: int) -> None:
    prompts = [engine.encode(PROMPT + " " * i) for i in range(B)]  # distinct lengths: a ragged batch
    t = time.perf_counter()
    engine.generate(prompts, max_new_tokens, ignore_eos=True)
    first_s = time.perf_counter() - t
    rows = engine.generate(prompts, max_new_tokens, ignore_eos=True)
    stats, dec = engine.decoder.last_stats, engine.decoder
    replay_ms = dec.time_graph_replay(40) * 1e3
    with quiet_profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        dec.replay_once()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    tokens = sum(len(r.tokens) for r in rows)
    tau = sum(r.mean_accepted for r in rows) / B
    print(f"B={B} {name:20s} first {first_s:5.1f}s {tokens / (stats.prefill_s + stats.decode_s):8.1f} tok/s  "
          f"loop {stats.decode_s / stats.steps * 1e3:.3f} ms/step  replay {replay_ms:.3f} ms  "
          f"kernels {len(kernels)}  tau {tau:.2f}", flush=True)
    if B == 1:
        by_name: dict[str, tuple[int, float]] = {}
        for e in kernels:
            count, us = by_name.get(e.name, (0, 0.0))
            by_name[e.name] = (count + 1, us + e.device_time)
        for kname, (count, us) in sorted(by_name.items(), key=lambda x: -x[1][1])[:16]:
            print(f"     {us / 1e3:7.3f} ms {count:4d}x {kname[:80]}", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    add_target_argument(ap, default="smollm2-135m")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--variants", default="ar,ar-sdpa,ngram-k4", help=f"any of {', '.join(VARIANTS)}")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--layer-bench", action="store_true",
                    help="first: the fused layer against the compiled modular one (bf16 check, µs per layer)")
    ap.add_argument("--layer-check", action="store_true", help="first: only the fused layer's fp32 and bf16 checks")
    ap.add_argument("--fma-max-tokens", default="",
                    help="with --layer-bench: FMA_MAX_TOKENS values to time the fused layer at, e.g. 1,8")
    ap.add_argument("--layer-tokens", default="1,5", help="with --layer-bench: tokens a step, e.g. 1,5,9")
    ap.add_argument("--no-attention-sweep", action="store_true",
                    help="with --layer-bench: only the attention settings as set (no sweep)")
    args = ap.parse_args(argv)
    target = loader.load(args.target, "bf16", "cuda")
    if args.layer_bench or args.layer_check:
        from ...engine.model import Block, compiled
        from ...kernels import triton_fused_layer

        with torch.inference_mode():
            for model in (loader.load(args.target, "fp32", "cuda").model, target.model):
                try:
                    err = triton_fused_layer.check(model, Block.forward)
                    print(f"fused layer check, {model.dtype}: largest error {err:.2e}", flush=True)
                except AssertionError as e:
                    print(f"fused layer check, {model.dtype}: FAILED {e}", flush=True)
            if args.layer_check:
                settings = []
            elif args.no_attention_sweep:
                settings = [None]
            else:
                settings = [dict(keys_per_split=k, block_s=b, num_warps=w)
                            for k, b, w in ((64, 64, 4), (32, 32, 4), (128, 64, 4), (128, 128, 4), (128, 128, 8),
                                            (256, 128, 8), (256, 256, 8))]
            for filled in (100, 300) if settings else ():
                fma = tuple(int(v) for v in args.fma_max_tokens.split(",") if v) or (None,)
                tokens = tuple(int(v) for v in args.layer_tokens.split(","))
                for row in triton_fused_layer.benchmark(target.model, compiled(Block.forward), tokens=tokens,
                                                        filled=filled, attention=settings, fma_max_tokens=fma):
                    print(f"fused layer T={row['tokens']} at {filled}: {row['fused_us']:.2f} us/layer, modular "
                          f"{row['modular_us']:.2f} us/layer, {row['speedup']:.2f}x  attention {row['attention']}  "
                          f"FMA up to {row['fma_max_tokens']} tokens", flush=True)
    for B in map(int, args.batch_sizes.split(",")):
        for name in filter(None, args.variants.split(",")):
            try:
                measure(Engine(target, parse({"name": name, **VARIANTS[name]})), name, B, args.max_new_tokens)
            except Exception as e:  # a variant that fails must not cost the others their measurements
                print(f"B={B} {name}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)


if __name__ == "__main__":
    main()
