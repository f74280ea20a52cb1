"""The `specpilot` command. Each subcommand parses its flags and calls into the package; errors become one line."""
from __future__ import annotations

import argparse
import json
import sys


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="smollm2-135m", help="alias, GGUF file, model directory or cached hub id")
    p.add_argument("--recipe", default="stock", help="ar, stock, or a recipe JSON file")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, help="fp32, bf16 or fp16 (default: bf16 on cuda, fp32 on cpu)")


def cmd_generate(args) -> int:
    from .engine import loader
    from .engine.engine import Engine
    from .engine.recipe import load_recipe
    from .engine.sampling import SamplingParams

    recipe = load_recipe(args.recipe)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specpilot", description=__doc__)
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt with a recipe")
    add_target_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    from .engine.errors import SpecPilotError

    parser = build_parser()
    args = parser.parse_args(argv)
    if "--debug" in (argv if argv is not None else sys.argv[1:]):
        args.debug = True
    try:
        return args.func(args)
    except (SpecPilotError, ValueError, FileNotFoundError) as e:
        if args.debug:
            raise
        print(f"specpilot: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, SpecPilotError) else 1


if __name__ == "__main__":
    sys.exit(main())
