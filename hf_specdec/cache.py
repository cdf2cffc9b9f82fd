"""KV caches that can be cut back to the accepted drafts.

The loop keeps one cache *column* per token that was fed to a model. Rows of a batch accept different numbers of
tokens per step, so after a step some rows have *holes*: columns that are masked out for that row. The
:class:`CacheLayout` records, per row and column, whether the column holds a real token, its position id and its
token id; the attention mask of every later forward is built from it (``tree.build_attention_mask``). Batch size 1
never has holes. When holes waste too much room, :func:`compact` moves every row's real columns to the right
(left padding again).

Sliding-window layers are stored as full layers: their window is enforced by the mask, by position id, exactly as
plain ``generate()`` does it for left-padded batches. That keeps every layer croppable and every column addressable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import Cache, DynamicCache, DynamicLayer, StaticCache, StaticLayer, StaticSlidingWindowLayer

from ._transformers import DynamicSlidingWindowLayer, set_static_layer_length, static_layer_length


class UnsupportedCacheError(ValueError):
    pass


def new_cache_like(model, cache: Cache | None, capacity: int) -> Cache:
    """A fresh, empty cache of the same kind as ``cache`` (dynamic unless it is static) that the loop can edit.

    ``capacity`` is the number of columns a static cache must hold; a longer ``cache`` (``max_cache_len``, sized for
    the longest call, as transformers' ``generation_config.max_cache_len``) keeps its length: the same shapes from
    call to call for a compiled forward. What ``cache`` holds is not copied (:func:`copy_columns` does that).
    """
    check_editable(cache)
    if isinstance(cache, StaticCache):
        return static_cache(model, max(capacity, cache.get_max_length() if cache.layers else 0))
    return DynamicCache()


def static_cache(model, capacity: int) -> StaticCache:
    """An empty static cache of ``capacity`` columns for ``model``, every layer a full one (sliding-window layers
    too: the loop keeps and cuts columns by index)."""
    new = StaticCache(config=model.config, max_cache_len=capacity)
    new.layers = [StaticLayer(max_cache_len=capacity) for _ in new.layers]
    return new


def check_editable(cache: Cache | None) -> None:
    """Raise :class:`UnsupportedCacheError` for a cache whose layers the loop cannot cut back (sliding-window layers
    are replaced by full ones in the loop's cache, so only the layer kinds matter)."""
    if cache is not None and not all(type(layer).__name__ in _EDITABLE for layer in cache.layers):
        kinds = sorted({type(layer).__name__ for layer in cache.layers})
        raise UnsupportedCacheError(
            f"Speculative decoding needs a KV cache whose rejected rows can be cut back, got {type(cache).__name__}"
            f" with layers {kinds}. Use the default dynamic cache or cache_implementation='static'."
        )


def emptied(cache: StaticCache) -> StaticCache:
    """A static cache of an earlier call as a fresh one would be, in place (its tensors keep their addresses): no
    column held, every column zeroed."""
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False):
            set_static_layer_length(layer, 0)
            layer.keys.zero_()
            layer.values.zero_()
    return cache


def copied(model, cache: StaticCache) -> StaticCache:
    """A new static cache for ``model`` of ``cache``'s length holding its columns (in tensors of its own)."""
    new = new_cache_like(model, cache, capacity=cache.get_max_length())
    copy_columns(cache, new, cache_length(cache))
    return new


def kv_shape(config) -> tuple[int, int]:
    """``(key/value heads, head dim)`` of a transformers text config's attention layers."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return heads, getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class FixedDraftCache:
    """A drafter's KV cache at a fixed width, for drafting at fixed shapes (:mod:`hf_specdec.graphs`): per layer
    ``keys, values [B, heads, width, head_dim]``, allocated before the first forward and kept for later calls of the
    same batch size and width by its owner (the same addresses, so CUDA graphs recorded over it stay valid). A forward
    writes its rows at the columns ``at`` names (set by the caller before it: a ``slice`` of fixed bounds or a ``[n]``
    index tensor) and attends over the whole width, the columns it may not see masked. Nothing is ever cut back:
    columns past the context are overwritten by the next writes there."""

    def __init__(self, width: int):
        self.width = width
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.at = None
        self.features = None  # a feature drafter's held target features (FeatureDrafterProposer.hold_features)

    def allocate(self, batch_size: int, heads: int, head_dim: int, layers: int, dtype, device) -> "FixedDraftCache":
        """Zeroed buffers for ``layers`` layers (before any forward: never inside a compiled region)."""
        shape = (batch_size, heads, self.width, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        return self

    def fill_from(self, cache: Cache, length: int) -> "FixedDraftCache":
        """Its first ``length`` columns copied from the dynamic ``cache`` (one layer per layer)."""
        for mine_k, mine_v, theirs in zip(self.keys, self.values, cache.layers):
            mine_k[:, :, :length] = theirs.keys[..., :length, :]
            mine_v[:, :, :length] = theirs.values[..., :length, :]
        return self

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer: int, *_, **__):
        """Write ``keys, values [B, heads, n, head_dim]`` at the columns ``at``; returns the layer's whole width (the
        call of transformers' attention layers: their further arguments are not needed here)."""
        if isinstance(self.at, slice):
            self.keys[layer][:, :, self.at] = keys
            self.values[layer][:, :, self.at] = values
        else:
            self.keys[layer].index_copy_(2, self.at, keys)
            self.values[layer].index_copy_(2, self.at, values)
        return self.keys[layer], self.values[layer]


def feed_sees(columns: torch.LongTensor, seen: torch.BoolTensor) -> torch.BoolTensor:
    """What rows fed into a :class:`FixedDraftCache` at ``columns [n]`` attend to: ``[B, n, width]``, the context
    columns (``seen [B, width]``) up to each row's own, and itself."""
    cols = torch.arange(seen.shape[1], device=seen.device)
    return ((cols <= columns[:, None]) & seen[:, None, :]) | (cols == columns[:, None])


# ---- continuing from a cache an earlier call filled (a conversation's next turn)
RECORD = "hf_specdec_continuation"  # the attribute of a cache handed back by a call: its :class:`Continuation`


@dataclass
class Continuation:
    """What a call hands back with its cache (the attribute :data:`RECORD` of the cache object): the cache holds
    ``length`` columns of ``batch_size`` rows, column ``j`` the key/values of token ``j`` of every row of the call's
    output sequences; ``carried`` is what the call's proposer needs to continue from them
    (:meth:`~hf_specdec.proposers.Proposer.hand_back`). A later call trusts it only while the cache still holds
    exactly ``length`` columns of ``batch_size`` rows (plain ``generate()`` continuing the cache makes it longer)."""

    length: int
    batch_size: int
    carried: object = None


def held_columns(cache: Cache | None, batch_size: int, width: int) -> int:
    """The columns ``cache`` (a ``cache=`` / ``past_key_values=`` the call was given) holds, for a call over
    ``batch_size`` rows of ``width`` input tokens; 0 for none. As ``generate()`` continues from a cache, they are the
    key/values of the first input tokens; a cache of another batch size or as long as the input is refused."""
    if cache is None:
        return 0
    held = cache_length(cache)
    if held == 0:
        return 0
    rows = next((layer.keys.shape[0] for layer in cache.layers
                 if getattr(layer, "is_initialized", False) and layer.keys is not None), batch_size)
    if rows != batch_size:
        raise UnsupportedCacheError(
            f"The cache holds {rows} rows but input_ids has {batch_size}: continue a conversation with the cache of "
            "the same batch (out.past_key_values of the call that made it), or pass a fresh cache.")
    if held >= width:
        raise UnsupportedCacheError(
            f"The cache holds {held} tokens but input_ids has {width}: pass the whole conversation as input_ids (the "
            "tokens the cache holds followed by the new ones, e.g. torch.cat([out.sequences, new_ids], dim=1)), as "
            "generate() continues from a cache, or a fresh cache.")
    return held


def continuation_of(cache: Cache, held: int, batch_size: int) -> Continuation | None:
    """The :class:`Continuation` a call handed back with ``cache``, if it still describes what the cache holds."""
    record = getattr(cache, RECORD, None)
    if isinstance(record, Continuation) and record.length == held and record.batch_size == batch_size:
        return record
    return None


def holds_every_column(cache: Cache, length: int) -> bool:
    """Whether every layer of ``cache`` holds its first ``length`` columns in order (a sliding-window layer of plain
    ``generate()`` keeps only its window of the latest ones)."""
    return all(layer.keys.shape[-2] >= length for layer in cache.layers
               if getattr(layer, "is_initialized", False) and layer.keys is not None)


def continues_in_place(cache: Cache, loop_cache: Cache) -> bool:
    """Whether the loop can run on ``cache`` itself instead of its fresh ``loop_cache``: a dynamic cache of full
    layers only, as the loop keeps them (no copy of its columns; the caller's object is filled as ``generate()``
    fills it)."""
    return (type(cache) is DynamicCache and not is_static(loop_cache) and not cache.offloading
            and all(type(layer) is DynamicLayer for layer in cache.layers))


def copy_columns(source: Cache, target: Cache, length: int) -> None:
    """Copy the first ``length`` columns of every layer of ``source`` into the empty ``target`` (dynamic or static)."""
    if not is_static(target):
        while len(target.layers) < len(source.layers):
            target.layers.append(DynamicLayer())
    for mine, theirs in zip(target.layers, source.layers):
        if getattr(theirs, "is_initialized", False) and theirs.keys is not None:
            mine.update(theirs.keys[..., :length, :], theirs.values[..., :length, :])


def hand_over(source: Cache, target: Cache) -> None:
    """Make ``target`` (the cache object the caller passed) hold what ``source`` (the loop's) holds, as ``generate()``
    fills the cache it is given: its layers become ``source``'s (a dynamic ``target`` of a static loop cache gets
    dynamic layers over the static layers' columns)."""
    if is_static(source) and not isinstance(target, StaticCache):
        length = cache_length(source)
        target.layers = []
        copy_columns(source, target, length)
    else:
        target.layers = source.layers
    target.layer_class_to_replicate = source.layer_class_to_replicate


def kept_mirror(cache: Cache, synced: int, index: torch.LongTensor) -> int:
    """A drafter cache that mirrors the target cache's first ``synced`` columns, rebuilt as the target's from the
    columns ``index`` ``[B, C]`` (:func:`gather_columns`): it keeps the leading columns of ``index`` it holds for every
    row and returns how many (one read of ``index``)."""
    below = (index < synced).all(0)  # [C]
    kept = int(below.long().cumprod(0).sum()) if below.numel() else 0
    crop(cache, synced)
    gather_columns(cache, index[:, :kept])
    return kept


_EDITABLE = {
    "DummyLayer",  # a layer that reads another layer's KV (Gemma 3n / Gemma 4 KV sharing): it holds nothing
    DynamicLayer.__name__,
    DynamicSlidingWindowLayer.__name__,
    StaticLayer.__name__,
    StaticSlidingWindowLayer.__name__,
}


def is_static(cache: Cache) -> bool:
    return bool(cache.layers) and isinstance(cache.layers[0], StaticLayer)


def cache_length(cache: Cache) -> int:
    """The number of columns ``cache`` holds (a static cache's count is a device tensor: reading it synchronises;
    the loop knows its length from the layout instead)."""
    return int(cache.get_seq_length())


def crop(cache: Cache, length: int) -> None:
    """Keep the first ``length`` columns, without reading any tensor value (a static layer's count is set, a
    dynamic layer's tensors are sliced when longer)."""
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", False):
            continue
        if isinstance(layer, StaticLayer):
            set_static_layer_length(layer, length)
        elif layer.keys.shape[-2] > length:
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]


