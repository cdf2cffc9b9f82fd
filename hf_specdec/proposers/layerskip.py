"""LayerSkip self-speculation (Elhoushi et al., 2024): the target's own first ``E`` layers draft, sharing its cache.

Drafting runs the root and each draft through layers ``0..E-1`` of the target itself (:class:`~hf_specdec.stack.
DecoderStack`, transformers' own modules) and reads the exit out with the target's final norm and LM head -- or,
with an exit adapter (:class:`~hf_specdec.modeling.layerskip.ExitAdapter`, Kangaroo-style, trained with the target
frozen), through the adapter and the head. The early layers' keys/values of the root and the drafts go into the
target's one cache as they are computed, and the chain is returned with their layer-``E`` hidden states
(:class:`~hf_specdec.tree.Resume`): verification then runs layers ``0..E-1`` for the last draft only and layers
``E..N-1`` for all, so no early layer runs twice for a token and the cache holds each early-layer key/value once.
Drafting at fixed shapes (``compile=True``), the last draft's early layers run with the drafting too, so that the
verification is layers ``E..N-1`` alone over the tree padded to its width (one CUDA graph on a GPU).
After acceptance the loop cuts every layer back to the accepted path, as for any method.

The target decides every token, so the output is the target's: greedy equals ``generate(do_sample=False)``, sampling
uses exact speculative sampling with the exit's distribution as the draft distribution. The draft length follows the
measured costs (the drafting steps, and verification without the early layers) and the running acceptance rate.

Unlike transformers' ``assistant_early_exit``, which drafts with a separate cache and verifies every layer of every
draft at batch size 1, this runs any batch and computes each early layer once per token.
"""

from __future__ import annotations

import json
import time

import torch
from transformers.cache_utils import DynamicCache

from .. import cache as cache_ops
from ..attention import additive
from ..compiled import FEED_BUCKETS_UP_TO, FEED_SIZES, feed_rows
from ..coupling import apply_warpers
from ..costs import AcceptanceEstimator, RecentMinimum, best_draft_length
from ..default_model import MODEL_ID as SMOLLM2
from ..modeling.layerskip import ExitAdapter
from ..placement import drafter_device
from ..registry import SCHEDULE, DrafterSpec, Method, Option, Shorthand
from ..stack import DecoderStack
from .._transformers import capture_off, capture_restore, static_layer_length
from ..tree import DraftTree, Resume, additive_mask, build_attention_mask
from ..syncs import host_side, to_device
from .base import Carried, Proposer, draw, next_draft, rules_of
from .hybrid import HYBRID

CONSTANT_TOKENS = 4  # draft_length_schedule="constant" when num_speculative_tokens is not given
MAX_TOKENS = 10  # the longest draft the adaptive length may choose


def default_exit_layer(num_layers: int) -> int:
    """``E`` when neither ``exit_layer`` nor an adapter says: a quarter of the layers (the LayerSkip checkpoints'
    published choices: 4 of 16 for Llama-3.2-1B, 8 of 32 for Llama-2-7B)."""
    return max(1, min(num_layers - 1, round(num_layers / 4)))


class _ResumedCost:
    """The target's measured costs as a resumed verification sees them: ``q`` tokens through layers ``E..``, one
    through layers ``0..E-1`` (``early`` = their share of a one-token forward)."""

    def __init__(self, cost, early: float):
        self.cost, self.early = cost, early

    def relative(self, q: int) -> float:
        return self.early + (1.0 - self.early) * self.cost.relative(q)

    def explore_due(self) -> bool:
        return self.cost.explore_due()


