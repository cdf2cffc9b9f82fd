"""Method ``auto``: transformers' own speculative arguments, added to a call that already has them, run the matching
method in hf_specdec's loop with the output of transformers' own run (greedy identical), in both entry forms."""

import pytest
import torch
from transformers import GenerationConfig

import hf_specdec
from hf_specdec.proposers.auto import choose
from hf_specdec.registry import get
from tiny import prompts, tiny_model

GEN = dict(max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
AUTO = dict(custom_generate=hf_specdec.custom_generate_path("auto"), trust_remote_code=True)


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", layers=4, hidden=32)


@pytest.fixture(scope="module")
def assistant():
    return tiny_model("llama", seed=1, layers=1, hidden=32)


def _stats(out):
    return out.speculative_stats


def _choice(target, **given):
    record = get("auto")
    opts = record.resolve(given)
    return choose(target, opts)


@pytest.mark.parametrize("form", ["folder", "callable"])
@pytest.mark.parametrize("argument", ["prompt_lookup", "assistant", "early_exit"])
def test_same_output_as_transformers_own_run(target, assistant, form, argument):
    """Each argument, exactly as a transformers user writes it: the same sequences as transformers' own run (and
    plain greedy decoding), with this library's loop doing the work (speculative_stats names the method)."""
    given = {"prompt_lookup": dict(prompt_lookup_num_tokens=5), "assistant": dict(assistant_model=assistant),
             "early_exit": dict(assistant_early_exit=2)}[argument]
    method = {"prompt_lookup": "prompt_lookup", "assistant": "assisted", "early_exit": "layerskip"}[argument]
    ids, _ = prompts(1, 12)
    theirs = target.generate(ids, **given, **GEN)
    assert torch.equal(theirs, target.generate(ids, **GEN))
    how = AUTO if form == "folder" else dict(custom_generate=hf_specdec.decoding_method("auto"))
    ours = target.generate(ids, **given, **how, **GEN, return_dict_in_generate=True)
    assert torch.equal(ours.sequences, theirs)
    assert _stats(ours)["method"] == method


def test_batches_which_transformers_refuses(target, assistant):
    """transformers' assisted decoding runs one row; the loop runs padded batches, each row as plain generate()."""
    ids, mask = prompts(3, 12)
    ref = target.generate(input_ids=ids, attention_mask=mask, **GEN)
    for given in (dict(assistant_model=assistant), dict(prompt_lookup_num_tokens=4), dict(assistant_early_exit=1)):
        out = target.generate(input_ids=ids, attention_mask=mask, **given, **AUTO, **GEN)
        assert torch.equal(out, ref), given


def test_generation_config_settings_are_read(target):
    """Settings in a GenerationConfig or on the model's own config reach auto as they reach transformers."""
    ids, _ = prompts(1, 12)
    ref = target.generate(ids, **GEN)
    config = GenerationConfig(prompt_lookup_num_tokens=3, **GEN)
    out = target.generate(ids, generation_config=config, **AUTO, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref) and _stats(out)["method"] == "prompt_lookup"
    out = target.generate(ids, generation_config=config, custom_generate=hf_specdec.decoding_method("auto"),
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref) and _stats(out)["method"] == "prompt_lookup"


def test_assistant_length_settings(target, assistant):
    """num_assistant_tokens / _schedule / assistant_confidence_threshold, read from the assistant's generation config
    as transformers reads them (a value given to the call first)."""
    assert _choice(target, drafter=assistant)[1] == {"drafter": assistant}  # nothing set: the adaptive length
    assistant.generation_config.num_assistant_tokens = 3
    try:
        _, opts = _choice(target, drafter=assistant)
        assert opts["num_speculative_tokens"] == 3 and opts["draft_length_schedule"] == "constant"
        assistant.generation_config.num_assistant_tokens_schedule = "heuristic"
        assert "num_speculative_tokens" not in _choice(target, drafter=assistant)[1]
        _, opts = _choice(target, drafter=assistant, num_assistant_tokens=5, num_assistant_tokens_schedule="constant",
                          assistant_confidence_threshold=0.3)
        assert (opts["num_speculative_tokens"], opts["confidence"]) == (5, 0.3)
        ids, mask = prompts(2, 12)
        ref = target.generate(input_ids=ids, attention_mask=mask, **GEN)
        out = target.generate(input_ids=ids, attention_mask=mask, assistant_model=assistant, **AUTO, **GEN,
                              num_assistant_tokens=4, num_assistant_tokens_schedule="constant",
                              assistant_confidence_threshold=0.5, return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref)
    finally:
        assistant.generation_config.num_assistant_tokens = None
        assistant.generation_config.num_assistant_tokens_schedule = None


def test_confidence_threshold_ends_chains(target, assistant):
    """A confidence of 1 ends every chain after its first draft; the output does not change."""
    ids, mask = prompts(2, 12)
    ref = target.generate(input_ids=ids, attention_mask=mask, **GEN)
    out = target.generate(input_ids=ids, attention_mask=mask, assistant_model=assistant, **GEN,
                          custom_generate=hf_specdec.decoding_method("assisted", num_speculative_tokens=4,
                                                                     confidence=1.0, hybrid=False),
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    stats = _stats(out)
    assert 0 < stats["proposed_drafts"] <= stats["verify_row_steps"]  # at most one draft per row per step


def test_precedence_as_transformers(target, assistant):
    """generate()'s order: early exit, then prompt lookup, then MTP, then the assistant's kind."""
    assert _choice(target, assistant_early_exit=2, prompt_lookup_num_tokens=3, drafter=assistant)[0] == "layerskip"
    assert _choice(target, prompt_lookup_num_tokens=3, drafter=assistant)[0] == "prompt_lookup"
    assert _choice(target, drafter=assistant, speculation_type="dflash")[0] == "dflash"
    assert _choice(target, drafter=assistant, tokenizer=object(), assistant_tokenizer=object())[0] == "universal"
    assert _choice(target, drafter=assistant)[0] == "assisted"
    opts = _choice(target, prompt_lookup_num_tokens=3)[1]
    assert opts["max_matching_ngram_size"] == 2  # transformers' default, not prompt_lookup's own


@pytest.mark.parametrize("given,match", [
    ({}, "has none: pass assistant_model"),
    ({"assistant_ensemble_weight": 0.5, "prompt_lookup_num_tokens": 3}, "lossy"),
    ({"tokenizer": "t"}, "needs both tokenizer"),
    ({"speculation_type": "eagle"}, "speculation_type must be 'dflash'"),
])
def test_refused(target, assistant, given, match):
    ids, _ = prompts(1, 12)
    if "tokenizer" in given:
        given = {**given, "assistant_model": assistant}
    with pytest.raises(ValueError, match=match):
        target.generate(ids, **given, **AUTO, **GEN)


def test_transformers_arguments_name_auto_for_other_methods(target):
    """Another method refuses transformers' own speculative arguments, naming the method that takes them."""
    ids, _ = prompts(1, 12)
    with pytest.raises(ValueError, match="use_mtp is an option of auto"):
        target.generate(ids, use_mtp=True, custom_generate=hf_specdec.custom_generate_path("prompt_lookup"),
                        trust_remote_code=True, **GEN)


def test_use_mtp_reads_the_targets_own_checkpoint(hub, monkeypatch):
    """use_mtp=True: the MTP layers of the checkpoint the target was loaded from (a tiny DeepSeek-V3 in transformers'
    own layout, in a local Hub cache), the same output as transformers' generate(use_mtp=True)."""
    from hf_specdec.hub_cache import write_cached_repo
    from mtp_fixtures import checkpoint

    fx = checkpoint("deepseek_v3")
    repo = "tiny/deepseek-v3-mtp"
    write_cached_repo(hub, repo, fx.files)
    cls = type(fx.target)
    monkeypatch.setattr(cls, "_keys_to_ignore_on_load_unexpected", [rf"model\.layers\.{fx.num_target_layers}.*"])
    target = cls.from_pretrained(repo).eval()
    ids = torch.randint(3, target.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    theirs = target.generate(ids, use_mtp=True, **kw)
    ours = target.generate(ids, use_mtp=True, **AUTO, **kw, return_dict_in_generate=True)
    assert torch.equal(ours.sequences, theirs)
    assert _stats(ours)["method"] == "mtp"
