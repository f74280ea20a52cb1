"""The fused layer against the modular one by tokens a step: where the FMA path, the tensor-core path and cuBLAS cross.

What it measures (kernels/triton_fused_layer.py `benchmark`): µs a layer of the staged target's 30 layers in one CUDA
graph (do_bench_cudagraph), one row of T tokens at position 300 of a 512-slot cache, bf16, for T in --tokens: the
modular layer (the engine's compiled Block.forward, cuBLAS) and the fused layer (called directly, whatever its step
limit) with the FMA path ending at 8 tokens and at 4 (tensor cores above, in blocks of 16 tokens past 16). Steps of T
tokens are AR steps at B = T, verification of k = T / B - 1 drafts, and trees of T nodes at B = 1. (First run:
thirteenth lease, which set FMA_MAX_TOKENS to 6 and kept the 16-token limit.)

With `--batch 8`: 8 rows of T tokens each, a step verifying T - 1 drafts a row at B = 8 (issue #21's verify time
against N at B = 8, for the layer).

Why (twelfth lease, A): a B = 8 AR step (8 tokens, the FMA path) cost 1.08 ms in the loop where a k' = 1 step of 16
tokens (tensor cores) cost 0.97 ms, and steps of 20-40 tokens (past the fused layer's 16-token limit, so modular)
1.37-1.45 ms; tree steps of 17-64 nodes run the modular layer unless the limit rises. The table says where each
threshold belongs: FMA_MAX_TOKENS (SPECPILOT_FMA_MAX_TOKENS) and the fused layer's limit (SPECPILOT_FUSED_MAX_TOKENS).

The thresholds the rows give (`thresholds`) are in the results and in WORK/fused_tokens.env (`export` lines for
SPECPILOT_FMA_MAX_TOKENS and SPECPILOT_FUSED_MAX_TOKENS), so a later call of the same warm machine can run a bench at
them (`. /tmp/fused_tokens.env`) before they become the defaults.

Backs docs/BENCHMARKS.md, "Speculative vs AR, by batch size" (the step prices by width behind the batch controller's
choices) once run; not run yet.

With `--tile-values 4096,8192,...`: each row also at those FMA-path tiles (TILE_VALUES: weight values a program);
at Llama-3.1-8B's shapes the default tile holds one row of K = 4096 (eighteenth lease, E: level with cuBLAS at 81%
of the copy bandwidth).

With `--fma-tiles '[{...}, ...]'`: each row also at those FMA_TILES settings (role -> rows, block_k, warps; `{}` is
the shipped rule): whether a step of a few tokens (verification of a short chain) pays for its programs' number or
their size (24th lease: smaller gate/up and down tiles, more programs, took a 3-token step from 17.2 to 18.0-21.3 µs a
layer; K read as two power-of-two tiles instead of one padded tile, half the registers, took one token from 12.9 to
19.2 and was removed).

With `--dot-tiles '[{...}, ...]'` each row also at those DOT_TILES settings (the tensor-core path's tile by role;
`{}` is the built-in rule), and with `--dot-pdl 0,1` each at both DOT_PDL settings: whether steps of 8-16 tokens pay
for launching before their predecessor ends when their weights load after the wait (thirty-eighth lease, A: 8 / 12 /
16 tokens 30.7 / 31.6 / 33.2 µs a layer without, 29.5 / 30.0 / 28.3 with, on the H100; all of K in one tile, its
weights before the wait, 43 / 33 µs). Then `--fma-max-tokens 1` times 2-6 tokens on the tensor cores too.
(`--attention-gqa` and `--attention-rows` timed two attention kernels that read a K/V tile once for several queries,
in the forty-fourth and forty-fifth leases; both lost and were removed: docs/BENCHMARKS.md.)

With `--dot-tokens 32,64,...` each row past 16 tokens also runs in one token block of up to that many tokens a
program (DOT_TILES' "tokens" on every role, `dot_token_block`: each weight tile read once a block, not once per 16
tokens); rows that would take the same block as another are timed once, and at B = 1 the cap whose blocks ran the
steps past 16 tokens fastest, with the fused layer's limit at it (`token_blocks`), go to WORK/fused_tokens.env as
SPECPILOT_DOT_TILES and SPECPILOT_FUSED_MAX_TOKENS for a later call's sweep. With `--target none` the layer is a random
model of SmolLM2-135M's shapes (harness.random_smollm2): no model is staged, one call on a fresh machine. Why: the
H200's chat sweep at B = 16 (thirty-ninth lease) priced a k' = 1 step (32 tokens, the modular layer past the fused
layer's 24-token limit) at 1.29 ms against 0.71 for its AR step (16 tokens, fused), and AR at B = 32 at 1.26 ms.

With `--filled 64,300,1000` each row at those cache positions (the context a step attends over; 300 by default, in
a cache of at least 512 slots): where a step's time grows with the context. Why (forty-second lease, H100): the loop
timed the fused layer's steps 20-43% above their warm-up replays (AR at chat B = 16 0.72 -> 0.87 ms, k' = 1 there
0.76 -> 1.08) and the modular layer's at them (k' = 3, 1.57 -> 1.56); the replays run at the prompts' lengths, the
loop's steps at contexts grown by up to 128 tokens, and the attention is the part of a layer that grows with them.

Device minutes: about 2.
"""
from __future__ import annotations

