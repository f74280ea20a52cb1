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
  untrained, not what a head trained on them would;
- with prompt lookup beside the head (`--lookup n`, the recipe's `drafter.lookup`): where the context so far ends in
  n to 6 tokens that occurred before, the token that followed them instead of the head's draft: the positions where
  lookup matched, how often its token and the head's were right there, and the first draft's agreement with lookup
  taking the matched positions (the engine asks for a whole chain after the match; a first draft, for one token);
- a chain's τ (`--chain k`): at each answer position with k tokens after it, the tokens a verification step of the
  head's k-draft chain would emit (1 + the drafts that match the answer's next tokens up to the first that does not;
  the head unrolled on the answer's tokens, as the trainer's test unrolls it: where its drafts were right, its own),
  alone, with prompt lookup's whole chain where it found one, with lookup's tokens (however many it found) as the
  chain's first drafts and the head's after them, and (`--lookup-k L`) with lookup copying up to L where it found at
  least k (`drafter.head_k`). Every position counts once: a mean over positions,
  not a decode's sequence of steps.

Acceptance is a count, not a time: any machine gives the same figures for the same fp32 computation (up to
summation order). CPU = True.

Backs docs/BENCHMARKS.md's line on the head's acceptance by workload (forty-ninth session).

Device minutes: none (CPU: about five minutes for the default 12 prompts of four workloads).
"""
from __future__ import annotations

import copy
import time

import harness

MINUTES = 0
CPU = True
HEAD = "smollm2-135m-eagle3"


def arguments(p) -> None:
    p.add_argument("--workloads", default="code,chat,summarize,rag")
    p.add_argument("--limit", type=int, default=12, help="prompts a workload")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--widths", default="16384,32768,0", help="wider draft vocabularies (0: the whole vocabulary)")
    p.add_argument("--head", default=HEAD, help="an alias or a directory")
    p.add_argument("--lookup", type=int, default=3, help="prompt lookup's shortest tail (drafter.lookup; 0: none)")
    p.add_argument("--chain", type=int, default=3, help="a chain's drafts for its τ (0: none)")
    p.add_argument("--lookup-k", type=int, default=0,
                   help="with --chain: lookup's copied chain up to this many drafts, the head's --chain (0: none)")


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


def with_lookup(samples, drafts, shortest: int) -> dict:
    """The head's first drafts `drafts` (trainer.first_drafts) against prompt lookup's at the same positions:
    matched (share of positions where the context's last `shortest`-6 tokens occurred before), lookup_right and
    head_right (on those positions), acceptance (lookup's token where it matched, else the head's), and by_length:
    per length of the longest tail that matched, [positions, lookup right, head right]."""
    import torch

    from specpilot.engine.drafters import NgramDrafter
    from specpilot.engine.recipe import LOOKUP_MAX_NGRAM

    lengths = range(LOOKUP_MAX_NGRAM, shortest - 1, -1)
    searches = {n: NgramDrafter(n, n) for n in lengths}  # the longest that matches: NgramDrafter(6, shortest)'s
    by_length = {n: [0, 0, 0] for n in lengths}
    hits = total = 0
    for s, d in zip(samples, drafts):
        tokens = s.tokens
        for t in range(max(s.prompt_len - 2, 0), len(tokens) - 2):  # draft t: token t + 2 (trainer's count)
            want, head_ok = int(s.greedy[t + 1]), int(d[t]) == int(s.greedy[t + 1])
            ok = head_ok
            for n, search in searches.items():
                found = search.propose(tokens[None, : t + 2], torch.tensor([t + 2]), 1, None, None)
                if int(found.valid[0]):
                    ok = int(found.tokens[0, 0]) == want
                    by_length[n] = [by_length[n][0] + 1, by_length[n][1] + ok, by_length[n][2] + head_ok]
                    break
            hits, total = hits + ok, total + 1
    matched, lookup_right, head_right = (sum(c[i] for c in by_length.values()) for i in range(3))
    return {"matched": matched / max(total, 1), "lookup_right": lookup_right / max(matched, 1),
            "head_right": head_right / max(matched, 1), "acceptance": hits / max(total, 1),
            "by_length": {str(n): c for n, c in by_length.items()}}


def chain_tau(head, samples, k: int, shortest: int, lookup_k: int = 0) -> dict:
    """τ of the head's k-draft chain at each answer position with max(k, lookup_k) tokens after it: alone, and with
    prompt lookup (tails of `shortest`-6 tokens; 0: none) drafting where it found a whole chain (k), its tokens as a
    prefix of the head's, and copying up to `lookup_k` where it found at least k (drafter.head_k = k, the recipe's
    k = lookup_k; module docstring)."""
    import torch

    from specpilot.engine.drafters import NgramDrafter
    from specpilot.engine.recipe import LOOKUP_MAX_NGRAM
    from specpilot.tools.train.trainer import collate, unrolled_logits

    search = NgramDrafter(LOOKUP_MAX_NGRAM, shortest) if shortest else None
    width = max(k, lookup_k)

    def accepted(drafts, truth) -> int:
        hits = (drafts == truth[: len(drafts)]).int()
        return int(hits.cumprod(0).sum())

    totals = dict.fromkeys(("head", "lookup", "prefix", "deep"), 0)
    steps = 0
    for s in samples:
        with torch.no_grad():
            logits = unrolled_logits(head, collate([s], k, head.device), k)
        drafts = torch.stack([head.draft_to_target[x[0].argmax(-1)].cpu() for x in logits], 1)  # [n, k]
        tokens = s.tokens
        for t in range(max(s.prompt_len - 2, 0), len(tokens) - 1 - width):  # drafts of tokens t + 2 .. t + 1 + k
            truth = tokens[t + 2: t + 2 + width]
            own = accepted(drafts[t], truth)
            got = dict.fromkeys(totals, own)
            if search is not None:
                found = search.propose(tokens[None, : t + 2], torch.tensor([t + 2]), width, None, None)
                valid = int(found.valid[0])
                if valid >= k:
                    got["lookup"] = accepted(found.tokens[0, :k], truth)
                    got["deep"] = accepted(found.tokens[0, :min(valid, lookup_k or k)], truth)
                if valid:  # lookup's tokens first, the head's after them (conditioned on them: the truth's if right)
                    got["prefix"] = accepted(torch.cat([found.tokens[0, :min(valid, k)], drafts[t, valid:]]), truth)
            totals = {name: totals[name] + got[name] for name in totals}
            steps += 1
    tau = {name: 1 + total / max(steps, 1) for name, total in totals.items()}
    lookup = search is not None
    return {"positions": steps, "tau": tau["head"], "tau_with_lookup": tau["lookup"] if lookup else None,
            "tau_with_lookup_prefix": tau["prefix"] if lookup else None,
            "tau_with_lookup_deep": tau["deep"] if lookup and lookup_k else None, "lookup_k": lookup_k}


def run(out_dir, args):
    from specpilot.engine.eagle3 import Eagle3Head
    from specpilot.engine.engine import Engine
    from specpilot.engine.loader import load, source_dir
    from specpilot.engine.recipe import parse
    from specpilot.engine.workloads import load_workload
    from specpilot.tools.train.data import capture_group
    from specpilot.tools.train.trainer import first_draft_acceptance, first_drafts

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
                  "acceptance": {name: first_draft_acceptance(h, samples, 4) for name, h in heads.items()}}
        if args.lookup:
            result["lookup"] = with_lookup(samples, first_drafts(head, samples, 4), args.lookup)
        if args.chain:
            result["chain"] = chain_tau(head, samples, args.chain, args.lookup, args.lookup_k)
        result["seconds"] = round(time.perf_counter() - t0, 1)
        found[wl] = result
        look = result.get("lookup")
        rows.append([wl, result["prompts"], result["positions"], f"{result['coverage']:.3f}"]
                    + [f"{a:.3f}" for a in result["acceptance"].values()]
                    + ([f"{look['matched']:.3f}", f"{look['lookup_right']:.3f} / {look['head_right']:.3f}",
                        f"{look['acceptance']:.3f}"] if look else []))
    lookup_heads = ([f"lookup {args.lookup}-6 matched", "there: lookup / head right", "acceptance, head + lookup"]
                    if args.lookup else [])
    table = ("The head's first draft (teacher-forced) equal to the target's greedy next token, by draft vocabulary "
             "(ids), and the share of those tokens the shipped vocabulary holds"
             + (f"; with prompt lookup (the context's last {args.lookup}-6 tokens seen before) taking the positions "
                "where it matched" if args.lookup else "") + ":\n\n"
             + harness.md_table(["workload", "prompts", "answer positions", "in the shipped vocabulary"]
                                + [f"acceptance, {name}" for name in heads] + lookup_heads, rows))
    if args.lookup:
        table += ("\n\nBy the longest tail that matched (tokens): positions, lookup right, the head right, there:\n\n"
                  + "\n".join(f"- {wl}: " + "; ".join(
                      f"{n}: {c[0]}, {c[1] / c[0]:.3f} / {c[2] / c[0]:.3f}" for n, c in r["lookup"]["by_length"].items()
                      if c[0]) for wl, r in found.items()))
    if args.chain:
        table += (f"\n\nτ of a chain of {args.chain} drafts a step, teacher-forced, at every answer position with "
                  f"{max(args.chain, args.lookup_k)} tokens after it: the head alone"
                  + (f"; with prompt lookup ({args.lookup}-6)" if args.lookup else "") + ":\n\n"
                  + "\n".join(f"- {wl}: {r['chain']['positions']} positions, {r['chain']['tau']:.3f}"
                               + (f"; {r['chain']['tau_with_lookup']:.3f}; lookup's tokens as a prefix, the head's "
                                  f"after: {r['chain']['tau_with_lookup_prefix']:.3f}" if args.lookup else "")
                               + (f"; lookup copying up to {args.lookup_k}: {r['chain']['tau_with_lookup_deep']:.3f}"
                                  if args.lookup and args.lookup_k else "")
                               for wl, r in found.items()))
    return {"head": args.head, "max_new_tokens": tokens, "lookup": args.lookup, "chain": args.chain,
            "lookup_k": args.lookup_k,
            "workloads": found}, table
