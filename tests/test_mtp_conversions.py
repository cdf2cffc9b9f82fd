"""MTP conversions: the MTP layers of DeepSeek-V3 (also FP8), GLM-4 MoE, Qwen3-Next, Qwen3.5 and MiMo checkpoints,
converted through the real converter from a local Hub cache offline, against plain re-implementations of each
layout's equations written here and against transformers' own MtpModel; only the MTP shard is fetched, the revision
is pinned, the errors name what was looked for, and a converted module saves and loads."""

import functools
import json

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, Qwen2ForCausalLM

from hf_specdec.conversions.common import ConversionError, load_converted_or_published
from hf_specdec.conversions.mtp import LAYOUTS, convert_mtp, detect_layout, mimo_main_config
from hf_specdec.hub_cache import write_cached_repo
from hf_specdec.modeling.mtp import MTPModule
from mtp_fixtures import INDEX, FakeHub, H, V, checkpoint, deepseek_checkpoint, sharded_files
from tiny import tiny_model

REPOS = {"deepseek_v3": "deepseek-ai/DeepSeek-V3-tiny", "glm4_moe": "zai-org/GLM-4.5-Air-tiny",
         "qwen3_next": "Qwen/Qwen3-Next-tiny", "qwen3_5": "Qwen/Qwen3.5-tiny", "mimo": "XiaomiMiMo/MiMo-7B-tiny"}
