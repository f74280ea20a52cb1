"""EAGLE-3 heads (issue #21 item 1): a randomly initialized head in the on-disk format SGLang and vLLM load
(tests/eagle3_head.py writes it) loads, its forward equals a plain reference written here from the safetensors, the
target's hidden states come from its own forward (equal to HF's layer outputs), decoding gives AR's tokens for every
tiny family (padded, ragged, with AR steps), every proposal is the reference head's argmax on HF's hidden states,
a head built to know the target is always accepted, and heads that do not fit the target are refused in one line."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from conftest import _COMMON, TINY_FAMILIES, build_tiny_hf
from eagle3_head import default_aux_ids, head_config, save_head, write_head
from specpilot.engine.decode import StopCondition
from specpilot.engine.eagle3 import Eagle3Head, draft_logits, fuse, fused_step, midlayer, pair_inputs
from specpilot.engine.engine import Engine
from specpilot.engine.errors import SpecPilotError
from specpilot.engine.loader import load
from specpilot.engine.recipe import RecipeError, parse
from specpilot.engine.sampling import SamplingParams
from specpilot.kernels.triton_fused_layer import draft_layer
from test_decoding import TINY_NEW, tiny_prompts, tiny_reference  # noqa: F401 (a fixture)


# -- a plain reference: the head written out from its files, no fusion, no cache, full causal attention -----------
def rms(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), -1)


class ReferenceHead:
    """SGLang's LlamaDecoderLayer (llama_eagle3.py) over a whole sequence of (token, hidden) pairs."""

    def __init__(self, path, target_embed):
        self.cfg = json.loads((path / "config.json").read_text())
        self.w = load_file(str(path / "model.safetensors"))
        self.embed = self.w.get("embed_tokens.weight", target_embed)

    def layer(self, tokens, hidden, positions):
        c, w, p = self.cfg, self.w, "midlayer."
        eps, nh, nkv, hd = c["rms_norm_eps"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        T = tokens.shape[0]
        normed = rms(hidden, w[p + "hidden_norm.weight"], eps)
        residual = normed if c.get("norm_before_residual") else hidden
        x = torch.cat([rms(self.embed[tokens], w[p + "input_layernorm.weight"], eps), normed], -1)

        def proj(name):
            bias = w.get(p + f"self_attn.{name}_proj.bias")
            return F.linear(x, w[p + f"self_attn.{name}_proj.weight"], bias)

        q, k, v = proj("q").view(T, nh, hd), proj("k").view(T, nkv, hd), proj("v").view(T, nkv, hd)
        inv_freq = 1.0 / (c["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))
        freqs = positions.float()[:, None] * inv_freq[None]
        cos, sin = torch.cat((freqs, freqs), -1).cos()[:, None], torch.cat((freqs, freqs), -1).sin()[:, None]
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(hd)
        scores = scores.masked_fill(positions[None, None, :] > positions[None, :, None], float("-inf"))
        o = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(T, nh * hd)
        h = residual + F.linear(o, w[p + "self_attn.o_proj.weight"], w.get(p + "self_attn.o_proj.bias"))
        g = rms(h, w[p + "post_attention_layernorm.weight"], eps)
        mlp = F.linear(F.silu(F.linear(g, w[p + "mlp.gate_proj.weight"])) * F.linear(g, w[p + "mlp.up_proj.weight"]),
                       w[p + "mlp.down_proj.weight"])
        return h + mlp

    def logits(self, out):
        return F.linear(rms(out, self.w["norm.weight"], self.cfg["rms_norm_eps"]), self.w["lm_head.weight"])

    def target_id(self, draft_id: int) -> int:
        return draft_id + int(self.w["d2t"][draft_id])

    def propose(self, states, context: list[int], k: int) -> list[int]:
        """k greedy drafts after `context`, from the target's states of its tokens 0..len-2 [len - 1, 3 Ht]: pairs
        (state of token t, token t + 1) at positions t, then the head's own output with each draft."""
        hidden = F.linear(states, self.w["fc.weight"], self.w.get("fc.bias"))
        tokens = torch.tensor(context[1:])
        drafts = []
        for _ in range(k):
            out = self.layer(tokens, hidden, torch.arange(tokens.shape[0]))
            draft = self.target_id(int(self.logits(out[-1]).argmax()))
            drafts.append(draft)
            hidden, tokens = torch.cat([hidden, out[-1:]]), torch.cat([tokens, torch.tensor([draft])])
        return drafts


def hf_layer_outputs(hf, tokens: list[int], layers) -> torch.Tensor:
    """HF's outputs of the given decoder layers for `tokens` [T, len(layers) * hidden], by forward hooks on the
    layers (as SpecForge's HF target backend captures them)."""
    got = {}
    hooks = [hf.model.layers[i].register_forward_hook(
        lambda mod, args, out, i=i: got.__setitem__(i, out[0] if isinstance(out, tuple) else out)) for i in set(layers)]
    try:
        with torch.no_grad():
            hf(torch.tensor([tokens]))
    finally:
        for h in hooks:
            h.remove()
    return torch.cat([got[i][0] for i in layers], -1)


# -- fixtures ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def head_dir(tiny, tmp_path_factory):
    """A random head for each tiny family (low / middle / high layer outputs, draft vocabulary 160 of 256)."""
    return write_head(tmp_path_factory.mktemp(f"eagle3-{tiny.family}"), tiny.hf.config, seed=3)


@pytest.fixture(scope="session")
def llama_target(tiny_model_dir):
    path = tiny_model_dir("llama")
    return load(str(path), "fp32", "cpu"), path


def eagle3_recipe(path, k=4, **extra):
    return parse({"drafter": {"kind": "eagle3", "model": str(path)}, "k": k, "cuda_graphs": False, **extra})


def record_proposals(eng):
    """Every propose call's (history, lengths, active rows, drafts), from now on, but those of the steps the batch
    controller times for its prices: they run each row past its length (`Decoder._time_step`'s `ahead`), where the
    history is not the row's, and are undone."""
    drafter, calls, real = eng.decoder.drafter, [], eng.decoder.drafter.propose
    decoder, time_step = eng.decoder, eng.decoder._time_step

    def propose(history, lengths, k, sampling, generator):
        out = real(history, lengths, k, sampling, generator)
        calls.append((history.clone(), lengths.clone(), eng.decoder._state.active.clone(), out.tokens.clone()))
        return out

    def untimed(*args, **kwargs):
        before = len(calls)
        try:
            return time_step(*args, **kwargs)
        finally:
            del calls[before:]

    drafter.propose, decoder._time_step = propose, untimed
    return calls


def check_rows(calls, hf, head_path, target_embed, aux_layers, expected) -> int:
    """Each active row's drafts at each recorded call equal `expected(reference head, HF's hidden states of the
    row's context, the context, the call's drafts)`; returns the number of rows checked."""
    ref, checked = ReferenceHead(head_path, target_embed), 0
    for history, lengths, active, drafts in calls:
        for b in range(history.shape[0]):
            if not active[b]:
                continue
            context = history[b, : int(lengths[b])].tolist()
            states = hf_layer_outputs(hf, context[:-1], aux_layers)
            assert expected(ref, states, context, drafts) == drafts[b].tolist(), (b, len(context))
            checked += 1
    return checked


def check_proposals(calls, hf, head_path, target_embed, aux_layers) -> int:
    """Each active row's chain drafts equal the reference head's on HF's hidden states (rows checked)."""
    return check_rows(calls, hf, head_path, target_embed, aux_layers,
                      lambda ref, states, context, drafts: ref.propose(states, context, drafts.shape[1]))


# -- the target's hidden states ------------------------------------------------------------------------------------
def test_aux_hidden_states_are_the_layer_outputs(tiny):
    """Transformer.forward(aux_layers=...) returns each named layer's output (HF's, hooked), in the order named,
    from the same forward; the logits are those of the plain forward."""
    model, n = tiny.loaded.model, tiny.loaded.model.cfg.n_layers
    layers = (n - 1, 0, n // 2, 0)
    tokens = tiny_prompts()[0]
    ids = torch.tensor([tokens])
    positions = torch.arange(len(tokens))[None]
    with torch.no_grad():
        plain = model(ids, positions, model.new_cache(1, 64))
        logits, states = model(ids, positions, model.new_cache(1, 64), aux_layers=layers)
    assert torch.equal(logits, plain)
    assert states.shape == (1, len(tokens), len(layers) * model.cfg.hidden_size)
    torch.testing.assert_close(states[0], hf_layer_outputs(tiny.hf, tokens, layers), rtol=1e-4, atol=1e-4)


# -- the head's forward against the reference ---------------------------------------------------------------------
@pytest.mark.parametrize("fused", [False, True], ids=["modular", "fused-kernels"])
@pytest.mark.parametrize("variant", ["plain", "narrow-own-embeddings", "vllm-options"])
def test_head_forward_matches_the_reference(llama_target, tmp_path, variant, fused):
    """fc, the midlayer with attention over [input_layernorm(embedding); hidden_norm(hidden)], the final norm, the
    LM head and the d2t map, on random inputs: the engine's fused forward equals the reference written from the
    files. Variants: a head narrower than the target (fc 3 x 64 -> 32, its own embeddings) and vLLM's options
    (q/k/v/o biases, norm_before_residual). `fused`: the chain step on the fused layer's kernels (`fused_step`, under
    Triton's interpreter), steps of 4 and 3 tokens a row."""
    loaded, _ = llama_target
    hf_cfg = loaded.hf_config
    kwargs = {"plain": {}, "narrow-own-embeddings": {"hidden": 32, "own_embeddings": True},
              "vllm-options": {"config_changes": {"attention_bias": True, "norm_before_residual": True}}}[variant]
    path = write_head(tmp_path / "head", hf_cfg, seed=11, **kwargs)
    if variant == "vllm-options":
        g = torch.Generator().manual_seed(5)
        w = load_file(str(path / "model.safetensors"))
        for n, size in (("q", 64), ("k", 32), ("v", 32), ("o", 64)):
            w[f"midlayer.self_attn.{n}_proj.bias"] = torch.randn(size, generator=g) * 0.2
        save_head(path, json.loads((path / "config.json").read_text()), w)
    head = Eagle3Head(path, loaded.model)
    ref = ReferenceHead(path, loaded.model.embed.detach())
    ops = loaded.model.default_ops
    g = torch.Generator().manual_seed(0)
    B, T = 2, 7
    tokens = torch.randint(0, 256, (B, T), generator=g)
    states = torch.randn(B, T, 3 * 64, generator=g)
    positions = torch.arange(T)[None].expand(B, T)
    cache = head.new_cache(B, 32)
    with torch.no_grad():  # in two calls: the second attends to the first's K/V in the head's cache
        if fused:
            head.ensure_rope(32)
            steps = [fused_step(head, (*pair_inputs(head, tokens[:, s], fuse(head, states[:, s], ops),
                                                    positions[:, s].contiguous(), ops), positions[:, s].contiguous()),
                                cache.kv[:, 0], draft_layer) for s in (slice(0, 4), slice(4, T))]
            assert all(step is not None for step in steps)
            out, logits = (torch.cat(parts, 1) for parts in zip(*steps))
        else:
            out = torch.cat([midlayer(head, tokens[:, s], fuse(head, states[:, s], ops), positions[:, s],
                                      cache.kv[:, 0], ops) for s in (slice(0, 4), slice(4, T))], 1)
            logits = draft_logits(head, out, ops)
    # (fp32; the reference's sums follow torch's thread count: with one thread, as under pytest-xdist, the fused
    # kernels' outputs differ from it by up to 2e-5 where two threads gave under 1e-5)
    tol = dict(rtol=5e-5, atol=5e-5) if fused else dict(rtol=1e-5, atol=1e-5)
    for b in range(B):
        hidden = F.linear(states[b], ref.w["fc.weight"])
        want = ref.layer(tokens[b], hidden, positions[b])
        torch.testing.assert_close(out[b], want, **tol)
        torch.testing.assert_close(logits[b], ref.logits(want), **tol)
        drafted = head.draft_to_target[logits[b].argmax(-1)]
        assert drafted.tolist() == [ref.target_id(int(i)) for i in ref.logits(want).argmax(-1)]
    # the draft vocabulary maps into the target's, as t2d says
    assert ref.w["t2d"][head.draft_to_target].all() and int(ref.w["t2d"].sum()) == 160


# -- decoding -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", (3, 4))
def test_eagle3_decodes_ar_tokens(tiny, tiny_reference, head_dir, k):
    """Greedy fp32, three prompts of different lengths in one batch: HF's greedy tokens, for every family."""
    eng = Engine(tiny.loaded, eagle3_recipe(head_dir, k))
    assert eng.decoder.drafter.name == "eagle3" and eng.decoder.aux_layers == tuple(default_aux_ids(
        tiny.loaded.model.cfg.n_layers))
    rows = eng.generate(tiny_prompts(), TINY_NEW, ignore_eos=True)
    assert [r.tokens for r in rows] == tiny_reference, tiny.family
    for r in rows:
        assert all(0 <= a <= k for a in r.accepted) and r.finish_reason == "length"


def test_eagle3_proposals_are_the_reference_heads(tiny, tiny_reference, head_dir):
    """Every draft of every step is the reference head's greedy draft, run on HF's own hidden states of the row's
    context: the layer outputs, the pairing (state of token t with token t + 1 at position t), the head's cache
    across steps and the d2t map are all as in SGLang and vLLM."""
    eng = Engine(tiny.loaded, eagle3_recipe(head_dir, 3))
    calls = record_proposals(eng)
    rows = eng.generate(tiny_prompts(), 12, ignore_eos=True)
    assert [r.tokens for r in rows] == [ref[:12] for ref in tiny_reference]
    checked = check_proposals(calls, tiny.hf, head_dir, tiny.loaded.model.embed.detach(),
                              eng.decoder.drafter.needs_hidden_states)
    assert checked >= 3 * 4


def test_eagle3_with_prompt_lookup_copies_where_the_context_repeats(tiny, tiny_reference, head_dir):
    """`drafter.lookup`: a row whose context's last 1-6 tokens (here from one: the tiny vocabulary's random text
    repeats few longer tails) occurred before, with a whole chain after them, drafts that chain (the n-gram
    drafter's proposal); every other row drafts the reference head's chain. Greedy fp32: HF's tokens still; both
    kinds of rows occur."""
    from specpilot.engine.drafters import NgramDrafter

    k = 3
    eng = Engine(tiny.loaded, parse({"drafter": {"kind": "eagle3", "model": str(head_dir), "lookup": 1}, "k": k,
                                     "cuda_graphs": False}))
    assert eng.decoder.drafter.lookup.min_ngram == 1 and eng.decoder.drafter.lookup.max_ngram == 6
    calls = record_proposals(eng)
    rows = eng.generate(tiny_prompts(), TINY_NEW, ignore_eos=True)
    assert [r.tokens for r in rows] == tiny_reference
    search, copied = NgramDrafter(6, 1), []

    def expected(ref, states, context, drafts):
        found = search._search(torch.tensor([context]), torch.tensor([len(context)]), drafts.shape[1])
        copied.append(int(found[1][0]) == drafts.shape[1])
        return found[0][0].tolist() if copied[-1] else ref.propose(states, context, drafts.shape[1])

    checked = check_rows(calls, tiny.hf, head_dir, tiny.loaded.model.embed.detach(),
                         eng.decoder.drafter.needs_hidden_states, expected)
    assert checked >= 3 * 3 and any(copied) and not all(copied), copied


def test_eagle3_lookup_deeper_than_the_heads_chain(tiny, tiny_reference, head_dir):
    """`drafter.head_k` below k: the head drafts head_k a step (its forwards: head_k, never k), a row whose lookup
    found at least that many drafts up to k copied ones, and each proposal's `found` (what the batch controller plans
    with) is what the row would draft in a step of k. Greedy fp32: HF's tokens; both kinds of rows occur, and copied
    chains longer than the head's are verified."""
    from specpilot.engine.drafters import NgramDrafter

    k, head_k = 5, 2
    eng = Engine(tiny.loaded, parse({"drafter": {"kind": "eagle3", "model": str(head_dir), "lookup": 1,
                                                 "head_k": head_k}, "k": k, "cuda_graphs": False}))
    drafter = eng.decoder.drafter
    assert (drafter.k, drafter.head_k, drafter.reports_found) == (k, head_k, True)
    calls, forwards, real, real_next = [], [], drafter.propose, drafter._draft_next

    def propose(history, lengths, width, sampling, generator):
        forwards.append(0)
        out = real(history, lengths, width, sampling, generator)
        calls.append((history.clone(), lengths.clone(), eng.decoder._state.active.clone(), out, width))
        return out

    def draft_next(*args):
        forwards[-1] += 1
        return real_next(*args)

    verified, real_forward = [], eng.decoder._forward

    def forward(tokens, positions, **kw):  # each row's tokens the step verifies (its live ones)
        if kw.get("live") is not None:
            verified.extend(kw["live"].view(tokens.shape).sum(1).tolist())
        return real_forward(tokens, positions, **kw)

    drafter.propose, drafter._draft_next, eng.decoder._forward = propose, draft_next, forward
    rows = eng.generate(tiny_prompts(), TINY_NEW, ignore_eos=True)
    assert [r.tokens for r in rows] == tiny_reference
    assert forwards and all(n == head_k - 1 for n in forwards)  # the first draft, then head_k - 1 more
    ref, search, copied = ReferenceHead(head_dir, tiny.loaded.model.embed.detach()), NgramDrafter(6, 1), []
    for history, lengths, active, out, width in calls:
        assert width == k and out.tokens.shape[1] == k
        for b in range(history.shape[0]):
            if not active[b]:
                continue
            context = history[b, : int(lengths[b])].tolist()
            tokens, n = search._search(torch.tensor([context]), torch.tensor([len(context)]), k)
            n, valid = int(n[0]), int(out.valid[b])
            copied.append(n >= head_k)
            assert int(out.found[b]) == max(n, head_k)
            if copied[-1]:
                assert valid == n and out.tokens[b, :n].tolist() == tokens[0, :n].tolist()
            else:
                states = hf_layer_outputs(tiny.hf, context[:-1], drafter.needs_hidden_states)
                assert valid == head_k and out.tokens[b, :head_k].tolist() == ref.propose(states, context, head_k)
    assert any(copied) and not all(copied), copied
    assert max(verified) > head_k + 1  # a copied chain's drafts past the head's were verified


def test_eagle3_continuous_batching_proposals_are_the_reference_heads(tiny, head_dir):
    """Six requests two rows at a time: each request after the first two starts in a row another finished, its
    head cache rows and pending pair set up anew (`start_rows`), and the last ones move to a smaller bucket with
    their head rows (`move_rows`). Every request decodes AR's tokens, and every draft of every step is the
    reference head's on HF's states of the row's own context."""
    prompts = tiny_prompts() + [p[::-1] for p in tiny_prompts()]
    eng = Engine(tiny.loaded, eagle3_recipe(head_dir, 3, batch={"max_batch_size": 2}))
    assert eng.decoder.continuous
    eng.warmup([1, 2], max(len(p) for p in prompts), 12)  # the smaller bucket's steps: a drained batch moves there
    calls = record_proposals(eng)
    stop = StopCondition(12, (tiny_prompts()[1][0],))  # (requests end at different steps)
    rows = eng.decoder.generate(prompts, stop, max_batch=2)
    want = [Engine(tiny.loaded, parse({"cuda_graphs": False})).decoder.generate([p], stop)[0].tokens for p in prompts]
    assert [r.tokens for r in rows] == want
    stats = eng.decoder.last_stats
    assert stats.refills == len(prompts) - 2
    if tiny.family == "llama":  # the reference check once (it replays HF per row and step)
        assert stats.shrinks >= 1  # (in this family the last two requests end at different steps)
        assert check_proposals(calls, tiny.hf, head_dir, tiny.loaded.model.embed.detach(),
                               eng.decoder.drafter.needs_hidden_states) > 20


def test_the_heads_prompt_passes_run_inside_the_prefills(tiny, head_dir, monkeypatch):
    """A request started in a running batch gets its head cache entries from a pass inside the prefill of the
    waiting requests (`Drafter.prefill_refills`: with CUDA graphs part of that captured graph, so a warmed-up refill
    compiles, plans and launches nothing of the head's on its own; on the H200 the eager pass had cost 2-3.5 ms of
    host time a refill, and its attention's first plans 27 ms a refill in a bench); `start_rows` only copies rows.
    The batch's own prompts get theirs inside the batch's prefill too (`Drafter.prefill_prompts`)."""
    eng = Engine(tiny.loaded, eagle3_recipe(head_dir, 3, batch={"max_batch_size": 2}))
    dec = eng.decoder
    inside, passes = [], []
    forward, pairs = dec._prefill_forward, dec.drafter._prompt_pairs

    def prefill_forward(*a, refill=False, **kw):
        inside.append(refill)
        try:
            return forward(*a, refill=refill, **kw)
        finally:
            inside.pop()

    def prompt_pairs(*a):
        passes.append(tuple(inside))
        return pairs(*a)

    monkeypatch.setattr(dec, "_prefill_forward", prefill_forward)
    monkeypatch.setattr(dec.drafter, "_prompt_pairs", prompt_pairs)
    prompts = tiny_prompts() + [p[::-1] for p in tiny_prompts()]
    rows = dec.generate(prompts, StopCondition(8, ()), max_batch=2)
    assert [r.tokens for r in rows] == [Engine(tiny.loaded, parse({"cuda_graphs": False})).decoder.generate(
        [p], StopCondition(8, ()))[0].tokens for p in prompts]
    stats = dec.last_stats
    assert stats.refills == len(prompts) - 2 and stats.refill_prefills >= 2
    assert passes == [(False,)] + [(True,)] * stats.refill_prefills


def test_a_row_moved_to_a_smaller_bucket_keeps_its_proposals(tiny, head_dir):
    """`move_rows` (a draining batch moving to a smaller bucket): row 1's head cache rows and pending pair move to
    row 0, and the row's next proposals are what they would have been where it was."""
    eng = Engine(tiny.loaded, eagle3_recipe(head_dir, 3))
    eng.generate(tiny_prompts()[:2], 6, ignore_eos=True)
    st, drafter = eng.decoder._state, eng.decoder.drafter
    with torch.inference_mode():
        there = drafter.propose(st.history, st.lengths, 3, SamplingParams(), None).tokens[1]
        drafter.move_rows(torch.tensor([1]), 1)
        here = drafter.propose(st.history[1:], st.lengths[1:], 3, SamplingParams(), None).tokens[0]
    assert here.tolist() == there.tolist()
    assert drafter._pending.shape[0] == 1 and drafter.cache.kv.shape[2] == 1  # the current batch: one row


def test_eagle3_ragged_steps_and_measured_prices(tiny, tiny_reference, head_dir):
    """With the batch controller and ragged verification (each kind of step in turn, AR steps among them; the
    hidden states of packed tokens go back to their rows), AR's tokens; and the steps the controller times for its
    prices (undone afterwards, the drafter's state too) leave every later proposal the reference head's."""
    eng = Engine(tiny.loaded, eagle3_recipe(head_dir, 4, batch={"controller": "cost", "ragged": True}))
    kinds = iter([4, 1, 0, 2, 3] * 1000)
    eng.decoder.controller.choose = lambda prices: next(kinds)  # prices still measured: first use of the bucket
    calls = record_proposals(eng)
    rows = eng.generate(tiny_prompts(), TINY_NEW, ignore_eos=True)
    assert [r.tokens for r in rows] == tiny_reference, tiny.family
    assert set(eng.decoder.last_stats.draft_lengths) == {0, 1, 2, 3, 4}
    if tiny.family == "llama":  # the reference check once (it replays HF per row and step)
        assert check_proposals(calls, tiny.hf, head_dir, tiny.loaded.model.embed.detach(),
                               eng.decoder.drafter.needs_hidden_states) > 0


def test_a_head_misses_no_pair_under_the_batch_controller(tiny, tiny_reference, head_dir):
    """The head's cache must see every token's pair. With the batch controller its AR steps that search draft one
    token (not k: the least that brings the head up to date); those that skip the search (BLIND_AR) leave their
    pairs pending, absorbed before the next step that searches or when `backlog` of them ran in a row. Either
    way the proposals after runs of AR steps are the reference head's. (Before, a step without the search
    overwrote the pending pair of the one before it: the head's cache missed that token.)"""
    from specpilot.engine.batch_controller import BLIND_AR

    def run(step_kinds, backlog=None):
        eng = Engine(tiny.loaded, eagle3_recipe(head_dir, 4, batch={"controller": "cost"}))
        if backlog is not None:
            eng.decoder.drafter.backlog = backlog
        kinds = iter(step_kinds * 1000)
        eng.decoder.controller.choose = lambda prices: next(kinds)
        calls = record_proposals(eng)
        rows = eng.generate(tiny_prompts(), TINY_NEW, ignore_eos=True)
        assert [r.tokens for r in rows] == tiny_reference, tiny.family
        return eng, calls

    eng, searching = run([0, 0, 0, 4])
    assert BLIND_AR in eng.decoder._step_kinds() and 0 not in eng.decoder._step_kinds()  # (never chosen)
    widths = [c[3].shape[1] for c in searching]
    assert widths.count(1) > widths.count(4)  # AR steps (forced: the controller's are blind) drafted one token
    absorbed = []
    _, blind = run([BLIND_AR, BLIND_AR, 4])
    eng, full = run([BLIND_AR] * 5 + [4], backlog=2)
    real = eng.decoder.drafter.absorb
    if tiny.family == "llama":  # the reference check once (it replays HF per row and step)
        args = (tiny.hf, head_dir, tiny.loaded.model.embed.detach(), eng.decoder.drafter.needs_hidden_states)
        for calls in (searching, blind, full):
            assert check_proposals(calls, *args) > 0
    eng.decoder.drafter.absorb = lambda *a: absorbed.append(1) or real(*a)
    eng.generate(tiny_prompts()[:1], TINY_NEW, ignore_eos=True)
    assert len(absorbed) >= 2  # a full backlog absorbed mid-run, and before each search


def test_a_step_timed_after_blind_steps_absorbs_their_backlog_first(tiny, tiny_reference, head_dir):
    """A call that ends on AR steps without the search leaves their pairs pending beyond the k + 1 a searching step
    reads. Timing a searching step from there (a price measured mid-call for a new bucket, or `loop_overhead`'s
    replays after a call, whose rows past the bucket it drained into keep a stale one) absorbs them first, as the
    loop would: it ran over the backlog and indexed past it (a device-side assert on the H100). Timed, the state is
    as the absorb left it, and the next call decodes AR's tokens."""
    from specpilot.engine.batch_controller import BLIND_AR

    eng = Engine(tiny.loaded, eagle3_recipe(head_dir, 3, batch={"controller": "cost"}))
    kinds = iter([3] + [BLIND_AR] * 1000)
    eng.decoder.controller.choose = lambda prices: next(kinds)
    eng.generate(tiny_prompts(), TINY_NEW, ignore_eos=True)
    dec = eng.decoder
    assert dec._blind_run > 0 and int(dec.drafter._new.max()) > dec.k  # a backlog past the searching step's slots
    absorbed = dec.drafter.snapshot()
    with torch.inference_mode():
        dec._time_step(dec._state, dec.k, 2)
    assert dec._blind_run == 0 and int(dec.drafter._new.max()) == 0
    after = dec.drafter.snapshot()
    dec._time_step(dec._state, BLIND_AR, 2)  # (a blind step reads no backlog: nothing absorbed, state put back)
    assert all(torch.equal(a, b) for a, b in zip(after, dec.drafter.snapshot()))
    assert not torch.equal(absorbed[1], after[1])
    dec.drafter._new[1:].fill_(dec.k + 5)  # rows a draining batch left behind, their backlog stale; none in the run
    dec._blind_run = 0
    dec._time_step(dec._state, dec.k, 2)
    eng.decoder.controller.choose = lambda prices: 3
    assert [r.tokens for r in eng.generate(tiny_prompts(), TINY_NEW, ignore_eos=True)] == tiny_reference


def test_eagle3_narrow_head_with_its_own_embeddings(llama_target, tmp_path):
    """A head of hidden size 32 on the 64-wide target (config target_hidden_size; its own embed_tokens): AR's
    tokens and the reference's drafts."""
    loaded, path = llama_target
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    head = write_head(tmp_path / "narrow", loaded.hf_config, seed=4, hidden=32, own_embeddings=True)
    eng = Engine(loaded, eagle3_recipe(head, 3))
    calls = record_proposals(eng)
    rows = eng.generate(tiny_prompts(), 10, ignore_eos=True)
    want = Engine(loaded, parse({})).generate(tiny_prompts(), 10, ignore_eos=True)
    assert [r.tokens for r in rows] == [r.tokens for r in want]
    assert check_proposals(calls, hf, head, loaded.model.embed.detach(), (0, 1, 1)) > 0


def sampled_proposals(loaded, recipe):
    """The tiny prompts decoded sampled (16 tokens each, temperature 0.8, top-k 50) with `recipe`: its drafter and
    every proposal it made."""
    eng = Engine(loaded, recipe)
    drafter, seen, real = eng.decoder.drafter, [], eng.decoder.drafter.propose

    def propose(*args):
        out = real(*args)
        seen.append(out)
        return out

    drafter.propose = propose
    rows = eng.generate(tiny_prompts(), 16, SamplingParams(temperature=0.8, top_k=50), seed=1, ignore_eos=True)
    assert all(len(r.tokens) == 16 for r in rows)
    return drafter, seen


def test_eagle3_sampling(llama_target, head_dir_llama):
    """Sampled decoding runs with the head's q: each step's proposal distribution over the target vocabulary sums
    to 1, lives on the draft vocabulary's target ids, and each draft is one of them."""
    drafter, seen = sampled_proposals(llama_target[0], eagle3_recipe(head_dir_llama, 3))
    in_draft = torch.zeros(256, dtype=torch.bool)
    in_draft[drafter.head.draft_to_target] = True
    for p in seen:
        assert p.probs is not None and p.probs.shape == (3, 3, 256)
        torch.testing.assert_close(p.probs.sum(-1), torch.ones(3, 3))
        assert (p.probs[..., ~in_draft] == 0).all() and in_draft[p.tokens].all()


@pytest.mark.parametrize("head_k", (0, 2))
def test_eagle3_sampling_with_prompt_lookup(llama_target, head_dir_llama, head_k):
    """Sampled, a copied chain's q is one-hot on its tokens (a deterministic draft, as the n-gram drafter's), the
    head's rows keep the head's q: each draft has its q's mass, every q sums to 1, and both kinds occur. With the
    head's chain shorter than k (head_k 2), its rows' q past it is one-hot on the filler (never verified)."""
    _, seen = sampled_proposals(llama_target[0], parse({
        "drafter": {"kind": "eagle3", "model": str(head_dir_llama), "lookup": 1, "head_k": head_k}, "k": 3,
        "cuda_graphs": False}))
    kinds = set()
    for p in seen:
        torch.testing.assert_close(p.probs.sum(-1), torch.ones(3, 3))
        at_draft = p.probs.gather(-1, p.tokens[..., None])[..., 0]
        assert (at_draft > 0).all()
        kinds |= {bool((at_draft[b] == 1).all()) for b in range(3)}
    assert kinds == {True, False}


@pytest.fixture(scope="session")
def head_dir_llama(llama_target, tmp_path_factory):
    loaded, _ = llama_target
    return write_head(tmp_path_factory.mktemp("eagle3-llama"), loaded.hf_config, seed=3)


@pytest.fixture(scope="session")
def bigram_target(tmp_path_factory):
    """A tiny Llama whose layers add nothing (o_proj and down_proj zero): its residual stream is the token's
    embedding, so its next token after x is f(x) = argmax lm_head(norm(embed(x))). Its HF model and our load."""
    cls, kw = TINY_FAMILIES["llama"]
    hf = build_tiny_hf(cls, 5, **{**_COMMON, **kw})
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    path = tmp_path_factory.mktemp("bigram-target")
    hf.save_pretrained(path)
    return hf, load(str(path), "fp32", "cpu")


def head_that_knows(hf, path, noise: float = 0.0, seed: int = 0):
    """An honest construction for `bigram_target`: fc and hidden_norm zero (with vLLM's norm_before_residual the
    residual is then zero too), q and k constant through their biases, so that rotary attention is sharp on the
    query's own position, v and o_proj the identity on the embedding half, no MLP, the target's final norm and its
    LM head's rows for a draft vocabulary holding every f(x). At position t the head then outputs
    norm(embed(token t + 1)) and drafts f(token t + 1) = token t + 2, and from its own output the same again. With
    `noise`, N(0, noise) is added to fc, hidden_norm, q/k/v and the MLP: the drafts then depend on the target's
    states, the head's cache and its own outputs, and are right only some of the time."""
    emb, norm_w, lm = (t.detach() for t in (hf.model.embed_tokens.weight, hf.model.norm.weight, hf.lm_head.weight))
    follows = (rms(emb, norm_w, hf.config.rms_norm_eps) @ lm.T).argmax(-1).unique()
    g = torch.Generator().manual_seed(seed)
    rest = torch.tensor([i for i in torch.randperm(256, generator=g).tolist() if i not in set(follows.tolist())])
    ids = torch.cat([follows, rest[: max(0, 160 - follows.numel())]]).sort().values
    Vd, H = ids.numel(), 64
    cfg = head_config(hf.config, draft_vocab=Vd, aux_ids=[0, 1, 1])
    cfg.update(num_key_value_heads=4, attention_bias=True, norm_before_residual=True)

    def jitter(*shape):
        return noise * torch.randn(*shape, generator=g)

    eye, zeros = torch.eye(H), torch.zeros(H, H)
    a, m = "midlayer.self_attn.", "midlayer.mlp."
    t2d = torch.zeros(256, dtype=torch.bool)
    t2d[ids] = True
    weights = {"fc.weight": jitter(H, 3 * H), "midlayer.input_layernorm.weight": torch.ones(H),
               "midlayer.hidden_norm.weight": jitter(H),
               a + "q_proj.weight": jitter(H, 2 * H), a + "q_proj.bias": torch.full((H,), 10.0),
               a + "k_proj.weight": jitter(H, 2 * H), a + "k_proj.bias": torch.full((H,), 10.0),
               a + "v_proj.weight": torch.cat([eye, zeros], 1) + jitter(H, 2 * H), a + "v_proj.bias": torch.zeros(H),
               a + "o_proj.weight": eye, a + "o_proj.bias": torch.zeros(H),
               "midlayer.post_attention_layernorm.weight": torch.ones(H),
               m + "gate_proj.weight": jitter(2 * H, H), m + "up_proj.weight": jitter(2 * H, H),
               m + "down_proj.weight": jitter(H, 2 * H), "norm.weight": norm_w.clone(),
               "lm_head.weight": lm[ids].clone(), "d2t": ids - torch.arange(Vd), "t2d": t2d}
    return save_head(path, cfg, weights)


def test_a_head_built_to_know_the_target_is_always_accepted(bigram_target, tmp_path):
    """Every draft is right (head_that_knows), so every step accepts all k: only a wrong pairing, position, draft
    step or d2t map could lose one."""
    hf, loaded = bigram_target
    head = head_that_knows(hf, tmp_path / "head")
    k = 4
    rows = Engine(loaded, eagle3_recipe(head, k)).generate(tiny_prompts(), TINY_NEW, ignore_eos=True)
    want = Engine(loaded, parse({})).generate(tiny_prompts(), TINY_NEW, ignore_eos=True)
    assert [r.tokens for r in rows] == [r.tokens for r in want]
    for r in rows:  # the last step may have been cut by the length limit
        assert r.accepted[:-1] == [k] * (len(r.accepted) - 1), r.accepted


@pytest.mark.parametrize("variant", ["padded", "ragged", "junk-past-accepted", "fused", "continuous"])
def test_proposals_after_partial_acceptance_are_the_reference_heads(bigram_target, tmp_path, variant):
    """The random heads above are never right, so each of their steps adds one new pair; this head (noisy
    head_that_knows) is right some of the time: steps accept 0, some or all of k drafts, and every proposal after
    any of them is still the reference head's on HF's states. Padded; ragged with every kind of step in turn (AR
    steps among them) and the controller's prices measured in the middle of the batch; with NaN in the hidden
    states of the slots past each row's accepted drafts (what a layer that skips dead tokens may leave there); on
    the fused layer (Triton's interpreter), which does skip them; and continuously batched, six requests two rows at
    a time, each started in a row another finished (`start_rows`), the last ones moved to a smaller bucket
    (`move_rows`)."""
    hf, loaded = bigram_target
    head = head_that_knows(hf, tmp_path / "head", noise=0.05)
    k = 4
    extra = {"ragged": {"batch": {"controller": "cost", "ragged": True}}, "fused": {"layer": "fused"},
             "continuous": {"batch": {"max_batch_size": 2}}}.get(variant, {})
    eng = Engine(loaded, eagle3_recipe(head, k, **extra))
    prompts = tiny_prompts() + [p[::-1] for p in tiny_prompts()] if variant == "continuous" else tiny_prompts()
    if variant == "continuous":  # the smaller bucket's steps, so that a draining batch can move there
        eng.warmup([1, 2], max(len(p) for p in prompts), TINY_NEW)
    if variant == "ragged":
        kinds = iter([4, 1, 0, 2, 3] * 1000)
        eng.decoder.controller.choose = lambda prices: next(kinds)
    if variant == "junk-past-accepted":
        drafter, real_update = eng.decoder.drafter, eng.decoder.drafter.update

        def update(accepted, hidden=None, **flags):
            past = torch.arange(hidden.shape[1])[None] > accepted[:, None]
            return real_update(accepted, hidden=hidden.masked_fill(past[..., None], float("nan")), **flags)

        drafter.update = update
    ran = []  # fused: whether each draft step ran on the fused layer's kernels (kernels/triton_fused_layer.py)
    if variant == "fused":
        drafter, real_layer = eng.decoder.drafter, eng.decoder.drafter.draft_layer

        def counted(*args):
            out = real_layer(*args)
            ran.append(out is not None)
            return out

        drafter.draft_layer = counted
    calls = record_proposals(eng)
    n = 12 if variant == "fused" else TINY_NEW
    rows = eng.generate(prompts, n, ignore_eos=True)
    assert (variant != "fused") or (ran and all(ran)), ran
    if variant == "continuous":
        stats = eng.decoder.last_stats
        assert stats.refills == len(prompts) - 2 and stats.shrinks >= 1, (stats.refills, stats.shrinks)
    want = Engine(loaded, parse({})).generate(prompts, n, ignore_eos=True)
    assert [r.tokens for r in rows] == [r.tokens for r in want]
    accepted = {a for r in rows for a in r.accepted}
    assert 0 in accepted and accepted & {2, 3}, accepted
    assert check_proposals(calls, hf, head, loaded.model.embed.detach(), (0, 1, 1)) > 10


def test_fused_greedy_chain_is_the_step_by_step_chain(llama_target, tmp_path):
    """A greedy chain on the fused layer's kernels with each draft's glue in one call (`greedy_draft`: the first
    forward's gathers, argmax, d2t, the next pair's inputs and rows) proposes what the step-by-step chain proposes
    (each draft step's inputs made apart, `_draft_next`), from the same state, for chains of 1 to 4 with and without
    prompt lookup; and the glue compiled (inductor, on the CPU here) equals it eagerly, lookup's copies too."""
    from specpilot.engine.eagle3 import copied_chain, greedy_draft, next_fused_inputs
    from specpilot.engine.model import compiled

    loaded, _ = llama_target
    head_dir = write_head(tmp_path / "head", loaded.hf_config, seed=7)
    for lookup in (0, 2):
        extra = {"layer": "fused"} | ({"drafter": {"kind": "eagle3", "model": str(head_dir), "lookup": lookup}}
                                      if lookup else {})
        eng = Engine(loaded, eagle3_recipe(head_dir, 4, **extra))
        eng.generate(tiny_prompts(), 5, ignore_eos=True)
        drafter, st = eng.decoder.drafter, eng.decoder._state
        state = drafter.snapshot()
        for k in (1, 2, 4):
            drafter.restore(state)
            fused = drafter.propose(st.history, st.lengths, k, SamplingParams(), None)
            drafter.restore(state)
            real, drafter._greedy_fused_chain = drafter._greedy_fused_chain, lambda *args: None
            stepwise = drafter.propose(st.history, st.lengths, k, SamplingParams(), None)
            drafter._greedy_fused_chain = real
            drafter.restore(state)
            assert real(st.history, st.lengths, k) is not None  # (the kernels ran the chain: not a fallback)
            assert torch.equal(fused.tokens, stepwise.tokens) and torch.equal(fused.valid, stepwise.valid), (lookup, k)
            assert fused.tokens.shape == (st.batch, 4 if lookup else k)

    head = drafter.head
    ops, kv = drafter.ops, drafter.cache.kv[:, 0]
    g = torch.Generator().manual_seed(2)
    B, H, Vd = 3, head.cfg.hidden_size, head.lm_head.shape[0]
    lengths, new = torch.tensor([9, 14, 20]), torch.tensor([0, 2, 4])
    first = (torch.randn(B, 5, H, generator=g), torch.randn(B, 5, Vd, generator=g))
    later = (torch.randn(B, 1, H, generator=g), torch.randn(B, 1, Vd, generator=g))
    earlier = [torch.tensor([3, 4, 5])]
    glue = compiled(greedy_draft)
    for out, logits, at, i, before in ((*first, new, 0, None), (*later, None, 2, None), (*later, None, 1, earlier),
                                       (*first, new, 0, [])):
        want, got = greedy_draft(head, out, logits, at, lengths, i, kv, ops, before), glue(
            head, out, logits, at, lengths, i, kv, ops, before)
        assert torch.equal(want[0], got[0])
        if before is None:  # the next step's pair: at position lengths - 1 + i, of this draft and the head's output
            last = out if at is None else out[torch.arange(B), at][:, None]
            ref = next_fused_inputs(head, want[0], last, (lengths - 1 + i)[:, None], kv, ops)
            for a, b, c in zip(want[1], got[1], ref):
                torch.testing.assert_close(a, b)
                torch.testing.assert_close(a, c)
        else:
            assert want[1].tolist() == got[1].tolist() == [len(before) + 1] * B
            assert want[0].shape == (B, len(before) + 1)
    # prompt lookup's copies beside the head's chain of 3: rows that found 2, 3 and 5 of k = 5 (head_k 3)
    chain, found = torch.tensor([[1, 2, 3]] * B), torch.tensor([2, 3, 5])
    copies = torch.arange(5)[None].repeat(B, 1) + 10
    want, got = copied_chain(chain, copies, found, 3), compiled(copied_chain)(chain, copies, found, 3)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert want[0][0, :3].tolist() == [1, 2, 3] and want[0][1].tolist() == want[0][2].tolist() == copies[0].tolist()
    assert want[1].tolist() == [3, 3, 5] and want[3].tolist() == [3, 3, 5] and want[2].tolist() == [False, True, True]


# -- heads that do not fit ----------------------------------------------------------------------------------------
BAD_HEADS = {
    "wrong hidden size": (dict(config_changes={"target_hidden_size": 48}), r"target hidden states of size 48"),
    "wrong vocabulary": (dict(config_changes={"vocab_size": 300}), r"vocab_size 300, the target has 256"),
    "layer id out of range": (dict(aux_ids=[0, 1, 7]), r"target layers \[0, 1, 7\].*layers 0\.\.1"),
    "default layers on a 2-layer target": (dict(aux_key="none"), r"\(the default\)"),
    "vLLM and SGLang ids disagree": (dict(aux_ids=[0, 1, 1], config_changes={
        "eagle_aux_hidden_state_layer_ids": [0, 1, 1]}), r"name different target layers"),
    "vLLM id 0 (the embeddings)": (dict(aux_ids=[0, 1, 2], aux_key="top"), r"target layers \[-1, 0, 1\]"),
    "missing weight": (dict(weight_changes={"midlayer.mlp.up_proj.weight": None}),
                       r"lacks the weight 'midlayer.mlp.up_proj.weight'"),
    "q/k/v over one hidden, not two": (dict(weight_changes={"midlayer.self_attn.k_proj.weight": torch.zeros(32, 64)}),
                                       r"k_proj.weight' has shape \[32, 64\], expected \[32, 128\]"),
    "a second decoder layer": (dict(weight_changes={"midlayers.1.mlp.up_proj.weight": torch.zeros(128, 64)}),
                               r"midlayers.1.mlp.up_proj.weight"),
    "two decoder layers in config": (dict(config_changes={"num_hidden_layers": 2}), r"2 decoder layers"),
    "not an EAGLE-3 head": (dict(config_changes={"architectures": ["LlamaForCausalLMEagle"]}), r"not \["),
    "d2t out of range": (dict(weight_changes={"d2t": torch.full((160,), 200)}),
                         r"d2t maps draft id 56 to target id 256, outside the target's 0\.\.255"),
    "d2t not one to one": (dict(weight_changes={"d2t": -torch.arange(160)}), r"same target id"),
    "t2d not d2t's": (dict(weight_changes={"t2d": torch.ones(256, dtype=torch.bool)}), r"t2d does not mark"),
    "no draft map": (dict(weight_changes={"d2t": None}), r"no d2t map"),
    "SpecForge fc_norm": (dict(config_changes={"fc_norm": True}), r"fc_norm"),
}


@pytest.mark.parametrize("case", list(BAD_HEADS))
def test_bad_heads_are_refused_in_one_line(llama_target, tmp_path, case):
    loaded, _ = llama_target
    kwargs, message = BAD_HEADS[case]
    path = write_head(tmp_path / "head", loaded.hf_config, **kwargs)
    with pytest.raises(SpecPilotError, match=message) as err:
        Engine(loaded, eagle3_recipe(path))
    text = str(err.value)
    assert text.startswith(f"EAGLE-3 head {path}: ") and "\n" not in text


def test_head_files_refused(llama_target, tmp_path):
    loaded, _ = llama_target
    path = write_head(tmp_path / "head", loaded.hf_config)
    (path / "model.safetensors").unlink()
    with pytest.raises(SpecPilotError, match=r"no \*\.safetensors"):
        Eagle3Head(path, loaded.model)
    with pytest.raises(SpecPilotError, match="model not found"):
        Engine(loaded, eagle3_recipe(tmp_path / "nowhere"))


def test_layer_id_conventions(llama_target, tiny_model_dir, tmp_path):
    """eagle_config's ids (SGLang, SpecForge) are layer outputs; top-level ids (vLLM) are layer inputs, id - 1's
    outputs; both may be given when they agree; none: the engines' default, outputs of 1, L // 2 - 1, L - 4."""
    loaded, _ = llama_target
    nested = write_head(tmp_path / "nested", loaded.hf_config, aux_ids=[1, 0, 1])
    assert Eagle3Head(nested, loaded.model).cfg.aux_layers == (1, 0, 1)
    top = write_head(tmp_path / "top", loaded.hf_config, aux_ids=[2, 1, 2], aux_key="top")
    assert Eagle3Head(top, loaded.model).cfg.aux_layers == (1, 0, 1)
    both = write_head(tmp_path / "both", loaded.hf_config, aux_ids=[1, 0, 1],
                      config_changes={"eagle_aux_hidden_state_layer_ids": [2, 1, 2]})
    assert Eagle3Head(both, loaded.model).cfg.aux_layers == (1, 0, 1)
    qwen3 = load(str(tiny_model_dir("qwen3")), "fp32", "cpu")  # 4 layers
    default = write_head(tmp_path / "default", qwen3.hf_config, aux_key="none")
    assert Eagle3Head(default, qwen3.model).cfg.aux_layers == (1, 1, 0)


def test_recipe_keys(tmp_path):
    r = parse({"drafter": {"kind": "eagle3", "model": "heads/h"}, "k": 4,
               "batch": {"controller": "cost", "ragged": True}})
    assert r.drafter.kind == "eagle3" and r.drafter.model == "heads/h"
    with pytest.raises(RecipeError, match="drafter.model"):
        parse({"drafter": {"kind": "eagle3"}, "k": 4})
    with pytest.raises(RecipeError, match="drafter.dtype"):
        parse({"drafter": {"kind": "eagle3", "model": "h", "dtype": "bf16"}, "k": 4})
    assert parse({"drafter": {"kind": "eagle3", "model": "h", "lookup": 3}, "k": 4}).drafter.lookup == 3
    for drafter, says in (({"kind": "ngram", "lookup": 3}, "prompt lookup alone"),
                          ({"kind": "eagle3", "model": "h", "lookup": 7}, "1 to 6 tokens")):
        with pytest.raises(RecipeError, match=f"drafter.lookup.*{says}"):
            parse({"drafter": drafter, "k": 4})
    with pytest.raises(RecipeError, match="drafter.lookup.*'chain'"):
        parse({"drafter": {"kind": "eagle3", "model": "h", "lookup": 2}, "k": 2, "verification": "tree",
               "tree": {"kind": "static", "paths": [[0], [0, 0]]}})
    assert parse({"drafter": {"kind": "eagle3", "model": "h", "lookup": 3, "head_k": 3}, "k": 5}).drafter.head_k == 3
    for drafter, k, says in (({"kind": "eagle3", "model": "h", "head_k": 2}, 4, "needs drafter.lookup"),
                             ({"kind": "eagle3", "model": "h", "lookup": 3, "head_k": 5}, 4, "1 to k \\(4\\)")):
        with pytest.raises(RecipeError, match=f"drafter.head_k.*{says}"):
            parse({"drafter": drafter, "k": k})


def test_fraction_steps_of_a_head_draft_one_token(tiny, tiny_reference, head_dir):
    """The head under the controller with fractions (each kind in turn: half a draft a row, a quarter, three, a
    blind AR step): a fraction step drafts one token a row (each draft is a pass of the head) and packs what its
    budget takes, the tokens are AR's, and every proposal is the reference head's."""
    from specpilot.engine.batch_controller import BLIND_AR

    eng = Engine(tiny.loaded, eagle3_recipe(head_dir, 4, batch={"controller": "cost", "fractions": [0.25, 0.5]}))
    kinds = iter([0.5, 0.25, 3, BLIND_AR] * 1000)
    eng.decoder.controller.choose = lambda prices: next(kinds)  # prices still measured: first use of the bucket
    eng.decoder.prices = {3: {kind: 1.0 for kind in eng.decoder._step_kinds(3)}}
    calls = record_proposals(eng)
    rows = eng.generate(tiny_prompts(), TINY_NEW, ignore_eos=True)
    assert [r.tokens for r in rows] == tiny_reference, tiny.family
    lengths = eng.decoder.last_stats.draft_lengths
    assert {0.25, 0.5, 3} <= set(lengths)
    widths = [c[3].shape[1] for c in calls]
    assert sorted(set(widths)) == [1, 3]  # (fraction steps: one; k' = 3: three)
    if tiny.family == "llama":  # the reference check once (it replays HF per row and step)
        assert check_proposals(calls, tiny.hf, head_dir, tiny.loaded.model.embed.detach(),
                               eng.decoder.drafter.needs_hidden_states) > 0
