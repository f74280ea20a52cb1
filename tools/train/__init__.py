"""`specpilot train-drafter`: an EAGLE-3 head trained for a target from the target alone (issue #22). One concern a
file:

- `prompts.py`: where the prompts come from: a JSONL file (Spec-Bench / MT-Bench `turns`, or `{"prompt": ...}`), or
  prompts the target writes itself from its chat template's user-turn prefix (Magpie-style self-instruct);
- `filters.py`: what may not enter training: exact and near duplicates, and anything that is or contains a prompt
  we benchmark (the built-in workloads, HumanEval);
- `data.py`: the target's own answers (decoded by the engine) and the hidden states the head reads, captured from
  target forwards over prompt + answer, samples of similar length batched;
- `vocab.py`: the reduced draft vocabulary from token frequencies, and its d2t / t2d maps;
- `head.py`: the trainable head (initialized from the target) and its export in the on-disk format that
  engine/eagle3.py's `load_head` (and SGLang / vLLM) load;
- `trainer.py`: EAGLE-3's training-time test loss, the optimizer loop, held-out acceptance, checkpoints, and the
  timing of a few steps that turns `--minutes` into a step count;
- `run.py`: the command: settings, the run directory, data -> vocabulary -> head -> training -> export.

Imports engine/ and kernels/ only (no other tools/ subpackage).
"""
