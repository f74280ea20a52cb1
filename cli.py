"""The `specpilot` command. Each subcommand parses its flags and calls into the package; errors become one line."""
from __future__ import annotations

import argparse
import json
import sys
import time

from .engine.errors import SpecPilotError
from .memory.cli import add_memory_parser
from .tools.argtypes import (DTYPE_HELP, add_device_arguments, add_target_argument, non_negative_float,
                              non_negative_int, positive_float, positive_int, positive_int_list, probability,
                              replay_profile)


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def add_target_args(p: argparse.ArgumentParser) -> None:
    add_target_argument(p, default="smollm2-135m")
    p.add_argument("--recipe", default="stock", help="ar, stock, or a recipe JSON file")
    add_device_arguments(p)


def add_workload_args(p: argparse.ArgumentParser, limit_help: str) -> None:
    p.add_argument("--workload", default="code", help="code, chat, math, summarize, rag, FILE.jsonl[:category]")
    p.add_argument("--limit", type=positive_int, default=None, help=limit_help)
    p.add_argument("--max-new-tokens", type=positive_int, default=64)


def cmd_generate(args) -> int:
    from .engine import loader
    from .engine.engine import Engine
    from .engine.recipe import load_recipe
    from .engine.sampling import SamplingParams

    recipe = load_recipe(args.recipe, args.target)
    device = args.device or _default_device()
    target = loader.load(args.target, args.dtype or ("bf16" if device.startswith("cuda") else "fp32"), device)
    engine = Engine(target, recipe)
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p)
    prompt = engine.encode(args.prompt, chat=not args.raw)
    [row] = engine.generate([prompt], args.max_new_tokens, sampling, tuple(args.stop), args.seed)
    stats = engine.decoder.last_stats
    elapsed = stats.prefill_s + stats.decode_s
    if args.json:
        print(json.dumps({
            "recipe": recipe.name, "target": args.target, "device": device, "prompt_tokens": len(prompt),
            "tokens": row.tokens, "text": row.text, "finish_reason": row.finish_reason,
            "tokens_per_s": len(row.tokens) / elapsed if elapsed > 0 else None,
            "mean_accepted": row.mean_accepted, "target_steps": stats.steps + 1,
            "time_to_first_token_s": stats.prefill_s, "seconds": elapsed,
        }))
    else:
        print(row.text)
    return 0


def cmd_bench(args) -> int:
    from .tools.bench.run import run_bench
    from .tools.sandbox import process as sandbox

    return run_bench(args, sandbox=sandbox)  # a recipe naming candidate kernel files is benched in the sandbox


def add_bench_parser(sub) -> None:
    from .tools.bench.run import add_arguments

    b = sub.add_parser("bench", help="measure recipes side by side with the same engine's AR (and HF baselines)",
                       description="Measure ar, stock, each --recipe and optional HF baselines side by side on "
                                   "the same prompts; write DIR/results.json, DIR/report.md and plots.")
    add_arguments(b)
    b.set_defaults(func=cmd_bench)


def cmd_grid(args) -> int:
    from .tools.grid.run import run_grid
    from .tools.sandbox import process as sandbox

    args.device = args.device or _default_device()
    return run_grid(args, sandbox=sandbox)  # handed on to the bench: a recipe naming candidate kernel files


def add_grid_parser(sub) -> None:
    from .tools.grid.space import MAX_COMBINATIONS, shipped_grids

    shipped = ", ".join(shipped_grids())
    g = sub.add_parser("grid", help="expand a space of recipes, gate each, bench the passing ones side by side",
                       description=f"Expand the recipes of a space file (or a shipped grid: {shipped}), put each "
                                   "through the token-forcing gate, and measure every passing recipe in one bench "
                                   "run with ar, stock and ar-fused-overlap, our fastest AR (the reference). "
                                   "Writes DIR/results.json, DIR/report.md, DIR/best.json, a plot, DIR/recipes/, "
                                   "DIR/gate/ and DIR/bench/ (docs/GRID.md).")
    add_target_argument(g, default="smollm2-135m")
    g.add_argument("--workload", default="code",
                   help="comma-separated: code, chat, math, summarize, rag, FILE.jsonl or FILE.jsonl:category")
    g.add_argument("--space", required=True, help=f"space JSON file, or a shipped grid's name ({shipped})")
    g.add_argument("--out", required=True, help="output directory")
    g.add_argument("--batch-sizes", type=positive_int_list, default=[1], help="comma-separated, e.g. 1,8")
    g.add_argument("--limit", type=positive_int, default=None, help="first K questions of each workload (bench)")
    g.add_argument("--max-new-tokens", type=positive_int, default=128, help="tokens a request in the bench")
    g.add_argument("--repeats", type=positive_int, default=2,
                   help="times the bench measures each timed call (median kept)")
    g.add_argument("--max-recipes", type=positive_int, default=64,
                   help=f"refuse a space that expands to more recipes (and any past {MAX_COMBINATIONS} "
                        "combinations)")
    g.add_argument("--no-gate", action="store_true", help="measure without the token-forcing gate (said in the report)")
    g.add_argument("--gate-limit", type=positive_int, default=2, help="prompts of each workload the gate checks")
    g.add_argument("--gate-tokens", type=positive_int, default=64, help="tokens a prompt the gate checks")
    g.add_argument("--gate-timeout", type=positive_float, default=600.0,
                   help="seconds the gate waits on one recipe's candidate in all")
    g.add_argument("--gate-workers", type=positive_int, default=1,
                   help="recipes gated at once, each its own candidate process (several can share a GPU)")
    add_device_arguments(g)
    g.set_defaults(func=cmd_grid)


