"""Where a batched decode's time goes: the loop's wall time against its steps' graph replays, host phases timed.

What it measures. A random-weight model of SmolLM2-135M's shapes (nothing staged: its time per step does not
depend on the weights), bf16, B = 64 rows, 256 requests of 96-192 random tokens, 128 new tokens (EOS ignored),
continuously batched. For each system (our fastest AR; the n-gram drafter at k = 4 on the fused layer with overlap,
every step verifying; the same with the batch controller) after a warm-up call: the call's wall time and steps; each
kind of step's graph replayed at warm-up (the controller's price) and again at the state the call left (real
lengths and history); and the host time inside the call's phases: waiting for a step's output (`_read`), launching
steps (`_launch`), prefilling requests to start in finished rows (`_prefill_requests`), moving them in
(`_move_in`), moving a draining batch to a smaller bucket (`_shrink`), the rest (the row loop); and the batch's mean
occupancy (live rows a step). Device-bound,
the waits dominate; host-bound, they vanish.

Run it with `--target none` on a fresh machine: it stages no model (one call, no parts to carry). With `--workload
NAME` it runs the staged target on that workload's prompts instead (cycled to `--requests`, chat-templated), where
the n-gram drafter finds what it finds on real text (on random tokens, nothing): the loop of a cell of
`batch_sweep`, timed phase by phase, with the controller's loop-timed prices.

With `--kernels`, each kind of step's graph on the call's bucket replayed under torch.profiler: kernels and device µs
a step, and the kernels whose time differs most from the first system's AR step; and the host time of a step's
launch, the same kind each time against the kinds in turn (`ar-attention-triton-overlap` is
AR with the Triton attention, which reads only the cache blocks a row has written).

With `--side-by-side ROUNDS`, after the last system every system's AR-like kinds of step (AR, blind AR) and its
longest one replayed in turn, round after round, all systems kept in memory: their costs compared in one stretch of
the device's time, where one system after another moved the same graph's time by a few percent (the head's blind
step against AR's step: thirty-fifth lease).

With `--timeline`, a further call with every step's run (its graph, and an ABSORB before it) bracketed by CUDA
timing events: each kind's device time a step in the loop and the device's idle gap before it (from the previous
step's end: the copy of its outputs, and any wait for the host's launch), steps behind host work or in the drain left
out. It tells a loop whose steps run longer on the device from one whose device waits between them (the forty-fifth
lease: the controllers' AR-kind steps 1-3% slower in the loop than AR's, their replays level).

Any of the bench's systems runs too (`stock` is the target's), NAME+compiled-prefill is NAME with its prefill's
layers compiled, and a system named twice runs twice (the second NAME#2): in the bench's order, with the controller
first and last, it says whether what ran before a system slows its steps (the twenty-fifth lease's bench replayed
the controller's steps 15% slower than `loop_overhead` did). `--eos` ends requests at the target's end of turn, as the bench does. `--probe-refills N` adds a
third call whose first N refills are timed phase by phase with the device drained around each (prefilling the
started requests, moving them in, the drafter's own `start_rows`), their kernels traced: where a refill's time goes
(the twenty-fourth lease's `stock` at B = 8 spent 27 ms a refill beyond a step, the overlapped chains 1 ms).

Backs docs/BENCHMARKS.md, "Speculative vs AR, by batch size" (why the controller's replayed prices fell short at
large batches): the eleventh lease's D, docs/benchmarks/2026-12-01-eleventh-lease.md; with `--kernels`, the
nineteenth lease's A and B (the controller's AR step is AR's), docs/benchmarks/2026-12-02-nineteenth-lease.md.

Device minutes: about 2 with random weights, 3 for two systems with `--workload chat` (124 s on the H200,
2026-12-02, nineteenth lease; the sixteenth's call of 175 s ran out warming a first version); the log says when
each system is warm.
"""
from __future__ import annotations

import sys
import time
import traceback
from dataclasses import asdict

import harness

