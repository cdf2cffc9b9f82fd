"""Trainers of the drafters that learn a network of their own on the shared feature cache
(:func:`.corpus.shared_features`): EAGLE-3 (:func:`train_eagle3`), DFlash (:func:`train_dflash`) and Medusa heads
(:func:`train_medusa`)."""

from __future__ import annotations

import torch

from .corpus import shared_features
from .saving import _half_copy, _record_dtype, _target_id
from .trainer import TrainConfig, train


def train_eagle3(target, tokenizer, out_dir, samples: int = 1500, max_length: int = 384, draft_vocab: int = 8192,
                 config: TrainConfig | None = None, features_dir=None, ttt_steps: int = 7, seed: int = 0,
                 save_dtype=torch.float16, progress: bool = True, regenerate_max_new_tokens: int | None = None,
                 data_path=None, init_from=None):
    """Train an EAGLE-3 drafter for ``target`` on ShareGPT (or ``data_path``); the result is saved in ``out_dir``
    (``save_dtype``). ``init_from``: a trained drafter folder to start from (its weights and draft vocabulary)."""
    from ..modeling.eagle3 import Eagle3Config, Eagle3Drafter
    from .eagle3 import draft_vocabulary

    text = target.config.get_text_config()
    out, layer_ids, shards = shared_features(target, tokenizer, out_dir, features_dir, samples, max_length, seed,
                                             progress, regenerate_max_new_tokens, data_path)
    torch.manual_seed(seed)
    if init_from is not None:
        drafter = _init_drafter(Eagle3Drafter, init_from, target, layer_ids)
        return _train_eagle3_model(drafter, target, shards, out, config, ttt_steps, save_dtype, progress)
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
        target_model=_target_id(target),
    )
    drafter = Eagle3Drafter(cfg)
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)
    return _train_eagle3_model(drafter, target, shards, out, config, ttt_steps, save_dtype, progress)


def _init_drafter(cls, folder, target, taps: list[int]):
    """A trained drafter to continue from, in fp32, checked against the target and the feature cache's ``taps``."""
    drafter = cls.from_pretrained(folder, dtype=torch.float32)
    drafter.config.check_target(target.config)
    reads = drafter.config.layer_ids_for(target.config.get_text_config().num_hidden_layers)
    if list(reads) != list(taps):
        raise ValueError(f"{folder} reads target layers {reads}; the feature cache was built for {list(taps)}.")
    return drafter


def _train_eagle3_model(drafter, target, shards, out, config, ttt_steps, save_dtype, progress):
    from ..modeling.eagle3 import Eagle3Drafter
    from .eagle3 import ttt_loss

    drafter.bind_target(target)
    drafter.embed_tokens.weight.requires_grad_(False)
    used = torch.arange(drafter.config.draft_vocab_size) + drafter.d2t
    head = target.get_output_embeddings().weight.detach()[used].clone()
    drafter.train()

    def loss_fn(model, batch):
        return ttt_loss(model, head, batch, steps=ttt_steps)

    def save(model, folder):  # a half-precision copy; the weights being trained stay fp32
        state = {k: (v.to(save_dtype) if v.is_floating_point() else v) for k, v in model.state_dict().items()
                 if k != "embed_tokens.weight"}
        model.save_pretrained(folder, state_dict=state)
        _record_dtype(folder, save_dtype)

    metrics = train(drafter, loss_fn, shards, out, config or TrainConfig(), save_model=save, progress=progress)
    final = Eagle3Drafter.from_pretrained(out / "final")
    return final, metrics


