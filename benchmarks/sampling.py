"""Issue 35: coupled (Gumbel-max) vs rejection speculative sampling, the same run.

SmolLM2-135M-Instruct (fp32) with the drafters shipped in hf_specdec/drafters, batch 1, sampled at temperature 0.7
and 1.0 (top_k=0, top_p=1: the whole distribution), the first N prompts of GSM8K, HumanEval and MT-bench. Per prompt
and temperature every entry runs once with seed = the prompt's index, in an order that rotates per prompt: stock
sampled ``generate()``, the same with the loop's CPU kernels (``plain_kernels``), the loop without drafts
(``plain``, coupled), and each method coupled and with rejection sampling (``draft_length_schedule`` the method's
default, adaptive). Reported: τ (tokens per target forward), speed over stock ``generate()`` and over
``plain_kernels`` (median of per-prompt ratios), and whether every coupled text equals the plain loop's.

Usage: python benchmarks/sampling.py [--limit 4] [--new 64] [--methods prompt_lookup,eagle3,...] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import hf_specdec
from hf_specdec.bench.data import load
from hf_specdec.default_model import load_smollm2
from hf_specdec.demo import available_demo_methods
from hf_specdec.dtypes import cpu_name
from hf_specdec.kernels import padded_plain_decoding

METHODS = ["prompt_lookup", "assisted", "eagle3", "dflash", "medusa", "mtp", "layerskip"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--temperatures", default="0.7,1.0")
    ap.add_argument("--datasets", default="gsm8k,humaneval,mtbench")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(2)
    model, tok = load_smollm2()
    methods = args.methods.split(",")
    temps = [float(t) for t in args.temperatures.split(",")]
    entries = ["stock", "plain_kernels", "plain"] + [f"{m}/{mode}" for m in methods for mode in ("coupled",
                                                                                                 "rejection")]
    loaded = available_demo_methods(model, only=methods)  # each shipped drafter loaded once
    customs = {m: hf_specdec.decoding_method(m, **loaded.get(m, {})) for m in ["plain"] + methods}
    records = []
    # warm-up: every method once (drafter loading, calibration of the forward costs)
    enc = tok.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    for m, custom in customs.items():
        model.generate(**enc, max_new_tokens=16, do_sample=True, custom_generate=custom, seed=0)
    model.generate(**enc, max_new_tokens=16, do_sample=True)
    for ds in args.datasets.split(","):
        for i, prompt in enumerate(load(ds, args.limit)):
            enc = tok.apply_chat_template([{"role": "user", "content": prompt.text}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)
            for temp in temps:
                gen = dict(max_new_tokens=args.new, do_sample=True, temperature=temp, top_k=0, top_p=1.0,
                           eos_token_id=None)
                shift = (i + temps.index(temp)) % len(entries)
                for entry in entries[shift:] + entries[:shift]:
                    kw = dict(gen)
                    context = None
                    if entry == "stock":
                        torch.manual_seed(i)
                    elif entry == "plain_kernels":
                        torch.manual_seed(i)
                        context = padded_plain_decoding(model)
                    else:
                        name, _, mode = entry.partition("/")
                        kw.update(custom_generate=customs[name], seed=i, return_dict_in_generate=True,
                                  speculative_sampling=mode or "coupled")
                    t0 = time.perf_counter()
                    if context is not None:
                        with context:
                            out = model.generate(**enc, **kw)
                    else:
                        out = model.generate(**enc, **kw)
                    seconds = time.perf_counter() - t0
                    seq = out.sequences if hasattr(out, "sequences") else out
                    stats = getattr(out, "speculative_stats", None)
                    records.append(dict(dataset=ds, prompt=i, temperature=temp, entry=entry, seconds=seconds,
                                        new=seq.shape[1] - enc["input_ids"].shape[1],
                                        tokens=seq[0, enc["input_ids"].shape[1]:].tolist(),
                                        tau=stats["acceptance_length"] if stats else None,
                                        noise_seconds=stats["noise_seconds"] if stats else None,
                                        forwards=stats["target_forward_passes"] if stats else None))
            print(ds, i, flush=True)
    result = dict(cpu=cpu_name(), torch=torch.__version__, limit=args.limit, new=args.new, records=records)
    print(report(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f)


def report(result: dict) -> str:
    recs = result["records"]
    by = {}
    for r in recs:
        by[(r["dataset"], r["prompt"], r["temperature"], r["entry"])] = r
    lines = [f"CPU: {result['cpu']}; torch {result['torch']}; {result['limit']} prompts per set, {result['new']} new "
             "tokens, batch 1, fp32", ""]
    temps = sorted({r["temperature"] for r in recs})
    sets = list(dict.fromkeys(r["dataset"] for r in recs))
    entries = list(dict.fromkeys(r["entry"] for r in recs))
    methods = list(dict.fromkeys(e.split("/")[0] for e in entries if "/" in e))
    for temp in temps:
        lines += [f"temperature {temp}: τ coupled / rejection | speed over stock generate() coupled / rejection | "
                  "over plain_kernels coupled / rejection (median per-prompt ratio)", "",
                  "| method | " + " | ".join(sets) + " |", "|---|" + "---|" * len(sets)]
        for m in ["plain"] + methods:
            cells = []
            for ds in sets:
                prompts = sorted({r["prompt"] for r in recs if r["dataset"] == ds})
                modes = ["coupled"] if m == "plain" else ["coupled", "rejection"]
                taus, vs_stock, vs_kern = [], [], []
                for mode in modes:
                    e = m if m == "plain" else f"{m}/{mode}"
                    rs = [by[(ds, p, temp, e)] for p in prompts]
                    taus.append(statistics.mean(r["tau"] for r in rs))
                    vs_stock.append(statistics.median(by[(ds, p, temp, "stock")]["seconds"] / by[(ds, p, temp, e)]
                                                      ["seconds"] for p in prompts))
                    vs_kern.append(statistics.median(by[(ds, p, temp, "plain_kernels")]["seconds"] /
                                                     by[(ds, p, temp, e)]["seconds"] for p in prompts))
                cells.append(" / ".join(f"{t:.2f}" for t in taus) + " \\| " + " / ".join(f"{v:.2f}x" for v in vs_stock)
                             + " \\| " + " / ".join(f"{v:.2f}x" for v in vs_kern))
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        lines.append("")
    same = [by[(r["dataset"], r["prompt"], r["temperature"], "plain")]["tokens"] == r["tokens"]
            for r in recs if r["entry"].endswith("/coupled")]
    lines.append(f"coupled texts equal to the plain loop's (same seed): {sum(same)} of {len(same)}")
    noise = [r["noise_seconds"] / r["forwards"] * 1e3 for r in recs if r["entry"].endswith("coupled") or
             r["entry"] == "plain"]
    if noise:
        lines.append(f"noise per target forward: median {statistics.median(noise):.3f} ms")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
