"""Post-hoc multi-token prediction training for a frozen target, on the shared feature cache.

**Sequential module** (:func:`mtp_loss`; DeepSeek-V3's MTP objective, one module applied at every depth as it drafts).
At depth ``j = 0..D-1`` row ``t`` feeds the module's depth ``j - 1`` output (the target's post-norm final state
``h_t`` at depth 0) with the token ``x_{t+1+j}``, at position ``t + j``, and scores ``x_{t+2+j}``. Its query sees the
depth-0 keys of rows ``<= t`` and the keys of depths ``1..j`` of the same row only: what a chain's draft row sees at
inference (the accepted context, then the drafts before it). The rows run through the module's own forward (the
target family's decoder layer with a 4D mask over a cache that holds the earlier depths' keys), so training and
drafting compute the same function. Each depth is trained with the soft cross-entropy against the target's
distribution of that token over the draft vocabulary, on positions under the loss mask whose target argmax is a
draft token; depth ``j`` weighs ``decay ** j``.

**Parallel heads** (:func:`parallel_heads_loss`; Gloeckle et al.): head ``i`` reads the trunk state ``z_t`` (the input
of the target's last layer) with causal attention and is trained against the target's distribution of ``x_{t+2+i}``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache

from .eagle3 import _shift
from .trainer import mean_denominator


def _depth_mask(valid: torch.BoolTensor, depth: int, dtype) -> torch.Tensor:
    """Additive ``[B, 1, T, T * (depth + 1)]``: depth-0 keys causally (real tokens only), the keys of depths
    ``1..depth`` of the same row only."""
    bsz, length = valid.shape
    causal = torch.ones(length, length, dtype=torch.bool, device=valid.device).tril()
    blocks = [causal[None] & valid[:, None, :]]
    eye = torch.eye(length, dtype=torch.bool, device=valid.device)
    blocks += [eye[None].expand(bsz, -1, -1)] * depth
    allowed = torch.cat(blocks, dim=-1)
    allowed |= torch.cat([eye[None].expand(bsz, -1, -1)] + [torch.zeros_like(eye)[None].expand(bsz, -1, -1)] * depth,
                         dim=-1)  # padding rows still see themselves (no empty softmax)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=valid.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def _soft_ce(logits: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    count = mean_denominator(torch.tensor(logits.shape[0], device=logits.device))  # a mean over the global batch
    loss = -(p * F.log_softmax(logits.float(), dim=-1)).sum() / count
    with torch.no_grad():
        acc = (logits.argmax(-1) == p.argmax(-1)).sum() / count
    return loss, acc


def mtp_loss(module, in_draft: torch.Tensor, batch: dict, depths: int = 3, decay: float = 0.8):
    """Depth-weighted loss of an :class:`~hf_specdec.modeling.mtp.MTPModule` (bound to its target) on a padded batch.

    Args:
        in_draft: ``[V]`` bool, the target tokens in the module's draft vocabulary.
        batch: ``input_ids [B, T]``, ``loss_mask [B, T]``, ``valid [B, T]``, ``last [B, T, H]`` (the target's
            post-norm final hidden states), ``target_argmax [B, T]``.

    Returns ``(loss, metrics)``; metrics: ``loss{j}``, ``acc{j}`` (agreement with the target's argmax at depth ``j``)
    and ``tau_chain`` (1 + the expected accepted length of a chain of ``depths``, from the per-depth accuracies).
    """
    proj = module.parts(0)[2]
    dtype = proj.weight.dtype
    ids = batch["input_ids"].long()
    valid = batch["valid"].bool()
    scored = valid & batch["loss_mask"].bool()
    last = batch["last"].to(dtype)
    bsz, length = ids.shape
    positions = torch.arange(length, device=ids.device).expand(bsz, length)
    with torch.no_grad():
        target_p = torch.softmax(module.logits(last), dim=-1)  # [B, T, Vd]: the target's next-token distribution
        argmax_in = in_draft.to(ids.device)[batch["target_argmax"].long()]
    cache = DynamicCache()
    hidden = last
    total, metrics, accs = 0.0, {}, []
    for j in range(depths):
        mask = _depth_mask(valid, j, dtype)
        logits, hidden = module(_shift(ids, 1 + j), hidden, positions + j, mask, cache, step=j)
        rows = _shift(scored, 2 + j) & _shift(valid, 1 + j) & _shift(argmax_in, 1 + j)
        loss_j, acc_j = _soft_ce(logits[rows], _shift(target_p, 1 + j)[rows])
        total = total + (decay ** j) * loss_j
        metrics[f"loss{j}"], metrics[f"acc{j}"] = float(loss_j.detach()), float(acc_j)
        accs.append(float(acc_j))
    metrics["tau_chain"] = float(1 + torch.tensor(accs).cumprod(0).sum())
    return total, metrics


def parallel_heads_loss(heads, in_draft: torch.Tensor, batch: dict, decay: float = 1.0):
    """Summed loss of :class:`~hf_specdec.modeling.mtp.ParallelMTPHeads` (bound) on a padded batch with the trunk
    states ``exit [B, T, H]`` (``hidden_states[N-1]``, :func:`.layerskip.exit_features`); head ``i`` at row ``t`` is trained against the target's distribution of
    ``x_{t+2+i}``."""
    dtype = heads.norm.weight.dtype
    ids = batch["input_ids"].long()
    valid = batch["valid"].bool()
    scored = valid & batch["loss_mask"].bool()
    bsz, length = ids.shape
    positions = torch.arange(length, device=ids.device).expand(bsz, length)
    with torch.no_grad():
        target_p = torch.softmax(heads.logits(batch["last"].to(dtype)), dim=-1)
        argmax_in = in_draft.to(ids.device)[batch["target_argmax"].long()]
    normed = heads(batch["exit"].to(dtype), positions, _depth_mask(valid, 0, dtype))  # [B, T, n, H]
    total, metrics, accs = 0.0, {}, []
    for i in range(heads.num_modules):
        rows = _shift(scored, 2 + i) & _shift(argmax_in, 1 + i) & _shift(valid, 1 + i)
        loss_i, acc_i = _soft_ce(heads.logits(normed[:, :, i][rows]), _shift(target_p, 1 + i)[rows])
        total = total + (decay ** i) * loss_i
        metrics[f"loss{i}"], metrics[f"acc{i}"] = float(loss_i.detach()), float(acc_i)
        accs.append(float(acc_i))
    metrics["tau_chain"] = float(1 + torch.tensor(accs).cumprod(0).sum())
    return total, metrics