import json
import math
import shlex

import harness

MINUTES = 2
CUDA_ONLY = True


# The on/off settings of triton_fused_layer each row can be timed both ways (`--dot-pdl 0,1`, ...): the benchmark's
# keyword and the module global are the name, upper-cased.
SWITCHES = {
    "dot_pdl": "the tensor-core path's kernels launched before their predecessor ends",
}


def arguments(p) -> None:
    p.add_argument("--tokens", default="1,2,4,5,6,8,10,12,16,20,24,32,40,48,64")
    p.add_argument("--batch", type=int, default=1,
                   help="rows of T tokens each (a step verifying T - 1 drafts a row at this batch size); the "
                        "thresholds are derived at 1 only")
    p.add_argument("--tile-values", default=None,
                   help="also time the fused layer with these TILE_VALUES (the FMA path's weight values a program, "
                        "e.g. 4096,8192,16384,32768); the thresholds use the default tile's rows")
    p.add_argument("--fma-tiles", default=None,
                   help="a JSON list of FMA_TILES settings to time too, e.g. '[{\"mlp\": {\"rows\": 2, "
                        "\"block_k\": 1024, \"warps\": 4}}]'")
    p.add_argument("--dot-tiles", default=None,
                   help="a JSON list of DOT_TILES settings to time too, e.g. '[{\"down\": {\"rows\": 16, "
                        "\"block_k\": 512, \"split\": 3}}]'")
    for name, what in SWITCHES.items():
        p.add_argument("--" + name.replace("_", "-"), default=None,
                       help=f"{name.upper()} settings to time each row at, e.g. 0,1 ({what})")
    p.add_argument("--dot-tokens", default=None,
                   help="token blocks past 16 to time each row past 16 tokens at too (DOT_TILES' \"tokens\"), "
                        "e.g. 32,64,128")
    p.add_argument("--layers", type=int, default=harness.SMOLLM2_SHAPES["num_hidden_layers"],
                   help="with --target none: the random model's layers")
    p.add_argument("--fma-max-tokens", default="8,4",
                   help="the FMA path's limits each row is timed at (the thresholds compare the first two)")
    p.add_argument("--filled", default="300",
                   help="the cache positions (context lengths) each row is timed at, e.g. 64,300,1000; the "
                        "thresholds use the first")