class LayerSkipProposer(Proposer):
    """Drafts a chain with the target's first ``exit_layer`` layers (see the module doc).

    Args:
        exit_layer: ``E`` (``1 <= E < num_hidden_layers``); default: the adapter's, else
            :func:`default_exit_layer`.
        adapter: an :class:`ExitAdapter` between the exit and the LM head, or ``None`` (the plain early exit).
        num_tokens: fixed draft length; ``None``: chosen per step (up to ``max_tokens``).
    """

    name = "layerskip"
    # its drafting writes the early layers' keys/values into the target's cache: its chains verify only as they
    # are, never merged with another source's rows (hybrid drafting takes that source for all rows or none)
    merges_rows = False

    def __init__(self, exit_layer: int | None = None, adapter: ExitAdapter | None = None,
                 num_tokens: int | None = None, max_tokens: int = MAX_TOKENS, confidence: float | None = None):
        if num_tokens is not None and num_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_tokens}.")
        if adapter is not None and exit_layer is not None and exit_layer != adapter.config.exit_layer:
            raise ValueError(f"The exit adapter reads layer {adapter.config.exit_layer}'s exit, not exit_layer="
                             f"{exit_layer}. Drop exit_layer, or pass exit='plain' to draft without the adapter.")
        self.exit_layer = adapter.config.exit_layer if adapter is not None else exit_layer
        self.adapter = adapter
        self.num_tokens = num_tokens
        self.max_tokens = num_tokens if num_tokens is not None else max_tokens
        self.max_nodes = self.max_tokens + 1
        if confidence is not None and not 0.0 <= confidence <= 1.0:
            raise ValueError(f"confidence must be in [0, 1], got {confidence!r}.")
        self.confidence = confidence

    def draft_modules(self) -> list:
        # the adapter and its read-out (the target head's rows, kept outside the module tree); the early layers and
        # the plain exit's head are the target's own, which take the drafting kernels inside every proposal anyway
        return [] if self.adapter is None else [self.adapter] + ([self.adapter.head] if self.adapter.head is not None
                                                                  else [])

    def network_parts(self) -> list:
        return [self]  # the target's first layers draft, with or without an adapter

    # ---- drafting at fixed shapes (compile=True: hf_specdec.graphs)
    def draft_at_fixed_shapes(self, runner) -> bool:
        """LayerSkip drafts at fixed shapes under ``compile=True`` where the target's masks are one additive tensor (no
        sliding-window layers, no flex attention) and its layers (and the exit adapter) are on one device: each
        drafting step (the early layers over the target's static cache, the adapter over its fixed cache, the exit's
        logits) is one region (:meth:`_step_region`), a CUDA graph on a GPU, recorded over the target's static cache
        (the runner's, kept for later calls of the batch size: they replay the same graphs). The adapter's own feeds
        of committed exits it has not seen run at a bucket of rows (:meth:`_adapter_feed_region`)."""
        if runner is None:
            self._cache = None
        devices = {p.device for p in self.stack.model.parameters()}
        if self.adapter is not None:
            devices |= {p.device for p in self.adapter.parameters()}
        ok = runner is not None and additive_mask(self.stack.config) and len(devices) == 1
        self._fixed = runner if ok else None
        return ok

    def graph_key(self):
        """What a CUDA graph of this proposer's regions is recorded over (:mod:`hf_specdec.graphs`): the target's
        static cache (the runner's: :meth:`~hf_specdec.compiled.CompiledRunner.loop_cache`), the target, and the exit
        adapter with its fixed cache."""
        return self._cache, self.stack.model, self.exit_layer, self.adapter, getattr(self, "adapter_cache", None)

    def _step_region(self, current, valid, root_positions, start, column):
        """One drafting step: token ``current [B]`` at cache column ``column [1]`` (position ``root_positions [B] +
        column - start``) through layers ``0..E-1`` over the call's static cache, seeing the layout's columns (``valid
        [B, W]`` before ``start``) and the chain's ``start [1]..column``; each early layer's write position set to
        ``column`` first, so that every run writes the same. Returns the exit's hidden state ``[B, 1, H]`` and logits
        ``[B, V]`` (fp32)."""
        hidden, positions, sees = self._early_layers(current, valid, root_positions, start, column)
        if self.adapter is None:
            return hidden, self.stack.logits(hidden)[:, -1]
        self.adapter_cache.at = column  # its scratch column (the last) is never seen
        seen = torch.nn.functional.pad(sees, (0, 1))
        normed = self.adapter(hidden, positions, additive(seen, self.adapter_dtype)[:, None, None], self.adapter_cache)
        return hidden, self._adapter_logits(normed)

    def _draw_region(self, current, valid, root_positions, start, column, noise, processors, sample: bool):
        """:meth:`_step_region` and the draft drawn from its logits in the same region, as :func:`next_draft` draws
        one without logits processors: under coupled sampling through the call's warpers (``processors``) plus the
        drafted position's noise (``noise [B, K, V]``, the chain's positions; ``None``: not coupled), then drawn
        (``sample``) or the argmax. Returns the exit's hidden state ``[B, 1, H]``, the drafts ``[B]``, their
        distribution ``[B, V]`` and the best row's probability of its draft (what the adaptive stop reads)."""
        hidden, logits = self._step_region(current, valid, root_positions, start, column)
        if noise is not None:
            logits = apply_warpers(processors, logits) + noise.index_select(1, column - start)[:, 0]
        token, probs = draw(logits, sample)
        return hidden, token, probs, _confidence(probs, token)

    def _early_region(self, current, valid, root_positions, start, column):
        """:meth:`_step_region`'s early layers alone (no read-out): the last draft's, so that the verification resumes
        every node of the chain from the exit (at fixed shapes: :meth:`~hf_specdec.compiled.CompiledSession.verify`).
        Returns its exit hidden state ``[B, 1, H]``."""
        return self._early_layers(current, valid, root_positions, start, column)[0]

    def _early_layers(self, current, valid, root_positions, start, column):
        """``(exit hidden [B, 1, H], positions [B, 1], sees [B, W])`` of token ``current`` through layers ``0..E-1``
        at ``column`` (as :meth:`_step_region` describes)."""
        stack = self.stack
        for layer in self._cache.layers[:self.exit_layer]:
            length = static_layer_length(layer)
            length.copy_(column.view_as(length))
        cols = torch.arange(valid.shape[1], device=valid.device)
        sees = (valid & (cols < start)) | ((cols >= start) & (cols <= column))
        mask = additive(sees, stack.model.dtype)
        positions = root_positions[:, None] + (column - start)
        hidden = stack.embed(current[:, None])
        token = capture_off()  # the target's output-capturing hooks, if a call installed them: nothing to capture here
        hidden = stack.run(hidden, 0, self.exit_layer, mask[:, None, None], stack.rotary(hidden, positions), positions,
                           self._cache)
        capture_restore(token)
        return hidden, positions, sees

    def _adapter_logits(self, normed) -> torch.Tensor:
        """The adapter's draft logits ``[B, V]`` (fp32, the target's vocabulary: tokens outside the draft vocabulary at
        -inf, never drafted) of its last output row."""
        sub = self.adapter.logits(normed)[:, -1]
        if self.adapter.config.draft_vocab_size == self.adapter.config.vocab_size:
            return sub
        logits = sub.new_full((sub.shape[0], self.adapter.config.vocab_size), float("-inf"))
        logits[:, self.adapter.token_map.to(sub.device)] = sub
        return logits

    def _adapter_feed_region(self, exits, positions, columns, seen) -> None:
        """The adapter's keys/values of exit states ``exits [B, n, H]`` (positions ``[B, n]``) written at its fixed
        cache's ``columns [n]``, each row seeing the columns of ``seen [B, width]`` up to its own, and itself."""
        self.adapter_cache.at = columns
        self.adapter(exits, positions, additive(cache_ops.feed_sees(columns, seen), self.adapter_dtype)[:, None],
                     self.adapter_cache)

    def _feed_adapter_fixed(self, state, exits, start: int) -> None:
        """:meth:`_feed_adapter` into the adapter's fixed cache: at a bucket of rows (padding rows write into the
        scratch column, which no row sees), more than the buckets at their own number."""
        layout, width = state.layout, self.adapter_cache.width
        n = layout.length - start
        # eager (a few small operations): compiled with dynamic shapes, each new count of rows in its first calls
        # (1, then 2, then one equal to its bucket) was a new graph, seconds each on a CPU
        inputs = _adapter_feed_inputs(exits, layout.positions, layout.valid, start, feed_rows(n), width)
        if n > FEED_BUCKETS_UP_TO:
            return self._adapter_feed_region(*inputs)
        feed = self._fixed.fixed(type(self)._adapter_feed_region)
        feed.warm(self, "adapter feeds", FEED_SIZES, lambda rows: feed(self, *_adapter_feed_inputs(
            exits.new_zeros(exits.shape[0], 0, exits.shape[2]), layout.positions[:, :0], layout.valid[:, :0], 0,
            rows, width)))
        feed(self, *inputs)

    def _take_fixed_adapter_cache(self, state) -> None:
        """The adapter's fixed cache (kept by the runner for later calls), holding what its dynamic cache held (the
        prompt's columns, fed in ``begin``)."""
        cfg = self.adapter.config
        fixed, _ = self._fixed_cache_of(self.adapter, state, 0, cfg.num_key_value_heads, cfg.head_dim,
                                        cfg.num_hidden_layers, self.adapter_dtype, self.adapter.norm.weight.device)
        self.adapter_cache = fixed.fill_from(self.adapter_cache, self.adapter_cache.get_seq_length())

    def prepare(self, model) -> None:
        DecoderStack.check(model)
        n = model.config.get_text_config().num_hidden_layers
        if self.exit_layer is None:
            self.exit_layer = default_exit_layer(n)
        if not isinstance(self.exit_layer, int) or not 1 <= self.exit_layer <= n - 1:
            raise ValueError(f"exit_layer must be in 1..{n - 1} for this {n}-layer model (layers 0..E-1 draft, "
                             f"E..{n - 1} only verify), got {self.exit_layer!r}.")
        if self.adapter is not None and self.adapter.bound_to() is not model:
            self.adapter.bind_target(model)
        self.stack = DecoderStack(model)
        # the adapter continues from hidden_states[E] of every committed token (verification returns them)
        self.target_hidden_states = [self.exit_layer] if self.adapter is not None else None
        early = sum(p.numel() for layer in self.stack.layers[:self.exit_layer] for p in layer.parameters())
        total = sum(p.numel() for layer in self.stack.layers for p in layer.parameters())
        self.early_share = early / max(total + self.stack.head.weight.numel(), 1)

    def begin(self, state) -> None:
        self.rules = rules_of(state)
        self.estimator = AcceptanceEstimator(prior_alpha=0.5, prior_weight=3.0, decay=0.9)
        # one drafting step: early layers + exit read-out (the rule recent_minimum off: the latest)
        self.step_times = RecentMinimum(window=16 if self.rules.recent_minimum else 1)
        self.prior_cost = self.early_share + (0.05 if self.adapter is None else 0.1)
        self.fed = 0
        if self.adapter is not None:
            self.adapter_dtype = self.adapter.norm.weight.dtype
            # a continued conversation: the adapter's keys/values of the cached columns came with the cache
            self.adapter_cache = state.carried.cache_for(self.adapter)[0] if state.cached else DynamicCache()
            self._feed_prompt(state)

    def _feed_prompt(self, state) -> None:
        """The adapter's keys/values of the prompt (after the columns a continued conversation kept), from the
        prefill's exit hidden states."""
        self._feed_adapter(state, state.hidden_states[self.exit_layer], state.cached)

    # ---- a conversation continued from its cache
    def can_continue(self, carried) -> bool:
        """Without an adapter the early layers' keys/values are the target cache's own; the adapter needs its cache
        of the cached columns (handed back by a call with this adapter): else every column is prefilled again."""
        if self.adapter is None:
            return True
        return isinstance(carried, Carried) and carried.drafter is not None and carried.drafter() is self.adapter \
            and carried.key == ("exit", self.exit_layer)

    def hand_back(self, state, index):
        """The adapter's cache over the handed-back columns (none from a fixed cache: the runner keeps that for later
        calls; a next call prefills the conversation again)."""
        if self.adapter is None or isinstance(self.adapter_cache, cache_ops.FixedDraftCache):
            return None
        synced = cache_ops.kept_mirror(self.adapter_cache, state.layout.length, index)
        return Carried.of(self.adapter, self.adapter_cache, synced, key=("exit", self.exit_layer))

    def _feed_adapter(self, state, exits, start: int) -> None:
        """Feed the adapter the exit states ``exits [B, n, H]`` of the layout's last ``n`` columns (from ``start``):
        each sees the columns before it that are real for its row, and itself."""
        layout = state.layout
        n = layout.length - start
        causal = torch.ones(n, n, dtype=torch.bool, device=state.device).tril()
        mask = build_attention_mask(self.adapter.config, layout.valid[:, :start], layout.positions[:, :start],
                                    layout.positions[:, start:], causal[None] & layout.valid[:, None, start:],
                                    self.adapter_dtype)
        self.adapter(exits.to(self.adapter_dtype), layout.positions[:, start:], mask, self.adapter_cache)

    # ---- drafting
    def _draft_cost(self, state) -> float:
        """A drafting step in one-token target steps: measured, else (or with the rule measured_costs off) the
        early layers' share of the parameters."""
        step, seconds = state.cost_model.step_seconds(), self.step_times.value()
        measured = seconds is not None and step and self.rules.measured_costs
        return seconds / step if measured else self.prior_cost

    def _exit_logits(self, state, hidden, past_valid, past_pos, positions):
        """Draft logits ``[B, V]`` (fp32, the target's vocabulary, on the loop's device: an LM head placed by
        Accelerate returns them on its own) of the exit hidden state ``hidden [B, 1, H]``."""
        if self.adapter is None:
            return self.stack.logits(hidden)[:, -1].to(state.device)
        mask = build_attention_mask(self.adapter.config, past_valid, past_pos, positions,
                                    torch.ones(state.batch_size, 1, 1, dtype=torch.bool, device=state.device),
                                    self.adapter_dtype)
        return self._adapter_logits(self.adapter(hidden, positions, mask, self.adapter_cache)).to(state.device)

    @host_side
    def _plan(self, state) -> int:
        """The proposal's host decisions before drafting (never traced: a compiled proposal would guard on the measured
        floats and make a graph a step): the chain's longest length ``k``, and what the adaptive stop
        (:meth:`_stops`) reads, kept on the proposer."""
        top = state.deepest(self.max_tokens)
        self._resumed = _ResumedCost(state.cost_model, self.early_share)
        self._step_cost = self._draft_cost(state)
        self._alpha = self.estimator.alpha("all")
        self._reach, self._last = 1.0, 1.0  # P(every draft so far accepted); the last draft's confidence
        want = best_draft_length(self._alpha, top, self._resumed, draft_cost=self._step_cost) \
            if self.num_tokens is None else top
        return min(want, top)

    @host_side
    def _stops(self, j: int) -> bool:
        """Whether the adaptive chain stops before draft ``j``: Kangaroo's second exit (the last draft was not confident
        enough), else unless the chance that draft ``j`` is reached and accepted covers its drafting step and the
        longer verification (the measured costs)."""
        if self.confidence is not None:
            return self._last < self.confidence
        extra = self._step_cost + self._resumed.relative(j + 2) - self._resumed.relative(j + 1)
        return self._reach * self._alpha < extra

    @host_side
    def _note_confidence(self, confidence: torch.Tensor) -> None:
        """The adaptive stop's read of the best row's confidence in its draft (rows draft in lockstep: :func:`
        _confidence`)."""
        self._last = float(confidence)
        self._reach *= self._last

    def propose(self, state):
        bsz = state.batch_size
        k = self._plan(state)
        if k <= 0:
            return None
        budgets = state.budgets(self.max_tokens)
        layout, cache, stack = state.layout, state.cache, self.stack
        kv_width = cache.get_max_length() if cache_ops.is_static(cache) else None
        roots = state.roots()
        process = state.draft_process_fn()
        prefixes = [state.prefix(b) for b in range(bsz)] if process is not None else None
        ones = torch.ones(bsz, k, dtype=torch.bool, device=state.device)
        drafts, probs, exits = [], [], []
        current = roots
        if self._fixed is not None:  # the chain's columns uploaded once; the layout's as wide as the cache
            self._cache = cache
            if self.adapter is not None and not isinstance(self.adapter_cache, cache_ops.FixedDraftCache):
                self._take_fixed_adapter_cache(state)
            # the draft drawn in the step's region, unless logits processors read each row's ids (then as eagerly)
            region = self._fixed.fixed(type(self)._step_region if process else type(self)._draw_region)
            last = self._fixed.fixed(type(self)._early_region)
            columns = to_device(list(range(layout.length, layout.length + k + 1)), state.device)
            # the layout's columns as wide as the cache: a buffered layout's buffer
            valid = layout.buffers[0] if isinstance(layout, cache_ops.BufferedLayout) else \
                self._fixed.fused(_padded)(layout.valid, kv_width)
            drawing = ()  # what _draw_region draws with: coupled sampling's noise and warpers, whether it samples
            if not process:
                coupled = state.coupling is not None
                drawing = (state.noise(self.max_tokens) if coupled else None, state.processors if coupled else None,
                           state.do_sample)
            # compiled (on a GPU captured) before the timed steps, which the length rule reads: the first step's own
            # inputs, so the run writes what that step writes
            region.warm(self, ("step", len(drawing)), [0], lambda _: region(
                self, current, valid, state.root_positions, columns[:1], columns[:1], *drawing))
            last.warm(self, "step", [0], lambda _: last(self, current, valid, state.root_positions, columns[:1],
                                                         columns[:1]))
        for j in range(k):
            if j > 0 and self.num_tokens is None and self._stops(j):
                break
            t0 = time.perf_counter()
            confidence = None
            if self._fixed is not None and drawing:
                hidden, current, p, confidence = region(self, current, valid, state.root_positions, columns[:1],
                                                        columns[j:j + 1], *drawing)
            elif self._fixed is not None:
                hidden, logits = region(self, current, valid, state.root_positions, columns[:1], columns[j:j + 1])
            else:
                # token j of the chain (the root, then drafts) at column layout.length + j, after the chain so far
                past_valid = torch.cat([layout.valid, ones[:, :j]], 1)
                past_pos = torch.cat([layout.positions,
                                      state.root_positions[:, None] + torch.arange(j, device=state.device)], 1)
                pos = state.root_positions[:, None] + j
                mask = build_attention_mask(stack.config, past_valid, past_pos, pos, ones[:, :1, None],
                                            state.model.dtype, kv_width=kv_width)
                hidden = stack.embed(current[:, None])
                hidden = stack.run(hidden, 0, self.exit_layer, mask, stack.rotary(hidden, pos), pos, cache)
                logits = self._exit_logits(state, hidden, past_valid, past_pos, pos)
            exits.append(hidden)
            if confidence is None:
                current, p = next_draft(state, logits, prefixes, drafts, process, want_probs=True)
            if state.do_sample:
                probs.append(p)
            if self.num_tokens is None:  # a fixed length reads none
                self._note_confidence(confidence if confidence is not None else _confidence(p, current))
            drafts.append(current)
            self.step_times.add(time.perf_counter() - t0)
        k = len(drafts)
        self.fed = k  # the root and drafts[:k-1] went through the early layers (and the adapter)
        if self._fixed is not None:  # the last draft's early layers too: the verification resumes every node
            exits.append(last(self, current, valid, state.root_positions, columns[:1], columns[k:k + 1]))
        counts = [min(b, k) for b in budgets]
        tree = DraftTree.chain(roots, torch.stack(drafts, 1), counts, torch.stack(probs, 1) if probs else None)
        tree.resume = Resume(layer=self.exit_layer, hidden=torch.cat(exits, 1), max_nodes=self.max_nodes)
        return tree

    # ---- after verification
    def commit(self, state, tree, result) -> None:
        fed, self.fed = self.fed, 0
        if fed == 0:
            if self.adapter is not None:
                self._sync_adapter(state, result, fed=0)
            return
        proposed = result.proposed if result.proposed is not None else (tree.valid.sum(1) - 1).tolist()
        for b, n_acc in enumerate(result.num_accepted):
            if result.paths[b] and proposed[b] > 0:
                self.estimator.update("all", proposed[b], n_acc)
        if self.adapter is not None:
            self._sync_adapter(state, result, fed)

    def _sync_adapter(self, state, result, fed: int) -> None:
        """Keep the adapter cache to the target layout: drop its rejected columns, and feed the exit states of kept
        columns it has not seen (an all-accepted chain's last draft; the node of a plain step; the accepted path of
        a hybrid's drafter-free tree, which it never saw)."""
        width = max(len(p) for p in result.paths)
        past = state.layout.length - width  # columns before this step
        seen = min(fed, width)
        fixed = isinstance(self.adapter_cache, cache_ops.FixedDraftCache)
        if not fixed:  # a fixed cache's later columns are masked until overwritten
            cache_ops.crop(self.adapter_cache, past + seen)
        if seen == width:
            return
        exits = state.hidden_states[self.exit_layer]
        if not result.is_prefix_paths():  # a tree: path node i of row b is column past + i
            nodes = to_device([p + [0] * (width - len(p)) for p in result.paths], exits.device)
            exits = exits.gather(1, nodes[:, :, None].expand(-1, -1, exits.shape[-1]))
        (self._feed_adapter_fixed if fixed else self._feed_adapter)(state, exits[:, seen:width], past + seen)

    def on_compact(self, state, index) -> None:
        if self.adapter is not None:
            cache_ops.gather_columns(self.adapter_cache, index)


