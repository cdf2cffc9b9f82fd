"""What the decoding loop knows about the batch: the state every proposer reads (and must not modify).

It sits below the proposers and the loop: :mod:`hf_specdec.proposers` import it, the loop
(:mod:`hf_specdec.engine`) owns and updates it.
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import LogitsProcessorList

from .adaptive import ALL_ON, Rules
from .cache import CacheLayout
from .costs import CallCosts, ForwardCostModel
from .coupling import WARPERS, CoupledNoise, apply_warpers, is_warper
from .syncs import host_side, to_device


class DecodingState:
    """The batch as the loop sees it between two verification steps.

    Attributes (``B`` rows):
        tokens: ``[B, max_length + 1]`` committed ids in plain ``generate()`` layout (left padding, prompt,
            generated tokens); row ``b`` is valid up to ``lengths[b]`` and its last token is the *root*.
        host_tokens: the same ids as host lists (``host_tokens[b]`` has ``lengths[b]`` ids): proposers that work on
            the committed text read these (:meth:`row_list`), never ``tokens`` (a read of a device tensor is a
            host-device synchronisation on a GPU; :mod:`hf_specdec.syncs`).
        lengths, pad_lengths: per row, committed length and left-padding length.
        active: rows that still take tokens.
        max_drafts: per row, the most drafts it may take this step (0: none).
        eos_token_ids: drafting past one of these is wasted work.
        layout: the target cache's columns (:class:`~hf_specdec.cache.CacheLayout`); ``root_positions [B]`` the
            position id of each row's root.
        hidden_states: the target hidden states of the last forward (the indices the proposer asked for).
        cached, carried: a conversation continued from its cache: the target's cache held the first ``cached`` input
            columns before the prefill, so the prefill's hidden states (in ``begin``) are those of columns
            ``cached..`` only; ``carried`` is what the proposer handed back with that cache
            (:meth:`Proposer.hand_back`; ``None`` for a cache without it). ``0`` and ``None`` for a fresh cache.
        tree_logits: ``[B, N, V]`` the target's raw logits at every node of the tree just verified (set before
            :meth:`Proposer.commit`; lookahead decoding harvests n-grams from the nodes that were not kept).
        rules: the call's adaptive rules (:class:`~hf_specdec.adaptive.Rules`; default: every rule on). Proposers
            take them in ``begin``.
        cost_model: the measured target forward costs the runner keeps (a
            :class:`~hf_specdec.costs.ForwardCostModel`), read under ``rules`` (:class:`~hf_specdec.costs.CallCosts`).
        processors: the call's logits processors and warpers (apply them with :meth:`process`).
        do_sample: drafts are *sampled* and verified by the rejection rules (``"rejection"``, ``"typical"``). Under
            coupled sampling it is False: proposers draft as they do greedily, from logits passed through
            :meth:`perturb`, and skip the call's processors (:meth:`draft_process_fn`).
        coupling: the call's :class:`~hf_specdec.coupling.CoupledNoise` (coupled sampling only, else ``None``).
    """

    def __init__(self, model, input_ids: torch.LongTensor, attention_mask: torch.LongTensor, max_length: int,
                 logits_processor: LogitsProcessorList, do_sample: bool, cost_model: ForwardCostModel,
                 host_ids: list[list[int]] | None = None, pad_lengths: list[int] | None = None,
                 rules: Rules | None = None):
        self.model = model
        self.config = model.config
        self.device = input_ids.device
        self.batch_size, self.prompt_length = input_ids.shape
        self.max_length = max_length
        self.do_sample = do_sample
        self.coupling: CoupledNoise | None = None
        self.vocab_ids: dict = {}  # (drafter id, size) -> its vocabulary's target ids (proposers.base.draft_vocab_ids)
        self.rules = rules if rules is not None else ALL_ON
        self.cost_model = CallCosts(cost_model, self.rules) if cost_model is not None else None
        self.tokens = input_ids.new_zeros((self.batch_size, max_length + 1))  # [B, max_length + 1]
        self.tokens[:, : self.prompt_length] = input_ids
        self.lengths = [self.prompt_length] * self.batch_size
        self.pad_lengths = pad_lengths if pad_lengths is not None else (attention_mask == 0).sum(1).tolist()
        self.host_tokens: list[list[int]] = host_ids if host_ids is not None else input_ids.tolist()
        self.active = [True] * self.batch_size
        self.eos_token_ids: list[int] = []
        self.max_drafts = [0] * self.batch_size
        self.root_positions: torch.LongTensor | None = None  # [B]
        self.layout: CacheLayout | None = None
        self.cache = None
        self.hidden_states = None
        self.cached, self.carried = 0, None
        self.tree_logits: torch.Tensor | None = None
        self.processors = logits_processor
        self._roots = None
        self._row_independent = all(_is_row_independent(p) for p in logits_processor)

    # ---- reading the sequences
    def prefix(self, b: int) -> torch.LongTensor:
        """Committed ids of row ``b`` in plain ``generate()`` layout (left padding included, root last)."""
        return self.tokens[b, : self.lengths[b]]

    def row_tokens(self, b: int) -> torch.LongTensor:
        """Real (unpadded) committed ids of row ``b``."""
        return self.tokens[b, self.pad_lengths[b]: self.lengths[b]]

    def row_list(self, b: int) -> list[int]:
        """Real (unpadded) committed ids of row ``b`` as host data (no read of a device tensor)."""
        return self.host_tokens[b][self.pad_lengths[b]: self.lengths[b]]

    @host_side
    def budgets(self, most: int | None = None) -> list[int]:
        """Each row's draft budget this step (:attr:`max_drafts`), at most ``most``. Proposers read the budgets
        through this and :meth:`deepest`, never from the list in their own code: a compiled proposal would trace the
        list (a symbol per row, a guard per value)."""
        return list(self.max_drafts) if most is None else [min(m, most) for m in self.max_drafts]

    @host_side
    def deepest(self, most: int | None = None) -> int:
        """The largest row budget this step, at most ``most`` (0: no row drafts)."""
        top = max(self.max_drafts, default=0)
        return top if most is None else min(top, most)

    @host_side
    def roots(self) -> torch.LongTensor:
        """``[B]`` the last committed token of every row (from the host copy: sent, never read back)."""
        key = tuple(self.lengths)
        if self._roots is None or self._roots[0] != key:
            self._roots = (key, to_device([self.host_tokens[b][n - 1] for b, n in enumerate(self.lengths)],
                                          self.device))
        return self._roots[1]

    # ---- logits processors with each position's own prefix
    def process(self, b: int, input_ids: torch.LongTensor, logits: torch.Tensor) -> torch.Tensor:
        """Apply the call's logits processors/warpers to ``logits [1, V]`` of row ``b`` with prefix ``input_ids [1, L]``.

        Rows of a batch are at different lengths, so rows are processed one at a time. Some processors keep
        per-row state indexed by batch position (``prefix_allowed_tokens_fn``'s batch id, the repetition penalty's
        per-row prompt length), so the row is placed at its own index of a full-batch tensor (the other rows are
        copies whose results are dropped).
        """
        if not self.processors:
            return logits
        if self.batch_size == 1 or self._row_independent:
            return self.processors(input_ids, logits)
        ids = input_ids.expand(self.batch_size, -1)
        scores = logits.expand(self.batch_size, -1).clone()
        return self.processors(ids, scores)[b:b + 1]

    def process_fn(self):
        """:meth:`process`, or ``None`` when the call has no logits processors (drafts can skip them)."""
        return self.process if self.processors else None

    def draft_process_fn(self):
        """What a proposer applies to its drafter's logits with each row's prefix: :meth:`process_fn`, or ``None``
        under coupled sampling (:meth:`perturb` applies the call's warpers there)."""
        return None if self.coupling is not None else self.process_fn()

    @property
    def warpers_only(self) -> bool:
        """Every processor of the call is a warper (:data:`hf_specdec.coupling.WARPERS`): its output at a node does
        not depend on the ids before it, so all rows' nodes of one depth are processed at once."""
        return all(is_warper(p) for p in self.processors)

    # ---- coupled sampling
    @host_side
    def noise(self, width: int) -> torch.Tensor:
        """``[B, width, V]`` the Gumbel noise of each row's next ``width`` positions: ``[b, j]`` is that of the token
        at depth ``j + 1`` below the root (drafters drafting depth ``d`` use column ``d - 1``; the target's choice at a
        node of depth ``d`` uses column ``d``)."""
        return self.coupling.block([n - self.prompt_length for n in self.lengths], width)

    def perturb(self, logits: torch.Tensor, column, vocab_ids: torch.LongTensor | None = None) -> torch.Tensor:
        """A drafter's logits as coupled sampling drafts from them: ``logits`` unchanged unless the call samples
        coupled; then float32, through the call's warpers, plus the noise of the drafted position. ``logits`` is
        ``[B, V]`` or ``[B, k, V]``; ``column`` (see :meth:`noise`) an int (the same position for every ``k``: siblings
        at one depth) or a ``range`` of ``k`` (one position per ``k``: a block of depths); ``vocab_ids [V']``: the
        target ids of a drafter's smaller vocabulary. The proposer then takes its greedy path on the result."""
        if self.coupling is None:
            return logits
        block = isinstance(column, range)
        g = self.noise(column.stop if block else column + 1)
        g = g[:, column.start:column.stop] if block else g[:, column]
        if vocab_ids is not None:
            g = g.index_select(-1, vocab_ids.to(g.device))
        g = g.to(logits.device)
        if logits.dim() == 3 and not block:
            g = g[:, None]
        return apply_warpers(self.processors, logits.float()) + g


_ROW_INDEPENDENT = WARPERS | {  # the warpers, and processors that read the row's own ids
    "NoRepeatNGramLogitsProcessor", "NoBadWordsLogitsProcessor", "SequenceBiasLogitsProcessor",
    "MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor", "SuppressTokensLogitsProcessor",
    "SuppressTokensAtBeginLogitsProcessor", "ForcedBOSTokenLogitsProcessor", "ForcedEOSTokenLogitsProcessor",
    "ExponentialDecayLengthPenalty",
}


def _is_row_independent(proc) -> bool:
    """Known processors whose output for a row depends on that row only (not on its batch index)."""
    name = type(proc).__name__
    if name == "RepetitionPenaltyLogitsProcessor":
        return not isinstance(getattr(proc, "prompt_ignore_length", None), torch.Tensor)
    return name in _ROW_INDEPENDENT
