"""The candidate's side of the gate: a process that decodes what it is asked to with the recipe under test.

    python -m specpilot.tools.sandbox.candidate_worker --target T --recipe R --dtype D --device DEV [--patch FILE] [--batch-size B]

It loads the target and the recipe, runs the patch file if one is given (untrusted code: tests' deliberately broken
candidates, agents' changes), builds the engine, then answers JSON lines on stdin, one line each on stdout:

    in:  {"id": 0, "prompts": [[token ids], ...], "max_new_tokens": 64}
    out: {"id": 0, "tokens": [[token ids], ...], "finish_reasons": ["eos" | "length" | ...]}

Prompts are decoded in order, in batches of the recipe's batch size. If the target or the recipe cannot be built it
writes {"error": "..."} and exits with 3. stdout carries the protocol only: file descriptor 1 is pointed at stderr
before anything else runs, and the protocol is written to a private duplicate of the original stdout.
The gate normally forks this worker from a fork server that has torch and transformers imported already
(tools/sandbox/candidate_forkserver.py calls `main` in the forked child, with pipes as stdin and stdout).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

STARTUP_ERROR = 3


def _claim_stdout():
    """A private handle on the real stdout; anything else printed (Python or C level) goes to stderr."""
    fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return os.fdopen(fd, "w", buffering=1)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="candidate_worker")
    ap.add_argument("--target", required=True)
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--patch", default=None, help="Python file executed in this process before the engine is built")
    ap.add_argument("--batch-size", type=int, default=None, help="overrides the recipe's batch.max_batch_size")
    return ap.parse_args(argv)


def serve(engine, lines, out) -> None:
    for line in lines:
        if not line.strip():
            continue
        job = json.loads(line)
        rows = engine.generate([list(p) for p in job["prompts"]], int(job["max_new_tokens"]))
        out.write(json.dumps({"id": job["id"], "tokens": [r.tokens for r in rows],
                              "finish_reasons": [r.finish_reason for r in rows]}) + "\n")
        out.flush()


def run(args: argparse.Namespace, lines, out) -> int:
    """Load, patch, build, then answer jobs from `lines` on `out` until the input ends; the exit status."""
    from ...engine import loader
    from ...engine.engine import Engine
    from ...engine.errors import SpecPilotError
    from ...engine.recipe import load_recipe

    try:
        target = loader.load(args.target, args.dtype, args.device)
        recipe = load_recipe(args.recipe, args.target)
        if args.batch_size is not None:
            recipe.batch.max_batch_size = args.batch_size
    except SpecPilotError as e:
        out.write(json.dumps({"error": str(e)}) + "\n")
        return STARTUP_ERROR
    if args.patch:
        import runpy

        runpy.run_path(args.patch, run_name="__candidate_patch__")
    try:
        engine = Engine(target, recipe)  # after the patch: kernels are resolved here, from the (patched) registry
    except SpecPilotError as e:
        out.write(json.dumps({"error": str(e)}) + "\n")
        return STARTUP_ERROR
    serve(engine, lines, out)
    return 0


def main(argv=None) -> int:
    proto = _claim_stdout()
    return run(parse_args(argv), sys.stdin, proto)


if __name__ == "__main__":
    sys.exit(main())
