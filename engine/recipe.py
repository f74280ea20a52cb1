"""Recipes: versioned JSON files that fully describe an engine configuration.

A recipe is the contract between the engine and everything else: the engine runs one, tools measure one, agents
propose changes to one. The schema is the dataclasses below (documented in docs/RECIPE.md); `parse` rejects unknown
keys and wrong types naming the key's path. `ar`, `stock` and `stock-ngram` are built in; anything else is a file
path. `stock` depends on the target (`stock_recipe`): a target that ships a trained drafter head gets the chain its
users deploy with it, any other the n-gram chain that `stock-ngram` always names.
"""
from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..kernels import DEFAULTS as KERNEL_DEFAULTS, check_choice as check_kernel, is_candidate_path
from .errors import SpecPilotError

SCHEMA_VERSION = 1
DRAFTER_KINDS = ("none", "ngram", "layerskip", "model", "eagle3", "replay")
VERIFICATION_KINDS = ("chain", "tree")
TREE_KINDS = ("static", "dynamic")
WEIGHT_FORMATS = ("native", "lossless12")
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
LAYER_KINDS = ("modular", "fused")
CONTROLLERS = ("none", "cost")


# An EAGLE-3 head's prompt lookup (drafter.lookup) tries context tails of up to this many tokens, the longest first
LOOKUP_MAX_NGRAM = 6


class RecipeError(SpecPilotError):
    pass


@dataclass
class DrafterSpec:
    kind: str = "none"
    max_ngram: int = 3  # ngram
    min_ngram: int = 1  # ngram
    layers: int = 0  # layerskip: how many of the target's first layers draft
    model: str = ""  # model: path, alias or cached hub id of the draft model; eagle3 (and replay's cost): a head
    dtype: str = ""  # model: its dtype ("" = the target's)
    adaptive: bool = False  # per-row draft length 1..k: +2 after a fully accepted draft, -1 after a rejection
    ar_after_miss: bool = False  # an AR step (no verification) after a step whose drafter found nothing
    # eagle3: prompt lookup beside the head, the shortest context tail (in tokens) whose earlier occurrence a row's
    # chain copies instead of the head's drafts (engine/eagle3.py, Eagle3Drafter); 0: the head alone
    lookup: int = 0
    # eagle3 with lookup: the head's chain a step when it is shorter than k (0: k); a row whose lookup matched
    # drafts up to k copied tokens, one whose lookup did not the head's head_k
    head_k: int = 0
    acceptance: list = field(default_factory=list)  # replay: a_i, the chance a step accepts >= i drafts, i = 1..k
    # replay on a tree: per depth i, the chances that the target's token is the drafter's 2nd, 3rd, ... candidate
    # there (its 1st is acceptance's a_i / a_{i-1}), given that the path to it was right
    ranks: list = field(default_factory=list)


@dataclass
class TreeSpec:
    kind: str = "static"  # static: the same tree shape every step, from `paths`; dynamic: EAGLE-2's, per row and step
    paths: list = field(default_factory=list)  # child-rank paths from the root, e.g. [[0], [0, 0], [1]] (engine/tree.py)
    depth: int = 0  # dynamic: levels of drafts (= k)
    topk: int = 0  # dynamic: drafts after each expanded node, and nodes expanded a level
    tokens: int = 0  # dynamic: nodes verified a row, the root included (SGLang's speculative_num_draft_tokens)


@dataclass
class WeightsSpec:
    format: str = "native"  # native: the target's own dtype; lossless12: bf16 re-encoded in 12 bits (bit-exact)


@dataclass
class BatchSpec:
    max_batch_size: int = 64  # rows decoded at once; more requests wait for a row (continuous batching)
    controller: str = "none"  # cost: each step's draft length 0..k from measured acceptance and step prices
    probe_every: int = 16  # cost: after this many AR steps in a row, one verifies k (after shorter: one more);
    # after probes that did not pay, up to 8 times as many
    margin: float = 0.05  # cost: how much more a verifying step must be expected to yield a second than an AR step
    ragged: bool = False  # cost: verification packs each row's live tokens; k' caps the batch's drafts at k' x B
    # cost, greedy chains: kinds below one draft a row, each a step verifying f x B drafts packed across the batch
    # (at B = 16, 0.5 verifies 8 drafts in a step of 24 tokens where k' = 1 has 32)
    fractions: list = field(default_factory=list)
    refill_at: float = 0.0  # continuous batching: waiting requests start once this share of the rows is free (0: as
    # soon as one is), so that rows ending at different steps start their next requests in fewer, larger groups


