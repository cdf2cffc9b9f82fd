"""Property test (hypothesis): speculative decoding never crashes and is token-for-token plain greedy ``generate()``.

Each example draws a tiny random target (Llama, Qwen3, Gemma-3 text with sliding-window layers, GPT-2), a batch of
left-padded prompts of different lengths, ``max_new_tokens``, EOS ids (none, a token the target is about to produce,
or a list) and one built-in method with random options and, where it needs one, a random drafter built for the drawn
target (EAGLE-3 and DFlash drafters bind to the target's hidden size and layer count, Medusa heads to its width
and vocabulary). Method ``gemma4_assistant`` draws its own kind of target (Gemma 4, Gemma 4 Unified or Gemma 3n, with
KV sharing and sliding windows, :func:`gemma4_specs`) and an assistant reading its shared KV; ``universal`` reads the
targets' ids as text (one character per id, :func:`target_tokenizer`) and drafts with a model over another tokenizer
of that text (shuffled ids, merges, missing characters: :func:`drafter_tokenizer`); ``auto`` draws one kind of
transformers' own arguments (:func:`auto_options`). The property: the method's
output equals ``model.generate(do_sample=False)`` on the same batch (fp32), row for row.

Invalid draws that the library refuses on purpose are checked as such, not compared: a prompt plus
``max_new_tokens`` past the target's context window (``max_position_embeddings``) raises a ``ValueError`` naming the
window (plain ``generate()`` would run RoPE models past their trained length and index past GPT-2's position table).

One test case per method variant (every registered built-in method; EAGLE-3, DFlash and Medusa as a tree and as a
chain), each with ``EXAMPLES_PER_VARIANT`` derandomized draws (the same on every run), so the test takes 20-40 s on
two CPU cores; the built targets and drafters are cached per drawn configuration. For a longer search, raise
``EXAMPLES_PER_VARIANT`` (and drop ``derandomize``) locally.

What the draws do not reach: batch compaction (it needs more than 32 cache holes, i.e. long generations;
tests/test_lossless.py covers it), sampling (tests/test_sampling.py) and ``auto``'s ``use_mtp=True`` (it needs a
checkpoint with MTP layers: tests/test_auto.py). Random DFlash drafters are accepted rarely (an EAGLE-3 drafter
can be built to echo the last token, see :func:`build_eagle3`, and Medusa heads to repeat the root, see
:func:`build_medusa`; a DFlash block cannot as simply).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from transformers import (
    Gemma3ForCausalLM,
    Gemma3nForCausalLM,
    Gemma3nTextConfig,
    Gemma3TextConfig,
    Gemma4AssistantConfig,
    Gemma4AssistantForCausalLM,
    Gemma4ForCausalLM,
    Gemma4TextConfig,
    Gemma4UnifiedAssistantConfig,
    Gemma4UnifiedAssistantForCausalLM,
    Gemma4UnifiedForCausalLM,
    Gemma4UnifiedTextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import hf_specdec
from hf_specdec import SuffixCache
from hf_specdec.modeling.dflash import DFlashConfig, DFlashDrafter
from hf_specdec.modeling.eagle3 import Eagle3Config, Eagle3Drafter
from hf_specdec.modeling.layerskip import ExitAdapter, ExitAdapterConfig
from hf_specdec.modeling.medusa import MedusaConfig, MedusaHeads
from hf_specdec.proposers import Proposer
from hf_specdec.proposers.medusa import MC_SIM_7B_63
from hf_specdec.registry import builtin_methods
from hf_specdec.tree import DraftTree
from tiny import word_tokenizer

PAD, EOS, BOS = 0, 1, 2
ARCHS = ("llama", "qwen3", "gemma3", "gpt2")
GEMMA4_ARCHS = ("gemma4", "gemma4_unified", "gemma3n")  # the targets of method gemma4_assistant only
LAYER_TYPES = ("sliding_attention", "full_attention")
WIDE_WINDOW = 512  # the context window of most drawn targets: never reached
MAX_PROMPT = 10
MAX_NEW = 12
EXAMPLES_PER_VARIANT = 10  # 180 draws in all


# ------------------------------------------------------------------------------------------------ tiny models
@dataclass(frozen=True)
class TargetSpec:
    """A tiny random target. ``layer_types`` and ``sliding_window`` are Gemma-3's (and Gemma 4's); ``kv_heads`` is
    not used by GPT-2 (no grouped-query attention). The last fields are the Gemma 4 / Gemma 3n targets' (see
    :func:`gemma4_specs`): ``kv_shared`` last layers reuse the KV of earlier ones, full-attention layers have head dim
    ``global_head_dim`` (Gemma 4) and, where ``global_kv_heads`` is set, keys equal to values over that many heads
    (``attention_k_eq_v``); ``per_layer`` is Gemma 4's per-layer input width; ``agree`` scales the blocks' output
    norms (small: the target is close to a bigram model of its embeddings, which an assistant can copy)."""

    arch: str
    vocab: int
    hidden: int
    layers: int
    kv_heads: int
    seed: int
    window: int = WIDE_WINDOW
    layer_types: tuple[str, ...] = ()
    sliding_window: int = 0
    kv_shared: int = 0
    global_head_dim: int = 0
    global_kv_heads: int = 0
    per_layer: int = 0
    agree: float = 1.0


def _sharpen(model, factor: float = 3.0):
    """Scale every weight matrix: sharper logits, fewer near-ties between a random model's top tokens (a near-tie
    could flip with the summation order of a batched verification forward, which is not what this test is about)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(factor)
    return model


_TARGETS: dict[TargetSpec, torch.nn.Module] = {}


def build_target(spec: TargetSpec):
    """The fp32 model of ``spec`` (eval mode, sdpa attention), built once per spec."""
    if spec in _TARGETS:
        return _TARGETS[spec]
    torch.manual_seed(spec.seed)
    common = dict(vocab_size=spec.vocab, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS)
    attention = dict(hidden_size=spec.hidden, intermediate_size=2 * spec.hidden, num_hidden_layers=spec.layers,
                     num_attention_heads=4, num_key_value_heads=spec.kv_heads, max_position_embeddings=spec.window)
    if spec.arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**attention, **common))
    elif spec.arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**attention, head_dim=8, **common))
    elif spec.arch == "gemma3":
        config = Gemma3TextConfig(**attention, head_dim=8, sliding_window=spec.sliding_window,
                                  layer_types=list(spec.layer_types), **common)
        model = Gemma3ForCausalLM(config)
    elif spec.arch == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(n_embd=spec.hidden, n_layer=spec.layers, n_head=4,
                                           n_positions=spec.window, **common))
    elif spec.arch in GEMMA4_ARCHS:
        _TARGETS[spec] = _gemma4_target(spec, {**attention, **common})
        return _TARGETS[spec]
    else:
        raise ValueError(spec.arch)
    model.config._attn_implementation = "sdpa"
    _TARGETS[spec] = _sharpen(model.eval())
    return _TARGETS[spec]


