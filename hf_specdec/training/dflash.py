"""DFlash training (z-lab recipe): random anchors per sequence, every block of a sequence in one pass.

Block ``a`` holds the token at its anchor ``p_a`` followed by ``B - 1`` mask tokens at positions ``p_a .. p_a+B-1``.
Its queries see the context keys/values (the projected target features) of positions strictly before the anchor and
the keys/values of their own block (bidirectional, or causal for causal layers); nothing of other blocks. The loss is
the cross-entropy of the target's (frozen) LM head on block positions ``k = 1..B-1`` against the token at ``p_a + k``,
weighted ``exp(-(k - 1) / gamma)``, on tokens under the loss mask. The target, its embeddings and head stay frozen.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .trainer import mean_denominator


def sample_anchors(loss_mask: torch.Tensor, valid: torch.Tensor, count: int, generator=None) -> torch.Tensor:
    """Up to ``count`` anchor positions ``p`` with a loss-masked label at ``p + 1`` (sorted; -1 pads)."""
    ok = torch.zeros_like(valid)
    ok[:-1] = valid[:-1] & (loss_mask[1:] > 0) & valid[1:]
    cand = ok.nonzero().flatten()
    if cand.numel() > count:
        cand = cand[torch.randperm(cand.numel(), generator=generator)[:count].to(cand.device)].sort().values
    out = torch.full((count,), -1, dtype=torch.long, device=valid.device)
    out[: cand.numel()] = cand
    return out


def block_loss(drafter, target_embed: torch.Tensor, target_head: torch.Tensor, batch: dict, num_anchors: int = 16,
               gamma: float = 7.0, generator=None):
    """Weighted block cross-entropy of a ``DFlashDrafter`` on a padded batch of cached target features."""
    cfg = drafter.config
    size = cfg.block_size
    dtype = drafter.fc.weight.dtype
    total, weight_total = 0.0, 0.0
    device = batch["input_ids"].device  # every index and mask on the batch's device (a GPU's too)
    correct = torch.zeros(size - 1, device=device)
    counted = torch.zeros(size - 1, device=device)
    for b in range(batch["input_ids"].shape[0]):
        valid = batch["valid"][b]
        length = int(valid.sum())
        ids = batch["input_ids"][b, :length].long()
        mask = batch["loss_mask"][b, :length]
        anchors = sample_anchors(mask, valid[:length], num_anchors, generator)
        anchors = anchors[anchors >= 0]
        if anchors.numel() == 0:
            continue
        n_blocks = anchors.numel()
        context = drafter.project(batch["features"][b, :length].to(dtype))[None]  # [1, T, H]
        offsets = torch.arange(size, device=device)
        pos = anchors[:, None] + offsets[None]  # [A, B]
        block_ids = torch.full((n_blocks, size), cfg.mask_token_id, dtype=torch.long, device=device)
        block_ids[:, 0] = ids[anchors]
        noise = F.embedding(block_ids, target_embed).to(dtype).reshape(1, n_blocks * size, -1)
        q_pos = pos.reshape(1, -1)
        ctx_pos = torch.arange(length, device=device)[None]
        # keys: context (T) then all blocks (A * B)
        key_block = torch.arange(n_blocks, device=device).repeat_interleave(size)
        query_block = key_block
        ctx_ok = ctx_pos < anchors.repeat_interleave(size)[:, None]  # strictly before anchor
        same = query_block[:, None] == key_block[None, :]
        masks = []
        minval = torch.finfo(dtype).min
        for i in range(cfg.num_hidden_layers):
            blk = same.clone()
            if cfg.layer_is_causal(i):
                blk &= offsets.repeat(n_blocks)[:, None] >= offsets.repeat(n_blocks)[None, :]
            allowed = torch.cat([ctx_ok, blk], dim=1)
            if cfg.layer_types[i] == "sliding_attention":
                kp = torch.cat([ctx_pos[0], q_pos[0]])
                allowed &= (q_pos[0][:, None] - kp[None, :]).abs() < cfg.sliding_window
            masks.append(torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, minval)[None, None])
        hidden = drafter(noise, context, q_pos, ctx_pos, attention_mask=masks)  # [1, A*B, H]
        hidden = hidden.reshape(n_blocks, size, -1)[:, 1:]  # positions 1..B-1
        label_pos = pos[:, 1:]
        in_range = label_pos < length
        labels = torch.where(in_range, ids[label_pos.clamp(max=length - 1)], torch.zeros_like(label_pos))
        keep = in_range & (mask[label_pos.clamp(max=length - 1)] > 0)
        logits = (hidden @ target_head.to(dtype).T).float()
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
        ce = ce.reshape(labels.shape)
        w = torch.exp(-(offsets[1:].float() - 1) / gamma)[None].expand_as(ce) * keep
        total = total + (ce * w).sum()
        weight_total += float(w.sum())
        with torch.no_grad():
            hit = (logits.argmax(-1) == labels) & keep
            correct += hit.sum(0).float()
            counted += keep.sum(0).float()
    # means over the global batch (every process gets here: the denominators are summed over the processes)
    weight = mean_denominator(torch.tensor(weight_total), floor=None)
    acc = correct / mean_denominator(counted)
    metrics = {"acc0": float(acc[0]), "acc1": float(acc[1]) if size > 2 else 0.0,
               "acc_mean": float(acc.mean()), "tau_est": float(1 + torch.cumprod(acc, 0).sum())}
    if weight_total == 0:  # no label here
        return drafter.fc.weight.sum() * 0.0, metrics
    return total / weight, metrics


def layer_ids_from_features(hidden_indices: list[int]) -> list[int]:
    """DFlash counts layer outputs: HF ``hidden_states[i + 1]`` is the output of layer ``i``."""
    if any(i < 1 for i in hidden_indices):
        raise ValueError("DFlash context features are layer outputs (hidden_states index >= 1).")
    return [i - 1 for i in hidden_indices]