MINUTES = 3
CUDA_ONLY = True
# The decoder's methods whose host time is measured, in the table's order
PHASES = ("_read", "_launch", "_prefill_requests", "_move_in", "_shrink")
SHAPES = harness.SMOLLM2_SHAPES
# A system's name with this suffix: the same system with its prefill's layers compiled (`Decoder.prefill_layer_fn`,
# off by default until timed: a refill's eager prefill of 16 chat prompts took 11-13 ms on the H200)
COMPILED_PREFILL = "+compiled-prefill"
SYSTEMS = {
    "ar-fused-overlap": {"layer": "fused", "overlap": True},
    "ngram-k4-fused-overlap": {"drafter": {"kind": "ngram", "min_ngram": 2, "max_ngram": 4}, "k": 4,
                               "layer": "fused", "overlap": True},
    "ar-attention-triton-overlap": {"layer": "fused", "overlap": True, "kernels": {"attention": "builtin:triton"}},
    "ngram2-k4-cost-fused-overlap": {"drafter": {"kind": "ngram", "min_ngram": 2, "max_ngram": 4, "adaptive": True,
                                                 "ar_after_miss": True}, "k": 4, "layer": "fused", "overlap": True,
                                     "batch": {"controller": "cost"}},
}


def arguments(p) -> None:
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--layers", type=int, default=SHAPES["num_hidden_layers"])
    p.add_argument("--systems", default="ar-fused-overlap,ngram-k4-fused-overlap,ngram2-k4-cost-fused-overlap")
    p.add_argument("--kernels", action="store_true",
                   help="also profile each kind of step's graph at the end, kernel by kernel (CUDA)")
    p.add_argument("--workload", default="", help="the staged target on this workload's prompts (default: random)")
    p.add_argument("--eos", action="store_true", help="requests end at the target's end of turn (as the bench's do), "
                                                      "not after exactly --max-new-tokens")
    p.add_argument("--probe-refills", type=int, default=0,
                   help="then a third call whose first N refills are timed alone (device drained before and after "
                        "each phase) and their kernels traced: where a started request's time goes")
    p.add_argument("--timeline", action="store_true",
                   help="then a call with every step bracketed by CUDA events: each kind's device time in the loop "
                        "and the device's idle gap before it (CUDA)")
    p.add_argument("--side-by-side", type=int, default=0, metavar="ROUNDS",
                   help="then every system's kinds of step replayed in turn, ROUNDS rounds of 10 replays each, all "
                        "systems kept: their step costs compared in one stretch of the device's time (medians)")


def timed(counter: dict, name: str, fn):
    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            counter[name] = counter.get(name, 0.0) + time.perf_counter() - t0
    return wrapper


def system_recipe(name: str, target: str | None, device: str):
    """A system of this experiment's own (SYSTEMS), else any of the bench's (tools/bench/engine_bench.SYSTEMS: a
    built-in name such as `stock`, the target's, or a recipe's fields)."""
    from specpilot.engine.recipe import load_recipe, parse
    from specpilot.tools.bench.engine_bench import SYSTEMS as BENCH

    eager = {"cuda_graphs": False} if device == "cpu" else {}
    spec = SYSTEMS.get(name, BENCH.get(name, name))
    if isinstance(spec, str):  # (a built-in or a recipe file)
        return parse({**asdict(load_recipe(spec, target)), **eager})
    return parse({**spec, **eager})


def device_timeline(dec, eng, prompts, new: int, eos: bool, rows: int) -> dict:
    """A further call with each step between two CUDA timing events (tools/bench/step_events): per kind, its device
    time and the idle before it, the steps behind host work (refills, moves) and the drain's left out."""
    from specpilot.tools.bench import step_events

    with step_events.bracketed(dec) as marks:
        eng.generate(prompts, new, ignore_eos=not eos, max_batch=rows)
    device_ms, idle_us = step_events.columns(marks)
    log = dec.last_stats.step_log  # (a step launched ahead and never read has no record: left out)
    return step_events.summary([k for k, _, _ in marks], device_ms, idle_us, step_events.steady(log))


def timeline_table(found: dict) -> str:
    """The timeline calls' table: per system and kind, device ms a step in the loop and the idle before it."""
    lines = [f"| {name} | {kind} | {t['steps']} | {t['device_ms']:.4f} | {t['idle_us_median']:.1f} | "
             f"{t['idle_us_mean']:.1f} | {t['idle_over_5us']:.0%} |"
             for name, f in found.items() if isinstance(f, dict) and f.get("timeline")
             for kind, t in f["timeline"].items()]
    if not lines:
        return ""
    return ("\n\nEach step of a further call between CUDA events (steps behind host work and the drain left out): "
            "device ms a step in the loop, and the device's idle µs before it (from the previous step's end)\n\n"
            "| system | kind | steps | device ms | idle µs, median | idle µs, mean | idle > 5 µs |\n"
            "|---|---:|---:|---:|---:|---:|---:|\n" + "\n".join(lines))


