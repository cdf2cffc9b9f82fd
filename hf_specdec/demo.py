"""``hf-specdec demo``: speculative generation with the embedded default model, outputs checked, speedup printed.

Two sizes. By default (the quick demo) a few methods (:data:`QUICK_METHODS`: prompt lookup, EAGLE-3 and DFlash with
their shipped drafters) run on two prompts (:data:`QUICK_PROMPTS`: one that copies from its prompt, one word
problem), each generation once: on an idle 2-core CPU the first comparison is printed about 15 s after the model has
loaded and the whole run takes about a minute. ``thorough=True`` (``hf-specdec demo --thorough``) runs every method
the default model has a drafter for on every demo prompt, :data:`THOROUGH_REPEATS` times each (about 15 minutes on
an idle 2-core CPU; the quick demo's last line estimates it for the machine it ran on). ``methods`` and ``repeats``
change either.

The repeats are interleaved: for each prompt, plain greedy ``generate()``, the kernel-matched plain loop (on a CPU),
then every method, and again, so that a busy moment of a shared machine falls on all of them. Each row (one prompt,
one method) is printed as soon as its last repeat has run and reports the median over its repeats, flagged when it
cannot be trusted:

* ``noisy: N%`` -- the speedup's spread across the repeats, ``(max - min) / median``, is over
  :data:`NOISY_SPREAD` (25 %): the machine was busy (needs 2 or more repeats);
* ``disturbed`` -- the figure is impossible: speculation commits ``tau`` tokens per target forward, and a
  verification forward costs at least one step of the kernel-matched plain loop, so its speedup over that loop
  cannot exceed ``tau``; above ``tau`` x :data:`TAU_MARGIN` (or above :data:`FLAT_SPEEDUP` while ``tau`` is
  about 1) the plain runs were slowed by something else.

With several repeats the demo prints how long the timed runs will take (from one full plain generation) before them,
and a line as each round finishes. Every output is checked token for token against plain greedy decoding.

``dtype`` (``hf-specdec demo --dtype bfloat16``): the model runs in it (:func:`~hf_specdec.dtypes.resolve_dtype`:
float32 on a CPU without fast kernels for it) and the drafters follow it. In half precision an output is identical
to plain greedy decoding in the same dtype only up to rounding: each row reports how many repeats matched
(``matches``), and a difference is no failure.

Example::

    from hf_specdec.demo import run_demo

    summary, rows = run_demo()  # the quick demo
    summary["prompt_lookup", "copy"]["speedup"], rows[0]["proposed_drafts"], rows[0]["same"]
    summary, rows = run_demo(max_new_tokens=32, methods=["prompt_lookup"], repeats=3, thorough=True)
    rows[0]["noisy"]
    summary, rows = run_demo(max_new_tokens=32, methods=["eagle3"], dtype="bfloat16")  # eagle3's drafter in bf16 too
    summary["eagle3", "math"]["match_rate"], rows[0]["matches"]
"""

from __future__ import annotations

import os
import statistics
import sysconfig
import time

import torch

from . import registry
from .default_model import MODEL_ID
from .dtypes import HALF, dtype_name, resolve_dtype
from .entry import decoding_method
from .kernels import padded_plain_decoding

NOISY_SPREAD = 0.25  # (max - min) / median of a row's speedups across repeats above this: "noisy"
TAU_MARGIN = 1.5  # a speedup over the kernel-matched plain loop above tau x this is impossible: "disturbed"
FLAT_TAU, FLAT_SPEEDUP = 1.05, 1.3  # tau about 1 (almost no draft accepted), yet this much faster: "disturbed"
HALF_NOTE = "half precision: outputs identical to plain decoding up to rounding; match rate reported"
QUICK_METHODS = ("prompt_lookup", "eagle3", "dflash")  # the default demo: a drafter-free method and two drafters
QUICK_PROMPTS = (1, 4)  # indices in demo_prompts(): the paragraph to repeat, the word problem
THOROUGH_REPEATS = 3  # --thorough: repeats per generation, for the medians and the noise marks

