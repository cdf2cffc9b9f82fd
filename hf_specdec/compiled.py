"""The compiled runner: the target's verification forward through ``torch.compile``, at a few fixed shapes.

A compiled forward (and on a GPU its CUDA graph) holds for one set of input shapes; the decoding loop's draft trees
change size every step and a dynamic cache grows by a column per token. So, with the ``compile`` option
(``compile=True``, the loop's option of every method), the call runs through :class:`CompiledRunner`:

* the target's cache is a static one (``cache_implementation="static"`` semantics), kept by the runner for later
  calls of the same batch size (:meth:`CompiledRunner.loop_cache`: the same tensors, emptied, so the graphs recorded
  over them replay), whose length is the longest so far (at least :attr:`CompiledRunner.MIN_CACHE`) so that a new
  prompt length is not a new shape;
* every verification forward of ``q`` tree nodes runs at ``bucket_size(q)`` nodes: 1, 2, 4, 8, 16,
  32, 64, then multiples of 64. The padding nodes repeat the root (its token, position and mask row): no tree node
  sees them (their cache columns lie after the tree's, masked in every real row, and the loop's crop / keep of the
  accepted path drops them); the logits and hidden states are sliced back to the ``q`` nodes;
* the forward is ``torch.compile(model.forward, dynamic=False)``, ``mode="reduce-overhead"`` (CUDA graphs) on a
  GPU, inductor's default mode on a CPU. The first verification compiles every bucket up to the proposer's largest
  tree (``max_nodes``), so that a later call records nothing new for its sizes. Compiled once per runner (one per
  model, :func:`~hf_specdec.runner_choice.runner_for`), so later calls reuse the graphs of earlier ones;
* a proposer that drafts at fixed shapes (:meth:`~hf_specdec.proposers.Proposer.draft_at_fixed_shapes`: EAGLE-3, MTP,
  DFlash, Medusa, draft models, LayerSkip) runs its drafter's forwards through :meth:`CompiledRunner.fixed`
  (:mod:`hf_specdec.graphs`: compiled at fixed shapes, a CUDA graph per shape on a GPU, over a drafter cache the runner
  keeps for later calls);
* the loop's own step is fixed-shape regions too, over a layout held at the static cache's width
  (:class:`~hf_specdec.cache.BufferedLayout`, :meth:`CompiledSession.hold`): the tree padded to its verification
  width in one copy (:meth:`~hf_specdec.tree.DraftTree.packed`; its padding nodes are not valid, so no node sees them
  and no rule keeps them), its mask and positions (:func:`~hf_specdec.tree.buffered_tree_inputs`), the forward over
  the padded tree, the greedy or coupled rule over the padded tree's logits, which also writes the kept paths into the
  layout's buffers (:func:`greedy_step`, :func:`coupled_step`), and the cache commit (every layer's accepted columns
  moved into place, its length set: :func:`hf_specdec.cache.commit_columns`, a graph per bucket of kept columns over
  the kept static cache). The tree's mask and the greedy rule compile every bucket up to the proposer's largest tree
  on first use, the commit every bucket up to its longest path; a LayerSkip verification resumed from its early exit
  is layers ``E..`` alone over the padded tree (:func:`resumed_layers`: its drafting ran every node's early layers);
  where the step cannot run so (flex attention's BlockMasks, a cache over several devices, a resumed tree whose last
  node's early layers did not run) it runs as before this existed;
* the rest of the step goes through :meth:`CompiledRunner.fused` (dynamic shapes): the proposal of every other method
  that drafts with a network (:meth:`~hf_specdec.proposers.Proposer.network_parts`), a LayerSkip verification resumed
  without its last node's early layers (:meth:`~hf_specdec.stack.DecoderStack.resume`), the noise of coupled
  sampling, and the step's functions of tensors where the step is not fixed. The host bookkeeping inside a proposal
  (lists of committed tokens, the rows' budgets) is never traced (:func:`~hf_specdec.syncs.host_side`): dynamo would
  make a graph per list length.
  ``hf_specdec.launches.LaunchCounter.dynamic`` counts the dynamic regions left in a step. The prefill runs eagerly.

On a CPU the CPU kernel runner's products are not used (the compiled forward is the model's own code). In float32
the outputs are the target's own greedy outputs as everywhere; in half precision a compiled forward rounds its own
way, so they equal the target's eager decoding up to rounding (``speculative_stats["exact_bits"]`` is False).

Example::

    out = model.generate(**inputs, max_new_tokens=128, do_sample=False,
                         custom_generate=hf_specdec.decoding_method("eagle3"), compile=True)
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref

import torch
from torch.fx.experimental import _config as fx_config
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

from . import cache as cache_ops
from .attention import TENSOR, tree_mask_format
from .coupling import uniforms_of
from .dtypes import HALF
from .graphs import FixedShapeRegion, dense
from .launches import DYNAMIC, step_range
from .placement import drafter_device
from .runners import TargetRunner, TargetSession, device_type_of, logger
from ._transformers import capture_off, capture_restore, static_layer_length
from .syncs import to_device
from .tree import DraftTree, _ancestors, _depths, buffered_tree_inputs, tree_inputs, unpack_tree
from .verify import coupled_rule, greedy_rule

BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # verification sizes; past the last one, multiples of it
# graphs per compiled function before dynamo runs it eagerly: dynamo keys its graphs by code object, so every model of
# one class compiled in a process shares the count (sizes x batch sizes x hidden-state sets x models)
RECOMPILE_LIMIT = 512


def _limits():
    return torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, accumulated_recompile_limit=8 * RECOMPILE_LIMIT)


@contextlib.contextmanager
def _oblivious():
    """:func:`_limits`, and sizes reasoned about size-obliviously (``backed_size_oblivious``): a dynamic region's
    sizes of 1 (a tree of one node, one accepted column) and those a slice brings to 1 (a chain of 2 nodes) are not
    specialised, so a region is one graph for every size instead of three (1, 2, then the rest), each met first in
    whichever later call takes that path (seconds of compilation inside a timed call); and no sizes assumed equal
    because they were equal when first seen (``use_duck_shape`` off: one row and one accepted column)."""
    with _limits(), fx_config.patch(backed_size_oblivious=True, use_duck_shape=False):
        yield


FEED_BUCKETS_UP_TO = 16  # a drafter's context feed of more rows (the prompt, a backlog) runs eagerly at its own width


def feed_rows(rows: int) -> int:
    """The rows a drafter's fixed-shape context feed of ``rows`` runs at: a bucket, or ``rows`` past the buckets."""
    return bucket_size(rows) if rows <= FEED_BUCKETS_UP_TO else rows


