"""Benchmark prompt sets, all offline: MT-bench, HumanEval, GSM8K (vendored, see data/NOTICE.md), a copy-heavy
set built from the standard library (and the Lee news corpus when gensim is installed), a repeating-structure
set (the same instructions over many standard-library functions: requests that repeat the structure of earlier
ones, where a cache of earlier outputs helps), and two that are not run by default: ``summaries`` (about 3,000
tokens of news articles from the Lee corpus, then "Summarise the text above.": a long prompt whose answer copies
little of it; needs gensim) and ``demo`` (the prompts of ``hf-specdec demo``, the quick demo's two first).

Example::

    from hf_specdec.bench.data import load

    load("summaries", limit=2)[0].text.endswith("Summarise the text above.")  # True
    load("demo", limit=1)[0].id  # 'copy1': the quick demo's copy prompt
"""

from __future__ import annotations

import ast
import gzip
import json
import random
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).parent / "data"
DEFAULT_DATASETS = ("mtbench", "humaneval", "gsm8k", "copy", "repeat")  # what ``bench`` runs unless told
DATASETS = DEFAULT_DATASETS + ("summaries", "demo")
GENSIM = "pip install --no-deps gensim==4.4.0"  # the Lee news corpus ships in it (gensim/test/test_data)
SUMMARY_CHARS = 13_000  # article text per summarisation prompt: about 3,000 SmolLM2 tokens
SUMMARY_INSTRUCTION = "Summarise the text above."


@dataclass
class Prompt:
    dataset: str
    id: str
    text: str  # the user message (the chat template is applied by the harness)


def mtbench() -> list[Prompt]:
    rows = [json.loads(line) for line in (DATA / "mt_bench_questions.jsonl").read_text().splitlines() if line.strip()]
    return [Prompt("mtbench", str(r["question_id"]), r["turns"][0]) for r in rows]


def humaneval() -> list[Prompt]:
    with gzip.open(DATA / "HumanEval.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [Prompt("humaneval", r["task_id"],
                   f"Complete the following Python function.\n```python\n{r['prompt']}```") for r in rows]


def gsm8k() -> list[Prompt]:
    rows = [json.loads(line) for line in (DATA / "gsm8k_test_subset.jsonl").read_text().splitlines() if line.strip()]
    return [Prompt("gsm8k", str(r["index"]), f"{r['question']}\nLet's think step by step.") for r in rows]


