"""Broken candidate: samples instead of decoding greedily (temperature 0.8, top-k 5).

Speculative sampling preserves the *sampled* distribution, so every token is plausible, but it is not the target's
argmax.
"""
from specpilot.engine.engine import Engine
from specpilot.engine.sampling import SamplingParams

_generate = Engine.generate


def generate(self, prompts, max_new_tokens, sampling=None, *args, **kwargs):
    return _generate(self, prompts, max_new_tokens, SamplingParams(temperature=0.8, top_k=5), *args, **kwargs)


Engine.generate = generate
