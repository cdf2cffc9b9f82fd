"""Medusa heads (Cai et al., 2024) as a transformers model.

As published by FasterDecoding (``medusa/model/medusa_model.py``, the initial-release head format):

* ``K`` heads read the target's **final, post-norm** hidden state ``h_t`` (HF ``hidden_states[-1]``, the state the
  target's own LM head reads) and nothing else: no embeddings, no attention, no cache;
* head ``i`` is ``L`` residual blocks ``x <- x + SiLU(W x + b)`` (``W`` is ``H x H`` with a bias) followed by a
  linear read-out ``H -> V`` without bias; it predicts the token ``i + 2`` positions after ``t`` (the target's LM head
  predicts ``t + 1``);
* the reference builds a head's blocks as ``[ResBlock(H)] * L``: with ``L > 1`` the ``L`` blocks are *one* module
  applied ``L`` times. ``shared_layers=True`` reproduces that (one weight, applied ``medusa_num_layers`` times).

The weight names are vLLM's Medusa layout (``blocks.{i}.layers.{j}.weight/bias``, ``lm_heads.{i}.weight``, optional
``token_map``), so a converted folder is also what vLLM reads. With a draft vocabulary (``draft_vocab_size <
vocab_size``) the read-outs score a subset of the target's tokens and ``token_map[j]`` is the target id of draft
token ``j``; the target still verifies every draft, so the output is unchanged.

Example::

    from modeling.medusa import MedusaConfig, MedusaHeads

    heads = MedusaHeads(MedusaConfig(hidden_size=576, vocab_size=49152, medusa_num_heads=4))
    logits = heads(target_out.hidden_states[-1])   # [B, T, 4, V]: head i scores token t + 2 + i
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, PretrainedConfig, PreTrainedModel

from hf_specdec._transformers import ACT2FN
from hf_specdec.placement import materialized

from .common import DraftVocabularyMixin, LoadsWithoutKernelsMixin, target_fit_problems


class MedusaConfig(PretrainedConfig):
    """Configuration of :class:`MedusaHeads`.

    Args:
        hidden_size: the target's hidden size (heads read its final hidden state).
        vocab_size: the target's vocabulary.
        medusa_num_heads: ``K``, the number of heads (drafts per step along one path).
        medusa_num_layers: ``L``, residual blocks per head.
        shared_layers: the ``L`` blocks of a head are one module applied ``L`` times (the published reference's
            ``[ResBlock] * L``); ``False``: ``L`` separate blocks.
        draft_vocab_size: tokens the read-outs score (default: the whole vocabulary); ``token_map`` maps them.
        hidden_act: the blocks' activation (SiLU in every published checkpoint).
        base_model_name_or_path: the target the heads were trained for (informational; fit is checked by shape).
    """

    model_type = "hf_specdec_medusa"

    def __init__(self, hidden_size: int = 4096, vocab_size: int = 32000, medusa_num_heads: int = 5,
                 medusa_num_layers: int = 1, shared_layers: bool = False, draft_vocab_size: int | None = None,
                 hidden_act: str = "silu", base_model_name_or_path: str | None = None,
                 initializer_range: float = 0.02, **kwargs):
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.medusa_num_heads = medusa_num_heads
        self.medusa_num_layers = medusa_num_layers
        self.shared_layers = bool(shared_layers)
        self.draft_vocab_size = draft_vocab_size if draft_vocab_size is not None else vocab_size
        self.hidden_act = hidden_act
        self.base_model_name_or_path = base_model_name_or_path
        self.initializer_range = initializer_range
        kwargs.pop("tie_word_embeddings", None)
        super().__init__(tie_word_embeddings=False, **kwargs)
        self.validate_fields()

    def validate_fields(self) -> None:
        for name in ("hidden_size", "vocab_size", "medusa_num_heads", "medusa_num_layers", "draft_vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"MedusaConfig.{name} must be a positive integer, got {value!r}.")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} is larger than the vocabulary "
                             f"{self.vocab_size}.")
        if self.hidden_act not in ACT2FN:
            raise ValueError(f"Unknown hidden_act {self.hidden_act!r}.")

    @property
    def num_stored_layers(self) -> int:
        """Linear layers each head stores: 1 when the blocks are shared, else ``medusa_num_layers``."""
        return 1 if self.shared_layers else self.medusa_num_layers

    @property
    def target_hidden_size(self) -> int:  # the heads read the target's final hidden state: same width
        return self.hidden_size

    num_target_layers = None  # the heads fit a target of any depth

    def check_target(self, target_config) -> None:
        """Raise a clear error when these heads were made for another target (hidden size, vocabulary)."""
        problems = target_fit_problems(self, target_config, "heads", lambda n: [n], hidden_state_ids=True)
        if problems:
            made_for = f" (made for {self.base_model_name_or_path})" if self.base_model_name_or_path else ""
            raise ValueError(f"These Medusa heads{made_for} do not fit the target model: " + "; ".join(problems) + ".")


class MedusaBlock(nn.Module):
    """One head's residual blocks: ``x <- x + act(layer(x))`` for each of ``medusa_num_layers`` applications."""

    def __init__(self, config: MedusaConfig):
        super().__init__()
        self.repeats = config.medusa_num_layers if config.shared_layers else 1
        self.layers = nn.ModuleList(nn.Linear(config.hidden_size, config.hidden_size, bias=True)
                                    for _ in range(config.num_stored_layers))
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            for _ in range(self.repeats):
                x = x + self.act(layer(x))
        return x


