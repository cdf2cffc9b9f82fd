"""The structures suffix decoding drafts from: :class:`SuffixIndex` (a suffix index of token sequences) and
:class:`SuffixCache` (earlier outputs kept across ``generate`` calls, bounded, thread-safe; the user creates one and
passes ``suffix_cache=``). The method that drafts from them is :class:`~hf_specdec.proposers.suffix.SuffixProposer`.

:class:`SuffixIndex` is a depth-bounded suffix trie over many sequences (ArcticInference's ``SuffixTree`` without
its path compression): it holds every substring of length ``<= max_depth`` of the indexed sequences, and a node's
``count`` is the number of start positions whose substring passes through it. Appending a token costs
``O(max_depth)``; removing a sequence ``O(len * max_depth)``.

:meth:`SuffixIndex.speculate` matches the tail of a context: for every match length ``m`` that the index holds
(1, 2, ... until one does not match), it drafts at most ``floor(alpha * m + offset)`` tokens from the node the match
ends in, moving to a child with probability ``count(child) / count(node)`` (the running product is each draft's
probability), either along the most frequent child (a path) or best-first over every child whose probability is at
least ``min_prob`` (a tree); the draft with the highest ``score`` (the sum of its tokens' probabilities: the expected
number of accepted tokens if they were right that often) wins, ties going to the longer match. Only some match
lengths are tried (:meth:`SuffixIndex.speculate`).
"""

from __future__ import annotations

import collections
import heapq
import itertools
import math
import threading
from dataclasses import dataclass, field


_MATCH_LENGTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)  # tried below the longest match


class _Node:
    __slots__ = ("count", "children")

    def __init__(self):
        self.count = 0
        self.children: dict[int, _Node] = {}


