"""Trainers of drafters made of the frozen target's own pieces and read out through its LM head (post-hoc): the
MTP module (:func:`train_mtp`), parallel MTP heads (:func:`train_parallel_mtp`) and the LayerSkip exit adapter
(:func:`train_exit_adapter`), on what they share (:func:`_train_posthoc`)."""

from __future__ import annotations

import torch

from .corpus import shared_features
from .saving import _half_copy, _target_id
from .trainer import TrainConfig, main_process_first, train


def _train_posthoc(model_cls, build, target, draft_vocab, shards, data, out, loss, config, init_from, save_dtype,
                   progress):
    """What the trainers of drafters that read out through the frozen target's head share (MTP modules, parallel
    heads, exit adapters): ``model_cls(build(size))`` started from ``target`` over the
    ``draft_vocab`` most frequent training tokens (or ``init_from``'s weights), trained with ``loss(model, in_draft,
    batch)`` on ``data`` and saved in ``save_dtype``; returns the saved model (bound to ``target``) and the metrics."""
    from .eagle3 import draft_vocabulary

    vocab = target.config.get_text_config().vocab_size
    if init_from is not None:
        model = model_cls.from_pretrained(init_from, dtype=torch.float32).bind_target(target)
    else:
        size = min(draft_vocab, vocab)
        d2t, _ = draft_vocabulary(shards.token_counts(vocab), size)
        model = model_cls(build(size)).init_from_target(target, torch.arange(size) + d2t)
    in_draft = torch.zeros(vocab, dtype=torch.bool)
    in_draft[model.token_map.cpu()] = True
    model.head.float()
    model.train()
    metrics = train(model, lambda m, b: loss(m, in_draft, b), data, out, config or TrainConfig(),
                    save_model=_half_copy(save_dtype), progress=progress)
    return model_cls.from_pretrained(out / "final").bind_target(target), metrics


def train_mtp(target, tokenizer, out_dir, depths: int = 3, draft_vocab: int = 8192, samples: int = 1500,
              max_length: int = 384, config: TrainConfig | None = None, features_dir=None, seed: int = 0,
              save_dtype=torch.float16, progress: bool = True, regenerate_max_new_tokens: int | None = None,
              data_path=None, init_from=None, decay: float = 0.8):
    """Train a DeepSeek-V3-style MTP module for the frozen ``target`` (post-hoc): one decoder layer of the target's
    own family between its embedding and its LM head (over the ``draft_vocab`` most frequent training tokens), fed
    with the target's cached final hidden states (the shared feature cache) and trained at chain depths
    ``1..depths`` (depth ``j`` weighed ``decay ** j``; :func:`.mtp.mtp_loss`). The block starts as a copy of the
    target's last layer. ``init_from``: a module folder to continue from."""
    from ..modeling.mtp import MTPConfig, MTPModule, block_config_for
    from .mtp import mtp_loss

    text = target.config.get_text_config()
    out, _, shards = shared_features(target, tokenizer, out_dir, features_dir, samples, max_length, seed, progress,
                                     regenerate_max_new_tokens, data_path)
    torch.manual_seed(seed)

    def build(size):
        return MTPConfig(block_config=block_config_for(text, 1), num_modules=1, layout="deepseek",
                         vocab_size=text.vocab_size, draft_vocab_size=size, num_target_layers=text.num_hidden_layers,
                         base_model_name_or_path=_target_id(target))

    return _train_posthoc(MTPModule, build, target, draft_vocab, shards, shards, out,
                          lambda m, in_draft, b: mtp_loss(m, in_draft, b, depths, decay), config, init_from,
                          save_dtype, progress)


