"""Draft trees and the attention masks that verify them.

A proposer returns a :class:`DraftTree` for every row of the batch. Node 0 of every row is the *root*: the last
committed token, which is not in the target's KV cache yet. Every other node is a draft token whose parent is an
earlier node. A chain of ``k`` drafts is the tree ``parents = [-1, 0, 1, ..., k-1]``; chains and trees share one code
path in the verifier, with a fast path for chains.

The target verifies the whole tree in one forward pass: node ``i`` sits at position ``root_position + depth[i]`` and
attends to the committed cache columns of its row and to its own ancestors in the tree (itself included).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .attention import TENSOR, to_mask, tree_mask_format
from .syncs import host_side, to_device


@dataclass
class Resume:
    """What a proposer computed of the target's forward over a tree: layers ``0..layer-1`` for its first
    ``hidden.shape[1]`` nodes, whose keys/values are already in the target cache (columns after the layout, in node
    order) and whose output of layer ``layer - 1`` is ``hidden [B, n, H]``. Verification runs those layers for the
    remaining nodes only, and layers ``layer..`` for all (:meth:`hf_specdec.runners.TargetSession.verify`).
    ``max_nodes``: the most nodes the proposer's resumed trees have (the widths a compiled verification prepares for
    them; ``None``: any the call's trees may have)."""

    layer: int
    hidden: torch.Tensor
    max_nodes: int | None = None


