"""``hf-specdec demo``: speculative generation with the embedded default model, outputs checked, speedup printed."""

from __future__ import annotations

import os
import statistics
import sysconfig
import time
from pathlib import Path

import torch

from . import registry
from .default_model import MODEL_ID
from .entry import decoding_method
from .kernels import padded_plain_decoding

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


def _encode(tokenizer, prompt):
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)


SHIPPED = registry.DRAFTERS_DIR
SHIPPED_NAMES = {m.name: m.drafter.shipped[MODEL_ID] for m in registry.methods()
                 if m.drafter is not None and MODEL_ID in m.drafter.shipped}  # the default model's, by method
shipped_drafter = registry.shipped_folder  # by folder name: hf_specdec/drafters/<name>, if present


def available_demo_methods(model, drafters: dict | None = None, **by_flag) -> dict[str, dict]:
    """Every registered method the default model can run: those without a drafter, and those whose drafter is given
    (a trained folder by its flag: ``eagle3="runs/eagle3/final"``, ``dflash=...``, ``drafter=...`` for
    ``assisted``; or ``drafters={method: source}``) or ships with the package. Returns the ``decoding_method``
    options of each (the drafter loaded)."""
    given = {**{registry.get(m).drafter_flag: src for m, src in (drafters or {}).items()}, **by_flag}
    unknown = set(given) - {m.drafter_flag for m in registry.methods() if m.drafter is not None}
    if unknown:
        raise ValueError(f"No method takes a drafter named {', '.join(sorted(unknown))}.")
    methods = {}
    for m in registry.methods():
        if m.drafter is None:
            methods[m.name] = {}
            continue
        source = given.get(m.drafter_flag) or registry.shipped_drafter(m, MODEL_ID)
        if source is not None:
            methods[m.name] = {"drafter": registry.load_drafter(m, source, model)}
    return methods


def _label(name: str, opts: dict) -> str:
    return f"{name} chain:{opts['num_speculative_tokens']}" if opts.get("num_speculative_tokens") else name


def run_demo(max_new_tokens: int = 96, methods: list[str] | None = None, repeats: int = 1, verbose: bool = True,
             drafters: dict | None = None, **by_flag):
    """Run plain greedy and every available method on the demo prompts; return the per-method summary.

    On a CPU, plain greedy decoding also runs with the CPU kernel trick the speculative loop uses
    (:func:`~hf_specdec.kernels.padded_plain_decoding`); ``vs_kernels`` is each method's speedup over that
    kernel-matched plain decoding, i.e. speculation's own share of the speedup over stock ``generate()``."""
    from .default_model import load_smollm2

    torch.manual_seed(0)
    model, tokenizer = load_smollm2(verbose=verbose)
    for name in methods or ():
        registry.get(name)  # an unknown name: the registry's error, with the list
    given = {k: v for k, v in by_flag.items() if v is not None}
    candidates = available_demo_methods(model, drafters=drafters, **given)
    missing = [m for m in methods or () if m not in candidates]
    if missing:
        flags = ", ".join(f"--{registry.get(m).drafter_flag} FOLDER" for m in missing)
        raise ValueError(f"{', '.join(missing)}: no drafter ships for {MODEL_ID}; pass one ({flags}).")
    chosen = {m: candidates[m] for m in (methods or candidates)}
    prompts = demo_prompts()
    encoded = [_encode(tokenizer, p) for _, p in prompts]
    gen = dict(max_new_tokens=max_new_tokens, do_sample=False)
    # warm-up (first calls pay one-time costs)
    model.generate(**encoded[0], max_new_tokens=8, do_sample=False)
    for name, opts in chosen.items():
        model.generate(**encoded[0], max_new_tokens=8, do_sample=False, custom_generate=decoding_method(name, **opts))

    rows = []
    for (kind, _), enc in zip(prompts, encoded):
        for _ in range(repeats):
            t0 = time.perf_counter()
            base = model.generate(**enc, **gen)
            t_base = time.perf_counter() - t0
            n_new = base.shape[1] - enc["input_ids"].shape[1]
            t_kern = None
            if model.device.type == "cpu":
                with padded_plain_decoding(model):
                    t0 = time.perf_counter()
                    padded = model.generate(**enc, **gen)
                    t_kern = time.perf_counter() - t0
                if not torch.equal(padded, base):
                    t_kern = None  # a last-bit tie broken the other way: no fair comparison for this prompt
            for name, opts in chosen.items():
                t0 = time.perf_counter()
                out = model.generate(**enc, **gen, custom_generate=decoding_method(name, **opts),
                                     return_dict_in_generate=True)
                t_spec = time.perf_counter() - t0
                same = torch.equal(out.sequences, base)
                rows.append(dict(kind=kind, method=name, new_tokens=n_new, base_s=t_base, spec_s=t_spec, kernel_s=t_kern,
                                 speedup=t_base / t_spec, tau=out.speculative_stats["acceptance_length"], same=same))
                if verbose:
                    print(f"  [{kind:4s}] {_label(name, opts):16s} {n_new:4d} tokens  plain {n_new / t_base:5.1f} tok/s  "
                          f"{name} {n_new / t_spec:5.1f} tok/s  speedup {t_base / t_spec:4.2f}x  "
                          f"acceptance length {out.speculative_stats['acceptance_length']:.2f}  "
                          + (f"vs padded plain {t_kern / t_spec:4.2f}x  " if t_kern else "") +
                          f"{'identical' if same else 'MISMATCH'}", flush=True)
    summary = {}
    for name in chosen:
        for kind in ("copy", "chat", "math"):
            sel = [r for r in rows if r["method"] == name and r["kind"] == kind]
            if not sel:
                continue
            summary[(name, kind)] = dict(
                speedup=sum(r["base_s"] for r in sel) / sum(r["spec_s"] for r in sel),
                median_speedup=statistics.median(r["speedup"] for r in sel),
                tau=statistics.mean(r["tau"] for r in sel),
                tokens_per_s=sum(r["new_tokens"] for r in sel) / sum(r["spec_s"] for r in sel),
                plain_tokens_per_s=sum(r["new_tokens"] for r in sel) / sum(r["base_s"] for r in sel),
                vs_kernels=(sum(r["kernel_s"] for r in sel) / sum(r["spec_s"] for r in sel)
                            if all(r["kernel_s"] for r in sel) else None),
                identical=all(r["same"] for r in sel),
            )
    if verbose:
        print()
        print(f"{'method':16s} {'prompts':8s} {'plain tok/s':>12s} {'tok/s':>8s} {'speedup':>8s} {'accept len':>10s} "
              f"{'vs padded plain':>15s}  outputs")
        for (name, kind), s in summary.items():
            vs = f"{s['vs_kernels']:14.2f}x" if s["vs_kernels"] else f"{'-':>15s}"
            print(f"{_label(name, chosen[name]):16s} {kind:8s} {s['plain_tokens_per_s']:12.1f} {s['tokens_per_s']:8.1f} "
                  f"{s['speedup']:7.2f}x {s['tau']:10.2f} {vs}  {'identical' if s['identical'] else 'MISMATCH'}")
        if any(s["vs_kernels"] for s in summary.values()):
            print("speedup: over stock generate(); vs padded plain: over plain greedy decoding that uses the same CPU "
                  "kernel trick as the speculative loop (one row computed as two), i.e. speculation's own share")
    return summary, rows
