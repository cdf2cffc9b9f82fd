"""Published Medusa heads -> :class:`hf_specdec.modeling.medusa.MedusaHeads` (vLLM's key names + our config).

Three layouts are read as published:

* **medusa** (FasterDecoding/medusa-vicuna-{7b,13b,33b}-v1.3, Medusa-1 heads only; also the legacy trainer's output):
  ``config.json`` = ``{base_model_name_or_path, medusa_num_heads, medusa_num_layers}`` with no model type, weights
  ``medusa_lm_head.pt`` (a torch pickle) or ``medusa_lm_head.safetensors``. Keys are those of the reference's
  ``medusa_head`` ModuleList: ``{i}.{j}.linear.weight [H, H]`` / ``{i}.{j}.linear.bias [H]`` for ``j < L`` and the
  read-out ``{i}.{L}.weight [V, H]``. The uploaded configs say 2 heads for weights that hold 5 (the reference's loader
  overrides it with 5), so the head count, ``L``, ``H`` and ``V`` come from the weights.
* **vllm** (vLLM's ``Medusa`` model, e.g. abhigoyal/vllm-medusa-vicuna-7b-v1.3): ``model_type: "medusa"``, keys
  ``blocks.{i}.layers.{j}.weight/bias``, ``lm_heads.{i}.weight``, optional ``token_map``; read the way vLLM reads it:
  blocks have a bias only with ``medusa_fc_bias: true``, ``original_lm_head: true`` gives every head the one read-out
  ``lm_heads.0.weight``, ``token_map`` counts only when ``truncated_vocab_size < vocab_size``.
* **medusa2** (FasterDecoding/medusa-1.0-*, trained with the axolotl fork): a llama/mistral checkpoint whose config
  adds ``medusa_num_heads`` / ``medusa_num_layers`` and whose weights add ``medusa_head.{i}.{j}.linear.*`` and
  ``medusa_head.{i}.{L}.weight`` to the base model's keys. The heads are split off; with ``base_out`` the base model
  (trained with them, so it is their target) is written as a plain transformers folder.

:func:`export_medusa` writes heads in the vllm layout (speculators 0.9.0 has no Medusa model), which
:func:`convert_medusa` reads back.

The reference builds a head's blocks as ``[ResBlock(H)] * L``: one module applied ``L`` times, which
``load_state_dict(strict=False)`` fills from every ``{i}.{j}.linear.*`` in turn, so the last ``j`` wins. That is
reproduced (``shared_layers=True`` with the weights of the last ``j``); vLLM's blocks are separate modules.

Verified in the published code: FasterDecoding/Medusa ``medusa/model/medusa_model.py`` at e2a5d20 (``ResBlock``,
``medusa_head``, ``medusa_lm_head.pt`` read with ``load_state_dict(strict=False)``, ``medusa_num_heads = 5 # TODO: fix
the uploaded config``), ``medusa/train/train_legacy.py`` (``medusa_lm_head.safetensors``); the key list of
medusa-vicuna-13b-v1.3 quoted in InternLM/lmdeploy issue 1180 (``0.0.linear.weight``, ``0.0.linear.bias``,
``0.1.weight``, ... 5 heads); the axolotl fork's ``add_medusa_heads`` (``self.medusa_head`` on the causal LM, hence
``medusa_head.`` keys); vLLM ``vllm/model_executor/models/medusa.py`` (``blocks``/``lm_heads``, ``medusa_fc_bias``,
``original_lm_head``, ``token_map``, the ``medusa_heads.`` prefix) and ``vllm/transformers_utils/configs/medusa.py``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

import torch

from .common import (
    ConversionError,
    Exported,
    check_fits,
    check_shapes,
    check_weight_files,
    drafter_to_export,
    load_pickled_state_dict,
    load_target_config,
    read_config,
    resolve_source,
    resolve_verifier,
    vllm_serve_command,
    write_export,
)

LAYOUTS = ("medusa", "vllm", "medusa2")
# weight files in order of preference: only the first format a repo has is fetched
_HEADS_FILES = (["medusa_lm_head.safetensors"], ["medusa_lm_head.pt"])
_MODEL_FILES = (["*.safetensors", "*.safetensors.index.json"], ["pytorch_model*.bin", "pytorch_model.bin.index.json"])
_BASE_FILES = ["generation_config.json", "tokenizer*", "special_tokens_map.json"]  # copied beside a split-off base
_REFERENCE_KEY = re.compile(r"(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)")
logger = logging.getLogger("hf_specdec")


def detect_layout(config: dict, files) -> str:
    """The layout of a published checkpoint from its ``config.json`` and the names of the files beside it."""
    names = {Path(f).name for f in files}
    model_type = config.get("model_type") or None  # the legacy trainer's MedusaConfig saves model_type ""
    archs = config.get("architectures") or []
    if model_type == "hf_specdec_medusa":
        raise ConversionError("This folder is already in hf_specdec's Medusa format: load it with "
                              "MedusaHeads.from_pretrained (or pass it as drafter=).")
    if any(n.startswith("medusa_lm_head.") for n in names):
        return "medusa"
    if model_type == "medusa" or "MedusaModel" in archs:
        return "vllm"
    if "medusa_num_heads" in config:
        return "medusa2" if model_type else "medusa"
    raise ConversionError(
        f"Unknown Medusa checkpoint layout (model_type={model_type}, architectures={archs}); expected FasterDecoding's "
        "heads (medusa_lm_head.pt / .safetensors), vLLM's Medusa (model_type medusa) or a Medusa-2 model (a causal LM "
        "config with medusa_num_heads). Pass --layout to force one.")


def _fetch(source, revision: str | None, layout: str, extra: list[str], heads_only: bool = False
           ) -> tuple[Path, list[Path]]:
    """The folder with config.json and the layout's weight files, fetching only the preferred format the repo has.
    ``heads_only`` (a Medusa-2 checkpoint whose base is not wanted): when the checkpoint is sharded, only the shards
    its index names for ``medusa_head.*`` keys are fetched, not the whole base model."""
    groups = _HEADS_FILES if layout == "medusa" else _MODEL_FILES
    for patterns in groups:
        if heads_only:
            index = [p for p in patterns if p.endswith(".index.json")]
            folder = resolve_source(source, revision, ["config.json", *index])
            shards = _head_shards(folder)
            if shards:
                folder = resolve_source(source, revision, ["config.json", *index, *shards])
                return folder, [folder / name for name in shards]
        folder = resolve_source(source, revision, ["config.json", *patterns, *extra])
        files = sorted(f for p in patterns if not p.endswith(".json") for f in folder.glob(p))
        if files:
            return folder, files
    wanted = " or ".join(p for g in groups for p in g if not p.endswith(".json"))
    raise ConversionError(f"{source} has no weights for the {layout} layout ({wanted}).")


def _head_shards(folder: Path) -> list[str]:
    """The shard files a sharded checkpoint's index names for ``medusa_head.*`` keys (none without an index)."""
    for index in sorted(folder.glob("*.index.json")):
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        shards = sorted({f for k, f in weight_map.items() if k.startswith("medusa_head.")})
        if shards:
            return shards
    return []


