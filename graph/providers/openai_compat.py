"""The OpenAI-compatible provider: decisions from any chat-completions endpoint (OpenAI, vLLM, Ollama, llama.cpp's
server, LM Studio) through the `openai` client with a `base_url`.

Each decision (a route, or one agent's proposals) is asked for as structured output, in the first mode the server
accepts: a forced tool call (`tools` + `tool_choice`), then `response_format` json_schema (strict), then
`response_format` {"type": "json_object", "schema": ...} (what llama.cpp's server takes). A mode the server rejects is
remembered and skipped from then on. Connection errors, timeouts, 429 and 5xx are retried with exponential backoff.
Every answer is validated (graph.candidates.Candidate.from_dict, the recipe schema, the agent's own fields; a route
against AGENTS); an invalid one gets exactly one repair round with the validation error; if that fails too, or the
endpoint cannot be reached, the policy provider decides that step. `trail` records, per step, who decided and why.

The API key comes from the environment (SPECPILOT_API_KEY, else OPENAI_API_KEY, else "none" for local servers that
ignore it). It lives only inside the openai client: it is never logged, and every text this module keeps or raises
is scrubbed of it. Every message sent to the endpoint passes through tools/scrub.py on its way out (`_request`, the
one place a request body is built): the key in use becomes `***` and the value of every secret-looking environment
variable `[redacted:NAME]`, wherever it came from (a tool's reason, an exception message, a memory hit, a trail).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import threading
import time
import typing

import openai

from ...engine.eagle3 import RANDOM_HEAD
from ...engine.recipe import COMPILE_MODES, DRAFTER_KINDS, TREE_KINDS, VERIFICATION_KINDS, WEIGHT_FORMATS, Recipe
from ...kernels import IMPLEMENTATIONS, SLOTS
from ...prompts import profile_summary, render, tool_list
from ...tools.scrub import scrub, scrub_messages
from ..candidates import AGENTS, AgentContext, Candidate, CandidateError, RouteDecision
from .base import Provider
from .policy import AGENT_FIELDS, MIN_GAIN, PolicyProvider, describe_deployment, patch_error

MODES = ("tools", "json_schema", "json_object")
PROPOSE_FUNCTION = "propose_candidates"
ROUTE_FUNCTION = "route_agents"
# Words a server's error uses when it does not support a request mode.
MODE_WORDS = {"tools": ("tool",), "json_schema": ("response_format", "json_schema"),
              "json_object": ("response_format", "json_object")}
# Worth another try: connection errors (timeouts among them), 429, 5xx.
RETRYABLE = (openai.APIConnectionError, openai.RateLimitError, openai.InternalServerError)
SYSTEM = ("You are the {role} of SpecPilot, a system that speeds up speculative decoding without changing a single "
          "output token. Reply with one JSON object that matches the requested schema, and nothing else.")


NO_KEY = "none"  # what local servers (llama.cpp, vLLM, Ollama) get when the environment holds no key


def api_key_from_env() -> str:
    return os.environ.get("SPECPILOT_API_KEY") or os.environ.get("OPENAI_API_KEY") or NO_KEY


# ---------------------------------------------------------------------------------------------------------- schemas

# An agent tunes a deployment's decoding; it never makes up its acceptance: the replay drafter (its profile and
# ranks), a measurement's stand-in for a drafter on a synthetic target (engine/replay.py), is no lever of theirs.
AGENT_DRAFTER_KINDS = tuple(k for k in DRAFTER_KINDS if k != "replay")
NOT_LEVERS = {"drafter.acceptance", "drafter.ranks"}
_ENUMS = {"drafter.kind": AGENT_DRAFTER_KINDS, "verification": VERIFICATION_KINDS, "tree.kind": TREE_KINDS,
          "weights.format": WEIGHT_FORMATS, "compile_mode": COMPILE_MODES}
# On a synthetic target (random weights) no drafter can predict the text: AR, or with optimize --acceptance the
# replay drafter, whose profile the harness fills in from the user's (`fill_replay`), never the agent.
SYNTHETIC_DRAFTER_KINDS, REPLAY_DRAFTER_KINDS = ("none",), ("none", "replay")


def drafter_kinds(deployment: dict | None) -> tuple[str, ...]:
    """The drafter kinds an agent may propose for this deployment."""
    deployment = deployment or {}
    if not deployment.get("synthetic"):
        return AGENT_DRAFTER_KINDS
    return REPLAY_DRAFTER_KINDS if deployment.get("replay_acceptance") else SYNTHETIC_DRAFTER_KINDS
_JSON_TYPES = {int: "integer", str: "string", bool: "boolean", float: "number"}


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def _closed(properties: dict) -> dict:
    """An object schema as OpenAI's strict mode wants it: every property required, nothing else allowed."""
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def _field_schema(hint, path: str, enums: dict = _ENUMS) -> dict:
    if path == "kernels":  # slot -> one of its built-ins (new source goes in the candidate's `kernel`)
        return _closed({s: _nullable({"type": "string", "enum": list(IMPLEMENTATIONS[s])}) for s in SLOTS})
    if dataclasses.is_dataclass(hint):
        hints = typing.get_type_hints(hint)
        return _closed({f.name: _nullable(_field_schema(hints[f.name], f"{path}.{f.name}", enums))
                        for f in dataclasses.fields(hint) if f"{path}.{f.name}" not in NOT_LEVERS})
    if path == "tree.paths":  # child-rank paths from the root
        return {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}}
    schema = {"type": _JSON_TYPES[hint]}
    if path in enums:
        schema["enum"] = list(enums[path])
    return schema


