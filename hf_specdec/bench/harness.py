"""``hf-specdec bench``: every method side by side with plain ``generate()`` and transformers' own modes.

In one process, after a warm-up, each prompt is run by the baseline (plain greedy ``generate()``) and every method,
in an order that rotates from prompt to prompt, so that drift of a shared, noisy machine falls on all of them.
Every output is compared with the baseline token for token; a mismatch is reported, never averaged away.

The *ceiling* of a run is the speedup its forwards would give with zero overhead: with ``c(q)`` the measured cost of
a target forward over ``q`` new tokens (in one-token steps), a run that committed ``n`` tokens after the prefill
in forwards of sizes ``q_1..q_s`` could at best be ``n / sum_i c(q_i)`` times faster than plain decoding.
``efficiency = achieved decode speedup / ceiling``. The oracle proposer (drafts = the baseline's own output)
measures what the engine itself costs. On a CPU, ``plain_kernels`` is plain greedy ``generate()`` with the kernel
trick the speculative loop uses (one row computed as two through ``(W @ x.T).T``,
:func:`hf_specdec.kernels.padded_plain_decoding`): when it runs, every method also gets ``speedup_vs_kernels``,
its speedup over that kernel-matched baseline on the same prompts, i.e. speculation's own share.

A half-precision target (``hf-specdec bench --dtype bfloat16``) is token-identical to plain decoding only up to
rounding (on a CPU one row's verification rounds as one-token steps where the kernels allow it,
:class:`hf_specdec.kernels.CpuKernelRunner`; a batch's rows, and other devices, may round differently), so a
mismatch there is a *match rate*, not an error; and the same target in float32 runs stock greedy ``generate()`` on every prompt
as one more baseline, ``plain_fp32`` (:func:`fp32_baseline`; its own model, in the same rotating order), so that
every method gets its speedup over what float32 gives.

JSON schema (``schema: "hf_specdec.bench/1"``):

* ``machine``: platform, cpu count, torch / transformers versions, device
* ``config``: the command-line options (``dtype``: the target's dtype as it ran, float32 after a fallback)
* ``cost_curve_ms``: ``{q: median milliseconds of a target forward over q new tokens, ~256-token cache}``, as the
  loop runs it (CPU verification kernels on for q >= 2 unless turned off); ``cost_curve_model_kernels_ms``: the same
  with the model's own kernels (CPU only)
* ``runs``: one record per (method, prompt): ``method, dataset, prompt_id, new_tokens, seconds,
  prefill_seconds, target_forwards, forward_sizes, target_forward_seconds, drafter_forward_seconds, tau,
  ceiling, identical, loaded, peak_mem_mb`` (peak over the memory in use before the call: RSS on CPU, allocated
  memory on CUDA), ``peak_abs_mb`` (absolute peak), ``steps`` (target forwards after the prefill: the loop's
  verification steps, stock ``generate()``'s decoding steps), ``host_ms_per_step`` (see below), ``stats``
  (hf_specdec's ``speculative_stats``, when available) and ``dtype`` (of the model that ran it: the target's, float32
  for ``plain_fp32``, whose forwards are not probed: no ``tau``, ``ceiling`` or ``host_ms_per_step``)
* ``summary``: per (method, dataset): ``prompts, tau, tokens_per_s, speedup_median, speedup_total, ceiling,
  efficiency, draft_share, loop_overhead (time outside the target's forwards and the drafting per target forward,
  relative to one 1-token forward), host_ms_per_step, syncs_per_step, peak_mem_mb, peak_abs_mb, mismatches``,
  ``proposed_drafts`` and ``accepted_drafts`` (summed over the prompts; ``None`` for a run without
  ``speculative_stats``), when ``plain_kernels`` ran, ``speedup_vs_kernels`` (median per-prompt ratio against it),
  when ``plain_fp32`` ran, ``speedup_vs_fp32`` (the same against it), and for a half-precision target ``match_rate``
  (the share of the method's runs token-identical to plain ``generate()`` in the same dtype; for ``plain_fp32``,
  informative)
* ``syncs`` (unless ``count_syncs=False``): ``{dataset: {method: {"count", "steps", "per_step", "by_name"}}}``, the
  host reads of tensor values (:class:`hf_specdec.syncs.SyncCounter`) of one call per method on the dataset's first
  prompt (batch)
* ``memory_check`` (with ``--memory-check N``): resident memory after each of N consecutive calls per method
* ``background_load``: ``{"mode": "off" | "on" | "both", "processes", "pids"}`` (see below)

Background load (``background_load="on"`` / ``"both"``, ``hf-specdec bench --background-load``): a separate process
keeps one CPU core busy with a pure-Python loop (:func:`hf_specdec.bench.load.background_load`) while the timed rows
run; the warm-up and the cost curve always run quiet. ``"on"`` runs every row under the load (the summary keeps its
usual keys). ``"both"`` runs each prompt twice in the same invocation, quiet and loaded, alternating which comes
first from prompt to prompt (the load is started before the loaded round and terminated after it), so that drift
falls on both conditions alike. Every run record then has ``loaded: true/false``, and each summary row holds the quiet
figures under the usual keys and the loaded ones beside them with the suffix ``_loaded`` (``tau_loaded``,
``proposed_drafts_loaded``, ``speedup_median_loaded``, ``speedup_vs_kernels_loaded``, ...; see
:data:`LOADED_FIELDS`). Every output, loaded or not, is compared with the baseline of the same round.

Per-step overheads. ``host_ms_per_step`` is the wall time of a call outside the target's forwards (the loop's own
work, the drafting, generate()'s set-up) over its steps (target forwards after the prefill): on a CPU the forwards are
timed with ``perf_counter``, on CUDA with events (the forwards' device time), so there it is the part of a step the
device does not spend in the target. ``syncs_per_step`` is the number of host reads of tensor values (each one a
host-device synchronisation on a GPU; :mod:`hf_specdec.syncs`) over the same steps. Counting intercepts every torch
call, which would slow a timed call, so the reads are counted in one extra, untimed call per method and dataset (its
first prompt batch, after the warm-up); a call's count is a property of its code path, not of the machine.

Besides ``bench.json``, :func:`write_outputs` writes ``bench.md`` (the table :func:`markdown` prints), ``bench.csv``
(the summary, one row per method and dataset, the same keys as ``summary``) and PNG plots.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import registry
from ..dtypes import dtype_name
from ..entry import decoding_method
from ..kernels import padded_plain_decoding
from ..runner_choice import runner_for
from ..syncs import SyncCounter
from . import load as load_mod
from .data import DATASETS, load
from .oracle import OracleProposer

SCHEMA = "hf_specdec.bench/1"


# ----------------------------------------------------------------------------------------------------- probes
class ForwardProbe:
    """Counts and times the forwards of a module (hooks); records the number of new tokens of each.

    For a decoder-only model the count and sizes come from its *last decoder layer*: a target forward is what ends
    in it, whether it ran through the model's ``forward`` or in pieces (LayerSkip's verification runs the late
    layers alone; transformers' ``assistant_early_exit`` drafts with the first layers only, which is no target
    forward). The times are those of the model's ``forward`` calls (``seconds`` may then be shorter than ``sizes``):
    with ``time_calls``, wall time (``perf_counter``) on a CPU and, on CUDA, the device time between two events
    recorded around each call (no synchronisation; read once the caller has synchronised, after the call).
    ``by_last_layer=False`` counts the module's own ``forward`` calls only (a drafter; a model sharing its layers
    with another, whose last layer also runs for the other).
    """

    def __init__(self, module, time_calls: bool, by_last_layer: bool = True):
        self.module = module
        self.time_calls = time_calls
        self.cuda = time_calls and next(module.parameters()).device.type == "cuda"
        self.calls: list[int] = []  # new tokens of each forward() call
        self.ends: list[int] = []  # new tokens of each call of the last decoder layer
        self._seconds: list[float] = []
        self._events: list[tuple] = []  # CUDA: (start, end) per call, read by ``seconds``
        self._t0 = None
        self._handles = [
            module.register_forward_pre_hook(self._pre, with_kwargs=True),
            module.register_forward_hook(self._post),
        ]
        layers = getattr(getattr(module, "base_model", None), "layers", None) if by_last_layer else None
        if isinstance(layers, torch.nn.ModuleList) and len(layers):
            self._handles.append(layers[-1].register_forward_pre_hook(self._end, with_kwargs=True))

    @property
    def sizes(self) -> list[int]:
        return self.ends if self.ends else self.calls

    @property
    def seconds(self) -> list[float]:
        """Seconds of each ``forward`` call (zeros without ``time_calls``); on CUDA, read after a synchronisation."""
        if self._events:
            self._seconds += [start.elapsed_time(end) / 1000 for start, end in self._events]
            self._events = []
        return self._seconds

    def _end(self, module, args, kwargs):
        hidden = args[0] if args else kwargs.get("hidden_states")
        self.ends.append(int(hidden.shape[1]) if hidden is not None else 0)

    def _pre(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds", kwargs.get("hidden_states"))
        self.calls.append(int(ids.shape[1]) if isinstance(ids, torch.Tensor) and ids.dim() > 1 else 0)
        if self.cuda:
            self._t0 = torch.cuda.Event(enable_timing=True)
            self._t0.record()
        else:
            self._t0 = time.perf_counter()

    def _post(self, module, args, output):
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._t0, end))
        else:
            self._seconds.append(time.perf_counter() - self._t0 if self.time_calls else 0.0)

    def reset(self):
        self.calls, self.ends, self._seconds, self._events = [], [], [], []

    def remove(self):
        for h in self._handles:
            h.remove()


def _rss_mb() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _peak_rss_mb() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _reset_peak(device: torch.device) -> float:
    """Reset the peak-memory counter; return the current usage (MB)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device) / 2**20
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM (Linux)
    except OSError:
        pass
    return _rss_mb()


