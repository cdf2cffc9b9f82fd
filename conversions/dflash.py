"""Published DFlash drafters -> :class:`hf_specdec.modeling.dflash.DFlashDrafter`.

Layouts read as published:

* **zlab** (z-lab/*-DFlash-b16 and later revisions): ``config.json`` with ``architectures: ["DFlashDraftModel"]``,
  ``block_size`` (top level or in ``dflash_config``), ``num_target_layers`` and ``dflash_config`` = {``mask_token_id``,
  ``target_layer_ids`` (layer outputs)}; Qwen3 layer fields (``layer_types``, ``sliding_window``, ``rope_theta`` or
  ``rope_parameters``); safetensors keys ``fc``, ``hidden_norm``, ``norm``, ``layers.{i}.*`` with q/k norms. The older
  5-layer / 5-tap and newer 6-layer / 8-tap revisions differ only in these fields. Causal variants: ``is_causal``
  (top level) or ``dflash_config.causal``; otherwise layers are bidirectional.
* **muse_glimmer** (transformers' native ``MuseGlimmerAssistantModel``): ``encoder.fc`` / ``encoder.output_norm_enc``
  instead of ``fc`` / ``hidden_norm``, fields at the top level.
"""

from __future__ import annotations

import os

import torch

from .common import ConversionError, check_shapes, load_target_config, load_weights, read_config, resolve_source

LAYOUTS = ("zlab", "muse_glimmer")
_FILES = ["config.json", "*.safetensors", "*.safetensors.index.json"]
_UNSUPPORTED = ("conv_kernel_size", "selector_rank", "attention_sink_bias", "output_multiplier")


def detect_layout(cfg: dict) -> str:
    archs = cfg.get("architectures") or []
    if cfg.get("model_type") == "muse_glimmer_assistant" or any("MuseGlimmerAssistant" in a for a in archs):
        return "muse_glimmer"
    if "dflash_config" in cfg or any("DFlash" in a for a in archs):
        return "zlab"
    raise ConversionError(f"Unknown DFlash checkpoint layout (architectures={archs}, model_type="
                          f"{cfg.get('model_type')}); expected z-lab's DFlashDraftModel or MuseGlimmerAssistantModel.")


def config_from_published(cfg: dict, layout: str) -> dict:
    dcfg = cfg.get("dflash_config") or {}
    for key in _UNSUPPORTED:
        if cfg.get(key) is not None or dcfg.get(key) is not None:
            raise ConversionError(f"{key} marks a DFlash 2 / variant drafter that hf_specdec does not implement.")
    missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
               if cfg.get(k) is None]
    if missing:
        raise ConversionError(f"config.json lacks {', '.join(missing)}.")
    rope = cfg.get("rope_parameters") or {}
    layer_types = cfg.get("layer_types")
    sliding = cfg.get("sliding_window")
    if layer_types is None and cfg.get("use_sliding_window") and sliding:
        layer_types = ["sliding_attention"] * cfg["num_hidden_layers"]
    mask = dcfg.get("mask_token_id", cfg.get("mask_token_id"))
    if mask is None:
        raise ConversionError("The DFlash config has no mask_token_id (dflash_config.mask_token_id).")
    ids = dcfg.get("target_layer_ids", cfg.get("target_layer_ids"))
    causal = cfg.get("is_causal")
    if causal is None:
        causal = dcfg.get("causal")
    return dict(
        hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        head_dim=cfg.get("head_dim"), rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), hidden_act=cfg.get("hidden_act", "silu"),
        attention_bias=bool(cfg.get("attention_bias", False)), vocab_size=cfg["vocab_size"],
        block_size=dcfg.get("block_size", cfg.get("block_size", 16)), mask_token_id=mask,
        target_layer_ids=list(ids) if ids is not None else None, num_target_layers=cfg.get("num_target_layers"),
        target_hidden_size=cfg.get("target_hidden_size"), layer_types=layer_types,
        sliding_window=sliding if layer_types and "sliding_attention" in layer_types else None,
        causal=bool(causal) if causal is not None else False,
        rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
        max_position_embeddings=cfg.get("max_position_embeddings", 40960),
    )


def expected_shapes(c) -> dict[str, tuple]:
    h, hd = c.hidden_size, c.head_dim
    n_taps = len(c.target_layer_ids) if c.target_layer_ids else c.num_hidden_layers
    shapes = {"fc.weight": (h, n_taps * c.target_hidden_size), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (c.num_attention_heads * hd, h),
            p + "self_attn.k_proj.weight": (c.num_key_value_heads * hd, h),
            p + "self_attn.v_proj.weight": (c.num_key_value_heads * hd, h),
            p + "self_attn.o_proj.weight": (h, c.num_attention_heads * hd),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (c.intermediate_size, h), p + "mlp.up_proj.weight": (c.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, c.intermediate_size),
        })
    return shapes


def convert_dflash(source: str | os.PathLike, out: str | os.PathLike | None = None, revision: str | None = None,
                   target: str | os.PathLike | None = None, layout: str = "auto", dtype: torch.dtype | None = None):
    """Convert a published DFlash drafter (Hub repo id or folder); returns the ``DFlashDrafter`` (saved to ``out``)."""
    from hf_specdec.modeling.dflash import DFlashConfig, DFlashDrafter

    folder = resolve_source(source, revision, _FILES)
    cfg = read_config(folder)
    layout = detect_layout(cfg) if layout == "auto" else layout
    if layout not in LAYOUTS:
        raise ConversionError(f"Unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}.")
    fields = config_from_published(cfg, layout)
    target_cfg = load_target_config(target)
    if target_cfg is not None:
        fields["num_target_layers"] = fields["num_target_layers"] or target_cfg.get_text_config().num_hidden_layers
    try:
        config = DFlashConfig(**fields, target_model=str(source))
    except ValueError as err:
        raise ConversionError(f"{source}: {err}") from err
    if target_cfg is not None:
        config.check_target(target_cfg)
    tensors = load_weights(folder)
    if layout == "muse_glimmer":
        tensors = {k.replace("encoder.fc.", "fc.").replace("encoder.output_norm_enc.", "hidden_norm."): v
                   for k, v in tensors.items()}
    tensors = {k[len("model."):] if k.startswith("model.") else k: v for k, v in tensors.items()}
    for extra in ("embed_tokens.weight", "lm_head.weight"):
        tensors.pop(extra, None)  # the target's are used
    expected = expected_shapes(config)
    check_shapes(tensors, expected, f"{source} ({layout} layout)")
    unknown = sorted(set(tensors) - set(expected))
    if unknown:
        raise ConversionError(f"{source}: unexpected tensors {unknown[:8]} for a DFlash drafter.")
    weight_dtype = dtype or tensors["fc.weight"].dtype
    drafter = DFlashDrafter(config)
    missing, unexpected = drafter.load_state_dict({k: v.to(weight_dtype) for k, v in tensors.items()}, strict=False)
    if missing or unexpected:
        raise ConversionError(f"{source}: weights do not fit (missing {missing}, unexpected {unexpected}).")
    drafter = drafter.to(weight_dtype).eval()
    if out is not None:
        drafter.save_pretrained(str(out))
    return drafter
