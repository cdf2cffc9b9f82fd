"""How ``model.generate()`` reaches the loop.

Three ways, one code path:

* ``model.generate(..., custom_generate="hf_specdec/<method>", trust_remote_code=True, ...)`` — a Hub-shaped folder
  (``hf_specdec/<method>/custom_generate/generate.py``, found relative to the working directory, by absolute path
  from :func:`custom_generate_path`, or as the Hub repository ``hf_specdec/<method>`` in the local cache after
  ``hf-specdec install-hub-cache``). transformers hands it the raw ``generate()`` arguments;
  :func:`generate_with_method` takes out what belongs to the method and calls ``model.generate`` again with a
  decoding callable, so transformers still prepares everything (generation config, processors, stopping criteria).
* ``model.generate(..., custom_generate=hf_specdec.decoding_method("prompt_lookup"), ...)`` — a Python callable.
  transformers drops ``streamer``/``assistant_model`` for callables: pass the drafter as ``drafter=``.
* the same from ``pipeline("text-generation", ...)(prompt, custom_generate=..., trust_remote_code=True, ...)``.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Callable

import torch
from transformers import PreTrainedModel
from transformers.generation.stopping_criteria import StopStringCriteria, StoppingCriteriaList

from .engine import speculative_decode
from .proposers import DraftModelProposer, PromptLookupProposer, Proposer
from .proposers.draft_model import check_same_vocabulary

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _load_drafter(drafter, target):
    if drafter is None or isinstance(drafter, torch.nn.Module):
        return drafter
    if isinstance(drafter, (str, os.PathLike)):
        from .draft_models import load_draft_model

        return load_draft_model(drafter, target)
    raise TypeError(f"drafter must be a model or a path / Hub repo id, got {type(drafter).__name__}.")


def _build_prompt_lookup(target, opts: dict) -> PromptLookupProposer:
    if opts.get("drafter") is not None:
        raise ValueError("prompt_lookup drafts from the text itself and takes no drafter/assistant_model. Use "
                         "custom_generate='hf_specdec/assisted' to draft with a model.")
    def given(key, default):
        return default if opts.get(key) is None else opts[key]

    return PromptLookupProposer(
        num_tokens=given("prompt_lookup_num_tokens", 20),
        max_ngram=given("max_matching_ngram_size", 5),
        adaptive=opts.get("draft_length_schedule", "adaptive") != "constant",
    )


def _build_assisted(target, opts: dict) -> DraftModelProposer:
    drafter = _load_drafter(opts.get("drafter"), target)
    if drafter is None:
        raise ValueError("The 'assisted' method needs a draft model: pass assistant_model=<small causal LM with the "
                         "target's tokenizer> (or drafter=<model or path>).")
    check_same_vocabulary(target, drafter)
    num = opts.get("num_speculative_tokens")
    if num is None and opts.get("draft_length_schedule") == "constant":
        num = 5
    return DraftModelProposer(drafter, num_tokens=num, draft_vocab=opts.get("draft_vocab"))


def _load_eagle3(drafter, target):
    from .conversions.eagle3 import convert_eagle3
    from .modeling.eagle3 import Eagle3Config, Eagle3Drafter

    return _load_published(drafter, target, Eagle3Drafter, Eagle3Config.model_type, convert_eagle3)


def _load_published(drafter, target, model_cls, model_type: str, convert):
    """A drafter given as an object, a converted folder, or a published repo id / folder (converted in memory)."""
    if isinstance(drafter, model_cls):
        return drafter
    if isinstance(drafter, torch.nn.Module):
        raise TypeError(f"This method needs a {model_cls.__name__}, got {type(drafter).__name__}.")
    if not isinstance(drafter, (str, os.PathLike)):
        raise TypeError(f"drafter must be a {model_cls.__name__} or a path / Hub repo id, got {type(drafter).__name__}.")
    from .conversions.common import read_config, resolve_source

    folder = resolve_source(drafter)
    if read_config(folder).get("model_type") == model_type:
        model = model_cls.from_pretrained(str(folder), dtype=target.dtype)
    else:
        model = convert(folder, dtype=target.dtype)
    return model.to(target.device).eval()


def _load_dflash(drafter, target):
    from .conversions.dflash import convert_dflash
    from .modeling.dflash import DFlashConfig, DFlashDrafter

    return _load_published(drafter, target, DFlashDrafter, DFlashConfig.model_type, convert_dflash)


def _build_dflash(target, opts: dict):
    from .proposers.dflash import DFlashProposer

    if opts.get("drafter") is None:
        raise ValueError("The 'dflash' method needs a DFlash drafter: pass drafter=<DFlashDrafter, converted folder, "
                         "or a published repo id / folder>.")
    return DFlashProposer(_load_dflash(opts["drafter"], target), block_size=opts.get("block_size"),
                          adaptive=opts.get("draft_length_schedule", "adaptive") != "constant")


def _build_eagle3(target, opts: dict):
    from .proposers.eagle3 import Eagle3Proposer, default_tree

    if opts.get("drafter") is None:
        raise ValueError("The 'eagle3' method needs an EAGLE-3 drafter: pass drafter=<Eagle3Drafter, converted "
                         "folder, or a published repo id / folder>.")
    drafter = _load_eagle3(opts["drafter"], target)
    given = {k: opts[f"tree_{k}"] for k in ("top_k", "depth", "total_tokens") if opts.get(f"tree_{k}") is not None}
    tree = {} if opts.get("num_speculative_tokens") else {**default_tree(target.device), **given}
    return Eagle3Proposer(drafter, num_speculative_tokens=opts.get("num_speculative_tokens"),
                          adaptive=opts.get("draft_length_schedule", "adaptive") != "constant", **tree)


METHODS: dict[str, Callable[[Any, dict], Any]] = {
    "prompt_lookup": _build_prompt_lookup,
    "assisted": _build_assisted,
    "eagle3": _build_eagle3,
    "dflash": _build_dflash,
}

# generate() keyword arguments that configure a method (taken out before transformers sees them)
METHOD_KWARGS = (
    "drafter",
    "num_speculative_tokens",
    "prompt_lookup_num_tokens",
    "max_matching_ngram_size",
    "draft_length_schedule",
    "tree_top_k",
    "tree_depth",
    "tree_total_tokens",
    "block_size",
    "draft_vocab",
)


def available_methods() -> list[str]:
    return sorted(METHODS)


def build_proposer(method: str, model, **opts):
    """The proposer of ``method`` for target ``model``; ``opts`` are the method's keyword arguments."""
    if method not in METHODS:
        raise ValueError(f"Unknown speculative decoding method {method!r}. Available: {', '.join(available_methods())}.")
    if opts.get("draft_length_schedule") not in (None, "adaptive", "constant"):
        raise ValueError("draft_length_schedule must be 'adaptive' or 'constant', "
                         f"got {opts.get('draft_length_schedule')!r}.")
    return METHODS[method](model, opts)


