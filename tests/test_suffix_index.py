"""The suffix index behind suffix decoding, against a brute-force n-gram search on random sequences."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_specdec.proposers.suffix_index import SuffixIndex


def occurrences(sequences, pattern) -> int:
    n = len(pattern)
    return sum(1 for s in sequences for i in range(len(s) - n + 1) if s[i:i + n] == pattern)


def _nodes(node):
    yield node
    for child in node.children.values():
        yield from _nodes(child)


sequences = st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=30), min_size=1, max_size=4)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(seqs=sequences, depth=st.integers(2, 6), chunks=st.integers(1, 4), drop=st.integers(0, 3),
       patterns=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=6), min_size=1, max_size=10))
def test_counts_equal_brute_force_after_appends_and_removal(seqs, depth, chunks, drop, patterns):
    index = SuffixIndex(max_depth=depth)
    for sid, seq in enumerate(seqs):  # appended in pieces, as a generation appends its tokens
        step = max(1, len(seq) // chunks)
        for i in range(0, len(seq), step):
            index.extend(sid, seq[i:i + step])
    if drop < len(seqs):
        index.remove(drop)
    kept = [s for sid, s in enumerate(seqs) if sid != drop]
    assert len(index) == sum(len(s) for s in kept)
    for pattern in patterns:
        if len(pattern) <= depth:
            assert index.count(pattern) == occurrences(kept, pattern), pattern
    assert all(n.count > 0 for n in _nodes(index.root) if n is not index.root)  # no dead nodes left
    if drop < len(seqs):
        for sid in range(len(seqs)):
            index.remove(sid)
        assert index.root.count == 0 and not index.root.children


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(seq=st.lists(st.integers(0, 3), min_size=2, max_size=40), depth=st.integers(3, 6),
       tail=st.integers(1, 5), tree=st.booleans())
def test_drafts_follow_the_counts(seq, depth, tail, tree):
    index = SuffixIndex(max_depth=depth)
    index.extend(0, seq)
    context = seq[-tail:]
    draft = index.speculate(context, max_tokens=8, alpha=2.0, min_prob=0.0, tree=tree)
    if not draft.tokens:
        return
    m = draft.match_len
    assert context[-m:] and index.count(context[-m:]) > 0
    for i, (token, parent, prob) in enumerate(zip(draft.tokens, draft.parents, draft.probs)):
        assert parent < i  # parents first
        path = [token]
        while parent >= 0:
            path.insert(0, draft.tokens[parent])
            parent = draft.parents[parent]
        pattern = context[-m:] + path
        assert len(pattern) <= depth
        # the probability of a draft = its continuation's count over the matched context's
        assert prob == pytest.approx(occurrences([seq], pattern) / occurrences([seq], context[-m:]))
    assert draft.score == pytest.approx(sum(draft.probs))
    if not tree:  # a path: each token is the most frequent continuation
        assert draft.parents == list(range(-1, len(draft.tokens) - 1))


def test_speculate_budget_and_floor():
    index = SuffixIndex(max_depth=8)
    index.extend("a", [1, 2, 3, 4, 5, 1, 2, 3, 4, 6])
    assert index.speculate([9, 9], max_tokens=4).tokens == []  # nothing matches
    draft = index.speculate([1, 2], max_tokens=10, alpha=1.0)
    assert draft.match_len == 2 and len(draft.tokens) <= 2  # at most alpha * match length
    draft = index.speculate([2, 3, 4], max_tokens=10, alpha=3.0, min_prob=0.6)
    assert draft.tokens == []  # 5 and 6 after "2 3 4": each 0.5, under the floor
    tree = index.speculate([2, 3, 4], max_tokens=10, alpha=3.0, min_prob=0.4, tree=True)
    assert sorted(tree.tokens[:2]) == [5, 6] and tree.parents[:2] == [-1, -1]
    with pytest.raises(ValueError, match="max_depth"):
        SuffixIndex(max_depth=1)


def test_the_contexts_own_occurrence_is_not_counted():
    index = SuffixIndex(max_depth=8)
    index.extend(0, [1, 2, 3, 1, 2])  # a row's own text: its tail "1 2" occurred once before, followed by 3
    assert index.speculate([1, 2], max_tokens=2, alpha=2.0).probs == [0.5, 0.5]  # the tail itself counted
    draft = index.speculate([1, 2], max_tokens=2, alpha=2.0, own_tail=2)
    assert draft.tokens == [3, 1] and draft.probs == [1.0, 1.0] and draft.match_len == 2
    index.extend(1, [7, 8])
    assert index.speculate([7, 8], max_tokens=2, own_tail=2).tokens == []  # only itself: nothing to follow
