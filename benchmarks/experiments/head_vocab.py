"""What the packaged EAGLE-3 head's draft vocabulary costs its acceptance, by workload: computed, on the CPU.

What it measures (issue #22: τ ≥ 3.5 needs a head that agrees with the target far more often than it does). A head
drafts only its draft vocabulary's ids (the packaged one: the 8,192 ids its training answers used most, of
SmolLM2's 49,152), so a target token outside it can never be drafted. Here, on `--workloads`' prompts (the first
`--limit` of each, their first turns): the target's greedy answer of `--max-new-tokens` (AR, the modular layer, fp32,
no graphs), then one target forward over prompt + answer (the states the head reads, as train-drafter captures them),
and for each answer position

- coverage: whether the target's greedy next token is in the head's draft vocabulary (what the vocabulary allows);
- the head's first draft, teacher-forced (the trainer's held-out acceptance: step 0 on the target's own states),
  equal to that token, with the shipped vocabulary and with wider ones (`--widths`): the same head, its LM head the
  target's rows of the shipped ids and of the lowest others (BPE merges the commonest pairs first), up to the whole
  vocabulary. The head was trained on its vocabulary alone, so a wider one shows what it would draft of the others
  untrained, not what a head trained on them would.

Acceptance is a count, not a time: any machine gives the same figures for the same fp32 computation (up to
summation order). CPU = True.

Backs docs/BENCHMARKS.md's line on the head's acceptance by workload (forty-ninth session).

Device minutes: none (CPU: about a minute for the default 12 prompts of three workloads).
"""
from __future__ import annotations

import copy
import time

import harness

MINUTES = 0
CPU = True
HEAD = "smollm2-135m-eagle3"


def arguments(p) -> None:
    p.add_argument("--workloads", default="code,chat,summarize")
    p.add_argument("--limit", type=int, default=12, help="prompts a workload")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--widths", default="16384,32768,0", help="wider draft vocabularies (0: the whole vocabulary)")
    p.add_argument("--head", default=HEAD, help="an alias or a directory")


def widened(head, target_lm_head, width: int):
    """`head` drafting from `width` ids (at least its own): its own ids and the lowest others, its LM head the
    target's rows of them (a shallow copy: its other weights shared)."""
    import torch

    own = head.draft_to_target.cpu()
    vocab = target_lm_head.shape[0]
    if width <= 0 or width >= vocab:
        ids = torch.arange(vocab)
    else:
        taken = torch.zeros(vocab, dtype=torch.bool)
        taken[own] = True
        others = (~taken).nonzero().flatten()[: max(0, width - own.numel())]
        ids = torch.cat([own, others]).sort().values
    wide = copy.copy(head)
    wide.draft_to_target = ids.to(head.device)
    wide.lm_head = target_lm_head.detach()[ids.to(target_lm_head.device)].contiguous()
    return wide


def coverage(draft_ids, vocab_size: int, samples) -> float:
    """The share of answer positions whose target greedy token is among `draft_ids`: the greedy token after each
    token from the prompt's last to the answer's second last, as `first_draft_acceptance` counts them."""
    import torch

    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[draft_ids.cpu()] = True
    hits = total = 0
    for s in samples:
        following = s.greedy[s.prompt_len - 1: -1]
        hits, total = hits + int(inside[following].sum()), total + following.numel()
    return hits / max(total, 1)


def run(out_dir, args):
    from specpilot.engine.eagle3 import Eagle3Head
    from specpilot.engine.engine import Engine
    from specpilot.engine.loader import load, source_dir
    from specpilot.engine.recipe import parse
    from specpilot.engine.workloads import load_workload
    from specpilot.tools.train.data import capture_group
    from specpilot.tools.train.trainer import first_draft_acceptance

    workloads, limit, tokens = harness.smoke_sized(args, args.workloads, args.limit, args.max_new_tokens)
    widths = [int(w) for w in args.widths.split(",") if w.strip()]
    loaded = load(args.ctx.target, "fp32", "cpu")
    model = loaded.model
    head = Eagle3Head(source_dir(args.head), model)
    heads = {f"{head.cfg.draft_vocab_size} (shipped)": head}
    for w in widths:
        heads[str(w or model.cfg.vocab_size)] = widened(head, model.lm_head, w)
    ar = Engine(loaded, parse({"name": "ar", "layer": "modular", "cuda_graphs": False, "compile": False}))
    found, rows = {}, []
    for wl in workloads:
        t0 = time.perf_counter()
        prompts = [ar.encode(q.turns[0]) for q in load_workload(wl, limit)]
        answers = [r.tokens for r in ar.generate(prompts, tokens, max_batch=4)]
        pairs = list(zip(prompts, answers))
        samples = [s for i in range(0, len(pairs), 4)
                   for s in capture_group(model, pairs[i: i + 4], head.cfg.aux_layers)]
        result = {"prompts": len(samples), "positions": sum(len(a) for a in answers),
                  "coverage": coverage(head.draft_to_target, model.cfg.vocab_size, samples),
                  "acceptance": {name: first_draft_acceptance(h, samples, 4) for name, h in heads.items()},
                  "seconds": round(time.perf_counter() - t0, 1)}
        found[wl] = result
        rows.append([wl, result["prompts"], result["positions"], f"{result['coverage']:.3f}"]
                    + [f"{a:.3f}" for a in result["acceptance"].values()])
    table = ("The head's first draft (teacher-forced) equal to the target's greedy next token, by draft vocabulary "
             "(ids), and the share of those tokens the shipped vocabulary holds:\n\n"
             + harness.md_table(["workload", "prompts", "answer positions", "in the shipped vocabulary"]
                                + [f"acceptance, {name}" for name in heads], rows))
    return {"head": args.head, "max_new_tokens": tokens, "workloads": found}, table
