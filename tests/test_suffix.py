"""Suffix decoding and hybrid drafting: greedy losslessness across architectures and batch shapes, the cross-call
cache (its memory bound, a repeated request drafting from the first one's output, concurrent calls), hybrid trees
of a model drafter and a drafter-free source, and the errors."""

import math
import threading

import pytest
import torch

import hf_specdec
from hf_specdec import SuffixCache
from hf_specdec.proposers.hybrid import HybridProposer, _merge
from hf_specdec.proposers.suffix import SuffixProposer
from hf_specdec import build_proposer
from tiny import prompts, tiny_model

MAX_NEW = 32


def generate(m, ids, mask, **kw):
    kw.setdefault("eos_token_id", None)
    return m.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW, **kw)


_models = {}


def model(arch):
    if arch not in _models:
        _models[arch] = tiny_model(arch)
    return _models[arch]


def suffix(**opts):
    return hf_specdec.decoding_method("suffix", **opts)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "gpt2"])
@pytest.mark.parametrize("bsz", [1, 3])
@pytest.mark.parametrize("variant", ["tree", "path", "adaptive", "cache"])
def test_greedy_matches_generate(arch, bsz, variant):
    m = model(arch)
    ids, mask = prompts(bsz, length=12, seed=bsz, repeat=True)
    ref = generate(m, ids, mask)
    opts = {"tree": dict(draft_length_schedule="constant"),
            "path": dict(draft_length_schedule="constant", use_tree_spec=False, max_spec_tokens=5),
            "adaptive": {},
            "cache": dict(suffix_cache=SuffixCache(max_sequences=4), draft_length_schedule="constant")}[variant]
    for _ in range(2 if variant == "cache" else 1):  # the second call drafts from the first one's output too
        out = generate(m, ids, mask, custom_generate=suffix(**opts), return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref)
    if variant != "adaptive":
        assert out.speculative_stats["accepted_drafts"] > 0


def test_stops_at_eos_like_generate():
    m = model("llama")
    ids, mask = prompts(3, length=12, seed=5, repeat=True)
    eos = int(generate(m, ids, mask)[0, ids.shape[1] + 8])  # a token the output reaches
    ref = generate(m, ids, mask, eos_token_id=eos)
    out = generate(m, ids, mask, eos_token_id=eos, custom_generate=suffix(draft_length_schedule="constant"))
    assert torch.equal(out, ref)


def test_second_call_drafts_from_the_first():
    m = model("qwen3")
    ids, mask = prompts(1, length=10, seed=11, repeat=False)  # nothing to copy from the prompt itself
    cache = SuffixCache()
    stats = []
    for _ in range(2):
        out = generate(m, ids, mask, custom_generate=suffix(suffix_cache=cache, draft_length_schedule="constant"),
                       return_dict_in_generate=True)
        stats.append(out.speculative_stats)
    assert torch.equal(out.sequences, generate(m, ids, mask))
    assert stats[1]["accepted_drafts"] > stats[0]["accepted_drafts"]
    assert stats[1]["target_forward_passes"] < stats[0]["target_forward_passes"]
    assert cache.num_sequences == 2 and cache.num_tokens == 2 * MAX_NEW


def test_cache_obeys_its_bounds():
    cache = SuffixCache(max_sequences=3, max_tokens=50, max_depth=4)
    g = torch.Generator().manual_seed(0)
    ids = [cache.add(torch.randint(0, 9, (int(torch.randint(5, 20, (1,), generator=g)),), generator=g).tolist())
           for _ in range(12)]
    assert cache.num_sequences <= 3 and cache.num_tokens <= 50
    assert len(cache.index) == cache.num_tokens  # the index holds exactly what is kept
    assert list(cache.index.sequences) == ids[-cache.num_sequences:]  # oldest evicted first
    assert cache.evictions == 12 - cache.num_sequences
    # pinned sequences stay; a sequence longer than the bound stops growing there
    cache = SuffixCache(max_sequences=2, max_tokens=30, max_depth=4)
    pinned = cache.add(list(range(10)), pinned=True)
    for _ in range(4):
        cache.add(list(range(8)))
    assert pinned in cache.index.sequences and cache.num_sequences == 2
    big = cache.open()
    cache.extend(big, list(range(100)))
    assert cache.num_tokens == 30 and len(cache.index) == 30 and pinned in cache.index.sequences
    with pytest.raises(ValueError, match="pinned sequences would hold"):
        cache.add(list(range(25)), pinned=True)