def _adapter_feed_inputs(exits, positions, valid, start: int, rows: int, width: int):
    """:meth:`LayerSkipProposer._adapter_feed_region`'s inputs for the exits ``exits [B, n, H]`` of the layout's
    columns ``start..`` (``positions, valid [B, T]``) at ``rows`` rows: the padding rows' columns the scratch one
    (``width - 1``), ``seen`` the layout's valid columns as wide as the cache."""
    n, length = exits.shape[1], valid.shape[1]
    pad = rows - n
    columns = torch.cat([torch.arange(start, start + n, device=valid.device),
                         torch.full((pad,), width - 1, dtype=torch.long, device=valid.device)])
    return (torch.nn.functional.pad(exits, (0, 0, 0, pad)),
            torch.nn.functional.pad(positions[:, start:start + n], (0, pad)), columns,
            torch.nn.functional.pad(valid, (0, width - length)))


def _confidence(probs: torch.Tensor, tokens: torch.LongTensor) -> torch.Tensor:
    """The best row's probability of its draft (``probs [B, V]``, ``tokens [B]``), a 0-dimensional tensor."""
    return probs.gather(1, tokens[:, None]).max()


def _padded(valid: torch.BoolTensor, width: int) -> torch.BoolTensor:
    """``valid [B, T]`` padded with False to ``width`` columns."""
    return torch.nn.functional.pad(valid, (0, width - valid.shape[1]))