MTP_SHARD = "model-00003-of-00003.safetensors"


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matrices: one intra-op thread is faster, and far faster on a busy machine (no OpenMP spin-waits)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------- plain reference equations
def rms(x, w, eps, centred):
    """RMSNorm written out: x * rsqrt(mean(x^2) + eps) * w (Qwen3-Next / Qwen3.5: * (1 + w))."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * ((1 + w) if centred else w)


def causal_mask(batch, length):
    mask = torch.full((length, length), torch.finfo(torch.float32).min).triu(1)
    return mask[None, None].expand(batch, 1, length, length)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def plain_qwen2_block(x, w, config, pos):
    """A Qwen2 decoder layer written out (MiMo's MTP block): pre-norm attention with q/k/v biases, RoPE (theta from
    the config), grouped KV heads, causal softmax, then a SwiGLU MLP, both residual."""
    eps, heads, kv = config["rms_norm_eps"], config["num_attention_heads"], config["num_key_value_heads"]
    b, t, h = x.shape
    hd = h // heads
    y = rms(x, w["input_layernorm.weight"], eps, False)

    def proj(name, n):
        return (y @ w[f"self_attn.{name}_proj.weight"].T + w[f"self_attn.{name}_proj.bias"]).view(b, t, n, hd)

    q, k, v = proj("q", heads).transpose(1, 2), proj("k", kv).transpose(1, 2), proj("v", kv).transpose(1, 2)
    inv_freq = 1.0 / (config["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))
    angles = pos[..., None].float() * inv_freq  # [B, T, hd/2]
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    k, v = k.repeat_interleave(heads // kv, dim=1), v.repeat_interleave(heads // kv, dim=1)
    scores = q @ k.transpose(-1, -2) / hd ** 0.5 + causal_mask(b, t)
    att = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, heads * hd)
    x = x + att @ w["self_attn.o_proj.weight"].T
    y = rms(x, w["post_attention_layernorm.weight"], eps, False)
    gate, up = y @ w["mlp.gate_proj.weight"].T, y @ w["mlp.up_proj.weight"].T
    return x + (torch.nn.functional.silu(gate) * up) @ w["mlp.down_proj.weight"].T


def plain_module(fx, k, target, next_ids, hidden, pos):
    """Module k: x = proj(cat([norm_e(embed(x_{t+1})), norm_h(h_t)])) (MiMo: hidden first); x = block(x);
    out = norm_out(x); logits = lm_head(out). Returns (logits, out)."""
    m, eps, centred = fx.modules[k], fx.eps, fx.centred
    emb = rms(target.get_input_embeddings().weight[next_ids], m["emb_norm"], eps, centred)
    hid = rms(hidden, m["hid_norm"], eps, centred)
    x = torch.cat([hid, emb] if fx.layout == "mimo" else [emb, hid], dim=-1) @ m["proj"].T
    if fx.layout == "mimo":
        x = plain_qwen2_block(x, m["block"], fx.config, pos)
    else:
        # MLA / MoE / gated-attention blocks: transformers' own decoder-layer class of the family, holding the
        # fixture's (un-wrapped) weights, with the target's rotary embedding and an explicit causal mask
        rope = target.model.rotary_emb(x, pos)
        x = m["block"](x, attention_mask=causal_mask(*x.shape[:2]), position_embeddings=rope, position_ids=pos)
        x = x[0] if isinstance(x, tuple) else x
    out = rms(x, m["out_norm"], eps, centred)
    return out @ target.get_output_embeddings().weight.T, out


def load_target(kind, repo):
    if kind == "mimo":  # MiMo's main model without its remote code: a Qwen2ForCausalLM
        return Qwen2ForCausalLM.from_pretrained(repo, config=mimo_main_config(repo)).eval()
    return AutoModelForCausalLM.from_pretrained(repo).eval()


def inputs(batch=2, length=8, seed=0):
    ids = torch.randint(3, V, (batch, length), generator=torch.Generator().manual_seed(seed))
    return ids, torch.arange(1, length).expand(batch, -1)  # positions of x_{t+1}


def assert_matches_plain(module, fx, target):
    """Every module k of ``module`` (bound to ``target``) against the plain equations, fp32, <= 1e-5."""
    ids, pos = inputs()
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states[-1]  # post final norm
        for k in range(len(fx.modules)):
            logits, out = module(ids[:, 1:], hidden[:, :-1], pos, step=k)
            ref_logits, ref_out = plain_module(fx, k, target, ids[:, 1:], hidden[:, :-1], pos)
            assert logits.shape == (2, 7, V)
            torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------------- the layouts
@pytest.mark.parametrize("kind,num_mtp", [("deepseek_v3", 1), ("deepseek_v3", 2), ("glm4_moe", 1), ("qwen3_next", 1),
                                          ("qwen3_5", 1), ("mimo", 1)])
def test_converted_module_computes_the_layout_equations(hub, kind, num_mtp):
    fx = checkpoint(kind, num_mtp=num_mtp)
    repo = REPOS[kind]
    write_cached_repo(hub, repo, fx.files)
    target = load_target(kind, repo)
    ids, _ = inputs()
    with torch.no_grad():  # the target as published loads as the model the fixture wrote
        torch.testing.assert_close(target(ids).logits, fx.target(ids).logits, atol=1e-5, rtol=1e-5)
    module = convert_mtp(repo, dtype=torch.float32, target=repo)
    cfg = module.config
    assert (cfg.layout, cfg.num_modules, cfg.num_target_layers, cfg.vocab_size, cfg.hidden_size) == (
        fx.layout, num_mtp, fx.num_target_layers, V, H)
    assert cfg.base_model_name_or_path == repo and not module.training
    assert not any(k.endswith(("embed_tokens.weight", "shared_head.head.weight")) for k in module.state_dict())
    assert_matches_plain(module.bind_target(target), fx, target)


@pytest.mark.parametrize("block", [(128, 128), (16, 16)])
def test_fp8_block_scaled_weights_are_dequantized(hub, tmp_path, block):
    """DeepSeek-V3's release: MTP block weights float8_e4m3fn with weight_scale_inv per block (the config's
    weight_block_size; 16 x 16 here crops blocks at the edges of 24-wide weights), the rest bf16."""
    from safetensors import safe_open

    fx = deepseek_checkpoint(fp8_block=block)
    repo = REPOS["deepseek_v3"]
    snapshot = write_cached_repo(hub, repo, fx.files)
    with safe_open(str(snapshot / MTP_SHARD), "pt") as f:
        assert f.get_tensor("model.layers.2.mlp.experts.0.gate_proj.weight").dtype == torch.float8_e4m3fn
        scale = f.get_tensor("model.layers.2.mlp.experts.0.gate_proj.weight_scale_inv")
        assert tuple(scale.shape) == ((1, 1) if block[0] == 128 else (2, 2))
    assert_matches_plain(convert_mtp(repo, dtype=torch.float32).bind_target(fx.target), fx, fx.target)
    default = convert_mtp(repo, out=tmp_path / "out")  # the published dtype: FP8 -> bf16; the router stays fp32
    again = MTPModule.from_pretrained(tmp_path / "out")
    for module in (default, again):  # as transformers keeps DeepSeek's router
        layer = module.layers[0]
        assert layer.mlp.experts.gate_up_proj.dtype == layer.eh_proj.weight.dtype == torch.bfloat16
        assert layer.mlp.gate.weight.dtype == layer.mlp.gate.e_score_correction_bias.dtype == torch.float32
    ids, pos = inputs()
    with torch.no_grad():
        hidden = fx.target(ids, output_hidden_states=True).hidden_states[-1][:, :-1]
        assert torch.equal(default.bind_target(fx.target)(ids[:, 1:], hidden, pos)[0],
                           again.bind_target(fx.target)(ids[:, 1:], hidden, pos)[0])


# ---------------------------------------------------------------------------------- against transformers' MtpModel
@pytest.mark.parametrize("kind", ["deepseek_v3", "glm4_moe"])
def test_same_logits_and_drafts_as_transformers_mtp_model(hub, monkeypatch, kind):
    """transformers' native MTP path (MtpModel, generate(use_mtp=True)) exists for DeepSeek-V3 and GLM-4 MoE; for
    Qwen3-Next, Qwen3.5 and MiMo transformers 5.24 has none (no num_mtp_layers / get_mtp_config for them, MiMo is
    remote code), so there is nothing to compare with there."""
    from transformers.generation.candidate_generator import MTPCandidateGenerator
    from transformers.modeling_layers import MtpModel

    fx = checkpoint(kind)
    repo = REPOS[kind]
    write_cached_repo(hub, repo, fx.files)
    cls = type(fx.target)
    # the class names the real checkpoints' MTP layer (61; GLM 92 / 46): point it at the tiny one's N
    monkeypatch.setattr(cls, "_keys_to_ignore_on_load_unexpected", [rf"model\.layers\.{fx.num_target_layers}.*"])
    target = cls.from_pretrained(repo).eval()
    native = MtpModel.from_pretrained(target).eval()
    ours = convert_mtp(repo, dtype=torch.float32).bind_target(target)
    ids, pos = inputs(batch=1, length=9, seed=3)
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states[-1]
        theirs = native.forward_layer(0, hidden[:, :-1], pos, None, input_ids=ids[:, 1:])
        logits, out = ours(ids[:, 1:], hidden[:, :-1], pos)
        torch.testing.assert_close(logits, native._project_to_logits(theirs).float(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out, theirs, atol=1e-5, rtol=1e-5)
        drafted, _, _ = native(input_ids=ids[:, 1:], last_hidden_states=hidden[:, :-1], attention_mask=None,
                               position_ids=pos, mtp_cache=None)
    assert torch.equal(drafted[:, 0], logits[:, -1].argmax(-1))

    # generate(use_mtp=True): the first candidate transformers drafts is the one our module drafts
    seen = []
    real = MTPCandidateGenerator.get_candidates

    def spy(self, input_ids, model_kwargs, model_outputs, is_first_iteration, n_last_matches, **kw):
        result = real(self, input_ids, model_kwargs, model_outputs, is_first_iteration, n_last_matches, **kw)
        if not is_first_iteration:
            seen.append((input_ids.clone(), result[0][:, input_ids.shape[1]:].clone()))
        return result

    monkeypatch.setattr(MTPCandidateGenerator, "get_candidates", spy)
    with torch.no_grad():
        generated = target.generate(ids, max_new_tokens=3, do_sample=False, use_mtp=True)
        assert torch.equal(generated, target.generate(ids, max_new_tokens=3, do_sample=False))
        prefix, candidate = seen[0]
        hidden = target(prefix, output_hidden_states=True).hidden_states[-1]
        n = prefix.shape[1]
        logits, _ = ours(prefix[:, 1:], hidden[:, :-1], torch.arange(1, n)[None])
    assert torch.equal(candidate[:, 0], logits[:, -1].argmax(-1))


# ------------------------------------------------------------------------------------------- what is fetched, where
@pytest.mark.parametrize("kind", ["deepseek_v3", "qwen3_5", "mimo"])
def test_only_the_mtp_shard_is_fetched(hub, tmp_path, monkeypatch, kind):
    fx = checkpoint(kind)
    repo = REPOS[kind]
    fake = FakeHub(tmp_path / "remote", hub)
    commit = fake.add(repo, fx.files)
    monkeypatch.setattr("huggingface_hub.snapshot_download", fake.snapshot_download)
    module = convert_mtp(repo, dtype=torch.float32)
    snapshot = hub / f"models--{repo.replace('/', '--')}" / "snapshots" / commit
    assert sorted(p.name for p in snapshot.iterdir()) == sorted(["config.json", INDEX, MTP_SHARD])
    assert fake.calls == [(repo, None, ["config.json", INDEX]), (repo, commit, ["config.json", INDEX, MTP_SHARD])]
    assert_matches_plain(module.bind_target(fx.target), fx, fx.target)


def test_an_unsharded_checkpoint_is_fetched_whole(hub, tmp_path, monkeypatch, caplog):
    fx = deepseek_checkpoint(single=True)
    repo = REPOS["deepseek_v3"]
    fake = FakeHub(tmp_path / "remote", hub)
    commit = fake.add(repo, fx.files)
    monkeypatch.setattr("huggingface_hub.snapshot_download", fake.snapshot_download)
    with caplog.at_level("INFO", logger="hf_specdec"):
        module = convert_mtp(repo, dtype=torch.float32)
    assert f"{repo} has no {INDEX}: fetching the whole model.safetensors" in caplog.text
    assert fake.calls[-1] == (repo, commit, ["config.json", "model.safetensors"])
    assert_matches_plain(module.bind_target(fx.target), fx, fx.target)


def test_the_revision_is_pinned(hub, tmp_path, monkeypatch):
    """Two revisions: main and the tag v1 hold different MTP weights; converting at v1 reads v1's, every file from
    the commit v1 resolved to."""
    repo = REPOS["qwen3_next"]
    new, old = checkpoint("qwen3_next", seed=5), checkpoint("qwen3_next", seed=0)
    fake = FakeHub(tmp_path / "remote", hub)
    main_commit = fake.add(repo, new.files)
    v1_commit = fake.add(repo, old.files, ref="v1")
    assert main_commit != v1_commit
    monkeypatch.setattr("huggingface_hub.snapshot_download", fake.snapshot_download)
    at_v1 = convert_mtp(repo, revision="v1", dtype=torch.float32)
    assert fake.calls == [(repo, "v1", ["config.json", INDEX]), (repo, v1_commit, ["config.json", INDEX, MTP_SHARD])]
    assert torch.equal(at_v1.fc.weight, old.modules[0]["proj"])
    assert_matches_plain(at_v1.bind_target(old.target), old, old.target)
    at_main = convert_mtp(repo, dtype=torch.float32)
    assert torch.equal(at_main.fc.weight, new.modules[0]["proj"])
    # the same from the offline Hub cache itself (huggingface_hub resolves the tag)
    assert torch.equal(convert_mtp(repo, revision=v1_commit, dtype=torch.float32).fc.weight, old.modules[0]["proj"])


# ---------------------------------------------------------------------------------------------------------- errors
def _variant(fx, problem):
    """The fixture's files with one problem."""
    cfg, mtp = json.loads(json.dumps(fx.config)), dict(fx.mtp)
    n = fx.num_target_layers
    if problem == "no_mtp":
        cfg["num_nextn_predict_layers"], mtp = 0, {}
    elif problem == "stripped":
        mtp = {}
    elif problem == "missing_key":
        del mtp[f"model.layers.{n}.enorm.weight"]
    elif problem == "unexpected_key":
        mtp[f"model.layers.{n}.foo.weight"] = torch.zeros(3)
    elif problem == "wrong_shape":
        mtp[f"model.layers.{n}.eh_proj.weight"] = torch.zeros(H, 2 * H + 1)
    elif problem == "more_modules":
        mtp.update({k.replace(f"model.layers.{n}.", f"model.layers.{n + 1}."): v.clone() for k, v in fx.mtp.items()})
    files = sharded_files(cfg, fx.main, mtp)
    if problem == "truncated":
        files[MTP_SHARD] = files[MTP_SHARD][:-100]
    elif problem == "missing_shard":
        del files[MTP_SHARD]
    elif problem == "already_converted":
        files["config.json"] = b'{"model_type": "hf_specdec_mtp"}'
    return files