def train_dflash(target, tokenizer, out_dir, layers: int = 3, block_size: int = 16, mask_token_id: int | None = None,
                 samples: int = 1500, max_length: int = 384, config: TrainConfig | None = None, features_dir=None,
                 num_anchors: int = 16, gamma: float = 7.0, seed: int = 0, save_dtype=torch.float16,
                 progress: bool = True, regenerate_max_new_tokens: int | None = None, data_path=None,
                 init_from=None):
    """Train a DFlash drafter for ``target``. The context taps are the layer outputs matching EAGLE-3's default
    features (so both drafters share one feature cache); ``mask_token_id`` defaults to the last vocabulary row.
    ``init_from``: a trained DFlash drafter folder to start from."""
    from ..modeling.dflash import DFlashConfig, DFlashDrafter
    from .dflash import block_loss, layer_ids_from_features

    text = target.config.get_text_config()
    out, hidden_ids, shards = shared_features(target, tokenizer, out_dir, features_dir, samples, max_length, seed,
                                              progress, regenerate_max_new_tokens, data_path)
    taps = layer_ids_from_features(hidden_ids)
    torch.manual_seed(seed)
    if init_from is not None:
        drafter = _init_drafter(DFlashDrafter, init_from, target, taps)
    else:
        rope = getattr(text, "rope_parameters", None) or {}
        drafter = DFlashDrafter(DFlashConfig(
            hidden_size=text.hidden_size, intermediate_size=text.intermediate_size, num_hidden_layers=layers,
            num_attention_heads=text.num_attention_heads, num_key_value_heads=text.num_key_value_heads,
            head_dim=getattr(text, "head_dim", None), rms_norm_eps=text.rms_norm_eps, hidden_act=text.hidden_act,
            vocab_size=text.vocab_size, block_size=block_size,
            mask_token_id=text.vocab_size - 1 if mask_token_id is None else mask_token_id,
            target_layer_ids=taps, num_target_layers=text.num_hidden_layers, target_hidden_size=text.hidden_size,
            rope_theta=rope.get("rope_theta", getattr(text, "rope_theta", 10000.0)),
            target_model=_target_id(target),
        ))
    drafter.config.check_target(target.config)
    embed = target.get_input_embeddings().weight.detach()
    head = target.get_output_embeddings().weight.detach()
    generator = torch.Generator().manual_seed(seed)
    drafter.train()

    def save(model, folder):
        model.save_pretrained(folder, state_dict={k: v.to(save_dtype) for k, v in model.state_dict().items()})

    metrics = train(drafter, lambda m, b: block_loss(m, embed, head, b, num_anchors, gamma, generator), shards, out,
                    config or TrainConfig(), save_model=save, progress=progress)
    return DFlashDrafter.from_pretrained(out / "final"), metrics


def train_medusa(target, tokenizer, out_dir, heads: int = 3, layers: int = 1, draft_vocab: int = 8192,
                 samples: int = 1500, max_length: int = 384, config: TrainConfig | None = None, features_dir=None,
                 seed: int = 0, save_dtype=torch.float16, progress: bool = True,
                 regenerate_max_new_tokens: int | None = None, data_path=None, init_from=None, decay: float = 1.0):
    """Train Medusa-1 heads for the frozen ``target`` on its cached final hidden states (the shared feature cache):
    ``heads`` heads of ``layers`` residual blocks, reading out the ``draft_vocab`` most frequent training tokens
    (their rows of the target's LM head to start with, the blocks at zero, as the reference starts). ``init_from``:
    a trained heads folder to continue from (its heads, blocks and draft vocabulary). ``decay``: head ``i``'s loss
    weight is ``decay ** i`` (1: the reference's plain sum)."""
    from ..modeling.medusa import MedusaConfig, MedusaHeads
    from .eagle3 import draft_vocabulary
    from .medusa import draft_index, medusa_loss

    text = target.config.get_text_config()
    out, _, shards = shared_features(target, tokenizer, out_dir, features_dir, samples, max_length, seed, progress,
                                     regenerate_max_new_tokens, data_path)
    torch.manual_seed(seed)
    if init_from is not None:
        model = MedusaHeads.from_pretrained(init_from, dtype=torch.float32).bind_target(target)
    else:
        size = min(draft_vocab, text.vocab_size)
        d2t, _ = draft_vocabulary(shards.token_counts(text.vocab_size), size)
        model = MedusaHeads(MedusaConfig(
            hidden_size=text.hidden_size, vocab_size=text.vocab_size, medusa_num_heads=heads,
            medusa_num_layers=layers, draft_vocab_size=size,
            base_model_name_or_path=_target_id(target),
        )).init_from_target(target, torch.arange(size) + d2t)
    index = draft_index(model.token_map, text.vocab_size)
    model.train()

    metrics = train(model, lambda m, b: medusa_loss(m, index, b, decay), shards, out, config or TrainConfig(),
                    save_model=_half_copy(save_dtype), progress=progress)
    return MedusaHeads.from_pretrained(out / "final"), metrics
