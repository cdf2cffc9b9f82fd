"""The proposer interface: the only part of the loop a method writes."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # pragma: no cover
    from ..state import DecodingState
    from ..tree import DraftTree
    from ..verify import AcceptResult


class BackOff:
    """Exponential back-off for a drafter that does not pay: after a proposal that was not worth it, skip the next
    1, 2, 4 .. ``limit`` proposals; one that pays resets it.

    :meth:`judge` decides "worth it" with the drafting time included: expected committed tokens over the cost of the
    verification plus the proposal, both in one-token target steps, must reach plain decoding's 1 token per step.
    """

    def __init__(self, limit: int = 16):
        self.limit, self.skip, self.length = limit, 0, 0
        self.draft_cost = 0.0  # a proposal's time in units of a one-token target step (running)

    def judge(self, state, seconds: float | None, expected: float | None, verify: float | None) -> None:
        """Record a proposal that took ``seconds`` and whose best draft expects ``expected`` tokens for a
        verification costing ``verify`` steps (``expected=None``: only record the time; ``seconds=None``: an
        untypical proposal, e.g. one that fed a backlog of context, whose time is not recorded)."""
        step = state.cost_model.step_seconds() if state.cost_model is not None else None
        if step and seconds is not None:
            rel = seconds / step
            self.draft_cost = 0.8 * self.draft_cost + 0.2 * rel if self.draft_cost else rel
        if expected is not None and self.draft_cost:
            self.update(paid=expected / (verify + self.draft_cost) >= 1.0)

    def skipping(self) -> bool:
        """Whether this step's proposal is skipped (counts the step down)."""
        if self.skip > 0:
            self.skip -= 1
            return True
        return False

    def update(self, paid: bool) -> None:
        self.length = 0 if paid else min(max(1, 2 * self.length), self.limit)
        self.skip = self.length


class Proposer:
    """Drafts tokens for the decoding loop (:func:`hf_specdec.engine.speculative_decode`).

    Life cycle inside one ``generate`` call: ``prepare`` before the target's prefill, ``begin`` after it (the first
    token is committed), then per step ``propose`` ->
    (target verifies) -> ``commit``; ``end`` once. A proposer keeps its own state (a drafter KV cache, n-gram
    statistics) and nothing global.

    Attributes:
        target_hidden_states: indices into the target's ``hidden_states`` tuple (``0`` = embeddings, ``i`` = output of
            layer ``i``) that the proposer needs from every target forward, or ``None``. They arrive in
            ``begin``/``commit`` through ``state.hidden_states``.
        max_nodes: upper bound of the tree size ``N`` it proposes (root included); sizes static caches.
        name: the method name used in statistics and error messages.
    """

    target_hidden_states: list[int] | None = None
    max_nodes: int = 1
    name: str = "proposer"

    def draft_modules(self) -> list:
        """The modules only drafting runs (default: ``self.drafter`` when it is one). The target runner may give
        them faster kernels for the call (:mod:`hf_specdec.runners`)."""
        drafter = getattr(self, "drafter", None)
        return [drafter] if isinstance(drafter, torch.nn.Module) else []

    def prepare(self, model) -> None:
        """Called before the target's prefill: check the proposer fits ``model`` and set ``target_hidden_states``."""

    def begin(self, state: "DecodingState") -> None:
        """Called once after the target's prefill (the first token is already committed)."""

    def propose(self, state: "DecodingState") -> "DraftTree | None":
        """Return the drafts for every row (``None``: no drafts, a plain decoding step).

        Rows with ``state.max_drafts[b] == 0`` (inactive or out of budget) must get no drafts; the tree depth of
        row ``b`` must not exceed ``state.max_drafts[b]``.
        """
        raise NotImplementedError

    def commit(self, state: "DecodingState", tree: "DraftTree", result: "AcceptResult") -> None:
        """Called after every verification with what was kept (the target cache is already cut back)."""

    def on_compact(self, state: "DecodingState", index) -> None:
        """The target cache columns were rebuilt from ``index`` ``[B, T']``; re-align any state that mirrors them."""

    def end(self, state: "DecodingState") -> None:
        """Called once when the generate call finishes."""
