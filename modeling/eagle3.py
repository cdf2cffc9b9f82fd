"""EAGLE-3 drafter (Li et al., 2025) as a transformers ``PreTrainedModel``.

One decoder layer over the fused target features, exactly as the reference (SafeAILab/EAGLE ``eagle/model/cnets.py``)
computes it:

* ``fc`` maps three concatenated target hidden states (``3 * target_hidden_size``) to ``hidden_size``; it is applied
  only to such inputs: deeper draft steps feed back the drafter's own pre-norm output (``hidden_size``) unchanged.
* the layer's q/k/v read ``cat(input_layernorm(embedding), hidden_norm(h))`` (embedding first, ``2 * hidden_size``
  wide); the residual is the un-normed ``h`` (``hidden_norm(h)`` with ``norm_before_residual``, a speculators flag).
* logits are ``lm_head(norm(h))`` over a draft vocabulary; ``d2t`` maps a draft id to the target id
  ``draft_id + d2t[draft_id]``; ``t2d`` marks the target ids in the draft vocabulary.
* RoPE with the drafter's own base (10000 when the checkpoint gives none), not the target's.
* token embeddings are the target's (published drafters carry none): :meth:`Eagle3Drafter.bind_target` shares them,
  and they are never saved.

Target features default to the inputs of layers ``(2, N // 2, N - 3)`` of an ``N``-layer target, i.e. HF
``hidden_states`` indices ``[2, N // 2, N - 3]`` (``Eagle3Config.target_layer_ids`` holds HF indices).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModel, PretrainedConfig, PreTrainedModel

from hf_specdec._transformers import ACT2FN, LlamaRMSNorm
from hf_specdec.placement import materialized

from .common import LoadsWithoutKernelsMixin, kept_rows, target_fit_problems


def default_target_layer_ids(num_target_layers: int) -> list[int]:
    """HF ``hidden_states`` indices of the inputs of layers 2, N // 2 and N - 3 (the reference's choice)."""
    n = num_target_layers
    return [2, n // 2, n - 3]


class Eagle3Config(PretrainedConfig):
    """Configuration of :class:`Eagle3Drafter`.

    Args:
        hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim, rms_norm_eps,
        hidden_act, attention_bias: the single decoder layer (Llama-style).
        vocab_size: the target's vocabulary (token embeddings, ``t2d``).
        draft_vocab_size: rows of ``lm_head`` (defaults to ``vocab_size``).
        target_hidden_size: width of each target feature (defaults to ``hidden_size``).
        num_target_layers: number of decoder layers of the target the drafter was trained for.
        target_layer_ids: HF ``hidden_states`` indices of the fused features (input of layer ``k`` =
            ``hidden_states[k]``); default ``[2, N // 2, N - 3]``.
        rope_theta, rope_scaling: the drafter's RoPE (linear scaling supported).
        norm_before_residual: speculators' flag: the residual is ``hidden_norm(h)`` instead of ``h``.
        target_model: name or path of the target (informational).
    """

    model_type = "hf_specdec_eagle3"

    def __init__(
        self,
        hidden_size: int = 4096,
        intermediate_size: int = 14336,
        num_attention_heads: int = 32,
        num_key_value_heads: int = 8,
        head_dim: int | None = None,
        rms_norm_eps: float = 1e-5,
        hidden_act: str = "silu",
        attention_bias: bool = False,
        vocab_size: int = 128256,
        draft_vocab_size: int | None = None,
        target_hidden_size: int | None = None,
        num_target_layers: int | None = None,
        target_layer_ids: list[int] | None = None,
        rope_theta: float = 10000.0,
        rope_scaling: dict | None = None,
        max_position_embeddings: int = 2048,
        norm_before_residual: bool = False,
        target_model: str | None = None,
        initializer_range: float = 0.02,
        **kwargs,
    ):
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim if head_dim is not None else hidden_size // num_attention_heads
        self.rms_norm_eps = rms_norm_eps
        self.hidden_act = hidden_act
        self.attention_bias = attention_bias
        self.vocab_size = vocab_size
        self.draft_vocab_size = draft_vocab_size if draft_vocab_size is not None else vocab_size
        self.target_hidden_size = target_hidden_size if target_hidden_size is not None else hidden_size
        self.num_target_layers = num_target_layers
        if target_layer_ids is None and num_target_layers is not None:
            target_layer_ids = default_target_layer_ids(num_target_layers)
        self.target_layer_ids = list(target_layer_ids) if target_layer_ids is not None else None
        self.rope_theta = float(rope_theta)
        if rope_scaling is not None:  # the published field; transformers 5 keeps it as ``rope_parameters``
            kwargs["rope_parameters"] = {**rope_scaling, "rope_theta": self.rope_theta}
        self.max_position_embeddings = max_position_embeddings
        self.norm_before_residual = norm_before_residual
        self.target_model = target_model
        self.initializer_range = initializer_range
        kwargs.pop("tie_word_embeddings", None)
        super().__init__(tie_word_embeddings=False, **kwargs)
        self.validate_fields()

    def validate_fields(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads}).")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"draft_vocab_size ({self.draft_vocab_size}) exceeds vocab_size ({self.vocab_size}).")
        scaling = getattr(self, "rope_parameters", None) or {}
        if scaling.get("rope_type", scaling.get("type")) not in (None, "default", "linear"):
            raise ValueError(f"Unsupported rope_scaling {scaling}: the EAGLE-3 reference drafter supports "
                             "default and linear RoPE only.")
        if self.target_layer_ids is not None and len(self.target_layer_ids) != 3:
            raise ValueError(f"EAGLE-3 fuses three target features; got target_layer_ids={self.target_layer_ids}.")

    def check_target(self, target_config) -> None:
        """Raise a clear error when this drafter was made for another target."""
        problems = target_fit_problems(self, target_config, "feature layer ids", self.layer_ids_for,
                                       hidden_state_ids=True)
        if problems:
            raise ValueError("This EAGLE-3 drafter does not fit the target model: " + "; ".join(problems) + ".")

    def layer_ids_for(self, num_target_layers: int) -> list[int]:
        return self.target_layer_ids if self.target_layer_ids is not None else default_target_layer_ids(
            num_target_layers)


