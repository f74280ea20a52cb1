"""Single-request speed of our engine beside HF transformers, in one process, systems alternating per prompt.

    python -m specpilot.tools.bench.engine_bench --device cuda --max-new-tokens 256 --limit 4 --out DIR

Every system decodes the same chat-templated prompts for exactly N new tokens (EOS ignored, so all do the same work).
Reports tok/s per (system, workload), milliseconds per target step, tau, and the weight-read floor (the bytes of the
weights a step reads, `step_weight_bytes`, over the measured copy bandwidth) so a step time can be read against its
physical ceiling.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from ...engine import loader
from ...engine.engine import Engine
from ...engine.recipe import load_recipe, parse
from ...engine.tree import chains
from ...engine.workloads import load_workload
from ..argtypes import add_target_argument

_AUTOTUNE = "max-autotune-no-cudagraphs"
SYSTEMS = {
    "ar": "ar",
    "ar-eager": {"name": "ar-eager", "cuda_graphs": False, "compile": False},
    "ar-graphs": {"name": "ar-graphs", "compile": False},
    "ngram-k4": "stock-ngram",
    "ngram-k8": {"name": "ngram-k8", "drafter": {"kind": "ngram"}, "k": 8},
    "layerskip8-k4": {"name": "layerskip8-k4", "drafter": {"kind": "layerskip", "layers": 8}, "k": 4},
    "selfdraft-fp16-k4": {"name": "selfdraft-fp16-k4", "drafter": {"kind": "model", "model": "smollm2-135m",
                                                                  "dtype": "fp16"}, "k": 4},
    "ar-overlap": {"name": "ar-overlap", "overlap": True},
    "ar-autotune": {"name": "ar-autotune", "compile_mode": _AUTOTUNE},
    "ar-triton-linear": {"name": "ar-triton-linear", "kernels": {"linear": "builtin:triton"}},
    "ar-autotune-overlap": {"name": "ar-autotune-overlap", "compile_mode": _AUTOTUNE, "overlap": True},
    "ngram-k4-autotune": {"name": "ngram-k4-autotune", "drafter": {"kind": "ngram"}, "k": 4, "compile_mode": _AUTOTUNE},
    "ngram-k8-autotune-overlap": {"name": "ngram-k8-autotune-overlap", "drafter": {"kind": "ngram"}, "k": 8,
                                  "compile_mode": _AUTOTUNE, "overlap": True},
    "ngram-k4-overlap": {"name": "ngram-k4-overlap", "drafter": {"kind": "ngram"}, "k": 4, "overlap": True},
    "ar-triton": {"name": "ar-triton", "kernels": {"rmsnorm": "builtin:triton", "attention": "builtin:triton"}},
    "ngram-k4-triton": {"name": "ngram-k4-triton", "drafter": {"kind": "ngram"}, "k": 4,
                        "kernels": {"rmsnorm": "builtin:triton", "attention": "builtin:triton",
                                    "accept": "builtin:triton"}},
    "ar-lossless12": {"name": "ar-lossless12", "weights": {"format": "lossless12"},
                      "kernels": {"linear": "builtin:lossless12"}},
    "ar-lossless12-fused-overlap": {"name": "ar-lossless12-fused-overlap", "layer": "fused", "overlap": True,
                                    "weights": {"format": "lossless12"}, "kernels": {"linear": "builtin:lossless12"}},
    "ar-fused": {"name": "ar-fused", "layer": "fused"},
    "ar-fused-overlap": {"name": "ar-fused-overlap", "layer": "fused", "overlap": True},
    "ngram-k4-fused": {"name": "ngram-k4-fused", "drafter": {"kind": "ngram"}, "k": 4, "layer": "fused"},
    "ngram-k8-fused": {"name": "ngram-k8-fused", "drafter": {"kind": "ngram"}, "k": 8, "layer": "fused"},
    "ngram-k4-fused-overlap": {"name": "ngram-k4-fused-overlap", "drafter": {"kind": "ngram"}, "k": 4,
                               "layer": "fused", "overlap": True},
    "ngram-k8-fused-overlap": {"name": "ngram-k8-fused-overlap", "drafter": {"kind": "ngram"}, "k": 8,
                               "layer": "fused", "overlap": True},
    "ngram-k4-adaptive-fused-overlap": {"name": "ngram-k4-adaptive-fused-overlap", "k": 4, "layer": "fused",
                                        "drafter": {"kind": "ngram", "adaptive": True}, "overlap": True},
    "ngram-k8-adaptive-fused-overlap": {"name": "ngram-k8-adaptive-fused-overlap", "k": 8, "layer": "fused",
                                        "drafter": {"kind": "ngram", "adaptive": True}, "overlap": True},
    "ngram2-k4-adaptive-fused-overlap": {"name": "ngram2-k4-adaptive-fused-overlap", "k": 4, "layer": "fused",
                                         "drafter": {"kind": "ngram", "min_ngram": 2, "max_ngram": 4,
                                                     "adaptive": True}, "overlap": True},
    "ngram2-k4-adaptive-armiss-fused-overlap": {"name": "ngram2-k4-adaptive-armiss-fused-overlap", "k": 4,
                                                "layer": "fused", "overlap": True,
                                                "drafter": {"kind": "ngram", "min_ngram": 2, "max_ngram": 4,
                                                            "adaptive": True, "ar_after_miss": True}},
    # the same with the batch controller (each step's k' from acceptance and step prices), padded or ragged
    "ngram2-k4-cost-fused-overlap": {"name": "ngram2-k4-cost-fused-overlap", "k": 4, "layer": "fused",
                                     "overlap": True, "batch": {"controller": "cost"},
                                     "drafter": {"kind": "ngram", "min_ngram": 2, "max_ngram": 4, "adaptive": True,
                                                 "ar_after_miss": True}},
    # ... and with requests started in groups of a sixteenth of the rows (batch.refill_at; issue #20's chat B = 64)
    "ngram2-k4-cost-refill-fused-overlap": {"name": "ngram2-k4-cost-refill-fused-overlap", "k": 4, "layer": "fused",
                                            "overlap": True, "batch": {"controller": "cost", "refill_at": 0.0625},
                                            "drafter": {"kind": "ngram", "min_ngram": 2, "max_ngram": 4,
                                                        "adaptive": True, "ar_after_miss": True}},
    # ... and with steps below one draft a row (a quarter and a half of the batch's rows' drafts, packed): at B = 16
    # k' = 1 is 32 tokens, past the fused layer's 24 (batch.fractions)
    "ngram2-k4-cost-frac-fused-overlap": {"name": "ngram2-k4-cost-frac-fused-overlap", "k": 4, "layer": "fused",
                                          "overlap": True, "batch": {"controller": "cost", "fractions": [0.25, 0.5]},
                                          "drafter": {"kind": "ngram", "min_ngram": 2, "max_ngram": 4,
                                                      "adaptive": True, "ar_after_miss": True}},
    "ngram2-k4-ragged-fused-overlap": {"name": "ngram2-k4-ragged-fused-overlap", "k": 4, "layer": "fused",
                                       "overlap": True, "batch": {"controller": "cost", "ragged": True},
                                       "drafter": {"kind": "ngram", "min_ngram": 2, "max_ngram": 4, "adaptive": True,
                                                   "ar_after_miss": True}},
    "ngram-k4-adaptive-armiss-fused-overlap": {"name": "ngram-k4-adaptive-armiss-fused-overlap", "k": 4,
                                               "layer": "fused", "overlap": True,
                                               "drafter": {"kind": "ngram", "adaptive": True, "ar_after_miss": True}},
    # an n-gram tree: the drafter's 3 latest matches as branches of 4 drafts (what the policy proposes where a chain's
    # drafts miss), 13 tokens a row on the fused layer's tensor-core path; against the min-2 chain above (issue #21)
    "ngram2-tree3x4-fused-overlap": {"name": "ngram2-tree3x4-fused-overlap", "k": 4, "layer": "fused",
                                     "overlap": True, "drafter": {"kind": "ngram", "min_ngram": 2, "max_ngram": 4},
                                     "verification": "tree",
                                     "tree": {"kind": "static", "paths": [list(p) for p in chains(3, 4).paths[1:]]}},
    # chains of smollm2-135m's packaged EAGLE-3 head (docs/TRAINING.md), its steps on the fused layer's kernels
    **{f"eagle3-k{k}-fused-overlap": {"name": f"eagle3-k{k}-fused-overlap", "k": k, "layer": "fused", "overlap": True,
                                      "drafter": {"kind": "eagle3", "model": "smollm2-135m-eagle3"}} for k in (2, 3, 4)},
    # ... and with the batch controller (each step's chain length 0..k from the measured acceptance and each kind's
    # price at the batch's bucket): the head's chain where it pays, AR steps where it would lose (large B)
    **{f"eagle3-k{k}-cost-fused-overlap": {"name": f"eagle3-k{k}-cost-fused-overlap", "k": k, "layer": "fused",
                                           "overlap": True, "batch": {"controller": "cost"},
                                           "drafter": {"kind": "eagle3", "model": "smollm2-135m-eagle3"}}
       for k in (3, 4)},
    # ... with prompt lookup beside the head: a row whose last 3-6 tokens occurred before copies what followed
    # (drafter.lookup; engine/eagle3.py), chains of 3 and 4
    **{f"eagle3-k{k}-lookup3-cost-fused-overlap": {
        "name": f"eagle3-k{k}-lookup3-cost-fused-overlap", "k": k, "layer": "fused", "overlap": True,
        "batch": {"controller": "cost"}, "drafter": {"kind": "eagle3", "model": "smollm2-135m-eagle3", "lookup": 3}}
       for k in (3, 4)},
    # ... copying up to k where lookup matched, the head drafting 3 elsewhere (drafter.head_k): k = 5 is a step of 6
    # tokens a row, the fused layer's FMA path at B = 1; 7, past it
    **{f"eagle3-k{k}-head3-lookup3-cost-fused-overlap": {
        "name": f"eagle3-k{k}-head3-lookup3-cost-fused-overlap", "k": k, "layer": "fused", "overlap": True,
        "batch": {"controller": "cost"},
        "drafter": {"kind": "eagle3", "model": "smollm2-135m-eagle3", "lookup": 3, "head_k": 3}}
       for k in (5, 7)},
    # ... without the controller (B = 1: a step of k's width whose dead tokens the fused layer skips, so a row without
    # a copied chain pays about a step of 3 drafts; the controller's kinds follow the last step's chain instead)
    **{f"eagle3-k{k}-head3-lookup3-fused-overlap": {
        "name": f"eagle3-k{k}-head3-lookup3-fused-overlap", "k": k, "layer": "fused", "overlap": True,
        "drafter": {"kind": "eagle3", "model": "smollm2-135m-eagle3", "lookup": 3, "head_k": 3}}
       for k in (4, 5)},
    **{f"eagle3-k{k}-cost-frac-fused-overlap": {"name": f"eagle3-k{k}-cost-frac-fused-overlap", "k": k,
                                                "layer": "fused", "overlap": True,
                                                "batch": {"controller": "cost", "fractions": [0.25, 0.5]},
                                                "drafter": {"kind": "eagle3", "model": "smollm2-135m-eagle3"}}
       for k in (3, 4)},
    # ... and its EAGLE-2 dynamic trees small enough for the fused layer's tree steps (at most 16 tokens): depth d,
    # top-k children a node, t tokens verified (the twenty-third lease's 32-token tree took 4.7 AR steps a step)
    **{f"eagle3-dyn-d{d}-k{topk}-t{t}-fused-overlap": {
        "name": f"eagle3-dyn-d{d}-k{topk}-t{t}-fused-overlap", "k": d, "layer": "fused", "overlap": True,
        "drafter": {"kind": "eagle3", "model": "smollm2-135m-eagle3"}, "verification": "tree",
        "tree": {"kind": "dynamic", "depth": d, "topk": topk, "tokens": t}} for d, topk, t in ((3, 2, 8), (4, 3, 12),
                                                                                             (4, 4, 16))},
    "layerskip8-k4-fused": {"name": "layerskip8-k4-fused", "drafter": {"kind": "layerskip", "layers": 8}, "k": 4,
                            "layer": "fused"},
    "selfdraft-fp16-k4-fused": {"name": "selfdraft-fp16-k4-fused", "drafter": {"kind": "model",
                                "model": "smollm2-135m", "dtype": "fp16"}, "k": 4, "layer": "fused"},
    "ngram-k4-lossless12": {"name": "ngram-k4-lossless12", "drafter": {"kind": "ngram"}, "k": 4,
                            "weights": {"format": "lossless12"}, "kernels": {"linear": "builtin:lossless12"}},
}


def step_weight_bytes(model) -> int:
    """The weight bytes an AR step reads: every parameter once (a tied LM head is the embedding), except an untied
    embedding table, of which a step reads one row a token (on an 8B target a sixteenth of the weights)."""
    params = {id(p): p for p in model.parameters()}
    if model.lm_head is not model.embed:
        params.pop(id(model.embed))
    return sum(p.numel() * p.element_size() for p in params.values())


def settle(device: str, seconds: float) -> None:
    """Keep the GPU busy with matmuls for `seconds` before a timed run, so that every run starts from the same clock
    state, whatever the system before it left behind (HF's eager runs leave the GPU mostly idle). CUDA only."""
    if device != "cuda" or seconds <= 0:
        return
    a = torch.randn(2048, 2048, device=device, dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(8):
            a @ a
        torch.cuda.synchronize()


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a large device copy (read + write counted)."""
    n = 1 << 30 if device == "cuda" else 1 << 24
    a = torch.empty(n, dtype=torch.uint8, device=device).random_()
    b = torch.empty_like(a)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):
        b.copy_(a)
    sync()
    times = []
    for _ in range(10):
        t = time.perf_counter()
        b.copy_(a)
        sync()
        times.append(time.perf_counter() - t)
    return 2 * n / statistics.median(times)


def hf_runner(source: str, device: str, dtype, mode: str):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(source, dtype=dtype).to(device).eval()

    def run(ids: list[int], n: int) -> tuple[list[int], float]:
        x = torch.tensor([ids], device=device)
        kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False)
        if mode == "static":
            kw["cache_implementation"] = "static"
        if mode == "prompt-lookup":
            kw["prompt_lookup_num_tokens"] = 10
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = hf.generate(x, **kw)
        if device == "cuda":
            torch.cuda.synchronize()
        return out[0, len(ids):].tolist(), time.perf_counter() - t

    return run


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    add_target_argument(ap, default="smollm2-135m")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--workloads", default="code,summarize,chat")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--hf", default="dynamic,static,prompt-lookup")
    ap.add_argument("--out", default=None)
    ap.add_argument("--settle-ms", type=float, default=50.0,
                    help="GPU work before each timed run, so each starts from the same clock state (0: none)")
    args = ap.parse_args(argv)
    dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    target = loader.load(args.target, dtype, args.device)
    engines = {}
    for name in args.systems.split(","):
        spec = SYSTEMS[name]
        if name.startswith("selfdraft"):
            spec = {**spec, "drafter": {**spec["drafter"], "model": args.target}}
        try:
            engines[name] = Engine(target, load_recipe(spec) if isinstance(spec, str) else parse(spec))
        except Exception as e:  # one system that cannot be built must not cost the others
            print(f"{name}: cannot build: {type(e).__name__}: {e}", flush=True)
    runners = {}
    for name, eng in engines.items():
        def ours(ids, n, eng=eng):
            [row] = eng.generate([ids], n, ignore_eos=True)
            st = eng.decoder.last_stats
            return row.tokens, st.prefill_s + st.decode_s, st.steps + 1, row.mean_accepted, st.prefill_s
        runners[name] = ours
    for mode in filter(None, args.hf.split(",")):
        run = hf_runner(target.source, args.device, loader.parse_dtype(dtype), mode)
        runners[f"hf-{mode}"] = lambda ids, n, run=run: (*run(ids, n), None, None, None)
    ar_engine = engines.get("ar") or Engine(target, load_recipe("ar"))
    bw = copy_bandwidth(args.device)
    weight_bytes = step_weight_bytes(target.model)
    floor_s = weight_bytes / bw  # a step must read every weight once at (at best) copy bandwidth
    rows = []
    for wl in args.workloads.split(","):
        questions = load_workload(wl, args.limit)
        prompts = [ar_engine.encode(q.turns[0]) for q in questions]
        for name, run in list(runners.items()):  # warm-up: compile, graphs captured, kernels loaded
            t = time.perf_counter()
            try:  # the measured length: same cache size, so nothing compiles again while measured
                run(prompts[0], args.max_new_tokens)
                # Each other prompt's prefill once: the first prefill at a new prompt length loads new kernels
                # (on the H200, ~55 ms more than the 20 ms prefill), which the first system to meet it would pay.
                for ids in prompts[1:]:
                    run(ids, 1)
            except Exception as e:  # one broken system must not cost the others' measurements
                print(f"{name}: failed in warm-up: {type(e).__name__}: {e}", flush=True)
                del runners[name]
                continue
            print(f"warm-up {name} {wl}: {time.perf_counter() - t:.1f}s", flush=True)
        for i, ids in enumerate(prompts):
            order = list(runners)
            order = order[i % len(order):] + order[: i % len(order)]  # rotate so drift hits every system alike
            for name in order:
                settle(args.device, args.settle_ms / 1e3)
                try:
                    tokens, seconds, steps, tau, prefill_s = runners[name](ids, args.max_new_tokens)
                except Exception as e:
                    print(f"{name} {wl} #{i}: failed: {type(e).__name__}: {e}", flush=True)
                    continue
                print(f"{name} {wl} #{i}: {len(tokens) / seconds:.1f} tok/s", flush=True)
                rows.append({"system": name, "workload": wl, "prompt": i, "prompt_tokens": len(ids),
                             "tokens": len(tokens), "seconds": seconds, "prefill_s": prefill_s,
                             "target_steps": steps, "tau": tau, "token_ids": tokens})
    ar_tokens = {(r["workload"], r["prompt"]): r["token_ids"] for r in rows if r["system"] == "ar"}
    table = []
    for name in runners:
        for wl in args.workloads.split(","):
            rs = [r for r in rows if r["system"] == name and r["workload"] == wl]
            if not rs:
                continue
            tps = statistics.median(r["tokens"] / r["seconds"] for r in rs)
            steps = [r for r in rs if r["target_steps"]]
            ms_step = statistics.median(r["seconds"] / r["target_steps"] * 1e3 for r in steps) if steps else None
            tau = statistics.mean(r["tau"] for r in steps) if steps else None
            same = sum(r["token_ids"] == ar_tokens.get((wl, r["prompt"])) for r in rs) / len(rs) if ar_tokens else None
            table.append({"system": name, "workload": wl, "tokens_per_s": tps, "ms_per_target_step": ms_step,
                          "tau": tau, "identical_to_ar": same})
    base = "ar" if "ar" in runners else next(iter(runners))  # the "vs" column: our AR, else the first system
    base_tps = {t["workload"]: t["tokens_per_s"] for t in table if t["system"] == base}
    print(f"device={torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'} dtype={dtype} "
          f"torch={torch.__version__} N={args.max_new_tokens} prompts/workload={args.limit}")
    print(f"weights {weight_bytes / 1e6:.1f} MB, copy bandwidth {bw / 1e12:.2f} TB/s -> weight-read floor "
          f"{floor_s * 1e6:.1f} us/step ({1 / floor_s:,.0f} steps/s)")
    print(f"{'system':20s} {'workload':10s} {'tok/s':>9s} {'vs':>6s} {'ms/step':>8s} {'tau':>5s} {'=ar':>5s}"
          f"   (vs: tok/s over {base}'s)")
    for t in table:
        ms = f"{t['ms_per_target_step']:.3f}" if t["ms_per_target_step"] else "-"
        tau = f"{t['tau']:.2f}" if t["tau"] else "-"
        same = f"{t['identical_to_ar']:.2f}" if t["identical_to_ar"] is not None else "-"
        print(f"{t['system']:20s} {t['workload']:10s} {t['tokens_per_s']:9.1f} "
              f"{t['tokens_per_s'] / base_tps[t['workload']]:6.2f} {ms:>8s} {tau:>5s} {same:>5s}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "engine_bench.json").write_text(json.dumps({
            "command": "python -m specpilot.tools.bench.engine_bench " + " ".join(sys.argv[1:] if argv is None else argv),
            "copy_bandwidth": bw,
            "weight_bytes": weight_bytes, "floor_s": floor_s, "table": table,
            "rows": [{k: v for k, v in r.items() if k != "token_ids"} for r in rows]}, indent=1))


if __name__ == "__main__":
    main()
