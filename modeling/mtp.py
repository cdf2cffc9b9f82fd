"""Multi-token prediction (MTP) modules as transformers ``PreTrainedModel``s: DeepSeek-V3-style sequential modules and
Gloeckle et al.'s parallel heads.

**Sequential modules** (:class:`MTPModule`; DeepSeek-V3, GLM-4.x, Qwen3-Next / Qwen3.5, MiMo, and the modules
hf_specdec trains for any frozen target). Module ``k`` reads the target's final, post-norm hidden state ``h_t`` (HF
``hidden_states[-1]``) and the embedding of the *next* token ``x_{t+1}``, and predicts ``x_{t+2}``::

    x   = proj(cat([norm_e(embed(x_{t+1})), norm_h(h_t)]))      # MiMo: cat([norm_h(h_t), norm_e(embed(x_{t+1}))])
    x   = block(x)                                               # one decoder layer of the target's own family
    out = norm_out(x);  logits = lm_head(out)                    # the target's embedding and LM head

A further draft applies a module again to its own output (``out``; ``chain_hidden="block"``: ``x``, as vLLM does)
and the token just drafted. The block is an instance of the target family's own transformers decoder-layer class
(``LlamaDecoderLayer``, ``DeepseekV3DecoderLayer`` with MLA and MoE, ``Qwen3NextDecoderLayer`` with its gated
attention, ...), built from ``block_config``; the norms are that family's RMSNorm (zero-centred ``x * (1 + w)`` for
Qwen3-Next / Qwen3.5 / Gemma). The block keeps its keys/values in the module's own cache (layer ``k``).

The state dict keeps each published layout's own names, with the checkpoint's prefix removed (``layout``):

* ``deepseek`` (DeepSeek-V3/R1 ``model.layers.{N}.*``, GLM-4.x at its own ``N``): ``layers.{k}.{enorm, hnorm,
  eh_proj, shared_head.norm}`` beside the block's own keys ``layers.{k}.{self_attn, mlp, input_layernorm,
  post_attention_layernorm}.*``; embedding first in the concatenation. The stored ``embed_tokens`` and
  ``shared_head.head`` are copies of the target's and are not kept.
* ``qwen3_next`` (Qwen3-Next, Qwen3.5 / 3.6 ``mtp.*``): ``fc``, ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``
  and ``norm`` shared by the blocks ``layers.{k}.*``; embedding first.
* ``mimo`` (XiaomiMiMo/MiMo-7B ``model.mtp_layers.{k}.*``): ``layers.{k}.{token_layernorm, hidden_layernorm,
  input_proj, final_layernorm}`` beside the block's keys; **hidden state first**.

**Parallel heads** (:class:`ParallelMTPHeads`; Gloeckle et al., 2024): ``n`` extra decoder layers of the target's
family on the *trunk*, the input of the target's last layer (HF ``hidden_states[-2]``); head ``i`` predicts
``x_{t+2+i}`` through the target's final norm and LM head, and the target's own last layer is the next-token head.

Both read out with the target's LM head over the whole vocabulary or over the ``draft_vocab_size`` target ids in
``token_map``; the head rows and the embedding are taken when the module is bound to its target
(:meth:`bind_target`) and never stored.

Example::

    from modeling.mtp import MTPModule

    mtp = MTPModule.from_pretrained("path/to/converted").bind_target(target)
    logits, hidden = mtp(next_ids, target_out.hidden_states[-1], position_ids)   # logits score x_{t+2}
"""

from __future__ import annotations

import copy
import inspect
import sys

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, PretrainedConfig, PreTrainedModel

from hf_specdec._transformers import no_split_modules, set_attention_implementation, set_experts_implementation
from hf_specdec.placement import execution_device, materialized_state_dict

from .common import LoadsWithoutKernelsMixin, TargetHeadMixin, kept_rows, target_fit_problems

LAYOUTS = ("deepseek", "qwen3_next", "mimo")
# per layout: (embedding norm, hidden norm, projection, output norm) names, and whether one set serves every block
_NAMES = {
    "deepseek": ("enorm", "hnorm", "eh_proj", "shared_head.norm", False),
    "qwen3_next": ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm", True),
    "mimo": ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm", False),
}


