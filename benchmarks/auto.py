"""`auto`: transformers' own speculative arguments in transformers' loop and in hf_specdec's, on SmolLM2-135M-Instruct.

Each of transformers' arguments is run twice in the same process, back to back in an order that rotates per prompt:
as transformers runs it (`generate(prompt_lookup_num_tokens=10)`, `generate(assistant_model=student)`,
`generate(assistant_early_exit=8)`) and with `custom_generate=hf_specdec.decoding_method("auto")` added — nothing else
changed. Stock `generate()` and `plain_kernels` (stock with the loop's CPU kernels) run beside them. The assistant is
the student shipped for SmolLM2 (`hf_specdec/drafters/smollm2-135m-instruct-student`; transformers reads its
generation config: 20 tokens, 'constant', confidence 0.4 by default). Greedy, batch 1, fp32; every output is checked
against stock `generate()`. Ratios are medians of per-prompt ratios.

Usage: python benchmarks/auto.py [--limit 2] [--new 64] [--datasets gsm8k,humaneval,mtbench]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import hf_specdec
from hf_specdec.bench.data import load
from hf_specdec.default_model import load_smollm2
from hf_specdec.draft_models import load_draft_model
from hf_specdec.dtypes import cpu_name
from hf_specdec.kernels import padded_plain_decoding
from hf_specdec.registry import shipped_folder


def entries(model, student) -> dict:
    """name -> (generate keywords, context factory or None, the transformers entry it is compared with)."""
    auto = dict(custom_generate=hf_specdec.decoding_method("auto"), return_dict_in_generate=True)
    out = {"stock": ({}, None, None), "plain_kernels": ({}, lambda: padded_plain_decoding(model), None)}
    for name, args in (("prompt_lookup_num_tokens=10", dict(prompt_lookup_num_tokens=10)),
                       ("assistant_model=student", dict(assistant_model=student)),
                       ("assistant_early_exit=8", dict(assistant_early_exit=8))):
        out[f"transformers {name}"] = (args, None, None)
        out[f"auto {name}"] = ({**args, **auto}, None, f"transformers {name}")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=2)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--datasets", default="gsm8k,humaneval,mtbench")
    args = ap.parse_args()
    model, tok = load_smollm2()
    student = load_draft_model(shipped_folder("smollm2-135m-instruct-student"), model)
    table = entries(model, student)
    names = list(table)
    records = []
    step = 0
    for ds in args.datasets.split(","):
        for i, prompt in enumerate(load(ds, limit=args.limit)):
            chat = [{"role": "user", "content": prompt.text}]
            enc = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
            n = enc["input_ids"].shape[1]
            order = names[step % len(names):] + names[:step % len(names)]
            step += 1
            for name in order:
                kw, context, _ = table[name]
                gen = dict(max_new_tokens=args.new, do_sample=False, eos_token_id=None, **kw)
                t0 = time.perf_counter()
                with context() if context is not None else torch.no_grad():
                    out = model.generate(**enc, **gen)
                seconds = time.perf_counter() - t0
                seq = out.sequences if hasattr(out, "sequences") else out
                stats = getattr(out, "speculative_stats", None)
                records.append(dict(key=(ds, i), entry=name, seconds=seconds, tokens=seq[0, n:].tolist(),
                                    tau=stats["acceptance_length"] if stats else None,
                                    method=stats["method"] if stats else None))
            print(ds, i, " ".join(f"{r['entry']}={r['seconds']:.1f}s" for r in records[-len(names):]), flush=True)
    by = {(r["key"], r["entry"]): r for r in records}
    keys = list(dict.fromkeys(r["key"] for r in records))

    def ratio(name, base):
        return statistics.median(by[k, base]["seconds"] / by[k, name]["seconds"] for k in keys)

    print(f"\nCPU: {cpu_name()}; torch {torch.__version__}; SmolLM2-135M-Instruct fp32, greedy, batch 1, "
          f"{len(keys)} prompts ({args.datasets}, {args.limit} each), {args.new} new tokens\n")
    print("| entry | method run | tokens/s | over transformers' own | over stock | over plain_kernels | τ | = stock |")
    print("|---|---|---|---|---|---|---|---|")
    for name in names:
        rows = [by[k, name] for k in keys]
        speed = sum(len(r["tokens"]) for r in rows) / sum(r["seconds"] for r in rows)
        same = sum(by[k, name]["tokens"] == by[k, "stock"]["tokens"] for k in keys)
        versus = table[name][2]
        taus = [r["tau"] for r in rows if r["tau"] is not None]
        print(f"| {name} | {rows[0]['method'] or '-'} | {speed:.1f} | "
              f"{f'{ratio(name, versus):.2f}x' if versus else '-'} | {ratio(name, 'stock'):.2f}x | "
              f"{ratio(name, 'plain_kernels'):.2f}x | {f'{statistics.mean(taus):.2f}' if taus else '-'} | "
              f"{same}/{len(keys)} |")


if __name__ == "__main__":
    main()
