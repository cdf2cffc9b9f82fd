"""The Hub-shaped folder of each method (``<method>/README.md`` + ``custom_generate/generate.py``) and the generated part
of its page ``docs/methods/<method>.md``, from its record.

``model.generate(custom_generate="hf_specdec/<method>", trust_remote_code=True)`` loads such a folder (relative to the
working directory, by absolute path, or as the Hub repository ``hf_specdec/<method>``). The built-in methods' folders
ship in the package (``hf_specdec/<method>/``); a method registered from outside gets its folder written on first use
under ``$HF_SPECDEC_CACHE/custom_generate/`` by :func:`custom_generate_path`. Both are rendered by :func:`render`, so
they never drift from the registry; after changing a built-in record, ``hf-specdec methods --write-folders``
rewrites the shipped folders and ``hf-specdec methods --write-docs`` the generated block of each docs page (tests
check both are current). A docs page's prose around that block is written by hand.
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


def generate(*args, model, **kwargs):
    # model=: transformers' custom_generate="..." passes it so; a model folder that carries this file makes it the
    # model's own generate (functools.partial(generate, model=model)), called with the call's arguments as given
    if PROVIDER is not None:
        __import__(PROVIDER)
    return generate_with_method(METHOD, model, *args, **kwargs)
'''


def _provider(method: registry.Method) -> str | None:
    module = getattr(method.build, "__module__", None)
    if module is None or module.startswith("hf_specdec.") or module == "__main__":
        return None
    return module


def option_rows(m: registry.Method) -> list[str]:
    """The rows of a method's options table (``| argument | default | meaning |``): its drafter, then its options."""
    rows = []
    if m.drafter is not None:
        rows.append(f"| `drafter` | {'required' if m.drafter.required else '–'} | {m.drafter.doc}: "
                    f"{m.drafter.hint} |")
    for o in m.options:
        choices = f" (one of {', '.join(repr(c) for c in o.choices)})" if o.choices else ""
        default = "–" if o.default is None else f"`{o.default!r}`"
        rows.append(f"| `{o.name}` | {default} | {o.doc}{choices} |")
    return rows


def render(method: str | registry.Method) -> dict[str, str]:
    """The files of ``method``'s folder: relative path -> text."""
    m = method if isinstance(method, registry.Method) else registry.get(method)
    call_end = ")"
    if m.drafter is not None and m.drafter.required:
        call_end = ",\n                     " + m.drafter.example
    rows = option_rows(m)
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


# ------------------------------------------------------------------------------------------- docs/methods/<method>.md
DOCS_DIR = PACKAGE_DIR.parent / "docs" / "methods"  # in a checkout of the repository (a wheel has no docs/)
DOC_BEGIN = ("<!-- generated by `hf-specdec methods --write-docs` from the method's record; tests/test_registry.py "
             "checks it: edit the record, not this block -->")
DOC_END = "<!-- end of the generated block -->"


def render_doc_block(method: str | registry.Method) -> str:
    """The generated block of ``docs/methods/<method>.md``: how to call the method, its drafter, its options."""
    m = method if isinstance(method, registry.Method) else registry.get(method)
    # a reference method (plain) is benched by its shorthand: the bench's own "plain" is stock generate()
    bench_name = next(iter(m.shorthands), m.name) if m.reference else m.name
    lines = [DOC_BEGIN, "", f"Call it as `custom_generate=\"hf_specdec/{m.name}\"` (with `trust_remote_code=True`), "
             f"`custom_generate=hf_specdec.decoding_method(\"{m.name}\")`, `hf-specdec generate --method {m.name}` or "
             f"`hf-specdec bench --methods {bench_name}`."]
    d = m.drafter
    if d is not None:
        facts = [f"Shipped for `{target}`: `hf_specdec/drafters/{folder}` (used when `drafter=` is not given)."
                  for target, folder in d.shipped.items()]
        if d.convert is not None:
            facts.append(f"Published checkpoints: `hf-specdec convert {m.name} SOURCE OUT` reads the layouts "
                         f"{', '.join(f'`{layout}`' for layout in d.layouts)} (or pass the repo id as `drafter=`).")
        if d.export is not None:
            facts.append(f"Serving: `hf-specdec export {m.name} DRAFTER --out FOLDER` "
                         "([docs/serving.md](../serving.md)).")
        facts += [f"Training: `hf-specdec train {name}`, {what}." for name, (what, _) in m.trainers.items()]
        lines += ["", f"**Drafter** ({d.doc}, {'required' if d.required else 'optional'}; `--{m.drafter_flag} FOLDER` in "
                  "`demo` / `bench`):", ""]
        lines += [f"- {fact}" for fact in facts]
    loop = [f"| `{o.name}` | – | every method (the loop's option): {o.doc}"
            + (f" (one of {', '.join(repr(c) for c in o.choices)})" if o.choices else "") + " |"
            for o in registry.LOOP_OPTIONS]
    lines += ["", "| argument | default | meaning |", "|---|---|---|", *option_rows(m), *loop]
    if m.shorthands:
        lines += ["", "`hf-specdec bench` method strings: "
                  + ", ".join(f"`{short}{':' + s.arg if s.arg else ''}`" for short, s in m.shorthands.items())
                  + " (and `NAME:KEY=VALUE` for any option)."]
    lines += ["", DOC_END]
    return "\n".join(lines)


def _doc_with_block(method: str, text: str | None) -> str:
    """A docs page's text with its generated block current (a new page: a title, the summary and the block)."""
    m = registry.get(method)
    block = render_doc_block(m)
    if text is None:
        return f"# {m.name}\n\n{m.summary}.\n\n## Options\n\n{block}\n"
    if DOC_BEGIN in text and DOC_END in text:
        head, rest = text.split(DOC_BEGIN, 1)
        return head + block + rest.split(DOC_END, 1)[1]
    return text.rstrip("\n") + f"\n\n{block}\n"  # a page written by hand: the block goes at its end


def stale_method_docs(docs_dir: str | os.PathLike = DOCS_DIR) -> list[str]:
    """Pages ``docs/methods/<method>.md`` of the built-in methods that are missing or whose generated block differs
    from the records (empty when current)."""
    stale = []
    for name in registry.builtin_methods():
        path = Path(docs_dir) / f"{name}.md"
        if not path.is_file() or _doc_with_block(name, path.read_text()) != path.read_text():
            stale.append(str(path))
    return stale


def write_method_docs(docs_dir: str | os.PathLike = DOCS_DIR) -> list[Path]:
    """Rewrite the generated block of each built-in method's docs page (``hf-specdec methods --write-docs``); a
    missing page is created with its title and block. Returns the pages written."""
    docs_dir = Path(docs_dir)
    if not docs_dir.parent.is_dir():
        raise FileNotFoundError(f"{docs_dir.parent} does not exist: --write-docs runs in a checkout of the "
                                "hf_specdec repository.")
    written = []
    for name in registry.builtin_methods():
        path = docs_dir / f"{name}.md"
        old = path.read_text() if path.is_file() else None
        new = _doc_with_block(name, old)
        if new != old:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(new)
            written.append(path)
    return written