def patch_schema(agent: str, deployment: dict | None = None) -> dict:
    """The recipe fields `agent` may change, each nullable (null: leave unchanged), from engine/recipe.py's
    dataclasses so that the schema follows the recipe format; the drafter kinds those of the deployment."""
    hints = typing.get_type_hints(Recipe)
    enums = _ENUMS | {"drafter.kind": drafter_kinds(deployment)}
    return _closed({name: _nullable(_field_schema(hints[name], name, enums)) for name in AGENT_FIELDS[agent]})


def candidates_schema(agent: str, max_candidates: int = 3, deployment: dict | None = None) -> dict:
    item = {"reason": {"type": "string"}, "recipe_patch": patch_schema(agent, deployment)}
    if agent == "kernel_writer":
        item["kernel"] = _nullable(_closed({"slot": {"type": "string", "enum": list(SLOTS)},
                                            "source": {"type": "string"}}))
    # maxItems also ends a grammar-constrained answer (llama.cpp) after the last candidate allowed
    return _closed({"candidates": {"type": "array", "items": _closed(item), "maxItems": max_candidates}})


def route_schema() -> dict:
    return _closed({"agents": {"type": "array", "items": {"type": "string", "enum": list(AGENTS)}},
                    "reason": {"type": "string"}})


# ------------------------------------------------------------------------------------------------------- validation

