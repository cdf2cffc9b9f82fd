"""Published multi-token-prediction (MTP) layers -> :class:`hf_specdec.modeling.mtp.MTPModule`.

The MTP layers ship inside the main model's checkpoint; only ``config.json``, ``model.safetensors.index.json`` and
the shard(s) the index names for the MTP tensors are fetched (pinned to one commit), and only the MTP tensors are
read from them. Three layouts (:data:`LAYOUTS`, read by :mod:`.mtp_layouts`) are read as published; the module
keeps each layout's own names with the checkpoint prefix removed:

* **deepseek**: DeepSeek-V3 / R1 (``deepseek_v3``), GLM-4.5 / 4.6 / 4.7 (``glm4_moe``) and other families that put
  ``num_nextn_predict_layers`` (``K``) modules after their ``N = num_hidden_layers`` decoder layers:
  ``model.layers.{N+k}.{enorm, hnorm, eh_proj, shared_head.norm}.weight`` and a decoder layer of the family
  (``self_attn.*``, ``mlp.*``, ``input_layernorm``, ``post_attention_layernorm``) -> ``layers.{k}.*``. The stored
  ``embed_tokens.weight`` and ``shared_head.head.weight`` are copies of the target's embedding and LM head and are not
  kept (the module uses the target's when bound). DeepSeek-V3's released weights are FP8 (``float8_e4m3fn``) with
  block scales ``*.weight_scale_inv`` (``quantization_config.weight_block_size``, 128 x 128): they are dequantized
  (``weight.float() * scale`` broadcast over the blocks, cropped to the weight's shape) and kept in bf16 by default.
* **qwen3_next**: Qwen3-Next (``qwen3_next``, ``num_nextn_predict_layers``) and Qwen3.5 / 3.6 (``qwen3_5``,
  ``qwen3_5_moe``: the config nests ``text_config``, which says ``mtp_num_hidden_layers``): ``mtp.fc.weight [H, 2H]``,
  ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``, ``mtp.norm`` and full-attention decoder layers
  ``mtp.layers.{k}.*`` -> the same names without ``mtp.``. The norms are the family's zero-centred ``x * (1 + w)``
  RMSNorm.
* **mimo**: XiaomiMiMo/MiMo-7B-{Base,SFT,RL} (config ``model_type: "mimo"``, a Qwen2-shaped model with remote code that
  is never executed here): ``model.mtp_layers.{k}.{token_layernorm, hidden_layernorm, input_proj [H, 2H],
  input_layernorm, post_attention_layernorm, self_attn.{q,k,v}_proj.{weight,bias}, self_attn.o_proj.weight,
  mlp.{gate,up,down}_proj.weight, final_layernorm}`` -> ``layers.{k}.*``; the projection reads the **hidden state
  first**. The block is a transformers ``Qwen2DecoderLayer`` built from the MiMo config's fields
  (:func:`mimo_main_config`). The main model runs without its remote code as a plain ``Qwen2ForCausalLM``::

      from transformers import Qwen2ForCausalLM
      from hf_specdec.conversions.mtp import convert_mtp, mimo_main_config

      repo = "XiaomiMiMo/MiMo-7B-RL"
      target = Qwen2ForCausalLM.from_pretrained(repo, config=mimo_main_config(repo))  # model.mtp_layers.* unused
      mtp = convert_mtp(repo).bind_target(target)

The MoE blocks' experts are stored per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``) while transformers
5.x modules hold them fused (``mlp.experts.gate_up_proj`` / ``down_proj``): the tensors go through transformers' own
loader with the family's own conversion mapping (``get_checkpoint_conversion_mapping(model_type)``), exactly as
``from_pretrained`` of the family would load them; parameters the family keeps in fp32
(``_keep_in_fp32_modules_strict``: DeepSeek's / GLM's router) stay fp32.

A **speculators** MTP folder (``speculators_model_type: "mtp"``: speculators' ``MTPDraftModel``, one module, Qwen3 /
Qwen3-Next / Qwen3.5 blocks; ``transformer_layer_config`` = the target's text config, keys
``mtp_layers.0.{token_layernorm, hidden_layernorm, input_proj, final_layernorm}`` beside the block's own) is read too
(:data:`SPECULATORS_LAYOUT`); the module takes the names of its family's published layout (``qwen3_next`` for
Qwen3-Next / Qwen3.5, else ``deepseek``, the layout hf_specdec trains). :func:`export_mtp` writes that folder.

A folder that is already in hf_specdec's format (``model_type: "hf_specdec_mtp"``) is refused with a message to load
it with ``MTPModule.from_pretrained`` (``conversions.common.load_converted_or_published`` does either).

Sources: deepseek-ai/DeepSeek-V3 ``README_WEIGHTS.md`` (``model.layers.61.*``, FP8 128 x 128 ``weight_scale_inv``)
and ``inference/fp8_cast_bf16.py`` (dequantization); vLLM ``vllm/model_executor/models/deepseek_mtp.py``,
``qwen3_next_mtp.py``, ``mimo_mtp.py``; SGLang ``deepseek_nextn.py``; transformers 5.24 ``modeling_layers.py``
(``MtpLayer``, ``MtpModel.from_pretrained``), ``conversion_mapping.py`` (``MtpModel`` renamings, ``qwen2_moe`` expert
fusion), ``Glm4MoePreTrainedModel._keys_to_ignore_on_load_unexpected`` (GLM's ``model.layers.92.*`` / ``46.*``);
XiaomiMiMo ``modeling_mimo.py`` (``MiMoMTPLayers``, ``cat([hidden_layernorm(h), token_layernorm(emb)])``); mlx-lm
PR 990 (Qwen3.5 ``mtp.*``, ``mtp_num_hidden_layers``); collected in ``shared/reference/dflash-layerskip-mtp.md`` §3.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import torch

from hf_specdec._transformers import keep_in_fp32_strict, load_with_conversions

from .common import (
    ConversionError,
    Exported,
    check_fits,
    check_weight_file,
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
from .mtp_layouts import LAYOUTS  # noqa: F401  (re-exported: the layouts convert_mtp reads)
from .mtp_layouts import (
    CONFIG,
    _DROPPED_CONFIG,
    _FP8_DTYPES,
    _MIMO_TYPES,
    _NOT_KEPT,
    _PROJ,
    _QWEN3_NEXT_TYPES,
    _family_text_config,
    _module_count,
    _published_dtype,
    dequantize_fp8,
    detect_layout,
    mimo_main_config,
)

SPECULATORS_LAYOUT = "speculators"  # speculators' MTPDraftModel folder (read back; see export_mtp)
# the block families speculators 0.9.0's MTPDraftModel builds (models/mtp/model_definitions.py)
SPECULATORS_MTP_TYPES = ("qwen3", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
_SPECULATORS_PREFIX = "mtp_layers.0."
DEFAULT_SPECULATIVE_TOKENS = 3  # the chain an export proposes
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
logger = logging.getLogger("hf_specdec")


def _pin(source, folder: Path, revision: str | None) -> str | None:
    """The commit the first fetch resolved (a Hub snapshot folder is named by it): later fetches use it, so every file
    comes from one revision even if the branch moves meanwhile."""
    if Path(source).expanduser().is_dir():
        return revision
    return folder.name if folder.parent.name == "snapshots" else revision


def _read_index(folder: Path) -> dict[str, str] | None:
    path = folder / INDEX
    if not path.is_file():
        return None
    try:
        weight_map = json.loads(path.read_text()).get("weight_map")
    except (json.JSONDecodeError, AttributeError) as err:
        raise ConversionError(f"{path} is not a valid safetensors index: {err}") from err
    if not isinstance(weight_map, dict):
        raise ConversionError(f"{path} has no weight_map.")
    return weight_map


def _read_tensors(folder: Path, where: dict[str, str], what: str) -> dict[str, torch.Tensor]:
    """The tensors ``where`` names (key -> file in ``folder``), file by file: a file missing or cut off is named."""
    from safetensors import safe_open

    by_file: dict[str, list[str]] = {}
    for key, name in where.items():
        by_file.setdefault(name, []).append(key)
    tensors = {}
    for name, keys in sorted(by_file.items()):
        path = folder / name
        if not path.is_file():
            raise ConversionError(
                f"{what}: {INDEX} names {name} for {len(keys)} MTP tensor(s) (e.g. {sorted(keys)[0]}), but {folder} "
                f"has no such file: the download is incomplete or the file was removed; download it again.")
        check_weight_file(path)
        with safe_open(str(path), framework="pt") as handle:
            present = set(handle.keys())
            absent = sorted(k for k in keys if k not in present)
            if absent:
                raise ConversionError(f"{what}: {INDEX} places {absent[0]} in {name}, which does not hold it "
                                      f"({len(absent)} such tensor(s)): the index and the shard do not match.")
            tensors.update({k: handle.get_tensor(k) for k in keys})
    return tensors


def _fp32_patterns(block_config) -> list[str]:
    """The family's ``_keep_in_fp32_modules_strict`` (parameters transformers keeps fp32 whatever the dtype)."""
    from transformers import MODEL_MAPPING

    try:
        cls = MODEL_MAPPING[type(block_config)]
    except KeyError:
        return []
    return keep_in_fp32_strict(cls)


