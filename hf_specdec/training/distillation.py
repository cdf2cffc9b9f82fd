"""A distilled student for the ``assisted`` method (:func:`train_draft`): a few of the target's own layers, trained on
the shared feature cache against the target's next-token distributions (:func:`distillation_loss`)."""

from __future__ import annotations

import torch

from .corpus import shared_features
from .trainer import TrainConfig, mean_denominator, train


def distillation_loss(student, target_head: torch.Tensor, batch: dict, temperature: float = 1.0):
    """KL(target || student) of the next-token distributions on loss-masked positions (teacher forcing).

    Only the positions some row is trained on are scored (``logits_to_keep``): the LM head over the whole vocabulary
    is most of a student's cost, and prompts and padding carry no loss."""
    ids = batch["input_ids"].long()
    mask = (batch["valid"] & batch["loss_mask"].bool())[:, 1:]
    keep = mask.any(0).nonzero().squeeze(1)  # positions (of the inputs) whose next token some row learns
    mask = mask[:, keep]
    logits = student(input_ids=ids, attention_mask=batch["valid"].long(), logits_to_keep=keep).logits.float()
    with torch.no_grad():
        teacher = (batch["last"][:, keep].to(target_head.dtype) @ target_head.T).float()
        p = torch.softmax(teacher / temperature, dim=-1)
    logq = torch.log_softmax(logits / temperature, dim=-1)
    per_pos = (p * (torch.log(p.clamp_min(1e-30)) - logq)).sum(-1)
    count = mean_denominator(mask.sum())  # a mean over the global batch
    loss = (per_pos * mask).sum() / count
    with torch.no_grad():
        acc = ((logits.argmax(-1) == teacher.argmax(-1)) & mask).sum() / count
    return loss, {"acc0": float(acc)}


def train_draft(target, tokenizer, out_dir, layers: int = 4, samples: int = 1500, max_length: int = 384,
                config: TrainConfig | None = None, features_dir=None, seed: int = 0, save_dtype=torch.float16,
                progress: bool = True, regenerate_max_new_tokens: int | None = None, data_path=None,
                init_from=None, draft_vocab: int | None = 8192):
    """Distil a small student of the target's architecture (``layers`` decoder layers initialised from evenly spaced
    target layers, the target's embeddings and head, frozen) for the ``assisted`` method. ``init_from``: a student
    saved by an earlier run to continue from. ``draft_vocab``: the student is saved with the ``draft_vocab`` most
    frequent target tokens of the training data, the only ones the ``assisted`` method lets it draft (its head then
    scores those only); ``None``/0 or at least the vocabulary size: the whole vocabulary. Training is unaffected."""
    from ..draft_models import VOCAB_KEY, load_draft_model, save_draft_model
    from .eagle3 import draft_vocabulary

    out, _, shards = shared_features(target, tokenizer, out_dir, features_dir, samples, max_length, seed, progress,
                                     regenerate_max_new_tokens, data_path)
    vocab_size = target.config.get_text_config().vocab_size
    vocab = None
    if draft_vocab and draft_vocab < vocab_size:
        vocab = draft_vocabulary(shards.token_counts(vocab_size), draft_vocab)[1].nonzero().flatten()
    if init_from is not None:
        student = _init_student(load_draft_model(init_from, target))
        if vocab is None and hasattr(student, VOCAB_KEY):  # asked for the whole vocabulary: not the old run's
            delattr(student, VOCAB_KEY)
    else:
        student = _init_student(_student_from_layers(target, layers))
    head = target.get_output_embeddings().weight.detach()
    student.train()

    def save(model, folder):  # the target's embeddings/head are not stored (load with load_draft_model)
        save_draft_model(model, folder, save_dtype, tokenizer, draft_vocab=vocab)

    metrics = train(student, lambda m, b: distillation_loss(m, head, b), shards, out, config or TrainConfig(),
                    save_model=save, progress=progress)
    return load_draft_model(out / "final", target), metrics


def _init_student(student):
    student = student.float()
    for p in student.get_input_embeddings().parameters():
        p.requires_grad_(False)
    for p in student.get_output_embeddings().parameters():
        p.requires_grad_(False)
    return student


def _student_from_layers(target, layers: int):
    """The target's architecture with ``layers`` decoder layers copied from evenly spaced target layers."""
    import copy

    text = target.config.get_text_config()
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
    return student
