"""How the loop runs the target: the one seam between the decoding loop and the model.

The loop never calls the target itself. Per ``generate`` call it opens a :class:`TargetSession` from a
:class:`TargetRunner` and goes through it for the prefill and every verification of a draft tree; the
session also brackets every proposal (:meth:`TargetSession.drafting`). A runner lives across calls
(one per model and kind, :func:`kept_runner`): it keeps the measured forward costs per batch size, and a backend may
keep its own state there (the CPU kernel runner's timing cache).

Backend speed tricks are runners of their own: :class:`hf_specdec.kernels.CpuKernelRunner` (small-row products and
grouped-query attention without copying the cache, for CPU targets) is the one there is today. The entry points
choose the runner once per call (:func:`hf_specdec.runner_choice.runner_for`, the one module that knows the
implementations) and hand it down; the loop and the proposers know only this interface.

Example::

    runner = runner_for(model)                      # (runner_choice) CpuKernelRunner on a CPU, TargetRunner elsewhere
    with runner.session(cache, hidden_states=[2, 15, 27]) as target:
        first_logits, hidden = target.prefill(input_ids, attention_mask, positions)
        ...
        logits, hidden = target.verify(state, tree)  # [B, N, V] fp32: one forward over every tree node
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref

import torch

from . import cache as cache_ops
from ._transformers import supports_logits_to_keep
from .attention import verifiable_attention
from .costs import _CPU_OWN_PRIOR, _GPU_PRIOR, ForwardCostModel
from .dtypes import HALF
from .placement import drafter_device
from .syncs import to_device
from .tree import build_attention_mask

logger = logging.getLogger("hf_specdec")
KERNELS_ENV = "HF_SPECDEC_VERIFY_KERNELS"  # "0": CPU targets run with the model's own kernels (TargetRunner)


class TargetSession:
    """One ``generate`` call's access to the target model (returned by :meth:`TargetRunner.session`).

    Args:
        runner: the runner that opened it.
        cache: the target's KV cache for the call (empty, or holding the columns a continued conversation kept;
            the loop edits it between forwards).
        hidden_states: ``hidden_states`` indices every forward must return (the proposer's), or ``None``.
        drafters: modules only drafting runs (:meth:`hf_specdec.proposers.Proposer.draft_modules`); a backend may
            give them faster kernels for the call.
        rounding: how a half-precision verification rounds (the ``rounding`` option: ``"auto"``, ``"exact"``,
            ``"fast"``; ``None``: ``"auto"``); a backend that computes as the model does ignores it.
    """

    def __init__(self, runner: "TargetRunner", cache, hidden_states: list[int] | None = None, drafters=(),
                 rounding: str | None = None):
        self.runner = runner
        self.rounding = rounding or "auto"
        self.model = runner.model
        self.cache = cache
        self.drafters = [d for d in drafters if isinstance(d, torch.nn.Module)]
        self.static = cache_ops.is_static(cache)
        self.text_config = self.model.config.get_text_config()
        self.dtype = self.model.dtype
        self.wants_hidden = bool(hidden_states)
        self.forward_kwargs = {"output_hidden_states": list(hidden_states)} if hidden_states else {}
        self._stack = None  # a DecoderStack, for trees that resume a forward (LayerSkip)

    # ---- backend hooks (the plain runner: the model's own code path)
    def __enter__(self) -> "TargetSession":
        # an attention that sees padding only verifies through sdpa for the call; one that cannot is refused here
        self._attention = verifiable_attention(self.model, *self.drafters)
        self._attention.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._attention.__exit__(*exc)

    def drafting(self) -> contextlib.AbstractContextManager:
        """Around every proposal: work inside is drafting cost."""
        return contextlib.nullcontext()

    def keep_columns(self, start: int, index: torch.LongTensor | None, width: int) -> None:
        """After a verification: keep the cache's columns ``start + index[b, j]`` at ``start + j`` (``index [B,
        width]``; ``None``: columns ``start..start + width - 1`` stay where they are) and drop the rest."""
        if index is None:
            cache_ops.crop(self.cache, start + width)
        else:
            cache_ops.keep_columns(self.cache, start, index)

    def hold(self, layout, proposer):
        """The cache layout the loop keeps after the prefill, for ``proposer``'s trees (``layout`` itself; the compiled
        runner's fixed-shape step holds it in buffers of the static cache's width)."""
        return layout

    def rule_inputs(self, tree, logits, on_device: bool):
        """What the acceptance rule runs over after :meth:`verify`: ``(tree, logits, fused)``, the verified tree, its
        logits and how the step's functions of tensors run (:meth:`TargetRunner.fused`). ``on_device``: the rule runs
        on the device (greedy without processors, or coupled sampling with warpers only)."""
        return tree, logits, self.runner.fused

    def keep_accepted(self, state, tree, result, past: int) -> None:
        """Keep the accepted paths' columns of the ``N`` verified ones (after ``past``) in the cache and the layout."""
        kept = [len(p) for p in result.paths]
        width = max(kept)
        if result.is_prefix_paths():
            path_nodes = None
        elif result.path_index is not None:  # the rule ran on the device: its paths are there already
            path_nodes = result.path_index[:, :width]
        else:
            path_nodes = to_device([p + [0] * (width - len(p)) for p in result.paths], state.device)  # [B, W]
        keep = to_device([[j < k for j in range(width)] for k in kept], state.device, dtype=torch.bool)
        self.keep_columns(past, path_nodes, width)
        layout = state.layout
        columns = self.runner.fused(cache_ops.path_columns, oblivious=True)(
            layout.valid, layout.positions, layout.tokens, keep, state.root_positions, tree.depths, tree.tokens,
            path_nodes)
        layout.grow(*columns, counts=kept)

    def propose(self, proposer, state):
        """``proposer``'s drafts for the step (:meth:`hf_specdec.proposers.Proposer.propose`; a backend may run the
        drafting its own way)."""
        return proposer.propose(state)

    def forward_context(self, tokens_per_row: int) -> contextlib.AbstractContextManager:
        """Around every target forward that scores ``tokens_per_row`` new tokens per row after the prefill."""
        return contextlib.nullcontext()

    # ---- what the loop asks of the target
    @property
    def kv_width(self) -> int | None:
        """Key length of the attention masks: a static cache's full length (``None``: cached + new columns)."""
        return self.cache.get_max_length() if self.static else None

    def forward(self, input_ids, attention_mask, position_ids, with_hidden: bool = True):
        """One target forward over ``input_ids [B, q]`` after the cached columns (``q >= 1``)."""
        kwargs = self.forward_kwargs if with_hidden else {}
        with self.forward_context(input_ids.shape[1]):
            return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              cache=self.cache, use_cache=True, return_dict=True, **kwargs)

    def prefill(self, input_ids: torch.LongTensor, attention_mask: torch.LongTensor, positions: torch.LongTensor,
                padded: bool | None = None, past: int = 0):
        """The prompt forward, fed as plain ``generate()`` feeds it (``padded``: whether any row has padding, as
        the loop knows it; ``None``: read from the mask). ``past``: the cache already holds the first ``past`` columns
        (a conversation continued from its cache): only the input after them is fed, as ``generate()`` feeds it.
        Returns ``(logits [B, V] fp32 of the last position, hidden_states of the fed positions or None)``."""
        bsz, length = input_ids.shape
        kwargs = dict(self.forward_kwargs)
        if supports_logits_to_keep(self.model):
            kwargs["logits_to_keep"] = 1
        new_ids, new_positions = input_ids[:, past:], positions[:, past:]
        if self.static:
            n = length - past
            valid = attention_mask.bool()
            causal = torch.ones(n, n, dtype=torch.bool, device=input_ids.device).tril()[None]
            mask = build_attention_mask(self.text_config, valid[:, :past], positions[:, :past], new_positions,
                                        causal & valid[:, None, past:], self.dtype, kv_width=self.kv_width)
        else:
            if padded is None:
                padded = not bool((attention_mask == 1).all())
            mask = attention_mask if padded else None
        out = self.model(input_ids=new_ids, attention_mask=mask, position_ids=new_positions, cache=self.cache,
                         use_cache=True, return_dict=True, **kwargs)
        return out.logits[:, -1].to(copy=True, dtype=torch.float32), self._hidden(out)

    def verify(self, state, tree):
        """One forward over every node of ``tree`` (``DraftTree``, ``N`` nodes per row) at positions
        ``root_position + depth``, with the tree mask over the cache layout. Returns ``(logits [B, N, V] fp32,
        hidden_states or None)``; the cache then holds the ``N`` new columns after ``state.layout.length``."""
        positions, mask = self._tree_inputs(state, tree)
        if tree.resume is not None:
            return self._resume(tree, mask, positions)
        out = self.forward(tree.tokens, mask, positions)
        return out.logits.float(), self._hidden(out)

    def _tree_inputs(self, state, tree):
        """The tree's positions ``[B, N]`` (``root_position + depth``) and its attention mask over the cache layout."""
        positions = state.root_positions[:, None] + tree.depths  # [B, N]
        mask = build_attention_mask(self.text_config, state.layout.valid, state.layout.positions, positions,
                                    tree.ancestors, self.dtype, kv_width=self.kv_width)
        return positions, mask

    def _resume(self, tree, mask, positions):
        """:meth:`verify` for a tree whose first nodes already went through layers ``0..E-1`` (``tree.resume``):
        those layers run for the other nodes only, layers ``E..`` for every node (the same arithmetic as the full
        forward, in two pieces)."""
        from .stack import DecoderStack

        stack, pieces = self._resumed_stack(tree.resume.layer)
        with self.forward_context(tree.num_nodes):
            # one compiled region under compile=True (the runner's fused; as it is for an eager runner)
            logits, captured = self.runner.fused(DecoderStack.resume)(
                stack, tree.tokens, tree.resume.hidden, mask, positions, self.cache, pieces)
        return logits, self._resumed_hidden(captured)

    def _resumed_stack(self, exit_layer: int):
        """``(stack, pieces)`` for a verification resumed at ``exit_layer``: the target's
        :class:`~hf_specdec.stack.DecoderStack` (made once per call) and the layers ``exit_layer..`` cut where the
        call keeps hidden states."""
        from .stack import DecoderStack

        if self._stack is None:
            self._stack = DecoderStack(self.model)
        wanted = self.forward_kwargs.get("output_hidden_states") or []
        if any(i < exit_layer for i in wanted):
            raise ValueError(f"A resumed verification has no hidden states before layer {exit_layer}; asked for "
                             f"{sorted(wanted)}.")
        return self._stack, _pieces(exit_layer, self._stack.num_layers, wanted)

    def _resumed_hidden(self, captured: dict):
        """The hidden states a resumed verification returns, of the layers ``captured`` holds (``None``: not asked)."""
        if not self.wants_hidden:
            return None
        wanted = self.forward_kwargs.get("output_hidden_states") or []
        return tuple(captured.get(i) if i in wanted else None for i in range(self._stack.num_layers + 1))

    def _hidden(self, out):
        return getattr(out, "hidden_states", None) if self.wants_hidden else None


