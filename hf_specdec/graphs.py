"""Fixed-shape regions of the step: compiled once per shape, and on a GPU replayed as one CUDA graph each.

``compile=True`` runs the target's verification at bucket sizes (:mod:`hf_specdec.compiled`). A proposer that drafts at
fixed shapes (:meth:`~hf_specdec.proposers.Proposer.draft_at_fixed_shapes`: EAGLE-3, MTP, DFlash and draft models over a
fixed drafter cache, Medusa's heads, LayerSkip's steps over the target's cache) hands its forwards to the runner as
:class:`FixedShapeRegion` s, functions of tensors whose every shape is fixed by a few host integers (the batch size, a
bucket, the tree's depth):

* the function goes through ``torch.compile(dynamic=False, fullgraph=True)``: one graph per input shape, no graph
  break (a host read or an unsupported call inside it is an error at the first call, not a silent slowdown);
* on a GPU each shape is captured as a CUDA graph by hand, as serving stacks do (SGLang's draft runners, vLLM's
  ``CUDAGraphWrapper``): two warm-up runs on a side stream (the second
  finds the code compiled), then ``torch.cuda.graph`` into one memory pool shared by every region of the process,
  keyed by the inputs' shapes, dtypes and the non-tensor arguments. A call copies its tensors into the graph's input
  buffers, replays and clones the outputs (the next replay overwrites them): the host launches a few copies and one
  graph for the whole region, however many kernels it holds (its input copies aside);
* on a CPU the compiled function is called (inductor's fused kernels; no graphs).

The function must be idempotent in what it writes outside its outputs: a region that writes into persistent buffers
(a static drafter cache) writes the same values for the same inputs, so that its warm-up runs change nothing. Those
buffers are reached through the first argument (the owner, e.g. the proposer), never copied: their addresses are
baked into the graph, and the key holds the owner's ``graph_key()`` (its buffers and modules themselves, not the
owner: a later call's new proposer over the same buffers replays the same graphs), so new buffers are a new graph,
and buffers live as long as graphs recorded over them. ``compiles`` counts the graphs compiled, ``captures`` the CUDA
graphs recorded, ``calls`` the calls (tests and benchmarks read them).
"""

from __future__ import annotations

import collections
import contextlib

import torch
from torch.utils import _pytree as pytree

REPLAY = "hf_specdec.graph_replay"  # the profiler range around a replay
_POOL: dict = {}  # device index -> the CUDA graph memory pool every region of the process records into


def _pool(device: torch.device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _POOL:
        _POOL[index] = torch.cuda.graph_pool_handle()
    return _POOL[index]


@contextlib.contextmanager
def counting_captures():
    """Count the CUDA graphs recorded inside the block (``with counting_captures() as recorded: ...; recorded[0]``):
    every ``torch.cuda.CUDAGraph`` capture, torch.compile's CUDA graph trees' (the target's verification under
    ``mode="reduce-overhead"``, which records a graph again when a static input, such as a new cache's tensors, has
    another address) and this module's. Always 0 without CUDA."""
    recorded = [0]
    graph_class = getattr(torch.cuda, "CUDAGraph", None)
    original = getattr(graph_class, "capture_begin", None)
    if original is None:
        yield recorded
        return

    def counted(self, *args, **kwargs):
        recorded[0] += 1
        return original(self, *args, **kwargs)

    graph_class.capture_begin = counted
    try:
        yield recorded
    finally:
        graph_class.capture_begin = original


def dense(t):
    """``t`` with the strides of a fresh contiguous tensor (a copy only where they differ). A compiled graph is
    specialised to strides, size-1 dimensions' included, which ``contiguous()`` leaves as they are: a ``[1, n]`` slice
    of a ``[1, T]`` tensor would be a new graph for every ``T``."""
    if not isinstance(t, torch.Tensor):
        return t
    stride, step = [], 1
    for size in reversed(t.shape):
        stride.append(step)
        step *= size
    return t if t.stride() == tuple(reversed(stride)) else t.clone(memory_format=torch.contiguous_format)


def _describe(leaf):
    """What a graph is recorded for: a tensor's shape, dtype and device; another value by what it holds (a call's
    logits warpers: their classes and settings, which the compiled code reads as constants)."""
    if isinstance(leaf, torch.Tensor):
        return ("tensor", tuple(leaf.shape), leaf.dtype, leaf.device)
    return ("value", value_key(leaf))


def value_key(obj):
    """``obj`` as a graph's key holds it: a number, string or ``None`` as itself, a sequence item by item, an object
    by its class and plain settings (a logits warper), anything else by identity."""
    if isinstance(obj, (int, float, bool, str, type(None))):
        return obj
    if isinstance(obj, (list, tuple)):
        return tuple(value_key(x) for x in obj)
    if hasattr(obj, "__dict__"):
        return type(obj).__qualname__, tuple(sorted((k, v) for k, v in vars(obj).items()
                                                     if isinstance(v, (int, float, bool, str, type(None)))))
    return id(obj)


class Graph:
    """``run()`` captured as one CUDA graph: two warm-up runs on a side stream (the first compiles), then
    ``torch.cuda.graph`` into the process's shared pool; :meth:`replay` runs it again and returns its output tensors
    (the same ones every time, overwritten by each replay)."""

    def __init__(self, run, device):
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                run()
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=_pool(device)):
            self.out = run()

    def replay(self):
        self.graph.replay()
        return self.out


