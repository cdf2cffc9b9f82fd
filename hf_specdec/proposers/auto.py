"""``auto``: transformers' own speculative arguments, run in this library's loop.

A call that already asks transformers for speculative decoding adds one argument and keeps the rest::

    model.generate(**inputs, assistant_model=assistant, max_new_tokens=64)                       # transformers
    model.generate(**inputs, assistant_model=assistant, max_new_tokens=64,
                   custom_generate="hf_specdec/auto", trust_remote_code=True)                    # this library

The arguments are read as ``generate()`` reads them (``GenerationMixin._get_candidate_generator``, transformers
5.24), in its order of precedence, and each selects the method of this library that drafts the same way:

==============================================  ======================================================
``assistant_early_exit=E``                      ``layerskip`` (``exit_layer=E``, the target's own head)
``prompt_lookup_num_tokens=K``                  ``prompt_lookup`` (at most K drafts, n-grams up to
                                                ``max_matching_ngram_size``, default 2 as transformers')
``use_mtp=True``                                ``mtp`` (the MTP layers of the target's own checkpoint)
a Gemma 4 / Gemma 4 Unified assistant           ``gemma4_assistant`` (the target's shared KV states)
``speculation_type="dflash"``                   ``dflash`` (e.g. a Muse Glimmer assistant)
``assistant_model`` + ``tokenizer`` +           ``universal`` (a drafter with another tokenizer)
``assistant_tokenizer``
``assistant_model``                             ``assisted``
==============================================  ======================================================

The draft length: transformers reads ``num_assistant_tokens``, ``num_assistant_tokens_schedule`` and
``assistant_confidence_threshold`` from the assistant's generation config (the target's for early exit); here a
value given to the call (or its generation config) comes first, then the assistant's. ``"constant"`` (transformers'
default schedule) with a ``num_assistant_tokens`` that was set drafts that many tokens every step; the ``"heuristic"``
schedules, or nothing set, take this library's adaptive length (from measured costs and acceptance), which is what
the heuristics approximate; a confidence threshold that was set stops a chain after a draft less likely than it
(``assisted`` / ``layerskip``). The output is the target's either way: greedy identical to ``generate()``, sampling
exact. ``assistant_ensemble_weight`` (transformers' lossy mixture) is refused. The chosen method drafts as transformers'
candidate generator does, without the hybrid drafting the model-drafter methods take by default
(:func:`~hf_specdec.proposers.hybrid.alone`).
"""

from __future__ import annotations

import torch

from ..draft_models import load_draft_model
from ..registry import DrafterSpec, Method, Option
from .build import build_proposer
from .hybrid import alone

GEMMA4_ASSISTANTS = ("Gemma4Assistant", "Gemma4UnifiedAssistant")  # class name prefixes transformers checks
TRANSFORMERS_NGRAM = 2  # transformers' prompt lookup default for max_matching_ngram_size


def _setting(name: str, type_, doc: str, choices: tuple = ()) -> Option:
    return Option(name, type_, None, doc, choices=choices, generation_setting=True)


OPTIONS = (
    _setting("assistant_early_exit", int, "E: the target's first E layers and its head draft (method layerskip)"),
    _setting("prompt_lookup_num_tokens", int, "the most drafts copied from the prompt and output (prompt_lookup)"),
    _setting("max_matching_ngram_size", int, f"the longest n-gram prompt lookup matches (default "
             f"{TRANSFORMERS_NGRAM}, as transformers')"),
    _setting("use_mtp", bool, "draft with the MTP layers of the target's own checkpoint (method mtp)"),
    _setting("speculation_type", str, "'dflash': the assistant is a block-diffusion drafter (method dflash)",
             choices=("dflash",)),
    Option("tokenizer", object, None, "the target's tokenizer; with assistant_tokenizer: an assistant with another "
           "tokenizer (method universal)"),
    Option("assistant_tokenizer", object, None, "the assistant's tokenizer (method universal)"),
    _setting("num_assistant_tokens", int, "drafts per step (default: the assistant's generation config's; with the "
             "'constant' schedule a fixed length, else the adaptive one)"),
    _setting("num_assistant_tokens_schedule", str, "'constant': num_assistant_tokens every step; 'heuristic' / "
             "'heuristic_transient': the adaptive length (default: the assistant's generation config's)",
             choices=("constant", "heuristic", "heuristic_transient")),
    _setting("assistant_confidence_threshold", float, "stop a chain after a draft less likely than this (default: "
             "the assistant's generation config's, when set there)"),
    _setting("assistant_ensemble_weight", float, "transformers' lossy ensemble verification: refused"),
)

_LENGTH_FIELDS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")


def _assistant_settings(opts: dict, source) -> dict:
    """The three draft-length fields: the call's, else those set in ``source``'s generation config."""
    config = getattr(source, "generation_config", None)
    return {k: opts[k] if opts[k] is not None else getattr(config, k, None) for k in _LENGTH_FIELDS}


