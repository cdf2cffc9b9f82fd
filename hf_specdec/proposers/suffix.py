"""Suffix decoding (SuffixDecoding, Oliaro et al.; ArcticInference): drafts from suffix indexes of token sequences.

Three pieces: :class:`SuffixIndex` (the structure), :class:`SuffixCache` (earlier outputs kept across ``generate``
calls, bounded, thread-safe; the user creates one and passes ``suffix_cache=``), both in :mod:`.suffix_index`, and
:class:`SuffixProposer` (the method: every row matches its own prompt + output and the cache, and drafts the better
candidate), here with its calibration and the registry record ``METHOD``.
"""

from __future__ import annotations

import itertools

from ..costs import best_count
from ..registry import SCHEDULE, Method, Option, Shorthand
from .base import Proposer, RowDraft, rules_of, tree_from_row_drafts
from .suffix_index import SuffixCache, SuffixDraft, SuffixIndex


_PRIOR = {1: 0.5, 2: 0.7, 3: 0.85, 4: 1.0, 8: 1.0}  # calibration of a bucket before anything was verified


def _bucket(match_len: int) -> int:
    """Calibration bucket of a match length: 1, 2, 3, 4-7, 8+."""
    return match_len if match_len < 4 else (4 if match_len < 8 else 8)


class SuffixProposer(Proposer):
    """Suffix decoding: each row drafts from a suffix index of its own prompt and output and, when given, a
    :class:`SuffixCache` of earlier outputs (the candidate with the higher score wins, ties to the row's own).

    The draft for a context tail matched over ``m`` tokens has at most ``floor(max_spec_factor * m +
    max_spec_offset)`` tokens; it follows the most frequent continuations (a tree, best first, or one path) while a
    token's estimated probability stays at least ``min_token_prob``. Adaptive: those probabilities, calibrated per
    match length by what was accepted, and the measured verification costs decide how many of the draft's tokens are
    verified (none when no count pays), so text that repeats nothing runs at plain-decoding speed.

    Args:
        cache: a :class:`SuffixCache` shared across calls, or ``None`` (this call's own sequences only).
        max_spec_tokens: the most drafts per step.
        max_spec_factor, max_spec_offset: draft length per matched token and its offset.
        min_token_prob: the probability floor of a drafted token.
        max_depth: the longest substring the per-call index holds (the cache has its own).
        tree: draft a tree of continuations (``False``: a single path).
        adaptive: verify only the drafts that pay (``False``: all of them).
    """

    name = "suffix"

    def __init__(self, cache: SuffixCache | None = None, max_spec_tokens: int = 32, max_spec_factor: float = 2.0,
                 max_spec_offset: float = 0.0, min_token_prob: float = 0.1, max_depth: int = 64, tree: bool = True,
                 adaptive: bool = True):
        if cache is not None and not isinstance(cache, SuffixCache):
            raise ValueError(f"suffix_cache must be a hf_specdec.SuffixCache, got {type(cache).__name__}.")
        if max_spec_tokens < 1:
            raise ValueError(f"max_spec_tokens must be >= 1, got {max_spec_tokens}.")
        if max_spec_factor <= 0:
            raise ValueError(f"max_spec_factor must be > 0, got {max_spec_factor}.")
        if not 0.0 <= min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob must be in [0, 1], got {min_token_prob}.")
        if max_depth < 2:
            raise ValueError(f"max_tree_depth must be >= 2, got {max_depth}.")
        self.cache = cache
        self.max_spec_tokens, self.factor, self.offset = max_spec_tokens, max_spec_factor, max_spec_offset
        self.min_prob, self.max_depth, self.tree, self.adaptive = min_token_prob, max_depth, tree, adaptive
        self.max_nodes = max_spec_tokens + 1

    def begin(self, state) -> None:
        self.rules = rules_of(state)
        self.local = [SuffixIndex(self.max_depth) for _ in range(state.batch_size)]
        for b, index in enumerate(self.local):
            index.extend(0, state.row_list(b))
        self.live = None
        if self.cache is not None:
            self.live = [self.cache.open() for _ in range(state.batch_size)]
            for b, seq_id in enumerate(self.live):
                self.cache.extend(seq_id, state.host_tokens[b][state.prompt_length:state.lengths[b]])
        self.calibration: dict[tuple[str, int], float] = {}  # (source, match-length bucket) -> accepted / predicted
        self.pending: list[RowDraft | None] = [None] * state.batch_size

    def row_drafts(self, state) -> list[RowDraft | None]:
        """Each row's candidate, cut to what pays (``None``: no draft): the drafts of its own index and of the cache
        merged into one tree, every node scored by the higher of its calibrated probabilities."""
        drafts: list[RowDraft | None] = []
        depth = max(self.max_depth, self.cache.max_depth if self.cache is not None else 0)
        for b in range(state.batch_size):
            budget = min(state.max_drafts[b], self.max_spec_tokens)
            if budget <= 0:
                drafts.append(None)
                continue
            context = state.row_list(b)[-(depth - 1):]
            opts = dict(max_tokens=budget, alpha=self.factor, offset=self.offset, min_prob=self.min_prob,
                        tree=self.tree)
            found = [("own", self.local[b].speculate(context, own_tail=len(context), **opts))]
            if self.cache is not None:  # the cache holds this row's output so far too
                output = state.lengths[b] - state.prompt_length
                found.append(("cache", self.cache.speculate(context, own_tail=output, **opts)))
            drafts.append(self._candidate(state, found, budget))
        return drafts

    def _candidate(self, state, found: list[tuple[str, SuffixDraft]], budget: int) -> RowDraft | None:
        eos = set(state.eos_token_ids or ())
        nodes: dict[tuple, dict] = {}  # path of tokens -> node (a trie over both sources' drafts)
        for source, draft in found:
            if not draft.tokens:
                continue
            key = (source, _bucket(draft.match_len))
            # the rule suffix_calibration off: the index's own probabilities
            cal = self.calibration.setdefault(key, _PRIOR[key[1]]) if self.rules.suffix_calibration else 1.0
            paths: list[tuple] = []
            for token, parent, prob in zip(draft.tokens, draft.parents, draft.probs):
                path = (paths[parent] if parent >= 0 else ()) + (token,)
                paths.append(path)
                if token in eos or (len(path) > 1 and path[:-1] not in nodes):  # nothing after an end token
                    continue
                node = nodes.setdefault(path, {"reach": 0.0, "from": {}})
                node["reach"] = max(node["reach"], prob * cal)
                node["from"][key] = prob
        if not nodes:
            return None
        for path in sorted(nodes, key=len):  # a child is never likelier than its parent (rounding aside) ...
            if len(path) > 1:
                nodes[path]["reach"] = min(nodes[path]["reach"], nodes[path[:-1]]["reach"])
        # ... so best first, ties to the shorter path, puts parents first
        order = sorted(nodes, key=lambda path: (-nodes[path]["reach"], len(path)))[:budget]
        slot = {path: i + 1 for i, path in enumerate(order)}
        reach = [nodes[path]["reach"] for path in order]
        n = len(order)
        if self.adaptive and state.cost_model is not None:
            n = best_count([1.0 + r for r in itertools.accumulate(reach)], state.cost_model)
        if n == 0:
            return None
        order = order[:n]
        learned: dict = {}  # per source key: (its uncalibrated predicted sum, the slots it drafted)
        for i, path in enumerate(order):
            for key, prob in nodes[path]["from"].items():
                total, slots = learned.get(key, (0.0, set()))
                learned[key] = (total + prob, slots | {i + 1})
        return RowDraft([path[-1] for path in order], [slot.get(path[:-1], 0) for path in order], reach[:n],
                        learned)

    def propose(self, state):
        self.pending = self.row_drafts(state)
        return tree_from_row_drafts(state, self.pending)

    def commit(self, state, tree, result) -> None:
        for b, new in enumerate(result.new_tokens):
            if not new:
                continue
            self.local[b].extend(0, new)
            if self.live is not None:
                self.cache.extend(self.live[b], new)
        self.learn(self.pending, result)
        self.pending = [None] * state.batch_size

    def learn(self, drafts: list[RowDraft | None], result) -> None:
        """Calibrate each source's match-length buckets: the drafts of that source on the accepted path over the
        sum of their estimated probabilities (nothing with the rule suffix_calibration off)."""
        if not self.rules.suffix_calibration:
            return
        for d, path in zip(drafts, result.paths):
            if d is None or not isinstance(d.key, dict):
                continue
            kept = set(path[1:])
            for key, (predicted, slots) in d.key.items():
                ratio = min(max(len(kept & slots) / max(predicted, 1e-6), 0.05), 1.5)
                self.calibration[key] = 0.85 * self.calibration[key] + 0.15 * ratio


