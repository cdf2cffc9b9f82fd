"""Medusa conversions: FasterDecoding's Medusa-1 heads, vLLM's Medusa and Medusa-2 full models, converted from a
local Hub cache offline (and from folders), against a plain re-implementation of the head equations written here;
the head count taken from the weights, the shared-block quirk, a Medusa-2 base split off, the errors."""

import functools
import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from hf_specdec.conversions import medusa as medusa_conv
from hf_specdec.conversions.common import ConversionError, load_converted_or_published
from hf_specdec.conversions.medusa import convert_medusa
from hf_specdec.hub_cache import write_cached_repo
from hf_specdec.modeling.medusa import MedusaHeads
from medusa_fixtures import (
    RAN,
    H,
    Payload,
    V,
    medusa2_files,
    medusa_files,
    pickled,
    random_heads,
    reference_state,
    shared_copies,
    vllm_files,
)
from tiny import tiny_model

REPO = "FasterDecoding/medusa-vicuna-7b-v1.3"


def plain_logits(heads, h, shared=False, bias=True, token_map=None):
    """Head i: x = h; for each block j: x = x + silu(x @ W_ij.T + b_ij); logits_i = x @ U_i.T -> [..., K, V].
    ``shared``: the reference's ``[ResBlock] * L``, the last block's weights applied L times."""
    out = []
    for blocks, u in heads:
        x = h
        for w, b in (blocks[-1:] * len(blocks) if shared else blocks):
            x = x + F.silu(x @ w.T + (b if bias else 0))
        out.append(x @ (u if token_map is None else u[token_map]).T)
    return torch.stack(out, dim=-2)


def rounded(heads, dtype=torch.bfloat16):
    return [([(w.to(dtype).float(), b.to(dtype).float()) for w, b in blocks], u.to(dtype).float())
            for blocks, u in heads]


def assert_heads_compute(model, heads, **plain):
    h = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(3))  # [B, T, H]
    with torch.no_grad():
        ours = model.float()(h)  # [B, T, K, Vd]
    torch.testing.assert_close(ours, plain_logits(heads, h, **plain), atol=1e-5, rtol=1e-5)


def as_folder(files, path):
    path.mkdir(parents=True)
    for name, data in files.items():
        (path / name).write_bytes(data)
    return path


# ------------------------------------------------------------------------------------------------ medusa (Medusa-1)
@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
@pytest.mark.parametrize("where", ["hub", "folder"])
def test_medusa_heads_convert_with_the_head_count_of_the_weights(hub, tmp_path, caplog, fmt, where):
    heads = random_heads(num_heads=5)
    files = medusa_files(heads, fmt=fmt, config_heads=2)  # the uploaded config says 2
    source = REPO if where == "hub" else as_folder(files, tmp_path / "src")
    if where == "hub":
        write_cached_repo(hub, REPO, files)
    with caplog.at_level("WARNING", logger="hf_specdec"):
        converted = convert_medusa(source, tmp_path / "out", dtype=torch.float32)
    assert "says medusa_num_heads=2, but the weights hold 5 heads; using 5" in caplog.text
    cfg = converted.config
    assert (cfg.medusa_num_heads, cfg.medusa_num_layers, cfg.shared_layers) == (5, 1, False)
    assert (cfg.hidden_size, cfg.vocab_size, cfg.draft_vocab_size) == (H, V, V)
    assert cfg.base_model_name_or_path == "lmsys/vicuna-7b-v1.3"
    loaded = MedusaHeads.from_pretrained(tmp_path / "out")
    assert loaded.lm_heads[0].weight.dtype == torch.float32
    assert_heads_compute(loaded, rounded(heads))  # the published weights are bf16
    # default dtype: as published
    assert convert_medusa(source).lm_heads[0].weight.dtype == torch.bfloat16


