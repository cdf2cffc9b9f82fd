"""Published DFlash drafters -> :class:`hf_specdec.modeling.dflash.DFlashDrafter`.

Layouts read as published:

* **zlab** (z-lab/*-DFlash-b16 and later revisions): ``config.json`` with ``architectures: ["DFlashDraftModel"]``,
  ``block_size`` (top level or in ``dflash_config``), ``num_target_layers`` and ``dflash_config`` = {``mask_token_id``,
  ``target_layer_ids`` (layer outputs)}; Qwen3 layer fields (``layer_types``, ``sliding_window``, ``rope_theta`` or
  ``rope_parameters``); safetensors keys ``fc``, ``hidden_norm``, ``norm``, ``layers.{i}.*`` with q/k norms. The older
  5-layer / 5-tap and newer 6-layer / 8-tap revisions differ only in these fields. Causal variants: ``is_causal``
  (top level) or ``dflash_config.causal``; otherwise layers are bidirectional.
* **muse_glimmer** (transformers' native ``MuseGlimmerAssistantModel``, saved with its ``save_pretrained`` or given
  as the loaded module): ``encoder.fc`` / ``encoder.output_norm_enc`` instead of ``fc`` / ``hidden_norm``
  (:data:`MUSE_GLIMMER_NAMES`), fields at the top level, the fields it leaves out taken from transformers'
  ``MuseGlimmerAssistantConfig`` defaults (every layer ``sliding_attention``, ``sliding_window`` 2048, RoPE theta
  500000). Its config has no ``vocab_size`` (the target's embeddings and LM head are used): it is the target's, so
  converting needs ``target=``. Its sliding layers are bidirectional, and transformers' mask for them
  (``create_bidirectional_sliding_window_mask``, the sdpa / eager / flex paths) lets a query see keys with
  ``|q - k| <= sliding_window``, one more on each side than hf_specdec's (and the z-lab / speculators / flash-attention)
  convention ``|q - k| < sliding_window``: the converted config records ``sliding_window + 1``, the same keys.
* **speculators** (vLLM ``DFlashSpeculatorConfig``, ``speculators_model_type: "dflash"``): the Qwen3 layer fields in
  ``transformer_layer_config``; ``block_size``, ``mask_token_id`` and ``aux_hidden_state_layer_ids`` at the top level,
  the ids counted as HF ``hidden_states`` indices (z-lab's layer-output id + 1, as vLLM's ``update_dflash`` undoes);
  the z-lab key names. Full-attention layers are bidirectional, sliding ones causal unless
  ``sliding_window_non_causal``. A draft vocabulary (``draft_vocab_size`` < ``vocab_size``, its own ``lm_head``) and
  ``sample_from_anchor`` are refused: this drafter reads out with the target's whole LM head and drafts after the
  anchor.

:func:`export_dflash` writes a drafter back in the speculators layout (what ``vllm serve <folder>`` loads).
"""

from __future__ import annotations

import os

import torch
import transformers

from .common import (
    ConversionError,
    Exported,
    check_shapes,
    drafter_to_export,
    load_target_config,
    load_weights,
    read_config,
    resolve_source,
    resolve_verifier,
    speculators_fields,
    vllm_serve_command,
    write_export,
)

LAYOUTS = ("zlab", "muse_glimmer", "speculators")
# transformers' MuseGlimmerAssistantModel names -> this drafter's (the one place the mapping is written)
MUSE_GLIMMER_NAMES = {"encoder.fc.": "fc.", "encoder.output_norm_enc.": "hidden_norm."}
# transformers' own DFlash drafter classes, accepted as objects and converted in memory (:func:`as_dflash_drafter`)
NATIVE_DRAFTERS = tuple(c for c in (getattr(transformers, "MuseGlimmerAssistantModel", None),) if c is not None)
_FILES = ["config.json", "*.safetensors", "*.safetensors.index.json"]
_UNSUPPORTED = ("conv_kernel_size", "selector_rank", "attention_sink_bias", "output_multiplier")


