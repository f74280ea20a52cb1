"""What the static KV cache's length costs a decoding step, and the fused attention's merge of its splits.

What it measures. A random-weight model of SmolLM2-135M's shapes (nothing staged), bf16, the fused layer: our
fastest AR's step and the n-gram controller's blind step (AR's kernels in a speculative decoder) at each batch size,
every row at the same position, in caches of several lengths (each system and length a decoder of its own, warmed,
then grown to that length), replayed in turn, rounds of 20 replays, each cell the median of its rounds, and over our
AR at the shortest cache. Then the same with the attention's merge taking all of a token's splits at once (the
kernel before the forty-eighth lease: `SPECPILOT_ATTENTION_MERGE_SPLITS=0`), and with the merge of 16 at a time
again: whether a longer cache costs the step, and whether the narrow merge removes that. With `--kernels`, each
kernel's device µs a step of our AR in each cache (torch.profiler over replays of its graph): where a cache length's
difference lies (the forty-eighth and forty-ninth leases: at B = 8, 1,024 slots 8-10% faster than 512). With
`--pad-splits N`, the merge of 16 again with every attention grid padded to at least N splits (past the cache: they
return at once): whether the grid's size, not the cache's layout, is what makes 1,024 slots faster there. With
`--multi-attention`, the merge of 16 with other settings of the multi-token attention (B rows of one token take it
past FMA_MAX_TOKENS, with tiles tuned for one row of 8 tokens). With `--late-trigger`, the attention letting the o
projection launch (PDL) once each split's tiles are attended: whether the early-launched o projection is what a
512-slot grid (its split programs past the position dispatched early) pays at B = 8. `--no-merge-ab`: the merge of
16 only.

Why: a decoder's cache only grows, and a recipe that verifies k drafts needs 2(k + 1) slots more than AR with
overlap (engine/decode.py, `cache_length`): after chat's longest prompt (380 tokens) the controllers held 576 slots
and our AR 512, and at summarize's contexts their AR-kind steps ran 2.4-6.2% over AR's on the device (forty-seventh
lease, M). The forty-eighth lease's run (H200, 19189e9) found a step of +3.6% at B = 2 from 512 slots to 576, 640 and
1,024 alike (16 splits merged over 16 lanes against 18-32 over 32), with the split programs past the position
ending at once or waiting alike, and that early exit 17% slower at B = 8: the exit went, the merge narrowed.

Backs docs/BENCHMARKS.md, "Speculative vs AR, by batch size" (the forty-seventh lease's summarize cells after chat's,
docs/benchmarks/2026-12-07-forty-eighth-lease.md).

Run it with `--target none` on a fresh machine: it stages no model (one call, no parts to carry).

Device minutes: about 2 (six decoders' warm-ups, three rounds of timing; 100 s on a fresh H200 at --rounds 3).
"""
from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time

import harness

MINUTES = 2
CUDA_ONLY = True


def arguments(p) -> None:
    p.add_argument("--batch-sizes", default="2,8")
    p.add_argument("--slots", default="512,576,640,1024", help="cache lengths our AR is timed in (the first: the base)")
    p.add_argument("--controller-slots", default="512,576", help="cache lengths the n-gram controller is timed in ('': none, AR alone)")
    p.add_argument("--position", type=int, default=440, help="every row's position (below the shortest cache)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--pad-splits", type=int, default=0,
                   help="also the merge of 16 with every attention grid padded to at least this many splits (those past "
                        "the cache return at once): whether the grid's size or the cache's layout is what 1,024 slots "
                        "change at B = 8")
    p.add_argument("--multi-attention", default="",
                   help="also the merge of 16 with these settings of the multi-token attention (ATTENTION_MULTI), "
                        "JSON objects separated by ';', e.g. '{\"keys_per_split\": 32, \"block_s\": 32}': a step of "
                        "B rows of one token each takes that path past FMA_MAX_TOKENS, with the tiles tuned for one "
                        "row of 8 tokens")
    p.add_argument("--no-merge-ab", action="store_true", help="the merge of 16 only (not all at once, not again)")
    p.add_argument("--late-trigger", action="store_true",
                   help="also the merge of 16 with the attention letting the o projection launch once each split's "
                        "tiles are attended, not at its start (SPECPILOT_ATTENTION_LATE_TRIGGER)")
    p.add_argument("--kernels", action="store_true",
                   help="also each kernel's device µs a step of our AR, by cache length (torch.profiler, merge of 16)")


