"""Training for LayerSkip self-speculation.

Two routes (see docs/training.md):

* **An exit adapter with the target frozen** (Kangaroo, Liu et al., 2024; Equationliu/Kangaroo ``train.py``): the
  adapter reads the target's ``hidden_states[E]`` of every token and learns the target's own next-token
  distribution there, a soft cross-entropy against ``softmax(lm_head(last))`` (``last``: the final post-norm hidden
  state the shared feature cache holds), over the adapter's draft vocabulary. :func:`exit_features` adds the exit
  states to the shared cache (only layers ``0..E-1`` run); :func:`exit_adapter_loss` is the loss.
* **The LayerSkip recipe** (Elhoushi et al., 2024), which changes the model itself: layer dropout whose rate rises
  with depth, and an early-exit loss at every layer through the shared final norm and LM head, switched on for
  layers by a curriculum (rotational or gradual). :func:`layerskip_loss` computes it for any model
  :class:`~hf_specdec.stack.DecoderStack` drives; the result is a new target, trained with
  ``hf-specdec train layerskip`` (Accelerate, for GPUs).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from ..placement import input_device
from .eagle3 import _shift
from .trainer import mean_denominator


# ------------------------------------------------------------------------------------------------ exit adapter
def exit_features(target, shards, exit_layer: int, progress: bool = True) -> list[Path]:
    """Write the exit hidden states ``hidden_states[exit_layer]`` (fp16, key ``exit``) of every shard of the
    feature cache ``shards`` (:class:`~hf_specdec.training.features.FeatureShards`) to ``exit_<E>/`` beside it,
    shard by shard (resumable). Only the target's layers ``0..E-1`` run. Returns the exit shard files, in order."""
    from tqdm.auto import tqdm

    from ..stack import DecoderStack

    stack = DecoderStack(target)
    files = []
    bar = tqdm(total=len(shards.files), desc=f"exit features (layer {exit_layer})", disable=not progress,
               file=sys.stderr)
    for path in shards.files:
        out = path.parent / f"exit_{exit_layer}" / path.name
        files.append(out)
        if out.exists():
            bar.update(1)
            continue
        out.parent.mkdir(exist_ok=True)
        with safe_open(str(path), "pt") as handle:
            ids, offsets = handle.get_tensor("input_ids").long(), handle.get_tensor("offsets").tolist()
        exits = []
        with torch.no_grad():
            for start, end in zip(offsets, offsets[1:]):
                x = ids[start:end][None].to(input_device(target))  # model.device: meta when offloaded
                pos = torch.arange(end - start, device=x.device)[None]
                hidden = stack.embed(x)
                # one unpadded sequence: no mask (causal attention), no cache
                hidden = stack.run(hidden, 0, exit_layer, None, stack.rotary(hidden, pos), pos, None)
                exits.append(hidden[0].to(torch.float16).cpu())
        tmp = out.with_suffix(".tmp")
        save_file({"exit": torch.cat(exits)}, str(tmp))
        tmp.rename(out)
        bar.update(1)
    bar.close()
    return files


class ExitShards(torch.utils.data.Dataset):
    """The shared cache's samples (``input_ids``, ``loss_mask``, ``valid`` after collation, ``last``) with their
    exit states ``exit`` (:func:`exit_features`); the taps the adapter does not read are left out."""

    KEYS = ("input_ids", "loss_mask", "last", "target_argmax")

    def __init__(self, shards, exit_files: list[Path]):
        self.shards, self.exit_files = shards, exit_files
        self._cache: dict = {}

    def __len__(self):
        return len(self.shards)

    def __getitem__(self, i):
        f, start, end = self.shards.index[i]
        if f not in self._cache:
            self._cache.clear()
            with safe_open(str(self.shards.files[f]), "pt") as handle:
                data = {k: handle.get_tensor(k) for k in self.KEYS}
            with safe_open(str(self.exit_files[f]), "pt") as handle:
                data["exit"] = handle.get_tensor("exit")
            self._cache[f] = data
        return {k: v[start:end] for k, v in self._cache[f].items()}


def exit_adapter_loss(adapter, batch: dict, temperature: float = 1.0):
    """Soft cross-entropy of the bound ``adapter`` against the target's next-token distribution over the draft
    vocabulary, at positions whose next token is under the loss mask.

    Returns ``(loss, metrics)``: ``kl`` is the loss less the target distribution's entropy (what the adapter can
    still learn), ``acc`` the top-1 agreement with the target's greedy token (a draft token's
    acceptance rate under teacher forcing; a greedy token outside the draft vocabulary counts as a miss),
    ``tau_chain4`` the mean accepted length of a 4-token chain under teacher forcing, plus one.
    """
    valid = batch["valid"]
    scored = valid & _shift(batch["loss_mask"].bool() & valid, 1)  # [B, T]: t predicts t + 1
    positions = torch.arange(valid.shape[1], device=valid.device)[None].expand_as(valid)
    mask = None  # right-padded rows: the padding comes after every real token, so causal attention is exact
    normed = adapter(batch["exit"].float(), positions, mask)
    all_logits = adapter.logits(normed)  # [B, T, Vd]
    logits = all_logits[scored]  # [N, Vd]
    head = adapter.head
    with torch.no_grad():
        target_logits = head(batch["last"][scored].to(head.weight.dtype)).float()
        target_p = torch.softmax(target_logits / temperature, dim=-1)
    count = mean_denominator(scored.sum())  # a mean over the global batch
    loss = -(target_p * torch.log_softmax(logits / temperature, dim=-1)).sum() / count
    with torch.no_grad():
        greedy = batch["target_argmax"].long()  # [B, T]: the target's token after t
        hits = (adapter.draft_to_target(all_logits.argmax(-1)) == greedy) & scored
        acc = float(hits.sum() / count)
        run = torch.stack([_shift(hits, i) for i in range(4)], -1).long().cumprod(-1).sum(-1)  # [B, T]
        tau = float(1 + run[scored].float().mean()) if scored.any() else 1.0
        entropy = -(target_p * torch.log(target_p.clamp(min=1e-30))).sum() / count
        kl = float(loss.detach() - entropy)
    return loss, {"acc": acc, "tau_chain4": tau, "kl": kl}


