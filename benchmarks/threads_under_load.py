"""Issue 15: plain / eagle3 / prompt_lookup with 2 and 1 torch threads, quiet and with one core kept busy
(benchmarks/RESULTS.md). Usage: python benchmarks/threads_under_load.py"""
import time, sys, torch, hf_specdec, contextlib
from hf_specdec.default_model import load_smollm2
from hf_specdec.bench.load import background_load
model, tok = load_smollm2(verbose=False)
text = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?\nLet's think step by step."
chat = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
enc = tok([chat], return_tensors="pt", add_special_tokens=False)
def run(method, **kw):
    t = time.perf_counter()
    if method is None:
        model.generate(**enc, max_new_tokens=48, do_sample=False)
    else:
        model.generate(**enc, max_new_tokens=48, do_sample=False, custom_generate=hf_specdec.decoding_method(method), **kw)
    return time.perf_counter() - t
for m in (None, "eagle3"): run(m)
for threads in (2, 1):
    torch.set_num_threads(threads)
    for loaded in (False, True):
        ctx = background_load() if loaded else contextlib.nullcontext()
        with ctx:
            r = {str(m): min(run(m) for _ in range(2)) for m in (None, "eagle3", "prompt_lookup")}
        print(threads, "loaded" if loaded else "quiet", {k: round(v, 2) for k, v in r.items()}, flush=True)
