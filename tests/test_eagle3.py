"""EAGLE-3: the drafter against an independent re-implementation, the three published layouts converted from a local
Hub cache offline, errors, and lossless generation (greedy across architectures and batches; sampling)."""

import pytest
import torch
from transformers import AutoConfig, AutoModel

import hf_specdec
from eagle3_fixtures import (
    H,
    reference_forward,
    random_weights,
    research_files,
    specforge_files,
    speculators_files,
)
from hf_specdec.conversions.common import ConversionError
from hf_specdec.conversions.eagle3 import convert_eagle3
from hf_specdec.hub_cache import write_cached_repo
from hf_specdec.modeling.eagle3 import Eagle3Config, Eagle3Drafter
from tiny import prompts, tiny_model

VOCAB = 96


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", layers=4, hidden=H)


def _compare_with_reference(drafter, weights, norm_before_residual=False, target_hidden=H):
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 7))
    feats = torch.randn(2, 7, 3 * target_hidden)
    pos = torch.arange(7).expand(2, 7)
    emb = torch.randn(VOCAB, H)
    drafter.embed_tokens.weight.data.copy_(emb)
    with torch.no_grad():
        logits, hidden = drafter(ids, feats, pos)
    ref_logits, ref_hidden = reference_forward({k: v.float() for k, v in weights.items()}, emb[ids], feats, pos,
                                               norm_before_residual)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(hidden, ref_hidden, atol=1e-4, rtol=1e-4)
    # deeper steps feed the drafter's own H-wide output back without fc
    with torch.no_grad():
        logits2, _ = drafter(ids, hidden, pos)
    ref2, _ = reference_forward({k: v.float() for k, v in weights.items()}, emb[ids], ref_hidden, pos,
                                norm_before_residual)
    torch.testing.assert_close(logits2, ref2, atol=1e-4, rtol=1e-4)


def _drafter_from(weights, **cfg):
    config = Eagle3Config(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                          vocab_size=VOCAB, draft_vocab_size=weights["lm_head.weight"].shape[0], num_target_layers=4,
                          **cfg)
    drafter = Eagle3Drafter(config)
    drafter.load_state_dict(weights, strict=False)
    return drafter.eval()


def test_forward_matches_reference_equations():
    w = random_weights()
    _compare_with_reference(_drafter_from(w), w)
    _compare_with_reference(_drafter_from(w, norm_before_residual=True), w, norm_before_residual=True)


def test_save_load_round_trip_without_embeddings(tmp_path, target):
    w = random_weights()
    drafter = _drafter_from(w).bind_target(target)
    drafter.save_pretrained(tmp_path / "d")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "d" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "embed_tokens.weight" not in keys and {"d2t", "t2d", "fc.weight"} <= keys
    assert AutoConfig.from_pretrained(tmp_path / "d").model_type == "hf_specdec_eagle3"
    again = AutoModel.from_pretrained(tmp_path / "d")
    assert isinstance(again, Eagle3Drafter)
    again.bind_target(target)
    for k, v in drafter.state_dict().items():
        torch.testing.assert_close(again.state_dict()[k], v)