def _keeps_fp32(name: str, patterns: list[str]) -> bool:
    return any(re.search(rf"(^|\.){re.escape(p)}(\.|$)", name) for p in patterns)


def _load_state(module, state: dict[str, torch.Tensor], names: dict[str, str], what: str) -> None:
    """Load ``state`` (checkpoint names, prefix removed) into the meta-device ``module`` with transformers' own
    loader and the block family's conversion mapping (per-expert -> fused experts, ...); anything missing,
    unexpected or of another shape is an error naming the checkpoint's keys."""
    from transformers import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        # saved in our (fused) names afterwards, loaded without conversion
        info = load_with_conversions(module, state, module.config.block_config.get("model_type"))
    finally:
        if bars:
            hf_logging.enable_progress_bar()

    def named(key):
        return names.get(key, key)

    problems = []
    if info.unexpected_keys:
        problems.append("unexpected tensors " + ", ".join(sorted(named(k) for k in info.unexpected_keys)[:8]))
    if info.missing_keys:
        problems.append("missing tensors " + ", ".join(sorted(info.missing_keys)[:8]))
    if info.mismatched_keys:
        problems.append("tensors of another shape " + "; ".join(
            f"{named(k)} {list(got)} (the config makes {list(want)})"
            for k, got, want in sorted(info.mismatched_keys, key=str)[:6]))
    problems += [f"{k}: {v}" for k, v in sorted(info.conversion_errors.items())]
    problems += list(info.error_msgs)
    if not problems:
        left = [n for n, t in list(module.named_parameters()) + list(module.named_buffers()) if t.is_meta]
        if left:
            problems.append("tensors not loaded " + ", ".join(left[:8]))
    if problems:
        raise ConversionError(f"{what}: the MTP tensors do not fit the MTP module the config describes: "
                              + "; ".join(problems) + ".")


