"""Broken candidate: off-by-one KV position after a rejection.

After a decoding step in which a row rejected one of its drafts, the row's length is advanced one slot too far: the
slot after its last emitted token (holding the target's guess after the rejected draft) is taken as part of the
row, and every later token's K/V and rotary position is one off. Each step's own tokens still reach the host, so
the damage shows only from the next step on. (The decoder's step and the drafter's proposal are wrapped.)
"""
from specpilot.engine.decode import Decoder

_step = Decoder._step


def step(self, st, sampling, drafts_k=None):
    if not self.k or (drafts_k is not None and drafts_k <= 0):  # a step that verifies nothing rejects nothing
        return _step(self, st, sampling, drafts_k)
    seen = {}
    propose = self.drafter.propose

    def spy(*args, **kwargs):
        seen["proposal"] = propose(*args, **kwargs)
        return seen["proposal"]

    self.drafter.propose = spy
    try:
        _step(self, st, sampling, drafts_k)
    finally:
        del self.drafter.propose  # back to the class's method
    rejected = st.out[:, 0] < seen["proposal"].valid
    st.lengths.add_((rejected & st.active).long())


Decoder._step = step
