"""DFlash: drafter vs an independent re-implementation, z-lab layouts from a local Hub cache offline, transformers'
native Muse-Glimmer drafter on the same weights (its drafts equal transformers' speculation_type="dflash", sliding
layers included; the object and a save_pretrained checkpoint by repo id), errors, and lossless generation."""

import pytest
import torch
from transformers import AutoModel

import hf_specdec
from dflash_fixtures import H, random_weights, reference_block, zlab_config, zlab_files
from hf_specdec.conversions.common import ConversionError
from hf_specdec.conversions.dflash import MUSE_GLIMMER_NAMES, convert_dflash
from hf_specdec.hub_cache import write_cached_repo
from hf_specdec.modeling.dflash import DFlashConfig, DFlashDrafter
from tiny import prompts, tiny_model

VOCAB = 96


def _target():
    return tiny_model("llama", layers=4, hidden=H)


def _drafter(weights, layers=2, **cfg):
    config = DFlashConfig(hidden_size=H, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, block_size=4, mask_token_id=95,
                          target_layer_ids=cfg.pop("target_layer_ids", [0, 2]), num_target_layers=4, **cfg)
    drafter = DFlashDrafter(config)
    drafter.load_state_dict(weights)
    return drafter.eval()


def _compare(drafter, weights, layers=2, causal=False, window=None, sliding_layers=(), base=1_000_000.0):
    torch.manual_seed(0)
    taps = drafter.fc.weight.shape[1] // H
    feats = torch.randn(2, 6, taps * H)
    noise = torch.randn(2, 4, H)
    ctx_pos = torch.arange(6).expand(2, 6)
    block_pos = torch.arange(6, 10).expand(2, 4)
    with torch.no_grad():
        ours = drafter(noise, drafter.project(feats), block_pos, ctx_pos)
        if causal or sliding_layers:  # build the same masks the proposer builds
            n, c = 4, 6
            masks = []
            for i in range(layers):
                allowed = torch.ones(n, c + n, dtype=torch.bool)
                if drafter.config.layer_is_causal(i):
                    allowed[:, c:] = torch.ones(n, n, dtype=torch.bool).tril()
                if drafter.config.layer_types[i] == "sliding_attention":
                    kp = torch.arange(10)
                    allowed &= (torch.arange(6, 10)[:, None] - kp[None]).abs() < drafter.config.sliding_window
                masks.append(torch.zeros(1, 1, n, c + n).masked_fill(~allowed, torch.finfo(torch.float32).min))
            ours = drafter(noise, drafter.project(feats), block_pos, ctx_pos, attention_mask=masks)
    ref = reference_block({k: v.float() for k, v in weights.items()}, layers, noise, feats, ctx_pos, block_pos, base,
                          causal=causal, window=window, sliding_layers=sliding_layers)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_forward_matches_reference_equations():
    w = random_weights()
    _compare(_drafter(w), w)
    _compare(_drafter(w, causal=True), w, causal=True)


def test_save_load_round_trip(tmp_path):
    w = random_weights()
    d = _drafter(w)
    d.save_pretrained(tmp_path / "d")
    again = AutoModel.from_pretrained(tmp_path / "d")
    assert isinstance(again, DFlashDrafter)
    for k, v in d.state_dict().items():
        torch.testing.assert_close(again.state_dict()[k], v)


@pytest.mark.parametrize("revision", ["old", "new"])
def test_convert_zlab_revisions_offline(hub, tmp_path, revision):
    if revision == "old":  # 2 layers / 2 taps, flat rope_theta
        w, kw = random_weights(layers=2, taps=2), dict(layers=2, target_layer_ids=(0, 2), revision="old")
    else:  # 3 layers / 4 taps, rope_parameters, sliding layers, block_size nested
        w, kw = random_weights(layers=3, taps=4, seed=1), dict(layers=3, target_layer_ids=(0, 1, 2, 3),
                                                              revision="new", sliding=True)
    write_cached_repo(hub, f"z-lab/Tiny-DFlash-{revision}", zlab_files(w, **kw))
    tpath = tmp_path / "target"
    _target().save_pretrained(tpath)
    drafter = convert_dflash(f"z-lab/Tiny-DFlash-{revision}", tmp_path / "out", target=str(tpath), dtype=torch.float32)
    assert drafter.config.block_size == 4 and drafter.config.mask_token_id == 95
    loaded = DFlashDrafter.from_pretrained(tmp_path / "out")
    rounded = {k: v.to(torch.bfloat16).float() for k, v in w.items()}
    if revision == "old":
        _compare(loaded, rounded, layers=2)
    else:
        assert loaded.config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
        _compare(loaded, rounded, layers=3, window=3, sliding_layers=(0, 2), base=10_000_000.0)