@dataclass
class SuffixDraft:
    """A draft: ``tokens[i]`` follows ``parents[i]`` (an index into ``tokens``, ``-1``: the context's last token);
    ``probs[i]`` its estimated probability; ``score`` their sum; ``match_len`` the context tail it continues."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0


class SuffixIndex:
    """Every substring of length ``<= max_depth`` of the sequences added, with occurrence counts.

    Example:
        >>> index = SuffixIndex(max_depth=4)
        >>> index.extend("a", [1, 2, 3, 1, 2, 4])
        >>> index.count([1, 2])
        2
        >>> draft = index.speculate([5, 1, 2], max_tokens=2)   # "1 2" went on with "3 1" once and with "4" once
        >>> draft.tokens, draft.probs, draft.match_len
        ([3, 1], [0.5, 0.5], 2)
    """

    def __init__(self, max_depth: int = 24):
        if not isinstance(max_depth, int) or max_depth < 2:
            raise ValueError(f"max_depth must be an integer >= 2, got {max_depth!r}.")
        self.max_depth = max_depth
        self.root = _Node()
        self.sequences: dict[object, list[int]] = {}
        self._active: dict[object, list[_Node]] = {}  # per sequence: nodes of its last max_depth - 1 start positions

    def __len__(self) -> int:
        """Tokens indexed."""
        return sum(len(s) for s in self.sequences.values())

    def extend(self, seq_id, tokens) -> None:
        """Append ``tokens`` to sequence ``seq_id`` (a new one if unknown)."""
        seq = self.sequences.setdefault(seq_id, [])
        active = self._active.setdefault(seq_id, [])
        for token in tokens:
            token = int(token)
            seq.append(token)
            grown = []
            for node in [*active, self.root]:  # every suffix still shorter than max_depth, and the new one
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                child.count += 1
                grown.append(child)
            self.root.count += 1
            active[:] = grown[-(self.max_depth - 1):] if len(grown) >= self.max_depth else grown

    def remove(self, seq_id) -> None:
        """Forget sequence ``seq_id``: its substrings' counts go down, nodes no substring reaches are deleted."""
        seq = self.sequences.pop(seq_id, None)
        self._active.pop(seq_id, None)
        if seq is None:
            return
        for start in range(len(seq)):
            self.root.count -= 1
            node = self.root
            for token in seq[start:start + self.max_depth]:
                child = node.children[token]
                child.count -= 1
                if child.count == 0:
                    del node.children[token]
                    break
                node = child

    def count(self, pattern) -> int:
        """How often ``pattern`` (``1..max_depth`` tokens) occurs in the indexed sequences."""
        node = self._walk(pattern)
        return node.count if node is not None else 0

    def _walk(self, pattern):
        node = self.root
        for token in pattern:
            node = node.children.get(int(token))
            if node is None:
                return None
        return node

    def speculate(self, context, max_tokens: int, alpha: float = 1.0, offset: float = 0.0, min_prob: float = 0.1,
                  tree: bool = False, own_tail: int = 0) -> SuffixDraft:
        """The best draft continuing ``context`` (see the module docstring); an empty draft when nothing matches.

        ``own_tail``: the context's last ``own_tail`` tokens are the end of an indexed sequence (a row's own text):
        that occurrence of a matched tail, which nothing follows yet, is not counted.

        The match lengths tried are the longest one and 1, 2, 3, 4, 6, 8, 12, ... below it (every length up to 4),
        not each one: a draft from a match is usually close to one from a match a few tokens longer, and each
        candidate costs a tree expansion."""
        best = SuffixDraft()
        context = [int(t) for t in context[-(self.max_depth - 1):]]
        longest = self._longest_match(context, own_tail)
        for m in sorted({longest} | {m for m in _MATCH_LENGTHS if m < longest}, reverse=True):  # ties: longer
            budget = min(max_tokens, math.floor(m * alpha + offset + 1e-6), self.max_depth - m)
            if budget <= 0 or budget <= best.score:  # a draft of `budget` tokens scores at most `budget`
                continue
            node = self._walk(context[-m:])
            total = node.count - (m <= own_tail)
            draft = self._tree(node, total, budget, min_prob) if tree else self._path(node, total, budget, min_prob)
            draft.match_len = m
            if draft.tokens and draft.score > best.score:
                best = draft
        return best

    def _longest_match(self, context: list[int], own_tail: int = 0) -> int:
        """The longest tail of ``context`` the index holds (every shorter tail of a held one is held too), not
        counting the occurrence at the end of a sequence whose last ``own_tail`` tokens end the context."""
        lo, hi = 0, len(context)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            node = self._walk(context[-mid:])
            if node is not None and node.count - (mid <= own_tail) > 0:
                lo = mid
            else:
                hi = mid - 1
        return lo

    @staticmethod
    def _path(node: _Node, total: int, budget: int, min_prob: float) -> SuffixDraft:
        """The most frequent continuation from ``node``, whose count is taken to be ``total``."""
        draft, prob = SuffixDraft(), 1.0
        while len(draft.tokens) < budget and node.children:
            token, child = max(node.children.items(), key=lambda kv: kv[1].count)
            prob *= child.count / total
            total = child.count
            if prob < min_prob:
                break
            draft.parents.append(len(draft.tokens) - 1)
            draft.tokens.append(token)
            draft.probs.append(prob)
            node = child
        draft.score = sum(draft.probs)
        return draft

    @staticmethod
    def _tree(node: _Node, total: int, budget: int, min_prob: float) -> SuffixDraft:
        """Best-first continuations from ``node``, whose count is taken to be ``total``."""
        draft = SuffixDraft()
        tie = itertools.count()  # heap order for equal probabilities: first pushed first
        heap = [(-(c.count / total), next(tie), t, c, -1) for t, c in node.children.items()
                if c.count >= min_prob * total - 1e-9]
        heapq.heapify(heap)
        while heap and len(draft.tokens) < budget:
            neg, _, token, child, parent = heapq.heappop(heap)
            prob = -neg
            if prob < min_prob:
                break
            draft.tokens.append(token)
            draft.parents.append(parent)
            draft.probs.append(prob)
            here = len(draft.tokens) - 1
            floor = min_prob * child.count / prob  # children counted less than this fall under the floor
            for t, c in child.children.items():
                if c.count >= floor - 1e-9:
                    heapq.heappush(heap, (-(prob * (c.count / child.count)), next(tie), t, c, here))
        draft.score = sum(draft.probs)
        return draft


