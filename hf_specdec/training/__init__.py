"""Drafter training: cache the frozen target's features once, then train on the cached shards (Accelerate).

``hf-specdec train eagle3 ...`` and ``hf-specdec train draft ...`` (a distilled student for the ``assisted``
method) share the data pipeline (:mod:`.data`, :mod:`.features`) and the loop (:mod:`.trainer`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from .trainer import TrainConfig, train


def prepare_features(target, tokenizer, out_dir, layer_ids, samples: int, max_length: int, seed: int = 0,
                     progress: bool = True):
    """Tokenize ShareGPT with the target's chat template and cache the target's features (resumable)."""
    from .data import training_samples
    from .features import cache_features

    folder = Path(out_dir)
    meta = folder / "meta.json"
    if meta.exists():
        info = json.loads(meta.read_text())
        if info.get("layer_ids") != list(layer_ids) or info.get("num_samples") != samples:
            raise ValueError(f"{folder} holds features for other settings ({info}); use another --features folder.")
    data = training_samples(tokenizer, samples, max_length=max_length, seed=seed)
    if progress:
        print(f"hf_specdec: {len(data)} conversations, {sum(len(i) for i, _ in data)} tokens "
              f"({sum(sum(m) for _, m in data)} under the loss mask)", file=sys.stderr)
    return cache_features(target, data, folder, list(layer_ids), progress=progress)


def train_eagle3(target, tokenizer, out_dir, samples: int = 1500, max_length: int = 384, draft_vocab: int = 8192,
                 config: TrainConfig | None = None, features_dir=None, ttt_steps: int = 7, seed: int = 0,
                 save_dtype=torch.float16, progress: bool = True):
    """Train an EAGLE-3 drafter for ``target`` on ShareGPT; the result is saved in ``out_dir`` (``save_dtype``)."""
    from ..modeling.eagle3 import Eagle3Config, Eagle3Drafter, default_target_layer_ids
    from .eagle3 import draft_vocabulary, ttt_loss
    from .features import FeatureShards

    text = target.config.get_text_config()
    layer_ids = default_target_layer_ids(text.num_hidden_layers)
    out = Path(out_dir)
    features = Path(features_dir) if features_dir else out / "features"
    prepare_features(target, tokenizer, features, layer_ids, samples, max_length, seed, progress)
    shards = FeatureShards(features)
    counts = shards.token_counts(text.vocab_size)
    size = min(draft_vocab, text.vocab_size)
    d2t, t2d = draft_vocabulary(counts, size)
    rope = getattr(text, "rope_parameters", None) or {}
    cfg = Eagle3Config(
        hidden_size=text.hidden_size, intermediate_size=text.intermediate_size,
        num_attention_heads=text.num_attention_heads, num_key_value_heads=text.num_key_value_heads,
        head_dim=getattr(text, "head_dim", None), rms_norm_eps=text.rms_norm_eps, hidden_act=text.hidden_act,
        vocab_size=text.vocab_size, draft_vocab_size=size, target_hidden_size=text.hidden_size,
        num_target_layers=text.num_hidden_layers, target_layer_ids=layer_ids,
        rope_theta=rope.get("rope_theta", getattr(text, "rope_theta", 10000.0)),
        target_model=getattr(target.config, "_name_or_path", None) or None,
    )
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(cfg)
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)
    drafter.bind_target(target)
    drafter.embed_tokens.weight.requires_grad_(False)
    used = torch.arange(size) + d2t
    head = target.get_output_embeddings().weight.detach()[used].clone()
    drafter.train()

    def loss_fn(model, batch):
        return ttt_loss(model, head, batch, steps=ttt_steps)

    def save(model, folder):  # a half-precision copy; the weights being trained stay fp32
        state = {k: (v.to(save_dtype) if v.is_floating_point() else v) for k, v in model.state_dict().items()
                 if k != "embed_tokens.weight"}
        model.save_pretrained(folder, state_dict=state)

    metrics = train(drafter, loss_fn, shards, out, config or TrainConfig(), save_model=save, progress=progress)
    final = Eagle3Drafter.from_pretrained(out / "final")
    return final, metrics


def distillation_loss(student, target_head: torch.Tensor, batch: dict, temperature: float = 1.0):
    """KL(target || student) of the next-token distributions on loss-masked positions (teacher forcing)."""
    ids = batch["input_ids"].long()
    mask = (batch["valid"] & batch["loss_mask"].bool())[:, 1:]
    logits = student(input_ids=ids, attention_mask=batch["valid"].long()).logits[:, :-1].float()
    with torch.no_grad():
        teacher = (batch["last"][:, :-1].to(target_head.dtype) @ target_head.T).float()
        p = torch.softmax(teacher / temperature, dim=-1)
    logq = torch.log_softmax(logits / temperature, dim=-1)
    per_pos = (p * (torch.log(p.clamp_min(1e-30)) - logq)).sum(-1)
    count = mask.sum().clamp(min=1)
    loss = (per_pos * mask).sum() / count
    with torch.no_grad():
        acc = ((logits.argmax(-1) == teacher.argmax(-1)) & mask).sum() / count
    return loss, {"acc0": float(acc)}


def train_draft(target, tokenizer, out_dir, layers: int = 4, samples: int = 1500, max_length: int = 384,
                config: TrainConfig | None = None, features_dir=None, seed: int = 0, save_dtype=torch.float16,
                progress: bool = True):
    """Distil a small student of the target's architecture (``layers`` decoder layers initialised from evenly spaced
    target layers, the target's embeddings and head, frozen) for the ``assisted`` method."""
    import copy

    from ..modeling.eagle3 import default_target_layer_ids
    from .features import FeatureShards

    text = target.config.get_text_config()
    out = Path(out_dir)
    features = Path(features_dir) if features_dir else out / "features"
    prepare_features(target, tokenizer, features, default_target_layer_ids(text.num_hidden_layers), samples,
                     max_length, seed, progress)
    shards = FeatureShards(features)
    cfg = copy.deepcopy(target.config)
    cfg.num_hidden_layers = layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:layers]
    student = type(target)(cfg)
    picks = torch.linspace(0, text.num_hidden_layers - 1, layers).round().long().tolist()
    state = target.state_dict()
    mapped = {}
    for key, value in state.items():
        parts = key.split(".")
        if "layers" in parts:
            i = parts.index("layers")
            src = int(parts[i + 1])
            if src in picks:
                for new, old in enumerate(picks):
                    if old == src:
                        mapped[".".join(parts[: i + 1] + [str(new)] + parts[i + 2:])] = value.clone()
        else:
            mapped[key] = value.clone()
    student.load_state_dict(mapped, strict=False)
    for p in student.get_input_embeddings().parameters():
        p.requires_grad_(False)
    for p in student.get_output_embeddings().parameters():
        p.requires_grad_(False)
    head = target.get_output_embeddings().weight.detach()
    student.train()

    def save(model, folder):
        model.save_pretrained(folder, state_dict={k: (v.to(save_dtype) if v.is_floating_point() else v)
                                                  for k, v in model.state_dict().items()})
        tokenizer.save_pretrained(folder)

    metrics = train(student, lambda m, b: distillation_loss(m, head, b), shards, out, config or TrainConfig(),
                    save_model=save, progress=progress)
    return type(target).from_pretrained(out / "final"), metrics
