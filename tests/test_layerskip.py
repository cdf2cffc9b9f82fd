"""LayerSkip self-speculation: lossless on every drivable architecture, each early layer computed once per token,
the exit adapter (equations, save/load, fit checks), and the errors."""

import pytest
import torch

import hf_specdec
from hf_specdec.modeling.layerskip import ExitAdapter, ExitAdapterConfig
from hf_specdec.stack import DecoderStack, UndrivableModelError
from tiny import PAD, VOCAB, prompts, tiny_model

MAX_NEW = 24
LAYERS = 4


def agreeable(arch, seed=0, layers=LAYERS, damp=0.15):
    """A tiny model whose later layers change little: its early exit often agrees with its output, so drafts are
    accepted at every depth and rejected too."""
    m = tiny_model(arch, seed=seed, layers=layers)
    with torch.no_grad():
        for i, layer in enumerate(m.model.layers):
            if i >= layers // 2:
                layer.self_attn.o_proj.weight.mul_(damp)
                layer.mlp.down_proj.weight.mul_(damp)
    return m


def random_adapter(model, exit_layer=2, seed=0, draft_vocab=None, mlp=True, scale=0.02):
    text = model.config.get_text_config()
    torch.manual_seed(seed)
    cfg = ExitAdapterConfig(exit_layer=exit_layer, hidden_size=text.hidden_size, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8, intermediate_size=16 if mlp else 0,
                            vocab_size=text.vocab_size, draft_vocab_size=draft_vocab or text.vocab_size,
                            num_target_layers=text.num_hidden_layers, rope_theta=10000.0)
    ids = torch.arange(0, text.vocab_size, text.vocab_size // cfg.draft_vocab_size)[:cfg.draft_vocab_size]
    adapter = ExitAdapter(cfg).init_from_target(model, ids)
    with torch.no_grad():  # away from the plain exit, a little
        for layer in adapter.layers:
            layer.o_proj.weight.normal_(0, scale)
    return adapter.eval()


def generate(m, ids, mask, **kw):
    return m.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=None,
                      **kw)


_models = {}


def model(arch):
    if arch not in _models:
        _models[arch] = agreeable(arch)
    return _models[arch]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("bsz", [1, 3])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("variant", ["chain3", "adaptive", "adapter"])
def test_greedy_matches_generate(arch, bsz, cache, variant):
    m = model(arch)
    ids, mask = prompts(bsz, length=12, seed=bsz)
    kw = {"cache_implementation": "static"} if cache == "static" else {}
    ref = generate(m, ids, mask, **kw)
    opts = {"chain3": dict(exit_layer=2, num_speculative_tokens=3), "adaptive": dict(exit_layer=1),
            "adapter": dict(drafter=random_adapter(m, draft_vocab=48), num_speculative_tokens=4)}[variant]
    out = generate(m, ids, mask, custom_generate=hf_specdec.decoding_method("layerskip"), return_dict_in_generate=True,
                   **opts, **kw)
    assert torch.equal(out.sequences, ref)
    stats = out.speculative_stats
    if variant != "adaptive":  # drafts accepted, and (in the batch) rejected too
        assert stats["accepted_drafts"] > 0
        assert bsz == 1 or stats["accepted_drafts"] < stats["proposed_drafts"]


def _count_layer_tokens(m):
    """Per layer, the number of tokens of every call, in call order."""
    calls = {i: [] for i in range(len(m.model.layers))}
    handles = [layer.register_forward_pre_hook(lambda mod, args, kw, i=i: calls[i].append(args[0].shape[1]),
                                               with_kwargs=True)
               for i, layer in enumerate(m.model.layers)]
    return calls, handles


