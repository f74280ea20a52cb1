"""`specpilot grid`: the space file's expansion (order, names, constraints, parser refusals, duplicates, limits),
its one-line errors, the shipped SmolLM2 grid, and one tiny end-to-end run on CPU in which a recipe that fails the
token-forcing gate is excluded while the others are measured."""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from conftest import tiny_smol_vocab_dir
from specpilot import cli
from specpilot.engine.recipe import parse
from specpilot.tools.grid.space import SpaceError, expand, load_space

SHIPPED_COUNT = 51  # docs/GRID.md names this number


def write(tmp_path: Path, space) -> str:
    path = tmp_path / "space.json"
    path.write_text(space if isinstance(space, str) else json.dumps(space))
    return str(path)


NGRAM = {"drafter": {"kind": "ngram"}}


def test_expansion_order_and_names():
    e = expand({"base": NGRAM, "axes": {"k": [2, 4], "drafter.adaptive": [False, True], "layer": ["modular", "fused"]}})
    assert [r.name for r in e.recipes] == [
        "k2-modular", "k2-fused", "k2-adapt-modular", "k2-adapt-fused",
        "k4-modular", "k4-fused", "k4-adapt-modular", "k4-adapt-fused"]
    assert e.recipes[3].recipe == {"drafter": {"kind": "ngram", "adaptive": True}, "k": 2, "layer": "fused",
                                   "name": "k2-adapt-fused"}
    assert all(re.fullmatch(r"[A-Za-z0-9_.-]+", r.name) for r in e.recipes)
    assert e.combinations == 8 and not (e.excluded or e.refused or e.duplicates)


def test_variants_are_subgrids_over_the_top_base():
    e = expand({"base": {"overlap": True}, "axes": {"k": [2]},
                "variants": [{"name": "ng", "base": NGRAM, "axes": {"drafter.max_ngram": [2, 4]}},
                             {"name": "ls", "base": {"drafter": {"kind": "layerskip", "layers": 1}}}]})
    assert [r.name for r in e.recipes] == ["ng-k2-ng2", "ng-k2-ng4", "ls-k2"]
    assert e.recipes[2].recipe["overlap"] is True and e.recipes[2].variant == "ls"


def test_names_stay_unique():
    e = expand({"base": NGRAM, "axes": {"k": [2], "kernels.attention": ["builtin:math", "builtin/math"]}})
    assert [r.name for r in e.recipes] == ["k2-attention-builtin_math"]
    assert [s.name for s in e.refused] == ["k2-attention-builtin_math-2"]  # refused, but named apart all the same
    e = expand({"axes": {"drafter.kind": ["none"], "k": [0]}, "variants": [{"name": "ar"}]})
    assert [r.name for r in e.recipes] == ["ar-none-k0"]
    e = expand({"variants": [{"name": "ar"}]})
    assert [r.name for r in e.recipes] == ["ar-2"]  # the bench's own system names are reserved


def test_constraints_exclude_exactly_the_matching_combinations():
    e = expand({"base": NGRAM, "axes": {"layer": ["modular", "fused"], "overlap": [False, True], "k": [1, 2]},
                "constraints": [{"if": {"layer": "modular"}, "then": {"overlap": True}},
                                {"if": {"k": 2, "overlap": True}, "then": {"layer": "fused"}}]})
    kept = {(r.values["layer"], r.values["overlap"], r.values["k"]) for r in e.recipes}
    assert kept == {("modular", True, 1), ("fused", False, 1), ("fused", False, 2), ("fused", True, 1),
                    ("fused", True, 2)}
    assert sorted(s.name for s in e.excluded) == ["modular-k1", "modular-k2", "modular-ovl-k2"]
    assert all(s.reason.startswith("constraint if") for s in e.excluded)


def test_constraints_see_the_defaults():
    # overlap is left out of the recipe: its default (false) is what `if` compares with
    e = expand({"base": NGRAM, "axes": {"k": [1, 2]}, "constraints": [{"if": {"overlap": False}, "then": {"k": 1}}]})
    assert [r.name for r in e.recipes] == ["k1"] and [s.name for s in e.excluded] == ["k2"]


def test_refused_combinations_are_skipped_with_the_parsers_reason():
    e = expand({"axes": {"drafter.kind": ["none", "ngram"], "k": [0, 2]}})
    assert [r.name for r in e.recipes] == ["none-k0", "ngram-k2"]
    reasons = {s.name: s.reason for s in e.refused}
    assert reasons == {"none-k2": "recipe key 'k': must be 0 without a drafter",
                       "ngram-k0": "recipe key 'k': must be between 1 and 64 with a drafter, got 0"}