# the block a config made without arguments describes (transformers builds one to diff a saved config against)
_BARE_BLOCK = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
               "num_key_value_heads": 2, "vocab_size": 256}


def block_config_for(text_config, num_layers: int) -> PretrainedConfig:
    """The config that builds ``num_layers`` MTP blocks of ``text_config``'s family: transformers' own
    ``get_mtp_config()`` where the family has MTP layers (DeepSeek-V3, GLM-4 MoE: MoE in every block), otherwise a copy
    with ``num_hidden_layers = num_layers`` and every block a full-attention layer."""
    config = copy.deepcopy(text_config)
    if getattr(config, "num_mtp_layers", None) and hasattr(config, "get_mtp_config"):
        try:
            config = config.get_mtp_config()
        except ValueError:
            pass
    config.num_hidden_layers = num_layers
    if hasattr(config, "first_k_dense_replace"):
        config.first_k_dense_replace = 0
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = list(getattr(config, "mtp_layer_types", None) or ["full_attention"] * num_layers)
        config.layer_types = (config.layer_types * num_layers)[:num_layers]
    return config


def family_classes(block_config) -> tuple[type, type, type | None]:
    """``(decoder layer class, RMSNorm class, rotary embedding class or None)`` of ``block_config``'s family, from
    transformers' own modeling module."""
    from transformers import MODEL_MAPPING

    try:
        base_cls = MODEL_MAPPING[type(block_config)]
    except KeyError:
        raise ValueError(f"transformers has no model for config {type(block_config).__name__} "
                         f"(model_type {block_config.model_type!r}): cannot build its decoder layer.") from None
    module = sys.modules[base_cls.__module__]
    names = [n for n in no_split_modules(base_cls) if n.endswith("DecoderLayer")]
    if not names or not hasattr(module, names[0]):
        raise ValueError(f"{base_cls.__name__} names no decoder layer class (_no_split_modules).")
    layer_cls = getattr(module, names[0])
    with torch.device("meta"):
        probe = layer_cls(block_config, 0)
    norm = getattr(probe, "input_layernorm", None)
    norm_cls = type(norm) if norm is not None else next(
        type(m) for n, m in probe.named_modules() if n.endswith("norm"))
    rotary = [getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding") and n.startswith(
        names[0][:-len("DecoderLayer")])]
    return layer_cls, norm_cls, (rotary[0] if rotary else None)


def _config_dict(config) -> dict:
    return config.to_dict() if hasattr(config, "to_dict") else dict(config)


def _build_block_config(data: dict) -> PretrainedConfig:
    data = dict(data)
    model_type = data.pop("model_type", None)
    if not model_type:
        raise ValueError("block_config needs the decoder family's model_type (e.g. 'llama', 'deepseek_v3').")
    for key in ("transformers_version", "architectures", "_name_or_path"):
        data.pop(key, None)
    try:
        config = AutoConfig.for_model(model_type, **data)
    except ValueError as err:
        raise ValueError(f"block_config: transformers does not know model_type {model_type!r}: {err}") from None
    set_attention_implementation(config, "sdpa")
    set_experts_implementation(config, "eager")  # MoE blocks: the plain per-expert loop (no dispatch to pick)
    return config


