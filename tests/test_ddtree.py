"""DDTree (method ``dflash`` with ``tree_budget``): the best-first selection against brute force, greedy decoding
identical to ``generate()`` (batch 1 and a padded batch, both schedules, a logits processor), exact sampling
(rejection sampling, chi-square against the enumerated distribution), the budget chosen from the forward costs,
and the option's errors. Coupled sampling equal to the plain loop's text: ``dflash_tree`` in test_syncs.METHODS,
which test_coupled.py runs."""

import itertools
import math
import random

import pytest
import torch

import hf_specdec
from hf_specdec import registry
from hf_specdec.costs import ForwardCostModel
from hf_specdec.modeling.dflash import DFlashConfig, DFlashDrafter
from hf_specdec.proposers.dflash import DFlashProposer, best_first
from test_sampling import NEW, PROMPT, WARP, _chi2, _dflash_drafter, _sample
from test_sampling import _target as _sampling_target
from tiny import PAD, tiny_model

V = 12  # a small vocabulary: random drafters are right often, at every sibling rank
H = 32


def _drafter(block=5, seed=0):
    torch.manual_seed(seed)
    config = DFlashConfig(hidden_size=H, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=V, block_size=block, mask_token_id=V - 1,
                          target_layer_ids=[0, 2], num_target_layers=3, initializer_range=0.5)
    return DFlashDrafter(config).eval()


def _prompts(bsz, length=10, seed=0):
    """Left-padded prompts of ``V``'s ids, each row shorter by two."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((bsz, length), PAD, dtype=torch.long)
    mask = torch.zeros(bsz, length, dtype=torch.long)
    for b in range(bsz):
        n = length - 2 * b
        ids[b, length - n:] = torch.randint(3, V, (n,), generator=g)
        mask[b, length - n:] = 1
    return ids, mask


# ---------------------------------------------------------------------------------------------- the selection
def _path_reach(probs, path):
    return math.prod(probs[d][r] for d, r in enumerate(path))


@pytest.mark.parametrize("seed", range(25))
def test_best_first_is_the_most_likely_paths(seed):
    """The nodes chosen are the ``budget`` paths with the largest products (brute force over every path), best
    first, parents before children (every prefix closed under ancestors)."""
    rng = random.Random(seed)
    depth, k, budget = rng.randint(1, 4), rng.randint(1, 4), rng.randint(1, 40)
    probs = []
    for _ in range(depth):  # a distribution's top-k probabilities, best first
        weights = [rng.random() ** 3 for _ in range(k + rng.randint(0, 3))]
        probs.append(sorted((w / sum(weights) for w in weights), reverse=True)[:k])
    nodes = best_first(probs, budget)
    paths = [p for d in range(1, depth + 1) for p in itertools.product(range(k), repeat=d)]
    expect = sorted(paths, key=lambda p: -_path_reach(probs, p))[:budget]
    got = []
    for d, r, parent, reach in nodes:
        assert 0 <= parent <= len(got)  # the root or a node chosen before
        path = (got[parent - 1] if parent else ()) + (r,)
        assert len(path) == d + 1 and reach == _path_reach(probs, path)
        got.append(path)
    assert set(got) == set(expect) and len(got) == len(expect)
    reaches = [n[3] for n in nodes]
    assert reaches == sorted(reaches, reverse=True)


def test_best_first_edges():
    assert best_first([], 5) == [] and best_first([[0.5]], 0) == [] and best_first([[0.0]], 3) == []
    # tokens of probability 0 are never drafted; a chain of one token per position is a chain
    assert best_first([[0.6, 0.0], [1.0, 0.0]], 8) == [(0, 0, 0, 0.6), (1, 0, 1, 0.6)]
    assert [n[:3] for n in best_first([[0.5, 0.3], [0.9, 0.1]], 4)] == [(0, 0, 0), (1, 0, 1), (0, 1, 0), (1, 0, 3)]


# ---------------------------------------------------------------------------------------------- greedy decoding
@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", vocab=V, layers=3, hidden=H)


def _trees(monkeypatch):
    """Record every proposal's tree (None: a plain step)."""
    seen = []
    propose = DFlashProposer.propose
    monkeypatch.setattr(DFlashProposer, "propose", lambda self, state: seen.append(propose(self, state)) or seen[-1])
    return seen


@pytest.mark.parametrize("schedule", ["constant", "adaptive"])
@pytest.mark.parametrize("bsz", [1, 3])
def test_greedy_is_generate(target, bsz, schedule, monkeypatch):
    trees = _trees(monkeypatch)
    ids, mask = _prompts(bsz)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=None,
              pad_token_id=PAD)
    ref = target.generate(**kw)
    out = target.generate(**kw, return_dict_in_generate=True, custom_generate=hf_specdec.decoding_method("dflash"),
                          drafter=_drafter(), tree_budget=7, draft_length_schedule=schedule)
    assert torch.equal(out.sequences, ref)
    if schedule == "constant":  # the budget as given: 7 drafts (the block allows depth 4, 7 tokens per position)
        assert out.speculative_stats["accepted_drafts"] > 0  # (adaptive: what pays depends on the timings)
        assert trees and all(t is not None and t.num_nodes == 8 for t in trees)
        assert any(not t.is_chain for t in trees)


