"""The batched-throughput sweep (``hf-specdec bench --batch-size 1,4,16``): :func:`run_bench` once per batch size,
then tokens/s of every method against plain batched ``generate()`` per size (:func:`batch_summary`), as a table
(:func:`batch_markdown`)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from .methods import BenchMethod
from .run import SCHEMA, run_bench


def batch_sweep(model, tokenizer, methods: list[BenchMethod], datasets: list[str], batch_sizes: list[int],
                limit: int, max_new_tokens: int, out: str | None = None, progress: bool = True, rounds: int = 1,
                **kwargs) -> dict:
    """Batched throughput: :func:`run_bench` once per batch size, on the first ``max(limit, rounds * B)`` prompts of
    each dataset for batch size ``B`` (the same prompts for every method; ``rounds``: at least that many batches per
    size, each timing plain ``generate()`` and every method in turn), then tokens/s per method and batch size against
    plain batched ``generate()`` at that size (:func:`batch_summary`, :func:`batch_markdown`). Each batch size's full
    result is written to ``<out>/batch<B>/``; the sweep to ``<out>/batch.json`` and ``<out>/batch.md``.

    Example::

        methods = build_methods(["plain_kernels", "prompt_lookup", "eagle3"], eagle3=drafter)
        sweep = batch_sweep(model, tok, methods, ["mtbench"], [1, 4, 16], limit=16, max_new_tokens=64)
        print(batch_markdown(sweep))
    """
    per_batch = {}
    for b in sorted(batch_sizes, reverse=True):  # the largest first: the longest runs, while the machine is fresh
        sub = str(Path(out) / f"batch{b}") if out else None
        per_batch[b] = run_bench(model, tokenizer, methods, datasets, max(limit, rounds * b), max_new_tokens,
                                 batch_size=b,
                                 out=sub, progress=progress, curve_sizes=[1, 2, 3, 4, 6, 8, 12, 16, 24, 32],
                                 **kwargs)
    per_batch = {b: per_batch[b] for b in sorted(per_batch)}
    sweep = {"schema": SCHEMA, "batch_sizes": sorted(batch_sizes), "limit": limit, "rounds": rounds,
             "max_new_tokens": max_new_tokens,
             "datasets": list(datasets), "machine": next(iter(per_batch.values()))["machine"],
             "summary": batch_summary(per_batch),
             "cost_curves_ms": {b: r["cost_curve_ms"] for b, r in per_batch.items()}}
    if out:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "batch.json").write_text(json.dumps(sweep, indent=1, default=float))
        (folder / "batch.md").write_text(batch_markdown(sweep) + "\n")
    return sweep


def batch_summary(per_batch: dict[int, dict]) -> list[dict]:
    """One row per (method, batch size) over every dataset: ``tokens_per_s`` (new tokens of every row / seconds),
    ``vs_plain`` (plain batched ``generate()``'s seconds over the method's on the same batches), ``vs_plain_median``
    (the median over the batches of that ratio within each batch, timed side by side: robust to a moment of other
    work on a shared machine), ``batches``, ``vs_kernels`` (the same as ``vs_plain`` against ``plain_kernels``, when it
    ran), ``tau``, ``mismatches`` and, for a half-precision target, ``match_rate``."""
    rows = []
    for b, result in per_batch.items():
        runs = result["runs"]
        methods = list(dict.fromkeys(r["method"] for r in runs))
        seconds = {m: sum(r["seconds"] for r in runs if r["method"] == m) for m in methods}
        plain_of = {_batch_key(r): r["seconds"] for r in runs if r["method"] == "plain"}
        for m in methods:
            mine = [r for r in runs if r["method"] == m]
            taus = [r["tau"] for r in mine if r["tau"]]
            paired = [plain_of[_batch_key(r)] / r["seconds"] for r in mine if _batch_key(r) in plain_of]
            row = dict(method=m, batch=b, tokens_per_s=sum(r["new_tokens"] for r in mine) / seconds[m],
                       vs_plain=seconds["plain"] / seconds[m],
                       vs_plain_median=statistics.median(paired) if paired else None, batches=len(mine),
                       tau=statistics.mean(taus) if taus else None, mismatches=sum(not r["identical"] for r in mine))
            if "plain_kernels" in seconds:
                row["vs_kernels"] = seconds["plain_kernels"] / seconds[m]
            if any(r["method"] == "plain" and r.get("dtype", "float32") != "float32" for r in runs):
                row["match_rate"] = sum(r["identical"] for r in mine) / len(mine)
            rows.append(row)
    return rows


def _batch_key(run: dict) -> tuple:
    """Which batch (and load condition) a run record timed: the same key for every method on that batch."""
    return run["dataset"], run["prompt_id"], run.get("repeat", 0), bool(run.get("loaded"))


def batch_markdown(sweep: dict) -> str:
    """The sweep as a table: per method, ``tok/s (x plain generate())`` at each batch size, then τ per batch size,
    the lowest ratio of each method and the mismatches."""
    sizes = sweep["batch_sizes"]
    by = {(r["method"], r["batch"]): r for r in sweep["summary"]}
    methods = list(dict.fromkeys(r["method"] for r in sweep["summary"]))
    head = ["method"] + [f"B={b} tok/s (× plain)" for b in sizes] + ["lowest × plain", "lowest median × plain",
                                                                    "τ by B", "mismatches"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in methods:
        cells, ratios, medians, taus, bad = [m], [], [], [], 0
        for b in sizes:
            r = by.get((m, b))
            if r is None:
                cells.append("–")
                continue
            ratios.append(r["vs_plain"])
            if r.get("vs_plain_median") is not None:
                medians.append(r["vs_plain_median"])
            taus.append("–" if r["tau"] is None else f"{r['tau']:.2f}")
            bad += r["mismatches"]
            cells.append(f"{r['tokens_per_s']:.1f} ({r['vs_plain']:.2f}x)")
        cells += [f"{min(ratios):.2f}x" if ratios else "–", f"{min(medians):.2f}x" if medians else "–",
                  " / ".join(taus), str(bad)]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    rounds = sweep.get("rounds", 1)
    lines.append(f"max({sweep['limit']}, {rounds} × B) prompts per set ({', '.join(sweep['datasets'])}), "
                 f"{sweep['max_new_tokens']} new tokens each, greedy; × plain: plain batched generate()'s time over "
                 "the method's on the same batches in the same run; median × plain: the median over the batches of "
                 "that ratio within each batch (plain and the methods timed side by side).")
    return "\n".join(lines)