_NEWS = (
    "The Bureau of Meteorology said a cold front would cross the state on Sunday, bringing strong winds and "
    "scattered showers to most coastal districts. Firefighters in the Blue Mountains spent the night containing "
    "three blazes that had threatened homes near Katoomba, and the Rural Fire Service said conditions would ease "
    "by Monday. Residents were asked to keep clearing gutters and to listen to local radio for updates."
)


def _stdlib_snippet(name: str = "textwrap.py", start: int = 2300, length: int = 1100) -> str:
    path = os.path.join(sysconfig.get_paths()["stdlib"], name)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return text[start:start + length]


def demo_prompts() -> list[tuple[str, str]]:
    """``(kind, prompt)`` pairs: two that copy from the prompt, two chat prompts that do not, and one grade-school
    word problem (the kind of answer the shipped drafters were trained on; written for the demo, not from GSM8K)."""
    return [
        ("copy", "Rename the variable `text` to `content` everywhere in this code and output the whole code:\n"
                 f"```python\n{_stdlib_snippet()}\n```"),
        ("copy", f"Repeat the following paragraph, replacing 'Sunday' with 'Saturday':\n\n{_NEWS}"),
        ("chat", "Write a short story about a robot who learns to paint."),
        ("chat", "What are three tips for staying productive while working from home?"),
        ("math", "A baker fills 14 trays with 12 muffins each. She sells 96 muffins in the morning and half of the "
                 "rest in the afternoon. How many muffins are left?\nLet's think step by step."),
    ]


def half_verdict(model, rounding: str = "auto") -> str:
    """What the exactness probe says of ``model`` in its half-precision dtype on this machine (one row)."""
    from .runner_choice import runner_for

    if runner_for(model).exact_bits(rounding):
        return f"probed: one row verifies with the bits of {dtype_name(model.dtype)} one-token steps (bit-identical)"
    return (f"probed: one row's verification does not round as {dtype_name(model.dtype)} one-token steps here, "
            "so outputs may differ in the last rounding (rounding='exact' makes them bit-identical)")


def _encode(tokenizer, prompt):
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)


SHIPPED = registry.DRAFTERS_DIR
SHIPPED_NAMES = {m.name: m.drafter.shipped[MODEL_ID] for m in registry.methods()
                 if m.drafter is not None and MODEL_ID in m.drafter.shipped}  # the default model's, by method
shipped_drafter = registry.shipped_folder  # by folder name: hf_specdec/drafters/<name>, if present


def available_demo_methods(model, drafters: dict | None = None, only: list[str] | None = None,
                           **by_flag) -> dict[str, dict]:
    """Every registered method the default model can run: those without a drafter, and those whose drafter is given
    (a trained folder by its flag: ``eagle3="runs/eagle3/final"``, ``dflash=...``, ``drafter=...`` for
    ``assisted``; or ``drafters={method: source}``) or ships with the package. Returns the ``decoding_method``
    options of each (the drafter loaded); ``only``: look at these methods only (no other drafter is loaded)."""
    given = {**{registry.get(m).drafter_flag: src for m, src in (drafters or {}).items()}, **by_flag}
    unknown = set(given) - {m.drafter_flag for m in registry.methods() if m.drafter is not None}
    if unknown:
        raise ValueError(f"No method takes a drafter named {', '.join(sorted(unknown))}.")
    return {name: {"drafter": registry.load_drafter(name, source, model)} if source is not None else {}
            for name, source in _demo_sources(model, given, only).items()}


def _demo_sources(model, given: dict, only: list[str] | None) -> dict:
    """The methods the demo runs on ``model`` (``only``, or every one but the reference and the routers) and the
    drafter each loads: ``given[flag]``, else the shipped one, else ``None`` (no drafter, or an optional one)."""
    sources = {}
    for m in registry.methods():
        if (only is not None and m.name not in only) or (only is None and (m.reference or m.router)):
            continue
        source = None if m.drafter is None else given.get(m.drafter_flag) or registry.shipped_drafter(m, model)
        if m.drafter is None or source is not None or not m.drafter.required:
            sources[m.name] = source
    return sources