def _build(target, opts) -> SuffixProposer:
    return SuffixProposer(cache=opts["suffix_cache"], max_spec_tokens=opts["max_spec_tokens"],
                          max_spec_factor=float(opts["max_spec_factor"]),
                          max_spec_offset=float(opts["max_spec_offset"]),
                          min_token_prob=float(opts["min_token_prob"]), max_depth=opts["max_tree_depth"],
                          tree=opts["use_tree_spec"], adaptive=opts["draft_length_schedule"] != "constant")


METHOD = Method(
    name="suffix",
    summary="suffix trees over the prompt, the output and earlier outputs; a draft tree sized by the match",
    description="Lossless suffix decoding (SuffixDecoding, Oliaro et al., 2025) for any causal LM in transformers: "
                "every row keeps a suffix index of its prompt and output, and an optional `SuffixCache` you create "
                "and pass to many calls (`suffix_cache=`) keeps earlier outputs (bounded, oldest evicted, "
                "thread-safe). The longer the context tail matches, the longer the draft; continuations are scored "
                "by how often they followed, and a tree of the likely ones is verified in one forward pass. The "
                "measured verification costs decide how much of it pays, so text that repeats nothing runs at "
                "plain-decoding speed. No drafter.",
    build=_build,
    options=(
        Option("suffix_cache", object, None, "a hf_specdec.SuffixCache shared across calls (default: none, this "
               "call's prompt and output only)"),
        Option("max_spec_tokens", int, 32, "the most drafts per step"),
        Option("max_spec_factor", (float, int), 2.0, "draft tokens per matched context token"),
        Option("max_spec_offset", (float, int), 0.0, "added to the draft length of a match"),
        Option("min_token_prob", (float, int), 0.1, "drafts estimated less likely than this are not proposed"),
        Option("max_tree_depth", int, 64, "the longest substring indexed per call (matched context + draft)"),
        Option("use_tree_spec", bool, True, "draft a tree of continuations (False: the most frequent path)"),
        SCHEDULE,
    ),
    shorthands={
        "suffix": Shorthand("K", lambda arg: {"max_spec_tokens": int(arg)} if arg else {}),
        "suffix_path": Shorthand("K", lambda arg: {"use_tree_spec": False,
                                                   **({"max_spec_tokens": int(arg)} if arg else {})}),
    },
)
