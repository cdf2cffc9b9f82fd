"""Synthetic EAGLE-3 checkpoints in the three published layouts, and an independent plain re-implementation of the
reference equations (SafeAILab/EAGLE eagle/model/cnets.py) to compare logits against."""

from __future__ import annotations

import io
import json
import math

import torch
from safetensors.torch import save as save_safetensors

H, HEADS, KV, INTER = 32, 4, 2, 64
HD = H // HEADS


def random_weights(target_hidden=H, vocab=96, draft_vocab=40, seed=0, scale=0.3):
    """Reference-named tensors (``midlayer.*``) of a tiny drafter, with a draft vocabulary of ``draft_vocab``."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g) * scale

    w = {
        "fc.weight": r(H, 3 * target_hidden),
        "midlayer.input_layernorm.weight": 1 + r(H) * 0.1,
        "midlayer.hidden_norm.weight": 1 + r(H) * 0.1,
        "midlayer.self_attn.q_proj.weight": r(HEADS * HD, 2 * H),
        "midlayer.self_attn.k_proj.weight": r(KV * HD, 2 * H),
        "midlayer.self_attn.v_proj.weight": r(KV * HD, 2 * H),
        "midlayer.self_attn.o_proj.weight": r(H, HEADS * HD),
        "midlayer.post_attention_layernorm.weight": 1 + r(H) * 0.1,
        "midlayer.mlp.gate_proj.weight": r(INTER, H),
        "midlayer.mlp.up_proj.weight": r(INTER, H),
        "midlayer.mlp.down_proj.weight": r(H, INTER),
        "norm.weight": 1 + r(H) * 0.1,
        "lm_head.weight": r(draft_vocab, H) * 3,
    }
    used = sorted(torch.randperm(vocab, generator=g)[:draft_vocab].tolist())
    w["d2t"] = torch.tensor([t - i for i, t in enumerate(used)], dtype=torch.long)
    w["t2d"] = torch.zeros(vocab, dtype=torch.bool)
    w["t2d"][used] = True
    return w


def llama_like_config(vocab=96, draft_vocab=40, **extra):
    cfg = {"architectures": ["LlamaForCausalLM"], "bos_token_id": 2, "eos_token_id": 1, "hidden_act": "silu",
           "hidden_size": H, "initializer_range": 0.02, "intermediate_size": INTER, "max_position_embeddings": 2048,
           "model_type": "llama", "num_attention_heads": HEADS, "num_key_value_heads": KV, "num_hidden_layers": 1,
           "pad_token_id": 0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "torch_dtype": "float16",
           "transformers_version": "4.28.1", "use_cache": True, "vocab_size": vocab, "draft_vocab_size": draft_vocab}
    cfg.update(extra)
    return cfg


def research_files(weights, **cfg_extra):
    """yuhuili layout: config.json without rope_theta + pytorch_model.bin (fp16, no embed_tokens)."""
    buf = io.BytesIO()
    torch.save({k: (v.half() if v.is_floating_point() else v) for k, v in weights.items()}, buf)
    return {"config.json": json.dumps(llama_like_config(**cfg_extra)).encode(), "pytorch_model.bin": buf.getvalue(),
            "README.md": b"eagle3"}


def specforge_files(weights, aux_ids=None, with_embed=False, vocab=96, **cfg_extra):
    cfg = llama_like_config(**cfg_extra)
    cfg["architectures"] = ["LlamaForCausalLMEagle3"]
    cfg["rope_theta"] = 10000.0
    if aux_ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_ids, "use_aux_hidden_state": True}
    tensors = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in weights.items()}
    if with_embed:
        tensors["embed_tokens.weight"] = torch.randn(vocab, H).to(torch.bfloat16)
    return {"config.json": json.dumps(cfg).encode(), "model.safetensors": save_safetensors(tensors)}


def speculators_files(weights, aux_ids=None, norm_before_residual=False, extra_flags=None, vocab=96, draft_vocab=40):
    tensors = {("layers.0." + k[len("midlayer."):]) if k.startswith("midlayer.") else k: v for k, v in weights.items()}
    cfg = {
        "architectures": ["Eagle3Speculator"], "auto_map": {"": "eagle3.Eagle3SpeculatorConfig"},
        "draft_vocab_size": draft_vocab, "norm_before_residual": norm_before_residual,
        "eagle_aux_hidden_state_layer_ids": aux_ids, "target_hidden_size": None,
        "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5,
                                                     "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                               "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": "tiny/target"}},
        "speculators_model_type": "eagle3", "speculators_version": "0.3.0",
        "transformer_layer_config": {"model_type": "llama", "hidden_size": H, "intermediate_size": INTER,
                                     "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": HD,
                                     "num_hidden_layers": 1, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
                                     "rope_scaling": None, "max_position_embeddings": 2048, "vocab_size": vocab,
                                     "hidden_act": "silu"},
    }
    cfg.update(extra_flags or {})
    return {"config.json": json.dumps(cfg).encode(), "model.safetensors": save_safetensors(tensors)}


# ------------------------------------------------------------------ independent re-implementation of the equations
def _rms(x, w, eps=1e-5):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x, pos, base=10000.0):
    d = x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, d, 2).float() / d))
    ang = pos.float()[:, :, None] * inv  # [B, T, d/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_forward(w, embeds, feats, pos, norm_before_residual=False, eps=1e-5):
    """Logits over the draft vocabulary and pre-norm outputs for rows (feature, token embedding), causal."""
    h = feats @ w["fc.weight"].T if feats.shape[-1] != H else feats
    normed = _rms(h, w["midlayer.hidden_norm.weight"], eps)
    residual = normed if norm_before_residual else h
    x = torch.cat([_rms(embeds, w["midlayer.input_layernorm.weight"], eps), normed], -1)
    b, t, _ = x.shape
    q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(b, t, HEADS, HD).transpose(1, 2)
    k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(b, t, KV, HD).transpose(1, 2)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(b, t, KV, HD).transpose(1, 2)
    q, k = _rope(q, pos), _rope(k, pos)
    k, v = k.repeat_interleave(HEADS // KV, 1), v.repeat_interleave(HEADS // KV, 1)
    att = (q @ k.transpose(-1, -2)) / math.sqrt(HD)
    att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    o = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, HEADS * HD) @ w["midlayer.self_attn.o_proj.weight"].T
    h = residual + o
    m = _rms(h, w["midlayer.post_attention_layernorm.weight"], eps)
    mlp = (torch.nn.functional.silu(m @ w["midlayer.mlp.gate_proj.weight"].T) * (m @ w["midlayer.mlp.up_proj.weight"].T))
    h = h + mlp @ w["midlayer.mlp.down_proj.weight"].T
    return _rms(h, w["norm.weight"], eps) @ w["lm_head.weight"].T, h
