"""DDTree vs the DFlash chain on SmolLM2-135M-Instruct with the shipped DFlash drafter (benchmarks/RESULTS.md).

One ``hf-specdec bench`` run per dtype (float32, bfloat16; :func:`hf_specdec.bench.run_bench`: warm-up, the methods
in an order that rotates per prompt, every output compared with plain ``generate()``), greedy, constant schedules:

* ``DFlash chain (block 16)``: ``dflash_fixed:16:tree_budget=0``, every block position verified;
* ``DDTree (budget N)``: ``ddtree:N:draft_length_schedule=constant``, the N most likely nodes of the block's
  per-position distributions (best first), verified in one forward (15, the default: as many nodes as the chain);
* ``--adaptive`` adds both with the adaptive schedule (the methods' defaults: sizes from the measured costs);

beside ``plain`` (stock ``generate()``) and ``plain_kernels`` (the loop's CPU kernels given to plain decoding), on the
bench's GSM8K / HumanEval / MT-bench prompts. Prints per dtype the harness's table, then τ (committed tokens per
verification step), tok/s, the speedups over ``plain`` and ``plain_kernels`` and whether every output equals
``generate()``'s (bfloat16: the match rate, identical up to rounding), and DDTree's τ over the chain's per dataset.

    python benchmarks/ddtree.py [--limit 4] [--max-new-tokens 64] [--budgets 15,32] [--dtypes float32,bfloat16]
                                [--adaptive] [--out runs/ddtree]
"""

from __future__ import annotations

import argparse

import torch

from hf_specdec import registry
from hf_specdec.bench import build_methods, markdown, run_bench
from hf_specdec.default_model import load_smollm2

DATASETS = ("gsm8k", "humaneval", "mtbench")
CHAIN = "dflash_fixed:16:tree_budget=0"
ADAPTIVE_CHAIN = "dflash_chain"


def rows(budgets: list[int], adaptive: bool) -> dict[str, str]:
    """Bench method string -> row label."""
    out = {CHAIN: "DFlash chain (block 16)"}
    out.update({f"ddtree:{n}:draft_length_schedule=constant": f"DDTree (budget {n})" for n in budgets})
    if adaptive:
        out[ADAPTIVE_CHAIN] = "DFlash chain (block 16), adaptive"
        out.update({f"ddtree:{n}": f"DDTree (budget {n}), adaptive" for n in budgets})
    return out


def run(dtype: torch.dtype, labels: dict[str, str], limit: int, new: int, out: str | None) -> dict:
    model, tok = load_smollm2(dtype=dtype, verbose=False)
    drafter = registry.load_drafter("dflash", None, model)  # the shipped one, in the target's dtype
    methods = build_methods(["plain_kernels", *labels], dflash=drafter)
    return run_bench(model, tok, methods, list(DATASETS), limit, new, count_syncs=False,
                     out=f"{out}/{str(dtype).removeprefix('torch.')}" if out else None,
                     config={"script": "benchmarks/ddtree.py", "dtype": str(dtype)})


def table(result: dict, labels: dict[str, str]) -> str:
    """τ, tok/s, speedups and identity per dataset and row, then DDTree's τ over the chain's."""
    names = {"plain": "plain generate()", "plain_kernels": "plain_kernels", **labels}
    lines = ["| dataset | row | τ | tok/s | vs plain | vs plain_kernels | identical |", "|---" * 7 + "|"]
    tau = {}
    for r in result["summary"]:
        tau[r["dataset"], r["method"]] = r["tau"]
        same = f"{r['match_rate']:.0%}" if "match_rate" in r else "yes" if not r["mismatches"] else \
            f"no ({r['mismatches']})"
        kernels = r.get("speedup_vs_kernels")
        cells = [r["dataset"], names.get(r["method"], r["method"]), f"{r['tau']:.2f}" if r["tau"] else "–",
                 f"{r['tokens_per_s']:.1f}", f"{r['speedup_median']:.2f}x", f"{kernels:.2f}x" if kernels else "–",
                 same]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for ds in DATASETS:  # each tree against the chain of its schedule
        ratios = []
        for m in labels:
            chain = CHAIN if "constant" in m else ADAPTIVE_CHAIN
            if m.startswith("ddtree") and tau.get((ds, m)) and tau.get((ds, chain)):
                ratios.append(f"{labels[m]} {tau[ds, m] / tau[ds, chain]:.2f}x")
        lines.append(f"{ds}: DDTree's τ over the chain's (same schedule): " + ", ".join(ratios))
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--limit", type=int, default=4, help="prompts per dataset")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--budgets", default="15,32", help="DDTree node budgets, comma separated")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--adaptive", action="store_true", help="also the adaptive schedules (the methods' defaults)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="a folder for the harness's bench.json / bench.md per dtype")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    labels = rows([int(n) for n in args.budgets.split(",")], args.adaptive)
    for name in args.dtypes.split(","):
        result = run(getattr(torch, name), labels, args.limit, args.max_new_tokens, args.out)
        print(f"\n## {name}\n\n{markdown(result)}\n\n{table(result, labels)}", flush=True)


if __name__ == "__main__":
    main()