def drop_nulls(value):
    """Nulls mean "leave unchanged": removed, and objects left empty by that with them."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            v = drop_nulls(v)
            if v is not None and v != {}:
                out[k] = v
        return out
    return value


def parse_json(text: str | None):
    """The JSON value of an answer; tolerates a markdown code fence around it and control characters in strings."""
    if text is None or not str(text).strip():
        raise CandidateError("the answer is empty")
    body = str(text).strip()
    fenced = re.fullmatch(r"```[a-zA-Z]*\s*(.*?)\s*```", body, re.S)
    if fenced:
        body = fenced.group(1)
    try:
        return json.loads(body, strict=False)  # raw newlines or tabs inside strings: small models write them
    except json.JSONDecodeError as e:
        raise CandidateError(f"the answer is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from e


def validate_candidates(answer, ctx: AgentContext, origin: str) -> list[Candidate]:
    """An answer {"candidates": [...]} as candidates for ctx.agent; CandidateError says what is wrong."""
    items = answer.get("candidates") if isinstance(answer, dict) else answer
    if isinstance(answer, dict) and set(answer) - {"candidates"}:
        raise CandidateError(f"unknown top-level field(s): {', '.join(sorted(set(answer) - {'candidates'}))}; "
                             "answer {\"candidates\": [...]}")
    if not isinstance(items, list):
        raise CandidateError("the answer must be an object {\"candidates\": [...]}")
    out, seen, tried = [], set(), []
    for n, item in enumerate(items, 1):
        if not isinstance(item, dict):
            raise CandidateError(f"candidate {n}: expected an object, got {type(item).__name__}")
        item = {k: v for k, v in item.items() if k not in ("id", "origin")}
        if item.get("agent", ctx.agent) != ctx.agent:
            raise CandidateError(f"candidate {n}: field 'agent' must be {ctx.agent!r} (you are the {ctx.agent} agent)")
        item["recipe_patch"] = drop_nulls(item.get("recipe_patch") or {})
        kind = (item["recipe_patch"].get("drafter") or {}).get("kind")
        if kind is not None and kind not in drafter_kinds(ctx.deployment):
            raise CandidateError(f"candidate {n}: drafter.kind {kind!r} is not one of "
                                 f"{', '.join(drafter_kinds(ctx.deployment))} for this deployment")
        try:
            item["recipe_patch"] = fill_replay(item["recipe_patch"], ctx)
        except CandidateError as e:
            raise CandidateError(f"candidate {n}: {e}") from e
        if item.get("kernel") is None:
            item.pop("kernel", None)
        try:
            cand = Candidate.from_dict(item, agent=ctx.agent, origin=origin)
        except CandidateError as e:
            raise CandidateError(f"candidate {n}: {e}") from e
        if cand.kernel is not None and (ctx.agent != "kernel_writer" or cand.kernel.slot not in SLOTS):
            raise CandidateError(f"candidate {n}: only the kernel_writer gives kernel source, for a slot among "
                                 f"{', '.join(SLOTS)}")
        why = patch_error(ctx.recipe, cand.recipe_patch, ctx.agent, cand.kernel)
        if why:
            raise CandidateError(f"candidate {n}: recipe_patch: {why}")
        if cand.id in ctx.tried:
            tried.append(cand.id)
            continue
        if cand.id not in seen:
            seen.add(cand.id)
            out.append(cand)
    if tried and not out:
        raise CandidateError(f"every candidate was already evaluated (ids {', '.join(tried)}): propose other "
                             "changes, or none")
    return out[: ctx.max_candidates]


def fill_replay(patch: dict, ctx: AgentContext) -> dict:
    """A replay drafter proposed for a synthetic target drafts at the user's acceptance (the deployment's
    replay_acceptance), its first k positions, and a random head's cost: the agent picks k, never the profile."""
    drafter = patch.get("drafter") or {}
    kind = drafter.get("kind", (ctx.recipe.get("drafter") or {}).get("kind"))
    if kind != "replay":
        return patch
    profile = list((ctx.deployment or {}).get("replay_acceptance") or ())
    k = patch.get("k", ctx.recipe.get("k", 0))
    if not 1 <= k <= len(profile):
        raise CandidateError(f"a replayed chain verifies k = 1..{len(profile)} drafts (the given acceptance's "
                             f"positions), got k = {k}")
    return {**patch, "drafter": {**drafter, "kind": "replay", "model": drafter.get("model") or RANDOM_HEAD,
                                 "acceptance": profile[:k]}}


def validate_route(answer) -> RouteDecision:
    if not isinstance(answer, dict):
        raise CandidateError("the answer must be an object {\"agents\": [...], \"reason\": \"...\"}")
    unknown = set(answer) - {"agents", "reason"}
    if unknown:
        raise CandidateError(f"unknown field(s): {', '.join(sorted(unknown))}")
    agents, reason = answer.get("agents"), answer.get("reason")
    if not isinstance(agents, list) or not all(isinstance(a, str) for a in agents):
        raise CandidateError("field 'agents': a list of agent names is required")
    names = []
    for a in agents:
        name = a.replace("-", "_")
        if name not in AGENTS:
            raise CandidateError(f"field 'agents': {a!r} is not one of {', '.join(AGENTS)}")
        if name not in names:
            names.append(name)
    if not isinstance(reason, str) or not reason.strip():
        raise CandidateError("field 'reason': a non-empty string is required")
    return RouteDecision(names, reason.strip())


