"""How ``model.generate()`` reaches the loop.

Three ways, one code path, every method and option read from the registry (:mod:`hf_specdec.registry`):

* ``model.generate(..., custom_generate="hf_specdec/<method>", trust_remote_code=True, ...)`` — a Hub-shaped folder
  (:mod:`hf_specdec.folders`: found relative to the working directory, by absolute path from
  :func:`custom_generate_path`, or as the Hub repository ``hf_specdec/<method>`` in the local cache after
  ``hf-specdec install-hub-cache``). transformers hands it the raw ``generate()`` arguments;
  :func:`generate_with_method` takes out what belongs to the method and calls ``model.generate`` again with a
  decoding callable, so transformers still prepares everything (generation config, processors, stopping criteria).
* ``model.generate(..., custom_generate=hf_specdec.decoding_method("prompt_lookup"), ...)`` — a Python callable.
  transformers keeps ``streamer``/``assistant_model``/``tokenizer`` from a callable: they are recovered from the
  calling ``generate()`` (:class:`_DecodingMethod`).
* the same from ``pipeline("text-generation", ...)(prompt, custom_generate=..., trust_remote_code=True, ...)``.

The target runner (:mod:`hf_specdec.runners`) is chosen here, once per call: :func:`~hf_specdec.runner_choice.runner_for`.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch
from transformers.generation.stopping_criteria import StopStringCriteria, StoppingCriteriaList

from . import registry
from .coupling import seed_first
from .engine import speculative_decode, unsupported_mode
from ._transformers import generation_defaults
from ._transformers_frames import (TOKENIZERS, calling_generate_arguments, generate_arguments_in_flight,
                                   hand_tokenizers_on, unused_generate_arguments)
from .folders import custom_generate_path
from .proposers import Proposer
from .proposers.build import build_proposer
from .registry import available_methods
from .runner_choice import runner_for

__all__ = ["available_methods", "build_proposer", "custom_generate_path", "decoding_method", "generate_with_method"]


SHARED_WITH_GENERATE = ("tokenizer",)  # generate()'s own arguments (stop strings) that a method may read too


def _take_options(kwargs: dict, model=None, method: str | None = None) -> dict:
    """Pop every method option (of any registered method) that was given, i.e. is not ``None``; with ``model``, also
    every argument that neither transformers nor the model takes (a misspelt option: the method's record names it).
    An argument of ``generate()`` itself (:data:`SHARED_WITH_GENERATE`) stays in ``kwargs`` and is copied for
    ``method`` when it has an option of that name."""
    names = set(registry.all_option_names()) - set(SHARED_WITH_GENERATE)
    if model is not None:
        names |= set(unused_generate_arguments(model, kwargs))
    taken = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
    if method is not None and isinstance(method, str):
        own = set(registry.get(method).option_names)
        taken.update({k: kwargs[k] for k in SHARED_WITH_GENERATE if k in own and k in kwargs})
    return {k: v for k, v in taken.items() if v is not None}


def _build(method, model, opts: dict, generation_config=None):
    """The call's proposer: ``method``'s options ``opts``, and those of its options that are transformers generation
    settings (:attr:`~hf_specdec.registry.Option.generation_setting`) read from the call's generation config where
    the call did not give them. A value equal to the one ``generate()`` fills in for an unset setting
    (``num_assistant_tokens=20``...) counts as unset: the config a decoding callable receives holds those."""
    config = generation_config if generation_config is not None else model.generation_config
    defaults = generation_defaults()
    for option in registry.get(method).options:
        if option.generation_setting and opts.get(option.name) is None:
            value = getattr(config, option.name, None)
            if value is not None and value != defaults.get(option.name):
                opts[option.name] = value
    return build_proposer(method, model, **opts)


def _split_loop_options(opts: dict) -> dict:
    """Pop the loop's options (:data:`hf_specdec.registry.LOOP_OPTIONS`) from ``opts``; the rest go to the proposer."""
    return {o.name: opts.pop(o.name) for o in registry.LOOP_OPTIONS if o.name in opts}


def _runner(model, loop: dict):
    """The call's target runner (:func:`~hf_specdec.runner_choice.runner_for`); pops the ``compile`` option from ``loop``,
    which chooses the compiled runner."""
    return runner_for(model, compile=bool(loop.pop("compile", False)))


def _decode(model, input_ids, logits_processor, stopping_criteria, generation_config, proposer, loop: dict,
            **kwargs):
    """One call of the loop from a decoding callable: its seed drawn first (:func:`~hf_specdec.coupling.seed_first`:
    before the proposer is built, a drafter loaded in the call initialised, or anything else drawn, so under
    ``torch.manual_seed`` every method samples with ``plain``'s seed), then the proposer (``proposer``: a
    :class:`~hf_specdec.proposers.Proposer`, or a function that builds one), the runner and the loop."""
    loop = dict(loop)
    config = generation_config if generation_config is not None else model.generation_config
    with seed_first(model, bool(config.do_sample), loop.pop("seed", None), loop.pop("generator", None)) as seed:
        proposer = proposer if isinstance(proposer, Proposer) else proposer()
        runner = _runner(model, loop)
        return speculative_decode(model, input_ids, logits_processor, stopping_criteria, generation_config,
                                  proposer=proposer, runner=runner, seed=seed, **loop, **kwargs)


class _DecodingMethod:
    """The callable :func:`decoding_method` returns (``model.generate(custom_generate=...)``).

    transformers hands a decoding callable only the ``generate()`` arguments its signature names, checks every other
    one against the model, and drops ``streamer``, ``assistant_model``, ``tokenizer`` and ``assistant_tokenizer``.
    So its signature names every method option (those of other methods too, so that a misplaced one gets the error
    naming its method) and, while ``generate()`` sorts its arguments, any argument the model would reject (a misspelt
    option gets the method's own message); the tokenizers go back into the arguments ``generate()`` sorts (its stop
    strings need them), and the ``streamer`` and ``assistant_model`` of the calling ``generate()`` are recovered from
    it."""

    def __init__(self, method, defaults: dict):
        if isinstance(method, Proposer):
            self.fixed, self.label = method, method.name
            if set(defaults) - {o.name for o in registry.LOOP_OPTIONS}:
                raise ValueError(f"decoding_method() got method option(s) {', '.join(sorted(defaults))} for a "
                                 "Proposer instance; configure the proposer itself.")
            for option in registry.LOOP_OPTIONS:
                defaults[option.name] = option.check(self.label, defaults.get(option.name))
        else:
            self.fixed, self.label = None, method
            registry.get(method).resolve(defaults)  # unknown or invalid options fail here, not at generate()
        self.method, self.defaults = method, defaults
        self.__name__ = f"hf_specdec_{self.label}"
        self.__doc__ = f"hf_specdec speculative decoding, method {self.label!r}."

    @property
    def __signature__(self) -> inspect.Signature:
        plain = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default)
                 for name, default in (("model", inspect.Parameter.empty), ("input_ids", inspect.Parameter.empty),
                                       ("logits_processor", None), ("stopping_criteria", None),
                                       ("generation_config", None))]
        names = list(dict.fromkeys([*registry.all_option_names(), *TOKENIZERS]))
        sorting = generate_arguments_in_flight()  # (model, kwargs) while generate() sorts its arguments
        if sorting is not None:
            names += [k for k in unused_generate_arguments(*sorting) if k not in names]
            hand_tokenizers_on()  # generate() popped them: back, to reach its stop strings and this call
        options = [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=None) for k in names]
        rest = inspect.Parameter("model_kwargs", inspect.Parameter.VAR_KEYWORD)
        return inspect.Signature(plain + options + [rest])

    def __call__(self, model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
                 **kwargs):
        dropped = calling_generate_arguments()  # streamer= and assistant_model= that generate() kept to itself
        dropped.update({k: kwargs.pop(k) for k in TOKENIZERS if k in kwargs})  # for the methods that take them
        opts = {**self.defaults, **_take_options(kwargs, model)}
        if dropped.get("assistant_model") is not None:
            if opts.get("drafter") is not None:
                raise ValueError("Pass the draft model once: assistant_model= or drafter=, not both.")
            opts["drafter"] = dropped["assistant_model"]
        if self.fixed is None:
            own = set(registry.get(self.method).option_names)
            opts.update({k: v for k, v in dropped.items() if k in own and k not in opts})
        loop = _split_loop_options(opts)
        if self.fixed is not None:
            if opts:
                raise ValueError(f"Method option(s) {', '.join(sorted(opts))} were given to a Proposer instance "
                                 f"({self.label}); configure the proposer itself.")
            proposer = self.fixed
        else:
            proposer = functools.partial(_build, self.method, model, opts, generation_config)
        return _decode(model, input_ids, logits_processor, stopping_criteria, generation_config, proposer, loop,
                       streamer=dropped.get("streamer"), prompt_streamed=True, **kwargs)


