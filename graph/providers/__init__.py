"""Providers: the deterministic cost-model policy (default) and any OpenAI-compatible endpoint."""
from __future__ import annotations

from .base import Provider

PROVIDERS = ("policy", "openai")


def make_provider(name: str = "policy", model: str | None = None, base_url: str | None = None, **kw) -> Provider:
    """`policy`, or `openai` with a model (also written `openai:<model>`) and optionally a base URL; keyword
    arguments go to the provider (OpenAIProvider: timeout_s, tries, retry_base_s, use_tools, max_tokens, ...)."""
    kind, _, suffix = (name or "").partition(":")
    if kind == "policy" and not suffix:
        if model or base_url or kw:
            given = ", ".join([n for n, v in (("model", model), ("base_url", base_url)) if v] + sorted(kw))
            raise ValueError(f"the policy provider takes no options (given: {given}); they are for 'openai'")
        from .policy import PolicyProvider

        return PolicyProvider()
    if kind == "openai":
        if suffix and model and suffix != model:
            raise ValueError(f"provider {name!r} names model {suffix!r} but model {model!r} was given")
        from .openai_compat import OpenAIProvider

        return OpenAIProvider(suffix or model or "", base_url, **kw)
    raise ValueError(f"unknown provider {name!r} (providers: policy, openai or openai:<model>)")