@pytest.mark.parametrize("layers", [0, 2, 3])
def test_medusa_shared_blocks_quirk(tmp_path, caplog, layers):
    """[ResBlock] * L is one block applied L times; load_state_dict(strict=False) leaves it with the last copy."""
    heads = random_heads(num_heads=3, layers=layers, seed=1)
    with caplog.at_level("WARNING", logger="hf_specdec"):
        converted = convert_medusa(as_folder(medusa_files(heads, config_heads=3), tmp_path / "differ"))
    assert converted.config.shared_layers == (layers > 1)
    assert converted.config.medusa_num_layers == max(layers, 1)
    assert ("block copies of head(s) [0, 1, 2] differ" in caplog.text) == (layers > 1)
    assert_heads_compute(converted, rounded(heads), shared=True)
    caplog.clear()
    same = shared_copies(heads)  # what the reference really saves: identical copies
    with caplog.at_level("WARNING", logger="hf_specdec"):
        converted = convert_medusa(as_folder(medusa_files(same, config_heads=3), tmp_path / "same"))
    assert "differ" not in caplog.text
    assert_heads_compute(converted, rounded(same))


# ------------------------------------------------------------------------------------------------------------ vllm
@pytest.mark.parametrize("variant", ["plain", "fc_bias_bin", "medusa_names", "original_lm_head", "token_map_full",
                                     "token_map_truncated"])
def test_vllm_layout_reads_as_vllm_does(hub, tmp_path, variant):
    heads = random_heads(num_heads=4, layers=2, seed=2)
    token_map = None
    kw = {}
    if variant == "fc_bias_bin":
        kw = dict(fc_bias=True, fmt="bin")
    elif variant == "original_lm_head":
        kw = dict(original_lm_head=True)
    elif variant.startswith("token_map"):
        token_map = torch.randperm(V, generator=torch.Generator().manual_seed(0))[:40].sort().values
        kw = dict(token_map=token_map)
    files = vllm_files(heads, **kw)
    if variant == "medusa_names":  # vLLM's MedusaConfig accepts the reference's names too
        cfg = json.loads(files["config.json"])
        cfg["medusa_num_heads"], cfg["medusa_num_layers"] = cfg.pop("num_heads"), cfg.pop("num_hidden_layers")
        files["config.json"] = json.dumps(cfg).encode()
    if variant == "token_map_truncated":  # read-outs stored with the draft vocabulary's rows only
        heads = [(blocks, u[token_map]) for blocks, u in heads]
        files = vllm_files(heads, token_map=token_map)
        files["config.json"] = json.dumps({**json.loads(files["config.json"]), "vocab_size": V}).encode()
    write_cached_repo(hub, "abhigoyal/vllm-medusa-tiny", files)
    converted = convert_medusa("abhigoyal/vllm-medusa-tiny", tmp_path / "out", dtype=torch.float32)
    loaded = MedusaHeads.from_pretrained(tmp_path / "out")
    cfg = loaded.config
    assert (cfg.medusa_num_heads, cfg.medusa_num_layers, cfg.shared_layers) == (4, 2, False)
    if variant == "original_lm_head":
        heads = [(blocks, heads[0][1]) for blocks, _ in heads]
    plain = dict(bias=variant == "fc_bias_bin")
    if variant == "token_map_full":
        plain["token_map"] = token_map
    if token_map is not None:
        assert cfg.draft_vocab_size == 40 and torch.equal(loaded.token_map, token_map)
        assert torch.equal(loaded.draft_to_target(torch.tensor([0, 39])), token_map[[0, 39]])
    assert_heads_compute(loaded, heads, **plain)
    assert_heads_compute(converted, heads, **plain)


def test_vllm_ignores_what_vllm_ignores(tmp_path, caplog):
    """Biases without medusa_fc_bias and heads beyond num_heads are not used by vLLM, so not here either (warned)."""
    heads = random_heads(num_heads=5, layers=1, seed=3)
    files = vllm_files(heads, fc_bias=True)
    cfg = json.loads(files["config.json"])
    del cfg["medusa_fc_bias"]
    cfg["num_heads"] = 3
    files["config.json"] = json.dumps(cfg).encode()
    with caplog.at_level("WARNING", logger="hf_specdec"):
        converted = convert_medusa(as_folder(files, tmp_path / "v"))
    assert "ignores the 3 bias tensors" in caplog.text and "the weights hold 5 heads" in caplog.text
    assert converted.config.medusa_num_heads == 3
    assert_heads_compute(converted, heads[:3], bias=False)