@dataclass
class DraftTree:
    """A batch of draft trees, one per row, padded to the same number of nodes.

    Args:
        tokens: ``[B, N]`` token ids; column 0 is the root (last committed token) of each row.
        parents: ``[B, N]`` index of each node's parent; ``-1`` for the root. Parents come before children.
        valid: ``[B, N]`` False for padding nodes (rows with fewer drafts than the widest row).
        draft_probs: optional ``[B, N, V]``: the distribution node ``i`` was *sampled* from (the drafter's
            distribution at its parent, after logits processors). ``None`` means the drafts are deterministic
            (argmax, top-k or copied n-grams); the sampling verifier then uses the rule that is exact for
            deterministic drafts.
        is_chain: True when every row is a chain ``0 <- 1 <- 2 ...`` (enables the fast verification path).
        resume: set by a proposer that already ran the target's first layers for the first nodes
            (:class:`Resume`, LayerSkip): verification then runs only the rest of the stack for them.
    """

    tokens: torch.LongTensor
    parents: torch.LongTensor
    valid: torch.BoolTensor
    draft_probs: torch.Tensor | None = None
    is_chain: bool = False
    resume: "Resume | None" = None
    _depths: torch.LongTensor | None = field(default=None, repr=False)
    _ancestors: torch.BoolTensor | None = field(default=None, repr=False)
    host_drafts: list[int] | None = field(default=None, repr=False)  # drafts per row, where known on the host
    host_depth: int | None = field(default=None, repr=False)  # at least the deepest node's depth, known on the host

    def max_depth(self) -> int:
        """The deepest node's depth (an upper bound, from the host when the proposer said it; else one read)."""
        if self.host_depth is None:
            self.host_depth = int(self.depths.max())
        return self.host_depth

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    @classmethod
    @host_side
    def from_rows(cls, root: torch.LongTensor, tokens: list[list[int]], parents: list[list[int]]) -> "DraftTree | None":
        """A tree per row from lists: row ``b``'s drafts ``tokens[b]`` (parents first) and, for each, its parent's
        slot (``0`` = the root, ``i`` = the row's ``i``-th draft); ``root [B]``. ``None`` when no row has a draft."""
        width = 1 + max((len(t) for t in tokens), default=0)
        if width == 1:
            return None
        for b, row in enumerate(parents):  # a proposer's bug would otherwise verify with the wrong ancestors
            if len(row) != len(tokens[b]) or any(not 0 <= p <= i for i, p in enumerate(row)):
                raise ValueError(f"Draft tree row {b}: every draft's parent must come before it (0 = the root), "
                                 f"got parents {row} for {len(tokens[b])} drafts.")
        bsz = root.shape[0]
        device = root.device
        pad = [[0] * (width - 1 - len(t)) for t in tokens]
        counts = [len(t) for t in tokens]
        token_rows = to_device([t + z for t, z in zip(tokens, pad)], device).reshape(bsz, width - 1)
        if all(row == list(range(len(row))) for row in parents):  # every row a chain: the verifier's fast path
            return cls.chain(root, token_rows, counts)
        parent_rows = to_device([[-1] + p + z for p, z in zip(parents, pad)], device).reshape(bsz, width)
        valid = torch.arange(width, device=device)[None, :] <= to_device(counts, device)[:, None]
        deepest = 0
        for row in parents:
            depth = [0]
            for p in row:
                depth.append(depth[p] + 1)
            deepest = max(deepest, max(depth))
        return cls(tokens=torch.cat([root[:, None], token_rows], dim=1), parents=parent_rows, valid=valid,
                   host_depth=deepest)

    @classmethod
    @host_side
    def chain(cls, root: torch.LongTensor, drafts: torch.LongTensor | None = None,
              num_drafts: torch.LongTensor | None = None, draft_probs: torch.Tensor | None = None) -> "DraftTree":
        """A chain per row: ``root [B]``, ``drafts [B, k]`` of which the first ``num_drafts[b]`` are real.

        ``num_drafts`` is a list of ints (host data) or a ``[B]`` tensor; ``draft_probs`` (optional) is ``[B, k, V]``:
        the distribution each draft was sampled from. Given as a list, drafts past the longest row's count are cut
        off (the verification forward then scores only what some row keeps); a tensor is not read back (that would
        synchronise), so its chain keeps all ``k`` columns.
        """
        bsz = root.shape[0]
        device = root.device
        if drafts is None:
            drafts = root.new_zeros((bsz, 0))
        counts = None
        if isinstance(num_drafts, (list, tuple)):
            counts = [int(c) for c in num_drafts]
            longest = max(counts, default=0)
            if drafts.shape[1] > longest:
                drafts = drafts[:, :longest]
                draft_probs = draft_probs[:, :longest] if draft_probs is not None else None
        k = drafts.shape[1]
        if num_drafts is None:
            counts = [k] * bsz
        if counts is not None:  # valid nodes and depths from the host counts: one copy, nothing computed
            rows = to_device([[j if j <= c else -1 for j in range(k + 1)] for c in counts], device)
            tokens, probs = chain_tensors(root, drafts, None, draft_probs)[::3]
            valid, depths = rows >= 0, rows.clamp(min=0)  # padding nodes: depth 0
        else:
            tokens, valid, depths, probs = chain_tensors(root, drafts, num_drafts.to(device), draft_probs)
        return cls.chain_of(tokens, valid, depths, probs, counts)

    @classmethod
    def chain_of(cls, tokens: torch.LongTensor, valid: torch.BoolTensor, depths: torch.LongTensor,
                 draft_probs: torch.Tensor | None, counts: list[int] | None) -> "DraftTree":
        """A chain of :func:`chain_tensors` (made elsewhere: a fixed-shape region) and the rows' counts of real drafts
        on the host (``None``: not known there; the chain is then as deep as it is long)."""
        tree = cls(tokens=tokens, parents=_chain_parents(*tokens.shape, tokens.device), valid=valid,
                   draft_probs=draft_probs, is_chain=True, _depths=depths)
        tree.host_drafts = None if counts is None else [int(c) for c in counts]
        tree.host_depth = tokens.shape[1] - 1 if counts is None else max(tree.host_drafts, default=0)
        return tree

    def packed(self, width: int, zeros: torch.LongTensor | None = None) -> torch.LongTensor:
        """``[B, 3 * width]``: its tokens, parents and valid flags, each padded with zeros to ``width`` nodes (nodes
        that are not valid, children of the root), in one copy (``zeros``: ``[B, width - N]`` zeros, made by the
        caller once per shape). :func:`unpack_tree` reads it."""
        parts = [self.tokens, self.parents, self.valid]
        if width > self.num_nodes:
            parts = [t for part in parts for t in (part, zeros)]
        return torch.cat(parts, dim=1)

    @property
    def depths(self) -> torch.LongTensor:
        """``[B, N]`` depth of every node (root = 0); padding nodes (``valid`` False) have depth 0.

        A node is verified at position ``root_position + depth``. Padding nodes are masked out, but their position
        must stay one the model can embed: a row that has just reached ``max_length`` next to the context window
        would otherwise place them past it (GPT-2's position table has ``n_positions`` rows).
        """
        if self._depths is None:
            self._depths = _depths(self.ancestors, self.valid)
        return self._depths

    @property
    def ancestors(self) -> torch.BoolTensor:
        """``[B, N, N]``: ``ancestors[b, i, j]`` is True when node ``j`` is node ``i`` or one of its ancestors (and
        valid). Built with tensor operations only: from the parent matrix by repeated squaring (paths double in
        length each round, so ``log2(N)`` rounds)."""
        if self._ancestors is None:
            n = self.num_nodes
            device = self.tokens.device
            self._ancestors = _ancestors(self.parents, self.valid, _lower_triangle(n, device) if self.is_chain
                                         else None)
        return self._ancestors

    def set_facts(self, ancestors: torch.BoolTensor, depths: torch.LongTensor) -> None:
        """Its :attr:`ancestors` and :attr:`depths`, computed elsewhere (:func:`tree_inputs`)."""
        self._ancestors, self._depths = ancestors, depths

    def children(self, b: int) -> list[list[int]]:
        """Children of every node of row ``b``, in node order (the order drafts are tried when sampling)."""
        kids: list[list[int]] = [[] for _ in range(self.num_nodes)]
        parents = self.parents[b].tolist()
        valid = self.valid[b].tolist()
        for i in range(1, self.num_nodes):
            if valid[i]:
                kids[parents[i]].append(i)
        return kids

    def path_to(self, b: int, node: int) -> list[int]:
        """Node indices from the root to ``node`` (both included) in row ``b``."""
        parents = self.parents[b].tolist()
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        return path[::-1]