def _peak_since(device: torch.device, start: float) -> tuple[float, float]:
    """``(peak - start, absolute peak)`` in MB since ``_reset_peak``."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        peak = _peak_rss_mb()
    return max(peak - start, 0.0), peak


# ---------------------------------------------------------------------------------------------------- methods
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
BACKGROUND_LOAD_MODES = ("off", "on", "both")


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
    lists them: e.g. ``eagle3:2-3-4``, ``eagle3_chain:3``, ``dflash_fixed:8``, ``prompt_lookup:prompt_lookup_num_tokens=8``),
    or a baseline: ``plain`` (always run), ``plain_kernels`` (plain greedy decoding with the loop's CPU kernel trick),
    ``oracle:K``, ``hf_prompt_lookup:K``, ``hf_assisted``, ``hf_early_exit:E`` (transformers'
    ``assistant_early_exit=E``). ``KEY=VALUE`` ``rounding=fast|auto|exact`` runs a method with that half-precision
    rounding (the ``rounding`` option; ``exact=0`` / ``exact=1`` are older names of ``rounding=fast`` / ``auto``). ``suffix_cache=shared`` / ``hybrid=shared`` give the method one
    :class:`~hf_specdec.SuffixCache` for all its calls of a prompt set (emptied after the warm-up and when the next
    set starts, so a prompt only ever drafts from the outputs of earlier prompts). ``drafters`` gives a method's drafter (a module) by its
    CLI flag, which is the method's name unless its record says otherwise (``drafter`` for ``assisted``; it is also
    the draft model of ``hf_assisted``).
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
                from ..proposers.suffix import SuffixCache

                opts[key] = SuffixCache()
                caches.append(opts[key])
        methods.append(BenchMethod(name, {"custom_generate": decoding_method(record.name, **opts)}, hf_specdec=True,
                                   caches=tuple(caches)))
    return methods


# ------------------------------------------------------------------------------------------------- the bench
def forward_cost_curve(model, input_ids, sizes, reps: int = 5, kernels: bool | None = None) -> dict[int, float]:
    """Median time (ms) of a forward over q new tokens after a prefill of ``input_ids`` (sizes interleaved), fed as
    the decoding loop feeds a verification: a 4D mask, through the target runner the loop would use
    (:func:`~hf_specdec.runner_choice.runner_for`: the CPU kernel runner on a CPU unless ``kernels=False`` or
    ``HF_SPECDEC_VERIFY_KERNELS=0``), with the rounding a call with the default ``rounding`` runs."""
    from transformers import DynamicCache

    from ..tree import build_attention_mask

    device = model.device
    text_config = model.config.get_text_config()
    vocab = text_config.vocab_size
    bsz, past = input_ids.shape
    times = {q: [] for q in sizes}
    cache = DynamicCache()
    runner = runner_for(model, kernels=kernels)
    with torch.no_grad(), runner.session(cache, rounding=runner.rounding_for(None)) as target:  # as a default call
        model(input_ids=input_ids.to(device), cache=cache)
        valid = torch.ones(bsz, past, dtype=torch.bool, device=device)
        past_pos = torch.arange(past, device=device)[None].expand(bsz, -1)
        for _ in range(reps):
            for q in sizes:
                x = torch.randint(0, vocab, (bsz, q), device=device)
                pos = torch.arange(past, past + q, device=device)[None].expand(bsz, -1)
                causal = torch.ones(q, q, dtype=torch.bool, device=device).tril().expand(bsz, q, q)
                mask = build_attention_mask(text_config, valid, past_pos, pos, causal, model.dtype)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                target.forward(x, mask, pos)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times[q].append(time.perf_counter() - t0)
                cache.crop(-q)
    return {q: 1000 * statistics.median(v) for q, v in times.items()}


def _relative_cost(curve: dict[int, float], q: int) -> float:
    if q in curve:
        return curve[q] / curve[1]
    keys = sorted(curve)
    lo = max(k for k in keys if k <= q) if q >= keys[0] else keys[0]
    hi = min((k for k in keys if k >= q), default=keys[-1])
    if hi == lo:
        return curve[lo] * (q / lo) / curve[1]
    t = (q - lo) / (hi - lo)
    return (curve[lo] + t * (curve[hi] - curve[lo])) / curve[1]


def _encode(tokenizer, texts, device):
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                           tokenize=False) for t in texts]
    enc = tokenizer(chats, return_tensors="pt", padding=True, add_special_tokens=False)
    return {k: v.to(device) for k, v in enc.items()}


def run_bench(model, tokenizer, methods: list[BenchMethod], datasets: list[str], limit: int, max_new_tokens: int,
              batch_size: int = 1, drafter=None, out: str | None = None, memory_check: int = 0,
              progress: bool = True, config: dict | None = None, seed: int = 0,
              background_load: str = "off", curve_sizes: list[int] | None = None, warmup_tokens: int = 10**9,
              count_syncs: bool = True) -> dict:
    """Run the baseline and ``methods`` on the first ``limit`` prompts of each of ``datasets``; return the result
    (schema at the top of this module) and write it to ``out`` when given.

    ``curve_sizes``: the forward sizes of the cost curve (default 1..32); ``warmup_tokens``: tokens per warm-up call
    (default: ``max_new_tokens``); ``count_syncs``: count the host reads per step of every method (one extra, untimed
    call per method and dataset; the ``syncs`` entry and the ``syncs_per_step`` column).

    ``background_load``: ``"off"`` (default), ``"on"`` (every timed row under a synthetic load keeping one core
    busy) or ``"both"`` (each prompt quiet and loaded in turn; the summary holds both, loaded keys with the suffix
    ``_loaded``).

    Example::

        methods = build_methods(["plain_kernels", "prompt_lookup"])
        result = run_bench(model, tok, methods, ["gsm8k"], limit=5, max_new_tokens=128, background_load="both")
        print(markdown(result))
    """
    from tqdm.auto import tqdm

    if background_load not in BACKGROUND_LOAD_MODES:
        raise ValueError(f"background_load must be one of {', '.join(BACKGROUND_LOAD_MODES)}, "
                         f"got {background_load!r}.")
    for m in methods:  # transformers' assisted loop takes the draft model as it is: it must match the target
        assistant = m.kwargs.get("assistant_model")
        if assistant is not None and assistant.dtype != model.dtype:
            raise ValueError(f"{m.name}: the draft model is {assistant.dtype}, the target {model.dtype}; load it in "
                             "the target's dtype (registry.load_drafter(\"assisted\", folder, target) does).")
    device = model.device
    time_calls = True  # CPU: perf_counter around each forward; CUDA: events, read after the call's synchronisation
    probe = ForwardProbe(model, time_calls)
    dprobe = ForwardProbe(drafter, time_calls) if drafter is not None else None
    gen = dict(max_new_tokens=max_new_tokens, do_sample=False)
    prompts = {ds: load(ds, limit, seed) for ds in datasets}

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def one(method: BenchMethod | None, enc, reference=None, counter: SyncCounter | None = None):
        kwargs = dict(gen)
        if method is not None:
            kwargs.update(method.kwargs)
            if method.oracle_k is not None:
                kwargs["custom_generate"] = decoding_method(OracleProposer(reference, method.oracle_k))
            if method.hf_specdec:
                kwargs["return_dict_in_generate"] = True
        target = method.model if method is not None and method.model is not None else model
        if target is not model:  # plain_fp32: its own model, not probed (placed on its own under --device auto)
            enc = {k: v.to(target.device) for k, v in enc.items()}
        probe.reset()
        if dprobe is not None:
            dprobe.reset()
        start_mem = _reset_peak(device)
        sync()
        t0 = time.perf_counter()
        with (method.context(target) if method is not None and method.context else contextlib.nullcontext()), \
                (counter if counter is not None else contextlib.nullcontext()):
            out = target.generate(**enc, **kwargs)
        sync()
        seconds = time.perf_counter() - t0
        peak = _peak_since(device, start_mem)  # (delta, absolute)
        sequences = out.sequences if hasattr(out, "sequences") else out
        stats = getattr(out, "speculative_stats", None)
        return sequences, seconds, peak, stats

    def round_of(order, enc):
        """The baseline first (the oracles need its output), then the methods: one record each."""
        ref, t_ref, mem_ref, _ = one(None, enc)
        records = [(None, ref, t_ref, mem_ref, None, list(probe.sizes), list(probe.seconds), [])]
        for m in order:
            seq, secs, mem, stats = one(m, enc, ref)
            records.append((m, seq, secs, mem, stats, list(probe.sizes), list(probe.seconds),
                            list(dprobe.seconds) if dprobe is not None else []))
        return ref, records

    # ---- warm-up: every method once, short
    first = next(iter(prompts.values()))[:batch_size]
    enc0 = _encode(tokenizer, [p.text for p in first], device)
    gen["max_new_tokens"] = min(max_new_tokens, warmup_tokens)
    ref0, *_ = one(None, enc0)
    for m in methods:
        one(m, enc0, ref0)
    gen["max_new_tokens"] = max_new_tokens

    # ---- the cost of a forward over q new tokens, over a realistic cache (always without the background load)
    sizes = list(curve_sizes or range(1, 33))
    ctx = enc0["input_ids"][:1]
    ctx = ctx.repeat(1, max(1, 256 // ctx.shape[1] + 1))[:, :256].repeat(batch_size, 1)
    curve = forward_cost_curve(model, ctx, sizes)
    curve_own = forward_cost_curve(model, ctx, sizes, kernels=False) if device.type == "cpu" else None

    # ---- host reads per step: one untimed call per method on each dataset's first prompt (batch)
    syncs = {}
    if count_syncs:
        for ds, plist in prompts.items():
            enc = _encode(tokenizer, [p.text for p in plist[:batch_size]], device)
            syncs[ds] = _count_syncs(one, probe, methods, enc)

    # ---- the timed rows: per prompt (batch), one round per load condition
    conditions = {"off": (False,), "on": (True,), "both": (False, True)}[background_load]
    load_pids: list[int] = []

    def nothing():
        return contextlib.nullcontext()

    whole_run_load = (lambda: _loaded(load_pids)) if background_load == "on" else nothing
    round_load = (lambda: _loaded(load_pids)) if background_load == "both" else nothing

    runs = []
    total = sum((len(p) + batch_size - 1) // batch_size for p in prompts.values()) * len(conditions)
    bar = tqdm(total=total, desc="bench", disable=not progress, file=sys.stderr)
    step = 0
    try:
        with whole_run_load():  # "on": one load process for every timed round
            for ds, plist in prompts.items():
                for m in methods:  # a prompt set starts with empty cross-call caches
                    for cache in m.caches:
                        cache.clear()
                for i in range(0, len(plist), batch_size):
                    batch = plist[i:i + batch_size]
                    enc = _encode(tokenizer, [p.text for p in batch], device)
                    # the methods in an order that rotates from prompt to prompt; with both load conditions,
                    # which one comes first alternates too
                    order = methods[step % len(methods):] + methods[: step % len(methods)] if methods else []
                    for loaded in (conditions if step % 2 == 0 else conditions[::-1]):
                        with round_load() if loaded else nothing():  # "both": a load per loaded round
                            ref, records = round_of(order, enc)
                        runs.extend(_run_records(records, ref, curve, ds, batch, enc["input_ids"].shape[1], loaded,
                                                 model.dtype))
                        bar.update(1)
                    step += 1
    finally:
        bar.close()
        probe.remove()
        if dprobe is not None:
            dprobe.remove()

    result = {
        "schema": SCHEMA,
        "machine": _machine(device),
        "config": config or {},
        "background_load": {"mode": background_load, "processes": 1 if background_load != "off" else 0,
                            "pids": load_pids},
        "cost_curve_ms": curve,
        "cost_curve_model_kernels_ms": curve_own,
        "runs": runs,
        "syncs": syncs,
        "summary": summarize(runs, curve, syncs),
    }
    if memory_check:
        result["memory_check"] = _memory_check(model, tokenizer, methods, enc0, ref0, gen, memory_check, one)
    if out:
        write_outputs(result, out)
    return result


@contextlib.contextmanager
def _loaded(pids: list[int]):
    """:func:`~hf_specdec.bench.load.background_load` (one busy core), recording the load's process ids."""
    with load_mod.background_load(1) as procs:
        pids.extend(p.pid for p in procs)
        yield procs


