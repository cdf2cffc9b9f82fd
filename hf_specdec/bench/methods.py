"""What the bench runs: :class:`BenchMethod` entries built from method strings (:func:`build_methods`: registered
methods, their shorthands and options) and the bench's own baselines (``plain_kernels``, ``oracle:K``, transformers'
modes, ``plain_fp32``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import registry
from ..entry import decoding_method
from ..kernels import padded_plain_decoding


@dataclass
class BenchMethod:
    name: str
    kwargs: dict = field(default_factory=dict)
    oracle_k: int | None = None
    hf_specdec: bool = False  # returns speculative_stats
    context: object = None  # a context manager factory ``f(model)`` around its generate call
    caches: tuple = ()  # SuffixCaches it shares across calls: emptied after the warm-up and at each prompt set
    model: object = None  # another model its generate call runs on (plain_fp32); None: the bench's target


BASELINES = ("plain", "plain_kernels", "oracle:K", "hf_prompt_lookup:K", "hf_assisted", "hf_early_exit:E")
FP32_BASELINE = "plain_fp32"  # stock generate() on the target in float32, beside a half-precision target


def method_names() -> list[str]:
    """Every name a bench method string may start with: the registered methods and their shorthands, then the
    baselines (``oracle:K`` etc. as written in :data:`BASELINES`).

    Example:
        >>> method_names()[:3]
        ['prompt_lookup', 'assisted', 'eagle3']
    """
    return list(dict.fromkeys(n for m in registry.methods() for n in [m.name, *m.shorthands])) + list(BASELINES)


def check_method_name(spec: str) -> str:
    """``spec`` if its name (the part before the first ``:``) is a registered method, a shorthand or a baseline;
    else :class:`~hf_specdec.registry.UnknownMethodError` listing them. The options after the name are checked by
    :func:`build_methods`.

    Example:
        >>> check_method_name("eagle3_chain:3")
        'eagle3_chain:3'
    """
    base = spec.partition(":")[0]
    registered = method_names()[: -len(BASELINES)]
    if base in registered or base in {b.partition(":")[0] for b in BASELINES}:
        return spec
    raise registry.UnknownMethodError(f"Unknown benchmark method {spec!r}: the methods are {', '.join(registered)}, "
                                      f"and the baselines {', '.join(BASELINES)}.")


def _baseline(base: str, arg: str, name: str, drafter) -> BenchMethod | None:
    """The bench's own comparisons (not speculative methods of the registry)."""
    if base == "plain_kernels":  # plain greedy decoding with the loop's CPU kernel trick
        return BenchMethod(name, context=padded_plain_decoding)
    if base == "oracle":  # drafts = the baseline's own output: what the loop itself costs
        return BenchMethod(name, oracle_k=int(arg or 4), hf_specdec=True)
    if base == "hf_prompt_lookup":  # transformers' built-in prompt lookup
        return BenchMethod(name, {"prompt_lookup_num_tokens": int(arg or 10)})
    if base == "hf_assisted":  # transformers' built-in assisted decoding
        if drafter is None:
            raise ValueError("method 'hf_assisted' needs --drafter")
        return BenchMethod(name, {"assistant_model": drafter})
    if base == "hf_early_exit":  # transformers' own LayerSkip: assistant_early_exit (a second cache, all layers)
        return BenchMethod(name, {"assistant_early_exit": int(arg or 4)})
    return None


def fp32_baseline(model32) -> BenchMethod:
    """``plain_fp32``: stock greedy ``generate()`` on ``model32``, the bench's target loaded in float32, run beside a
    half-precision target (its forwards are not probed: no τ or ceiling). Every method then gets
    ``speedup_vs_fp32``.

    Example::

        model32, _ = load_smollm2(dtype=torch.float32)
        methods = build_methods(["prompt_lookup"]) + [fp32_baseline(model32)]
        result = run_bench(model_bf16, tok, methods, ["gsm8k"], limit=5, max_new_tokens=128)
    """
    if model32.dtype != torch.float32:
        raise ValueError(f"plain_fp32 runs a float32 model, got {model32.dtype}.")
    return BenchMethod(FP32_BASELINE, model=model32.eval())


EXACT_ALIASES = {"exact=0": "rounding=fast", "exact=1": "rounding=auto"}  # the bench's older spelling of rounding=


def build_methods(names: list[str], drafter=None, **drafters) -> list[BenchMethod]:
    """Benchmark entries from method strings.

    A string is a registered method or one of its shorthands, ``NAME[:ARG][:KEY=VALUE...]`` (``hf-specdec methods``
    lists them: e.g. ``eagle3:2-3-4``, ``eagle3_chain:3``, ``dflash_fixed:8``,
    ``prompt_lookup:prompt_lookup_num_tokens=8``), or a baseline: ``plain`` (always run), ``plain_kernels`` (plain
    greedy decoding with the loop's CPU kernel trick), ``oracle:K``, ``hf_prompt_lookup:K``, ``hf_assisted``,
    ``hf_early_exit:E`` (transformers' ``assistant_early_exit=E``). ``KEY=VALUE`` ``rounding=fast|auto|exact`` runs a
    method with that half-precision rounding (the ``rounding`` option; ``exact=0`` / ``exact=1`` are older names of
    ``rounding=fast`` / ``auto``). ``suffix_cache=shared`` / ``hybrid=shared`` give the method one
    :class:`~hf_specdec.SuffixCache` for all its calls of a prompt set (emptied after the warm-up and when the next
    set starts, so a prompt only ever drafts from the outputs of earlier prompts). ``drafters`` gives a method's
    drafter (a module) by its CLI flag, which is the method's name unless its record says otherwise (``drafter`` for
    ``assisted``; it is also the draft model of ``hf_assisted``).
    """
    by_flag = {"drafter": drafter, **drafters}
    methods = []
    for name in names:
        base, _, arg = name.partition(":")
        if base == "plain":
            continue  # always run as the baseline
        entry = _baseline(base, arg, name, drafter)
        if entry is not None:
            methods.append(entry)
            continue
        check_method_name(name)
        record, opts = registry.parse_spec(":".join(EXACT_ALIASES.get(p, p) for p in name.split(":")))
        if record.drafter is not None:
            flag = record.drafter_flag
            module = by_flag.get(flag)
            if module is None and record.drafter.required:
                raise ValueError(f"method {name!r} needs --{flag}" + (" <drafter>" if flag != "drafter" else ""))
            opts["drafter"] = module
        caches = []
        for key in ("suffix_cache", "hybrid"):  # KEY=shared: one SuffixCache across this method's calls
            if opts.get(key) == "shared":
                from ..proposers.suffix_index import SuffixCache

                opts[key] = SuffixCache()
                caches.append(opts[key])
        methods.append(BenchMethod(name, {"custom_generate": decoding_method(record.name, **opts)}, hf_specdec=True,
                                   caches=tuple(caches)))
    return methods