# the norms after each sub-block of Gemma 4 / 3n (they set the scale of what a block adds to the residual)
POST_NORMS = ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight",
              "post_per_layer_input_norm.weight")


def _gemma4_shapes(spec: TargetSpec, hidden: int) -> dict:
    """The attention shapes a Gemma 4 text config of ``spec``'s target (or of an assistant for it) takes."""
    shapes = dict(num_attention_heads=4, num_key_value_heads=spec.kv_heads, head_dim=8,
                  sliding_window=spec.sliding_window, hidden_size=hidden, intermediate_size=2 * hidden)
    if spec.arch != "gemma3n":
        shapes["global_head_dim"] = spec.global_head_dim
        if spec.global_kv_heads:
            shapes.update(attention_k_eq_v=True, num_global_key_value_heads=spec.global_kv_heads)
    return shapes


def _sdpa(model):
    for config in (model.config, model.config.get_text_config()):
        config._attn_implementation = "sdpa"
    return model.eval()


def _gemma4_target(spec: TargetSpec, common: dict):
    """A Gemma 4, Gemma 4 Unified or Gemma 3n text model of ``spec`` (sharpened as the others, its blocks' output
    norms scaled by ``spec.agree``)."""
    common = {k: v for k, v in common.items() if k in ("vocab_size", "pad_token_id", "eos_token_id",
                                                        "bos_token_id", "max_position_embeddings")}
    shapes = dict(_gemma4_shapes(spec, spec.hidden), num_hidden_layers=spec.layers,
                  layer_types=list(spec.layer_types), num_kv_shared_layers=spec.kv_shared, **common)
    if spec.arch == "gemma4":
        model = Gemma4ForCausalLM(Gemma4TextConfig(**shapes, hidden_size_per_layer_input=spec.per_layer,
                                                   vocab_size_per_layer_input=spec.vocab, tie_word_embeddings=False))
    elif spec.arch == "gemma4_unified":
        model = Gemma4UnifiedForCausalLM(Gemma4UnifiedTextConfig(**shapes, tie_word_embeddings=False))
    else:  # Gemma 3n: AltUp, LAuReL, per-layer inputs, logits soft-capped at 30
        model = Gemma3nForCausalLM(Gemma3nTextConfig(**shapes, hidden_size_per_layer_input=4,
                                                     vocab_size_per_layer_input=spec.vocab, laurel_rank=4,
                                                     altup_num_inputs=2,
                                                     activation_sparsity_pattern=[0.0] * spec.layers))
    model = _sharpen(_sdpa(model))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(POST_NORMS):
                p.mul_(spec.agree)
        if spec.arch != "gemma3n":  # few near-ties between a bigram's top tokens (3n's soft cap would make ties)
            model.get_output_embeddings().weight.mul_(10.0)
    return model