@dataclass
class Recipe:
    name: str = "custom"
    specpilot_recipe: int = SCHEMA_VERSION
    description: str = ""
    drafter: DrafterSpec = field(default_factory=DrafterSpec)
    k: int = 0  # draft tokens verified per target forward
    verification: str = "chain"  # chain: k drafts a row in a line; tree: the nodes of `tree` (k = its depth)
    tree: TreeSpec = field(default_factory=TreeSpec)
    weights: WeightsSpec = field(default_factory=WeightsSpec)
    kernels: dict[str, str] = field(default_factory=lambda: dict(KERNEL_DEFAULTS))  # slot -> implementation
    layer: str = "modular"  # modular: each layer from the kernel slots; fused: five Triton kernels a layer per step
    cuda_graphs: bool = True  # CUDA only: each step, and the prefill, replayed as one captured graph
    compile: bool = True  # CUDA only: step-shaped forwards compiled by torch.compile (inductor)
    compile_mode: str = "default"  # torch.compile mode; "max-autotune-no-cudagraphs" autotunes the small GEMMs
    overlap: bool = False  # the host reads step i's tokens while the device runs step i+1
    batch: BatchSpec = field(default_factory=BatchSpec)
    measured: dict = field(default_factory=dict)  # results attached by tools (speedup, gate report); not read

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())


_NGRAM_STOCK = dict(description="chain speculative decoding with an n-gram prompt-lookup drafter",
                    drafter=DrafterSpec(kind="ngram", max_ngram=3, min_ngram=1), k=4)
BUILTIN = {
    "ar": Recipe(name="ar", description="autoregressive greedy decoding, no speculation"),
    # for a target without a packaged head; `stock_recipe(target)` says which stock a target gets
    "stock": Recipe(name="stock", **_NGRAM_STOCK),
    "stock-ngram": Recipe(name="stock-ngram", **_NGRAM_STOCK),
}
# Drafts a step of the stock chain with a trained EAGLE-3 head: vLLM's EAGLE-3 example speculates 2 tokens a step
# (docs.vllm.ai, features/speculative_decoding/eagle: "num_speculative_tokens": 2), with the rest of the recipe at
# its defaults (the modular layer, no overlap), as a user of vLLM or SGLang would first deploy the head.
STOCK_HEAD_K = 2


def _build(cls, data, path: str):
    if not isinstance(data, dict):
        raise RecipeError(f"recipe key {path or '<root>'}: expected an object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise RecipeError(f"recipe key {path + key!r} is unknown (allowed: {', '.join(sorted(names))})")
    values = {}
    for key, value in data.items():
        values[key] = _typed(hints[key], value, path + key)
    return cls(**values)


def _typed(hint, value, path: str):
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, path + ".")
    if origin is dict:
        if not isinstance(value, dict):
            raise RecipeError(f"recipe key {path!r}: expected an object, got {type(value).__name__}")
        args = typing.get_args(hint)
        if args:
            for k, v in value.items():
                if not isinstance(v, args[1]):
                    raise RecipeError(f"recipe key {path}.{k!r}: expected {args[1].__name__}, got {type(v).__name__}")
        return dict(value)
    if origin in (typing.Union, types.UnionType):
        hint = tuple(typing.get_args(hint))
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)  # JSON writes 0.0 as 0
    ok = isinstance(value, hint) and not (isinstance(value, bool) and hint in (int, float))
    if not ok:
        want = hint.__name__ if isinstance(hint, type) else " or ".join(h.__name__ for h in hint)
        raise RecipeError(f"recipe key {path!r}: expected {want}, got {type(value).__name__} {value!r}")
    return value


