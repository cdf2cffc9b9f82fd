"""Run the frozen target once over the training data and cache what drafters need, as safetensors shards.

Per token: ``input_ids`` (int32), ``loss_mask`` (uint8), the target hidden states a drafter is fed (``features``,
fp16, the requested HF ``hidden_states`` indices concatenated), the target's final post-norm hidden state
(``last``, fp16) from which the target's own next-token distribution is recomputed exactly during training
(``lm_head(last)``, for any draft vocabulary), and the target's greedy next token (``target_argmax``). Shards are written one after the other, so an interrupted run
resumes where it stopped.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..placement import input_device


def cache_features(target, samples, out_dir, layer_ids: list[int], shard_size: int = 64, progress: bool = True,
                   part: tuple[int, int] = (0, 1), batch_size: int = 1):
    """Write ``shard_XXXXX.safetensors`` files for ``samples`` (``(input_ids, loss_mask)`` lists) into ``out_dir``.

    ``part=(i, n)``: only shards ``k`` with ``k % n == i`` (``n`` processes, e.g. one per core or per GPU, build
    one cache side by side; each skips what exists). ``batch_size``: conversations of a shard per target forward,
    of similar lengths, right-padded (a causal model's real positions never see the padding after them, so only
    the rounding of batched products can differ); 1 runs each conversation alone."""
    from tqdm.auto import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    n_layers = target.config.get_text_config().num_hidden_layers
    wanted = sorted(set(layer_ids) | {n_layers})
    meta = {"layer_ids": list(layer_ids), "num_samples": len(samples), "shard_size": shard_size,
            "hidden_size": target.config.get_text_config().hidden_size}
    (out / "meta.json").write_text(json.dumps(meta))
    shards = [samples[i:i + shard_size] for i in range(0, len(samples), shard_size)]
    index, count = part
    if not 0 <= index < count:
        raise ValueError(f"part must be (i, n) with 0 <= i < n, got {part}.")
    mine = [k for k in range(len(shards)) if k % count == index]
    bar = tqdm(total=sum(len(shards[k]) for k in mine), desc="target features", disable=not progress,
               file=sys.stderr)
    for k in mine:
        shard = shards[k]
        path = out / f"shard_{k:05d}.safetensors"
        if path.exists():
            bar.update(len(shard))
            continue
        rows = {}  # sample index in the shard -> (features, last, argmax)
        order = sorted(range(len(shard)), key=lambda i: len(shard[i][0]))  # similar lengths share a forward
        with torch.no_grad():
            for start in range(0, len(order), batch_size):
                group = order[start:start + batch_size]
                width = max(len(shard[i][0]) for i in group)
                x = torch.tensor([shard[i][0] + [shard[i][0][-1]] * (width - len(shard[i][0])) for i in group],
                                 device=input_device(target))  # model.device: meta when offloaded
                hs = target(input_ids=x, output_hidden_states=wanted, logits_to_keep=1).hidden_states
                top = target.get_output_embeddings()(hs[n_layers]).argmax(-1)
                for row, i in enumerate(group):
                    n = len(shard[i][0])
                    rows[i] = (torch.cat([hs[j][row, :n].to(torch.float16).cpu() for j in layer_ids], dim=-1),
                               hs[n_layers][row, :n].to(torch.float16).cpu(), top[row, :n].to(torch.int32).cpu())
                bar.update(len(group))
        offsets = torch.tensor([0] + [len(ids) for ids, _ in shard], dtype=torch.int64).cumsum(0)
        tmp = path.with_suffix(".tmp")
        save_file({"input_ids": torch.tensor([t for ids, _ in shard for t in ids], dtype=torch.int32),
                   "loss_mask": torch.tensor([m for _, mask in shard for m in mask], dtype=torch.uint8),
                   "features": torch.cat([rows[i][0] for i in range(len(shard))]),
                   "last": torch.cat([rows[i][1] for i in range(len(shard))]),
                   "target_argmax": torch.cat([rows[i][2] for i in range(len(shard))]), "offsets": offsets}, str(tmp))
        tmp.rename(path)
    bar.close()
    return out


def complete(folder) -> bool:
    """Whether a feature folder holds every shard its ``meta.json`` announces."""
    meta = Path(folder) / "meta.json"
    if not meta.is_file():
        return False
    info = json.loads(meta.read_text())
    return len(list(Path(folder).glob("shard_*.safetensors"))) == -(-info["num_samples"] // info["shard_size"])


class FeatureShards(torch.utils.data.Dataset):
    """Sequences from cached shards: ``dict(input_ids, loss_mask, features, last)`` per sample. Several folders
    (written with the same taps) read as one dataset, in order. At most :attr:`SHARDS_IN_MEMORY` shards are held
    (the trainer's :class:`.trainer.ShardWindowShuffle` reads that many at a time)."""

    SHARDS_IN_MEMORY = 4

    def __init__(self, folder, *more):
        folders = [Path(f) for f in (folder, *more)]
        self.folder = folders[0]
        metas = [json.loads((f / "meta.json").read_text()) for f in folders]
        for f, meta in zip(folders[1:], metas[1:]):
            if (meta["layer_ids"], meta["hidden_size"]) != (metas[0]["layer_ids"], metas[0]["hidden_size"]):
                raise ValueError(f"{f} holds features of other taps or width ({meta}) than {folders[0]} "
                                 f"({metas[0]}); build it again with the same target.")
        self.meta = dict(metas[0], num_samples=sum(m["num_samples"] for m in metas))
        self.index = []
        self.files = []
        for f in folders:
            files = sorted(f.glob("shard_*.safetensors"))
            if not files:
                raise FileNotFoundError(f"No feature shards in {f}; run the feature caching step first.")
            self.files += files
        self._cache = {}
        for f, path in enumerate(self.files):
            with safe_open(str(path), "pt") as handle:
                offsets = handle.get_tensor("offsets").tolist()
            self.index.extend((f, offsets[i], offsets[i + 1]) for i in range(len(offsets) - 1))

    def __len__(self):
        return len(self.index)

    def shard_ranges(self) -> list[tuple[int, int]]:
        """``(start, end)`` sample indices of each shard (samples are numbered shard by shard)."""
        ranges, start = [], 0
        for f in range(len(self.files)):
            end = start
            while end < len(self.index) and self.index[end][0] == f:
                end += 1
            ranges.append((start, end))
            start = end
        return ranges

    def _shard(self, f):
        if f not in self._cache:
            if len(self._cache) >= self.SHARDS_IN_MEMORY:  # the oldest goes (samples come a window of shards at a time)
                self._cache.pop(next(iter(self._cache)))
            with safe_open(str(self.files[f]), "pt") as handle:
                self._cache[f] = {k: handle.get_tensor(k)
                                  for k in ("input_ids", "loss_mask", "features", "last", "target_argmax")}
        return self._cache[f]

    def __getitem__(self, i):
        f, start, end = self.index[i]
        shard = self._shard(f)
        return {k: v[start:end] for k, v in shard.items()}

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """How often every target token appears under the loss mask (to choose the draft vocabulary)."""
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for path in self.files:
            with safe_open(str(path), "pt") as handle:
                ids = handle.get_tensor("input_ids").long()
                mask = handle.get_tensor("loss_mask").bool()
            counts += torch.bincount(ids[mask], minlength=vocab_size)
        return counts