class _Bound(TargetHeadMixin):
    """The MTP classes' shared part: the target's head and embedding (:class:`TargetHeadMixin`), the family's rotary
    embedding, linear initialisation."""

    @property
    def num_modules(self) -> int:
        return self.config.num_modules

    def _rope(self, x, position_ids):
        """The family's rotary embedding for ``position_ids`` (``None`` for a family without one). The rotary
        module holds only computed buffers; it lives outside the module tree (never saved, never initialised on the
        meta device by ``from_pretrained``) and is built on first use on ``x``'s device."""
        rotary = self.rotary_on(x.device)
        if rotary is None:
            return None
        if self._typed_rope:
            return rotary(x, position_ids, "full_attention")
        return rotary(x, position_ids)

    def rotary_on(self, device: torch.device):
        """The family's rotary embedding module on ``device`` (made on first use there; ``None`` for a family without
        one). A compiled caller makes it before tracing: dynamo does not enter the ``torch.device`` context."""
        if self._rotary_cls is None:
            return None
        rotary = self.__dict__.get("_rotary")
        if rotary is None or rotary[0] != device:
            with torch.device(device):
                rotary = (device, self._rotary_cls(config=self.config.block_text_config()))
            self.__dict__["_rotary"] = rotary
        return rotary[1]

    def _family(self, config):
        """What both classes start with: ``(block config, decoder layer class, norm class)`` of the family; the
        rotary embedding's class and the ``token_map`` buffer are set up."""
        block_config = config.block_text_config()
        layer_cls, norm_cls, rotary_cls = family_classes(block_config)
        self._rotary_cls = rotary_cls
        self._typed_rope = rotary_cls is not None and "layer_type" in inspect.signature(
            rotary_cls.forward).parameters
        self.register_buffer("token_map", torch.arange(config.draft_vocab_size, dtype=torch.long))
        self.head = None  # the target's LM head rows of token_map (bind_target), not a parameter
        return block_config, layer_cls, norm_cls

    def _init_weights(self, module):
        # linear layers only: the family's norms keep their own initialisation (1, or 0 for the (1 + w) ones)
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=self.config.initializer_range)
            if module.bias is not None:
                module.bias.data.zero_()


class _MTPConfigBase(PretrainedConfig):
    """Fields every MTP config shares (see :class:`MTPConfig`)."""

    def _init_common(self, block_config, num_modules, vocab_size, draft_vocab_size, num_target_layers,
                     base_model_name_or_path, initializer_range):
        if block_config is None:
            raise ValueError(f"{type(self).__name__} needs block_config: the target family's text config (a dict "
                             "with its model_type, or a transformers config).")
        self.block_config = _config_dict(block_config)
        self.num_modules = num_modules
        block = self.block_text_config()
        self.hidden_size = block.hidden_size
        self.rms_norm_eps = getattr(block, "rms_norm_eps", 1e-6)
        self.vocab_size = vocab_size if vocab_size is not None else block.vocab_size
        self.draft_vocab_size = draft_vocab_size if draft_vocab_size is not None else self.vocab_size
        self.num_target_layers = num_target_layers
        self.base_model_name_or_path = base_model_name_or_path
        self.initializer_range = initializer_range

    def block_text_config(self) -> PretrainedConfig:
        """The transformers config the blocks are built from (``num_hidden_layers`` = the number of blocks)."""
        config = _build_block_config(self.block_config)
        config.num_hidden_layers = self.num_modules
        if getattr(config, "layer_types", None) is not None:
            config.layer_types = (list(config.layer_types) * self.num_modules)[:self.num_modules]
        return config

    def _validate_common(self) -> None:
        for name in ("num_modules", "vocab_size", "draft_vocab_size", "hidden_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{type(self).__name__}.{name} must be a positive integer, got {value!r}.")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} is larger than the vocabulary "
                             f"{self.vocab_size}.")
        if self.num_target_layers is not None and (not isinstance(self.num_target_layers, int)
                                                   or self.num_target_layers < 1):
            raise ValueError(f"num_target_layers must be a positive integer or None, got {self.num_target_layers!r}.")

    @property
    def target_hidden_size(self) -> int:  # a module reads the target's hidden states: same width
        return self.hidden_size

    def _check_target(self, target_config, what: str) -> None:
        problems = target_fit_problems(self, target_config, "hidden states", lambda n: [n], hidden_state_ids=True)
        if problems:
            made_for = f" (made for {self.base_model_name_or_path})" if self.base_model_name_or_path else ""
            raise ValueError(f"This {what}{made_for} does not fit the target model: " + "; ".join(problems) + ".")


