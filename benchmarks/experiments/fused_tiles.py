"""The fused layer's one-token GEMV tiles, role by role, against the copy bandwidth: which tile reads a layer fastest.

What it measures (kernels/triton_fused_layer.py, `benchmark` with `fma_tiles`): µs a layer of the target's layers in
one CUDA graph, one token at position 300 of a 512-slot cache (an AR step at B = 1), bf16, PDL on as the engine runs
it. First the layer as shipped; then, one role at a time (q/k/v, o, gate/up, down: `ROLES`), each candidate tile
(rows or pairs a program, the K tile, warps; `candidates`) with the other roles as shipped; then the best tile of
every role together, timed again beside the shipped layer. Then each of the kernels' device time a layer under
torch.profiler, for the shipped tiles and the best ones (the kernels in launch order: q/k/v, Qwen3's q/k norm,
attention, o, gate/up, down), against each GEMV's floor: its weight bytes at the measured copy bandwidth.

Why (issue #24): at Llama-3.1-8B's shapes the shipped tile holds one row of K = 4096, so every program reads as
many activation values (from L2) as weights, and the pair kernels read x and delta twice; the layer ran at 81% of
the copy bandwidth (134.5 µs against 109; eighteenth lease, E), and AR at B = 1 at 78-79% of its weight-read floor
where the issue asks 85%.

With `--w12` the layer reads its 12-bit planes (`weights.format: lossless12`; engine/weights.py encodes them on the
device): the sweep and the profiles are of the 12-bit kernels, each GEMV's floor is its planes' bytes, and the bf16
layer's kernels are profiled beside them (`--roles ''` skips the sweep).

The best tiles go to WORK/fused_tiles.env (`export SPECPILOT_FMA_TILES=...`; with --w12 SPECPILOT_FMA_TILES_12), so a
later call of the same warm machine can run a bench with them before they become defaults. Run it with `--target
synthetic:llama-3.1-8b` (the staged GGUF gives it its tokenizer).

Backs docs/BENCHMARKS.md's row on the fused layer's tiles at 8B shapes (issue #24) once run; not run yet.

Device minutes: about 7 (each candidate tile compiles its kernel once).
"""
from __future__ import annotations

import json
import shlex

import harness

MINUTES = 7
CUDA_ONLY = True
KERNELS = ("qkv", "attention", "o", "mlp", "down")  # a layer's five kernels in launch order


def kernel_names(cfg) -> tuple[str, ...]:
    """A layer's kernels in launch order: five, and with Qwen3's per-head q/k norm its own kernel after q/k/v."""
    return ("qkv", "qk_norm") + KERNELS[1:] if cfg.qk_norm else KERNELS


def arguments(p) -> None:
    p.add_argument("--roles", default="qkv,o,mlp,down", help="the GEMV roles to sweep")
    p.add_argument("--warps", default="4,8")
    p.add_argument("--w12", action="store_true", help="the layer on its 12-bit planes (the bf16 kernels profiled "
                                                       "beside them)")
    p.add_argument("--attention", action="store_true",
                   help="also sweep the one-token attention's split (cache slots a split, slots an iteration, warps)")


def candidates(role: str, k: int, warps=(4, 8)) -> list[dict]:
    """Tiles to try for a role with K = k: rows (pairs for the pair kernels, each two rows) a program in 1-8, the K
    tile from 1024 to all of K, at most 16,384 weight values a program (128 a thread at 4 warps)."""
    pairs = role in ("qkv", "mlp")
    full = 1 << (k - 1).bit_length()
    out = []
    for rows in (1, 2, 4, 8):
        for block_k in sorted({1024, 2048, 4096, min(full, 16384)}):
            values = rows * (2 if pairs else 1) * min(block_k, full)
            if block_k > full or values > 16384 or (pairs and rows > 4):
                continue
            out += [{"rows": rows, "block_k": block_k, "warps": w} for w in warps]
    return out


def attention_candidates() -> list[dict]:
    """One-token attention settings to try: cache slots a split 16-128, slots a loop iteration up to that, 2-8 warps."""
    return [{"keys_per_split": keys, "block_s": block, "num_warps": warps}
            for keys in (16, 32, 64, 128) for block in (16, 32, 64) if block <= keys for warps in (2, 4, 8)]


