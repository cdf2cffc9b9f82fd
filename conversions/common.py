"""Shared pieces of the converters: fetch only the needed files, read weights safely, check shapes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

WEIGHT_PATTERNS = ["*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json"]


class ConversionError(ValueError):
    pass


def resolve_source(source: str | os.PathLike, revision: str | None = None, allow_patterns: list[str] | None = None
                   ) -> Path:
    """A local folder as is, or a Hub repo id downloaded (only ``allow_patterns``) with huggingface_hub.

    Offline (``HF_HUB_OFFLINE=1``, or no network) a repo already in the local Hub cache is used.
    """
    path = Path(source)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    patterns = allow_patterns or (["config.json", "*.json"] + WEIGHT_PATTERNS)
    try:
        return Path(snapshot_download(str(source), revision=revision, allow_patterns=patterns))
    except Exception as err:  # huggingface_hub raises several types (offline, not found, gated)
        raise ConversionError(f"Could not fetch {source!r} (revision {revision or 'main'}) from the Hub or the local "
                              f"cache: {err}") from err


def read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise ConversionError(f"{folder} has no config.json.")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConversionError(f"{path} is not valid JSON: {err}") from err


def load_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint: safetensors files, else ``pytorch_model*.bin`` read with
    ``torch.load(weights_only=True)`` (no code from a downloaded file is ever executed)."""
    tensors: dict[str, torch.Tensor] = {}
    safetensors_files = sorted(folder.glob("*.safetensors"))
    bin_files = sorted(folder.glob("pytorch_model*.bin"))
    if not safetensors_files and not bin_files:
        raise ConversionError(f"{folder} has no weights (*.safetensors or pytorch_model.bin).")
    if safetensors_files:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        for f in safetensors_files:
            try:
                tensors.update(load_file(str(f)))
            except (SafetensorError, OSError, ValueError) as err:
                raise ConversionError(f"{f.name} is corrupt or truncated: {err}") from err
    else:
        for f in bin_files:
            try:
                state = torch.load(str(f), map_location="cpu", weights_only=True)
            except Exception as err:  # pickle/zip errors of a truncated or foreign file
                raise ConversionError(f"{f.name} is corrupt, truncated or not a plain state dict "
                                      f"(loaded with weights_only=True): {err}") from err
            if not isinstance(state, dict):
                raise ConversionError(f"{f.name} does not hold a state dict.")
            tensors.update(state)
    return tensors


def check_shapes(tensors: dict[str, torch.Tensor], expected: dict[str, tuple], what: str) -> None:
    missing = [k for k in expected if k not in tensors]
    if missing:
        raise ConversionError(f"{what}: the checkpoint lacks {', '.join(sorted(missing))}.")
    wrong = [f"{k} {tuple(tensors[k].shape)} (config says {tuple(v)})" for k, v in expected.items()
             if tuple(tensors[k].shape) != tuple(v)]
    if wrong:
        raise ConversionError(f"{what}: tensor shapes do not match the config: " + "; ".join(wrong))


def load_target_config(target: str | os.PathLike | None, revision: str | None = None):
    """The target's config (a path or Hub id; only config.json is fetched), or ``None``."""
    if target is None:
        return None
    from transformers import AutoConfig

    folder = resolve_source(target, revision=None, allow_patterns=["config.json"]) if not Path(
        target).is_dir() else Path(target)
    return AutoConfig.from_pretrained(str(folder))


def load_converted_or_published(source: str | os.PathLike, target, model_cls, convert):
    """A drafter of ``model_cls`` for ``target`` from a folder or Hub repo id: a folder converted by hf_specdec
    (its ``config.json`` names ``model_cls``'s model type) loads with ``from_pretrained``; a published layout is
    converted in memory with ``convert``. On the target's device and dtype, in eval mode."""
    folder = resolve_source(source)
    if read_config(folder).get("model_type") == model_cls.config_class.model_type:
        model = model_cls.from_pretrained(str(folder), dtype=target.dtype)
    else:
        model = convert(folder, dtype=target.dtype)
    return model.to(target.device).eval()
