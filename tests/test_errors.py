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
    with pytest.raises(ValueError, match="Available: assisted, auto, dflash, eagle3, gemma4_assistant, layerskip, "
                                           "lookahead, medusa, mtp, plain, prompt_lookup, suffix, universal"):
        generate_with_method("nope", target, prompts(1)[0], **GEN)
    with pytest.raises(ValueError, match="Unknown"):
        hf_specdec.custom_generate_path("nope")


def test_unknown_method_option():
    # a misspelt option must not silently run the method's defaults (the tree options are tree_top_k, ...)
    with pytest.raises(ValueError, match="unknown method option.*top_k.*tree_top_k"):
        hf_specdec.decoding_method("eagle3", top_k=2, depth=4)


MISSPELT = "Got unknown method option.*tree_depthh for 'eagle3'.*tree_depthh: did you mean tree_depth\\?.*the options of 'eagle3' are"


def test_misspelt_option_in_every_entry_form(target):
    """transformers would answer a misspelt option with its generic "model_kwargs are not used" (before a callable
    even runs): every entry form gives the method's own message, naming the nearest option."""
    from transformers import pipeline

    from hf_specdec.cli import main
    from tiny import word_tokenizer

    ids, bad = prompts(1)[0], dict(tree_depthh=3)
    forms = {
        "callable, generate()": lambda: target.generate(ids, custom_generate=hf_specdec.decoding_method("eagle3"), **bad,
                                                        **GEN),
        "callable, decoding_method()": lambda: hf_specdec.decoding_method("eagle3", **bad),
        "folder": lambda: target.generate(ids, custom_generate=hf_specdec.custom_generate_path("eagle3"),
                                          trust_remote_code=True, **bad, **GEN),
    }
    pipe = pipeline("text-generation", model=target, tokenizer=word_tokenizer())
    forms["pipeline, callable"] = lambda: pipe("abcabc", custom_generate=hf_specdec.decoding_method("eagle3"), **bad,
                                               max_new_tokens=4)
    forms["pipeline, folder"] = lambda: pipe("abcabc", custom_generate=hf_specdec.custom_generate_path("eagle3"),
                                             trust_remote_code=True, **bad, max_new_tokens=4)
    for form, call in forms.items():
        with pytest.raises(ValueError, match=MISSPELT):
            call()
    with pytest.raises(SystemExit, match="--option: " + MISSPELT):
        main(["generate", "hi", "--method", "eagle3", "-o", "tree_depthh=3"])
    # a generation setting misspelt: the nearest setting; an argument transformers takes still reaches the model
    with pytest.raises(ValueError, match="max_new_tokns: did you mean max_new_tokens \\(a generation setting\\)"):
        target.generate(ids, custom_generate=hf_specdec.decoding_method("prompt_lookup"), max_new_tokns=3, **GEN)


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


def test_prefilled_cache_as_long_as_the_prompt(target):
    """A filled cache continues a conversation (tests/test_continuation.py) when the prompt goes on after it."""
    ids, _ = prompts(1, 12)
    cache = DynamicCache()
    target(ids, cache=cache)
    with pytest.raises(ValueError, match="The cache holds 12 tokens but input_ids has 12: pass the whole conversation"):
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


# ---- drafters given by path: the cause and the fix in the message
def _eagle3_folder(folder, target):
    from hf_specdec.modeling.eagle3 import Eagle3Config, Eagle3Drafter

    cfg = target.config
    Eagle3Drafter(Eagle3Config(hidden_size=cfg.hidden_size, intermediate_size=64, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=cfg.vocab_size, draft_vocab_size=40,
                               num_target_layers=cfg.num_hidden_layers)).save_pretrained(folder)
    return folder


def _eagle3(target, drafter):
    return target.generate(prompts(1)[0], custom_generate=hf_specdec.decoding_method("eagle3"), drafter=drafter,
                           **GEN)


@pytest.mark.parametrize("path", ["/no/such/folder/drafter", "./missing-drafter", "a/b/c"])
def test_missing_drafter_path(target, tmp_path, monkeypatch, path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=f"{path} does not exist"):
        _eagle3(target, path)


def test_drafter_path_that_is_neither_folder_nor_cached_repo(target, hub):
    with pytest.raises(ValueError, match="'someone/drafter' is not a local folder.*could not be fetched"):
        _eagle3(target, "someone/drafter")


def test_truncated_drafter_weights(target, tmp_path):
    folder = _eagle3_folder(tmp_path / "d", target)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])
    with pytest.raises(ValueError, match=r"d/model\.safetensors is incomplete or corrupt.*download it again"):
        _eagle3(target, folder)


def test_config_disagreeing_with_weights_names_the_field(target, tmp_path):
    import json

    folder = _eagle3_folder(tmp_path / "d", target)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["intermediate_size"] = 48
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="config.json says intermediate_size=48, but the weights were made with "
                                         "intermediate_size=64.*not pass ignore_mismatched_sizes"):
        _eagle3(target, folder)
    # a plain causal LM as draft model
    tiny_model("llama").save_pretrained(tmp_path / "lm")
    cfg = json.loads((tmp_path / "lm" / "config.json").read_text())
    cfg["hidden_size"] = 64
    (tmp_path / "lm" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="config.json says hidden_size=64, but the weights were made with "
                                         "hidden_size=32"):
        target.generate(prompts(1)[0], custom_generate=hf_specdec.decoding_method("assisted"),
                        drafter=str(tmp_path / "lm"), **GEN)