def keep_columns(cache: Cache, start: int, index: torch.LongTensor) -> None:
    """Keep, for each row ``b``, the columns ``start + index[b, j]`` at ``start + j``; drop everything after.

    ``index`` is ``[B, m]``. Used to keep the accepted path of a tree (the path nodes are columns ``start + node``).
    """
    m = index.shape[1]
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", False):
            continue
        keys, values = layer.keys, layer.values
        idx = index.to(keys.device)
        if isinstance(layer, StaticLayer):
            keep_static_columns([keys], [values], [static_layer_length(layer)], start, idx, m)
        else:
            def pick(buf):
                return buf[:, :, start:].gather(2, idx[:, None, :, None].expand(-1, buf.shape[1], -1, buf.shape[3]))
            layer.keys = torch.cat([keys[:, :, :start], pick(keys)], dim=2)
            layer.values = torch.cat([values[:, :, :start], pick(values)], dim=2)


def path_columns(valid: torch.BoolTensor, positions: torch.LongTensor, tokens: torch.LongTensor,
                 keep: torch.BoolTensor, root_positions: torch.LongTensor, depths: torch.LongTensor,
                 tree_tokens: torch.LongTensor, path_nodes: torch.LongTensor | None):
    """A layout's ``(valid, positions, tokens)`` with the columns of a verified tree's kept paths appended: ``keep
    [B, W]`` which of the ``W`` columns are real, the path nodes ``path_nodes [B, W]`` (``None``: nodes ``0..W-1``,
    a chain), each at ``root_position + depth`` (one function of tensors: the compiled runner runs it as one
    region)."""
    width = keep.shape[1]
    if path_nodes is None:
        new_positions, new_tokens = root_positions[:, None] + depths[:, :width], tree_tokens[:, :width]
    else:
        new_positions = root_positions[:, None] + depths.gather(1, path_nodes)
        new_tokens = tree_tokens.gather(1, path_nodes)
    return (torch.cat([valid, keep], dim=1), torch.cat([positions, new_positions], dim=1),
            torch.cat([tokens, new_tokens], dim=1))