_CONSTANTS: dict = {}  # small constant tensors per shape and device (chain parents, triangles): made once


def _reach(parents: torch.LongTensor) -> torch.BoolTensor:
    """``[B, N, N]``: node ``j`` is node ``i`` or one of its ancestors, from the parent matrix by repeated squaring
    (paths double in length each round, so ``log2(N)`` rounds)."""
    n = parents.shape[1]
    nodes = torch.arange(n, device=parents.device)
    reach = ((parents[:, :, None] == nodes) | (nodes[:, None] == nodes)).float()  # [B, N, N] parent or self
    for _ in range(max(n - 1, 1).bit_length()):
        reach = (torch.bmm(reach, reach) > 0).float()
    return reach.bool()


def _ancestors(parents: torch.LongTensor, valid: torch.BoolTensor, triangle: torch.BoolTensor | None):
    """:attr:`DraftTree.ancestors` from the parents; a chain's is ``triangle`` (``[N, N]`` lower), masked by ``valid``."""
    return (triangle if triangle is not None else _reach(parents)) & valid[:, None, :]


def _depths(ancestors: torch.BoolTensor, valid: torch.BoolTensor) -> torch.LongTensor:
    """:attr:`DraftTree.depths` from the ancestors (padding nodes: depth 0)."""
    return (ancestors.sum(-1) - 1).masked_fill(~valid, 0)


def tree_inputs(config, parents: torch.LongTensor, valid: torch.BoolTensor, chain: bool,
                root_positions: torch.LongTensor, past_valid: torch.BoolTensor, past_positions: torch.LongTensor,
                dtype: torch.dtype, kv_width: int | None):
    """A tree's verification inputs in one function of tensors (what the compiled runner compiles as one region):
    ``(ancestors [B, N, N], depths [B, N], positions [B, N], mask)``, as :attr:`DraftTree.ancestors`,
    :attr:`DraftTree.depths` and :func:`build_attention_mask` give them."""
    n = parents.shape[1]
    # made here, not taken from the constants' cache: a compiled function reads no module-level dict
    anc = _ancestors(parents, valid, torch.ones(n, n, dtype=torch.bool, device=parents.device).tril() if chain
                     else None)
    depths = _depths(anc, valid)
    positions = root_positions[:, None] + depths
    mask = build_attention_mask(config, past_valid, past_positions, positions, anc, dtype, kv_width=kv_width)
    return anc, depths, positions, mask