@pytest.mark.parametrize("problem,match", [
    ("no_mtp", r"no MTP layers: config\.json has num_nextn_predict_layers=0 \(looked for num_nextn_predict_layers, "
               r"num_mtp_layers, mtp_num_hidden_layers\), and it holds no model\.layers\.2\.\* tensors"),
    ("stripped", r"says num_nextn_predict_layers=1, but the checkpoint holds no model\.layers\.2\.\* tensors"),
    ("truncated", r"model-00003-of-00003\.safetensors is incomplete or corrupt.*download it again"),
    ("missing_shard", r"model\.safetensors\.index\.json names model-00003-of-00003\.safetensors for \d+ MTP "
                      r"tensor\(s\).*has no such file"),
    ("missing_key", r"missing tensors layers\.0\.enorm\.weight"),
    ("unexpected_key", r"unexpected tensors model\.layers\.2\.foo\.weight"),
    ("wrong_shape", r"another shape model\.layers\.2\.eh_proj\.weight \[32, 65\] \(the config makes \[32, 64\]\)"),
    ("more_modules", r"holds 2 MTP modules, config\.json says num_nextn_predict_layers=1"),
    ("already_converted", r"already in hf_specdec's MTP format: load it with MTPModule\.from_pretrained"),
])
def test_conversion_errors(hub, problem, match):
    write_cached_repo(hub, "org/bad", _variant(checkpoint("deepseek_v3"), problem))
    with pytest.raises(ConversionError, match=match):
        convert_mtp("org/bad")


