"""Every private transformers name hf_specdec uses, in one place.

Public transformers API (``generate()``, the Auto classes, the caches, logits processors, stopping criteria, names
exported by ``transformers`` or ``transformers.generation``) is imported where it is used. What is not public --
underscore attributes and methods, names of modules outside those namespaces, internals of cache layers -- is reached
through this module only, one name a line: what it is for and the transformers versions it was checked with
(``scripts/check_transformers.sh VERSION`` runs the losslessness tests against another version;
``tests/test_transformers_names.py`` keeps the rest of the library off these names). The calling frames of
``generate()`` are read in :mod:`hf_specdec._transformers_frames`, the same kind of reach.

When a name moves in a new release, the accessor here changes and nothing else does.
"""

from __future__ import annotations

from transformers import GenerationMixin  # public; its private _assisted_decoding is run below

# drafters: the activation of a config's hidden_act by name; checked: 5.24.0, 5.25.0
from transformers.activations import ACT2FN
# cache.py: a dynamic layer kind the loop can cut back (not exported by transformers); checked: 5.24.0, 5.25.0
from transformers.cache_utils import DynamicSlidingWindowLayer
# MTP conversion: a family's checkpoint renames and fusions (load_with_conversions); checked: 5.24.0, 5.25.0
from transformers.conversion_mapping import get_checkpoint_conversion_mapping
# MTP conversion: transformers' own state-dict loader (load_with_conversions); checked: 5.24.0, 5.25.0
from transformers.core_model_loading import convert_and_load_state_dict_in_model
# CPU kernels: the stock sdpa attention their attention falls back to; checked: 5.24.0, 5.25.0
from transformers.integrations.sdpa_attention import sdpa_attention_forward
# CPU kernels: the registry of mask builders per attention name (theirs is registered); checked: 5.24.0, 5.25.0
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
# CPU kernels: the mask builder registered for their attention name (sdpa's); checked: 5.24.0, 5.25.0
from transformers.masking_utils import sdpa_mask
# attention.py: eager's mask builder (a name registered with it takes a 4D mask); checked: 5.24.0, 5.25.0
from transformers.masking_utils import eager_mask
# attention.py: FlashAttention's mask builder (a name registered with it sees padding only); checked: 5.24.0, 5.25.0
from transformers.masking_utils import flash_attention_mask
# attention.py: flex's mask builder (a name registered with it takes a BlockMask); checked: 5.24.0, 5.25.0
from transformers.masking_utils import flex_attention_mask
# MTP conversion: the options of transformers' loader (load_with_conversions); checked: 5.24.0, 5.25.0
from transformers.modeling_utils import LoadStateDictConfig
# drafters (EAGLE-3, DFlash, LayerSkip): Llama's RMSNorm module; checked: 5.24.0, 5.25.0
from transformers.models.llama.modeling_llama import LlamaRMSNorm
# loaders: whether the `kernels` package transformers' hub kernels need is importable; checked: 5.24.0, 5.25.0
from transformers.utils import is_kernels_available

__all__ = [
    "ACT2FN", "ALL_MASK_ATTENTION_FUNCTIONS", "DynamicSlidingWindowLayer", "LlamaRMSNorm", "attention_implementation",
    "eager_mask", "flash_attention_mask", "flex_attention_mask",
    "from_pretrained_options", "keep_in_fp32_strict", "load_pretrained", "load_with_conversions", "no_split_modules",
    "pad_token_tensor", "run_assisted_decoding", "sdpa_attention_forward", "sdpa_mask", "set_attention_implementation",
    "set_experts_implementation", "set_static_layer_length", "supports_logits_to_keep", "supports_sdpa",
    "switch_attention", "dropped_mask_length", "user_defined_cache",
]

CHECKED = ("5.24.0", "5.25.0")  # the versions every name here was checked with


