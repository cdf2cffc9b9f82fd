"""What the decoding loop knows about the batch: the state every proposer reads (and must not modify).

It sits below the proposers and the loop: :mod:`hf_specdec.proposers` import it, the loop
(:mod:`hf_specdec.engine`) owns and updates it.
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import LogitsProcessorList

from .cache import CacheLayout
from .costs import ForwardCostModel
from .syncs import to_device


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
        tree_logits: ``[B, N, V]`` the target's raw logits at every node of the tree just verified (set before
            :meth:`Proposer.commit`; lookahead decoding harvests n-grams from the nodes that were not kept).
        cost_model: measured target forward costs (:class:`~hf_specdec.costs.ForwardCostModel`).
        processors: the call's logits processors and warpers (apply them with :meth:`process`).
    """

    def __init__(self, model, input_ids: torch.LongTensor, attention_mask: torch.LongTensor, max_length: int,
                 logits_processor: LogitsProcessorList, do_sample: bool, cost_model: ForwardCostModel,
                 host_ids: list[list[int]] | None = None, pad_lengths: list[int] | None = None):
        self.model = model
        self.config = model.config
        self.device = input_ids.device
        self.batch_size, self.prompt_length = input_ids.shape
        self.max_length = max_length
        self.do_sample = do_sample
        self.cost_model = cost_model
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


_ROW_INDEPENDENT = {
    "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper", "TypicalLogitsWarper",
    "EpsilonLogitsWarper", "EtaLogitsWarper", "NoRepeatNGramLogitsProcessor", "NoBadWordsLogitsProcessor",
    "SequenceBiasLogitsProcessor", "MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor",
    "SuppressTokensLogitsProcessor", "SuppressTokensAtBeginLogitsProcessor", "ForcedBOSTokenLogitsProcessor",
    "ForcedEOSTokenLogitsProcessor", "InfNanRemoveLogitsProcessor", "ExponentialDecayLengthPenalty",
    "LogitNormalization", "TopHLogitsWarper",
}


def _is_row_independent(proc) -> bool:
    """Known processors whose output for a row depends on that row only (not on its batch index)."""
    name = type(proc).__name__
    if name == "RepetitionPenaltyLogitsProcessor":
        return not isinstance(getattr(proc, "prompt_ignore_length", None), torch.Tensor)
    return name in _ROW_INDEPENDENT