def bucket_size(nodes: int) -> int:
    """The number of nodes a compiled verification of ``nodes`` runs at (``nodes`` rounded up to a bucket)."""
    for size in BUCKETS:
        if nodes <= size:
            return size
    return -(-nodes // BUCKETS[-1]) * BUCKETS[-1]


FEED_SIZES = tuple(sorted({bucket_size(n) for n in range(1, FEED_BUCKETS_UP_TO + 1)}))  # compiled on first use


class CompiledSession(TargetSession):
    """A :class:`~hf_specdec.runners.TargetSession` whose verification forwards run compiled, at bucket sizes."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not self.static:
            raise ValueError(
                f"compile=True verifies at fixed shapes over a static KV cache, got a {type(self.cache).__name__}. "
                "Give the option to generate() / decoding_method(), which hands the loop a static cache, or pass "
                "cache_implementation='static'.")
        self.cuda = device_type_of(self.model) == "cuda"
        self._past: int | None = None  # cached columns before the next forward's (set by verify)
        self._parts: list | None = None  # the proposers whose propose runs compiled for the call
        self._fixed_parts: list = []  # those drafting at fixed shapes for the call (hf_specdec.graphs)
        self._max_nodes = 1  # the proposer's largest tree (root included): the sizes compiled on first use
        self._max_path = 1  # its longest path (root included): the commit's sizes compiled on first use
        self._cache_device = None  # the static cache's one device, False if several (set after the prefill)
        self._tensor_masks: bool | None = None  # the call's tree masks are tensors (set on first verification)
        self._columns = None  # the static cache's tensors as the commit region writes into them (StaticColumns)
        self._constants: dict = {}  # the identity indices of the commit region, the trees' padding, per shape
        self._step = None  # a fixed-shape step's (padded tree, its logits, the rule's tensors), set by verify
        self._written = False  # the step's rule wrote the layout's new columns (a fixed-shape step)

    def __exit__(self, *exc) -> None:
        for part in self._parts or ():
            part.__dict__.pop("propose", None)  # the class's own propose again
        for part in self._fixed_parts:
            part.draft_at_fixed_shapes(None)
        super().__exit__(*exc)

    def propose(self, proposer, state):
        """The proposal with the proposer's network parts (:meth:`~hf_specdec.proposers.Proposer.network_parts`)
        drafting at fixed shapes where they can (:meth:`~hf_specdec.proposers.Proposer.draft_at_fixed_shapes`), else
        through their compiled ``propose`` (:meth:`CompiledRunner.fused`), set on the instances for the call."""
        if self._parts is None:
            self._max_nodes = max(1, proposer.max_nodes)
            self._max_path = proposer.longest_path()
            parts = proposer.network_parts()
            self._fixed_parts = [part for part in parts if part.draft_at_fixed_shapes(self.runner)]
            self._parts = [part for part in parts if part not in self._fixed_parts]
            for part in self._parts:
                part.propose = functools.partial(self.runner.fused(type(part).propose), part)
        with warnings.catch_warnings():
            # the proposers' clocks are where dynamo splits a proposal, as meant: not worth a warning
            warnings.filterwarnings("ignore", "Dynamo does not know how to trace the builtin `time.", UserWarning)
            return proposer.propose(state)

    def hold(self, layout, proposer):
        """A :class:`~hf_specdec.cache.BufferedLayout` (the runner's, for the batch size) holding ``layout``, where the
        step runs at fixed shapes: tensor masks (not flex's BlockMasks) and the static cache on the layout's
        device."""
        if self._masks_are_tensors() and self._one_device() == layout.valid.device:
            key = (layout.valid.shape[0], self.kv_width, str(layout.valid.device))
            kept = self.runner.layouts
            buffered = kept.pop(key, None) or cache_ops.BufferedLayout(*key[:2], layout.valid.device)
            kept[key] = buffered
            while len(kept) > self.runner.KEPT_CACHES:
                kept.pop(next(iter(kept)))
            return buffered.load(layout)
        return layout

    def verify(self, state, tree):
        self._past = state.layout.length
        self._step, self._written = None, False
        resumed = tree.resume is None or tree.resume.hidden.shape[1] >= tree.num_nodes
        if isinstance(state.layout, cache_ops.BufferedLayout) and resumed:
            return self._verify_fixed(state, tree)
        return super().verify(state, tree)

    def _verify_fixed(self, state, tree):
        """:meth:`verify` at fixed shapes: the tree padded to its verification width (a bucket, fewer where the cache
        has no room) in one copy (:meth:`~hf_specdec.tree.DraftTree.packed`), its mask and positions over the
        layout's buffers one region (:func:`~hf_specdec.tree.buffered_tree_inputs`), the forward over the padded
        tree; its rule then runs over the padded tree too (:meth:`rule_inputs`). Returns the ``N`` real nodes'
        logits and hidden states."""
        q, bsz, device = tree.num_nodes, tree.batch_size, state.layout.buffers[0].device
        n = max(q, min(bucket_size(q), self.kv_width - self._past))
        packed = tree.packed(n, self._constant(("zeros", bsz, n - q), lambda: torch.zeros(
            bsz, n - q, dtype=torch.long, device=device)) if n > q else None)
        scalars = to_device([self._past, *(int(a) for a in state.active)], device)  # [1 + B] start, active rows
        region, layout, chain = self.runner.fixed(buffered_tree_inputs), state.layout, tree.is_chain

        def tree_inputs_of(p):
            return region(layout, p, scalars, state.root_positions, self.text_config, chain, self.dtype)

        sizes = self._sizes(n)
        region.warm(layout, ("tree", bsz, chain), sizes, lambda w: tree_inputs_of(self._root_only(bsz, w, device)))
        tokens, valid, anc, depths, positions, mask = tree_inputs_of(packed)
        tree.set_facts(anc[:, :q, :q], depths[:, :q])
        if tree.resume is None:
            out = self.forward(tokens, mask, positions)
            logits, hidden = out.logits.float(), self._hidden(out)
        else:
            logits, hidden = self._resumed(tree.resume, mask, positions, scalars, sizes,
                                           lambda w: tree_inputs_of(self._root_only(bsz, w, device))[-2:])
        if state.coupling is None and not state.do_sample:  # the greedy rule's sizes too, before its first use
            rule, count = self.runner.fixed(greedy_step), not (chain and tree.host_drafts is not None)
            vocab = logits.shape[-1]
            rule.warm(layout, ("greedy", bsz, chain, count), sizes, lambda w: rule(
                layout, self._root_only(bsz, w, device), torch.zeros(bsz, w, vocab, device=device), scalars,
                state.root_positions, chain, count))
        padded = DraftTree(tokens=tokens, parents=packed[:, n:2 * n], valid=valid, is_chain=tree.is_chain,
                           host_drafts=tree.host_drafts, host_depth=tree.host_depth)
        padded.set_facts(anc, depths)
        self._step = (padded, logits, (state.layout, packed, scalars, state.root_positions))
        if hidden is not None and n > q:
            hidden = tuple(h if h is None else h[:, :q] for h in hidden)
        return (logits[:, :q] if n > q else logits), hidden

    def _resumed(self, resume, mask, positions, scalars, sizes: list[int], inputs_of):
        """The forward of a padded tree (``positions [B, n]``, its ``mask``) whose real nodes all went through layers
        ``0..E-1`` in the drafting (``resume``, LayerSkip's: their keys and values already in the cache): layers
        ``E..`` one region (:func:`resumed_layers`), the padding nodes' exit states zeros; compiled at every width of
        ``sizes`` on first use (``inputs_of(width)``: ``(positions, mask)`` of a tree that wide). Returns ``(logits
        [B, n, V] fp32, hidden states or None)``."""
        stack, pieces = self._resumed_stack(resume.layer)
        owner = _ResumedLayers(stack, self._static_columns())
        region, n, q = self.runner.fixed(resumed_layers), positions.shape[1], resume.hidden.shape[1]
        hidden = resume.hidden[:, :n] if q >= n else torch.nn.functional.pad(resume.hidden, (0, 0, 0, n - q))
        # every size on first use: they write layers E.. after the layout only, which this step's forward overwrites
        most = bucket_size(resume.max_nodes) if resume.max_nodes else sizes[-1]
        sizes = [w for w in sizes if w <= most or w == n]
        region.warm(owner, ("resumed", tuple(pieces)), sizes, lambda w: region(
            owner, hidden.new_zeros(hidden.shape[0], w, hidden.shape[2]), *inputs_of(w)[::-1], scalars, pieces))
        logits, captured = region(owner, hidden, mask, positions, scalars, pieces)
        return logits, self._resumed_hidden(captured)

    def _sizes(self, n: int) -> list[int]:
        """The tree widths the step's regions are compiled at on first use: ``n`` and every bucket up to the
        proposer's largest tree that the cache has room for (as :meth:`_warm` for the forward)."""
        room = self.kv_width - self._past
        return sorted({n} | {bucket_size(m) for m in range(1, self._max_nodes + 1) if bucket_size(m) <= room})

    def _root_only(self, bsz: int, width: int, device) -> torch.LongTensor:
        """A packed tree of ``width`` nodes of which only the root is valid (what warms a region's size up)."""
        def make():
            packed = torch.zeros(bsz, 3 * width, dtype=torch.long, device=device)
            packed[:, 2 * width] = 1
            return packed

        return self._constant(("root only", bsz, width), make)

    def rule_inputs(self, tree, logits, on_device: bool):
        """After a fixed-shape verification, for a rule on the device: the padded tree and its logits, and the rule
        as a fixed-shape region that also writes the kept paths' layout columns (:func:`greedy_step`,
        :func:`coupled_step`)."""
        if self._step is None or not on_device:
            return super().rule_inputs(tree, logits, on_device)
        padded, padded_logits, tensors = self._step
        return padded, padded_logits, functools.partial(self._rule, tensors)

    def _rule(self, tensors, fn, oblivious: bool = False):
        """How :func:`~hf_specdec.verify.accept` runs ``fn`` after a fixed-shape verification: its rules as
        :class:`StepRule` s (one per rule and runner: a coupled rule's compiled walks are recorded per rule object),
        anything else as the runner's ``fused``."""
        if fn not in STEP_RULES:
            return self.runner.fused(fn, oblivious)
        key = (fn, "step")
        if key not in self.runner.compiled_fns:
            self.runner.compiled_fns[key] = StepRule(self.runner.fixed(STEP_RULES[fn]), fn)
        rule = self.runner.compiled_fns[key]
        rule.tensors = tensors
        self._written = True  # accept() calls the rule it asked for: it writes the layout's new columns
        return rule

    def keep_accepted(self, state, tree, result, past: int) -> None:
        if not self._written:
            return super().keep_accepted(state, tree, result, past)
        kept = [len(p) for p in result.paths]
        width = max(kept)
        self.keep_columns(past, None if result.is_prefix_paths() else result.path_index[:, :width], width)
        state.layout.advance(width, kept)  # its columns were written by the rule (write_path_columns)

    def _masks_are_tensors(self) -> bool:
        if self._tensor_masks is None:  # the call's attention (switched for the call on entering the session)
            self._tensor_masks = tree_mask_format(self.text_config) == TENSOR
        return self._tensor_masks

    def _one_device(self):
        """The static cache's one device, or False when its layers lie on several (decided once per call, after the
        prefill filled every layer)."""
        if self._cache_device is None:
            layers = [layer for layer in self.cache.layers if getattr(layer, "is_initialized", False)]
            devices = {layer.keys.device for layer in layers}
            one = len(devices) == 1 and all(isinstance(layer, StaticLayer) for layer in layers)
            self._cache_device = devices.pop() if one else False
        return self._cache_device

    def _constant(self, key, make):
        if key not in self._constants:
            self._constants[key] = make()
        return self._constants[key]

    def keep_columns(self, start: int, index, width: int) -> None:
        if self._one_device() is False:  # layers placed on several devices: one at a time
            return super().keep_columns(start, index, width)
        owner = self._static_columns()
        device, bsz, k = self._cache_device, owner.keys[0].shape[0], bucket_size(width)
        region = self.runner.fixed(cache_ops.commit_columns)
        if not region.warmed(owner, ("commit", bsz, k)):
            # every size the call's trees may keep, on first use: with an identity index (nothing moves), so that a
            # graph's warm-up runs (two on a GPU) do not apply the step's permutation of columns twice
            for size in sorted({bucket_size(n) for n in range(1, self._max_path + 1)} | {k}):
                region.warm(owner, ("commit", bsz, size), [size],
                            lambda n: region(owner, to_device([start, 1], device), self._identity(bsz, n, device)))
        if index is None:  # the kept paths are prefixes: the columns stay where they are
            index = self._identity(bsz, k, device)
        else:
            index = index.to(device)
            index = torch.nn.functional.pad(index, (0, k - index.shape[1])) if index.shape[1] < k else index[:, :k]
        region(owner, to_device([start, width], device), index)

    def _static_columns(self) -> cache_ops.StaticColumns:
        """The static cache's buffers, as the regions that write them are recorded over (made once per cache)."""
        if self._columns is None or self._columns.cache is not self.cache:
            layers = [layer for layer in self.cache.layers if getattr(layer, "is_initialized", False)]
            self._columns = cache_ops.StaticColumns(self.cache, layers)
        return self._columns

    def _identity(self, bsz: int, k: int, device) -> torch.LongTensor:
        """``[bsz, k]`` column indices ``0..k-1`` (made once per shape and call)."""
        return self._constant(("identity", bsz, k), lambda: torch.arange(k, device=device).expand(bsz, k).contiguous())

    def _tree_inputs(self, state, tree):
        if not self._masks_are_tensors():  # a flex BlockMask is built outside compiled code
            return super()._tree_inputs(state, tree)
        anc, depths, positions, mask = self.runner.fused(tree_inputs)(
            self.text_config, tree.parents, tree.valid, tree.is_chain, state.root_positions, state.layout.valid,
            state.layout.positions, self.dtype, self.kv_width)
        tree.set_facts(anc, depths)
        return positions, mask

    def forward(self, input_ids, attention_mask, position_ids, with_hidden: bool = True):
        """The compiled forward over ``input_ids [B, q]`` padded to ``bucket_size(q)`` nodes (fewer where the static
        cache has no room for them); the output holds the ``q`` nodes' logits and hidden states. Always with the
        proposer's hidden states (one graph per size, not two)."""
        q = input_ids.shape[1]
        width = bucket_size(q)
        if self._past is not None:
            width = max(q, min(width, self.kv_width - self._past))
        masks = attention_mask.values() if isinstance(attention_mask, dict) else [attention_mask]
        tensors = all(isinstance(m, torch.Tensor) for m in masks)
        if not tensors:
            width = q  # another mask format (a flex BlockMask): run unpadded (a graph per size, still correct)
        pad = width - q
        if pad:  # padding nodes: copies of the first node (the root), which no node attends to (one region)
            input_ids, position_ids, attention_mask = self.runner.fused(_pad_nodes, oblivious=True)(
                input_ids, position_ids, attention_mask, pad)
        # dense inputs: a graph is specialised to strides too (expanded tokens would be another one)
        inputs = dict(input_ids=dense(input_ids), position_ids=dense(position_ids),
                      attention_mask=_map_masks(attention_mask, dense))
        if self._past is not None:
            self._warm(inputs, width, others=tensors)
        with self.forward_context(width):
            out = self._compiled(inputs)
        # a CUDA graph's outputs live in its memory pool, overwritten by its next replay: copied out
        keep = (lambda t: t[:, :q].clone()) if self.cuda else (lambda t: t[:, :q] if pad else t)
        out.logits = keep(out.logits)
        if getattr(out, "hidden_states", None) is not None:
            out.hidden_states = tuple(h if h is None else keep(h) for h in out.hidden_states)
        return out

    def _warm(self, inputs: dict, width: int, others: bool = True) -> None:
        """Compile a verification size before its first use (on a GPU the second run records its CUDA graph), the
        cache cut back after each run, so that no compilation is timed as the forward's cost (costs.py would shun the
        size). The first time, every bucket up to the proposer's largest tree (``max_nodes``) that fits the cache:
        a later call (another prompt length, other trees) then records nothing new (``others=False``: this size
        only)."""
        bsz, warm = inputs["input_ids"].shape[0], self.runner.warm

        def key(w):
            return (bsz, w), self.kv_width, self.dtype, repr(self.forward_kwargs)

        if key(width) in warm:
            return
        sizes = {width}
        if others:
            room = self.kv_width - self._past
            sizes |= {bucket_size(n) for n in range(1, self._max_nodes + 1) if bucket_size(n) <= room}
        for w in sorted(sizes):
            if key(w) in warm:
                continue
            args = inputs if w == width else _resized(inputs, w)
            for _ in range(2 if self.cuda else 1):
                self._compiled(args)
                cache_ops.crop(self.cache, self._past)
            warm.add(key(w))

    def _compiled(self, inputs: dict):
        if self.cuda:
            torch.compiler.cudagraph_mark_step_begin()
        with _limits():
            return self.runner.compiled(**inputs, cache=self.cache, use_cache=True, return_dict=True,
                                        **self.forward_kwargs)


def greedy_step(layout, packed, logits, scalars, root_positions, chain: bool, count_drafts: bool):
    """:func:`~hf_specdec.verify.greedy_rule` over a tree padded to ``n`` nodes (``packed [B, 3n]``, its logits ``[B,
    n, V]``) at fixed shapes, its kept paths written into ``layout`` after column ``scalars[0]`` (rows whose
    ``scalars[1 + b]`` is 0, stopped ones, keep none): a region the compiled runner replays as one CUDA graph."""
    tokens, parents, valid = unpack_tree(packed)
    ancestors = depths = None
    if not chain:
        ancestors = _ancestors(parents, valid, None)
        depths = _depths(ancestors, valid)
    out, order = greedy_rule(tokens, parents, valid, ancestors, depths, logits, chain, count_drafts)
    cache_ops.write_path_columns(layout, scalars[0], tokens, order, (out[:, 0] + 1) * scalars[1:], root_positions)
    return out, order.contiguous()  # a chain's is expanded: a graph's output is a tensor of its own


def coupled_step(layout, packed, logits, noise, scalars, root_positions, depth: int, warp, keep_scores: bool,
                 count_drafts: bool):
    """:func:`~hf_specdec.verify.coupled_rule` as :func:`greedy_step` runs the greedy rule."""
    tokens, parents, valid = unpack_tree(packed)
    out, kept, scored = coupled_rule(tokens, parents, valid, logits, noise, depth, warp, keep_scores, count_drafts)
    cache_ops.write_path_columns(layout, scalars[0], tokens, kept[:, :tokens.shape[1]], (out[:, 0] + 1) * scalars[1:],
                                 root_positions)
    return out, kept, scored


STEP_RULES = {greedy_rule: greedy_step, coupled_rule: coupled_step}


def resumed_layers(owner, hidden, mask, positions, scalars, pieces):
    """:meth:`~hf_specdec.stack.DecoderStack.finish` at fixed shapes (a region the compiled runner replays as one CUDA
    graph): layers ``E..`` (``pieces[0][0]``) of the padded tree's ``hidden [B, n, H]`` exit states written at the
    static cache's columns ``scalars[0]..`` (each such layer's write position set first), the final norm and the LM
    head. ``owner``: :class:`_ResumedLayers`."""
    stack, cache = owner.stack, owner.columns.cache
    for layer in cache.layers[pieces[0][0]:]:
        length = static_layer_length(layer)
        length.copy_(scalars[:1].view_as(length))
    token = capture_off()  # the layers run outside the model's forward: what a call keeps is returned
    out = stack.finish(hidden, mask, positions, cache, pieces)
    capture_restore(token)
    return out


class _ResumedLayers:
    """What :func:`resumed_layers` runs over: the target's layers (a :class:`~hf_specdec.stack.DecoderStack`) and its
    static cache, whose buffers a CUDA graph of it is recorded over (its :meth:`graph_key`)."""

    def __init__(self, stack, columns: cache_ops.StaticColumns):
        self.stack, self.columns = stack, columns

    def graph_key(self):
        return self.columns.graph_key()


class StepRule:
    """A rule of :func:`~hf_specdec.verify.accept` (``rule``: greedy or coupled) as its fixed-shape step region
    (``region``), called with the rule's own arguments: the padded tree's tensors are the session's (``tensors``: the
    layout, the packed tree, the ``[start, active...]`` scalars, the root positions), the rest passed on."""

    def __init__(self, region: FixedShapeRegion, rule):
        self.region, self.rule = region, rule
        self.tensors = None

    def __call__(self, tokens, parents, valid, *args):
        layout, packed, scalars, roots = self.tensors
        if self.rule is greedy_rule:
            _ancestors_, _depths_, logits, chain, count_drafts = args
            return self.region(layout, packed, logits, scalars, roots, chain, count_drafts)
        logits, noise, depth, warp, keep_scores, count_drafts = args[:6]
        return self.region(layout, packed, logits, noise, scalars, roots, depth, warp, keep_scores, count_drafts)


def _pad_nodes(input_ids, position_ids, attention_mask, pad: int):
    """Verification inputs with ``pad`` padding nodes after the ``q`` real ones: copies of the first (the root)."""
    return (torch.cat([input_ids, input_ids[:, :1].expand(-1, pad)], dim=1),
            torch.cat([position_ids, position_ids[:, :1].expand(-1, pad)], dim=1),
            _map_masks(attention_mask, lambda m: torch.cat([m, m[:, :, :1].expand(-1, -1, pad, -1)], dim=2)))


def _resized(inputs: dict, width: int) -> dict:
    """Verification inputs of another ``width`` nodes (for compiling that size): cut, or padded with copies of the
    first node as :meth:`CompiledSession.forward` pads."""
    def fit(t, dim):
        have = t.shape[dim]
        if width <= have:
            return dense(t.narrow(dim, 0, width))
        shape = list(t.shape)
        shape[dim] = width - have
        return torch.cat([t, t.narrow(dim, 0, 1).expand(shape)], dim=dim).contiguous()

    return dict(input_ids=fit(inputs["input_ids"], 1), position_ids=fit(inputs["position_ids"], 1),
                attention_mask=_map_masks(inputs["attention_mask"],
                                          lambda m: fit(m, 2) if isinstance(m, torch.Tensor) else m))


def _map_masks(mask, fn):
    """``fn`` applied to a 4D mask, or to each of a ``{layer type: mask}`` mapping."""
    return {k: fn(v) for k, v in mask.items()} if isinstance(mask, dict) else fn(mask)


class CompiledRunner(TargetRunner):
    """Runs the target's verification forwards through ``torch.compile`` at bucket sizes over a static cache
    (module docstring). Chosen by :func:`~hf_specdec.runner_choice.runner_for` with ``compile=True``; one per model, kept
    across calls with its compiled forward and measured costs."""

    name = "compiled"
    session_class = CompiledSession
    backend = "inductor"  # torch.compile's backend ("eager" in tests: dynamo's graphs and guards, no code generation)
    MIN_CACHE = 512  # static cache columns of the first call at least (prompt + new tokens + a tree, rounded up)
    CACHE_STEP = 256  # a longer call's cache length is rounded up to a multiple of this for the calls after it
    KEPT_CACHES = 4  # the static caches kept for later calls (one per batch size, the most recently used)

    def __init__(self, model):
        super().__init__(model)
        # CUDA graphs on a GPU (inductor's mode; another backend takes no mode)
        self.mode = "reduce-overhead" if device_type_of(model) == "cuda" and self.backend == "inductor" else None
        self.compiled = torch.compile(model.forward, backend=self.backend, mode=self.mode, dynamic=False)
        self.cache_length = self.MIN_CACHE
        self.caches: dict = {}  # (batch size, length, dtype, device) -> the static cache kept for later calls
        self.warm: set = set()  # input shapes (and hidden-state sets) compiled already
        self.layouts: dict = {}  # (batch size, width, device) -> the BufferedLayout kept for later calls
        self.compiled_fns: dict = {}  # a function of the step (or a proposer's propose) -> its compiled self
        # drafter -> (shape, the FixedDraftCache EAGLE-3 drafts over), kept for later calls, which replay its graphs
        self.draft_buffers = weakref.WeakKeyDictionary()

    def fused(self, fn, oblivious: bool = False):
        """``fn`` through ``torch.compile`` with dynamic shapes, made once per function: a function of the step's
        tensors (a tree's mask, the acceptance rule, the cache commit) as one compiled region, or a proposer class's
        ``propose`` (called with the instance first; dynamo splits it into regions where it reads the host or a clock).

        Dynamic shapes from the first compilation (``dynamic=True``: sizes symbolic, but for 0 and 1), as the drafters'
        own caches and the layout grow every step and the context a drafter is fed first is the prompt: a new prompt
        length is then no new graph. So inductor's default mode on a GPU too: CUDA graphs need fixed shapes, which
        :meth:`fixed` gives the proposers that draft at them.

        ``oblivious``: sizes reasoned about size-obliviously (:func:`_oblivious`), for the loop's own functions of the
        step's tensors, whose sizes of 1 (one node, one accepted column) are sizes like any other; not for model code,
        whose masks' broadcast dimensions of 1 must stay 1. Where the backend cannot compile a function so (inductor
        lowers some operations only with sizes it can compare), it is compiled again without, for good."""
        if fn not in self.compiled_fns:
            made = {"fn": torch.compile(fn, backend=self.backend, dynamic=True), "oblivious": oblivious}

            name = DYNAMIC + fn.__qualname__

            @functools.wraps(fn)
            def run(*args, **kwargs):
                with step_range(name):  # a profiler range while one runs (launch counts)
                    return call(*args, **kwargs)

            def call(*args, **kwargs):
                if made["oblivious"]:
                    try:
                        with _oblivious():
                            return made["fn"](*args, **kwargs)
                    except torch._dynamo.exc.BackendCompilerFailed as err:  # raised compiling: nothing ran yet
                        logger.debug(f"hf_specdec: {fn.__qualname__} compiled without size-oblivious sizes ({err})")
                        made.update(fn=torch.compile(fn, backend=self.backend, dynamic=True), oblivious=False)
                with _limits():
                    return made["fn"](*args, **kwargs)

            self.compiled_fns[fn] = run
        return self.compiled_fns[fn]

    def noise_maker(self):
        """Coupled sampling's uniforms as one region (:func:`hf_specdec.coupling.uniforms_of`, every position at
        once)."""
        return self.fused(uniforms_of)

    def fixed(self, fn):
        """``fn(owner, *tensors)`` as a :class:`~hf_specdec.graphs.FixedShapeRegion` (made once per function): compiled
        at fixed shapes, one CUDA graph per shape on a GPU. What a proposer drafting at fixed shapes runs its drafter
        through (:meth:`~hf_specdec.proposers.Proposer.draft_at_fixed_shapes`)."""
        key = (fn, "fixed")
        if key not in self.compiled_fns:
            self.compiled_fns[key] = FixedShapeRegion(fn, backend=self.backend, limits=_limits)
        return self.compiled_fns[key]

    def loop_cache(self, given, capacity: int, batch_size: int):
        """The static cache the call's loop runs with, kept for the calls after it: one per batch size (the
        :attr:`KEPT_CACHES` most recently used), emptied in place for each call (:func:`hf_specdec.cache.emptied`), so
        that its tensors keep their addresses and the graphs recorded over them (on a GPU the target's CUDA graphs,
        LayerSkip's drafting steps) replay in later calls instead of being recorded again. Its length is the longest
        any call needed (``capacity``, ``given``'s own if static and longer, at least :attr:`MIN_CACHE`), rounded up
        to a multiple of :attr:`CACHE_STEP`: the same shapes call after call."""
        cache_ops.check_editable(given)
        length = given.get_max_length() if isinstance(given, StaticCache) and given.layers else 0
        step = self.CACHE_STEP
        self.cache_length = max(self.cache_length, -(-max(capacity, length) // step) * step)
        key = (batch_size, self.cache_length, str(self.model.dtype), str(drafter_device(self.model)))
        cache = self.caches.pop(key, None)
        if cache is None:
            cache = cache_ops.static_cache(self.model, self.cache_length)
        self.caches[key] = cache_ops.emptied(cache)
        for stale in [k for k in self.caches if k[1] < self.cache_length] + list(self.caches)[:-self.KEPT_CACHES]:
            self.caches.pop(stale, None)
        return cache

    def hand_out(self, cache):
        """A copy of the loop's cache for the caller (the runner writes into its own in the next call)."""
        return cache_ops.copied(self.model, cache) if any(cache is kept for kept in self.caches.values()) else cache

    def exact_bits(self, rounding: str | None = None) -> bool:
        """Not probed: a compiled forward rounds its own way (fused kernels), so in half precision a verification
        does not reproduce the bits of the eager one-token steps (float32: the output is identical anyway)."""
        key = (device_type_of(self.model), str(self.model.dtype), rounding or "auto")
        if key not in self.bits:
            self.bits[key] = False
            if self.model.dtype in HALF:
                logger.warning(f"hf_specdec: compile=True in {key[1].removeprefix('torch.')}: the compiled "
                               "verification rounds as compiled kernels do, so outputs equal the target's own eager "
                               "decoding in this dtype only up to rounding. float32 is always identical.")
        return self.bits[key]