def _count_syncs(one, probe: ForwardProbe, methods: list[BenchMethod], enc) -> dict:
    """``{method: {"count", "steps", "per_step", "by_name"}}``: the host reads of tensor values of one call of plain
    ``generate()`` and of each method on ``enc`` (:class:`~hf_specdec.syncs.SyncCounter`), over its steps (target
    forwards after the prefill). A model other than the bench's target (``plain_fp32``) is not probed: its steps are
    the new tokens."""
    report = {}
    ref = None
    for m in [None] + list(methods):
        counter = SyncCounter()
        seq, _, _, _ = one(m, enc, ref, counter=counter)
        if m is None:
            ref = seq
        if m is not None and m.model is not None:
            steps = int(seq.shape[1] - enc["input_ids"].shape[1]) - 1
        else:
            steps = len(probe.sizes) - 1
        steps = max(steps, 1)
        report[m.name if m is not None else "plain"] = {
            "count": counter.count, "steps": steps, "per_step": counter.count / steps,
            "by_name": dict(counter.by_name.most_common()),
        }
    return report


def _run_records(records, ref, curve, dataset, batch, prompt_len, loaded: bool, dtype: torch.dtype) -> list[dict]:
    """The ``runs`` entries of one round (the baseline and every method on one prompt batch); ``dtype``: the
    target's."""
    runs = []
    for m, seq, secs, mem, stats, fsizes, fsecs, dsecs in records:
        ran_in = m.model.dtype if m is not None and m.model is not None else dtype
        new_tokens = int(seq.shape[1] - prompt_len) * seq.shape[0]
        decode_sizes = fsizes[1:]
        n_decode = max(new_tokens - seq.shape[0], 0)
        cost = sum(_relative_cost(curve, q) for q in decode_sizes)
        forward_seconds = sum(fsecs)
        if stats and len(fsizes) > len(fsecs):  # forwards run in pieces (LayerSkip): the loop's own timing
            forward_seconds = stats["verify_seconds"]
        steps = len(decode_sizes)
        runs.append(dict(
            method=m.name if m else "plain", dataset=dataset, prompt_id=",".join(p.id for p in batch),
            new_tokens=new_tokens, seconds=secs, prefill_seconds=fsecs[0] if fsecs else None,
            target_forwards=len(fsizes), forward_sizes=decode_sizes, steps=steps,
            target_forward_seconds=forward_seconds, drafter_forward_seconds=sum(dsecs),
            # wall time outside the target's forwards per step (None: forwards not probed, e.g. plain_fp32)
            host_ms_per_step=1000 * (secs - forward_seconds) / steps if steps and fsecs else None,
            tau=(n_decode / seq.shape[0]) / len(decode_sizes) if decode_sizes else None,
            ceiling=(n_decode / seq.shape[0]) / cost if cost else None,
            identical=bool(seq.shape == ref.shape and torch.equal(seq.cpu(), ref.cpu())),
            loaded=loaded, peak_mem_mb=mem[0], peak_abs_mb=mem[1], stats=stats, batch=len(batch),
            dtype=dtype_name(ran_in),
        ))
    return runs