@pytest.mark.parametrize("layout", ["research", "specforge", "speculators"])
def test_convert_published_layouts_offline(hub, tmp_path, layout, target):
    w = random_weights()
    if layout == "research":
        files, repo = research_files(w), "yuhuili/EAGLE3-Tiny"
    elif layout == "specforge":
        files, repo = specforge_files(w, aux_ids=[0, 1, 2], with_embed=True), "lmsys/SGLang-EAGLE3-Tiny"
    else:
        files, repo = speculators_files(w, aux_ids=[1, 2, 3]), "RedHatAI/Tiny-speculator.eagle3"
    write_cached_repo(hub, repo, files)
    tpath = tmp_path / "target"
    target.save_pretrained(tpath)
    drafter = convert_eagle3(repo, tmp_path / "out", target=str(tpath), dtype=torch.float32)
    assert drafter.config.draft_vocab_size == 40
    # explicit ids are read according to their origin: SpecForge counts outputs (+1), speculators HF indices
    expected_ids = {"research": [2, 2, 1], "specforge": [1, 2, 3], "speculators": [1, 2, 3]}[layout]
    assert drafter.config.layer_ids_for(4) == expected_ids
    loaded = Eagle3Drafter.from_pretrained(tmp_path / "out")
    # fp16/bf16 published weights: compare with the reference on the same (rounded) weights
    dtype = {"research": torch.float16, "specforge": torch.bfloat16, "speculators": torch.float32}[layout]
    rounded = {k: (v.to(dtype).float() if v.is_floating_point() else v) for k, v in w.items()}
    _compare_with_reference(loaded, rounded)


def test_research_layout_has_default_layers_and_base_10000(hub, tmp_path):
    write_cached_repo(hub, "yuhuili/EAGLE3-Tiny", research_files(random_weights()))
    drafter = convert_eagle3("yuhuili/EAGLE3-Tiny")
    assert drafter.config.rope_theta == 10000.0
    assert drafter.config.target_layer_ids is None  # decided from the target: [2, N//2, N-3]
    assert drafter.config.layer_ids_for(32) == [2, 16, 29]


@pytest.mark.parametrize("problem,match", [
    ("missing_d2t", "needs the d2t mapping"),
    ("truncated", "incomplete or corrupt.*download it again"),
    ("unknown_layout", "Unknown EAGLE-3 checkpoint layout"),
    ("fc_norm", "fc_norm=true"),
    ("wrong_shape", "shapes do not match"),
    ("missing_field", "lacks hidden_size"),
])
def test_conversion_errors(hub, tmp_path, problem, match):
    w = random_weights()
    if problem == "missing_d2t":
        del w["d2t"]
        files = specforge_files(w)
    elif problem == "truncated":
        files = specforge_files(w)
        files["model.safetensors"] = files["model.safetensors"][:-100]
    elif problem == "unknown_layout":
        files = research_files(w)
        files["config.json"] = b'{"architectures": ["BertModel"], "hidden_size": 32}'
    elif problem == "fc_norm":
        files = speculators_files(w, extra_flags={"fc_norm": True})
    elif problem == "wrong_shape":
        w["fc.weight"] = torch.randn(H, 2 * H)
        files = specforge_files(w)
    else:
        import json

        files = research_files(w)
        cfg = json.loads(files["config.json"])
        del cfg["hidden_size"]
        files["config.json"] = json.dumps(cfg).encode()
    write_cached_repo(hub, "org/bad", files)
    with pytest.raises(ConversionError, match=match):
        convert_eagle3("org/bad")


def test_drafter_for_another_target(tmp_path, hub):
    write_cached_repo(hub, "yuhuili/EAGLE3-Tiny", research_files(random_weights()))
    drafter = convert_eagle3("yuhuili/EAGLE3-Tiny")
    wider = tiny_model("llama", layers=4, hidden=64)
    with pytest.raises(ValueError, match="target hidden size 32 vs the target's 64"):
        drafter.bind_target(wider)
    other_vocab = tiny_model("llama", layers=4, hidden=H, vocab=128)
    with pytest.raises(ValueError, match="vocabulary 96 vs the target's 128"):
        drafter.bind_target(other_vocab)
    drafter.config.target_layer_ids = [2, 3, 9]
    with pytest.raises(ValueError, match="out of range"):
        drafter.bind_target(tiny_model("llama", layers=4, hidden=H))
    ids, _ = prompts(1, 10)
    with pytest.raises(ValueError, match="does not fit the target"):
        wider.generate(ids, max_new_tokens=4, custom_generate=hf_specdec.decoding_method("eagle3"), drafter=drafter)


