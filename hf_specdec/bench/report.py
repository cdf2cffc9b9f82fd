"""A bench result as its reader gets it: the markdown table of the summary (:func:`markdown`, its columns), the CSV,
and the files of an output folder (:func:`write_outputs`: ``bench.json``, ``bench.md``, ``bench.csv``, PNG plots)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


_COLUMNS = (  # (header, summary key, format); a trailing "x" in the format is written after the number
    ("dataset", "dataset", ""), ("method", "method", ""), ("prompts", "prompts", "d"),
    ("τ", "tau", ".2f"), ("proposed drafts", "proposed_drafts", "d"), ("tok/s", "tokens_per_s", ".1f"),
    ("speedup (median)", "speedup_median", ".2fx"), ("speedup (total)", "speedup_total", ".2fx"),
    ("vs plain_kernels (median)", "speedup_vs_kernels", ".2fx"), ("vs fp32 stock (median)", "speedup_vs_fp32", ".2fx"),
    ("ceiling", "ceiling", ".2f"), ("efficiency", "efficiency", ".2f"), ("draft share", "draft_share", ".1%"),
    ("loop overhead", "loop_overhead", ".1%"), ("host ms/step", "host_ms_per_step", ".2f"),
    ("syncs/step", "syncs_per_step", ".1f"), ("launches/step", "launches_per_step", ".0f"),
    ("peak +MB", "peak_mem_mb", ".0f"), ("peak MB", "peak_abs_mb", ".0f"),
    ("mismatches", "mismatches", "d"), ("match", "match_rate", ".0%"), ("exact bits", "exact_bits", ""),
)
_OPTIONAL_COLUMNS = ("speedup_vs_kernels", "speedup_vs_fp32", "match_rate", "exact_bits")  # shown when a row has them
_LOADED_COLUMNS = ("tau", "proposed_drafts", "tokens_per_s", "speedup_median", "speedup_vs_kernels", "speedup_vs_fp32",
                   "mismatches", "match_rate")


def _cell(value, fmt: str) -> str:
    if value is None:
        return "–"
    if fmt.endswith("x"):
        return format(value, fmt[:-1]) + "x"
    return format(value, fmt)


def markdown(result: dict) -> str:
    """The summary as a markdown table, then the forward-cost curve (and the memory check, when it ran).

    A column appears when any row has it (``vs plain_kernels`` when ``plain_kernels`` ran, ``vs fp32 stock`` when
    ``plain_fp32`` ran, ``match`` for a half-precision target; a line naming the quantization of a quantized target,
    ``config["quantize"]``); with
    ``background_load="both"`` the loaded figures of τ, proposed drafts, tok/s, the speedups and mismatches stand
    right after their quiet ones ("τ loaded", ...).
    """
    summary = result["summary"]
    columns = []
    for header, key, fmt in _COLUMNS:
        if key in _OPTIONAL_COLUMNS and not any(key in r for r in summary):
            continue
        columns.append((header, key, fmt))
        if key in _LOADED_COLUMNS and any(f"{key}_loaded" in r for r in summary):
            columns.append((f"{header.replace(' (median)', '')} loaded", f"{key}_loaded", fmt))
    lines = ["| " + " | ".join(h for h, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    for r in summary:
        lines.append("| " + " | ".join(_cell(r.get(key), fmt) for _, key, fmt in columns) + " |")
    if any("match_rate" in r for r in summary):
        lines.append("")
        lines.append("Half precision: outputs identical to plain decoding up to rounding; match: the share of runs "
                     "token-identical to plain generate() in the same dtype; exact bits: whether the method's "
                     "verification gives the bits of the target's own one-token steps on this machine (probed, "
                     "speculative_stats['exact_bits']; yes: identical by construction, not by chance)"
                     + ("; vs fp32 stock: the speedup over stock generate() on the float32 target (plain_fp32)."
                        if any("speedup_vs_fp32" in r for r in summary) else "."))
    quantize = (result.get("config") or {}).get("quantize")
    if quantize:
        lines.append("")
        lines.append(f"Quantized target ({quantize}): plain and every method ran on it, compared with its own plain "
                     "generate()" + ("; vs fp32 stock: the speedup over stock generate() on the unquantized float32 "
                                     "target (plain_fp32)." if any("speedup_vs_fp32" in r for r in summary) else "."))
    mode = (result.get("background_load") or {}).get("mode", "off")
    if mode != "off":
        lines.append("")
        lines.append("Background load: " + (
            "every timed row ran while another process kept one CPU core busy." if mode == "on" else
            "every prompt ran quiet and, alternately before or after, while another process kept one CPU core busy "
            "(the 'loaded' columns)."))
    curve = result["cost_curve_ms"]
    lines.append("")
    lines.append("Forward cost c(q) (ms, q new tokens over a 256-token cache): " + ", ".join(
        f"{q}: {ms:.1f}" for q, ms in sorted(curve.items(), key=lambda kv: int(kv[0]))))
    if result.get("cost_curve_model_kernels_ms"):
        lines.append("")
        lines.append("The same with the model's own kernels (no hf_specdec.kernels): " + ", ".join(
            f"{q}: {ms:.1f}" for q, ms in sorted(result["cost_curve_model_kernels_ms"].items(),
                                                  key=lambda kv: int(kv[0]))))
    if "memory_check" in result:
        lines.append("")
        lines.append("Memory over consecutive calls (RSS growth over the second half, MB): " + ", ".join(
            f"{m}: {v['growth_mb_second_half']:+.1f}" for m, v in result["memory_check"].items()))
    return "\n".join(lines)


def write_outputs(result: dict, out: str) -> None:
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "bench.json").write_text(json.dumps(result, indent=1, default=float))
    (folder / "bench.md").write_text(markdown(result) + "\n")
    write_csv(result["summary"], folder / "bench.csv")
    try:
        from .plots import plot_all

        plot_all(result, folder)
    except ImportError as err:
        print(f"(plots skipped: {err}; pip install matplotlib)", file=sys.stderr)


def write_csv(summary: list[dict], path) -> None:
    """The summary rows as CSV: one column per key (first-seen order), empty cells for ``None`` or absent keys.

    Example::

        write_csv(result["summary"], "bench_out/bench.csv")   # columns dataset, method, prompts, tau, ...
    """
    import csv

    keys = list(dict.fromkeys(k for row in summary for k in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys, restval="")
        writer.writeheader()
        for row in summary:
            writer.writerow({k: "" if v is None else v for k, v in row.items()})
