"""``hf-specdec demo``: speculative vs plain generation on the default model, its options and its run."""

from __future__ import annotations

from ..dtypes import DTYPES
from .common import CPU_HELP, HALF_HELP, _drafter_methods, _method_list, _method_list_help, _positive_int


def add_commands(add) -> None:
    """Adds the ``demo`` command through :func:`~hf_specdec.cli.build_parser`'s ``add``."""
    from ..demo import QUICK_METHODS, THOROUGH_REPEATS, demo_prompts

    drafter_methods = _drafter_methods()
    method_list_help = _method_list_help()

    p = add("demo", "speculative vs plain generation on SmolLM2-135M-Instruct: checks the outputs are identical and "
                    "prints tokens/s, acceptance length and the speedup. By default a quick run (about a minute on 2 "
                    "idle cores): " + ", ".join(QUICK_METHODS) + " on a copy prompt and a word problem, once each; "
                    "--thorough runs every method on every prompt with repeats")
    p.add_argument("--thorough", action="store_true",
                   help=f"every method the default model has a drafter for, on all {len(demo_prompts())} demo prompts, "
                        f"{THOROUGH_REPEATS} interleaved repeats each with noisy / disturbed marks (about 15 minutes "
                        "on 2 idle cores; the quick demo's last line estimates it for this machine)")
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


def _demo(args) -> int:
    from ..demo import run_demo

    given = {flag: getattr(args, flag) for flag, _ in _drafter_methods() if getattr(args, flag, None)}
    summary, rows = run_demo(max_new_tokens=args.max_new_tokens, methods=args.methods, repeats=args.repeats,
                             dtype=args.dtype, thorough=args.thorough, **given)
    # only float32 is token-identical by construction: in half precision a mismatch is the reported match rate
    return 1 if any(not r["same"] and r["dtype"] == "float32" for r in rows) else 0
