"""Synthetic z-lab DFlash checkpoints (old and new revisions) and an independent re-implementation of the equations
(z-lab dflash/model.py) to compare against."""

from __future__ import annotations

import json
import math

import torch
from safetensors.torch import save as save_safetensors

H, HEADS, KV, HD, INTER = 32, 4, 2, 8, 64


def random_weights(layers=2, taps=2, seed=0, scale=0.3, target_hidden=H):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g) * scale

    w = {"fc.weight": r(H, taps * target_hidden), "hidden_norm.weight": 1 + r(H) * 0.1, "norm.weight": 1 + r(H) * 0.1}
    for i in range(layers):
        p = f"layers.{i}."
        w.update({
            p + "input_layernorm.weight": 1 + r(H) * 0.1, p + "post_attention_layernorm.weight": 1 + r(H) * 0.1,
            p + "self_attn.q_proj.weight": r(HEADS * HD, H), p + "self_attn.k_proj.weight": r(KV * HD, H),
            p + "self_attn.v_proj.weight": r(KV * HD, H), p + "self_attn.o_proj.weight": r(H, HEADS * HD),
            p + "self_attn.q_norm.weight": 1 + r(HD) * 0.1, p + "self_attn.k_norm.weight": 1 + r(HD) * 0.1,
            p + "mlp.gate_proj.weight": r(INTER, H), p + "mlp.up_proj.weight": r(INTER, H),
            p + "mlp.down_proj.weight": r(H, INTER),
        })
    return w


def zlab_config(layers=2, target_layer_ids=(0, 2), num_target_layers=4, mask_token_id=95, block_size=4,
                vocab=96, sliding=False, revision="old", **extra):
    cfg = {"architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
           "model_type": "qwen3", "num_target_layers": num_target_layers,
           "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids)},
           "hidden_size": H, "intermediate_size": INTER, "num_hidden_layers": layers, "num_attention_heads": HEADS,
           "num_key_value_heads": KV, "head_dim": HD, "hidden_act": "silu", "attention_bias": False,
           "attention_dropout": 0.0, "max_position_embeddings": 4096, "max_window_layers": layers,
           "rms_norm_eps": 1e-06, "rope_scaling": None, "vocab_size": vocab, "bos_token_id": 2, "eos_token_id": 1,
           "dtype": "bfloat16", "use_cache": True, "tie_word_embeddings": False}
    if revision == "old":  # Qwen3-*-DFlash-b16: flat rope_theta, block_size at the top level, full attention
        cfg.update(block_size=block_size, rope_theta=1000000, sliding_window=None, use_sliding_window=False,
                   layer_types=["full_attention"] * layers)
    else:  # newer revisions: rope_parameters, block_size inside dflash_config, sliding layers
        cfg["dflash_config"]["block_size"] = block_size
        cfg.update(rope_parameters={"rope_theta": 10000000, "rope_type": "default"},
                   layer_types=(["sliding_attention", "full_attention"] * layers)[:layers] if sliding
                   else ["full_attention"] * layers, sliding_window=3 if sliding else None)
    cfg.update(extra)
    return cfg


def zlab_files(weights, **cfg_kwargs):
    tensors = {k: v.to(torch.bfloat16) for k, v in weights.items()}
    return {"config.json": json.dumps(zlab_config(**cfg_kwargs)).encode(),
            "model.safetensors": save_safetensors(tensors), "dflash.py": b"# remote code: never executed"}


# ------------------------------------------------------------------ independent re-implementation of the equations
def _rms(x, w, eps=1e-6):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x, pos, base):
    d = x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, d, 2).float() / d))
    ang = pos.float()[:, :, None] * inv
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin


def reference_block(w, layers, noise, target_feats, ctx_pos, block_pos, base, causal=False, window=None,
                    sliding_layers=()):
    """Block hidden states: context = hidden_norm(fc(features)) as K/V in every layer, queries from the block."""
    ctx = _rms(target_feats @ w["fc.weight"].T, w["hidden_norm.weight"])
    h = noise
    b, n, _ = noise.shape
    c = ctx.shape[1]
    for i in range(layers):
        p = f"layers.{i}."
        x = _rms(h, w[p + "input_layernorm.weight"])
        kv_in = torch.cat([ctx, x], 1)
        q = _rms((x @ w[p + "self_attn.q_proj.weight"].T).view(b, n, HEADS, HD), w[p + "self_attn.q_norm.weight"])
        k = _rms((kv_in @ w[p + "self_attn.k_proj.weight"].T).view(b, c + n, KV, HD), w[p + "self_attn.k_norm.weight"])
        v = (kv_in @ w[p + "self_attn.v_proj.weight"].T).view(b, c + n, KV, HD)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q = _rope(q, block_pos, base)
        k = _rope(k, torch.cat([ctx_pos, block_pos], 1), base)
        k, v = k.repeat_interleave(HEADS // KV, 1), v.repeat_interleave(HEADS // KV, 1)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(HD)
        allowed = torch.ones(n, c + n, dtype=torch.bool)
        if causal:
            allowed[:, c:] = torch.ones(n, n, dtype=torch.bool).tril()
        if i in sliding_layers:
            kp = torch.cat([ctx_pos, block_pos], 1)[0]
            allowed &= (block_pos[0][:, None] - kp[None, :]).abs() < window
        att = att.masked_fill(~allowed, float("-inf"))
        o = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, n, HEADS * HD) @ w[p + "self_attn.o_proj.weight"].T
        h = h + o
        m = _rms(h, w[p + "post_attention_layernorm.weight"])
        h = h + (torch.nn.functional.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T)
                 ) @ w[p + "mlp.down_proj.weight"].T
    return _rms(h, w["norm.weight"])