# --------------------------------------------------------------------------------------------------------- medusa2
@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
def test_medusa2_heads_and_base_split(hub, tmp_path, fmt):
    base = tiny_model("llama", hidden=H, vocab=V)
    heads = random_heads(num_heads=4, layers=1, seed=4)
    repo = "FasterDecoding/medusa-1.0-vicuna-tiny"
    write_cached_repo(hub, repo, medusa2_files(base, heads, fmt=fmt))
    converted = convert_medusa(repo, tmp_path / "heads", base_out=tmp_path / "base")
    assert converted.config.medusa_num_heads == 4
    assert_heads_compute(MedusaHeads.from_pretrained(tmp_path / "heads"), heads)
    cfg = json.loads((tmp_path / "base" / "config.json").read_text())
    assert cfg["model_type"] == "llama" and not any(k.startswith("medusa_") for k in cfg)
    assert (tmp_path / "base" / "generation_config.json").exists()
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "base" / "model.safetensors"), "pt") as f:
        assert not any(k.startswith("medusa_head.") for k in f.keys())
    ids = torch.randint(3, V, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, base(ids).logits, atol=1e-5, rtol=1e-5)
    # the heads alone (no base_out): only the head tensors are kept
    assert_heads_compute(convert_medusa(repo), heads)
    # the same through the CLI
    from hf_specdec import cli

    assert cli.main(["convert", "medusa", repo, str(tmp_path / "cli"), "--base-out", str(tmp_path / "cli_base")]) == 0
    assert_heads_compute(MedusaHeads.from_pretrained(tmp_path / "cli"), heads)
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "cli_base").config.model_type == "llama"


def test_medusa2_heads_alone_fetch_only_the_shards_holding_them(hub, monkeypatch):
    """A 7B Medusa-2 checkpoint is ~14 GB of base weights around ~1.5 GB of heads: without --base-out only the
    index and the shards it names for medusa_head.* keys are fetched."""
    heads = random_heads(num_heads=2, layers=1, seed=5)
    repo = "FasterDecoding/medusa-1.0-vicuna-tiny-sharded"
    write_cached_repo(hub, repo, medusa2_files(tiny_model("llama", hidden=H, vocab=V), heads, fmt="safetensors",
                                               shards=3, heads_last=True))
    asked = []
    real = medusa_conv.resolve_source
    monkeypatch.setattr(medusa_conv, "resolve_source",
                        lambda source, revision=None, patterns=None: asked.append(patterns) or real(source, revision,
                                                                                                       patterns))
    assert_heads_compute(convert_medusa(repo), heads)
    fetched = {p for patterns in asked for p in patterns or ["<everything>"]}
    assert "model-00003-of-00003.safetensors" in fetched
    assert not fetched & {"model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors", "*.safetensors",
                          "<everything>"}


# ---------------------------------------------------------------------------------------------- fit, round trip, load
def test_heads_that_do_not_fit_the_target_are_refused(tmp_path):
    src = as_folder(medusa_files(random_heads()), tmp_path / "src")
    tiny_model("llama", hidden=H, vocab=V).save_pretrained(tmp_path / "fits")
    assert convert_medusa(src, target=str(tmp_path / "fits")).config.hidden_size == H
    for name, kw, match in (("wider", dict(hidden=64, vocab=V), "hidden size 32 vs the target's 64"),
                            ("vocab", dict(hidden=H, vocab=128), "vocabulary 96 vs the target's 128")):
        other = tiny_model("llama", **kw)
        other.save_pretrained(tmp_path / name)
        with pytest.raises(ConversionError, match=f"do not fit the target model: (target )?{match}"):
            convert_medusa(src, target=str(tmp_path / name))
        with pytest.raises(ValueError, match=match):
            convert_medusa(src).bind_target(other)


