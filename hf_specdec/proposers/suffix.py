"""Suffix decoding (SuffixDecoding, Oliaro et al.; ArcticInference): drafts from a suffix index of token sequences.

This module holds the index; the proposer and its registry record follow (issue 19).

:class:`SuffixIndex` is a depth-bounded suffix trie over many sequences (ArcticInference's ``SuffixTree`` without
its path compression): it holds every substring of length ``<= max_depth`` of the indexed sequences, and a node's
``count`` is the number of start positions whose substring passes through it. Appending a token costs
``O(max_depth)``; removing a sequence ``O(len * max_depth)``.

:meth:`SuffixIndex.speculate` matches the tail of a context: for every match length ``m`` that the index holds
(1, 2, ... until one does not match), it drafts at most ``floor(alpha * m + offset)`` tokens from the node the match
ends in, moving to a child with probability ``count(child) / count(node)`` (the running product is each draft's
probability), either along the most frequent child (a path) or best-first over every child whose probability is at
least ``min_prob`` (a tree); the draft with the highest ``score`` (the sum of its tokens' probabilities: the expected
number of accepted tokens if they were right that often) wins, ties going to the longer match.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field


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
                  tree: bool = False) -> SuffixDraft:
        """The best draft continuing ``context`` (see the module docstring); an empty draft when nothing matches."""
        best = SuffixDraft()
        context = [int(t) for t in context[-(self.max_depth - 1):]]
        for m in range(1, len(context) + 1):
            node = self._walk(context[-m:])
            if node is None or node.count == 0:
                break
            budget = min(max_tokens, math.floor(m * alpha + offset + 1e-6), self.max_depth - m)
            if budget <= 0:
                continue
            draft = self._tree(node, budget, min_prob) if tree else self._path(node, budget, min_prob)
            draft.match_len = m
            if draft.tokens and draft.score >= best.score:
                best = draft
        return best

    @staticmethod
    def _path(node: _Node, budget: int, min_prob: float) -> SuffixDraft:
        draft, prob = SuffixDraft(), 1.0
        while len(draft.tokens) < budget and node.children:
            token, child = max(node.children.items(), key=lambda kv: kv[1].count)
            prob *= child.count / node.count
            if prob < min_prob:
                break
            draft.parents.append(len(draft.tokens) - 1)
            draft.tokens.append(token)
            draft.probs.append(prob)
            node = child
        draft.score = sum(draft.probs)
        return draft

    @staticmethod
    def _tree(node: _Node, budget: int, min_prob: float) -> SuffixDraft:
        draft = SuffixDraft()
        tie = itertools.count()  # heap order for equal probabilities: first pushed first
        heap = [(-(c.count / node.count), next(tie), t, c, -1) for t, c in node.children.items()]
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
            for t, c in child.children.items():
                heapq.heappush(heap, (-(prob * c.count / child.count), next(tie), t, c, here))
        draft.score = sum(draft.probs)
        return draft