def probe_refills(dec, eng, prompts, new: int, eos: bool, rows: int, n: int) -> dict:
    """A call whose first `n` refills are timed phase by phase, each phase alone: the device drained before and after
    `_prefill_requests`, `_move_in` and the drafter's `start_rows` (inside `_move_in`), so each figure is its host
    and device time together; and the CUDA kernels of each probed phase under torch.profiler (device µs by
    kernel). The call's own figures are not measurements (every probe drains the device)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    probed: dict[str, list] = {}
    kernels: dict[str, dict] = {}
    depth: list[str] = []  # the probed phase being traced (one trace at a time: start_rows runs inside _move_in)

    def probe(owner, method: str):
        fn = getattr(owner, method)

        def wrapper(*a, **kw):
            calls = probed.setdefault(method, [])
            if len(calls) >= n:
                return fn(*a, **kw)
            torch.cuda.synchronize()
            if depth:  # (inside another probed phase, which traces it: timed only)
                t0 = time.perf_counter()
                out = fn(*a, **kw)
                torch.cuda.synchronize()
                calls.append((time.perf_counter() - t0) * 1e3)
                return out
            depth.append(method)
            try:
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    t0 = time.perf_counter()
                    out = fn(*a, **kw)
                    torch.cuda.synchronize()
                    calls.append((time.perf_counter() - t0) * 1e3)
            finally:
                depth.pop()
            by = kernels.setdefault(method, {})
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    entry = by.setdefault(e.name, [0, 0.0])
                    entry[0] += 1
                    entry[1] += e.device_time
            return out
        setattr(owner, method, wrapper)

    probe(dec, "_prefill_requests")
    probe(dec, "_move_in")
    if dec.drafter is not None:
        probe(dec.drafter, "start_rows")
    try:
        eng.generate(prompts, new, ignore_eos=not eos, max_batch=rows)
    finally:
        for owner in (dec, dec.drafter):
            if owner is not None:
                for method in ("_prefill_requests", "_move_in", "start_rows"):
                    owner.__dict__.pop(method, None)
    top = {m: sorted(({"kernel": k, "count": c, "us": us} for k, (c, us) in by.items()), key=lambda e: -e["us"])[:8]
           for m, by in kernels.items()}
    return {"ms": probed, "kernels": top,
            "device_us": {m: sum(us for _, us in by.values()) for m, by in kernels.items()},
            "kernel_count": {m: sum(c for c, _ in by.values()) for m, by in kernels.items()}}


def step_kernels(dec, kind: int, replays: int = 5) -> dict:
    """One step of this kind on the batch's bucket, kernel by kernel: its graph replayed `replays` times from the
    state the call left (`_time_step` puts the state back) under torch.profiler; device µs a step by kernel name.
    Where the trace holds no kernels of the graph's (a CUPTI that does not trace graph nodes), the step run eagerly
    instead (its kernels' device times are the same; only the gaps between them differ), marked so. What the timing
    does around the steps (its copies that save and put back the rows' lengths and the drafter's state, an absorb
    of pending pairs first) is traced again with the steps left out and taken off: a step's table holds its own
    kernels alone. (Counted in, the head's state put back before each replay read as three device copies a step
    more than AR's: thirty-fourth lease, not the loop's.)"""
    import torch
    from torch.profiler import ProfilerActivity, profile

    def traced(fn) -> dict:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        by_name: dict[str, list] = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                entry = by_name.setdefault(e.name, [0, 0.0])
                entry[0] += 1
                entry[1] += e.device_time
        return {name: {"per_step": n / replays, "us": us / replays} for name, (n, us) in by_name.items()}

    dec._time_step(dec._state, kind, 2)  # (outside the trace: the profiler's own start-up)
    kernels = traced(lambda: dec._time_step(dec._state, kind, replays))
    how, step = "graph", lambda: dec._time_step(dec._state, kind, replays)
    if sum(v["per_step"] for v in kernels.values()) <= 2:
        how, step = "eager", lambda: eager_steps(dec, kind, replays)
        kernels = traced(step)
    with steps_left_out(dec, kind):
        around = traced(step)
    return {"how": how, "kernels": without(kernels, around)}


class _NoReplay:
    replay = staticmethod(lambda: None)


class steps_left_out:
    """Within it, `dec`'s steps of `kind` do nothing (their graph's replay, or the eager step), everything around
    them as before: what a timing of them does besides the steps."""

    def __init__(self, dec, kind: int):
        self.dec, self.kind = dec, kind

    def __enter__(self):
        graph, step, kind = self.dec._graph, self.dec._step, self.kind
        self.dec._graph = lambda st, sampling, k: _NoReplay() if k == kind else graph(st, sampling, k)
        self.dec._step = lambda st, sampling, k=None: None if k == kind else step(st, sampling, k)
        return self

    def __exit__(self, *exc):
        del self.dec._graph, self.dec._step  # (the instance's shadows: the class's methods again)


def without(kernels: dict, around: dict) -> dict:
    """`kernels` (name -> per step count, µs) less what ran `around` them; names left with no count or time a step
    are dropped."""
    out = {}
    for name, v in kernels.items():
        less = around.get(name, {"per_step": 0.0, "us": 0.0})
        count, us = v["per_step"] - less["per_step"], v["us"] - less["us"]
        if count > 1e-9 or abs(us) > 1e-3:
            out[name] = {"per_step": count, "us": us}
    return out


def side_by_side(systems: list, rounds: int, replays: int = 10) -> dict:
    """Each system's kinds of step (`systems`: (name, decoder, state, kinds)) replayed `replays` times in turn, system
    after system, for `rounds` rounds: ms a step, each (name, kind) the median of its rounds. Timed one system at a
    time, the same graph on the same card moved by a few percent between systems (the thirty-fourth lease's
    profiles: the n-gram's blind step, AR's graph, +17 µs a step at B = 8); in turn, a drift of clocks or of what
    ran before lands on every system alike."""
    import statistics

    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        for name, dec, st, kinds in systems:
            for kind in kinds:
                times.setdefault((name, kind), []).append(dec._time_step(st, kind, replays) * 1e3)
    out: dict[str, dict[int, float]] = {}
    for (name, kind), ms in times.items():
        out.setdefault(name, {})[kind] = statistics.median(ms)
    return out


def side_by_side_table(found: dict) -> str:
    """The side-by-side replays' table: ms a step by system and kind, and over the first system's first kind."""
    rows = found.get("side_by_side")
    if not rows:
        return ""
    first = next(iter(rows.values()))
    ref = first[next(iter(first))]
    lines = [f"| {name} | {kind} | {ms:.4f} | {ms / ref:.3f} |" for name, kinds in rows.items()
             for kind, ms in kinds.items()]
    return ("\n\nEvery system's kinds of step replayed in turn (ms a step, the median of the rounds; over the first "
            "row):\n\n| system | kind | ms | ratio |\n|---|---:|---:|---:|\n" + "\n".join(lines))


def launch_costs(dec, kinds, launches: int = 40) -> dict:
    """Host µs of one step's launch (`graph.replay()`, the call alone) on the call's bucket: the same kind each time,
    and the kinds in turn (as the controller launches them when its choice changes from step to step), each with the
    device drained before every launch and, `queued`, back to back behind the steps before; lengths and the drafter's state are put back
    afterwards as `_time_step` does. On the H200's chat run (nineteenth lease, B) a controller step's launch took
    0.45 ms of host time against 0.12 for AR's and 0.25 where the controller ran one kind."""
    import torch

    from specpilot.engine.sampling import SamplingParams

    st = dec._state
    graphs = {k: dec._graph(st, SamplingParams(), k) for k in kinds}
    dec.absorb_backlog(st)  # (searching steps read no backlog of pending pairs)
    saved = (st.lengths.clone(), st.budget.clone(), st.active.clone())
    drafter_state = dec.drafter.snapshot() if dec.drafter is not None else None
    cuda = st.out.device.type == "cuda"

    def timed(order, drained: bool = True) -> float:
        total = 0.0
        for k in order:
            st.lengths.copy_(saved[0])
            if dec.drafter is not None:
                dec.drafter.restore(drafter_state)
            if cuda and drained:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            graphs[k].replay()
            total += time.perf_counter() - t0
        if cuda:
            torch.cuda.synchronize()
        return total / len(order) * 1e6

    with torch.inference_mode():
        out = {f"same {k}": timed([k] * launches) for k in kinds}
        if len(kinds) > 1:
            out["in turn"] = timed([kinds[i % len(kinds)] for i in range(launches)])
            # and back to back, the device busy with the steps before (as in the loop, where up to two are queued)
            out["in turn, queued"] = timed([kinds[i % len(kinds)] for i in range(launches)], drained=False)
        out[f"same {kinds[0]}, queued"] = timed([kinds[0]] * launches, drained=False)
    for buf, value in zip((st.lengths, st.budget, st.active), saved):
        buf.copy_(value)
    if dec.drafter is not None:
        dec.drafter.restore(drafter_state)
    return out