def test_cache_filled_past_its_bound_by_generate_calls():
    m = model("llama")
    cache = SuffixCache(max_sequences=3, max_tokens=80)
    for seed in range(6):
        ids, mask = prompts(2, length=8, seed=seed, repeat=False)
        out = generate(m, ids, mask, custom_generate=suffix(suffix_cache=cache))
        assert torch.equal(out, generate(m, ids, mask))
        assert cache.num_sequences <= 3 and cache.num_tokens <= 80
    assert cache.evictions > 0


def test_concurrent_calls_share_one_cache():
    m = model("llama")
    cache = SuffixCache(max_sequences=8)
    inputs = [prompts(1, length=10, seed=s, repeat=False) for s in range(4)]
    refs = [generate(m, *inp) for inp in inputs]
    outs, errors = {}, []

    def run(i):
        try:
            outs[i] = generate(m, *inputs[i], custom_generate=suffix(suffix_cache=cache))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(torch.equal(outs[i], refs[i]) for i in range(4))
    assert cache.num_sequences == 4


@pytest.mark.parametrize("opts, message", [
    ({"max_spec_tokens": 0}, "max_spec_tokens must be >= 1"),
    ({"max_spec_factor": 0.0}, "max_spec_factor must be > 0"),
    ({"min_token_prob": 1.5}, "min_token_prob must be in"),
    ({"max_tree_depth": 1}, "max_tree_depth must be >= 2"),
    ({"suffix_cache": {}}, "suffix_cache must be a hf_specdec.SuffixCache"),
    ({"use_tree_spec": "yes"}, "use_tree_spec must be bool"),
])
def test_bad_options(opts, message):
    m = model("llama")
    ids, mask = prompts(1, length=6)
    with pytest.raises(ValueError, match=message):
        generate(m, ids, mask, custom_generate=suffix(**opts))


def test_bad_cache_bounds():
    with pytest.raises(ValueError, match="max_sequences must be an integer >= 1"):
        SuffixCache(max_sequences=0)
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1"):
        SuffixCache(max_tokens=2.5)
    with pytest.raises(ValueError, match="max_depth must be an integer >= 2"):
        SuffixCache(max_depth=1)


# ------------------------------------------------------------------------------------------------ hybrid drafting
def _assisted(m, other, **opts):
    return hf_specdec.decoding_method("assisted", drafter=other, **opts)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("bsz", [1, 3])
@pytest.mark.parametrize("hybrid", ["suffix", "prompt_lookup", "cache"])
def test_hybrid_greedy_matches_generate(arch, bsz, hybrid):
    m = model(arch)
    other = tiny_model(arch, seed=3)  # a drafter that is often wrong: both sources draft
    ids, mask = prompts(bsz, length=12, seed=bsz, repeat=True)
    ref = generate(m, ids, mask)
    value = SuffixCache() if hybrid == "cache" else hybrid
    for _ in range(2 if hybrid == "cache" else 1):
        out = generate(m, ids, mask, custom_generate=_assisted(m, other, hybrid=value, num_speculative_tokens=3),
                       return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref)
    assert out.speculative_stats["accepted_drafts"] > 0


def test_hybrid_takes_the_lookup_draft_when_it_pays_and_the_model_otherwise():
    m = model("llama")
    ids, mask = prompts(3, length=12, seed=2, repeat=True)
    proposer = build_proposer("assisted", m, drafter=tiny_model("llama", seed=3), hybrid="suffix",
                              num_speculative_tokens=3)
    assert isinstance(proposer, HybridProposer) and isinstance(proposer.lookup, SuffixProposer)
    out = generate(m, ids, mask, custom_generate=hf_specdec.decoding_method(proposer))
    assert torch.equal(out, generate(m, ids, mask))
    assert proposer.lookup_steps > 0 and proposer.model_steps > 0


def test_merged_tree_gives_lookup_rows_point_masses():
    from types import SimpleNamespace

    from hf_specdec.proposers.base import RowDraft
    from hf_specdec.tree import DraftTree

    state = SimpleNamespace(batch_size=2, device=torch.device("cpu"), roots=lambda: torch.tensor([5, 6]))
    probs = torch.softmax(torch.randn(2, 2, 10), -1)
    model_tree = DraftTree.chain(torch.tensor([5, 6]), torch.tensor([[1, 2], [3, 4]]), torch.tensor([0, 2]), probs)
    merged = _merge(state, model_tree, [RowDraft([7, 8, 9], [0, 0, 1], [0.5, 0.4, 0.3]), None])
    assert merged.tokens[0].tolist() == [5, 7, 8, 9] and merged.parents[0].tolist() == [-1, 0, 0, 1]
    assert merged.tokens[1, :3].tolist() == [6, 3, 4] and merged.valid.sum(1).tolist() == [4, 3]
    assert torch.equal(merged.draft_probs[0, 1:4].argmax(-1), torch.tensor([7, 8, 9]))
    assert torch.allclose(merged.draft_probs[0, 1:4].sum(-1), torch.ones(3))
    assert torch.equal(merged.draft_probs[1, 1:3], probs[1])


