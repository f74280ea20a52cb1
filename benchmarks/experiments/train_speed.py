"""Where `specpilot train-drafter`'s minutes go: the target writing answers, and the head's optimizer steps.

What it measures (issue #22: a head trained on more data in the same minutes). On the staged target, bf16:
1. `--prompts` self-instructed prompts (the task mix, as train-drafter writes them: none from a benchmark), written
   once at `--answer-batch`'s largest size.
2. Their greedy and sampled answers (`--max-new-tokens` at most) decoded by train-drafter's own answer engine at each
   of `--answer-batch`'s row counts: tokens a second, and the decoder's steps, refills and prefill time, per kind.
3. The hidden states of those samples captured (tokens a second), then the training step (the head of
   train-drafter's defaults, the target's LM-head rows frozen) timed at each of `--batch-sizes` samples a step:
   ms a step and answer tokens a second.

Backs docs/BENCHMARKS.md, "What is not yet fast" (the heads: how much data a training minute buys), docs/TRAINING.md's
data and step rates, and `train_head --sized-by`, which sizes a run's data and batch from its record.

Device minutes: about 3.
"""
from __future__ import annotations

import time

import harness

MINUTES = 4
CUDA_ONLY = True


def arguments(p) -> None:
    p.add_argument("--prompts", type=int, default=512, help="prompts written and answered")
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--answer-batch", default="64,256", help="rows decoded at once, comma-separated")
    p.add_argument("--batch-sizes", default="16,32,64", help="samples a training step, comma-separated")


def decode_stats(stats) -> dict:
    kinds: dict[int, list[float]] = {}
    for s in stats.step_log:
        kinds.setdefault(s.kind, []).append(s.seconds)
    return {"steps": stats.steps, "refills": stats.refills, "refill_prefills": stats.refill_prefills,
            "prefill_s": round(stats.prefill_s, 3), "refill_prefill_s": round(stats.refill_prefill_s, 3),
            "decode_s": round(stats.decode_s, 3), "row_steps": stats.row_steps,
            "median_step_ms": {k: round(1e3 * sorted(v)[len(v) // 2], 3) for k, v in kinds.items()}}


def run(out_dir, args):
    import torch

    from specpilot.engine import loader
    from specpilot.tools.train import data as data_mod
    from specpilot.tools.train.head import TrainableHead, default_aux_layers, head_config
    from specpilot.tools.train.prompts import write_prompts
    from specpilot.tools.train.trainer import Schedule, time_training
    from specpilot.tools.train.vocab import draft_vocabulary

    smoke = args.ctx.smoke
    n_prompts, tokens = (8, 8) if smoke else (args.prompts, args.max_new_tokens)
    rows_list = [int(x) for x in args.answer_batch.split(",") if x]
    batch_sizes = [2] if smoke else [int(x) for x in args.batch_sizes.split(",") if x]
    target = loader.load(args.ctx.target, "bf16", args.ctx.device)
    model = target.model
    record: dict = {"prompts": n_prompts, "max_new_tokens": tokens}

    engine = data_mod.answer_engine(target, max(rows_list))
    started = time.perf_counter()
    written = write_prompts(engine, n_prompts, 0, lambda texts: texts, "tasks")
    record["prompt_writing"] = {"seconds": round(time.perf_counter() - started, 2), "written": len(written)}
    prompts = [engine.encode(text) for _, text in written]
    print(record["prompt_writing"], flush=True)

    decoding, pairs = [], None
    for rows in rows_list:
        engine = data_mod.answer_engine(target, rows)
        for kind, sampling in (("greedy", data_mod.SamplingParams()), ("sampled", data_mod.ANSWER_SAMPLING)):
            engine.generate(prompts[: rows], 8, sampling, seed=1)  # captures this bucket's graphs, untimed
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = engine.generate(prompts, tokens, sampling, seed=1)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            made = sum(len(r.tokens) for r in out)
            decoding.append({"rows": rows, "kind": kind, "seconds": round(seconds, 2), "tokens": made,
                             "tokens_per_second": round(made / seconds, 1),
                             **decode_stats(engine.decoder.last_stats)})
            print(decoding[-1], flush=True)
            if kind == "greedy" and pairs is None:
                pairs = [(p, r.tokens) for p, r in zip(prompts, out) if r.tokens]
        del engine
        torch.cuda.empty_cache()
    record["decoding"] = decoding

    aux = default_aux_layers(model.cfg.n_layers)
    t0 = time.perf_counter()
    samples = []
    for group in data_mod.capture_groups([len(p) + len(a) for p, a in pairs]):
        samples += data_mod.capture_group(model, [pairs[i] for i in group], aux)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    n_tok = sum(s.tokens.numel() for s in samples)
    record["capture"] = {"samples": len(samples), "tokens": n_tok, "seconds": round(seconds, 2),
                         "tokens_per_second": round(n_tok / seconds, 1)}
    print(record["capture"], flush=True)

    held, train = samples[:max(1, len(samples) // 10)], samples[max(1, len(samples) // 10):]
    draft_ids = draft_vocabulary([s.answer for s in train], min(8192, model.cfg.vocab_size), model.cfg.vocab_size)
    config = head_config(target.hf_config, len(draft_ids), aux, model.dtype)
    answer_tokens = sum(len(s.answer) for s in train) / len(train)
    steps = []
    for b in batch_sizes:
        head = TrainableHead(config, draft_ids, model, 0, "target")
        timing = time_training(head, target, train, held, Schedule(1, 7, 3e-4, b, 0, 10 ** 9, 10 ** 9),
                               args.ctx.scratch / "timing.pt")
        steps.append({"batch_size": b, "ms_per_step": round(1e3 * timing.step, 2),
                      "answer_tokens_per_second": round(b * answer_tokens / timing.step, 1),
                      "evaluation_s": round(timing.evaluation, 3)})
        print(steps[-1], flush=True)
        del head
    record["training"] = steps

    table = [f"Prompt writing: {record['prompt_writing']['written']} prompts in "
             f"{record['prompt_writing']['seconds']} s.", "",
             harness.md_table(["rows", "kind", "tokens", "s", "tok/s", "steps", "refills", "prefill s",
                               "median step ms"],
                              [[d["rows"], d["kind"], d["tokens"], d["seconds"], harness.fmt(d["tokens_per_second"]),
                                d["steps"], d["refills"], d["prefill_s"] + d["refill_prefill_s"],
                                d["median_step_ms"]] for d in decoding]), "",
             f"Capture: {record['capture']['tokens']:,} tokens in {record['capture']['seconds']} s.", "",
             harness.md_table(["batch", "ms a step", "answer tok/s"],
                              [[s["batch_size"], s["ms_per_step"], harness.fmt(s["answer_tokens_per_second"])]
                               for s in steps])]
    return record, "\n".join(table)
