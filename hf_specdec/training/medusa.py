"""Medusa-1 training (Cai et al., 2024; FasterDecoding/Medusa ``medusa/train/train_legacy.py``): the target stays
frozen and only the heads learn, from the cached post-norm final hidden states ``last``.

Head ``i`` reads ``h_t`` and is trained with the cross-entropy against the token at ``t + 2 + i``, on label positions
under the loss mask. The reference sums the heads' mean losses unweighted (``loss += loss_i``); ``decay`` weighs head
``i`` by ``decay ** i`` (the Medusa-2 recipe's 0.8), although the heads share no parameter, so with Adam a weight only
matters through the global gradient clipping. With a draft vocabulary a label outside it is left out of the loss
and counted as a miss in the accuracies: a head can never draft it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .eagle3 import _shift
from .trainer import mean_denominator


def draft_index(token_map: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[vocab_size]``: the draft id of every target token, -1 for those outside the draft vocabulary."""
    index = torch.full((vocab_size,), -1, dtype=torch.long)
    index[token_map.cpu()] = torch.arange(token_map.numel())
    return index


def medusa_loss(heads, draft_ids: torch.Tensor, batch: dict, decay: float = 1.0):
    """Summed per-head cross-entropy of ``MedusaHeads`` on a padded batch of cached target features.

    Args:
        draft_ids: :func:`draft_index` of the heads' ``token_map`` ``[V]``.
        batch: ``input_ids [B, T]``, ``loss_mask [B, T]``, ``valid [B, T]``, ``last [B, T, H]``.

    Returns ``(loss, metrics)``; metrics: ``loss{i}``, ``acc{i}`` (top-1 of head ``i``), ``tau_est`` (``1 + sum_k
    prod_{i<=k} acc_i``, heads assumed independent) and ``tau_chain`` (1 + the leading heads right at a position,
    averaged: what a chain of all heads gets accepted under teacher forcing).
    """
    num = heads.config.medusa_num_heads
    ids = batch["input_ids"].long()
    scored = batch["valid"] & batch["loss_mask"].bool()  # [B, T] tokens a head learns to predict
    labels = torch.stack([_shift(ids, 2 + i) for i in range(num)], dim=-1)  # [B, T, K]: token t + 2 + i
    has = torch.stack([_shift(scored, 2 + i) for i in range(num)], dim=-1)  # [B, T, K]
    rows = has.any(-1)  # [B, T]: only positions some head learns from are scored
    logits = heads(batch["last"][rows]).float()  # [N, K, Vd]
    has = has[rows]  # [N, K]
    target = draft_ids.to(ids.device)[labels[rows]]  # [N, K]: draft ids, -1 outside the draft vocabulary
    trained = has & (target >= 0)
    with torch.no_grad():
        hits = (logits.argmax(-1) == target) & has  # [N, K]
    total = logits.sum() * 0.0  # keeps the graph when a batch has no label
    counts = mean_denominator(trained.sum(0))  # means over the global batch
    labelled = mean_denominator(has.sum(0))
    metrics, accs = {}, []
    for i in range(num):
        keep = trained[:, i]
        loss_i = F.cross_entropy(logits[keep, i], target[keep, i], reduction="sum") / counts[i]
        total = total + (decay ** i) * loss_i
        accs.append(float(hits[:, i].sum() / labelled[i]))
        metrics[f"loss{i}"] = float(loss_i.detach())
        metrics[f"acc{i}"] = accs[-1]
    metrics["tau_est"] = float(1 + torch.tensor(accs).cumprod(0).sum())
    first = has[:, 0]
    metrics["tau_chain"] = float(1 + hits[first].long().cumprod(-1).sum(-1).float().mean()) if first.any() else 1.0
    return total, metrics