def _label(name: str, opts: dict) -> str:
    return f"{name} chain:{opts['num_speculative_tokens']}" if opts.get("num_speculative_tokens") else name


def spread(values) -> float:
    """``(max - min) / median`` of ``values`` (0.0 for fewer than two).

    Example:
        >>> round(spread([1.0, 1.2, 1.5]), 2)
        0.42
    """
    values = list(values)
    if len(values) < 2:
        return 0.0
    return (max(values) - min(values)) / statistics.median(values)


def disturbed(matched_speedup: float | None, tau: float) -> bool:
    """Whether a speedup over the kernel-matched plain loop (over stock ``generate()`` where the loop takes no
    kernel trick, e.g. on a GPU) is impossible for an acceptance length ``tau``: above ``tau`` x
    :data:`TAU_MARGIN`, or above :data:`FLAT_SPEEDUP` with ``tau`` below :data:`FLAT_TAU`.

    Example:
        >>> disturbed(1.4, tau=1.8), disturbed(3.1, tau=1.8), disturbed(1.4, tau=1.0)
        (False, True, True)
    """
    if matched_speedup is None:
        return False
    return matched_speedup > tau * TAU_MARGIN or (tau < FLAT_TAU and matched_speedup > FLAT_SPEEDUP)


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} minutes"


def _row(kind, index, name, label, new_tokens, times, stats, matches, cpu, dtype="float32"):
    """One (prompt, method) row from its repeats: medians, drafts, spread and flags; ``matches``: how many repeats'
    outputs were identical to plain greedy decoding."""
    base, spec, kern = times["plain"], times[name], times["kernels"]
    speedups = [b / s for b, s in zip(base, spec)]
    vs_kernels = [k / s for k, s in zip(kern, spec)] if kern else None
    tau = statistics.median(s["acceptance_length"] for s in stats)
    row_spread = max(spread(speedups), spread(vs_kernels) if vs_kernels else 0.0)
    median_vs_kernels = statistics.median(vs_kernels) if vs_kernels else None
    matched = median_vs_kernels if cpu else statistics.median(speedups)  # CPU without a fair kernel run: no check
    return dict(
        kind=kind, prompt=index, method=name, label=label, new_tokens=new_tokens,
        base_s=statistics.median(base), spec_s=statistics.median(spec),
        kernel_s=statistics.median(kern) if kern else None,
        speedup=statistics.median(speedups), vs_kernels=median_vs_kernels, tau=tau,
        proposed_drafts=int(statistics.median(s["proposed_drafts"] for s in stats)),
        accepted_drafts=int(statistics.median(s["accepted_drafts"] for s in stats)),
        spread=row_spread, noisy=row_spread > NOISY_SPREAD, disturbed=disturbed(matched, tau),
        same=matches == len(spec), matches=matches, dtype=dtype, repeats=len(spec),
        base_times=list(base), spec_times=list(spec), kernel_times=list(kern) if kern else None,
    )


def _flags(r) -> str:
    notes = ([f"noisy: {r['spread']:.0%}"] if r["noisy"] else []) + (["disturbed"] if r["disturbed"] else [])
    return ", ".join(notes)


def _outputs(identical: bool, dtype: str, match: str) -> str:
    """``identical``, else ``MISMATCH`` in float32 and ``match <match>`` (``2/3`` repeats, ``80%`` of the runs)
    in half precision."""
    if identical:
        return "identical"
    return "MISMATCH" if dtype == "float32" else f"match {match}"


def _row_line(r, n_prompts) -> str:
    n = r["new_tokens"]
    outputs = _outputs(r["same"], r.get("dtype", "float32"), f"{r['matches']}/{r['repeats']}")
    return (f"  [{r['kind']:4s} {r['prompt'] + 1}/{n_prompts}] {r['label']:16s} {n:4d} tokens  "
            f"plain {n / r['base_s']:5.1f} tok/s  {r['method']} {n / r['spec_s']:5.1f} tok/s  "
            f"speedup {r['speedup']:4.2f}x  "
            + (f"vs padded plain {r['vs_kernels']:4.2f}x  " if r["vs_kernels"] else "")
            + f"acceptance length {r['tau']:.2f} ({r['proposed_drafts']} drafts proposed, "
            f"{r['accepted_drafts']} accepted)  {outputs}"
            + (f"  [{_flags(r)}]" if _flags(r) else ""))