def cmd_calibrate(args) -> int:
    from .tools.profile.calibrate import cache_path, describe, load_or_measure

    ceilings = load_or_measure(args.device or _default_device(), args.force)
    print(describe(ceilings))
    print(f"cached in {cache_path(ceilings.name)}")
    return 0


def cmd_profile(args) -> int:
    import time

    from .tools.profile.profiler import profile
    from .tools.sandbox import process as sandbox

    out = args.out or f"runs/profile-{time.strftime('%Y%m%d-%H%M%S')}"
    # a recipe naming candidate kernel files is profiled in the sandbox
    result = profile(args.target, args.recipe, args.workload, args.limit, args.max_new_tokens, args.batch_size,
                     args.device or _default_device(), args.dtype, out, repeats=args.repeats, sandbox=sandbox)
    print(json.dumps(result.to_dict(), default=str) if args.json else result.table())
    print(f"wrote {out}/profile.json", file=sys.stderr)
    return 0


def add_costmodel_parsers(sub) -> None:
    c = sub.add_parser("calibrate", help="measure the device's ceilings for the cost model (cached per device)",
                       description="Measure copy bandwidth, matmul FLOP/s, kernel launch and CUDA-graph node "
                                   "overhead; cache them under $SPECPILOT_CACHE/calibration/.")
    add_device_arguments(c, dtype_help=None)
    c.add_argument("--force", action="store_true", help="measure again even when cached")
    c.set_defaults(func=cmd_calibrate)
    p = sub.add_parser("profile", help="time a recipe's step phases against their floors; ranked gaps per agent",
                       description="Measure step phases, top kernels and acceptance of a target under a recipe, "
                                   "compare them with the cost model's floors and write DIR/profile.json with the "
                                   "gaps ranked by end-to-end gain. The cost model's GPU validation table: "
                                   "python -m specpilot.tools.profile.costmodel_validate")
    add_target_args(p)
    add_workload_args(p, "questions to decode (default: one batch)")
    p.add_argument("--batch-size", type=positive_int, default=1)
    p.add_argument("--repeats", type=positive_int, default=2,
                   help="interleaved timed runs; the fastest of each is kept")
    p.add_argument("--out", default=None, help="output directory (default: runs/profile-<timestamp>)")
    p.add_argument("--json", action="store_true", help="print the profile JSON instead of the table")
    p.set_defaults(func=cmd_profile)


def cmd_check(args) -> int:
    from pathlib import Path

    from .engine.errors import SpecPilotError
    from .tools.gate.check import check

    device = args.device or _default_device()
    try:
        report = check(args.target, args.recipe, args.workload, args.limit, args.max_new_tokens, device,
                       args.dtype or ("bf16" if device.startswith("cuda") else "fp32"), Path(args.out),
                       salt=args.salt, patch=args.patch, batch_size=args.batch_size, timeout_s=args.timeout,
                       cache_dir=Path(args.cache_dir) if args.cache_dir else None)
    except SpecPilotError:
        raise
    except Exception as e:  # the gate itself failed: exit 2 (no verdict), never 1, which means "the candidate failed"
        raise SpecPilotError(f"check could not run: {type(e).__name__}: {e}") from e
    print(report.summary())
    return 0 if report.passed else 1