def test_bad_hybrid_value():
    m = model("llama")
    ids, mask = prompts(1, length=6)
    with pytest.raises(ValueError, match="hybrid must be 'suffix', 'prompt_lookup', a hf_specdec.SuffixCache, or "
                                         "False / 'off'"):
        generate(m, ids, mask, custom_generate=_assisted(m, tiny_model("llama", seed=3), hybrid="eagle"))


MODEL_DRAFTERS = ("assisted", "eagle3", "dflash", "medusa", "layerskip", "mtp")  # the methods with hybrid=


def _drafter_opts(method, target):
    from test_syncs import _dflash, _eagle3, _medusa, _mtp

    return {"assisted": lambda: {"drafter": tiny_model("llama", seed=7, hidden=32)}, "eagle3": lambda: {
        "drafter": _eagle3()}, "dflash": lambda: {"drafter": _dflash()}, "medusa": lambda: {"drafter": _medusa()},
        "layerskip": lambda: {"exit_layer": 1}, "mtp": lambda: {"drafter": _mtp(target)}}[method]()


@pytest.mark.parametrize("method", MODEL_DRAFTERS)
def test_model_drafters_draft_hybrid_with_suffix_by_default(method):
    """Every model-drafter method wraps its proposer in hybrid drafting with suffix decoding unless told otherwise:
    ``hybrid=False`` / ``"off"`` (and ``off`` / ``none`` in method strings) turn it off, so does the constant
    schedule (the method's own drafts every step) unless ``hybrid=`` is given."""
    from hf_specdec import registry
    from hf_specdec.proposers.prompt_lookup import PromptLookupProposer

    assert {m.name for m in registry.methods() if "hybrid" in m.option_names} == set(MODEL_DRAFTERS)
    target = tiny_model("llama", seed=0, hidden=32, layers=2)
    opts = _drafter_opts(method, target)
    for given, lookup in [({}, SuffixProposer), ({"hybrid": None}, SuffixProposer),
                          ({"hybrid": "prompt_lookup"}, PromptLookupProposer), ({"hybrid": False}, None),
                          ({"hybrid": "off"}, None), ({"draft_length_schedule": "constant"}, None),
                          ({"draft_length_schedule": "constant", "hybrid": "suffix"}, SuffixProposer)]:
        proposer = build_proposer(method, target, **opts, **given)
        if lookup is None:
            assert not isinstance(proposer, HybridProposer), given
        else:
            assert isinstance(proposer, HybridProposer) and type(proposer.lookup) is lookup, given
            assert proposer.name == f"{proposer.model.name}+{proposer.lookup.name}"
    for text, value in [("off", False), ("none", False), ("False", False), ("suffix", "suffix")]:
        assert registry.parse_spec(f"{method}:hybrid={text}")[1]["hybrid"] == value


def test_layerskip_hybrid_is_lossless_whichever_source_a_step_takes(monkeypatch):
    """LayerSkip's chains write the early layers into the target's cache, so a step takes the drafter-free draft for
    every row or for none; with the choice at random (batch 3: mixed wishes fall back to LayerSkip), with and without
    an exit adapter (fed the accepted path of a suffix tree it never drafted), greedy output is the target's."""
    import random

    from hf_specdec.proposers import hybrid
    from test_layerskip import agreeable, random_adapter

    rng = random.Random(0)
    monkeypatch.setattr(hybrid.HybridProposer, "_model_rate", lambda self, state: rng.choice([0.0, 1.0, 1e9]))
    m = agreeable("llama")
    steps = []  # (batch size, steps that took the drafter-free draft, steps that LayerSkip drafted, accepted drafts)
    for bsz, seed in ((1, 1), (3, 2), (3, 3)):
        ids, mask = prompts(bsz, length=12, seed=seed, repeat=True)
        ref = generate(m, ids, mask)
        for opts in ({"exit_layer": 1}, {"drafter": random_adapter(m, draft_vocab=48)}):
            proposer = build_proposer("layerskip", m, **opts)
            out = generate(m, ids, mask, custom_generate=hf_specdec.decoding_method(proposer),
                           return_dict_in_generate=True)
            assert torch.equal(out.sequences, ref), (bsz, opts)
            steps.append((bsz, proposer.lookup_steps, proposer.model_steps, out.speculative_stats["accepted_drafts"]))
    assert all(sum(s[i] for s in steps if s[0] == bsz) > 0 for bsz in (1, 3) for i in (1, 2, 3)), steps