def _stdlib_functions(seed: int, count: int) -> list[tuple[str, str, str]]:
    """``(source, old_name, new_name)`` for standard-library functions of 10-35 lines."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if not p.name.startswith("_"))
    rng = random.Random(seed)
    rng.shuffle(files)
    found = []
    for path in files:
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (UnicodeDecodeError, SyntaxError):
            continue
        lines = source.splitlines()
        funcs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and 10 <= n.end_lineno - n.lineno + 1 <= 35]
        if not funcs:
            continue
        fn = funcs[rng.randrange(len(funcs))]
        names = sorted({a.arg for a in fn.args.args if len(a.arg) >= 3 and a.arg != "self"}
                       | {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
                          and len(n.id) >= 3})
        if not names:
            continue
        old = names[rng.randrange(len(names))]
        new = old + ("_value" if "_" in old or old.islower() else "Value")
        found.append(("\n".join(lines[fn.lineno - 1: fn.end_lineno]), old, new))
        if len(found) == count:
            break
    return found


def lee_articles() -> list[str]:
    """The 300 news articles of the Lee corpus (``lee_background.cor``, shipped in gensim), in the file's order;
    ``[]`` when gensim is not installed."""
    import importlib.metadata

    try:
        lee = Path(importlib.metadata.distribution("gensim").locate_file("gensim/test/test_data/lee_background.cor"))
    except importlib.metadata.PackageNotFoundError:
        return []
    if not lee.is_file():
        return []
    return [t.strip() for t in lee.read_text(encoding="utf-8", errors="replace").splitlines() if t.strip()]


def _prose(seed: int, count: int) -> list[str]:
    """News articles from the Lee corpus (gensim) when installed, else long standard-library docstrings."""
    texts = [t for t in lee_articles() if 600 <= len(t) <= 1400]
    if not texts:
        root = Path(sysconfig.get_paths()["stdlib"])
        for path in sorted(root.glob("*.py")):
            try:
                doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
            except (UnicodeDecodeError, SyntaxError):
                continue
            if doc and 500 <= len(doc) <= 1400 and doc.count("\n\n") < 8:
                texts.append(doc.strip())
                if len(texts) >= 3 * count:
                    break
    rng = random.Random(seed)
    rng.shuffle(texts)
    return texts[:count]


def copy_heavy(seed: int = 0, count: int = 40) -> list[Prompt]:
    """Rewrites that copy most of the prompt: rename a variable in a function; repeat an article with one word
    replaced. Alternates code and prose."""
    prompts = []
    code = _stdlib_functions(seed, count)
    prose = _prose(seed, count)
    for i in range(count):
        if i % 2 == 0 and code:
            src, old, new = code.pop(0)
            prompts.append(Prompt("copy", f"code{i}", (
                f"Rename the variable `{old}` to `{new}` in the following Python function. Output the complete "
                f"function and nothing else.\n```python\n{src}\n```")))
        elif prose:
            text = prose.pop(0)
            words = [w for w in re.findall(r"\b[A-Z][a-z]{3,}\b", text)]
            word = words[len(words) // 2] if words else "the"
            prompts.append(Prompt("copy", f"prose{i}", (
                f"Repeat the following text exactly, but replace every occurrence of the word '{word}' with "
                f"'{word.upper()}'.\n\n{text}")))
    return prompts


_REPEAT_INSTRUCTIONS = (
    "Describe the following Python function as a JSON object with exactly these keys, in this order: \"name\", "
    "\"arguments\" (a list of the argument names), \"returns\" (what it returns, in a few words), \"raises\" (a "
    "list of the exceptions it may raise) and \"summary\" (one sentence). Output the JSON object and nothing else.",
    "Add a Google-style docstring (a one-line summary, then Args:, Returns: and Raises: sections) to the following "
    "Python function. Output the complete function with its docstring and nothing else.",
)


def repeating(seed: int = 0, count: int = 40) -> list[Prompt]:
    """The same two instructions (a JSON description; a docstring added) alternating over standard-library
    functions: each request repeats the structure of the earlier ones (an agentic or batch-processing workload)."""
    prompts = []
    for i, (src, _, _) in enumerate(_stdlib_functions(seed + 1, count)):
        kind = i % len(_REPEAT_INSTRUCTIONS)
        prompts.append(Prompt("repeat", f"{('json', 'docstring')[kind]}{i}",
                              f"{_REPEAT_INSTRUCTIONS[kind]}\n```python\n{src}\n```"))
    return prompts


def summaries(seed: int = 0, count: int = 10) -> list[Prompt]:
    """Long summarisation requests: news articles of the Lee corpus (a seeded draw, each used once) joined by blank
    lines until :data:`SUMMARY_CHARS` characters (about 3,000 SmolLM2 tokens), then :data:`SUMMARY_INSTRUCTION`. The
    answer restates the text in its own words: little to copy, a long context to verify over. Needs gensim (the
    corpus ships in it); without it a ``RuntimeError`` says how to install it."""
    articles = lee_articles()
    if not articles:
        raise RuntimeError(f"The summaries set is built from the Lee news corpus, which ships in gensim: {GENSIM}")
    rng = random.Random(seed)
    rng.shuffle(articles)
    prompts = []
    while articles and len(prompts) < count:
        parts: list[str] = []
        while articles and sum(len(p) + 2 for p in parts) < SUMMARY_CHARS:
            parts.append(articles.pop())
        if sum(len(p) + 2 for p in parts) < SUMMARY_CHARS:
            break  # the corpus is used up: no short prompt
        prompts.append(Prompt("summaries", f"lee{len(prompts)}", "\n\n".join(parts) + f"\n\n{SUMMARY_INSTRUCTION}"))
    return prompts


def demo() -> list[Prompt]:
    """The prompts of ``hf-specdec demo`` (:func:`hf_specdec.demo.demo_prompts`), the quick demo's
    (:data:`~hf_specdec.demo.QUICK_PROMPTS`: the paragraph to repeat, the word problem) first; ids are the kind and
    the index in ``demo_prompts()`` (``copy1``, ``math4``, ...)."""
    from ..demo import QUICK_PROMPTS, demo_prompts

    prompts = demo_prompts()
    order = list(QUICK_PROMPTS) + [i for i in range(len(prompts)) if i not in QUICK_PROMPTS]
    return [Prompt("demo", f"{prompts[i][0]}{i}", prompts[i][1]) for i in order]


LOADERS = {"mtbench": mtbench, "humaneval": humaneval, "gsm8k": gsm8k, "copy": copy_heavy, "repeat": repeating,
           "summaries": summaries, "demo": demo}
SEEDED = ("copy", "repeat", "summaries")  # the sets drawn with the bench's seed


def load(dataset: str, limit: int | None = None, seed: int = 0) -> list[Prompt]:
    """The first ``limit`` prompts of a set (GSM8K, the copy, repeating and summaries sets are seeded draws
    already)."""
    if dataset not in LOADERS:
        raise ValueError(f"Unknown dataset {dataset!r}; choose from {', '.join(DATASETS)}.")
    prompts = LOADERS[dataset](seed) if dataset in SEEDED else LOADERS[dataset]()
    return prompts[:limit] if limit else prompts
