"""Every attention backend verifies draft trees correctly or is refused (issue 34).

flex_attention takes the tree mask as a BlockMask; an attention that sees padding only (FlashAttention's kind) is
switched to sdpa for the call; one transformers gives no mask is refused with the cause and the fix. Each output is
the target's own ``generate(do_sample=False)`` with the same backend, in float32. torch's CPU flex kernels fail for
padded batches even in plain decoding, so flex is tested at batch 1.
"""

import pytest
import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import flash_attention_mask

import hf_specdec
from hf_specdec.attention import BLOCK, TENSOR, UnsupportedAttentionError, mask_format, verifiable_attention
from hf_specdec.modeling.eagle3 import Eagle3Config, Eagle3Drafter
from hf_specdec.modeling.medusa import MedusaConfig, MedusaHeads
from eagle3_fixtures import random_weights
from oracles import OracleTree
from tiny import VOCAB, on_device, prompts, tiny_model

pytestmark = pytest.mark.device  # pytest --device cuda runs these there (docs/gpu.md)

KW = dict(max_new_tokens=16, do_sample=False, eos_token_id=None)
FAKE_FLASH = "test_padding_only"  # registered with transformers' flash mask builder
NO_MASK = "test_attention_without_mask"  # registered as an attention only: transformers gives it no mask


def _medusa(hidden=32, seed=0):
    torch.manual_seed(seed)
    heads = MedusaHeads(MedusaConfig(hidden_size=hidden, vocab_size=VOCAB, medusa_num_heads=3)).eval()
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.3)
    return on_device(heads)


def _eagle3(target, seed=0):
    weights = random_weights(target_hidden=target.config.hidden_size, draft_vocab=40, seed=seed, scale=0.5)
    config = Eagle3Config(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                          vocab_size=VOCAB, draft_vocab_size=40, num_target_layers=4)
    drafter = Eagle3Drafter(config)
    drafter.load_state_dict(weights, strict=False)
    return on_device(drafter.eval())


def _methods(target, ref):
    return {
        "prompt_lookup": ("prompt_lookup", {"draft_length_schedule": "constant"}),
        "oracle_tree": (OracleTree(ref, depth=4), {}),  # true path among decoy siblings: they must not see each other
        "medusa": ("medusa", {"drafter": _medusa(), "medusa_choices": [[0], [1], [0, 0], [0, 1], [1, 0]],
                              "draft_length_schedule": "constant"}),
        "eagle3": ("eagle3", {"drafter": _eagle3(target), "tree_top_k": 3, "tree_depth": 3, "tree_total_tokens": 8,
                              "draft_length_schedule": "constant"}),
        "layerskip": ("layerskip", {"exit_layer": 2, "num_speculative_tokens": 3}),
    }


def _speculate(target, ids, mask, method, ref=None, **kw):
    name, opts = _methods(target, ref)[method]
    return target.generate(input_ids=ids, attention_mask=mask, custom_generate=hf_specdec.decoding_method(name),
                           return_dict_in_generate=True, **opts, **kw, **KW)


def _check(out, ref, method):
    assert torch.equal(out.sequences, ref)
    stats = out.speculative_stats  # random drafters draft, and may have nothing accepted; the others must
    assert stats["accepted_drafts" if method in ("prompt_lookup", "oracle_tree") else "proposed_drafts"] > 0


# ------------------------------------------------------------------------------------------------ flex attention
_FLEX = {}


def _flex_target():
    if "llama" not in _FLEX:
        _FLEX["llama"] = tiny_model("llama", layers=4).eval()
        _FLEX["llama"].set_attn_implementation("flex_attention")
    return _FLEX["llama"]


@pytest.mark.slow  # the first flex test of a process compiles flex attention (inductor): 15-30 s on a CPU
@pytest.mark.parametrize("method", ["prompt_lookup", "oracle_tree", "medusa", "eagle3", "layerskip"])
def test_flex_attention_batch_1_matches_its_own_generate(method):
    target = _flex_target()
    assert mask_format(target.config) == BLOCK
    ids, mask = prompts(1, length=12, seed=3)
    ref = target.generate(input_ids=ids, attention_mask=mask, **KW)
    _check(_speculate(target, ids, mask, method, ref), ref, method)
    assert target.config._attn_implementation == "flex_attention"