def route_covering_gaps(decision: RouteDecision, gaps: list[dict]) -> RouteDecision:
    """The route, unless it leaves out the agent of the largest gap worth MIN_GAIN or more: whether a round is worth
    running is the graph's rule (a budget, a gap of at least MIN_GAIN), not the model's, so such a route is
    questioned with the gap it ignores (the one repair round); ignored twice, the policy routes (a fallback)."""
    top = max((g for g in gaps or [] if float(g.get("gain", 0.0)) >= MIN_GAIN and
               str(g.get("agent", "")).replace("-", "_") in AGENTS),
              key=lambda g: float(g["gain"]), default=None)
    if top is None:
        return decision
    agent = str(top["agent"]).replace("-", "_")
    if agent in decision.agents:
        return decision
    raise CandidateError(f"the route leaves out {agent}, the agent of the largest gap: {top.get('component')} "
                         f"{float(top['gain']):.0%} ({top.get('reason', '')}); every gap of {MIN_GAIN:.0%} or more "
                         f"is worth a round: route to {agent} (with any others)")


# ------------------------------------------------------------------------------------------------------- transport

class EndpointError(RuntimeError):
    """The endpoint gave no usable answer: unreachable after the retries, or every request mode refused."""


class ModeRejected(Exception):
    def __init__(self, why: str, remember: bool):
        super().__init__(why)
        self.why, self.remember = why, remember


def _error_text(e: Exception) -> str:
    status = getattr(e, "status_code", None)
    return f"{type(e).__name__}{f' (HTTP {status})' if status else ''}: {getattr(e, 'message', None) or e}"


def _memory_view(hits: list[dict]) -> list[dict]:
    """Memory hits as the prompt shows them: what changed, where, what it measured; kernel source left out."""
    out = []
    for hit in hits or []:
        o = hit.get("outcome") or {}
        cand = dict(o.get("candidate") or {})
        if isinstance(cand.get("kernel"), dict):
            cand["kernel"] = {"slot": cand["kernel"].get("slot"), "source": "(omitted)"}
        out.append({"candidate": cand, "deployment": describe_deployment(o.get("deployment") or {}),
                    "results": o.get("results"), "gate_passed": (o.get("gate") or {}).get("passed"),
                    "failure": o.get("failure"), "score": hit.get("score"), "flags": hit.get("flags") or []})
    return out


