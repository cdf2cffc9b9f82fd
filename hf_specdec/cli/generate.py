"""``hf-specdec generate``: one prompt through a method, streamed, with the method's statistics."""

from __future__ import annotations

import sys

from .. import registry
from .._transformers import load_pretrained
from ..dtypes import DTYPES
from .common import CPU_HELP, _positive_int


def add_commands(add) -> None:
    """Adds the ``generate`` command through :func:`~hf_specdec.cli.build_parser`'s ``add``."""
    names = registry.available_methods()

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


def _generate(args) -> int:
    from ..dtypes import resolve_dtype

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
        from ..default_model import load_smollm2

        model, tokenizer = load_smollm2(dtype=dtype)
    if tokenizer.chat_template and not args.raw:
        enc = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)
    else:
        enc = tokenizer(args.prompt, return_tensors="pt")
    drafter = args.drafter
    if drafter is None and args.model is None:  # the default model: the drafter shipped for the method, if any
        from ..default_model import MODEL_ID

        shipped = registry.shipped_drafter(method, MODEL_ID)
        drafter = str(shipped) if shipped is not None else None
    if drafter:
        opts["drafter"] = drafter
    if args.seed is not None:
        opts["seed"] = args.seed
    from transformers import TextStreamer

    from ..entry import generate_with_method

    out = generate_with_method(args.method, model, **enc, max_new_tokens=args.max_new_tokens, do_sample=args.sample,
                               streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True),
                               return_dict_in_generate=True, **opts)
    s = out.speculative_stats
    print(f"\n[{args.method}] {s['committed_tokens'] + 1} tokens, acceptance length {s['acceptance_length']:.2f}, "
          f"{s['target_forward_passes']} target forwards, {s['total_seconds']:.2f} s"
          + (f", {s['sampling']} sampling, seed {s['seed']}" if s["seed"] is not None else ""), file=sys.stderr)
    return 0