def eager_steps(dec, kind: int, replays: int) -> None:
    """`replays` steps of this kind run eagerly from the state the call left, put back after each (as `_time_step`
    does for a graph's replays)."""
    import torch

    from specpilot.engine.sampling import SamplingParams

    st = dec._state
    dec.absorb_backlog(st)  # (searching steps read no backlog of pending pairs)
    saved = (st.lengths.clone(), st.budget.clone(), st.active.clone())
    drafter_state = dec.drafter.snapshot() if dec.drafter is not None else None
    st.active.fill_(True)
    with torch.inference_mode():
        for _ in range(replays):
            dec._step(st, SamplingParams(), kind)
            for buf, value in zip((st.lengths, st.budget, st.active), saved):
                buf.copy_(value)
            if dec.drafter is not None:
                dec.drafter.restore(drafter_state)


def kernel_table(found: dict, top: int = 12) -> str:
    """Each system's steps, kernels a step and device µs, and the kernels whose time differs most from the first
    system's AR step (kind 0)."""
    profiled = {name: {kind: p["kernels"] for kind, p in r["kernels"].items()}
                for name, r in found.items() if r.get("kernels")}
    how = sorted({p["how"] for r in found.values() for p in r.get("kernels", {}).values()})
    if not profiled:
        return ""
    rows = [f"Each kind of step, kernel by kernel ({' and '.join(how)} steps under torch.profiler):", "",
            "| system | kind | kernels a step | device µs a step |", "|---|---:|---:|---:|"]
    for name, kinds in profiled.items():
        for kind, kernels in kinds.items():
            rows.append(f"| {name} | {kind} | {sum(v['per_step'] for v in kernels.values()):.0f} | "
                        f"{sum(v['us'] for v in kernels.values()):,.1f} |")
    rows += ["", "Host µs of one step's launch (the replay call alone; the device drained before it, or queued behind "
             "the launches before): the same kind each time, and the kinds in turn:", "", "| system | launch µs |", "|---|---|"]
    rows += [f"| {name} | " + ", ".join(f"{k}: {v:.0f}" for k, v in r.get("launch_us", {}).items()) + " |"
             for name, r in found.items() if r.get("launch_us")]
    base_name = next(iter(profiled))
    base = profiled[base_name].get(0) or next(iter(profiled[base_name].values()))
    for name, kinds in profiled.items():
        for kind, kernels in kinds.items():
            if name == base_name or kind > 0:
                continue
            diff = {k: kernels.get(k, {"us": 0.0})["us"] - base.get(k, {"us": 0.0})["us"] for k in set(kernels) | set(base)}
            worst = sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:top]
            rows += ["", f"{name}, kind {kind}, against {base_name}'s AR step: µs a step by kernel (+: more)", "",
                     "| kernel | µs | count a step |", "|---|---:|---:|"]
            rows += [f"| {k[:90]} | {d:+.1f} | {kernels.get(k, {'per_step': 0})['per_step']:.0f} / "
                     f"{base.get(k, {'per_step': 0})['per_step']:.0f} |" for k, d in worst]
    return "\n".join(rows)


