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

:func:`export_eagle3` writes a drafter back in the speculators layout (what ``vllm serve <folder>`` loads) or the
SpecForge layout (what SGLang loads); reading the folder with :func:`convert_eagle3` gives the same drafter.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

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


# ------------------------------------------------------------------------------------------------------ export
EXPORT_LAYOUTS = ("speculators", "specforge")
DEFAULT_SPECULATIVE_TOKENS = 3  # speculators convert's default for EAGLE-3


def layer_config(c) -> dict:
    """The draft decoder layer as a ``LlamaConfig`` dict (speculators' ``transformer_layer_config``, SpecForge's top
    level): RoPE both as ``rope_theta`` / ``rope_scaling`` (transformers 4.x readers) and ``rope_parameters`` (5.x)."""
    rope = dict(getattr(c, "rope_parameters", None) or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    scaling = None if kind == "default" else {k: v for k, v in rope.items() if k != "rope_theta"}
    return {
        "model_type": "llama", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim, "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps, "hidden_act": c.hidden_act,
        "attention_bias": c.attention_bias, "mlp_bias": False, "vocab_size": c.vocab_size,
        "max_position_embeddings": c.max_position_embeddings, "rope_theta": c.rope_theta, "rope_scaling": scaling,
        "rope_parameters": {**(scaling or {"rope_type": "default"}), "rope_theta": c.rope_theta},
        "tie_word_embeddings": False,
    }


def export_eagle3(drafter_or_path, out, verifier=None, speculative_tokens: int | None = None,
                  dtype: torch.dtype | None = None, layout: str = "speculators") -> Exported:
    """Write an EAGLE-3 drafter where a serving engine loads it.

    * ``layout="speculators"`` (vLLM: ``vllm serve <out>``): ``config.json`` is an ``Eagle3SpeculatorConfig``
      (``architectures: ["Eagle3Speculator"]``, ``transformer_layer_config`` = the draft layer as a LlamaConfig,
      ``draft_vocab_size``, ``target_hidden_size``, ``norm_before_residual`` always written -- vLLM takes a missing
      one as ``true`` --, ``eagle_aux_hidden_state_layer_ids`` = our HF ``hidden_states`` indices as they are, the
      ``speculators_config`` block); ``model.safetensors`` holds ``fc``, ``layers.0.*``, ``norm``, ``lm_head`` and,
      with a draft vocabulary, ``d2t`` / ``t2d``.
    * ``layout="specforge"`` (SGLang ``--speculative-algorithm EAGLE3``): a LlamaConfig with ``architectures:
      ["LlamaForCausalLMEagle3"]`` and ``eagle_config.eagle_aux_hidden_state_layer_ids`` counted as SGLang counts
      them (layer outputs: our index - 1); keys ``midlayer.*`` as ours.

    The target's embedding is never written (ours is always the target's; both engines share the target's).

    Args:
        drafter_or_path: an ``Eagle3Drafter``, a folder or Hub id in hf_specdec's format, or a published layout
            :func:`convert_eagle3` reads.
        out: the folder to write.
        verifier: the target (Hub id, folder, config or model); default: the target the drafter records.
        speculative_tokens: drafts per step the config proposes (default 3).
        dtype: store floating weights in this dtype (default: as they are).
    """
    from hf_specdec.modeling.eagle3 import Eagle3Drafter, default_target_layer_ids

    if layout not in EXPORT_LAYOUTS:
        raise ConversionError(f"Unknown export layout {layout!r}; choose from {', '.join(EXPORT_LAYOUTS)}.")
    drafter = drafter_to_export(drafter_or_path, Eagle3Drafter, convert_eagle3)
    c = drafter.config
    target = resolve_verifier(verifier, c.target_model, c)
    ids = c.target_layer_ids
    if ids is None and target.num_hidden_layers is not None:
        ids = default_target_layer_ids(target.num_hidden_layers)
    k = DEFAULT_SPECULATIVE_TOKENS if speculative_tokens is None else speculative_tokens
    tensors = {name: t for name, t in drafter.state_dict().items() if name != "embed_tokens.weight"}
    if c.draft_vocab_size == c.vocab_size:  # the identity mapping: engines need none
        tensors.pop("d2t")
        tensors.pop("t2d")
    if layout == "specforge":
        if c.norm_before_residual:
            raise ConversionError("norm_before_residual=true (a speculators variant) has no SpecForge/SGLang field: "
                                  "export with layout='speculators'.")
        if ids is not None and min(ids) < 1:
            raise ConversionError(f"SGLang counts feature layers as layer outputs (HF index - 1): the index 0 in "
                                  f"{ids} (the embeddings) cannot be written.")
        config = {**layer_config(c), "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size":
                  c.draft_vocab_size, "target_hidden_size": c.target_hidden_size}
        if ids is not None:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids],
                                      "use_aux_hidden_state": True}
        serve = (f"python -m sglang.launch_server --model-path {target.name_or_path} --speculative-algorithm EAGLE3 "
                 f"--speculative-draft-model-path {out} --speculative-num-steps {k} --speculative-eagle-topk 1 "
                 f"--speculative-num-draft-tokens {k + 1}")
        return write_export(out, config, tensors, dtype, serve)
    tensors = {("layers.0." + n[len("midlayer."):]) if n.startswith("midlayer.") else n: t for n, t in tensors.items()}
    config = {
        "architectures": ["Eagle3Speculator"],
        **speculators_fields("eagle3", k, target),
        "transformer_layer_config": layer_config(c),
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(ids) if ids is not None else None,
        "norm_before_residual": bool(c.norm_before_residual),
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": False,
    }
    return write_export(out, config, tensors, dtype, f"vllm serve {out}   # or: "
                        + vllm_serve_command(out, target, "eagle3", k))