def thresholds(rows: list[dict], shipped_fma: int = 8, fma_alt: int = 4, block: int = 16, cap: int = 64) -> dict:
    """The thresholds the rows support. FMA_MAX_TOKENS: the largest tested T in (fma_alt, shipped_fma] up to which
    the FMA path (fma_max_tokens = shipped_fma) beat the tensor-core path (fma_max_tokens = fma_alt) at every tested
    T, else fma_alt. The fused layer's limit: the largest multiple of `block` (at most `cap`) up to which the fused
    layer beat the modular one at every tested T above `block`; tensor-core steps cost by blocks of `block` tokens,
    so a limit between tested points would let untested widths run a whole extra block."""
    by = {(r["tokens"], r["fma_max_tokens"]): r for r in rows}
    fma = fma_alt
    for T in sorted({t for t, _ in by if fma_alt < t <= shipped_fma}):
        on, off = by.get((T, shipped_fma)), by.get((T, fma_alt))
        if on is None or off is None or on["fused_us"] > off["fused_us"]:
            break
        fma = T
    fused = block
    above = sorted({t for t, _ in by if t > block})
    for limit in range(2 * block, cap + 1, block):
        tested = [t for t in above if fused < t <= limit]
        if limit not in above or any(min(r["fused_us"] for (t2, _), r in by.items() if t2 == t)
                                     > by[(t, shipped_fma)]["modular_us"] for t in tested):
            break
        fused = limit
    return {"SPECPILOT_FMA_MAX_TOKENS": fma, "SPECPILOT_FUSED_MAX_TOKENS": fused}


def with_token_blocks(dot_tiles: tuple, blocks: str | None, n_tokens: int) -> tuple:
    """`dot_tiles` (None: the shipped DOT_TILES), and for a step of `n_tokens` each of them again with every role's
    "tokens" at each of `blocks` (e.g. "32,64") that gives the step a token block it does not have yet."""
    from specpilot.kernels import triton_fused_layer as F

    out = list(dot_tiles)
    for d in dot_tiles:
        base = F.DOT_TILES if d is None else d
        seen = {F.dot_token_block(n_tokens, base.get("o", {}))}
        for t in (blocks.split(",") if blocks else ()):
            wide = {role: {**tile, "tokens": int(t)} for role, tile in base.items()}
            if F.dot_token_block(n_tokens, wide["o"]) not in seen:
                seen.add(F.dot_token_block(n_tokens, wide["o"]))
                out.append(wide)
    return tuple(out)


def token_blocks(rows: list[dict], shipped: dict) -> dict:
    """From rows at the `shipped` DOT_TILES, bare or with every role's "tokens" (`--dot-tokens`): the token-block cap
    ("tokens") whose blocks ran the tested steps past 16 tokens fastest (the geometric mean of each width's time over
    its 16-token blocks' time, so each width weighs the same), and the fused layer's limit at that cap: the widest
    tested step up to which every tested step past 16 tokens beat the modular layer. Empty without such rows.
    SPECPILOT_DOT_TILES is given only for a cap past 16 (the shipped rule's blocks)."""
    from specpilot.kernels.triton_fused_layer import dot_token_block

    def bare(d):
        return {role: {k: v for k, v in tile.items() if k != "tokens"} for role, tile in d.items()}

    timed: dict[int, dict[int, dict]] = {}  # width -> token block -> row
    for r in rows:
        width = r["batch"] * r["tokens"]
        if width > 16 and "fused_us" in r and bare(r["dot_tiles"]) == bare(shipped):
            timed.setdefault(width, {})[r["token_block"]] = r
    widths = sorted(w for w, by in timed.items() if 16 in by)
    caps = sorted({b for w in widths for b in timed[w]})
    if not widths:
        return {}

    def at(width, cap):
        return timed[width].get(dot_token_block(width, {"tokens": cap}))

    def score(cap):
        ratios = [at(w, cap)["fused_us"] / timed[w][16]["fused_us"] for w in widths if at(w, cap) is not None]
        return math.prod(ratios) ** (1 / len(ratios)) if len(ratios) == len(widths) else math.inf

    cap = min(caps, key=lambda c: (score(c), c))
    limit = 16
    for w in widths:
        row = at(w, cap)
        if row.get("modular_us") is None or row["fused_us"] >= row["modular_us"]:
            break
        limit = w
    chosen = {"SPECPILOT_FUSED_MAX_TOKENS": limit}
    if cap > 16:
        chosen["SPECPILOT_DOT_TILES"] = json.dumps({role: {**tile, "tokens": cap} for role, tile in shipped.items()},
                                                   separators=(",", ":"))
    return chosen