def from_pretrained_options(kwargs: dict) -> dict:
    """``kwargs`` for a ``from_pretrained``, with ``use_kernels=False`` added where the ``kernels`` package is missing:
    transformers 5.25 turns ``use_kernels`` on by default and then raises "Kernels are not available" without it
    (5.24: off by default). With ``kernels`` installed, transformers' default stands (on a GPU hub kernels replace the
    RMSNorm, activation and rotary forwards; see the README). Checked: 5.24.0, 5.25.0."""
    if is_kernels_available() or "use_kernels" in kwargs:
        return kwargs
    return {**kwargs, "use_kernels": False}


def load_pretrained(cls, source, **kwargs):
    """``cls.from_pretrained(source, **kwargs)`` for a transformers model the library loads itself (a target, a draft
    model), loadable without the ``kernels`` package (:func:`from_pretrained_options`). Checked: 5.24.0, 5.25.0."""
    return cls.from_pretrained(source, **from_pretrained_options(kwargs))


def pad_token_tensor(generation_config):
    """The pad token as ``generate()`` prepared it (``GenerationConfig._pad_token_tensor``: the pad id, else the EOS
    id; a tensor or ``None``). Checked: 5.24.0, 5.25.0."""
    return getattr(generation_config, "_pad_token_tensor", None)


def generation_defaults() -> dict:
    """The values ``generate()`` gives the generation settings a call and the model leave unset (``num_assistant_tokens``
    20, ...): they are in the generation config a decoding callable receives. Checked: 5.24.0, 5.25.0."""
    from transformers import GenerationConfig

    return GenerationConfig()._get_default_generation_params()


def supports_logits_to_keep(model) -> bool:
    """Whether ``model.forward`` takes ``logits_to_keep`` (``GenerationMixin._supports_logits_to_keep``).
    Checked: 5.24.0, 5.25.0."""
    return bool(model._supports_logits_to_keep())


def attention_implementation(config) -> str | None:
    """The attention implementation a config's modules dispatch to (``PretrainedConfig._attn_implementation``).
    Checked: 5.24.0, 5.25.0."""
    return getattr(config, "_attn_implementation", None)


def set_attention_implementation(config, name: str) -> None:
    """Set a config's attention implementation through its setter (``_attn_implementation``: sub-configs too).
    Checked: 5.24.0, 5.25.0."""
    config._attn_implementation = name


def supports_sdpa(model) -> bool:
    """Whether a model's class runs transformers' sdpa attention (``PreTrainedModel._supports_sdpa``); a module that
    is not a transformers model: True. Checked: 5.24.0, 5.25.0."""
    return bool(getattr(model, "_supports_sdpa", True))


def switch_attention(config, name: str) -> None:
    """Switch one config's attention implementation for the next forwards, per forward: writes the field the setter
    writes (``_attn_implementation_internal``) without its checks and sub-config walk. Checked: 5.24.0, 5.25.0."""
    config._attn_implementation_internal = name


def set_experts_implementation(config, name: str) -> None:
    """Set a config's mixture-of-experts implementation (``_experts_implementation``). Checked: 5.24.0, 5.25.0."""
    config._experts_implementation = name


def no_split_modules(model_class) -> list[str]:
    """The module class names a transformers model keeps whole on one device (``_no_split_modules``): the decoder
    layer's name among them. Checked: 5.24.0, 5.25.0."""
    return list(getattr(model_class, "_no_split_modules", None) or [])


def keep_in_fp32_strict(model_class) -> list[str]:
    """The parameter name patterns a transformers model keeps fp32 whatever the dtype
    (``_keep_in_fp32_modules_strict``). Checked: 5.24.0, 5.25.0."""
    return list(getattr(model_class, "_keep_in_fp32_modules_strict", None) or [])


# generate()'s renamed keywords (its @deprecate_kwarg decorators): old name -> new. A model folder's custom generate,
# called in place of generate(), gets them as the caller wrote them. Checked: 5.24.0, 5.25.0.
GENERATE_RENAMED_KWARGS = {"past_key_values": "cache", "cache_params": "cache"}


