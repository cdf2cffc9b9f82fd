"""A conversation continued from its cache: ``out = generate(..., return_dict_in_generate=True)``, the next turn's
input the whole conversation (``torch.cat([out.sequences, new_ids], 1)``) and ``generate(..., past_key_values=
out.past_key_values)`` (or ``cache=``). For every method, at batch 1 and a left-padded batch of 3, three turns give
what plain ``generate()`` gives continuing from its own cache, token for token; the cache a call returns prefills
only the new tokens of the next (``speculative_stats["cached_tokens"]``) and carries what the method's drafter needs
(its target features, its own KV cache); a cache from plain ``generate()`` works for every method (a feature drafter
prefills the conversation again, a drafter-free method continues); rows that stopped early, the same cache object
passed every turn, static caches, a sliding-window model, ``compile=True``, coupled sampling; bad caches are refused.
"""

import copy

import pytest
import torch
from transformers import DynamicCache, StaticCache

import hf_specdec
from hf_specdec import cache as cache_ops
from hf_specdec.proposers.base import Carried
from test_syncs import METHODS, _target, method
from tiny import one_thread, prompts, tiny_model

NEW = 10  # tokens per turn
GREEDY = dict(max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
# what the returned cache carries for the next call: the drafter's KV cache; the target features too
CARRIES = {"assisted": "drafter", "hybrid": "drafter", "eagle3": "features", "eagle3_chain": "features",
           "dflash": "features", "dflash_tree": "features", "mtp": "features"}
FEATURES = {name for name, what in CARRIES.items() if what == "features"}  # need them: a plain cache is prefilled again


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def target():
    return _target()


def _turns(bsz: int, width: int = 16, count: int = 2, seed: int = 5):
    """The first turn's prompt and mask (left padding), and each later turn's new tokens ``[B, 4]``."""
    ids, mask = prompts(bsz, length=width, seed=seed)
    ids[:, -6:] = ids[:, -12:-6]  # something to copy for the lookup methods
    g = torch.Generator().manual_seed(seed)
    return ids, mask, [torch.randint(3, 90, (bsz, 4), generator=g) for _ in range(count)]


def _next(out, mask, new):
    """The next turn's input: the previous output and the new tokens; the mask marks every generated token, as
    ``generate()`` marks them while it generates."""
    ids = torch.cat([out.sequences, new], dim=1)
    return ids, torch.cat([mask, mask.new_ones(mask.shape[0], ids.shape[1] - mask.shape[1])], dim=1)


def conversation(model, ids, mask, news, custom=None, cache_name="cache", first=None, **kw):
    """Every turn's output of a conversation continued from the cache each turn returns (``first``: the first
    turn's output, made elsewhere)."""
    kw = {**GREEDY, "return_dict_in_generate": True, **kw}
    if custom is not None:
        kw["custom_generate"] = custom
    outs = [first if first is not None else model.generate(input_ids=ids, attention_mask=mask, **kw)]
    kw.pop("cache", None)  # a cache given to the first turn: the turns after it get the one returned
    for new in news:
        ids, mask = _next(outs[-1], mask, new)
        outs.append(model.generate(input_ids=ids, attention_mask=mask, **{cache_name: outs[-1].past_key_values},
                                   **kw))
    return outs


def plain_first_turn(model, bsz):
    """Plain ``generate()``'s first turn, with a cache of its own (the cache of :func:`reference`'s first turn went
    on to hold the whole conversation: it is filled in place)."""
    ids, mask, _ = _turns(bsz)
    return conversation(model, ids, mask, [])[0]


def _same(outs, refs):
    assert [o.sequences.tolist() for o in outs] == [r.sequences.tolist() for r in refs]


_references = {}  # (id of the model, batch size) -> (the model, kept alive so that its id is not reused; outputs)


def reference(model, bsz):
    """Plain ``generate()``'s conversation of :func:`_turns`, continued from its own cache."""
    key = (id(model), bsz)
    if key not in _references:
        ids, mask, news = _turns(bsz)
        _references[key] = (model, conversation(model, ids, mask, news))
    return _references[key][1]


# ------------------------------------------------------------------------------------ every method, its own cache
@pytest.mark.parametrize("bsz", [1, 3])
@pytest.mark.parametrize("name", METHODS)
def test_every_method_continues_from_its_own_cache(target, name, bsz):
    """Three turns, ``past_key_values=out.past_key_values`` as transformers documents it: the outputs of plain
    ``generate()`` continuing from its own cache; each later turn prefills only its new tokens, and the returned
    cache carries the drafter's state."""
    ids, mask, news = _turns(bsz)
    custom = method(name, target)
    outs = conversation(target, ids, mask, news, custom, cache_name="past_key_values")
    _same(outs, reference(target, bsz))
    for before, out in zip(outs, outs[1:]):
        assert out.speculative_stats["cached_tokens"] == before.sequences.shape[1] - 1
    assert outs[0].cache is outs[2].cache  # one cache object, filled in place as generate() fills it
    record = getattr(outs[2].cache, cache_ops.RECORD)
    assert record.length == outs[2].cache.get_seq_length() == outs[2].sequences.shape[1] - 1
    carried = record.carried
    if name in CARRIES:
        assert isinstance(carried, Carried) and carried.synced > 0
    if name in FEATURES:
        assert carried.features.shape[:2] == (bsz, record.length)


@pytest.mark.parametrize("name", METHODS)
def test_a_cache_from_plain_generate(target, name):
    """A plain ``generate()`` turn, then the method's: the method continues from the plain cache (a feature drafter
    prefills the conversation again: the plain cache has no target features)."""
    refs = reference(target, 3)
    ids, mask, news = _turns(3)
    outs = conversation(target, ids, mask, news[:1], method(name, target), first=plain_first_turn(target, 3))
    _same(outs, refs[:2])
    expected = 0 if name in FEATURES else refs[0].sequences.shape[1] - 1
    assert outs[1].speculative_stats["cached_tokens"] == expected


def test_a_cache_handed_to_plain_generate(target):
    """The cache a method returns is a transformers cache: plain ``generate()`` continues from it (rows that stopped
    early included), as from its own."""
    ids, mask, news = _turns(3)
    eos = int(reference(target, 3)[0].sequences[0, ids.shape[1] + 3])  # row 0 stops early
    refs = conversation(target, ids, mask, news, eos_token_id=eos)
    first = conversation(target, ids, mask, [], method("eagle3", target), eos_token_id=eos)[0]
    _same(conversation(target, ids, mask, news, first=first, eos_token_id=eos), refs)


@pytest.mark.parametrize("name", ["prompt_lookup", "eagle3", "assisted"])
def test_rows_that_stopped_early(target, name):
    """A row that stopped at its EOS has padding after it: the returned cache holds every row's first
    ``min(lengths) - 1`` tokens (column ``j`` token ``j``), and the next turn prefills the rest."""
    ids, mask, news = _turns(3)
    eos = int(reference(target, 3)[0].sequences[0, ids.shape[1] + 3])
    refs = conversation(target, ids, mask, news, eos_token_id=eos)
    custom = method(name, target)
    first = conversation(target, ids, mask, [], custom, eos_token_id=eos)[0]
    length = getattr(first.cache, cache_ops.RECORD).length
    assert length == first.cache.get_seq_length() < first.sequences.shape[1] - 1  # row 0 stopped: fewer than plain's
    outs = conversation(target, ids, mask, news, custom, first=first, eos_token_id=eos)
    _same(outs, refs)
    assert outs[1].speculative_stats["cached_tokens"] == length


@pytest.mark.parametrize("name", ["prompt_lookup", "eagle3"])
def test_a_prefix_cache_made_by_a_forward(target, name):
    """transformers' prefix caching: a cache filled by a forward over a shared prefix, deep-copied for each request
    that starts with it (a feature drafter prefills the request again: nothing gave the prefix's target features)."""
    ids, mask, _ = _turns(1)
    prefix = DynamicCache()
    with torch.no_grad():
        target(input_ids=ids[:, :9], cache=prefix)
    ref = target.generate(input_ids=ids, attention_mask=mask, cache=copy.deepcopy(prefix), **GREEDY)
    out = target.generate(input_ids=ids, attention_mask=mask, cache=copy.deepcopy(prefix), **GREEDY,
                          custom_generate=method(name, target), return_dict_in_generate=True)
    assert out.sequences.tolist() == ref.tolist()
    assert out.speculative_stats["cached_tokens"] == (0 if name in FEATURES else 9)


def test_the_same_cache_object_every_turn(target):
    """transformers' chat loop: one ``DynamicCache()`` passed to every call (filled in place), no
    ``return_dict_in_generate``; turns of a method and of plain ``generate()`` mixed. Each turn's output and the
    cache's length are plain ``generate()``'s."""
    ids, mask, news = _turns(1, count=3)
    customs = [method("eagle3", target), None, method("prompt_lookup", target), method("eagle3", target)]

    def chat(use):
        cache, outputs, lengths = DynamicCache(), [], []
        turn_ids, turn_mask = ids, mask
        for i, custom in enumerate(use):
            kw = {**GREEDY, "cache": cache} | ({"custom_generate": custom} if custom is not None else {})
            out = target.generate(input_ids=turn_ids, attention_mask=turn_mask, **kw)
            outputs.append(out.tolist())
            lengths.append(cache.get_seq_length())
            if i < len(news):
                turn_ids = torch.cat([out, news[i]], dim=1)
                turn_mask = torch.ones_like(turn_ids)
        return outputs, lengths

    assert chat(customs) == chat([None] * len(customs))


@pytest.mark.parametrize("name", ["prompt_lookup", "eagle3"])
def test_static_cache(target, name):
    """A ``StaticCache`` passed to every turn (sized for the conversation)."""
    ids, mask, news = _turns(3)
    caches = [StaticCache(config=target.config, max_cache_len=96) for _ in range(2)]
    refs = conversation(target, ids, mask, news, cache=caches[0])
    outs = conversation(target, ids, mask, news, method(name, target), cache=caches[1])
    _same(outs, refs)
    assert outs[2].speculative_stats["cached_tokens"] == outs[1].sequences.shape[1] - 1
    assert isinstance(outs[2].cache, StaticCache)


def test_sliding_window_model():
    """Gemma 3 (a window of 6): a method's own cache keeps every column, so the next turn continues from it; plain
    ``generate()``'s sliding layers keep their window only, so from its cache the conversation is prefilled again."""
    model = tiny_model("gemma3")
    refs = reference(model, 3)
    ids, mask, news = _turns(3)
    custom = hf_specdec.decoding_method("assisted", drafter=tiny_model("gemma3", seed=3), num_speculative_tokens=3)
    outs = conversation(model, ids, mask, news, custom)
    _same(outs, refs)
    assert outs[2].speculative_stats["cached_tokens"] == outs[1].sequences.shape[1] - 1
    from_plain = conversation(model, ids, mask, news[:1], custom, first=plain_first_turn(model, 3))
    _same(from_plain, refs[:2])
    assert from_plain[1].speculative_stats["cached_tokens"] == 0


def test_layerskip_exit_adapter_carries_its_cache():
    from hf_specdec.modeling.layerskip import ExitAdapter, ExitAdapterConfig

    model = tiny_model("llama", layers=2)
    torch.manual_seed(0)
    adapter = ExitAdapter(ExitAdapterConfig(exit_layer=1, hidden_size=32, num_attention_heads=4,
                                            num_key_value_heads=2, head_dim=8, intermediate_size=16, vocab_size=96,
                                            num_target_layers=2)).init_from_target(model, torch.arange(96))
    custom = hf_specdec.decoding_method("layerskip", drafter=adapter, num_speculative_tokens=3)
    ids, mask, news = _turns(3)
    outs = conversation(model, ids, mask, news, custom)
    _same(outs, reference(model, 3))
    assert outs[2].speculative_stats["cached_tokens"] == outs[1].sequences.shape[1] - 1
    assert getattr(outs[2].cache, cache_ops.RECORD).carried.drafter() is adapter
    from_plain = conversation(model, ids, mask, news[:1], custom, first=plain_first_turn(model, 3))
    _same(from_plain, reference(model, 3)[:2])
    assert from_plain[1].speculative_stats["cached_tokens"] == 0  # the adapter's cache of the conversation: rebuilt


@pytest.mark.parametrize("bsz", [1, 3])
def test_gemma4_assistant(bsz):
    import test_gemma4_assistant as g4

    model = g4._gemma4_target()
    custom = hf_specdec.decoding_method("gemma4_assistant", num_speculative_tokens=3)
    ids, mask, news = _turns(bsz)
    outs = conversation(model, ids, mask, news, custom, assistant_model=g4._assistant(model))
    _same(outs, reference(model, bsz))
    assert outs[2].speculative_stats["cached_tokens"] == outs[1].sequences.shape[1] - 1


@pytest.mark.parametrize("bsz", [1, 3])
def test_universal(bsz):
    import test_universal as un

    tok, dtok = un._bpe("bytelevel", 300), un._bpe("metaspace", 120)
    model = tiny_model("llama", seed=0, vocab=len(tok), hidden=32)
    custom = un._universal(tok, dtok, num_speculative_tokens=3)
    ids, mask, news = _turns(bsz)
    outs = conversation(model, ids, mask, news, custom, assistant_model=tiny_model("qwen2", seed=5, vocab=len(dtok)))
    _same(outs, reference(model, bsz))
    assert outs[2].speculative_stats["cached_tokens"] == outs[1].sequences.shape[1] - 1


def test_auto_and_the_folder_form(target):
    """``auto`` (transformers' own ``prompt_lookup_num_tokens=``) and the ``custom_generate`` folder."""
    ids, mask, news = _turns(3)
    auto = conversation(target, ids, mask, news, hf_specdec.decoding_method("auto"), prompt_lookup_num_tokens=3)
    folder = conversation(target, ids, mask, news, hf_specdec.custom_generate_path("eagle3"), trust_remote_code=True,
                          drafter=method("eagle3", target).defaults["drafter"])
    for outs in (auto, folder):
        _same(outs, reference(target, 3))
        assert outs[2].speculative_stats["cached_tokens"] == outs[1].sequences.shape[1] - 1


def test_compiled_runner(target, monkeypatch):
    from hf_specdec.compiled import CompiledRunner

    monkeypatch.setattr(CompiledRunner, "backend", "eager")
    ids, mask, news = _turns(3)
    outs = conversation(target, ids, mask, news, hf_specdec.decoding_method("prompt_lookup", compile=True))
    _same(outs, reference(target, 3))
    assert outs[2].speculative_stats["cached_tokens"] == outs[1].sequences.shape[1] - 1


def test_coupled_sampling_continues_as_plain(target):
    """Sampled (coupled, the default), a continued conversation of a method is the ``plain`` method's for the same
    seeds."""
    ids, mask, news = _turns(3)
    kw = dict(do_sample=True, temperature=0.8, top_p=0.9, seed=11)
    refs = conversation(target, ids, mask, news, hf_specdec.decoding_method("plain"), **kw)
    outs = conversation(target, ids, mask, news, method("eagle3", target), **kw)
    _same(outs, refs)
    assert outs[2].speculative_stats["cached_tokens"] == outs[1].sequences.shape[1] - 1


# ------------------------------------------------------------------------------------------------------ bad caches
def test_a_cache_as_long_as_the_input_is_refused(target):
    ids, mask, _ = _turns(1)
    out = conversation(target, ids, mask, [], method("prompt_lookup", target))[0]
    with pytest.raises(ValueError, match="The cache holds 25 tokens but input_ids has 16: pass the whole "
                                         "conversation as input_ids"):
        target.generate(input_ids=ids, attention_mask=mask, cache=out.cache, **GREEDY,
                        custom_generate=hf_specdec.decoding_method("prompt_lookup"))


def test_a_cache_of_another_batch_is_refused(target):
    ids, mask, news = _turns(3)
    out = conversation(target, ids[:1], mask[:1], [], method("prompt_lookup", target))[0]
    ids, mask = _next(out, mask[:1], news[0][:1])
    with pytest.raises(ValueError, match="The cache holds 1 rows but input_ids has 3"):
        target.generate(input_ids=ids.expand(3, -1), attention_mask=mask.expand(3, -1), cache=out.cache, **GREEDY,
                        custom_generate=hf_specdec.decoding_method("prompt_lookup"))


def test_only_the_new_tokens_is_refused(target):
    """transformers also takes only the new tokens with the whole conversation's mask: the loop needs the whole
    conversation (its drafters read it) and says so."""
    ids, mask, news = _turns(3)
    out = conversation(target, ids, mask, [], method("prompt_lookup", target))[0]
    full_ids, full_mask = _next(out, mask, news[0])
    with pytest.raises(ValueError, match="attention_mask covers 30 tokens but input_ids has 4.*whole conversation"):
        target.generate(input_ids=news[0], attention_mask=full_mask, cache=out.cache, **GREEDY,
                        custom_generate=hf_specdec.decoding_method("prompt_lookup"))


def test_a_mask_with_holes_names_the_fix(target):
    """The padding after a row's end-of-sequence token masked out in the next turn: refused as right padding, with
    how to mark it."""
    ids, mask, news = _turns(3)
    eos = int(reference(target, 3)[0].sequences[0, ids.shape[1] + 3])
    out = conversation(target, ids, mask, [], method("prompt_lookup", target), eos_token_id=eos)[0]
    ids, mask = _next(out, mask, news[0])
    mask[:, :out.sequences.shape[1]] &= (out.sequences != 0).long()
    with pytest.raises(ValueError, match="mark every generated token 1"):
        target.generate(input_ids=ids, attention_mask=mask, cache=out.cache, **GREEDY,
                        custom_generate=hf_specdec.decoding_method("prompt_lookup"))
