"""The proposer interface: the only part of the loop a method writes."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import DynamicCache

from .. import cache as cache_ops
from ..adaptive import ALL_ON, Rules
from ..costs import RecentMinimum
from ..tree import DraftTree

if TYPE_CHECKING:  # pragma: no cover
    from ..state import DecodingState
    from ..verify import AcceptResult


def rules_of(state) -> Rules:
    """The call's adaptive rules (:class:`~hf_specdec.adaptive.Rules`); every rule on for a state that carries none
    (a proposer driven by a state of its caller's own making)."""
    return getattr(state, "rules", ALL_ON)


class BackOff:
    """Exponential back-off for a drafter that does not pay: after proposals that were not worth it, skip the next
    1, 2, 4 .. ``limit`` proposals; one that pays resets it.

    :meth:`judge` decides "worth it" with the drafting time included: the expected committed tokens over the cost
    of the verification plus the proposal, both in one-token target steps, must reach plain decoding's 1 token per
    step. The decision survives a busy machine: the drafting time is the minimum of the recent ones
    (:class:`~hf_specdec.costs.RecentMinimum`, as the target's costs are). ``rules``: the call's
    (:mod:`hf_specdec.adaptive`): ``backoff`` off never skips, ``recent_minimum`` off takes the latest time.
    """

    def __init__(self, limit: int = 16, rules: Rules = ALL_ON):
        self.limit, self.skip, self.length = limit, 0, 0
        self.rules = rules
        self._step: float | None = None
        self.draft_times = RecentMinimum(window=8 if rules.recent_minimum else 1)

    @property
    def draft_cost(self) -> float:
        """A proposal's time in units of a one-token target step (0 until both are measured)."""
        seconds, step = self.draft_times.value(), self._step
        return seconds / step if seconds is not None and step else 0.0

    def judge(self, state, seconds: float | None, expected: float | None, verify: float | None) -> None:
        """Record a proposal that took ``seconds`` and whose best draft expects ``expected`` tokens for a
        verification costing ``verify`` steps (``expected=None``: only record the time; ``seconds=None``: an
        untypical proposal, e.g. one that fed a backlog of context, whose time is not recorded)."""
        self._step = state.cost_model.step_seconds() if state.cost_model is not None else None
        if seconds is not None:
            self.draft_times.add(seconds)
        if expected is not None and self.draft_cost:
            self.update(paid=expected / (verify + self.draft_cost) >= 1.0)

    def skipping(self) -> bool:
        """Whether this step's proposal is skipped (counts the step down; never with the rule backoff off)."""
        if self.skip > 0 and self.rules.backoff:
            self.skip -= 1
            return True
        return False

    def update(self, paid: bool) -> None:
        self.length = 0 if paid else min(max(1, 2 * self.length), self.limit)
        self.skip = self.length


def next_draft(state, logits: torch.Tensor, prefixes, drafts: list, process, want_probs: bool = False):
    """One more draft per row of a chain from the drafter's ``logits [B, V]`` (fp32, the target's vocabulary): the
    call's logits processors applied with each row's own prefix and its drafts so far (``process``:
    :meth:`DecodingState.process_fn`, ``None`` without processors; ``prefixes``: each row's committed ids), then
    sampled when the call samples, else the argmax. Returns ``(tokens [B], probs [B, V] or None)``: ``probs`` is the
    distribution the drafts come from (the softmax of the processed logits; the exact sampling rule needs it), given
    when the call samples or ``want_probs``. Under coupled sampling the draft is the argmax of the logits with the
    call's warpers and the drafted position's noise (:meth:`DecodingState.perturb`)."""
    logits = state.perturb(logits, len(drafts))
    if process is not None:
        logits = torch.cat([
            process(b, torch.cat([prefixes[b]] + [d[b:b + 1] for d in drafts])[None], logits[b:b + 1])
            for b in range(logits.shape[0])
        ])
    return draw(logits, state.do_sample, want_probs)


def draw(scores: torch.Tensor, sample: bool, want_probs: bool = True):
    """:func:`next_draft`'s draw from ``scores [B, V]`` (processed, perturbed): ``(tokens [B], probs [B, V] or
    None)``, drawn from their softmax when ``sample``, else the argmax; ``probs`` when ``sample`` or ``want_probs``.
    Tensor operations only: a fixed-shape region draws with it too (LayerSkip's drafting step)."""
    probs = torch.softmax(scores, dim=-1) if sample or want_probs else None
    tokens = torch.multinomial(probs, 1)[:, 0] if sample else scores.argmax(-1)
    return tokens, probs


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
        max_path: upper bound of a path's length in its trees (root included; ``None``: ``max_nodes``; read through
            :meth:`longest_path`): the most columns a step keeps, whose sizes ``compile=True`` compiles up front (a
            longer path only compiles later).
        name: the method name used in statistics and error messages.
        typical_acceptance: ``(threshold, alpha)`` to verify with Medusa's typical acceptance (lossy, sampling
            only; :func:`hf_specdec.verify.accept`), or ``None`` for the exact rules.
        rules: the call's adaptive rules (:class:`~hf_specdec.adaptive.Rules`): a proposer with rules of its own
            takes ``state.rules`` in ``begin``; every rule on until then.
        merges_rows: whether its trees may be merged row by row with another source's drafts in one verification
            (hybrid drafting, :mod:`.hybrid`); ``False`` for a proposer whose drafting writes into the target's cache
            (LayerSkip): hybrid drafting then takes the other source for all rows or for none.
    """

    target_hidden_states: list[int] | None = None
    rules: Rules = ALL_ON
    typical_acceptance: tuple[float, float] | None = None
    max_nodes: int = 1
    max_path: int | None = None
    name: str = "proposer"
    merges_rows: bool = True
    _fixed = None  # the compiled runner while the call drafts at fixed shapes (:meth:`draft_at_fixed_shapes`)
    _layout = None  # the call's BufferedLayout while it drafts at fixed shapes over one (:meth:`_hold_layout`)

    def longest_path(self) -> int:
        """The longest path its trees may have, root included (:attr:`max_path`, at most :attr:`max_nodes`)."""
        return max(1, min(self.max_path or self.max_nodes, self.max_nodes))

    def draft_modules(self) -> list:
        """The modules only drafting runs (default: ``self.drafter`` when it is one). The target runner may give
        them faster kernels for the call (:mod:`hf_specdec.runners`)."""
        drafter = getattr(self, "drafter", None)
        return [drafter] if isinstance(drafter, torch.nn.Module) else []

    def network_parts(self) -> list["Proposer"]:
        """The proposers (this one, or parts of it) whose :meth:`propose` runs a drafter network. With
        ``compile=True`` the runner compiles their ``propose`` for the call (:mod:`hf_specdec.compiled`), which is
        only worth it where drafting is tensor work: a proposer drafting from host data (n-gram tables, text) has
        none. Default: this proposer when it has :meth:`draft_modules`."""
        return [self] if self.draft_modules() else []

    def draft_at_fixed_shapes(self, runner) -> bool:
        """Offered by a compiled call (``compile=True``, :mod:`hf_specdec.compiled`) to each of
        :meth:`network_parts` at its first proposal: draft through the runner's fixed-shape regions
        (``runner.fixed(fn)``, :mod:`hf_specdec.graphs`: one CUDA graph per shape on a GPU) instead of having
        :meth:`propose` compiled whole with dynamic shapes. Returns whether this proposer does so for the call; called
        again with ``runner=None`` when the call ends. Default: it does not."""
        return False

    def _on(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the drafter's device (no call when it is there: a step makes many of these)."""
        return t if t.device == self.device else t.to(self.device)

    def _take_fixed_cache(self, state, rows: int, heads: int, head_dim: int, layers: int) -> int:
        """Draft over the fixed cache of this drafter, batch size and width (:meth:`_fixed_cache_of`), from its first
        column (``self.cache``, ``self.synced = 0``). Returns the first column after the scratch one (the guesses')."""
        self.cache, base = self._fixed_cache_of(self.drafter, state, rows, heads, head_dim, layers, self.dtype,
                                                self.device)
        self.synced = 0
        return base

    def _hold_layout(self, state) -> bool:
        """Drafting at fixed shapes: keep the call's layout as ``self._layout`` when ``compile=True`` holds it in
        buffers on the drafter's cache's device (:class:`~hf_specdec.cache.BufferedLayout`: a feed then makes its
        inputs inside its region from them), else ``None``; its :meth:`graph_key` holds it. Returns whether it is."""
        layout = state.layout
        held = isinstance(layout, cache_ops.BufferedLayout) and layout.buffers[0].device == self.cache.keys[0].device
        self._layout = layout if held else None
        return held

    def _fixed_cache_of(self, drafter, state, rows: int, heads: int, head_dim: int, layers: int, dtype, device):
        """The fixed cache of ``drafter`` for this batch size and width (:class:`~hf_specdec.cache.FixedDraftCache`):
        the target's static cache columns, a scratch column (where padding rows write, which no row sees) and ``rows``
        columns of the drafter's own guesses after it. The runner keeps it for later calls (one per drafter: a call of
        another shape replaces it), so their regions find their graphs recorded over it. Returns ``(cache, the first
        column after the scratch one)``."""
        base = state.cache.get_max_length() + 1
        key = (state.batch_size, base + rows, dtype, str(device))
        kept = self._fixed.draft_buffers.get(drafter)
        if kept is None or kept[0] != key:
            kept = (key, cache_ops.FixedDraftCache(base + rows).allocate(state.batch_size, heads, head_dim, layers,
                                                                         dtype, device))
            self._fixed.draft_buffers[drafter] = kept
        return kept[1], base

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

    # ---- a conversation continued from its cache (docs/usage.md, "Continued conversations")
    def can_continue(self, carried) -> bool:
        """Whether a call can start from a target cache that already holds the first input columns, given
        ``carried`` (what :meth:`hand_back` returned with that cache, or ``None``): the prefill then runs over the
        other columns only and ``begin`` finds ``state.cached``/``state.carried`` set. Called after ``prepare``. The
        default: a proposer that reads no target hidden states rebuilds its state from the token ids. ``False``: the
        call prefills every column again (the same output)."""
        return not self.target_hidden_states

    def hand_back(self, state: "DecodingState", index: torch.LongTensor):
        """Called after ``end`` when the call's cache goes back to the caller: its columns were rebuilt from
        ``index`` ``[B, C]`` (column ``j`` is now the old column ``index[b, j]``, token ``j`` of the output), as in
        :meth:`on_compact`. Returns what a later call continuing from that cache needs (:class:`Carried`; it comes
        back as ``state.carried``), or ``None``."""
        return None