# ------------------------------------------------------------------------------------------ lossless generation
def _eagle_drafter(target, seed=0, draft_vocab=40):
    w = random_weights(target_hidden=target.config.hidden_size, draft_vocab=draft_vocab, seed=seed, scale=0.5)
    return _drafter_from(w)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "gpt2"])
@pytest.mark.parametrize("bsz", [1, 3])
@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_greedy_lossless(arch, bsz, mode):
    target = tiny_model(arch, layers=4, hidden=H)
    drafter = _eagle_drafter(target)
    ids, mask = prompts(bsz, 12, seed=bsz)
    kw = dict(max_new_tokens=20, do_sample=False, eos_token_id=None)
    ref = target.generate(input_ids=ids, attention_mask=mask, **kw)
    opts = {"num_speculative_tokens": 3} if mode == "chain" else {"tree_top_k": 4, "tree_depth": 3,
                                                                    "tree_total_tokens": 12}
    opts["draft_length_schedule"] = "constant"  # drafts whatever the timings (the adaptive rule: tests/test_costs.py)
    out = target.generate(input_ids=ids, attention_mask=mask, **kw, return_dict_in_generate=True,
                          custom_generate=hf_specdec.decoding_method("eagle3"), drafter=drafter, **opts)
    assert torch.equal(out.sequences, ref)
    assert out.speculative_stats["proposed_drafts"] > 0


def test_adaptive_tree_size_follows_confidence(monkeypatch):
    """The adaptive tree verifies fewer nodes when the drafter is unsure; outputs stay identical."""
    from hf_specdec.costs import ForwardCostModel

    # fixed forward costs (a CPU-like curve): the decision must not depend on this machine's timing noise
    monkeypatch.setattr(ForwardCostModel, "record", lambda self, q, s: None)
    target = tiny_model("llama", layers=4, hidden=H)
    ids, _ = prompts(1, 12)
    kw = dict(max_new_tokens=16, do_sample=False, eos_token_id=None, return_dict_in_generate=True)
    ref = target.generate(ids, **{k: v for k, v in kw.items() if k != "return_dict_in_generate"})
    sizes = {}
    for name, scale in (("flat", 0.05), ("sharp", 3.0)):
        drafter = _eagle_drafter(target, draft_vocab=VOCAB)
        with torch.no_grad():
            drafter.lm_head.weight.mul_(scale)
        out = target.generate(ids, **kw, custom_generate=hf_specdec.decoding_method("eagle3"), drafter=drafter,
                              tree_top_k=4, tree_depth=4, tree_total_tokens=20)
        assert torch.equal(out.sequences, ref)
        stats = out.speculative_stats
        sizes[name] = stats["proposed_drafts"] / max(stats["verify_row_steps"], 1)
    assert sizes["flat"] < sizes["sharp"]


def test_full_draft_vocabulary_and_static_cache():
    target = tiny_model("llama", layers=4, hidden=H)
    w = random_weights(draft_vocab=VOCAB)
    drafter = _drafter_from({k: v for k, v in w.items() if k not in ("d2t", "t2d")})
    ids, mask = prompts(2, 12)
    kw = dict(max_new_tokens=16, do_sample=False, eos_token_id=None)
    ref = target.generate(input_ids=ids, attention_mask=mask, **kw)
    out = target.generate(input_ids=ids, attention_mask=mask, **kw, cache_implementation="static",
                          custom_generate=hf_specdec.decoding_method("eagle3"), drafter=drafter)
    assert torch.equal(out, ref)