def kernel_times(model, F, tiles: dict, n_slots: int = 512, filled: int = 300, replays: int = 20,
                 planes=None) -> dict:
    """Device µs a layer of each of the fused layer's kernels (one token, `tiles` as FMA_TILES), from
    torch.profiler over replays of all layers captured in one graph: kernels in launch order (`kernel_names`). Without
    PDL: with it a kernel starts early and waits for its predecessor, so its span would hold part of the other's.
    `planes`: block -> its 12-bit planes, which the layer then reads."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cfg, dev, dt = model.cfg, model.device, model.dtype
    cache = model.new_cache(1, n_slots)
    positions = torch.full((1, 1), filled, device=dev)
    x = torch.randn(1, 1, cfg.hidden_size, device=dev, dtype=dt)
    delta = torch.randn_like(x)
    cos, sin = (t[positions].unsqueeze(2) for t in model._rope)
    rows = torch.zeros(1, 1, dtype=torch.long, device=dev)
    table = "FMA_TILES" if planes is None else "FMA_TILES_12"  # (the tiles of the weights' format)
    saved, saved_pdl = getattr(F, table), F._pdl
    setattr(F, table, tiles)
    F._pdl = lambda device: False
    try:
        def layers():
            a, d = x, delta
            for i, block in enumerate(model.layers):
                a, d = F.fused_layer(block, a, d, cos, sin, cache.kv[:, i], rows, positions, {}, model.default_ops,
                                     weights12=planes(block) if planes is not None else None)
        layers()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            layers()
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                graph.replay()
            torch.cuda.synchronize()
    finally:
        setattr(F, table, saved)
        F._pdl = saved_pdl
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    names = kernel_names(cfg)
    want = replays * cfg.n_layers * len(names)
    if len(events) != want:
        raise RuntimeError(f"profiler saw {len(events)} kernels, expected {want} ({len(names)} a layer)")
    totals = dict.fromkeys(names, 0.0)
    for i, e in enumerate(events):
        totals[names[i % len(names)]] += e.time_range.elapsed_us()
    return {name: t / (replays * cfg.n_layers) for name, t in totals.items()}


def run(out_dir, args):
    import torch

    from specpilot.engine import loader
    from specpilot.engine.model import Block, compiled
    from specpilot.kernels import triton_fused_layer as F
    from specpilot.tools.bench.engine_bench import copy_bandwidth

    target = loader.load(args.ctx.target, "bf16", "cuda")
    model = target.model
    cfg = model.cfg
    modular = compiled(Block.forward)
    warps = tuple(int(w) for w in args.warps.split(","))
    roles = [r for r in args.roles.split(",") if r]
    unknown = sorted(set(roles) - set(F.ROLES))
    if unknown:
        raise SystemExit(f"--roles: {', '.join(unknown)} (of {', '.join(F.ROLES)})")
    block = model.layers[0]
    k_of = {"qkv": cfg.hidden_size, "o": cfg.n_heads * cfg.head_dim, "mlp": cfg.hidden_size,
            "down": cfg.intermediate_size}
    weight_of = {"qkv": block.wqkv, "o": block.wo, "mlp": block.w13, "down": block.w2}
    nbytes = {role: w.numel() * w.element_size() for role, w in weight_of.items()}
    planes = None
    if args.w12:
        from specpilot.engine.weights import lossless12_weights

        packed = lossless12_weights(model)

        def planes(b):
            return tuple(packed[w.data_ptr()] for w in (b.wqkv, b.wo, b.w13, b.w2))
        nbytes = {role: packed[w.data_ptr()].nbytes for role, w in weight_of.items()}
    bandwidth = copy_bandwidth("cuda")  # bytes moved a second, read and written alike
    torch.cuda.empty_cache()
    floor_us = {role: nbytes[role] / bandwidth * 1e6 for role in F.ROLES}

    def timed(tiles_list):
        return F.benchmark(model, modular, tokens=(1,), fma_tiles=tuple(tiles_list), planes=planes)

    shipped = dict(F.FMA_TILES_12 if args.w12 else F.FMA_TILES)
    base = timed([shipped])[0]
    print(f"shipped: {base['fused_us']:.2f} µs a layer (modular {base['modular_us']:.2f})", flush=True)
    sweep, best = [], {}
    for role in roles:
        timings = []
        for t in candidates(role, k_of[role], warps):
            try:  # a tile that does not compile or run costs its own row only
                us = timed([{**shipped, role: t}])[0]["fused_us"]
                sweep.append({"role": role, **t, "fused_us": us, "vs_shipped": base["fused_us"] / us})
                timings.append((us, t))
            except Exception as e:
                sweep.append({"role": role, **t, "error": f"{type(e).__name__}: {str(e).strip()[:200]}"})
                torch.cuda.synchronize()
            print(sweep[-1], flush=True)
        if timings and min(timings, key=lambda ut: ut[0])[0] < base["fused_us"] * 0.995:  # the sweep's own noise
            best[role] = min(timings, key=lambda ut: ut[0])[1]
    attention, best_attention = [], None
    if args.attention:
        shipped_attention = dict(F.ATTENTION)
        timings = []
        for setting in attention_candidates():
            try:
                us = F.benchmark(model, modular, tokens=(1,), attention=(setting,))[0]["fused_us"]
                attention.append({**setting, "fused_us": us, "vs_shipped": base["fused_us"] / us})
                timings.append((us, setting))
            except Exception as e:
                attention.append({**setting, "error": f"{type(e).__name__}: {str(e).strip()[:200]}"})
                torch.cuda.synchronize()
            print(attention[-1], flush=True)
        if timings and min(timings, key=lambda ut: ut[0])[0] < base["fused_us"] * 0.995:
            best_attention = min(timings, key=lambda ut: ut[0])[1]
            if best_attention == shipped_attention:
                best_attention = None
    both = timed([shipped, {**shipped, **best}, shipped, {**shipped, **best}])
    shipped_us = min(both[0]["fused_us"], both[2]["fused_us"])
    best_us = min(both[1]["fused_us"], both[3]["fused_us"])
    kernels = {}
    for name, tiles, read in (("shipped", shipped, planes), ("best", {**shipped, **best}, planes),
                              *((("bf16", dict(F.FMA_TILES), None),) if args.w12 else ())):
        try:  # a profile that fails leaves the timings above
            kernels[name] = kernel_times(model, F, tiles, planes=read)
        except Exception as e:
            kernels[name] = {"error": f"{type(e).__name__}: {str(e).strip()[:200]}"}
    layer_bytes = sum(nbytes.values())
    layer_floor_us = layer_bytes / bandwidth * 1e6
    env = harness.WORK / "fused_tiles.env"
    variable = "SPECPILOT_FMA_TILES_12" if args.w12 else "SPECPILOT_FMA_TILES"
    env.write_text(f"export {variable}={shlex.quote(json.dumps({**shipped, **best}))}\n"
                   + (f"export SPECPILOT_FMA_ATTENTION={shlex.quote(json.dumps(best_attention))}\n"
                      if best_attention else ""))

    lines = [f"Target {args.ctx.target}{' (12-bit planes)' if args.w12 else ''}: {cfg.n_layers} layers of "
             f"{layer_bytes / 1e6:.1f} MB; copy bandwidth "
             f"{bandwidth / 1e12:.2f} TB/s, so a layer's weight-read floor is {layer_floor_us:.1f} µs.",
             f"Shipped tiles {shipped or '(the TILE_VALUES rule)'}: {shipped_us:.2f} µs a layer "
             f"({layer_floor_us / shipped_us:.0%} of the floor); best tiles {best or '(none better)'}: "
             f"{best_us:.2f} µs ({layer_floor_us / best_us:.0%}); modular {base['modular_us']:.2f} µs."
             + (f" Best one-token attention split: {best_attention or 'as shipped'} (shipped {dict(F.ATTENTION)})."
                if args.attention else ""), ""]
    header = (["kernel", "floor µs", "shipped µs", "of floor", "best µs", "of floor"]
              + (["bf16 µs"] if args.w12 else []))
    table_rows = []
    for name in kernel_names(cfg):
        fl = floor_us.get(name)
        s, b = kernels["shipped"].get(name), kernels["best"].get(name)
        table_rows.append([name, harness.fmt(fl, ".2f") if fl else "–"]
                          + [x for t in (s, b) for x in ((f"{t:.2f}", f"{fl / t:.0%}" if fl else "–") if t else
                                                           ("–", "–"))]
                          + ([harness.fmt(kernels["bf16"].get(name), ".2f")] if args.w12 else []))
    errors = [f"{name} profile: {k['error']}" for name, k in kernels.items() if "error" in k]
    lines += errors
    table = "\n".join(lines) + "\n" + harness.md_table(header, table_rows)
    sweep_table = harness.md_table(["role", "rows", "block_k", "warps", "µs a layer", "vs shipped"],
                                   [[s["role"], s["rows"], s["block_k"], s["warps"],
                                     f"{s['fused_us']:.2f}" if "fused_us" in s else s["error"],
                                     f"{s['vs_shipped']:.3f}" if "fused_us" in s else "–"] for s in sweep])
    record = {"target": args.ctx.target, "copy_bandwidth": bandwidth, "layer_bytes": layer_bytes,
              "layer_floor_us": layer_floor_us, "floor_us": floor_us, "shipped": shipped, "shipped_us": shipped_us,
              "best": best, "best_us": best_us, "modular_us": base["modular_us"], "kernels": kernels, "sweep": sweep,
              "attention": attention, "best_attention": best_attention, "w12": args.w12}
    if attention:
        sweep_table += "\n\nThe one-token attention's split (the tiles shipped):\n\n" + harness.md_table(
            ["slots a split", "slots an iteration", "warps", "µs a layer", "vs shipped"],
            [[a["keys_per_split"], a["block_s"], a["num_warps"],
              f"{a['fused_us']:.2f}" if "fused_us" in a else a["error"],
              f"{a['vs_shipped']:.3f}" if "fused_us" in a else "–"] for a in attention])
    return record, table + "\n\nThe sweep (one role's tile changed, the others shipped):\n\n" + sweep_table