def _summarize(rows, chosen, cpu: bool) -> dict:
    summary = {}
    for name in chosen:
        for kind in ("copy", "chat", "math"):
            sel = [r for r in rows if r["method"] == name and r["kind"] == kind]
            if not sel:
                continue
            tau = statistics.mean(r["tau"] for r in sel)
            vs_kernels = (sum(r["kernel_s"] for r in sel) / sum(r["spec_s"] for r in sel)
                          if all(r["kernel_s"] for r in sel) else None)
            speedup = sum(r["base_s"] for r in sel) / sum(r["spec_s"] for r in sel)
            summary[(name, kind)] = dict(
                speedup=speedup,
                median_speedup=statistics.median(r["speedup"] for r in sel),
                tau=tau,
                proposed_drafts=sum(r["proposed_drafts"] for r in sel),
                accepted_drafts=sum(r["accepted_drafts"] for r in sel),
                tokens_per_s=sum(r["new_tokens"] for r in sel) / sum(r["spec_s"] for r in sel),
                plain_tokens_per_s=sum(r["new_tokens"] for r in sel) / sum(r["base_s"] for r in sel),
                vs_kernels=vs_kernels,
                spread=max(r["spread"] for r in sel),
                noisy=any(r["noisy"] for r in sel),
                disturbed=any(r["disturbed"] for r in sel) or disturbed(vs_kernels if cpu else speedup, tau),
                identical=all(r["same"] for r in sel),
                match_rate=sum(r["matches"] for r in sel) / sum(r["repeats"] for r in sel),
                dtype=sel[0]["dtype"],
            )
    return summary


def _print_summary(summary, chosen, repeats) -> None:
    print()
    print(f"{'method':16s} {'prompts':8s} {'plain tok/s':>12s} {'tok/s':>8s} {'speedup':>8s} {'vs padded plain':>15s} "
          f"{'accept len':>10s} {'proposed':>9s} {'accepted':>9s}  outputs    flags")
    for (name, kind), s in summary.items():
        vs = f"{s['vs_kernels']:14.2f}x" if s["vs_kernels"] else f"{'-':>15s}"
        flags = ", ".join(([f"noisy: {s['spread']:.0%}"] if s["noisy"] else [])
                          + (["disturbed"] if s["disturbed"] else []))
        outputs = _outputs(s["identical"], s.get("dtype", "float32"), f"{s['match_rate']:.0%}")
        print(f"{_label(name, chosen[name]):16s} {kind:8s} {s['plain_tokens_per_s']:12.1f} {s['tokens_per_s']:8.1f} "
              f"{s['speedup']:7.2f}x {vs} {s['tau']:10.2f} {s['proposed_drafts']:9d} {s['accepted_drafts']:9d}  "
              f"{outputs:9s}  {flags}")
    print(("times: one run of each prompt" if repeats == 1 else
           f"times: the median of the {repeats} interleaved repeats of each prompt") + "; speedup: over stock generate()"
          + ("; vs padded plain: over plain greedy decoding that uses the same CPU kernel trick as the speculative "
             "loop (one row computed as two), i.e. speculation's own share"
             if any(s["vs_kernels"] for s in summary.values()) else "")
          + "; proposed / accepted: draft tokens per generation, summed over the prompts")
    if any(s["noisy"] for s in summary.values()):
        print(f"noisy: the speedup varied by more than {NOISY_SPREAD:.0%} across the {repeats} repeats of a prompt: "
              "the machine is busy (other processes compete for its cores); rerun when it is idle, or with more "
              "--repeats")
    if any(s["disturbed"] for s in summary.values()):
        print(f"disturbed: a speedup over the kernel-matched plain loop above {TAU_MARGIN} x the acceptance length "
              f"(or above {FLAT_SPEEDUP}x while it is about 1) cannot come from speculation: the timing was "
              "disturbed (something slowed the plain runs), this is not a clean number")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"


