"""An exit adapter for LayerSkip self-speculation (Kangaroo, Liu et al., 2024) as a transformers ``PreTrainedModel``.

Self-speculation drafts with the target's own first ``E`` layers. A target trained with the LayerSkip recipe
(facebook/layerskip-*) reads its early exit with its own final norm and LM head; for any other target that exit is
poor (SmolLM2's layer 8 agrees with its output 3 % of the time). The adapter is a small trained module between the
exit and the target's frozen LM head, with the target itself unchanged, so the output stays the target's:

* input: the output of layer ``E - 1``, i.e. HF ``hidden_states[E]`` (``exit_layer = E``) of every token;
* ``num_hidden_layers`` adapter layers, each ``h <- h + attn(norm(h))`` (causal self-attention with RoPE over the
  earlier tokens' adapter keys/values, kept in the adapter's own cache) and, when ``intermediate_size > 0``,
  ``h <- h + mlp(norm(h))`` (SwiGLU). Kangaroo's adapter is one layer without the MLP (``intermediate_size=0``);
* a final RMSNorm, then the target's LM head: over the whole vocabulary, or over the ``draft_vocab_size`` target
  ids in ``token_map`` (rows of the target's head, taken when the adapter is bound to its target; never stored).

:meth:`ExitAdapter.init_from_target` starts with the attention and MLP outputs at zero and the target's final-norm
weight, so an untrained adapter drafts exactly what the plain early exit drafts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModel, PretrainedConfig, PreTrainedModel

from hf_specdec._transformers import ACT2FN, LlamaRMSNorm
from hf_specdec.placement import execution_device

from .common import LoadsWithoutKernelsMixin, TargetHeadMixin, target_fit_problems


class ExitAdapterConfig(PretrainedConfig):
    """Configuration of :class:`ExitAdapter`.

    Args:
        exit_layer: ``E``: the adapter reads the output of the target's layer ``E - 1`` (1 <= E < target layers).
        hidden_size: the target's hidden size.
        num_hidden_layers: adapter layers.
        num_attention_heads, num_key_value_heads, head_dim, rope_theta, rms_norm_eps: their attention and norms.
        intermediate_size: SwiGLU width of each layer's MLP; 0 for none (Kangaroo's adapter).
        vocab_size: the target's vocabulary; draft_vocab_size: how many of its tokens the adapter drafts
            (``token_map``; default all).
        num_target_layers: the target's layer count.
        base_model_name_or_path: the target the adapter was trained for (fit is checked by shape).
    """

    model_type = "hf_specdec_exit_adapter"

    def __init__(self, exit_layer: int = 8, hidden_size: int = 576, num_hidden_layers: int = 1,
                 num_attention_heads: int = 9, num_key_value_heads: int = 3, head_dim: int | None = None,
                 intermediate_size: int = 0, hidden_act: str = "silu", rope_theta: float = 10000.0,
                 rms_norm_eps: float = 1e-5, vocab_size: int = 49152, draft_vocab_size: int | None = None,
                 num_target_layers: int = 30, base_model_name_or_path: str | None = None,
                 initializer_range: float = 0.02, **kwargs):
        self.exit_layer = exit_layer
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim if head_dim is not None else (
            hidden_size // num_attention_heads if num_attention_heads else None)
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.rope_theta = rope_theta
        self.rms_norm_eps = rms_norm_eps
        self.vocab_size = vocab_size
        self.draft_vocab_size = draft_vocab_size if draft_vocab_size is not None else vocab_size
        self.num_target_layers = num_target_layers
        self.base_model_name_or_path = base_model_name_or_path
        self.initializer_range = initializer_range
        kwargs.pop("tie_word_embeddings", None)
        super().__init__(tie_word_embeddings=False, **kwargs)
        self.validate_fields()

    def validate_fields(self) -> None:
        for name in ("exit_layer", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "vocab_size", "draft_vocab_size", "num_target_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ExitAdapterConfig.{name} must be a positive integer, got {value!r}.")
        if not isinstance(self.intermediate_size, int) or self.intermediate_size < 0:
            raise ValueError(f"ExitAdapterConfig.intermediate_size must be >= 0, got {self.intermediate_size!r}.")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}.")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} is larger than the vocabulary "
                             f"{self.vocab_size}.")
        if not 1 <= self.exit_layer < self.num_target_layers:
            raise ValueError(f"exit_layer {self.exit_layer} must be in 1..{self.num_target_layers - 1} (the target "
                             f"has {self.num_target_layers} layers).")
        if self.hidden_act not in ACT2FN:
            raise ValueError(f"Unknown hidden_act {self.hidden_act!r}.")

    @property
    def target_hidden_size(self) -> int:  # the adapter reads the target's hidden states: same width
        return self.hidden_size

    def check_target(self, target_config) -> None:
        """Raise a clear error when the adapter was made for another target (vocabulary, hidden size, layers)."""
        problems = target_fit_problems(self, target_config, "exit layer", lambda n: [self.exit_layer])
        if problems:
            made_for = f" (made for {self.base_model_name_or_path})" if self.base_model_name_or_path else ""
            raise ValueError(f"This exit adapter{made_for} does not fit the target model: " + "; ".join(problems)
                             + ".")


def _rope(x: torch.Tensor, position_ids: torch.LongTensor, theta: float) -> torch.Tensor:
    dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=x.device) / dim))
    freqs = position_ids.to(device=x.device, dtype=torch.float32)[..., None] * inv_freq  # [B, T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos()[:, None].to(x.dtype), emb.sin()[:, None].to(x.dtype)
    half = dim // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class ExitAdapterLayer(nn.Module):
    """``h + attn(norm(h))``, then ``+ mlp(norm(h))`` when the config has an MLP."""

    def __init__(self, config: ExitAdapterConfig, index: int):
        super().__init__()
        self.config, self.index = config, index
        heads, kv, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.q_proj = nn.Linear(config.hidden_size, heads * dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, kv * dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, kv * dim, bias=False)
        self.o_proj = nn.Linear(heads * dim, config.hidden_size, bias=False)
        if config.intermediate_size:
            self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
            self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
            self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
            self.act = ACT2FN[config.hidden_act]

    def forward(self, hidden, position_ids, attention_mask=None, cache=None):
        cfg = self.config
        bsz, length, _ = hidden.shape
        x = self.input_layernorm(hidden)
        q = self.q_proj(x).view(bsz, length, cfg.num_attention_heads, cfg.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(bsz, length, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(bsz, length, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        q, k = _rope(q, position_ids, cfg.rope_theta), _rope(k, position_ids, cfg.rope_theta)
        if cache is not None:
            k, v = cache.update(k, v, self.index)
        if attention_mask is not None and attention_mask.dtype != q.dtype:
            attention_mask = attention_mask.to(q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask,
                                             is_causal=attention_mask is None and length > 1,
                                             enable_gqa=cfg.num_key_value_heads != cfg.num_attention_heads)
        hidden = hidden + self.o_proj(out.transpose(1, 2).reshape(bsz, length, -1))
        if cfg.intermediate_size:
            y = self.post_attention_layernorm(hidden)
            hidden = hidden + self.down_proj(self.act(self.gate_proj(y)) * self.up_proj(y))
        return hidden


class ExitAdapter(LoadsWithoutKernelsMixin, TargetHeadMixin, PreTrainedModel):
    """The exit adapter (see the module docstring).

    ``forward(hidden_states [B, q, H], position_ids [B, q], attention_mask=None, cache=None) -> normed [B, q, H]``;
    :meth:`logits` reads them out with the bound target's LM head (over ``token_map`` when the draft vocabulary is
    smaller); :meth:`draft_to_target` maps draft ids to target ids.

    Example::

        adapter = ExitAdapter.from_pretrained(folder).bind_target(target)
        normed = adapter(target_hidden_states[adapter.config.exit_layer], position_ids)
        draft_ids = adapter.logits(normed).argmax(-1)
    """

    config_class = ExitAdapterConfig
    base_model_prefix = "adapter"
    main_input_name = "hidden_states"
    _no_split_modules = ["ExitAdapterLayer"]

    def __init__(self, config: ExitAdapterConfig):
        super().__init__(config)
        self.layers = nn.ModuleList(ExitAdapterLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.register_buffer("token_map", torch.arange(config.draft_vocab_size, dtype=torch.long))
        self.head: nn.Linear | None = None  # the target's LM head rows of token_map (bind_target), not a parameter
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, LlamaRMSNorm):
            module.weight.data.fill_(1.0)

    def init_from_target(self, target, draft_ids: torch.LongTensor | None = None) -> "ExitAdapter":
        """Start from the plain early exit: attention and MLP outputs zero, the final norm the target's; sets
        ``token_map`` (``draft_ids``: the target ids kept, default all) and binds the target."""
        self.config.check_target(target.config)
        self.set_draft_vocabulary(torch.arange(self.config.vocab_size) if draft_ids is None else draft_ids)
        with torch.no_grad():
            for layer in self.layers:
                layer.o_proj.weight.zero_()
                if self.config.intermediate_size:
                    layer.down_proj.weight.zero_()
            norm = getattr(target.base_model, "norm", None)
            if isinstance(norm, nn.Module):
                # the target norm's effective scale, whatever its parametrisation (Gemma's is 1 + w): its output
                # for a constant input c, which has RMS c (c large: the epsilon drops out)
                param = next(norm.parameters(), None)
                probe = torch.full((1, self.config.hidden_size), 1e3, dtype=param.dtype if param is not None else
                                   torch.float32, device=execution_device(norm))  # not the weight's: meta if offloaded
                scale = norm(probe).float()
                self.norm.weight.copy_(scale[0].to(self.norm.weight))
        return self.bind_target(target)

    def forward(self, hidden_states: torch.Tensor, position_ids: torch.LongTensor, attention_mask=None, cache=None):
        """The adapter's normed output for the exit hidden states ``[B, q, H]`` (keys/values appended to ``cache``,
        one layer per adapter layer); ``attention_mask``: additive ``[B, 1, q, keys]`` (``None``: causal)."""
        if hidden_states.shape[-1] != self.config.hidden_size:
            raise ValueError(f"The exit adapter reads {self.config.hidden_size}-wide hidden states, got "
                             f"{hidden_states.shape[-1]}.")
        device = self.norm.weight.device  # the exit layer's output may come from another device of the target
        x = hidden_states.to(device, self.norm.weight.dtype)
        position_ids = position_ids.to(device)
        attention_mask = attention_mask.to(device) if isinstance(attention_mask, torch.Tensor) else attention_mask
        for layer in self.layers:
            x = layer(x, position_ids, attention_mask, cache)
        return self.norm(x)


AutoConfig.register(ExitAdapterConfig.model_type, ExitAdapterConfig)
AutoModel.register(ExitAdapterConfig, ExitAdapter)