def keep_static_columns(keys: list[torch.Tensor], values: list[torch.Tensor], lengths: list[torch.Tensor],
                        start: int, index: torch.LongTensor | None, width: int) -> None:
    """:func:`keep_columns` (``index`` given) or :func:`crop` to ``start + width`` (``None``) of static layers, from
    their tensors (one function of tensors: the compiled runner runs it as one region)."""
    for layer_keys, layer_values, length in zip(keys, values, lengths):
        if index is not None:
            for buf in (layer_keys, layer_values):
                picked = buf[:, :, start:].gather(2, index[:, None, :, None].expand(-1, buf.shape[1], -1,
                                                                                    buf.shape[3]))
                buf[:, :, start:start + width] = picked
        length.fill_(start + width)


class StaticColumns:
    """A static cache's layer tensors as :func:`commit_columns` writes into them: a CUDA graph of that region is
    recorded over them (:mod:`hf_specdec.graphs`; ``graph_key``: the cache and its tensors, which the compiled runner
    keeps for later calls of the batch size, so their graphs replay)."""

    def __init__(self, cache: Cache, layers: list):
        self.cache = cache
        self.keys = [layer.keys for layer in layers]
        self.values = [layer.values for layer in layers]
        self.lengths = [static_layer_length(layer) for layer in layers]
        self.key = (cache, *(id(t) for t in self.keys + self.values + self.lengths))

    def graph_key(self):
        return self.key


