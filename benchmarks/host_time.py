"""Issue 34: host ms per step outside the target's forwards (and outside the EAGLE-3 drafter's), SmolLM2-135M-Instruct
fp32, batch 1, one GSM8K prompt, 64 new tokens, constant schedules: prompt lookup and EAGLE-3 with the GPU default tree
(10/7/60). Forward hooks time the target and the drafter's modules; the rest of each step is the loop's host work.

Usage: python benchmarks/host_time.py [REPO_ROOT]   (REPO_ROOT: another checkout to measure, default this one)
"""
import sys, time, torch
root = sys.argv[1] if len(sys.argv) > 1 else None
if root:
    sys.path.insert(0, root)
import hf_specdec
from hf_specdec.default_model import load_smollm2
print(hf_specdec.__file__)
torch.set_num_threads(2)
model, tok = load_smollm2()
text = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips "
        "did Natalia sell altogether in April and May? Let's think step by step.")
ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt")
ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
inside = [0.0]
stack = []
def pre(*a): stack.append(time.perf_counter())
def post(*a):
    t0 = stack.pop()
    if not stack:
        inside[0] += time.perf_counter() - t0
drafter_time = [0.0]
dstack = []
drafter_mods = set()
def gpre(mod, args):
    if mod is model:
        pre()
    elif type(mod).__name__ == "Eagle3Drafter" and not drafter_mods:
        drafter_mods.update(id(m) for m in mod.modules())
    if id(mod) in drafter_mods and not stack:
        dstack.append(time.perf_counter())
def gpost(mod, args, out):
    if mod is model:
        post()
    if id(mod) in drafter_mods and not stack and dstack:
        t0 = dstack.pop()
        if not dstack:
            drafter_time[0] += time.perf_counter() - t0
torch.nn.modules.module.register_module_forward_pre_hook(gpre)
torch.nn.modules.module.register_module_forward_hook(gpost)
specs = {
    "prompt_lookup": dict(draft_length_schedule="constant"),
    "eagle3_10_7_60": dict(tree_top_k=10, tree_depth=7, tree_total_tokens=60, draft_length_schedule="constant"),
}
for name, opts in specs.items():
    method = "eagle3" if name.startswith("eagle3") else name
    custom = hf_specdec.decoding_method(method, **opts)
    kw = dict(input_ids=ids, max_new_tokens=64, do_sample=False, custom_generate=custom, return_dict_in_generate=True)
    out = model.generate(**kw)
    best = None
    for rep in range(3):
        inside[0] = 0.0; drafter_time[0] = 0.0
        t0 = time.perf_counter(); out = model.generate(**kw); total = time.perf_counter() - t0
        steps = out.speculative_stats["target_forward_passes"]
        drafting = out.speculative_stats["draft_seconds"]
        host = (total - inside[0]) / steps * 1e3
        host_nodraft = (total - inside[0] - drafter_time[0]) / steps * 1e3
        best = min(best or 1e9, host)
        print(f"{name}: steps {steps} tau {out.speculative_stats['acceptance_length']:.2f} total {total/steps*1e3:.1f} ms/step, "
              f"outside target forwards {host:.2f} ms/step, drafting {drafting/steps*1e3:.2f}, "
              f"outside target and drafter forwards {host_nodraft:.2f}")