def timed(decoders: dict, batch_sizes, position: int, rounds: int) -> dict:
    """{(system, slots, B): median ms} of each decoder's step kind, replayed in turn round after round."""
    times: dict[tuple, list[float]] = {}
    for B in batch_sizes:
        for _ in range(rounds):
            for (system, slots), (dec, kind) in decoders.items():
                st = dec._use(B, 0)
                st.lengths.fill_(position)
                times.setdefault((system, slots, B), []).append(dec._time_step(st, kind, 20) * 1e3)
    return {key: statistics.median(v) for key, v in times.items()}


def ab_runs(args, multi: dict) -> list[tuple[str, int, int, dict, bool]]:
    """What is timed, in order: (label, splits merged at a time, attention grid padded to at least, the multi-token
    attention's setting, whether the attention lets the next kernel launch late), from the shipped multi-token
    setting `multi` and the arguments."""
    runs = [("16", 16, 0, multi, False)] if args.no_merge_ab else [
        ("16", 16, 0, multi, False), ("all", 0, 0, multi, False), ("16 again", 16, 0, multi, False)]
    if args.pad_splits:
        runs.append((f"16, grid of {args.pad_splits}+ splits", 16, args.pad_splits, multi, False))
    if getattr(args, "late_trigger", False):
        runs.append(("16, o projection launched after the splits' tiles", 16, 0, multi, True))
    for text in filter(None, (t.strip() for t in args.multi_attention.split(";"))):
        try:
            change = json.loads(text)
        except ValueError as e:
            raise SystemExit(f"--multi-attention: {text!r} is not a JSON object ({e})")
        if not isinstance(change, dict) or set(change) - set(multi):
            raise SystemExit(f"--multi-attention: {text!r} must be a JSON object of some of {', '.join(multi)}")
        runs.append((f"16, multi-token attention {json.dumps(change)}", 16, 0, {**multi, **change}, False))
    return runs


@contextlib.contextmanager
def padded_grid(F, at_least: int):
    """The fused attention's grid at least `at_least` splits a token (0: as shipped), the splits' length unchanged:
    the extra splits start past the cache and return at once, as those past a token's position do."""
    shipped = F.attention_splits
    if at_least > 0:
        def padded(n_slots, n_tokens, device):
            splits, per = shipped(n_slots, n_tokens, device)
            return max(splits, at_least), per
        F.attention_splits = padded
    try:
        yield
    finally:
        F.attention_splits = shipped