@pytest.mark.parametrize("problem,match", [
    ("mask_outside", "outside the vocabulary"),
    ("truncated", "incomplete or corrupt.*download it again"),
    ("no_mask", "no mask_token_id"),
    ("dflash2", "DFlash 2"),
    ("wrong_shape", "shapes do not match"),
])
def test_conversion_errors(hub, problem, match):
    w = random_weights()
    kw = {}
    if problem == "mask_outside":
        kw["mask_token_id"] = 500
    files = zlab_files(w, **kw)
    if problem == "truncated":
        files["model.safetensors"] = files["model.safetensors"][:-64]
    elif problem == "no_mask":
        import json

        cfg = json.loads(files["config.json"])
        del cfg["dflash_config"]["mask_token_id"]
        files["config.json"] = json.dumps(cfg).encode()
    elif problem == "dflash2":
        files["config.json"] = __import__("json").dumps(zlab_config(conv_kernel_size=2)).encode()
    elif problem == "wrong_shape":
        w["fc.weight"] = torch.randn(H, 3 * H)
        files = zlab_files(w)
    write_cached_repo(hub, "z-lab/bad", files)
    with pytest.raises(ConversionError, match=match):
        convert_dflash("z-lab/bad")


def test_drafter_that_does_not_fit_the_target():
    d = _drafter(random_weights())
    with pytest.raises(ValueError, match="target hidden size 32 vs the target's 64"):
        d.bind_target(tiny_model("llama", layers=4, hidden=64))
    d.config.target_layer_ids = [0, 7]
    with pytest.raises(ValueError, match="out of range"):
        d.bind_target(_target())
    with pytest.raises(ValueError, match="mask_token_id 200 is outside"):
        DFlashConfig(vocab_size=96, mask_token_id=200)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "gpt2"])
@pytest.mark.parametrize("bsz", [1, 3])
def test_greedy_lossless(arch, bsz):
    target = tiny_model(arch, layers=4, hidden=H)
    drafter = _drafter(random_weights(scale=0.5))
    ids, mask = prompts(bsz, 12, seed=bsz)
    kw = dict(max_new_tokens=20, do_sample=False, eos_token_id=None)
    ref = target.generate(input_ids=ids, attention_mask=mask, **kw)
    out = target.generate(input_ids=ids, attention_mask=mask, **kw, return_dict_in_generate=True,
                          custom_generate=hf_specdec.decoding_method("dflash"), drafter=drafter,
                          draft_length_schedule="constant")
    assert torch.equal(out.sequences, ref)
    assert out.speculative_stats["proposed_drafts"] > 0


def test_entry_point_published_layout_and_static_cache(hub):
    target = _target()
    write_cached_repo(hub, "z-lab/Tiny-DFlash-b4", zlab_files(random_weights()))
    ids, mask = prompts(2, 12)
    kw = dict(max_new_tokens=14, do_sample=False, eos_token_id=None)
    ref = target.generate(input_ids=ids, attention_mask=mask, **kw)
    out = target.generate(input_ids=ids, attention_mask=mask, **kw, custom_generate=hf_specdec.custom_generate_path(
        "dflash"), trust_remote_code=True, drafter="z-lab/Tiny-DFlash-b4", cache_implementation="static")
    assert torch.equal(out, ref)


