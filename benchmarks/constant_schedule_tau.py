"""Deterministic acceptance counters (benchmarks/RESULTS.md, 2026-12-01): no timing enters any decision.

Every method with draft_length_schedule="constant", greedy, the drafters shipped for SmolLM2, 4 prompts per set,
64 new tokens. Prints exact counters per set and writes them to a JSON file; run it in two checkouts and diff
to show that a change leaves drafting and acceptance as they were.

    python benchmarks/constant_schedule_tau.py out.json
"""
import json, sys
import torch
torch.set_num_threads(2)
import hf_specdec
from hf_specdec.default_model import load_smollm2
from hf_specdec.demo import available_demo_methods
from hf_specdec.bench.data import load

model, tok = load_smollm2(verbose=False)
drafters = available_demo_methods(model)
configs = {
    "prompt_lookup": ("prompt_lookup", {}),
    "assisted chain 3": ("assisted", {"num_speculative_tokens": 3}),
    "eagle3 tree 2/3/4": ("eagle3", {"tree_top_k": 2, "tree_depth": 3, "tree_total_tokens": 4}),
    "eagle3 chain 3": ("eagle3", {"num_speculative_tokens": 3}),
    "dflash block 16": ("dflash", {"tree_budget": 0}),  # the chain (the row's meaning before DDTree)
    "dflash ddtree 15": ("dflash", {"tree_budget": 15}),
}
out = {}
for ds in ("gsm8k", "humaneval", "mtbench"):
    for p in load(ds, 4):
        enc = tok.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)
        ref = model.generate(**enc, max_new_tokens=64, do_sample=False)
        for label, (method, opts) in configs.items():
            res = model.generate(**enc, max_new_tokens=64, do_sample=False, return_dict_in_generate=True,
                                 custom_generate=hf_specdec.decoding_method(method, draft_length_schedule="constant",
                                                                            **drafters[method], **opts))
            s = res.speculative_stats
            acc = out.setdefault(ds, {}).setdefault(label, {"committed": 0, "steps": 0, "proposed": 0, "accepted": 0,
                                                             "identical": True})
            acc["committed"] += s["committed_tokens"]; acc["steps"] += s["verify_row_steps"]
            acc["proposed"] += s["proposed_drafts"]; acc["accepted"] += s["accepted_drafts"]
            acc["identical"] &= bool(torch.equal(res.sequences, ref))
for ds, rows in out.items():
    for label, a in rows.items():
        a["tau"] = round(a["committed"] / a["steps"], 4)
        print(f"{ds:9s} {label:18s} tau {a['tau']:.4f}  proposed {a['proposed']:5d} accepted {a['accepted']:5d} "
              f"identical {a['identical']}")
json.dump(out, open(sys.argv[1], "w"), indent=1)