def custom_generate_path(method: str) -> str:
    """Absolute path of the Hub-shaped folder of ``method`` (pass it as ``custom_generate=``)."""
    if method not in METHODS:
        raise ValueError(f"Unknown speculative decoding method {method!r}. Available: {', '.join(available_methods())}.")
    return os.path.join(PACKAGE_DIR, method)


def decoding_method(method, **defaults) -> Callable:
    """A decoding callable for ``model.generate(custom_generate=...)``.

    ``method`` is a method name (see :func:`available_methods`) or a :class:`~hf_specdec.proposers.Proposer`
    instance of your own (it is re-initialised by ``begin`` at every call).

    Example:
        >>> out = model.generate(**inputs, max_new_tokens=64, do_sample=False,
        ...                      custom_generate=hf_specdec.decoding_method("prompt_lookup"))

    Method options (``drafter=``, ``prompt_lookup_num_tokens=``...) may be given here or to ``generate``.
    transformers does not forward ``streamer``/``assistant_model`` to a callable: use the folder form
    (``custom_generate="hf_specdec/<method>"``) for streaming, and ``drafter=`` for the draft model.
    """
    unknown = sorted(set(defaults) - set(METHOD_KWARGS))
    if unknown:
        raise ValueError(f"decoding_method() got unknown method option(s) {', '.join(unknown)}; the options are "
                         f"{', '.join(METHOD_KWARGS)} (generation settings such as top_k go to generate()).")
    if isinstance(method, Proposer):
        fixed, label = method, method.name
    else:
        custom_generate_path(method)  # validates the name
        fixed, label = None, method

    def run(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None, **kwargs):
        given = {k: kwargs.pop(k, None) for k in METHOD_KWARGS}
        opts = {**defaults, **{k: v for k, v in given.items() if v is not None}}
        proposer = fixed if fixed is not None else build_proposer(method, model, **opts)
        return speculative_decode(model, input_ids, logits_processor, stopping_criteria, generation_config,
                                  proposer=proposer, **kwargs)

    # transformers hands a callable only the generate() arguments its signature names: name every method option
    plain = [p for p in inspect.signature(run).parameters.values() if p.kind is not p.VAR_KEYWORD]
    options = [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=None) for k in METHOD_KWARGS]
    rest = inspect.Parameter("model_kwargs", inspect.Parameter.VAR_KEYWORD)
    run.__signature__ = inspect.Signature(plain + options + [rest])
    run.__name__ = f"hf_specdec_{label}"
    run.__doc__ = f"hf_specdec speculative decoding, method {label!r}."
    return run


