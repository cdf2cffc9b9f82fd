"""DFlash proposer: one drafter forward fills a block of mask tokens after the last committed token.

The drafter's cache holds the keys/values of the *context* only: the projected target features of committed tokens
(one per target cache column, so its layout mirrors the target cache, holes included). Each step feeds the features
of the columns committed since the last step as new context together with the block ``[root, mask, ..., mask]`` at
positions ``root_position + 0..B-1``; the block's keys/values are dropped afterwards. Draft ``i`` is the prediction at
block position ``i`` (argmax, or a sample from the drafter's distribution when the call samples). The number of drafts
kept is chosen from the drafter's confidence and the measured verification costs (``adaptive``). When the adaptive rule
keeps nothing, or the best draft does not pay for the verification plus the drafter's own time, the drafter is not run
again for 1, 2, 4, ... (at most 16) steps — a drafter that cannot pay for itself then costs almost nothing — and the
skipped context is fed at the next probe.

DDTree (Ringel and Romano, 2026, "Accelerating Speculative Decoding with Block Diffusion Draft Trees"; the default,
``tree_budget``; ``tree_budget=0`` drafts the chain above): the one drafter forward already gives a distribution for
every block position, none of them conditioned on the tokens drafted before it, so a path's probability is taken as
the product of its tokens' probabilities at their positions. The ``tree_budget`` most likely paths (a best-first heap
over each position's :attr:`~DFlashProposer.TREE_WIDTH` most likely tokens, :func:`best_first`) form a tree, closed
under ancestors, that the target verifies in one forward: where the chain bets on the argmax at every position, the
tree also tries the runner-up tokens where the drafter hesitates. The adaptive schedule verifies the best-first
prefix of ``n`` nodes that maximises the expected tokens (1 + the nodes' path probabilities) per unit of
measured verification cost ``c(n + 1)``, as the chain's length is chosen; the constant schedule the whole budget.
Drafts are deterministic (each position's most likely tokens, after the call's logits processors, or under coupled
sampling its noise), so sampling is exact by the verifier's rule for such drafts. One host read per proposal (the
positions' top probabilities and tokens). Measured τ and speed against the chain: benchmarks/RESULTS.md, "DDTree".
"""

from __future__ import annotations

import dataclasses
import heapq
import time

import torch
import torch.nn.functional as F

from .. import cache as cache_ops
from ..conversions.common import load_converted_or_published
from ..conversions.dflash import LAYOUTS, NATIVE_DRAFTERS, as_dflash_drafter, convert_dflash, export_dflash
from ..attention import additive
from ..compiled import FEED_BUCKETS_UP_TO, FEED_SIZES, feed_rows
from ..costs import best_count
from ..default_model import MODEL_ID as SMOLLM2
from ..modeling.dflash import DFlashDrafter
from ..registry import SCHEDULE, DrafterSpec, Method, Option, Shorthand
from ..syncs import host_side, to_device
from ..tree import DraftTree
from .features import FeatureDrafterProposer
from .hybrid import HYBRID


