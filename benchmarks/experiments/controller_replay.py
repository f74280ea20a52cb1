"""The batch controller's choices on the real target, priced at a device's step times: modeled, on the CPU.

What it computes. Each recipe of `--recipes` (a batch controller's, from the bench's systems) decodes `--requests`
prompts of `--workload` on this machine's CPU (the staged target in fp32, the modular layer, no graphs), `--rows` at
a time, continuously batched, its controller's prices fixed at `--prices` (the step times of each kind measured on
a device; the CPU's own loop times never enter its choices), and every step's kind is recorded. Its modeled tok/s is
its tokens over the sum of the prices of the steps it ran; AR's is the same requests decoded by our fastest AR's
recipe the same way (its steps counted, each at the AR step's price). Their ratio is what the controller's choices
make of AR on that device where the steps' prices are all that differs: the host's time, prefills and graph
launches are priced out. For working on the controller's choices without a device; never a
speed, and every figure it gives is modeled.

`--prices`: a JSON object {"ar": ms, "-1": ms, "0": ms, ..., "k": ms} (kind -1: a blind AR step; "ar": our fastest
AR's step, else kind 0's), or FILE.json:SYSTEM for a loop_overhead run's warm-up replays of SYSTEM's kinds at its
rows (e.g. docs/benchmarks/raw/2026-12-06-thirty-sixth/a_loop_overhead_chat_b4.json.gz:ngram2-k4-cost-fused-overlap,
the H100 at B = 4).

Backs docs/BENCHMARKS.md: none; docs/benchmarks/2026-12-06-thirty-sixth-lease.md, F.

Device minutes: none (CPU: about a minute a recipe for 16 chat requests at B = 4).
"""
from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

import harness

MINUTES = 0
FASTEST_AR = "ar-fused-overlap"  # (on the CPU: its overlap; the modular layer, no graphs)
CPU = True  # computes on the CPU whatever the machine has: its figures are modeled, not timed


def arguments(p) -> None:
    p.add_argument("--workload", default="chat")
    p.add_argument("--rows", type=int, default=4, help="requests decoded at once (B)")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--recipes", default="ngram2-k4-cost-fused-overlap",
                   help="batch-controller recipes among the bench's systems (tools/bench/engine_bench.py)")
    p.add_argument("--batch", default="{}", help="a JSON object of batch keys set in every recipe, e.g. "
                                                  "'{\"probe_every\": 32}' (docs/RECIPE.md)")
    p.add_argument("--prices", required=True, help="the step prices in ms: a JSON object, or FILE.json[.gz]:SYSTEM "
                                                   "(a loop_overhead run's warm-up replays)")


def read_prices(spec: str) -> tuple[dict[int, float], float]:
    """(ms by kind, AR's ms) from `--prices`."""
    if spec.lstrip().startswith("{"):
        given = json.loads(spec)
    else:
        path, _, system = spec.rpartition(":")
        if not path or not system:
            raise SystemExit(f"--prices: {spec!r} is neither a JSON object nor FILE.json:SYSTEM")
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt") as f:
            results = json.load(f)["results"]
        if system not in results or not results[system].get("replay_ms_at_warmup"):
            raise SystemExit(f"--prices: {path} has no warm-up replays of {system!r} "
                             f"(systems: {', '.join(k for k in results if k != 'side_by_side')})")
        given = results[system]["replay_ms_at_warmup"]
    kinds = {_kind(k): float(v) for k, v in given.items() if k != "ar"}
    if 0 not in kinds and "ar" not in given:
        raise SystemExit("--prices: no AR price (an \"ar\" or a \"0\" entry)")
    return kinds, float(given.get("ar", kinds.get(0)))


def _kind(key: str) -> int | float:
    """A kind of step from its JSON key: k' (an int), or a fraction of a draft a row ("0.5": batch.fractions)."""
    value = float(key)
    return int(value) if value.is_integer() else value