def test_verification_runs_only_the_late_layers_for_drafted_tokens():
    m = model("llama")
    ids, mask = prompts(1, length=12, seed=4)
    exit_layer, k = 2, 3
    call = dict(custom_generate=hf_specdec.decoding_method("layerskip"), exit_layer=exit_layer,
                num_speculative_tokens=k, hybrid=False)  # LayerSkip's drafts alone
    generate(m, ids, mask, **call)  # the first call on a model times its forward sizes (calibration forwards)
    calls, handles = _count_layer_tokens(m)
    try:
        out = generate(m, ids, mask, **call, return_dict_in_generate=True)
    finally:
        for h in handles:
            h.remove()
    prompt = ids.shape[1]
    early, late = calls[0], calls[LAYERS - 1]
    assert early[0] == late[0] == prompt  # the prefill
    # late layers: one call per verification, k + 1 tokens (root + k drafts; fewer where max_new_tokens is near)
    verifications = late[1:]
    assert verifications[0] == k + 1 and all(q <= k + 1 for q in verifications), verifications
    # early layers: one-token calls only -- k - 1 drafts and the root while drafting, the last draft in verification
    assert set(early[1:]) == {1}
    assert len(early) - 1 == sum(verifications)
    # each token goes through every layer once: as many early-layer tokens as late-layer tokens
    for i in range(LAYERS):
        assert sum(calls[i]) == sum(late), i
    # the cache holds each early-layer column once: every layer as long as the committed sequence minus the root
    cache = out.cache
    lengths = {layer.keys.shape[2] for layer in cache.layers}
    assert lengths == {out.sequences.shape[1] - 1}
    assert out.speculative_stats["target_forward_passes"] == len(late)


def test_early_layer_keys_equal_a_plain_forward():
    """The keys/values drafting wrote into the shared cache are the ones a plain forward writes."""
    m = model("qwen3")
    ids, mask = prompts(1, length=10, seed=2)
    out = generate(m, ids, mask, custom_generate=hf_specdec.decoding_method("layerskip"), exit_layer=2,
                   num_speculative_tokens=3, return_dict_in_generate=True)
    seq = out.sequences[:, :-1]
    with torch.no_grad():
        plain = m(input_ids=seq, use_cache=True).cache
    for ours, ref in zip(out.cache.layers, plain.layers):
        torch.testing.assert_close(ours.keys, ref.keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ours.values, ref.values, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------------------ the adapter
def _plain_adapter(adapter, exits, positions):
    """An independent re-implementation of the adapter's equations (one sequence, causal)."""
    cfg = adapter.config
    sd = {k: v.float() for k, v in adapter.state_dict().items()}

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * w

    def rope(x):  # x [T, heads, D]
        d = x.shape[-1]
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2).float() / d))
        ang = positions[:, None].float() * inv[None]
        cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
        rot = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
        return x * cos + rot * sin

    h = exits.float()
    t = h.shape[0]
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        x = rms(h, sd[p + "input_layernorm.weight"])
        q = rope((x @ sd[p + "q_proj.weight"].T).view(t, cfg.num_attention_heads, cfg.head_dim))
        k = rope((x @ sd[p + "k_proj.weight"].T).view(t, cfg.num_key_value_heads, cfg.head_dim))
        v = (x @ sd[p + "v_proj.weight"].T).view(t, cfg.num_key_value_heads, cfg.head_dim)
        rep = cfg.num_attention_heads // cfg.num_key_value_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = torch.einsum("thd,shd->hts", q, k) / cfg.head_dim ** 0.5
        scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
        att = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(t, -1)
        h = h + att @ sd[p + "o_proj.weight"].T
        if cfg.intermediate_size:
            y = rms(h, sd[p + "post_attention_layernorm.weight"])
            gate = y @ sd[p + "gate_proj.weight"].T
            h = h + (torch.nn.functional.silu(gate) * (y @ sd[p + "up_proj.weight"].T)) @ sd[p + "down_proj.weight"].T
    return rms(h, sd["norm.weight"])


@pytest.mark.parametrize("mlp", [True, False])
def test_adapter_equals_a_plain_reimplementation(mlp):
    m = model("llama")
    adapter = random_adapter(m, mlp=mlp, scale=0.3, draft_vocab=32)
    exits = torch.randn(7, 32)
    pos = torch.arange(3, 10)
    ours = adapter(exits[None], pos[None])[0]
    ref = _plain_adapter(adapter, exits, pos)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    head = m.lm_head.weight[adapter.token_map]
    torch.testing.assert_close(adapter.logits(ours[None])[0], ref @ head.T, atol=1e-5, rtol=1e-5)
    assert torch.equal(adapter.draft_to_target(torch.tensor([0, 31])), adapter.token_map[[0, 31]])


def test_an_untrained_adapter_is_the_plain_early_exit():
    m = model("llama")
    adapter = ExitAdapter(ExitAdapterConfig(exit_layer=2, hidden_size=32, num_attention_heads=4,
                                            num_key_value_heads=2, head_dim=8, intermediate_size=16,
                                            vocab_size=VOCAB, num_target_layers=LAYERS)).init_from_target(m)
    stack = DecoderStack(m)
    exits = torch.randn(1, 5, 32)
    torch.testing.assert_close(adapter.logits(adapter(exits, torch.arange(5)[None])), stack.logits(exits),
                               atol=1e-5, rtol=1e-5)


