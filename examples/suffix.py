"""Suffix decoding with model.generate(): drafts from the prompt, the output and earlier outputs (no drafter).

    python examples/suffix.py

The same instruction over several standard-library functions: every call drafts from its own prompt and output, and
from the outputs of the calls before it through one `SuffixCache`. Then EAGLE-3 in hybrid mode: the shipped drafter
drafts where the text does not copy, the suffix index where it does.
"""
import time

import hf_specdec
from hf_specdec.bench.data import load
from hf_specdec.default_model import load_smollm2

model, tok = load_smollm2()
suffix = hf_specdec.custom_generate_path("suffix")
cache = hf_specdec.SuffixCache(max_sequences=100)

for prompt in load("repeat", limit=4):
    chat = [{"role": "user", "content": prompt.text}]
    inputs = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    t0 = time.perf_counter()
    plain = model.generate(**inputs, max_new_tokens=96, do_sample=False)
    t_plain = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = model.generate(**inputs, max_new_tokens=96, do_sample=False, custom_generate=suffix,
                         trust_remote_code=True, suffix_cache=cache, return_dict_in_generate=True)
    seconds = time.perf_counter() - t0
    stats = out.speculative_stats
    print(f"{prompt.id}: identical {bool((out.sequences == plain).all())}, speedup {t_plain / seconds:.2f}x, "
          f"acceptance length {stats['acceptance_length']:.2f}, cache {cache.num_sequences} outputs")

out = model.generate(**inputs, max_new_tokens=96, do_sample=False, custom_generate=hf_specdec.custom_generate_path(
    "eagle3"), trust_remote_code=True, hybrid=cache, return_dict_in_generate=True)
print(f"eagle3 + suffix: identical {bool((out.sequences == plain).all())}, acceptance length "
      f"{out.speculative_stats['acceptance_length']:.2f}")
print(tok.decode(plain[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
