"""Shared pieces of the converters: fetch only the needed files, read weights safely, check shapes; and of the
exporters: the speculators config block, the verifier it names, the safetensors folder."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

WEIGHT_PATTERNS = ["*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json"]


class ConversionError(ValueError):
    pass


def could_be_repo_id(text: str) -> bool:
    """Whether ``text`` (a path that does not exist) can be a Hub repo id: ``org/name``, not ``/abs/path``, ``./x``,
    ``~/x`` or ``a/b/c``."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return "\\" not in text and not text.startswith((".", "~"))


def resolve_source(source: str | os.PathLike, revision: str | None = None, allow_patterns: list[str] | None = None
                   ) -> Path:
    """A local folder as is, or a Hub repo id downloaded (only ``allow_patterns``) with huggingface_hub.

    Offline (``HF_HUB_OFFLINE=1``, or no network) a repo already in the local Hub cache is used. A path that does
    not exist and cannot be a Hub repo id (``/abs/path``, ``./x``, ``a/b/c``) is reported as a missing path.
    """
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    text = os.fspath(source)
    if path.exists():
        raise ConversionError(f"{text} is a file; give the folder that holds config.json and the weights.")
    from huggingface_hub import snapshot_download

    if not could_be_repo_id(text):
        raise FileNotFoundError(f"{text} does not exist (looked from {os.getcwd()}), and it cannot be a Hub repo id.")
    patterns = allow_patterns or (["config.json", "*.json"] + WEIGHT_PATTERNS)
    try:
        return Path(snapshot_download(text, revision=revision, allow_patterns=patterns))
    except Exception as err:  # huggingface_hub raises several types (offline, not found, gated)
        raise ConversionError(f"{text!r} is not a local folder (looked from {os.getcwd()}), and as a Hub repo id "
                              f"(revision {revision or 'main'}) it could not be fetched from the Hub or found in the "
                              f"local cache: {err}") from err


def read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise ConversionError(f"{folder} has no config.json.")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConversionError(f"{path} is not valid JSON: {err}") from err


def check_weight_files(folder: Path) -> None:
    """Raise a clear error for a ``*.safetensors`` file in ``folder`` that is cut short or corrupt (its header does not
    describe the file: an interrupted download or copy), naming the file. Reads headers only."""
    for f in sorted(Path(folder).glob("*.safetensors")):
        check_weight_file(f)


def check_weight_file(path: Path) -> None:
    """:func:`check_weight_files` for one ``*.safetensors`` file."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            handle.keys()
    except (SafetensorError, OSError, ValueError) as err:
        raise ConversionError(
            f"{path} is incomplete or corrupt ({path.stat().st_size:,} bytes; safetensors says: {err}). It was "
            "probably cut off while downloading or copying: download it again (for a Hub repo, "
            "`huggingface-cli download <repo> --force-download`, or delete it from the Hub cache).") from err


def weight_shapes(folder: Path) -> dict[str, tuple]:
    """``{key: shape}`` of every tensor in the folder's safetensors files, from their headers (nothing is loaded)."""
    from safetensors import safe_open

    shapes = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as handle:
            for key in handle.keys():
                shapes[key] = tuple(handle.get_slice(key).get_shape())
    return shapes


# config fields a shape can come from, most telling first
_SHAPE_FIELDS = ("hidden_size", "target_hidden_size", "intermediate_size", "vocab_size", "draft_vocab_size",
                 "head_dim", "num_attention_heads", "num_key_value_heads", "n_embd", "n_inner", "n_head")


def check_config_matches_weights(folder: Path, config, build) -> None:
    """Refuse a folder whose ``config.json`` disagrees with its weights, naming the config field and both values.

    ``build(config)`` makes the model the config describes; it is built on the meta device (no memory) and its
    parameter shapes are compared with the safetensors headers. transformers would report the same as a "mismatched
    sizes" load report and suggest ``ignore_mismatched_sizes``, which would silently drop those weights.
    """
    shapes = weight_shapes(folder)
    if not shapes:
        return
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in build(config).state_dict().items()}
    wrong = [(k, shapes[k], expected[k]) for k in sorted(shapes) if k in expected and shapes[k] != expected[k]]
    if not wrong:
        return
    key, got, want = wrong[0]
    field = _field_behind(config, wrong)
    more = f"; {len(wrong) - 1} more tensor(s) differ" if len(wrong) > 1 else ""
    said = (f"config.json says {field[0]}={field[1]}, but the weights were made with {field[0]}={field[2]}"
            if field else "config.json and the weights disagree")
    raise ConversionError(
        f"{folder}: {said} ({key} is {list(got)} in the weights, the config expects {list(want)}{more}). The config "
        "and the weights come from different models: fix config.json, or download both again. (Do not pass "
        "ignore_mismatched_sizes: it would drop these weights and draft with random ones.)")