def test_save_load_round_trip_and_auto_classes(tmp_path):
    converted = convert_medusa(as_folder(medusa_files(random_heads()), tmp_path / "src"), tmp_path / "out")
    assert AutoConfig.from_pretrained(tmp_path / "out").model_type == "hf_specdec_medusa"
    again = AutoModel.from_pretrained(tmp_path / "out")
    assert isinstance(again, MedusaHeads)
    assert again.state_dict().keys() == converted.state_dict().keys()
    for k, v in converted.state_dict().items():
        assert torch.equal(again.state_dict()[k].to(v.dtype), v)
    converted.save_pretrained(tmp_path / "twice")
    twice = MedusaHeads.from_pretrained(tmp_path / "twice")
    assert torch.equal(twice.lm_heads[4].weight.to(torch.bfloat16), converted.lm_heads[4].weight)


def test_drafter_by_repo_id_or_converted_folder_loads_in_memory(hub, tmp_path):
    """The drafter= path: a published repo id converts in memory (medusa_lm_head.pt is fetched), a converted folder
    loads with from_pretrained."""
    heads = random_heads()
    write_cached_repo(hub, REPO, medusa_files(heads))
    target = tiny_model("llama", hidden=H, vocab=V)
    load = functools.partial(load_converted_or_published, model_cls=MedusaHeads, convert=convert_medusa)
    in_memory = load(REPO, target)
    assert isinstance(in_memory, MedusaHeads) and not in_memory.training
    assert in_memory.lm_heads[0].weight.dtype == target.dtype
    assert_heads_compute(in_memory, rounded(heads))
    in_memory.save_pretrained(tmp_path / "conv")
    assert_heads_compute(load(str(tmp_path / "conv"), target), rounded(heads))


def test_revision_is_passed_through_and_only_the_needed_files_are_asked_for(hub, tmp_path, monkeypatch):
    pr_heads, main_heads = random_heads(seed=5), random_heads(seed=6)
    snapshot = write_cached_repo(hub, REPO, medusa_files(pr_heads, fmt="safetensors"))  # refs/pr/1 (Narsil's)
    refs = snapshot.parent.parent / "refs"
    (refs / "refs" / "pr").mkdir(parents=True)
    (refs / "refs" / "pr" / "1").write_text(snapshot.name)
    write_cached_repo(hub, REPO, medusa_files(main_heads, fmt="pt"))  # main
    calls = []
    real = medusa_conv.resolve_source

    def spy(source, revision=None, allow_patterns=None):
        calls.append((revision, allow_patterns))
        return real(source, revision, allow_patterns)

    monkeypatch.setattr(medusa_conv, "resolve_source", spy)
    assert_heads_compute(convert_medusa(REPO, revision="refs/pr/1"), rounded(pr_heads))
    assert calls == [("refs/pr/1", ["config.json"]), ("refs/pr/1", ["config.json", "medusa_lm_head.safetensors"])]
    calls.clear()
    assert_heads_compute(convert_medusa(REPO), rounded(main_heads))  # main has only the .pt: asked for next
    assert [p for _, p in calls] == [["config.json"], ["config.json", "medusa_lm_head.safetensors"],
                                     ["config.json", "medusa_lm_head.pt"]]


def test_cli_convert_passes_the_revision(hub, tmp_path, monkeypatch):
    from hf_specdec import cli, registry

    if "medusa" not in [m.name for m in registry.methods()]:
        pytest.skip("the medusa method is not registered yet")
    revisions = []
    real = medusa_conv.resolve_source

    def spy(source, revision=None, allow_patterns=None):
        revisions.append(revision)
        return real(source, revision, allow_patterns)

    monkeypatch.setattr(medusa_conv, "resolve_source", spy)
    snapshot = write_cached_repo(hub, REPO, medusa_files(random_heads()))
    (snapshot.parent.parent / "refs" / "v1").write_text(snapshot.name)
    assert cli.main(["convert", "medusa", REPO, str(tmp_path / "out"), "--revision", "v1"]) == 0
    assert revisions and set(revisions) == {"v1"}
    assert MedusaHeads.from_pretrained(tmp_path / "out").config.medusa_num_heads == 5


# ---------------------------------------------------------------------------------------------------------- errors
def _state(heads=None):
    return {k: v.to(torch.bfloat16) for k, v in reference_state(heads or random_heads(num_heads=2)).items()}


