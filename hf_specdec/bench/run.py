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
mismatch there is a *match rate*, not an error; and the same target in float32 runs stock greedy ``generate()`` on
every prompt as one more baseline, ``plain_fp32`` (:func:`~hf_specdec.bench.methods.fp32_baseline`; its own model, in
the same rotating order), so that every method gets its speedup over what float32 gives. A quantized target
(``hf-specdec bench --quantize torchao-int8``, docs/quantization.md) gets the same ``plain_fp32`` baseline (the target
unquantized); its outputs are compared with its own plain ``generate()``, as a float32 target's are.

JSON schema (``schema: "hf_specdec.bench/1"``):

* ``machine``: platform, cpu count, torch / transformers versions, device
* ``config``: the command-line options (``dtype``: the target's dtype as it ran, float32 after a fallback;
  ``quantize``: the quantization the target was loaded with, or ``null``)
* ``cost_curve_ms``: ``{q: median milliseconds of a target forward over q new tokens, ~256-token cache}``, as the
  loop runs it (CPU verification kernels on for q >= 2 unless turned off); ``cost_curve_model_kernels_ms``: the same
  with the model's own kernels (CPU only)
* ``runs``: one record per (method, prompt, repeat): ``method, dataset, prompt_id, repeat, new_tokens, seconds,
  prefill_seconds, target_forwards, forward_sizes, target_forward_seconds, drafter_forward_seconds, tau,
  ceiling, identical, loaded, peak_mem_mb`` (peak over the memory in use before the call: RSS on CPU, allocated
  memory on CUDA), ``peak_abs_mb`` (absolute peak), ``steps`` (target forwards after the prefill: the loop's
  verification steps, stock ``generate()``'s decoding steps), ``host_ms_per_step`` (see below), ``stats``
  (hf_specdec's ``speculative_stats``, when available) and ``dtype`` (of the model that ran it: the target's, float32
  for ``plain_fp32``, whose forwards are not probed: no ``tau``, ``ceiling`` or ``host_ms_per_step``)
* ``summary``: per (method, dataset): ``prompts, tau, tokens_per_s, speedup_median, speedup_total, ceiling,
  efficiency, draft_share, loop_overhead (time outside the target's forwards and the drafting per target forward,
  relative to one 1-token forward), host_ms_per_step, syncs_per_step, launches_per_step, peak_mem_mb, peak_abs_mb,
  mismatches``,
  ``proposed_drafts`` and ``accepted_drafts`` (summed over the prompts; ``None`` for a run without
  ``speculative_stats``), when ``plain_kernels`` ran, ``speedup_vs_kernels`` (median per-prompt ratio against it),
  when ``plain_fp32`` ran, ``speedup_vs_fp32`` (the same against it), and for a half-precision target ``match_rate``
  (the share of the method's runs token-identical to plain ``generate()`` in the same dtype; for ``plain_fp32``,
  informative)
* ``syncs`` (unless ``count_syncs=False``): ``{dataset: {method: {"count", "steps", "per_step", "by_name",
  "launches_per_step"}}}``, the host reads of tensor values (:class:`hf_specdec.syncs.SyncCounter`) and the kernels
  the host starts per step (:class:`hf_specdec.launches.LaunchCounter`) of one call per method on the dataset's first
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
:data:`~hf_specdec.bench.summary.LOADED_FIELDS`). Every output, loaded or not, is compared with the baseline of the
same round.

