"""Prompt templates, one per agent plus the router (`*.md` beside this file), rendered with string.Template.

Placeholders are `$name`; `render` fills them from keyword arguments, strings as they are and everything else as
compact JSON, and refuses a missing one by name. `profile_summary` and `tool_list` build the two context values that
are too large or too live to pass as they are.
"""
from __future__ import annotations

import json
from pathlib import Path
from string import Template

PROMPTS_DIR = Path(__file__).parent
NAMES = ("router", "kernel_writer", "algorithm", "scheduler")


class PromptError(ValueError):
    """An unknown template or a placeholder the context does not give."""


def rounded(value):
    """Floats to 4 significant digits, all the way down: a prompt needs 0.001284 s, not 0.0012839957141425526 s, and
    every digit is a token the model reads."""
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [rounded(v) for v in value]
    return value


def compact(value) -> str:
    """A context value as prompt text: strings as they are, anything else as compact JSON with rounded floats."""
    if isinstance(value, str):
        return value
    return json.dumps(rounded(value), separators=(",", ":"), default=str)


def template(name: str) -> Template:
    if name not in NAMES:
        raise PromptError(f"unknown prompt {name!r} (prompts: {', '.join(NAMES)})")
    return Template((PROMPTS_DIR / f"{name}.md").read_text())


def placeholders(name: str) -> set[str]:
    return set(template(name).get_identifiers())


def render(name: str, **context) -> str:
    """Template `name` with every placeholder filled from `context`; PromptError names any missing one."""
    t = template(name)
    missing = sorted(set(t.get_identifiers()) - set(context))
    if missing:
        raise PromptError(f"prompt {name!r} needs {', '.join(missing)} (given: {', '.join(sorted(context)) or 'none'})")
    return t.substitute({key: compact(value) for key, value in context.items()})


def profile_summary(profile: dict) -> dict:
    """What an agent needs of a profile (schema 1, tools/profile/profiler.py): the deployment measured, the step, its phases,
    acceptance, floors and the cost model's prediction; not the raw kernel table."""
    if not profile:
        return {}
    meta, step, phases = profile.get("meta") or {}, profile.get("step") or {}, profile.get("phases") or {}
    pred = ((profile.get("prediction") or {}).get("graphed") or {})
    keep = ("step_s", "tokens_per_step", "tokens_per_s", "ar_tokens_per_s", "speedup", "memory_floor_s",
            "launch_floor_s", "perfect_speedup")
    return {
        "meta": {k: meta.get(k) for k in ("target", "recipe", "device", "device_name", "dtype", "batch_size", "k",
                                           "drafter", "workload", "context_len") if k in meta},
        "step": {k: step.get(k) for k in ("loop_s", "replay_s", "eager_s", "tokens_per_s", "graphed") if k in step},
        "phases_s": {k: phases.get(k) for k in ("draft", "verify", "bookkeeping", "host_sync", "idle") if k in phases},
        "kernels_per_step": phases.get("kernels") or {},
        "acceptance": profile.get("acceptance") or {},
        "floors": {k: v for k, v in (profile.get("floors") or {}).items() if not isinstance(v, dict)},
        "prediction": {k: pred.get(k) for k in keep if k in pred},
        "top_kernels": [{k: t.get(k) for k in ("op", "shapes", "count", "per_step_s", "share", "bandwidth_fraction")}
                        for t in (profile.get("top_kernels") or [])[:5]],
    }


def tool_list() -> list[dict]:
    """The sandboxed tools the graph evaluates candidates with (tools/agent_tools.py), by name and the first
    sentence of their description (the agent does not call them: the graph does, on its candidates)."""
    from ..tools.agent_tools import TOOLS

    return [{"name": t.name, "purpose": t.description.split(". ")[0].rstrip(".") + "."} for t in TOOLS.values()]
