"""The Hub-shaped folder of each method (``<method>/README.md`` + ``custom_generate/generate.py``), from its record.

``model.generate(custom_generate="hf_specdec/<method>", trust_remote_code=True)`` loads such a folder (relative to the
working directory, by absolute path, or as the Hub repository ``hf_specdec/<method>``). The built-in methods' folders
ship in the package (``hf_specdec/<method>/``); a method registered from outside gets its folder written on first use
under ``$HF_SPECDEC_CACHE/custom_generate/`` by :func:`custom_generate_path`. Both are rendered by :func:`render`, so
they never drift from the registry; after changing a built-in record, ``hf-specdec methods --write-folders``
rewrites the shipped folders (a test checks they are current).
"""

from __future__ import annotations

import os
import textwrap
import threading
from pathlib import Path

from . import registry

PACKAGE_DIR = Path(__file__).resolve().parent

_GENERATE = '''"""hf_specdec `{name}` speculative decoding as a transformers `custom_generate` entry point.

Usage and options: README.md in the folder above this one. The decoding loop lives in the installed
`hf_specdec` package (pip install hf_specdec); this file only binds the method name.
"""

from hf_specdec.entry import generate_with_method

METHOD = "{name}"
PROVIDER = {provider!r}  # the module that registers the method (None: built into hf_specdec)


def generate(model, *args, **kwargs):
    if PROVIDER is not None:
        __import__(PROVIDER)
    return generate_with_method(METHOD, model, *args, **kwargs)
'''


def _provider(method: registry.Method) -> str | None:
    module = getattr(method.build, "__module__", None)
    if module is None or module.startswith("hf_specdec.") or module == "__main__":
        return None
    return module


def render(method: str | registry.Method) -> dict[str, str]:
    """The files of ``method``'s folder: relative path -> text."""
    m = method if isinstance(method, registry.Method) else registry.get(method)
    call_end = ")"
    if m.drafter is not None and m.drafter.required:
        call_end = ",\n                     " + m.drafter.example
    rows = []
    if m.drafter is not None:
        rows.append(f"| `drafter` | {'required' if m.drafter.required else '–'} | {m.drafter.doc}: "
                    f"{m.drafter.hint} |")
    for o in m.options:
        choices = f" (one of {', '.join(repr(c) for c in o.choices)})" if o.choices else ""
        default = "–" if o.default is None else f"`{o.default!r}`"
        rows.append(f"| `{o.name}` | {default} | {o.doc}{choices} |")
    shipped = ""
    if m.drafter is not None and m.drafter.shipped:
        shipped = "\nDrafters trained by hf_specdec ship with the package and are used by `hf-specdec demo` / `bench` / " \
                  "`generate` for their target: " + ", ".join(
                      f"`hf_specdec/drafters/{folder}` ({target})" for target, folder in m.drafter.shipped.items()) + ".\n"
    readme = f"""---
library_name: transformers
tags:
  - custom_generate
  - speculative-decoding
  - {m.name}
---

# hf_specdec / {m.name}

{textwrap.fill(m.description or m.summary, width=116)}

Lossless: greedy output is identical to `generate(do_sample=False)` token for token; sampled output is distributed
exactly as `generate(do_sample=True)`. Batches (left padded) are supported.

Needs the `hf_specdec` package: `pip install hf_specdec` (see the project README).

## Usage

```python
out = model.generate(**inputs, max_new_tokens=128, do_sample=False,
                     custom_generate="hf_specdec/{m.name}", trust_remote_code=True{call_end}
```

`"hf_specdec/{m.name}"` resolves to this folder when run from the hf_specdec repository root, to the Hub repository of
that name otherwise (`hf-specdec install-hub-cache` places it in the local cache for offline use), or pass
`hf_specdec.custom_generate_path("{m.name}")`.

## Options (keyword arguments of `generate`)

| argument | default | meaning |
|---|---|---|
""" + "\n".join(rows) + f"""
| `return_dict_in_generate` | `False` | the output then has `speculative_stats` (acceptance length, forwards, ...) |
{shipped}
A misspelt or unknown option raises an error that lists these (`hf-specdec methods` prints them too). Streamers,
logits processors/warpers, stopping criteria, `stop_strings` (with `tokenizer=`), `output_scores` and static caches
(`cache_implementation="static"`) work as with plain `generate()`. Beam search and `num_return_sequences > 1` are
refused.
"""
    files = {
        "README.md": readme,
        "custom_generate/generate.py": _GENERATE.format(name=m.name, provider=_provider(m)),
        "custom_generate/requirements.txt": "hf_specdec>=0.1.0\n",
    }
    return files


def write(method: str | registry.Method, folder: str | os.PathLike) -> Path:
    """Write ``method``'s folder at ``folder`` (only files whose text changed); returns it."""
    folder = Path(folder)
    for rel, text in render(method).items():
        path = folder / rel
        if path.is_file() and path.read_text() == text:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file(path, text)
    return folder


def write_file(path: Path, data: str | bytes) -> None:
    """Write ``path`` so that a reader (another thread or process: transformers loading ``generate.py``) sees its
    old content or the new one, never a part: written beside it under a name of this thread's, then renamed over it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def custom_generate_path(method: str) -> str:
    """Absolute path of the Hub-shaped folder of ``method`` (pass it as ``custom_generate=``): the package's own
    folder for a built-in method, else one written for it under ``$HF_SPECDEC_CACHE/custom_generate/``."""
    registry.get(method)  # validates the name
    if method in registry.builtin_methods():
        return str(PACKAGE_DIR / method)
    from .default_model import cache_root

    return str(write(method, cache_root() / "custom_generate" / method))


def stale_builtin_folders() -> list[str]:
    """Shipped folders whose files differ from their rendering (empty when current)."""
    stale = []
    for name in registry.builtin_methods():
        for rel, text in render(name).items():
            path = PACKAGE_DIR / name / rel
            if not path.is_file() or path.read_text() != text:
                stale.append(str(path))
    return stale


def write_builtin_folders() -> list[Path]:
    """Rewrite the shipped folders of the built-in methods from their records (``hf-specdec methods
    --write-folders``)."""
    return [write(name, PACKAGE_DIR / name) for name in registry.builtin_methods()]