class MTPConfig(_MTPConfigBase):
    """Configuration of :class:`MTPModule`.

    Args:
        block_config: the target family's text config (dict with ``model_type``, or a config) the blocks are built
            from (:func:`block_config_for`).
        num_modules: ``K``, stored modules; a chain of more drafts applies them again (``step % K``).
        layout: ``"deepseek"``, ``"qwen3_next"`` or ``"mimo"``: the published layout whose names and concatenation
            order the module keeps (see the module docstring).
        chain_hidden: what a further draft step reads: ``"normed"`` (the output norm's result, as transformers'
            ``MtpLayer`` and SGLang chain) or ``"block"`` (the block's output before it, as vLLM chains).
        vocab_size: the target's vocabulary; draft_vocab_size: how many of its tokens are scored (``token_map``).
        num_target_layers: the target's layer count (``None``: any).
        base_model_name_or_path: the target the module was made for (fit is checked by shape).
    """

    model_type = "hf_specdec_mtp"

    def __init__(self, block_config: dict | None = None, num_modules: int = 1, layout: str = "deepseek",
                 chain_hidden: str = "normed", vocab_size: int | None = None, draft_vocab_size: int | None = None,
                 num_target_layers: int | None = None, base_model_name_or_path: str | None = None,
                 initializer_range: float = 0.02, **kwargs):
        kwargs.pop("tie_word_embeddings", None)
        super().__init__(tie_word_embeddings=False, **kwargs)
        if block_config is None and not kwargs:  # the bare default transformers builds to diff against
            block_config = _BARE_BLOCK
        self.layout = layout
        self.chain_hidden = chain_hidden
        self._init_common(block_config, num_modules, vocab_size, draft_vocab_size, num_target_layers,
                          base_model_name_or_path, initializer_range)
        self.validate_fields()

    def validate_fields(self) -> None:
        self._validate_common()
        if self.layout not in LAYOUTS:
            raise ValueError(f"MTPConfig.layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}.")
        if self.chain_hidden not in ("normed", "block"):
            raise ValueError(f"MTPConfig.chain_hidden must be 'normed' or 'block', got {self.chain_hidden!r}.")

    def check_target(self, target_config) -> None:
        """Raise a clear error when the module was made for another target (vocabulary, hidden size, layers)."""
        self._check_target(target_config, "MTP module")


