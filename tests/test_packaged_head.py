"""The EAGLE-3 head that ships with smollm2-135m (docs/TRAINING.md, "The packaged head"): the file the docs name,
loadable by its alias against the packaged target, and lossless: its chain decodes AR's greedy tokens."""
from __future__ import annotations

import hashlib
import re
from pathlib import Path

from specpilot.engine.eagle3 import load_head
from specpilot.engine.engine import Engine
from specpilot.engine.loader import PACKAGED_HEAD, source_dir
from specpilot.engine.recipe import parse

DOCS = Path(__file__).resolve().parents[1] / "docs" / "TRAINING.md"


def test_the_packaged_head_is_the_file_the_docs_name():
    text = DOCS.read_text()
    section = text[text.index("## The packaged head"):]
    named = re.search(r"sha256 of `model.safetensors`: `([0-9a-f]{64})`", section).group(1)
    data = (PACKAGED_HEAD / "model.safetensors").read_bytes()
    assert hashlib.sha256(data).hexdigest() == named
    assert len(data) <= 16 * 1024 * 1024  # the repository's limit for a shipped artifact
    assert source_dir("smollm2-135m-eagle3") == PACKAGED_HEAD


def test_the_packaged_head_loads_by_alias_and_its_chain_decodes_ar_tokens(smollm2):
    loaded, _ = smollm2
    head = load_head("smollm2-135m-eagle3", loaded.model)
    assert head.cfg.draft_vocab_size == 8192 and head.cfg.aux_layers == (1, 14, 26)
    assert head.lm_head.shape == (8192, loaded.model.cfg.hidden_size)  # the target's rows, not stored in the file
    prompts = [Engine(loaded, parse({"name": "ar"})).encode(text) for text in
               ("Write a Python function that reverses a list.", "What is the capital of France? Explain briefly.")]
    ar = [r.tokens for r in Engine(loaded, parse({"name": "ar"})).generate(prompts, 24)]
    chain = Engine(loaded, parse({"drafter": {"kind": "eagle3", "model": "smollm2-135m-eagle3"}, "k": 2}))
    rows = chain.generate(prompts, 24)
    assert [r.tokens for r in rows] == ar
    stats = chain.decoder.last_stats
    assert stats.steps < 2 * 23  # drafts were accepted: fewer verification steps than tokens after the first
    # an EAGLE-2 dynamic tree of the head (issue #22's "done when": AR-identical greedy tokens on a CPU)
    tree = Engine(loaded, parse({"drafter": {"kind": "eagle3", "model": "smollm2-135m-eagle3"}, "k": 3,
                                 "verification": "tree", "tree": {"kind": "dynamic", "depth": 3, "topk": 2,
                                                                  "tokens": 8}}))
    assert [r.tokens for r in tree.generate(prompts, 24)] == ar
    assert tree.decoder.last_stats.steps < 2 * 23
    # continuously batched: three requests, one row at a time, each started in the row the last one finished
    rows = chain.generate(prompts + prompts[:1], 24, max_batch=1)
    assert [r.tokens for r in rows] == ar + ar[:1] and chain.decoder.last_stats.refills == 2