def _read(folder: Path, files: list[Path], keep=lambda key: True) -> dict[str, torch.Tensor]:
    """The tensors whose key passes ``keep``; a cut-off safetensors file is named, pickles load with weights_only."""
    from safetensors import safe_open

    tensors = {}
    if any(f.suffix == ".safetensors" for f in files):
        check_weight_files(folder)
    for f in files:
        if f.suffix == ".safetensors":
            with safe_open(str(f), framework="pt") as handle:
                tensors.update({k: handle.get_tensor(k) for k in handle.keys() if keep(k)})
        else:
            tensors.update({k: v for k, v in load_pickled_state_dict(f).items() if keep(k)})
    return tensors


def _expected_shapes(k: int, h: int, vocab: int) -> dict[str, tuple]:
    shapes = {}
    for i in range(k):
        shapes.update({f"blocks.{i}.layers.0.weight": (h, h), f"blocks.{i}.layers.0.bias": (h,),
                       f"lm_heads.{i}.weight": (vocab, h)})
    return shapes


def _count_warning(config: dict, field: str, found: int, what: str, unit: str) -> None:
    said = config.get(field)
    if said is not None and said != found:
        logger.warning(f"hf_specdec: {what}: config.json says {field}={said}, but the weights hold {found} {unit}; "
                       f"using {found}, the count of the weights.")


