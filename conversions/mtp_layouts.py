"""The published MTP layouts and how each is read (:data:`LAYOUTS`: deepseek, qwen3_next, mimo; described in
:mod:`.mtp`): which layout a checkpoint is and which of its keys are MTP tensors, under which of our names
(:func:`detect_layout`, :class:`MTPSource`), how many modules it holds, the family's text config (MiMo's:
:func:`mimo_main_config`) and DeepSeek's block-scaled FP8 (:func:`dequantize_fp8`). Fetching the files and building
the module: :func:`.mtp.convert_mtp`."""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field

import torch

from hf_specdec.modeling.mtp import LAYOUTS as _MODEL_LAYOUTS

from .common import ConversionError, read_config, resolve_source

LAYOUTS = _MODEL_LAYOUTS
CONFIG = "config.json"
# config fields that count the MTP modules, in the order they are looked for
COUNT_FIELDS = ("num_nextn_predict_layers", "num_mtp_layers", "mtp_num_hidden_layers")
_QWEN3_NEXT_TYPES = {"qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text"}
_MIMO_TYPES = {"mimo"}
_PROJ = {"deepseek": "eh_proj", "qwen3_next": "fc", "mimo": "input_proj"}
_NOT_KEPT = ("embed_tokens.weight", "shared_head.head.weight")  # deepseek: copies of the target's
_DROPPED_CONFIG = ("quantization_config", "auto_map", "architectures", "transformers_version", "_name_or_path")
_MIMO_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
                "rope_theta", "rope_scaling", "rope_parameters", "use_sliding_window", "sliding_window",
                "max_window_layers", "attention_dropout", "tie_word_embeddings", "use_cache", "bos_token_id",
                "eos_token_id", "pad_token_id", "torch_dtype", "dtype")
logger = logging.getLogger("hf_specdec")


@dataclass(frozen=True)
class MTPSource:
    """Where a checkpoint keeps its MTP layers: the layout, the main model's layer count ``N``, the module count its
    config states (``None``: not stated) and the field that states it, and the (text) config."""

    layout: str
    num_target_layers: int
    num_modules: int | None
    count_field: str | None
    text_config: dict = field(repr=False)

    @property
    def key_pattern(self) -> str:
        """The checkpoint keys of the MTP layers, as a reader would write them."""
        if self.layout == "deepseek":
            return f"model.layers.{self.num_target_layers}.*"
        return "mtp.*" if self.layout == "qwen3_next" else "model.mtp_layers.*"

    def match(self, key: str) -> tuple[int | None, str] | None:
        """``(module k, our key)`` of a checkpoint key of the MTP layers (k ``None``: shared by all modules), or
        ``None`` for a key of the main model."""
        if self.layout == "deepseek":
            m = re.match(r"model\.layers\.(\d+)\.(.+)$", key)
            if m is None or int(m[1]) < self.num_target_layers:
                return None
            k = int(m[1]) - self.num_target_layers
            return k, f"layers.{k}.{m[2]}"
        if self.layout == "mimo":
            m = re.match(r"model\.mtp_layers\.(\d+)\.(.+)$", key)
            return None if m is None else (int(m[1]), f"layers.{m[1]}.{m[2]}")
        if not key.startswith("mtp."):
            return None
        ours = key[len("mtp."):]
        m = re.match(r"layers\.(\d+)\.", ours)
        return (int(m[1]) if m else None), ours


def _text_config(config: dict) -> dict:
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def _count(text: dict, config: dict) -> tuple[str | None, int | None]:
    for name in COUNT_FIELDS:
        for where in (text, config):
            if isinstance(where.get(name), int):
                return name, where[name]
    return None, None


def detect_layout(config: dict, keys=None, layout: str | None = None) -> tuple[str, MTPSource]:
    """The MTP layout of a published checkpoint from its ``config.json`` (and, when given, its tensor names):
    ``(layout, MTPSource)``. ``layout`` forces one of :data:`LAYOUTS`."""
    if config.get("model_type") == "hf_specdec_mtp":
        raise ConversionError("This folder is already in hf_specdec's MTP format: load it with "
                              "MTPModule.from_pretrained (or pass it as drafter=).")
    text = _text_config(config)
    n = text.get("num_hidden_layers")
    if not isinstance(n, int) or n < 1:
        raise ConversionError(f"config.json has no num_hidden_layers (got {n!r}): cannot tell where the main model "
                              "ends and the MTP layers begin.")
    count_field, count = _count(text, config)
    types = {config.get("model_type"), text.get("model_type")}
    archs = " ".join(config.get("architectures") or [])
    keys = list(keys or [])
    if layout is not None:
        if layout not in LAYOUTS:
            raise ConversionError(f"Unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}.")
    elif types & _MIMO_TYPES or "MiMo" in archs:
        layout = "mimo"
    elif types & _QWEN3_NEXT_TYPES:
        layout = "qwen3_next"
    elif any(k.startswith("mtp.") for k in keys):
        layout = "qwen3_next"
    elif any(k.startswith("model.mtp_layers.") for k in keys):
        layout = "mimo"
    else:
        layout = "deepseek"
    return layout, MTPSource(layout, n, count, count_field, text)


def mimo_main_config(source, revision: str | None = None) -> "transformers.Qwen2Config":  # noqa: F821
    """The ``Qwen2Config`` of a MiMo checkpoint's main model (and of its MTP blocks) from the MiMo ``config.json``
    fields (a dict, a folder or a Hub repo id; only config.json is fetched): MiMo's main model is Qwen2-shaped, so it
    loads as ``Qwen2ForCausalLM.from_pretrained(repo, config=mimo_main_config(repo))`` without the remote code."""
    from transformers import Qwen2Config

    if not isinstance(source, dict):
        source = read_config(resolve_source(source, revision, allow_patterns=[CONFIG]))
    fields = {k: source[k] for k in _MIMO_FIELDS if k in source}
    if "torch_dtype" in fields:
        fields["dtype"] = fields.pop("torch_dtype")
    config = Qwen2Config(**fields)
    config.architectures = ["Qwen2ForCausalLM"]
    return config


