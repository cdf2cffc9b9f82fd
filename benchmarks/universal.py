"""Method ``universal``: SmolLM2-135M-Instruct (target) with Gemma-3-270M (drafter, another tokenizer), greedy.

The same run, batch 1, fp32, the first N prompts of GSM8K and HumanEval (chat template applied), M new tokens. Per
prompt every entry runs once, in an order that rotates per prompt: stock greedy ``generate()``, the same with the
loop's CPU kernels (``plain_kernels``), transformers' own universal assisted decoding (``assistant_model=gemma,
tokenizer=, assistant_tokenizer=``, its defaults), hf_specdec's loop without drafts (``plain``) and method
``universal`` with the adaptive draft length and with a fixed one. Reported per entry: tokens/s (all prompts'
tokens over their seconds), the median per-prompt speed ratio over transformers' own, over stock ``generate()`` and
over ``plain_kernels``, τ (tokens per target forward) and how many outputs equal stock ``generate()``'s.

Usage: python benchmarks/universal.py [--limit 5] [--new 96] [--fixed 4] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import hf_specdec
from hf_specdec.bench.data import load
from hf_specdec.default_model import load_gemma3_270m, load_smollm2
from hf_specdec.dtypes import cpu_name
from hf_specdec.kernels import padded_plain_decoding


def entries(model, tok, drafter, dtok, fixed: int) -> dict:
    """name -> (generate keywords, context manager factory or None)."""
    universal = dict(assistant_model=drafter, return_dict_in_generate=True)
    return {
        "stock": ({}, None),
        "plain_kernels": ({}, lambda: padded_plain_decoding(model)),
        "transformers_uad": (dict(assistant_model=drafter, tokenizer=tok, assistant_tokenizer=dtok), None),
        "plain": (dict(custom_generate=hf_specdec.decoding_method("plain"), return_dict_in_generate=True), None),
        "universal": (dict(custom_generate=hf_specdec.decoding_method("universal", tokenizer=tok,
                                                                      assistant_tokenizer=dtok), **universal), None),
        f"universal_k{fixed}": (dict(custom_generate=hf_specdec.decoding_method(
            "universal", tokenizer=tok, assistant_tokenizer=dtok, num_speculative_tokens=fixed,
            draft_length_schedule="constant"), **universal), None),
    }


def run(model, enc, kw: dict, context, new: int):
    gen = dict(max_new_tokens=new, do_sample=False, eos_token_id=None, **kw)
    t0 = time.perf_counter()
    if context is not None:
        with context():
            out = model.generate(**enc, **gen)
    else:
        out = model.generate(**enc, **gen)
    seconds = time.perf_counter() - t0
    seq = out.sequences if hasattr(out, "sequences") else out
    stats = getattr(out, "speculative_stats", None)
    return seconds, seq[0, enc["input_ids"].shape[1]:].tolist(), stats


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=5)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--fixed", type=int, default=4)
    ap.add_argument("--datasets", default="gsm8k,humaneval")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(2)
    model, tok = load_smollm2()
    drafter, dtok = load_gemma3_270m()
    table = entries(model, tok, drafter, dtok, args.fixed)
    names = list(table)
    warm = tok.apply_chat_template([{"role": "user", "content": "Hello, who are you?"}], add_generation_prompt=True,
                                   return_tensors="pt", return_dict=True)
    for name in names:  # warm-up: the kernels' timing caches, the loop's cost calibration, the drafter's cost
        run(model, warm, *table[name], new=16)
    records = []
    for ds in args.datasets.split(","):
        for i, prompt in enumerate(load(ds, args.limit)):
            enc = tok.apply_chat_template([{"role": "user", "content": prompt.text}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)
            shift = (len(records) // len(names)) % len(names)
            for name in names[shift:] + names[:shift]:
                seconds, tokens, stats = run(model, enc, *table[name], new=args.new)
                records.append(dict(dataset=ds, prompt=i, entry=name, seconds=seconds, tokens=tokens,
                                    tau=stats["acceptance_length"] if stats else None,
                                    proposed=stats["proposed_drafts"] if stats else None,
                                    accepted=stats["accepted_drafts"] if stats else None))
            print(ds, i, " ".join(f"{r['entry']}={r['seconds']:.1f}s" for r in records[-len(names):]), flush=True)
            if args.out:  # what is done so far (report() reads a partial file too)
                with open(args.out, "w") as f:
                    json.dump(dict(cpu=cpu_name(), torch=torch.__version__, limit=args.limit, new=args.new,
                                   records=records), f)
    result = dict(cpu=cpu_name(), torch=torch.__version__, limit=args.limit, new=args.new, records=records)
    print(report(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f)


def report(result: dict) -> str:
    recs = result["records"]
    by = {(r["dataset"], r["prompt"], r["entry"]): r for r in recs}
    keys = sorted({(r["dataset"], r["prompt"]) for r in recs})
    names = list(dict.fromkeys(r["entry"] for r in recs))

    def ratio(name, base):
        return statistics.median(by[k + (base,)]["seconds"] / by[k + (name,)]["seconds"] for k in keys)

    lines = [f"CPU: {result['cpu']}; torch {result['torch']}; SmolLM2-135M-Instruct target, Gemma-3-270M drafter; "
             f"{len(keys)} prompts ({', '.join(dict.fromkeys(k[0] for k in keys))}), {result['new']} new tokens, "
             "greedy, batch 1, fp32", "",
             "| entry | tokens/s | over transformers' own | over stock generate() | over plain_kernels | τ | "
             "drafts accepted / proposed | outputs = stock |", "|---|---|---|---|---|---|---|---|"]
    for name in names:
        rs = [by[k + (name,)] for k in keys]
        tps = sum(len(r["tokens"]) for r in rs) / sum(r["seconds"] for r in rs)
        same = sum(r["tokens"] == by[k + ("stock",)]["tokens"] for k, r in zip(keys, rs))
        tau = f"{statistics.mean(r['tau'] for r in rs):.2f}" if rs[0]["tau"] is not None else "-"
        acc = f"{sum(r['accepted'] for r in rs)} / {sum(r['proposed'] for r in rs)}" if rs[0]["tau"] is not None \
            else "-"
        lines.append(f"| {name} | {tps:.1f} | {ratio(name, 'transformers_uad'):.2f}x | {ratio(name, 'stock'):.2f}x | "
                     f"{ratio(name, 'plain_kernels'):.2f}x | {tau} | {acc} | {same} of {len(keys)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