def _target_config(target):
    if target is None:
        return None
    if hasattr(target, "get_text_config"):  # a config
        return target
    if hasattr(target, "config") and hasattr(target.config, "get_text_config"):  # a model
        return target.config
    folder = Path(target) if Path(target).is_dir() else resolve_source(target, allow_patterns=[CONFIG])
    if read_config(folder).get("model_type") in _MIMO_TYPES:
        return mimo_main_config(read_config(folder))
    return load_target_config(target)


def convert_mtp(source: str | os.PathLike, out: str | os.PathLike | None = None, revision: str | None = None,
                target=None, layout: str | None = None, dtype: torch.dtype | None = None):
    """Convert a published checkpoint's MTP layers (Hub repo id or folder) to an :class:`MTPModule`.

    Fetched: ``config.json`` and ``model.safetensors.index.json`` first, then only the shard(s) the index names for
    MTP tensors (an unsharded ``model.safetensors`` is fetched whole), all at the commit ``revision`` resolves to.
    ``layout`` (default: detected) is one of :data:`LAYOUTS` or :data:`SPECULATORS_LAYOUT`. With ``target`` (a path,
    repo id, config or model) the module is checked against the target's config (hidden size, vocabulary, layer
    count). With ``out`` it is also saved there (``save_pretrained``). Weights are kept in ``dtype`` (default: the
    published dtype; FP8 -> bf16), except what the family keeps in fp32. Returns the module in eval mode (not bound:
    ``bind_target``).
    """
    from hf_specdec.modeling.mtp import MTPConfig, block_config_for

    folder = resolve_source(source, revision, [CONFIG, INDEX])
    pinned = _pin(source, folder, revision)
    cfg = read_config(folder)
    if cfg.get("model_type") == MTPConfig.model_type:
        raise ConversionError(f"{source} is already in hf_specdec's MTP format: load it with "
                              "MTPModule.from_pretrained (or pass it as drafter=).")
    if cfg.get("speculators_model_type") == "mtp" or layout == SPECULATORS_LAYOUT:
        return _convert_speculators(source, pinned, cfg, target, dtype, out)
    weight_map = _read_index(folder)
    sharded = weight_map is not None
    if not sharded:
        logger.info(f"hf_specdec: {source} has no {INDEX}: fetching the whole {SINGLE} for its MTP layers.")
        folder = resolve_source(source, pinned, [CONFIG, SINGLE])
        single = folder / SINGLE
        if not single.is_file():
            raise ConversionError(f"{source}: no {INDEX} and no {SINGLE} (MTP layers are read from safetensors "
                                  "checkpoints only).")
        check_weight_file(single)
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as handle:
            weight_map = {k: SINGLE for k in handle.keys()}
    name, info = detect_layout(cfg, weight_map.keys(), None if layout in (None, "auto") else layout)
    what = f"{source} ({name} layout)"
    where = {k: f for k, f in weight_map.items() if info.match(k) is not None}
    num_modules = _module_count(info, where, what)
    shards = sorted(set(where.values()))
    if sharded:  # only the shards that hold MTP tensors
        folder = resolve_source(source, pinned, [CONFIG, INDEX, *shards])
    tensors = _read_tensors(folder, where, what)
    proj = f"layers.0.{_PROJ[name]}.weight" if name != "qwen3_next" else "fc.weight"
    published = _published_dtype({info.match(k)[1]: v for k, v in tensors.items()}, proj)
    quant = cfg.get("quantization_config") or {}
    if any(k.endswith(".weight_scale_inv") for k in tensors) or any(t.dtype in _FP8_DTYPES for t in tensors.values()):
        tensors = dequantize_fp8(tensors, quant.get("weight_block_size") or (128, 128), what)
    odd = sorted(k for k, v in tensors.items() if not v.is_floating_point())
    if odd:
        method = f" (quant_method {quant.get('quant_method')!r})" if quant else ""
        raise ConversionError(f"{what}: {odd[0]} is {tensors[odd[0]].dtype}: quantized checkpoints{method} are not "
                              "supported (only DeepSeek's block-scaled FP8); use the unquantized release.")

    state, names = {}, {}
    for key, value in tensors.items():
        k, ours = info.match(key)
        if name == "deepseek" and ours.split(".", 2)[2] in _NOT_KEPT:
            continue  # the target's embedding / LM head, stored again
        state[ours], names[ours] = value, key
    weight_dtype = dtype or published

    text = _family_text_config(info, cfg)
    try:
        config = MTPConfig(block_config=block_config_for(text, num_modules), num_modules=num_modules, layout=name,
                           vocab_size=text.vocab_size, num_target_layers=info.num_target_layers,
                           base_model_name_or_path=str(source))
    except ValueError as err:
        raise ConversionError(f"{what}: {err}") from err
    check_fits(config, _target_config(target), source)

    module = _build(config, state, names, weight_dtype, what)
    if out is not None:
        module.save_pretrained(str(out))
    return module