def reference_heads(tensors: dict[str, torch.Tensor], config: dict, what: str) -> tuple[dict, dict]:
    """Our state dict and MedusaConfig fields from the reference's ``medusa_head`` keys (``{i}.{j}.linear.*``,
    ``{i}.{L}.weight``); counts and sizes come from the weights, the shared-block quirk is reproduced."""
    parsed = {}
    for key, value in tensors.items():
        m = _REFERENCE_KEY.fullmatch(key)
        if m is None:
            raise ConversionError(f"{what}: unexpected tensor {key} for Medusa heads.")
        parsed[int(m[1]), int(m[2]), m[3]] = value
    heads = sorted({i for i, _, _ in parsed})
    if heads != list(range(len(heads))) or not heads:
        raise ConversionError(f"{what}: the heads are numbered {heads}, expected 0..K-1.")
    readout = {i: j for i, j, name in parsed if name == "weight"}
    if set(readout) != set(heads):
        raise ConversionError(
            f"{what}: head(s) {sorted(set(heads) - set(readout))} have no read-out ({{i}}.{{L}}.weight). Heads that "
            "read out through the target's LM head (the Medusa legacy trainer since commit 2b8020f, TGI's Medusa v2) "
            "are not supported: hf_specdec's heads carry their own read-out.")
    if len(set(readout.values())) != 1:
        raise ConversionError(f"{what}: the heads have different numbers of blocks ({readout}).")
    n_layers = next(iter(readout.values()))  # the read-out follows the L blocks in the reference's Sequential
    vocab, hidden = parsed[0, n_layers, "weight"].shape
    _count_warning(config, "medusa_num_heads", len(heads), what, "heads")
    _count_warning(config, "medusa_num_layers", n_layers, what, "blocks per head")
    state, differ = {}, []
    for i in heads:
        present = sorted(j for h, j, name in parsed if h == i and name == "linear.weight")
        if any(j >= n_layers for j in present) or (n_layers and not present):
            raise ConversionError(f"{what}: head {i} has blocks {present}, expected some of 0..{n_layers - 1}.")
        if any((i, j, "linear.bias") not in parsed for j in present):
            raise ConversionError(f"{what}: head {i} lacks a block bias ({i}.j.linear.bias): the reference's blocks "
                                  "have one.")
        if n_layers == 0:  # a zero block is the identity (silu(0) = 0)
            weight, bias = torch.zeros(hidden, hidden), torch.zeros(hidden)
        else:  # one module in the reference: the last j loaded is the one applied L times
            weight, bias = parsed[i, present[-1], "linear.weight"], parsed[i, present[-1], "linear.bias"]
            differ += [i for j in present[:-1] if not (torch.equal(parsed[i, j, "linear.weight"], weight)
                                                       and torch.equal(parsed[i, j, "linear.bias"], bias))]
        state.update({f"blocks.{i}.layers.0.weight": weight, f"blocks.{i}.layers.0.bias": bias,
                      f"lm_heads.{i}.weight": parsed[i, n_layers, "weight"]})
    if differ:
        logger.warning(f"hf_specdec: {what}: the {n_layers} block copies of head(s) {sorted(set(differ))} differ; "
                       f"the reference applies one block {n_layers} times, loaded from the last copy, and so does "
                       "this conversion.")
    check_shapes(state, _expected_shapes(len(heads), hidden, vocab), what)
    state["token_map"] = torch.arange(vocab)
    fields = dict(hidden_size=hidden, vocab_size=vocab, medusa_num_heads=len(heads),
                  medusa_num_layers=max(n_layers, 1), shared_layers=n_layers > 1)
    return state, fields


def _vllm_count(config: dict, word: str):
    """vLLM's MedusaConfig renames every key with "num" and ``word`` (num_heads, medusa_num_heads, ...); last wins."""
    value = None
    for key, v in config.items():
        if "num" in key and word in key and not (word == "heads" and key == "num_attention_heads"):
            value = v
    return value