def test_adapter_save_load_and_auto_classes(tmp_path):
    from transformers import AutoConfig, AutoModel

    m = model("llama")
    adapter = random_adapter(m, draft_vocab=48)
    adapter.save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path).exit_layer == 2
    loaded = AutoModel.from_pretrained(tmp_path)
    assert isinstance(loaded, ExitAdapter)
    assert torch.equal(loaded.token_map, adapter.token_map)
    assert not any("head" in k.split(".")[0] for k in loaded.state_dict())  # the target's head is never stored
    ids, mask = prompts(3, length=12, seed=5)
    ref = generate(m, ids, mask)
    out = generate(m, ids, mask, custom_generate=hf_specdec.decoding_method("layerskip"), drafter=str(tmp_path),
                   num_speculative_tokens=2)
    assert torch.equal(out, ref)


# ------------------------------------------------------------------------------------------------------ errors
def test_exit_layer_outside_the_model_is_refused():
    m = model("llama")
    ids, mask = prompts(1, length=8)
    for bad in (0, LAYERS, -1):
        with pytest.raises(ValueError, match="exit_layer must be in 1..3"):
            generate(m, ids, mask, custom_generate=hf_specdec.decoding_method("layerskip"), exit_layer=bad)


def test_a_model_whose_layers_cannot_be_driven_is_named():
    gpt2 = tiny_model("gpt2")
    ids, mask = prompts(1, length=8)
    with pytest.raises(UndrivableModelError, match="GPT2LMHeadModel"):
        generate(gpt2, ids, mask, custom_generate=hf_specdec.decoding_method("layerskip"), exit_layer=1)


def test_an_adapter_for_another_target_is_refused():
    m = model("llama")
    other = tiny_model("llama", hidden=48, layers=LAYERS)
    adapter = random_adapter(other)
    ids, mask = prompts(1, length=8)
    with pytest.raises(ValueError, match="hidden size 48 vs the target's 32"):
        generate(m, ids, mask, custom_generate=hf_specdec.decoding_method("layerskip"), drafter=adapter)
    deeper = random_adapter(tiny_model("llama", layers=6), exit_layer=2)
    with pytest.raises(ValueError, match="6 target layers vs the target's 4"):
        generate(m, ids, mask, custom_generate=hf_specdec.decoding_method("layerskip"), drafter=deeper)
    with pytest.raises(ValueError, match="reads layer 2's exit, not exit_layer=3"):
        generate(m, ids, mask, custom_generate=hf_specdec.decoding_method("layerskip"), drafter=adapter_for(m),
                 exit_layer=3)


def adapter_for(m):
    return random_adapter(m)


def test_adapter_config_fields_are_checked():
    with pytest.raises(ValueError, match="exit_layer 4 must be in 1..3"):
        ExitAdapterConfig(exit_layer=4, num_target_layers=4)
    with pytest.raises(ValueError, match="intermediate_size"):
        ExitAdapterConfig(exit_layer=1, num_target_layers=4, intermediate_size=-1)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        ExitAdapterConfig(exit_layer=1, num_target_layers=4, vocab_size=10, draft_vocab_size=11)


def test_exit_adapter_mode_needs_an_adapter():
    m = model("llama")
    ids, mask = prompts(1, length=8)
    with pytest.raises(ValueError, match="exit='adapter' needs an exit adapter"):
        generate(m, ids, mask, custom_generate=hf_specdec.decoding_method("layerskip"), exit="adapter")


def test_pipeline_and_hub_folder():
    from transformers import pipeline

    from tiny import word_tokenizer

    pipe = pipeline("text-generation", model=model("llama"), tokenizer=word_tokenizer())
    texts = ["abcdefabcdef", "hello world! hello", "xyz"]
    kw = dict(max_new_tokens=10, do_sample=False, return_full_text=False)
    ref = pipe(texts, batch_size=3, **kw)
    out = pipe(texts, batch_size=3, **kw, custom_generate=hf_specdec.custom_generate_path("layerskip"),
               trust_remote_code=True, exit_layer=2, num_speculative_tokens=3)
    assert out == ref
    with pytest.raises(ValueError, match="exit_layer must be in"):  # the call went through hf_specdec
        pipe(texts[0], **kw, custom_generate=hf_specdec.custom_generate_path("layerskip"), trust_remote_code=True,
             exit_layer=9)
