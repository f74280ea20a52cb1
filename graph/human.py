"""A person in the loop (`specpilot optimize --interactive`): the graph stops at each decision with its evidence,
and the person approves, edits, skips, sends it to another agent, or stops the run.

Two halves. In a node, `ask()` is a LangGraph interrupt: the run is checkpointed and the node waits; on resume
LangGraph re-executes the node and `ask()` returns the person's answer (several `ask()`s in one node are answered in
order). On the terminal, `prompt()` shows the evidence and reads keys from a stream (stdin, or a script in tests).
"""
from __future__ import annotations

import json

from langgraph.types import interrupt

from .candidates import AGENTS

ACTIONS = {
    "route": ("approve", "edit", "skip", "redirect", "stop"),
    "candidate": ("approve", "edit", "skip", "redirect", "stop"),
    "integration": ("approve", "edit", "skip", "stop"),
}
KEYS = {"a": "approve", "e": "edit", "s": "skip", "r": "redirect", "q": "stop"}
KEY_OF = {action: key for key, action in KEYS.items()}
WHAT = {  # what each action means at each kind of decision, shown with the keys
    "route": {"approve": "run these agents", "edit": 'JSON {"agents": [...], "reason": "..."}',
              "skip": "no agent this round", "redirect": "one other agent instead", "stop": "end the run"},
    "candidate": {"approve": "evaluate it", "edit": "JSON candidate {reason, recipe_patch, kernel}",
                  "skip": "reject it", "redirect": "reject it and ask another agent", "stop": "end the run"},
    "integration": {"approve": "adopt the proposal", "edit": "JSON recipe patch to evaluate instead",
                    "skip": "keep the current best", "stop": "keep the current best and end the run"},
}


# -- in a node ----------------------------------------------------------------------------------------------------

def ask(kind: str, round_: int, evidence: dict) -> dict:
    """The person's answer {"action", "value"} to one decision; an answer this graph does not understand (e.g.
    sent from Studio by hand) comes back as {"action": "invalid", "value": why}."""
    answer = interrupt({"kind": kind, "round": round_, "evidence": evidence, "actions": list(ACTIONS[kind])})
    if isinstance(answer, str):
        answer = {"action": KEYS.get(answer, answer)}
    if not isinstance(answer, dict) or answer.get("action") not in ACTIONS[kind]:
        return {"action": "invalid", "value": f"not an answer to a {kind} decision: {answer!r}"}
    if answer["action"] == "redirect" and answer.get("value") not in AGENTS:
        return {"action": "invalid", "value": f"redirect needs one of {', '.join(AGENTS)}, got {answer.get('value')!r}"}
    return {"action": answer["action"], "value": answer.get("value")}


# -- on the terminal ----------------------------------------------------------------------------------------------

def _lines(kind: str, ev: dict) -> list[str]:
    out = []
    if kind == "route":
        out.append("gaps (largest end-to-end gain first):")
        for g in ev.get("gaps", []):
            out.append(f"  {g['gain'] * 100:6.1f}%  {g['component']:<28.28} {g['agent']:<13} {g.get('reason', '')}")
        for h in ev.get("memory", []):
            out.append(f"  memory: {h}")
        out.append(f"{ev.get('who')} chose: {', '.join(ev.get('agents') or []) or 'no agent'} — {ev.get('reason')}")
    elif kind == "candidate":
        out.append(f"candidate {ev['id']} from {ev['agent']} ({ev['origin']}): {ev['reason']}")
        out.append(f"  patch: {json.dumps(ev.get('recipe_patch'), sort_keys=True)}")
        for line in ev.get("changes", []):
            out.append(f"  {line}")
        if ev.get("kernel"):
            out.append(f"  kernel for slot {ev['kernel']['slot']}:")
            out += [f"    | {line}" for line in ev["kernel"]["head"]]
    else:
        out.append(f"current best: {ev.get('best')}")
        for w in ev.get("winners", []):
            out.append(f"  passed the gate and beat it: {w}")
        if ev.get("combination"):
            out.append(f"  combination: {ev['combination']}")
        out.append(f"proposal: {ev.get('proposal')}")
    return out


def prompt(request: dict, read_line, write) -> dict | None:
    """Show one decision and read the answer: a key (a/e/s/r/q or the action's name), then for edit one line of
    JSON and for redirect an agent name. None when the input ends (the run pauses; `specpilot resume` asks again)."""
    kind, actions = request["kind"], request["actions"]
    write(f"\n== round {request['round']}: {kind} decision ==\n")
    for line in _lines(kind, request["evidence"]):
        write(line + "\n")
    menu = "  ".join(f"[{KEY_OF[a]}]{a[1:]} ({WHAT[kind][a]})" if a[0] == KEY_OF[a] else
                     f"[{KEY_OF[a]}] {a} ({WHAT[kind][a]})" for a in actions)  # (stop's key is q: s skips)
    while True:
        write(f"{menu}\n> ")
        line = read_line()
        if not line:
            return None
        key = line.strip().lower()
        action = KEYS.get(key, key)
        if action not in actions:
            write(f"not one of: {', '.join(actions)}\n")
            continue
        if action == "edit":
            write("JSON> ")
            text = read_line()
            if not text:
                return None
            try:
                return {"action": "edit", "value": json.loads(text)}
            except json.JSONDecodeError as e:
                write(f"not valid JSON ({e}); choose again\n")
                continue
        if action == "redirect":
            write(f"agent ({', '.join(AGENTS)})> ")
            agent = (read_line() or "").strip()
            if agent not in AGENTS:
                write(f"not an agent: {agent!r}; choose again\n")
                continue
            return {"action": "redirect", "value": agent}
        return {"action": action, "value": None}