def commit_columns(owner: StaticColumns, scalars: torch.LongTensor, index: torch.LongTensor) -> None:
    """:func:`keep_static_columns` at fixed shapes (a region the compiled runner replays as one CUDA graph): with
    ``scalars = [start, width]`` (a ``[2]`` tensor: no host value in the graph), every row keeps its columns ``start +
    index[b, j]`` at ``start + j`` for ``j < width`` and every layer then holds ``start + width`` columns. ``index [B,
    K]`` holds at least ``width`` columns (``K``: a bucket; those past ``width`` are not read: the padding columns
    copy the last kept one onto itself again, the same value twice). An identity ``index`` moves nothing (what warms
    a size up: a graph's warm-up runs must change nothing)."""
    bsz, k = index.shape
    start, width = scalars[0], scalars[1]
    j = torch.minimum(torch.arange(k, device=index.device), width - 1)  # [K]
    source = start + index.gather(1, j.expand(bsz, k))  # [B, K]
    for keys, values in zip(owner.keys, owner.values):
        for buf in (keys, values):
            picked = buf.gather(2, source[:, None, :, None].expand(-1, buf.shape[1], -1, buf.shape[3]))
            buf.index_copy_(2, start + j, picked)
    for length in owner.lengths:
        length.copy_(start + width)


