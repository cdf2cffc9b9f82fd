"""LayerSkip self-speculation with model.generate(): the target's own first layers draft, no second model.

    python examples/layerskip.py

On SmolLM2-135M-Instruct the exit adapter shipped for it is used (hf_specdec/drafters/smollm2-135m-instruct-layerskip,
trained with the target frozen); `exit="plain"` drafts with the target's own norm and head at the exit layer, which is
what a checkpoint trained with the LayerSkip recipe wants:

    model = AutoModelForCausalLM.from_pretrained("facebook/layerskip-llama3.2-1B")
    model.generate(**inputs, custom_generate="hf_specdec/layerskip", trust_remote_code=True, exit_layer=4)
"""
import time

import hf_specdec
from hf_specdec.default_model import load_smollm2

model, tok = load_smollm2()
chat = [{"role": "user", "content": "Natalia sold clips to 48 of her friends in April, and then she sold half as "
                                    "many clips in May. How many clips did Natalia sell altogether?"}]
inputs = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
layerskip = hf_specdec.custom_generate_path("layerskip")

t0 = time.perf_counter()
plain = model.generate(**inputs, max_new_tokens=96, do_sample=False)
t_plain = time.perf_counter() - t0

for label, opts in [("exit adapter", {}), ("plain exit at layer 8", {"exit_layer": 8, "exit": "plain"})]:
    t0 = time.perf_counter()
    out = model.generate(**inputs, max_new_tokens=96, do_sample=False, return_dict_in_generate=True,
                         custom_generate=layerskip, trust_remote_code=True, **opts)
    seconds = time.perf_counter() - t0
    stats = out.speculative_stats
    print(f"{label}: identical {bool((out.sequences == plain).all())}, speedup {t_plain / seconds:.2f}x, "
          f"acceptance length {stats['acceptance_length']:.2f} ({stats['accepted_drafts']} of "
          f"{stats['proposed_drafts']} drafts accepted)")
print(tok.decode(plain[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