def _field_behind(config, wrong) -> tuple[str, int, int] | None:
    """``(field, config value, value the weights imply)`` that best explains the mismatched shapes, or ``None``."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    fields = [(name, getattr(text, name)) for name in _SHAPE_FIELDS
              if isinstance(getattr(text, name, None), int) and getattr(text, name) > 1]
    votes: dict[tuple[str, int, int], float] = {}
    for _, got, want in wrong:
        if len(got) != len(want):
            continue
        for g, w in zip(got, want):
            if g == w:
                continue
            for rank, (name, value) in enumerate(fields):
                if w == value:
                    implied, weight = g, 2.0
                elif w % value == 0 and (g * value) % w == 0:
                    implied, weight = g * value // w, 1.0
                else:
                    continue
                vote = (name, value, implied)
                votes[vote] = votes.get(vote, 0.0) + weight - rank * 1e-3
    return max(votes, key=votes.get) if votes else None


def load_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint: safetensors files, else ``pytorch_model*.bin`` read with
    ``torch.load(weights_only=True)`` (no code from a downloaded file is ever executed)."""
    tensors: dict[str, torch.Tensor] = {}
    safetensors_files = sorted(folder.glob("*.safetensors"))
    bin_files = sorted(folder.glob("pytorch_model*.bin"))
    if not safetensors_files and not bin_files:
        raise ConversionError(f"{folder} has no weights (*.safetensors or pytorch_model.bin).")
    if safetensors_files:
        from safetensors.torch import load_file

        check_weight_files(folder)
        for f in safetensors_files:
            tensors.update(load_file(str(f)))
    else:
        for f in bin_files:
            tensors.update(load_pickled_state_dict(f))
    return tensors


def load_pickled_state_dict(f: Path) -> dict[str, torch.Tensor]:
    """A ``torch.save``-d state dict read with ``torch.load(weights_only=True)`` (a pickle that would run code or
    build other objects is refused, nothing in it is executed); every value must be a tensor."""
    try:
        state = torch.load(str(f), map_location="cpu", weights_only=True)
    except Exception as err:  # pickle/zip errors of a truncated or foreign file
        raise ConversionError(f"{f} is incomplete, corrupt or not a plain state dict (loaded with "
                              f"weights_only=True): {err}. If it was cut off while downloading or copying, "
                              "download it again.") from err
    if not isinstance(state, dict):
        raise ConversionError(f"{f.name} does not hold a state dict.")
    odd = sorted(f"{k} ({type(v).__name__})" for k, v in state.items() if not isinstance(v, torch.Tensor))
    if odd:
        raise ConversionError(f"{f.name} is not a plain state dict of tensors: {', '.join(odd[:4])}.")
    return state


def check_shapes(tensors: dict[str, torch.Tensor], expected: dict[str, tuple], what: str) -> None:
    missing = [k for k in expected if k not in tensors]
    if missing:
        raise ConversionError(f"{what}: the checkpoint lacks {', '.join(sorted(missing))}.")
    wrong = [f"{k} {tuple(tensors[k].shape)} (config says {tuple(v)})" for k, v in expected.items()
             if tuple(tensors[k].shape) != tuple(v)]
    if wrong:
        raise ConversionError(f"{what}: tensor shapes do not match the config: " + "; ".join(wrong))


def check_fits(config, target_config, source) -> None:
    """``config`` (a drafter config with ``check_target``) must fit ``target_config`` (``None``: not known)."""
    if target_config is not None:
        try:
            config.check_target(target_config)
        except ValueError as err:
            raise ConversionError(f"{source}: {err}") from err


