"""``hf-specdec convert`` (a published drafter to hf_specdec's format) and ``hf-specdec export`` (a drafter in the
layout a serving engine loads): their options and their runs, by the registry's converters and exporters."""

from __future__ import annotations

import inspect
from pathlib import Path

from .. import registry
from ..dtypes import DTYPES
from .common import CommandError, _drafter_methods, _positive_int


def add_commands(add) -> None:
    """Adds the ``convert`` and ``export`` commands through :func:`~hf_specdec.cli.build_parser`'s ``add``."""
    drafter_methods = _drafter_methods()

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
