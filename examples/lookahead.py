"""Lookahead decoding with model.generate(): no drafter, n-grams from Jacobi iterations and from the text itself.

    python examples/lookahead.py

`window_size` (W), `ngram_size` (N) and `guess_set_size` (G) are the paper's. The defaults are sized for a CPU, where
a forward over many tokens costs much more than over few; on a GPU a larger window pays (the paper's 7 / 5 / 7).
The adaptive schedule (default) runs the window and verifies guesses only while they pay for their tokens;
`draft_length_schedule="constant"` always verifies the whole window and every guess, as the reference does.
"""
import time

import hf_specdec
from hf_specdec.default_model import load_smollm2

model, tok = load_smollm2()
chat = [{"role": "user", "content": "Natalia sold clips to 48 of her friends in April, and then she sold half as "
                                    "many clips in May. How many clips did Natalia sell altogether?"}]
inputs = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
lookahead = hf_specdec.custom_generate_path("lookahead")

t0 = time.perf_counter()
plain = model.generate(**inputs, max_new_tokens=96, do_sample=False)
t_plain = time.perf_counter() - t0

for label, opts in [("adaptive (default)", {}),
                    ("constant W=5 N=4 G=4", {"window_size": 5, "ngram_size": 4, "guess_set_size": 4,
                                              "draft_length_schedule": "constant"})]:
    t0 = time.perf_counter()
    out = model.generate(**inputs, max_new_tokens=96, do_sample=False, return_dict_in_generate=True,
                         custom_generate=lookahead, trust_remote_code=True, **opts)
    seconds = time.perf_counter() - t0
    stats = out.speculative_stats
    print(f"{label}: identical {bool((out.sequences == plain).all())}, speedup {t_plain / seconds:.2f}x, "
          f"acceptance length {stats['acceptance_length']:.2f} ({stats['accepted_drafts']} of "
          f"{stats['proposed_drafts']} drafts accepted)")
print(tok.decode(plain[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