def modeled_speedup(kinds: list[int], prices: dict[int, float], ar_ms: float, ar_steps: int) -> float:
    """AR's modeled time for these requests (its steps at AR's price) over the recipe's: the prices of the steps it
    ran, summed."""
    missing = sorted(set(kinds) - set(prices))
    if missing:
        raise ValueError(f"no price for the kinds of step {missing} that the controller ran")
    return ar_steps * ar_ms / sum(prices[k] for k in kinds)


def run(out_dir, args):
    from specpilot.engine.engine import Engine
    from specpilot.engine.loader import load
    from specpilot.engine.recipe import parse
    from specpilot.engine.workloads import load_workload
    from specpilot.tools.bench.engine_bench import SYSTEMS

    prices, ar_ms = read_prices(args.prices)
    batch = json.loads(args.batch)
    names = [n for n in args.recipes.split(",") if n]
    unknown = [n for n in names if SYSTEMS.get(n, {}).get("batch", {}).get("controller") != "cost"]
    if unknown:
        raise SystemExit(f"--recipes: {', '.join(unknown)}: not a batch-controller recipe of the bench's systems")
    requests, tokens, rows = ((2, 8, 2) if args.smoke else (args.requests, args.max_new_tokens, args.rows))
    loaded = load(args.ctx.target, "fp32", "cpu")
    on_cpu = {"layer": "modular", "cuda_graphs": False, "compile": False}
    ar = Engine(loaded, parse({**{k: v for k, v in SYSTEMS[FASTEST_AR].items() if k != "name"}, **on_cpu}))
    prompts = [ar.encode(q.turns[0]) for q in load_workload(args.workload, requests)]
    reference = [r.tokens for r in ar.generate(prompts, tokens, max_batch=rows)]
    # (steps launched, as the recipes' kinds count theirs: under overlap a call launches a step past its last read,
    # which the device runs like any other; counted as read, AR's came one step short)
    steps_ar = len(ar.decoder.last_stats.draft_lengths)
    found, table = {}, []
    for name in names:
        spec = {k: v for k, v in SYSTEMS[name].items() if k != "name"}
        spec["batch"] = {**spec["batch"], **batch}
        eng = Engine(loaded, parse({**spec, **on_cpu}))
        # the rows' prices as the batch drains; of the kinds this recipe has (up to its k: a price of a wider kind
        # would have the controller probe a step its decoder never captures)
        own = {kind: ms for kind, ms in prices.items() if kind <= eng.decoder.k}
        eng.decoder.prices = {b: dict(own) for b in range(1, rows + 1)}
        eng.decoder.controller.observe_time = lambda kind, seconds: None  # (the CPU's loop times price nothing)
        out = eng.generate(prompts, tokens, max_batch=rows)
        kinds = eng.decoder.last_stats.draft_lengths
        speedup = modeled_speedup(kinds, prices, ar_ms, steps_ar)
        same = sum(r.tokens == t for r, t in zip(out, reference)) / len(out)  # (fp32 ties may part them)
        found[name] = {"modeled_speedup": speedup, "kinds": dict(Counter(kinds)), "steps": len(kinds),
                       "tokens": sum(len(r.tokens) for r in out), "ar_steps": steps_ar, "identical_to_ar": same}
        table.append([name, f"{speedup:.3f}", found[name]["tokens"], len(kinds), steps_ar, f"{same:.0%}",
                      ", ".join(f"{k}: {n}" for k, n in sorted(found[name]["kinds"].items()))])
        print(f"controller_replay: {name}: {speedup:.3f}x AR (modeled)", flush=True)
    head = (f"{args.workload}, B = {rows}, {requests} requests, {tokens} new tokens"
            + (f"; batch {json.dumps(batch)}" if batch else "") + "; prices (ms) "
            + ", ".join(f"{k}: {v:.4g}" for k, v in sorted(prices.items())) + f", AR {ar_ms:.4g}\n\n")
    return ({"prices_ms": {str(k): v for k, v in prices.items()}, "ar_ms": ar_ms, "batch": batch, "recipes": found},
            head + harness.md_table(["recipe", "modeled x AR", "tokens", "steps", "AR's steps", "=AR", "steps by kind"],
                                    table))
