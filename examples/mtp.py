"""Multi-token prediction with model.generate(): an MTP module drafts from the target's own last hidden state.

    python examples/mtp.py

On SmolLM2-135M-Instruct the module shipped for it is used (hf_specdec/drafters/smollm2-135m-instruct-mtp, trained
post hoc with the target frozen). A model published with MTP layers drafts with its own, read from the one
checkpoint shard that holds them:

    model = AutoModelForCausalLM.from_pretrained("deepseek-ai/DeepSeek-V3", dtype="auto", device_map="auto")
    model.generate(**inputs, custom_generate="hf_specdec/mtp", trust_remote_code=True,
                   drafter="deepseek-ai/DeepSeek-V3")
"""
import time

import hf_specdec
from hf_specdec.default_model import load_smollm2

model, tok = load_smollm2()
chat = [{"role": "user", "content": "Natalia sold clips to 48 of her friends in April, and then she sold half as "
                                    "many clips in May. How many clips did Natalia sell altogether?"}]
inputs = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
mtp = hf_specdec.custom_generate_path("mtp")

t0 = time.perf_counter()
plain = model.generate(**inputs, max_new_tokens=96, do_sample=False)
t_plain = time.perf_counter() - t0

for label, opts in [("chain of 3 (default)", {}), ("dynamic tree 2 / 3 / 4", {"tree_top_k": 2, "tree_depth": 3,
                                                                             "tree_total_tokens": 4})]:
    t0 = time.perf_counter()
    out = model.generate(**inputs, max_new_tokens=96, do_sample=False, return_dict_in_generate=True,
                         custom_generate=mtp, trust_remote_code=True, **opts)
    seconds = time.perf_counter() - t0
    stats = out.speculative_stats
    print(f"{label}: identical {bool((out.sequences == plain).all())}, speedup {t_plain / seconds:.2f}x, "
          f"acceptance length {stats['acceptance_length']:.2f} ({stats['accepted_drafts']} of "
          f"{stats['proposed_drafts']} drafts accepted)")
print(tok.decode(plain[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
