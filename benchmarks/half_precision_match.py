"""Match rate in half precision (benchmarks/RESULTS.md, "bfloat16 on the CPU"): no timing, only counts.

Every method with the drafters shipped for SmolLM2 and transformers' own prompt lookup / assisted decoding, greedy,
on GSM8K and HumanEval prompts, in the given dtypes, one row (batch 1) and left-padded batches of 2: how many outputs
are token-identical to the target's own greedy generate() in the same dtype and batch, with the CPU kernel runner's
half-precision rounding (``exact``: each verified token rounds as a one-token step, kernels._ExactRows) and without
it (``packed``: the attention of all tokens in one call, what this project did before), and the first divergence.

    python benchmarks/half_precision_match.py --dtypes bfloat16,float16 --limit 10 --max-new-tokens 128
"""
import argparse
import json

import torch

import hf_specdec
from hf_specdec.bench.data import load
from hf_specdec.default_model import load_smollm2
from hf_specdec.demo import available_demo_methods
from hf_specdec.runners import runner_for

parser = argparse.ArgumentParser()
parser.add_argument("--dtypes", default="bfloat16")
parser.add_argument("--limit", type=int, default=10)
parser.add_argument("--max-new-tokens", type=int, default=128)
parser.add_argument("--batch-sizes", default="1,2")
parser.add_argument("--methods", default="prompt_lookup,assisted,eagle3,dflash,medusa,layerskip,mtp,suffix,lookahead")
parser.add_argument("--out", default=None)
args = parser.parse_args()
torch.set_num_threads(2)


def first_divergence(a, b):
    n = min(a.shape[-1], b.shape[-1])
    diff = (a[..., :n] != b[..., :n]).nonzero()
    return int(diff[:, -1].min()) if len(diff) else (None if a.shape == b.shape else n)


results = {}
for dtype_name in args.dtypes.split(","):
    model, tok = load_smollm2(dtype=getattr(torch, dtype_name), verbose=False)
    drafters = available_demo_methods(model)
    configs = {m: {"custom_generate": hf_specdec.decoding_method(m, **drafters.get(m, {}))}
               for m in args.methods.split(",")}
    configs["hf_prompt_lookup:10"] = {"prompt_lookup_num_tokens": 10}
    if "assisted" in drafters:
        configs["hf_assisted"] = {"assistant_model": drafters["assisted"]["drafter"]}
    texts = [p.text for ds in ("gsm8k", "humaneval") for p in load(ds, args.limit)]
    for bsz in map(int, args.batch_sizes.split(",")):
        for i in range(0, len(texts) - bsz + 1, bsz):
            chats = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                             tokenize=False) for t in texts[i:i + bsz]]
            enc = tok(chats, return_tensors="pt", padding=True, add_special_tokens=False)
            gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
            ref = model.generate(**enc, **gen)
            for label, kw in configs.items():
                if bsz > 1 and "custom_generate" not in kw:
                    continue  # transformers' assisted modes take one row
                for rounding in (("exact", "packed") if "custom_generate" in kw else ("-",)):
                    runner_for(model).exact = rounding != "packed"
                    out = model.generate(**enc, **gen, **kw)
                    rec = results.setdefault(f"{dtype_name} B={bsz} {label} {rounding}",
                                             {"calls": 0, "identical": 0, "divergence": []})
                    rec["calls"] += 1
                    div = first_divergence(out, ref)
                    rec["identical"] += div is None
                    if div is not None:
                        rec["divergence"].append(div - enc["input_ids"].shape[1])
            runner_for(model).exact = True
    print(f"| dtype, batch, method, rounding | identical calls | first divergence (new tokens) |")
    print("|---|---|---|")
    for key, rec in results.items():
        if key.startswith(dtype_name):
            print(f"| {key} | {rec['identical']}/{rec['calls']} | {sorted(rec['divergence']) or '-'} |")
if args.out:
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
