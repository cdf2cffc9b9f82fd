"""Coupled (Gumbel-max) speculative sampling: the noise, the call's seed and the processors it runs through.

With coupled sampling (``speculative_sampling="coupled"``, the default when ``do_sample=True``) the token of row
``b`` at generated position ``t`` is ``argmax(log p_t + g[b, t])``: ``p_t`` is the target's processed distribution
(temperature, top-k, top-p, any logits processor) and ``g[b, t]`` a vector of Gumbel noise, one entry per vocabulary
id, that depends only on the call's seed, the row and ``t``. ``argmax(log p + g)`` is an exact sample of ``p``
(Gumbel-max), and the noise of a position is independent of every other position and of the drafts, so every
position is an exact sample of the target's distribution given the text before it. Drafters draft with the same
noise (``argmax(log q_t + g[b, t])``) and verification is the greedy tree walk on the perturbed target logits: the
text is a function of the seed alone, the same for every method, draft length, tree, schedule and timing (for the
same batch), and identical to decoding without drafts (``decoding_method("plain")``) under the same seed. Daliri,
Musco and Suresh (2024), "Coupling without communication and drafter-invariant speculative decoding".

The noise is counter-based: ``g[b, t, v]`` is a hash of ``(seed, b, t, v)`` (murmur3's 32-bit finaliser), 23 bits of
a uniform per entry (torch's float32 ``rand`` has 24), made on the device for a block of positions at once with
tensor operations, never a host loop over positions or vocabulary ids. :class:`CoupledNoise` keeps the block of the
positions a step uses; the next step computes only the positions it has not seen (about one per committed token).

Example:
    >>> torch.manual_seed(0)  # or seed=0, or generator=torch.Generator().manual_seed(0)
    >>> out = model.generate(**inputs, do_sample=True, temperature=0.7, top_p=0.9, max_new_tokens=64,
    ...                      custom_generate=hf_specdec.decoding_method("eagle3"))  # the same text every time
"""

from __future__ import annotations

import contextlib
import time

import torch

from .syncs import to_device

_M = 0xFFFFFFFF
_GOLDEN = 0x9E3779B1

# processors whose output at a position depends on its scores alone (not on the ids before it, the batch index or
# the vocabulary's ids): coupled verification applies them to all rows at once, and drafters apply them to their own
# (possibly smaller) vocabulary
WARPERS = {"TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper",
           "TypicalLogitsWarper", "EpsilonLogitsWarper", "EtaLogitsWarper", "TopHLogitsWarper", "LogitNormalization",
           "InfNanRemoveLogitsProcessor"}


def is_warper(proc) -> bool:
    return type(proc).__name__ in WARPERS


