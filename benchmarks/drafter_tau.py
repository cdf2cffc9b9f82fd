"""tau of a method's shipped drafter and another side by side (benchmarks/RESULTS.md): constant schedule, greedy, 4
prompts per set (GSM8K, HumanEval, MT-bench) and, with a corpus folder, 8 held-out chat prompts (the first user turns
of its held-out split, up to 256 tokens), 64 new tokens; every output checked against generate().

    python benchmarks/drafter_tau.py out.json METHOD NEW_DRAFTER [CORPUS]   (e.g. eagle3 runs/eagle3-gpu runs/corpus)
"""
import json, sys, torch
torch.set_num_threads(2)
import hf_specdec
from hf_specdec.default_model import load_smollm2
from hf_specdec.bench.data import load
model, tok = load_smollm2(verbose=False)
method = sys.argv[2]
drafters = {"shipped": f"hf_specdec/drafters/smollm2-135m-instruct-{method}", "new": sys.argv[3]}
configs = {"eagle3": {"tree 2/3/4": {"tree_top_k": 2, "tree_depth": 3, "tree_total_tokens": 4},
                      "chain 3": {"num_speculative_tokens": 3},
                      "reference tree 10/7/60": {"tree_top_k": 10, "tree_depth": 7, "tree_total_tokens": 60}},
           "mtp": {"chain 3": {"num_speculative_tokens": 3}},
           "dflash": {"ddtree 15": {"tree_budget": 15}, "block 16": {"tree_budget": 0}}}[method]
sets = {ds: [p.text for p in load(ds, 4)] for ds in ("gsm8k", "humaneval", "mtbench")}
if len(sys.argv) > 4:  # the corpus' held-out chat: first user turns the training never saw
    records = json.load(open(f"{sys.argv[4]}/heldout.json"))
    firsts = [r["conversations"][0]["value"] for r in records]
    sets["heldout"] = [t for t in firsts if 8 <= len(tok(t)["input_ids"]) <= 256][:8]
out = {}
for ds, prompts in sets.items():
    for text in prompts:
        enc = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)
        ref = model.generate(**enc, max_new_tokens=64, do_sample=False)
        for name, path in drafters.items():
            for label, opts in configs.items():
                res = model.generate(**enc, max_new_tokens=64, do_sample=False, return_dict_in_generate=True,
                                     custom_generate=hf_specdec.decoding_method(method, draft_length_schedule="constant",
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
