"""What a ``custom_generate`` callable cannot see: the arguments of the ``generate()`` call that runs it.

transformers (checked: 5.24.0, 5.25.0) hands a decoding callable only the arguments its signature names, validates
every other one against the model before the callable runs, and keeps ``streamer`` / ``assistant_model`` to itself.
These read the calling frames of ``GenerationMixin.generate`` (by function name and local variable names) to give the
library's own answer instead; each returns ``None`` / ``{}`` where the frames are not there (another version, another
caller).
"""

from __future__ import annotations

import inspect
import sys

_GENERATE = "generate"  # GenerationMixin.generate: its locals `custom_generate`, `streamer`, `assistant_model`
_SORTING = "_extract_generation_mode_kwargs"  # GenerationMixin: its locals `self` (the model), `kwargs` (the rest)
_GENERATE_OWN = {"tokenizer", "assistant_tokenizer", "trust_remote_code", "custom_generate"}  # generate() pops these


def _frame(name: str, depth: int = 12, start: int = 2):
    frame = sys._getframe(start)
    for _ in range(depth):
        if frame is None:
            return None
        if frame.f_code.co_name == name:
            return frame
        frame = frame.f_back
    return None


def calling_generate_arguments() -> dict:
    """``{"streamer": ..., "assistant_model": ...}`` of the ``generate()`` call running the caller (a decoding
    callable), those that were given."""
    frame = _frame(_GENERATE)
    if frame is None or "custom_generate" not in frame.f_locals:
        return {}
    return {k: frame.f_locals[k] for k in ("streamer", "assistant_model") if frame.f_locals.get(k) is not None}


def generate_arguments_in_flight():
    """``(model, kwargs)`` while ``generate()`` sorts its keyword arguments (it reads the callable's signature then),
    else ``None``."""
    frame = _frame(_SORTING)
    if frame is None:
        return None
    model, kwargs = frame.f_locals.get("self"), frame.f_locals.get("kwargs")
    return (model, kwargs) if model is not None and isinstance(kwargs, dict) else None


TOKENIZERS = ("tokenizer", "assistant_tokenizer")


def hand_tokenizers_on() -> None:
    """While ``generate()`` sorts its keyword arguments: it has popped ``tokenizer=`` / ``assistant_tokenizer=`` and
    would hand a decoding callable neither (nor its own stopping criteria: ``stop_strings`` then fail with "could not
    locate a tokenizer"). Put the given ones back into the arguments it is sorting, so that it takes them as the
    callable's own (whose signature names them) and passes them on to its stopping criteria and to the callable, as
    it does for plain decoding."""
    frame = _frame(_SORTING)
    if frame is None:
        return
    taken, kwargs = frame.f_locals.get("generation_mode_kwargs"), frame.f_locals.get("kwargs")
    if isinstance(taken, dict) and isinstance(kwargs, dict):
        kwargs.update({k: taken[k] for k in TOKENIZERS if taken.get(k) is not None})


def unused_generate_arguments(model, kwargs: dict) -> list[str]:
    """The names in ``kwargs`` (``generate()`` keyword arguments) that are neither generation settings nor inputs
    the model takes: what transformers would reject as "not used by the model" (typos, a method option misspelt)."""
    from transformers import GenerationConfig
    from transformers.utils.generic import TransformersKwargs

    settings = GenerationConfig().to_dict()
    taken = set(inspect.signature(model.prepare_inputs_for_generation).parameters)
    if {"kwargs", "model_kwargs"} & taken:
        taken |= set(inspect.signature(model.forward).parameters)
    taken |= set(getattr(TransformersKwargs, "__optional_keys__", ())) | set(getattr(TransformersKwargs, "__annotations__", ()))
    return [k for k, v in kwargs.items() if v is not None and k not in settings and k not in taken
            and k not in _GENERATE_OWN and not hasattr(GenerationConfig, k)]