def test_duplicates_are_dropped():
    # max_ngram 3 is the default: the two recipes are the same engine configuration
    e = expand({"base": {**NGRAM, "k": 2}, "axes": {"drafter.max_ngram": [3, 4], "drafter.min_ngram": [1]},
                "variants": [{"name": "a"}, {"name": "b", "base": {"drafter": {"max_ngram": 3}}}]})
    assert [r.name for r in e.recipes] == ["a-ng3-mn1", "a-ng4-mn1"]
    assert [(s.name, s.reason) for s in e.duplicates] == [("b-ng3-mn1", "the same recipe as a-ng3-mn1"),
                                                          ("b-ng4-mn1", "the same recipe as a-ng4-mn1")]


def test_max_recipes_refuses_a_large_space(tmp_path, capsys):
    space = write(tmp_path, {"base": NGRAM, "axes": {"k": list(range(1, 11)), "drafter.max_ngram": [3, 4]}})
    with pytest.raises(SpaceError, match="expands to 20 recipes, more than --max-recipes 19"):
        expand(load_space(space), 19)
    assert len(expand(load_space(space), 20).recipes) == 20
    assert cli.main(["grid", "--space", space, "--out", str(tmp_path / "out"), "--max-recipes", "5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "expands to 20 recipes, more than --max-recipes 5" in err[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("space,message", [
    ("{not json", "is not valid JSON"),
    ({"base": {}, "axis": {}}, "key 'axis' is unknown"),
    ({"axes": {"k": []}}, "axis 'k' has no values"),
    ({"axes": {"k": 4}}, "axis 'k': expected a list of values, got int"),
    ({"base": {"k": 4}, "axes": {"k.x": [1]}}, "key 'k.x' goes through 'k', which is int 4, not an object"),
    ({"variants": [{"name": "a", "axis": {}}]}, "variants[0]: key 'axis' is unknown"),
    ({"constraints": [{"if": {"drafter.kindd": "ngram"}, "then": {"k": 1}}]}, "key 'drafter.kindd' is not a recipe key"),
    ({"constraints": [{"if": {"k": 1}}]}, "'then': expected an object, got NoneType"),
    ([1, 2], "expected an object, got list"),
])
def test_bad_space_files_give_one_clear_line(tmp_path, capsys, space, message):
    path = write(tmp_path, space)
    with pytest.raises(SpaceError, match=re.escape(message)):
        expand(load_space(path))
    assert cli.main(["grid", "--space", path, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("specpilot: error: ") and message in err[0]


def test_missing_space_names_the_shipped_grids():
    shipped = r"\(llama-3.1-8b-head, llama-3.1-8b-replay, smollm2\)"
    with pytest.raises(SpaceError, match=r"neither a file nor a shipped grid " + shipped):
        load_space("no-such-space")


def test_shipped_grid_expands_to_the_documented_count():
    e = expand(load_space("smollm2"), 64)
    assert len(e.recipes) == SHIPPED_COUNT and e.combinations == 96 and not e.refused
    assert f"**{SHIPPED_COUNT} recipes**" in (Path(cli.__file__).parent / "docs" / "GRID.md").read_text()
    for r in e.recipes:
        assert parse(r.recipe).name == r.name
    assert not any(r.values["layer"] == "modular" and (r.values["drafter.adaptive"] or not r.values["overlap"]
                                                       or r.values["drafter.min_ngram"] != 1
                                                       or r.values["drafter.ar_after_miss"])
                   for r in e.recipes)
    assert sorted({r.values["k"] for r in e.recipes}) == [2, 3, 4]


# -- a tiny end-to-end run -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> Path:
    """A random 1-layer Llama with SmolLM2's vocabulary, saved with SmolLM2's tokenizer (the gate needs one). One
    layer: the grid's reference (`ar-fused-overlap`) runs the fused layer in Triton's interpreter, seconds a layer
    a step, and what the grid does with the numbers does not depend on the model's depth."""
    from specpilot.tools.gate import reference as gr

    path = tiny_smol_vocab_dir(tmp_path_factory, "grid-target", 3, 64, 1, tied=False)
    gr.load_tokenizer(gr.model_source("smollm2-135m")).save_pretrained(path)
    return path


def test_tiny_grid_gates_measures_and_ranks(tiny_target, tiny_model_dir, tmp_path):
    # bad-k2's draft model has another vocabulary: its candidate cannot start, a gate failure, not an error of the run
    space = write(tmp_path, {"base": {"drafter": {"kind": "ngram"}}, "axes": {"k": [1, 2]},
                             "variants": [{"name": "ng", "axes": {"k": [1, 3]}},
                                          {"name": "bad", "base": {"drafter": {"kind": "model",
                                                                               "model": str(tiny_model_dir("llama"))}},
                                           "axes": {"k": [2]}}],
                             "constraints": [{"if": {"k": 3}, "then": {"layer": "fused"}}]})
    out = tmp_path / "out"
    assert cli.main(["grid", "--target", str(tiny_target), "--workload", "code", "--space", space, "--out", str(out),
                     "--limit", "1", "--max-new-tokens", "8", "--repeats", "1", "--gate-limit", "1",
                     "--gate-tokens", "8", "--gate-workers", "2", "--device", "cpu"]) == 0
    results = json.loads((out / "results.json").read_text())
    grid = results["grid"]
    assert [r["name"] for r in grid["expansion"]["recipes"]] == ["ng-k1", "bad-k2"]
    assert [s["name"] for s in grid["expansion"]["excluded"]] == ["ng-k3"]
    verdicts = {g["name"]: g for g in grid["gate"]}
    assert verdicts["ng-k1"]["verdict"] == "pass"
    assert verdicts["bad-k2"]["verdict"] == "fail" and "vocabulary mismatch" in verdicts["bad-k2"]["reason"]
    assert grid["measured"] == ["ng-k1"]
    systems = {r["system"] for r in results["runs"]}
    assert systems == {"ar", "stock", "ng-k1", "ar-fused-overlap"}  # the failing recipe was never measured
    [cell] = grid["ranking"]
    ref = cell["reference_tokens_per_s"]
    for row in cell["rows"]:
        assert row["ratio"] == pytest.approx(row["tokens_per_s"] / ref)
        assert row["identical_to_ar"] == 1.0
    assert grid["best"]["name"] == "ng-k1"
    best = json.loads((out / "best.json").read_text())
    assert parse(best).name == "ng-k1" and best["k"] == 1
    report = (out / "report.md").read_text()
    assert "**Best: `ng-k1`**" in report and "`bad-k2`: fail: code: " in report
    assert "`ng-k3`: constraint if" in report and "specpilot grid --target" in report
    assert (out / "bench" / "results.json").is_file()


def test_the_synthetic_8b_grid_replays_chains_in_both_weight_formats(tmp_path):
    """The shipped yardstick for synthetic:llama-3.1-8b: replayed chains of k = 2-4 (their acceptance the profile's
    first k positions) on both layers, the chains in 12-bit weights and 12-bit AR on both layers; every combination a
    recipe, named as the bench names its system (a replay recipe's name says `replay`; the H200's first grid ranked
    its replay recipes as the bench's own and named 12-bit AR the best)."""
    from specpilot.tools.bench.run import recipes_to_measure

    e = expand(load_space("llama-3.1-8b-replay"), 64)
    files = []
    for r in e.recipes:
        files.append(tmp_path / f"{r.name}.json")
        files[-1].write_text(json.dumps(r.recipe))
    assert [name for name, _ in recipes_to_measure([str(f) for f in files], None)][2:] == [r.name for r in e.recipes]
    assert sum("replay" in r.name for r in e.recipes) == 9
    assert len(e.recipes) == 11 and not (e.refused or e.excluded or e.duplicates)
    assert "**11 recipes**" in (Path(cli.__file__).parent / "docs" / "GRID.md").read_text()
    recipes = [parse(r.recipe) for r in e.recipes]
    drafting = [r for r in recipes if r.drafter.kind != "none"]
    assert all(r.drafter.kind == "replay" and len(r.drafter.acceptance) == r.k for r in drafting)
    assert {r.k for r in drafting} == {2, 3, 4}
    assert sum(r.weights.format == "lossless12" for r in recipes) == 5
    assert {r.layer for r in recipes if r.weights.format == "lossless12" and r.k == 0} == {"modular", "fused"}


def test_gates_run_several_at_once_after_the_first_alone(tmp_path, monkeypatch):
    """--gate-workers N: the first recipe is gated alone (it computes the references the others read), then up to N
    at a time; verdicts are written as they come and kept in the space's order, and a failing recipe is left out."""
    import threading
    from argparse import Namespace

    from specpilot.tools.grid import run as grid_run
    from specpilot.tools.grid.space import expand, load_space

    expansion = expand(load_space(write(tmp_path, {"base": {"drafter": {"kind": "ngram"}},
                                                   "axes": {"k": [1, 2, 3, 4, 5, 6]}})), 64)
    names = [r.name for r in expansion.recipes]
    running, most, spans, lock = set(), [0], {}, threading.Lock()

    def fake_gate(args, name, recipe_file, workloads, device, dtype, salt, out):
        with lock:
            running.add(name)
            most[0] = max(most[0], len(running))
            spans[name] = [time.perf_counter(), None]
        time.sleep(0.05 * (len(names) - names.index(name)))  # later recipes finish first
        with lock:
            running.discard(name)
            spans[name][1] = time.perf_counter()
        return {"verdict": "fail" if name == names[2] else "pass", "reason": None, "seconds": 0.0}

    monkeypatch.setattr(grid_run, "gate_one", fake_gate)
    grid = {"gate": []}
    passing = grid_run.gate_all(Namespace(gate_workers=3), expansion, dict.fromkeys(names), ["code"], "cpu", "fp32",
                                "s", tmp_path, grid)
    assert passing == [n for n in names if n != names[2]]
    assert [g["name"] for g in grid["gate"]] == names  # the space's order, whatever order they finished in
    assert most[0] == 3
    assert all(spans[n][0] >= spans[names[0]][1] for n in names[1:])  # the first ran alone
    written = json.loads((tmp_path / "results.json").read_text())["grid"]["gate"]
    assert [g["name"] for g in written] == names


def test_a_second_run_into_the_same_dir_keeps_the_gate_verdicts(tmp_path, monkeypatch):
    """A grid killed after its gate (here: its bench fails) and run again into the same DIR gates only what has no
    verdict yet, an error, or a crashed candidate; another space, or other gate settings, gate everything."""
    from specpilot.tools.grid import run as grid_run

    space = write(tmp_path, {"base": {"drafter": {"kind": "ngram"}}, "axes": {"k": [1, 2, 3, 4]}})
    gated, runs = [], []

    def fake_gate(args, name, recipe_file, workloads, device, dtype, salt, out):
        gated.append(name)
        if len(runs) == 1 and name in ("k3", "k4"):  # an error, a crash: gated again
            return {"verdict": "error" if name == "k3" else "fail", "reason": None, "seconds": 0.0, "kind": "crashed"}
        verdict = {"k1": "pass", "k2": "fail"}.get(name, "pass")
        return {"verdict": verdict, "reason": None, "seconds": 0.0, "kind": "divergence" if verdict == "fail" else None}

    def killed_bench(args, sandbox=None):
        raise RuntimeError("killed")

    monkeypatch.setattr(grid_run, "gate_one", fake_gate)
    monkeypatch.setattr(grid_run.bench_run, "run_bench", killed_bench)

    def grid(*extra) -> None:
        runs.append(extra)
        args = cli.build_parser().parse_args(["grid", "--target", "t", "--workload", "code", "--space", space,
                                              "--out", str(tmp_path / "out"), "--device", "cpu", *extra])
        with pytest.raises(RuntimeError, match="killed"):
            grid_run.run_grid(args)

    grid()
    names = [r["name"] for r in json.loads((tmp_path / "out" / "results.json").read_text())["grid"]["expansion"]
             ["recipes"]]
    assert sorted(gated) == sorted(names) and len(names) == 4
    gated.clear()
    grid("--gate-workers", "2")  # the workers do not change a verdict
    errored = [n for n in names if n not in ("k1", "k2")]
    assert gated == errored
    verdicts = json.loads((tmp_path / "out" / "results.json").read_text())["grid"]["gate"]
    assert [(v["name"], v["verdict"]) for v in verdicts] == [("k1", "pass"), ("k2", "fail"), ("k3", "pass"),
                                                              ("k4", "pass")]
    gated.clear()
    grid("--gate-tokens", "16")  # another gate: every recipe again
    assert sorted(gated) == sorted(names)


def test_the_synthetic_8b_grid_at_the_packaged_heads_profile():
    """`--space llama-3.1-8b-head`, the yardstick for `optimize --target synthetic:llama-3.1-8b --acceptance
    smollm2-135m-eagle3`: replayed chains of k = 2-4 at the packaged head's measured profile (its first k positions)
    and the best static trees of 15 and 31 drafts for it (the profile's ranks included), on the fused layer; the
    file's profile is the one shipped beside the head and its trees what `best_static_tree` builds from it."""
    from specpilot.engine.loader import PACKAGED_HEAD
    from specpilot.engine.replay import best_static_tree

    profile = json.loads((PACKAGED_HEAD / "replay_profile.json").read_text())
    e = expand(load_space("llama-3.1-8b-head"), 64)
    assert [r.name for r in e.recipes] == ["k2-replay", "k3-replay", "k4-replay", "tree15-replay", "tree31-replay"]
    assert not (e.refused or e.excluded or e.duplicates)
    recipes = [parse(r.recipe) for r in e.recipes]
    for r in recipes:
        assert r.drafter.kind == "replay" and r.drafter.acceptance == profile["acceptance"][:r.k]
        assert r.layer == "fused" and r.overlap
    chains, trees = recipes[:3], recipes[3:]
    assert [r.k for r in chains] == [2, 3, 4] and all(r.verification == "chain" for r in chains)
    for r, drafts in zip(trees, (15, 31)):
        assert r.drafter.ranks == profile["ranks"][:r.k]
        assert r.tree.paths == best_static_tree(profile["acceptance"], profile["ranks"], drafts)
    assert "`--space llama-3.1-8b-head`" in (Path(cli.__file__).parent / "docs" / "GRID.md").read_text()