def test_a_checkpoint_of_a_model_without_mtp_names_what_was_looked_for(tmp_path):
    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "llama")
    with pytest.raises(ConversionError, match=r"no MTP layers: config\.json has no num_nextn_predict_layers / "
                                              r"num_mtp_layers / mtp_num_hidden_layers .*no model\.layers\.2\.\* "
                                              r"tensors \(looked for model\.layers\.2\.\*, mtp\.\* and "
                                              r"model\.mtp_layers\.\*\)"):
        convert_mtp(tmp_path / "llama")


def test_a_module_for_another_target_is_refused(hub, tmp_path):
    fx = checkpoint("mimo")
    write_cached_repo(hub, REPOS["mimo"], fx.files)
    tiny_model("qwen2").save_pretrained(tmp_path / "fits")  # hidden 32, vocabulary 96, 2 layers
    assert convert_mtp(REPOS["mimo"], target=str(tmp_path / "fits")).config.hidden_size == H
    for name, kw, match in (("wider", dict(hidden=64), "target hidden size 32 vs the target's 64"),
                            ("vocab", dict(vocab=128), "vocabulary 96 vs the target's 128")):
        other = tiny_model("qwen2", **kw)
        other.save_pretrained(tmp_path / name)
        with pytest.raises(ConversionError, match=f"does not fit the target model: .*{match}"):
            convert_mtp(REPOS["mimo"], target=str(tmp_path / name))
        with pytest.raises(ValueError, match=match):
            convert_mtp(REPOS["mimo"]).bind_target(other)


