"""``hf-specdec bench``: its options (method strings, prompt sets, batch sizes) and its run, one bench or a
batch-size sweep (:mod:`hf_specdec.bench`)."""

from __future__ import annotations

import argparse

from .. import registry
from ..dtypes import DTYPES
from ..quantization import QUANTIZATIONS
from .common import CPU_HELP, HALF_HELP, _drafter_methods, _load_model, _positive_int, _split_methods


def _bench_method_list(text: str) -> list[str]:
    """``bench --methods``: method strings, comma-separated, each starting with a method, shorthand or baseline."""
    from ..bench import check_method_name

    names = _split_methods(text)
    if not names:
        raise argparse.ArgumentTypeError("give one or more method strings, comma-separated")
    try:
        return [check_method_name(name) for name in names]
    except registry.UnknownMethodError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _dataset_list(text: str) -> list[str]:
    """``bench --datasets``: dataset names, comma-separated."""
    from ..bench.data import DATASETS

    names = _split_methods(text)
    unknown = [n for n in names if n not in DATASETS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown dataset(s) {', '.join(map(repr, unknown)) or '(none given)'}; "
                                         f"the datasets are {', '.join(DATASETS)}")
    return names


def _batch_sizes(text: str) -> list[int]:
    """``bench --batch-size``: one size, or several comma-separated (a batched-throughput sweep)."""
    try:
        sizes = [_positive_int(t) for t in _split_methods(text)]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected batch sizes like 1,2,4,8,16, got {text!r} ({err})") from None
    if not sizes:
        raise argparse.ArgumentTypeError("no batch size given")
    return list(dict.fromkeys(sizes))


def add_commands(add) -> None:
    """Adds the ``bench`` command through :func:`~hf_specdec.cli.build_parser`'s ``add``."""
    from ..bench import BACKGROUND_LOAD_MODES
    from ..bench.data import DATASETS, DEFAULT_DATASETS, GENSIM
    from ..bench.methods import BASELINES

    drafter_methods = _drafter_methods()
    bench_names = list(dict.fromkeys(n for m in registry.methods() for n in (m.name, *(
        f"{k}[:{v.arg}]" for k, v in m.shorthands.items()))))

    p = add("bench", "benchmark methods against plain generate() and transformers' own modes")
    p.add_argument("--target", default=None, help="path or Hub id (default: the embedded SmolLM2-135M-Instruct)")
    for flag, method in drafter_methods:
        p.add_argument(f"--{flag}", default=None, metavar="PATH",
                       help=f"{method.drafter.doc} (path or Hub id) for '{method.name}'"
                            + (" and 'hf_assisted'" if flag == "drafter" else "")
                            + " (default for the default model: the shipped one, if any)")
    p.add_argument("--methods", type=_bench_method_list, default="prompt_lookup,hf_prompt_lookup:3,hf_prompt_lookup:10",
                   metavar="M1,M2",
                   help="comma-separated, each NAME[:ARG][:KEY=VALUE...]: " + ", ".join(bench_names)
                        + f"; baselines {', '.join(BASELINES)} (plain_kernels: plain decoding with the loop's CPU "
                        "kernel trick, adds a 'vs plain_kernels' column; plain generate() always runs as the "
                        "baseline; options: hf-specdec methods)")
    p.add_argument("--datasets", type=_dataset_list, default=",".join(DEFAULT_DATASETS), metavar="D1,D2",
                   help=f"prompt sets, comma-separated, of {', '.join(DATASETS)} (summaries: about 3,000 tokens of "
                        f"news articles to summarise, needs gensim: {GENSIM}; demo: the demo's prompts, its copy "
                        "prompt first)")
    p.add_argument("--limit", type=_positive_int, default=10, help="prompts per dataset")
    p.add_argument("--repeats", type=_positive_int, default=1, metavar="N",
                   help="time each prompt N times, one round after another (each with plain generate() and every "
                        "method); the speedups are medians over prompts and repeats")
    p.add_argument("--max-new-tokens", type=_positive_int, default=128, help="tokens generated per prompt")
    p.add_argument("--batch-size", type=_batch_sizes, default=[1], metavar="B[,B...]",
                   help="prompts per generate() call; several (1,2,4,8,16): one run per size on the same prompts and "
                        "a batched-throughput table, batch.md (tokens/s of every method and plain batched generate())")
    p.add_argument("--rounds", type=_positive_int, default=1, metavar="N",
                   help="with several batch sizes: at least N batches per size (max(limit, N * B) prompts), each "
                        "timing plain generate() and every method side by side; batch.md adds the median of the "
                        "per-batch ratios")
    p.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="the target's dtype (drafters follow it; not float32: the same target in float32 runs stock "
                        f"generate() as 'plain_fp32', and {HALF_HELP}); {CPU_HELP}")
    p.add_argument("--quantize", default=None, choices=list(QUANTIZATIONS), metavar="Q",
                   help="load the target quantized, through from_pretrained's quantization_config (its package "
                        f"installed): {', '.join(QUANTIZATIONS)}; drafters stay unquantized, and the same target "
                        "unquantized in float32 runs stock generate() as 'plain_fp32' (docs/quantization.md)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N, or auto (Accelerate places the model)")
    p.add_argument("--out", default="bench_out", metavar="FOLDER",
                   help="output folder: bench.json, bench.md, bench.csv, *.png")
    p.add_argument("--memory-check", type=int, default=0, metavar="N",
                   help="N consecutive calls per method, resident memory recorded (0: off)")
    p.add_argument("--background-load", default="off", choices=BACKGROUND_LOAD_MODES,
                   help="'on': run the timed rows while another process keeps one CPU core busy; 'both': every "
                        "prompt quiet and loaded in turn, the report side by side (tau/tau_loaded, "
                        "speedup/speedup_loaded, ...)")
    p.add_argument("--seed", type=int, default=0, help="seed of the copy, repeat and summaries sets' draws")
    p.set_defaults(func=_bench)