class MTPModule(LoadsWithoutKernelsMixin, _Bound, PreTrainedModel):
    """``K`` sequential MTP modules (see the module docstring).

    ``forward(input_ids [B, T], hidden_states [B, T, H], position_ids [B, T], attention_mask=None, cache=None,
    step=0) -> (logits [B, T, draft_vocab_size] fp32, hidden [B, T, H])``: row ``t`` pairs ``h_t`` with token
    ``x_{t+1}`` and scores ``x_{t+2}``; module ``step % K`` runs; ``hidden`` is what a further step reads.
    """

    config_class = MTPConfig
    base_model_prefix = "mtp"
    main_input_name = "input_ids"
    _supports_sdpa = True

    def __init__(self, config: MTPConfig):
        super().__init__(config)
        block_config, layer_cls, norm_cls = self._family(config)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        emb_norm, hid_norm, proj, out_norm, shared = _NAMES[config.layout]
        self._names = (emb_norm, hid_norm, proj, out_norm, shared)
        blocks = []
        for k in range(config.num_modules):
            block = layer_cls(block_config, k)
            if not shared:
                self._add_inputs(block, norm_cls, hidden, eps)
            blocks.append(block)
        self.layers = nn.ModuleList(blocks)
        if shared:
            self._add_inputs(self, norm_cls, hidden, eps)
        self.post_init()

    def _add_inputs(self, owner: nn.Module, norm_cls, hidden: int, eps: float) -> None:
        emb_norm, hid_norm, proj, out_norm, _ = self._names
        setattr(owner, emb_norm, norm_cls(hidden, eps=eps))
        setattr(owner, hid_norm, norm_cls(hidden, eps=eps))
        setattr(owner, proj, nn.Linear(2 * hidden, hidden, bias=False))
        if "." in out_norm:  # DeepSeek's shared_head.norm
            parent, name = out_norm.split(".")
            holder = nn.Module()
            setattr(holder, name, norm_cls(hidden, eps=eps))
            setattr(owner, parent, holder)
        else:
            setattr(owner, out_norm, norm_cls(hidden, eps=eps))

    def parts(self, step: int = 0) -> tuple[nn.Module, nn.Module, nn.Linear, nn.Module, nn.Module]:
        """``(embedding norm, hidden norm, projection, block, output norm)`` of module ``step % K``."""
        block = self.layers[step % self.config.num_modules]
        emb_norm, hid_norm, proj, out_norm, shared = self._names
        owner = self if shared else block
        out = owner
        for name in out_norm.split("."):
            out = getattr(out, name)
        return getattr(owner, emb_norm), getattr(owner, hid_norm), getattr(owner, proj), block, out

    # ---- the interface the feature-drafter proposers share
    def feature_layer_ids(self, target_config) -> list[int]:
        """The target ``hidden_states`` index the module reads: the last one (post final norm)."""
        text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        return [text.num_hidden_layers]

    def init_from_target(self, target, draft_ids=None) -> "MTPModule":
        """Start training for ``target``: ``token_map`` = ``draft_ids`` (default all), the block's attention and MLP
        weights copied from the target's last decoder layer where the shapes match (the post-hoc recipe's start),
        the projection's hidden half the identity; binds the target."""
        self.config.check_target(target.config)
        if draft_ids is not None:
            self.set_draft_vocabulary(draft_ids)
        last = materialized_state_dict(target.get_decoder().layers[-1])  # its data, even offloaded
        with torch.no_grad():
            for k in range(self.num_modules):
                _, _, proj, block, _ = self.parts(k)
                own = block.state_dict()
                for name, value in last.items():
                    if name in own and own[name].shape == value.shape:
                        own[name].copy_(value)
                h = self.config.hidden_size
                proj.weight.normal_(0.0, self.config.initializer_range)
                first_hidden = self.config.layout == "mimo"
                cols = slice(0, h) if first_hidden else slice(h, 2 * h)
                proj.weight[:, cols] += torch.eye(h, dtype=proj.weight.dtype, device=proj.weight.device)
        return self.bind_target(target)

    # ---- forward
    def forward(self, input_ids: torch.LongTensor, hidden_states: torch.Tensor, position_ids: torch.LongTensor,
                attention_mask: torch.Tensor | None = None, cache=None, step: int = 0, logits_to_keep: int = 0):
        """Logits and chain states of module ``step % K`` (see the class docstring). ``attention_mask``: additive
        ``[B, 1, T, keys]`` (``None``: causal); ``cache``: a transformers cache (the block writes layer ``k``);
        ``logits_to_keep``: as transformers' models, the logits of the last that many rows only (``0``: every row); a
        ``[B]`` tensor: of that one row of each batch row (:func:`~.common.kept_rows`)."""
        self._require_bound()
        if hidden_states.shape[-1] != self.config.hidden_size:
            raise ValueError(f"The MTP module reads {self.config.hidden_size}-wide target hidden states, got "
                             f"{hidden_states.shape[-1]}.")
        emb_norm, hid_norm, proj, block, out_norm = self.parts(step)
        dtype = proj.weight.dtype
        with torch.no_grad():  # the target's embedding: shared, never trained here
            emb = self.embed(input_ids.to(execution_device(self.embed))).to(device=proj.weight.device, dtype=dtype)
        emb = emb_norm(emb)
        hid = hid_norm(hidden_states.to(device=proj.weight.device, dtype=dtype))
        x = proj(torch.cat([hid, emb] if self.config.layout == "mimo" else [emb, hid], dim=-1))
        if attention_mask is not None and attention_mask.dtype != dtype:
            attention_mask = attention_mask.to(dtype)
        x = block(x, attention_mask=attention_mask, position_embeddings=self._rope(x, position_ids),
                  position_ids=position_ids, cache=cache, use_cache=cache is not None)
        out = out_norm(x)
        return (self.logits(kept_rows(out, logits_to_keep)),
                out if self.config.chain_hidden == "normed" else x)