def gather_columns(cache: Cache, index: torch.LongTensor) -> None:
    """Rebuild every row from the columns ``index[b, :]`` (``[B, T']``); the cache then holds ``T'`` columns."""
    length = index.shape[1]
    if isinstance(cache, FixedDraftCache):
        for buf in cache.keys + cache.values:
            _gather_in_place(buf, index.to(buf.device))
        return
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", False):
            continue
        idx = index.to(layer.keys.device)
        if isinstance(layer, StaticLayer):
            for buf in (layer.keys, layer.values):
                _gather_in_place(buf, idx)
            set_static_layer_length(layer, length)
        else:
            layer.keys = layer.keys.gather(2, idx[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3]))
            layer.values = layer.values.gather(
                2, idx[:, None, :, None].expand(-1, layer.values.shape[1], -1, layer.values.shape[3])
            )


def _gather_in_place(buf: torch.Tensor, index: torch.LongTensor) -> None:
    """``buf [B, heads, W, D]``'s first ``T'`` columns rebuilt from its columns ``index [B, T']`` (its address kept)."""
    buf[:, :, :index.shape[1]] = buf.gather(2, index[:, None, :, None].expand(-1, buf.shape[1], -1, buf.shape[3]))


@dataclass
class CacheLayout:
    """Per-row bookkeeping of the cache columns: ``valid``, ``positions`` and ``tokens``, each ``[B, T]``.

    ``counts`` (host data, optional) is the number of real columns per row: kept by the loop from what it knows,
    so that deciding on compaction reads nothing from the device."""

    valid: torch.BoolTensor
    positions: torch.LongTensor
    tokens: torch.LongTensor
    counts: list[int] | None = None

    @property
    def length(self) -> int:
        return self.valid.shape[1]

    def grow(self, valid: torch.BoolTensor, positions: torch.LongTensor, tokens: torch.LongTensor,
             counts: list[int] | None = None) -> None:
        """Take the layout ``(valid, positions, tokens)`` that :func:`path_columns` made: these columns, then new ones
        with ``counts`` real columns per row (host data)."""
        self.valid, self.positions, self.tokens = valid, positions, tokens
        self._add_counts(counts)

    def _add_counts(self, counts: list[int] | None) -> None:
        """``counts`` more real columns per row (host data; ``None``: not known, so no longer kept)."""
        if self.counts is not None:
            self.counts = [a + b for a, b in zip(self.counts, counts)] if counts is not None else None

    def real_counts(self) -> torch.LongTensor:
        return self.valid.sum(1)

    def last_real(self) -> torch.LongTensor:
        """``[B]``: each row's last real column (the committed token before the root; -1 for a row without one)."""
        columns = torch.arange(self.length, device=self.valid.device)
        return torch.where(self.valid, columns, -1).max(1).values

    def compaction_index(self) -> torch.LongTensor:
        """``[B, T']`` column indices that move every row's real columns to the right (left padding)."""
        width = max(self.counts) if self.counts is not None else int(self.real_counts().max())
        # stable order of real columns, right-aligned: sort key puts holes first, real columns after in order
        order = torch.argsort(self.valid.to(torch.int8), dim=1, stable=True)
        return order[:, -width:] if width > 0 else order[:, :0]

    def gather(self, index: torch.LongTensor) -> "CacheLayout":
        """The layout of the columns ``index [B, T']`` (a compaction: every real column kept)."""
        return CacheLayout(
            valid=self.valid.gather(1, index),
            positions=self.positions.gather(1, index),
            tokens=self.tokens.gather(1, index),
            counts=self.counts,
        )