def vllm_heads(tensors: dict[str, torch.Tensor], config: dict, what: str) -> tuple[dict, dict]:
    """Our state dict and MedusaConfig fields from vLLM's Medusa keys, read the way vLLM reads them."""
    tensors = {k[len("medusa_heads."):] if k.startswith("medusa_heads.") else k: v for k, v in tensors.items()}
    if config.get("logit_scale", 1.0) != 1.0:
        raise ConversionError(f"{what}: logit_scale={config['logit_scale']} is not supported by hf_specdec's heads.")
    stored = sorted({int(k.split(".")[1]) for k in tensors if k.startswith("blocks.")})
    n_heads = _vllm_count(config, "heads") or len(stored)
    n_layers = _vllm_count(config, "layers") or len({k.split(".")[3] for k in tensors if k.startswith("blocks.0.")})
    if len(stored) > n_heads:
        logger.warning(f"hf_specdec: {what}: the weights hold {len(stored)} heads, config.json asks for {n_heads}; "
                       "the others are ignored, as vLLM does.")
    with_bias = bool(config.get("medusa_fc_bias", False))
    one_readout = bool(config.get("original_lm_head", False))
    state, ignored = {}, 0
    for i in range(n_heads):
        for j in range(n_layers):
            key = f"blocks.{i}.layers.{j}."
            if key + "weight" not in tensors or (with_bias and key + "bias" not in tensors):
                raise ConversionError(f"{what}: the checkpoint lacks {key}weight or {key}bias (config: {n_heads} "
                                      f"heads of {n_layers} blocks, medusa_fc_bias={with_bias}).")
            weight = tensors[key + "weight"]
            state[f"blocks.{i}.layers.{j}.weight"] = weight
            # without medusa_fc_bias vLLM builds the blocks without bias and skips any stored one
            state[f"blocks.{i}.layers.{j}.bias"] = tensors[key + "bias"] if with_bias else torch.zeros(
                weight.shape[0], dtype=weight.dtype)
            if not with_bias and key + "bias" in tensors:
                ignored += 1
        readout = "lm_heads.0.weight" if one_readout else f"lm_heads.{i}.weight"
        if one_readout and readout not in tensors:
            readout = "lm_head.weight"
        if readout not in tensors:
            raise ConversionError(f"{what}: the checkpoint lacks the read-out {readout}.")
        # one read-out shared by vLLM is stored once per head here (a copy: saved tensors must not share memory)
        state[f"lm_heads.{i}.weight"] = tensors[readout].clone() if one_readout and i else tensors[readout]
    if ignored:
        logger.warning(f"hf_specdec: {what}: config.json does not set medusa_fc_bias, so vLLM builds the blocks "
                       f"without bias and ignores the {ignored} bias tensors stored; so does this conversion (set "
                       "\"medusa_fc_bias\": true to use them).")
    hidden = config.get("hidden_size") or state["lm_heads.0.weight"].shape[1]
    vocab = config.get("vocab_size") or state["lm_heads.0.weight"].shape[0]
    draft_vocab = config.get("truncated_vocab_size") or vocab
    token_map = torch.arange(vocab)
    if draft_vocab < vocab:  # vLLM reads token_map only with a truncated vocabulary
        if tuple(tensors.get("token_map", torch.empty(0)).shape) != (draft_vocab,):
            raise ConversionError(f"{what}: truncated_vocab_size={draft_vocab} needs a token_map of {draft_vocab} "
                                  "target ids, which is missing or of another size.")
        token_map = tensors["token_map"].long()
        if token_map.min() < 0 or token_map.max() >= vocab:
            raise ConversionError(f"{what}: token_map holds ids outside the vocabulary of {vocab}.")
        for i in range(n_heads):  # vLLM keeps the token_map rows of a full-vocabulary read-out
            if state[f"lm_heads.{i}.weight"].shape[0] == vocab:
                state[f"lm_heads.{i}.weight"] = state[f"lm_heads.{i}.weight"][token_map]
    known = ("blocks.", "lm_heads.", "lm_head.weight", "token_map")
    unknown = sorted(k for k in tensors if not k.startswith(known))
    if unknown:
        raise ConversionError(f"{what}: unexpected tensors {unknown[:8]} for vLLM's Medusa heads.")
    expected = {f"blocks.{i}.layers.{j}.{p}": (hidden, hidden) if p == "weight" else (hidden,)
                for i in range(n_heads) for j in range(n_layers) for p in ("weight", "bias")}
    expected.update({f"lm_heads.{i}.weight": (draft_vocab, hidden) for i in range(n_heads)})
    check_shapes(state, expected, what)
    state["token_map"] = token_map
    fields = dict(hidden_size=hidden, vocab_size=vocab, medusa_num_heads=n_heads, medusa_num_layers=n_layers,
                  shared_layers=False, draft_vocab_size=draft_vocab)
    return state, fields