def _build(config, state: dict[str, torch.Tensor], names: dict[str, str], weight_dtype: torch.dtype, what: str):
    """The :class:`MTPModule` of ``config`` holding ``state`` (our names; ``names``: ours -> the checkpoint's, for
    errors), in ``weight_dtype`` except what the family keeps in fp32; eval mode."""
    from hf_specdec.modeling.mtp import MTPModule

    default = torch.get_default_dtype()
    try:  # built as from_pretrained builds: on the meta device, in the weights' dtype (fp32 where a class says so)
        torch.set_default_dtype(weight_dtype)
        with torch.device("meta"):
            module = MTPModule(config)
    except ValueError as err:
        raise ConversionError(f"{what}: {err}") from err
    finally:
        torch.set_default_dtype(default)
    keep = _fp32_patterns(config.block_text_config())
    for full_name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        if tensor.is_floating_point() and _keeps_fp32(full_name, keep):
            owner, _, attr = full_name.rpartition(".")
            holder = module.get_submodule(owner)
            if attr in holder._parameters:
                holder._parameters[attr] = torch.nn.Parameter(tensor.float(), requires_grad=tensor.requires_grad)
            else:
                holder._buffers[attr] = tensor.float()
    state = {**state, "token_map": torch.arange(config.draft_vocab_size)}
    _load_state(module, state, names, what)
    module.config.dtype = weight_dtype
    return module.eval()


