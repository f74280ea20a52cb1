"""The fused layer's GEMV tiles, role by role, against the copy bandwidth: which tile reads a layer fastest.

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

With `--tokens T` past FMA_MAX_TOKENS (e.g. 8: a verification step of 7-16 tokens, or a B = 8 AR step) the sweep
is of the tensor-core path's tiles (`DOT_TILES`: 16 or 32 rows a program, the K tile, warps, then the K loop's
pipeline depth for the best of those, then K split over 2-6 programs), T tokens of one row, each
kernel profiled at T tokens; the layer as shipped and with the best tiles is then timed at 1-32 tokens a step beside
the modular layer, and the best tiles go to WORK/fused_tiles.env as SPECPILOT_DOT_TILES (with `--attention`, the
multi-token attention's split: SPECPILOT_DOT_ATTENTION). Why (issue #20): on SmolLM2 such a step cost 2.2x a
one-token step (32-35 against 14 µs a layer), as much as cuBLAS, so a verification step at B = 2-8 cost 1.7x the AR
step it replaced (the thirty-second lease's B made its best tiles the defaults: 5% a layer).

Backs docs/BENCHMARKS.md's row on the fused layer's tiles at 8B shapes (issue #24).

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
    p.add_argument("--tokens", type=int, default=1,
                   help="tokens a step (one row); past FMA_MAX_TOKENS the tensor-core path's tiles (DOT_TILES)")


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


def dot_candidates(role: str, k: int, warps=(2, 4, 8)) -> list[dict]:
    """Tensor-core tiles to try for a role with K = k: 16 rows a program (tl.dot's least: the most programs) with the
    K tile 32 to all of K (all of K: loaded before the loop, as the FMA path's one tile), then 32 rows at the shipped K
    tile; Triton's default pipeline depth (`stages_candidates` tries others for the best)."""
    full = 1 << (k - 1).bit_length()
    out = [{"rows": 16, "block_k": bk, "warps": w} for bk in (32, 64, 128, 256, 512, 1024, 2048) if bk <= full
           for w in warps]
    return out + [{"rows": 32, "block_k": 128, "warps": w} for w in warps]


def stages_candidates(tile: dict) -> list[dict]:
    return [{**tile, "stages": n} for n in (1, 2, 3, 4, 5)]


def split_candidates(tile: dict) -> list[dict]:
    """K split over 2-6 programs (a role's few row blocks at 16 rows a program leave most multiprocessors idle:
    SmolLM2's q/k/v has 30, o and down 36); `_split_k` takes fewer where K has fewer tiles."""
    return [{**tile, "split": n} for n in (2, 3, 4, 6)]


def attention_candidates() -> list[dict]:
    """One-token attention settings to try: cache slots a split 16-128, slots a loop iteration up to that, 2-8 warps."""
    return [{"keys_per_split": keys, "block_s": block, "num_warps": warps}
            for keys in (16, 32, 64, 128) for block in (16, 32, 64) if block <= keys for warps in (2, 4, 8)]


def kernel_times(model, F, tiles: dict, n_slots: int = 512, filled: int = 300, replays: int = 20,
                 planes=None, tokens: int = 1) -> dict:
    """Device µs a layer of each of the fused layer's kernels (`tokens` of one row, `tiles` as the table of their
    path: `table`), from torch.profiler over replays of all layers captured in one graph: kernels in launch order
    (`kernel_names`). Without PDL: with it a kernel starts early and waits for its predecessor, so its span would hold
    part of the other's. `planes`: block -> its 12-bit planes, which the layer then reads."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cfg, dev, dt = model.cfg, model.device, model.dtype
    cache = model.new_cache(1, n_slots)
    positions = (filled + torch.arange(tokens, device=dev))[None]
    x = torch.randn(1, tokens, cfg.hidden_size, device=dev, dtype=dt)
    delta = torch.randn_like(x)
    cos, sin = (t[positions].unsqueeze(2) for t in model._rope)
    rows = torch.zeros(1, tokens, dtype=torch.long, device=dev)
    table = tile_table(F, tokens, planes is not None)
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


def tile_table(F, tokens: int, w12: bool) -> str:
    """The table of tiles a step of `tokens` reads: the tensor-core path's past FMA_MAX_TOKENS, else the FMA path's
    for the weights' format."""
    if tokens > F.FMA_MAX_TOKENS:
        return "DOT_TILES"
    return "FMA_TILES_12" if w12 else "FMA_TILES"


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
    tokens = args.tokens
    tiles_of = tile_table(F, tokens, args.w12)
    dot = tiles_of == "DOT_TILES"
    if dot and args.w12:
        raise SystemExit(f"--tokens {tokens} with --w12: 12-bit weights run the FMA path only "
                         f"(at most {F.FMA_MAX_TOKENS} tokens)")
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

    def timed(tiles_list, with_modular=False):
        tiles = {"dot_tiles" if dot else "fma_tiles": tuple(tiles_list)}
        return F.benchmark(model, modular if with_modular else None, tokens=(tokens,), planes=planes, **tiles)

    shipped = dict(getattr(F, tiles_of))
    base = timed([shipped], with_modular=True)[0]
    print(f"shipped: {base['fused_us']:.2f} µs a layer (modular {base['modular_us']:.2f})", flush=True)
    sweep, best = [], {}

    def swept(role, tiles):
        """Time each of `tiles` for `role` (the others as shipped): (µs, tile) of those that ran."""
        timings = []
        for t in tiles:
            try:  # a tile that does not compile or run costs its own row only
                us = timed([{**shipped, role: t}])[0]["fused_us"]
                sweep.append({"role": role, **t, "fused_us": us, "vs_shipped": base["fused_us"] / us})
                timings.append((us, t))
            except Exception as e:
                sweep.append({"role": role, **t, "error": f"{type(e).__name__}: {str(e).strip()[:200]}"})
                torch.cuda.synchronize()
            print(sweep[-1], flush=True)
        return timings

    for role in roles:
        timings = swept(role, dot_candidates(role, k_of[role]) if dot else candidates(role, k_of[role], warps))
        if dot and timings:  # then the pipeline depth of the best tile, then K split over programs
            timings += swept(role, stages_candidates(min(timings, key=lambda ut: ut[0])[1]))
            timings += swept(role, split_candidates(min(timings, key=lambda ut: ut[0])[1]))
        if timings and min(timings, key=lambda ut: ut[0])[0] < base["fused_us"] * 0.995:  # the sweep's own noise
            best[role] = min(timings, key=lambda ut: ut[0])[1]
    attention, best_attention = [], None
    if args.attention:
        shipped_attention = dict(F.ATTENTION_MULTI if dot else F.ATTENTION)
        timings = []
        for setting in attention_candidates():
            try:  # (at --tokens: a step of that many tokens attends with ATTENTION_MULTI past the FMA path)
                us = F.benchmark(model, None, tokens=(tokens,), attention=(setting,))[0]["fused_us"]
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
            kernels[name] = kernel_times(model, F, tiles, planes=read, tokens=tokens if name != "bf16" else 1)
        except Exception as e:
            kernels[name] = {"error": f"{type(e).__name__}: {str(e).strip()[:200]}"}
    layer_bytes = sum(nbytes.values())
    layer_floor_us = layer_bytes / bandwidth * 1e6
    env = harness.WORK / "fused_tiles.env"
    variable = f"SPECPILOT_{tiles_of}"
    env.write_text(f"export {variable}={shlex.quote(json.dumps({**shipped, **best}))}\n"
                   + (f"export SPECPILOT_{'DOT' if dot else 'FMA'}_ATTENTION="
                      f"{shlex.quote(json.dumps(best_attention))}\n"
                      if best_attention else ""))

    by_tokens = []
    if dot:  # the layer as shipped and with the best tiles at every size of step, beside the modular layer
        for T in (1, 2, 4, 6, 8, 12, 16, 24, 32):
            pair = F.benchmark(model, modular, tokens=(T,), dot_tiles=(shipped, {**shipped, **best}))
            by_tokens.append({"tokens": T, "shipped_us": pair[0]["fused_us"], "best_us": pair[1]["fused_us"],
                              "modular_us": pair[0]["modular_us"]})
            print(by_tokens[-1], flush=True)

    lines = [f"Target {args.ctx.target}{' (12-bit planes)' if args.w12 else ''}, {tokens} token"
             f"{'s' if tokens > 1 else ''} a step ({'tensor cores' if dot else 'FMA path'}): {cfg.n_layers} layers of "
             f"{layer_bytes / 1e6:.1f} MB; copy bandwidth "
             f"{bandwidth / 1e12:.2f} TB/s, so a layer's weight-read floor is {layer_floor_us:.1f} µs.",
             f"Shipped tiles {shipped or '(the TILE_VALUES rule)'}: {shipped_us:.2f} µs a layer "
             f"({layer_floor_us / shipped_us:.0%} of the floor); best tiles {best or '(none better)'}: "
             f"{best_us:.2f} µs ({layer_floor_us / best_us:.0%}); modular {base['modular_us']:.2f} µs."
             + (f" Best {'multi' if dot else 'one'}-token attention split: {best_attention or 'as shipped'} (shipped "
                f"{dict(F.ATTENTION_MULTI if dot else F.ATTENTION)})."
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
    sweep_table = harness.md_table(["role", "rows", "block_k", "warps", "stages", "K split", "µs a layer",
                                    "vs shipped"],
                                   [[s["role"], s["rows"], s["block_k"], s["warps"], s.get("stages", "–"),
                                     s.get("split", "–"),
                                     f"{s['fused_us']:.2f}" if "fused_us" in s else s["error"],
                                     f"{s['vs_shipped']:.3f}" if "fused_us" in s else "–"] for s in sweep])
    record = {"target": args.ctx.target, "copy_bandwidth": bandwidth, "layer_bytes": layer_bytes,
              "layer_floor_us": layer_floor_us, "floor_us": floor_us, "shipped": shipped, "shipped_us": shipped_us,
              "best": best, "best_us": best_us, "modular_us": base["modular_us"], "kernels": kernels, "sweep": sweep,
              "attention": attention, "best_attention": best_attention, "w12": args.w12, "tokens": tokens,
              "table": tiles_of, "by_tokens": by_tokens}
    if by_tokens:
        table += ("\n\nµs a layer by tokens a step (one row; the FMA path up to FMA_MAX_TOKENS = "
                  f"{F.FMA_MAX_TOKENS}, where the tiles change nothing):\n\n" + harness.md_table(
                      ["tokens", "shipped", "best tiles", "modular", "best / one token"],
                      [[b["tokens"], f"{b['shipped_us']:.2f}", f"{b['best_us']:.2f}", f"{b['modular_us']:.2f}",
                        f"{b['best_us'] / by_tokens[0]['best_us']:.2f}x"] for b in by_tokens]))
    if attention:
        sweep_table += (f"\n\nThe {'multi' if dot else 'one'}-token attention's split (the tiles shipped):\n\n"
                        + harness.md_table(
            ["slots a split", "slots an iteration", "warps", "µs a layer", "vs shipped"],
            [[a["keys_per_split"], a["block_s"], a["num_warps"],
              f"{a['fused_us']:.2f}" if "fused_us" in a else a["error"],
              f"{a['vs_shipped']:.3f}" if "fused_us" in a else "–"] for a in attention]))
    return record, table + "\n\nThe sweep (one role's tile changed, the others shipped):\n\n" + sweep_table