def test_native_muse_glimmer_on_the_same_weights():
    """transformers' native DFlash drafter (MuseGlimmerAssistantModel) computes the same block states on the same
    weights, and its speculation_type='dflash' path and ours both reproduce plain greedy decoding."""
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    w = random_weights()
    ours = _drafter(w)
    cfg = MuseGlimmerAssistantConfig(hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, vocab_size=VOCAB,
                                     block_size=4, mask_token_id=95, target_layer_ids=[0, 2],
                                     layer_types=["full_attention"] * 2, sliding_window=16,
                                     rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"},
                                     bos_token_id=2, eos_token_id=1, pad_token_id=0)
    native = MuseGlimmerAssistantModel(cfg).eval()
    missing, unexpected = native.load_state_dict(_muse_glimmer_names(w), strict=False)
    assert not unexpected and all("rotary" in m for m in missing)
    torch.manual_seed(0)
    feats, noise = torch.randn(1, 6, 2 * H), torch.randn(1, 4, H)
    with torch.no_grad():
        theirs = native(noise_embeds=noise, context_hidden_states=feats, position_ids=torch.arange(10)[None],
                        use_cache=False).last_hidden_state
        mine = ours(noise, ours.project(feats), torch.arange(6, 10)[None], torch.arange(6)[None])
    torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)
    target = _target()
    ids, _ = prompts(1, 12)
    ref = target.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None)
    native_out = target.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, assistant_model=native,
                                 speculation_type="dflash")
    ours_out = target.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None,
                               custom_generate=hf_specdec.decoding_method("dflash"), drafter=ours)
    assert torch.equal(native_out, ref) and torch.equal(ours_out, ref)


@pytest.mark.parametrize("bsz", [1, 2])
def test_adaptive_backs_off_from_a_drafter_that_does_not_pay(bsz, monkeypatch):
    """A drafter whose drafts are never worth verifying is run less and less often; output stays identical."""
    from hf_specdec.costs import ForwardCostModel

    # fixed forward costs (a CPU-like curve): on a tiny model a forward over k tokens costs about the same as over 1
    monkeypatch.setattr(ForwardCostModel, "record", lambda self, q, s: None)
    target = tiny_model("llama", layers=4, hidden=H)
    drafter = _drafter(random_weights(scale=0.5))
    with torch.no_grad():
        drafter.norm.weight.zero_()  # flat draft distributions: nothing is ever worth verifying
    calls = []
    drafter.register_forward_hook(lambda *a: calls.append(1))
    ids, mask = prompts(bsz, 12, seed=bsz)
    kw = dict(max_new_tokens=40, do_sample=False, eos_token_id=None)
    ref = target.generate(input_ids=ids, attention_mask=mask, **kw)
    out = target.generate(input_ids=ids, attention_mask=mask, **kw, return_dict_in_generate=True,
                          custom_generate=hf_specdec.decoding_method("dflash"), drafter=drafter,
                          hybrid=False)  # the drafter alone
    assert torch.equal(out.sequences, ref)
    assert out.speculative_stats["proposed_drafts"] <= 40 // ForwardCostModel.EXPLORE_EVERY + 1  # exploration only
    assert 0 < len(calls) <= 7  # 40 steps: a miss, then probes after 1, 2, 4, 8, 16 skipped steps


def test_adaptive_backs_off_when_drafting_costs_more_than_it_saves(monkeypatch):
    """Drafts that would be worth verifying for free are not worth it when the drafter's own time is counted."""
    from hf_specdec.costs import ForwardCostModel

    monkeypatch.setattr(ForwardCostModel, "record", lambda self, q, s: None)
    monkeypatch.setattr(ForwardCostModel, "relative", lambda self, q: 1.0)  # verification is free ...
    monkeypatch.setattr(ForwardCostModel, "step_seconds", lambda self: 1e-9)  # ... but a drafter call is not
    target = tiny_model("llama", layers=4, hidden=H)
    drafter = _drafter(random_weights(scale=0.5))
    calls = []
    drafter.register_forward_hook(lambda *a: calls.append(1))
    ids, mask = prompts(1, 12, seed=1)
    kw = dict(max_new_tokens=40, do_sample=False, eos_token_id=None)
    ref = target.generate(input_ids=ids, attention_mask=mask, **kw)
    out = target.generate(input_ids=ids, attention_mask=mask, **kw, return_dict_in_generate=True,
                          custom_generate=hf_specdec.decoding_method("dflash"), drafter=drafter,
                          hybrid=False)  # the drafter alone
    assert torch.equal(out.sequences, ref)
    assert out.speculative_stats["proposed_drafts"] > 0  # free verification: it does draft when it runs
    assert 0 < len(calls) <= 8  # but backs off: 40 steps, probes after 1, 2, 4, 8, 16 skipped steps


