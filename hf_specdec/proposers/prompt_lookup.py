"""Prompt lookup decoding: drafts copied from earlier in the prompt or the output."""

from __future__ import annotations

import torch

from ..costs import AcceptanceEstimator, best_draft_length
from ..registry import SCHEDULE, Method, Option
from .base import Proposer, RowDraft, rules_of, tree_from_row_drafts

NUM_TOKENS = Option("prompt_lookup_num_tokens", int, 20, "the most drafts per step")
MAX_NGRAM = Option("max_matching_ngram_size", int, 5, "the longest suffix n-gram matched")


def find_continuation(seq, max_ngram: int, min_ngram: int, max_tokens: int):
    """The tokens that followed the most recent earlier occurrence of the longest suffix n-gram of ``seq``.

    ``seq`` is a list of ids (or a 1D tensor). Returns ``(n, tokens)`` with ``n`` the matched n-gram size and
    ``tokens`` a list, or ``(0, None)`` when no suffix n-gram of size ``min_ngram..max_ngram`` occurred before.
    One-off search; the proposer keeps an :class:`NgramIndex` per row instead.
    """
    index = NgramIndex(max_ngram)
    return index.continuation(seq.tolist() if isinstance(seq, torch.Tensor) else list(seq), min_ngram, max_tokens)


class NgramIndex:
    """Where each n-gram (``n <= max_ngram``) of a growing sequence last started, updated with the new tokens only,
    so a lookup costs ``O(max_ngram)`` host work whatever the length (no device tensor is read)."""

    def __init__(self, max_ngram: int):
        self.max_ngram = max_ngram
        self.last: dict[tuple, int] = {}  # n-gram -> start of its most recent occurrence
        self.done = 0  # n-grams ending before this index are in ``last``
        self.seen = 0  # length of the sequence last indexed (a shorter one is indexed afresh)

    def continuation(self, seq: list[int], min_ngram: int, max_tokens: int):
        """:func:`find_continuation` for ``seq``, the sequence indexed so far plus new tokens at its end."""
        if len(seq) < self.seen:
            self.last.clear()
            self.done = 0
        self.seen = len(seq)
        for end in range(self.done, len(seq) - 1):  # n-grams that end before the last token
            for n in range(1, min(self.max_ngram, end + 1) + 1):
                self.last[tuple(seq[end - n + 1:end + 1])] = end - n + 1
        self.done = max(self.done, len(seq) - 1)
        for n in range(min(self.max_ngram, len(seq) - 1), min_ngram - 1, -1):
            start = self.last.get(tuple(seq[-n:]))
            if start is not None:
                return n, seq[start + n:start + n + max_tokens]
        return 0, None


class PromptLookupProposer(Proposer):
    """Drafts by n-gram lookup (Saxena, 2023): longest suffix n-gram first, most recent match.

    Args:
        num_tokens: the most drafts per step (``prompt_lookup_num_tokens``).
        max_ngram: the longest suffix n-gram tried (``max_matching_ngram_size``).
        min_ngram: the shortest.
        adaptive: pick the draft length per step from the measured cost of verification and the running acceptance
            rate of matches of that n-gram size, drafting nothing when no length pays off (so text that does not
            copy runs at the speed of plain decoding). ``False`` drafts the whole match up to ``num_tokens``.
    """

    name = "prompt_lookup"

    def __init__(self, num_tokens: int = NUM_TOKENS.default, max_ngram: int = MAX_NGRAM.default, min_ngram: int = 1,
                 adaptive: bool = True):
        if num_tokens < 1:
            raise ValueError(f"prompt_lookup_num_tokens must be >= 1, got {num_tokens}.")
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"Need 1 <= min n-gram size <= max_matching_ngram_size, got {min_ngram}, {max_ngram}.")
        self.num_tokens = num_tokens
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.adaptive = adaptive
        self.max_nodes = num_tokens + 1

    def begin(self, state) -> None:
        self.rules = rules_of(state)
        self.estimator = AcceptanceEstimator(prior_alpha=0.35, prior_weight=2.0, decay=0.9)
        self.indexes = [NgramIndex(self.max_ngram) for _ in range(state.batch_size)]
        self.streak = [False] * state.batch_size
        self.pending: list = [None] * state.batch_size

    @staticmethod
    def _prior(key) -> float:
        n, streak = key
        return 0.75 if streak else {1: 0.2, 2: 0.35}.get(n, 0.5)

    def row_drafts(self, state) -> list:
        """Each row's candidate (:class:`~hf_specdec.proposers.base.RowDraft`, ``None``: no draft), cut to the
        length that pays when adaptive."""
        drafts = []
        for b in range(state.batch_size):
            budget = min(state.max_drafts[b], self.num_tokens)
            n, cont = self.indexes[b].continuation(state.row_list(b), self.min_ngram, budget) if budget > 0 \
                else (0, None)
            if n and state.eos_token_ids:  # a draft past an end-of-sequence token is never used
                stop = next((i for i, tok in enumerate(cont) if tok in state.eos_token_ids), None)
                cont = cont[:stop]
            if n == 0 or not cont:
                drafts.append(None)
                continue
            k, key, alpha = len(cont), None, 1.0
            if self.adaptive:  # acceptance per (n-gram size, streak); the rule lookup_keys off: one for every match
                key = (n, self.streak[b]) if self.rules.lookup_keys else "all"
                alpha = self.estimator.alpha(key, self._prior(key) if self.rules.lookup_keys else None)
                k = best_draft_length(alpha, k, state.cost_model)
            drafts.append(RowDraft(cont[:k], list(range(k)), [alpha ** (i + 1) for i in range(k)], key)
                          if k else None)
        return drafts

    def propose(self, state):
        self.pending = self.row_drafts(state)
        return tree_from_row_drafts(state, self.pending)

    def commit(self, state, tree, result) -> None:
        self.learn(self.pending, result)
        self.pending = [None] * state.batch_size

    def learn(self, drafts: list, result) -> None:
        """Update the acceptance statistics with what the verification of ``drafts`` (one per row) accepted."""
        for b, n_acc in enumerate(result.num_accepted):
            if not result.paths[b]:
                continue
            d = drafts[b]
            proposed = len(d.tokens) if d is not None else 0
            if d is not None and d.key is not None:
                self.estimator.update(d.key, proposed, n_acc)
            self.streak[b] = proposed > 0 and n_acc == proposed


METHOD = Method(
    name="prompt_lookup",
    summary="n-grams of the prompt and output, draft length adapted to measured costs",
    description="Lossless prompt lookup decoding for any causal LM in transformers: drafts are copied from earlier "
                "in the prompt or the output (longest suffix n-gram first, most recent match) and verified by the "
                "model in one forward pass. Unlike transformers' built-in `prompt_lookup_num_tokens`, the draft "
                "length adapts to the measured cost of a verification step and to how often matches are accepted, "
                "so text that does not copy runs at plain-decoding speed. No drafter.",
    build=lambda target, opts: PromptLookupProposer(num_tokens=opts["prompt_lookup_num_tokens"],
                                                    max_ngram=opts["max_matching_ngram_size"],
                                                    adaptive=opts["draft_length_schedule"] != "constant"),
    options=(NUM_TOKENS, MAX_NGRAM, SCHEDULE),
)