def _check(r: Recipe) -> Recipe:
    def bad(key, msg):
        raise RecipeError(f"recipe key {key!r}: {msg}")

    if r.specpilot_recipe != SCHEMA_VERSION:
        bad("specpilot_recipe", f"version {r.specpilot_recipe} is not supported (this SpecPilot reads {SCHEMA_VERSION})")
    if r.drafter.kind not in DRAFTER_KINDS:
        bad("drafter.kind", f"{r.drafter.kind!r} is not one of {', '.join(DRAFTER_KINDS)}")
    if r.verification not in VERIFICATION_KINDS:
        bad("verification", f"{r.verification!r} is not one of {', '.join(VERIFICATION_KINDS)}")
    if r.verification == "tree":
        _check_tree(r, bad)
    if r.weights.format not in WEIGHT_FORMATS:
        bad("weights.format", f"{r.weights.format!r} is not one of {', '.join(WEIGHT_FORMATS)}")
    if r.drafter.kind == "none" and r.k != 0:
        bad("k", "must be 0 without a drafter")
    if r.drafter.kind != "none" and not 1 <= r.k <= 64:
        bad("k", f"must be between 1 and 64 with a drafter, got {r.k}")
    if r.drafter.kind == "ngram" and not 1 <= r.drafter.min_ngram <= r.drafter.max_ngram:
        bad("drafter.min_ngram", "needs 1 <= min_ngram <= max_ngram")
    if r.drafter.kind == "layerskip" and r.drafter.layers < 1:
        bad("drafter.layers", "a layer-skip drafter needs layers >= 1")
    if r.drafter.kind == "model" and not r.drafter.model:
        bad("drafter.model", "a model drafter needs the draft model's path or alias")
    if r.drafter.kind == "eagle3" and not r.drafter.model:
        bad("drafter.model", "an eagle3 drafter needs the head's directory (config.json + *.safetensors)")
    if r.drafter.kind == "replay":
        _check_replay(r, bad)
    elif r.drafter.acceptance:
        bad("drafter.acceptance", "is a replay drafter's profile (drafter.kind 'replay')")
    elif r.drafter.ranks:
        bad("drafter.ranks", "is a replay drafter's profile (drafter.kind 'replay')")
    if r.drafter.kind == "eagle3" and r.drafter.dtype:
        bad("drafter.dtype", "an eagle3 head runs in the target's dtype (it reads the target's hidden states)")
    if r.drafter.lookup:
        if r.drafter.kind != "eagle3":
            bad("drafter.lookup", "is an EAGLE-3 head's prompt lookup (drafter.kind 'eagle3'); prompt lookup alone "
                                  "is drafter.kind 'ngram'")
        if not 1 <= r.drafter.lookup <= LOOKUP_MAX_NGRAM:
            bad("drafter.lookup", f"the shortest context tail that prompt lookup copies after: 1 to "
                                  f"{LOOKUP_MAX_NGRAM} tokens (0: none), got {r.drafter.lookup}")
        if r.verification == "tree":
            bad("drafter.lookup", "replaces a chain's drafts: verification 'chain'")
    if r.drafter.head_k:
        if not r.drafter.lookup:
            bad("drafter.head_k", "caps an EAGLE-3 head's chain below k for prompt lookup's longer one: it needs "
                                  "drafter.lookup (without it, set k)")
        if not 1 <= r.drafter.head_k <= r.k:
            bad("drafter.head_k", f"the head's drafts a step: 1 to k ({r.k}), got {r.drafter.head_k}")
    for slot, impl in r.kernels.items():
        why = check_kernel(slot, impl)
        if why:
            bad(f"kernels.{slot}", why)
    if r.weights.format == "lossless12" and r.kernels.get("linear", KERNEL_DEFAULTS["linear"]) == "builtin:torch":
        bad("kernels.linear", "weights.format 'lossless12' needs a linear kernel that reads 12-bit weights "
                              "(builtin:lossless12 or a candidate file)")
    if r.layer not in LAYER_KINDS:
        bad("layer", f"{r.layer!r} is not one of {', '.join(LAYER_KINDS)}")
    if r.compile_mode not in COMPILE_MODES:
        bad("compile_mode", f"{r.compile_mode!r} is not one of {', '.join(COMPILE_MODES)}")
    if r.batch.max_batch_size < 1:
        bad("batch.max_batch_size", "must be >= 1")
    if r.batch.controller not in CONTROLLERS:
        bad("batch.controller", f"{r.batch.controller!r} is not one of {', '.join(CONTROLLERS)}")
    if r.batch.controller != "none" and r.drafter.kind == "none":
        bad("batch.controller", "chooses a draft length: it needs a drafter")
    if r.batch.probe_every < 1:
        bad("batch.probe_every", "must be >= 1")
    if not 0 <= r.batch.margin <= 1:
        bad("batch.margin", f"{r.batch.margin} must be between 0 and 1 (a share of an AR step's rate)")
    if not 0 <= r.batch.refill_at <= 0.5:
        bad("batch.refill_at", f"{r.batch.refill_at} must be between 0 and 0.5 (a share of the batch's rows)")
    for f in r.batch.fractions:
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f < 1:
            bad("batch.fractions", f"each must be a number strictly between 0 and 1 (drafts a row), got {f!r}")
    if r.batch.fractions and r.batch.controller != "cost":
        bad("batch.fractions", "are kinds of step the controller chooses: they need batch.controller 'cost'")
    if r.batch.fractions and r.verification != "chain":
        bad("batch.fractions", "pack a chain's drafts: they need verification 'chain'")
    if r.batch.ragged and r.batch.controller != "cost":
        bad("batch.ragged", "packs up to k' x B drafts a step, k' chosen by the controller: it needs "
                            "batch.controller 'cost'")
    return r