def _family_text_config(info: MTPSource, config: dict):
    """The transformers config of the main model's text part (MiMo: its Qwen2 equivalent)."""
    from transformers import AutoConfig

    if info.layout == "mimo" and config.get("model_type") in _MIMO_TYPES | {None}:
        return mimo_main_config(config)
    data = {k: v for k, v in config.items() if k not in _DROPPED_CONFIG}
    model_type = data.pop("model_type", None)
    if not model_type:
        raise ConversionError("config.json has no model_type: cannot tell which decoder layer the MTP blocks are.")
    try:
        built = AutoConfig.for_model(model_type, **data)
    except (ValueError, KeyError, TypeError) as err:
        raise ConversionError(f"transformers cannot build a {model_type!r} config (needed for the MTP blocks' "
                              f"decoder layers): {err}") from err
    return built.get_text_config(decoder=True)


def _module_count(info: MTPSource, mtp_keys, what: str) -> int:
    found = sorted({k for k, _ in (info.match(key) for key in mtp_keys) if k is not None})
    said = f"{info.count_field}={info.num_modules}" if info.count_field else \
        f"no {' / '.join(COUNT_FIELDS)}"
    if not mtp_keys:
        if info.num_modules:
            raise ConversionError(
                f"{what}: config.json says {said}, but the checkpoint holds no {info.key_pattern} tensors: its MTP "
                "layers are not in this checkpoint (some re-uploads and quantizations strip them).")
        raise ConversionError(
            f"{what}: the checkpoint has no MTP layers: config.json has {said} (looked for "
            f"{', '.join(COUNT_FIELDS)}), and it holds no {info.key_pattern} tensors (looked for "
            f"model.layers.{info.num_target_layers}.*, mtp.* and model.mtp_layers.*).")
    if info.layout == "qwen3_next" and not found:
        raise ConversionError(f"{what}: the checkpoint's mtp.* tensors hold no decoder layer (mtp.layers.0.*).")
    if found != list(range(len(found))):
        raise ConversionError(f"{what}: the MTP modules are numbered {found} ({info.key_pattern}); expected "
                              f"0..K-1 consecutive.")
    if not info.num_modules:
        logger.warning(f"hf_specdec: {what}: config.json has {said}; the checkpoint holds {len(found)} MTP "
                       "module(s), which are used.")
        return len(found)
    if len(found) < info.num_modules:
        raise ConversionError(f"{what}: config.json says {said}, but the checkpoint holds only {len(found)} MTP "
                              f"module(s) ({info.key_pattern}).")
    if len(found) > info.num_modules:
        raise ConversionError(f"{what}: the checkpoint holds {len(found)} MTP modules, config.json says {said}; "
                              "unexpected tensors: " + ", ".join(sorted(
                                  k for k in mtp_keys if info.match(k)[0] is not None
                                  and info.match(k)[0] >= info.num_modules)[:6]))
    return info.num_modules


def dequantize_fp8(tensors: dict[str, torch.Tensor], block_size=(128, 128), what: str = "checkpoint"
                   ) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's FP8 weights in fp32: every ``X.weight`` (``float8_e4m3fn``) with ``X.weight_scale_inv``
    ``[ceil(rows / b0), ceil(cols / b1)]`` becomes ``weight.float() * scale`` with each scale over its
    ``b0 x b1`` block (cropped at the edges). Other tensors pass as they are."""
    out = dict(tensors)
    b0, b1 = (int(b) for b in block_size)
    for scale_key in sorted(k for k in tensors if k.endswith(".weight_scale_inv")):
        key = scale_key[:-len("_scale_inv")]
        if key not in out:
            raise ConversionError(f"{what}: {scale_key} has no {key} to scale.")
        weight, scale = out.pop(key), out.pop(scale_key).float()
        if weight.dim() != 2:
            raise ConversionError(f"{what}: {key} is {tuple(weight.shape)}; block-scaled FP8 weights are 2-D.")
        rows, cols = weight.shape
        expected = (math.ceil(rows / b0), math.ceil(cols / b1))
        if tuple(scale.shape) != expected:
            raise ConversionError(f"{what}: {scale_key} is {tuple(scale.shape)}, but a {rows}x{cols} weight in "
                                  f"{b0}x{b1} blocks needs {expected} scales (quantization_config.weight_block_size).")
        full = scale.repeat_interleave(b0, dim=0).repeat_interleave(b1, dim=1)[:rows, :cols]
        out[key] = weight.float() * full
    left = sorted(k for k, v in out.items() if v.dtype in _FP8_DTYPES)
    if left:
        raise ConversionError(f"{what}: {left[0]} is {out[left[0]].dtype} without a {left[0]}_scale_inv block scale "
                              f"({len(left)} such tensor(s)); only DeepSeek-style block-scaled FP8 is supported.")
    return out


_FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
                    if hasattr(torch, n))


def _published_dtype(tensors: dict[str, torch.Tensor], proj_key: str) -> torch.dtype:
    """The dtype the MTP layers were published in: that of the projection (FP8 -> bf16)."""
    candidates = [tensors[proj_key]] if proj_key in tensors else list(tensors.values())
    for t in candidates:
        if t.is_floating_point() and t.dtype not in _FP8_DTYPES:
            return t.dtype
    return torch.bfloat16