def load_target_config(target, revision: str | None = None):
    """The target's config (a path or Hub id: only config.json is fetched; a loaded model: its config; a config as
    it is), or ``None``."""
    if target is None:
        return None
    if not isinstance(target, (str, os.PathLike)):
        return getattr(target, "config", target)
    from transformers import AutoConfig

    folder = resolve_source(target, revision=None, allow_patterns=["config.json"]) if not Path(
        target).is_dir() else Path(target)
    return AutoConfig.from_pretrained(str(folder))


def load_converted_or_published(source: str | os.PathLike, target, model_cls, convert):
    """A drafter of ``model_cls`` for ``target`` from a folder or Hub repo id: a folder converted by hf_specdec
    (its ``config.json`` names ``model_cls``'s model type) loads with ``from_pretrained``; a published layout is
    converted in memory with ``convert``, which fetches only the files its layout needs. On the target's drafter
    device (:func:`hf_specdec.placement.drafter_device`) and dtype, in eval mode."""
    from hf_specdec.placement import drafter_device

    folder = resolve_source(source, allow_patterns=["config.json"])
    if read_config(folder).get("model_type") == model_cls.config_class.model_type:
        folder = resolve_source(source)
        check_weight_files(folder)
        check_config_matches_weights(folder, model_cls.config_class.from_pretrained(str(folder)), model_cls)
        model = model_cls.from_pretrained(str(folder), dtype=target.dtype)
    else:
        model = convert(source, dtype=target.dtype)
    return model.to(drafter_device(target)).eval()


# ------------------------------------------------------------------------------------------------- export
# Writing our drafters in the layouts serving engines load: the speculators format (``speculators_model_type``,
# ``speculators_config``, ``transformer_layer_config``; what ``vllm serve <folder>`` reads) and vLLM's own layouts.
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose config schema the exports follow
SPECULATORS_INSTALL = ("pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0 openai sniffio datasets "
                       "multiprocess pandas pyarrow pydantic pydantic-settings loguru dill xxhash aiohttp")
# the architectures of the embedded default target, whose config cannot be read offline (it ships as a GGUF file)
_DEFAULT_TARGET_ARCHITECTURES = ["LlamaForCausalLM"]


@dataclass(frozen=True)
class Verifier:
    """The target an export is for: ``name_or_path`` and ``architectures`` as the speculators config records them,
    and its ``config.json`` (``None`` when it could not be read: offline and not in the local Hub cache)."""

    name_or_path: str
    architectures: list[str]
    config: dict | None = None

    @property
    def text_config(self) -> dict | None:
        """The language model's fields (a multimodal config's ``text_config``)."""
        if self.config is None:
            return None
        text = self.config.get("text_config")
        return text if isinstance(text, dict) else self.config

    @property
    def num_hidden_layers(self) -> int | None:
        return (self.text_config or {}).get("num_hidden_layers")

    def transformers_config(self):
        """The target's transformers config (for a drafter's fit check), or ``None``."""
        if self.config is None:
            return None
        from transformers import AutoConfig

        data = {k: v for k, v in self.config.items() if k not in ("auto_map", "quantization_config")}
        try:
            return AutoConfig.for_model(data.pop("model_type"), **data)
        except (KeyError, ValueError, TypeError):  # a remote-code model type: no fit check
            return None


def resolve_verifier(verifier, recorded: str | None, drafter_config=None) -> Verifier:
    """The :class:`Verifier` of ``verifier`` (a Hub id, a local folder, a transformers config or model; ``None``:
    ``recorded``, the target the drafter says it was made for). A local folder is recorded by its absolute path.
    With ``drafter_config`` (one with ``check_target``), a verifier whose config is known must fit the drafter."""
    target = _resolve_verifier(verifier, recorded)
    fit = target.transformers_config() if drafter_config is not None else None
    if fit is not None:
        try:
            drafter_config.check_target(fit)
        except ValueError as err:
            raise ConversionError(f"verifier {target.name_or_path}: {err}") from err
    return target