def _check_replay(r: Recipe, bad) -> None:
    """A replay drafter's profile: a_1..a_k, the chance that a step accepts at least i drafts (as the bench's
    acceptance_by_position), each in [0, 1] and none above the one before."""
    a = r.drafter.acceptance
    if len(a) != r.k:
        bad("drafter.acceptance", f"needs k = {r.k} values (a_i: the chance a step accepts at least i drafts), "
                                  f"got {len(a)}")
    for i, v in enumerate(a):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
            bad("drafter.acceptance", f"value {i + 1} must be a number in [0, 1], got {v!r}")
        if i and v > a[i - 1]:
            bad("drafter.acceptance", f"value {i + 1} ({v}) is above value {i} ({a[i - 1]}): a step cannot accept "
                                      f"{i + 1} drafts more often than {i}")
    ranks = r.drafter.ranks
    if not ranks:
        return
    if r.verification != "tree" or r.tree.kind != "static":
        bad("drafter.ranks", "places the target's token among a static tree's siblings: it needs verification "
                             "'tree' with tree.kind 'static'")
    if not isinstance(ranks, list) or len(ranks) > r.k:
        bad("drafter.ranks", f"needs at most k = {r.k} lists (one a depth), got {ranks!r}")
    firsts = [v / before if before > 0 else 0.0 for v, before in zip(a, [1.0, *a])]  # (replay.kept_probabilities)
    for i, (first, more) in enumerate(zip(firsts, ranks)):
        if not isinstance(more, list) or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1
                                             for v in more):
            bad("drafter.ranks", f"depth {i + 1} must be a list of numbers in [0, 1], got {more!r}")
        if first + sum(more) > 1 + 1e-9:
            bad("drafter.ranks", f"depth {i + 1}: the 1st candidate's {first:.3g} (acceptance) and these "
                                 f"{sum(more):.3g} add up to more than 1")