def save_base(config: dict, tensors: dict[str, torch.Tensor], folder: Path, out, dtype: torch.dtype | None) -> None:
    """Write a Medusa-2 checkpoint's base model as a plain transformers folder: its config without the ``medusa_*``
    fields, its weights without the heads (safetensors shards), and its tokenizer and generation config."""
    from huggingface_hub import save_torch_state_dict

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    base = {k: v for k, v in tensors.items()
            if not k.startswith("medusa_head.") and not k.endswith("rotary_emb.inv_freq")}  # inv_freq is recomputed
    fields = {k: v for k, v in config.items() if not k.startswith("medusa_")}
    if dtype is not None:
        base = {k: v.to(dtype) if v.is_floating_point() else v for k, v in base.items()}
        fields["torch_dtype" if "torch_dtype" in fields else "dtype"] = str(dtype).removeprefix("torch.")
    save_torch_state_dict(base, out)  # shards + index; tied (shared) tensors are stored once
    (out / "config.json").write_text(json.dumps(fields, indent=2) + "\n")
    for pattern in _BASE_FILES:
        for f in folder.glob(pattern):
            if f.name != "config.json" and not (out / f.name).exists():
                shutil.copyfile(f, out / f.name)


def convert_medusa(source: str | os.PathLike, out: str | os.PathLike | None = None, revision: str | None = None,
                   target: str | os.PathLike | None = None, layout: str | None = None,
                   dtype: torch.dtype | None = None, base_out: str | os.PathLike | None = None):
    """Convert published Medusa heads (Hub repo id or folder) to hf_specdec's format; returns the ``MedusaHeads``.

    Only ``config.json`` and the layout's weights are fetched (one format: safetensors when the repo has them),
    at ``revision``. With ``target`` (path or repo id) the heads are checked against the target's config (hidden size
    and vocabulary). With ``out`` they are also saved there (config + safetensors, in ``dtype``, default the published
    dtype). For a Medusa-2 checkpoint, ``base_out`` also receives its base model as a plain transformers folder.
    """
    from hf_specdec.modeling.medusa import MedusaConfig, MedusaHeads

    folder = resolve_source(source, revision, ["config.json"])
    cfg = read_config(folder)
    if layout in (None, "auto"):
        layout = detect_layout(cfg, [p.name for p in folder.iterdir()])
    elif layout not in LAYOUTS:
        raise ConversionError(f"Unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}.")
    if base_out is not None and layout != "medusa2":
        raise ConversionError(f"base_out is for Medusa-2 checkpoints (base model + heads); {source} holds heads only.")
    what = f"{source} ({layout} layout)"
    folder, files = _fetch(source, revision, layout, _BASE_FILES if base_out is not None else [],
                           heads_only=layout == "medusa2" and base_out is None)
    if layout == "medusa2":
        keep = (lambda k: True) if base_out is not None else (lambda k: k.startswith("medusa_head."))
        tensors = _read(folder, files, keep)
        heads = {k[len("medusa_head."):]: v for k, v in tensors.items() if k.startswith("medusa_head.")}
        if not heads:
            raise ConversionError(f"{what}: the checkpoint has no medusa_head.* tensors.")
        state, fields = reference_heads(heads, cfg, what)
        for field in ("hidden_size", "vocab_size"):
            if cfg.get(field) not in (None, fields[field]):
                raise ConversionError(f"{what}: config.json says {field}={cfg[field]}, but the heads were made with "
                                      f"{field}={fields[field]}.")
        fields["base_model_name_or_path"] = str(base_out or source)
    elif layout == "medusa":
        state, fields = reference_heads(_read(folder, files), cfg, what)
        fields["base_model_name_or_path"] = cfg.get("base_model_name_or_path")
    else:
        state, fields = vllm_heads(_read(folder, files), cfg, what)
        fields["base_model_name_or_path"] = cfg.get("base_model_name_or_path")
    try:
        config = MedusaConfig(**fields)
    except ValueError as err:
        raise ConversionError(f"{what}: {err}") from err
    check_fits(config, load_target_config(target), source)

    weight_dtype = dtype or state["lm_heads.0.weight"].dtype
    state = {k: (v.to(weight_dtype) if v.is_floating_point() else v) for k, v in state.items()}
    with torch.device("meta"):  # no memory for weights that are replaced at once
        heads = MedusaHeads(config)
    try:
        heads.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as err:
        raise ConversionError(f"{what}: the weights do not fit the heads: {err}") from err
    heads = heads.eval()
    if out is not None:
        heads.save_pretrained(str(out))
    if base_out is not None:
        save_base(cfg, tensors, folder, base_out, dtype)
    return heads