def _fmix(x):
    """murmur3's 32-bit finaliser on 32-bit values held in int64 (tensors or Python ints)."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _M
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _M
    return x ^ (x >> 16)


def position_key(seed: int, row: int, position: int) -> int:
    """The 32-bit key of ``(seed, row, position)`` (host arithmetic)."""
    h = _fmix((seed & _M) ^ 0x243F6A88)
    h = _fmix(h ^ ((seed >> 32) & _M))
    h = _fmix(h ^ ((row * 0x9E3779B9) & _M))
    return _fmix(h ^ ((position * 0x85EBCA77 + 0x6A09E667) & _M))


_VOCAB_KEYS: dict = {}


def _vocab_keys(vocab: int, device) -> torch.Tensor:
    key = (vocab, str(device))
    if key not in _VOCAB_KEYS:
        v = torch.arange(vocab, dtype=torch.int64, device=device)
        _VOCAB_KEYS[key] = _fmix((v * _GOLDEN + 0x7F4A7C15) & _M)
    return _VOCAB_KEYS[key]


def _fmix_(x: torch.Tensor) -> torch.Tensor:
    """:func:`_fmix` in place on an int64 tensor."""
    x.bitwise_xor_(x >> 16).mul_(0x85EBCA6B).bitwise_and_(_M)
    x.bitwise_xor_(x >> 13).mul_(0xC2B2AE35).bitwise_and_(_M)
    return x.bitwise_xor_(x >> 16)


_CPU_CHUNK = 1 << 16  # on a CPU, entries per chunk (int64: 512 KB, the working set stays in cache)


def gumbel(keys: torch.Tensor, vocab: int, make=None) -> torch.Tensor:
    """``[*keys.shape, vocab]`` float32 Gumbel noise for position keys ``keys`` (int64, from :func:`position_key`).
    Entries are in ``[-2.8, 16.7]``: uniforms ``(k + 0.5) / 2**23`` are never 0 or 1. One batch of tensor operations
    on a GPU; on a CPU a few positions at a time (3-6x faster past the caches' size, the same values). ``make``: how
    the call's runner runs :func:`uniforms_of` (a compiled runner: one region, every position at once; its integer
    arithmetic and the uniforms are exact, so compiled code gives the same values, and the logarithms run here as
    always: a compiled ``log`` may round its own way)."""
    flat = keys.reshape(-1)
    vocab_keys = _vocab_keys(vocab, keys.device)
    if make is not None:
        return make(flat, vocab_keys).log_().neg_().log_().neg_().view(*keys.shape, vocab)
    rows = max(1, _CPU_CHUNK // vocab) if keys.device.type == "cpu" else flat.numel()
    parts = [uniforms_of(flat[i:i + rows], vocab_keys).log_().neg_().log_().neg_()
             for i in range(0, flat.numel(), rows)]
    return (parts[0] if len(parts) == 1 else torch.cat(parts)).view(*keys.shape, vocab)


def uniforms_of(keys: torch.LongTensor, vocab_keys: torch.LongTensor) -> torch.Tensor:
    """:func:`gumbel`'s uniforms: ``[n, V]`` float32 ``(k + 0.5) / 2**23`` for the position keys ``keys [n]`` and the
    vocabulary's keys (exact in any code: integer arithmetic, and a 23-bit integer plus a half scaled by a power of
    2)."""
    x = _fmix_(keys[:, None] ^ vocab_keys)
    return x.bitwise_right_shift_(9).to(torch.float32).add_(0.5).mul_(2.0 ** -23)


def call_seed(seed: int | None = None, generator: torch.Generator | None = None) -> int:
    """The call's seed: ``seed`` when given, else one draw from ``generator``, else one draw from torch's global
    generator (so ``torch.manual_seed(s)`` before a call makes it repeat)."""
    if seed is not None:
        return int(seed) & (2 ** 63 - 1)
    return int(torch.randint(0, 2 ** 62, (), generator=generator, device=generator.device if generator is not None
                             else "cpu"))


def _cuda_indices(model) -> list[int]:
    """The CUDA devices ``model`` sits on (its device and, under Accelerate, those of its device map)."""
    places = [model.device, *(getattr(model, "hf_device_map", None) or {}).values()]
    found = set()
    for place in places:
        if isinstance(place, int):
            found.add(place)
        elif place != "disk" and torch.device(place).type == "cuda":
            index = torch.device(place).index
            found.add(index if index is not None else torch.cuda.current_device())
    return sorted(found)


@contextlib.contextmanager
def seed_first(model, do_sample: bool, seed: int | None = None, generator: torch.Generator | None = None):
    """A call's seed drawn before the call does anything else, and torch's global generators left as that draw left
    them: yields the seed (``None`` for a greedy call, which draws nothing), and on exit restores the global
    generators (CPU and the target's CUDA devices) from whatever the call drew besides -- a drafter's modules
    initialised while it loads, a conversion's, rejection sampling's draws. So under ``torch.manual_seed(s)`` every
    method draws the same seed as ``decoding_method("plain")`` (the same text under coupled sampling), whether its
    drafter is loaded in the call or was loaded before, and the global generator moves on by that one draw only."""
    drawn = call_seed(seed, generator) if do_sample else None
    with torch.random.fork_rng(devices=_cuda_indices(model)):
        yield drawn


@contextlib.contextmanager
def seeded(seed: int, device):
    """torch's generators (CPU and ``device``) seeded with ``seed`` inside, restored after: rejection sampling's
    draws under a given ``seed=`` / ``generator=``."""
    device = torch.device(device)
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.random.default_generator.manual_seed(seed)
        if devices:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        yield


class CoupledNoise:
    """The Gumbel noise of one call: ``block(starts, width)`` is ``[B, width, V]`` where ``[b, j]`` is the noise of
    row ``b`` at generated position ``starts[b] + j`` (0 = the first new token). Positions already made for the
    previous block are reused; the rest are made in one batch of tensor operations."""

    def __init__(self, seed: int, batch_size: int, vocab: int, device, make=None):
        self.seed, self.batch_size, self.vocab, self.device = seed, batch_size, vocab, torch.device(device)
        self.make = make  # how uniforms_of runs (gumbel's make: the call's runner's way), None: gumbel's own
        self._starts: list[int] | None = None
        self._block: torch.Tensor | None = None
        self.positions_made = 0
        self.seconds = 0.0

    def block(self, starts: list[int], width: int) -> torch.Tensor:
        old, old_starts, asked = self._block, self._starts, width
        if old is not None and old_starts == list(starts) and old.shape[1] >= width:
            return old[:, :width]
        t0 = time.perf_counter()
        old_width = old.shape[1] if old is not None else 0
        if old is not None:  # keep what the last block made beyond this request (drafts deeper than this step's)
            width = max([width] + [old_starts[b] + old_width - s for b, s in enumerate(starts)])
        index, fresh = [], []
        base = self.batch_size * old_width
        for b, s in enumerate(starts):
            for j in range(width):
                k = s + j - old_starts[b] if old is not None else -1
                if 0 <= k < old_width:
                    index.append(b * old_width + k)
                else:
                    index.append(base + len(fresh))
                    fresh.append(position_key(self.seed, b, s + j))
        made = gumbel(to_device(fresh, self.device), self.vocab, self.make) if fresh else None
        if old is None or len(fresh) == len(index):
            noise = made.view(self.batch_size, width, self.vocab)
        else:
            pool = old.reshape(-1, self.vocab) if made is None else torch.cat([old.reshape(-1, self.vocab), made])
            noise = pool.index_select(0, to_device(index, self.device)).view(self.batch_size, width, self.vocab)
        self._starts, self._block = list(starts), noise
        self.positions_made += len(fresh)
        self.seconds += time.perf_counter() - t0
        return noise[:, :asked]


def apply_warpers(processors, scores: torch.Tensor) -> torch.Tensor:
    """``scores [..., V]`` through the call's processors that are :data:`WARPERS` (the others are skipped: a
    drafter's heuristic, never the target's rule), every leading index as one row."""
    warpers = [p for p in processors if is_warper(p)]
    if not warpers:
        return scores
    flat = scores.reshape(-1, scores.shape[-1])
    ids = torch.zeros((flat.shape[0], 1), dtype=torch.long, device=flat.device)  # read by none of them
    for p in warpers:
        flat = p(ids, flat)
    return flat.view(scores.shape)