def train_parallel_mtp(target, tokenizer, out_dir, heads: int = 3, draft_vocab: int = 8192, samples: int = 1500,
                       max_length: int = 384, config: TrainConfig | None = None, features_dir=None, seed: int = 0,
                       save_dtype=torch.float16, progress: bool = True, regenerate_max_new_tokens: int | None = None,
                       data_path=None, init_from=None, decay: float = 1.0):
    """Train ``heads`` parallel MTP heads (Gloeckle et al.) for the frozen ``target``: extra decoder layers of its
    family on its trunk (the input of its last layer, added to the shared feature cache; the target's layers
    ``0..N-2`` run once more over the data), each started as a copy of the last layer and read out through the
    target's final norm and LM head (:func:`.mtp.parallel_heads_loss`)."""
    from ..modeling.mtp import ParallelMTPConfig, ParallelMTPHeads, block_config_for
    from .layerskip import ExitShards, exit_features
    from .mtp import parallel_heads_loss

    text = target.config.get_text_config()
    out, _, shards = shared_features(target, tokenizer, out_dir, features_dir, samples, max_length, seed, progress,
                                     regenerate_max_new_tokens, data_path)
    with main_process_first() as main:
        data = ExitShards(shards, exit_features(target, shards, text.num_hidden_layers - 1, progress and main))
    torch.manual_seed(seed)

    def build(size):
        return ParallelMTPConfig(block_config=block_config_for(text, heads), num_modules=heads,
                                 vocab_size=text.vocab_size, draft_vocab_size=size,
                                 num_target_layers=text.num_hidden_layers, base_model_name_or_path=_target_id(target))

    return _train_posthoc(ParallelMTPHeads, build, target, draft_vocab, shards, data, out,
                          lambda m, in_draft, b: parallel_heads_loss(m, in_draft, b, decay), config, init_from,
                          save_dtype, progress)


def train_exit_adapter(target, tokenizer, out_dir, exit_layer: int = 4, draft_vocab: int = 8192, mlp: bool = True,
                       layers: int = 1,
                       samples: int = 1500, max_length: int = 384, config: TrainConfig | None = None,
                       features_dir=None, seed: int = 0, save_dtype=torch.float16, progress: bool = True,
                       regenerate_max_new_tokens: int | None = None, data_path=None, init_from=None):
    """Train a LayerSkip exit adapter (Kangaroo-style) for the frozen ``target``: ``layers`` adapter layers
    (attention, and a SwiGLU MLP of the target's width unless ``mlp=False``) between ``hidden_states[exit_layer]``
    and the target's LM head over the ``draft_vocab`` most frequent training tokens, started as the plain early exit.
    The exit states are added to the shared feature cache (only layers ``0..exit_layer-1`` run). ``init_from``: an
    adapter folder to continue from."""
    from ..modeling.layerskip import ExitAdapter, ExitAdapterConfig
    from .layerskip import ExitShards, exit_adapter_loss, exit_features

    text = target.config.get_text_config()
    out, _, shards = shared_features(target, tokenizer, out_dir, features_dir, samples, max_length, seed, progress,
                                     regenerate_max_new_tokens, data_path)
    with main_process_first() as main:
        data = ExitShards(shards, exit_features(target, shards, exit_layer, progress and main))
    torch.manual_seed(seed)
    rope = getattr(text, "rope_parameters", None) or {}

    def build(size):
        return ExitAdapterConfig(
            exit_layer=exit_layer, hidden_size=text.hidden_size, num_hidden_layers=layers,
            num_attention_heads=text.num_attention_heads,
            num_key_value_heads=getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
            intermediate_size=text.intermediate_size if mlp else 0,
            rope_theta=float(rope.get("rope_theta", getattr(text, "rope_theta", 10000.0))),
            rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6), vocab_size=text.vocab_size, draft_vocab_size=size,
            num_target_layers=text.num_hidden_layers, base_model_name_or_path=_target_id(target))

    return _train_posthoc(ExitAdapter, build, target, draft_vocab, shards, data, out,
                          lambda m, in_draft, b: exit_adapter_loss(m, b), config, init_from, save_dtype, progress)