class SuffixCache:
    """Token sequences kept across ``generate`` calls for suffix decoding: the outputs of earlier calls (and of
    concurrent ones, as they are generated), plus any corpus you add (a REST-style datastore).

    Pass the same object to every call that should learn from the others: ``generate(..., suffix_cache=cache)``.
    The memory is bounded: when more than ``max_sequences`` sequences or ``max_tokens`` tokens are held, the oldest
    sequences are evicted first (``pinned`` ones never); a sequence that alone would pass ``max_tokens`` stops
    growing at the bound. The index holds every substring of up to ``max_depth`` tokens, so its nodes number at
    most ``max_depth`` per token held.

    Thread-safe: every read and write takes the cache's lock, so concurrent ``generate`` calls (threads) may share
    one cache; each call's rows see the others' outputs as they grow.

    Args:
        max_sequences: the most sequences held (outputs and added ones together).
        max_tokens: the most tokens held.
        max_depth: the longest substring indexed (the matched context plus the draft).

    Example:
        >>> from hf_specdec.proposers.suffix_index import SuffixCache
        >>> cache = SuffixCache(max_sequences=256)
        >>> # out = model.generate(**inputs, custom_generate="hf_specdec/suffix", trust_remote_code=True,
        >>> #                      suffix_cache=cache)   # later calls draft from this call's output
        >>> _ = cache.add([1, 2, 3, 4], pinned=True)     # or index a corpus once (token ids)
        >>> cache.num_sequences, cache.num_tokens
        (1, 4)
    """

    def __init__(self, max_sequences: int = 10_000, max_tokens: int = 2_000_000, max_depth: int = 64):
        for name, value in (("max_sequences", max_sequences), ("max_tokens", max_tokens)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"SuffixCache: {name} must be an integer >= 1, got {value!r}.")
        self.max_sequences, self.max_tokens = max_sequences, max_tokens
        self.index = SuffixIndex(max_depth)
        self._order: collections.OrderedDict = collections.OrderedDict()  # id -> pinned, oldest first
        self._lengths: dict[int, int] = {}
        self._closed: set[int] = set()  # evicted while still being written: later tokens are dropped
        self._ids = itertools.count()
        self._lock = threading.RLock()
        self.evictions = 0

    @property
    def max_depth(self) -> int:
        return self.index.max_depth

    @property
    def num_sequences(self) -> int:
        return len(self._order)

    @property
    def num_tokens(self) -> int:
        return sum(self._lengths.values())

    def add(self, tokens, pinned: bool = False) -> int:
        """Index a finished sequence of token ids (a document, an earlier answer); returns its id. ``pinned``: never
        evicted (a ``ValueError`` when pinned sequences alone would pass the bounds)."""
        tokens = [int(t) for t in tokens]
        with self._lock:
            if pinned:
                held = sum(self._lengths[i] for i, p in self._order.items() if p)
                count = sum(self._order.values())
                if held + len(tokens) > self.max_tokens or count + 1 > self.max_sequences:
                    raise ValueError(f"SuffixCache: pinned sequences would hold {held + len(tokens)} tokens / "
                                     f"{count + 1} sequences, over max_tokens={self.max_tokens} / "
                                     f"max_sequences={self.max_sequences}.")
            seq_id = self.open(pinned)
            self.extend(seq_id, tokens)
            return seq_id

    def add_texts(self, tokenizer, texts, pinned: bool = True) -> list[int]:
        """Index documents (strings) with ``tokenizer``, no special tokens: a static datastore to draft from."""
        return [self.add(tokenizer(t, add_special_tokens=False)["input_ids"], pinned=pinned) for t in texts]

    def open(self, pinned: bool = False) -> int:
        """A new, empty sequence (an output about to be generated); returns its id."""
        with self._lock:
            seq_id = next(self._ids)
            self._order[seq_id] = pinned
            self._lengths[seq_id] = 0
            self._evict(keep=seq_id)
            return seq_id

    def extend(self, seq_id: int, tokens) -> None:
        """Append ``tokens`` to sequence ``seq_id`` (dropped if it was evicted meanwhile)."""
        with self._lock:
            if seq_id not in self._order:
                return
            tokens = list(tokens)
            self._lengths[seq_id] += len(tokens)
            self._evict(keep=seq_id)
            over = self.num_tokens - self.max_tokens
            if over > 0:  # only this sequence (and pinned ones) left: it stops growing at the bound
                self._lengths[seq_id] -= over
                tokens = tokens[: len(tokens) - over]
            self.index.extend(seq_id, tokens)

    def _evict(self, keep: int) -> None:
        while self.num_sequences > self.max_sequences or self.num_tokens > self.max_tokens:
            victim = next((i for i, pinned in self._order.items() if not pinned and i != keep), None)
            if victim is None:
                return
            del self._order[victim]
            del self._lengths[victim]
            self.index.remove(victim)
            self.evictions += 1

    def speculate(self, context, **kwargs) -> SuffixDraft:
        """:meth:`SuffixIndex.speculate` under the lock."""
        with self._lock:
            return self.index.speculate(context, **kwargs)

    def clear(self) -> None:
        """Forget everything (pinned sequences too)."""
        with self._lock:
            for seq_id in list(self._order):
                self.index.remove(seq_id)
            self._order.clear()
            self._lengths.clear()

    def __repr__(self) -> str:
        return (f"SuffixCache({self.num_sequences} sequences, {self.num_tokens} tokens; max_sequences="
                f"{self.max_sequences}, max_tokens={self.max_tokens}, max_depth={self.max_depth})")
