"""Issue 16: tau of the shipped Medusa heads (or a heads folder: argv[1]) with every tree node verified, for several
trees; 4 prompts per set, 64 new tokens, outputs checked against plain greedy decoding (benchmarks/RESULTS.md).
Usage: python benchmarks/medusa_tree_tau.py [HEADS_FOLDER] [PROMPTS_PER_SET]"""
import sys, torch, hf_specdec
torch.set_num_threads(2)
from hf_specdec.default_model import load_smollm2
from hf_specdec.bench.data import load
from hf_specdec.modeling.medusa import MedusaHeads
from hf_specdec.proposers.medusa import MC_SIM_7B_63
model, tok = load_smollm2(verbose=False)
heads = MedusaHeads.from_pretrained(sys.argv[1] if len(sys.argv) > 1 else hf_specdec.shipped_drafter("medusa")).to(torch.float32)
configs = {"pool8": {"medusa_choices": list(MC_SIM_7B_63[:8])}, "pool4": {"medusa_choices": list(MC_SIM_7B_63[:4])},
           "pool15": {"medusa_choices": list(MC_SIM_7B_63[:15])},
           "chain3": {"num_speculative_tokens": 3}}
n = int(sys.argv[2]) if len(sys.argv) > 2 else 4
for ds in ("gsm8k", "humaneval", "mtbench"):
    acc = {k: [0, 0] for k in configs}
    for p in load(ds, n):
        enc = tok.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True, return_tensors="pt", return_dict=True)
        ref = model.generate(**enc, max_new_tokens=64, do_sample=False)
        for k, o in configs.items():
            r = model.generate(**enc, max_new_tokens=64, do_sample=False, return_dict_in_generate=True,
                               custom_generate=hf_specdec.decoding_method("medusa", drafter=heads, draft_length_schedule="constant", **o))
            assert torch.equal(r.sequences, ref)
            print(ds, k, round(r.speculative_stats["acceptance_length"], 2), round(r.speculative_stats["total_seconds"], 1), flush=True)
            acc[k][0] += r.speculative_stats["committed_tokens"]; acc[k][1] += r.speculative_stats["verify_row_steps"]
    print(ds, {k: round(a / b, 3) for k, (a, b) in acc.items()}, flush=True)