def detect_layout(cfg: dict) -> str:
    archs = cfg.get("architectures") or []
    if cfg.get("speculators_model_type") == "dflash":
        return "speculators"
    if cfg.get("model_type") == "muse_glimmer_assistant" or any("MuseGlimmerAssistant" in a for a in archs):
        return "muse_glimmer"
    if "dflash_config" in cfg or any("DFlash" in a for a in archs):
        return "zlab"
    raise ConversionError(f"Unknown DFlash checkpoint layout (architectures={archs}, model_type="
                          f"{cfg.get('model_type')}); expected z-lab's DFlashDraftModel, MuseGlimmerAssistantModel or "
                          "a speculators DFlash config.")


def _from_speculators(cfg: dict) -> dict:
    """The z-lab-shaped config of a speculators DFlash config (the layer fields, then the DFlash ones)."""
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ConversionError("The speculators DFlash config lacks transformer_layer_config.")
    vocab = layer.get("vocab_size")
    if cfg.get("draft_vocab_size") not in (None, vocab):
        raise ConversionError(f"draft_vocab_size={cfg['draft_vocab_size']} < vocab_size={vocab}: a DFlash drafter with "
                              "its own reduced LM head, which hf_specdec's drafter (the target's head) does not have.")
    if cfg.get("sample_from_anchor"):
        raise ConversionError("sample_from_anchor=true (the anchor position drafts too) is not what hf_specdec's "
                              "DFlash drafter does (the anchor is the target's token).")
    ids = cfg.get("aux_hidden_state_layer_ids")
    if not ids:
        raise ConversionError("The speculators DFlash config has no aux_hidden_state_layer_ids.")
    sliding = [t == "sliding_attention" for t in layer.get("layer_types") or []]
    return {**layer, "block_size": cfg.get("block_size"), "target_hidden_size": cfg.get("target_hidden_size"),
            "dflash_config": {"mask_token_id": cfg.get("mask_token_id"), "target_layer_ids": [i - 1 for i in ids]},
            "_causal_sliding": any(sliding) and not cfg.get("sliding_window_non_causal", False)}


def _from_muse_glimmer(cfg: dict, target_cfg) -> dict:
    """A Muse Glimmer assistant config with transformers' defaults for the fields it leaves out, and the target's
    vocabulary (its config has none: the drafter reads out with the target's LM head)."""
    native = getattr(transformers, "MuseGlimmerAssistantConfig", None)
    if native is not None:
        try:
            cfg = {**cfg, **native.from_dict(cfg).to_dict()}
        except Exception as err:  # transformers' strict config checks (several error types)
            raise ConversionError(f"transformers does not read this Muse Glimmer assistant config: {err}") from err
    if cfg.get("vocab_size") is None:
        if target_cfg is None:
            raise ConversionError("A Muse Glimmer assistant's config has no vocab_size (it uses the target's "
                                  "embeddings and LM head): pass the target (target= or --target; verifier= or "
                                  "--verifier when exporting): the model, its folder or Hub id.")
        cfg = {**cfg, "vocab_size": target_cfg.get_text_config().vocab_size}
    if "sliding_attention" in (cfg.get("layer_types") or []) and cfg.get("sliding_window"):
        # transformers' bidirectional sliding mask: |q - k| <= W; ours: |q - k| < sliding_window
        cfg = {**cfg, "sliding_window": cfg["sliding_window"] + 1}
    return cfg


