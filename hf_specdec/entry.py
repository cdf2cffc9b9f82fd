"""How ``model.generate()`` reaches the loop.

Three ways, one code path, every method and option read from the registry (:mod:`hf_specdec.registry`):

* ``model.generate(..., custom_generate="hf_specdec/<method>", trust_remote_code=True, ...)`` — a Hub-shaped folder
  (:mod:`hf_specdec.folders`: found relative to the working directory, by absolute path from
  :func:`custom_generate_path`, or as the Hub repository ``hf_specdec/<method>`` in the local cache after
  ``hf-specdec install-hub-cache``). transformers hands it the raw ``generate()`` arguments;
  :func:`generate_with_method` takes out what belongs to the method and calls ``model.generate`` again with a
  decoding callable, so transformers still prepares everything (generation config, processors, stopping criteria).
* ``model.generate(..., custom_generate=hf_specdec.decoding_method("prompt_lookup"), ...)`` — a Python callable.
  transformers drops ``streamer``/``assistant_model`` for callables: pass the drafter as ``drafter=``.
* the same from ``pipeline("text-generation", ...)(prompt, custom_generate=..., trust_remote_code=True, ...)``.

The target runner (:mod:`hf_specdec.runners`) is chosen here, once per call: :func:`~hf_specdec.runners.runner_for`.
"""

from __future__ import annotations

import inspect
import sys
import warnings
from typing import Callable

import torch
from transformers.generation.stopping_criteria import StopStringCriteria, StoppingCriteriaList

from . import registry
from .engine import speculative_decode
from .folders import custom_generate_path
from .proposers import Proposer
from .registry import available_methods, build_proposer
from .runners import runner_for

__all__ = ["available_methods", "build_proposer", "custom_generate_path", "decoding_method", "generate_with_method"]


def _take_options(kwargs: dict) -> dict:
    """Pop every method option (of any registered method) that was given, i.e. is not ``None``."""
    taken = {k: kwargs.pop(k) for k in registry.all_option_names() if k in kwargs}
    return {k: v for k, v in taken.items() if v is not None}


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
    if isinstance(method, Proposer):
        fixed, label = method, method.name
        if defaults:
            raise ValueError(f"decoding_method() got method option(s) {', '.join(sorted(defaults))} for a Proposer "
                             "instance; configure the proposer itself.")
    else:
        fixed, label = None, method
        registry.get(method).resolve(defaults)  # unknown or invalid options fail here, not at the first generate() call

    def run(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None, **kwargs):
        _warn_dropped_streamer(label)
        given = _take_options(kwargs)
        if fixed is not None:
            if given:
                raise ValueError(f"Method option(s) {', '.join(sorted(given))} were given to a Proposer instance "
                                 f"({label}); configure the proposer itself.")
            proposer = fixed
        else:
            proposer = build_proposer(method, model, **{**defaults, **given})
        return speculative_decode(model, input_ids, logits_processor, stopping_criteria, generation_config,
                                  proposer=proposer, runner=runner_for(model), **kwargs)

    # transformers hands a callable only the generate() arguments its signature names: name every method option
    # (those of other methods too, so that a misplaced one gets an error naming its method)
    plain = [p for p in inspect.signature(run).parameters.values() if p.kind is not p.VAR_KEYWORD]
    options = [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=None) for k in registry.all_option_names()]
    rest = inspect.Parameter("model_kwargs", inspect.Parameter.VAR_KEYWORD)
    run.__signature__ = inspect.Signature(plain + options + [rest])
    run.__name__ = f"hf_specdec_{label}"
    run.__doc__ = f"hf_specdec speculative decoding, method {label!r}."
    return run


def _warn_dropped_streamer(label: str) -> None:
    """transformers hands a decoding callable no ``streamer`` (it only receives the prompt): say so rather than let a
    stream stop silently. The streamer is looked up in the calling ``generate()`` frame."""
    frame = sys._getframe(2)
    for _ in range(6):
        if frame is None:
            return
        if frame.f_code.co_name == "generate" and "custom_generate" in frame.f_locals:
            if frame.f_locals.get("streamer") is not None:
                warnings.warn(f"transformers does not pass streamer= to a custom_generate callable, so the streamer "
                              f"gets the prompt only. To stream, use the folder form: custom_generate="
                              f"'hf_specdec/{label}' (or hf_specdec.custom_generate_path({label!r})) with "
                              "trust_remote_code=True.", UserWarning, stacklevel=4)
            return
        frame = frame.f_back


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
    registry.get(method)  # an unknown name fails first
    opts = _take_options(kwargs)
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
    runner = runner_for(model)

    def run(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None, **model_kwargs):
        return speculative_decode(model, input_ids, logits_processor, stopping_criteria, generation_config,
                                  proposer=proposer, streamer=streamer, runner=runner, **model_kwargs)

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