def kernel_times(decoders: dict, batch_sizes, position: int, replays: int = 20) -> dict:
    """{(slots, B): {kernel name: device µs a step}} of our AR's step in each cache, from torch.profiler over
    `replays` replays of its graph (PDL on, as shipped: a kernel's span then starts at its early launch and holds its
    wait on the one before)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for (system, slots), (dec, kind) in decoders.items():
        if system != "ar-fused-overlap":
            continue
        for B in batch_sizes:
            st = dec._use(B, 0)
            st.lengths.fill_(position)
            dec._time_step(st, kind, 3)  # (captured and warm before the profiler starts)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                dec._time_step(st, kind, replays)
                torch.cuda.synchronize()
            totals: dict[str, float] = {}
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    totals[e.name] = totals.get(e.name, 0.0) + e.time_range.elapsed_us() / replays
            out[(slots, B)] = totals
    return out


def kernel_table(times: dict, slots: list[int], batch_sizes) -> str:
    """Per B, the kernels that took at least 1 µs a step, µs in each cache length (the first column the base)."""
    parts = []
    for B in batch_sizes:
        names = sorted({n for (s, b), t in times.items() if b == B for n, us in t.items() if us >= 1.0},
                       key=lambda n: -times[(slots[0], B)].get(n, 0.0))
        rows = [f"| {n[:60]} | " + " | ".join(f"{times[(s, B)].get(n, 0.0):.1f}" for s in slots) + " |" for n in names]
        total = "| all | " + " | ".join(f"{sum(times[(s, B)].values()):.1f}" for s in slots) + " |"
        parts.append(f"B = {B}, device µs a step (all layers) by cache slots:\n\n| kernel | "
                     + " | ".join(str(s) for s in slots) + " |\n|---|" + "---:|" * len(slots) + "\n"
                     + "\n".join(rows + [total]))
    return "\n\n".join(parts)


def run(out_dir, args):
    import torch

    from specpilot.engine.engine import Engine
    from specpilot.engine.recipe import parse
    from specpilot.kernels import triton_fused_layer
    from specpilot.tools.bench.engine_bench import SYSTEMS

    ctx = args.ctx
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")][: 1 if ctx.smoke else None]
    slots = [int(s) for s in args.slots.split(",")][: 2 if ctx.smoke else None]
    controller_slots = [int(s) for s in args.controller_slots.split(",") if s.strip()][: 1 if ctx.smoke else None]
    if args.position + 2 * 5 >= min(slots + controller_slots):
        raise SystemExit(f"--position {args.position}: leave room for a step below the shortest cache")
    target = harness.random_smollm2(2 if ctx.smoke else args.layers, "cuda", ctx.scratch)
    plan = [("ar-fused-overlap", 0, s) for s in slots] + [("ngram2-k4-cost-fused-overlap", -1, s)
                                                          for s in controller_slots]
    decoders = {}
    for system, kind, n in plan:
        t0 = time.perf_counter()
        eng = Engine(target, parse(SYSTEMS[system]))
        eng.warmup(batch_sizes, 300, 128)
        for B in batch_sizes:
            eng.decoder.reserve(B, n)
        decoders[(system, n)] = (eng.decoder, kind)
        print(f"cache_length: {system} in {eng.decoder.cache_slots} slots, warm in {time.perf_counter() - t0:.0f} s",
              file=sys.stderr, flush=True)
    found = {}
    F = triton_fused_layer
    saved = F.ATTENTION_MERGE_SPLITS, F.ATTENTION_MULTI, F.ATTENTION_LATE_TRIGGER
    try:
        for label, merge, pad, multi, late in ab_runs(args, saved[1]):
            F.ATTENTION_MERGE_SPLITS, F.ATTENTION_MULTI, F.ATTENTION_LATE_TRIGGER = merge, multi, late
            for dec, _ in decoders.values():
                dec.forget_steps()  # (captured again with this kernel at their first replay)
            with padded_grid(triton_fused_layer, pad):
                found[label] = timed(decoders, batch_sizes, args.position, 1 if ctx.smoke else args.rounds)
        F.ATTENTION_MERGE_SPLITS, F.ATTENTION_MULTI, F.ATTENTION_LATE_TRIGGER = saved
        kernels = None
        if args.kernels:
            triton_fused_layer.ATTENTION_MERGE_SPLITS = 16
            for dec, _ in decoders.values():
                dec.forget_steps()
            kernels = kernel_times(decoders, batch_sizes, args.position)
    finally:
        F.ATTENTION_MERGE_SPLITS, F.ATTENTION_MULTI, F.ATTENTION_LATE_TRIGGER = saved
        torch.cuda.synchronize()
    rows = []
    for label, times in found.items():
        for B in batch_sizes:
            base = times[("ar-fused-overlap", slots[0], B)]
            cells = [f"{times[(system, n, B)]:.4f} ({times[(system, n, B)] / base:.3f})" for system, _, n in plan]
            rows.append(f"| {label} | {B} | " + " | ".join(cells) + " |")
    head = ("| splits merged at a time | B | " + " | ".join(f"{'AR' if k == 0 else 'n-gram blind'} {n}"
                                                        for _, k, n in plan) + " |\n|---|---:|"
            + "---:|" * len(plan))
    text = (f"Device ms a step (over our AR in {slots[0]} slots), rows at position {args.position}, by cache "
            f"length (slots a row):\n\n{head}\n" + "\n".join(rows))
    found_json = {label: {f"{system} {n} B={B}": ms for (system, n, B), ms in times.items()}
                  for label, times in found.items()}
    if kernels is not None:
        found_json["kernels_us"] = {f"{n} B={B}": t for (n, B), t in kernels.items()}
        text += "\n\n" + kernel_table(kernels, slots, batch_sizes)
    return found_json, text