def decoding_method(method, **defaults) -> Callable:
    """A decoding callable for ``model.generate(custom_generate=...)``.

    ``method`` is a method name (see :func:`available_methods`) or a :class:`~hf_specdec.proposers.Proposer`
    instance of your own (it is re-initialised by ``begin`` at every call).

    Example:
        >>> out = model.generate(**inputs, max_new_tokens=64, do_sample=False,
        ...                      custom_generate=hf_specdec.decoding_method("prompt_lookup"))

    Method options (``drafter=``, ``prompt_lookup_num_tokens=``...) may be given here or to ``generate``;
    ``assistant_model=`` and ``streamer=`` given to ``generate`` work as in the folder form.
    """
    return _DecodingMethod(method, dict(defaults))


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
    record = registry.get(method)  # an unknown name fails first
    # a misspelt option too: the method's record names it (resolve, below); transformers' own speculative arguments
    # (assistant_early_exit=, use_mtp=, ...) are options of method 'auto', refused by the others with its name
    opts = _take_options(kwargs, model, method)
    if assistant_model is not None:
        if opts.get("drafter") is not None:
            raise ValueError("Pass the draft model once: assistant_model= or drafter=, not both.")
        opts["drafter"] = assistant_model
    _check_lengths(inputs if inputs is not None else kwargs.get("input_ids"), generation_config, kwargs)
    reason = unsupported_call(model, generation_config, kwargs)
    if reason is not None:  # before generate(): it would switch to continuous batching for cache_implementation='paged'
        raise ValueError(reason)
    stop, generation_config = _take_stop_strings(model, generation_config, kwargs)
    if stop is not None:
        stopping_criteria = StoppingCriteriaList([*(stopping_criteria or []), stop])
    loop = _split_loop_options(opts)
    record.resolve(dict(opts))  # option errors before generate() runs; the proposer is built with the call's config

    def run(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None, **model_kwargs):
        proposer = functools.partial(_build, method, model, dict(opts), generation_config)
        return _decode(model, input_ids, logits_processor, stopping_criteria, generation_config, proposer, loop,
                       streamer=streamer, **model_kwargs)

    # the class's generate: where a model folder carries a custom_generate/generate.py, transformers made that the
    # instance's generate, which would call this function again
    return type(model).generate(
        model,
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


def unsupported_call(model, generation_config, kwargs) -> str | None:
    """:func:`hf_specdec.engine.unsupported_mode` of a ``generate()`` call: its ``generation_config`` (or the
    model's) updated by its settings in ``kwargs``."""
    import copy

    from transformers import GenerationConfig

    base = generation_config if isinstance(generation_config, GenerationConfig) else model.generation_config
    config = copy.deepcopy(base)
    try:
        config.update(**{k: v for k, v in kwargs.items() if hasattr(config, k)})
    except ValueError:  # an invalid setting: generate() reports it
        return None
    return unsupported_mode(config)


def _check_lengths(prompt, generation_config, kwargs) -> None:
    if isinstance(prompt, torch.Tensor) and prompt.dim() >= 1 and prompt.shape[-1] == 0:
        raise ValueError("The prompt is empty: speculative decoding needs at least one prompt token.")
    max_new = kwargs.get("max_new_tokens")
    if max_new is None and generation_config is not None:
        max_new = generation_config.max_new_tokens
    if max_new is not None and max_new < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new}.")
