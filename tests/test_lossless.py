"""Greedy losslessness: every method, every architecture, batch 1 and a padded batch of 3, both cache kinds."""

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import hf_specdec
from oracles import OracleChain, OracleTree
from tiny import ARCHS, EOS, prompts, tiny_model, word_tokenizer

pytestmark = pytest.mark.device  # pytest --device cuda runs these there (docs/gpu.md)

MAX_NEW = 24

_models = {}


def model(arch, seed=0):
    if (arch, seed) not in _models:
        _models[arch, seed] = tiny_model(arch, seed=seed)
    return _models[arch, seed]


def reference(m, ids, mask, **kw):
    return m.generate(input_ids=ids, attention_mask=mask, do_sample=False, **kw)


def run(m, ids, mask, method, **kw):
    return m.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                      custom_generate=hf_specdec.decoding_method(method) if not isinstance(method, str)
                      else hf_specdec.decoding_method(method), **kw)


def proposers(arch, ref):
    return {
        "prompt_lookup": ("prompt_lookup", {"draft_length_schedule": "constant"}),
        "prompt_lookup_adaptive": ("prompt_lookup", {}),
        "assisted_self": ("assisted", {"drafter": model(arch), "num_speculative_tokens": 3}),
        "assisted_other": ("assisted", {"drafter": model(arch, seed=7), "num_speculative_tokens": 4}),
        # half the vocabulary: the self-drafter's greedy token is sometimes outside it, so drafts are also rejected
        "assisted_draft_vocab": ("assisted", {"drafter": model(arch), "num_speculative_tokens": 3,
                                              "draft_vocab": list(range(0, 96, 2))}),
        "oracle_chain": (OracleChain(ref, k=5), {}),
        "oracle_tree": (OracleTree(ref, depth=4), {}),
    }


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("bsz", [1, 3])
@pytest.mark.parametrize("method", ["prompt_lookup", "prompt_lookup_adaptive", "assisted_self", "assisted_other",
                                    "assisted_draft_vocab", "oracle_chain", "oracle_tree"])
def test_greedy_matches_generate(arch, bsz, method):
    m = model(arch)
    ids, mask = prompts(bsz, length=12, seed=bsz)
    kw = dict(max_new_tokens=MAX_NEW, eos_token_id=None)
    ref = reference(m, ids, mask, **kw)
    name, opts = proposers(arch, ref)[method]
    out = run(m, ids, mask, name, **opts, **kw)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt2"])
@pytest.mark.parametrize("bsz", [1, 3])
@pytest.mark.parametrize("method", ["prompt_lookup", "oracle_chain", "oracle_tree"])
def test_static_cache(arch, bsz, method):
    m = model(arch)
    ids, mask = prompts(bsz, length=12, seed=4)
    kw = dict(max_new_tokens=MAX_NEW, eos_token_id=None)
    ref = reference(m, ids, mask, **kw)
    name, opts = proposers(arch, ref)[method]
    out = run(m, ids, mask, name, cache_implementation="static", **opts, **kw)
    assert torch.equal(out, ref)


def _eos_from(ref, prompt_len, row=0, at=7):
    return int(ref[row, prompt_len + at])


@pytest.mark.parametrize("bsz", [1, 3])
@pytest.mark.parametrize("method", ["oracle_chain", "oracle_tree", "prompt_lookup"])
def test_eos_inside_accepted_block(bsz, method):
    m = model("llama")
    ids, mask = prompts(bsz, length=12, seed=5)
    free = reference(m, ids, mask, max_new_tokens=MAX_NEW, eos_token_id=None)
    eos = _eos_from(free, ids.shape[1])
    kw = dict(max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=0)
    ref = reference(m, ids, mask, **kw)
    assert ref.shape[1] < free.shape[1] or bsz > 1
    name, opts = proposers("llama", free)[method]
    out = run(m, ids, mask, name, **opts, **kw)
    assert torch.equal(out, ref)


def test_eos_list_and_whole_block_accepted():
    m = model("qwen2")
    ids, mask = prompts(1, length=12, seed=6)
    free = reference(m, ids, mask, max_new_tokens=MAX_NEW, eos_token_id=None)
    eos = [int(free[0, ids.shape[1] + 9]), int(free[0, ids.shape[1] + 15])]
    kw = dict(max_new_tokens=MAX_NEW, eos_token_id=eos)
    ref = reference(m, ids, mask, **kw)
    out = run(m, ids, mask, OracleChain(free, k=6, error_rate=0.0), **kw)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("method", ["oracle_chain", "prompt_lookup", "assisted_self"])
def test_max_new_tokens_one(method):
    m = model("llama")
    ids, mask = prompts(3, length=12, seed=7)
    kw = dict(max_new_tokens=1, eos_token_id=None)
    ref = reference(m, ids, mask, **kw)
    free = reference(m, ids, mask, max_new_tokens=MAX_NEW, eos_token_id=None)
    name, opts = proposers("llama", free)[method]
    out = run(m, ids, mask, name, **opts, **kw)
    assert torch.equal(out, ref) and out.shape[1] == ids.shape[1] + 1


