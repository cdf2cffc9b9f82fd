"""The shared base of proposers whose drafter reads the target's hidden states (EAGLE-3, DFlash, Medusa, MTP).

What every such proposer does the same way, written once here:

* **feature capture**: :meth:`prepare` binds the drafter to the target and asks the loop for the hidden states it
  reads (``target_hidden_states``); every verification forward returns them.
* **mirroring**: ``features [B, T, F]`` holds one fused target feature per target cache column, holes included, so
  it mirrors the target cache's column layout; after a step the features of the accepted path's nodes are appended
  (:meth:`commit`), after a compaction the same columns are gathered (:meth:`on_compact`). ``cache`` is the
  drafter's own KV cache and ``synced`` the number of target columns whose drafter rows it holds.
* **sizing**: the drafter's confidences (a draft's probability of lying on the accepted path) predict how many
  drafts are accepted; :meth:`_pays` and :meth:`_cut_chains` keep the drafts that pay for their verification.
* **back-off**: ``backoff`` (:class:`~hf_specdec.proposers.base.BackOff`) skips proposals that do not pay.

The call's adaptive rules (``rules``) are taken from the state in ``begin`` (:meth:`_start`).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache

from .. import cache as cache_ops
from ..costs import best_count
from ..syncs import to_device
from ..tree import additive_mask, build_attention_mask
from .base import BackOff, Carried, Proposer, draft_vocab_ids, rules_of


class FeatureDrafterProposer(Proposer):
    """Base class: subclasses set ``name``, implement :meth:`propose` and, if their drafter reads other
    ``hidden_states`` indices than its layer ids, :meth:`hidden_state_ids`.

    Args:
        drafter: a drafter with ``bind_target(model)`` and ``feature_layer_ids(config)``.
        adaptive: size drafts from the measured costs and the drafter's confidence, and back off when
            drafting does not pay (the subclass's rule); ``False`` always drafts the most it may.
    """

    BACKLOG = 8  # a proposal that feeds more context columns than this is not a typical step's drafting cost

    def __init__(self, drafter, adaptive: bool = True):
        self.drafter = drafter
        self.adaptive = adaptive
        self.target_hidden_states = None

    def hidden_state_ids(self, layer_ids: list[int]) -> list[int]:
        """The target ``hidden_states`` indices the drafter's ``layer_ids`` name (default: the same)."""
        return list(layer_ids)

    # ---- life cycle
    def prepare(self, model) -> None:
        self.drafter.bind_target(model)
        self.layer_ids = self.drafter.feature_layer_ids(model.config)
        self.target_hidden_states = self.hidden_state_ids(self.layer_ids)

    def begin(self, state) -> None:
        self._start(state)
        self.cache = DynamicCache()
        self.synced = 0
        self.features = self._fuse(state.hidden_states)  # [B, T, F]: one fused feature per layout column
        if state.cached:  # a continued conversation: the features of the cached columns came with the cache
            carried = state.carried
            self.features = torch.cat([carried.features.to(self.device, self.dtype), self.features], dim=1)
            self.cache, self.synced = carried.cache_for(self.drafter)

    # ---- a conversation continued from its cache
    def _feature_key(self) -> tuple:
        return tuple(self.target_hidden_states), self._drafter_weight().dtype

    def can_continue(self, carried) -> bool:
        """Only with the target features of the cached columns (a cache this kind of drafter handed back): from a
        cache without them the call prefills every column again, which gives the features."""
        return isinstance(carried, Carried) and carried.features is not None and carried.key == self._feature_key()

    def hand_back(self, state, index) -> Carried:
        """The features of the cache's columns, and the drafter cache over those it holds (its row of the last column
        is left out: its next token is the next call's)."""
        features = self.features.gather(1, index.to(self.device)[:, :, None].expand(-1, -1, self.features.shape[-1]))
        if isinstance(self.cache, cache_ops.FixedDraftCache):  # kept by the proposer for its later calls
            return Carried.of(self.drafter, None, 0, features=features, key=self._feature_key())
        synced = cache_ops.kept_mirror(self.cache, self.synced, index.to(self.device)[:, :-1])
        return Carried.of(self.drafter, self.cache, synced, features=features, key=self._feature_key())

    def _start(self, state) -> None:
        """What every call starts with: the call's adaptive rules, the drafter's device and dtype, a fresh back-off."""
        self.rules = rules_of(state)
        weight = self._drafter_weight()
        self.device, self.dtype = weight.device, weight.dtype
        self.backoff = BackOff(rules=self.rules)
        self._additive: bool | None = None  # :meth:`_additive_masks`, looked up at the call's first mask

    def commit(self, state, tree, result) -> None:
        width = max(len(p) for p in result.paths)
        if result.path_index is not None:  # the rule ran on the device: the paths are there already
            nodes = result.path_index[:, :width].to(self.device)  # [B, W]
        else:
            nodes = to_device([p + [0] * (width - len(p)) for p in result.paths], self.device)  # [B, W]
        fused = self._fuse(state.hidden_states)  # [B, N, F] for every tree node
        picked = fused.gather(1, nodes[:, :, None].expand(-1, -1, fused.shape[-1]))
        held, length = self._held_features(), self.features.shape[1]
        if held is not None:  # written after the held ones, in place
            held[:, length:length + width] = picked
            self.features = held[:, :length + width]
        else:
            self.features = torch.cat([self.features, picked], dim=1)

    def hold_features(self, width: int) -> torch.Tensor:
        """``compile=True``: :attr:`features` held in a ``[B, width, F]`` buffer kept with the drafter's fixed cache
        (``self.cache.features``: the same addresses in later calls, which replay the graphs that read it), of which
        :attr:`features` is then the view of the first ``T`` columns; :meth:`commit` and :meth:`on_compact` write into
        it. Returns the buffer."""
        bsz, length, size = self.features.shape
        held = getattr(self.cache, "features", None)
        if held is None or held.shape != (bsz, width, size) or held.dtype != self.features.dtype:
            held = self.cache.features = self.features.new_zeros(bsz, width, size)
        if self._held_features() is not held:
            held[:, :length] = self.features
            self.features = held[:, :length]
        return held

    def _held_features(self) -> torch.Tensor | None:
        """The buffer :meth:`hold_features` holds :attr:`features` in, if it does."""
        held = getattr(self.cache, "features", None)
        return held if held is not None and self.features.data_ptr() == held.data_ptr() else None

    def on_compact(self, state, index) -> None:
        index = index.to(self.device)
        held = self._held_features()
        self.features = self.features.gather(1, index[:, :, None].expand(-1, -1, self.features.shape[-1]))
        if held is not None:
            held[:, :index.shape[1]] = self.features
            self.features = held[:, :index.shape[1]]
        self.cache = DynamicCache()
        self.synced = 0

    # ---- helpers
    def _drafter_weight(self) -> torch.Tensor:
        """A weight of the drafter's own (the device and dtype it computes in): its input projection ``fc`` when it
        has one (its first parameter may be the target's shared embedding)."""
        fc = getattr(self.drafter, "fc", None)
        return fc.weight if isinstance(fc, torch.nn.Linear) else next(self.drafter.parameters())

    def _fuse(self, hidden_states) -> torch.Tensor:
        """``[B, T, F]``: the requested target hidden states, concatenated, in the drafter's device and dtype (a
        target spread over devices by Accelerate returns each layer's on its own device: each is moved once)."""
        if hidden_states is None:
            raise RuntimeError(f"{self.name} needs the target's hidden states; the loop did not return them.")
        return torch.cat([hidden_states[i].to(self.device, self.dtype) for i in self.target_hidden_states], dim=-1)

    def _additive_masks(self) -> bool:
        """Whether the drafter takes one additive float mask (:func:`~hf_specdec.tree.additive_mask`): its masks are
        then assembled from additive pieces (0 / finfo.min) directly, else from booleans by
        :func:`~hf_specdec.tree.build_attention_mask`. Looked up once per call."""
        if self._additive is None:
            self._additive = additive_mask(self.drafter.config)
        return self._additive

    def _context_mask(self, state, start: int, end: int):
        """The mask of the drafter's rows for the target columns ``start..end`` after its rows of ``0..start``:
        causal over the real columns, a hole seeing only itself."""
        layout = state.layout
        n = end - start
        holes = layout.counts is None or any(c != layout.length for c in layout.counts)  # some row has holes
        if self._additive_masks():
            # from index comparisons, not triu / diagonal at offset ``start``: a compiled proposal would
            # specialise those on the offset's value, a new graph per context length
            rows = torch.arange(start, end, device=self.device)[:, None]
            cols = torch.arange(end, device=self.device)
            hidden = cols > rows  # [n, end] causal
            if holes:  # a hole still sees itself
                hidden = (hidden | ~layout.valid[:, None, :end].to(self.device)) & (cols != rows)  # [B, n, end]
            mask = torch.zeros(hidden.shape, dtype=self.dtype, device=self.device).masked_fill_(
                hidden, torch.finfo(self.dtype).min)
            return mask.expand(layout.valid.shape[0], 1, n, end) if not holes else mask[:, None]
        attends = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()[None]
        if holes:
            attends = attends & layout.valid[:, None, start:end].to(self.device)
            attends |= torch.eye(n, dtype=torch.bool, device=self.device)[None]  # holes still see themselves
        else:
            attends = attends.expand(layout.valid.shape[0], n, n)
        return build_attention_mask(self.drafter.config, layout.valid[:, :start].to(self.device),
                                    layout.positions[:, :start].to(self.device),
                                    layout.positions[:, start:end].to(self.device), attends, self.dtype)

    def _pays(self, state, reach: list[float]) -> int:
        """How many of the best drafts to verify (``reach``: host floats, their probabilities of lying on
        the accepted path, best first): the count maximising expected committed tokens per unit of verification cost
        (0: none beats a plain step); all of them when not adaptive."""
        if not self.adaptive or state.cost_model is None:
            return len(reach)
        expected, total = [], 1.0
        for r in reach:
            total += r
            expected.append(total)
        return best_count(expected, state.cost_model)

    def _cut_chains(self, state, reach: list[list[float]], counts: list[int]) -> list[int]:
        """Each row's chain cut to the drafts that pay (``reach[b][i]``, host floats read in the proposal's one read:
        the probability that draft ``i`` and the drafts before it are accepted; ``counts``: the drafts each row may
        have); the predictions are recorded for the back-off."""
        counts = [min(c, self._pays(state, reach[b][:c])) if c else 0 for b, c in enumerate(counts)]
        for b, c in enumerate(counts):
            if c:
                self._note_worth(state, sum(reach[b][:c]), c)
        return counts

    def _coupling_inputs(self, state, vocab: int, depths: int):
        """``(noise, warpers)``: what :meth:`DecodingState.perturb` applies to the drafter's scores of the next
        ``depths`` positions, taken before a fixed-shape region (:mod:`hf_specdec.graphs`) that applies it: coupled
        sampling's noise ``[B, depths, vocab]`` in the drafter's vocabulary of ``vocab`` tokens, on its device, and
        the call's warpers; ``(None, None)`` when the call is not coupled."""
        if state.coupling is None:
            return None, None
        noise = state.noise(depths)
        vocab_ids = draft_vocab_ids(state, self.drafter, vocab)
        if vocab_ids is not None:
            noise = noise.index_select(-1, vocab_ids.to(noise.device))
        return noise.to(self.device), state.processors

    def _target_probs(self, state, probs: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary distributions ``[..., Vd]`` as target-vocabulary ones ``[..., V]`` on the loop's device
        (what the exact sampling rule reads)."""
        return self._in_target_vocab(probs, self._target_vocab(state)).to(state.device)

    @staticmethod
    def _target_vocab(state) -> int:
        return state.model.config.get_text_config().vocab_size

    def _in_target_vocab(self, probs: torch.Tensor, vocab: int) -> torch.Tensor:
        """Draft-vocabulary distributions ``[..., Vd]`` as distributions over the target's ``vocab`` tokens."""
        full = torch.zeros(*probs.shape[:-1], vocab, device=probs.device, dtype=probs.dtype)
        full.index_add_(probs.dim() - 1, self.drafter.draft_to_target(torch.arange(probs.shape[-1],
                                                                                   device=probs.device)), probs)
        return full

    def _note_worth(self, state, reach: float, n: int) -> None:
        """Add one row's drafts to ``_worth``, the proposal's ``(expected tokens, verification cost)`` for
        :meth:`BackOff.judge` (``None`` starts a proposal): ``n`` drafts whose probabilities of lying on
        the accepted path sum to ``reach``. The rows share one verification, as wide as the widest row, so the
        expected tokens are the mean over the active rows (a row without drafts commits one)."""
        if state.cost_model is None:
            return
        total, widest = (0.0, 0) if self._worth is None else self._worth_sum
        total, widest = total + reach, max(widest, n)
        self._worth_sum = (total, widest)
        rows = max(1, sum(1 for a in state.active if a))
        self._worth = (1.0 + total / rows, state.cost_model.relative(widest + 1))
