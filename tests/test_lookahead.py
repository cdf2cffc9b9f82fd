"""Lookahead decoding: greedy losslessness across architectures and batch shapes, the window as a draft tree (its
ancestors are the reference's attention mask), the n-gram pool (policy, harvest, accepted drafts), the budgets, and
the errors. Sampling exactness: tests/test_sampling.py."""

import random
from types import SimpleNamespace

import pytest
import torch

import hf_specdec
from hf_specdec.proposers.lookahead import TEXT_SOURCE, WINDOW_SOURCE, LookaheadProposer, NGramPool, _Row, window_tree
from hf_specdec.tree import DraftTree
from tiny import ARCHS, EOS, prompts, tiny_model

MAX_NEW = 24

_models = {}


def model(arch):
    if arch not in _models:
        _models[arch] = tiny_model(arch)
    return _models[arch]


def greedy(m, ids, mask, **kw):
    return m.generate(input_ids=ids, attention_mask=mask, do_sample=False, **kw)


CONFIGS = {
    "default": {},
    "constant": {"draft_length_schedule": "constant"},
    "wide": {"draft_length_schedule": "constant", "window_size": 5, "ngram_size": 4, "guess_set_size": 4},
    "jacobi": {"draft_length_schedule": "constant", "window_size": 4, "ngram_size": 2, "guess_set_size": 2},
    "window_only": {"draft_length_schedule": "constant", "guess_set_size": 0, "pool_from_prompt": False},
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------------------ losslessness
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("bsz", [1, 3])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_matches_generate(arch, bsz, config):
    m = model(arch)
    ids, mask = prompts(bsz, length=12, seed=bsz)
    kw = dict(max_new_tokens=MAX_NEW, eos_token_id=None)
    ref = greedy(m, ids, mask, **kw)
    out = greedy(m, ids, mask, custom_generate=hf_specdec.decoding_method("lookahead", **CONFIGS[config]), **kw)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_static_cache_and_folder_entry(arch):
    m = model(arch)
    ids, mask = prompts(3, length=12, seed=4)
    kw = dict(max_new_tokens=MAX_NEW, eos_token_id=None)
    ref = greedy(m, ids, mask, **kw)
    out = greedy(m, ids, mask, custom_generate=hf_specdec.custom_generate_path("lookahead"), trust_remote_code=True,
                 cache_implementation="static", draft_length_schedule="constant", **kw)
    assert torch.equal(out, ref)


class CheckedLookahead(LookaheadProposer):
    """Asserts the budget rules of :meth:`Proposer.propose` on every proposal."""

    def propose(self, state):
        tree = super().propose(state)
        if tree is not None:
            for b, budget in enumerate(state.max_drafts):
                assert int(tree.depths[b].max()) <= budget
                if budget == 0:
                    assert int(tree.valid[b].sum()) == 1
        return tree


@pytest.mark.parametrize("max_new", [1, 3, 7, MAX_NEW])
def test_budgets_and_eos_in_a_batch(max_new):
    """Rows stop at different steps (an EOS the target produces, max_new_tokens): a finished or nearly finished
    row gets no drafts or a shallower tree, and the output stays plain greedy."""
    m = model("llama")
    ids, mask = prompts(3, length=12, seed=5)
    free = greedy(m, ids, mask, max_new_tokens=MAX_NEW, eos_token_id=None)
    eos = int(free[0, ids.shape[1] + 4])
    kw = dict(max_new_tokens=max_new, eos_token_id=eos, pad_token_id=0)
    ref = greedy(m, ids, mask, **kw)
    for adaptive in (False, True):
        out = greedy(m, ids, mask, custom_generate=hf_specdec.decoding_method(
            CheckedLookahead(window_size=4, ngram_size=3, guess_set_size=3, adaptive=adaptive)), **kw)
        assert torch.equal(out, ref)


def test_deterministic():
    """Greedy runs repeat exactly, drafts included (the window is seeded from the prompt, not the global RNG)."""
    m = model("qwen2")
    ids, mask = prompts(2, length=12, seed=6)
    stats = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        out = greedy(m, ids, mask, max_new_tokens=MAX_NEW, eos_token_id=None, return_dict_in_generate=True,
                     custom_generate=hf_specdec.decoding_method("lookahead", draft_length_schedule="constant"))
        stats.append({k: out.speculative_stats[k] for k in ("proposed_drafts", "accepted_drafts")})
    assert stats[0] == stats[1]


# ------------------------------------------------------------------------------------------------ the window tree
def lade_mask(n_levels: int, width: int) -> torch.BoolTensor:
    """The reference's window mask (``j_make_causal_mask_multilevel``), written from its description: token
    (level l, column i) sees the root, level-0 tokens 0..i and column i of levels 1..l. Order: level by level."""
    n = 1 + n_levels * width
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[:, 0] = True

    def index(l, i):
        return 1 + l * width + i

    for l in range(n_levels):
        for i in range(width):
            q = index(l, i)
            for j in range(i + 1):
                mask[q, index(0, j)] = True
            for k in range(1, l + 1):
                mask[q, index(k, i)] = True
    return mask


@pytest.mark.parametrize("n_levels,width", [(1, 4), (2, 3), (3, 5), (4, 1)])
def test_window_tree_is_the_lade_mask(n_levels, width):
    levels = [[10 * l + i + 3 for i in range(width)] for l in range(n_levels)]
    tokens, parents, slots = window_tree(levels)
    tree = DraftTree.from_rows(torch.tensor([2]), [tokens], [parents])
    assert torch.equal(tree.ancestors[0], lade_mask(n_levels, width))
    depths = tree.depths[0].tolist()
    for l in range(n_levels):
        for i in range(width):
            assert depths[slots[l][i]] == i + 1 + l  # the position the reference gives it, relative to the root
            assert tree.tokens[0, slots[l][i]] == levels[l][i]


def test_window_after_guesses_sees_no_guess():
    """Guesses (a trie under the root) come first; the window's nodes see none of them and vice versa."""
    guess_tokens, guess_parents = [7, 8, 9], [0, 1, 0]  # root -> 7 -> 8, root -> 9
    tokens, parents, slots = window_tree([[3, 4], [5, 6]], offset=len(guess_tokens))
    tree = DraftTree.from_rows(torch.tensor([2]), [guess_tokens + tokens], [guess_parents + parents])
    anc = tree.ancestors[0]
    window = [n for level in slots for n in level]
    assert not anc[window][:, 1:4].any() and not anc[1:4][:, window].any()
    assert torch.equal(anc[window][:, [0] + window], lade_mask(2, 2)[1:])


# ------------------------------------------------------------------------------------------------ the pool
def test_pool_policy():
    pool = NGramPool(capacity=2)
    assert pool.add(5, (1, 2), TEXT_SOURCE) and pool.add(5, (3, 4), WINDOW_SOURCE)
    assert not pool.add(5, (1, 2), WINDOW_SOURCE)  # seen again: most recent, keeps its first source
    assert pool.guesses(5) == [((1, 2), TEXT_SOURCE), ((3, 4), WINDOW_SOURCE)]
    pool.add(5, (6, 7), TEXT_SOURCE)  # full: the least recently seen goes
    assert [v for v, _ in pool.guesses(5)] == [(6, 7), (1, 2)]
    assert pool.guesses(9) == [] and len(pool) == 2
    none = NGramPool(capacity=0)
    assert not none.add(5, (1, 2), TEXT_SOURCE) and none.guesses(5) == []


def _state(text, eos=()):
    return SimpleNamespace(eos_token_ids=list(eos), row_tokens=lambda b: torch.tensor(text))


def test_window_step_harvests_the_diagonals_and_shifts():
    p = LookaheadProposer(window_size=2, ngram_size=4, guess_set_size=4, adaptive=False)
    row = _Row(index=0, pool=NGramPool(4), rng=random.Random(0), prompt=[50], levels=[[10, 11, 12, 13]])
    state = _state([50, 51], eos=[EOS])
    assert p.window_depth == 4  # W + N - 2: the depth of the window's deepest node, while it fills and after
    choice = list(range(100))  # the target's argmax at node n is n
    # filling: every level loses its first column, the new level is the argmax at the last level minus its first
    _, _, row.slots = window_tree(row.levels)
    p._step_window(state, row, choice)
    assert row.levels == [[11, 12, 13], [2, 3, 4]] and len(row.pool) == 0
    _, _, row.slots = window_tree(row.levels)  # last level at nodes 4, 5, 6
    p._step_window(state, row, choice)
    assert row.levels == [[12, 13], [3, 4], [5, 6]] and len(row.pool) == 0
    # full (N - 1 = 3 levels): column i read down the levels plus the new token is an n-gram keyed by level 0
    choice[5] = EOS  # an end-of-sequence token in the new level is replaced by a prompt token
    _, _, row.slots = window_tree(row.levels)  # last level at nodes 5, 6
    p._step_window(state, row, choice)
    assert row.pool.guesses(12) == [((3, 5, 50), WINDOW_SOURCE)]
    assert row.pool.guesses(13) == [((4, 6, 6), WINDOW_SOURCE)]
    assert row.levels == [[3, 4], [5, 6], [50, 6]]


def test_text_ngrams_seed_the_pool():
    m = model("llama")
    ids, mask = prompts(1, length=12, seed=1)
    p = LookaheadProposer(window_size=2, ngram_size=3, guess_set_size=8)
    greedy(m, ids, mask, max_new_tokens=6, eos_token_id=None, custom_generate=hf_specdec.decoding_method(p))
    row, pool = ids[0].tolist(), p.rows[0].pool
    for j in range(len(row) - 2):  # every n-gram of the prompt (the capacity is not reached here)
        assert tuple(row[j + 1:j + 3]) in [value for value, _ in pool.guesses(row[j])]


def test_window_ngrams_are_accepted_on_a_repetitive_sequence():
    """Without text n-grams the pool holds only what the window produced; on a target whose greedy output falls
    into runs, those n-grams are verified and accepted (several tokens per forward)."""
    m = model("gpt2")  # its greedy continuation of this prompt is runs of one token
    ids, mask = prompts(1, length=12, seed=1)
    kw = dict(max_new_tokens=48, eos_token_id=None)
    ref = greedy(m, ids, mask, **kw)
    p = LookaheadProposer(window_size=3, ngram_size=3, guess_set_size=3, pool_from_prompt=False, adaptive=False)
    out = greedy(m, ids, mask, return_dict_in_generate=True, custom_generate=hf_specdec.decoding_method(p), **kw)
    assert torch.equal(out.sequences, ref)
    stats = out.speculative_stats
    assert stats["acceptance_length"] > 1.8
    assert any(k >= 2 for k, count in stats["accept_histogram"].items() if count)
    pool = p.rows[0].pool
    assert len(pool) > 0 and all(src != TEXT_SOURCE for key in pool.entries for _, src in pool.guesses(key))
    assert p.rows[0].credit > 0  # accepted tokens came from the window's n-grams (or its own nodes)


def test_text_ngrams_are_accepted_on_a_copy():
    """A prompt that repeats a passage: its n-grams draft the continuation when the output copies it."""
    m = model("llama")
    ids, mask = prompts(1, length=12, seed=2)
    ref = greedy(m, ids, mask, max_new_tokens=MAX_NEW, eos_token_id=None)
    text = torch.cat([ref, ref[:, 12:]], dim=1)  # the output once more: the continuation is in the prompt
    ref2 = greedy(m, text, torch.ones_like(text), max_new_tokens=MAX_NEW, eos_token_id=None)
    out = greedy(m, text, torch.ones_like(text), max_new_tokens=MAX_NEW, eos_token_id=None,
                 return_dict_in_generate=True, custom_generate=hf_specdec.decoding_method("lookahead"))
    assert torch.equal(out.sequences, ref2)
    assert out.speculative_stats["accepted_drafts"] > 0


def test_adaptive_window_switches_off_when_it_does_not_pay():
    """With a cost curve where the window's nodes cost much more than its yield, the adaptive schedule stops
    running it (and tries it again later), and does not start filling one; the constant one always runs it."""
    from hf_specdec.costs import ForwardCostModel

    class Steep(ForwardCostModel):
        def relative(self, q):
            return 1.0 if q <= 4 else q / 2

    p = LookaheadProposer(window_size=4, ngram_size=3, guess_set_size=2)
    state = SimpleNamespace(cost_model=Steep())
    row = _Row(index=0, pool=NGramPool(2), rng=random.Random(0), prompt=[5, 6])
    row.levels = [[5, 6, 5, 6], [6, 5, 6, 5]]  # full
    _, on = p._choose(state, row, [], True)
    assert not on and row.levels is None and row.pause == 1 and row.backoff == 2
    row.levels = [[5, 6, 5, 6, 5]]  # filling, where a full window could never pay (a large batch): does not run
    _, on = p._choose(state, row, [], True)
    assert not on and row.levels is None

    class Flat(ForwardCostModel):
        def relative(self, q):
            return 1.0 if q <= 4 else 1.2

    row.levels = [[5, 6, 5, 6, 5]]  # filling where a full window could pay: runs, whatever its own step yields
    _, on = p._choose(SimpleNamespace(cost_model=Flat()), row, [], True)
    assert on


# ------------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("opts,match", [
    ({"window_size": 0}, "window_size must be >= 1, got 0"),
    ({"ngram_size": 1}, "ngram_size must be >= 2, got 1"),
    ({"guess_set_size": -1}, "guess_set_size must be >= 0, got -1"),
])
def test_bad_values(opts, match):
    m = model("llama")
    ids, mask = prompts(1, length=8)
    with pytest.raises(ValueError, match=match):
        greedy(m, ids, mask, max_new_tokens=4, custom_generate=hf_specdec.decoding_method("lookahead"), **opts)
    with pytest.raises(ValueError, match=match):
        LookaheadProposer(**opts)


@pytest.mark.parametrize("opts,match", [
    ({"window_size": "3"}, "lookahead: window_size must be int, got str '3'"),
    ({"ngram_size": 2.5}, "lookahead: ngram_size must be int, got float 2.5"),
    ({"pool_from_prompt": "yes"}, "lookahead: pool_from_prompt must be bool"),
    ({"draft_length_schedule": "fast"}, "draft_length_schedule must be 'adaptive' or 'constant'"),
    ({"guess_size": 3}, "unknown method option.*guess_size.*guess_set_size"),
])
def test_bad_types(opts, match):
    with pytest.raises(ValueError, match=match):
        hf_specdec.decoding_method("lookahead", **opts)


def test_bool_is_not_a_size():
    with pytest.raises(ValueError, match="window_size must be an int, got bool True"):
        LookaheadProposer(window_size=True)
