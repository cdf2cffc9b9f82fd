"""Bad input gets a clear error that names the fix, never silently wrong output."""

import pytest
import torch
from transformers import DynamicCache

import hf_specdec
from hf_specdec.entry import generate_with_method
from tiny import prompts, tiny_model

GEN = dict(max_new_tokens=8, do_sample=False, eos_token_id=None)


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama")


def _pl(target, ids, **kw):
    return target.generate(ids, custom_generate=hf_specdec.custom_generate_path("prompt_lookup"),
                           trust_remote_code=True, **{**GEN, **kw})


def test_unknown_method(target):
    with pytest.raises(ValueError, match="Unknown speculative decoding method 'medusa2'.*Available"):
        hf_specdec.decoding_method("medusa2")
    with pytest.raises(ValueError, match="Available: assisted, dflash, eagle3, prompt_lookup"):
        generate_with_method("nope", target, prompts(1)[0], **GEN)
    with pytest.raises(ValueError, match="Unknown"):
        hf_specdec.custom_generate_path("nope")


def test_unknown_method_option():
    # a misspelt option must not silently run the method's defaults (the tree options are tree_top_k, ...)
    with pytest.raises(ValueError, match="unknown method option.*top_k.*tree_top_k"):
        hf_specdec.decoding_method("eagle3", top_k=2, depth=4)


def test_missing_drafter(target):
    with pytest.raises(ValueError, match="assistant_model=.*drafter="):
        target.generate(prompts(1)[0], custom_generate=hf_specdec.custom_generate_path("assisted"),
                        trust_remote_code=True, **GEN)


def test_drafter_with_another_vocabulary(target):
    other = tiny_model("llama", seed=1, vocab=128)
    with pytest.raises(ValueError, match="vocabulary of 128 tokens but the target has 96"):
        target.generate(prompts(1)[0], custom_generate=hf_specdec.custom_generate_path("assisted"),
                        trust_remote_code=True, assistant_model=other, **GEN)
    with pytest.raises(ValueError, match="another tokenizer"):
        target.generate(prompts(1)[0], custom_generate=hf_specdec.decoding_method("assisted"), drafter=other, **GEN)


def test_drafter_given_to_prompt_lookup(target):
    with pytest.raises(ValueError, match="takes no drafter"):
        _pl(target, prompts(1)[0], assistant_model=target)


def test_both_assistant_and_drafter(target):
    with pytest.raises(ValueError, match="once"):
        target.generate(prompts(1)[0], custom_generate=hf_specdec.custom_generate_path("assisted"),
                        trust_remote_code=True, assistant_model=target, drafter=target, **GEN)


@pytest.mark.parametrize("kw,match", [
    ({"num_beams": 2}, "beam search"),
    ({"num_beams": 2, "do_sample": True}, "beam search"),
    ({"num_return_sequences": 2, "do_sample": True}, "num_return_sequences"),
    ({"output_hidden_states": True, "return_dict_in_generate": True}, "output_hidden_states"),
    ({"assistant_early_exit": 1}, "assistant_early_exit"),
    ({"stop_strings": ["ab"]}, "tokenizer"),
    ({"max_new_tokens": 0}, "max_new_tokens must be at least 1"),
    ({"draft_length_schedule": "fast"}, "draft_length_schedule"),
    ({"prompt_lookup_num_tokens": 0}, "prompt_lookup_num_tokens must be >= 1"),
])
def test_refused_options(target, kw, match):
    with pytest.raises(ValueError, match=match):
        _pl(target, prompts(1)[0], **kw)


def test_empty_prompt(target):
    with pytest.raises(ValueError, match="prompt is empty"):
        _pl(target, torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="prompt is empty"):
        target.generate(torch.zeros(1, 0, dtype=torch.long), custom_generate=hf_specdec.decoding_method("prompt_lookup"),
                        **GEN)


def test_prompt_past_context_window(target):
    long = torch.randint(3, 96, (1, 600))  # max_position_embeddings is 512
    with pytest.raises(ValueError, match="past the model's context window of 512"):
        _pl(target, long)
    ok = torch.randint(3, 96, (1, 500))
    with pytest.raises(ValueError, match="Lower max_new_tokens to at most 12"):
        _pl(target, ok, max_new_tokens=40)


def test_right_padding(target):
    ids, mask = prompts(2, 12)
    right_ids = torch.stack([torch.roll(r, -int((m == 0).sum())) for r, m in zip(ids, mask)])
    right_mask = torch.stack([torch.roll(m, -int((m == 0).sum())) for m in mask])
    with pytest.raises(ValueError, match="padding_side = 'left'"):
        target.generate(input_ids=right_ids, attention_mask=right_mask, **GEN,
                        custom_generate=hf_specdec.decoding_method("prompt_lookup"))


def test_row_all_padding(target):
    ids, mask = prompts(2, 12)
    mask[1] = 0
    with pytest.raises(ValueError, match="all padding"):
        target.generate(input_ids=ids, attention_mask=mask, **GEN,
                        custom_generate=hf_specdec.decoding_method("prompt_lookup"))


def test_prefilled_cache(target):
    ids, _ = prompts(1, 12)
    cache = DynamicCache()
    target(ids[:, :5], cache=cache)
    with pytest.raises(ValueError, match="pre-filled"):
        target.generate(ids, **GEN, cache=cache, custom_generate=hf_specdec.decoding_method("prompt_lookup"))


def test_unrollable_cache(target):
    from transformers.cache_utils import QuantizedCache

    try:
        cache = QuantizedCache(backend="hqq", config=target.config)
    except Exception:  # quantization backend not installed: any non-croppable cache will do
        cache = DynamicCache()
        cache.layers = [object()]
        cache.get_seq_length = lambda *a, **k: 0
    with pytest.raises(ValueError, match="cut back"):
        target.generate(prompts(1)[0], **GEN, cache=cache, custom_generate=hf_specdec.decoding_method("prompt_lookup"))


def test_encoder_decoder_refused():
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2, decoder_start_token_id=0)
    model = T5ForConditionalGeneration(cfg).eval()
    with pytest.raises(ValueError, match="decoder-only"):
        model.generate(torch.randint(1, 60, (1, 6)), custom_generate=hf_specdec.decoding_method("prompt_lookup"),
                       **GEN)
