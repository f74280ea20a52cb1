"""Token identity at B = 1, for the H200 scripts: each configuration decodes 2 code and 2 summarization prompts, in
fp32 against our modular AR (every configuration must give its tokens) and in bf16 against a reference
configuration (the fused AR: verification on the fused layer's FMA path must give its tokens bit for bit). Prints,
per dtype and configuration, how many prompts are identical, the first differing position of each, and τ.

    python tools/h200/token_identity.py '{"ngram-k4-fused": {"drafter": {"kind": "ngram"}, "k": 4, "layer": "fused"}}'

Configurations are recipe fields by name; a name's first word is the recipe's name (the rest may say more).
"""
from __future__ import annotations

import argparse
import json

from specpilot.engine import loader
from specpilot.engine.engine import Engine
from specpilot.engine.recipe import parse
from specpilot.engine.workloads import load_workload


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("configs", help="JSON object: name -> recipe fields")
    ap.add_argument("--target", default="/tmp/smollm2/model.gguf")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=192, help="new tokens a prompt")
    ap.add_argument("--bf16-reference", default="ar-fused", help="the configuration bf16 tokens are compared with")
    args = ap.parse_args(argv)
    configs = json.loads(args.configs)
    for dtype, ref_name in (("fp32", "ar"), ("bf16", args.bf16_reference)):
        target = loader.load(args.target, dtype, args.device)
        engines = {"ar": Engine(target, parse({"name": "ar"}))}
        engines.update({n: Engine(target, parse({"name": n.split()[0], **f})) for n, f in configs.items()})
        questions = load_workload("code", 2) + load_workload("summarize", 2)
        prompts = [engines["ar"].encode(q.turns[0]) for q in questions]
        out = {n: [e.generate([p], args.tokens, ignore_eos=True)[0] for p in prompts] for n, e in engines.items()}
        ref = [r.tokens for r in out[ref_name]]
        for n, rows in out.items():
            same = [r.tokens == t for r, t in zip(rows, ref)]
            first = [next((i for i, (a, b) in enumerate(zip(r.tokens, t)) if a != b), None) for r, t in zip(rows, ref)]
            print(f"{dtype} {n:30s} = {ref_name}: {sum(same)}/{len(same)} first diff {first} "
                  f"tau {[round(r.mean_accepted, 2) for r in rows]}", flush=True)


if __name__ == "__main__":
    main()
