"""`specpilot optimize`, `specpilot resume DIR` and `specpilot history DIR`: the graph run headless (or with a
person answering its questions), checkpointed in DIR/checkpoints.sqlite under the thread id kept in DIR/run.json.

Everything the user typed is checked before the graph starts (target, workload, device, dtype, budget, provider
endpoint, memory store), so bad input costs one line and nothing else. Once it runs, every node is checkpointed:
an error, Ctrl-C or a killed process leaves a run that `specpilot resume DIR` continues where it stopped.
"""
from __future__ import annotations

import sqlite3
import sys
import time
import uuid
from pathlib import Path

from ..engine.errors import SpecPilotError
from .artifacts import CHECKPOINTS, RUN_FILE, read_json, write_json
from .context import RunContext, open_run_memory, register, release
from .human import prompt
from .progress import ProgressLine
from .state import make_settings

PAUSED = 3  # exit status when the input ended at a question: the run waits there for `specpilot resume`


def one_line(text) -> str:
    """Errors reach the user as one line: tracebacks and multi-line messages are collapsed."""
    return " ".join(str(text).split())


def check_endpoint(base_url: str | None, timeout_s: float = 10.0) -> None:
    """An OpenAI-compatible endpoint that cannot be reached, or refuses the key, is bad input."""
    import openai

    from .providers.openai_compat import api_key_from_env

    client = openai.OpenAI(api_key=api_key_from_env(), base_url=base_url, timeout=timeout_s, max_retries=0)
    where = base_url or "the OpenAI API"
    try:
        client.models.list()
    except openai.APIConnectionError as e:
        raise SpecPilotError(one_line(f"provider endpoint {where} is unreachable: {e}")) from None
    except (openai.AuthenticationError, openai.PermissionDeniedError) as e:
        raise SpecPilotError(f"provider endpoint {where} refused the API key (SPECPILOT_API_KEY / OPENAI_API_KEY): "
                             f"{e.status_code}") from None
    except openai.APIStatusError:
        pass  # it answered: a server without /models is still reachable


def check_settings(s: dict) -> None:
    from ..engine import loader
    from ..engine.workloads import load_workload

    positive = ("budget_rounds", "budget_minutes", "budget_gpu_minutes", "batch_size", "max_new_tokens", "limit",
                "max_candidates")
    for key in positive:
        if s[key] is not None and s[key] <= 0:
            raise SpecPilotError(f"--{key.replace('_', '-')} must be positive, got {s[key]}")
    loader.parse_dtype(s["dtype"])
    loader.check_device(s["device"])
    loader.source_dir(s["target"])  # an unknown target, or one without config.json
    try:
        questions = load_workload(s["workload"], s["limit"])
    except ValueError as e:  # WorkloadError
        raise SpecPilotError(str(e)) from None
    if not questions:
        raise SpecPilotError(f"workload {s['workload']!r} has no questions")
    if s["acceptance"] is not None:
        check_acceptance(s["target"], s["acceptance"], s.get("acceptance_ranks"))


def check_acceptance(target: str, acceptance: list[float], ranks: list | None = None) -> None:
    """--acceptance replays drafts, which only a synthetic target needs (a real one's drafters are measured); the
    profile, its ranks too, obeys the replay drafter's rules (docs/RECIPE.md, drafter.acceptance and ranks)."""
    from ..engine import loader
    from ..engine.recipe import parse
    from ..engine.synthetic import synthetic_seed

    if synthetic_seed(loader.source_dir(target) / "config.json") is None:
        raise SpecPilotError(f"--acceptance replays drafts on a synthetic target (synthetic:NAME); {target} is a real "
                             "model, whose drafters' acceptance the run measures")
    chain = [[0] * d for d in range(1, len(acceptance) + 1)]  # (ranks need a static tree: its first-child chain)
    tree = {"verification": "tree", "tree": {"kind": "static", "paths": chain}} if ranks else {}
    try:
        parse({"drafter": {"kind": "replay", "acceptance": list(acceptance), "ranks": list(ranks or [])},
               "k": len(acceptance), **tree})
    except SpecPilotError as e:
        raise SpecPilotError(f"--acceptance: {one_line(e)}") from None


def open_provider(s: dict):
    from .providers import make_provider

    try:
        provider = make_provider(s["provider"], s["model"], s["base_url"])
    except ValueError as e:
        raise SpecPilotError(str(e)) from None
    if s["provider"].startswith("openai"):
        check_endpoint(s["base_url"])
    return provider


