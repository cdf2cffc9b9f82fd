"""EAGLE-3 proposer: a dynamic draft tree (EAGLE-2) or a chain from an :class:`Eagle3Drafter`.

Drafter rows pair a target feature with the *next* token: row ``t`` = ``(h_t, x_{t+1})`` at position ``t``. Every
target cache column therefore has exactly one drafter row (its feature, the token of the row's next column, or the
root for the last one), so the drafter's KV cache mirrors the target cache's column layout, holes included: after a
step the rows of the accepted path are fed with the target's own features of those nodes; tree rows drafted from
the drafter's own outputs are thrown away.

Tree expansion (Li et al., EAGLE-2): the root row's logits give ``top_k`` depth-1 nodes; at every further depth the
``top_k`` best frontier nodes (by cumulative log-probability) are expanded by ``top_k`` children each; finally the
``total_tokens - 1`` best nodes of all depths form the tree. Children are deterministic top-k picks, so the sampling
verifier uses its rule for deterministic drafts (exact). The chain mode (``num_speculative_tokens``) drafts the
argmax, or samples from the drafter's distribution when the call samples (exact speculative sampling).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache

from .. import cache as cache_ops
from ..compiled import FEED_BUCKETS_UP_TO, FEED_SIZES, bucket_size, feed_rows
from ..coupling import apply_warpers
from ..conversions.eagle3 import LAYOUTS, convert_eagle3, export_eagle3
from ..default_model import MODEL_ID as SMOLLM2
from ..modeling.eagle3 import Eagle3Drafter
from ..placement import drafter_device
from ..registry import SCHEDULE, DrafterSpec, Method, Option, Shorthand
from ..syncs import host_side, to_device
from ..tree import DraftTree, build_attention_mask, chain_tensors
from .base import draft_vocab_ids
from .features import FeatureDrafterProposer
from .hybrid import HYBRID

# The dynamic tree's defaults per device type of the target: the reference's on accelerators; on a CPU in fp32 a
# forward over 5+ tokens costs much more than over 4 and every depth is a drafter forward on the critical path, so a
# small tree of three drafts (benchmarks/RESULTS.md, "τ per tree shape"); on a CPU in half precision a forward over 8
# tokens costs about one step, so a wider and deeper tree ("bfloat16 on the CPU").
TREE_DEFAULTS = {"cpu": {"top_k": 2, "depth": 3, "total_tokens": 4},
                 "cpu-half": {"top_k": 3, "depth": 4, "total_tokens": 8}}
REFERENCE_TREE = {"top_k": 10, "depth": 7, "total_tokens": 60}


def default_tree(device, dtype: torch.dtype | None = None) -> dict:
    """``top_k`` / ``depth`` / ``total_tokens`` of the dynamic tree for a target on ``device`` in ``dtype``."""
    kind = torch.device(device).type
    if kind == "cpu" and dtype in (torch.bfloat16, torch.float16):
        kind = "cpu-half"
    return dict(TREE_DEFAULTS.get(kind, REFERENCE_TREE))


class Eagle3Proposer(FeatureDrafterProposer):
    """Args:
        drafter: an ``Eagle3Drafter`` (bound to the target in ``prepare``).
        top_k, depth, total_tokens: the dynamic tree (reference defaults 10 / 7 / 60; ``generate`` with
            ``custom_generate="hf_specdec/eagle3"`` uses :func:`default_tree` for the target's device when the
            ``tree_*`` options are not given: 2 / 3 / 4 on a CPU in fp32, 3 / 4 / 8 in half precision).
        num_speculative_tokens: draft a chain of this length instead of a tree.
        adaptive: verify only as many of the best ``total_tokens - 1`` nodes as pay for their cost (the loop's
            measured forward costs, the drafter's probabilities); ``False`` always verifies them all.
            When even the best tree cannot pay for the drafting itself (measured time of a proposal, in units of a
            one-token target step), the tree is not drafted for the next 1, 2, 4 .. 16 steps; the
            drafter catches up on the skipped context at the next proposal. A chain is cut the same way, and each
            row verifies the drafts that pay for their verification. Trees and chains are drafted at most one depth
            past the deepest where the previous proposal's best draft could still add 2 % to a row's expected
            acceptance (judged from the probabilities read with that proposal's one host read, so that drafting
            never waits for the device mid-proposal).
    """

    name = "eagle3"

    def __init__(self, drafter, top_k: int = REFERENCE_TREE["top_k"], depth: int = REFERENCE_TREE["depth"],
                 total_tokens: int = REFERENCE_TREE["total_tokens"],
                 num_speculative_tokens: int | None = None, adaptive: bool = True):
        if num_speculative_tokens is not None and num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}.")
        if num_speculative_tokens is None and not (top_k >= 1 and depth >= 1 and total_tokens >= 2):
            raise ValueError("The EAGLE-3 tree needs top_k >= 1, depth >= 1 and total_tokens >= 2.")
        super().__init__(drafter, adaptive)
        self.chain = num_speculative_tokens
        self.top_k, self.depth, self.total_tokens = top_k, depth, total_tokens
        self.max_nodes = (num_speculative_tokens + 1) if num_speculative_tokens else total_tokens
        self.max_path = (num_speculative_tokens + 1) if num_speculative_tokens else min(depth + 1, total_tokens)
        self._candidate_facts: dict = {}  # (device, depth) -> :meth:`_candidates`; (k, device, dtype) -> :meth:`_own`

    # ---- drafting at fixed shapes (compile=True: hf_specdec.graphs)

    def draft_at_fixed_shapes(self, runner) -> bool:
        """An :class:`Eagle3Drafter` drafts at fixed shapes under ``compile=True``: the drafter's cache a
        :class:`~hf_specdec.cache.FixedDraftCache` as wide as the target's static cache, plus a scratch column and the
        tree's (chain's) rows at fixed columns after it; the context fed at bucket sizes (:meth:`_feed_fixed`) and
        the whole expansion one region per depth limit (:meth:`_expand_fixed`, :meth:`_chain_fixed`). A drafter of
        another kind (MTP) keeps its dynamic compiled proposal."""
        ok = runner is not None and self._kv_shape() is not None and self._additive_masks()
        self._fixed = runner if ok else None
        return ok

    def _kv_shape(self) -> tuple[int, int] | None:
        """``(key/value heads, head dim)`` of the drafter's one attention layer; ``None``: a drafter that does not
        draft at fixed shapes."""
        if not isinstance(self.drafter, Eagle3Drafter):
            return None
        attn = self.drafter.midlayer.self_attn
        return attn.num_kv, attn.head_dim

    def graph_key(self):
        """What a CUDA graph of this proposer's regions is recorded over (:mod:`hf_specdec.graphs`): its cache (and the
        features held with it), its drafter, the tree's shape and the call's buffered layout."""
        return self.cache, self.drafter, self.top_k, self._tree_base, self._layout

    def _fixed_cache_for(self, state) -> None:
        """Draft over the runner's fixed cache (:meth:`_take_fixed_cache`), the tree's (chain's) rows after its
        scratch column."""
        if isinstance(self.cache, cache_ops.FixedDraftCache):
            return
        self._tree_base = self._take_fixed_cache(state, self.chain - 1 if self.chain else (self.depth - 1) * self.top_k,
                                                 *self._kv_shape(), 1)

    def _feed_fixed(self, state):
        """:meth:`_feed_context` at fixed shapes: the new context columns padded to a bucket of rows (the padding rows
        write into the scratch column, which no row sees), the mask over the cache's whole width. Returns the root
        rows' ``(logits, hidden)`` and ``seen [B, width]``, which cache columns hold the context."""
        layout = state.layout
        n = layout.length - self.synced
        rows = feed_rows(n)
        roots = self._on(state.roots())
        if self._hold_layout(state) and n <= FEED_BUCKETS_UP_TO:  # the inputs made inside the region, from buffers
            self.hold_features(layout.buffers[0].shape[1])
            region = self._fixed.fixed(type(self)._buffered_feed_region)
            region.warm(self, "feeds", FEED_SIZES,
                        lambda size: region(self, roots, to_device([self.synced, 0], roots.device), size))
            logits, hidden, seen = region(self, roots, to_device([self.synced, n], roots.device), rows)
            self.synced = layout.length
            return logits, hidden, seen
        inputs = self._fixed.fused(_fixed_feed_inputs)(
            self._on(layout.valid), self._on(layout.tokens), self._on(layout.positions), self.features,
            self._on(state.roots()), self.synced, rows, self._tree_base - 1, self.cache.width)
        if n > FEED_BUCKETS_UP_TO:
            logits, hidden = self._feed_region(*inputs)
        else:
            region = self._fixed.fixed(type(self)._feed_region)
            region.warm(self, "feeds", FEED_SIZES,
                        lambda size: region(self, *self._scratch_feed(inputs, size)))
            logits, hidden = region(self, *inputs)
        self.synced = layout.length
        return logits, hidden, inputs[4]

    def _scratch_feed(self, inputs, rows: int):
        """Feed inputs of ``rows`` rows shaped as ``inputs`` that only write into the scratch column and see nothing
        else (to compile a bucket size before its first use)."""
        tokens, features, positions, _, seen, root = inputs
        return (tokens.new_zeros(tokens.shape[0], rows), features.new_zeros(features.shape[0], rows, features.shape[2]),
                positions.new_zeros(positions.shape[0], rows), root.new_full((rows,), self._tree_base - 1),
                torch.zeros_like(seen), torch.zeros_like(root))

    def _buffered_feed_region(self, roots, scalars, rows: int):
        """:meth:`_feed_region` over the call's :class:`~hf_specdec.cache.BufferedLayout` and the held features
        (:meth:`hold_features`), both reached through the proposer (its :meth:`graph_key` holds them), the inputs made
        inside the region as :func:`_fixed_feed_inputs` makes them: ``n = scalars[1]`` of the layout's columns from
        ``scalars[0]``, padded to ``rows`` (``n = 0``: every row the scratch column's, what warms a size up). Returns
        ``(logits, hidden)`` of the root rows and ``seen [B, width]``."""
        valid, tokens, positions = self._layout.buffers
        features, width, (start, n) = self.cache.features, valid.shape[1], scalars
        j, at, inside = cache_ops.window(scalars, rows, width)
        fed = valid[:, at] & inside
        tokens = torch.where(inside, _next_tokens(fed, tokens[:, at], roots[:, None]), 0)
        features = torch.where(inside[None, :, None], features[:, at], 0)
        positions = torch.where(inside, positions[:, at], 0)
        columns = torch.where(inside, start + j, self._tree_base - 1)
        cols = torch.arange(self.cache.width, device=valid.device)
        seen = F.pad(valid, (0, self.cache.width - width)) & (cols < start + n)
        root = torch.where(fed, j, -1).max(1).values.clamp(min=0)
        logits, hidden = self._feed_region(tokens, features, positions, columns, seen, root)
        return logits, hidden, seen

    def _feed_region(self, tokens, features, positions, columns, seen, root):
        """One drafter forward over context rows ``tokens, features, positions [B, n(, F)]`` written at the cache
        ``columns [n]``, each row seeing the context columns (``seen [B, width]``) up to its own and itself; the
        logits and hidden state of each batch row's row ``root [B]``."""
        sees = cache_ops.feed_sees(columns, seen)  # [B, n, width]
        self.cache.at = columns
        logits, hidden = self.drafter(tokens, features, positions, self._visible(sees)[:, None], self.cache,
                                      logits_to_keep=root)
        return logits[:, 0], hidden.gather(1, root[:, None, None].expand(-1, 1, hidden.shape[-1]))[:, 0]

    def _tree_fixed(self, state, logits, hidden, seen):
        """:meth:`_tree` with its expansion as one fixed-shape region per depth limit (:meth:`_expand_fixed`)."""
        max_depth = self._depth_limit(state, self.depth)
        if max_depth <= 0:
            return None
        own = self._own(self.top_k)
        region = self._fixed.fixed(type(self)._expand_fixed)
        root_positions = self._on(state.root_positions)

        def expand(d):
            _, digits_d, keyed_d = self._candidates(d)
            return region(self, logits, hidden, root_positions, seen, own,
                          *self._coupling_inputs(state, logits.shape[-1], d), tuple(digits_d) if keyed_d else None, d)

        region.warm(self, state.coupling is None, [d for d in range(1, self.depth + 1) if d != max_depth], expand)
        return self._select_fixed(state, expand(max_depth), max_depth)

    def _expand_fixed(self, logits, hidden, root_positions, seen, own, noise, processors, digits, max_depth):
        """The tree's expansion (:meth:`_expand`) over the fixed cache (:meth:`_fixed_parts`), its candidates padded to
        those of a tree of the whole depth (as :meth:`_select_fixed` takes them: the missing ones score ``-inf``, are
        ranked last and never kept; ``best`` -inf past ``max_depth``)."""
        visible, perturb, step = self._fixed_parts(seen, own, noise, processors)
        score, tok, parent, key, best = self._expand(logits, hidden, root_positions, visible, perturb, step,
                                                     max_depth, digits)
        pad = (0, self._count(self.depth) - score.shape[1])
        return (F.pad(score, pad, value=float("-inf")), F.pad(tok, pad), F.pad(parent, pad),
                None if key is None else F.pad(key, pad, value=2 ** 62),
                None if best is None else F.pad(best, (0, self.depth - best.shape[1]), value=float("-inf")))

    def _fixed_parts(self, seen, own, noise, processors):
        """``(visible, perturb, step)`` for :meth:`_expand` / :meth:`_draft_chain` over the fixed cache: what the
        first rows see (``seen [B, width]``, the context columns, as a mask over the whole width), coupled sampling's
        ``noise [B, D, Vd]`` added after the call's warpers (``None``: as drafted), and the feed of depth ``d``'s
        ``k`` rows (``own [k, k]``) at the cache columns ``tree base + (d - 1) * k ..``."""
        bsz, k = seen.shape[0], own.shape[-1]
        visible = self._visible(seen)[:, None, :].expand(-1, k, -1)

        def perturb(scores, d):
            if noise is None:
                return scores
            g = noise[:, d] if scores.dim() == 2 else noise[:, d, None]
            return apply_warpers(processors, scores.float()) + g

        def step(tokens, rows_hidden, positions, visible, d):
            at = self._tree_base + (d - 1) * k
            seen = torch.cat([visible[..., :at], own.expand(bsz, -1, -1), visible[..., at + k:]], dim=-1)
            self.cache.at = slice(at, at + k)
            step_logits, step_hidden = self._draft_forward(tokens, rows_hidden, positions, seen[:, None], d)
            return step_logits, step_hidden, seen

        return visible, perturb, step

    def _chain_fixed(self, state, logits, hidden, seen):
        """:meth:`_chain` with the drafting as one fixed-shape region per length (:meth:`_draft_chain_fixed`); the
        first time for this cache every length (as :meth:`_tree_fixed`)."""
        k = self._depth_limit(state, self.chain)
        if k <= 0:
            return None
        region = self._fixed.fixed(type(self)._draft_chain_fixed)
        root_positions, own, vocab = self._on(state.root_positions), self._own(1), self._target_vocab(state)

        def draft(n):
            return region(self, logits, hidden, root_positions, seen, own,
                          *self._coupling_inputs(state, logits.shape[-1], n), state.do_sample, vocab, n)

        region.warm(self, (state.coupling is None, state.do_sample), [n for n in range(1, self.chain + 1) if n != k],
                    draft)
        return self._chain_tree_fixed(state, *draft(k), k)

    def _chain_tree_fixed(self, state, drafts, reach, probs, k: int):
        """:meth:`_chain_tree` at fixed shapes (``drafts, reach, probs`` of ``k`` drafts padded to the longest chain's:
        :meth:`_draft_chain_fixed`): the host read (adaptive), then the chain of ``2 ** i - 1`` drafts that holds
        every row's count as one region (:meth:`_chain_region`; the drafts past a row's count not valid: the
        verification runs at that bucket anyway), every width compiled on first use."""
        counts = state.budgets(k)
        if reach is not None:  # verify only the drafts that pay for their verification (the measured costs)
            counts = self._paying_chains(state, [r[:k] for r in reach.tolist()], counts)  # the proposal's one read
            if counts is None:
                return None
        most, dev, region = self.chain, drafts.device, self._fixed.fixed(type(self)._chain_region)
        roots = self._on(state.roots())
        widths = sorted({min(bucket_size(n + 1) - 1, most) for n in range(most + 1)})
        region.warm(self, ("chain", probs is None), widths,
                    lambda w: region(self, roots, drafts, to_device([0] * len(counts), dev), probs, w))
        parts = region(self, roots, drafts, to_device(counts, dev), probs,
                       min(bucket_size(max(counts) + 1) - 1, most))
        return DraftTree.chain_of(*(None if t is None else t.to(state.device) for t in parts), counts)

    def _chain_region(self, roots, drafts, counts, probs, width: int):
        """The tensors of the chain of each row's first ``width`` drafts (``drafts [B, k]``, ``probs [B, k, V]`` or
        ``None``), the first ``counts [B]`` real: :func:`~hf_specdec.tree.chain_tensors`."""
        return chain_tensors(roots, drafts[:, :width], counts, None if probs is None else probs[:, :width])

    def _draft_chain_fixed(self, logits, hidden, root_positions, seen, own, noise, processors, sample, vocab, k):
        """The chain's drafting (:meth:`_draft_chain`) over the fixed cache (:meth:`_fixed_parts`), its ``k`` drafts
        padded with zeros to the longest chain's (as :meth:`_chain_tree_fixed` takes them)."""
        visible, perturb, step = self._fixed_parts(seen, own, noise, processors)
        out = self._draft_chain(logits, hidden, root_positions, visible, perturb, step, k, sample, vocab)
        pad = self.chain - k
        return tuple(t if t is None or not pad else F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in out)

    def begin(self, state) -> None:
        super().begin(state)
        self._worth = None
        self._confident: int | None = None  # depths the last proposal found worth drafting (None: not judged yet)
        self._rotary = None  # the proposal's RoPE table for the tree rows (:meth:`_draft_forward`)

    # ---- drafter forwards
    def _mask(self, state, past_valid, past_pos, new_pos, new_attends):
        return build_attention_mask(self.drafter.config, self._on(past_valid), self._on(past_pos), self._on(new_pos),
                                    self._on(new_attends), self.dtype)

    def _feed_context(self, state):
        """Feed the drafter rows of the target columns it has not seen; return the root rows' outputs."""
        layout = state.layout
        start, end = self.synced, layout.length
        roots = state.roots()[:, None]
        tokens = layout.tokens[:, start:end]  # [B, n]
        # the token after each column: the row's next real column's, or the root after its last one
        holes = layout.counts is None or any(c != end for c in layout.counts)  # host data: no hole in any row
        if holes:
            next_tok = _next_tokens(layout.valid[:, start:end], tokens, roots)
        else:
            next_tok = torch.cat([tokens[:, 1:], roots], dim=1)
        if not holes and start == 0 and isinstance(self.drafter, Eagle3Drafter):
            mask = None  # the first feed over a layout without holes: causal, which the drafter's attention does
        else:
            mask = self._context_mask(state, start, end)
        # the root row of a row is its last real column: without holes the last column, whose logits alone are read
        logits, hidden = self._draft_forward(self._on(next_tok), self.features[:, start:end],
                                             self._on(layout.positions[:, start:end]), mask, step=0,
                                             logits_to_keep=0 if holes else 1)
        self.synced = end
        if not holes:
            return logits[:, -1], hidden[:, -1]
        idx = self._on((layout.last_real() - start).clamp(min=0))
        root_logits = logits.gather(1, idx[:, None, None].expand(-1, 1, logits.shape[-1]))[:, 0]
        root_hidden = hidden.gather(1, idx[:, None, None].expand(-1, 1, hidden.shape[-1]))[:, 0]
        return root_logits, root_hidden

    def propose(self, state):
        backs_off = self.adaptive
        if backs_off and self.backoff.skipping():
            return None
        start = time.perf_counter()
        fixed = self._fixed is not None
        if fixed:
            self._fixed_cache_for(state)
        if self.synced > state.layout.length:  # cannot happen unless the layout was rebuilt
            self.cache, self.synced = (self.cache if fixed else DynamicCache()), 0
        fed = state.layout.length - self.synced
        if fixed:
            root_logits, root_hidden, seen = self._feed_fixed(state)
        else:
            root_logits, root_hidden = self._feed_context(state)
        context = self.synced
        if fed > self.BACKLOG:  # the prompt, or a backlog after skipped steps: time the tree alone
            start = time.perf_counter()
        self._worth = None
        try:
            if fixed:
                return (self._chain_fixed if self.chain else self._tree_fixed)(state, root_logits, root_hidden, seen)
            if self.chain:
                return self._chain(state, root_logits, root_hidden)
            return self._tree(state, root_logits, root_hidden)
        finally:
            if not fixed:
                cache_ops.crop(self.cache, context)  # tree rows are drafter guesses: never kept
            self._rotary = None
            if backs_off:
                self._schedule(state, time.perf_counter() - start)

    def _schedule(self, state, seconds: float) -> None:
        """Back off when the best tree does not pay for its verification and drafting (:meth:`BackOff.judge`)."""
        self.backoff.judge(state, seconds, *(self._worth or (None, None)))

    def _draft_forward(self, tokens, hidden, positions, mask, step: int, logits_to_keep: int = 0):
        """One drafter forward over rows ``tokens [B, k]`` (``step``: 0 for context rows, ``d`` for the rows that
        draft depth ``d + 1``, at position ``root + d - 1``); returns ``(logits, hidden)``, the logits of the last
        ``logits_to_keep`` rows only when it is not 0. A drafter with one module per depth (MTP) picks it. The rows of
        step ``d >= 1`` take their RoPE from the proposal's table."""
        rotary = self._rotary[step - 1] if step and self._rotary is not None else None
        return self.drafter(tokens, hidden, positions, mask, self.cache, rotary=rotary, logits_to_keep=logits_to_keep)

    def _rotary_table(self, positions: torch.LongTensor):
        """RoPE's ``(cos, sin)`` at the tree rows' positions ``[B, n]``, computed once for all of a proposal's steps:
        one ``([B, 1, 1, D], [B, 1, 1, D])`` per step (step ``d``'s at position ``d - 1``); ``None`` for a drafter that
        computes its own (MTP)."""
        if not isinstance(self.drafter, Eagle3Drafter) or positions.shape[1] == 0:
            return None
        cos, sin = self.drafter.rotary(positions)  # [B, n, 1, D]
        return list(zip(cos[:, :, None].unbind(1), sin[:, :, None].unbind(1)))

    def _visible(self, valid: torch.BoolTensor) -> torch.Tensor:
        """``valid`` (True: seen) on the drafter's device in the masks' representation (:meth:`_additive_masks`)."""
        valid = self._on(valid)
        if not self._additive_masks():
            return valid
        return torch.zeros(valid.shape, dtype=self.dtype, device=self.device).masked_fill_(
            ~valid, torch.finfo(self.dtype).min)

    @host_side
    def _own(self, k: int) -> torch.Tensor:
        """``[k, k]``: each of ``k`` new rows sees itself only, in the masks' representation (cached)."""
        key = (k, str(self.device), self.dtype, self._additive_masks())
        if key not in self._candidate_facts:
            self._candidate_facts[key] = self._visible(torch.eye(k, dtype=torch.bool, device=self.device))
        return self._candidate_facts[key]

    def _step(self, state, tokens, hidden, positions, visible, own, step: int):
        """Feed tree rows ``tokens [B, k]`` (at ``positions [B, k]``) after the context and the ``R`` tree rows fed
        so far; returns ``(logits, hidden, seen)``.

        ``visible [B, k, T + R]``: the context columns and earlier tree rows each new row sees (its ancestors);
        ``own [B, k, k]``: the new rows it sees (itself); ``seen [B, k, T + R + k]``: both, what a child of each new
        row sees but its own row. All in the masks' representation (:meth:`_additive_masks`).
        """
        seen = torch.cat([visible, own], dim=2)
        if self._additive_masks():  # the mask is what the rows see: one cat per step
            mask = seen[:, None]
        else:  # tree rows of step j sit at root + j - 1, k of them per step
            rows_pos = (state.root_positions[:, None] + torch.arange(step - 1, device=state.device)
                        ).repeat_interleave(tokens.shape[1], dim=1)
            past_pos = torch.cat([state.layout.positions, rows_pos], dim=1)
            mask = self._mask(state, visible, past_pos, positions, own)
        logits, hidden = self._draft_forward(self._on(tokens), hidden, self._on(positions), mask, step)
        return logits, hidden, seen

    def _depth_limit(self, state, most: int) -> int:
        """The drafts (chain) or depths (tree) to draft this step: at most ``most`` and each row's budget; adaptive, at
        most one past those the last proposal found worth drafting (its drafts' probabilities, read with its one host
        read: drafting stops where no row's next draft could add 2 % to its expected acceptance, without reading
        anything mid-proposal)."""
        limit = state.deepest(most)
        if self.adaptive and self.rules.eagle3_depth_limit and self._confident is not None:
            limit = min(limit, self._confident + 1)
        return limit

    @host_side
    def _judge_depths(self, state, best: list[list[float]]) -> None:
        """Record how many leading depths were worth drafting (``best[b][d]``: row ``b``'s most likely node at depth
        ``d + 1``, host floats): those where some drafting row's could add 2 % to its expected acceptance."""
        rows = [r for b, r in enumerate(best) if state.max_drafts[b]] or best
        self._confident = 0
        for d in range(len(rows[0]) if rows else 0):
            if max(r[d] for r in rows) < 0.02:
                break
            self._confident = d + 1

    def _chain(self, state, logits, hidden):
        k = self._depth_limit(state, self.chain)
        if k <= 0:
            return None
        visible = self._visible(state.layout.valid)[:, None, :]  # [B, 1, T + i]: the context and the drafts so far
        own = self._own(1).expand(state.batch_size, 1, 1)
        vocab_ids = draft_vocab_ids(state, self.drafter, logits.shape[-1])

        def step(tokens, rows_hidden, positions, visible, d):
            return self._step(state, tokens, rows_hidden, positions, visible, own, step=d)

        return self._chain_tree(state, *self._draft_chain(
            logits, hidden, state.root_positions, visible, lambda scores, i: state.perturb(scores, i, vocab_ids),
            step, k, state.do_sample, self._target_vocab(state)))

    def _draft_chain(self, logits, hidden, root_positions, visible, perturb, step, k: int, sample: bool, vocab: int):
        """Draft a chain of ``k`` from the root rows' ``logits [B, Vd]`` and ``hidden [B, H]`` (``perturb`` and
        ``step`` as :meth:`_expand` takes them); sampled when ``sample``, else the argmax. Returns ``(drafts [B, k]
        target ids, reach [B, k] or None, probs [B, k, vocab] or None)``: the probability that every draft up to
        each is accepted (adaptive), and the target-vocabulary distributions the drafts were sampled from."""
        drafts, probs, reaches = [], [], []
        reach = torch.ones(logits.shape[0], device=self.device)  # drafter probability that every draft so far is kept
        self._rotary = self._rotary_table(root_positions[:, None] + torch.arange(k - 1, device=root_positions.device))
        for i in range(k):
            scores = perturb(logits, i).float()
            p = torch.softmax(scores, dim=-1) if sample or self.adaptive else None
            if sample:
                pick = torch.multinomial(p, 1)[:, 0]
                probs.append(self._in_target_vocab(p, vocab))
            else:
                pick = scores.argmax(-1)
            token = self.drafter.draft_to_target(pick)
            drafts.append(token)
            if self.adaptive:
                reach = reach * p.gather(1, pick[:, None])[:, 0]
                reaches.append(reach)
            if i == k - 1:
                break
            pos = (root_positions + i)[:, None]  # row (g, d_{i+1}) sits at the position of d_i's parent
            logits, hidden, visible = step(token[:, None], hidden[:, None], pos, visible, i + 1)
            logits, hidden = logits[:, 0], hidden[:, 0]
        return (torch.stack(drafts, dim=1), torch.stack(reaches, dim=1) if reaches else None,
                torch.stack(probs, dim=1) if probs else None)

    def _chain_tree(self, state, drafts, reach, probs):
        """The chain's draft tree: each row's drafts cut to its budget, and (adaptive) to those that pay for their
        verification (``reach``: the proposal's one host read)."""
        counts = state.budgets(drafts.shape[1])
        if reach is not None:  # verify only the drafts that pay for their verification (the measured costs)
            counts = self._paying_chains(state, reach.tolist(), counts)  # [B][k]: the proposal's one host read
            if counts is None:
                return None
        return DraftTree.chain(state.roots(), drafts.to(state.device), counts,
                               probs.to(state.device) if probs is not None else None)

    @host_side
    def _paying_chains(self, state, reach_rows: list, counts: list[int]) -> list[int] | None:
        """:meth:`_chain_tree`'s host side (never traced: a compiled caller would guard on the floats): the rows'
        drafts that pay (``reach_rows``: host floats, the drafter's chance that each draft and those before it are
        accepted), ``None`` when no row keeps one."""
        self._judge_depths(state, reach_rows)
        counts = self._cut_chains(state, reach_rows, counts)
        return counts if any(counts) else None

    def _tree(self, state, logits, hidden):
        """EAGLE-2 dynamic tree, expanded for every row of the batch at once, with tensor operations only.

        Candidates are numbered by depth: the ``top_k`` depth-1 nodes, then per further depth ``top_k * top_k``
        children (``top_k`` per frontier node, in frontier order, each node's children by rank). Every candidate has a
        score (cumulative log-probability), a draft token, a parent (``1 +`` its candidate index; 0: the root) and a
        depth-first key: its path of sibling ranks from the root, one base-``top_k + 1`` digit per depth (``rank +
        1``, 0 past its depth), so that sorting by key lists parents before children and each node's better children
        first."""
        max_depth = self._depth_limit(state, self.depth)
        if max_depth <= 0:
            return None
        depth, digits, keyed = self._candidates(max_depth)
        vocab_ids = draft_vocab_ids(state, self.drafter, logits.shape[-1])
        own = self._own(self.top_k).expand(state.batch_size, -1, -1)
        # [B, k, T + R] what each frontier row sees: the context, then its ancestors among the R tree rows fed
        visible = self._visible(state.layout.valid)[:, None, :].expand(-1, self.top_k, -1)

        def step(tokens, rows_hidden, positions, visible, d):
            return self._step(state, tokens, rows_hidden, positions, visible, own, step=d)

        out = self._expand(logits, hidden, state.root_positions, visible,
                           lambda scores, d: state.perturb(scores, d, vocab_ids), step, max_depth,
                           digits if keyed else None)
        return self._select(state, *out[:3], depth, *out[3:])

    def _expand(self, logits, hidden, root_positions, visible, perturb, step, max_depth: int, digits):
        """Expand every row's tree to ``max_depth`` from the root rows' ``logits [B, Vd]`` and ``hidden [B, H]``;
        ``visible [B, k, K]``: what the first frontier's rows see (mask representation); ``perturb(scores, d)``:
        the scores depth ``d + 1`` is drafted from (coupled sampling's noise); ``step(tokens, hidden, positions,
        visible, d)``: feed a frontier (:meth:`_step`); ``digits``: the keys' digits (:meth:`_candidates`, ``None``
        when unkeyed). Returns ``(score, tok, parent [B, C], key [B, C] or None, best [B, D] or None)`` as
        :meth:`_select` takes them."""
        bsz, dev, top_k = logits.shape[0], self.device, self.top_k
        keyed = digits is not None
        logits = perturb(logits, 0)  # coupled sampling: candidates under the positions' noise
        score, tok = torch.log_softmax(logits.float(), dim=-1).topk(top_k, dim=-1)  # [B, k] depth 1: the frontier
        scores, toks, frontier_idx, best = [score], [tok], [], [score[:, :1]]
        key = digits[0].expand(bsz, -1) if keyed else None  # the frontier's keys
        keys = [key]
        positions = root_positions[:, None] + torch.arange(max_depth - 1, device=root_positions.device)  # [B, D-1]
        self._rotary = self._rotary_table(positions)
        row_positions = positions[:, :, None].expand(-1, -1, top_k).unbind(1)  # per depth [B, k]
        rows = torch.arange(bsz, device=dev)[:, None]
        frontier_hidden = hidden[:, None].expand(-1, top_k, -1)
        for d in range(1, max_depth):
            # feed the frontier: row (parent output, node token) at the position of the node's parent
            step_logits, step_hidden, seen = step(self.drafter.draft_to_target(tok), frontier_hidden,
                                                  row_positions[d - 1], visible, d)
            # children of every frontier node
            step_logits = perturb(step_logits, d)
            if step_logits.dtype != torch.float32:
                step_logits = step_logits.float()
            child_score, child_tok = torch.log_softmax(step_logits, -1).topk(top_k, dim=-1)  # [B, k, k]
            child_score = (score[:, :, None] + child_score).flatten(1)  # [B, k * k]
            child_tok = child_tok.flatten(1)
            scores.append(child_score)
            toks.append(child_tok)
            if keyed:  # each frontier node's key, plus its children's digits ([k, k] by parent and rank)
                keys.append((key[:, :, None] + digits[d]).flatten(1))
            if d == max_depth - 1:  # the last depth: no frontier to feed
                if self.adaptive:
                    best.append(child_score.max(1, keepdim=True).values)
                break
            # the next frontier: the best k children overall
            score, pick = child_score.topk(top_k, dim=-1)
            frontier_idx.append(pick)
            parent = pick // top_k
            tok = child_tok.gather(1, pick)
            key = keys[-1].gather(1, pick) if keyed else None
            frontier_hidden = step_hidden[rows, parent]
            visible = seen[rows, parent]  # a child sees what its parent saw, and its parent
            if self.adaptive:
                best.append(score[:, :1])
        # each candidate's parent: depth 1 the root, then the frontier node (1 + its candidate index) of each block
        parents = [torch.zeros(bsz, top_k, dtype=torch.long, device=dev)]
        if max_depth > 1:
            frontier = torch.arange(1, top_k + 1, device=dev).expand(bsz, 1, -1)  # [B, 1, k] depth 1
            if frontier_idx:  # depths 2 .. D-1: block i's picks, numbered after depth 1 and the blocks before
                offsets = 1 + top_k + top_k * top_k * torch.arange(max_depth - 2, device=dev)[None, :, None]
                frontier = torch.cat([frontier, torch.stack(frontier_idx, 1) + offsets], dim=1)  # [B, D-1, k]
            parents.append(frontier.repeat_interleave(top_k, dim=2).flatten(1))
        return (torch.cat(scores, 1), torch.cat(toks, 1), torch.cat(parents, 1), torch.cat(keys, 1) if keyed else None,
                torch.cat(best, 1) if self.adaptive else None)

    @host_side
    def _candidates(self, max_depth: int):
        """``(depth [C], digits, keyed)`` for a tree of ``max_depth`` (cached): each candidate's depth; per depth
        ``d + 1`` the key digit of each candidate of its block at its place (``[k]`` at depth 1, ``[k, k]`` by parent
        and rank deeper: ``(rank + 1) * (top_k + 1) ** (max_depth - 1 - d)``); and whether keys fit in 62 bits (else
        the best-first order is kept, parents first too)."""
        cache = self._candidate_facts
        key = (str(self.device), max_depth)
        if key not in cache:
            top_k, dev, base = self.top_k, self.device, self.top_k + 1
            depth = torch.cat([torch.ones(top_k, dtype=torch.long, device=dev),
                               2 + torch.arange((max_depth - 1) * top_k * top_k, device=dev) // (top_k * top_k)])
            keyed = base ** max_depth < 2 ** 62
            rank = torch.arange(top_k * top_k, device=dev) % top_k + 1
            digits = [rank[:top_k] * base ** (max_depth - 1) if d == 0 else
                      (rank * base ** (max_depth - 1 - d)).view(top_k, top_k)
                      for d in range(max_depth)] if keyed else None
            cache[key] = (depth, digits, keyed)
        return cache[key]

    def _select(self, state, score, tok, parent, depth, key, best):
        """The tree of each row's best candidates (at most ``total_tokens - 1``, fewer when more would not pay for
        their verification), built on the device in depth-first order (``key``; ``None``: best first).

        ``score, tok, parent [B, C]``, ``depth [C]``, ``key [B, C]`` as :meth:`_tree` describes them; ``best [B, D]``
        (adaptive only) each depth's most likely node (log). A child never scores above its parent (log-probabilities
        are <= 0) and a stable sort keeps equal scores in candidate order, where parents come first, so every
        best-first prefix is closed under ancestors. Adaptive, the proposal's one host read takes the best scores
        (and ``best``); the rest is decided on the host."""
        dev = score.device
        depths = self._depth_of(score.shape[1])
        keep_n = min(self.total_tokens - 1, score.shape[1])
        budgets, counts = self._budgets(state, depths, keep_n)
        ranked, probs = self._ranked(score, depth, budgets, best, keep_n)
        if self.adaptive:
            counts = self._paying_counts(state, probs, keep_n, depths, counts)
        width = max(counts)
        if width == 0:
            return None
        keep = None if min(counts) == width else \
            torch.arange(width, device=dev) < to_device(counts, dev)[:, None]  # None: every node kept
        parts = self._tree_parts(ranked[:, :width], tok, parent, depth, key,
                                 self._spans(score.shape[1], dev) if key is not None else None, keep,
                                 self._on(state.roots()))
        return self._draft_tree(state, parts, depths, counts)

    def _select_fixed(self, state, out, max_depth: int):
        """:meth:`_select` at fixed shapes: ``out`` (:meth:`_expand_fixed`'s, its candidates padded to those of the
        whole depth) ranked in one region (:meth:`_rank_region`), the host read, then the tree of each row's kept
        candidates as one region at a width of ``2 ** i - 1`` nodes after the root (:meth:`_tree_region`: the nodes
        past a row's count not valid; the verification runs at that bucket anyway). Every width and both kinds of
        budgets compile on first use."""
        score, tok, parent, key, best = out
        dev, most = score.device, min(self.total_tokens - 1, score.shape[1])
        keep_n = min(self.total_tokens - 1, self._count(max_depth))
        budgets, counts = self._budgets(state, max_depth, keep_n)
        depth = self._candidates(self.depth)[0]
        spans = self._spans(self._count(max_depth), dev, pad_to=score.shape[1]) if key is not None else None
        rank, tree = self._fixed.fixed(type(self)._rank_region), self._fixed.fixed(type(self)._tree_region)
        roots, kind = self._on(state.roots()), ("select", key is None, best is None)
        if not tree.warmed(self, kind):  # the ranking with and without budgets, the tree at every width
            ones = to_device([1] * state.batch_size, dev)
            ranked = [rank(self, score, depth, b, best, most)[0] for b in (ones, None)][-1]
            tree.warm(self, kind, sorted({min(bucket_size(w + 1) - 1, most) for w in range(1, most + 1)}),
                      lambda w: tree(self, ranked, tok, parent, depth, key, spans, ones, roots, w))
        ranked, probs = rank(self, score, depth, budgets, best, most)
        if self.adaptive:
            counts = self._paying_counts(state, probs, keep_n, max_depth, counts, stride=most)
        if max(counts) == 0:
            return None
        width = min(bucket_size(max(counts) + 1) - 1, most)
        parts = tree(self, ranked, tok, parent, depth, key, spans, to_device(counts, dev), roots, width)
        return self._draft_tree(state, parts, max_depth, counts)

    def _rank_region(self, score, depth, budgets, best, most: int):
        """:meth:`_ranked` as a fixed-shape region."""
        return self._ranked(score, depth, budgets, best, most)

    def _ranked(self, score, depth, budgets, best, most: int):
        """``(ranked [B, C], probs or None)``: each row's candidates best first (those deeper than the row's depth
        budget, ``budgets [B]`` or ``None``, last), and (adaptive) what the proposal's host read takes: the best
        ``most`` candidates' probabilities, then each depth's best node's (``best [B, D]``)."""
        if budgets is not None:  # some row may not draft as deep: its deeper ones last
            score = score.masked_fill(depth > budgets[:, None], float("-inf"))
        ranked_score, ranked = score.sort(dim=1, descending=True, stable=True)
        probs = torch.cat([ranked_score[:, :most].exp().flatten(), best.exp().flatten()]) if self.adaptive else None
        return ranked, probs

    def _tree_region(self, ranked, tok, parent, depth, key, spans, counts, root, width: int):
        """:meth:`_tree_parts` as a fixed-shape region: each row's best ``width`` candidates, the first ``counts [B]``
        kept."""
        keep = torch.arange(width, device=ranked.device) < counts[:, None]
        return self._tree_parts(ranked[:, :width], tok, parent, depth, key, spans, keep, root)

    def _tree_parts(self, nodes, tok, parent, depth, key, spans, keep, root):
        """The draft tree of the candidates ``nodes [B, W]`` (each row's best, best first; ``keep [B, W]``: those it
        keeps, ``None``: all), in depth-first order where ``key`` is given: ``(tokens, parents, valid, depths,
        ancestors or None)`` of its ``W + 1`` nodes (``root [B]`` first; a node not kept is padding: not valid, a child
        of the root). ``spans [C]``: :meth:`_spans`."""
        bsz, width = nodes.shape
        dev, top_k = nodes.device, self.top_k
        ancestors = None
        if key is not None:  # depth-first: kept nodes first, in key order
            node_key = key.gather(1, nodes)
            node_key, order = (node_key if keep is None else node_key.masked_fill(~keep, 2 ** 62)).sort(dim=1,
                                                                                                      stable=True)
            nodes = nodes.gather(1, order)
            keep = keep.gather(1, order) if keep is not None else None
            # node j is node i or an ancestor of i when i's key starts with j's digits: key_j <= key_i < key_j + span_j
            # (span: the key range of a subtree, (top_k + 1) ** (depth - depth_j)); the root (key 0) spans all
            # (the root's span: a depth-1 candidate's times top_k + 1, a tensor product: a power of a size traced
            # with dynamic shapes is more than inductor's code generation takes)
            node_key = torch.cat([node_key.new_zeros(bsz, 1), node_key], 1)  # [B, W + 1] with the root
            span = torch.cat([(spans[:1] * (top_k + 1)).expand(bsz, 1), spans[nodes]], 1)
            ancestors = (node_key[:, :, None] >= node_key[:, None, :]) & \
                (node_key[:, :, None] < (node_key + span)[:, None, :])
        slot = torch.zeros(bsz, tok.shape[1] + 1, dtype=torch.long, device=dev)  # tree slot of 1 + each candidate
        slot.scatter_(1, nodes + 1, torch.arange(1, width + 1, device=dev).expand(bsz, -1))
        parents = slot.gather(1, parent.gather(1, nodes))
        tokens = self.drafter.draft_to_target(tok.gather(1, nodes))
        depths = depth[nodes]
        if keep is not None:
            parents, tokens, depths = parents * keep, tokens * keep, depths * keep
        valid = torch.ones(bsz, width + 1, dtype=torch.bool, device=dev)
        if keep is not None:
            valid[:, 1:] = keep
        if ancestors is not None:
            ancestors = ancestors & valid[:, None, :]
            if keep is not None:
                ancestors[:, :, 0] = True  # a padding node below the root, as the tree's own rule has it
        root = root[:, None]
        return (torch.cat([root, tokens], 1), torch.cat([torch.full_like(root, -1), parents], 1), valid,
                torch.cat([torch.zeros_like(root), depths], 1), ancestors)

    def _draft_tree(self, state, parts, depth: int, counts: list[int]) -> DraftTree:
        """The :class:`~hf_specdec.tree.DraftTree` of :meth:`_tree_parts`' tensors (``depth``: its deepest node's, on
        the host), on the loop's device (a chain when ``top_k`` is 1: the verifier's fast path)."""
        out = state.device
        tokens, parents, valid, depths, ancestors = (None if t is None else t.to(out) for t in parts)
        if self.top_k == 1:
            return DraftTree.chain(tokens[:, 0], tokens[:, 1:], counts)
        return DraftTree(tokens=tokens, parents=parents, valid=valid, host_depth=depth, _depths=depths,
                         _ancestors=ancestors)

    @host_side
    def _paying_counts(self, state, probs: torch.Tensor, keep_n: int, depths: int, counts: list[int],
                       stride: int | None = None) -> list[int]:
        """How many of its best candidates each row verifies: the proposal's one host read (``probs``: each row's
        best ``stride`` (default ``keep_n``) candidates' probabilities, then each row's best node per depth, of which
        the first ``depths`` count), the decisions made on the host (never traced: a compiled proposal would guard on
        the floats)."""
        bsz, stride = len(counts), stride or keep_n
        host = probs.tolist()  # the proposal's one read
        reach = [host[b * stride:b * stride + counts[b]] for b in range(bsz)]
        per_row = (len(host) - bsz * stride) // bsz  # the best nodes' depths (padded ones past ``depths``)
        self._judge_depths(state, [host[bsz * stride + b * per_row:bsz * stride + b * per_row + depths]
                                   for b in range(bsz)])
        counts = [min(c, self._pays(state, r)) for c, r in zip(counts, reach)]
        for r, c in zip(reach, counts):
            self._note_worth(state, sum(r[:c]), c)
        return counts

    @host_side
    def _budgets(self, state, depths: int, keep_n: int):
        """``(budgets, counts)``: each row's depth budget on the device where some row may not draft all ``depths``
        (else ``None``), and how many of the best ``keep_n`` candidates each row may keep within it (host arithmetic:
        ``top_k`` at depth 1, ``top_k ** 2`` at each deeper)."""
        top_k = self.top_k
        budgets = None
        if any(0 < m < depths for m in state.max_drafts):
            budgets = to_device(state.max_drafts, self.device)
        return budgets, [min(keep_n, top_k + top_k * top_k * (min(m, depths) - 1)) if m else 0
                         for m in state.max_drafts]

    @host_side
    def _spans(self, candidates: int, device, pad_to: int = 0) -> torch.Tensor:
        """``[C]`` the key range of each candidate's subtree, ``(top_k + 1) ** (depth of the tree - its depth)``
        (cached with :meth:`_candidates`; host-side: traced, a ``top_k`` that dynamo made a symbol after calls with
        other trees was a power inductor cannot generate code for); padded with ones to ``pad_to`` candidates."""
        max_depth = self._depth_of(candidates)
        depth = self._candidates(max_depth)[0]
        cache = self._candidate_facts
        key = (str(device), max_depth, "span", pad_to)
        if key not in cache:
            cache[key] = F.pad((self.top_k + 1) ** (max_depth - depth), (0, max(pad_to - candidates, 0)), value=1)
        return cache[key]

    def _count(self, max_depth: int) -> int:
        """The candidates of a tree of ``max_depth`` (host arithmetic)."""
        return self.top_k + (max_depth - 1) * self.top_k * self.top_k

    def _depth_of(self, candidates: int) -> int:
        """The depth of a tree of ``candidates`` candidates (host arithmetic)."""
        return 1 + (candidates - self.top_k) // (self.top_k * self.top_k)


def _fixed_feed_inputs(valid, tokens, positions, features, roots, start: int, rows: int, scratch: int, width: int):
    """The drafter rows of the layout's columns ``start..`` (``valid, tokens, positions [B, T]``, ``features [B, T,
    F]``, ``roots [B]``) as :meth:`Eagle3Proposer._feed_region` takes them, padded to ``rows`` rows (padding rows
    write into the cache's ``scratch`` column): ``(tokens, features, positions, columns, seen, root)``, ``seen [B,
    width]`` the columns holding context, ``root [B]`` each batch row's root row (its last real column's)."""
    n = valid.shape[1] - start
    fed = valid[:, start:]
    index = torch.arange(n, device=valid.device)
    root = torch.where(fed, index, -1).max(1).values.clamp(min=0)
    pad = rows - n
    columns = torch.cat([index + start, index.new_full((pad,), scratch)])
    return (F.pad(_next_tokens(fed, tokens[:, start:], roots[:, None]), (0, pad)),
            F.pad(features[:, start:], (0, 0, 0, pad)), F.pad(positions[:, start:], (0, pad)), columns,
            F.pad(valid, (0, width - valid.shape[1])), root)


def _next_tokens(valid, tokens, roots):
    """``[B, n]`` the token after each of ``n`` columns (``valid, tokens [B, n]``; ``roots [B, 1]``): the row's next
    real column's, or the root after its last one."""
    n = valid.shape[1]
    real = torch.where(valid, torch.arange(n, device=valid.device), n)  # [B, n] the column if real, else n
    after = torch.cat([real[:, 1:], real.new_full((real.shape[0], 1), n)], dim=1)  # the next column's entry
    following = after.flip(1).cummin(1).values.flip(1)  # [B, n] the next real column (n: the root)
    return torch.cat([tokens, roots], dim=1).gather(1, following)


def _build(target, opts) -> Eagle3Proposer:
    chain = opts["num_speculative_tokens"]
    given = {k: opts[f"tree_{k}"] for k in ("top_k", "depth", "total_tokens") if opts[f"tree_{k}"] is not None}
    tree = {} if chain else {**default_tree(drafter_device(target), target.dtype), **given}
    return Eagle3Proposer(opts["drafter"], num_speculative_tokens=chain,
                          adaptive=opts["draft_length_schedule"] != "constant", **tree)


def _tree_arg(arg: str) -> dict:
    if not arg:
        return {}
    top_k, depth, total = (int(x) for x in arg.split("-"))
    return {"tree_top_k": top_k, "tree_depth": depth, "tree_total_tokens": total}


def _train(target, tokenizer, out, args, common):
    from .. import training

    return training.train_eagle3(target, tokenizer, out, draft_vocab=args.draft_vocab, **common)


METHOD = Method(
    name="eagle3",
    summary="one-layer drafter over fused low/mid/high target features; dynamic draft tree (EAGLE-2) or a chain",
    description="Lossless EAGLE-3 speculative decoding (Li et al., 2025): a one-layer drafter fed with three fused "
                "hidden states of the target drafts a dynamic tree (EAGLE-2) that the target verifies in one forward "
                "pass with a tree attention mask; sampling is exact (tree rejection rule for top-k drafts). Published "
                "layouts (research `yuhuili/EAGLE3-*`, SpecForge/SGLang, speculators) are converted in memory when "
                "given by repo id or folder; `hf-specdec convert eagle3 <repo> <out>` converts once to safetensors. "
                "The tree defaults depend on the target's device and dtype: the reference's on an accelerator, a "
                "small tree on a CPU in fp32, where a forward over 5 or more tokens costs much more than over 4 and "
                "every depth is one more drafter forward on the critical path, a larger one in half precision, where "
                "8 tokens cost about one step (measured in benchmarks/RESULTS.md); a `tree_*` option you pass "
                "replaces only that value.",
    build=_build,
    options=(
        Option("tree_top_k", int, None, f"children per expanded node (default by device: {REFERENCE_TREE['top_k']}; "
               f"CPU {TREE_DEFAULTS['cpu']['top_k']}, CPU half precision {TREE_DEFAULTS['cpu-half']['top_k']})"),
        Option("tree_depth", int, None, f"tree depth, the longest draft (default {REFERENCE_TREE['depth']}; "
               f"CPU {TREE_DEFAULTS['cpu']['depth']}, half {TREE_DEFAULTS['cpu-half']['depth']})"),
        Option("tree_total_tokens", int, None, f"tree size, root included (default {REFERENCE_TREE['total_tokens']}; "
               f"CPU {TREE_DEFAULTS['cpu']['total_tokens']}, half {TREE_DEFAULTS['cpu-half']['total_tokens']})"),
        Option("num_speculative_tokens", int, None, "draft a chain of this length instead of a tree"),
        SCHEDULE,
        HYBRID,
    ),
    drafter=DrafterSpec.published(
        Eagle3Drafter, convert_eagle3, LAYOUTS,
        export=export_eagle3,
        doc="an EAGLE-3 drafter",
        shipped={SMOLLM2: "smollm2-135m-instruct-eagle3"},
        train=_train,
        example="drafter=\"yuhuili/EAGLE3-LLaMA3.1-Instruct-8B\")   # published repo, converted folder, or model",
    ),
    shorthands={
        "eagle3": Shorthand("TOPK-DEPTH-TOTAL", _tree_arg),
        "eagle3_chain": Shorthand("K", lambda arg: {"num_speculative_tokens": int(arg or 4)}),
    },
)