def test_flex_attention_gets_block_masks_of_the_tree():
    """The verification forwards of a flex target are given BlockMasks whose dense form is the tree mask."""
    from torch.nn.attention.flex_attention import BlockMask

    from hf_specdec.tree import build_attention_mask

    target = _flex_target()
    ancestors = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)[None]
    valid = torch.tensor([[False, True, True, True, True]])
    pos = torch.tensor([[4, 5, 5, 6]])
    block = build_attention_mask(target.config, valid, torch.arange(-1, 4)[None], pos, ancestors, torch.float32)
    dense = build_attention_mask(tiny_model("llama").config, valid, torch.arange(-1, 4)[None], pos, ancestors,
                                 torch.float32)
    assert isinstance(block, BlockMask) and block.shape == (1, 1, 4, 9)
    assert torch.equal(block.allowed, dense[:, 0] == 0)


# ------------------------------------------------------------------------------- attentions that see padding only
def _padding_only_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """What FlashAttention computes: causal over the new tokens (aligned to the last key), padding from a 2D mask
    (transformers' flash mask builder), any 4D mask ignored. ``[B, H, q, D]`` in, ``[B, q, H, D]`` out."""
    q_len, kv_len = query.shape[2], key.shape[2]
    allowed = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)[None, None]
    if attention_mask is not None and attention_mask.dim() == 2:  # [B, kv] padding
        allowed = allowed & attention_mask[:, None, None, -kv_len:].bool()
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scaling,
                                         enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


@pytest.fixture
def padding_only():
    """A FlashAttention-like implementation under FAKE_FLASH (with transformers' flash mask builder), and the same
    function as an attention transformers registers no mask builder for (NO_MASK)."""
    AttentionInterface.register(FAKE_FLASH, _padding_only_attention)
    AttentionMaskInterface.register(FAKE_FLASH, flash_attention_mask)
    AttentionInterface.register(NO_MASK, _padding_only_attention)
    yield
    for interface in (AttentionInterface, AttentionMaskInterface):
        for name in (FAKE_FLASH, NO_MASK):
            interface._global_mapping.pop(name, None)


def _with_attention(model, name):
    model.set_attn_implementation(name)
    assert model.config._attn_implementation == name
    return model


def test_the_fake_is_wrong_with_a_tree_mask(padding_only):
    """The negative control: given the tree mask directly, a padding-only attention ignores it (siblings see each
    other), so the verification logits differ from sdpa's."""
    from hf_specdec.tree import build_attention_mask

    target = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (1, 8))
    ancestors = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)[None]
    pos = torch.tensor([[8, 9, 9]])
    mask = build_attention_mask(target.config, torch.ones(1, 8, dtype=torch.bool), torch.arange(8)[None], pos,
                                ancestors, torch.float32)
    tokens = torch.randint(3, VOCAB, (1, 3))
    logits = {}
    for name in ("sdpa", FAKE_FLASH):
        _with_attention(target, name)
        with torch.no_grad():
            cache = target(input_ids=ids, use_cache=True).past_key_values
            logits[name] = target(input_ids=tokens, attention_mask=mask, position_ids=pos, past_key_values=cache).logits
    assert (logits["sdpa"][0, 2] - logits[FAKE_FLASH][0, 2]).abs().max() > 1e-3  # the second child saw its sibling


def test_without_the_switch_the_output_would_differ(padding_only, monkeypatch):
    """The negative control in the loop: verified through the padding-only attention itself (no switch, the 4D
    mask handed over and ignored), a tree of decoys changes the output of one row."""
    import contextlib

    from hf_specdec import runners, tree

    target = _with_attention(tiny_model("llama", layers=4), FAKE_FLASH)
    ids, mask = prompts(1, length=12, seed=0)
    ref = target.generate(input_ids=ids, attention_mask=mask, **KW)
    monkeypatch.setattr(runners, "verifiable_attention", lambda *models: contextlib.nullcontext())
    monkeypatch.setattr(tree, "tree_mask_format", lambda config: TENSOR)
    assert not torch.equal(_speculate(target, ids, mask, "oracle_tree", ref).sequences, ref)