def _memory_check(model, tokenizer, methods, enc, ref, gen, calls, one):
    """Resident memory (MB) after each of ``calls`` consecutive generate calls per method."""
    report = {}
    for m in [None] + methods:
        rss = []
        for _ in range(calls):
            one(m, enc, ref)
            gc.collect()
            rss.append(_rss_mb() if model.device.type != "cuda" else torch.cuda.memory_allocated() / 2**20)
        tail = rss[len(rss) // 2:]
        report[m.name if m else "plain"] = {
            "rss_mb": rss,
            "growth_mb_second_half": tail[-1] - tail[0] if len(tail) > 1 else 0.0,
        }
    return report


def _machine(device):
    import transformers

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
    }


LOADED_FIELDS = ("tau", "proposed_drafts", "accepted_drafts", "tokens_per_s", "speedup_median", "speedup_total",
                 "speedup_vs_kernels", "speedup_vs_fp32", "ceiling", "efficiency", "draft_share", "loop_overhead",
                 "host_ms_per_step", "mismatches", "match_rate")
"""The summary keys that also appear with the suffix ``_loaded`` when the bench ran with ``background_load="both"``."""


def summarize(runs: list[dict], curve: dict[int, float], syncs: dict | None = None) -> list[dict]:
    """One row per (method, dataset) (keys in the module's schema). Runs of both load conditions: the quiet figures
    under the usual keys, the loaded ones of the same method and dataset beside them (:data:`LOADED_FIELDS` with
    the suffix ``_loaded``). ``syncs``: the bench's ``syncs`` entry (``syncs_per_step``; ``None`` without it)."""
    quiet = [r for r in runs if not r.get("loaded")]
    loaded = [r for r in runs if r.get("loaded")]
    rows = _summarize(quiet if quiet and loaded else runs, curve)
    for row in rows:
        row["syncs_per_step"] = ((syncs or {}).get(row["dataset"], {}).get(row["method"]) or {}).get("per_step")
    if not quiet or not loaded:
        return rows
    under_load = {(r["dataset"], r["method"]): r for r in _summarize(loaded, curve)}
    for row in rows:
        other = under_load.get((row["dataset"], row["method"]), {})
        row.update({f"{key}_loaded": other[key] for key in LOADED_FIELDS if key in other})
    return rows


