"""EAGLE-3 training with the training-time test (Li et al., 2025; SafeAILab/EAGLE ``eagle/traineagle3``).

Sequence row ``t`` feeds feature ``f_t`` and token ``x_{t+1}``. Step 0 is ordinary causal attention. At step ``j`` the
row feeds the drafter's own step ``j-1`` output with token ``x_{t+1+j}`` at position ``t + j``; its query sees the
step-0 keys of rows ``<= t`` and the keys of steps ``1..j`` of the same row only. Step ``j`` is trained against the
target's distribution of ``x_{t+2+j}`` restricted to the draft vocabulary (soft cross-entropy), on positions whose
target argmax is in the draft vocabulary and whose token is under the loss mask; step losses weigh ``0.8 ** j``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .trainer import mean_denominator


def draft_vocabulary(counts: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t, t2d)`` for the ``size`` most frequent target tokens (draft ids = those tokens in ascending order)."""
    used = counts.topk(size).indices.sort().values
    d2t = used - torch.arange(size)
    t2d = torch.zeros(counts.shape[0], dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d


def _shift(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x[:, k:]`` padded back to length with zeros."""
    if k == 0:
        return x
    pad = torch.zeros_like(x[:, :k])
    return torch.cat([x[:, k:], pad], dim=1)


def ttt_loss(drafter, target_head: torch.Tensor, batch: dict, steps: int = 7, decay: float = 0.8):  # noqa: C901
    """Training-time-test loss of an ``Eagle3Drafter`` on a padded batch of cached target features.

    Args:
        target_head: the target's ``lm_head`` rows of the draft vocabulary ``[draft_vocab, H_target]`` (frozen).
        batch: ``input_ids [B, T]``, ``loss_mask [B, T]``, ``features [B, T, 3H]``, ``last [B, T, H]`` (the
            target's post-norm final hidden states), ``target_argmax [B, T]``, ``valid [B, T]``.
    """
    layer = drafter.midlayer
    attn = layer.self_attn
    cfg = drafter.config
    dtype = drafter.fc.weight.dtype
    ids = batch["input_ids"].long()
    valid = batch["valid"] & batch["loss_mask"].bool()
    feats = batch["features"].to(dtype)
    last = batch["last"].to(dtype)
    bsz, length = ids.shape
    positions = torch.arange(length, device=ids.device).expand(bsz, length)
    with torch.no_grad():
        target_logits = last @ target_head.to(dtype).T  # [B, T, Vd]
        target_p = torch.softmax(target_logits.float(), dim=-1)
        # the target's greedy token must be a draft token (the reference's position mask)
        full_argmax_in_draft = drafter.t2d[batch["target_argmax"].long()]
        # row t at step j predicts x_{t+2+j}: the target's distribution at position t+1+j, on real loss-masked
        # tokens whose target argmax is a draft token
        masks = [_shift(valid, 2 + j) & _shift(batch["valid"], 1 + j) & _shift(full_argmax_in_draft, 1 + j)
                 for j in range(steps)]
        counts = mean_denominator(torch.stack([m.sum() for m in masks]))  # means over the global batch
    causal = torch.ones(length, length, dtype=torch.bool, device=ids.device).tril()
    hidden = drafter.project(feats)
    keys_v = []  # (k, v) of steps >= 1 at the same row
    k0 = v0 = None
    total, metrics = 0.0, {}
    weight_sum = 0.0
    rep = attn.num_heads // attn.num_kv
    for j in range(steps):
        tok = _shift(ids, 1 + j)
        emb = drafter.embed_tokens(tok).to(dtype)
        normed = layer.hidden_norm(hidden)
        residual = normed if cfg.norm_before_residual else hidden
        x = torch.cat([layer.input_layernorm(emb), normed], dim=-1)
        pos = positions + j
        q = attn.q_proj(x).view(bsz, length, attn.num_heads, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(bsz, length, attn.num_kv, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(bsz, length, attn.num_kv, attn.head_dim).transpose(1, 2)
        q, k = attn.rope(q, pos), attn.rope(k, pos)
        if j == 0:
            k0, v0 = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        else:
            keys_v.append((k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)))
        scale = 1.0 / math.sqrt(attn.head_dim)
        scores = (q @ k0.transpose(-1, -2)) * scale
        scores = scores.masked_fill(~causal, float("-inf"))
        diag = [(q * ks).sum(-1, keepdim=True) * scale for ks, _ in keys_v]  # [B, h, T, 1] each
        probs = torch.softmax(torch.cat([scores] + diag, dim=-1).float(), dim=-1).to(dtype)
        out = probs[..., :length] @ v0
        for s, (_, vs) in enumerate(keys_v):
            out = out + probs[..., length + s:length + s + 1] * vs
        out = out.transpose(1, 2).reshape(bsz, length, attn.num_heads * attn.head_dim)
        hidden = residual + attn.o_proj(out)
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        # the head scores only the rows under the loss (about half of a padded batch), the draft head being about
        # half of a step's cost
        mask = masks[j]
        logits = drafter.lm_head(drafter.norm(hidden[mask])).float()
        p = _shift(target_p, 1 + j)[mask]
        logq = F.log_softmax(logits, dim=-1)
        count = counts[j]
        step_loss = -(p * logq).sum() / count
        total = total + (decay ** j) * step_loss
        weight_sum += decay ** j
        with torch.no_grad():
            acc = (logits.argmax(-1) == p.argmax(-1)).sum() / count
        metrics[f"acc{j}"] = float(acc)
        metrics[f"loss{j}"] = float(step_loss.detach())
    return total, metrics