def rename_published(tensors: dict[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """A published layout's tensor names -> this drafter's (``model.`` prefix dropped; Muse Glimmer's
    :data:`MUSE_GLIMMER_NAMES`); the embeddings / LM head a checkpoint may carry are left out (the target's are
    used), as are rotary tables."""
    out = {}
    for key, value in tensors.items():
        key = key[len("model."):] if key.startswith("model.") else key
        if layout == "muse_glimmer":
            for old, new in MUSE_GLIMMER_NAMES.items():
                if key.startswith(old):
                    key = new + key[len(old):]
        if key in ("embed_tokens.weight", "lm_head.weight") or key.startswith("rotary_emb."):
            continue
        out[key] = value
    return out


def config_from_published(cfg: dict, layout: str) -> dict:
    if layout == "speculators":
        cfg = _from_speculators(cfg)
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
        causal=bool(causal) if causal is not None else False, causal_sliding=bool(cfg.get("_causal_sliding", False)),
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


def convert_dflash(source, out: str | os.PathLike | None = None, revision: str | None = None, target=None,
                   layout: str = "auto", dtype: torch.dtype | None = None):
    """Convert a published DFlash drafter; returns the ``DFlashDrafter`` (saved to ``out``).

    ``source``: a Hub repo id or folder in one of :data:`LAYOUTS`, or a loaded module of one (transformers'
    ``MuseGlimmerAssistantModel``: its config and state dict are read, and the drafter shares its weight tensors
    unless ``dtype`` asks for another dtype). ``target``: the target model, its config, folder or Hub id (a Muse
    Glimmer assistant needs it for the vocabulary size; any target is checked to fit)."""
    from hf_specdec.modeling.dflash import DFlashConfig, DFlashDrafter

    module = isinstance(source, torch.nn.Module)
    if module:
        if not hasattr(source, "config"):
            raise ConversionError(f"{type(source).__name__} has no config: not a published DFlash drafter.")
        cfg = source.config.to_dict()
        name = getattr(source, "name_or_path", "") or type(source).__name__
    else:
        folder = resolve_source(source, revision, _FILES)
        cfg = read_config(folder)
        name = str(source)
    layout = detect_layout(cfg) if layout == "auto" else layout
    if layout not in LAYOUTS:
        raise ConversionError(f"Unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}.")
    target_cfg = load_target_config(target)
    if layout == "muse_glimmer":
        cfg = _from_muse_glimmer(cfg, target_cfg)
    fields = config_from_published(cfg, layout)
    if target_cfg is not None:
        fields["num_target_layers"] = fields["num_target_layers"] or target_cfg.get_text_config().num_hidden_layers
    recorded = ((cfg.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    try:
        config = DFlashConfig(**fields, target_model=recorded or name)
    except ValueError as err:
        raise ConversionError(f"{name}: {err}") from err
    if target_cfg is not None:
        try:
            config.check_target(target_cfg)
        except ValueError as err:
            raise ConversionError(f"{name}: {err}") from err
    tensors = rename_published(dict(source.state_dict()) if module else load_weights(folder), layout)
    expected = expected_shapes(config)
    check_shapes(tensors, expected, f"{name} ({layout} layout)")
    unknown = sorted(set(tensors) - set(expected))
    if unknown:
        raise ConversionError(f"{name}: unexpected tensors {unknown[:8]} for a DFlash drafter.")
    weight_dtype = dtype or tensors["fc.weight"].dtype
    with torch.device("meta"):  # no initialisation: every weight is assigned (a module's tensors are shared)
        drafter = DFlashDrafter(config)
    missing, unexpected = drafter.load_state_dict({k: v.detach().to(weight_dtype) for k, v in tensors.items()},
                                                  strict=False, assign=True)
    if missing or unexpected:
        raise ConversionError(f"{name}: weights do not fit (missing {missing}, unexpected {unexpected}).")
    drafter = drafter.eval()
    if out is not None:
        drafter.save_pretrained(str(out))
    return drafter


def as_dflash_drafter(drafter, target=None):
    """``drafter`` as a ``DFlashDrafter``: one as it is; transformers' own (:data:`NATIVE_DRAFTERS`) converted in
    memory with :func:`convert_dflash`, sharing its weights (cheap enough for every ``generate`` call)."""
    from hf_specdec.modeling.dflash import DFlashDrafter

    if isinstance(drafter, DFlashDrafter):
        return drafter
    return convert_dflash(drafter, target=target)


# ------------------------------------------------------------------------------------------------------ export
def export_dflash(drafter_or_path, out, verifier=None, speculative_tokens: int | None = None,
                  dtype: torch.dtype | None = None) -> Exported:
    """Write a DFlash drafter in the speculators layout (``vllm serve <out>``).

    ``config.json`` is a ``DFlashSpeculatorConfig``: ``architectures: ["DFlashSpeculator"]``,
    ``transformer_layer_config`` = the draft layers as a Qwen3Config (q/k norms; ``layer_types``, ``sliding_window``),
    ``block_size``, ``mask_token_id``, ``aux_hidden_state_layer_ids`` = our layer-output ids + 1 (HF
    ``hidden_states`` indices; vLLM subtracts the 1 again for its ``dflash_config.target_layer_ids``),
    ``draft_vocab_size`` = ``vocab_size`` (the target's LM head reads out; no ``lm_head`` is written),
    ``target_hidden_size``, ``sliding_window_non_causal``, ``sample_from_anchor: false`` and the ``speculators_config``
    block (``speculative_tokens``: default and at most ``block_size - 1``). ``model.safetensors`` holds ``fc``,
    ``hidden_norm``, ``norm`` and ``layers.{i}.*``. A drafter whose full-attention layers are causal (``causal``) has
    no speculators equivalent (its full-attention layers are always bidirectional) and is refused.

    Args: as :func:`hf_specdec.conversions.eagle3.export_eagle3` (``drafter_or_path``: a ``DFlashDrafter``, a folder
    or Hub id in hf_specdec's format, or a layout :func:`convert_dflash` reads).
    """
    from hf_specdec.modeling.dflash import DFlashDrafter

    if isinstance(drafter_or_path, NATIVE_DRAFTERS):
        drafter_or_path = convert_dflash(drafter_or_path, target=verifier)
    drafter = drafter_to_export(drafter_or_path, DFlashDrafter, convert_dflash)
    c = drafter.config
    if c.causal:
        raise ConversionError("This DFlash drafter makes every layer causal (causal=true): speculators' DFlash keeps "
                              "full-attention layers bidirectional, so vLLM would run another network.")
    target = resolve_verifier(verifier, c.target_model, c)
    ids = c.target_layer_ids
    if ids is None:
        if target.num_hidden_layers is None:
            raise ConversionError("The drafter records no target_layer_ids and the verifier's layer count is unknown.")
        ids = c.layer_ids_for(target.num_hidden_layers)
    k = c.block_size - 1 if speculative_tokens is None else speculative_tokens
    if not isinstance(k, int) or not 1 <= k <= c.block_size - 1:
        raise ConversionError(f"speculative_tokens must be 1..{c.block_size - 1} (block_size - 1: the anchor is the "
                              f"target's token), got {k!r}.")
    sliding = "sliding_attention" in c.layer_types
    layer = {
        "model_type": "qwen3", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
        "hidden_act": c.hidden_act, "attention_bias": c.attention_bias, "vocab_size": c.vocab_size,
        "max_position_embeddings": c.max_position_embeddings, "rope_theta": c.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta}, "layer_types": list(c.layer_types),
        "use_sliding_window": sliding, "sliding_window": c.sliding_window if sliding else None,
        "tie_word_embeddings": False,
    }
    config = {
        "architectures": ["DFlashSpeculator"],
        **speculators_fields("dflash", k, target),
        "transformer_layer_config": layer,
        "draft_vocab_size": c.vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "block_size": c.block_size,
        "mask_token_id": c.mask_token_id,
        "aux_hidden_state_layer_ids": [i + 1 for i in ids],
        "sliding_window_non_causal": not (sliding and c.causal_sliding),
        "sample_from_anchor": False,
    }
    tensors = dict(drafter.state_dict())
    return write_export(out, config, tensors, dtype, f"vllm serve {out}   # or: "
                        + vllm_serve_command(out, target, "dflash", k))