@pytest.mark.parametrize("method", ["prompt_lookup", "oracle_tree", "eagle3", "layerskip"])
@pytest.mark.parametrize("bsz", [1, 3])
def test_padding_only_attention_verifies_through_sdpa(padding_only, method, bsz):
    target = _with_attention(tiny_model("llama", layers=4), FAKE_FLASH)
    assert mask_format(target.config) is None
    ids, mask = prompts(bsz, length=12, seed=bsz)
    ref = target.generate(input_ids=ids, attention_mask=mask, **KW)
    _check(_speculate(target, ids, mask, method, ref), ref, method)
    assert target.config._attn_implementation == FAKE_FLASH  # restored after the call


def test_flash_attention_2_name_takes_the_same_route(padding_only, monkeypatch):
    """The real name: transformers' flash_attention_2 (its function replaced by the fake, as no flash-attn runs on a
    CPU), mask built by transformers' flash builder; verification switches it to sdpa and back."""
    from hf_specdec._transformers import switch_attention

    monkeypatch.setitem(AttentionInterface._global_mapping, "flash_attention_2", _padding_only_attention)
    target = tiny_model("llama", layers=4)
    switch_attention(target.config, "flash_attention_2")  # set_attn_implementation would ask for the flash-attn package
    ids, mask = prompts(3, length=12, seed=5)
    ref = target.generate(input_ids=ids, attention_mask=mask, **KW)
    seen = []
    with verifiable_attention(target):
        seen.append(target.config._attn_implementation)
    out = _speculate(target, ids, mask, "oracle_tree", ref)
    _check(out, ref, "oracle_tree")
    assert seen == ["sdpa"] and target.config._attn_implementation == "flash_attention_2"


def test_flash_draft_model_is_switched_too(padding_only):
    target = tiny_model("llama")
    drafter = _with_attention(tiny_model("llama", seed=7), FAKE_FLASH)
    ids, mask = prompts(3, length=12, seed=2)
    ref = target.generate(input_ids=ids, attention_mask=mask, **KW)
    out = target.generate(input_ids=ids, attention_mask=mask, custom_generate=hf_specdec.decoding_method("assisted"),
                          drafter=drafter, num_speculative_tokens=3, **KW)
    assert torch.equal(out, ref)
    assert drafter.config._attn_implementation == FAKE_FLASH


def test_flash_draft_model_in_transformers_loop(padding_only):
    """transformers' own assisted loop verifies with its own masks; the draft model's forwards (4D masks) switch."""
    from hf_specdec.candidate_generators import in_transformers_loop

    target = tiny_model("llama")
    drafter = _with_attention(tiny_model("llama", seed=7), FAKE_FLASH)
    ids, mask = prompts(1, length=12, seed=2)
    ref = target.generate(input_ids=ids, attention_mask=mask, **KW)
    out = target.generate(input_ids=ids, attention_mask=mask, custom_generate=in_transformers_loop("assisted"),
                          drafter=drafter, **KW)
    assert torch.equal(out, ref)
    assert drafter.config._attn_implementation == FAKE_FLASH


@pytest.mark.parametrize("name", [NO_MASK, "paged|eager"])
def test_attention_without_a_tree_mask_is_refused(padding_only, name):
    target = _with_attention(tiny_model("llama"), name)
    ids, mask = prompts(1, length=12)
    with pytest.raises(UnsupportedAttentionError, match=f"{name}.*cannot verify a draft tree.*set_attn_implementation"):
        _speculate(target, ids, mask, "prompt_lookup")
    assert target.config._attn_implementation == name


def test_formats():
    model = tiny_model("llama")
    assert mask_format(model.config) == TENSOR
    for name in ("eager", "sdpa"):
        model.set_attn_implementation(name)
        assert mask_format(model.config) == TENSOR
    with verifiable_attention(model):  # nothing to switch
        assert model.config._attn_implementation == "sdpa"
