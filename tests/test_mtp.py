"""Multi-token prediction: the modules' equations (sequential and parallel heads), greedy losslessness across
architectures and batch shapes, training equals drafting (the depth-j rows of the loss are the chain's rows), save /
load, and the errors."""

import math

import pytest
import torch
from transformers import AutoModel
from transformers.cache_utils import DynamicCache

import hf_specdec
from hf_specdec.modeling.mtp import (
    MTPConfig,
    MTPModule,
    ParallelMTPConfig,
    ParallelMTPHeads,
    block_config_for,
)
from hf_specdec import build_proposer
from hf_specdec.training.eagle3 import _shift
from hf_specdec.training.mtp import _depth_mask, mtp_loss
from tiny import PAD, VOCAB, prompts, tiny_model

MAX_NEW = 24


def damped(arch, seed=0, layers=2, damp=0.15):
    """A tiny model whose layers change little: its next token depends mostly on the current one, so a module
    that reads the next token's embedding (and little else) predicts the token after it."""
    m = tiny_model(arch, seed=seed, layers=layers)
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.o_proj.weight.mul_(damp)
            layer.mlp.down_proj.weight.mul_(damp)
    return m


def mtp_module(model, seed=0, draft_vocab=None, agree=True, num_modules=1, noise=0.1, layout="deepseek"):
    """An MTP module for ``model``. ``agree``: its projection passes the next token's embedding and its block adds
    little, so on a :func:`damped` target it often drafts what the target says (drafts accepted and rejected)."""
    text = model.config.get_text_config()
    torch.manual_seed(seed)
    cfg = MTPConfig(block_config=block_config_for(text, num_modules), num_modules=num_modules, layout=layout,
                    vocab_size=text.vocab_size, draft_vocab_size=draft_vocab, num_target_layers=text.num_hidden_layers)
    module = MTPModule(cfg)
    if draft_vocab:
        module.set_draft_vocabulary(torch.arange(0, text.vocab_size, text.vocab_size // draft_vocab)[:draft_vocab])
    h = text.hidden_size
    with torch.no_grad():
        for k in range(num_modules):
            _, _, proj, block, out_norm = module.parts(k)
            if agree:
                proj.weight.normal_(0, noise)
                cols = slice(h, 2 * h) if layout == "mimo" else slice(0, h)
                proj.weight[:, cols] += torch.eye(h)
                block.self_attn.o_proj.weight.mul_(0.1)
                block.mlp.down_proj.weight.mul_(0.1)
                out_norm.load_state_dict(model.model.norm.state_dict())
    return module.bind_target(model).eval()


def generate(m, ids, mask, **kw):
    return m.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=None,
                      **kw)


_models = {}


def model(arch):
    if arch not in _models:
        _models[arch] = damped(arch)
    return _models[arch]


# ------------------------------------------------------------------------------------------------- equations
def _rms(x, w, eps, zero_centred=False):
    scale = (1 + w) if zero_centred else w
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * scale


def _plain_llama_block(block, x, pos, theta, eps, heads, kv):
    """A Llama decoder layer written out: pre-norm GQA attention with RoPE (causal), pre-norm SwiGLU MLP."""
    a = block.self_attn
    bsz, t, hidden = x.shape
    dim = hidden // heads
    y = _rms(x, block.input_layernorm.weight, eps)
    q = (y @ a.q_proj.weight.T).view(bsz, t, heads, dim).transpose(1, 2)
    k = (y @ a.k_proj.weight.T).view(bsz, t, kv, dim).transpose(1, 2)
    v = (y @ a.v_proj.weight.T).view(bsz, t, kv, dim).transpose(1, 2)
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim))
    ang = pos[..., None].float() * inv
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]

    def rot(z):
        return z * cos + torch.cat([-z[..., dim // 2:], z[..., :dim // 2]], -1) * sin

    q, k = rot(q), rot(k)
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(dim)
    s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    o = (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(bsz, t, hidden)
    x = x + o @ a.o_proj.weight.T
    m = block.mlp
    y = _rms(x, block.post_attention_layernorm.weight, eps)
    return x + (torch.nn.functional.silu(y @ m.gate_proj.weight.T) * (y @ m.up_proj.weight.T)) @ m.down_proj.weight.T


@pytest.mark.parametrize("layout", ["deepseek", "qwen3_next", "mimo"])
def test_module_equals_plain_equations(layout):
    target = tiny_model("llama")
    text = target.config
    module = mtp_module(target, agree=False, layout=layout)
    with torch.no_grad():  # non-trivial norms
        for name, p in module.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0, 0.3)
    ids = torch.randint(3, VOCAB, (2, 9))
    pos = torch.arange(9).expand(2, 9)
    hidden = target(ids, output_hidden_states=True).hidden_states[-1]
    logits, chain = module(ids, hidden, pos)
    e_norm, h_norm, proj, block, out_norm = module.parts(0)
    eps = text.rms_norm_eps
    e = _rms(target.model.embed_tokens(ids), e_norm.weight, eps)
    h = _rms(hidden, h_norm.weight, eps)
    x = torch.cat([h, e] if layout == "mimo" else [e, h], -1) @ proj.weight.T
    x = _plain_llama_block(block, x, pos, text.rope_parameters["rope_theta"], eps, 4, 2)
    out = _rms(x, out_norm.weight, eps)
    torch.testing.assert_close(logits, out @ target.lm_head.weight.T, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chain, out, atol=1e-5, rtol=1e-5)


def test_parallel_heads_equal_plain_equations_and_start_as_the_next_token_head():
    target = tiny_model("llama")
    text = target.config
    heads = ParallelMTPHeads(ParallelMTPConfig(block_config=block_config_for(text, 2), num_modules=2,
                                               vocab_size=VOCAB)).init_from_target(target).eval()
    ids = torch.randint(3, VOCAB, (2, 9))
    pos = torch.arange(9).expand(2, 9)
    out = target(ids, output_hidden_states=True)
    trunk = out.hidden_states[-2]
    normed = heads(trunk, pos)
    # a head started as the last layer is the target's own next-token head
    torch.testing.assert_close(heads.logits(normed[:, :, 0]), out.logits, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    normed = heads(trunk, pos)
    for i in range(2):
        x = _plain_llama_block(heads.layers[i], trunk, pos, text.rope_parameters["rope_theta"], text.rms_norm_eps,
                               4, 2)
        torch.testing.assert_close(normed[:, :, i], _rms(x, heads.norm.weight, text.rms_norm_eps),
                                   atol=1e-5, rtol=1e-5)


def test_zero_centred_norms_come_from_the_family():
    """A Gemma-3 target's module uses Gemma's (1 + w) RMSNorm: a zero weight is a unit scale."""
    target = tiny_model("gemma3")
    module = mtp_module(target, agree=False)
    e_norm = module.parts(0)[0]
    assert type(e_norm).__name__ == "Gemma3RMSNorm"
    x = torch.randn(3, 32)
    with torch.no_grad():
        e_norm.weight.zero_()
    torch.testing.assert_close(e_norm(x), _rms(x, torch.zeros(32), target.config.rms_norm_eps, zero_centred=True),
                               atol=1e-5, rtol=1e-5)


def test_save_load_and_auto_classes(tmp_path):
    target = tiny_model("qwen3")
    module = mtp_module(target, draft_vocab=48)
    ids = torch.randint(3, VOCAB, (1, 7))
    pos = torch.arange(7)[None]
    hidden = target(ids, output_hidden_states=True).hidden_states[-1]
    module.save_pretrained(tmp_path / "m")
    assert not any("embed" in k or k.startswith("head") for k in module.state_dict())  # the target's: not stored
    for loaded in (MTPModule.from_pretrained(tmp_path / "m"), AutoModel.from_pretrained(tmp_path / "m")):
        assert isinstance(loaded, MTPModule)
        loaded.bind_target(target).eval()
        torch.testing.assert_close(loaded(ids, hidden, pos)[0], module(ids, hidden, pos)[0])
        assert torch.equal(loaded.token_map, module.token_map)


# ------------------------------------------------------------------------------------------------- lossless
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("bsz", [1, 3])
@pytest.mark.parametrize("variant", ["chain3", "adaptive", "tree", "draft_vocab", "static"])
def test_greedy_matches_generate(arch, bsz, variant):
    m = model(arch)
    ids, mask = prompts(bsz, length=12, seed=bsz, repeat=False)
    kw = {"cache_implementation": "static"} if variant == "static" else {}
    ref = generate(m, ids, mask, **kw)
    module = mtp_module(m, draft_vocab=48 if variant == "draft_vocab" else None)
    opts = {"chain3": dict(num_speculative_tokens=3, draft_length_schedule="constant"), "adaptive": {},
            "tree": dict(tree_top_k=2, tree_depth=3, tree_total_tokens=6, draft_length_schedule="constant"),
            "draft_vocab": dict(num_speculative_tokens=2, draft_length_schedule="constant"),
            "static": dict(num_speculative_tokens=3, draft_length_schedule="constant")}[variant]
    out = generate(m, ids, mask, custom_generate=hf_specdec.decoding_method("mtp", drafter=module, **opts),
                   return_dict_in_generate=True, **kw)
    assert torch.equal(out.sequences, ref)
    stats = out.speculative_stats
    if variant in ("chain3", "tree", "static"):  # drafts accepted, and rejected too
        assert 0 < stats["accepted_drafts"] < stats["proposed_drafts"]


@pytest.mark.parametrize("bsz", [1, 3])
def test_parallel_heads_greedy_matches_generate(bsz):
    m = model("llama")
    ids, mask = prompts(bsz, length=12, seed=bsz, repeat=False)
    heads = ParallelMTPHeads(ParallelMTPConfig(block_config=block_config_for(m.config, 3), num_modules=3,
                                               vocab_size=VOCAB, draft_vocab_size=48))
    heads.set_draft_vocabulary(torch.arange(0, VOCAB, 2))
    heads.init_from_target(m).eval()
    ref = generate(m, ids, mask)
    for opts in ({"draft_length_schedule": "constant"}, {}, {"num_speculative_tokens": 2}):
        out = generate(m, ids, mask, custom_generate=hf_specdec.decoding_method("mtp", drafter=heads, **opts),
                       return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref)
        assert out.speculative_stats["method"] == ("mtp" if opts.get("draft_length_schedule") else "mtp+suffix")  # hybrid by default


def test_module_cache_holds_one_row_per_target_column():
    """After a call, the module's own cache mirrors the target's columns: one row per column (no draft rows)."""
    m = model("llama")
    ids, mask = prompts(1, length=12, seed=3, repeat=False)
    module = mtp_module(m)
    proposer = build_proposer("mtp", m, drafter=module, num_speculative_tokens=3,
                              draft_length_schedule="constant")
    out = generate(m, ids, mask, custom_generate=hf_specdec.decoding_method(proposer), return_dict_in_generate=True)
    assert proposer.cache.get_seq_length() == proposer.synced <= out.sequences.shape[1]
    assert proposer.features.shape[1] >= proposer.synced


# ------------------------------------------------------------------------------------------------- training
def test_training_depths_are_the_chain_rows():
    """The loss's depth-j logits of row t equal what drafting computes: the module over the context rows 0..t in its
    cache, then the chain's rows (its own output and the tokens before), one at a time."""
    target = model("llama")
    module = mtp_module(target, agree=False)
    ids = torch.randint(3, VOCAB, (1, 10))
    last = target(ids, output_hidden_states=True).hidden_states[-1]
    valid = torch.ones(1, 10, dtype=torch.bool)
    positions = torch.arange(10)[None]
    cache = DynamicCache()
    hidden, depth_logits = last, []
    for j in range(3):  # what mtp_loss runs
        logits, hidden = module(_shift(ids, 1 + j), hidden, positions + j, _depth_mask(valid, j, torch.float32),
                                cache, step=j)
        depth_logits.append(logits)
    t = 5
    cache = DynamicCache()
    logits, h = module(ids[:, 1:t + 2], last[:, :t + 1], positions[:, :t + 1], None, cache)  # context rows 0..t
    torch.testing.assert_close(logits[:, t], depth_logits[0][:, t], atol=1e-5, rtol=1e-5)
    h = h[:, -1:]
    for j in (1, 2):  # the chain row of depth j: the token x_{t+1+j} at position t + j
        logits, h = module(ids[:, t + 1 + j:t + 2 + j], h, positions[:, t + j:t + j + 1], None, cache, step=j)
        torch.testing.assert_close(logits[:, 0], depth_logits[j][:, t], atol=1e-5, rtol=1e-5)


def test_mtp_loss_learns_and_reports_depths():
    target = model("llama")
    module = mtp_module(target, agree=False)
    module.train()
    in_draft = torch.ones(VOCAB, dtype=torch.bool)
    ids = torch.randint(3, VOCAB, (2, 12))
    out = target(ids, output_hidden_states=True)
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids), "valid": torch.ones_like(ids, dtype=torch.bool),
             "last": out.hidden_states[-1].detach(), "target_argmax": out.logits.argmax(-1)}
    opt = torch.optim.Adam([p for p in module.parameters() if p.requires_grad], lr=1e-2)
    with torch.no_grad():  # the loss's floor: the target distributions' entropies, weighted as the depths are
        p = torch.softmax(out.logits, -1)
        entropy = -(p * p.log()).sum(-1)  # [B, T]: of the token after each position
        floor = sum(0.8 ** j * float(entropy[:, 1 + j:12 - 1].mean()) for j in range(3))
    losses = []
    for _ in range(40):
        loss, metrics = mtp_loss(module, in_draft, batch, depths=3)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] - floor < 0.5 * (losses[0] - floor)
    assert {"loss0", "loss2", "acc0", "acc2", "tau_chain"} <= set(metrics)
    assert all(p.grad is None for p in target.parameters())  # the target stays frozen


# ------------------------------------------------------------------------------------------------- errors
def test_module_for_another_target_is_refused():
    module = mtp_module(tiny_model("llama"))
    with pytest.raises(ValueError, match="vocabulary 96 vs the target's 64"):
        module.bind_target(tiny_model("llama", vocab=64))
    with pytest.raises(ValueError, match="hidden size 32 vs the target's 48"):
        module.bind_target(tiny_model("llama", hidden=48))
    ids, mask = prompts(1, length=8)
    with pytest.raises(ValueError, match="does not fit the target"):
        generate(tiny_model("llama", layers=3), ids, mask,
                 custom_generate=hf_specdec.decoding_method("mtp", drafter=module))


def test_several_modules_draft_with_the_first(caplog):
    """A checkpoint with K = 2 modules: the first drafts at every depth (said once), the output is the target's."""
    m = model("llama")
    module = mtp_module(m, num_modules=2)
    ids, mask = prompts(3, length=12, seed=3, repeat=False)
    with caplog.at_level("WARNING", logger="hf_specdec"):
        out = generate(m, ids, mask, custom_generate=hf_specdec.decoding_method("mtp", drafter=module,
                                                                                draft_length_schedule="constant"),
                       return_dict_in_generate=True)
    assert "has 2 modules" in caplog.text
    assert torch.equal(out.sequences, generate(m, ids, mask))
    assert out.speculative_stats["accepted_drafts"] > 0


def test_bad_options_and_configs():
    m = model("llama")
    heads = ParallelMTPHeads(ParallelMTPConfig(block_config=block_config_for(m.config, 2), num_modules=2,
                                               vocab_size=VOCAB)).init_from_target(m)
    with pytest.raises(ValueError, match="tree_"):
        build_proposer("mtp", m, drafter=heads, tree_top_k=2)
    with pytest.raises(ValueError, match=r"1\.\.2"):
        build_proposer("mtp", m, drafter=heads, num_speculative_tokens=3)
    with pytest.raises(ValueError, match="not both"):
        build_proposer("mtp", m, drafter=mtp_module(m), num_speculative_tokens=2, tree_depth=2)
    with pytest.raises(ValueError, match="layout"):
        MTPConfig(block_config=m.config.to_dict(), layout="gpt")
    with pytest.raises(ValueError, match="chain_hidden"):
        MTPConfig(block_config=m.config.to_dict(), chain_hidden="both")
    with pytest.raises(ValueError, match="model_type"):
        MTPConfig(block_config={"hidden_size": 32})
    with pytest.raises(ValueError, match="drafter"):
        generate(m, *prompts(1, length=8), custom_generate=hf_specdec.decoding_method("mtp", drafter=None))
    with pytest.raises(ValueError, match="Bind"):
        MTPModule(MTPConfig(block_config=block_config_for(m.config, 1), vocab_size=VOCAB))(
            torch.ones(1, 2, dtype=torch.long), torch.zeros(1, 2, 32), torch.arange(2)[None])
    assert PAD == 0


def test_pipeline_with_the_method_folder(tmp_path):
    """A batched text-generation pipeline with the method folder and a converted module folder."""
    from transformers import pipeline

    from tiny import word_tokenizer

    m = model("llama")
    mtp_module(m).save_pretrained(tmp_path / "m")
    pipe = pipeline("text-generation", model=m, tokenizer=word_tokenizer())
    texts = ["abcdefabcdef", "hello world! hello", "xyz"]
    kw = dict(max_new_tokens=10, do_sample=False, return_full_text=False)
    ref = pipe(texts, batch_size=3, **kw)
    out = pipe(texts, batch_size=3, **kw, custom_generate=hf_specdec.custom_generate_path("mtp"),
               trust_remote_code=True, drafter=str(tmp_path / "m"))
    assert out == ref