class BufferedLayout(CacheLayout):
    """A :class:`CacheLayout` held in ``[B, width]`` buffers (``width``: the static cache's), for ``compile=True``:
    its ``valid`` / ``positions`` / ``tokens`` are views of their first :attr:`length` columns (what every reader of a
    layout reads), while the fixed-shape regions of the step read and write the whole buffers, at the same addresses
    every step and call (:mod:`hf_specdec.compiled`): the tree's mask reads them, the acceptance rule writes the kept
    paths' columns (:func:`write_path_columns`), then the host moves :attr:`length` on (:meth:`advance`). Kept by the
    compiled runner for later calls of the batch size (:meth:`load` fills it in place)."""

    __hash__ = object.__hash__  # a graph's key (hf_specdec.graphs): by identity, as its buffers
    __eq__ = object.__eq__

    def __init__(self, batch_size: int, width: int, device):
        self.buffers = (torch.zeros(batch_size, width, dtype=torch.bool, device=device),
                        torch.zeros(batch_size, width, dtype=torch.long, device=device),
                        torch.zeros(batch_size, width, dtype=torch.long, device=device))
        self.counts = None
        self._length = 0
        self._views = None

    def load(self, layout: CacheLayout) -> "BufferedLayout":
        """Hold ``layout``'s columns (copied into the buffers) and its counts."""
        self._fill(layout.valid, layout.positions, layout.tokens)
        self.counts = layout.counts
        return self

    def graph_key(self):
        return (self, *(id(t) for t in self.buffers))

    @property
    def length(self) -> int:
        return self._length

    @property
    def valid(self) -> torch.BoolTensor:
        return self._view(0)

    @property
    def positions(self) -> torch.LongTensor:
        return self._view(1)

    @property
    def tokens(self) -> torch.LongTensor:
        return self._view(2)

    def _view(self, i: int) -> torch.Tensor:
        if self._views is None or self._views[0] != self._length:  # views, made once per length
            self._views = (self._length, tuple(buf[:, :self._length] for buf in self.buffers))
        return self._views[1][i]

    def _fill(self, *tensors, start: int = 0) -> None:
        """The columns ``start..`` of ``tensors`` (``valid, positions, tokens [B, T]``) into the buffers: it then
        holds ``T`` columns."""
        length = tensors[0].shape[1]
        for buf, t in zip(self.buffers, tensors):
            buf[:, start:length] = t[:, start:]
        self._length = length

    def advance(self, width: int, counts: list[int]) -> None:
        """After :func:`write_path_columns` wrote a step's kept paths: ``width`` more columns, of which ``counts``
        real per row (host data)."""
        self._length += width
        self._add_counts(counts)

    def grow(self, valid, positions, tokens, counts=None) -> None:
        """:meth:`CacheLayout.grow` (a step not run at fixed shapes): the new columns written into the buffers."""
        self._fill(valid, positions, tokens, start=self._length)
        self._add_counts(counts)

    def gather(self, index: torch.LongTensor) -> "BufferedLayout":
        """A compaction, in place: the columns ``index [B, T']`` moved to the front."""
        self._fill(*(buf.gather(1, index) for buf in self.buffers))
        return self


def window(scalars: torch.LongTensor, rows: int, width: int):
    """Inside a fixed-shape region, the ``rows`` columns from ``start = scalars[0]`` of a :class:`BufferedLayout` of
    ``width`` columns, ``n = scalars[1]`` of them real: ``(j, at, inside)``, the rows ``0..rows - 1``, the column each
    reads (``start + j``, kept inside the buffers) and ``j < n``."""
    start, n = scalars[0], scalars[1]
    j = torch.arange(rows, device=scalars.device)
    return j, (start + j).clamp(max=width - 1), j < n


def write_path_columns(layout: BufferedLayout, start: torch.LongTensor, tokens: torch.LongTensor,
                       path: torch.LongTensor, kept: torch.LongTensor, root_positions: torch.LongTensor) -> None:
    """A verified tree's kept paths into ``layout``'s buffers (inside a fixed-shape region; :func:`path_columns` for a
    :class:`BufferedLayout`): column ``start + j`` of row ``b`` (``start`` a 0-d tensor) holds node ``path[b, j]``
    (``[B, K]``, the path's nodes in depth order), at position ``root_position + j``, real for ``j < kept[b]``."""
    valid, positions, toks = layout.buffers
    j = torch.arange(path.shape[1], device=path.device)
    columns = start + j
    valid.index_copy_(1, columns, j[None, :] < kept[:, None])
    positions.index_copy_(1, columns, root_positions[:, None] + j)
    toks.index_copy_(1, columns, tokens.gather(1, path))