def test_drafter_with_the_vocabulary_size_of_another_tokenizer(target):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=96)).eval()  # bos/eos 50256
    with pytest.raises(ValueError, match=r"special token id\(s\) \[50256\], outside the target's vocabulary"):
        target.generate(prompts(1)[0], custom_generate=hf_specdec.decoding_method("assisted"), drafter=gpt2, **GEN)
    other = tiny_model("llama", seed=3, bos_token_id=5, eos_token_id=6)
    with pytest.raises(ValueError, match=r"other special token ids than the target: bos \[5\] \(target: \[2\]\)"):
        target.generate(prompts(1)[0], custom_generate=hf_specdec.custom_generate_path("assisted"),
                        trust_remote_code=True, assistant_model=other, **GEN)


def test_drafter_saved_with_another_tokenizer(target, tmp_path):
    from tiny import word_tokenizer

    draft = tiny_model("llama", seed=3)
    draft.save_pretrained(tmp_path / "draft")
    word_tokenizer().save_pretrained(tmp_path / "draft")
    target.save_pretrained(tmp_path / "target")
    tok = word_tokenizer()
    tok.add_tokens(["zzz"])  # one more entry: another token -> id map
    tok.save_pretrained(tmp_path / "target")
    from transformers import AutoModelForCausalLM

    from hf_specdec._transformers import from_pretrained_options  # transformers 5.25 without `kernels`

    moved = AutoModelForCausalLM.from_pretrained(tmp_path / "target", **from_pretrained_options({}))
    with pytest.raises(ValueError, match="saved with another tokenizer than the target's"):
        moved.generate(prompts(1)[0], custom_generate=hf_specdec.decoding_method("assisted"),
                       drafter=str(tmp_path / "draft"), **GEN)


def test_drafter_that_carries_no_tokenizer_information_warns(target, caplog):
    anonymous = tiny_model("llama", seed=4, bos_token_id=None, eos_token_id=None)
    anonymous.generation_config.bos_token_id = anonymous.generation_config.eos_token_id = None
    with caplog.at_level("WARNING", logger="hf_specdec"):
        target.generate(prompts(1)[0], custom_generate=hf_specdec.decoding_method("assisted"), drafter=anonymous,
                        **GEN)
    assert "cannot confirm" in caplog.text


def test_assistant_model_given_to_generate_reaches_the_callable_form(target):
    """transformers keeps assistant_model= from a custom_generate callable: it is recovered from generate(), so the
    draft model is used (not answered with "pass assistant_model=", which the user just did)."""
    draft = tiny_model("llama", seed=3)
    ids = prompts(1)[0]
    ref = target.generate(ids, **GEN)
    out = target.generate(ids, custom_generate=hf_specdec.decoding_method("assisted"), assistant_model=draft,
                          draft_length_schedule="constant", return_dict_in_generate=True, **GEN)
    assert torch.equal(out.sequences, ref) and out.speculative_stats["proposed_drafts"] > 0
    with pytest.raises(ValueError, match="once"):
        target.generate(ids, custom_generate=hf_specdec.decoding_method("assisted", drafter=draft),
                        assistant_model=draft, **GEN)
    with pytest.raises(ValueError, match="takes no drafter"):
        target.generate(ids, custom_generate=hf_specdec.decoding_method("prompt_lookup"), assistant_model=draft, **GEN)


def test_shipped_drafter_by_repository_path_from_any_directory(tmp_path, monkeypatch):
    from hf_specdec import registry

    monkeypatch.chdir(tmp_path)
    shipped = registry.shipped_drafter("eagle3")
    if shipped is None:
        pytest.skip("this install has no shipped drafters")
    assert registry.drafter_source(f"hf_specdec/drafters/{shipped.name}") == str(shipped)
    with pytest.raises(FileNotFoundError, match="ships no drafter 'nope'.*shipped: smollm2"):
        registry.drafter_source("hf_specdec/drafters/nope")


def test_targets_are_identified_by_config_and_vocabulary(tmp_path):
    from transformers import LlamaConfig

    from hf_specdec import identity
    from hf_specdec.default_model import MODEL_ID
    from tiny import word_tokenizer

    fields = dict(identity.KNOWN_TARGETS[MODEL_ID]["config"])
    fields.pop("model_type")
    config = LlamaConfig(**fields)
    assert identity.identify(config) == MODEL_ID  # path-independent: no folder at all
    config._name_or_path = str(tmp_path)
    word_tokenizer().save_pretrained(tmp_path)  # another vocabulary beside it
    assert identity.identify(config) is None
    assert identity.identify(tiny_model("llama").config) is None
    assert hf_specdec.shipped_drafter("eagle3", "someone/else") is None


def test_shipped_checkpoints_load_without_deprecation_warnings():
    import warnings

    from hf_specdec import registry
    from hf_specdec.modeling.dflash import DFlashDrafter
    from hf_specdec.modeling.eagle3 import Eagle3Drafter

    for method, cls in (("eagle3", Eagle3Drafter), ("dflash", DFlashDrafter)):
        folder = registry.shipped_drafter(method)
        if folder is None:
            pytest.skip("this install has no shipped drafters")
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            warnings.simplefilter("error", DeprecationWarning)
            cls.from_pretrained(folder)