class OpenAIProvider(Provider):
    """Decisions from an OpenAI-compatible chat-completions endpoint, the policy deciding any step it cannot."""

    def __init__(self, model: str, base_url: str | None = None, *, timeout_s: float = 120.0, tries: int = 3,
                 retry_base_s: float = 1.0, use_tools: bool = True, max_tokens: int | None = 2048,
                 temperature: float | None = 0.0, fallback: Provider | None = None):
        if not model:
            raise ValueError("the openai provider needs a model name (--model)")
        self.model, self.base_url = model, base_url
        self.name = f"openai:{model}"
        self.tries, self.retry_base_s = max(1, int(tries)), float(retry_base_s)
        self.max_tokens, self.temperature = max_tokens, temperature
        self.token_limit_param = "max_tokens"      # becomes max_completion_tokens where the server asks for it
        self.modes = MODES if use_tools else MODES[1:]
        self.fallback = fallback or PolicyProvider()
        self.trail: list[dict] = []
        self.rejected_modes: dict[str, str] = {}   # mode -> why the server refused it
        self._lock = threading.Lock()
        # The client retries nothing itself: _call does, with its own backoff, and counts the tries for the trail.
        self._client = openai.OpenAI(api_key=api_key_from_env(), base_url=base_url, timeout=timeout_s, max_retries=0)

    def __repr__(self) -> str:
        return f"OpenAIProvider(model={self.model!r}, base_url={self.base_url!r})"

    # ---- the Provider interface

    def route(self, gaps: list[dict], memory_hits: list[dict], deployment: dict) -> RouteDecision:
        schema = route_schema()
        prompt = render("router", deployment=deployment, gaps=gaps, memory_hits=_memory_view(memory_hits),
                        min_gain=f"{MIN_GAIN:.0%}", agents=list(AGENTS), schema=schema)
        decision = self._decide("route", "router", prompt, ROUTE_FUNCTION, schema,
                                lambda answer: route_covering_gaps(validate_route(answer), gaps))
        return decision if decision is not None else self.fallback.route(gaps, memory_hits, deployment)

    def propose(self, ctx: AgentContext) -> list[Candidate]:
        schema = candidates_schema(ctx.agent, ctx.max_candidates, ctx.deployment)
        prompt = render(ctx.agent, deployment=ctx.deployment, recipe=ctx.recipe, profile=profile_summary(ctx.profile),
                        gaps=ctx.gaps, memory_hits=_memory_view(ctx.memory_hits), tried=ctx.tried, tools=tool_list(),
                        max_candidates=ctx.max_candidates, fields=list(AGENT_FIELDS[ctx.agent]), schema=schema)
        found = self._decide(f"propose:{ctx.agent}", f"{ctx.agent} agent", prompt, PROPOSE_FUNCTION, schema,
                             lambda answer: validate_candidates(answer, ctx, self.name))
        return found if found is not None else self.fallback.propose(ctx)

    # ---- one decision: ask, validate, one repair round, else None (the caller falls back to the policy)

    def _decide(self, step: str, role: str, prompt: str, function: str, schema: dict, validate):
        messages = [{"role": "system", "content": SYSTEM.format(role=role)}, {"role": "user", "content": prompt}]
        first_error = None
        for round_ in ("answer", "repair"):
            try:
                text, mode, tries = self._complete(messages, function, schema)
            except EndpointError as e:
                earlier = f" (first answer invalid: {first_error})" if first_error else ""
                self._note(step, "policy-fallback", f"endpoint gave no answer: {e}{earlier}")
                return None
            try:
                value = validate(parse_json(text))
            except CandidateError as e:
                if round_ == "repair":
                    self._note(step, "policy-fallback", f"invalid after one repair round: {e} (first: {first_error})",
                               mode, tries)
                    return None
                first_error = str(e)
                messages += [{"role": "assistant", "content": text or ""},
                             {"role": "user", "content": f"That answer is invalid: {e}. Answer again with one JSON "
                                                         "object that matches the schema, fixing exactly this."}]
                continue
            if round_ == "answer":
                self._note(step, "llm", "valid answer", mode, tries)
            else:
                self._note(step, "repaired", f"first answer invalid: {first_error}", mode, tries)
            return value
        return None

    def _note(self, step: str, source: str, why: str, mode: str | None = None, tries: int | None = None) -> None:
        entry = {"step": step, "source": source, "why": self._scrub(why)}
        if mode:
            entry["mode"] = mode
        if tries:
            entry["tries"] = tries
        with self._lock:
            self.trail.append(entry)

    def _secrets(self) -> dict[str, str]:
        """{value: replacement} of what this provider knows is secret beyond the environment: the API key in use,
        whatever its length. The one exception is NO_KEY, our own placeholder when there is no key: it is not a
        secret, and replacing every "none" in a text would garble it."""
        key = self._client.api_key
        return {key: "***"} if key and key != NO_KEY else {}

    def _scrub(self, text: str) -> str:
        """`text` without the API key and the environment's secrets, wherever a server, a tool or an exception may
        have put them."""
        return scrub(text, self._secrets())

    # ---- transport: request modes and retries

    def _complete(self, messages: list[dict], function: str, schema: dict) -> tuple[str | None, str, int]:
        """The answer's text in the first mode the server accepts: (text, mode, tries)."""
        refused = []
        for mode in self.modes:
            if mode in self.rejected_modes:
                continue
            try:
                response, tries = self._call(mode, messages, function, schema)
            except ModeRejected as e:
                refused.append(f"{mode}: {e.why}")
                if e.remember:
                    with self._lock:
                        self.rejected_modes[mode] = e.why
                continue
            return self._answer_text(response, function), mode, tries
        known = [f"{m}: {w}" for m, w in self.rejected_modes.items()]
        raise EndpointError(self._scrub("no request mode accepted (" + "; ".join(refused or known) + ")"))

    def _request(self, mode: str, messages: list[dict], function: str, schema: dict) -> dict:
        # the one place a request body is built: nothing reaches the endpoint unscrubbed
        kw = {"model": self.model, "messages": scrub_messages(messages, self._secrets())}
        if self.temperature is not None:
            kw["temperature"] = self.temperature
        if self.max_tokens:
            kw[self.token_limit_param] = self.max_tokens
        if mode == "tools":
            kw["tools"] = [{"type": "function", "function": {"name": function, "parameters": schema,
                                                             "description": "Give the decision."}}]
            kw["tool_choice"] = {"type": "function", "function": {"name": function}}
        elif mode == "json_schema":
            kw["response_format"] = {"type": "json_schema",
                                     "json_schema": {"name": function, "schema": schema, "strict": True}}
        else:
            kw["response_format"] = {"type": "json_object", "schema": schema}
        return kw

    def _adapt(self, error_text: str) -> bool:
        """Follow a 400 that refuses one of our sampling parameters, once each: OpenAI's reasoning models take
        `max_completion_tokens` instead of `max_tokens`, and only their default temperature."""
        text = error_text.lower()
        with self._lock:
            if self.token_limit_param == "max_tokens" and "max_completion_tokens" in text:
                self.token_limit_param = "max_completion_tokens"
                return True
            if self.temperature is not None and "temperature" in text:
                self.temperature = None
                return True
        return False

    def _call(self, mode: str, messages: list[dict], function: str, schema: dict):
        """One request, retried on connection errors, timeouts, 429 and 5xx with exponential backoff."""
        attempt = 0
        while True:
            attempt += 1
            try:
                return self._client.chat.completions.create(**self._request(mode, messages, function, schema)), attempt
            except openai.APIStatusError as e:
                text = self._scrub(_error_text(e))
                if e.status_code == 400 and self._adapt(text):
                    attempt -= 1  # our parameters' fault, not the endpoint's: not a try
                    continue
                # A refusal that names the mode is the server's lack of it, whatever its status (llama-cpp-python
                # answers json_schema with a 500 naming response_format): remembered. A bare 400/422 may be this
                # request's own fault (too long a prompt), so only this request moves on to the next mode.
                mentions = any(w in text.lower() for w in MODE_WORDS[mode])
                if mentions or e.status_code in (400, 422):
                    raise ModeRejected(text, remember=mentions) from None
                if not isinstance(e, RETRYABLE):
                    raise EndpointError(text) from None
                if attempt >= self.tries:
                    raise EndpointError(f"{text}, after {attempt} tries") from None
            except RETRYABLE as e:  # connection errors and timeouts
                if attempt >= self.tries:
                    raise EndpointError(self._scrub(f"{_error_text(e)}, after {attempt} tries")) from None
            except openai.OpenAIError as e:
                raise EndpointError(self._scrub(_error_text(e))) from None
            time.sleep(self.retry_base_s * 2 ** (attempt - 1))

    @staticmethod
    def _answer_text(response, function: str) -> str | None:
        """A forced tool call's arguments when there is one, else the message text."""
        try:
            message = response.choices[0].message
        except (AttributeError, IndexError, TypeError):
            return None
        for call in getattr(message, "tool_calls", None) or []:
            fn = getattr(call, "function", None)
            if fn is not None and getattr(fn, "name", None) == function:
                return fn.arguments
        return getattr(message, "content", None)
