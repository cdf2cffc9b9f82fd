"""The ``hf-specdec`` command: demo, generate, install-hub-cache, publish-hub."""

from __future__ import annotations

import argparse
import sys


def _demo(args) -> int:
    from .demo import run_demo

    summary, rows = run_demo(max_new_tokens=args.max_new_tokens, methods=args.methods, repeats=args.repeats)
    return 0 if all(r["same"] for r in rows) else 1


def _generate(args) -> int:
    import torch

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
    opts = {"drafter": args.drafter} if args.drafter else {}
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
    parser = argparse.ArgumentParser(prog="hf-specdec", description="Lossless speculative decoding for transformers.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="speculative vs plain generation on SmolLM2-135M-Instruct; prints the speedup")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--methods", nargs="*", default=None, help="methods to run (default: every available one)")
    p.add_argument("--repeats", type=int, default=1)
    p.set_defaults(func=_demo)

    p = sub.add_parser("generate", help="generate from one prompt with a method")
    p.add_argument("prompt")
    p.add_argument("--method", default="prompt_lookup")
    p.add_argument("--model", default=None, help="path or Hub id (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", default=None, help="draft model path or Hub id (method 'assisted')")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--sample", action="store_true", help="sample (do_sample=True) instead of greedy decoding")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.set_defaults(func=_generate)

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