Per-step overheads. ``host_ms_per_step`` is the wall time of a call outside the target's forwards (the loop's own
work, the drafting, generate()'s set-up) over its steps (target forwards after the prefill): on a CPU the forwards are
timed with ``perf_counter``, on CUDA with events (the forwards' device time), so there it is the part of a step the
device does not spend in the target. ``syncs_per_step`` is the number of host reads of tensor values (each one a
host-device synchronisation on a GPU; :mod:`hf_specdec.syncs`) over the same steps. Counting intercepts every torch
call, which would slow a timed call, so the reads are counted in one extra, untimed call per method and dataset (its
first prompt batch, after the warm-up); a call's count is a property of its code path, not of the machine. The same
call counts ``launches_per_step``: the kernels the host starts per step (each torch operation that does work outside a
compiled region, each compiled region one; :mod:`hf_specdec.launches`), the CPU's proxy for a GPU's launch cost.

Besides ``bench.json``, :func:`~hf_specdec.bench.report.write_outputs` writes ``bench.md`` (the table
:func:`~hf_specdec.bench.report.markdown` prints), ``bench.csv`` (the summary, one row per method and dataset, the
same keys as ``summary``) and PNG plots.
"""

from __future__ import annotations

import contextlib
import gc
import os
import platform
import sys
import time

import torch

from ..dtypes import dtype_name
from ..entry import decoding_method
from ..launches import LaunchCounter
from ..syncs import SyncCounter
from . import load as load_mod
from .data import load
from .methods import BenchMethod
from .oracle import OracleProposer
from .probes import ForwardProbe, _peak_since, _relative_cost, _reset_peak, _rss_mb, forward_cost_curve
from .report import write_outputs
from .summary import summarize


SCHEMA = "hf_specdec.bench/1"
BACKGROUND_LOAD_MODES = ("off", "on", "both")


def _encode(tokenizer, texts, device):
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                           tokenize=False) for t in texts]
    enc = tokenizer(chats, return_tensors="pt", padding=True, add_special_tokens=False)
    return {k: v.to(device) for k, v in enc.items()}


def run_bench(model, tokenizer, methods: list[BenchMethod], datasets: list[str], limit: int, max_new_tokens: int,
              batch_size: int = 1, drafter=None, out: str | None = None, memory_check: int = 0,
              progress: bool = True, config: dict | None = None, seed: int = 0,
              background_load: str = "off", curve_sizes: list[int] | None = None, warmup_tokens: int = 10**9,
              count_syncs: bool = True, repeats: int = 1) -> dict:
    """Run the baseline and ``methods`` on the first ``limit`` prompts of each of ``datasets``; return the result
    (schema at the top of this module) and write it to ``out`` when given.

    ``curve_sizes``: the forward sizes of the cost curve (default 1..32); ``warmup_tokens``: tokens per warm-up call
    (default: ``max_new_tokens``); ``count_syncs``: count the host reads per step of every method (one extra, untimed
    call per method and dataset; the ``syncs`` entry and the ``syncs_per_step`` column); ``repeats``: rounds per
    prompt (batch), one after another, the methods' order rotating between them (each run record has its ``repeat``;
    the summary's medians are over prompts and repeats).

    ``background_load``: ``"off"`` (default), ``"on"`` (every timed row under a synthetic load keeping one core
    busy) or ``"both"`` (each prompt quiet and loaded in turn; the summary holds both, loaded keys with the suffix
    ``_loaded``).

    Example::

        methods = build_methods(["plain_kernels", "prompt_lookup"])
        result = run_bench(model, tok, methods, ["gsm8k"], limit=5, max_new_tokens=128, background_load="both")
        print(markdown(result))
    """
    from tqdm.auto import tqdm

    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}.")
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
    total = sum((len(p) + batch_size - 1) // batch_size for p in prompts.values()) * len(conditions) * repeats
    bar = tqdm(total=total, desc="bench", disable=not progress, file=sys.stderr)
    step = 0
    try:
        with whole_run_load():  # "on": one load process for every timed round
            for ds, plist in prompts.items():
                for m in methods:  # a prompt set starts with empty cross-call caches
                    for cache in m.caches:
                        cache.clear()
                for i, repeat in ((i, r) for i in range(0, len(plist), batch_size) for r in range(repeats)):
                    batch = plist[i:i + batch_size]
                    enc = _encode(tokenizer, [p.text for p in batch], device)
                    # the methods in an order that rotates from round to round; with both load conditions,
                    # which one comes first alternates too
                    order = methods[step % len(methods):] + methods[: step % len(methods)] if methods else []
                    for loaded in (conditions if step % 2 == 0 else conditions[::-1]):
                        with round_load() if loaded else nothing():  # "both": a load per loaded round
                            ref, records = round_of(order, enc)
                        runs.extend(_run_records(records, ref, curve, ds, batch, enc["input_ids"].shape[1], loaded,
                                                 model.dtype, repeat))
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
    """``{method: {"count", "steps", "per_step", "by_name", "launches_per_step"}}``: the host reads of tensor values
    of one call of plain ``generate()`` and of each method on ``enc`` (:class:`~hf_specdec.syncs.SyncCounter`), over
    its steps (target forwards after the prefill), and in the same call the kernels the host starts per step
    (:class:`~hf_specdec.launches.LaunchCounter`; plain ``generate()`` has no step ranges: its whole call over its
    forwards, the prefill's included). A model other than the bench's target (``plain_fp32``) is not probed: its steps
    are the new tokens."""
    report = {}
    ref = None
    for m in [None] + list(methods):
        counter = SyncCounter()
        with LaunchCounter() as launches:
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
            "launches_per_step": launches.per_step() if launches.steps else launches.outside / (steps + 1),
        }
    return report


def _run_records(records, ref, curve, dataset, batch, prompt_len, loaded: bool, dtype: torch.dtype,
                 repeat: int = 0) -> list[dict]:
    """The ``runs`` entries of one round (the baseline and every method on one prompt batch, its ``repeat``-th
    round); ``dtype``: the target's."""
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
            method=m.name if m else "plain", dataset=dataset, prompt_id=",".join(p.id for p in batch), repeat=repeat,
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