def _randomize(module, seed: int, scale: float):
    """Seeded N(0, scale) weight matrices (norm weights stay 1): a drafter with opinions rather than the near-uniform
    distributions of a freshly initialised one. The shared target embedding of an EAGLE-3 drafter is skipped."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() >= 2 and not name.startswith("embed_tokens"):
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return module


_DRAFTERS: dict[tuple, torch.nn.Module] = {}


def build_eagle3(target_spec: TargetSpec, layer_ids: tuple[int, int, int], draft_vocab: int, echo: bool, seed: int):
    """A random EAGLE-3 drafter for the target of ``target_spec``: its width is the target's (it shares the target's
    token embeddings), it fuses the target's ``hidden_states[layer_ids]``; a draft vocabulary smaller than the
    target's maps through ``d2t`` / ``t2d`` as published drafters do.

    A random drafter almost never agrees with the target, and a fuzzer whose drafts are all rejected never selects
    an accepted tree path. ``echo`` (with ``layer_ids[0] == 0``, the target's input embeddings) builds one that mostly
    drafts the token before the root again, with random perturbations: the tiny targets repeat tokens in runs, so its
    drafts are often accepted, and when a run ends a second-ranked child of the tree sometimes is.
    """
    key = ("eagle3", target_spec, layer_ids, draft_vocab, echo, seed)
    if key not in _DRAFTERS:
        h = target_spec.hidden
        config = Eagle3Config(hidden_size=h, intermediate_size=2 * h, num_attention_heads=4, num_key_value_heads=2,
                              vocab_size=target_spec.vocab, draft_vocab_size=draft_vocab,
                              num_target_layers=target_spec.layers, target_layer_ids=list(layer_ids))
        torch.manual_seed(seed)
        drafter = _randomize(Eagle3Drafter(config), seed, scale=0.5)
        used = list(range(target_spec.vocab))
        if draft_vocab < target_spec.vocab:
            g = torch.Generator().manual_seed(seed)
            used = sorted(torch.randperm(target_spec.vocab, generator=g)[:draft_vocab].tolist())
            drafter.d2t.copy_(torch.tensor([t - i for i, t in enumerate(used)]))
            drafter.t2d.zero_()
            drafter.t2d[used] = True
        if echo:
            assert layer_ids[0] == 0
            embeddings = build_target(target_spec).get_input_embeddings().weight
            with torch.no_grad():
                scale = 1 / float(embeddings.std())
                drafter.fc.weight.mul_(0.02)
                drafter.fc.weight[:, :h] += scale * torch.eye(h)  # the first fused feature: the token's embedding
                drafter.midlayer.self_attn.o_proj.weight.mul_(0.02)
                drafter.midlayer.mlp.down_proj.weight.mul_(0.02)
                drafter.lm_head.weight.copy_(scale * embeddings[used])
        _DRAFTERS[key] = drafter.eval()
    return _DRAFTERS[key]


def build_dflash(target_spec: TargetSpec, layers: int, layer_ids: tuple[int, ...], block_size: int,
                 mask_token_id: int, sliding: bool, seed: int):
    """A random DFlash drafter for the target of ``target_spec`` (the target's width: it uses the target's
    embeddings and LM head), reading the outputs of target layers ``layer_ids``; ``sliding`` makes its first layer a
    sliding-window one."""
    key = ("dflash", target_spec, layers, layer_ids, block_size, mask_token_id, sliding, seed)
    if key not in _DRAFTERS:
        h = target_spec.hidden
        layer_types = ["full_attention"] * layers
        if sliding:
            layer_types[0] = "sliding_attention"
        config = DFlashConfig(hidden_size=h, intermediate_size=2 * h, num_hidden_layers=layers, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=8, vocab_size=target_spec.vocab, block_size=block_size,
                              mask_token_id=mask_token_id, target_layer_ids=list(layer_ids),
                              num_target_layers=target_spec.layers, layer_types=layer_types,
                              sliding_window=3 if sliding else None)
        torch.manual_seed(seed)
        _DRAFTERS[key] = _randomize(DFlashDrafter(config), seed, scale=0.5).eval()
    return _DRAFTERS[key]


def build_medusa(target_spec: TargetSpec, heads: int, layers: int, shared: bool, draft_vocab: int, echo: bool,
                 seed: int):
    """Random Medusa heads for the target of ``target_spec``. ``echo`` starts them as the reference's training
    does (zero blocks, the target's LM head rows as read-outs), perturbed: every head then mostly drafts the root
    token again, which the tiny targets' runs of repeated tokens often accept."""
    key = ("medusa", target_spec, heads, layers, shared, draft_vocab, echo, seed)
    if key not in _DRAFTERS:
        config = MedusaConfig(hidden_size=target_spec.hidden, vocab_size=target_spec.vocab, medusa_num_heads=heads,
                              medusa_num_layers=layers, shared_layers=shared, draft_vocab_size=draft_vocab)
        torch.manual_seed(seed)
        model = _randomize(MedusaHeads(config), seed, scale=0.5)
        g = torch.Generator().manual_seed(seed)
        used = torch.arange(target_spec.vocab) if draft_vocab == target_spec.vocab else \
            torch.randperm(target_spec.vocab, generator=g)[:draft_vocab].sort().values
        model.token_map.copy_(used)
        if echo:
            target = build_target(target_spec)
            model.init_from_target(target, used)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.02 * torch.randn(p.shape, generator=g))
        _DRAFTERS[key] = model.eval()
    return _DRAFTERS[key]


def build_exit_adapter(target_spec: TargetSpec, exit_layer: int, draft_vocab: int, mlp: bool, seed: int = 0):
    """A LayerSkip exit adapter for the target of ``target_spec``: the plain early exit plus a small random
    attention (and MLP) output, over a random draft vocabulary of ``draft_vocab`` tokens."""
    key = ("exit_adapter", target_spec, exit_layer, draft_vocab, mlp, seed)
    if key not in _DRAFTERS:
        target = build_target(target_spec)
        config = ExitAdapterConfig(exit_layer=exit_layer, hidden_size=target_spec.hidden, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=8, intermediate_size=16 if mlp else 0,
                                   vocab_size=target_spec.vocab, draft_vocab_size=draft_vocab,
                                   num_target_layers=target_spec.layers)
        g = torch.Generator().manual_seed(seed)
        used = torch.arange(target_spec.vocab) if draft_vocab == target_spec.vocab else \
            torch.randperm(target_spec.vocab, generator=g)[:draft_vocab].sort().values
        torch.manual_seed(seed)
        adapter = ExitAdapter(config).init_from_target(target, used)
        with torch.no_grad():
            for layer in adapter.layers:
                layer.o_proj.weight.add_(0.1 * torch.randn(layer.o_proj.weight.shape, generator=g))
        _DRAFTERS[key] = adapter.eval()
    return _DRAFTERS[key]


def build_mtp(target_spec: TargetSpec, draft_vocab: int, parallel: int, seed: int = 0):
    """An MTP module (``parallel=0``) or ``parallel`` parallel heads for the target of ``spec``: its own family's
    decoder layer(s), random weights, over a random draft vocabulary of ``draft_vocab`` tokens."""
    from hf_specdec.modeling.mtp import MTPConfig, MTPModule, ParallelMTPConfig, ParallelMTPHeads, block_config_for

    key = ("mtp", target_spec, draft_vocab, parallel, seed)
    if key not in _DRAFTERS:
        target = build_target(target_spec)
        text = target.config.get_text_config()
        common = dict(vocab_size=target_spec.vocab, draft_vocab_size=draft_vocab,
                      num_target_layers=target_spec.layers)
        torch.manual_seed(seed)
        if parallel:
            model = ParallelMTPHeads(ParallelMTPConfig(block_config=block_config_for(text, parallel),
                                                       num_modules=parallel, **common))
        else:
            model = MTPModule(MTPConfig(block_config=block_config_for(text, 1), **common))
        g = torch.Generator().manual_seed(seed)
        used = torch.arange(target_spec.vocab) if draft_vocab == target_spec.vocab else \
            torch.randperm(target_spec.vocab, generator=g)[:draft_vocab].sort().values
        model.set_draft_vocabulary(used)
        _DRAFTERS[key] = model.eval()
    return _DRAFTERS[key]


def build_gemma4_assistant(target_spec: TargetSpec, layer_types: tuple[str, ...], hidden: int, window: int,
                           oracle: bool, ordered: int, seed: int):
    """A Gemma 4 assistant for the Gemma 4 / 3n target of ``target_spec`` (a Gemma 4 Unified one for a Unified
    target): ``layer_types`` (each a type whose KV the target shares), width ``hidden``, sliding window ``window``,
    the target's KV geometry. ``oracle`` (width = the target's) reads the token's embedding and predicts the target's
    bigram, so that drafts of a low-``agree`` target are accepted; else random. ``ordered`` (plain assistants): the
    ordered-embedding head over 4 clusters, the best ``ordered`` of them scored."""
    key = ("gemma4_assistant", target_spec, layer_types, hidden, window, oracle, ordered, seed)
    if key not in _DRAFTERS:
        target = build_target(target_spec)
        unified = target_spec.arch == "gemma4_unified"
        spec = replace(target_spec, sliding_window=window)
        if target_spec.arch == "gemma3n":  # 3n's full-attention layers have the sliding ones' head dim
            spec = replace(spec, arch="gemma4", global_head_dim=8, global_kv_heads=0)
        common = dict(vocab_size=spec.vocab, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS,
                      max_position_embeddings=spec.window)
        text_cls, cfg_cls, cls = ((Gemma4UnifiedTextConfig, Gemma4UnifiedAssistantConfig,
                                   Gemma4UnifiedAssistantForCausalLM) if unified else
                                  (Gemma4TextConfig, Gemma4AssistantConfig, Gemma4AssistantForCausalLM))
        extra = {} if unified else dict(hidden_size_per_layer_input=0, vocab_size_per_layer_input=0)
        text = text_cls(**_gemma4_shapes(spec, hidden), num_hidden_layers=len(layer_types),
                        layer_types=list(layer_types), **extra, **common)
        ordering = dict(use_ordered_embeddings=True, num_centroids=4, centroid_intermediate_top_k=ordered) \
            if ordered else {}
        torch.manual_seed(seed)
        assistant = _sharpen(_sdpa(cls(cfg_cls(text_config=text, backbone_hidden_size=target_spec.hidden,
                                               **ordering))))
        with torch.no_grad():
            if ordered:
                assistant.masked_embedding.token_ordering.copy_(torch.randperm(spec.vocab))
            if oracle:
                h = target_spec.hidden
                assistant.pre_projection.weight.copy_(torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1))
                for name, p in assistant.named_parameters():
                    if name.endswith(POST_NORMS):
                        p.mul_(0.05)
                assistant.lm_head.weight.copy_(target.get_output_embeddings().weight)
                assistant.model.norm.weight.copy_(target.base_model.norm.weight)
        _DRAFTERS[key] = assistant
    return _DRAFTERS[key]


