"""Tiny seeded random models and a word-level tokenizer for the tests (no download)."""

from __future__ import annotations

import contextlib

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB = 96
PAD, EOS, BOS = 0, 1, 2
# where the tiny models and prompts live: the CPU, or what ``pytest --device cuda`` names (tests marked ``device`` run
# there; tests/conftest.py sets it before collection)
DEVICE = torch.device("cpu")


def on_device(module_or_tensor):
    """``module_or_tensor`` moved to :data:`DEVICE` (the CPU unless ``pytest --device`` names another)."""
    return module_or_tensor.to(DEVICE)
ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "gpt2")


@contextlib.contextmanager
def one_thread():
    """torch on one thread inside the block (for bf16 / fp16 models: their products go through oneDNN's thread pool
    even at tiny shapes, and on a busy 2-core machine each then waits for a time slice)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _scale(model, factor: float):
    # sharper, more varied logits: fewer near-ties between the top tokens of a random model
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.mul_(factor)
    return model


def tiny_model(arch: str = "llama", seed: int = 0, vocab: int = VOCAB, layers: int = 2, hidden: int = 32,
               scale: float = 3.0, **overrides):
    """A seeded random causal LM in fp32 (eval mode, sdpa attention)."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS)
    if arch == "llama":
        cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, **common)
        cls = LlamaForCausalLM
    elif arch == "qwen2":
        cfg = Qwen2Config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, **common)
        cls = Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg = Qwen3Config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                          **common)
        cls = Qwen3ForCausalLM
    elif arch == "gemma3":
        # a window of 6 tokens: the tests' sequences are longer, so the window really slides
        cfg = Gemma3TextConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=max(layers, 2),
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=6,
                               layer_types=["sliding_attention", "full_attention"] * (max(layers, 2) // 2),
                               max_position_embeddings=512, **common)
        cls = Gemma3ForCausalLM
    elif arch == "gpt2":
        cfg = GPT2Config(n_embd=hidden, n_layer=layers, n_head=4, n_positions=512, **common)
        cls = GPT2LMHeadModel
    else:
        raise ValueError(arch)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    cfg._attn_implementation = "sdpa"
    model = cls(cfg).eval()
    return on_device(_scale(model, scale))


def word_tokenizer(vocab: int = VOCAB) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: ids 0..2 are <pad>, </s>, <s>; id ``i >= 3`` is the character ``chr(30 + i)``."""
    from tokenizers import Tokenizer, decoders, models

    chars = [chr(30 + i) for i in range(3, vocab)]
    table = {w: i for i, w in enumerate(["<pad>", "</s>", "<s>"] + chars)}
    tk = Tokenizer(models.BPE(vocab=table, merges=[], unk_token="<pad>"))
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="</s>", bos_token="<s>")
    tok.padding_side = "left"
    return tok


CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}:{{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}")


def chat_tokenizer(vocab: int = VOCAB) -> PreTrainedTokenizerFast:
    """:func:`word_tokenizer` with a chat template (pipelines with chat messages, transformers serve)."""
    tok = word_tokenizer(vocab)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def prompts(batch: int = 1, length: int = 10, seed: int = 1, pad: bool = True, repeat: bool = True):
    """Random prompts (copy-friendly: the first half repeats) with left padding that differs per row."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for b in range(batch):
        n = length - (2 * b if pad else 0)
        base = torch.randint(3, VOCAB, (max(n // 2, 1),), generator=g)
        row = torch.cat([base, base])[:n] if repeat else torch.randint(3, VOCAB, (n,), generator=g)
        rows.append(row)
    width = max(len(r) for r in rows)
    ids = torch.full((batch, width), PAD, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, width - len(r):] = r
        mask[b, width - len(r):] = 1
    return on_device(ids), on_device(mask)


# methods a tiny Llama target cannot run (their tests build their own targets)
OWN_TARGETS = {"gemma4_assistant": "a Gemma 4 target (tests/test_gemma4_assistant.py)",
               "universal": "two tokenizers (tests/test_universal.py)"}


def tiny_drafter(method: str, target):
    """A small fp32 drafter of ``method`` for ``target`` (a tiny Llama of :func:`tiny_model`, any width and depth);
    ``assisted`` and ``auto`` (transformers' ``assistant_model=``): a one-layer draft model of the same vocabulary."""
    from hf_specdec.modeling.dflash import DFlashConfig, DFlashDrafter
    from hf_specdec.modeling.eagle3 import Eagle3Config, Eagle3Drafter
    from hf_specdec.modeling.layerskip import ExitAdapter, ExitAdapterConfig
    from hf_specdec.modeling.medusa import MedusaConfig, MedusaHeads
    from hf_specdec.modeling.mtp import MTPConfig, MTPModule, block_config_for

    cfg = target.config
    hidden, layers, vocab = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    torch.manual_seed(0)
    if method in ("assisted", "auto"):
        return tiny_model("llama", seed=9, layers=1, vocab=vocab, hidden=hidden)
    if method == "eagle3":
        return Eagle3Drafter(Eagle3Config(hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=4,
                                          num_key_value_heads=2, vocab_size=vocab, num_target_layers=layers))
    if method == "dflash":
        return DFlashDrafter(DFlashConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=vocab,
                                          block_size=4, mask_token_id=vocab - 1, target_layer_ids=[0, 1],
                                          num_target_layers=layers))
    if method == "medusa":
        return MedusaHeads(MedusaConfig(hidden_size=hidden, vocab_size=vocab, medusa_num_heads=2))
    if method == "layerskip":
        config = ExitAdapterConfig(exit_layer=1, hidden_size=hidden, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=8, intermediate_size=16, vocab_size=vocab, num_target_layers=layers)
        return ExitAdapter(config).init_from_target(target, torch.arange(vocab))
    if method == "mtp":
        return MTPModule(MTPConfig(block_config=block_config_for(target.config, 1), vocab_size=vocab,
                                   num_target_layers=layers))
    raise AssertionError(f"no test drafter for the method {method!r}: add one to tests/tiny.py (tiny_drafter)")