@pytest.mark.parametrize("bsz", [1, 3])
@pytest.mark.parametrize("processors", [
    {"repetition_penalty": 1.5},
    {"no_repeat_ngram_size": 2},
    {"min_new_tokens": 10, "eos_token_id": EOS},
    {"repetition_penalty": 1.3, "suppress_tokens": [5, 6, 7]},
])
@pytest.mark.parametrize("method", ["oracle_chain", "oracle_tree", "assisted_other"])
def test_logits_processors(bsz, processors, method):
    m = model("llama")
    ids, mask = prompts(bsz, length=12, seed=8)
    kw = dict(max_new_tokens=MAX_NEW, eos_token_id=None)
    kw.update(processors)
    ref = reference(m, ids, mask, **kw)
    name, opts = proposers("llama", ref)[method]
    out = run(m, ids, mask, name, **opts, **kw)
    assert torch.equal(out, ref)


def test_prefix_allowed_tokens_fn_batch():
    m = model("llama")
    ids, mask = prompts(3, length=12, seed=9)

    def allowed(batch_id, sent):  # each row may only use its own band of tokens
        lo = 3 + 30 * batch_id
        return list(range(lo, lo + 30))

    kw = dict(max_new_tokens=12, eos_token_id=None, prefix_allowed_tokens_fn=allowed)
    ref = reference(m, ids, mask, **kw)
    out = run(m, ids, mask, OracleChain(ref, k=4), **kw)
    assert torch.equal(out, ref)


class _StopAfterSmallToken(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] < 20


@pytest.mark.parametrize("with_eos", [True, False])
@pytest.mark.parametrize("method", ["oracle_chain", "oracle_tree"])
def test_custom_stopping_criteria_batch(with_eos, method):
    """Without an EOS criterion plain generate() keeps generating real tokens for finished rows."""
    m = model("llama")
    ids, mask = prompts(3, length=12, seed=10)
    kw = dict(max_new_tokens=MAX_NEW, stopping_criteria=StoppingCriteriaList([_StopAfterSmallToken()]))
    kw["eos_token_id"] = EOS if with_eos else None
    ref = reference(m, ids, mask, **kw)
    free = reference(m, ids, mask, max_new_tokens=MAX_NEW, eos_token_id=None)
    name, opts = proposers("llama", free)[method]
    out = run(m, ids, mask, name, **opts, **kw)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("bsz", [1, 2])
def test_stop_strings(bsz):
    m = model("llama")
    tok = word_tokenizer()
    ids, mask = prompts(bsz, length=12, seed=11)
    free = reference(m, ids, mask, max_new_tokens=MAX_NEW, eos_token_id=None)
    stop = tok.convert_ids_to_tokens(int(free[0, ids.shape[1] + 6]))
    kw = dict(max_new_tokens=MAX_NEW, stop_strings=[stop], tokenizer=tok, eos_token_id=EOS, pad_token_id=0)
    ref = reference(m, ids, mask, **kw)
    out = m.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                     custom_generate=hf_specdec.custom_generate_path("prompt_lookup"), trust_remote_code=True, **kw)
    assert torch.equal(out, ref)
    assert ref.shape[1] < free.shape[1] or bsz > 1


def test_scores_and_logits_match():
    m = model("llama")
    ids, mask = prompts(1, length=12, seed=12)
    kw = dict(max_new_tokens=12, eos_token_id=None, return_dict_in_generate=True, output_scores=True,
              output_logits=True, repetition_penalty=1.2)
    ref = reference(m, ids, mask, **kw)
    out = run(m, ids, mask, OracleTree(ref.sequences, depth=3), **kw)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores) == 12
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    stats = out.speculative_stats
    assert stats["target_forward_passes"] >= 2 and stats["acceptance_length"] >= 1.0


def test_stats_and_output_type():
    m = model("llama")
    ids, mask = prompts(1, length=12, seed=13)
    ref = reference(m, ids, mask, max_new_tokens=20, eos_token_id=None)
    out = run(m, ids, mask, OracleChain(ref, k=4, error_rate=0.0), max_new_tokens=20, eos_token_id=None,
              return_dict_in_generate=True)
    from transformers.generation import GenerateDecoderOnlyOutput

    assert isinstance(out, GenerateDecoderOnlyOutput)
    s = out.speculative_stats
    assert s["accepted_drafts"] <= s["proposed_drafts"]
    # every verify step commits accepted drafts + 1; the prefill committed the first token
    assert s["committed_tokens"] == 19
    assert s["acceptance_length"] == pytest.approx(19 / (s["target_forward_passes"] - 1))
    assert s["acceptance_length"] > 2.0


def test_long_batch_compaction():
    """Rows that accept very different amounts leave holes in the cache; compaction must keep outputs exact."""
    m = model("llama")
    ids, mask = prompts(3, length=10, seed=14)
    kw = dict(max_new_tokens=120, eos_token_id=None)
    ref = reference(m, ids, mask, **kw)
    prop = OracleChain(ref, k=8, error_rate=0.5)
    out = run(m, ids, mask, prop, return_dict_in_generate=True, **kw)
    assert torch.equal(out.sequences, ref)
    assert out.speculative_stats["compactions"] >= 1
    out = run(m, ids, mask, OracleChain(ref, k=8, error_rate=0.5), cache_implementation="static", **kw)
    assert torch.equal(out, ref)
