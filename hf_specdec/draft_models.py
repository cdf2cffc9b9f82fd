"""Draft models for the ``assisted`` method that share the target's token embeddings and LM head.

A distilled student keeps the target's (frozen) embeddings and head, which for a small target are most of its weights
(SmolLM2-135M: 28 M of the student's 42 M parameters). :func:`save_draft_model` therefore stores only the student's
own weights and marks the config with ``hf_specdec_shares_target_embeddings``; :func:`load_draft_model` rebuilds the
full model from the target it will serve. Folders without the mark load as ordinary ``from_pretrained`` models.
A student may also carry a draft vocabulary (the most frequent target tokens of its training data, key
``hf_specdec_draft_vocab``): the ``assisted`` method then scores only those tokens with its head.

Example::

    >>> from hf_specdec import load_draft_model
    >>> draft = load_draft_model("hf_specdec/drafters/smollm2-135m-instruct-student", target)  # doctest: +SKIP
    >>> target.generate(**enc, assistant_model=draft, custom_generate="hf_specdec/assisted",
    ...                 trust_remote_code=True)  # doctest: +SKIP
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch

from ._transformers import load_pretrained
from .placement import drafter_device, materialized

SHARED_FLAG = "hf_specdec_shares_target_embeddings"
VOCAB_KEY = "hf_specdec_draft_vocab"  # target token ids the student drafts (a model attribute once loaded)
WEIGHTS = "model.safetensors"


def _shared_keys(model) -> set[str]:
    """State-dict keys of the input embeddings and the output head (one key when tied)."""
    keys = set()
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    for name, module in model.named_modules():
        if module is emb or (head is not None and module is head):
            keys.add(f"{name}.weight")
    return keys


def save_draft_model(model, folder, dtype=torch.float16, tokenizer=None, draft_vocab=None) -> None:
    """Save ``model`` without its embeddings/head (they are the target's) in ``dtype`` safetensors + config;
    ``draft_vocab``: target token ids the ``assisted`` method should draft from (default: the model's own
    ``hf_specdec_draft_vocab``, if any)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shared = _shared_keys(model)
    state = {k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).contiguous()
             for k, v in model.state_dict().items() if k not in shared}
    if draft_vocab is None:
        draft_vocab = getattr(model, VOCAB_KEY, None)
    if draft_vocab is not None:
        state[VOCAB_KEY] = torch.as_tensor(draft_vocab, dtype=torch.long).flatten().unique().cpu()
    save_file(state, str(folder / WEIGHTS), metadata={"format": "pt"})
    config = copy.deepcopy(model.config)  # the saved copy names the stored dtype; the model's own config is kept
    setattr(config, SHARED_FLAG, True)
    config.dtype = dtype
    config.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def _resolve(path: str, filename: str, revision=None) -> str:
    local = Path(path)
    if local.is_dir():
        found = local / filename
        if not found.is_file():
            raise FileNotFoundError(f"{found} is missing: {path} is not a complete draft-model folder.")
        return str(found)
    from huggingface_hub import hf_hub_download

    return hf_hub_download(path, filename, revision=revision)


def load_draft_model(path: str | os.PathLike, target, revision=None):
    """Load a draft model for ``target``. A folder saved by :func:`save_draft_model` gets the target's embeddings and
    head (its hidden size and vocabulary are checked against the target's); any other folder or Hub id loads with
    ``AutoModelForCausalLM.from_pretrained``. The model is put on the target's drafter device
    (:func:`hf_specdec.placement.drafter_device`) and dtype, in eval mode."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from .conversions.common import check_config_matches_weights
    from .registry import drafter_source

    path = drafter_source(path) if revision is None else str(path)
    config = AutoConfig.from_pretrained(path, revision=revision)
    if Path(path).is_dir():
        check_config_matches_weights(Path(path), config, AutoModelForCausalLM.from_config)
    if not getattr(config, SHARED_FLAG, False):
        model = load_pretrained(AutoModelForCausalLM, path, revision=revision, dtype=target.dtype)
        return model.to(drafter_device(target)).eval()
    text, mine = target.config.get_text_config(), config.get_text_config()
    for field in ("hidden_size", "vocab_size"):
        if getattr(text, field) != getattr(mine, field):
            raise ValueError(f"The draft model at {path} was trained for a target with {field}="
                             f"{getattr(mine, field)}, but this target has {field}={getattr(text, field)}: it "
                             "shares the target's embeddings, so it only works with the target it was trained for.")
    state = load_file(_resolve(path, WEIGHTS, revision))
    vocab = state.pop(VOCAB_KEY, None)
    config.name_or_path = path  # where its tokenizer, if saved, is found (hf_specdec.identity)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    shared = _shared_keys(model)
    expected = set(model.state_dict()) - shared
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise ValueError(f"The weights at {path} do not match its config: missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}.")
    model.load_state_dict(state, strict=False)
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(materialized(target.get_input_embeddings()))
        head = model.get_output_embeddings()
        if head is not None and head.weight is not model.get_input_embeddings().weight:
            head.weight.copy_(materialized(target.get_output_embeddings()))
    model = model.to(device=drafter_device(target), dtype=target.dtype).eval()
    if vocab is not None:  # checked where it is used (proposers.draft_model.restricted_head)
        setattr(model, VOCAB_KEY, vocab)
    return model