def run(out_dir, args):
    import torch

    from specpilot.engine.decode import batch_bucket
    from specpilot.engine.engine import Engine
    from specpilot.engine.recipe import parse
    from specpilot.tools.bench.metrics import time_budget

    ctx = args.ctx
    device = "cuda" if torch.cuda.is_available() and not ctx.smoke else "cpu"
    rows, requests, new = (2, 4, 8) if ctx.smoke else (args.rows, args.requests, args.max_new_tokens)
    if args.workload:
        from specpilot.engine import loader
        from specpilot.engine.workloads import load_workload

        target = loader.load(ctx.target, "bf16" if device == "cuda" else "fp32", device)
        questions = load_workload(args.workload)
        encode = Engine(target, parse({})).encode
        prompts = [encode(questions[i % len(questions)].turns[0]) for i in range(requests)]
    else:
        target = harness.random_smollm2(2 if ctx.smoke else args.layers, device, ctx.scratch)
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, SHAPES["vocab_size"], (int(torch.randint(96, 193, (1,), generator=g)),),
                                 generator=g).tolist() for _ in range(requests)]
    found, lines, kept = {}, [], []
    names = args.systems.split(",")
    for at, system in enumerate(names):
        # a system named twice is measured twice, the second time as NAME#2 (in the same process after the others:
        # whether a system's steps depend on what ran before it, as the bench's controller's seemed to, 25th lease)
        name = system if system not in names[:at] else f"{system}#{names[:at].count(system) + 1}"
        system, compiled_prefill = system.removesuffix(COMPILED_PREFILL), system.endswith(COMPILED_PREFILL)
        try:  # a system that fails costs its own row, not the systems after it
            eng = Engine(target, system_recipe(system, ctx.target if args.workload else None, device))
            dec = eng.decoder
            if compiled_prefill:  # (what SPECPILOT_COMPILED_PREFILL=1 sets for every decoder of a process)
                from specpilot.engine.decode import Block
                from specpilot.engine.model import compiled_dynamic

                dec.prefill_layer_fn = compiled_dynamic(Block.forward)
            t_warm = time.perf_counter()
            print(f"loop_overhead: {name}: warming up", file=sys.stderr, flush=True)  # (minutes on a real workload)
            eng.warmup([rows], max(map(len, prompts)), new)
            print(f"loop_overhead: {name}: warm in {time.perf_counter() - t_warm:.0f} s", file=sys.stderr, flush=True)
            # the first real call: caches, allocator
            eng.generate(prompts, new, ignore_eos=not args.eos, max_batch=rows)
            phases = {}
            for method in PHASES:
                setattr(dec, method, timed(phases, method, getattr(dec, method)))
            if dec.drafter is not None:  # (inside _move_in: its share of it)
                dec.drafter.start_rows = timed(phases, "start_rows", dec.drafter.start_rows)
            torch.cuda.synchronize() if device == "cuda" else None
            t0 = time.perf_counter()
            out = eng.generate(prompts, new, ignore_eos=not args.eos, max_batch=rows)
            torch.cuda.synchronize() if device == "cuda" else None
            wall = time.perf_counter() - t0
            for method in PHASES:
                delattr(dec, method)
            if dec.drafter is not None:
                del dec.drafter.start_rows
            stats = dec.last_stats
            kinds = sorted(set(stats.draft_lengths))
            # Replays and kernels on the call's own bucket, the state its rows left there (a batch that drained into
            # smaller buckets ends in one of those: replayed there, its steps priced a batch of 8 or 16 rows)
            st = dec._use(batch_bucket(rows) if dec.bucketed else rows, 0)
            if dec.drafter is not None:  # its state on those rows too (it was left on the smaller bucket's): the
                # head's restore between replays put back one row of four, and the other rows' backlog grew
                # past the pending pairs a searching step reads (device-side asserts, thirty-fourth lease)
                dec.drafter.move_rows(torch.arange(st.batch, device=st.lengths.device), st.batch)
                dec.absorb_backlog(st)
            at_end = {k: dec._time_step(st, k, 20) * 1e3 for k in kinds}
            warm = {k: v * 1e3 for k, v in dec.prices.get(st.batch, {}).items()}
            loop = {k: v * 1e3 for k, v in dec.step_seconds.get(st.batch, {}).items()}
            tokens = sum(len(r.tokens) for r in out)
            rest = wall - sum(phases.get(m, 0.0) for m in PHASES)  # (start_rows runs inside _move_in)
            budget = time_budget(stats.step_log)
            found[name] = {"wall_s": wall, "tokens": tokens, "steps": stats.steps, "refills": stats.refills,
                           "live_rows_per_step": stats.row_steps / max(1, stats.steps), "shrinks": stats.shrinks,
                           "kinds": {k: stats.draft_lengths.count(k) for k in kinds}, "replay_ms_at_end": at_end,
                           "replay_ms_at_warmup": warm, "loop_ms": loop, "host_s": phases, "rest_s": rest,
                           "time_budget": budget}
            if args.timeline and device == "cuda":
                found[name]["timeline"] = device_timeline(dec, eng, prompts, new, args.eos, rows)
            if args.probe_refills and device == "cuda":
                found[name]["refill_probe"] = probe_refills(dec, eng, prompts, new, args.eos, rows, args.probe_refills)
            if args.kernels and device == "cuda":
                found[name]["kernels"] = {k: step_kernels(dec, k) for k in dec._step_kinds()}
                # (a controller's AR, blind AR and two draft lengths; a fixed-k decoder's own kinds)
            found[name]["launch_us"] = launch_costs(dec, [k for k in dec._step_kinds() if k in (-1, 0, 3, 4)]
                                                    or list(dec._step_kinds()))
            if args.side_by_side:  # kept for the replays in turn after the last system: its AR-like kinds, and k
                kept.append((name, dec, st, [k for k in dec._step_kinds() if k <= 0 or k == dec.k]))
            lines.append(f"| {name} | {tokens / wall:,.0f} | {stats.steps} | "
                         f"{stats.row_steps / max(1, stats.steps):.1f} | "
                         f"{wall / stats.steps * 1e3:.3f} | "
                         + ", ".join(f"{k}: {v:.3f}" for k, v in at_end.items()) + " | "
                         + (", ".join(f"{k}: {v:.3f}" for k, v in warm.items()) or "-") + " | "
                         + (", ".join(f"{k}: {v:.3f}" for k, v in loop.items()) or "-") + " | "
                         + " / ".join(f"{phases.get(m, 0) * 1e3:.0f}" for m in PHASES)
                         + f" / {rest * 1e3:.0f} | {phases.get('start_rows', 0) * 1e3:.0f} | {stats.refill_prefills}, "
                         f"{stats.refill_prefill_s * 1e3:.0f} | {stats.refills} | {budget['refill_steps']} | "
                         f"{budget['refill_extra_s'] * 1e3:.0f} | {budget['drain_steps']} | {budget['drain_s'] * 1e3:.0f} |")
            print(f"loop_overhead: {name}: {tokens / wall:,.0f} tok/s", file=sys.stderr, flush=True)
        except Exception as e:
            why = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
            found[name] = {"error": why}
            lines.append(f"| {name} | error: {why} |")
            print(f"loop_overhead: {name}: {why}", file=sys.stderr, flush=True)
            traceback.print_exc()  # (where: a device-side assert's line says nothing of the Python that launched it)
        eng = dec = None
        torch.cuda.empty_cache() if device == "cuda" else None
    if kept:
        found["side_by_side"] = side_by_side(kept, args.side_by_side)
        kept.clear()
    head = ("| system | tok/s | steps | live rows a step | wall ms/step | replay ms at the end, by kind | at warm-up | "
            "in the loop | host ms: wait / launch / prefill requests / move them in / move to a smaller bucket / rest "
            "| of which the drafter's start_rows ms | refill prefills, their device ms | requests started | steps behind a "
            "refill | their ms beyond a typical step | drain steps | drain ms |\n"
            "|---|---:|---:|---:|---:|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    return found, (head + "\n" + "\n".join(lines) + "\n\n" + probe_table(found) + kernel_table(found)
                   + side_by_side_table(found) + timeline_table(found))


def probe_table(found: dict) -> str:
    """The probed refills: each phase's ms (host and device, the device drained around it), its kernels' device µs,
    and its costliest kernels."""
    rows = []
    for name, r in found.items():
        p = r.get("refill_probe")
        if not p:
            continue
        rows.append(f"{name}, refills probed alone (ms each: host and device; kernels and their device µs a call):\n")
        for method, ms in p["ms"].items():
            calls = max(1, len(ms))
            rows.append(f"- {method}: " + ", ".join(f"{v:.2f}" for v in ms)
                        + f" ms; {p['kernel_count'].get(method, 0) / calls:.0f} kernels, "
                        f"{p['device_us'].get(method, 0.0) / calls:,.0f} µs a call; costliest: "
                        + ", ".join(f"{e['kernel'][:60]} {e['us'] / calls:,.0f} µs x{e['count'] / calls:.0f}"
                                    for e in p["kernels"].get(method, [])[:4]))
        rows.append("")
    return "\n".join(rows) + "\n" if rows else ""