_TOKENIZERS: dict[tuple, object] = {}
DRAFTER_SPECIALS = ("<pad>", "</s>", "<s>", "<unk>")


def target_tokenizer(vocab: int):
    """The fuzz targets' tokenizer: :func:`tiny.word_tokenizer`, one character per id ``3..vocab-1``."""
    if ("target", vocab) not in _TOKENIZERS:
        _TOKENIZERS["target", vocab] = word_tokenizer(vocab)
    return _TOKENIZERS["target", vocab]


def drafter_tokenizer(vocab: int, seed: int, merges: int, missing: int):
    """Another tokenizer of the fuzz targets' text (a BPE, as the target's): its specials (an ``<unk>`` more) and the
    target's characters under shuffled ids, ``missing`` characters left out (it reads them as ``<unk>``), and
    ``merges`` BPE merges of random characters or earlier merges with a character (one drafter token for text the
    target spells with two or more). Returns the tokenizer and ``{piece: its id}``."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    key = ("drafter", vocab, seed, merges, missing)
    if key not in _TOKENIZERS:
        g = torch.Generator().manual_seed(seed)
        chars = [chr(30 + i) for i in range(3, vocab)]
        chars = [chars[i] for i in sorted(torch.randperm(len(chars), generator=g)[missing:].tolist())]
        pieces = list(DRAFTER_SPECIALS) + chars
        table = {piece: i for piece, i in zip(pieces, torch.randperm(len(pieces), generator=g).tolist())}
        pairs = []
        for _ in range(merges):
            left = pieces[4 + int(torch.randint(len(pieces) - 4, (1,), generator=g))]
            right = chars[int(torch.randint(len(chars), (1,), generator=g))]
            if left + right not in table:
                pairs.append((left, right))
                table[left + right] = len(table)
                pieces.append(left + right)
        tk = Tokenizer(models.BPE(vocab=table, merges=pairs, unk_token="<unk>"))
        tk.decoder = decoders.Fuse()
        tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="</s>", bos_token="<s>",
                                      unk_token="<unk>")
        tok.padding_side = "left"
        _TOKENIZERS[key] = (tok, table)
    return _TOKENIZERS[key]


def build_twin(target_spec: TargetSpec, vocab_key: tuple, seed: int = 0):
    """The target of ``target_spec`` over the drafter tokenizer ``drafter_tokenizer(*vocab_key)``'s ids: each
    piece that is a target token has that token's embedding and output rows (it predicts what the target predicts,
    spelt otherwise); a merged piece reads as its last character and scores as its first one, perturbed (drafted now
    and then instead of it); ``<unk>`` keeps the fresh rows of a model built with that vocabulary."""
    key = ("twin", target_spec, vocab_key, seed)
    if key not in _DRAFTERS:
        target = build_target(target_spec)
        _, table = drafter_tokenizer(*vocab_key)
        twin = copy.deepcopy(build_target(replace(target_spec, vocab=len(table))))
        mine = twin.state_dict()
        twin.load_state_dict({k: v for k, v in target.state_dict().items() if mine[k].shape == v.shape}, strict=False)
        theirs = target_tokenizer(target_spec.vocab).get_vocab()
        g = torch.Generator().manual_seed(seed)
        t_in, t_out = target.get_input_embeddings().weight, target.get_output_embeddings().weight
        d_in, d_out = twin.get_input_embeddings().weight, twin.get_output_embeddings().weight
        with torch.no_grad():
            for piece, i in table.items():
                if piece in theirs:
                    d_in[i], d_out[i] = t_in[theirs[piece]], t_out[theirs[piece]]
                elif piece != "<unk>":
                    first, last = theirs[piece[0]], theirs[piece[-1]]
                    d_in[i] = t_in[last]
                    d_out[i] = t_out[first] + 0.05 * t_out[first].abs().mean() * torch.randn(d_out.shape[1],
                                                                                              generator=g)
        _DRAFTERS[key] = twin.eval()
    return _DRAFTERS[key]


# ------------------------------------------------------------------------------------------------ strategies
# what each test case runs: every built-in method, EAGLE-3, DFlash, Medusa and MTP with their draft shapes
VARIANTS = {"prompt_lookup": "prompt_lookup", "assisted": "assisted", "eagle3_tree": "eagle3",
            "eagle3_chain": "eagle3", "dflash": "dflash", "dflash_tree": "dflash", "medusa_tree": "medusa",
            "medusa_chain": "medusa", "layerskip": "layerskip", "mtp_chain": "mtp", "mtp_tree": "mtp",
            "mtp_parallel": "mtp", "suffix": "suffix",
            "lookahead": "lookahead", "plain": "plain", "gemma4_assistant": "gemma4_assistant",
            "universal": "universal", "auto": "auto"}
HYBRID_VARIANTS = ("assisted", "eagle3_tree", "eagle3_chain", "dflash", "dflash_tree", "medusa_tree", "medusa_chain",
                   "mtp_chain", "mtp_tree", "mtp_parallel")  # the methods with a hybrid= option
DRIVABLE_ONLY = ("layerskip", "mtp_chain", "mtp_tree", "mtp_parallel")  # need a decoder-layer family (not GPT-2)


@st.composite
def target_specs(draw, vocab: int, window: int = WIDE_WINDOW, drivable: bool = False):
    """A tiny target of any of :data:`ARCHS`: 1-3 layers, width 16-48, 1, 2 or 4 key/value heads. ``drivable``:
    one LayerSkip can run in pieces (not GPT-2, 2-3 layers)."""
    arch = draw(st.sampled_from([a for a in ARCHS if a != "gpt2"] if drivable else ARCHS))
    layers = draw(st.integers(2 if drivable else 1, 3))
    spec = dict(arch=arch, vocab=vocab, hidden=draw(st.sampled_from([16, 32, 48])), layers=layers,
                kv_heads=draw(st.sampled_from([1, 2, 4])) if arch != "gpt2" else 4, seed=draw(st.integers(0, 3)),
                window=window)
    if arch == "gemma3":
        # at least one sliding layer and a window shorter than the sequences: the window really slides
        types = draw(st.lists(st.sampled_from(["sliding_attention", "full_attention"]), min_size=layers,
                              max_size=layers).filter(lambda t: "sliding_attention" in t))
        spec.update(layer_types=tuple(types), sliding_window=draw(st.integers(2, 6)))
    return TargetSpec(**spec)


@st.composite
def gemma4_specs(draw, vocab: int, window: int = WIDE_WINDOW):
    """A tiny target of method ``gemma4_assistant``: Gemma 4 (most often), Gemma 4 Unified or Gemma 3n, 1-4 layers
    of random types (the last one full attention: Gemma 4 forces it, and every assistant has one), a sliding window
    of 2-6 tokens, the last ``kv_shared`` layers reusing KV (as many as leave a layer computing KV for each type)."""
    arch = draw(st.sampled_from(["gemma4", "gemma4", "gemma4_unified", "gemma3n"]))
    layers = draw(st.integers(1, 4))
    types = draw(st.lists(st.sampled_from(LAYER_TYPES), min_size=layers - 1, max_size=layers - 1))
    types = tuple(types) + ("full_attention",)
    most_shared = max(s for s in range(layers) if set(types[:layers - s]) == set(types))
    spec = dict(arch=arch, vocab=vocab, hidden=draw(st.sampled_from([16, 32, 48])), layers=layers,
                kv_heads=draw(st.sampled_from([1, 2, 4])), seed=draw(st.integers(0, 3)), window=window,
                layer_types=types, sliding_window=draw(st.integers(2, 6)),
                kv_shared=draw(st.integers(0, most_shared)), agree=draw(st.sampled_from([0.05, 0.05, 1.0])))
    if arch != "gemma3n":
        spec.update(global_head_dim=draw(st.sampled_from([8, 16])),
                    global_kv_heads=draw(st.sampled_from([0, 0, 1, 2])))
    if arch == "gemma4":  # no per-layer inputs only without KV sharing: transformers 5.24's Gemma 4 then fails
        # a prefill with logits_to_keep (Gemma4TextModel._maybe_slice_kv_shared_inputs slices per_layer_inputs=None)
        spec["per_layer"] = draw(st.sampled_from([0, 4])) if spec["kv_shared"] == 0 else 4
    return TargetSpec(**spec)


@st.composite
def gemma4_assistants(draw, spec: TargetSpec):
    """A Gemma 4 assistant for the target of ``spec`` (:func:`build_gemma4_assistant`): 1 or 2 layers of types the
    target shares KV of (the last one full attention), often the oracle, its sliding window the target's or 3."""
    types = draw(st.sampled_from([("full_attention",), ("full_attention", "full_attention")] +
                                 ([("sliding_attention", "full_attention")]
                                  if "sliding_attention" in spec.layer_types else [])))
    oracle = spec.arch != "gemma3n" and draw(st.sampled_from([True, True, False]))
    ordered = draw(st.sampled_from([0, 0, 1, 3])) if spec.arch == "gemma4" else 0
    return build_gemma4_assistant(spec, types, spec.hidden if oracle else draw(st.sampled_from([16, spec.hidden])),
                                  window=draw(st.sampled_from([spec.sliding_window, 3])), oracle=oracle,
                                  ordered=ordered, seed=draw(st.integers(0, 2)))


