"""Nothing sent to an LLM provider holds a secret (issue 19, item 5): secrets from the environment placed in a real
tool's result, an exception message, a gap's reason and a memory hit reach the OpenAI-compatible provider's prompt,
and the fake server on loopback (tests/test_providers.py's) receives none of their values; tools/scrub.py's rules
on their own. No model is loaded."""
from __future__ import annotations

import json
from dataclasses import asdict

from test_providers import FakeServer, answer, completion, error, llm
from specpilot.engine.recipe import load_recipe
from specpilot.graph.candidates import AgentContext
from specpilot.tools import agent_tools
from specpilot.tools.scrub import looks_like_credential, scrub, secret_name, secrets_in_env

PAT = "ghp_R8x2Kq9ZtLm4Vw7Yc1Nb6Hd3Jf5Gs0Pa"
DB = "postgres://u:p@h/db"
API_KEY = "sk-specpilot-0c5e7a91d2b84f36"
UNNAMED = "Zq7Wm2Xc9Vb4Nl6Kj8Hg"  # a credential in a variable whose name says nothing


def set_secrets(monkeypatch) -> list[str]:
    monkeypatch.setenv("GITHUB_PAT", PAT)
    monkeypatch.setenv("DATABASE_URL", DB)
    monkeypatch.setenv("SPECPILOT_API_KEY", API_KEY)
    monkeypatch.setenv("SERVICE_CONFIG_X", UNNAMED)
    return [PAT, DB, API_KEY, UNNAMED]


def leaky_context(tmp_path) -> AgentContext:
    """A round whose gaps, memory and profile carry what tools and exceptions said, secrets included."""
    # a real tool result: the profile tool's error names the recipe path, which holds the token
    tool = agent_tools.profile(recipe=str(tmp_path / f"recipe-{PAT}.json"), out_dir=str(tmp_path / "p")).to_dict()
    assert not tool["ok"] and PAT in tool["error"]
    try:
        raise ConnectionError(f"could not reach {DB} with token {PAT} (key {API_KEY}, config {UNNAMED})")
    except ConnectionError as e:
        crash = f"{type(e).__name__}: {e}"
    outcome = {"candidate": {"agent": "algorithm", "reason": crash, "recipe_patch": {"k": 2}},
               "deployment": {"target": "smollm2-135m", "device": "cpu"}, "results": {"error": tool["error"]},
               "gate": {"passed": False, "reason": crash}, "failure": crash}
    gaps = [{"component": "verify", "measured_s": 0.01, "floor_s": 0.005, "gap_s": 0.005, "gain": 0.5,
             "agent": "algorithm", "reason": tool["error"]}]
    return AgentContext("algorithm", {"target": "smollm2-135m", "device": "cpu", "note": crash},
                        asdict(load_recipe("stock")), {"meta": {"target": crash}}, gaps,
                        [{"outcome": outcome, "score": 1.0, "flags": []}], [], 3)


def test_no_secret_reaches_the_llm_provider(tmp_path, monkeypatch):
    secrets = set_secrets(monkeypatch)
    ctx = leaky_context(tmp_path)
    # propose: a first answer that is invalid and quotes the secrets back (the repair round sends it and the
    # validation error to the server), then a valid one; route: an error that echoes the key, then an answer
    bad = answer({"reason": f"use {PAT}", "recipe_patch": {"k": "x"}})
    with FakeServer([completion(bad), completion(answer()),
                     lambda h: error(500, f"bad {h.headers['Authorization']} {DB}"),
                     completion(json.dumps({"agents": ["algorithm"], "reason": f"since {DB} failed"}))]) as server:
        provider = llm(server, tries=2)
        assert provider.propose(ctx) == []
        decision = provider.route(ctx.gaps, ctx.memory_hits, ctx.deployment)
    assert decision.agents == ["algorithm"]
    assert len(server.requests) == 4 and not server.script
    bodies = json.dumps(server.requests)
    leaked = [s for s in secrets if s in bodies]
    assert not leaked, f"sent to the provider: {leaked}"
    for name in ("GITHUB_PAT", "DATABASE_URL", "SERVICE_CONFIG_X"):
        assert f"[redacted:{name}]" in bodies  # the secrets were in the prompts, and were replaced
    assert "***" in bodies  # the key in use
    # the key still authenticates: it went in the header only
    assert all(h["authorization"] == f"Bearer {API_KEY}" for h in server.headers)
    trail = json.dumps(provider.trail)
    assert not [s for s in secrets if s in trail]


def test_scrub_rules(monkeypatch):
    set_secrets(monkeypatch)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # named like a token, not one
    monkeypatch.setenv("MY_TOKEN", "ab")  # too short to search for: it would garble every "ab"
    monkeypatch.setenv("SPECPILOT_TARGET", "Qwen2.5-Coder-7B-Instruct")  # a name, not a credential
    monkeypatch.setenv("REDIS_URL", "redis://:hunter2pass@cache:6379/0")
    text = (f"{PAT} {DB} {API_KEY} {UNNAMED} false about Qwen2.5-Coder-7B-Instruct "
            "redis://:hunter2pass@cache:6379/0 /usr/bin")
    out = scrub(text, {API_KEY: "***"})
    assert out == ("[redacted:GITHUB_PAT] [redacted:DATABASE_URL] *** [redacted:SERVICE_CONFIG_X] false about "
                   "Qwen2.5-Coder-7B-Instruct [redacted:REDIS_URL] /usr/bin")
    assert scrub(API_KEY) == "[redacted:SPECPILOT_API_KEY]"
    found = secrets_in_env()
    assert "false" not in found and "ab" not in found and "Qwen2.5-Coder-7B-Instruct" not in found
    assert list(found) == sorted(found, key=len, reverse=True)  # a secret holding another goes first
    assert all(secret_name(n) for n in ("GITHUB_PAT", "DATABASE_URL", "AWS_SECRET_ACCESS_KEY", "HF_TOKEN",
                                        "SMTP_PASSWD", "GCP_CREDENTIALS", "SENTRY_DSN", "X_AUTH", "APIKEY"))
    assert not any(secret_name(n) for n in ("PATH", "PWD", "TOKENIZERS_PARALLELISM", "PATCH_LEVEL", "HOME"))
    assert looks_like_credential("dGhpcyBpcyBhIHNlY3JldCB2YWx1ZQ==")
    assert not any(looks_like_credential(v) for v in ("runs/bench-20261201-155207", "/usr/local/cuda-12.4/bin",
                                                      "SmolLM2-135M-Instruct.Q4_1.gguf", "short1"))
