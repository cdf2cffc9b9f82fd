"""Published EAGLE-3 drafters -> :class:`hf_specdec.modeling.eagle3.Eagle3Drafter` (safetensors + our config).

Three layouts are read exactly as published:

* **research** (yuhuili/EAGLE3-*): LlamaConfig-like ``config.json`` with ``draft_vocab_size`` (no ``rope_theta``:
  RoPE base 10000), ``pytorch_model.bin`` with ``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d`` and no
  ``embed_tokens``; features at the reference's default layers.
* **specforge** (SpecForge / SGLang, ``architectures: ["LlamaForCausalLMEagle3"]``): the same keys in safetensors;
  explicit ``eagle_config.eagle_aux_hidden_state_layer_ids`` count layer *outputs* (SGLang adds one), so HF index =
  id + 1.
* **speculators** (vLLM ``Eagle3SpeculatorConfig``): ``transformer_layer_config`` holds the layer config, keys
  ``layers.0.*``; ``eagle_aux_hidden_state_layer_ids`` are HF indices as they are; ``norm_before_residual`` is
  honoured; ``norm_before_fc``, ``fc_norm`` and ``norm_output`` change the network and are refused.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .common import ConversionError, check_shapes, load_target_config, load_weights, read_config, resolve_source

LAYOUTS = ("research", "specforge", "speculators")
_FILES = ["config.json", "*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json"]


def detect_layout(config: dict) -> str:
    archs = config.get("architectures") or []
    if config.get("speculators_model_type") == "eagle3" or "Eagle3Speculator" in archs or "transformer_layer_config" in config:
        return "speculators"
    if any("Eagle3" in a for a in archs):
        return "specforge"
    if "draft_vocab_size" in config and any(a in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen2ForCausalLM")
                                            for a in archs):
        return "research"
    raise ConversionError(
        f"Unknown EAGLE-3 checkpoint layout (architectures={archs}); expected the research layout "
        "(LlamaForCausalLM + draft_vocab_size), SpecForge/SGLang (LlamaForCausalLMEagle3) or speculators "
        "(Eagle3Speculator). Pass --layout to force one.")


def _layer_fields(cfg: dict) -> dict:
    """Decoder-layer fields common to the research and SpecForge configs (Llama naming)."""
    hidden = cfg.get("hidden_size")
    heads = cfg.get("num_attention_heads")
    missing = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size") if cfg.get(k) is None]
    if missing:
        raise ConversionError(f"config.json lacks {', '.join(missing)}.")
    rope = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling")
    return dict(
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        hidden_act=cfg.get("hidden_act", "silu"),
        attention_bias=bool(cfg.get("attention_bias", False)),
        vocab_size=cfg["vocab_size"],
        rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
        rope_scaling=None if not scaling or scaling.get("rope_type", scaling.get("type")) == "default" else scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
    )


def config_from_published(cfg: dict, layout: str) -> dict:
    """Our Eagle3Config fields from a published config.json."""
    if layout == "speculators":
        layer = cfg.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise ConversionError("speculators config lacks transformer_layer_config.")
        for flag in ("norm_before_fc", "fc_norm", "norm_output"):
            if cfg.get(flag):
                raise ConversionError(f"speculators flag {flag}=true changes the EAGLE-3 network and is not supported "
                                      "by hf_specdec's drafter.")
        fields = _layer_fields(layer)
        ids = cfg.get("eagle_aux_hidden_state_layer_ids")
        fields.update(draft_vocab_size=cfg.get("draft_vocab_size", fields["vocab_size"]),
                      target_hidden_size=cfg.get("target_hidden_size"),
                      target_layer_ids=list(ids) if ids else None,
                      norm_before_residual=bool(cfg.get("norm_before_residual", False)))
        verifier = ((cfg.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
        fields["target_model"] = verifier
        return fields
    fields = _layer_fields(cfg)
    eagle_cfg = cfg.get("eagle_config") or {}
    ids = eagle_cfg.get("eagle_aux_hidden_state_layer_ids")
    if ids and layout == "specforge":
        ids = [i + 1 for i in ids]  # SGLang/SpecForge count layer outputs: HF hidden_states index = id + 1
    fields.update(draft_vocab_size=cfg.get("draft_vocab_size") or fields["vocab_size"],
                  target_hidden_size=cfg.get("target_hidden_size"),
                  target_layer_ids=list(ids) if ids else None)
    return fields


def expected_shapes(c) -> dict[str, tuple]:
    h, hd = c.hidden_size, c.head_dim
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    return {
        "fc.weight": (h, 3 * c.target_hidden_size),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, q),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.mlp.gate_proj.weight": (c.intermediate_size, h),
        "midlayer.mlp.up_proj.weight": (c.intermediate_size, h),
        "midlayer.mlp.down_proj.weight": (h, c.intermediate_size),
        "norm.weight": (h,),
        "lm_head.weight": (c.draft_vocab_size, h),
    }


def convert_eagle3(source: str | os.PathLike, out: str | os.PathLike | None = None, revision: str | None = None,
                   target: str | os.PathLike | None = None, layout: str = "auto", dtype: torch.dtype | None = None):
    """Convert a published EAGLE-3 drafter (Hub repo id or folder) to hf_specdec's format.

    Only ``config.json`` and the weight files are fetched (``allow_patterns``). With ``target`` (path or repo id),
    the drafter is checked against the target's config (vocabulary, hidden size, layer ids). Returns the
    ``Eagle3Drafter``; with ``out`` it is also saved there (safetensors + config, embeddings excluded).
    """
    from hf_specdec.modeling.eagle3 import Eagle3Config, Eagle3Drafter

    folder = resolve_source(source, revision, _FILES)
    cfg = read_config(folder)
    if layout == "auto":
        layout = detect_layout(cfg)
    elif layout not in LAYOUTS:
        raise ConversionError(f"Unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}.")
    fields = config_from_published(cfg, layout)
    target_cfg = load_target_config(target)
    if target_cfg is not None:
        text = target_cfg.get_text_config()
        fields["num_target_layers"] = text.num_hidden_layers
        fields["target_model"] = fields.get("target_model") or str(target)
    fields["target_model"] = fields.get("target_model") or (str(source) if not Path(str(source)).is_dir() else None)
    config = Eagle3Config(**fields)
    if target_cfg is not None:
        config.check_target(target_cfg)

    tensors = load_weights(folder)
    if layout == "speculators":
        tensors = {("midlayer." + k[len("layers.0."):]) if k.startswith("layers.0.") else k: v for k, v in tensors.items()}
        if any(k.startswith("layers.1.") for k in tensors):
            raise ConversionError("The checkpoint has more than one decoder layer; EAGLE-3 drafters have one.")
    tensors = {k[len("model."):] if k.startswith("model.") else k: v for k, v in tensors.items()}
    tensors.pop("embed_tokens.weight", None)  # the target's embeddings are used (and never stored)
    check_shapes(tensors, expected_shapes(config), f"{source} ({layout} layout)")
    if config.draft_vocab_size != config.vocab_size:
        for key, shape in (("d2t", (config.draft_vocab_size,)), ("t2d", (config.vocab_size,))):
            if key not in tensors:
                raise ConversionError(f"{source}: the draft vocabulary ({config.draft_vocab_size} of "
                                      f"{config.vocab_size} tokens) needs the {key} mapping, which is missing.")
            if tuple(tensors[key].shape) != shape:
                raise ConversionError(f"{source}: {key} has shape {tuple(tensors[key].shape)}, expected {shape}.")
        d2t = tensors["d2t"].long()
        mapped = torch.arange(config.draft_vocab_size) + d2t
        if mapped.min() < 0 or mapped.max() >= config.vocab_size:
            raise ConversionError(f"{source}: d2t maps draft ids outside the target vocabulary.")
        tensors["d2t"], tensors["t2d"] = d2t, tensors["t2d"].bool()
    else:
        tensors.pop("d2t", None)
        tensors.pop("t2d", None)
    unknown = sorted(set(tensors) - set(expected_shapes(config)) - {"d2t", "t2d"})
    if unknown:
        raise ConversionError(f"{source}: unexpected tensors {unknown[:8]} for an EAGLE-3 drafter.")

    weight_dtype = dtype or tensors["fc.weight"].dtype
    drafter = Eagle3Drafter(config)
    state = {k: (v.to(weight_dtype) if v.is_floating_point() else v) for k, v in tensors.items()}
    result = drafter.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if k != "embed_tokens.weight" and not k.endswith(("d2t", "t2d"))]
    if missing or result.unexpected_keys:
        raise ConversionError(f"{source}: weights do not fit the drafter (missing {missing}, "
                              f"unexpected {result.unexpected_keys}).")
    drafter = drafter.to(weight_dtype).eval()
    if out is not None:
        drafter.save_pretrained(str(out))
    return drafter