# ------------------------------------------------------------------------------------------ speculators layout
def _speculators_names(module) -> dict[str, str]:
    """speculators' module prefix -> ours, for module 0 of ``module``: its four input/output parts and its block."""
    emb_norm, hid_norm, proj, block, out_norm = module.parts(0)
    ours = {id(m): n for n, m in module.named_modules()}
    return {"token_layernorm": ours[id(emb_norm)], "hidden_layernorm": ours[id(hid_norm)],
            "input_proj": ours[id(proj)], "final_layernorm": ours[id(out_norm)], "": ours[id(block)]}


def _layer_text_config(layer: dict, what: str):
    """The transformers text config of a speculators ``transformer_layer_config``."""
    from transformers import AutoConfig

    data = {k: v for k, v in layer.items() if k not in _DROPPED_CONFIG}
    try:
        return AutoConfig.for_model(data.pop("model_type"), **data).get_text_config(decoder=True)
    except (KeyError, ValueError, TypeError) as err:
        raise ConversionError(f"{what}: transformer_layer_config does not make a transformers config: {err}") from err


def _convert_speculators(source, revision, cfg: dict, target, dtype, out):
    """:func:`convert_mtp` for a speculators ``MTPDraftModel`` folder (see the module docstring)."""
    from hf_specdec.modeling.mtp import MTPConfig, MTPModule, block_config_for

    what = f"{source} ({SPECULATORS_LAYOUT} layout)"
    layer = cfg.get("transformer_layer_config")
    if cfg.get("speculators_model_type") != "mtp" or not isinstance(layer, dict):
        raise ConversionError(f"{what}: not a speculators MTP config (speculators_model_type 'mtp' with a "
                              "transformer_layer_config).")
    if cfg.get("num_nextn_predict_layers", 1) != 1:
        raise ConversionError(f"{what}: num_nextn_predict_layers={cfg['num_nextn_predict_layers']}; speculators' MTP "
                              "format holds one module.")
    text = _layer_text_config(layer, what)
    name = "qwen3_next" if text.model_type in _QWEN3_NEXT_TYPES else "deepseek"
    verifier = ((cfg.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    try:
        config = MTPConfig(block_config=block_config_for(text, 1), num_modules=1, layout=name,
                           vocab_size=text.vocab_size, num_target_layers=text.num_hidden_layers,
                           base_model_name_or_path=verifier or str(source))
    except ValueError as err:
        raise ConversionError(f"{what}: {err}") from err
    check_fits(config, _target_config(target), source)
    folder = resolve_source(source, revision, [CONFIG, SINGLE, INDEX, "model-*.safetensors"])
    tensors = load_weights(folder)
    with torch.device("meta"):
        mapping = _speculators_names(MTPModule(config))
    state, names, unknown = {}, {}, []
    for key, value in tensors.items():
        if key in ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight"):
            continue  # the verifier's, filled in at load time
        if not key.startswith(_SPECULATORS_PREFIX):
            unknown.append(key)
            continue
        rest = key[len(_SPECULATORS_PREFIX):]
        part, _, tail = rest.partition(".")
        ours = f"{mapping[part]}.{tail}" if part in mapping else f"{mapping['']}.{rest}"
        state[ours], names[ours] = value, key
    if unknown:
        raise ConversionError(f"{what}: unexpected tensors {sorted(unknown)[:6]} (expected {_SPECULATORS_PREFIX}*).")
    floats = [v.dtype for v in state.values() if v.is_floating_point()]
    module = _build(config, state, names, dtype or (floats[0] if floats else torch.float32), what)
    if out is not None:
        module.save_pretrained(str(out))
    return module


def export_mtp(drafter_or_path, out, verifier=None, speculative_tokens: int | None = None,
               dtype: torch.dtype | None = None) -> Exported:
    """Write an MTP module in speculators' MTP layout (``MTPDraftModel``; ``vllm serve <out>`` where vLLM's
    speculators reader knows ``mtp``).

    ``config.json``: ``architectures: ["MTPDraftModel"]``, ``transformer_layer_config`` = the block's family config
    with ``num_hidden_layers`` = the target's layer count (speculators reads the target's last hidden state as
    layer ``num_hidden_layers``), ``num_nextn_predict_layers: 1`` and the ``speculators_config`` block
    (``speculative_tokens``: the chain's length, default :data:`DEFAULT_SPECULATIVE_TOKENS`).
    ``model.safetensors``: ``mtp_layers.0.{token_layernorm, hidden_layernorm, input_proj, final_layernorm}`` (our
    embedding norm, hidden norm, projection -- embedding first -- and output norm) and the block's own keys under
    ``mtp_layers.0.``; no embedding or LM head (the target's).

    What the format cannot hold is refused, naming why: parallel heads (no engine serves them), more than one module,
    a draft vocabulary (speculators' MTP scores the whole vocabulary), a block family speculators has no MTP layer for
    (:data:`SPECULATORS_MTP_TYPES`; vLLM serves MTP for DeepSeek-V3, GLM-4.x, Qwen3-Next, Qwen3.5 and MiMo from the
    target checkpoint's own MTP layers, ``--speculative-config '{"method": "mtp"}'``, and has no separate-drafter
    format for other families), MiMo's hidden-first projection, and chaining on the pre-norm block output
    (``chain_hidden="block"``; speculators chains the normed output).
    """
    from hf_specdec.modeling.mtp import MTPModule, ParallelMTPHeads

    module = drafter_to_export(drafter_or_path, (MTPModule, ParallelMTPHeads), convert_mtp)
    if isinstance(module, ParallelMTPHeads):
        raise ConversionError("Parallel MTP heads (Gloeckle et al.) have no serving layout: speculators and vLLM serve "
                              "sequential MTP modules only.")
    c = module.config
    family = c.block_config.get("model_type")
    problems = []
    if c.num_modules != 1:
        problems.append(f"it has {c.num_modules} modules; speculators' MTP format holds one")
    if family not in SPECULATORS_MTP_TYPES:
        problems.append(f"its blocks are {family!r}; speculators' MTPDraftModel builds "
                        f"{', '.join(SPECULATORS_MTP_TYPES)} blocks only (vLLM serves MTP for DeepSeek-V3, GLM-4.x, "
                        "Qwen3-Next, Qwen3.5 and MiMo from the target checkpoint's own MTP layers, "
                        "--speculative-config '{\"method\": \"mtp\"}', and has no separate-drafter format for other "
                        "families)")
    if c.draft_vocab_size != c.vocab_size:
        problems.append(f"it scores {c.draft_vocab_size} of the {c.vocab_size} tokens; speculators' MTP scores the "
                        "whole vocabulary with the target's LM head")
    elif not torch.equal(module.token_map.cpu(), torch.arange(c.vocab_size)):
        problems.append("its token_map reorders the vocabulary")
    if c.layout == "mimo":
        problems.append("its projection reads the hidden state first (MiMo); speculators' reads the embedding first")
    if c.chain_hidden != "normed":
        problems.append(f"it chains on {c.chain_hidden!r}; speculators chains the normed output")
    if problems:
        raise ConversionError("This MTP module cannot be exported to a serving layout: " + "; ".join(problems) + ".")
    target = resolve_verifier(verifier, c.base_model_name_or_path, c)
    n = c.num_target_layers or target.num_hidden_layers
    if n is None:
        raise ConversionError("The module records no target layer count and the verifier's config is unknown.")
    layer = {k: v for k, v in c.block_config.items()
             if k not in _DROPPED_CONFIG + ("_model_name_or_path", "dtype", "torch_dtype")}
    layer["num_hidden_layers"] = n
    if layer.get("layer_types") is not None:
        layer["layer_types"] = (list(layer["layer_types"]) * n)[:n]
    k = DEFAULT_SPECULATIVE_TOKENS if speculative_tokens is None else speculative_tokens
    config = {"architectures": ["MTPDraftModel"], **speculators_fields("mtp", k, target),
              "transformer_layer_config": layer, "num_nextn_predict_layers": 1}
    mapping = _speculators_names(module)
    theirs = {ours: part for part, ours in mapping.items() if part}
    block = mapping[""]
    tensors = {}
    for key, value in module.state_dict().items():
        if key == "token_map":
            continue
        owner = next((p for p in theirs if key.startswith(p + ".")), None)
        if owner is not None:
            tensors[f"{_SPECULATORS_PREFIX}{theirs[owner]}.{key[len(owner) + 1:]}"] = value
        elif key.startswith(block + "."):
            tensors[_SPECULATORS_PREFIX + key[len(block) + 1:]] = value
        else:
            raise ConversionError(f"{key} belongs to no part of the MTP module.")
    return write_export(out, config, tensors, dtype, f"vllm serve {out}   # or: "
                        + vllm_serve_command(out, target, "mtp", k))