def chain_tensors(root: torch.LongTensor, drafts: torch.LongTensor, num_drafts: torch.LongTensor | None,
                  draft_probs: torch.Tensor | None = None) -> tuple:
    """A chain's tensors with tensor operations only (traceable: :meth:`DraftTree.chain`'s device side): ``(tokens,
    valid, depths [B, k + 1], draft_probs [B, k + 1, V] or None)`` of ``root [B]`` and ``drafts [B, k]``, the first
    ``num_drafts [B]`` real (``None``: ``valid`` and ``depths`` not made)."""
    bsz, k = drafts.shape
    tokens = torch.cat([root[:, None], drafts], dim=1)
    valid = depths = None
    if num_drafts is not None:
        index = torch.arange(k + 1, device=drafts.device)
        valid = index[None, :] <= num_drafts[:, None]
        depths = index.expand(bsz, k + 1) * valid  # padding nodes: depth 0
    probs = None
    if draft_probs is not None:
        probs = torch.cat([draft_probs.new_zeros((bsz, 1, draft_probs.shape[-1])), draft_probs], dim=1)
    return tokens, valid, depths, probs


def _chain_parents(bsz: int, n: int, device) -> torch.LongTensor:
    key = ("parents", bsz, n, str(device))
    if key not in _CONSTANTS:
        _CONSTANTS[key] = (torch.arange(n, device=device) - 1).expand(bsz, n)
    return _CONSTANTS[key]


def _lower_triangle(n: int, device) -> torch.BoolTensor:
    key = ("tril", n, str(device))
    if key not in _CONSTANTS:
        _CONSTANTS[key] = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    return _CONSTANTS[key]


def _sliding(config) -> bool:
    """Whether ``config`` has sliding-window layers (:func:`build_attention_mask` then gives a mask per layer type)."""
    return getattr(config, "sliding_window", None) is not None and "sliding_attention" in (
        getattr(config, "layer_types", None) or [])


def additive_mask(config) -> bool:
    """Whether :func:`build_attention_mask` gives ``config`` one ``[B, 1, n, kv]`` additive float tensor (no
    sliding-window layers, no ``BlockMask``): 0 where a query attends, ``finfo(dtype).min`` elsewhere, so that a
    caller feeding many steps may assemble it from such pieces itself (raises as the builder does)."""
    return tree_mask_format(config) == TENSOR and not _sliding(config)


def build_attention_mask(
    config,
    past_valid: torch.BoolTensor,
    past_positions: torch.LongTensor,
    new_positions: torch.LongTensor,
    new_attends_new: torch.BoolTensor,
    dtype: torch.dtype,
    kv_width: int | None = None,
):
    """The additive 4D attention mask for ``n`` new tokens appended after ``T`` cached columns.

    Args:
        config: the model config; decides whether a ``{"full_attention", "sliding_attention"}`` mapping is needed.
        past_valid: ``[B, T]`` True where a cached column holds a real token (False: padding or a hole), or
            ``[B, n, T]`` to say it per new token (draft-tree rows in a drafter cache).
        past_positions: ``[B, T]`` position id of each cached column.
        new_positions: ``[B, n]`` position ids of the new tokens.
        new_attends_new: ``[B, n, n]`` which new tokens each new token may see (tree ancestors, itself included).
        dtype: dtype of the attention scores (the model's dtype).
        kv_width: total key length the attention will see (static caches: their full length); defaults to ``T + n``.

    Returns a ``[B, 1, n, kv_width]`` float tensor (0 = attend, finfo.min = masked), or a dict of them keyed by
    layer type for models that mix full and sliding-window layers. Sliding windows are applied by position ids,
    which is what plain ``generate()`` does for left-padded batches. A ``flex_attention`` config gets the same masks
    as ``BlockMask`` objects (:mod:`hf_specdec.attention`).
    """
    bsz, past = past_valid.shape[0], past_valid.shape[-1]
    n = new_positions.shape[1]
    width = kv_width if kv_width is not None else past + n
    allowed = torch.zeros(bsz, n, width, dtype=torch.bool, device=past_valid.device)
    allowed[:, :, :past] = past_valid if past_valid.dim() == 3 else past_valid[:, None, :]
    allowed[:, :, past:past + n] = new_attends_new

    def key_positions():
        key_pos = torch.full((bsz, width), _FAR, dtype=torch.long, device=past_valid.device)
        key_pos[:, :past] = past_positions
        key_pos[:, past:past + n] = new_positions
        return key_pos

    return _layer_masks(config, allowed, new_positions, key_positions, dtype)