def add_check_parser(sub) -> None:
    c = sub.add_parser("check", help="token-forcing gate: does a recipe give the stock system's greedy tokens?",
                       description="Compare a candidate recipe's greedy tokens with the stock system's (same engine, "
                                   "AR, same dtype and device) on salted prompts, forcing the reference token at "
                                   "numerical ties. Exit 0 pass, 1 fail, 2 error. Writes DIR/report.json and "
                                   "DIR/summary.txt (docs/GATE.md).")
    add_target_args(c)
    add_workload_args(c, "first K questions")
    c.add_argument("--salt", default=None, help="nonce in the prompts' system turn (default: a fresh one)")
    c.add_argument("--patch", default=None, help="Python file the candidate process runs before decoding")
    c.add_argument("--batch-size", type=positive_int, default=None, help="overrides the recipe's batch.max_batch_size")
    c.add_argument("--timeout", type=positive_float, default=600.0,
                   help="seconds the gate waits on the candidate in all")
    c.add_argument("--cache-dir", default=None, help="reference cache (default: $SPECPILOT_CACHE/gate)")
    c.add_argument("--out", required=True, help="output directory for report.json and summary.txt")
    c.set_defaults(func=cmd_check)


def cmd_optimize(args) -> int:
    from .graph.run import optimize

    keys = ("target", "workload", "device", "dtype", "batch_size", "max_new_tokens", "limit", "budget_rounds",
            "budget_minutes", "budget_gpu_minutes", "provider", "model", "base_url", "memory", "interactive",
            "max_candidates", "salt", "heads")
    replay = args.acceptance or {}  # (argtypes.replay_profile)
    return optimize({k: getattr(args, k) for k in keys} | {"out_dir": args.out, "acceptance": replay.get("acceptance"),
                                                           "acceptance_ranks": replay.get("ranks") or None})


def cmd_resume(args) -> int:
    from .graph.run import resume

    return resume(args.dir)


def cmd_history(args) -> int:
    from .graph.run import history

    return history(args.dir)


def add_optimize_parsers(sub) -> None:
    from .graph.state import DEFAULTS as D

    o = sub.add_parser("optimize", help="the agent graph: profile, route, propose, gate, measure, keep the best",
                       description="Optimize a deployment's speculative decoding with the agent graph: each round "
                                   "profiles the best recipe, routes its gaps to agents, gates and measures their "
                                   "candidates, and keeps the fastest recipe that passes the token-forcing gate. "
                                   "Writes DIR/recipe.json, DIR/report.md, DIR/progress.png, DIR/candidates/; "
                                   "checkpointed for `specpilot resume DIR` (docs/AGENTS.md).")
    add_target_argument(o, default=D["target"])
    o.add_argument("--workload", default=D["workload"], help="code, chat, math, summarize, rag, FILE.jsonl[:category]")
    o.add_argument("--provider", default=D["provider"], help="policy (deterministic, offline) or openai")
    o.add_argument("--model", default=None, help="the openai provider's model")
    o.add_argument("--base-url", default=None, help="an OpenAI-compatible endpoint (vLLM, Ollama, llama.cpp, ...)")
    o.add_argument("--budget-rounds", type=positive_int, default=D["budget_rounds"])
    o.add_argument("--budget-minutes", type=positive_float, default=D["budget_minutes"], help="wall minutes of work")
    o.add_argument("--budget-gpu-minutes", type=positive_float, default=D["budget_gpu_minutes"],
                   help="minutes the measurements hold the device (on a CPU, the CPU)")
    o.add_argument("--batch-size", type=positive_int, default=D["batch_size"], help="the deployment's batch size")
    add_device_arguments(o)
    o.add_argument("--max-new-tokens", type=positive_int, default=D["max_new_tokens"])
    o.add_argument("--limit", type=positive_int, default=D["limit"],
                   help="prompts of the workload (at least the batch size)")
    o.add_argument("--max-candidates", type=positive_int, default=D["max_candidates"],
                   help="candidates per agent per round")
    o.add_argument("--memory", default=None,
                   help="memory: a Chroma store directory, FILE.jsonl (a plain JSON-lines file: no chromadb needed), "
                        "or http://HOST:PORT of a Chroma server (default: $SPECPILOT_MEMORY or "
                        "~/.local/share/specpilot/memory)")
    o.add_argument("--salt", default=None, help="the gate's prompt nonce for the run (default: a fresh one)")
    o.add_argument("--head", action="append", dest="heads", default=None, metavar="DIR",
                   help="an EAGLE-3 head for the target (repeatable): the algorithm agent may draft with it")
    o.add_argument("--acceptance", type=replay_profile, default=None, metavar="A1,A2,...|FILE|HEAD",
                   help="with a synthetic target (random weights, whose text no drafter can predict): the acceptance "
                        "your drafter reaches, a_i the share of steps that accept at least i drafts (as the bench "
                        "reports a real drafter's); the algorithm agent then drafts by replaying it at an EAGLE-3 "
                        "head's cost. FILE: a JSON of {\"acceptance\": [...], \"ranks\": [[...], ...]} (ranks: per "
                        "depth, the chances the target's token is the drafter's 2nd, 3rd, ... candidate; the "
                        "head_ranks experiment's output is one): static trees are proposed too. HEAD: a packaged "
                        "head's measured profile (smollm2-135m-eagle3)")
    o.add_argument("--interactive", action="store_true",
                   help="stop at each decision: [a]pprove [e]dit [s]kip [r]edirect [q]stop")
    o.add_argument("--out", default=None, help="run directory (default: runs/optimize-<timestamp>)")
    o.set_defaults(func=cmd_optimize)
    r = sub.add_parser("resume", help="continue a stopped or killed optimize run",
                       description="Continue the optimize run in DIR from its last checkpoint; finished evaluations "
                                   "are not redone.")
    r.add_argument("dir")
    r.set_defaults(func=cmd_resume)
    h = sub.add_parser("history", help="print an optimize run's decisions from its checkpoints")
    h.add_argument("dir")
    h.set_defaults(func=cmd_history)