def _check_tree(r: Recipe, bad) -> None:
    """A tree recipe: a static tree of valid paths whose depth is k, drafted by the n-gram drafter (its several
    matches are the branches) or an EAGLE-3 head (its ranked drafts are), or a dynamic tree of depth k drafted by an
    EAGLE-3 head (its draft probabilities shape it); greedy-only mechanisms that do not change the step's shape left
    out."""
    from .tree import tree_from_paths

    t = r.tree
    if t.kind not in TREE_KINDS:
        bad("tree.kind", f"{t.kind!r} is not one of {', '.join(TREE_KINDS)}")
    if t.kind == "dynamic":
        # The n-gram drafter's matches have no probabilities to rank them by (a static tree of chains uses them)
        if r.drafter.kind != "eagle3":
            bad("tree.kind", f"'dynamic' trees are shaped by draft probabilities: drafted by an EAGLE-3 head, not "
                             f"drafter.kind {r.drafter.kind!r} (a static tree takes the n-gram drafter's matches)")
        if t.paths:
            bad("tree.paths", "a dynamic tree's shape comes from depth, topk and tokens: no paths")
        for key in ("depth", "topk"):
            if getattr(t, key) < 1:
                bad(f"tree.{key}", f"a dynamic tree needs {key} >= 1, got {getattr(t, key)}")
        most = min(256, 1 + t.topk + (t.depth - 1) * t.topk ** 2)  # the root and every candidate (DynamicTree)
        if not 2 <= t.tokens <= most:
            bad("tree.tokens", f"counts the verified nodes, the root included: must be between 2 and {most} (at most "
                               f"1 + topk + (depth - 1) x topk^2 candidates, and 256), got {t.tokens}")
        depth = t.depth
    else:
        for key in ("depth", "topk", "tokens"):
            if getattr(t, key):
                bad(f"tree.{key}", "is a dynamic tree's; a static tree's shape comes from its paths")
        if not t.paths:
            bad("tree.paths", "a static tree needs paths, e.g. [[0], [0, 0], [1]]")
        try:
            depth = tree_from_paths(t.paths).depth
        except (TypeError, ValueError) as e:
            bad("tree.paths", str(e))
    if r.k != depth:
        bad("k", f"must equal the tree's depth {depth} with verification 'tree', got {r.k}")
    if r.drafter.kind not in ("ngram", "eagle3", "replay"):
        bad("verification", f"'tree' is drafted by the n-gram drafter, an EAGLE-3 head or the replay drafter; "
                            f"drafter.kind {r.drafter.kind!r} drafts chains")
    for key, on in (("drafter.adaptive", r.drafter.adaptive), ("batch.controller", r.batch.controller != "none")):
        if on:
            bad(key, "works on chains of drafts; verification 'tree' verifies the whole tree every step")


def parse(data: dict) -> Recipe:
    return _check(_build(Recipe, data, ""))


def reported_name(name: str, drafter_kind: str) -> str:
    """The name a recipe's figures are reported under (the bench's systems, the grid's ranking, optimize's
    summary): a replay recipe's says `replay`, since its acceptance is replayed from a profile, not measured."""
    return f"{name}-replay" if drafter_kind == "replay" and "replay" not in name else name


def stock_recipe(target: str | None) -> Recipe:
    """`stock` for `target` (an alias, GGUF or directory as the user named it): with a head that ships for it
    (engine/loader.packaged_heads), a chain of STOCK_HEAD_K drafts from that head; else, or with no target, the
    n-gram chain (`stock-ngram`)."""
    from .loader import packaged_heads  # here: reading a recipe needs none of the loader's imports

    heads = packaged_heads(target) if target else []
    if not heads:
        return parse(asdict(BUILTIN["stock"]))
    return parse(asdict(Recipe(name="stock", k=STOCK_HEAD_K, drafter=DrafterSpec(kind="eagle3", model=heads[0]),
                               description=f"chain speculative decoding with the packaged EAGLE-3 head {heads[0]}, "
                                           f"{STOCK_HEAD_K} drafts a step")))


def load_recipe(spec: str | Path, target: str | None = None) -> Recipe:
    """A built-in recipe name (`ar`, `stock`, `stock-ngram`) or a recipe file path; `stock` is `target`'s
    (`stock_recipe`)."""
    if spec == "stock":
        return stock_recipe(target)
    if isinstance(spec, str) and spec in BUILTIN:
        return parse(asdict(BUILTIN[spec]))
    path = Path(spec)
    if not path.is_file():
        raise RecipeError(f"recipe {str(spec)!r} is neither a built-in ({', '.join(BUILTIN)}) nor a file")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RecipeError(f"recipe file {path} is not valid JSON: {e}") from e
    return parse(data)


def with_absolute_paths(recipe: Recipe) -> Recipe:
    """The recipe as a process with another working directory must see it: kernel files and the draft model made
    absolute (a draft model named by alias, GGUF or hub id resolved to its directory here; as given when it cannot
    be, and the other process says why)."""
    from . import loader  # here, not at the top: reading and checking a recipe needs none of the loader's imports

    def model_dir(spec: str) -> str:
        try:
            return str(loader.source_dir(spec).resolve())
        except SpecPilotError:
            return spec

    kernels = {slot: str(Path(impl).resolve()) if is_candidate_path(impl) and Path(impl).is_file() else impl
               for slot, impl in recipe.kernels.items()}
    drafter = dataclasses.replace(recipe.drafter, model=model_dir(recipe.drafter.model)) if recipe.drafter.model \
        else recipe.drafter
    return dataclasses.replace(recipe, kernels=kernels, drafter=drafter)
