"""Timing a region of device work without waiting for the device.

On a GPU, ``time.perf_counter()`` around a forward measures how long the host took to queue its kernels, and a
``torch.cuda.synchronize()`` to measure more stalls the loop every step. :class:`StepTimer` records a pair of CUDA
events around the region instead and reads their elapsed time later, once the end event has completed
(``event.query()``, which never blocks): a step's time arrives a step (or a few) late, which is all the forward-cost
model (:class:`~hf_specdec.costs.ForwardCostModel`) needs. On a CPU the work is done when the call returns:
``time.perf_counter`` gives the time at once.

Example (the decoding loop's verification, feeding the cost model)::

    timer = StepTimer(device)
    for step in steps:
        timer.start()
        logits, hidden = target.verify(state, tree)
        timer.stop(tree.num_nodes)                   # tag: the number of tree nodes
        for q, seconds in timer.ready():             # regions whose end has completed (CPU: this one, at once)
            cost_model.record(q, seconds)
    for q, seconds in timer.flush():                 # end of the call: waits once for what is still queued
        cost_model.record(q, seconds)
"""

from __future__ import annotations

import collections
import functools
import time
from typing import Any, Callable

import torch


class StepTimer:
    """Times regions of work on ``device``: :meth:`start` before a region, :meth:`stop` after it, :meth:`ready` for
    the ``(tag, seconds)`` of every region measured since, in the order they ran.

    Args:
        device: where the timed work runs (``torch.device`` or its name). ``cuda``: a pair of
            ``torch.cuda.Event(enable_timing=True)`` per region, read only once the end event has completed; any
            other device: ``time.perf_counter``, results at once.
        event_factory: ``() -> event`` with ``record()``, ``query() -> bool``, ``elapsed_time(end) -> ms`` and
            ``synchronize()`` (``torch.cuda.Event``'s interface), used instead of CUDA events on any device; for tests
            (a fake clock) and other event-based backends.
        max_pending: regions kept waiting for their end event; past it the oldest is dropped (a caller that never
            reads :meth:`ready` must not hold events forever).
    """

    def __init__(self, device: torch.device | str = "cpu", event_factory: Callable[[], Any] | None = None,
                 max_pending: int = 256):
        device = torch.device(device)
        if event_factory is None and device.type == "cuda":
            event_factory = functools.partial(torch.cuda.Event, enable_timing=True)
        self.event_factory = event_factory
        self.pending: collections.deque = collections.deque(maxlen=max_pending)  # (tag, start event, end event)
        self.done: list[tuple[Any, float]] = []  # measured on the host, not handed back yet
        self._start = None  # the open region's start event or perf_counter reading

    @property
    def uses_events(self) -> bool:
        return self.event_factory is not None

    def start(self) -> None:
        """Open a region (work queued from now on)."""
        if self.event_factory is not None:
            event = self.event_factory()
            event.record()
            self._start = event
        else:
            self._start = time.perf_counter()

    def stop(self, tag: Any = None) -> None:
        """Close the region opened by :meth:`start`; its time is handed back with ``tag``."""
        if self._start is None:
            raise RuntimeError("StepTimer.stop() without a start(): call timer.start() before the timed region.")
        start, self._start = self._start, None
        if self.event_factory is None:
            self.done.append((tag, time.perf_counter() - start))
            return
        end = self.event_factory()
        end.record()
        self.pending.append((tag, start, end))

    def ready(self) -> list[tuple[Any, float]]:
        """``(tag, seconds)`` of every region finished since the last call, in order; never waits for the device
        (a region whose end event has not completed stays for a later call, and so does every region after it)."""
        out, self.done = self.done, []
        while self.pending and self.pending[0][2].query():
            tag, start, end = self.pending.popleft()
            out.append((tag, start.elapsed_time(end) / 1000.0))
        return out

    def flush(self) -> list[tuple[Any, float]]:
        """:meth:`ready` after waiting for the last region to finish (once: the regions before it finished first).
        For the end of a call, not for a step of the loop."""
        if self.pending:
            self.pending[-1][2].synchronize()
        out = self.ready()
        # a fake or foreign event whose synchronize() does not make query() true: its regions are dropped, not
        # kept to block the next call
        self.pending.clear()
        return out