def test_adaptive_scores_only_the_block_positions_it_may_keep(monkeypatch):
    """The target's LM head scores the first HEAD_FIRST block positions, the rest only while a draft there could
    still be kept; the constant schedule scores the whole block. Output is plain greedy decoding either way."""
    from hf_specdec.proposers.dflash import DFlashProposer

    target = _target()
    drafter = _drafter(random_weights(scale=0.5))
    drafter.config.block_size = 8
    with torch.no_grad():
        drafter.norm.weight.zero_()  # flat draft distributions: no draft is likely
    widths = []
    head = DFlashDrafter.draft_logits
    monkeypatch.setattr(DFlashDrafter, "draft_logits", lambda self, h: widths.append(h.shape[1]) or head(self, h))
    ids, mask = prompts(1, 12, seed=5)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=None)
    ref = target.generate(**kw)
    for options, expect in (({}, {DFlashProposer.HEAD_FIRST}), ({"draft_length_schedule": "constant"}, {7})):
        widths.clear()
        out = target.generate(**kw, custom_generate=hf_specdec.decoding_method("dflash", **options), drafter=drafter)
        assert torch.equal(out, ref)
        assert widths and max(widths) == max(expect)
    monkeypatch.setattr(DFlashProposer, "HEAD_MORE", 0.0)  # every draft counts as likely: the rest is scored too
    widths.clear()
    out = target.generate(**kw, custom_generate=hf_specdec.decoding_method("dflash"), drafter=drafter)
    assert torch.equal(out, ref) and widths[:2] == [4, 3]


def _muse_glimmer_names(weights):
    """Our tensor names -> MuseGlimmerAssistantModel's (the inverse of the converter's mapping)."""
    back = {new: old for old, new in MUSE_GLIMMER_NAMES.items()}
    return {next((back[p] + k[len(p):] for p in back if k.startswith(p)), k): v for k, v in weights.items()}


def _muse_glimmer(window=5):
    """A random Muse Glimmer assistant for the 4-layer target: 3 layers, sliding / full / sliding (a window of
    ``window`` tokens, shorter than the tests' sequences), 3 taps; transformers' defaults otherwise (no vocab_size:
    the target's)."""
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    cfg = MuseGlimmerAssistantConfig(hidden_size=H, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=8, block_size=4, mask_token_id=95,
                                     target_layer_ids=[0, 1, 3], sliding_window=window,
                                     layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                     bos_token_id=2, eos_token_id=1, pad_token_id=0)
    native = MuseGlimmerAssistantModel(cfg).eval()
    missing, unexpected = native.load_state_dict(
        _muse_glimmer_names(random_weights(layers=3, taps=3, scale=0.5, seed=3)), strict=False)
    assert not missing and not unexpected
    return native


def test_muse_glimmer_drafts_equal_transformers_dflash(monkeypatch):
    """transformers' MuseGlimmerAssistantModel given as the assistant: our drafts (the block's argmax, constant
    schedule, whole block) equal DFlashTokenCandidateGenerator's candidates at prefill and after every acceptance
    pattern (0..3 of 3 drafts accepted: both loops get the same drafts forced from the reference, the drafters'
    own are recorded), with sliding layers whose window is shorter than the sequence (transformers' bidirectional
    window |q - k| <= W: without the conversion's + 1, 6 of 7 steps' drafts differed). Greedy outputs equal plain
    generate, ours also at padded batch 3."""
    from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator

    from hf_specdec.proposers.dflash import DFlashProposer

    target, native = _target(), _muse_glimmer()
    ids, _ = prompts(1, 12)
    kw = dict(max_new_tokens=24, do_sample=False, eos_token_id=None)
    ref = target.generate(ids, **kw)

    def forced(anchor, width):  # the reference's tokens after the anchor, the first wrong after anchor % 4 of them
        right = min(anchor % 4, width)
        true = [int(ref[0, q]) if q < ref.shape[1] else 3 for q in range(anchor + 1, anchor + 1 + width)]
        return torch.tensor([t if j < right else (t + 1) % VOCAB for j, t in enumerate(true)])

    ours, theirs = [], []
    block_logits, get_candidates = DFlashProposer._block_logits, DFlashTokenCandidateGenerator.get_candidates

    def our_block(self, state, hidden):
        logits = block_logits(self, state, hidden)
        if not logits.shape[1]:
            return logits
        ours.append(logits.argmax(-1)[0].tolist())
        tokens = forced(int(state.root_positions[0]), logits.shape[1]).to(logits.device)
        return torch.nn.functional.one_hot(tokens, logits.shape[-1])[None].to(logits.dtype) * 100

    def their_candidates(self, input_ids, *args, **kwargs):
        out, logits = get_candidates(self, input_ids, *args, **kwargs)
        if logits is None:  # the first iteration: no candidates yet
            return out, logits
        n = input_ids.shape[1]
        theirs.append(out[0, n:].tolist())
        return torch.cat([input_ids, forced(n - 1, out.shape[1] - n)[None]], dim=1), logits

    monkeypatch.setattr(DFlashProposer, "_block_logits", our_block)
    monkeypatch.setattr(DFlashTokenCandidateGenerator, "get_candidates", their_candidates)
    native_out = target.generate(ids, **kw, assistant_model=native, speculation_type="dflash")
    ours_out = target.generate(ids, **kw, assistant_model=native,
                               custom_generate=hf_specdec.decoding_method("dflash", draft_length_schedule="constant"))
    assert torch.equal(native_out, ref) and torch.equal(ours_out, ref)
    assert len(ours) == len(theirs) >= 6  # prefill, then steps accepting 0, 1, 2 and 3 drafts
    assert all(mine == other[:len(mine)] and len(mine) >= min(3, len(other)) for mine, other in zip(ours, theirs))
    monkeypatch.undo()
    ids, mask = prompts(3, 12, seed=3)
    ref = target.generate(input_ids=ids, attention_mask=mask, **kw)
    out = target.generate(input_ids=ids, attention_mask=mask, **kw, assistant_model=native,
                          custom_generate=hf_specdec.decoding_method("dflash"))
    assert torch.equal(out, ref)


