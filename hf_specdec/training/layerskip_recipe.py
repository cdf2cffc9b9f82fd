"""The LayerSkip recipe (:func:`train_layerskip`): continued training of the target itself, with layer dropout and
early-exit losses (the losses: :mod:`.layerskip`)."""

from __future__ import annotations

from pathlib import Path

import torch

from .trainer import TrainConfig, train


def train_layerskip(target, tokenizer, out_dir, samples: int = 1500, max_length: int = 384,
                    config: TrainConfig | None = None, seed: int = 0, progress: bool = True,
                    regenerate_max_new_tokens: int | None = None, data_path=None, max_dropout: float = 0.1,
                    dropout_scale: str = "exp", curriculum: str = "rotational", exit_every: int = 8,
                    exit_scale: float = 1.0, **_ignored):
    """Continue training ``target`` itself with the LayerSkip recipe (:func:`.layerskip.layerskip_loss`): layer
    dropout rising to ``max_dropout`` at the last layer, and early-exit losses through the shared final norm and LM
    head on the layers of the ``curriculum`` ('rotational': every ``exit_every``-th layer, rotating; 'gradual').
    Every weight trains, so this is for GPUs (``accelerate launch`` for several); the result, ``<out_dir>/final``, is
    a new target model (a plain transformers folder) to run with ``layerskip`` and ``exit_layer=E``."""
    from .corpus import training_samples
    from .layerskip import dropout_rates, layerskip_loss

    out = Path(out_dir)
    pairs = training_samples(tokenizer, samples, max_length=max_length, seed=seed, target=target,
                             regenerate_max_new_tokens=regenerate_max_new_tokens, data_path=data_path)
    data = [{"input_ids": torch.tensor(ids), "loss_mask": torch.tensor(mask, dtype=torch.uint8)}
            for ids, mask in pairs]
    config = config or TrainConfig()
    model = target.float()
    model.train()
    for p in model.parameters():
        p.requires_grad_(True)
    n = model.config.get_text_config().num_hidden_layers
    rates = dropout_rates(n, max_dropout, dropout_scale)
    per_epoch = max(1, -(-len(data) // max(config.batch_size, 1)) // max(config.grad_accum, 1))
    total = config.max_steps or max(1, int(per_epoch * config.epochs))
    calls = [0]

    def loss_fn(m, batch):  # the curriculum advances per optimizer step
        step = calls[0] // max(config.grad_accum, 1)
        calls[0] += 1
        return layerskip_loss(m, batch, step, rates, curriculum, exit_every, total, exit_scale)

    def save(m, folder):
        m.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    metrics = train(model, loss_fn, data, out, config, save_model=save, progress=progress)
    model.eval()
    return model, metrics