@st.composite
def universal_drafters(draw, spec: TargetSpec):
    """``(drafter, the target's tokenizer, the drafter's tokenizer)`` for method ``universal``: the drafter's
    tokenizer is :func:`drafter_tokenizer` of the target's characters, the drafter the target's twin over it (most
    drafts accepted) or another tiny random model of its vocabulary."""
    vocab_key = (spec.vocab, draw(st.integers(0, 3)), draw(st.sampled_from([0, 0, 2, 6])),
                 draw(st.sampled_from([0, 0, 0, 2])))
    tok, table = drafter_tokenizer(*vocab_key)
    if draw(st.sampled_from(["twin", "twin", "other"])) == "twin":
        drafter = build_twin(spec, vocab_key, seed=draw(st.integers(0, 2)))
    else:
        drafter = build_target(draw(target_specs(len(table))))
    return drafter, target_tokenizer(spec.vocab), tok


@st.composite
def batches(draw, vocab: int):
    """``(input_ids, attention_mask)``: 1-3 rows of 1-10 real tokens, left padded to the longest. Rows are random
    or copy-friendly (a repeated chunk, so prompt lookup finds n-grams); any id may appear, EOS and pad ids too."""
    bsz = draw(st.integers(1, 3))
    rows = []
    for _ in range(bsz):
        n = draw(st.integers(1, MAX_PROMPT))
        if draw(st.booleans()):
            chunk = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=4))
            row = (chunk * n)[:n]
        else:
            row = draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n))
        rows.append(row)
    width = max(len(r) for r in rows)
    ids = torch.full((bsz, width), PAD, dtype=torch.long)
    mask = torch.zeros(bsz, width, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, width - len(row):] = torch.tensor(row)
        mask[b, width - len(row):] = 1
    return ids, mask


# mostly constant: the adaptive schedule soon stops drafting with a random drafter (or on a short output)
SCHEDULES = st.sampled_from(["constant", "adaptive", "constant"])