class FixedShapeRegion:
    """``fn(owner, *args)`` compiled at fixed shapes, replayed as one CUDA graph per shape on a GPU (module docstring).

    ``backend``: torch.compile's (``"eager"`` in tests: dynamo's graphs and guards without code generation);
    ``limits``: a context manager around every compiled call (the runner's recompile limits)."""

    OWNERS = 4  # the buffer sets (owners' graph_key()) whose graphs are kept, the most recently used
    GRAPHED = ("cuda",)  # device types whose regions are captured as graphs
    GRAPH = Graph  # how a shape is captured

    def __init__(self, fn, backend="inductor", limits=None):
        self.fn = fn
        inner = torch._dynamo.lookup_backend(backend)

        def counted(gm, example_inputs):
            self.compiles += 1
            return inner(gm, example_inputs)

        self.compiled = torch.compile(fn, backend=counted, dynamic=False, fullgraph=True)
        self.limits = limits
        # owner's graph_key() -> ({inputs' key -> (graph, input buffers)}, the keys :meth:`warm` ran), the most
        # recently used OWNERS of them (a key holds the buffers a graph was recorded over: they live as long as it)
        self.owners = collections.OrderedDict()
        self.compiles = 0  # graphs compiled (one per shape; a host read or graph break inside is an error instead)
        self.captures = 0  # CUDA graphs recorded
        self.calls = 0

    def __call__(self, owner, *args):
        self.calls += 1
        leaves, spec = pytree.tree_flatten(args)
        device = next((t.device for t in leaves if isinstance(t, torch.Tensor)), None)
        if device is None or device.type not in self.GRAPHED:  # dense inputs: a graph is specialised to strides too
            return self._run(owner, *pytree.tree_map(dense, args))
        owned = self._owned(owner)[0]
        key = (str(spec), tuple(_describe(leaf) for leaf in leaves))
        entry = owned.get(key)
        if entry is None:
            entry = owned[key] = self._capture(owner, leaves, spec, device)
        graph, buffers = entry
        for buf, leaf in zip(buffers, leaves):
            if isinstance(buf, torch.Tensor):
                buf.copy_(leaf, non_blocking=True)
        with torch.profiler.record_function(REPLAY):  # one launch for LaunchCounter (hf_specdec.launches)
            out = graph.replay()
        # the outputs live in the shared pool: copied out before another graph's replay may write there
        return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out)

    def warm(self, owner, key, sizes, run) -> None:
        """``run(size)`` for each of ``sizes`` the first time ``owner``'s buffers (its ``graph_key()``) meet ``key``:
        every size a call may ask for compiled (on a GPU captured) before decoding needs it, so that no step and no
        later call compiles."""
        warmed = self._owned(owner)[1]
        if key not in warmed:
            warmed.add(key)
            for size in sizes:
                run(size)

    def warmed(self, owner, key) -> bool:
        """Whether :meth:`warm` ran ``key`` for ``owner``'s buffers (and they are still kept)."""
        return key in self._owned(owner)[1]

    def _owned(self, owner):
        """``owner``'s record in :attr:`owners` (made on first use); the least recently used beyond
        :attr:`OWNERS` let go (buffers of earlier calls' shapes, another batch size)."""
        key = owner.graph_key()
        record = self.owners.setdefault(key, ({}, set()))
        self.owners.move_to_end(key)
        while len(self.owners) > self.OWNERS:
            self.owners.popitem(last=False)
        return record

    def _run(self, owner, *args):
        if self.limits is None:
            return self.compiled(owner, *args)
        with self.limits():
            return self.compiled(owner, *args)

    def _capture(self, owner, leaves, spec, device):
        """The region's graph over input buffers of its own (copies of this call's inputs)."""
        buffers = [leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        args = pytree.tree_unflatten(buffers, spec)
        graph = self.GRAPH(lambda: self._run(owner, *args), device)
        self.captures += 1
        return graph, buffers