def cmd_train_drafter(args) -> int:
    from .tools.train.run import Settings, train_drafter

    device = args.device or _default_device()
    settings = Settings(target=args.target, kind=args.kind, prompts=args.prompts, samples=args.samples,
                        max_new_tokens=args.max_new_tokens, draft_vocab=args.draft_vocab,
                        steps=2000 if args.steps is None and args.minutes is None else args.steps,
                        ttt_steps=args.ttt_steps, lr=args.lr, batch_size=args.batch_size, seed=args.seed,
                        device=device, dtype=args.dtype or ("bf16" if device.startswith("cuda") else "fp32"),
                        checkpoint_every=args.checkpoint_every, log_every=args.log_every, minutes=args.minutes,
                        lm_head=args.lm_head, prompt_mix=args.prompt_mix, answer_batch=args.answer_batch,
                        init=args.init, intermediate_size=args.intermediate_size)
    started = time.perf_counter()  # each line says when: where a long build's minutes go
    train_drafter(settings, args.out, resume=args.resume,
                  say=lambda line: print(f"[{time.perf_counter() - started:6.1f} s] {line}", flush=True))
    return 0


def add_train_parser(sub) -> None:
    t = sub.add_parser("train-drafter", help="train an EAGLE-3 head for a target from the target alone",
                       description="Build training data from the target itself (prompts from --prompts or written "
                                   "by the target from its chat template; its own greedy and sampled answers and "
                                   "hidden states), never from a benchmarked prompt, and train an EAGLE-3 head with "
                                   "the training-time test. Writes DIR/config.json and DIR/model.safetensors, "
                                   "loadable as drafter {\"kind\": \"eagle3\", \"model\": DIR} "
                                   "(docs/TRAINING.md).")
    add_target_argument(t, default="smollm2-135m")
    t.add_argument("--kind", default="eagle3", choices=["eagle3"], help="the drafter to train")
    t.add_argument("--out", required=True, help="output directory (empty or new; with --resume, the run's)")
    t.add_argument("--prompts", default=None,
                   help='JSONL of {"turns": [...]} or {"prompt": ...} (default: the target writes its own)')
    t.add_argument("--prompt-mix", default="tasks", choices=["chat", "tasks"],
                   help="what the target writes without --prompts: chat, open user requests from its bare "
                        "user-turn prefix (Magpie); tasks (default), equal shares of open chat and of user turns "
                        "the target continues from a generic task opener: a Python function to write, a math word "
                        "problem, a text to summarize, a passage with a question (generic framings the target "
                        "fills, never benchmark text; all filtered as any prompt)")
    t.add_argument("--samples", type=positive_int, default=256,
                   help="prompts to use; each gives a greedy and a sampled answer")
    t.add_argument("--max-new-tokens", type=positive_int, default=256, help="longest answer")
    t.add_argument("--answer-batch", type=positive_int, default=256,
                   help="rows decoded at once while the target writes prompts and answers (its K/V cache grows "
                        "with it)")
    t.add_argument("--draft-vocab", type=positive_int, default=None,
                   help="draft vocabulary size (default: min(8192, the target's vocabulary))")
    length = t.add_mutually_exclusive_group()
    length.add_argument("--steps", type=positive_int, default=None,
                        help="optimizer steps (default 2000, unless --minutes)")
    length.add_argument("--minutes", type=positive_float, default=None,
                        help="train for about M minutes instead of --steps: once the data is built, a few steps "
                             "are timed and the step count set to fit M minutes of training (evaluations and "
                             "checkpoints included; building the data is NOT counted); written to "
                             "DIR/schedule.json, which --resume keeps")
    t.add_argument("--ttt-steps", type=positive_int, default=7, help="training-time-test unroll length")
    t.add_argument("--init", default=None, metavar="HEAD",
                   help="continue a trained EAGLE-3 head of this target (a directory or an alias, e.g. "
                        "smollm2-135m-eagle3) on this run's data: its weights and draft vocabulary instead of a "
                        "fresh draw (the optimizer and its schedule start anew); run.json records its sha256")
    t.add_argument("--intermediate-size", type=positive_int, default=None, metavar="N",
                   help="the head's MLP width (default: the target layer's; with --init, that head's): a wider head "
                        "within the package's 16 MB")
    t.add_argument("--lm-head", default="trained", choices=["trained", "target"],
                   help="trained: the head's own LM head (starting from the target's rows of the draft vocabulary), "
                        "trained and exported; target: those rows frozen and not exported (EAGLE-1/2 style; about "
                        "half the file for a small target; SpecPilot's loader takes the target's rows back)")
    # 32 samples a step at 4e-4: on the H200 a step of 32 took what one of 16 did (twenty-third lease, A), and the
    # packaged head was trained so (docs/TRAINING.md)
    t.add_argument("--lr", type=positive_float, default=4e-4)
    t.add_argument("--batch-size", type=positive_int, default=32, help="samples per optimizer step")
    t.add_argument("--seed", type=non_negative_int, default=0)
    t.add_argument("--checkpoint-every", type=positive_int, default=200, help="steps between checkpoints")
    t.add_argument("--log-every", type=positive_int, default=50, help="steps between progress lines")
    add_device_arguments(t, dtype_help=f"the target's: {DTYPE_HELP}; the head trains in fp32 and is written in "
                                       "this dtype")
    t.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    t.set_defaults(func=cmd_train_drafter)