def open_memory_store(spec: str | None):
    try:
        return open_run_memory(spec)
    except SpecPilotError as e:
        raise SpecPilotError(one_line(e)) from None
    except Exception as e:  # a path that is a file, unwritable, a store Chroma cannot read
        raise SpecPilotError(one_line(f"memory {spec or '(default store)'} cannot be opened: {type(e).__name__}: {e}")) \
            from None


def _compiled(out: Path):
    from langgraph.checkpoint.sqlite import SqliteSaver

    from .graph import build_graph

    conn = sqlite3.connect(str(out / CHECKPOINTS), check_same_thread=False)  # SqliteSaver serializes with a lock
    return build_graph(SqliteSaver(conn)), conn


def _drive(graph, config: dict, inp, out: Path, stdin, stderr) -> int:
    from langgraph.types import Command

    progress = ProgressLine(stderr)
    progress.set_best(graph.get_state(config).values.get("best"))
    while True:
        try:
            # "sync": a step's checkpoint is on disk before the next step starts, so a killed run loses at most
            # the step that was running (LangGraph's default, "async", can lag several steps behind under load)
            for mode, chunk in graph.stream(inp, config, stream_mode=["updates", "custom"], durability="sync"):
                if mode == "custom":
                    progress.show(chunk.get("progress", ""))
                    continue
                for node, update in chunk.items():
                    if node != "__interrupt__" and isinstance(update, dict):
                        progress.set_best(update.get("best"))
                        progress.show(f"{node} done")
        except KeyboardInterrupt:
            progress.done()
            print(f"specpilot: interrupted; every finished step is kept: specpilot resume {out}", file=stderr)
            return 130
        except SpecPilotError as e:
            progress.done()
            raise SpecPilotError(one_line(f"{e} (the run is checkpointed: specpilot resume {out})")) from e
        except Exception as e:  # an internal error: one line, and the run stays resumable
            progress.done()
            raise SpecPilotError(one_line(f"{type(e).__name__}: {e} (the run is checkpointed: specpilot resume {out})")) \
                from e
        progress.done()
        snap = graph.get_state(config)
        if snap.interrupts:
            answer = prompt(snap.interrupts[0].value, stdin.readline, lambda t: (stderr.write(t), stderr.flush()))
            if answer is None:
                print(f"specpilot: no answer (end of input); the run waits at this question: specpilot resume {out}",
                      file=stderr)
                return PAUSED
            inp = Command(resume=answer)
            continue
        return _finish(snap.values, out)


def _finish(values: dict, out: Path) -> int:
    best = values.get("best")
    if not best:
        print(f"specpilot optimize: no recipe: {values.get('stop_reason')}; see {out / 'report.md'}")
        return 1
    m = best["measured"]
    print(f"specpilot optimize: best {best['source']}: {m['speedup_vs_ar']:.2f}x ar, {m['speedup_vs_stock']:.2f}x "
          f"stock ({m['tokens_per_s']:.1f} tok/s), gate passed; stopped: {values.get('stop_reason')}")
    written = [out / name for name in ("recipe.json", "report.md", "progress.png") if (out / name).is_file()]
    print(f"wrote {', '.join(map(str, written))}")
    return 0


def optimize(settings: dict, stdin=None, stderr=None, provider=None, memory=None) -> int:
    """Run the graph from the start into settings["out_dir"]. `provider` / `memory` replace the ones the settings
    name (tests use a scripted provider)."""
    stdin, stderr = stdin or sys.stdin, stderr or sys.stderr
    s = make_settings(**settings)
    if not s["out_dir"]:
        s["out_dir"] = f"runs/optimize-{time.strftime('%Y%m%d-%H%M%S')}"
    out = Path(s["out_dir"]).resolve()
    s["out_dir"] = str(out)
    if (out / RUN_FILE).exists():
        raise SpecPilotError(f"{out} already holds an optimize run: continue it with `specpilot resume {out}` or "
                             "choose another --out")
    check_settings(s)
    provider = provider or open_provider(s)
    ours = memory is None  # a store this call opened is closed when it returns
    memory = memory or open_memory_store(s["memory"])
    out.mkdir(parents=True, exist_ok=True)
    thread = uuid.uuid4().hex
    write_json(out / RUN_FILE, {"thread_id": thread, "settings": s, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                "provider": getattr(provider, "name", s["provider"])})
    register(out, RunContext(provider, memory))
    graph, conn = _compiled(out)
    try:
        return _drive(graph, {"configurable": {"thread_id": thread}}, {"settings": s, "round": 0}, out, stdin,
                      stderr)
    finally:
        _close(conn, out, memory if ours else None)