# ------------------------------------------------------------------------------------------------------ export
def export_medusa(drafter_or_path, out, verifier=None, speculative_tokens: int | None = None,
                  dtype: torch.dtype | None = None) -> Exported:
    """Write Medusa heads in vLLM's Medusa layout (``--speculative-config '{"method": "medusa", "model": <out>}'``).

    ``config.json`` holds vLLM's ``MedusaConfig`` fields: ``model_type: "medusa"``, ``architectures:
    ["MedusaModel"]``, ``hidden_size``, ``vocab_size``, ``num_heads``, ``num_hidden_layers`` (blocks per head),
    ``truncated_vocab_size`` (the draft vocabulary), ``medusa_fc_bias: true`` (our blocks have biases),
    ``original_lm_head: false``, ``base_model_name_or_path`` (the verifier). ``model.safetensors`` holds
    ``blocks.{i}.layers.{j}.weight/bias``, ``lm_heads.{i}.weight`` and, with a draft vocabulary, ``token_map``
    (vLLM reads it only then). A head whose blocks are one module applied ``L`` times (``shared_layers``, the
    reference's quirk) is written as ``L`` copies of it: the same network, which reads back with ``shared_layers``
    off. ``speculative_tokens`` (default: every head) is at most the number of heads.

    Args: as :func:`hf_specdec.conversions.eagle3.export_eagle3` (``drafter_or_path``: ``MedusaHeads``, a folder or
    Hub id in hf_specdec's format, or a layout :func:`convert_medusa` reads).
    """
    from hf_specdec.modeling.medusa import MedusaHeads

    heads = drafter_to_export(drafter_or_path, MedusaHeads, convert_medusa)
    c = heads.config
    if c.hidden_act != "silu":
        raise ConversionError(f"vLLM's Medusa blocks use SiLU; these heads use {c.hidden_act}.")
    target = resolve_verifier(verifier, c.base_model_name_or_path, c)
    k = c.medusa_num_heads if speculative_tokens is None else speculative_tokens
    if not isinstance(k, int) or not 1 <= k <= c.medusa_num_heads:
        raise ConversionError(f"speculative_tokens must be 1..{c.medusa_num_heads} (one draft per head), got {k!r}.")
    state = heads.state_dict()
    tensors = {}
    for i in range(c.medusa_num_heads):
        for j in range(c.medusa_num_layers):
            stored = j if not c.shared_layers else 0
            for part in ("weight", "bias"):
                tensors[f"blocks.{i}.layers.{j}.{part}"] = state[f"blocks.{i}.layers.{stored}.{part}"]
        tensors[f"lm_heads.{i}.weight"] = state[f"lm_heads.{i}.weight"]
    if c.draft_vocab_size < c.vocab_size:
        tensors["token_map"] = state["token_map"]
    elif not torch.equal(state["token_map"].cpu(), torch.arange(c.vocab_size)):
        raise ConversionError("token_map reorders the whole vocabulary; vLLM reads a token_map only for a truncated "
                              "vocabulary (truncated_vocab_size < vocab_size).")
    # vLLM renames every key holding "num" and "heads" / "layers" to num_heads / num_hidden_layers: write no others
    config = {
        "model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": c.hidden_size,
        "vocab_size": c.vocab_size, "num_heads": c.medusa_num_heads, "num_hidden_layers": c.medusa_num_layers,
        "truncated_vocab_size": c.draft_vocab_size, "medusa_fc_bias": True, "original_lm_head": False,
        "max_paths": 64, "topk": 10, "base_model_name_or_path": target.name_or_path,
    }
    return write_export(out, config, tensors, dtype, vllm_serve_command(out, target, "medusa", k))