def _bench(args) -> int:
    import torch

    from ..bench import batch_markdown, batch_sweep, build_methods, fp32_baseline, markdown, mismatches, run_bench
    from ..default_model import MODEL_ID
    from ..dtypes import dtype_name

    model, tok = _load_model(args.target, args.dtype, args.device, quantize=args.quantize)
    drafters = {}
    for flag, method in _drafter_methods():
        source = getattr(args, flag, None)
        if source is None and args.target is None:  # the default model: the drafter shipped for it, unless given
            source = registry.shipped_drafter(method, MODEL_ID)
        if source is not None:
            drafters[flag] = registry.load_drafter(method, str(source), model)  # in the target's dtype
    methods = build_methods(args.methods, **drafters)
    exact = model.dtype == torch.float32  # half precision: outputs identical up to rounding, a match rate
    if not exact or args.quantize:  # the same target in float32, stock generate(): what half precision buys
        methods.append(fp32_baseline(_load_model(args.target, "float32", args.device)[0]))
    config = vars(args) | {"func": None, "dtype": dtype_name(model.dtype)}  # the dtype that ran (after a fallback)
    common = dict(drafter=drafters.get("drafter"), config=config, seed=args.seed,
                  background_load=args.background_load, repeats=args.repeats)
    if len(args.batch_size) > 1:
        sweep = batch_sweep(model, tok, methods, args.datasets, args.batch_size, args.limit, args.max_new_tokens,
                            out=args.out, rounds=args.rounds, **common)
        print(batch_markdown(sweep))
        print(f"\nwritten to {args.out}/ (batch.json, batch.md; one folder per batch size)")
        return 1 if exact and any(r["mismatches"] for r in sweep["summary"]) else 0
    result = run_bench(model, tok, methods, args.datasets, args.limit, args.max_new_tokens,
                       batch_size=args.batch_size[0], out=args.out, memory_check=args.memory_check, **common)
    print(markdown(result))
    print(f"\nwritten to {args.out}/ (bench.json, bench.md, bench.csv, *.png)")
    return 1 if exact and mismatches(result) else 0
