"""Targets placed by Accelerate (``device_map``, offload to CPU and disk, its hooks): every method lossless on an
offloaded target, drafters that read the target's offloaded weights for real, and where a drafter goes
(:mod:`hf_specdec.placement`).

No GPU here: a tiny target reloaded with a ``device_map`` that sends half its layers, its embeddings, final norm and
LM head to ``"disk"`` (their weights on the ``meta`` device, loaded by ``AlignDevicesHook`` for each forward) and the
rest to ``"cpu"``. The device decision for real accelerators is tested on a fake ``hf_device_map``."""

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_specdec
from dflash_fixtures import random_weights as dflash_weights
from eagle3_fixtures import random_weights as eagle3_weights
from hf_specdec.draft_models import load_draft_model, save_draft_model
from hf_specdec.modeling.dflash import DFlashConfig, DFlashDrafter
from hf_specdec.modeling.eagle3 import Eagle3Config, Eagle3Drafter
from hf_specdec.modeling.layerskip import ExitAdapter, ExitAdapterConfig
from hf_specdec.modeling.medusa import MedusaConfig, MedusaHeads
from hf_specdec.modeling.mtp import MTPConfig, MTPModule, block_config_for
from hf_specdec.placement import drafter_device, input_device, materialized
from hf_specdec.runners import device_type_of
from tiny import VOCAB, prompts, tiny_model

LAYERS, H = 4, 32
GEN = dict(max_new_tokens=10, do_sample=False, eos_token_id=None)


def spread(model) -> dict:
    """A device map over CPU and disk: odd layers, and every top-level module with weights (embeddings, final
    norm, LM head), on disk; even layers and the rotary embedding on the CPU."""
    prefix = model.base_model_prefix
    device_map = {}
    for name, child in getattr(model, prefix).named_children():
        if isinstance(child, torch.nn.ModuleList):
            device_map.update({f"{prefix}.{name}.{i}": "disk" if i % 2 else "cpu" for i in range(len(child))})
        else:
            device_map[f"{prefix}.{name}"] = "disk" if any(True for _ in child.parameters()) else "cpu"
    device_map["lm_head"] = "disk"
    return device_map


def placed_copy(model, folder, device_map, offload_folder=None):
    model.save_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder, device_map=device_map, offload_folder=offload_folder,
                                                dtype=torch.float32)


@pytest.fixture(scope="module")
def placed(tmp_path_factory):
    plain = tiny_model("llama", layers=LAYERS, hidden=H)
    tmp = tmp_path_factory.mktemp("placement")
    offloaded = placed_copy(plain, tmp / "target", spread(plain), tmp / "offload")
    return SimpleNamespace(plain=plain, offloaded=offloaded, tmp=tmp)


# ------------------------------------------------------------------------------------------------- drafters
def eagle3_drafter():
    w = eagle3_weights(target_hidden=H, draft_vocab=40, scale=0.5)
    config = Eagle3Config(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                          vocab_size=VOCAB, draft_vocab_size=40, num_target_layers=LAYERS)
    drafter = Eagle3Drafter(config)
    drafter.load_state_dict(w, strict=False)
    return drafter.eval()


def dflash_drafter():
    config = DFlashConfig(hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, block_size=4, mask_token_id=95,
                          target_layer_ids=[0, 2], num_target_layers=LAYERS)
    drafter = DFlashDrafter(config)
    drafter.load_state_dict(dflash_weights(scale=0.5))
    return drafter.eval()


def medusa_heads():
    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig(hidden_size=H, vocab_size=VOCAB, medusa_num_heads=3, medusa_num_layers=1))
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.3)
    return heads.eval()


def mtp_module(target):
    text = target.config.get_text_config()
    torch.manual_seed(0)
    module = MTPModule(MTPConfig(block_config=block_config_for(text, 1), num_modules=1, vocab_size=VOCAB,
                                 num_target_layers=LAYERS))
    return module.eval()


def adapter_config(draft_vocab=48):
    return ExitAdapterConfig(exit_layer=2, hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                             intermediate_size=16, vocab_size=VOCAB, draft_vocab_size=draft_vocab,
                             num_target_layers=LAYERS)