def test_own_and_cache_drafts_merge_into_one_tree():
    from types import SimpleNamespace

    from hf_specdec.proposers.suffix_index import SuffixDraft

    proposer = SuffixProposer(adaptive=False)
    proposer.calibration = {}
    state = SimpleNamespace(eos_token_ids=[9], cost_model=None)
    own = SuffixDraft(tokens=[1, 2, 3], parents=[-1, 0, 1], probs=[1.0, 0.9, 0.8], match_len=5)
    shared = SuffixDraft(tokens=[1, 4, 9, 5], parents=[-1, 0, 1, 2], probs=[0.9, 0.6, 0.6, 0.5], match_len=2)
    d = proposer._candidate(state, [("own", own), ("cache", shared)], budget=10)
    # 1 from both (max of the calibrated probabilities), 2-3 from the row's own index, 4 from the cache; the end
    # token 9 and what follows it are dropped
    assert d.tokens == [1, 2, 3, 4] and d.parents == [0, 1, 2, 1]
    assert d.reach[0] == pytest.approx(1.0) and d.reach[3] == pytest.approx(0.6 * 0.7)
    # each source learns from its own drafts on the accepted path: own drafted slots 1-3, the cache slots 1 and 4
    assert d.key[("own", 4)][1] == {1, 2, 3} and d.key[("cache", 2)][1] == {1, 4}
    from hf_specdec.verify import AcceptResult

    proposer.learn([d], AcceptResult(paths=[[0, 1, 4]], new_tokens=[[1, 4, 7]]))
    assert proposer.calibration[("cache", 2)] > 0.7 and proposer.calibration[("own", 4)] < 1.0


def test_a_pinned_corpus_is_a_datastore():
    from tiny import word_tokenizer

    m = model("llama")
    ids, mask = prompts(1, length=10, seed=21, repeat=False)
    ref = generate(m, ids, mask)
    corpus = SuffixCache(max_sequences=2)
    corpus.add(ref[0, ids.shape[1]:].tolist(), pinned=True)  # a document that holds the answer
    out = generate(m, ids, mask, custom_generate=suffix(suffix_cache=corpus, draft_length_schedule="constant"),
                   return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.speculative_stats["accepted_drafts"] >= MAX_NEW // 2
    for _ in range(3):  # outputs come and go; the document stays
        generate(m, ids, mask, custom_generate=suffix(suffix_cache=corpus))
    assert 0 in corpus.index.sequences and corpus.num_sequences == 2
    tok = word_tokenizer()
    docs = SuffixCache()
    docs.add_texts(tok, ["abcabc", "hello"])
    assert docs.num_tokens == len(tok("abcabc", add_special_tokens=False)["input_ids"]) + 5


def test_a_child_rounded_above_its_parent_still_comes_after_it():
    from types import SimpleNamespace

    from hf_specdec.proposers.suffix_index import SuffixDraft
    from hf_specdec.tree import DraftTree

    proposer = SuffixProposer(adaptive=False)
    proposer.calibration = {}
    state = SimpleNamespace(eos_token_ids=[], cost_model=None)
    p = 0.8333333333333334
    draft = SuffixDraft(tokens=[5, 6, 7], parents=[-1, 0, 1], probs=[1.0, p, math.nextafter(p, 1.0)], match_len=4)
    d = proposer._candidate(state, [("own", draft)], budget=5)
    assert d.parents == [0, 1, 2]
    with pytest.raises(ValueError, match="parent must come before it"):  # what a wrong order would have done
        DraftTree.from_rows(torch.tensor([1]), [[5, 7, 6]], [[0, 3, 1]])


def test_hybrid_stays_lossless_whichever_source_each_row_takes(monkeypatch):
    """The per-row choice depends on measured times; here it is random, and any mix must keep the output."""
    import random

    from hf_specdec.proposers import hybrid, suffix as suffix_module

    rng = random.Random(0)
    monkeypatch.setattr(suffix_module, "best_count", lambda expected, cost, *a, **k: rng.randint(0, len(expected)))
    monkeypatch.setattr(hybrid.HybridProposer, "_model_rate", lambda self, state: rng.choice([0.0, 1.0, 1e9]))
    m, other = model("llama"), tiny_model("llama", seed=3)
    for trial in range(6):
        ids, mask = prompts(3, length=12, seed=trial, repeat=True)
        ref = generate(m, ids, mask)
        cache = SuffixCache()
        for _ in range(2):
            out = generate(m, ids, mask, custom_generate=_assisted(m, other, hybrid=cache, num_speculative_tokens=3))
            assert torch.equal(out, ref)