class Eagle3Attention(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = config
        self.num_heads = config.num_attention_heads
        self.num_kv = config.num_key_value_heads
        self.head_dim = config.head_dim
        width = 2 * config.hidden_size
        bias = config.attention_bias
        self.q_proj = nn.Linear(width, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(width, self.num_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(width, self.num_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        scaling = getattr(config, "rope_parameters", None) or {}
        linear = scaling.get("rope_type", scaling.get("type")) == "linear"
        self.position_scale = float(scaling.get("factor", 1.0)) if linear else 1.0

    def rotary(self, position_ids: torch.LongTensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)``, each ``[B, T, 1, head_dim]`` in ``dtype``, for :meth:`rotate`; the first half of ``sin``
        negated (``rotate_half``'s sign, moved off the activations)."""
        device = position_ids.device
        inv_freq = self.__dict__.get("_inv_freq")
        if inv_freq is None or inv_freq.device != device:
            # a plain attribute, not a buffer: a non-persistent buffer would be left uninitialised by from_pretrained
            inv_freq = 1.0 / (self.config.rope_theta ** (
                torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim))
            self.__dict__["_inv_freq"] = inv_freq
        pos = position_ids.to(torch.float32)
        if self.position_scale != 1.0:
            pos = pos / self.position_scale
        freqs = (pos[..., None] * inv_freq)[:, :, None]  # [B, T, 1, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        return torch.cat([cos, cos], dim=-1).to(dtype), torch.cat([-sin, sin], dim=-1).to(dtype)

    @staticmethod
    def rotate(x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """RoPE of ``x [B, T, heads, D]``: ``x * cos + rotate_half(x) * sin``, with ``rotate_half(x) = cat(-x2, x1)``
        written as ``roll(x) * (sin with its first half negated)`` (the same products, bit for bit)."""
        cos, sin = rotary
        return x * cos + x.roll(x.shape[-1] // 2, -1) * sin

    def rope(self, x: torch.Tensor, position_ids: torch.LongTensor) -> torch.Tensor:
        """RoPE of ``x [B, heads, T, D]`` at ``position_ids [B, T]``."""
        return self.rotate(x.transpose(1, 2), self.rotary(position_ids.to(x.device), x.dtype)).transpose(1, 2)

    def forward(self, x, position_ids, attention_mask=None, cache=None, extra_kv=None, rotary=None):
        bsz, length, _ = x.shape
        if rotary is None:
            rotary = self.rotary(position_ids.to(x.device), x.dtype)
        q = self.q_proj(x).view(bsz, length, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(bsz, length, self.num_kv, self.head_dim)
        v = self.v_proj(x).view(bsz, length, self.num_kv, self.head_dim).transpose(1, 2)
        qk = self.rotate(torch.cat([q, k], dim=2), rotary).transpose(1, 2)  # queries and keys rotated at once
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        if cache is not None:
            k, v = cache.update(k, v, 0)
        if extra_kv is not None:  # training-time test: keys/values of earlier steps at the same positions
            k = torch.cat([k, extra_kv[0]], dim=2)
            v = torch.cat([v, extra_kv[1]], dim=2)
        # grouped heads: the CPU kernel reads each key/value head for its query heads (the same products as over
        # repeated heads, without the copies); elsewhere repeated, as some accelerator kernels take no groups
        grouped = self.num_kv != self.num_heads
        if grouped and q.device.type != "cpu":
            rep = self.num_heads // self.num_kv
            k_all, v_all, grouped = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), False
        else:
            k_all, v_all = k, v
        out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=attention_mask,
                                             is_causal=attention_mask is None and length > 1, enable_gqa=grouped)
        out = out.transpose(1, 2).reshape(bsz, length, self.num_heads * self.head_dim)
        return self.o_proj(out), (k, v)


class Eagle3MLP(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = config
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = Eagle3MLP(config)
        # read per forward: plain attributes (a transformers config's attribute reads are slow)
        self.hidden_size, self.norm_before_residual = config.hidden_size, config.norm_before_residual

    def input_norms(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """``cat(input_layernorm(embeds), hidden_norm(hidden))`` (``[B, T, 2 * hidden_size]``), both RMSNorms in one
        pass over the two stacked: each row's statistics and products are the ones its own norm computes."""
        first, second = self.input_layernorm, self.hidden_norm
        if first.variance_epsilon != second.variance_epsilon or embeds.dtype != hidden.dtype:
            return torch.cat([first(embeds), second(hidden)], dim=-1)
        both = torch.stack([embeds, hidden], dim=-2).to(torch.float32)  # [B, T, 2, H]
        both = both * torch.rsqrt(both.pow(2).mean(-1, keepdim=True) + first.variance_epsilon)
        weight = torch.stack([first.weight, second.weight])  # [2, H]
        return (weight * both.to(hidden.dtype)).flatten(-2)

    def forward(self, embeds, hidden, position_ids, attention_mask=None, cache=None, extra_kv=None, rotary=None):
        x = self.input_norms(embeds, hidden)
        residual = x[..., self.hidden_size:] if self.norm_before_residual else hidden
        attn, kv = self.self_attn(x, position_ids, attention_mask, cache, extra_kv, rotary)
        hidden = residual + attn
        hidden = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return hidden, kv


class Eagle3Drafter(LoadsWithoutKernelsMixin, PreTrainedModel):
    """The EAGLE-3 draft network. ``forward`` returns ``(draft_logits, prenorm_hidden)``.

    Example:
        >>> drafter = Eagle3Drafter.from_pretrained("path/to/converted")   # or AutoModel.from_pretrained
        >>> drafter.bind_target(target)                                     # shares the target's embeddings
        >>> out = target.generate(**inputs, custom_generate="hf_specdec/eagle3", trust_remote_code=True,
        ...                       drafter=drafter)
    """

    config_class = Eagle3Config
    base_model_prefix = "eagle3"
    main_input_name = "input_ids"
    _no_split_modules = ["Eagle3DecoderLayer"]
    # the embeddings belong to the target: never written, never expected in a checkpoint
    _keys_to_ignore_on_load_missing = [r"embed_tokens\.weight"]
    _keys_to_ignore_on_save = ["embed_tokens.weight"]

    def __init__(self, config: Eagle3Config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(3 * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        # read per forward and per draft: plain attributes (a transformers config's attribute reads are slow)
        self._widths = (3 * config.target_hidden_size, config.hidden_size)  # fused target features, own states
        self._same_vocab = config.draft_vocab_size == config.vocab_size
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool)
                             if config.draft_vocab_size == config.vocab_size
                             else torch.zeros(config.vocab_size, dtype=torch.bool))
        self.post_init()

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=std)
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, LlamaRMSNorm):
            module.weight.data.fill_(1.0)

    # ---- target binding
    def bind_target(self, target) -> "Eagle3Drafter":
        """Check the drafter fits ``target`` and share its token embeddings (frozen; a copy on the drafter's device
        when they are elsewhere, or offloaded by Accelerate)."""
        self.config.check_target(target.config)
        emb = materialized(target.get_input_embeddings())
        if emb.shape != self.embed_tokens.weight.shape:
            raise ValueError(f"Target embeddings {tuple(emb.shape)} do not match the drafter's "
                             f"{tuple(self.embed_tokens.weight.shape)}.")
        shared = isinstance(emb, nn.Parameter) and emb.device == self.fc.weight.device
        self.embed_tokens.weight = emb if shared else nn.Parameter(emb.detach().to(self.fc.weight.device),
                                                                    requires_grad=False)
        return self

    def feature_layer_ids(self, target_config) -> list[int]:
        text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        return self.config.layer_ids_for(text.num_hidden_layers)

    def draft_to_target(self, draft_ids: torch.LongTensor) -> torch.LongTensor:
        if self._same_vocab:
            return draft_ids
        return draft_ids + self.d2t[draft_ids]

    # ---- forward
    def rotary(self, position_ids: torch.LongTensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's ``(cos, sin)`` at ``position_ids [B, T]`` (``[B, T, 1, head_dim]`` each), for ``forward``'s
        ``rotary``."""
        return self.midlayer.self_attn.rotary(position_ids.to(self.fc.weight.device), self.fc.weight.dtype)

    def project(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``fc`` for fused target features (``3 * target_hidden_size`` wide); drafter states pass unchanged."""
        fused, own = self._widths
        if hidden_states.shape[-1] == fused and fused != own:
            return self.fc(hidden_states)
        if hidden_states.shape[-1] != own:
            raise ValueError(f"EAGLE-3 input states must be {3 * self.config.target_hidden_size} (fused target "
                             f"features) or {self.config.hidden_size} wide, got {hidden_states.shape[-1]}.")
        return hidden_states

    def forward(self, input_ids: torch.LongTensor, hidden_states: torch.Tensor, position_ids: torch.LongTensor,
                attention_mask: torch.Tensor | None = None, cache=None, extra_kv=None, return_kv: bool = False,
                rotary: tuple[torch.Tensor, torch.Tensor] | None = None, logits_to_keep: int = 0):
        """Draft logits for the next tokens.

        Args:
            input_ids: ``[B, T]`` target token ids; row ``t`` pairs feature ``h_t`` with token ``x_{t+1}``.
            hidden_states: ``[B, T, 3 * target_hidden_size]`` fused target features or ``[B, T, hidden_size]``
                drafter outputs of the previous draft step.
            position_ids: ``[B, T]``.
            attention_mask: additive ``[B, 1, T, K]`` (``None``: causal).
            cache: a ``transformers`` cache for the drafter's single layer (index 0).
            extra_kv: training-time test only: ``(k, v)`` of earlier steps appended to the keys.
            rotary: :meth:`rotary` of ``position_ids`` (or any ``[B or 1, T or 1, 1, head_dim]`` views of it), when
                the caller has it already (a draft tree computes it once for all its depths).
            logits_to_keep: as transformers' models: the logits of the last ``logits_to_keep`` rows only (``0``: of
                every row); a long context fed at once needs its last row's only. A ``[B]`` tensor: the logits of
                that one row of each batch row (a context fed with holes or padding, whose root rows differ).

        Returns ``(logits [B, T or logits_to_keep, draft_vocab_size], prenorm [B, T, hidden_size])`` (and
        ``(k, v)`` with ``return_kv``).
        """
        embeds = self.embed_tokens(input_ids).to(self.fc.weight.dtype)
        hidden = self.project(hidden_states.to(self.fc.weight.dtype))
        hidden, kv = self.midlayer(embeds, hidden, position_ids, attention_mask, cache, extra_kv, rotary)
        logits = self.lm_head(self.norm(kept_rows(hidden, logits_to_keep)))
        return (logits, hidden, kv) if return_kv else (logits, hidden)


AutoConfig.register(Eagle3Config.model_type, Eagle3Config)
AutoModel.register(Eagle3Config, Eagle3Drafter)