def _close(conn, out: Path, memory) -> None:
    conn.close()
    release(out)
    if memory is not None and hasattr(memory, "close"):
        memory.close()


def _run_file(out: Path) -> dict:
    if not (out / RUN_FILE).is_file() or not (out / CHECKPOINTS).is_file():
        raise SpecPilotError(f"{out} is not an optimize run directory (no {RUN_FILE} / {CHECKPOINTS})")
    return read_json(out / RUN_FILE)


def finished(snap) -> bool:
    """Whether the graph reached END. An empty `next` alone does not say so: a process killed after a step's writes
    were saved but before the checkpoint that applies them leaves a checkpoint whose tasks have all run (so none is
    `next`), and streaming from it applies their writes and goes on."""
    return not snap.tasks and not snap.interrupts


def resume(out_dir: str, stdin=None, stderr=None, provider=None, memory=None) -> int:
    """Continue a stopped, killed or paused run: the node that was running runs again (its finished evaluations are
    read from DIR/evaluations/), a pending question is asked again, a finished run just reports."""
    stdin, stderr = stdin or sys.stdin, stderr or sys.stderr
    out = Path(out_dir).resolve()
    run = _run_file(out)
    s = run["settings"]
    provider = provider or open_provider(s)
    ours = memory is None
    memory = memory or open_memory_store(s["memory"])
    register(out, RunContext(provider, memory))
    graph, conn = _compiled(out)
    config = {"configurable": {"thread_id": run["thread_id"]}}
    try:
        snap = graph.get_state(config)
        if finished(snap):
            print(f"specpilot resume: {out} has finished", file=stderr)
            return _finish(snap.values, out)
        # None: the node that was running runs again; one waiting at a question asks it again
        return _drive(graph, config, None, out, stdin, stderr)
    finally:
        _close(conn, out, memory if ours else None)


def load_snapshot(out_dir: str):
    """The run's latest checkpoint as LangGraph's StateSnapshot (what `resume` would continue from)."""
    out = Path(out_dir).resolve()
    run = _run_file(out)
    graph, conn = _compiled(out)
    try:
        return graph.get_state({"configurable": {"thread_id": run["thread_id"]}})
    finally:
        conn.close()


def load_state(out_dir: str) -> dict:
    """The run's latest checkpointed state."""
    return load_snapshot(out_dir).values


def history(out_dir: str, stdout=None) -> int:
    """Every decision of a run, read from its checkpoints, oldest first, with the step that made it."""
    stdout = stdout or sys.stdout
    out = Path(out_dir).resolve()
    run = _run_file(out)
    graph, conn = _compiled(out)
    try:
        snaps = list(graph.get_state_history({"configurable": {"thread_id": run["thread_id"]}}))[::-1]
    finally:
        conn.close()
    s = run["settings"]
    stdout.write(f"{out}: {s['target']}, {s['workload']}, batch {s['batch_size']}, {s['device']} ({s['dtype']}), "
                 f"provider {run.get('provider', s['provider'])}; {len(snaps)} checkpoints\n")
    seen = 0
    for snap in snaps:
        trail = snap.values.get("trail", [])
        for t in trail[seen:]:
            why = f" — {t['why']}" if t.get("why") else ""
            stdout.write(f"step {snap.metadata.get('step', '?'):>3}  round {t['round']}  {t['node']:<13} "
                         f"{t['who']}: {t['decision']}{why}\n")
        seen = max(seen, len(trail))
    last = snaps[-1] if snaps else None
    if last is not None and not finished(last):
        waiting = " (waiting for a person: " + ", ".join(i.value["kind"] for i in last.interrupts) + ")" \
            if last.interrupts else ""
        nodes = last.next or tuple(f"after {t.name}" for t in last.tasks)
        stdout.write(f"not finished: next {', '.join(nodes)}{waiting}; specpilot resume {out}\n")
    elif last is not None:
        stdout.write(f"finished: {last.values.get('stop_reason')}\n")
    return 0