def _thorough_count(model) -> int:
    """How many methods ``--thorough`` runs on ``model`` (the reference and the routers are not among them)."""
    return len(_demo_sources(model, {}, None))


def run_demo(max_new_tokens: int = 96, methods: list[str] | None = None, repeats: int | None = None,
             verbose: bool = True, drafters: dict | None = None, dtype: str | torch.dtype = "float32",
             thorough: bool = False, **by_flag):
    """Run plain greedy decoding and speculative methods on the demo prompts; return ``(summary, rows)``.

    By default the quick demo: :data:`QUICK_METHODS` on the prompts :data:`QUICK_PROMPTS`, one run each.
    ``thorough``: every available method on every prompt of :func:`demo_prompts`, :data:`THOROUGH_REPEATS` runs
    each. ``methods`` / ``repeats`` replace either choice.

    Each generation runs ``repeats`` times, interleaved (plain, kernel-matched plain, m1, m2, ..., plain, ...), and
    each row (one prompt, one method) reports the medians: ``speedup`` over stock ``generate()``, ``vs_kernels``
    over the kernel-matched plain loop (on a CPU: plain greedy decoding with the CPU kernel trick the speculative
    loop uses, :func:`~hf_specdec.kernels.padded_plain_decoding`, i.e. speculation's own share), ``tau`` (the
    acceptance length), ``proposed_drafts`` / ``accepted_drafts``, ``spread`` with the flags ``noisy`` and
    ``disturbed`` (see the module's docstring), ``same`` (every repeat's output identical to plain greedy
    decoding), ``matches`` (how many repeats' were) and ``dtype``. ``summary[(method, kind)]`` aggregates the rows
    of a method by kind of prompt (copy, chat, math), with ``match_rate``.

    ``dtype``: the model's (:func:`~hf_specdec.dtypes.resolve_dtype`; the drafters follow it, and plain greedy
    decoding runs in it too). In half precision ``same`` is informative: identical up to rounding.

    Example:
        >>> summary, rows = run_demo(max_new_tokens=8, methods=["prompt_lookup"])  # doctest: +SKIP
        >>> all(r["same"] for r in rows)  # doctest: +SKIP
        True
    """
    from .default_model import load_smollm2

    repeats = (THOROUGH_REPEATS if thorough else 1) if repeats is None else repeats
    if repeats < 1:
        raise ValueError(f"repeats must be 1 or more, got {repeats}.")

    def say(*args):
        if verbose:
            print(*args, flush=True)

    dtype = resolve_dtype(dtype)  # the default model runs on the CPU
    torch.manual_seed(0)
    model, tokenizer = load_smollm2(dtype=dtype, verbose=verbose)
    for name in methods or ():
        registry.get(name)  # an unknown name: the registry's error, with the list
    given = {k: v for k, v in by_flag.items() if v is not None}
    only = methods or (None if thorough else list(QUICK_METHODS))
    candidates = available_demo_methods(model, drafters=drafters, only=only, **given)
    missing = [m for m in methods or () if m not in candidates]
    if missing:
        flags = ", ".join(f"--{registry.get(m).drafter_flag} FOLDER" for m in missing)
        raise ValueError(f"{', '.join(missing)}: no drafter ships for {MODEL_ID}; pass one ({flags}).")
    chosen = {m: candidates[m] for m in (only or candidates) if m in candidates}
    prompts = demo_prompts() if thorough else [demo_prompts()[i] for i in QUICK_PROMPTS]
    encoded = [_encode(tokenizer, p) for _, p in prompts]
    gen = dict(max_new_tokens=max_new_tokens, do_sample=False)
    cpu = model.device.type == "cpu"

    # warm-up (first calls pay one-time costs)
    say(f"warming up {', '.join(_label(n, o) for n, o in chosen.items())} in {dtype_name(dtype)} ...")
    model.generate(**encoded[0], max_new_tokens=8, do_sample=False)
    if cpu:
        with padded_plain_decoding(model):
            model.generate(**encoded[0], max_new_tokens=8, do_sample=False)
    for name, opts in chosen.items():
        model.generate(**encoded[0], max_new_tokens=8, do_sample=False, custom_generate=decoding_method(name, **opts))
    per_round = len(chosen) + 1 + cpu
    n_runs = len(prompts) * repeats * per_round
    plan = (f"timed runs: {_plural(len(prompts), 'prompt')} x {_plural(repeats, 'repeat')} x (plain"
            f"{', padded plain' if cpu else ''} + {_plural(len(chosen), 'method')}) = {n_runs} generations of up to "
            f"{max_new_tokens} tokens")
    if repeats > 1:  # a long run: one full plain generation says how long it will take
        t0 = time.perf_counter()
        model.generate(**encoded[0], **gen)
        t_plain = time.perf_counter() - t0
        plan += (f"; one plain generation took {t_plain:.1f} s, so about {_duration(n_runs * t_plain)} for "
                 f"{_plural(len(chosen), 'method')} x {_plural(repeats, 'repeat')}")
    say(plan)
    if dtype in HALF:
        say(HALF_NOTE + "; " + half_verdict(model))

    rows = []
    started = time.perf_counter()
    rounds_done, n_rounds = 0, len(prompts) * repeats
    for index, ((kind, _), enc) in enumerate(zip(prompts, encoded)):
        times = {"plain": [], "kernels": [], **{name: [] for name in chosen}}
        stats = {name: [] for name in chosen}
        matches = dict.fromkeys(chosen, 0)  # repeats whose output is identical to plain greedy decoding
        kernels_fair = cpu
        n_new = 0
        for rep in range(repeats):
            t0 = time.perf_counter()
            base = model.generate(**enc, **gen)
            times["plain"].append(time.perf_counter() - t0)
            n_new = base.shape[1] - enc["input_ids"].shape[1]
            if kernels_fair:
                with padded_plain_decoding(model):
                    t0 = time.perf_counter()
                    padded = model.generate(**enc, **gen)
                    times["kernels"].append(time.perf_counter() - t0)
                if not torch.equal(padded, base):
                    # a last-bit tie broken the other way: no fair comparison for this prompt
                    kernels_fair, times["kernels"] = False, []
            for name, opts in chosen.items():
                t0 = time.perf_counter()
                out = model.generate(**enc, **gen, custom_generate=decoding_method(name, **opts),
                                     return_dict_in_generate=True)
                times[name].append(time.perf_counter() - t0)
                stats[name].append(out.speculative_stats)
                matches[name] += torch.equal(out.sequences, base)
                if rep == repeats - 1:  # the row is complete: print it now
                    rows.append(_row(kind, index, name, _label(name, opts), n_new, times, stats[name],
                                     matches[name], cpu, dtype_name(dtype)))
                    say(_row_line(rows[-1], len(prompts)))
            rounds_done += 1
            if repeats > 1:
                left = (time.perf_counter() - started) / rounds_done * (n_rounds - rounds_done)
                say(f"  [{kind:4s} {index + 1}/{len(prompts)}] repeat {rep + 1}/{repeats}: "
                    + ", ".join(f"{label} {times[key][-1]:.1f} s" for key, label in
                                [("plain", "plain"), ("kernels", "padded plain"),
                                 *((n, _label(n, o)) for n, o in chosen.items())] if times[key])
                    + (f"  (about {_duration(left)} left)" if rounds_done < n_rounds else ""))

    summary = _summarize(rows, chosen, cpu)
    if verbose:
        _print_summary(summary, chosen, repeats)
        if not thorough:
            t_plain = statistics.median(r["base_s"] for r in rows)
            n_thorough = len(demo_prompts()) * THOROUGH_REPEATS * (_thorough_count(model) + 1 + cpu)
            say(f"This was the quick demo ({_plural(len(prompts), 'prompt')}, "
                f"{_plural(repeats, 'run')} of each generation). The thorough version runs every method on "
                f"{len(demo_prompts())} prompts, {THOROUGH_REPEATS} interleaved repeats each, and marks noisy "
                f"rows (about {_duration(n_thorough * t_plain)} here): hf-specdec demo --thorough")
    return summary, rows