def test_entry_by_folder_and_published_layout(hub, tmp_path):
    target = tiny_model("llama", layers=4, hidden=H)
    w = random_weights()
    write_cached_repo(hub, "RedHatAI/Tiny-speculator.eagle3", speculators_files(w))
    ids, _ = prompts(1, 12)
    kw = dict(max_new_tokens=12, do_sample=False, eos_token_id=None)
    ref = target.generate(ids, **kw)
    # a published repo id: converted in memory
    out = target.generate(ids, **kw, custom_generate=hf_specdec.custom_generate_path("eagle3"),
                          trust_remote_code=True, drafter="RedHatAI/Tiny-speculator.eagle3")
    assert torch.equal(out, ref)
    convert_eagle3("RedHatAI/Tiny-speculator.eagle3", tmp_path / "conv")
    out = target.generate(ids, **kw, custom_generate=hf_specdec.custom_generate_path("eagle3"),
                          trust_remote_code=True, drafter=str(tmp_path / "conv"), num_speculative_tokens=2)
    assert torch.equal(out, ref)


def test_eagle3_chain_in_transformers_loop():
    from hf_specdec.candidate_generators import in_transformers_loop

    target = tiny_model("llama", layers=4, hidden=H)
    drafter = _eagle_drafter(target, draft_vocab=VOCAB)
    ids, _ = prompts(1, 12)
    kw = dict(max_new_tokens=16, do_sample=False, eos_token_id=None)
    ref = target.generate(ids, **kw)
    out = target.generate(ids, **kw, custom_generate=in_transformers_loop("eagle3", num_speculative_tokens=3),
                          drafter=drafter)
    assert torch.equal(out, ref)


def test_eagle3_pipeline_and_push_to_hub(hub_upload):
    from transformers import pipeline

    from tiny import word_tokenizer

    target = tiny_model("llama", layers=4, hidden=H)
    drafter = _eagle_drafter(target)
    tok = word_tokenizer()
    pipe = pipeline("text-generation", model=target, tokenizer=tok)
    kw = dict(max_new_tokens=8, do_sample=False, return_full_text=False)
    texts = ["abcabcabc", "hello!!"]
    assert pipe(texts, batch_size=2, **kw, custom_generate=hf_specdec.custom_generate_path("eagle3"),
                trust_remote_code=True, drafter=drafter) == pipe(texts, batch_size=2, **kw)
    # push_to_hub uploads what save_pretrained writes (the upload itself is intercepted: no network here)
    drafter.push_to_hub("me/tiny-eagle3")
    assert hub_upload["repo"] == "me/tiny-eagle3"
    assert {"config.json", "model.safetensors"} <= set(hub_upload["files"])


def test_adaptive_tree_backs_off_when_drafting_cannot_pay(monkeypatch):
    """A drafter whose trees cannot pay for the drafting is run less and less often; outputs stay identical."""
    from hf_specdec.costs import ForwardCostModel

    monkeypatch.setattr(ForwardCostModel, "record", lambda self, q, s: None)
    monkeypatch.setattr(ForwardCostModel, "step_seconds", lambda self: 1e-6)  # drafting looks very expensive
    target = tiny_model("llama", layers=4, hidden=H)
    drafter = _eagle_drafter(target, draft_vocab=VOCAB)
    calls = []
    drafter.register_forward_hook(lambda *a: calls.append(1))
    for bsz in (1, 2):
        calls.clear()
        ids, mask = prompts(bsz, 12, seed=bsz)
        kw = dict(max_new_tokens=40, do_sample=False, eos_token_id=None)
        ref = target.generate(input_ids=ids, attention_mask=mask, **kw)
        out = target.generate(input_ids=ids, attention_mask=mask, **kw, return_dict_in_generate=True,
                              custom_generate=hf_specdec.decoding_method("eagle3"), drafter=drafter,
                              tree_top_k=3, tree_depth=3, tree_total_tokens=8, hybrid=False)  # the drafter alone
        assert torch.equal(out.sequences, ref)
        assert out.speculative_stats["target_forward_passes"] >= 30 and len(calls) <= 7 * 3  # 7 proposals at most (back-off)