def run(out_dir, args):
    from specpilot.engine import loader
    from specpilot.engine.model import Block, compiled
    from specpilot.kernels import triton_fused_layer

    tokens = [int(t) for t in args.tokens.split(",")]
    if args.smoke:
        tokens = tokens[:2]
    if args.ctx.target == "none":
        target = harness.random_smollm2(2 if args.smoke else args.layers, "cuda", args.ctx.scratch)
    else:
        target = loader.load(args.ctx.target, "bf16", "cuda")
    modular = compiled(Block.forward)
    tiles = tuple(int(t) for t in args.tile_values.split(",")) if args.tile_values else (None,)
    fma_tiles = (None, *json.loads(args.fma_tiles)) if args.fma_tiles else (None,)
    dot_tiles = (None, *json.loads(args.dot_tiles)) if args.dot_tiles else (None,)
    switches = {name: tuple(bool(int(v)) for v in getattr(args, name).split(",")) if getattr(args, name) else (None,)
                for name in SWITCHES}
    fma = tuple(int(v) for v in args.fma_max_tokens.split(","))
    filled = [int(v) for v in args.filled.split(",")]
    rows = []
    for position, T in ((f, T) for f in filled for T in tokens):
        modular_us = None
        # the cache: at least the shipped 512 slots, and room for the step (the attention's splits cover all of it)
        n_slots = max(512, position + T)
        for i, dot in enumerate(with_token_blocks(dot_tiles, args.dot_tokens, args.batch * T)):
            try:  # the modular layer once a T, with the first tiling
                got = triton_fused_layer.benchmark(target.model, modular if i == 0 else None, tokens=(T,),
                                                   n_slots=n_slots, filled=position,
                                                   fma_max_tokens=fma, batch=args.batch, tile_values=tiles,
                                                   fma_tiles=fma_tiles, dot_tiles=(dot,), **switches)
            except Exception as e:  # (a tiling that does not compile or run costs its own row)
                got = [dict(batch=args.batch, tokens=T, dot_tiles=dot or triton_fused_layer.DOT_TILES,
                            error=f"{type(e).__name__}: {e}"[:300])]
            for r in got:
                r["filled"] = position
                modular_us = r.get("modular_us") if i == 0 else modular_us
                r["modular_us"] = modular_us
                if "fused_us" in r:
                    r["speedup"] = modular_us / r["fused_us"] if modular_us else None
                r["token_block"] = triton_fused_layer.dot_token_block(args.batch * T, r["dot_tiles"].get("o", {}))
                print(r, flush=True)
            rows += got
    keys = sorted({k for r in rows for k in r})
    default_tile = [r for r in rows if "fused_us" in r and r["filled"] == filled[0]
                    and r["tile_values"] == triton_fused_layer.TILE_VALUES
                    and r["fma_tiles"] == triton_fused_layer.FMA_TILES
                    and r["dot_tiles"] == triton_fused_layer.DOT_TILES
                    and all(r.get(name, False) == getattr(triton_fused_layer, name.upper()) for name in SWITCHES)]
    chosen = (thresholds(default_tile, *fma[:2]) if args.batch == 1 and default_tile and len(fma) >= 2 else {})
    blocks = {}
    if args.dot_tokens:  # the token blocks' cap and the limit at it
        blocks = token_blocks([r for r in rows if r["filled"] == filled[0]], triton_fused_layer.DOT_TILES)
        if args.batch == 1:
            chosen = {**chosen, **blocks}
    if chosen:
        (harness.WORK / "fused_tokens.env").write_text("".join(f"export {k}={shlex.quote(str(v))}\n"
                                                               for k, v in chosen.items()))
    table = harness.md_table(keys, [[harness.fmt(r.get(k), ".2f") if isinstance(r.get(k), float) else r.get(k)
                                     for k in keys] for r in rows])
    summary = f"\n\n{args.batch} rows a step: no thresholds (B = 1 only)"
    if chosen:
        summary = "\n\nThresholds these rows support: " + ", ".join(f"{k}={v}" for k, v in chosen.items())
    if blocks and args.batch != 1:
        summary += ("\n\nToken blocks at these steps: " + ", ".join(f"{k}={v}" for k, v in blocks.items())
                    + " (not written to the env file: B = 1 sets it)")
    return {"rows": rows, "thresholds": chosen, "token_blocks": blocks}, table + summary