class ParallelMTPConfig(_MTPConfigBase):
    """Configuration of :class:`ParallelMTPHeads`.

    Args:
        block_config: the target family's text config the heads' decoder layers are built from.
        num_modules: ``n``, extra heads; head ``i`` predicts ``x_{t+2+i}``.
        vocab_size, draft_vocab_size, num_target_layers, base_model_name_or_path: as :class:`MTPConfig`.
    """

    model_type = "hf_specdec_parallel_mtp"

    def __init__(self, block_config: dict | None = None, num_modules: int = 3, vocab_size: int | None = None,
                 draft_vocab_size: int | None = None, num_target_layers: int | None = None,
                 base_model_name_or_path: str | None = None, initializer_range: float = 0.02, **kwargs):
        kwargs.pop("tie_word_embeddings", None)
        super().__init__(tie_word_embeddings=False, **kwargs)
        if block_config is None and not kwargs:
            block_config = _BARE_BLOCK
        self._init_common(block_config, num_modules, vocab_size, draft_vocab_size, num_target_layers,
                          base_model_name_or_path, initializer_range)
        self.validate_fields()

    def validate_fields(self) -> None:
        self._validate_common()

    def check_target(self, target_config) -> None:
        self._check_target(target_config, "set of parallel MTP heads")


class ParallelMTPHeads(LoadsWithoutKernelsMixin, _Bound, PreTrainedModel):
    """``n`` parallel heads on the target's trunk (see the module docstring).

    ``forward(trunk [B, T, H], position_ids [B, T], attention_mask=None, cache=None) -> normed [B, T, n, H]``:
    every head's output for every row after the target's final norm (:meth:`logits` reads them out); head ``i``
    keeps its keys/values in layer ``i`` of ``cache``.
    """

    config_class = ParallelMTPConfig
    base_model_prefix = "heads"
    main_input_name = "hidden_states"
    _supports_sdpa = True

    def __init__(self, config: ParallelMTPConfig):
        super().__init__(config)
        block_config, layer_cls, norm_cls = self._family(config)
        self.layers = nn.ModuleList(layer_cls(block_config, i) for i in range(config.num_modules))
        self.norm = norm_cls(config.hidden_size, eps=config.rms_norm_eps)
        self.post_init()

    def feature_layer_ids(self, target_config) -> list[int]:
        """The target ``hidden_states`` index the heads read: the trunk, the input of the last layer."""
        text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        return [text.num_hidden_layers - 1]

    def init_from_target(self, target, draft_ids=None) -> "ParallelMTPHeads":
        """Start every head as a copy of the target's last decoder layer and its final norm (the recipe's start:
        head ``i`` begins as the next-token head); sets ``token_map`` and binds the target."""
        self.config.check_target(target.config)
        if draft_ids is not None:
            self.set_draft_vocabulary(draft_ids)
        decoder = target.get_decoder()
        with torch.no_grad():
            for layer in self.layers:
                layer.load_state_dict(materialized_state_dict(decoder.layers[-1]), strict=False)
            self.norm.load_state_dict(materialized_state_dict(decoder.norm))
        return self.bind_target(target)

    def forward(self, hidden_states: torch.Tensor, position_ids: torch.LongTensor, attention_mask=None, cache=None,
                heads: int | None = None):
        if hidden_states.shape[-1] != self.config.hidden_size:
            raise ValueError(f"The parallel MTP heads read {self.config.hidden_size}-wide trunk states, got "
                             f"{hidden_states.shape[-1]}.")
        x = hidden_states.to(self.norm.weight.dtype)
        if attention_mask is not None and attention_mask.dtype != x.dtype:
            attention_mask = attention_mask.to(x.dtype)
        rope = self._rope(x, position_ids)
        n = self.num_modules if heads is None else min(heads, self.num_modules)
        outs = [self.norm(self.layers[i](x, attention_mask=attention_mask, position_embeddings=rope,
                                         position_ids=position_ids, cache=cache, use_cache=cache is not None))
                for i in range(n)]
        return torch.stack(outs, dim=-2)


AutoConfig.register(MTPConfig.model_type, MTPConfig)
AutoModel.register(MTPConfig, MTPModule)
AutoConfig.register(ParallelMTPConfig.model_type, ParallelMTPConfig)
AutoModel.register(ParallelMTPConfig, ParallelMTPHeads)