@st.composite
def method_options(draw, variant: str, spec: TargetSpec):
    """The options of one ``variant`` of :data:`VARIANTS`, its drafter (if any) built for the target of ``spec``."""
    if variant == "plain":  # no options: the loop without drafts
        return {}
    if variant == "auto":
        return draw(auto_options(spec))
    opts = {"draft_length_schedule": draw(SCHEDULES)}
    if variant == "prompt_lookup":
        opts.update(prompt_lookup_num_tokens=draw(st.sampled_from([None, 1, 3, 8])),
                    max_matching_ngram_size=draw(st.sampled_from([None, 1, 2, 4])))
    elif variant == "lookahead":  # W, N, G; a window of 1 and n-grams of 2 (plain Jacobi) included
        opts.update(window_size=draw(st.sampled_from([None, 1, 2, 4])),
                    ngram_size=draw(st.sampled_from([None, 2, 3, 5])),
                    guess_set_size=draw(st.sampled_from([None, 0, 1, 3])),
                    pool_from_prompt=draw(st.sampled_from([None, True, False])))
    elif variant == "suffix":
        opts.update(max_spec_tokens=draw(st.sampled_from([None, 1, 4, 12])),
                    use_tree_spec=draw(st.sampled_from([None, False])),
                    min_token_prob=draw(st.sampled_from([None, 0.0, 0.3])),
                    max_spec_factor=draw(st.sampled_from([None, 0.5, 2.0])),
                    max_tree_depth=draw(st.sampled_from([None, 2, 6])))
        if draw(st.booleans()):  # a cache with earlier outputs of random sequences of this vocabulary
            cache = SuffixCache(max_sequences=draw(st.integers(1, 4)), max_tokens=draw(st.integers(1, 64)))
            for _ in range(draw(st.integers(0, 3))):
                cache.add(draw(st.lists(st.integers(0, spec.vocab - 1), min_size=0, max_size=20)))
            opts["suffix_cache"] = cache
    elif variant == "assisted":
        # the target itself (every draft accepted), or another tiny model with the same vocabulary
        if draw(st.sampled_from(["self", "other"])) == "self":
            drafter = build_target(spec)
        else:
            drafter = build_target(draw(target_specs(spec.vocab)))
        opts.update(drafter=drafter, num_speculative_tokens=draw(st.sampled_from([None, 1, 2, 5])),
                    draft_vocab=draw(st.sampled_from([None, "full", "even"])))
        if opts["draft_vocab"] == "even":  # half the vocabulary: drafts outside it are never proposed
            opts["draft_vocab"] = list(range(0, spec.vocab, 2))
    elif variant in ("eagle3_tree", "eagle3_chain"):
        # three hidden_states indices in 0..layers (repeats allowed: a 1-layer target has only two)
        layer_ids = sorted(draw(st.lists(st.integers(0, spec.layers), min_size=3, max_size=3)))
        echo = draw(st.sampled_from([True, False]))
        if echo:
            layer_ids[0] = 0
        draft_vocab = draw(st.sampled_from([spec.vocab, spec.vocab // 2]))
        opts["drafter"] = build_eagle3(spec, tuple(layer_ids), draft_vocab, echo, seed=draw(st.integers(0, 2)))
        if variant == "eagle3_chain":
            opts["num_speculative_tokens"] = draw(st.integers(1, 5))
        else:  # any option left out takes its default
            top_k, depth = draw(st.integers(1, 4)), draw(st.integers(1, 4))
            opts.update(tree_top_k=draw(st.sampled_from([top_k, None])),
                        tree_depth=draw(st.sampled_from([depth, None])),
                        tree_total_tokens=draw(st.sampled_from([None] + list(range(2, 2 + top_k * depth + 2)))))
    elif variant in ("dflash", "dflash_tree"):  # a chain, or a DDTree of 1-12 nodes
        layers = draw(st.integers(1, 2))
        layer_ids = tuple(sorted(draw(st.lists(st.integers(0, spec.layers - 1), min_size=1, max_size=2))))
        block = draw(st.integers(2, 5))
        mask_token_id = draw(st.integers(0, spec.vocab - 1))
        opts["drafter"] = build_dflash(spec, layers, layer_ids, block, mask_token_id, sliding=draw(st.booleans()),
                                       seed=draw(st.integers(0, 2)))
        opts["block_size"] = draw(st.sampled_from([None] + list(range(2, block + 1))))
        opts["tree_budget"] = draw(st.integers(1, 12)) if variant == "dflash_tree" else 0
    elif variant in ("medusa_tree", "medusa_chain"):
        heads = draw(st.integers(1, 4))
        opts["drafter"] = build_medusa(spec, heads, draw(st.integers(1, 3)), draw(st.booleans()),
                                       draw(st.sampled_from([spec.vocab, spec.vocab // 2])), draw(st.booleans()),
                                       seed=draw(st.integers(0, 2)))
        if variant == "medusa_chain":
            opts["num_speculative_tokens"] = draw(st.integers(1, 5))
        else:  # the default pool, a prefix of mc_sim_7b_63, or a small random ancestor-closed tree
            pick = draw(st.sampled_from(["default", "prefix", "random"]))
            if pick == "prefix":
                opts["medusa_choices"] = [list(c) for c in MC_SIM_7B_63[:draw(st.integers(1, 63))]]
            elif pick == "random":
                paths = {(draw(st.integers(0, 3)),)}
                for _ in range(draw(st.integers(0, 8))):
                    parent = draw(st.sampled_from(sorted(paths)))
                    paths.add(parent + (draw(st.integers(0, 3)),))
                opts["medusa_choices"] = [list(p) for p in sorted(paths)]
    elif variant == "layerskip":
        exit_layer = draw(st.integers(1, spec.layers - 1))
        opts["num_speculative_tokens"] = draw(st.sampled_from([None, 1, 3, 5]))
        if draw(st.booleans()):
            opts["drafter"] = build_exit_adapter(spec, exit_layer, draw(st.sampled_from([spec.vocab, spec.vocab // 2])),
                                                 mlp=draw(st.booleans()), seed=draw(st.integers(0, 2)))
        else:
            opts["exit_layer"] = exit_layer
    elif variant in ("mtp_chain", "mtp_tree", "mtp_parallel"):
        draft_vocab = draw(st.sampled_from([spec.vocab, spec.vocab // 2]))
        parallel = draw(st.integers(1, 3)) if variant == "mtp_parallel" else 0
        opts["drafter"] = build_mtp(spec, draft_vocab, parallel, seed=draw(st.integers(0, 2)))
        if variant == "mtp_chain":
            opts["num_speculative_tokens"] = draw(st.sampled_from([None, 1, 2, 5]))
        elif variant == "mtp_parallel":
            opts["num_speculative_tokens"] = draw(st.sampled_from([None] + list(range(1, parallel + 1))))
        else:
            opts.update(tree_top_k=draw(st.integers(1, 3)), tree_depth=draw(st.integers(1, 3)),
                        tree_total_tokens=draw(st.sampled_from([None, 2, 4, 7])))
    elif variant == "gemma4_assistant":
        opts["drafter"] = draw(gemma4_assistants(spec))
        opts.update(num_speculative_tokens=draw(st.sampled_from([None, 1, 2, 4])),
                    tree_width=draw(st.sampled_from([None, 1, 2, 3])))
    elif variant == "universal":
        opts["drafter"], opts["tokenizer"], opts["assistant_tokenizer"] = draw(universal_drafters(spec))
        # one drafter token makes no target draft unless its text is complete (the last target token is held back)
        opts.update(num_speculative_tokens=draw(st.sampled_from([None, 1, 2, 3, 6])),
                    draft_vocab=draw(st.sampled_from([None, "shared", "full"])))
    elif variant not in ("suffix", "prompt_lookup"):
        raise ValueError(variant)
    if variant in HYBRID_VARIANTS:  # now and then with a drafter-free source in the same proposals
        opts["hybrid"] = draw(st.sampled_from([None, None, "suffix", "prompt_lookup"]))
    return {k: v for k, v in opts.items() if v is not None}


@st.composite
def auto_options(draw, spec: TargetSpec):
    """Method ``auto``: transformers' own arguments of one kind (each selects a method), with or without the
    assistant's draft-length fields: an assistant (the target itself or another model: ``assisted``), one with
    another tokenizer (``universal``), a DFlash assistant (``speculation_type="dflash"``), prompt lookup, early exit
    where the target can run in pieces (``layerskip``); a Gemma 4 assistant for a Gemma 4 / 3n target
    (``gemma4_assistant``, the only kind drawn for those)."""
    kinds = ["assistant", "universal", "dflash", "prompt_lookup"]
    if spec.arch != "gpt2" and spec.layers > 1:
        kinds.append("early_exit")
    kind = "gemma4" if spec.arch in GEMMA4_ARCHS else draw(st.sampled_from(kinds))
    opts = {}
    if kind == "gemma4":
        opts["assistant_model"] = draw(gemma4_assistants(spec))
    elif kind == "assistant":
        opts["assistant_model"] = build_target(spec) if draw(st.booleans()) else \
            build_target(draw(target_specs(spec.vocab)))
    elif kind == "universal":
        opts["assistant_model"], opts["tokenizer"], opts["assistant_tokenizer"] = draw(universal_drafters(spec))
    elif kind == "dflash":
        opts.update(speculation_type="dflash", assistant_model=build_dflash(
            spec, 1, (draw(st.integers(0, spec.layers - 1)),), draw(st.integers(2, 4)),
            mask_token_id=draw(st.integers(0, spec.vocab - 1)), sliding=False, seed=draw(st.integers(0, 2))))
    elif kind == "prompt_lookup":
        opts.update(prompt_lookup_num_tokens=draw(st.integers(1, 8)),
                    max_matching_ngram_size=draw(st.sampled_from([None, 1, 3])))
    else:
        opts["assistant_early_exit"] = draw(st.integers(1, spec.layers - 1))
    opts.update(num_assistant_tokens=draw(st.sampled_from([None, 2, 4])),
                num_assistant_tokens_schedule=draw(st.sampled_from([None, "constant", "heuristic"])),
                assistant_confidence_threshold=draw(st.sampled_from([None, None, 0.3])))
    return {k: v for k, v in opts.items() if v is not None}


@st.composite
def scenarios(draw, variant: str):
    """One call of ``variant``: the target, the batch, the generation settings, the method's options.

    The target's context window is usually out of reach; now and then it is set around the longest row plus
    ``max_new_tokens``: exactly filled (must work, GPT-2's last position included) or overrun by a token or two (the
    documented ``ValueError``)."""
    vocab = draw(st.sampled_from([16, 64, 12, 128]))  # small vocabularies: random drafts are right more often
    ids, mask = draw(batches(vocab))
    max_new = draw(st.integers(1, MAX_NEW))
    slack = draw(st.sampled_from([None] * 6 + [0, 1, -1]))
    window = WIDE_WINDOW if slack is None else int(mask.sum(1).max()) + max_new + slack
    if variant == "gemma4_assistant" or (variant == "auto" and draw(st.sampled_from([False] * 4 + [True]))):
        spec = draw(gemma4_specs(vocab, window))
    else:
        spec = draw(target_specs(vocab, window, drivable=variant in DRIVABLE_ONLY))
    return dict(spec=spec, ids=ids, mask=mask, max_new=max_new,
                eos=draw(st.sampled_from(["none", "likely", "list"])), eos_pick=draw(st.integers(0, 10 ** 6)),
                pad=draw(st.sampled_from([None, EOS])),  # None: the config's pad id (0); EOS: GPT-2's habit
                call=(VARIANTS[variant], draw(method_options(variant, spec))),
                entry=draw(st.sampled_from(["callable", "folder"])),
                cache=draw(st.sampled_from([None, None, None, "static"])))


# ------------------------------------------------------------------------------------------------ the property
@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Run the tiny models on one thread: their matrices are too small to split, and on a machine whose cores are
    busy with other work two threads that wait for each other made an example 10-50x slower (seconds, not 0.1 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def plain(model, ids, mask, **kw):
    return model.generate(input_ids=ids, attention_mask=mask, do_sample=False, **kw)


def speculative(model, ids, mask, method, opts, entry, **kw):
    if entry == "folder":
        kw.update(custom_generate=hf_specdec.custom_generate_path(method), trust_remote_code=True)
    else:
        kw.update(custom_generate=hf_specdec.decoding_method(method))
    return model.generate(input_ids=ids, attention_mask=mask, **{"do_sample": False, **opts, **kw})


def eos_ids(choice: str, pick: int, free: torch.LongTensor, prompt_len: int):
    """``None``, one token of the free-running plain output (so some row really stops there), or a list of two."""
    if choice == "none":
        return None
    new = free[:, prompt_len:].reshape(-1).tolist()
    first = new[pick % len(new)]
    if choice == "likely":
        return first
    return [first, new[(pick // 7) % len(new)] if len(new) > 1 else EOS]


def past_the_window(spec: TargetSpec, mask: torch.LongTensor, max_new: int) -> bool:
    """The longest row plus ``max_new_tokens`` does not fit the target's context window."""
    return int(mask.sum(1).max()) + max_new > spec.window


def check_scenario(spec, ids, mask, max_new, eos, eos_pick, call, entry, cache, pad=None):
    """The property for one draw (also the body of the regression tests)."""
    model = build_target(spec)
    method, opts = call
    kw = dict(max_new_tokens=max_new)
    if cache is not None:
        kw["cache_implementation"] = cache
    if pad is not None:  # the id finished rows are padded with
        kw["pad_token_id"] = pad
    if past_the_window(spec, mask, max_new):
        with pytest.raises(ValueError, match="context window"):
            speculative(model, ids, mask, method, opts, entry, eos_token_id=None, **kw)
        return
    free = plain(model, ids, mask, eos_token_id=None, **kw)
    kw["eos_token_id"] = eos_ids(eos, eos_pick, free, ids.shape[1])
    ref = free if kw["eos_token_id"] is None else plain(model, ids, mask, **kw)
    out = speculative(model, ids, mask, method, opts, entry, **kw)
    assert out.shape == ref.shape and torch.equal(out, ref), (
        f"{method} {opts} differs from plain generate():\nplain {ref.tolist()}\nspec  {out.tolist()}")


@pytest.mark.parametrize("variant", list(VARIANTS))
@settings(max_examples=EXAMPLES_PER_VARIANT, deadline=None, derandomize=True, database=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
@given(data=st.data())
def test_speculative_greedy_is_plain_greedy(variant, data):
    check_scenario(**data.draw(scenarios(variant), label="scenario"))


COUPLED_EXAMPLES = 8  # sampled draws per variant for the coupled property
WARPS = (dict(temperature=1.0, top_k=0), dict(temperature=0.7, top_p=0.9), dict(temperature=1.3, top_k=5),
         dict(temperature=0.9, repetition_penalty=1.2))


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "plain"])
@settings(max_examples=COUPLED_EXAMPLES, deadline=None, derandomize=True, database=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
@given(data=st.data())
def test_coupled_sampling_is_the_plain_loops(variant, data):
    """Sampled with coupled sampling (the default), every method's text is the plain loop's for the same seed:
    any target, batch, options, warpers (a repetition penalty: the host walk), EOS, cache and entry point."""
    sc = data.draw(scenarios(variant), label="scenario")
    assume(not past_the_window(sc["spec"], sc["mask"], sc["max_new"]))
    warp = data.draw(st.sampled_from(WARPS), label="warp")
    model = build_target(sc["spec"])
    kw = dict(max_new_tokens=sc["max_new"], do_sample=True, seed=data.draw(st.integers(0, 2 ** 40), label="seed"),
              eos_token_id=None if sc["eos"] == "none" else sc["eos_pick"] % sc["spec"].vocab, **warp)
    if sc["cache"] is not None:
        kw["cache_implementation"] = sc["cache"]
    if sc["pad"] is not None:
        kw["pad_token_id"] = sc["pad"]
    method, opts = sc["call"]
    ref = speculative(model, sc["ids"], sc["mask"], "plain", {}, sc["entry"], **kw)
    out = speculative(model, sc["ids"], sc["mask"], method, opts, sc["entry"], **kw)
    assert out.shape == ref.shape and torch.equal(out, ref), (
        f"{method} {opts} {warp} differs from the plain loop:\nplain {ref.tolist()}\nspec  {out.tolist()}")


def test_every_builtin_method_is_drawn():
    """The fuzzer covers the registry: a new built-in method must get a variant in :data:`VARIANTS`."""
    assert set(VARIANTS.values()) == set(builtin_methods())


# ------------------------------------------------------------------------------------------------ regressions
# Bugs the fuzzer found, shrunk to their smallest form. Both crashed GPT-2 (absolute positions: a position id past
# n_positions indexes out of its position table) while RoPE models silently computed a throw-away row.

def test_gpt2_prompt_next_to_the_window_calibrates_only_usable_sizes():
    """The cost calibration before the first step timed forwards of up to ``proposer.max_nodes`` tokens (21 for
    prompt lookup) at the root's position: past the window when the prompt nearly fills it, although the call itself
    fits (found with a 1-token prompt and ``max_new_tokens=2`` on a 14-position GPT-2; here the prompt and
    ``max_new_tokens`` fill the window exactly)."""
    spec = TargetSpec("gpt2", vocab=64, hidden=16, layers=1, kv_heads=4, seed=0, window=14)
    ids, mask = torch.tensor([[5] * 10]), torch.ones(1, 10, dtype=torch.long)
    check_scenario(spec, ids, mask, max_new=4, eos="none", eos_pick=0, call=("prompt_lookup", {}), entry="callable",
                   cache=None)


class ScriptedChain(Proposer):
    """Drafts the target's true continuation (``reference``): ``script[step][b]`` tokens for row ``b`` at each step
    (capped by the row's budget), so a test decides which rows accept how much."""

    name = "scripted_chain"

    def __init__(self, reference: torch.LongTensor, script: list[list[int]]):
        self.reference = reference
        self.script = script
        self.max_nodes = 1 + max(max(step) for step in script)
        self.step = 0

    def propose(self, state):
        wanted = self.script[min(self.step, len(self.script) - 1)]
        self.step += 1
        counts = [min(n, state.max_drafts[b]) for b, n in enumerate(wanted)]
        width = max(counts)
        if width == 0:
            return None
        drafts = torch.zeros(state.batch_size, width, dtype=torch.long)
        for b, n in enumerate(counts):
            start = state.lengths[b]
            drafts[b, :n] = self.reference[b, start:start + n]
        return DraftTree.chain(state.roots(), drafts, torch.tensor(counts))


def test_gpt2_padding_nodes_of_a_finished_row_stay_inside_the_window():
    """A batch whose rows take different numbers of drafts pads the shorter trees; the padding nodes sat at
    ``root_position + depth`` like real ones, so a row that had just filled the window (here: row 0 accepts two
    drafts and finishes, row 1 still drafts one) placed them past GPT-2's position table."""
    spec = TargetSpec("gpt2", vocab=16, hidden=16, layers=1, kv_heads=4, seed=1, window=14)
    model = build_target(spec)
    ids = torch.tensor([[7, 3, 9, 4, 7, 3, 9, 4, 7, 3], [0] * 9 + [5]])
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    kw = dict(max_new_tokens=4, eos_token_id=None, do_sample=False)
    ref = model.generate(input_ids=ids, attention_mask=mask, **kw)
    proposer = ScriptedChain(ref, script=[[2, 0], [0, 1]])
    out = model.generate(input_ids=ids, attention_mask=mask, custom_generate=hf_specdec.decoding_method(proposer), **kw)
    assert torch.equal(out, ref)
