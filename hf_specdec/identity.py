"""Which target a model is, and whether a drafter speaks its tokenizer.

Two questions the loading code asks of what a checkpoint carries, never of its path:

* :func:`identify` names a target the package ships drafters for (today SmolLM2-135M-Instruct): its config's
  architecture fields and special token ids match, and, where its tokenizer can be found (the model's folder or
  the local Hub cache), so does a hash of its vocabulary. A renamed or moved copy is still recognised; another model
  with the same vocabulary size is not.
* :func:`check_same_tokenizer` refuses a drafter whose token ids mean other tokens than the target's although the
  vocabulary sizes agree (a GPT-2 cut to 49,152 rows drafting for SmolLM2): its special token ids, or its saved
  tokenizer's vocabulary, disagree with the target's. Where the drafter carries neither, it warns once.

Example:
    >>> from hf_specdec import identity
    >>> identity.identify(model)  # doctest: +SKIP
    'HuggingFaceTB/SmolLM2-135M-Instruct'
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import threading
from pathlib import Path

from .default_model import MODEL_ID as SMOLLM2

logger = logging.getLogger("hf_specdec")

# The targets drafters ship for: config fields that must match, and the vocabulary hash (:func:`vocabulary_hash`).
KNOWN_TARGETS = {
    SMOLLM2: {
        "config": {"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
                   "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152,
                   "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2},
        "vocabulary": "450fd25da1a689ff",
    },
}
TOKENIZER_FILES = ("tokenizer.json", "vocab.json")
_WARNED: set[tuple[str, str]] = set()
_WARNED_LOCK = threading.Lock()


def _first_warning(key: tuple[str, str]) -> bool:
    """Whether ``key`` was not warned about yet (and now is: one thread of many gets ``True``)."""
    with _WARNED_LOCK:
        first = key not in _WARNED
        _WARNED.add(key)
    return first


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def vocabulary_hash(folder: str | os.PathLike | None) -> str | None:
    """A short hash of the token -> id map saved in ``folder`` (``tokenizer.json``, else ``vocab.json``), or
    ``None`` when the folder holds neither. Two tokenizers with the same hash give every id the same token."""
    if folder is None:
        return None
    for name in TOKENIZER_FILES:
        path = Path(folder) / name
        if not path.is_file():
            continue
        found = _file_hash(str(path.resolve()), path.stat().st_mtime)
        if found is not None:
            return found
    return None


@functools.lru_cache(maxsize=64)
def _file_hash(path: str, mtime: float) -> str | None:
    """:func:`vocabulary_hash` of one tokenizer file (``tokenizer.json`` or ``vocab.json``), remembered per path and
    modification time (a file rewritten is read again)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    vocab = data.get("model", {}).get("vocab") if Path(path).name == "tokenizer.json" else data
    if isinstance(vocab, list):  # unigram tokenizers: [[piece, score], ...]
        vocab = {piece[0]: i for i, piece in enumerate(vocab)}
    if isinstance(vocab, dict) and Path(path).name == "tokenizer.json":  # special and added tokens have ids too
        vocab = {**vocab, **{t["content"]: t["id"] for t in data.get("added_tokens") or []}}
    return (hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()[:16]
            if isinstance(vocab, dict) and vocab else None)


def model_folder(model) -> Path | None:
    """The folder ``model`` was loaded from (``config.name_or_path``): a local folder, or a Hub id's snapshot in the
    local cache (never downloaded); ``None`` when unknown."""
    config = getattr(model, "config", model)
    name = getattr(config, "name_or_path", None)
    if not name:
        return None
    if Path(name).is_dir():
        return Path(name)
    try:
        from huggingface_hub import try_to_load_from_cache

        for filename in ("config.json", *TOKENIZER_FILES):
            found = try_to_load_from_cache(str(name), filename)
            if isinstance(found, str):
                return Path(found).parent
    except Exception:  # a name that is not a valid repo id
        return None
    return None


def special_ids(model) -> tuple[set[int], set[int]]:
    """``(bos ids, eos ids)`` named by the model's config and generation config (empty when none)."""
    bos, eos = set(), set()
    for cfg in (_text_config(getattr(model, "config", model)), getattr(model, "generation_config", None)):
        if cfg is None:
            continue
        for ids, key in ((bos, "bos_token_id"), (eos, "eos_token_id")):
            value = getattr(cfg, key, None)
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(v for v in value if isinstance(v, int))
    return bos, eos


def identify(model) -> str | None:
    """The id of the known target ``model`` is (see :data:`KNOWN_TARGETS`), from its config and vocabulary; ``None``
    for any other model."""
    config = _text_config(getattr(model, "config", model))
    for target_id, signature in KNOWN_TARGETS.items():
        if any(getattr(config, k, None) != v for k, v in signature["config"].items()):
            continue
        vocab = vocabulary_hash(model_folder(model))
        if vocab is not None and vocab != signature["vocabulary"]:
            continue
        return target_id
    return None


def check_same_tokenizer(target, drafter, what: str = "drafter") -> None:
    """Refuse ``drafter`` when what it carries says its token ids are another tokenizer's (the vocabulary sizes are
    checked elsewhere): special token ids outside the target's vocabulary, bos *and* eos ids that differ from the
    target's, or a saved vocabulary whose hash differs from the target's. One differing special id only warns (a base
    and an instruct model of one family may end turns differently); a drafter that carries no special ids and no
    tokenizer is accepted with a warning, once."""
    vocab_size = getattr(_text_config(target.config), "vocab_size", None)
    t_bos, t_eos = special_ids(target)
    d_bos, d_eos = special_ids(drafter)
    label = getattr(drafter.config, "name_or_path", "") or type(drafter).__name__
    fix = ("Use a drafter trained with the target's tokenizer (e.g. `hf-specdec train draft`), or transformers' "
           "universal assisted decoding (assistant_model= with tokenizer= and assistant_tokenizer=, without "
           "custom_generate).")
    outside = sorted(i for i in d_bos | d_eos if vocab_size is not None and not 0 <= i < vocab_size)
    if outside:
        raise ValueError(f"The {what} ({label}) names special token id(s) {outside}, outside the target's vocabulary "
                         f"of {vocab_size}: it was made for another tokenizer, although its vocabulary size matches. "
                         + fix)
    differ = [f"{name} {sorted(d)} (target: {sorted(t)})" for name, d, t in (("bos", d_bos, t_bos), ("eos", d_eos, t_eos))
              if d and t and not d & t]
    if len(differ) == 2:
        raise ValueError(f"The {what} ({label}) has other special token ids than the target: {'; '.join(differ)}. "
                         f"It was made for another tokenizer, although its vocabulary size matches. " + fix)
    d_hash, t_hash = vocabulary_hash(model_folder(drafter)), vocabulary_hash(model_folder(target))
    if d_hash is not None and t_hash is not None and d_hash != t_hash:
        raise ValueError(f"The {what} ({label}) was saved with another tokenizer than the target's (vocabulary hash "
                         f"{d_hash} vs {t_hash}), although the vocabulary sizes match. " + fix)
    key = (label, str(getattr(target.config, "name_or_path", "")))
    if differ:
        if _first_warning(key):
            logger.warning(f"hf_specdec: the {what} ({label}) has another {differ[0]}; check it uses the target's "
                           "tokenizer (the output stays lossless, but drafts of another tokenizer are rejected).")
    elif not (d_bos or d_eos) and d_hash is None and _first_warning(key):
        logger.warning(f"hf_specdec: cannot confirm that the {what} ({label}) uses the target's tokenizer (it carries "
                       "no special token ids and no tokenizer); the output stays lossless either way.")
