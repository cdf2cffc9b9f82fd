"""EAGLE-3 tau of two drafters side by side (benchmarks/RESULTS.md, 2026-12-04): constant schedule, greedy, 4 prompts
per set, 64 new tokens; edit `drafters` to compare others.  python benchmarks/eagle3_drafter_tau.py out.json"""
import json, sys, torch
torch.set_num_threads(2)
import hf_specdec
from hf_specdec.default_model import load_smollm2
from hf_specdec.bench.data import load
model, tok = load_smollm2(verbose=False)
drafters = {"shipped": "hf_specdec/drafters/smollm2-135m-instruct-eagle3", "new": "runs/eagle3-new"}
configs = {"tree 2/3/4": {"tree_top_k": 2, "tree_depth": 3, "tree_total_tokens": 4},
           "chain 3": {"num_speculative_tokens": 3},
           "reference tree 10/7/60": {"tree_top_k": 10, "tree_depth": 7, "tree_total_tokens": 60}}
out = {}
for ds in ("gsm8k", "humaneval", "mtbench"):
    for p in load(ds, 4):
        enc = tok.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)
        ref = model.generate(**enc, max_new_tokens=64, do_sample=False)
        for name, path in drafters.items():
            for label, opts in configs.items():
                res = model.generate(**enc, max_new_tokens=64, do_sample=False, return_dict_in_generate=True,
                                     custom_generate=hf_specdec.decoding_method("eagle3", draft_length_schedule="constant",
                                                                                drafter=path, **opts))
                s = res.speculative_stats
                a = out.setdefault(ds, {}).setdefault(f"{name} {label}", {"committed": 0, "steps": 0, "identical": True})
                a["committed"] += s["committed_tokens"]; a["steps"] += s["verify_row_steps"]
                a["identical"] &= bool(torch.equal(res.sequences, ref))
for ds, rows in out.items():
    for label, a in rows.items():
        a["tau"] = round(a["committed"] / a["steps"], 3)
        print(f"{ds:9s} {label:32s} tau {a['tau']:.3f} identical {a['identical']}")
json.dump(out, open(sys.argv[1], "w"), indent=1)