def load_adapter(source, target) -> ExitAdapter:
    """An exit adapter folder (``save_pretrained``) for ``target``, on its drafter device and dtype, bound to it."""
    adapter = ExitAdapter.from_pretrained(source, dtype=target.dtype)
    return adapter.to(drafter_device(target)).eval().bind_target(target)  # bind_target checks the fit


def _build(target, opts) -> LayerSkipProposer:
    num = opts["num_speculative_tokens"]
    if num is None and opts["draft_length_schedule"] == "constant":
        num = CONSTANT_TOKENS
    adapter = opts["drafter"]
    if opts["exit"] == "plain":
        adapter = None
    elif opts["exit"] == "adapter" and adapter is None:
        raise ValueError("exit='adapter' needs an exit adapter: pass drafter=<ExitAdapter or folder> "
                         "(`hf-specdec train layerskip-adapter` trains one).")
    return LayerSkipProposer(exit_layer=opts["exit_layer"], adapter=adapter, num_tokens=num,
                             confidence=opts["confidence"])


def _check(target, adapter) -> None:
    adapter.config.check_target(target.config)


def _shipped_applies(opts: dict) -> bool:
    """Whether the adapter shipped for the target drafts when none is given: not with exit='plain', nor with an
    exit_layer other than the one it was trained for (that asks for the plain exit at that layer)."""
    if opts.get("exit") == "plain":
        return False
    if opts.get("exit_layer") is None:
        return True
    from ..registry import get, shipped_drafter

    folder = shipped_drafter(get("layerskip"))
    return folder is not None and json.loads((folder / "config.json").read_text()).get("exit_layer") == opts[
        "exit_layer"]