@pytest.mark.parametrize("problem,match", [
    ("payload", r"medusa_lm_head\.pt is incomplete, corrupt or not a plain state dict \(loaded with weights_only=True"),
    ("non_tensor", r"medusa_lm_head\.pt is not a plain state dict of tensors: step \(int\)"),
    ("truncated", r"medusa_lm_head\.safetensors is incomplete or corrupt.*download it again"),
    ("no_readout", r"head\(s\) \[0, 1\] have no read-out.*not supported"),
    ("unknown_layout", "Unknown Medusa checkpoint layout"),
    ("no_weights", r"has no weights for the medusa layout \(medusa_lm_head\.safetensors or medusa_lm_head\.pt\)"),
    ("already_converted", "already in hf_specdec's Medusa format"),
    ("vllm_missing_bias", r"lacks blocks\.0\.layers\.0\.weight or blocks\.0\.layers\.0\.bias.*medusa_fc_bias=True"),
    ("vllm_token_map", "truncated_vocab_size=40 needs a token_map"),
    ("vllm_unknown_tensor", r"unexpected tensors \['foo\.weight'\]"),
    ("vllm_logit_scale", "logit_scale=2.0 is not supported"),
    ("wrong_shape", r"tensor shapes do not match.*lm_heads\.1\.weight"),
])
def test_conversion_errors(hub, problem, match):
    files = medusa_files(random_heads(num_heads=2))
    if problem == "payload":
        files["medusa_lm_head.pt"] = pickled({**_state(), "x": Payload()})
    elif problem == "non_tensor":
        files["medusa_lm_head.pt"] = pickled({**_state(), "step": 3})
    elif problem == "truncated":
        files = medusa_files(random_heads(num_heads=2), fmt="safetensors")
        files["medusa_lm_head.safetensors"] = files["medusa_lm_head.safetensors"][:-100]
    elif problem == "no_readout":  # the legacy trainer since 2b8020f: heads read out with the target's LM head
        files["medusa_lm_head.pt"] = pickled({k: v for k, v in _state().items() if "linear" in k})
    elif problem == "unknown_layout":
        files = {"config.json": b'{"architectures": ["BertModel"], "model_type": "bert"}'}
    elif problem == "no_weights":
        del files["medusa_lm_head.pt"]
    elif problem == "already_converted":
        files["config.json"] = b'{"model_type": "hf_specdec_medusa"}'
    elif problem.startswith("vllm"):
        files = vllm_files(random_heads(num_heads=2))
        cfg = json.loads(files["config.json"])
        if problem == "vllm_missing_bias":  # the flag set, the biases not stored
            cfg["medusa_fc_bias"] = True
        elif problem == "vllm_token_map":
            cfg["truncated_vocab_size"] = 40
        elif problem == "vllm_logit_scale":
            cfg["logit_scale"] = 2.0
        else:
            from safetensors.torch import load as load_safetensors, save as save_safetensors

            state = load_safetensors(files["model.safetensors"])
            files["model.safetensors"] = save_safetensors({**state, "foo.weight": torch.zeros(2)})
        files["config.json"] = json.dumps(cfg).encode()
    else:  # wrong_shape: a read-out of another vocabulary
        state = _state()
        state["1.1.weight"] = torch.zeros(V + 1, H, dtype=torch.bfloat16)
        files["medusa_lm_head.pt"] = pickled(state)
    write_cached_repo(hub, "org/bad", files)
    with pytest.raises(ConversionError, match=match):
        convert_medusa("org/bad")
    assert not RAN  # the payload was never run


def test_argument_errors(tmp_path):
    src = as_folder(medusa_files(random_heads()), tmp_path / "src")
    with pytest.raises(ConversionError, match="Unknown layout 'eagle'; choose from medusa, vllm, medusa2"):
        convert_medusa(src, layout="eagle")
    with pytest.raises(ConversionError, match="base_out is for Medusa-2 checkpoints"):
        convert_medusa(src, base_out=tmp_path / "base")
    shutil.rmtree(src)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        convert_medusa(src)