def test_argument_errors_and_layout_detection(tmp_path):
    with pytest.raises(ConversionError, match="Unknown layout 'eagle'; choose from deepseek, qwen3_next, mimo"):
        detect_layout({"num_hidden_layers": 2}, layout="eagle")
    assert LAYOUTS == ("deepseek", "qwen3_next", "mimo")
    cases = {"deepseek": checkpoint("deepseek_v3").config, "qwen3_next": checkpoint("qwen3_5").config,
             "mimo": checkpoint("mimo").config}
    for layout, cfg in cases.items():
        found, info = detect_layout(cfg)
        assert found == layout and info.num_modules == 1 and info.num_target_layers == 2
    _, info = detect_layout(cases["qwen3_next"])
    assert info.count_field == "mtp_num_hidden_layers" and info.key_pattern == "mtp.*"
    assert info.match("mtp.layers.0.self_attn.q_proj.weight") == (0, "layers.0.self_attn.q_proj.weight")
    assert info.match("mtp.fc.weight") == (None, "fc.weight") and info.match("model.language_model.norm.weight") is None
    _, info = detect_layout(cases["deepseek"])
    assert info.match("model.layers.2.enorm.weight") == (0, "layers.0.enorm.weight")
    assert info.match("model.layers.1.mlp.gate.weight") is None
    with pytest.raises(FileNotFoundError, match="does not exist"):
        convert_mtp(tmp_path / "nothing")