_FAR = -(1 << 40)  # the position of a key column that holds nothing: outside every sliding window


def _layer_masks(config, allowed: torch.BoolTensor, new_positions: torch.LongTensor, key_positions, dtype):
    """:func:`build_attention_mask`'s result from ``allowed [B, n, width]`` (which columns each new token sees) and,
    for sliding-window layers, ``key_positions()`` (``[B, width]``: each column's position)."""
    fmt = tree_mask_format(config)  # flex_attention: BlockMasks; an attention that sees padding only: raises
    full = to_mask(allowed, fmt, dtype)
    if not _sliding(config):
        return full
    in_window = (new_positions[:, :, None] - key_positions()[:, None, :]) < config.sliding_window
    masks = {"full_attention": full, "sliding_attention": to_mask(allowed & in_window, fmt, dtype)}
    for kind in set(getattr(config, "layer_types", None) or []) - set(masks):
        masks[kind] = full
    return masks


def unpack_tree(packed: torch.LongTensor):
    """``(tokens, parents, valid)`` of a tree packed as ``[B, 3n]`` (:meth:`DraftTree.packed`)."""
    n = packed.shape[1] // 3
    return packed[:, :n], packed[:, n:2 * n], packed[:, 2 * n:] != 0


def buffered_tree_inputs(layout, packed: torch.LongTensor, scalars: torch.LongTensor,
                         root_positions: torch.LongTensor, config, chain: bool, dtype: torch.dtype):
    """:func:`tree_inputs` at fixed shapes (a region the compiled runner replays as one CUDA graph): a tree padded to
    ``n`` nodes (``packed [B, 3n]``, :meth:`DraftTree.packed`) after the ``start = scalars[0]`` columns of a
    :class:`~hf_specdec.cache.BufferedLayout` (read over the buffers' whole width: no shape follows ``start``).
    Returns ``(tokens, valid, ancestors, depths, positions, mask)`` of the padded tree, the mask over the buffers'
    width (the static cache's). Its padding nodes (``valid`` False, parent the root) see the root and the layout: a
    row with something to attend to, which no real node sees."""
    tokens, parents, valid = unpack_tree(packed)
    bsz, n = tokens.shape
    device = packed.device
    anc = _ancestors(parents, valid, torch.ones(n, n, dtype=torch.bool, device=device).tril() if chain else None)
    depths = _depths(anc, valid)
    positions = root_positions[:, None] + depths
    past_valid, past_positions, _ = layout.buffers
    width, start = past_valid.shape[1], scalars[0]
    columns = torch.arange(width, device=device)
    before = columns < start  # [W] the layout's columns
    new = (columns >= start) & (columns < start + n)  # [W] the tree's
    at = (columns - start).clamp(0, n - 1)  # [W] the node of a tree column
    allowed = (past_valid & before)[:, None, :] | (anc.gather(2, at.expand(bsz, n, width)) & new)

    def key_positions():
        return torch.where(before, past_positions, torch.where(new, positions.gather(1, at.expand(bsz, width)), _FAR))

    # the tokens a tensor of their own (a slice of ``packed`` would be copied to be dense for the forward)
    mask = _layer_masks(config, allowed, positions, key_positions, dtype)
    return tokens.clone(memory_format=torch.contiguous_format), valid, anc, depths, positions, mask