class Parser(argparse.ArgumentParser):
    """argparse with a bad argument reported like every other bad input: one line `specpilot: error: ...` and exit
    code 2 (argparse's usage block would bury the line that says what is wrong). Subcommands' parsers are built
    from this class too (add_subparsers uses the parent's class)."""

    def error(self, message: str):
        self.exit(2, f"specpilot: error: {one_line(message)} (see `{self.prog} --help`)\n")


def one_line(message) -> str:
    return " ".join(str(message).split())


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="specpilot", description=__doc__)
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt with a recipe")
    add_target_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=positive_int, default=128)
    g.add_argument("--temperature", type=non_negative_float, default=0.0, help="0: greedy")
    g.add_argument("--top-k", type=non_negative_int, default=0, help="0: no top-k cut")
    g.add_argument("--top-p", type=probability, default=1.0, help="nucleus mass in (0, 1]; 1: no cut")
    g.add_argument("--seed", type=non_negative_int, default=0)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.set_defaults(func=cmd_generate)
    add_bench_parser(sub)
    add_grid_parser(sub)
    add_costmodel_parsers(sub)
    add_check_parser(sub)
    add_optimize_parsers(sub)
    add_memory_parser(sub)
    add_train_parser(sub)
    return parser


# Errors that mean "what was typed cannot be used": a flag's value, a recipe, workload, target or file. All exit 2,
# as argparse's own errors do; `check` keeps 1 for its verdict "the candidate failed the gate".
BAD_INPUT = (SpecPilotError, ValueError, FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)


def main(argv: list[str] | None = None) -> int:
    argv = list(argv) if argv is not None else sys.argv[1:]
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # a bad argument (2, the line is printed) or --help (0): returned like any other exit
        return e.code if isinstance(e.code, int) else 2
    args.argv = argv  # recorded by bench in its results header
    if "--debug" in argv:
        args.debug = True
    try:
        return args.func(args)
    except BAD_INPUT as e:
        if args.debug:
            raise
        print(f"specpilot: error: {one_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
