"""A bench run's figures per method and dataset (:func:`summarize`): τ, tokens/s, the speedups against the
baselines of the same prompts, ceiling and efficiency, overheads, memory, mismatches; with ``background_load="both"``
the loaded figures beside the quiet ones."""

from __future__ import annotations

import statistics

from .methods import FP32_BASELINE


LOADED_FIELDS = ("tau", "proposed_drafts", "accepted_drafts", "tokens_per_s", "speedup_median", "speedup_total",
                 "speedup_vs_kernels", "speedup_vs_fp32", "ceiling", "efficiency", "draft_share", "loop_overhead",
                 "host_ms_per_step", "mismatches", "match_rate")
"""The summary keys that also appear with the suffix ``_loaded`` when the bench ran with ``background_load="both"``."""


def summarize(runs: list[dict], curve: dict[int, float], syncs: dict | None = None) -> list[dict]:
    """One row per (method, dataset) (keys in the module's schema). Runs of both load conditions: the quiet figures
    under the usual keys, the loaded ones of the same method and dataset beside them (:data:`LOADED_FIELDS` with
    the suffix ``_loaded``). ``syncs``: the bench's ``syncs`` entry (``syncs_per_step``; ``None`` without it)."""
    quiet = [r for r in runs if not r.get("loaded")]
    loaded = [r for r in runs if r.get("loaded")]
    rows = _summarize(quiet if quiet and loaded else runs, curve)
    for row in rows:
        counted = (syncs or {}).get(row["dataset"], {}).get(row["method"]) or {}
        row["syncs_per_step"] = counted.get("per_step")
        row["launches_per_step"] = counted.get("launches_per_step")
    if not quiet or not loaded:
        return rows
    under_load = {(r["dataset"], r["method"]): r for r in _summarize(loaded, curve)}
    for row in rows:
        other = under_load.get((row["dataset"], row["method"]), {})
        row.update({f"{key}_loaded": other[key] for key in LOADED_FIELDS if key in other})
    return rows


def mismatches(result: dict) -> int:
    """How many runs of a bench result (any method, any load condition) differ from their baseline."""
    return sum(not r["identical"] for r in result["runs"])


def _summarize(runs: list[dict], curve: dict[int, float]) -> list[dict]:
    by_prompt = {}
    for r in runs:
        by_prompt.setdefault((r["dataset"], r["prompt_id"], r.get("repeat", 0)), {})[r["method"]] = r
    rows = []
    methods = list(dict.fromkeys(r["method"] for r in runs))
    datasets = list(dict.fromkeys(r["dataset"] for r in runs))
    t1 = curve[1] / 1000
    # a half-precision target: outputs identical to plain decoding up to rounding, so a match rate per row
    half = any(r["method"] == "plain" and r.get("dtype", "float32") != "float32" for r in runs)
    for ds in datasets:
        for m in methods:
            pairs = [(g["plain"], g[m]) for (d, *_), g in by_prompt.items() if d == ds and m in g and "plain" in g]
            if not pairs:
                continue
            base = [p for p, _ in pairs]
            mine = [r for _, r in pairs]
            ratios = [b["seconds"] / r["seconds"] for b, r in pairs]
            taus = [r["tau"] for r in mine if r["tau"]]
            ceilings = [r["ceiling"] for r in mine if r["ceiling"]]
            # achieved speedup of the decode phase (prefill removed from both sides), against the ceiling
            dec = [((b["seconds"] - (b["prefill_seconds"] or 0))
                    / max(r["seconds"] - (r["prefill_seconds"] or 0), 1e-9))
                   for b, r in pairs]
            eff = [d / c for d, c in zip(dec, [r["ceiling"] or 1 for r in mine])]
            draft = [r["stats"]["draft_seconds"] / r["seconds"] for r in mine if r.get("stats")]
            if not draft:
                draft = [r["drafter_forward_seconds"] / r["seconds"] for r in mine if r["drafter_forward_seconds"]]
            overhead = [
                (r["seconds"] - r["target_forward_seconds"]
                 - max(r["drafter_forward_seconds"], (r.get("stats") or {}).get("draft_seconds", 0.0)))
                / max(r["target_forwards"], 1) / t1 for r in mine if r["target_forward_seconds"]
            ]
            rows.append(dict(
                method=m, dataset=ds, prompts=len(pairs),
                tau=statistics.mean(taus) if taus else None,
                tokens_per_s=sum(r["new_tokens"] for r in mine) / sum(r["seconds"] for r in mine),
                speedup_median=statistics.median(ratios),
                speedup_total=sum(b["seconds"] for b in base) / sum(r["seconds"] for r in mine),
                ceiling=statistics.mean(ceilings) if ceilings else None,
                efficiency=statistics.median(eff) if m != "plain" and ceilings else None,
                draft_share=statistics.mean(draft) if draft else 0.0,
                loop_overhead=statistics.median(overhead) if overhead else None,
                host_ms_per_step=(statistics.median(h for r in mine if (h := r.get("host_ms_per_step")) is not None)
                                  if any(r.get("host_ms_per_step") is not None for r in mine) else None),
                peak_mem_mb=max(r["peak_mem_mb"] for r in mine),
                peak_abs_mb=max(r["peak_abs_mb"] for r in mine),
                mismatches=sum(not r["identical"] for r in mine),
                proposed_drafts=(sum(r["stats"]["proposed_drafts"] for r in mine)
                                 if all(r.get("stats") for r in mine) else None),
                accepted_drafts=(sum(r["stats"]["accepted_drafts"] for r in mine)
                                 if all(r.get("stats") for r in mine) else None),
            ))
            for base, key in (("plain_kernels", "speedup_vs_kernels"), (FP32_BASELINE, "speedup_vs_fp32")):
                pairs = [(g[base], g[m]) for (d, *_), g in by_prompt.items() if d == ds and m in g and base in g]
                if pairs:  # the median per-prompt ratio against that baseline
                    rows[-1][key] = statistics.median(b["seconds"] / r["seconds"] for b, r in pairs)
            if half:
                rows[-1]["match_rate"] = sum(r["identical"] for r in mine) / len(mine)
                bits = {r["stats"].get("exact_bits") for r in mine if r.get("stats")}
                rows[-1]["exact_bits"] = None if not bits or None in bits else "yes" if bits == {True} else "no"
    return rows