def test_adaptive_tree_drafts_every_step_when_drafting_is_free(monkeypatch):
    from hf_specdec.costs import ForwardCostModel

    monkeypatch.setattr(ForwardCostModel, "record", lambda self, q, s: None)
    monkeypatch.setattr(ForwardCostModel, "step_seconds", lambda self: 1e6)
    target = tiny_model("llama", layers=4, hidden=H)
    drafter = _eagle_drafter(target, draft_vocab=VOCAB)
    with torch.no_grad():
        drafter.lm_head.weight.mul_(3.0)  # confident drafts
    ids, _ = prompts(1, 12)
    kw = dict(max_new_tokens=24, do_sample=False, eos_token_id=None)
    ref = target.generate(ids, **kw)
    out = target.generate(ids, **kw, return_dict_in_generate=True, drafter=drafter,
                          custom_generate=hf_specdec.decoding_method("eagle3"), tree_top_k=3, tree_depth=3,
                          tree_total_tokens=8)
    assert torch.equal(out.sequences, ref)
    stats = out.speculative_stats
    assert stats["proposed_drafts"] >= stats["target_forward_passes"] - 2


def test_tree_defaults_follow_the_targets_device():
    """On a CPU the tree defaults to 2 / 3 / 4 (small verifies and few drafter forwards pay there); elsewhere the
    reference 10 / 7 / 60. Options given explicitly win; a chain has no tree."""
    from hf_specdec.entry import build_proposer
    from hf_specdec.proposers.eagle3 import default_tree

    assert default_tree("cuda:0") == {"top_k": 10, "depth": 7, "total_tokens": 60}
    assert default_tree("cpu") == {"top_k": 2, "depth": 3, "total_tokens": 4}
    assert default_tree("cpu", torch.bfloat16) == {"top_k": 3, "depth": 4, "total_tokens": 8}  # a flat cost curve
    assert default_tree("cuda", torch.bfloat16) == default_tree("cuda")
    target = tiny_model("llama", layers=4, hidden=H)
    drafter = _eagle_drafter(target)
    p = build_proposer("eagle3", target, drafter=drafter, hybrid=False)
    assert (p.top_k, p.depth, p.total_tokens, p.max_nodes, p.chain) == (2, 3, 4, 4, None)
    p = build_proposer("eagle3", target, drafter=drafter, tree_top_k=5, tree_total_tokens=9, hybrid=False)
    assert (p.top_k, p.depth, p.total_tokens) == (5, 3, 9)
    p = build_proposer("eagle3", target, drafter=drafter, num_speculative_tokens=3, hybrid=False)
    assert (p.chain, p.max_nodes) == (3, 4)


def test_the_loop_gives_the_drafter_the_cpu_kernels(monkeypatch):
    """The drafter's linears run with the CPU kernels during the call (patched, then restored); output unchanged."""
    from hf_specdec import kernels

    target = tiny_model("llama", layers=4, hidden=H)
    drafter = _eagle_drafter(target)
    seen = []
    real = kernels.VerifyKernels.__enter__

    def spy(self):
        out = real(self)
        seen.append([m for m in self.linears if any(m is d for d in drafter.modules())])
        return out

    monkeypatch.setattr(kernels.VerifyKernels, "__enter__", spy)  # what the CPU kernel runner installs per call
    ids, mask = prompts(2, 12, seed=5)
    kw = dict(max_new_tokens=16, do_sample=False, eos_token_id=None)
    ref = target.generate(input_ids=ids, attention_mask=mask, **kw)
    for opts in ({}, {"num_speculative_tokens": 3}):
        out = target.generate(input_ids=ids, attention_mask=mask, **kw, drafter=drafter, **opts,
                              custom_generate=hf_specdec.decoding_method("eagle3"))
        assert torch.equal(out, ref)
    assert len(seen) == 2 and all(len(s) >= 5 for s in seen)  # fc, q/k/v/o, mlp, lm_head
    assert all("forward" not in m.__dict__ for m in drafter.modules())