class TargetRunner:
    """Runs a target model for the decoding loop with the model's own code path.

    Kept across ``generate`` calls (:func:`kept_runner`): it holds the measured forward costs of its model, one
    :class:`~hf_specdec.costs.ForwardCostModel` per device type, dtype and batch size. A backend subclass sets
    :attr:`session_class` (and :attr:`cost_prior`) and keeps its own state on the instance.
    """

    name = "plain"
    session_class = TargetSession

    def __init__(self, model):
        try:  # kept per model (PER_MODEL, weak keys): a strong reference here would keep every model run alive
            self._model = weakref.ref(model)
        except TypeError:  # not weak-referenceable: such a model gets a fresh runner per call anyway
            self._model = lambda: model
        self.costs: dict[tuple[str, str, int, str], ForwardCostModel] = {}
        self.bits: dict[tuple[str, str, str], bool] = {}  # exact_bits verdicts (device type, dtype, rounding)

    @property
    def model(self):
        """The runner's model (held weakly: the runner is dropped with it)."""
        return self._model()

    @classmethod
    def applies_to(cls, model) -> bool:
        """Whether this runner can run ``model`` (the plain runner runs any model)."""
        return True

    def fused(self, fn, oblivious: bool = False):
        """``fn`` (a function of tensors of the loop's step) as this runner runs it: itself here; compiled into one
        region by the compiled runner (:meth:`hf_specdec.compiled.CompiledRunner.fused`, which reads ``oblivious``)."""
        return fn

    def noise_maker(self):
        """How coupled sampling makes its noise (:func:`hf_specdec.coupling.gumbel`'s ``make``): ``None``, its own
        way here; one compiled region for the compiled runner."""
        return None

    def fixed(self, fn):
        """``fn(owner, *tensors)`` at fixed shapes as this runner runs it: itself here; compiled per shape, and a CUDA
        graph per shape on a GPU, by the compiled runner (:class:`hf_specdec.graphs.FixedShapeRegion`)."""
        return fn

    @property
    def cost_prior(self) -> dict[int, float]:
        """Relative forward costs assumed before any is measured."""
        return _CPU_OWN_PRIOR if device_type_of(self.model) == "cpu" else _GPU_PRIOR

    def cost_model(self, batch_size: int, rounding: str | None = None) -> ForwardCostModel:
        # a model cast in place: new costs; in half precision each rounding has its own (``exact`` may cost more)
        rounding = (rounding or "auto") if self.model.dtype in HALF else ""
        key = (device_type_of(self.model), str(self.model.dtype), batch_size, rounding)
        if key not in self.costs:
            self.costs[key] = ForwardCostModel(key[0], prior=self.cost_prior)
        return self.costs[key]

    def session(self, cache, hidden_states: list[int] | None = None, drafters=(),
                rounding: str | None = None) -> TargetSession:
        """The target for one ``generate`` call (a context manager)."""
        return self.session_class(self, cache, hidden_states, drafters, rounding)

    def loop_cache(self, given, capacity: int, batch_size: int):
        """The empty cache a call's loop runs with, for ``batch_size`` rows and at least ``capacity`` columns (the
        loop copies into it what the caller's cache ``given`` holds): a fresh one of ``given``'s kind
        (:func:`hf_specdec.cache.new_cache_like`); a runner with static shapes keeps a static one for later calls
        (:class:`~hf_specdec.compiled.CompiledRunner`)."""
        return cache_ops.new_cache_like(self.model, given, capacity)

    def hand_out(self, cache):
        """The loop's ``cache`` at the call's end as the caller may keep it (``out.cache``): itself, or a copy where
        the runner keeps it for later calls."""
        return cache

    def rounding_for(self, rounding: str | None) -> str | None:
        """The rounding a call runs with: ``"auto"`` in half precision where the probe says one row's verification
        does not get the bits of its one-token steps here runs as ``"fast"`` (the packed attention: nothing
        bit-identical to gain by paying for one query per token); any other value as given."""
        if self.model.dtype not in HALF or rounding not in (None, "auto"):
            return rounding
        return rounding if self.exact_bits("auto") else "fast"

    def exact_bits(self, rounding: str | None = None) -> bool:
        """Whether one row's verification through this runner gives every draft-tree node the bits of plain
        decoding's one-token step (:func:`hf_specdec.exactness.probe_exact_bits`), probed once per dtype, device and
        ``rounding``; a negative verdict is logged once."""
        from .exactness import probe_exact_bits

        key = (device_type_of(self.model), str(self.model.dtype), rounding or "auto")
        if key in self.bits:
            return self.bits[key]
        with call_lock(self.model):  # the probe runs the model with the kernels installed, as a call does
            if key in self.bits:
                return self.bits[key]
            self.bits[key] = probe_exact_bits(self, rounding)
            if not self.bits[key]:
                logger.warning(
                    f"hf_specdec: in {key[1].removeprefix('torch.')} on this {key[0]}, a verification forward does "
                    "not round as the model's own one-token steps (probed), so outputs equal the target's own "
                    "decoding in this dtype only up to rounding" + (
                        "; rounding='exact' makes them bit-identical, at a cost (docs/half-precision.md)"
                        if key[2] == "auto" and self.name == "cpu_kernels" else "") + ". float32 is always identical.")
        return self.bits[key]