def test_greedy_with_a_logits_processor_and_gpt2(monkeypatch):
    """Drafts through the call's processors (each position with the most likely path before it): still greedy
    ``generate()``, on a target with absolute positions."""
    model = tiny_model("gpt2", vocab=V, layers=3, hidden=H)
    ids, mask = _prompts(3, seed=1)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=None,
              pad_token_id=PAD, repetition_penalty=1.3, no_repeat_ngram_size=3)
    ref = model.generate(**kw)
    out = model.generate(**kw, return_dict_in_generate=True, custom_generate=hf_specdec.decoding_method("dflash"),
                         drafter=_drafter(seed=1), tree_budget=6, draft_length_schedule="constant")
    assert torch.equal(out.sequences, ref)
    assert out.speculative_stats["accepted_drafts"] > 0


def test_adaptive_budget_follows_the_forward_costs(monkeypatch):
    """Adaptive: as many of the best-first nodes as pay for the measured verification cost: free verification keeps
    the whole budget, a verification that costs 50 steps nothing (but now and then an exploratory single draft). A
    target of its own: its runner's costs are measured by no earlier call."""
    target = tiny_model("llama", vocab=V, layers=3, hidden=H)
    monkeypatch.setattr(ForwardCostModel, "record", lambda self, q, s: None)
    trees = _trees(monkeypatch)
    ids, mask = _prompts(1, seed=2)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=None,
              pad_token_id=PAD)
    ref = target.generate(**kw)
    for relative, drafts in ((lambda self, q: 1.0, {7}), (lambda self, q: 1.0 if q <= 1 else 50.0, {0, 1})):
        monkeypatch.setattr(ForwardCostModel, "relative", relative)
        trees.clear()
        out = target.generate(**kw, custom_generate=hf_specdec.decoding_method("dflash"), drafter=_drafter(),
                              tree_budget=7)
        assert torch.equal(out, ref)
        assert trees and {t.num_nodes - 1 if t is not None else 0 for t in trees} <= drafts


# ---------------------------------------------------------------------------------------------- sampling
def _exact(model):
    """P(t1, t2, t3) under the target with the call's warpers, by enumeration (test_sampling.py's, every prefix of a
    length in one forward)."""
    processors = model._get_logits_processor(
        generation_config=model.generation_config.__class__(do_sample=True, **WARP), input_ids_seq_length=len(PROMPT),
        encoder_input_ids=None, prefix_allowed_tokens_fn=None, logits_processor=None, device="cpu", model_kwargs={})
    probs = {(): 1.0}
    for _ in range(NEW):
        seqs = list(probs)
        ids = torch.tensor([PROMPT + list(seq) for seq in seqs])
        with torch.no_grad():
            q = torch.softmax(processors(ids, model(ids).logits[:, -1].float()), dim=-1).tolist()
        probs = {seq + (t,): probs[seq] * q[i][t] for i, seq in enumerate(seqs) for t in range(len(q[i]))}
    return probs


@pytest.fixture(scope="module")
def sampling_target_and_exact():
    model = _sampling_target()
    return model, _exact(model)


@pytest.mark.parametrize("budget", [4, 0])
def test_sampling_matches_target(sampling_target_and_exact, budget):
    """Rejection sampling: deterministic tree drafts verified by the rule for such drafts, and the chain's drafts
    sampled from the drafter (speculative sampling): the distribution of the first three tokens is the target's own
    (test_sampling.py's chi-square, whose ``dflash`` case runs the default). Coupled sampling: test_coupled.py."""
    model, exact = sampling_target_and_exact
    custom = hf_specdec.decoding_method("dflash", drafter=_dflash_drafter(), tree_budget=budget,
                                        draft_length_schedule="constant")
    counts, stats = _sample(model, PROMPT, custom, sampling="rejection")
    accepted = sum(s["accepted_drafts"] for s in stats)
    assert 0 < accepted < sum(s["proposed_drafts"] for s in stats)
    result = _chi2(counts, exact)
    assert result.pvalue > 1e-3, result


# ---------------------------------------------------------------------------------------------- the option
def test_option_forms_and_errors(target):
    assert registry.parse_spec("ddtree:16")[1] == {"tree_budget": 16}
    assert registry.parse_spec("dflash_chain")[1] == {"tree_budget": 0}
    assert registry.parse_spec("dflash_chain:8")[1] == {"tree_budget": 0, "block_size": 8}
    assert registry.parse_spec("dflash:tree_budget=24:draft_length_schedule=constant")[1] == {
        "tree_budget": 24, "draft_length_schedule": "constant"}
    ids, mask = _prompts(1)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, eos_token_id=None,
              pad_token_id=PAD, custom_generate=hf_specdec.decoding_method("dflash"), drafter=_drafter())
    with pytest.raises(ValueError, match=r"tree_budget must be an int >= 0 .*0 drafts a chain.*got -3"):
        target.generate(**kw, tree_budget=-3)
    with pytest.raises(ValueError, match="dflash: tree_budget must be int, got str"):
        target.generate(**kw, tree_budget="16")
    assert DFlashProposer(_drafter(), tree_budget=0).max_nodes == 5  # the chain: the block
    assert DFlashProposer(_drafter()).tree_budget == 4  # default: as many nodes as the chain
    assert DFlashProposer(_drafter(), tree_budget=12).max_nodes == 13
