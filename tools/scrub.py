"""Secrets out of text that leaves this machine: `scrub(text)` replaces the value of every secret-looking environment
variable found in `text` with `[redacted:NAME]`.

What counts as a secret (docs/PROVIDERS.md, "Secrets"):
- by name: a variable whose name has a part (split at `_`, `-`, `.`) among KEY, TOKEN, SECRET, PASSWORD, PASSWD,
  PASS, PAT, CREDENTIAL(S), CREDS, AUTH, PRIVATE, DSN, COOKIE, SESSION, SIGNATURE, SALT, or a part ending in KEY,
  TOKEN, SECRET or PASSWORD (APIKEY, GHTOKEN), or a name among DATABASE_URL, *_DATABASE_URL, *_URI/_URL whose value
  carries a password (`scheme://user:password@host`); its value when it is at least MIN_NAMED characters long (a
  1-character value would replace that character everywhere);
- by value, whatever the name: a value of at least 16 characters that looks like a credential: a URL with a
  password, a known token prefix (ghp_, github_pat_, sk-, xoxb-, AKIA, glpat-, hf_, eyJ…), or a word (not a path)
  holding a run of at least 16 letters and digits, mixed, with at least 3.3 bits of entropy a character;
- `extra`: values the caller knows are secret (the API key in use), always, however short.

Longer values are replaced first, so that a secret containing another is not left half-visible. The environment is
read at each call: a secret set after import is still caught.
"""
from __future__ import annotations

import math
import os
import re
from collections import Counter
from collections.abc import Mapping

MIN_NAMED = 4       # a secret-named variable's value shorter than this is not searched for (e.g. "1", "no")
MIN_UNNAMED = 16    # a value that is not secret by name must be this long, and look like a credential
SECRET_PARTS = {"KEY", "KEYS", "TOKEN", "TOKENS", "SECRET", "SECRETS", "PASSWORD", "PASSWORDS", "PASSWD", "PASS",
                "PAT", "CREDENTIAL", "CREDENTIALS", "CREDS", "AUTH", "PRIVATE", "DSN", "COOKIE", "SESSION",
                "SIGNATURE", "SALT", "APIKEY"}
SECRET_SUFFIXES = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD")
SECRET_NAMES = {"DATABASE_URL"}
NOT_SECRET = {"PATH", "PWD", "OLDPWD", "HOME", "SHELL", "TERM", "USER", "LOGNAME", "LANG", "TOKENIZERS_PARALLELISM",
              "KEYMAP"}
TOKEN_PREFIXES = ("ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_", "sk-", "sk_live_", "sk_test_", "rk_live_",
                  "xoxb-", "xoxp-", "xoxa-", "xoxs-", "AKIA", "ASIA", "glpat-", "hf_", "ya29.", "eyJ", "npm_",
                  "pypi-", "SG.", "AIza")
URL_PASSWORD = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*:[^/\s@]+@")
WORD = re.compile(r"^[A-Za-z0-9_\-+/=.~]+$")


def secret_name(name: str) -> bool:
    up = name.upper()
    if up in NOT_SECRET:
        return False
    if up in SECRET_NAMES or up.endswith("_DATABASE_URL"):
        return True
    parts = [p for p in re.split(r"[_\-.]", up) if p]
    return any(p in SECRET_PARTS or p.endswith(SECRET_SUFFIXES) for p in parts)


def _entropy(s: str) -> float:
    n = len(s)
    return -sum(c / n * math.log2(c / n) for c in Counter(s).values())


def looks_like_credential(value: str) -> bool:
    """A value that is secret whatever its variable's name: a URL with a password, a known token prefix, or one
    high-entropy word of letters and digits (not a path)."""
    if len(value) < MIN_UNNAMED or len(value) > 8192:
        return False
    if URL_PASSWORD.match(value):
        return True
    if not WORD.match(value) or value.startswith(("/", "~", ".")):
        return False
    if value.startswith(TOKEN_PREFIXES):
        return True
    # one long run of letters and digits, mixed, with enough entropy: a generated key, not a name like
    # "Qwen2.5-Coder-7B-Instruct" or "runs/bench-20261201-155207"
    run = max(re.findall(r"[A-Za-z0-9]+", value), key=len, default="")
    return (len(run) >= MIN_UNNAMED and any(c.isdigit() for c in run) and any(c.isalpha() for c in run)
            and _entropy(run) >= 3.3)


def secrets_in_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """{value: NAME} of every secret in `env` (default: os.environ), longest value first."""
    env = os.environ if env is None else env
    found: dict[str, str] = {}
    for name, value in env.items():
        if not value or not isinstance(value, str):
            continue
        named = secret_name(name) and len(value) >= MIN_NAMED
        url_password = name.upper().endswith(("_URL", "_URI")) and URL_PASSWORD.match(value)
        if named or url_password or looks_like_credential(value):
            found.setdefault(value, name)
    return dict(sorted(found.items(), key=lambda kv: -len(kv[0])))


def scrub(text, extra: Mapping[str, str] | None = None, env: Mapping[str, str] | None = None) -> str:
    """`text` (anything: str() is taken) with every secret value replaced: `extra` {value: label} first, each by
    its label, then the environment's, each by `[redacted:NAME]`."""
    text = str(text)
    for value, label in sorted((extra or {}).items(), key=lambda kv: -len(kv[0])):
        if value:
            text = text.replace(value, label)
    for value, name in secrets_in_env(env).items():
        if value in text:
            text = text.replace(value, f"[redacted:{name}]")
    return text


def scrub_messages(messages: list[dict], extra: Mapping[str, str] | None = None) -> list[dict]:
    """Chat messages with every string content scrubbed (a list of content parts: each text part)."""
    out = []
    for m in messages:
        m = dict(m)
        content = m.get("content")
        if isinstance(content, str):
            m["content"] = scrub(content, extra)
        elif isinstance(content, list):
            m["content"] = [({**p, "text": scrub(p["text"], extra)} if isinstance(p, dict)
                             and isinstance(p.get("text"), str) else p) for p in content]
        out.append(m)
    return out
