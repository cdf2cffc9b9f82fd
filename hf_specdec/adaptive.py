"""The adaptive rules of the decoding loop, and one switch per rule: :class:`Rules`.

Every method drafts, verifies and accepts by exact rules; *how much* it drafts, and whether it drafts at all, is
decided while it runs, from measurements, by the rules that :class:`Rules` names field by field (each field's line
says what the rule does and what takes its place when it is off). None of them changes what is committed: greedy
output is the target's own ``generate(do_sample=False)`` with any of them off; each changes only the speed.

Each rule here earned its place in a same-run ablation (``benchmarks/ablation.py``: every rule switched off in turn
against the full set and a control, chat / math / copy, batch 1 and 4, quiet, one core busy, busy by turns, first
calls; benchmarks/RESULTS.md, "the adaptive rules switched off one at a time"). Rules that did not measurably pay
were removed (issue 38): timing the tree sizes before decoding, forced plain steps to re-measure the one-token unit,
drafters' confidence calibration, the batch's common draft cap, and the back-off's hysteresis and realized-token
credit. The kept rules act in five places:

* the target's forward costs (:class:`~hf_specdec.costs.ForwardCostModel`, kept per runner and batch size across
  calls): sizes measured while decoding, each the minimum of its recent samples, a prior table per runner, device
  and dtype for sizes not measured yet, an exploratory draft now and then where drafting looks unprofitable;
* the speculation gate of a batch (:class:`~hf_specdec.costs.SpeculationGate`): plain pauses sized by the loss,
  judged again quickly after a pause;
* a drafter's back-off (:class:`~hf_specdec.proposers.base.BackOff`): proposals that do not pay, drafting time
  included, are skipped for growing stretches;
* drafters' shapes: EAGLE-3's (and MTP's) depth limit, DFlash's head-first LM head;
* the drafter-free sources: hybrid's per-row choice, suffix decoding's per-bucket calibration, prompt lookup's
  per-key acceptance, lookahead's window pause, universal drafting's rare retries of a hopeless drafter.

The per-row draft counts themselves (the most expected tokens per unit of measured cost,
:func:`~hf_specdec.costs.best_count`) are the methods' ``draft_length_schedule``: ``"constant"`` switches them, with
every rule above that a method applies to its own drafts, off.

A call's rules are the loop option ``adaptive_rules`` (default: every rule on) and travel with the call only:
:func:`~hf_specdec.engine.speculative_decode` puts them on the call's :class:`~hf_specdec.state.DecodingState`
(``state.rules``), whose ``cost_model`` is the call's view of the runner's kept costs under them
(:class:`~hf_specdec.costs.CallCosts`: the kept model never holds a call's rules); proposers take ``state.rules`` in
``begin``.

Example::

    from hf_specdec.adaptive import Rules

    rules = Rules().without("exploration", "backoff")
    out = model.generate(**inputs, max_new_tokens=64, custom_generate=hf_specdec.decoding_method("eagle3"),
                         adaptive_rules=rules)
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Rules:
    """One switch per adaptive rule, every one on by default (the library's behaviour). Immutable: a call's rules are
    a value; :meth:`without` gives a copy with some off."""

    # ---- the target's forward costs (hf_specdec.costs.ForwardCostModel, read through CallCosts)
    # costs are what was measured while decoding (the target per tree size, a drafter per token); off: priors only
    measured_costs: bool = True
    # sizes not measured yet follow a prior table per runner, device and dtype; off: one table (the accelerators')
    device_priors: bool = True
    # a time is the minimum of its recent samples (other work only slows a forward); off: its latest sample
    recent_minimum: bool = True
    # where drafting looks unprofitable, one draft anyway at most every 16 forwards; off: no exploration
    exploration: bool = True

    # ---- the speculation gate of a batch (hf_specdec.costs.SpeculationGate, engine)
    # a batch whose drafts did not pay decodes plainly for a pause, then retries; off: a batch always asks for drafts
    gate: bool = True
    # a pause is sized by the measured loss and doubles while retries lose (8 to 256 steps); off: always 8 steps
    gate_loss_pause: bool = True
    # a retry after a pause is judged on 2 steps; off: on 6, as the first judgement
    gate_quick_retry: bool = True

    # ---- a drafter's back-off (hf_specdec.proposers.base.BackOff: EAGLE-3, DFlash, Medusa, MTP, universal)
    # proposals that do not pay for themselves are skipped for 1, 2, 4 .. 16 steps; off: a proposal every step
    backoff: bool = True

    # ---- drafters' shapes
    # EAGLE-3 / MTP draft one depth past where the last proposal could still gain 2 %; off: always the full depth
    eagle3_depth_limit: bool = True
    # DFlash scores 4 block positions first and the rest only while a row's drafts are likely; off: every position
    dflash_head_first: bool = True

    # ---- the drafter-free sources
    # hybrid= takes per row the source with more tokens per unit of cost; off: the drafter-free draft when there is one
    hybrid_choice: bool = True
    # suffix decoding scales its probabilities per (source, match-length bucket) by what was accepted; off: unscaled
    suffix_calibration: bool = True
    # prompt lookup estimates acceptance per (n-gram size, last draft all accepted); off: one estimate for all matches
    lookup_keys: bool = True
    # lookahead runs its window only while it pays (else off for 1, 2 .. 32 steps); off: the window always runs
    lookahead_window_pause: bool = True
    # universal drafting retries a drafter that cannot pay even fully accepted every 128 steps; off: as any, every 16
    universal_hopeless: bool = True

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Every rule's name, in the order of the fields."""
        return tuple(f.name for f in dataclasses.fields(cls))

    def without(self, *names: str) -> "Rules":
        """A copy with the rules ``names`` off (an unknown name raises ``ValueError`` listing the rules).

        Example:
            >>> Rules().without("backoff", "recent_minimum").off()
            ('recent_minimum', 'backoff')
        """
        unknown = [n for n in names if n not in self.names()]
        if unknown:
            raise ValueError(f"Unknown adaptive rule(s) {', '.join(unknown)}; the rules are: "
                             f"{', '.join(self.names())}.")
        return dataclasses.replace(self, **{n: False for n in names})

    def off(self) -> tuple[str, ...]:
        """The names of the rules that are off, in the order of the fields."""
        return tuple(n for n in self.names() if not getattr(self, n))


ALL_ON = Rules()  # the default: every rule on (immutable, as every Rules)
