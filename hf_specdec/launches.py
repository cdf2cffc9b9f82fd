"""Counting the kernels the host starts per decoding step: on a GPU each one is a launch the host pays for.

A step of the decoding loop runs a few hundred to a few thousand torch operations; on a GPU each one that does work
is a kernel the host launches (5-40 µs of a slow host's time each), unless it runs inside a captured CUDA graph, whose
replay is one launch for all of them. Which operations a step runs is the same on a CPU, so counting them here is a
deterministic proxy for the launches a GPU would pay, as :mod:`hf_specdec.syncs` is for host reads.

The count, over the operations torch's profiler records inside the loop's steps (each step is a
``record_function("hf_specdec.step")`` range while a profiler runs, :func:`step_range`):

* a compiled region (``torch.compile``'s ``Torch-Compiled Region``; on a GPU under ``mode="reduce-overhead"`` one
  CUDA-graph replay) counts **one**, whatever runs inside it. Those of a region compiled with dynamic shapes (the
  runner's ``fused``, inside a :data:`DYNAMIC` range) are also counted apart, per function
  (:attr:`LaunchCounter.dynamic`): on a GPU such a region is no graph but inductor's kernels, a launch each, so the
  count of one is a floor there;
* outside compiled regions, each ``aten::`` operation that does work counts one: the lowest such operation in the
  profiler's tree (an operation calling others counts through them: ``aten::linear`` is its ``aten::mm``), never a
  view or an allocation (``aten::view``, ``aten::slice``, ``aten::empty``, ... start no kernel). A host read
  (``aten::_local_scalar_dense``) counts one: a copy to the host.

Example::

    from hf_specdec.launches import LaunchCounter

    with LaunchCounter() as launches:
        model.generate(input_ids, max_new_tokens=32, custom_generate=hf_specdec.decoding_method("prompt_lookup"))
    print(launches.steps, launches.per_step(), launches.by_name.most_common(5))
"""

from __future__ import annotations

import collections
import contextlib

import torch
from torch.profiler import ProfilerActivity, profile, record_function

STEP = "hf_specdec.step"  # the name of a decoding step's profiler range
DYNAMIC = "hf_specdec.dynamic:"  # the profiler range around a call of a region compiled with dynamic shapes (+ name)
# profiler ranges of compiled code: one launch each (a graph replay on a GPU; hf_specdec.graphs' replays by hand)
COMPILED = ("Torch-Compiled Region", "hf_specdec.graph_replay")
# operations that start no kernel: views, allocations, metadata, no-op conversions (their work, if any, is a child)
NO_KERNEL = frozenset(f"aten::{name}" for name in (
    "view", "_unsafe_view", "reshape", "_reshape_alias", "view_as", "slice", "select", "narrow", "expand",
    "expand_as", "as_strided", "t", "transpose", "permute", "unsqueeze", "squeeze", "detach", "detach_", "alias",
    "lift_fresh", "unbind", "split", "split_with_sizes", "chunk", "unfold", "diagonal", "flatten", "unflatten",
    "movedim", "numpy_T", "real", "imag", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
    "resize_", "set_", "size", "stride", "sym_size", "sym_stride", "is_nonzero", "result_type", "to", "type_as",
    "contiguous", "broadcast_tensors", "meshgrid", "align_to", "item", "is_same_size", "dim", "numel",
    "_has_compatible_shallow_copy_type", "record_stream", "pin_memory", "_pin_memory", "is_pinned", "lift",
    "_nested_tensor_from_mask_left_aligned", "scalar_tensor", "resolve_conj", "resolve_neg", "conj",
))


def step_range(name: str = STEP):
    """The context of one decoding step: a ``record_function`` range named :data:`STEP` (or ``name``) while a
    profiler runs, nothing otherwise (the loop pays no profiler call when none is active)."""
    if torch.autograd._profiler_enabled():
        return record_function(name)
    return contextlib.nullcontext()


class LaunchCounter:
    """Counts the kernels the host starts in the decoding steps run while it is active (see the module docstring).

    Attributes (set when the ``with`` block ends):
        steps: the decoding steps seen (one target forward each).
        launches: the kernels counted inside them.
        by_name: a :class:`collections.Counter` of ``launches`` per operation (``"compiled region"`` for a compiled
            region).
        outside: with ``steps == 0`` (code without the loop's step ranges, e.g. plain ``generate()``), the count over
            everything that ran; else the count outside the steps (the prefill, the call's set-up).
        dynamic: a :class:`collections.Counter` of the compiled regions inside the steps that were compiled with
            dynamic shapes, per function (no CUDA graph on a GPU: see the module docstring).
    """

    def __init__(self):
        self.steps = 0
        self.launches = 0
        self.outside = 0
        self.by_name: collections.Counter = collections.Counter()
        self.dynamic: collections.Counter = collections.Counter()
        self._profile = None

    def __enter__(self) -> LaunchCounter:
        self._profile = profile(activities=[ProfilerActivity.CPU])
        self._profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._profile.__exit__(*exc)
        events = self._profile.events()
        self._profile = None
        for event in events:
            if event.cpu_parent is None:
                self._visit(event, in_step=False)

    def per_step(self) -> float:
        """Launches per step (``0.0`` without steps)."""
        return self.launches / self.steps if self.steps else 0.0

    def _visit(self, event, in_step: bool, dynamic: str | None = None) -> int:
        """Counts ``event``'s subtree; returns how many it counted. An operation counts itself only when nothing
        below it counted (``aten::linear`` is its ``aten::mm``; ``aten::mm`` counts although its children, the
        ``aten::resolve_conj`` calls, start no kernel)."""
        name = event.name
        if name == STEP:
            self.steps += 1
            in_step = True
        if name.startswith(DYNAMIC):
            dynamic = name[len(DYNAMIC):]
        if name.startswith(COMPILED):
            self._count("compiled region", in_step)
            if in_step and dynamic is not None:
                self.dynamic[dynamic] += 1
            return 1  # everything inside is the region's
        below = sum(self._visit(child, in_step, dynamic) for child in event.cpu_children)
        if below == 0 and name.startswith("aten::") and name not in NO_KERNEL:
            self._count(name, in_step)
            return 1
        return below

    def _count(self, name: str, in_step: bool) -> None:
        if in_step:
            self.launches += 1
            self.by_name[name] += 1
        else:
            self.outside += 1