def _length_options(settings: dict, confidence: str | None = "confidence") -> dict:
    """This library's draft-length options for transformers' fields (see the module docstring)."""
    out = {}
    tokens, schedule = settings["num_assistant_tokens"], settings["num_assistant_tokens_schedule"]
    if tokens is not None and schedule in (None, "constant"):
        out.update(num_speculative_tokens=int(tokens), draft_length_schedule="constant")
    threshold = settings["assistant_confidence_threshold"]
    if confidence is not None and threshold is not None and threshold > 0:
        out[confidence] = float(threshold)
    return out


def choose(target, opts: dict) -> tuple[str, dict]:
    """``(method, its options)`` for transformers' arguments ``opts`` (:data:`OPTIONS` and ``drafter``, the
    ``assistant_model``), in ``generate()``'s order of precedence."""
    if opts["assistant_ensemble_weight"] is not None:
        raise ValueError("assistant_ensemble_weight verifies against a mixture of target and assistant: the output is "
                         "no longer the target's (lossy). hf_specdec runs lossless methods only; drop it.")
    assistant = opts["drafter"]
    if opts["assistant_early_exit"] is not None:
        return "layerskip", {"exit_layer": opts["assistant_early_exit"], "exit": "plain",
                             **_length_options(_assistant_settings(opts, target))}
    if opts["prompt_lookup_num_tokens"] is not None:
        return "prompt_lookup", {"prompt_lookup_num_tokens": opts["prompt_lookup_num_tokens"],
                                 "max_matching_ngram_size": opts["max_matching_ngram_size"] or TRANSFORMERS_NGRAM}
    if opts["use_mtp"]:
        source = getattr(target, "name_or_path", None)
        if not source:
            raise ValueError("use_mtp=True drafts with the MTP layers of the target's checkpoint, but this target "
                             "was not loaded from one (no name_or_path). Load it with from_pretrained, or use "
                             "custom_generate='hf_specdec/mtp' with drafter=<checkpoint with MTP layers>.")
        return "mtp", {"drafter": source}
    if assistant is None:
        raise ValueError(
            "custom_generate='hf_specdec/auto' runs transformers' own speculative arguments in hf_specdec's loop, and "
            "this call has none: pass assistant_model=<draft model> (with tokenizer= and assistant_tokenizer= when it "
            "has another tokenizer; speculation_type='dflash' for a block-diffusion assistant), "
            "prompt_lookup_num_tokens=K, assistant_early_exit=E or use_mtp=True — or name a method: "
            "custom_generate='hf_specdec/<method>'.")
    if type(assistant).__name__.startswith(GEMMA4_ASSISTANTS):
        return "gemma4_assistant", {"drafter": assistant,
                                    **_length_options(_assistant_settings(opts, assistant), confidence=None)}
    if opts["speculation_type"] == "dflash":
        return "dflash", {"drafter": assistant}
    tokenizers = (opts["tokenizer"], opts["assistant_tokenizer"])
    if any(t is not None for t in tokenizers):
        if any(t is None for t in tokenizers):
            raise ValueError("An assistant with another tokenizer needs both tokenizer=<the target's tokenizer> and "
                             "assistant_tokenizer=<the assistant's>, as transformers' universal assisted decoding; "
                             "give both, or neither when the assistant shares the target's tokenizer.")
        return "universal", {"drafter": assistant, "tokenizer": opts["tokenizer"],
                             "assistant_tokenizer": opts["assistant_tokenizer"],
                             **_length_options(_assistant_settings(opts, assistant), confidence=None)}
    return "assisted", {"drafter": assistant, **_length_options(_assistant_settings(opts, assistant))}


def _build(target, opts):
    method, chosen = choose(target, opts)
    return build_proposer(method, target, **alone(method, chosen))  # the drafts transformers' generator would make


METHOD = Method(
    name="auto",
    summary="transformers' own speculative arguments (assistant_model=, prompt_lookup_num_tokens=, "
            "assistant_early_exit=, use_mtp=, speculation_type=, assistant_tokenizer=) run by the matching method",
    description="A drop-in for a call that already asks transformers for speculative decoding: add "
                "custom_generate='hf_specdec/auto' (with trust_remote_code=True) and keep every other argument. "
                "The arguments are read as transformers' generate() reads them, in its order of precedence "
                "(assistant_early_exit, prompt_lookup_num_tokens, use_mtp, a Gemma 4 assistant, "
                "speculation_type='dflash', tokenizer= with assistant_tokenizer=, assistant_model=), and the method of "
                "this library that drafts the same way runs in its loop: layerskip, prompt_lookup, mtp, "
                "gemma4_assistant, dflash, universal or assisted, with its trees, batching and adaptive draft "
                "lengths. The assistant's num_assistant_tokens / num_assistant_tokens_schedule / "
                "assistant_confidence_threshold are honoured ('constant' with a set length: that many drafts; the "
                "heuristic schedules: the adaptive length). Lossless: greedy output identical, sampling exact.",
    build=_build,
    options=OPTIONS,
    router=True,
    drafter=DrafterSpec(
        doc="transformers' assistant_model",
        hint="pass assistant_model=<model> (or a folder / Hub id of a causal LM; optional: prompt lookup, early exit "
             "and MTP draft without one)",
        load=load_draft_model,
        accepts=torch.nn.Module,
        required=False,
        example="assistant_model=assistant)             # as in transformers: prompt_lookup_num_tokens=10, ...",
    ),
)
