"""How much of a CPU speedup is the verification kernels' and not speculation's (benchmarks/RESULTS.md).

On some CPUs (this project's 2-core AMD EPYC with MKL) the product ``(W @ x.T).T`` over two rows is faster than
MKL's one-row path that plain decoding takes. Plain decoding could use that too, by padding its one row to two.
This script measures exactly that: plain greedy ``generate()`` with the model's own kernels against plain greedy
``generate()`` whose ``nn.Linear`` layers compute one row as two through ``(W @ x.T).T`` (the second row is a copy
and is dropped), on the benchmark's prompts. The ratio is the part of an hf_specdec speedup that a kernel-tuned
plain decoding loop would also have had; divide a reported speedup by it to get speculation's own share.

    python benchmarks/kernel_baseline.py --limit 5 --max-new-tokens 128
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from hf_specdec.bench import data
from hf_specdec.bench.harness import _encode
from hf_specdec.default_model import load_smollm2
from hf_specdec.kernels import _mm_t, plain_cpu_linears


def padded_linears(model):
    """Make every plain ``nn.Linear`` compute a single row as two rows of ``(W @ x.T).T``; returns an undo."""
    patched = plain_cpu_linears(model)
    for module in patched:
        def forward(x, m=module):
            k = m.weight.shape[1]
            if x.numel() != k:
                return F.linear(x, m.weight, m.bias)
            row = x.reshape(1, k)
            return _mm_t(torch.cat([row, row]), m.weight, m.bias)[:1].reshape(*x.shape[:-1], m.weight.shape[0])
        module.forward = forward
    return lambda: [m.__dict__.pop("forward", None) for m in patched]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--datasets", default="mtbench,humaneval,gsm8k,copy")
    args = ap.parse_args()
    model, tok = load_smollm2(verbose=False)
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    print(f"torch threads: {torch.get_num_threads()}")
    for name in args.datasets.split(","):
        ratios, mismatches = [], 0
        t_own = t_pad = 0.0
        for prompt in data.load(name, args.limit):
            enc = _encode(tok, [prompt.text], "cpu")
            model.generate(**enc, max_new_tokens=4, do_sample=False)
            t0 = time.perf_counter()
            own = model.generate(**enc, **gen)
            a = time.perf_counter() - t0
            undo = padded_linears(model)
            try:
                t0 = time.perf_counter()
                pad = model.generate(**enc, **gen)
                b = time.perf_counter() - t0
            finally:
                undo()
            mismatches += int(not torch.equal(own, pad))
            ratios.append(a / b)
            t_own, t_pad = t_own + a, t_pad + b
        print(f"{name:10s} plain decoding, one row padded to two: {statistics.median(ratios):.2f}x (median), "
              f"{t_own / t_pad:.2f}x (total) over the model's own kernels; outputs differing: {mismatches}",
              flush=True)


if __name__ == "__main__":
    main()