# -------------------------------------------------------------------------------------------------- save and load
@pytest.mark.parametrize("kind", ["deepseek_v3", "qwen3_next", "mimo"])
def test_save_load_round_trip_and_auto_classes(hub, tmp_path, kind):
    fx = checkpoint(kind)
    repo = REPOS[kind]
    write_cached_repo(hub, repo, fx.files)
    converted = convert_mtp(repo, out=tmp_path / "out")  # the published dtype (fp32 here)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["model_type"] == "hf_specdec_mtp" and cfg["layout"] == fx.layout
    again = MTPModule.from_pretrained(tmp_path / "out")
    auto = AutoModel.from_pretrained(tmp_path / "out")
    assert isinstance(auto, MTPModule)
    assert again.state_dict().keys() == converted.state_dict().keys()
    ids, pos = inputs()
    with torch.no_grad():
        hidden = fx.target(ids, output_hidden_states=True).hidden_states[-1][:, :-1]
        expected = converted.bind_target(fx.target)(ids[:, 1:], hidden, pos)[0]
        for loaded in (again, auto):
            assert torch.equal(loaded.eval().bind_target(fx.target)(ids[:, 1:], hidden, pos)[0], expected)
    with pytest.raises(ConversionError, match="already in hf_specdec's MTP format"):
        convert_mtp(tmp_path / "out")


def test_drafter_by_repo_id_or_converted_folder(hub, tmp_path):
    """The drafter= path: a published repo id converts in memory (in the target's dtype), a converted folder loads
    with from_pretrained."""
    fx = checkpoint("glm4_moe")
    write_cached_repo(hub, REPOS["glm4_moe"], fx.files)
    load = functools.partial(load_converted_or_published, model_cls=MTPModule, convert=convert_mtp)
    in_memory = load(REPOS["glm4_moe"], fx.target)
    assert isinstance(in_memory, MTPModule) and not in_memory.training
    assert in_memory.layers[0].eh_proj.weight.dtype == fx.target.dtype
    assert_matches_plain(in_memory.bind_target(fx.target), fx, fx.target)
    in_memory.save_pretrained(tmp_path / "conv")
    assert_matches_plain(load(str(tmp_path / "conv"), fx.target).bind_target(fx.target), fx, fx.target)


# --------------------------------------------------------------------------------------------- end to end
def test_convert_command(hub, tmp_path):
    """``hf-specdec convert mtp <repo> <out>``: the registry's converter, from the local Hub cache."""
    from hf_specdec import cli

    fx = checkpoint("deepseek_v3")
    write_cached_repo(hub, REPOS["deepseek_v3"], fx.files)
    assert cli.main(["convert", "mtp", REPOS["deepseek_v3"], str(tmp_path / "out"), "--dtype", "float32"]) == 0
    assert_matches_plain(MTPModule.from_pretrained(tmp_path / "out").bind_target(fx.target), fx, fx.target)


@pytest.mark.parametrize("kind", ["deepseek_v3", "glm4_moe", "mimo"])
def test_published_module_drafts_losslessly_for_its_own_target(hub, kind):
    """The published layout end to end: the target of the checkpoint (DeepSeek-V3's MLA / MoE, GLM-4 MoE, MiMo as
    Qwen2) drafting with its own MTP layer by repo id, greedy output identical to its plain generate()."""
    import hf_specdec

    fx = checkpoint(kind)
    write_cached_repo(hub, REPOS[kind], fx.files)
    ids = torch.randint(3, V, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # a padded row
    kw = dict(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=12, eos_token_id=None,
              pad_token_id=0)
    ref = fx.target.generate(**kw)
    out = fx.target.generate(**kw, custom_generate=hf_specdec.decoding_method("mtp", drafter=REPOS[kind],
                                                                               draft_length_schedule="constant"),
                             return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.speculative_stats["proposed_drafts"] > 0
