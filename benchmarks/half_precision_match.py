"""Match rate in half precision (benchmarks/RESULTS.md, "bfloat16 on the CPU"): no timing, only counts.

Every method with the drafters shipped for SmolLM2 and transformers' own prompt lookup / assisted decoding, greedy,
on GSM8K and HumanEval prompts, in the given dtypes, one row (batch 1) and left-padded batches of 2: how many outputs
are token-identical to the target's own greedy generate() in the same dtype and batch, with each half-precision
``rounding`` of the loop (``auto``: the default, one-token-step attention and the products that round as one row where
the CPU has them; ``exact``: one-row products where it does not; ``fast``: the packed attention), the first
divergence, and the probe's verdict (``speculative_stats["exact_bits"]``).

    python benchmarks/half_precision_match.py --dtypes bfloat16,float16 --limit 10 --max-new-tokens 128
"""
import argparse
import json

import torch

import hf_specdec
from hf_specdec.bench.data import load
from hf_specdec.default_model import load_smollm2
from hf_specdec.demo import available_demo_methods

parser = argparse.ArgumentParser()
parser.add_argument("--dtypes", default="bfloat16")
parser.add_argument("--limit", type=int, default=10)
parser.add_argument("--max-new-tokens", type=int, default=128)
parser.add_argument("--batch-sizes", default="1,2")
parser.add_argument("--methods", default="prompt_lookup,assisted,eagle3,dflash,medusa,layerskip,mtp,suffix,lookahead")
parser.add_argument("--roundings", default="auto,exact,fast")
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
    configs = {(m, r): {"custom_generate": hf_specdec.decoding_method(m, **drafters.get(m, {}), rounding=r),
                        "return_dict_in_generate": True}
               for m in args.methods.split(",") for r in args.roundings.split(",")}
    configs["hf_prompt_lookup:10", "-"] = {"prompt_lookup_num_tokens": 10}
    if "assisted" in drafters:
        configs["hf_assisted", "-"] = {"assistant_model": drafters["assisted"]["drafter"]}
    texts = [p.text for ds in ("gsm8k", "humaneval") for p in load(ds, args.limit)]
    for bsz in map(int, args.batch_sizes.split(",")):
        for i in range(0, len(texts) - bsz + 1, bsz):
            chats = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                             tokenize=False) for t in texts[i:i + bsz]]
            enc = tok(chats, return_tensors="pt", padding=True, add_special_tokens=False)
            gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
            ref = model.generate(**enc, **gen)
            for (label, rounding), kw in configs.items():
                if bsz > 1 and "custom_generate" not in kw:
                    continue  # transformers' assisted modes take one row
                out = model.generate(**enc, **gen, **kw)
                stats = getattr(out, "speculative_stats", None) or {}
                out = getattr(out, "sequences", out)
                rec = results.setdefault(f"{dtype_name} B={bsz} {label} {rounding}",
                                         {"calls": 0, "identical": 0, "divergence": [], "exact_bits": set()})
                rec["calls"] += 1
                rec["exact_bits"].add(stats.get("exact_bits"))
                div = first_divergence(out, ref)
                rec["identical"] += div is None
                if div is not None:
                    rec["divergence"].append(div - enc["input_ids"].shape[1])
    print("| dtype, batch, method, rounding | identical calls | first divergence (new tokens) | exact_bits |")
    print("|---|---|---|---|")
    for key, rec in results.items():
        if key.startswith(dtype_name):
            bits = "/".join(sorted(str(b) for b in rec["exact_bits"]))
            print(f"| {key} | {rec['identical']}/{rec['calls']} | {sorted(rec['divergence']) or '-'} | {bits} |")
if args.out:
    with open(args.out, "w") as f:
        json.dump({k: {**v, "exact_bits": sorted(map(str, v["exact_bits"]))} for k, v in results.items()}, f,
                  indent=1)
