"""An engine is a loaded target plus a recipe: it builds the drafter and decoder the recipe names and runs requests."""
from __future__ import annotations

from dataclasses import dataclass

from . import loader
from ..kernels import resolve as resolve_kernels
from .decode import Decoder, RowResult, StopCondition
from .drafters import Drafter, ModelDrafter, NgramDrafter
from .eagle3 import Eagle3Drafter, load_head
from .errors import SpecPilotError
from .loader import LoadedModel
from .recipe import Recipe
from .replay import ReplayDrafter
from .sampling import SamplingParams
from .tree import DynamicTree, TreeShape, tree_from_paths
from .weights import bind_weights, lossless12_weights


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    t, d = target.model.cfg.vocab_size, draft.model.cfg.vocab_size
    if t != d:
        raise SpecPilotError(f"vocabulary mismatch: target has {t} token ids, draft model {draft.source} has {d}")
    if target.tokenizer is not None and draft.tokenizer is not None:
        if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
            raise SpecPilotError(f"vocabulary mismatch: draft model {draft.source} maps tokens to other ids "
                                 f"than the target")


def build_drafter(target: LoadedModel, recipe: Recipe, draft: LoadedModel | None = None) -> Drafter | None:
    spec = recipe.drafter
    if spec.kind == "none":
        return None
    if spec.kind == "ngram":
        return NgramDrafter(spec.max_ngram, spec.min_ngram)
    if spec.kind == "layerskip":
        n = target.model.cfg.n_layers
        if spec.layers >= n:
            raise SpecPilotError(f"recipe key 'drafter.layers': {spec.layers} must be below the target's {n} layers")
        return ModelDrafter(target.model, n_layers=spec.layers, name="layerskip")
    if spec.kind == "eagle3":
        return Eagle3Drafter(load_head(spec.model, target.model), recipe.k, spec.lookup, spec.head_k or recipe.k)
    if spec.kind == "replay":  # its cost: a head's drafting, when drafter.model names one
        cost = Eagle3Drafter(load_head(spec.model, target.model), recipe.k) if spec.model else None
        return ReplayDrafter(spec.acceptance, target.model.cfg.vocab_size, target.model.device, cost,
                             ranks=spec.ranks)
    if draft is None:
        draft = loader.load(spec.model, spec.dtype or target.model.dtype, str(target.model.device))
    check_same_vocabulary(target, draft)
    return ModelDrafter(draft.model, name="model")


def draft_tree(recipe: Recipe) -> TreeShape | DynamicTree | None:
    """The tree a tree recipe verifies (its static shape or its dynamic spec), None for chain verification."""
    if recipe.verification != "tree":
        return None
    t = recipe.tree
    return DynamicTree(t.depth, t.topk, t.tokens) if t.kind == "dynamic" else tree_from_paths(t.paths)


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int = 128


class Engine:
    def __init__(self, target: LoadedModel, recipe: Recipe, draft: LoadedModel | None = None):
        self.target, self.recipe = target, recipe
        ops, compile = resolve_kernels(recipe.kernels), recipe.compile
        packed = lossless12_weights(target.model) if recipe.weights.format == "lossless12" else None
        if packed is not None:
            ops = ops._replace(linear=bind_weights(ops.linear, packed))
        self._ops, self._compile = ops, compile
        self.decoder = Decoder(target.model, build_drafter(target, recipe, draft), recipe.k, recipe.cuda_graphs,
                               target.eos_token_ids, target.tokenizer, compile, ops, recipe.overlap,
                               recipe.compile_mode, recipe.layer, recipe.drafter.adaptive,
                               recipe.drafter.ar_after_miss, recipe.batch.controller, recipe.batch.probe_every,
                               ragged=recipe.batch.ragged, tree=draft_tree(recipe), margin=recipe.batch.margin,
                               refill_at=recipe.batch.refill_at, packed_weights=packed,
                               fractions=tuple(recipe.batch.fractions))

    def encode(self, text: str, chat: bool = True) -> list[int]:
        """Token ids of a user message, through the chat template when the tokenizer has one."""
        tok = self.target.tokenizer
        if tok is None:
            raise SpecPilotError(f"target {self.target.source} has no tokenizer: pass token ids")
        if chat and tok.chat_template:
            return list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False))
        return tok.encode(text)

    def warmup(self, batch_sizes, max_prompt_tokens: int, max_new_tokens: int) -> None:
        """Capture and compile, before anything is timed, every shape that `generate` will run for this many prompts
        at once (at most max_batch_size rows; without continuous batching the last batch of a split may be
        smaller), prompts of up to `max_prompt_tokens` tokens and up to `max_new_tokens` new tokens: afterwards such
        calls capture nothing (decoder.captures stays put). With the batch controller it also measures each kind of
        step's price at each batch size."""
        size = self.recipe.batch.max_batch_size
        sizes = {min(n, size) for n in batch_sizes}
        if not self.decoder.continuous:
            sizes |= {n % size for n in batch_sizes if n > size and n % size}
        self.decoder.warmup(sorted(sizes), max_prompt_tokens, max_new_tokens)

    def prepare(self, prompts: list[list[int]], max_new_tokens: int) -> None:
        """What the drafter needs before these prompts decode, done outside any timed call: a replay drafter's
        references, each prompt's greedy continuation of max_new_tokens tokens (EOS ignored) by AR on the recipe's
        target, layer and kernels, computed once (`generate` calls it too: then inside its time). Other drafters
        need nothing."""
        drafter = self.decoder.drafter
        if not isinstance(drafter, ReplayDrafter):
            return
        todo = drafter.missing(prompts, max_new_tokens)
        if not todo:
            return
        r = self.recipe
        ar = Decoder(self.target.model, None, 0, r.cuda_graphs, self.target.eos_token_ids, None, self._compile,
                     self._ops, False, r.compile_mode, r.layer)
        rows = ar.generate(todo, StopCondition(max_new_tokens, ()), max_batch=r.batch.max_batch_size)
        if drafter.add_references({tuple(p): list(p) + row.tokens for p, row in zip(todo, rows)}):
            self.decoder.forget_steps()  # they read the replaced table

    def generate(self, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
                 stop_strings: tuple[str, ...] = (), seed: int = 0, ignore_eos: bool = False,
                 max_batch: int | None = None) -> list[RowResult]:
        """Decode prompts, at most the recipe's max_batch_size (or `max_batch`, if smaller) at once, continuously
        batched where the drafter allows it (Decoder.generate); results in the prompts' order."""
        self.prepare(prompts, max_new_tokens)
        stop = StopCondition(max_new_tokens, () if ignore_eos else None, tuple(stop_strings))
        size = self.recipe.batch.max_batch_size
        size = size if max_batch is None else min(max_batch, size)
        return self.decoder.generate(prompts, stop, sampling, seed, max_batch=size)