def mismatches(result: dict) -> int:
    """How many runs of a bench result (any method, any load condition) differ from their baseline."""
    return sum(not r["identical"] for r in result["runs"])


def _summarize(runs: list[dict], curve: dict[int, float]) -> list[dict]:
    by_prompt = {}
    for r in runs:
        by_prompt.setdefault((r["dataset"], r["prompt_id"]), {})[r["method"]] = r
    rows = []
    methods = list(dict.fromkeys(r["method"] for r in runs))
    datasets = list(dict.fromkeys(r["dataset"] for r in runs))
    t1 = curve[1] / 1000
    # a half-precision target: outputs identical to plain decoding up to rounding, so a match rate per row
    half = any(r["method"] == "plain" and r.get("dtype", "float32") != "float32" for r in runs)
    for ds in datasets:
        for m in methods:
            pairs = [(g["plain"], g[m]) for (d, _), g in by_prompt.items() if d == ds and m in g and "plain" in g]
            if not pairs:
                continue
            base = [p for p, _ in pairs]
            mine = [r for _, r in pairs]
            ratios = [b["seconds"] / r["seconds"] for b, r in pairs]
            taus = [r["tau"] for r in mine if r["tau"]]
            ceilings = [r["ceiling"] for r in mine if r["ceiling"]]
            # achieved speedup of the decode phase (prefill removed from both sides), against the ceiling
            dec = [((b["seconds"] - (b["prefill_seconds"] or 0)) / max(r["seconds"] - (r["prefill_seconds"] or 0), 1e-9))
                   for b, r in pairs]
            eff = [d / c for d, c in zip(dec, [r["ceiling"] or 1 for r in mine])]
            draft = [r["stats"]["draft_seconds"] / r["seconds"] for r in mine if r.get("stats")]
            if not draft:
                draft = [r["drafter_forward_seconds"] / r["seconds"] for r in mine if r["drafter_forward_seconds"]]
            overhead = [
                (r["seconds"] - r["target_forward_seconds"]
                 - max(r["drafter_forward_seconds"], (r.get("stats") or {}).get("draft_seconds", 0.0)))
                / max(r["target_forwards"], 1) / t1 for r in mine if r["target_forward_seconds"]
            ]
            rows.append(dict(
                method=m, dataset=ds, prompts=len(pairs),
                tau=statistics.mean(taus) if taus else None,
                tokens_per_s=sum(r["new_tokens"] for r in mine) / sum(r["seconds"] for r in mine),
                speedup_median=statistics.median(ratios),
                speedup_total=sum(b["seconds"] for b in base) / sum(r["seconds"] for r in mine),
                ceiling=statistics.mean(ceilings) if ceilings else None,
                efficiency=statistics.median(eff) if m != "plain" and ceilings else None,
                draft_share=statistics.mean(draft) if draft else 0.0,
                loop_overhead=statistics.median(overhead) if overhead else None,
                host_ms_per_step=(statistics.median(h for r in mine if (h := r.get("host_ms_per_step")) is not None)
                                  if any(r.get("host_ms_per_step") is not None for r in mine) else None),
                peak_mem_mb=max(r["peak_mem_mb"] for r in mine),
                peak_abs_mb=max(r["peak_abs_mb"] for r in mine),
                mismatches=sum(not r["identical"] for r in mine),
                proposed_drafts=(sum(r["stats"]["proposed_drafts"] for r in mine)
                                 if all(r.get("stats") for r in mine) else None),
                accepted_drafts=(sum(r["stats"]["accepted_drafts"] for r in mine)
                                 if all(r.get("stats") for r in mine) else None),
            ))
            for base, key in (("plain_kernels", "speedup_vs_kernels"), (FP32_BASELINE, "speedup_vs_fp32")):
                pairs = [(g[base], g[m]) for (d, _), g in by_prompt.items() if d == ds and m in g and base in g]
                if pairs:  # the median per-prompt ratio against that baseline
                    rows[-1][key] = statistics.median(b["seconds"] / r["seconds"] for b, r in pairs)
            if half:
                rows[-1]["match_rate"] = sum(r["identical"] for r in mine) / len(mine)
                bits = {r["stats"].get("exact_bits") for r in mine if r.get("stats")}
                rows[-1]["exact_bits"] = None if not bits or None in bits else "yes" if bits == {True} else "no"
    return rows


