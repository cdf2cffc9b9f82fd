"""Issue 34: eager vs compiled (the ``compile`` option, hf_specdec/compiled.py) on the CPU, SmolLM2-135M-Instruct fp32.

Rows: plain greedy ``generate()`` eager and compiled by transformers (static cache + ``compile_config``), the
speculative loop without drafts (one compiled one-token verification per step) and the methods drafting with a network
(EAGLE-3, DFlash, MTP, Medusa, a draft model, LayerSkip) with their shipped drafters, each eager and with
``compile=True``. A row's first call (compilation, calibration) is reported apart; then the mean over ``--reps`` rounds
of the prompts. ``same`` checks every output against plain eager greedy decoding.

Usage: python benchmarks/compile_cpu.py [--new 64] [--reps 2] [--threads 2] [--rows plain,dflash,dflash_compiled]
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import CompileConfig

import hf_specdec
from hf_specdec.default_model import load_smollm2
from hf_specdec.proposers.base import Proposer

TEXTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips "
    "did Natalia sell altogether in April and May?\nLet's think step by step.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring and a short example.",
    "Explain in three sentences why the sky is blue.",
]


# the rows NAME and NAME_compiled: method and options (layerskip: the shipped exit adapter; layerskip_plain: without)
NETWORK = {"eagle3": ("eagle3", {}), "dflash": ("dflash", {}), "mtp": ("mtp", {}), "medusa": ("medusa", {}),
           "assisted": ("assisted", {}), "layerskip": ("layerskip", {}),
           "layerskip_plain": ("layerskip", {"exit": "plain"})}


class NoDrafts(Proposer):
    """Plain decoding through the speculative loop: never drafts (each step verifies the root alone)."""

    name = "no_drafts"

    def propose(self, state):
        return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rows", default="plain,plain_compiled,loop,loop_compiled,eagle3,eagle3_compiled")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_smollm2(verbose=False)
    encs = []
    for text in TEXTS:
        chat = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        encs.append(tok([chat], return_tensors="pt", add_special_tokens=False))
    kw = dict(max_new_tokens=args.new, do_sample=False, eos_token_id=None)
    compiled_plain = CompileConfig(fullgraph=False, dynamic=False, mode="default")
    compiled_plain._compile_all_devices = True  # transformers compiles on GPUs only unless told (a private flag)

    rows = {
        "plain": dict(),
        "plain_compiled": dict(cache_implementation="static", compile_config=compiled_plain),
        "loop": dict(custom_generate=hf_specdec.decoding_method(NoDrafts())),
        "loop_compiled": dict(custom_generate=hf_specdec.decoding_method(NoDrafts(), compile=True)),
    }
    for row, (method, options) in NETWORK.items():  # each with its shipped drafter, eager and compiled
        rows[row] = dict(custom_generate=hf_specdec.decoding_method(method, **options))
        rows[f"{row}_compiled"] = dict(custom_generate=hf_specdec.decoding_method(method, compile=True, **options))
    with torch.no_grad():
        refs = [model.generate(**enc, **kw) for enc in encs]
        base = None
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.new} new tokens, "
              f"{len(TEXTS)} prompts x {args.reps}", flush=True)
        print(f"{'row':16s} {'first call s':>12s} {'s / call':>9s} {'tok/s':>7s} {'vs plain':>8s} same", flush=True)
        for name in args.rows.split(","):
            extra = rows[name]
            t0 = time.perf_counter()
            model.generate(**encs[0], **kw, **extra)
            first = time.perf_counter() - t0
            same, times = True, []
            for _ in range(args.reps):
                for enc, ref in zip(encs, refs):
                    t0 = time.perf_counter()
                    out = model.generate(**enc, **kw, **extra)
                    times.append(time.perf_counter() - t0)
                    same &= torch.equal(out, ref)
            per_call = sum(times) / len(times)
            base = base or per_call
            print(f"{name:16s} {first:12.1f} {per_call:9.2f} {args.new / per_call:7.1f} {base / per_call:7.2f}x "
                  f"{same}", flush=True)


if __name__ == "__main__":
    main()
