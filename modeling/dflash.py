"""DFlash drafter (Chen, Liang, Liu, 2026: block diffusion for speculative decoding) as a transformers model.

As published by z-lab (``dflash/model.py``):

* no embeddings and no LM head of its own: the block is embedded with the target's embeddings and read out with the
  target's LM head (:meth:`DFlashDrafter.bind_target` keeps references to them, never saved);
* ``fc`` over the concatenated target features (``target_layer_ids`` are layer *outputs*: HF ``hidden_states[i + 1]``),
  then ``hidden_norm``: one context feature per committed token, injected as keys/values in *every* layer (context ‖
  block), with no per-layer input norm on the context;
* queries come from the block only (the last committed token followed by ``block_size - 1`` mask tokens), which is
  bidirectional inside itself and sees all earlier context; q/k RMS norms per head; RoPE at absolute positions;
  layers may be causal or sliding-window as the config's ``layer_types`` / ``causal`` say; a final norm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModel, PretrainedConfig, PreTrainedModel

from hf_specdec._transformers import ACT2FN, LlamaRMSNorm
from hf_specdec.placement import execution_device, materialized

from .common import LoadsWithoutKernelsMixin, target_fit_problems


def default_dflash_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default taps: evenly from layer 1 to layer N - 3 (layer output ids), one per draft layer."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    return [int(round(1 + i * (num_target_layers - 4) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


class DFlashConfig(PretrainedConfig):
    """Configuration of :class:`DFlashDrafter`.

    Args:
        hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim,
        rms_norm_eps, hidden_act, attention_bias: the drafter's decoder layers (Qwen3-style, with q/k norms).
        vocab_size: the target's vocabulary (``mask_token_id`` must be inside it).
        block_size: tokens per drafted block (the anchor included).
        mask_token_id: the target embedding row used for the masked block positions.
        target_layer_ids: target layer *output* ids of the fused context (HF ``hidden_states[i + 1]``).
        num_target_layers: decoder layers of the target the drafter was trained for.
        target_hidden_size: width of each target feature (defaults to ``hidden_size``).
        layer_types: per layer ``"full_attention"`` or ``"sliding_attention"`` (``sliding_window`` tokens).
        causal: make every layer causal inside the block (a published variant); by default a layer is causal only
            when it is a sliding layer and ``causal_sliding`` is set.
    """

    model_type = "hf_specdec_dflash"

    def __init__(self, hidden_size: int = 4096, intermediate_size: int = 12288, num_hidden_layers: int = 5,
                 num_attention_heads: int = 32, num_key_value_heads: int = 8, head_dim: int | None = None,
                 rms_norm_eps: float = 1e-6, hidden_act: str = "silu", attention_bias: bool = False,
                 vocab_size: int = 151936, block_size: int = 16, mask_token_id: int | None = None,
                 target_layer_ids: list[int] | None = None, num_target_layers: int | None = None,
                 target_hidden_size: int | None = None, layer_types: list[str] | None = None,
                 sliding_window: int | None = None, causal: bool = False, causal_sliding: bool = False,
                 rope_theta: float = 1_000_000.0, max_position_embeddings: int = 40960,
                 target_model: str | None = None, initializer_range: float = 0.02, **kwargs):
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim if head_dim is not None else hidden_size // num_attention_heads
        self.rms_norm_eps = rms_norm_eps
        self.hidden_act = hidden_act
        self.attention_bias = attention_bias
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        self.num_target_layers = num_target_layers
        if target_layer_ids is None and num_target_layers is not None:
            target_layer_ids = default_dflash_layer_ids(num_target_layers, num_hidden_layers)
        self.target_layer_ids = list(target_layer_ids) if target_layer_ids is not None else None
        self.target_hidden_size = target_hidden_size if target_hidden_size is not None else hidden_size
        self.layer_types = list(layer_types) if layer_types else ["full_attention"] * num_hidden_layers
        self.sliding_window = sliding_window
        self.causal = causal
        self.causal_sliding = causal_sliding
        self.rope_theta = float(rope_theta)
        self.max_position_embeddings = max_position_embeddings
        self.target_model = target_model
        self.initializer_range = initializer_range
        kwargs.pop("tie_word_embeddings", None)
        super().__init__(tie_word_embeddings=False, **kwargs)
        self.validate_fields()

    def validate_fields(self) -> None:
        if self.block_size < 2:
            raise ValueError(f"block_size must be at least 2, got {self.block_size}.")
        if self.mask_token_id is None:
            raise ValueError("DFlash needs mask_token_id (dflash_config.mask_token_id in published configs).")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary (0..{self.vocab_size - 1}).")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers.")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_attention layers need sliding_window.")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads.")

    def layer_ids_for(self, num_target_layers: int) -> list[int]:
        if self.target_layer_ids is not None:
            return self.target_layer_ids
        return default_dflash_layer_ids(num_target_layers, self.num_hidden_layers)

    def layer_is_causal(self, i: int) -> bool:
        return self.causal or (self.causal_sliding and self.layer_types[i] == "sliding_attention")

    def check_target(self, target_config) -> None:
        """Raise a clear error when this drafter was made for another target."""
        problems = target_fit_problems(self, target_config, "target_layer_ids", self.layer_ids_for)
        if problems:
            raise ValueError("This DFlash drafter does not fit the target model: " + "; ".join(problems) + ".")


class DFlashAttention(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        self.num_heads, self.num_kv, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                      config.head_dim)
        h, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=bias)
        self.q_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def rope(self, x, position_ids):
        inv = 1.0 / (self.config.rope_theta ** (
            torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=x.device) / self.head_dim))
        ang = position_ids.to(device=x.device, dtype=torch.float32)[..., None] * inv
        emb = torch.cat([ang, ang], dim=-1)
        cos, sin = emb.cos()[:, None].to(x.dtype), emb.sin()[:, None].to(x.dtype)
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    def forward(self, x, context, block_pos, context_pos, mask, cache, layer_idx):
        bsz, n, _ = x.shape
        kv_in = torch.cat([context, x], dim=1) if context is not None and context.shape[1] else x
        kv_pos = torch.cat([context_pos, block_pos], dim=1) if context is not None and context.shape[1] else block_pos
        q = self.q_norm(self.q_proj(x).view(bsz, n, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_in).view(bsz, kv_in.shape[1], self.num_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(kv_in).view(bsz, kv_in.shape[1], self.num_kv, self.head_dim).transpose(1, 2)
        q, k = self.rope(q, block_pos), self.rope(k, kv_pos)
        if cache is not None:
            k, v = cache.update(k, v, layer_idx)
        rep = self.num_heads // self.num_kv
        if rep > 1:
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, n, self.num_heads * self.head_dim))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.mlp.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.mlp.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x, context, block_pos, context_pos, mask, cache):
        h = x + self.self_attn(self.input_layernorm(x), context, block_pos, context_pos, mask, cache, self.layer_idx)
        m = self.post_attention_layernorm(h)
        return h + self.mlp.down_proj(self.act(self.mlp.gate_proj(m)) * self.mlp.up_proj(m))


class DFlashDrafter(LoadsWithoutKernelsMixin, PreTrainedModel):
    """The DFlash block drafter. ``forward`` returns the final-normed hidden states of the block; the target's LM head
    turns positions ``1..block_size-1`` into draft logits (:meth:`draft_logits`).

    Example:
        >>> drafter = DFlashDrafter.from_pretrained("path/to/converted").bind_target(target)
        >>> out = target.generate(**inputs, custom_generate="hf_specdec/dflash", trust_remote_code=True,
        ...                       drafter=drafter)
    """

    config_class = DFlashConfig
    base_model_prefix = "dflash"
    main_input_name = "noise_embeds"
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config: DFlashConfig):
        super().__init__(config)
        n_taps = len(config.target_layer_ids) if config.target_layer_ids else config.num_hidden_layers
        self.fc = nn.Linear(n_taps * config.target_hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self._target_embed = None
        self._target_head = None
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=self.config.initializer_range)
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, LlamaRMSNorm):
            module.weight.data.fill_(1.0)

    def bind_target(self, target) -> "DFlashDrafter":
        """Check the drafter fits ``target`` and use its embeddings and LM head (kept as plain references; an
        embedding table offloaded by Accelerate is read once, the LM head runs through its hooks)."""
        self.config.check_target(target.config)
        object.__setattr__(self, "_target_embed", target.get_input_embeddings())
        object.__setattr__(self, "_target_embed_weight", materialized(self._target_embed))
        object.__setattr__(self, "_target_head", target.get_output_embeddings())
        return self

    def feature_layer_ids(self, target_config) -> list[int]:
        text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        return self.config.layer_ids_for(text.num_hidden_layers)

    def project(self, target_features: torch.Tensor) -> torch.Tensor:
        """``hidden_norm(fc(features))``: the context fed to every layer as keys/values."""
        return self.hidden_norm(self.fc(target_features.to(self.fc.weight.dtype)))

    def embed(self, ids: torch.LongTensor) -> torch.Tensor:
        if self._target_embed is None:
            raise RuntimeError("Call bind_target(target) first: DFlash uses the target's embeddings and LM head.")
        # the raw embedding table (a model's own embedding scaling, e.g. Gemma's, is not part of DFlash's input)
        table = self._target_embed_weight
        return F.embedding(ids.to(table.device), table).to(self.fc.weight.device, self.fc.weight.dtype)

    def forward(self, noise_embeds: torch.Tensor, context: torch.Tensor | None, block_positions: torch.LongTensor,
                context_positions: torch.LongTensor | None = None, attention_mask=None, cache=None) -> torch.Tensor:
        """Hidden states of the block.

        Args:
            noise_embeds: ``[B, n, H]`` embeddings of the block (anchor, then mask tokens).
            context: ``[B, c, H]`` projected context (:meth:`project`) of the committed tokens not yet in ``cache``.
            block_positions / context_positions: absolute positions ``[B, n]`` / ``[B, c]``.
            attention_mask: ``[B, 1, n, K]`` additive, or a per-layer list of them (``None``: see everything).
            cache: a transformers cache holding earlier context keys/values (one layer per drafter layer).
        """
        h = noise_embeds.to(self.fc.weight.dtype)
        for i, layer in enumerate(self.layers):
            mask = attention_mask[i] if isinstance(attention_mask, (list, tuple)) else attention_mask
            h = layer(h, context, block_positions, context_positions, mask, cache)
        return self.norm(h)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self._target_head
        return head(hidden.to(execution_device(head), head.weight.dtype))


AutoConfig.register(DFlashConfig.model_type, DFlashConfig)
AutoModel.register(DFlashConfig, DFlashDrafter)