def _take_stop_strings(model, generation_config, kwargs):
    """transformers drops ``tokenizer`` on the way to a decoding callable, so stop strings are built here.

    Returns ``(StopStringCriteria or None, generation_config without stop strings)``.
    """
    stop = kwargs.pop("stop_strings", None)
    tokenizer = kwargs.pop("tokenizer", None)
    config = generation_config if generation_config is not None else model.generation_config
    if getattr(config, "stop_strings", None) is not None:
        stop = stop if stop is not None else config.stop_strings
        generation_config = config.__class__.from_dict({**config.to_dict(), "stop_strings": None})
    if stop is None:
        return None, generation_config
    if tokenizer is None:
        raise ValueError("stop_strings needs the tokenizer: pass tokenizer=<the model's tokenizer> to generate().")
    return StopStringCriteria(stop_strings=stop, tokenizer=tokenizer), generation_config


def generate_with_method(method: str, model, inputs=None, generation_config=None, logits_processor=None,
                         stopping_criteria=None, prefix_allowed_tokens_fn=None, synced_gpus=None,
                         assistant_model=None, streamer=None, negative_prompt_ids=None,
                         negative_prompt_attention_mask=None, **kwargs):
    """The body of every ``custom_generate/generate.py``: ``generate()``'s arguments in, sequences out."""
    if method not in METHODS:
        raise ValueError(f"Unknown speculative decoding method {method!r}. Available: {', '.join(available_methods())}.")
    opts = {k: kwargs.pop(k) for k in METHOD_KWARGS if k in kwargs}
    if assistant_model is not None:
        if opts.get("drafter") is not None:
            raise ValueError("Pass the draft model once: assistant_model= or drafter=, not both.")
        opts["drafter"] = assistant_model
    for key in ("assistant_early_exit", "use_mtp", "speculation_type", "assistant_tokenizer"):
        if kwargs.get(key) is not None:
            raise ValueError(f"{key}= selects one of transformers' own assisted modes; it cannot be combined with "
                             f"custom_generate='hf_specdec/{method}'. Drop one of the two.")
    _check_lengths(inputs if inputs is not None else kwargs.get("input_ids"), generation_config, kwargs)
    stop, generation_config = _take_stop_strings(model, generation_config, kwargs)
    if stop is not None:
        stopping_criteria = StoppingCriteriaList([*(stopping_criteria or []), stop])
    proposer = build_proposer(method, model, **opts)

    def run(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None, **model_kwargs):
        return speculative_decode(model, input_ids, logits_processor, stopping_criteria, generation_config,
                                  proposer=proposer, streamer=streamer, **model_kwargs)

    return model.generate(
        inputs,
        generation_config=generation_config,
        logits_processor=logits_processor,
        stopping_criteria=stopping_criteria,
        prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
        synced_gpus=synced_gpus,
        negative_prompt_ids=negative_prompt_ids,
        negative_prompt_attention_mask=negative_prompt_attention_mask,
        custom_generate=run,
        **kwargs,
    )


def _check_lengths(prompt, generation_config, kwargs) -> None:
    if isinstance(prompt, torch.Tensor) and prompt.dim() >= 1 and prompt.shape[-1] == 0:
        raise ValueError("The prompt is empty: speculative decoding needs at least one prompt token.")
    max_new = kwargs.get("max_new_tokens")
    if max_new is None and generation_config is not None:
        max_new = generation_config.max_new_tokens
    if max_new is not None and max_new < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new}.")
