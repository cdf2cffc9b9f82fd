"""Exporting drafters to the layouts serving engines load (``conversions.<method>.export_<method>``,
``hf-specdec export``): our own converters read every export back to the same tensors and network config; the
speculators package (optional) loads the EAGLE-3, DFlash and MTP exports and drafts the same logits; the shipped
SmolLM2 drafters export with the fields vLLM reads."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig

import hf_specdec
from dflash_fixtures import random_weights as dflash_weights
from eagle3_fixtures import random_weights as eagle3_weights
from hf_specdec.cli import main
from hf_specdec.conversions.common import SPECULATORS_INSTALL, ConversionError
from hf_specdec.conversions.dflash import convert_dflash, export_dflash
from hf_specdec.conversions.eagle3 import convert_eagle3, export_eagle3
from hf_specdec.conversions.medusa import convert_medusa, export_medusa
from hf_specdec.conversions.mtp import convert_mtp, export_mtp
from hf_specdec.modeling.dflash import DFlashConfig, DFlashDrafter
from hf_specdec.modeling.eagle3 import Eagle3Config, Eagle3Drafter
from hf_specdec.modeling.medusa import MedusaConfig, MedusaHeads
from hf_specdec.modeling.mtp import MTPConfig, MTPModule, ParallelMTPConfig, ParallelMTPHeads, block_config_for
from tiny import tiny_model

H, VOCAB = 32, 96
SKIP = f"the speculators package checks the exports; install it with: {SPECULATORS_INSTALL}"


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """Tiny targets saved as folders (the exports' verifiers): llama with 8 layers (EAGLE-3's default feature layers
    2, 4, 5 are distinct, as speculators requires), qwen3 with 4 and with 2."""
    root = tmp_path_factory.mktemp("targets")
    made = {}
    for name, arch, layers in (("llama", "llama", 8), ("qwen3", "qwen3", 4), ("qwen3_2", "qwen3", 2)):
        model = tiny_model(arch, layers=layers, hidden=H)
        model.save_pretrained(root / name)
        made[name] = (model, str(root / name))
    return made


def _state(module, drop=("embed_tokens.weight",)):
    return {k: v for k, v in module.state_dict().items() if k not in drop}


def assert_same_tensors(a, b):
    sa, sb = _state(a), _state(b)
    assert sorted(sa) == sorted(sb)
    for key in sa:
        assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), key


def assert_same_fields(a, b, fields):
    for name in fields:
        assert getattr(a.config, name, None) == getattr(b.config, name, None), name


def _randomize(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    return module.eval()


# ------------------------------------------------------------------------------------------------- drafters
def eagle3_drafter(verifier, target_hidden=H, draft_vocab=40, **cfg):
    w = eagle3_weights(target_hidden=target_hidden, vocab=VOCAB, draft_vocab=draft_vocab)
    config = Eagle3Config(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                          vocab_size=VOCAB, draft_vocab_size=draft_vocab, target_hidden_size=target_hidden,
                          num_target_layers=8, target_model=verifier, **cfg)
    drafter = Eagle3Drafter(config)
    drafter.load_state_dict(w, strict=False)
    return drafter.eval()


def dflash_drafter(verifier, **cfg):
    fields = dict(hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, block_size=4, mask_token_id=95,
                  target_layer_ids=[0, 2], num_target_layers=4, rope_theta=10000.0, target_model=verifier)
    fields.update(cfg)
    drafter = DFlashDrafter(DFlashConfig(**fields))
    drafter.load_state_dict(dflash_weights(layers=2, taps=2))
    return drafter.eval()


def medusa_heads(verifier, draft_vocab=40, layers=2, shared=False):
    heads = MedusaHeads(MedusaConfig(hidden_size=H, vocab_size=VOCAB, medusa_num_heads=3, medusa_num_layers=layers,
                                     shared_layers=shared, draft_vocab_size=draft_vocab,
                                     base_model_name_or_path=verifier))
    _randomize(heads)
    heads.set_draft_vocabulary(sorted(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))[:draft_vocab]
                                      .tolist()))
    return heads


def mtp_module(target, verifier, **cfg):
    config = MTPConfig(block_config=block_config_for(target.config, 1), num_modules=1, layout="deepseek",
                       vocab_size=VOCAB, num_target_layers=target.config.num_hidden_layers,
                       base_model_name_or_path=verifier, **cfg)
    return _randomize(MTPModule(config))


EAGLE3_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "rms_norm_eps", "hidden_act", "attention_bias", "vocab_size", "draft_vocab_size", "target_hidden_size",
                 "target_layer_ids", "rope_theta", "rope_parameters", "max_position_embeddings", "norm_before_residual",
                 "target_model")
DFLASH_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "rms_norm_eps", "hidden_act", "attention_bias", "vocab_size", "block_size",
                 "mask_token_id", "target_layer_ids", "target_hidden_size", "layer_types", "sliding_window", "causal",
                 "causal_sliding", "rope_theta", "max_position_embeddings", "target_model")
MEDUSA_FIELDS = ("hidden_size", "vocab_size", "medusa_num_heads", "medusa_num_layers", "shared_layers",
                 "draft_vocab_size", "hidden_act", "base_model_name_or_path")
MTP_FIELDS = ("num_modules", "layout", "chain_hidden", "vocab_size", "draft_vocab_size", "hidden_size", "rms_norm_eps",
              "num_target_layers", "base_model_name_or_path")
BLOCK_FIELDS = ("model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "rms_norm_eps", "hidden_act", "attention_bias", "rope_parameters", "layer_types")


# ------------------------------------------------------------------------------------- export -> convert back
@pytest.mark.parametrize("variant", ["plain", "norm_before_residual", "linear_rope", "wide_target", "full_vocab"])
def test_eagle3_export_reads_back(tmp_path, targets, variant):
    _, verifier = targets["llama"]
    cfg = {"norm_before_residual": {"norm_before_residual": True}, "linear_rope": {
        "rope_theta": 5000.0, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}}.get(variant, {})
    wide = None
    if variant == "wide_target":  # a target wider than the drafter, given as a config
        wide = LlamaConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4,
                           vocab_size=VOCAB, architectures=["LlamaForCausalLM"])
        wide._name_or_path = verifier = "tiny/wide-target"
    drafter = eagle3_drafter(verifier, target_hidden=48 if wide else H,
                             draft_vocab=VOCAB if variant == "full_vocab" else 40, **cfg)
    done = export_eagle3(drafter, tmp_path / "out", verifier=wide)
    assert done.config["eagle_aux_hidden_state_layer_ids"] == drafter.config.target_layer_ids == [2, 4, 5]
    assert done.config["target_hidden_size"] == (48 if wide else H)
    assert done.config["speculators_config"]["verifier"]["name_or_path"] == verifier
    back = convert_eagle3(tmp_path / "out")
    assert_same_tensors(drafter, back)
    assert_same_fields(drafter, back, EAGLE3_FIELDS)
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "fc.weight" in keys and "layers.0.self_attn.q_proj.weight" in keys and "embed_tokens.weight" not in keys
    assert ({"d2t", "t2d"} <= keys) == (variant != "full_vocab")


def test_eagle3_specforge_export_reads_back(tmp_path, targets):
    _, verifier = targets["llama"]
    drafter = eagle3_drafter(verifier)
    done = export_eagle3(drafter, tmp_path / "sg", layout="specforge")
    assert done.config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert done.config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # SGLang counts outputs
    back = convert_eagle3(tmp_path / "sg")
    assert_same_tensors(drafter, back)
    assert_same_fields(drafter, back, [f for f in EAGLE3_FIELDS if f != "target_model"])
    with pytest.raises(ConversionError, match="norm_before_residual"):
        export_eagle3(eagle3_drafter(verifier, norm_before_residual=True), tmp_path / "x", layout="specforge")


@pytest.mark.parametrize("variant", ["plain", "sliding_causal", "sliding_bidirectional"])
def test_dflash_export_reads_back(tmp_path, targets, variant):
    _, verifier = targets["qwen3"]
    cfg = {} if variant == "plain" else dict(layer_types=["sliding_attention", "full_attention"], sliding_window=3,
                                             causal_sliding=variant == "sliding_causal")
    drafter = dflash_drafter(verifier, **cfg)
    done = export_dflash(drafter, tmp_path / "out")
    assert done.config["aux_hidden_state_layer_ids"] == [1, 3]  # HF hidden_states indices = layer outputs + 1
    assert done.config["sliding_window_non_causal"] == (variant != "sliding_causal")
    assert done.config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    back = convert_dflash(tmp_path / "out")
    assert_same_tensors(drafter, back)
    assert_same_fields(drafter, back, DFLASH_FIELDS)


@pytest.mark.parametrize("variant", ["draft_vocab", "full_vocab", "shared_blocks"])
def test_medusa_export_reads_back(tmp_path, targets, variant):
    _, verifier = targets["llama"]
    heads = medusa_heads(verifier, draft_vocab=VOCAB if variant == "full_vocab" else 40,
                         shared=variant == "shared_blocks")
    done = export_medusa(heads, tmp_path / "out", speculative_tokens=2)
    assert done.config["num_heads"] == 3 and done.config["num_hidden_layers"] == 2
    assert '"method": "medusa"' in done.serve and '"num_speculative_tokens": 2' in done.serve
    back = convert_medusa(tmp_path / "out")
    if variant == "shared_blocks":  # the same network, written as L copies of the shared block
        x = torch.randn(3, 5, H)
        torch.testing.assert_close(back(x), heads(x), rtol=0, atol=0)
        assert not back.config.shared_layers
        return
    assert_same_tensors(heads, back)
    assert_same_fields(heads, back, MEDUSA_FIELDS)


def test_mtp_export_reads_back(tmp_path, targets):
    target, verifier = targets["qwen3_2"]
    module = mtp_module(target, verifier)
    done = export_mtp(module, tmp_path / "out")
    assert done.config["transformer_layer_config"]["num_hidden_layers"] == 2
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert {"mtp_layers.0.token_layernorm.weight", "mtp_layers.0.hidden_layernorm.weight",
            "mtp_layers.0.input_proj.weight", "mtp_layers.0.final_layernorm.weight",
            "mtp_layers.0.self_attn.q_norm.weight"} <= keys
    back = convert_mtp(tmp_path / "out")
    assert_same_tensors(module, back)
    assert_same_fields(module, back, MTP_FIELDS)
    for name in BLOCK_FIELDS:
        assert module.config.block_config.get(name) == back.config.block_config.get(name), name


def test_exports_refuse_what_the_layout_cannot_hold(tmp_path, targets):
    target, verifier = targets["qwen3_2"]
    with pytest.raises(ConversionError, match="whole vocabulary"):
        export_mtp(mtp_module(target, verifier, draft_vocab_size=40), tmp_path / "a")
    with pytest.raises(ConversionError, match="speculators chains the normed output"):
        export_mtp(mtp_module(target, verifier, chain_hidden="block"), tmp_path / "b")
    llama, llama_dir = targets["llama"]
    with pytest.raises(ConversionError, match="'llama'.*qwen3"):
        export_mtp(mtp_module(llama, llama_dir), tmp_path / "c")
    heads = ParallelMTPHeads(ParallelMTPConfig(block_config=block_config_for(target.config, 2), num_modules=2,
                                               vocab_size=VOCAB))
    with pytest.raises(ConversionError, match="Parallel MTP heads"):
        export_mtp(heads, tmp_path / "d", verifier=verifier)
    _, qwen_dir = targets["qwen3"]
    with pytest.raises(ConversionError, match="causal=true"):
        export_dflash(dflash_drafter(qwen_dir, causal=True), tmp_path / "e")
    with pytest.raises(ConversionError, match="1..3"):
        export_dflash(dflash_drafter(qwen_dir), tmp_path / "f", speculative_tokens=4)
    with pytest.raises(ConversionError, match="does not fit"):  # a verifier of another depth
        export_eagle3(eagle3_drafter(llama_dir), tmp_path / "g", verifier=verifier)
    with pytest.raises(ConversionError, match="does not record the target"):
        export_medusa(medusa_heads(None), tmp_path / "h")


# ----------------------------------------------------------------------------- the peer package drafts the same
def _capture(module):
    seen = []
    module.register_forward_hook(lambda m, i, o: seen.append(o.detach()))
    return seen


def _eager(config):
    config.transformer_layer_config._attn_implementation = "eager"
    return config


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_speculators_eagle3_computes_the_same_draft_logits(tmp_path, targets, norm_before_residual):
    pytest.importorskip("speculators", reason=SKIP)
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    target, verifier = targets["llama"]
    drafter = eagle3_drafter(verifier, norm_before_residual=norm_before_residual).bind_target(target)
    export_eagle3(drafter, tmp_path / "out")
    peer = Eagle3DraftModel.from_pretrained(str(tmp_path / "out"),
                                            config=_eager(Eagle3SpeculatorConfig.from_pretrained(tmp_path / "out")))
    peer = peer.float().eval()
    # speculators 0.9.0 fills the embedding from the verifier only where it is NaN, a mark transformers 5.24's loading
    # on the meta device does not keep: the peer may hold uninitialised memory there. It is the target's embedding
    # (neither folder stores one), so it is set here.
    with torch.no_grad():
        peer.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
    assert peer.target_layer_ids == drafter.config.target_layer_ids
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (1, 9), generator=g)
    feats = torch.randn(1, 9, 3 * H, generator=g)  # fused target features, row t with token x_{t+1}
    pos = torch.arange(9)[None]
    seen = _capture(peer.lm_head)
    with torch.no_grad():
        ours, _ = drafter(ids, feats, pos)
        peer(hidden_states=feats, input_ids=ids, document_ids=torch.zeros_like(ids), position_ids=pos, ttt_steps=1)
    assert ours.shape == seen[0].shape == (1, 9, 40)
    assert (ours - seen[0]).abs().max().item() <= 1e-5


def test_speculators_dflash_computes_the_same_draft_logits(tmp_path, targets):
    pytest.importorskip("speculators", reason=SKIP)
    from speculators.losses import resolve_loss_config
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

    target, verifier = targets["qwen3"]
    drafter = dflash_drafter(verifier).bind_target(target)
    export_dflash(drafter, tmp_path / "out")
    peer = DFlashDraftModel.from_pretrained(str(tmp_path / "out"),
                                            config=_eager(DFlashSpeculatorConfig.from_pretrained(tmp_path / "out")))
    peer = peer.float().eval()
    g = torch.Generator().manual_seed(0)
    length, anchor, bs = 12, 6, drafter.config.block_size
    ids = torch.randint(0, VOCAB - 1, (1, length), generator=g)
    feats = torch.randn(1, length, 2 * H, generator=g)
    only_anchor = torch.zeros(1, length, dtype=torch.long)
    only_anchor[0, anchor] = 1  # the one block drafted: after the anchor token, context = the features before it
    seen = _capture(peer.lm_head)
    with torch.no_grad():
        peer(hidden_states=feats, input_ids=ids, loss_mask=only_anchor, document_ids=torch.zeros_like(ids),
             verifier_last_hidden_states=torch.randn(1, length, H, generator=g),
             position_ids=torch.arange(length)[None], max_anchors=1,
             loss_config=resolve_loss_config("kl_div", "eager"))  # the training loss (off Triton), not compared
        block = torch.tensor([[ids[0, anchor].item()] + [drafter.config.mask_token_id] * (bs - 1)])
        hidden = drafter(drafter.embed(block), drafter.project(feats[:, :anchor]),
                         torch.arange(anchor, anchor + bs)[None], torch.arange(anchor)[None])
        ours = drafter.draft_logits(hidden)
    assert ours.shape == seen[0].shape == (1, bs, VOCAB)
    assert (ours - seen[0]).abs().max().item() <= 1e-5


def test_speculators_mtp_computes_the_same_draft_logits(tmp_path, targets):
    pytest.importorskip("speculators", reason=SKIP)
    from speculators.models.mtp import MTPDraftModel

    target, verifier = targets["qwen3_2"]
    module = mtp_module(target, verifier).bind_target(target)
    export_mtp(module, tmp_path / "out", speculative_tokens=2)
    peer = MTPDraftModel.from_pretrained(str(tmp_path / "out")).float().eval()
    g = torch.Generator().manual_seed(0)
    length = 10
    ids = torch.randint(0, VOCAB, (1, length), generator=g)
    hidden = torch.randn(1, length, H, generator=g)  # the target's final hidden states
    pos = torch.arange(length)[None]
    with torch.no_grad():
        steps, _, _ = peer(input_ids=ids, hidden_states=hidden, position_ids=pos)
        valid = length - len(steps) - 1
        logits0, h0 = module(ids[:, 1:1 + valid], hidden[:, :valid], pos[:, :valid])
        logits1, _ = module(ids[:, 2:2 + valid], h0, pos[:, :valid])  # a chain step reads the normed output
    assert len(steps) == 2
    assert (logits0 - steps[0]).abs().max().item() <= 1e-5
    assert (logits1 - steps[1]).abs().max().item() <= 1e-5


# ----------------------------------------------------------------------------------------- shipped drafters
def test_shipped_smollm2_eagle3_exports_what_vllm_reads(tmp_path):
    folder = hf_specdec.shipped_drafter("eagle3")
    if folder is None:
        pytest.skip("this install has no shipped EAGLE-3 drafter")
    done = export_eagle3(folder, tmp_path / "out")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg == done.config
    assert cfg["speculators_model_type"] == "eagle3" and cfg["architectures"] == ["Eagle3Speculator"]
    assert cfg["speculators_config"]["verifier"] == {"name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
                                                     "architectures": ["LlamaForCausalLM"]}
    assert cfg["speculators_config"]["proposal_methods"] == [
        {"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1, "accept_tolerance": 0.0}]
    assert cfg["draft_vocab_size"] == 8192 and cfg["target_hidden_size"] == 576
    assert "norm_before_residual" in cfg and cfg["norm_before_residual"] is False  # vLLM defaults a missing one to true
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]  # HF hidden_states indices, as vLLM reads them
    layer = cfg["transformer_layer_config"]
    assert (layer["model_type"], layer["hidden_size"], layer["num_hidden_layers"], layer["head_dim"]) == (
        "llama", 576, 1, 64)
    assert layer["rope_theta"] == 100000.0 and layer["vocab_size"] == 49152
    back = convert_eagle3(tmp_path / "out")
    assert_same_tensors(Eagle3Drafter.from_pretrained(folder), back)


def test_shipped_smollm2_mtp_is_refused_with_the_reasons(tmp_path):
    folder = hf_specdec.shipped_drafter("mtp")
    if folder is None:
        pytest.skip("this install has no shipped MTP module")
    with pytest.raises(ConversionError, match=r"'llama'.*8192 of the 49152"):
        export_mtp(folder, tmp_path / "out")


# ------------------------------------------------------------------------------------------------------ CLI
def test_cli_export(tmp_path, targets, capsys):
    _, verifier = targets["llama"]
    eagle3_drafter(verifier).save_pretrained(tmp_path / "drafter")
    assert main(["export", "eagle3", str(tmp_path / "drafter"), "--out", str(tmp_path / "out"),
                 "--speculative-tokens", "5", "--dtype", "float16"]) == 0
    printed = capsys.readouterr().out
    assert "config.json" in printed and "model.safetensors (" in printed and "layers.0." in printed
    assert "vllm serve" in printed
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5 and cfg["dtype"] == "float16"
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("fc.weight").dtype == torch.float16 and f.get_tensor("d2t").dtype == torch.int64
    if hf_specdec.shipped_drafter("dflash") is not None:  # a target id names the drafter shipped for it
        assert main(["export", "dflash", "HuggingFaceTB/SmolLM2-135M-Instruct", "--out", str(tmp_path / "d")]) == 0
        cfg = json.loads((tmp_path / "d" / "config.json").read_text())
        assert cfg["speculators_model_type"] == "dflash" and cfg["aux_hidden_state_layer_ids"] == [2, 15, 27]


@pytest.mark.parametrize("argv, message", [
    (["export", "nosuch", "x"], "Unknown speculative decoding method 'nosuch'"),
    (["export", "prompt_lookup", "x"], "prompt_lookup has no drafter.*eagle3, dflash, medusa, mtp"),
    (["export", "layerskip", "x"], "layerskip has no exporter"),
    (["export", "dflash", "smollm2-135m-instruct-dflash", "--layout", "specforge"], "one layout"),
])
def test_cli_export_errors(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit, match=message) as err:
        main(argv + ["--out", str(tmp_path / "out")])
    assert err.value.code == 2
    assert "hf-specdec: error:" in capsys.readouterr().err