def _resolve_verifier(verifier, recorded: str | None) -> Verifier:
    given = recorded if verifier is None else verifier
    if given is None:
        raise ConversionError("The drafter does not record the target it was made for: pass verifier= (the target's "
                              "Hub id or folder; --verifier on the command line).")
    config = getattr(given, "config", given)  # a model -> its config
    if hasattr(config, "to_dict"):
        data = config.to_dict()
        name = getattr(config, "name_or_path", None) or data.get("_name_or_path")
        if not name:
            raise ConversionError("The verifier config names no model (_name_or_path is empty): pass the target's "
                                  "Hub id or folder instead.")
        return Verifier(str(name), list(data.get("architectures") or []), data)
    text = os.fspath(given)
    local = Path(text).expanduser()
    name = str(local.resolve()) if local.is_dir() else text
    try:
        data = read_config(local if local.is_dir() else resolve_source(text, allow_patterns=["config.json"]))
    except (ConversionError, FileNotFoundError):
        data = None
    if data is not None:
        return Verifier(name, list(data.get("architectures") or []), data)
    from hf_specdec.default_model import MODEL_ID

    if text == MODEL_ID:
        return Verifier(name, list(_DEFAULT_TARGET_ARCHITECTURES))
    raise ConversionError(f"Cannot read the config of the verifier {text!r} (not a local folder; offline or not in the "
                          "local Hub cache): pass verifier= as a local folder of the target, or run online once.")


def speculators_fields(algorithm: str, speculative_tokens: int, verifier: Verifier) -> dict:
    """The top-level fields every speculators config has: model type, version and the ``speculators_config`` block
    (one greedy proposal method of ``speculative_tokens`` drafts; the verifier)."""
    if not isinstance(speculative_tokens, int) or speculative_tokens < 1:
        raise ConversionError(f"speculative_tokens must be a positive integer, got {speculative_tokens!r}.")
    return {
        "speculators_model_type": algorithm,
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": algorithm,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier.name_or_path, "architectures": list(verifier.architectures)},
        },
    }


@dataclass(frozen=True)
class Exported:
    """What an exporter wrote: the ``folder``, its ``files``, the ``config`` written and a command that serves it."""

    folder: Path
    files: list[Path]
    config: dict
    serve: str


def write_export(out, config: dict, tensors: dict[str, torch.Tensor], dtype: torch.dtype | None, serve: str
                 ) -> Exported:
    """Write ``config.json`` (with the ``dtype`` of the weights and the ``transformers_version``) and
    ``model.safetensors`` (floating tensors in ``dtype``, default as they are; every tensor contiguous and unshared)
    to ``out``."""
    import transformers
    from safetensors.torch import save_file

    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: (v.detach().to("cpu", dtype) if dtype is not None and v.is_floating_point() else v.detach().cpu())
             .contiguous().clone() for k, v in tensors.items()}
    floats = [v.dtype for v in state.values() if v.is_floating_point()]
    if floats:
        config = {**config, "dtype": str(floats[0]).removeprefix("torch.")}
    config = {**config, "transformers_version": transformers.__version__}
    weights, meta = folder / "model.safetensors", folder / "config.json"
    save_file(state, str(weights), metadata={"format": "pt"})
    meta.write_text(json.dumps(config, indent=2) + "\n")
    return Exported(folder, [meta, weights], config, serve)


def drafter_to_export(drafter_or_path, model_cls, convert):
    """The drafter to export: a ``model_cls`` instance as it is; a folder or Hub id in hf_specdec's format loaded with
    ``from_pretrained``; any other layout ``convert`` reads, converted in memory."""
    classes = model_cls if isinstance(model_cls, tuple) else (model_cls,)
    if isinstance(drafter_or_path, torch.nn.Module):
        if not isinstance(drafter_or_path, classes):
            raise ConversionError(f"Expected {' or '.join(c.__name__ for c in classes)}, got "
                                  f"{type(drafter_or_path).__name__}.")
        return drafter_or_path
    folder = resolve_source(drafter_or_path, allow_patterns=["config.json"])
    model_type = read_config(folder).get("model_type")
    for cls in classes:
        if model_type == cls.config_class.model_type:
            folder = resolve_source(drafter_or_path)
            check_weight_files(folder)
            return cls.from_pretrained(str(folder)).eval()
    return convert(drafter_or_path)


def vllm_serve_command(folder, verifier: Verifier, method: str, speculative_tokens: int) -> str:
    """``vllm serve`` with a ``--speculative-config`` naming the exported folder."""
    spec = json.dumps({"model": str(folder), "method": method, "num_speculative_tokens": speculative_tokens})
    return f"vllm serve {verifier.name_or_path} --speculative-config '{spec}'"