def loaded_revision(config) -> str | None:
    """The Hub commit a model was loaded from (``config._commit_hash``; ``None`` for a local folder). Checked:
    5.24.0, 5.25.0."""
    return getattr(config, "_commit_hash", None)


def user_defined_cache(cache) -> bool:
    """Whether ``generate()`` got ``cache`` from its caller (``cache=`` / ``past_key_values=``; it marks such a cache
    ``_is_user_defined``, not one it made itself): the loop fills a caller's cache, as ``generate()`` does.
    Checked: 5.25.0."""
    return bool(getattr(cache, "_is_user_defined", False))


def dropped_mask_length(generation_config) -> int | None:
    """The width of the attention mask ``generate()`` dropped for holding only ones (``_mask_length``: it slices the
    input by it when continuing from a cache); ``None`` when it kept the mask. Checked: 5.25.0."""
    return getattr(generation_config, "_mask_length", None)


def set_static_layer_length(layer, length: int) -> None:
    """After the loop moved a ``StaticLayer``'s columns in place: the number of columns it now holds (its
    ``cumulative_length`` tensor, what ``get_seq_length`` and the next write read). Checked: 5.24.0, 5.25.0."""
    static_layer_length(layer).fill_(length)


def static_layer_length(layer) -> torch.Tensor:
    """A ``StaticLayer``'s count of the columns it holds: its ``cumulative_length`` tensor. Checked: 5.24.0, 5.25.0."""
    return layer.cumulative_length


def load_with_conversions(module, state: dict, model_type: str):
    """Load ``state`` into the meta-device ``module`` with transformers' loader and the checkpoint conversion mapping
    of ``model_type`` (plus the legacy renames), as ``from_pretrained`` loads that family. Returns the loader's info
    (``missing_keys``, ``unexpected_keys``, ``mismatched_keys``, ``conversion_errors``, ``error_msgs``). The module keeps
    no record of the conversions (``_weight_conversions``): it is saved in the loaded names. Checked: 5.24.0, 5.25.0."""
    mapping = list(get_checkpoint_conversion_mapping(model_type) or []) + list(
        get_checkpoint_conversion_mapping("legacy") or [])
    info, _ = convert_and_load_state_dict_in_model(module, dict(state), LoadStateDictConfig(weight_mapping=mapping))
    module.__dict__.pop("_weight_conversions", None)
    return info


def run_assisted_decoding(model, candidate_generator, input_ids, logits_processor, stopping_criteria,
                          generation_config, **model_kwargs):
    """transformers' own assisted loop (``GenerationMixin._assisted_decoding``) with ``candidate_generator`` as its
    drafter: the model's ``_get_candidate_generator`` is overridden on the instance for the call and restored after.
    Checked: 5.24.0, 5.25.0."""
    had_own = "_get_candidate_generator" in vars(model)
    model._get_candidate_generator = lambda *args, **kwargs: candidate_generator
    try:
        return GenerationMixin._assisted_decoding(model, input_ids, logits_processor, stopping_criteria,
                                                  generation_config, **model_kwargs)
    finally:
        if not had_own:
            del model._get_candidate_generator


def capture_off():
    """Switch transformers' output capturing off (its hooks on a model's layers, installed once a call asked for
    hidden states, read a ``ContextVar`` that dynamo cannot trace): the token for :func:`capture_restore`. Inside
    compiled code it sets the collector's compile-time global (as a compiled model forward does), outside it the context
    variable. For layers run outside the model's forward (:class:`~hf_specdec.stack.DecoderStack` in a fixed-shape
    region). Checked: 5.24.0, 5.25.0 (``transformers.utils.output_capturing._active_collector``)."""
    from transformers.utils import output_capturing

    return output_capturing._active_collector.set(None)


def capture_restore(token) -> None:
    """Undo :func:`capture_off`. Checked: 5.24.0, 5.25.0."""
    from transformers.utils import output_capturing

    output_capturing._active_collector.reset(token)