class DFlashProposer(FeatureDrafterProposer):
    name = "dflash"
    HEAD_FIRST = 4  # block positions scored first (adaptive schedule)
    HEAD_MORE = 0.1  # ... and the rest only when a row's draft 4 is at least this likely to be accepted

    TREE_WIDTH = 8  # DDTree: the most likely tokens of each block position the tree may branch into

    def __init__(self, drafter, block_size: int | None = None, adaptive: bool = True, tree_budget: int | None = None):
        size = block_size or drafter.config.block_size
        if not 2 <= size <= drafter.config.block_size:
            raise ValueError(f"block_size must be in 2..{drafter.config.block_size} for this drafter, got {size}.")
        tree_budget = size - 1 if tree_budget is None else tree_budget  # default: as many nodes as the chain
        if not isinstance(tree_budget, int) or tree_budget < 0:
            raise ValueError(f"tree_budget must be an int >= 0 (draft nodes of the DDTree; 0 drafts a chain), got "
                             f"{tree_budget!r}.")
        super().__init__(drafter, adaptive)
        self.block_size = size
        self.tree_budget = tree_budget
        self.max_nodes = tree_budget + 1 if tree_budget else size
        self.max_path = min(size, self.max_nodes)  # a block drafts size - 1 tokens: no path is deeper

    def hidden_state_ids(self, layer_ids):
        return [i + 1 for i in layer_ids]  # the drafter names layers; their outputs are hidden_states[i + 1]

    def _masks(self, state, block_pos):
        """One additive mask per drafter layer over [context columns ‖ block]."""
        layout = state.layout
        bsz, n = block_pos.shape
        ctx_ok = layout.valid.to(self.device)[:, None, :].expand(bsz, n, layout.length)

        def allowed(causal: bool):
            block_ok = torch.ones(n, n, dtype=torch.bool, device=self.device)
            return torch.cat([ctx_ok, (block_ok.tril() if causal else block_ok).expand(bsz, n, n)], dim=2)

        key_pos = torch.cat([layout.positions, block_pos], dim=1).to(self.device)
        return self._layer_masks(allowed, key_pos, block_pos.to(self.device))

    def _layer_masks(self, allowed, key_pos, q_pos):
        """One additive mask per drafter layer: ``allowed(causal)`` (``[B, n, K]`` booleans, the block causal inside
        itself or not), a sliding layer's window by position (``key_pos [B, K]``, ``q_pos [B, n]``). Layers of one kind
        share their mask."""
        cfg = self.drafter.config
        masks, made = [], {}
        for i in range(cfg.num_hidden_layers):
            kind = (cfg.layer_is_causal(i), cfg.layer_types[i] == "sliding_attention")
            if kind not in made:
                ok = allowed(kind[0])
                if kind[1]:
                    ok = ok & ((q_pos[:, :, None] - key_pos[:, None, :]).abs() < cfg.sliding_window)
                made[kind] = additive(ok, self.dtype)[:, None]
            masks.append(made[kind])
        return masks

    # ---- drafting at fixed shapes (compile=True: hf_specdec.graphs)

    def draft_at_fixed_shapes(self, runner) -> bool:
        """A :class:`DFlashDrafter` drafts at fixed shapes under ``compile=True``: its cache a
        :class:`~hf_specdec.cache.FixedDraftCache` as wide as the target's static cache, plus a scratch column and the
        block's columns; the new context padded to a bucket of rows and the block in one forward, with the block
        positions' logits, one region per bucket (:meth:`_block_region`)."""
        ok = runner is not None and isinstance(self.drafter, DFlashDrafter)
        self._fixed = runner if ok else None
        return ok

    def graph_key(self):
        """What a CUDA graph of :meth:`_block_region` is recorded over (:mod:`hf_specdec.graphs`): the drafter's cache
        (and the features held with it), the drafter (with the target's embeddings and LM head it holds) and the call's
        buffered layout."""
        return self.cache, self.drafter, self._layout

    def _block_fixed(self, state) -> tuple[torch.Tensor, int]:
        """:meth:`_block_eager` at fixed shapes: the new context columns padded to a bucket of rows (the padding rows
        write into the scratch column, which no row sees), the block written at its own columns after it (overwritten
        by the next proposal's), every mask over the cache's whole width; the first time for this cache every bucket
        compiled (on a GPU captured)."""
        if not isinstance(self.cache, cache_ops.FixedDraftCache):
            attn = self.drafter.layers[0].self_attn
            self._block_base = self._take_fixed_cache(state, self.block_size, attn.num_kv, attn.head_dim,
                                                      len(self.drafter.layers))
        layout = state.layout
        n = layout.length - self.synced
        rows = feed_rows(n)
        width = min(self.block_size - 1, self.tree_budget or self.block_size)
        roots, root_positions = self._on(state.roots()), self._on(state.root_positions)
        if self._hold_layout(state) and n <= FEED_BUCKETS_UP_TO:  # the inputs made inside the region, from buffers
            self.hold_features(layout.buffers[0].shape[1])
            region = self._fixed.fixed(type(self)._buffered_block_region)
            region.warm(self, "blocks", FEED_SIZES, lambda size: region(
                self, roots, root_positions, to_device([self.synced, 0], roots.device), size, width))
            logits = region(self, roots, root_positions, to_device([self.synced, n], roots.device), rows, width)
            self.synced = layout.length
            return self._deepest(state, logits, width), n
        inputs = self._fixed.fused(_fixed_block_inputs)(
            self._on(layout.valid), self._on(layout.positions), self.features, self._on(state.roots()),
            self._on(state.root_positions), self.synced, rows, self._block_base, self.block_size,
            self.drafter.config.mask_token_id)
        if n > FEED_BUCKETS_UP_TO:
            logits = self._block_region(*inputs, width)
        else:
            region = self._fixed.fixed(type(self)._block_region)
            region.warm(self, "blocks", FEED_SIZES,
                        lambda size: region(self, *self._scratch_block(inputs, size), width))
            logits = region(self, *inputs, width)
        self.synced = layout.length
        return self._deepest(state, logits, width), n

    def _deepest(self, state, logits: torch.Tensor, width: int) -> torch.Tensor:
        """The block positions' ``logits`` a chain may draft from: those the deepest row's budget reaches. A tree
        keeps them all (its host side cuts each row to its budget), so that its top tokens are one fixed shape
        (:meth:`_top_region`)."""
        return logits if self.tree_budget else logits[:, :state.deepest(width)]

    def _scratch_block(self, inputs, rows: int):
        """Inputs of ``rows`` context rows shaped as ``inputs`` that write only into the scratch column and the block's
        columns and see nothing else (to compile a bucket size before its first use)."""
        features, ctx_pos, columns, seen, key_pos, block, block_pos = inputs
        size = block.shape[1]
        return (features.new_zeros(features.shape[0], rows, features.shape[2]),
                ctx_pos.new_zeros(ctx_pos.shape[0], rows),
                torch.cat([columns.new_full((rows,), self._block_base - 1), columns[-size:]]), torch.zeros_like(seen),
                torch.zeros_like(key_pos), torch.zeros_like(block), torch.zeros_like(block_pos))

    def _buffered_block_region(self, roots, root_positions, scalars, rows: int, width: int):
        """:meth:`_block_region` over the call's :class:`~hf_specdec.cache.BufferedLayout` and the held features
        (:meth:`hold_features`), both reached through the proposer (its :meth:`graph_key` holds them), the inputs made
        inside the region as :func:`_fixed_block_inputs` makes them: ``n = scalars[1]`` of the layout's columns from
        ``scalars[0]`` as context rows padded to ``rows`` (``n = 0``: every one the scratch column's, what warms a size
        up), then the block after the root (``roots, root_positions [B]``)."""
        valid, _, positions = self._layout.buffers
        features, length, base, size = self.cache.features, valid.shape[1], self._block_base, self.block_size
        (start, n), device = scalars, valid.device
        j, at, inside = cache_ops.window(scalars, rows, length)
        ctx_features = torch.where(inside[None, :, None], features[:, at], 0)
        ctx_pos = torch.where(inside, positions[:, at], 0)
        columns = torch.cat([torch.where(inside, start + j, base - 1), torch.arange(base, base + size, device=device)])
        before = torch.arange(base, device=device) < start + n  # the context columns
        seen = F.pad(F.pad(valid, (0, base - length)) & before, (0, size))
        block_pos = root_positions[:, None] + torch.arange(size, device=device)
        key_pos = torch.cat([torch.where(before, F.pad(positions, (0, base - length)), 0), block_pos], dim=1)
        block = torch.cat([roots[:, None], roots.new_full((roots.shape[0], size - 1),
                                                          self.drafter.config.mask_token_id)], dim=1)
        return self._block_region(ctx_features, ctx_pos, columns, seen, key_pos, block, block_pos, width)

    def _block_region(self, features, ctx_pos, columns, seen, key_pos, block, block_pos, width: int):
        """One drafter forward: context rows ``features [B, c, F]`` at positions ``ctx_pos [B, c]`` written at the
        cache ``columns[:c]``, the block ``block [B, n]`` at ``block_pos`` written at ``columns[c:]`` (the cache's last
        ``n``), the block seeing the context columns ``seen [B, K]`` and itself (``key_pos [B, K]``: every column's
        position, for sliding layers); the logits of block positions ``1..width``, float32."""
        n, cols = block.shape[1], torch.arange(seen.shape[1], device=seen.device)
        offset = cols - (seen.shape[1] - n)  # [K] the column's place in the block (negative: not the block's)
        below = offset <= torch.arange(n, device=seen.device)[:, None]  # [n, K] not after the query in the block

        def allowed(causal: bool):
            own = (offset >= 0) & below if causal else (offset >= 0).expand(n, -1)
            return seen[:, None, :] | own

        self.cache.at = columns
        hidden = self.drafter(self.drafter.embed(block), self.drafter.project(features), block_pos, ctx_pos,
                              self._layer_masks(allowed, key_pos, block_pos), self.cache)
        return self.drafter.draft_logits(hidden[:, 1:1 + width]).float()

    def _block_eager(self, state) -> tuple[torch.Tensor, int]:
        """The proposal's drafter forward: the context columns fed since the last one and the block ``[root, mask,
        ...]`` at positions ``root_position + 0..``; the block's keys/values dropped after it. Returns the logits of the
        block positions a draft may use (:meth:`_block_logits`) and the context columns fed."""
        layout = state.layout
        bsz, size = state.batch_size, self.block_size
        start, end = self.synced, layout.length
        context = self.drafter.project(self.features[:, start:end])
        block = torch.full((bsz, size), self.drafter.config.mask_token_id, dtype=torch.long, device=self.device)
        block[:, 0] = state.roots().to(self.device)
        block_pos = state.root_positions[:, None] + torch.arange(size, device=state.device)
        hidden = self.drafter(self.drafter.embed(block), context, block_pos.to(self.device),
                              layout.positions[:, start:end].to(self.device), self._masks(state, block_pos), self.cache)
        self.synced = end
        cache_ops.crop(self.cache, end)  # keep the context, drop the block
        # [B, width <= size-1, V]; a tree is at most as deep as its budget
        return self._block_logits(state, hidden[:, 1:1 + (self.tree_budget or size)]), end - start

    def _keep(self, state, reaches: list[float], budget: int) -> tuple[int, tuple[float, float] | None]:
        """Drafts worth verifying: ``k`` maximising expected committed tokens per unit of forward cost, where the
        ``i``-th draft (best first) is accepted with probability ``reaches[i]`` (host floats: a chain's
        running product of the drafter's top probabilities, a tree node's path product); with the expected tokens
        and the verification cost of that ``k`` (``None`` when no ``k`` beats a plain step). Not adaptive:
        ``budget``."""
        if not self.adaptive:
            return budget, None
        expected, total = [], 1.0
        for reach in reaches[:budget]:
            total += reach
            expected.append(total)
        k = best_count(expected, state.cost_model)
        verify = state.cost_model.relative(k + 1)
        worth = (expected[k - 1], verify) if k and expected[k - 1] > verify else None
        return k, worth

    def _block_logits(self, state, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of the block positions a draft may use. The target's LM head over all 15 positions costs about a
        third of a decoding step on a CPU; the adaptive rule rarely keeps more than a few drafts of a weak drafter, so
        the first :attr:`HEAD_FIRST` positions are scored first and the rest only while some row's drafts are still
        likely enough (cumulative confidence >= :attr:`HEAD_MORE`) to be kept."""
        need = state.deepest(hidden.shape[1])
        first = min(need, self.HEAD_FIRST) if self.adaptive and self.rules.dflash_head_first else need
        logits = self.drafter.draft_logits(hidden[:, :first]).float().to(state.device)
        if first < need:
            confidence = torch.softmax(logits, dim=-1).max(-1).values
            if float(torch.cumprod(confidence.clamp(max=1.0), 1)[:, -1].max()) >= self.HEAD_MORE:
                rest = self.drafter.draft_logits(hidden[:, first:need]).float().to(state.device)
                logits = torch.cat([logits, rest], dim=1)
        return logits

    def propose(self, state):
        if self.backoff.skipping():
            return None
        t0 = time.perf_counter()
        logits, fed = (self._block_fixed if self._fixed is not None else self._block_eager)(state)
        bsz = state.batch_size
        width = logits.shape[1]
        logits = state.perturb(logits, range(width))  # coupled sampling: each depth under its position's noise
        if self.tree_budget:
            return self._tree(state, logits, t0 if fed <= self.BACKLOG else None)
        process = state.draft_process_fn()
        probs_all = []
        if process is None and not state.do_sample:  # greedy, on the device; adaptive: the confidences in one read
            drafts = logits.argmax(-1)
            host_conf = torch.softmax(logits, -1).max(-1).values.tolist() if self.adaptive else None
        else:  # row by row: each draft through the processors with its prefix, or drawn
            drafts, host_conf = [], []
            for b in range(bsz):
                rows, prefix, toks = [], state.prefix(b), []
                for i in range(width):
                    ids = torch.cat([prefix, prefix.new_tensor(toks)])[None] if toks else prefix[None]
                    scores = process(b, ids, logits[b, i:i + 1])[0] if process is not None else logits[b, i]
                    p = torch.softmax(scores, dim=-1)
                    toks.append(int(torch.multinomial(p, 1)) if state.do_sample else int(scores.argmax()))
                    rows.append(p)
                row_probs = torch.stack(rows)
                drafts.append(torch.tensor(toks, device=state.device))
                probs_all.append(row_probs)
                host_conf.append(row_probs.max(-1).values.tolist())
            drafts = torch.stack(drafts)
        kept = self._keep_rows(state, host_conf, width, t0 if fed <= self.BACKLOG else None)
        if kept is None:
            return None
        draft_probs = torch.stack(probs_all) if state.do_sample else None
        return DraftTree.chain(state.roots(), drafts, kept, draft_probs)

    @host_side
    def _keep_rows(self, state, confidences: list | None, width: int, t0: float | None) -> list[int] | None:
        """The chain's host side: how many drafts each row keeps (its budget; adaptive, as many as pay), as
        :meth:`_settle` judges them (``confidences[b]``: the drafter's confidence in each of row ``b``'s drafts, host
        floats; ``None``: not read, greedy and not adaptive). ``None`` when no row keeps a draft."""
        kept, best, reach = [], None, []
        for b in range(state.batch_size):
            budget = min(state.max_drafts[b], width)
            row = _reaches((confidences[b] if confidences is not None else [])[:budget])
            k, worth = self._keep(state, row, budget) if budget > 0 else (0, None)
            best = _better(best, worth)
            kept.append(k)
            reach.append(row[:k])  # running products: those of the kept drafts are a prefix
        return self._settle(state, reach, kept, best, t0)

    def _tree(self, state, logits: torch.Tensor, t0: float | None) -> DraftTree | None:
        """DDTree (module docstring): each row's best-first tree over the block positions' distributions (``logits
        [B, W, V]``, perturbed under coupled sampling), cut to what pays (adaptive). The drafts are deterministic (a
        position's most likely tokens): the sampling verifier uses its rule for such drafts."""
        width = logits.shape[1]
        process = state.draft_process_fn()
        if process is not None:
            logits = _processed(state, process, logits)
        k = min(self.TREE_WIDTH, self.tree_budget, logits.shape[-1])
        if self._fixed is not None:  # one fixed-shape region (its logits as wide as the block's: _deepest)
            host = self._fixed.fixed(type(self)._top_region)(self, logits, k).tolist()  # the one read
        else:
            host = _top_tokens(logits, k).tolist()  # the one read
        return self._tree_of(state, host, width, t0)

    def _top_region(self, logits: torch.Tensor, k: int) -> torch.Tensor:
        """:func:`_top_tokens` as a fixed-shape region."""
        return _top_tokens(logits, k)

    @host_side
    def _tree_of(self, state, host: list, width: int, t0: float | None) -> DraftTree | None:
        """:meth:`_tree`'s host side: each row's best-first tree from the block positions' top tokens and
        probabilities (``host[1][b][d]`` / ``host[0][b][d]``), kept as far as it pays."""
        rows, reach, kept, best = [], [], [], None
        for b in range(state.batch_size):
            nodes = best_first(host[0][b][:min(state.max_drafts[b], width)], self.tree_budget)
            reach.append([p for _, _, _, p in nodes])  # path products of probabilities
            k, worth = self._keep(state, reach[b], len(nodes))
            best = _better(best, worth)
            kept.append(k)
            rows.append(([int(host[1][b][d][r]) for d, r, _, _ in nodes], [q for _, _, q, _ in nodes]))
        kept = self._settle(state, reach, kept, best, t0)
        if kept is None:
            return None
        return DraftTree.from_rows(state.roots(), [t[:k] for (t, _), k in zip(rows, kept)],
                                   [q[:k] for (_, q), k in zip(rows, kept)])

    def _settle(self, state, reach: list[list[float]], kept: list[int],
                best: tuple[float, float] | None, t0: float | None) -> list[int] | None:
        """What chains and trees decide alike: the back-off's judgement of each row's ``kept`` drafts (best first;
        ``reach[b]`` the drafter's probabilities of their being accepted, host floats; ``best``: the best row's
        ``(expected tokens, verification cost)`` when it pays, replaced by the batch's mean with several rows; ``t0``:
        when the proposal started, ``None`` for one that fed a backlog of context). ``None`` when no row keeps a
        draft."""
        bsz = state.batch_size
        if self.adaptive and bsz > 1 and state.cost_model is not None:  # one shared forward
            # what the batch expects of this proposal (the back-off's judgement): the active rows' mean
            active = [b for b in range(bsz) if state.active[b]] or list(range(bsz))
            expected = 1.0 + sum(sum(reach[b][:kept[b]]) for b in active) / len(active)
            verify = state.cost_model.relative(max(kept) + 1)
            best = (expected, verify) if any(kept) else None
        seconds = time.perf_counter() - t0 if t0 is not None else None
        if not any(kept):
            if self.adaptive and all(state.max_drafts[b] > 0 for b in range(bsz)):
                self.backoff.judge(state, seconds, None, None)
                self.backoff.update(paid=False)
            return None
        if self.adaptive:
            self.backoff.judge(state, seconds, *(best or (None, None)))
        return kept


def best_first(probs: list[list[float]], budget: int) -> list[tuple[int, int, int, float]]:
    """DDTree's selection: the ``budget`` most likely paths of a block whose positions are independent, i.e. the
    nodes with the largest products of per-position probabilities. ``probs[d]``: the most likely tokens' probabilities
    at depth ``d + 1``, best first (host floats; as many depths as a draft may have).

    Returns the nodes in the order chosen, best first, each as ``(depth - 1, rank, parent, reach)``: the token is
    ``rank``-th most likely at its position, ``parent`` 0 for the root or ``i`` for the ``i``-th node returned (every
    node comes after its parent, so every prefix of the list is a tree), ``reach`` the product along its path. Lazy
    best-first enumeration: popping a node pushes its first child (the next position's best token) and its next
    sibling (its position's next-best token); neither scores above it, so nodes leave the heap best first, and the
    heap holds at most ``budget + 1`` entries."""
    nodes: list[tuple[int, int, int, float]] = []
    if not probs or budget <= 0 or probs[0][0] <= 0:
        return nodes
    heap = [(-probs[0][0], 0, 0, 0, 0, 1.0)]  # (-reach, order pushed, depth - 1, rank, parent, the parent's reach)
    pushed = 1
    while heap and len(nodes) < budget:
        neg, _, d, r, parent, above = heapq.heappop(heap)
        nodes.append((d, r, parent, -neg))
        if r + 1 < len(probs[d]) and probs[d][r + 1] > 0:  # the next sibling
            heapq.heappush(heap, (-above * probs[d][r + 1], pushed, d, r + 1, parent, above))
            pushed += 1
        if d + 1 < len(probs) and probs[d + 1][0] > 0:  # the first child
            heapq.heappush(heap, (neg * probs[d + 1][0], pushed, d + 1, 0, len(nodes), -neg))
            pushed += 1
    return nodes


def _top_tokens(logits: torch.Tensor, k: int) -> torch.Tensor:
    """``[2, B, W, k]`` (float64): the probabilities and ids of the ``k`` most likely tokens of each block position
    (``logits [B, W, V]``)."""
    top_p, top_ids = torch.softmax(logits, -1).topk(k, -1)
    return torch.stack([top_p.double(), top_ids.double()])


def _fixed_block_inputs(valid, positions, features, roots, root_positions, start: int, rows: int, base: int, size: int,
                        mask_id: int):
    """:meth:`DFlashProposer._block_region`'s inputs: the layout's columns ``start..`` (``valid, positions [B, T]``,
    ``features [B, T, F]``) as context rows padded to ``rows`` (padding rows write into the scratch column ``base -
    1``), the block ``[root, mask, ...]`` of ``size`` at positions ``root_positions [B] + 0..`` written at the columns
    ``base..base + size``: ``(features, ctx_pos, columns, seen, key_pos, block, block_pos)``, ``seen [B, base + size]``
    the columns holding context, ``key_pos`` every column's position."""
    n, pad = valid.shape[1] - start, rows - (valid.shape[1] - start)
    index = torch.arange(n, device=valid.device)
    columns = torch.cat([index + start, index.new_full((pad,), base - 1),
                         torch.arange(base, base + size, device=valid.device)])
    block_pos = root_positions[:, None] + torch.arange(size, device=valid.device)
    block = torch.cat([roots[:, None], roots.new_full((roots.shape[0], size - 1), mask_id)], dim=1)
    width = base + size - valid.shape[1]
    return (F.pad(features[:, start:], (0, 0, 0, pad)), F.pad(positions[:, start:], (0, pad)), columns,
            F.pad(valid, (0, width)), torch.cat([F.pad(positions, (0, width - size)), block_pos], dim=1), block,
            block_pos)


def _processed(state, process, logits: torch.Tensor) -> torch.Tensor:
    """``logits [B, W, V]`` through the call's logits processors: row ``b``'s position ``i`` with the row's prefix
    and the best tokens of the positions before it (the tree's most likely path), all on the device."""
    rows = []
    for b in range(logits.shape[0]):
        ids, scores = state.prefix(b), []
        for i in range(logits.shape[1]):
            scores.append(process(b, ids[None], logits[b, i:i + 1]))  # [1, V]
            ids = torch.cat([ids, scores[-1].argmax(-1)])
        rows.append(torch.cat(scores))
    return torch.stack(rows)


def _better(best: tuple[float, float] | None, worth: tuple[float, float] | None) -> tuple[float, float] | None:
    """The proposal whose expected tokens per unit of verification cost is higher (``None``: none pays)."""
    if worth is not None and (best is None or worth[0] / worth[1] > best[0] / best[1]):
        return worth
    return best


def _reaches(confidence: list[float]) -> list[float]:
    """Running products of the confidences (each clamped to 1): draft ``i``'s estimated chance that it and the drafts
    before it are accepted."""
    out, run = [], 1.0
    for c in confidence:
        run *= min(c, 1.0)
        out.append(run)
    return out


def _load(source, target):
    """A folder / Hub id for ``target``: one hf_specdec converted, or a published layout converted in memory for this
    target (a Muse Glimmer assistant's config has no vocabulary size: it is the target's)."""
    return load_converted_or_published(source, target, DFlashDrafter,
                                       lambda src, **kw: convert_dflash(src, target=target, **kw))


def _train(target, tokenizer, out, args, common):
    from .. import training

    return training.train_dflash(target, tokenizer, out, layers=args.layers or 3, block_size=args.block_size,
                                 num_anchors=args.num_anchors, **common)


METHOD = Method(
    name="dflash",
    summary="a block-diffusion drafter filling a block of mask tokens in one forward, conditioned on target "
            "features; a draft tree of the block (DDTree) or a chain",
    description="Lossless DFlash speculative decoding (block diffusion drafter conditioned on target hidden "
                "states): one drafter forward fills a block of mask tokens after the last committed token, using "
                "the target's embeddings and LM head and fused target features injected as keys/values in every "
                "drafter layer; the target verifies the block in one forward pass: by default as a DDTree (Ringel "
                "and Romano, 2026), the most likely paths of the block positions' distributions, best first, "
                "sized from the measured verification costs; `tree_budget=0` verifies a chain. Sampling is exact "
                "(the tree's deterministic drafts by the rule for such drafts; a chain's drafts sampled from the "
                "drafter's distribution, speculative rejection sampling). z-lab layouts (old "
                "5-layer/5-tap, new 6-layer/8-tap revisions) and transformers' native Muse-Glimmer assistant layout "
                "are converted in memory; `hf-specdec convert dflash <repo> <out> --revision <rev>` converts once.",
    build=lambda target, opts: DFlashProposer(as_dflash_drafter(opts["drafter"], target),
                                              block_size=opts["block_size"],
                                              adaptive=opts["draft_length_schedule"] != "constant",
                                              tree_budget=opts["tree_budget"]),
    options=(
        Option("block_size", int, None, "block positions drafted (default: the drafter's block size)"),
        Option("tree_budget", int, None, "DDTree: draft nodes of a best-first tree over the block positions' "
               "distributions, verified in one forward (default: block_size - 1, the chain's count); 0: a chain"),
        SCHEDULE,
        HYBRID,
    ),
    # objects: a DFlashDrafter, or transformers' own MuseGlimmerAssistantModel (converted in memory by `build`,
    # sharing its weights); folders / Hub ids: converted for the target (a Muse Glimmer config has no vocabulary size)
    drafter=dataclasses.replace(DrafterSpec.published(
        DFlashDrafter, convert_dflash, LAYOUTS,
        export=export_dflash,
        doc="a DFlash drafter",
        shipped={SMOLLM2: "smollm2-135m-instruct-dflash"},
        train=_train,
        example="drafter=\"z-lab/Qwen3-4B-DFlash-b16\")     # published repo, converted folder, or model",
    ), load=_load, accepts=(DFlashDrafter, *NATIVE_DRAFTERS)),
    shorthands={
        "dflash": Shorthand("B", lambda arg: {"block_size": int(arg)} if arg else {}),
        "dflash_fixed": Shorthand("B", lambda arg: {"draft_length_schedule": "constant",
                                                    **({"block_size": int(arg)} if arg else {})}),
        "dflash_chain": Shorthand("B", lambda arg: {"tree_budget": 0, **({"block_size": int(arg)} if arg else {})}),
        "ddtree": Shorthand("N", lambda arg: {"tree_budget": int(arg)} if arg else {}),
    },
)