_COLUMNS = (  # (header, summary key, format); a trailing "x" in the format is written after the number
    ("dataset", "dataset", ""), ("method", "method", ""), ("prompts", "prompts", "d"),
    ("τ", "tau", ".2f"), ("proposed drafts", "proposed_drafts", "d"), ("tok/s", "tokens_per_s", ".1f"),
    ("speedup (median)", "speedup_median", ".2fx"), ("speedup (total)", "speedup_total", ".2fx"),
    ("vs plain_kernels (median)", "speedup_vs_kernels", ".2fx"), ("vs fp32 stock (median)", "speedup_vs_fp32", ".2fx"),
    ("ceiling", "ceiling", ".2f"), ("efficiency", "efficiency", ".2f"), ("draft share", "draft_share", ".1%"),
    ("loop overhead", "loop_overhead", ".1%"), ("host ms/step", "host_ms_per_step", ".2f"),
    ("syncs/step", "syncs_per_step", ".1f"), ("peak +MB", "peak_mem_mb", ".0f"), ("peak MB", "peak_abs_mb", ".0f"),
    ("mismatches", "mismatches", "d"), ("match", "match_rate", ".0%"), ("exact bits", "exact_bits", ""),
)
_OPTIONAL_COLUMNS = ("speedup_vs_kernels", "speedup_vs_fp32", "match_rate", "exact_bits")  # shown when a row has them
_LOADED_COLUMNS = ("tau", "proposed_drafts", "tokens_per_s", "speedup_median", "speedup_vs_kernels", "speedup_vs_fp32",
                   "mismatches", "match_rate")