# ------------------------------------------------------------------------------------------ the LayerSkip recipe
def dropout_rates(num_layers: int, max_rate: float, scale: str = "exp") -> torch.Tensor:
    """Per-layer dropout rates rising with depth, from 0 at layer 0 to ``max_rate`` at the last (the paper's
    ``p_l = S(l) p_max``: ``scale='exp'`` is ``(2^(l/(L-1)) - 1)``, ``'linear'`` is ``l/(L-1)``)."""
    depth = torch.arange(num_layers, dtype=torch.float32) / max(num_layers - 1, 1)
    shape = torch.exp2(depth) - 1 if scale == "exp" else depth
    return max_rate * shape


def curriculum_layers(step: int, num_layers: int, kind: str = "rotational", every: int = 8,
                      total_steps: int = 1) -> list[int]:
    """The layers whose early exit is in the loss at ``step`` (the last layer always is).

    ``rotational``: every ``every``-th layer, the set rotating by one layer per step (the paper's ``C_rot,R``);
    ``gradual``: exits switch on from the last layer down, all of them by the end of training (``C_grad``)."""
    last = num_layers - 1
    if kind == "rotational":
        chosen = {i for i in range(num_layers) if (i + step) % every == 0}
    elif kind == "gradual":
        on = math.ceil(num_layers * min(1.0, (step + 1) / max(total_steps, 1)))
        chosen = set(range(num_layers - on, num_layers))
    else:
        raise ValueError(f"curriculum must be 'rotational' or 'gradual', got {kind!r}.")
    return sorted(chosen | {last})


def exit_scales(layers: list[int], num_layers: int, scale: float = 1.0) -> dict[int, float]:
    """Loss weights of the exits in ``layers``: ``scale * sum_{i<=l} i`` for an early layer ``l`` (deeper exits weigh
    more, as in the paper's ``e_scale``), 1 for the last, normalised to sum to 1."""
    raw = {l: (1.0 if l == num_layers - 1 else scale * (l + 1) * (l + 2) / 2) for l in layers}
    total = sum(raw.values())
    return {l: v / total for l, v in raw.items()}


def layerskip_loss(model, batch: dict, step: int, rates: torch.Tensor, curriculum: str = "rotational",
                   every: int = 8, total_steps: int = 1, exit_scale: float = 1.0):
    """The LayerSkip training loss of ``model`` (a causal LM :class:`~hf_specdec.stack.DecoderStack` drives) on a
    right-padded ``batch`` (``input_ids``, ``valid``, optional ``loss_mask``): layer ``l`` is skipped with
    probability ``rates[l]`` (per sequence, in training), and the next-token cross-entropy is taken at the exits of
    :func:`curriculum_layers` through the shared final norm and LM head, weighted by :func:`exit_scales`.

    Returns ``(loss, metrics)`` with ``loss_l<i>`` per exit."""
    from ..stack import DecoderStack

    stack = DecoderStack(model)
    ids = batch["input_ids"].long()
    valid = batch["valid"]
    labels = _shift(ids, 1)
    scored = valid & _shift(valid, 1)
    if "loss_mask" in batch:
        scored = scored & _shift(batch["loss_mask"].bool(), 1)
    n = stack.num_layers
    exits = curriculum_layers(step, n, curriculum, every, total_steps)
    weights = exit_scales(exits, n, exit_scale)
    pos = torch.arange(ids.shape[1], device=ids.device)[None].expand_as(ids)
    hidden = stack.embed(ids)
    rope = stack.rotary(hidden, pos)
    total = hidden.sum() * 0.0
    count = mean_denominator(scored.sum())  # a mean over the global batch
    metrics = {}
    for layer in range(n):
        out = stack.run(hidden, layer, layer + 1, None, rope, pos, None)
        if model.training and rates[layer] > 0:  # stochastic depth, per sequence
            keep = (torch.rand(ids.shape[0], 1, 1, device=ids.device) >= rates[layer]).to(out.dtype)
            out = keep * out + (1 - keep) * hidden
        hidden = out
        if layer in weights:
            logits = stack.logits(hidden)[scored]
            loss = F.cross_entropy(logits, labels[scored], reduction="sum") / count
            total = total + weights[layer] * loss
            metrics[f"loss_l{layer}"] = float(loss.detach())
    return total, metrics
