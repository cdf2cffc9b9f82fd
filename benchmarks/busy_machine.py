"""Issue 15: quiet vs loaded rounds (one core kept busy by hf_specdec.bench.load.background_load), interleaved:
seconds, tau and proposed drafts of every method, adaptive and constant schedules; every output checked against
plain greedy decoding. Usage: python benchmarks/busy_machine.py [NEW_TOKENS] [OUT.json] (benchmarks/RESULTS.md)."""
import json, statistics, sys, time
import torch, hf_specdec
from hf_specdec.default_model import load_smollm2
from hf_specdec.bench.load import background_load
from hf_specdec.kernels import padded_plain_decoding

model, tok = load_smollm2(verbose=False)
prompts = {
 "gsm8k": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?\nLet's think step by step.",
 "humaneval": "Complete this Python function.\n\ndef has_close_elements(numbers: list[float], threshold: float) -> bool:\n    \"\"\"Check if in given list of numbers, are any two numbers closer to each other than given threshold.\n    >>> has_close_elements([1.0, 2.0, 3.0], 0.5)\n    False\n    \"\"\"\n",
}
N = int(sys.argv[1]) if len(sys.argv) > 1 else 96
rows = [("plain", None, {}), ("plain_kernels", None, {}),
        ("prompt_lookup", "prompt_lookup", {}), ("prompt_lookup constant", "prompt_lookup", {"draft_length_schedule": "constant"}),
        ("eagle3", "eagle3", {}), ("eagle3 constant", "eagle3", {"draft_length_schedule": "constant"}),
        ("dflash", "dflash", {}), ("assisted", "assisted", {}), ("assisted constant", "assisted", {"draft_length_schedule": "constant"})]
def run(name, method, opts, enc):
    t = time.perf_counter()
    if name == "plain":
        out = model.generate(**enc, max_new_tokens=N, do_sample=False); st = None
    elif name == "plain_kernels":
        with padded_plain_decoding(model):
            out = model.generate(**enc, max_new_tokens=N, do_sample=False)
        st = None
    else:
        o = model.generate(**enc, max_new_tokens=N, do_sample=False, return_dict_in_generate=True,
                           custom_generate=hf_specdec.decoding_method(method), **opts)
        out, st = o.sequences, o.speculative_stats
    return time.perf_counter() - t, out, st
results = []
for ds, text in prompts.items():
    chat = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    enc = tok([chat], return_tensors="pt", add_special_tokens=False)
    ref = model.generate(**enc, max_new_tokens=N, do_sample=False)
    for r in rows: run(*r, enc)  # warm-up
    for loaded in (False, True, False, True):
        ctx = background_load() if loaded else __import__("contextlib").nullcontext()
        with ctx:
            for name, method, opts in rows:
                secs, out, st = run(name, method, opts, enc)
                same = torch.equal(out, ref)
                results.append(dict(ds=ds, loaded=loaded, name=name, secs=secs, same=same,
                                    tau=st and st["acceptance_length"], proposed=st and st["proposed_drafts"]))
                print(ds, "loaded" if loaded else "quiet ", f"{name:24s} {secs:6.1f}s", "same" if same else "DIFF",
                      "" if st is None else f"tau {st['acceptance_length']:.2f} proposed {st['proposed_drafts']}", flush=True)
json.dump(results, open(sys.argv[2] if len(sys.argv) > 2 else "busy_machine.json", "w"), indent=1)