def _pieces(start: int, stop: int, cuts) -> list[tuple[int, int]]:
    """``[start, stop)`` split at the layer outputs in ``cuts`` (hidden-state indices) inside it."""
    bounds = sorted({start, stop} | {c for c in cuts if start < c < stop})
    return list(zip(bounds, bounds[1:]))


def device_type_of(model) -> str:
    """Where ``model`` computes its logits (``meta`` never: an Accelerate-offloaded model computes on its hooks'
    execution device)."""
    return drafter_device(model).type


class PerModel:
    """What belongs to a model across ``generate`` calls, dropped with it (weak references): its kept runners (one
    per runner class) and the lock a call holds on it. One instance (:data:`PER_MODEL`) serves :func:`call_lock` and
    :func:`kept_runner`."""

    def __init__(self):
        self.runners: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {runner name: runner}
        self.call_locks: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model or proposer -> its lock
        self.lock = threading.Lock()  # around every look-up-or-fill of both (once per call, never per step)

    def call_lock(self, obj) -> threading.RLock:
        with self.lock:
            try:
                lock = self.call_locks.get(obj)
                if lock is None:
                    lock = self.call_locks[obj] = threading.RLock()
            except TypeError:
                return threading.RLock()
        return lock

    def kept_runner(self, model, cls: type) -> "TargetRunner":
        with self.lock:  # WeakKeyDictionary.setdefault and the check-then-fill are not atomic: one runner per model
            try:
                per_model = self.runners.setdefault(model, {})
            except TypeError:  # not weak-referenceable: a fresh runner per call
                return cls(model)
            if cls.name not in per_model:
                per_model[cls.name] = cls(model)
            return per_model[cls.name]

    def forget(self, model) -> None:
        """Drop ``model``'s kept runners and what they measured: its next call starts as a process's first (a
        benchmark of first calls; a model whose hardware changed under it)."""
        with self.lock:
            try:
                self.runners.pop(model, None)
            except TypeError:  # not weak-referenceable: nothing was kept
                pass


PER_MODEL = PerModel()


def call_lock(obj) -> threading.RLock:
    """The lock a decoding call holds on its target model (and its proposer) from start to end
    (:func:`hf_specdec.engine.speculative_decode`): two calls on the same model in two threads run one after the
    other, each with its own output, because a call edits what belongs to the model for its duration (the kernels it
    installs, the attention it switches, the runner's measured costs). Re-entrant: a call made inside a call of the
    same thread (a drafter that decodes with the loop itself) does not wait for itself. An object that cannot be
    weakly referenced gets a fresh lock (nothing to share)."""
    return PER_MODEL.call_lock(obj)


def kept_runner(model, cls: type) -> TargetRunner:
    """The one runner of class ``cls`` kept for ``model`` (made on first use), so later calls reuse what earlier
    ones measured (and compiled); a model that cannot be weakly referenced gets a fresh runner per call. Which class a
    call runs is chosen above this module (:func:`hf_specdec.runner_choice.runner_for`)."""
    return PER_MODEL.kept_runner(model, cls)