def _cell(value, fmt: str) -> str:
    if value is None:
        return "–"
    if fmt.endswith("x"):
        return format(value, fmt[:-1]) + "x"
    return format(value, fmt)


def markdown(result: dict) -> str:
    """The summary as a markdown table, then the forward-cost curve (and the memory check, when it ran).

    A column appears when any row has it (``vs plain_kernels`` when ``plain_kernels`` ran, ``vs fp32 stock`` when
    ``plain_fp32`` ran, ``match`` for a half-precision target); with
    ``background_load="both"`` the loaded figures of τ, proposed drafts, tok/s, the speedups and mismatches stand
    right after their quiet ones ("τ loaded", ...).
    """
    summary = result["summary"]
    columns = []
    for header, key, fmt in _COLUMNS:
        if key in _OPTIONAL_COLUMNS and not any(key in r for r in summary):
            continue
        columns.append((header, key, fmt))
        if key in _LOADED_COLUMNS and any(f"{key}_loaded" in r for r in summary):
            columns.append((f"{header.replace(' (median)', '')} loaded", f"{key}_loaded", fmt))
    lines = ["| " + " | ".join(h for h, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    for r in summary:
        lines.append("| " + " | ".join(_cell(r.get(key), fmt) for _, key, fmt in columns) + " |")
    if any("match_rate" in r for r in summary):
        lines.append("")
        lines.append("Half precision: outputs identical to plain decoding up to rounding; match: the share of runs "
                     "token-identical to plain generate() in the same dtype; exact bits: whether the method's "
                     "verification gives the bits of the target's own one-token steps on this machine (probed, "
                     "speculative_stats['exact_bits']; yes: identical by construction, not by chance)"
                     + ("; vs fp32 stock: the speedup over stock generate() on the float32 target (plain_fp32)."
                        if any("speedup_vs_fp32" in r for r in summary) else "."))
    mode = (result.get("background_load") or {}).get("mode", "off")
    if mode != "off":
        lines.append("")
        lines.append("Background load: " + (
            "every timed row ran while another process kept one CPU core busy." if mode == "on" else
            "every prompt ran quiet and, alternately before or after, while another process kept one CPU core busy "
            "(the 'loaded' columns)."))
    curve = result["cost_curve_ms"]
    lines.append("")
    lines.append("Forward cost c(q) (ms, q new tokens over a 256-token cache): " + ", ".join(
        f"{q}: {ms:.1f}" for q, ms in sorted(curve.items(), key=lambda kv: int(kv[0]))))
    if result.get("cost_curve_model_kernels_ms"):
        lines.append("")
        lines.append("The same with the model's own kernels (no hf_specdec.kernels): " + ", ".join(
            f"{q}: {ms:.1f}" for q, ms in sorted(result["cost_curve_model_kernels_ms"].items(),
                                                  key=lambda kv: int(kv[0]))))
    if "memory_check" in result:
        lines.append("")
        lines.append("Memory over consecutive calls (RSS growth over the second half, MB): " + ", ".join(
            f"{m}: {v['growth_mb_second_half']:+.1f}" for m, v in result["memory_check"].items()))
    return "\n".join(lines)


def write_outputs(result: dict, out: str) -> None:
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "bench.json").write_text(json.dumps(result, indent=1, default=float))
    (folder / "bench.md").write_text(markdown(result) + "\n")
    write_csv(result["summary"], folder / "bench.csv")
    try:
        from .plots import plot_all

        plot_all(result, folder)
    except ImportError as err:
        print(f"(plots skipped: {err}; pip install matplotlib)", file=sys.stderr)


def write_csv(summary: list[dict], path) -> None:
    """The summary rows as CSV: one column per key (first-seen order), empty cells for ``None`` or absent keys.

    Example::

        write_csv(result["summary"], "bench_out/bench.csv")   # columns dataset, method, prompts, tau, ...
    """
    import csv

    keys = list(dict.fromkeys(k for row in summary for k in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys, restval="")
        writer.writeheader()
        for row in summary:
            writer.writerow({k: "" if v is None else v for k, v in row.items()})


def batch_sweep(model, tokenizer, methods: list[BenchMethod], datasets: list[str], batch_sizes: list[int],
                limit: int, max_new_tokens: int, out: str | None = None, progress: bool = True, rounds: int = 1,
                **kwargs) -> dict:
    """Batched throughput: :func:`run_bench` once per batch size, on the first ``max(limit, rounds * B)`` prompts of
    each dataset for batch size ``B`` (the same prompts for every method; ``rounds``: at least that many batches per
    size, each timing plain ``generate()`` and every method in turn), then tokens/s per method and batch size against
    plain batched ``generate()`` at that size (:func:`batch_summary`, :func:`batch_markdown`). Each batch size's full
    result is written to ``<out>/batch<B>/``; the sweep to ``<out>/batch.json`` and ``<out>/batch.md``.

    Example::

        methods = build_methods(["plain_kernels", "prompt_lookup", "eagle3"], eagle3=drafter)
        sweep = batch_sweep(model, tok, methods, ["mtbench"], [1, 4, 16], limit=16, max_new_tokens=64)
        print(batch_markdown(sweep))
    """
    per_batch = {}
    for b in sorted(batch_sizes, reverse=True):  # the largest first: the longest runs, while the machine is fresh
        sub = str(Path(out) / f"batch{b}") if out else None
        per_batch[b] = run_bench(model, tokenizer, methods, datasets, max(limit, rounds * b), max_new_tokens,
                                 batch_size=b,
                                 out=sub, progress=progress, curve_sizes=[1, 2, 3, 4, 6, 8, 12, 16, 24, 32],
                                 **kwargs)
    per_batch = {b: per_batch[b] for b in sorted(per_batch)}
    sweep = {"schema": SCHEMA, "batch_sizes": sorted(batch_sizes), "limit": limit, "rounds": rounds,
             "max_new_tokens": max_new_tokens,
             "datasets": list(datasets), "machine": next(iter(per_batch.values()))["machine"],
             "summary": batch_summary(per_batch),
             "cost_curves_ms": {b: r["cost_curve_ms"] for b, r in per_batch.items()}}
    if out:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "batch.json").write_text(json.dumps(sweep, indent=1, default=float))
        (folder / "batch.md").write_text(batch_markdown(sweep) + "\n")
    return sweep


def batch_summary(per_batch: dict[int, dict]) -> list[dict]:
    """One row per (method, batch size) over every dataset: ``tokens_per_s`` (new tokens of every row / seconds),
    ``vs_plain`` (plain batched ``generate()``'s seconds over the method's on the same batches), ``vs_plain_median``
    (the median over the batches of that ratio within each batch, timed side by side: robust to a moment of other
    work on a shared machine), ``batches``, ``vs_kernels`` (the same as ``vs_plain`` against ``plain_kernels``, when it
    ran), ``tau``, ``mismatches`` and, for a half-precision target, ``match_rate``."""
    rows = []
    for b, result in per_batch.items():
        runs = result["runs"]
        methods = list(dict.fromkeys(r["method"] for r in runs))
        seconds = {m: sum(r["seconds"] for r in runs if r["method"] == m) for m in methods}
        plain_of = {_batch_key(r): r["seconds"] for r in runs if r["method"] == "plain"}
        for m in methods:
            mine = [r for r in runs if r["method"] == m]
            taus = [r["tau"] for r in mine if r["tau"]]
            paired = [plain_of[_batch_key(r)] / r["seconds"] for r in mine if _batch_key(r) in plain_of]
            row = dict(method=m, batch=b, tokens_per_s=sum(r["new_tokens"] for r in mine) / seconds[m],
                       vs_plain=seconds["plain"] / seconds[m],
                       vs_plain_median=statistics.median(paired) if paired else None, batches=len(mine),
                       tau=statistics.mean(taus) if taus else None, mismatches=sum(not r["identical"] for r in mine))
            if "plain_kernels" in seconds:
                row["vs_kernels"] = seconds["plain_kernels"] / seconds[m]
            if any(r["method"] == "plain" and r.get("dtype", "float32") != "float32" for r in runs):
                row["match_rate"] = sum(r["identical"] for r in mine) / len(mine)
            rows.append(row)
    return rows


def _batch_key(run: dict) -> tuple:
    """Which batch (and load condition) a run record timed: the same key for every method on that batch."""
    return run["dataset"], run["prompt_id"], bool(run.get("loaded"))


def batch_markdown(sweep: dict) -> str:
    """The sweep as a table: per method, ``tok/s (x plain generate())`` at each batch size, then τ per batch size,
    the lowest ratio of each method and the mismatches."""
    sizes = sweep["batch_sizes"]
    by = {(r["method"], r["batch"]): r for r in sweep["summary"]}
    methods = list(dict.fromkeys(r["method"] for r in sweep["summary"]))
    head = ["method"] + [f"B={b} tok/s (× plain)" for b in sizes] + ["lowest × plain", "lowest median × plain",
                                                                    "τ by B", "mismatches"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in methods:
        cells, ratios, medians, taus, bad = [m], [], [], [], 0
        for b in sizes:
            r = by.get((m, b))
            if r is None:
                cells.append("–")
                continue
            ratios.append(r["vs_plain"])
            if r.get("vs_plain_median") is not None:
                medians.append(r["vs_plain_median"])
            taus.append("–" if r["tau"] is None else f"{r['tau']:.2f}")
            bad += r["mismatches"]
            cells.append(f"{r['tokens_per_s']:.1f} ({r['vs_plain']:.2f}x)")
        cells += [f"{min(ratios):.2f}x" if ratios else "–", f"{min(medians):.2f}x" if medians else "–",
                  " / ".join(taus), str(bad)]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    rounds = sweep.get("rounds", 1)
    lines.append(f"max({sweep['limit']}, {rounds} × B) prompts per set ({', '.join(sweep['datasets'])}), "
                 f"{sweep['max_new_tokens']} new tokens each, greedy; × plain: plain batched generate()'s time over the "
                 "method's on the same batches in the same run; median × plain: the median over the batches of that "
                 "ratio within each batch (plain and the methods timed side by side).")
    return "\n".join(lines)
