"""Broken candidate: verifies drafts with the layer-skipped model instead of the target.

Every verification forward (more than one token, not a prefill) runs only the target's first layer, then its final
norm and LM head: the drafts are checked against a shallow model's argmax, not the target's.
"""
from specpilot.engine.model import Transformer

LAYERS = 1
_forward = Transformer.forward


def forward(self, tokens, positions, cache, n_layers=None, logits_at=None, ops=None, layer_fn=None, live=None,
            **more):
    if tokens.shape[1] > 1 and n_layers is None and logits_at is None:
        n_layers = LAYERS
    return _forward(self, tokens, positions, cache, n_layers, logits_at, ops, layer_fn, live, **more)


Transformer.forward = forward