def test_muse_glimmer_saved_by_transformers_loads_by_repo_id(hub, tmp_path):
    """A Muse Glimmer assistant written by transformers' save_pretrained (no vocab_size in its config) is read by
    repo id from a local Hub cache offline, converted for the target (its vocabulary, window + 1) to the drafter the
    object converts to, and decodes losslessly at padded batch 3."""
    import json

    from hf_specdec.conversions.dflash import as_dflash_drafter

    target, native = _target(), _muse_glimmer()
    native.save_pretrained(tmp_path / "saved")
    files = {f.name: f.read_bytes() for f in (tmp_path / "saved").iterdir()}
    assert "vocab_size" not in json.loads(files["config.json"])
    write_cached_repo(hub, "meta-models/Tiny-Muse-Glimmer-assistant", files)
    with pytest.raises(ConversionError, match="no vocab_size.*pass the target"):
        convert_dflash("meta-models/Tiny-Muse-Glimmer-assistant")
    loaded = convert_dflash("meta-models/Tiny-Muse-Glimmer-assistant", target=target)
    from_object = as_dflash_drafter(native, target)
    assert loaded.config.sliding_window == from_object.config.sliding_window == 6
    assert loaded.config.vocab_size == VOCAB and loaded.config.layer_types == native.config.layer_types
    for k, v in from_object.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v)
    assert from_object.fc.weight.data_ptr() == native.encoder.fc.weight.data_ptr()  # shared, not copied
    ids, mask = prompts(3, 12, seed=4)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=None)
    out = target.generate(**kw, custom_generate=hf_specdec.custom_generate_path("dflash"), trust_remote_code=True,
                          drafter="meta-models/Tiny-Muse-Glimmer-assistant")
    assert torch.equal(out, target.generate(**kw))


def test_auto_runs_speculation_type_dflash():
    """transformers' call generate(assistant_model=<Muse Glimmer>, speculation_type='dflash') plus
    custom_generate='hf_specdec/auto': this library's dflash method, the same text as transformers' own run (batch 1)
    and as plain greedy decoding (padded batch 3)."""
    target, native = _target(), _muse_glimmer()
    kw = dict(max_new_tokens=12, do_sample=False, eos_token_id=None)
    auto = dict(custom_generate=hf_specdec.custom_generate_path("auto"), trust_remote_code=True)
    ids, _ = prompts(1, 12)
    ref = target.generate(ids, **kw)
    assert torch.equal(target.generate(ids, **kw, assistant_model=native, speculation_type="dflash"), ref)
    out = target.generate(ids, **kw, assistant_model=native, speculation_type="dflash", **auto,
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref) and out.speculative_stats["method"] == "dflash"
    ids, mask = prompts(3, 12, seed=3)
    ref = target.generate(input_ids=ids, attention_mask=mask, **kw)
    out = target.generate(input_ids=ids, attention_mask=mask, **kw, assistant_model=native, speculation_type="dflash",
                          **auto)
    assert torch.equal(out, ref)