def exit_adapter(target, draft_vocab=48):
    torch.manual_seed(0)
    adapter = ExitAdapter(adapter_config(draft_vocab))
    adapter.init_from_target(target, torch.arange(0, VOCAB, VOCAB // draft_vocab)[:draft_vocab])
    with torch.no_grad():
        for layer in adapter.layers:
            layer.o_proj.weight.normal_(0, 0.02)
    return adapter.eval()


def saved(module, folder):
    module.save_pretrained(folder)
    return str(folder)


def shared_draft_model(folder):
    """A draft model saved without its embeddings and head (they are the target's: read from it when loaded)."""
    save_draft_model(tiny_model("llama", seed=7, hidden=H), folder, dtype=torch.float32)
    return str(folder)


CONSTANT = {"draft_length_schedule": "constant"}
# each method with its drafter; drafters given as a folder are loaded for the offloaded target by the library
METHODS = {
    "prompt_lookup": lambda p: ("prompt_lookup", CONSTANT),
    "suffix": lambda p: ("suffix", CONSTANT),
    "lookahead": lambda p: ("lookahead", CONSTANT),
    "assisted": lambda p: ("assisted", dict(drafter=shared_draft_model(p.tmp / "draft"), num_speculative_tokens=3,
                                            **CONSTANT)),
    "hybrid": lambda p: ("assisted", dict(drafter=tiny_model("llama", seed=7, hidden=H), hybrid="suffix",
                                          num_speculative_tokens=3)),
    "eagle3": lambda p: ("eagle3", dict(drafter=saved(eagle3_drafter(), p.tmp / "eagle3"), **CONSTANT)),
    "dflash": lambda p: ("dflash", dict(drafter=dflash_drafter(), **CONSTANT)),
    "medusa": lambda p: ("medusa", dict(drafter=medusa_heads(), **CONSTANT)),
    "layerskip": lambda p: ("layerskip", dict(exit_layer=2, num_speculative_tokens=3)),
    "layerskip_adapter": lambda p: ("layerskip", dict(drafter=saved(exit_adapter(p.plain), p.tmp / "adapter"),
                                                      num_speculative_tokens=3)),
    "mtp": lambda p: ("mtp", dict(drafter=saved(mtp_module(p.plain), p.tmp / "mtp"), num_speculative_tokens=3,
                                  **CONSTANT)),
}


# ------------------------------------------------------------------------------------------------ lossless
@pytest.mark.parametrize("method", list(METHODS))
def test_offloaded_target_is_lossless(placed, method):
    name, opts = METHODS[method](placed)
    target = placed.offloaded
    for bsz in (1, 3):
        ids, mask = prompts(bsz, length=12, seed=bsz)
        ref = target.generate(input_ids=ids, attention_mask=mask, **GEN)
        out = target.generate(input_ids=ids, attention_mask=mask, **GEN, return_dict_in_generate=True,
                              custom_generate=hf_specdec.decoding_method(name), **opts)
        assert torch.equal(out.sequences, ref), (method, bsz)
        assert out.speculative_stats["proposed_drafts"] > 0


def test_offloaded_target_is_the_plain_one(placed):
    ids, mask = prompts(3, length=12, seed=3)
    assert torch.equal(placed.offloaded.generate(input_ids=ids, attention_mask=mask, **GEN),
                       placed.plain.generate(input_ids=ids, attention_mask=mask, **GEN))


@pytest.mark.parametrize("where", ["one_device", "layers_on_disk"])
def test_other_maps(placed, where, tmp_path):
    """``{"": "cpu"}`` (no hooks) and a map that offloads layers only (embeddings and head stay real)."""
    device_map = {"": "cpu"} if where == "one_device" else {k: ("disk" if ".layers." in k and v == "disk" else "cpu")
                                                          for k, v in spread(placed.plain).items()}
    target = placed_copy(placed.plain, tmp_path / "t", device_map, tmp_path / "off")
    ids, mask = prompts(2, length=12, seed=2)
    ref = target.generate(input_ids=ids, attention_mask=mask, **GEN)
    for name, opts in (("eagle3", dict(drafter=eagle3_drafter())), ("mtp", dict(drafter=mtp_module(placed.plain))),
                       ("layerskip", dict(drafter=exit_adapter(placed.plain)))):
        out = target.generate(input_ids=ids, attention_mask=mask, **GEN, num_speculative_tokens=3,
                              custom_generate=hf_specdec.decoding_method(name), **opts)
        assert torch.equal(out, ref), (where, name)


# ------------------------------------------------------------------------- drafters read the real weights
def test_drafters_read_the_offloaded_weights(placed):
    """What a drafter takes from the target (embedding table, LM head rows, the head itself) holds the target's
    values when the target's are on the meta device, offloaded: bound to the offloaded target and to the same
    target in memory, a drafter computes the same."""
    plain, offloaded = placed.plain, placed.offloaded
    assert offloaded.get_input_embeddings().weight.device.type == "meta"  # really offloaded
    emb, head = plain.get_input_embeddings().weight, plain.get_output_embeddings().weight

    eagle = eagle3_drafter().bind_target(offloaded)
    assert torch.equal(eagle.embed_tokens.weight, emb)

    ids = torch.randint(3, VOCAB, (2, 5))
    hidden = torch.randn(2, 5, H)
    pos = torch.arange(5)[None].expand(2, 5)
    mine, theirs = dflash_drafter().bind_target(offloaded), dflash_drafter().bind_target(plain)
    with torch.no_grad():
        assert torch.equal(mine.embed(ids), theirs.embed(ids))
        torch.testing.assert_close(mine.draft_logits(hidden), theirs.draft_logits(hidden))  # through the head's hook

    module = mtp_module(plain)
    with torch.no_grad():
        expected = module.bind_target(plain)(ids, hidden, pos)[0]
        got = module.bind_target(offloaded)(ids, hidden, pos)[0]
    assert module.head.weight.device.type == "cpu" and torch.equal(module.head.weight, head)
    torch.testing.assert_close(got, expected)

    adapter = exit_adapter(plain).bind_target(offloaded)
    assert torch.equal(adapter.head.weight, head[adapter.token_map])

    draft = load_draft_model(shared_draft_model(placed.tmp / "shared"), offloaded)
    assert {p.device.type for p in draft.parameters()} == {"cpu"}
    assert torch.equal(draft.get_input_embeddings().weight, emb)


def test_training_starts_from_an_offloaded_target(placed):
    """``init_from_target`` (a trained drafter's start: the target's head rows, last layer, final norm) reads the
    offloaded target's values."""
    from hf_specdec.modeling.mtp import ParallelMTPConfig, ParallelMTPHeads

    text = placed.plain.config.get_text_config()
    builders = [
        lambda: ExitAdapter(adapter_config(VOCAB)),
        lambda: MTPModule(MTPConfig(block_config=block_config_for(text, 1), num_modules=1, vocab_size=VOCAB,
                                    num_target_layers=LAYERS)),
        lambda: ParallelMTPHeads(ParallelMTPConfig(block_config=block_config_for(text, 2), num_modules=2,
                                                   vocab_size=VOCAB)),
        lambda: MedusaHeads(MedusaConfig(hidden_size=H, vocab_size=VOCAB, medusa_num_heads=2)),
    ]
    for build in builders:
        torch.manual_seed(0)
        expected = build().init_from_target(placed.plain).state_dict()
        torch.manual_seed(0)
        got = build().init_from_target(placed.offloaded).state_dict()
        for key, value in expected.items():
            torch.testing.assert_close(got[key], value, msg=key)


def test_training_features_from_an_offloaded_target(placed):
    """The training caches (EAGLE-3 / DFlash / Medusa / MTP features, LayerSkip exit states) from an offloaded target
    are the in-memory target's."""
    from safetensors.torch import load_file

    from hf_specdec.training.features import FeatureShards, cache_features
    from hf_specdec.training.layerskip import exit_features

    samples = [(list(range(3, 13)), [1] * 10), (list(range(20, 27)), [1] * 7)]
    written = {}
    for name, target in (("plain", placed.plain), ("offloaded", placed.offloaded)):
        folder = cache_features(target, samples, placed.tmp / f"features_{name}", [0, 2], progress=False)
        exits = exit_features(target, FeatureShards(folder), 2, progress=False)
        written[name] = {**load_file(str(folder / "shard_00000.safetensors")), "exit": load_file(str(exits[0]))["exit"]}
    for key, value in written["plain"].items():
        torch.testing.assert_close(written["offloaded"][key], value, msg=key)


# -------------------------------------------------------------------------------------- where things go
def test_offloaded_target_devices(placed):
    target = placed.offloaded
    assert target.device.type == "meta"  # why the library never asks model.device where to put things
    assert drafter_device(target) == input_device(target) == torch.device("cpu")
    assert device_type_of(target) == "cpu"


def test_drafter_device_follows_the_device_map():
    """The decision for accelerators this machine lacks: the device map's entry for the LM head; a "cpu" or
    "disk" entry computes on the main device (the map's first other device)."""
    model = tiny_model("llama", layers=2, hidden=H)
    cases = [
        ({"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "model.norm": 1, "lm_head": "cuda:1"},
         torch.device("cuda", 1)),
        ({"": "cuda:0"}, torch.device("cuda", 0)),
        ({"model": "cuda:2", "lm_head": "cpu"}, torch.device("cuda", 2)),  # offloaded to the CPU: runs on cuda:2
        ({"model": "disk", "lm_head": "cpu"}, torch.device("cpu")),
        ({"model.embed_tokens": "mps", "model.layers": "mps", "model.norm": "mps", "model.rotary_emb": "mps",
          "lm_head": "mps"}, torch.device("mps")),
    ]
    for device_map, expected in cases:
        model.hf_device_map = device_map
        assert drafter_device(model) == expected, device_map
    model.hf_device_map = {"model": 0, "lm_head": 1}  # an index names the machine's accelerator
    assert drafter_device(model).index == 1
    model.hf_device_map = {"model": "cuda:0", "lm_head": "cuda:1"}
    assert device_type_of(model) == "cuda"
    del model.hf_device_map
    assert drafter_device(model) == torch.device("cpu")


def test_meta_weight_without_its_data_names_the_fix():
    with torch.device("meta"):
        head = torch.nn.Linear(4, 8)
    with pytest.raises(ValueError, match="meta device and no Accelerate hook.*device_map"):
        materialized(head)