def draft_vocab_ids(state, drafter, size: int) -> torch.LongTensor | None:
    """The target ids of ``drafter``'s vocabulary of ``size`` entries (its ``draft_to_target``), for
    :meth:`DecodingState.perturb`; ``None`` when it drafts in the target's vocabulary or the call is not coupled."""
    if state.coupling is None or size == state.coupling.vocab:
        return None
    key = (id(drafter), size)
    if key not in state.vocab_ids:
        state.vocab_ids[key] = drafter.draft_to_target(torch.arange(size, device=state.device))
    return state.vocab_ids[key]


@dataclass
class Carried:
    """What a proposer hands back with a call's cache (:meth:`Proposer.hand_back`) for the call that continues from
    it: ``features [B, C, F]``, the drafter's fused target features of the cache's ``C`` columns (``key`` names them:
    hidden-state indices and dtype), and ``cache``, the drafter's own KV cache over the first ``synced`` of those
    columns, which belongs to the module ``drafter`` refers to (a weak reference)."""

    drafter: weakref.ref | None = None
    cache: object = None
    synced: int = 0
    features: torch.Tensor | None = None
    key: tuple | None = None

    @classmethod
    def of(cls, drafter, cache, synced: int, **kw) -> "Carried":
        return cls(drafter=weakref.ref(drafter), cache=cache, synced=synced, **kw)

    def cache_for(self, drafter) -> tuple[object, int]:
        """``(cache, synced)`` for ``drafter`` to continue with: its own cache, or a fresh one when this is another
        drafter's."""
        if self.cache is not None and self.drafter is not None and self.drafter() is drafter:
            return self.cache, self.synced
        return DynamicCache(), 0


@dataclass
class RowDraft:
    """One row's candidate: ``tokens`` with ``parents`` (``0`` = the root, ``i`` = the ``i``-th draft), best first;
    ``reach[i]``: the estimated probability that draft ``i`` is accepted (calibrated); ``key``: what the proposer
    learns from its outcome."""

    tokens: list[int]
    parents: list[int]
    reach: list[float]
    key: object = None

    @property
    def expected(self) -> float:
        """Expected committed tokens when verified (the target's own token included)."""
        return 1.0 + sum(self.reach)

    @property
    def is_chain(self) -> bool:
        return self.parents == list(range(len(self.tokens)))


def tree_from_row_drafts(state, drafts: list[RowDraft | None]) -> DraftTree | None:
    """The draft tree of per-row candidates (``None``: no drafts)."""
    return DraftTree.from_rows(state.roots(), [d.tokens if d is not None else [] for d in drafts],
                               [d.parents if d is not None else [] for d in drafts])
