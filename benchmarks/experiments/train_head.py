"""An EAGLE-3 head for the staged target, trained on the device by `specpilot train-drafter`, then benchmarked.

What it does (issue #22 items 3-4). `specpilot train-drafter` on the staged target: self-instructed prompts (none
from a benchmark), the target's greedy and sampled answers, EAGLE-3's training-time test for `--minutes` of training
(the data's build is not counted), the target's own LM-head rows frozen (`--lm-head target`, so the file stays under
the repository's 16 MB). The head comes back in the out dir (`head/config.json`, `head/model.safetensors`) with the
training log and data report. Then one `specpilot bench` at B = 1 (`--bench-workloads`, `--bench-limit` prompts each,
128 new tokens): our fastest AR, the shipped n-gram recipe and the head as a chain (k = 4, modular and fused layer)
and as EAGLE-2's dynamic tree, each recipe's tokens checked against AR by the bench. A system that fails is recorded
as that system's error; the head is kept either way.

Backs docs/BENCHMARKS.md, "What is not yet fast" (the first trained EAGLE-3 head, twelfth lease B), and
docs/TRAINING.md's "First run on the H200".

Longer than a device call (10 minutes at most): `--run-dir DIR --call-minutes 8` keeps the run in DIR (on the warm
machine) and stops the training step after 8 minutes; the same command in the next call resumes it (`train-drafter
--resume`: the data is not built again, the step count and the optimizer state carry over; at most a checkpoint's
steps are lost, --checkpoint-every), and the call in which it finishes benchmarks the head. A call that stops it
reports the steps reached and the latest held-out acceptance.

Longer than a lease (30 device minutes, and only files of at most 16 MiB come back): `--init HEAD --seed S`
continues HEAD (the head an earlier lease brought back, or `smollm2-135m-eagle3`) on new data (another seed, other
prompts) and benches HEAD's chain of 2 beside the new head's.

With `--bench-batch B` also one `specpilot bench` at B, continuously batched: the head's chain of 3 under the
batch controller (and HEAD's, with `--init`) against our fastest AR, to ship a continued head on batched
evidence too.

Device minutes: about 4 to build the data, `--minutes` to train, 1-2 for the bench (2 more with --bench-batch).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import harness

MINUTES = 9
FASTEST_AR = "ar-fused-overlap"


def head_recipes(head: str) -> dict[str, dict]:
    drafter = {"kind": "eagle3", "model": head}
    return {
        "eagle3-k4": {"drafter": drafter, "k": 4},
        "eagle3-k4-fused-overlap": {"drafter": drafter, "k": 4, "layer": "fused", "overlap": True},
        "eagle3-k2-fused-overlap": {"drafter": drafter, "k": 2, "layer": "fused", "overlap": True},
        "eagle3-dyn-d5-t32": {"drafter": drafter, "k": 5, "verification": "tree",
                              "tree": {"kind": "dynamic", "depth": 5, "topk": 4, "tokens": 32}},
    }


def arguments(p) -> None:
    p.add_argument("--samples", type=int, default=1500, help="prompts (each gives a greedy and a sampled answer)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--minutes", type=float, default=3.0, help="training minutes (the data's build not counted)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--bench-workloads", default="code,chat,math,summarize,rag")
    p.add_argument("--bench-limit", type=int, default=2)
    p.add_argument("--no-bench", action="store_true")
    p.add_argument("--bench-batch", type=int, default=None,
                   help="also bench at this batch size, continuously batched (8 requests a cell, 4 waves: "
                        "batch_sweep's cells): the head's chain of 3 under the batch controller against our fastest "
                        "AR, and with --init HEAD's beside it")
    p.add_argument("--run-dir", default=None, help="train-drafter's --out, kept across calls of a warm machine "
                                                   "(default: a fresh one in the scratch folder); a run there is "
                                                   "resumed")
    p.add_argument("--call-minutes", type=float, default=None,
                   help="stop the training step after this many minutes (with --run-dir): the next call resumes it")
    p.add_argument("--checkpoint-every", type=int, default=1000)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--answer-batch", type=int, default=256, help="rows the target decodes prompts and answers in")
    p.add_argument("--sized-by", default=None,
                   help="a train_speed.json: --samples becomes the prompts whose data builds in --data-seconds at "
                        "its rates (at most --samples), and --batch-size / --lr its fastest batch (lr scaled by the "
                        "square root of the batch's ratio to --batch-size); a resumed run keeps its run.json's")
    p.add_argument("--data-seconds", type=float, default=240.0)
    p.add_argument("--init", default=None, help="continue this head (train-drafter --init: a directory or an alias, "
                                                "e.g. smollm2-135m-eagle3); the bench then runs its chain of 2 too")
    p.add_argument("--seed", type=int, default=0, help="train-drafter's seed (another one: other prompts)")
    p.add_argument("--intermediate-size", type=int, default=None,
                   help="train-drafter's --intermediate-size: the head's MLP width (default: the target layer's)")


def sized(args, speed: dict) -> dict:
    """The data's prompts and the training batch from a train_speed record (--sized-by): the prompts whose writing,
    greedy and sampled answers at --answer-batch rows and capture fit in --data-seconds, at the rates measured for
    speed['prompts'] prompts; the batch size with the most answer tokens a second, lr scaled by sqrt(batch ratio)."""
    speed = speed.get("results", speed)  # a runner record holds the experiment's under "results"
    n = speed["prompts"]
    decode = sum(d["seconds"] for d in speed["decoding"] if d["rows"] == args.answer_batch)
    if not decode:
        raise ValueError(f"--sized-by: no decoding measured at {args.answer_batch} rows")
    per_prompt = (speed["prompt_writing"]["seconds"] + decode + speed["capture"]["seconds"]) / n
    samples = max(2, min(args.samples, int(args.data_seconds / per_prompt)))
    best = max(speed["training"], key=lambda s: s["answer_tokens_per_second"])
    lr = args.lr * (best["batch_size"] / args.batch_size) ** 0.5
    return {"samples": samples, "batch_size": best["batch_size"], "lr": float(f"{lr:.3g}"),
            "seconds_per_prompt": round(per_prompt, 4)}


def stopped(head: Path, train, resumed: bool) -> tuple[dict, str]:
    """A run stopped by --call-minutes: how far it got (the log's latest progress line, the checkpoint kept)."""
    progress = [line for line in train.tail if " step " in line and "held-out acceptance" in line]
    checkpoint = head / "checkpoint.pt"
    found = {"stopped": True, "resumed": resumed, "run_dir": str(head), "train_seconds": train.seconds,
             "last_progress": progress[-1] if progress else None, "checkpoint": checkpoint.is_file(),
             "data_built": (head / "heldout.pt").is_file(), "train_tail": train.tail[-12:]}
    data = "built" if found["data_built"] else "not yet built"
    kept = "kept" if found["checkpoint"] else "none yet"
    text = (f"Training stopped after {train.seconds:.0f} s ({'resumed' if resumed else 'a new run'}; data {data}; "
            f"checkpoint {kept}): {found['last_progress'] or 'no progress line yet'}. Run the same command again to "
            f"resume it.")
    return found, text + "\n\n```\n" + "\n".join(train.tail[-12:]) + "\n```"


def run(out_dir, args):
    from specpilot.tools.bench.engine_bench import SYSTEMS

    ctx = args.ctx
    if args.call_minutes is not None and args.run_dir is None:
        raise ValueError("--call-minutes needs --run-dir: the next call resumes the run kept there")
    head = Path(args.run_dir) if args.run_dir else ctx.scratch / "head"
    resume = ["--resume"] if (head / "run.json").is_file() else []
    chosen = None
    if resume:  # the run's own settings: a resumed run must be the same run
        held = json.loads((head / "run.json").read_text())
        chosen = {"samples": held["samples"], "batch_size": held["batch_size"], "lr": held["lr"]}
    elif args.sized_by:
        chosen = sized(args, json.loads(Path(args.sized_by).read_text()))
    if chosen:
        print(f"train_head: {chosen}", flush=True)
        args.samples, args.batch_size, args.lr = chosen["samples"], chosen["batch_size"], chosen["lr"]
    if args.smoke:
        sizing = ["--samples", 4, "--max-new-tokens", 8, "--steps", 2, "--batch-size", 2, "--draft-vocab", 512]
    else:
        sizing = ["--samples", args.samples, "--max-new-tokens", args.max_new_tokens, "--minutes", args.minutes,
                  "--batch-size", args.batch_size, "--lr", args.lr, "--draft-vocab", args.draft_vocab,
                  "--log-every", args.log_every, "--checkpoint-every", args.checkpoint_every,
                  "--answer-batch", args.answer_batch]
    if args.init:  # a continued head keeps its own draft vocabulary
        i = sizing.index("--draft-vocab")
        del sizing[i: i + 2]
    limit = 60 * (args.call_minutes if args.call_minutes is not None else args.minutes + 6)
    train = ctx.module("train", "specpilot.cli", ["train-drafter", "--target", ctx.target, "--kind", "eagle3",
                                                  "--out", head, "--device", ctx.device, "--lm-head", "target",
                                                  "--seed", args.seed, *(["--init", args.init] if args.init else []),
                                                  *(["--intermediate-size", args.intermediate_size]
                                                    if args.intermediate_size else []),
                                                  *sizing, *resume], timeout=limit)
    if args.call_minutes is not None and not (head / "model.safetensors").is_file():
        return stopped(head, train, bool(resume))
    ctx.need(head / "model.safetensors", train)
    kept = out_dir / "head"
    kept.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(head / name, kept / name)
    # the whole log, less the per-chunk progress lines: where the data's minutes went (phase by phase) is in it
    lines = Path(train.log).read_text().splitlines() if Path(train.log).is_file() else train.tail
    (out_dir / "train_log.txt").write_text("\n".join(
        line for line in lines if not any(k in line for k in ("hidden states:", "answers:"))))
    data = json.loads((head / "data.json").read_text())
    data.pop("dropped", None)
    schedule = json.loads((head / "schedule.json").read_text()) if (head / "schedule.json").is_file() else {}
    found = {"sizing": chosen, "head_sha256": harness.sha256(kept / "model.safetensors"),
             "head_bytes": (kept / "model.safetensors").stat().st_size, "data": data, "schedule": schedule,
             "train_seconds": train.seconds, "train_tail": train.tail[-12:]}
    text = [f"Head: {found['head_bytes']:,} bytes, sha256 {found['head_sha256']}; train-drafter "
            f"{train.seconds:.0f} s; data {json.dumps(data)}; schedule {json.dumps(schedule)}",
            "```\n" + "\n".join(train.tail[-12:]) + "\n```"]
    if not args.no_bench:
        workloads, limit, tokens = harness.smoke_sized(args, args.bench_workloads, args.bench_limit, 128)
        recipes = [ctx.recipe(name, SYSTEMS[name]) for name in (FASTEST_AR, "ngram2-k4-adaptive-armiss-fused-overlap")]
        recipes += [ctx.recipe(name, fields) for name, fields in head_recipes(str(head)).items()]
        if args.init:  # the head it continued, beside it
            recipes.append(ctx.recipe("init-k2-fused-overlap", head_recipes(args.init)["eagle3-k2-fused-overlap"]))
        bench = harness.bench_b1(ctx, recipes, workloads, limit, tokens, timeout=240)
        found["bench"] = bench
        text.append("## B = 1, 128 new tokens\n\n" + harness.bench_table(bench, FASTEST_AR))
        if args.bench_batch:
            batched = bench_batched(ctx, args, str(head), workloads, limit, tokens)
            found["bench_batched"] = batched
            text.append(f"## B = {args.bench_batch}, 128 new tokens, continuously batched\n\n"
                        + harness.bench_table(batched, FASTEST_AR))
    return found, "\n\n".join(text)


def bench_batched(ctx, args, head: str, workloads: list[str], limit: int, tokens: int) -> dict:
    """`specpilot bench` at B = --bench-batch: our fastest AR, the head's chain of 3 under the batch controller, and
    with --init HEAD's (batch_sweep's cells: 8 requests, at least 4 waves of B)."""
    from specpilot.tools.bench.engine_bench import SYSTEMS

    controlled = SYSTEMS["eagle3-k3-cost-fused-overlap"]
    heads = {"eagle3-k3-cost-fused-overlap": head, **({"init-k3-cost-fused-overlap": args.init} if args.init else {})}
    argv = ["--workload", ",".join(workloads), "--batch-sizes", args.bench_batch, "--max-new-tokens", tokens,
            "--limit", max(limit, args.bench_batch), "--cell-requests", 1 if args.smoke else 8,
            "--waves", 1 if args.smoke else 4, "--baselines", "none",
            "--recipe", ctx.recipe(FASTEST_AR, SYSTEMS[FASTEST_AR])]
    for name, path in heads.items():
        argv += ["--recipe", ctx.recipe(name, {**controlled, "drafter": {**controlled["drafter"], "model": path}})]
    return harness.specpilot_bench(ctx, "bench_batched", argv, timeout=420)