class MedusaHeads(LoadsWithoutKernelsMixin, DraftVocabularyMixin, PreTrainedModel):
    """``K`` Medusa heads over the target's final hidden state (see the module docstring).

    ``forward(hidden_states [..., H]) -> logits [..., K, draft_vocab_size]``; :meth:`draft_to_target` maps draft
    ids to target ids. The heads hold no reference to the target and run on whatever device they are put on.
    """

    config_class = MedusaConfig
    base_model_prefix = "medusa"
    main_input_name = "hidden_states"
    _no_split_modules = ["MedusaBlock"]

    def __init__(self, config: MedusaConfig):
        super().__init__(config)
        self.blocks = nn.ModuleList(MedusaBlock(config) for _ in range(config.medusa_num_heads))
        self.lm_heads = nn.ModuleList(nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
                                      for _ in range(config.medusa_num_heads))
        self.register_buffer("token_map", torch.arange(config.draft_vocab_size, dtype=torch.long))
        self.post_init()

    def _init_weights(self, module):
        # the reference zero-initialises the blocks (each head starts as its read-out of h_t)
        if isinstance(module, nn.Linear):
            if module.bias is not None:
                module.weight.data.zero_()
                module.bias.data.zero_()
            else:
                module.weight.data.normal_(mean=0.0, std=self.config.initializer_range)

    @property
    def num_heads(self) -> int:
        return self.config.medusa_num_heads

    # ---- the interface the feature-drafter proposers share
    def bind_target(self, target) -> "MedusaHeads":
        """Check the heads fit ``target`` (hidden size and vocabulary); they share nothing with it."""
        self.config.check_target(target.config)
        return self

    def feature_layer_ids(self, target_config) -> list[int]:
        """The target ``hidden_states`` index the heads read: the last one (post final norm)."""
        text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        return [text.num_hidden_layers]

    def init_from_target(self, target, draft_ids: torch.LongTensor | None = None) -> "MedusaHeads":
        """Start training from the target: every read-out is a copy of the target's LM head rows (``draft_ids``, or
        the whole vocabulary) and every block is zero, as the reference does; sets ``token_map``."""
        self.config.check_target(target.config)
        weight = materialized(target.get_output_embeddings()).detach()  # its data, even offloaded
        if draft_ids is None:
            if self.config.draft_vocab_size != self.config.vocab_size:
                raise ValueError("A draft vocabulary needs the target ids it keeps (draft_ids).")
            draft_ids = torch.arange(self.config.vocab_size)
        draft_ids = self.set_draft_vocabulary(draft_ids)
        with torch.no_grad():
            for head in self.lm_heads:
                head.weight.copy_(weight[draft_ids.to(weight.device)].to(head.weight))
            for block in self.blocks:
                for layer in block.layers:
                    layer.weight.zero_()
                    layer.bias.zero_()
        return self

    # ---- forward
    def forward(self, hidden_states: torch.Tensor, heads: int | None = None) -> torch.Tensor:
        """Logits ``[..., heads, draft_vocab_size]`` of the first ``heads`` heads (default: all) for the target's
        final hidden states ``[..., hidden_size]``; head ``i`` scores the token ``i + 2`` positions ahead."""
        if hidden_states.shape[-1] != self.config.hidden_size:
            raise ValueError(f"Medusa heads read {self.config.hidden_size}-wide target hidden states, got "
                             f"{hidden_states.shape[-1]}.")
        weight = self.lm_heads[0].weight
        x = hidden_states.to(weight.dtype)
        n = self.num_heads if heads is None else min(heads, self.num_heads)
        return torch.stack([self.lm_heads[i](self.blocks[i](x)) for i in range(n)], dim=-2)


AutoConfig.register(MedusaConfig.model_type, MedusaConfig)
AutoModel.register(MedusaConfig, MedusaHeads)
