"""The loop without drafts: every step verifies the root alone, one token per target forward.

The reference the other methods are measured against: its greedy output is ``generate(do_sample=False)``'s, and
under coupled sampling (:mod:`hf_specdec.coupling`) its text is what every method gives for the same seed. It runs
the loop's own one-token steps (the target runner's kernels, the same masks and caches), so comparing a method with
it measures the speculation alone.

Example:
    >>> out = model.generate(**inputs, do_sample=True, seed=7, max_new_tokens=64,
    ...                      custom_generate=hf_specdec.decoding_method("plain"))
"""

from __future__ import annotations

from ..registry import Method, Shorthand
from .base import Proposer


class PlainProposer(Proposer):
    """Proposes nothing: the loop takes a plain decoding step every time."""

    name = "plain"
    adaptive = False  # nothing for the speculation gate to switch off

    def propose(self, state):
        return None


METHOD = Method(
    name="plain",
    summary="no drafts: the loop's one-token steps (the reference coupled sampling equals)",
    description="The speculative loop with no drafter: one token per target forward. Greedy output equals "
                "`generate(do_sample=False)`; sampled with coupled sampling (the default), its text is the text every "
                "other method gives for the same seed, so it is the reference to compare a method against, and the "
                "baseline that measures what speculation adds over the loop's own kernels.",
    build=lambda target, opts: PlainProposer(),
    shorthands={"plain_loop": Shorthand("", lambda arg: {})},
    reference=True,
)