def _train(target, tokenizer, out, args, common):
    from .. import training

    return training.train_exit_adapter(target, tokenizer, out, exit_layer=args.exit_layer or 4,
                                       draft_vocab=args.draft_vocab or 8192, mlp=not args.no_mlp,
                                       layers=args.layers or 1, **common)


def _train_recipe(target, tokenizer, out, args, common):
    from .. import training

    common = {k: v for k, v in common.items() if k not in ("features_dir", "init_from")}
    return training.train_layerskip(target, tokenizer, out, max_dropout=args.max_dropout,
                                    curriculum=args.curriculum, exit_every=args.exit_every, **common)


METHOD = Method(
    name="layerskip",
    summary="the target's own first E layers + its head (LayerSkip self-speculation; the early layers' KV and "
            "activations are reused by verification); an exit adapter (Kangaroo) for targets not trained for it",
    description="LayerSkip self-speculation (Elhoushi et al., 2024): the target's first E layers, its final norm and "
                "its LM head draft a chain; the early layers' keys/values go into the target's one cache and their "
                "exit hidden states are handed to verification, which runs layers 0..E-1 only for the last draft "
                "and layers E..N-1 for all (transformers' assistant_early_exit recomputes every layer, with a "
                "second cache, at batch size 1). For a target not trained with the LayerSkip recipe an exit adapter "
                "(drafter=, Kangaroo-style: a small module between layer E and the frozen head, trained with the "
                "target frozen) makes the exit usable; the output is the target's either way (greedy identical, "
                "exact speculative sampling). Published LayerSkip checkpoints (facebook/layerskip-llama2-7B, "
                "-llama3-8B, -llama3.2-1B, ...) are plain transformers models: load them with from_pretrained and "
                "pass exit_layer (4 or 8 in the authors' runs).",
    build=_build,
    options=(
        Option("exit_layer", int, None, "E: layers 0..E-1 draft (default: the adapter's; without one, a quarter "
               "of the layers)"),
        Option("exit", str, None, "'adapter' (needs drafter=) or 'plain' (the target's own norm and head at layer E); "
               "default: the adapter when there is one", choices=("adapter", "plain")),
        Option("confidence", float, None, "stop drafting after a draft whose probability is below this (Kangaroo's "
               "second exit; default: stop where one more draft no longer pays for its measured cost)"),
        Option("num_speculative_tokens", int, None,
               f"fixed draft length (default: chosen per step from measured costs, up to {MAX_TOKENS}; "
               f"{CONSTANT_TOKENS} with draft_length_schedule='constant')"),
        SCHEDULE,
        HYBRID,
    ),
    drafter=DrafterSpec(
        doc="an exit adapter",
        hint="pass drafter=<ExitAdapter or folder> (optional: without one the plain early exit drafts)",
        load=load_adapter,
        accepts=ExitAdapter,
        check=_check,
        shipped={SMOLLM2: "smollm2-135m-instruct-layerskip"},
        required=False,
        default_when=_shipped_applies,
        train=_train,
        train_name="layerskip-adapter",
        more_training={"layerskip": ("the target itself, with the LayerSkip recipe (layer dropout + early-exit "
                                     "loss; for GPUs)", _train_recipe)},
        example="exit_layer=4)                          # or drafter=\"path/to/exit-adapter\"",
    ),
    shorthands={
        "layerskip": Shorthand("E", lambda arg: {"exit_layer": int(arg), "exit": "plain"} if arg else {}),
    },
)
