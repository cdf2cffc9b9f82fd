"""Counting host reads of tensor values: each one is a host-device synchronisation on a GPU.

On CUDA, reading a tensor's value on the host (``.item()``, ``.tolist()``, ``bool(t)``, ``nonzero``, a boolean-mask
index, ...) waits until the device has run everything queued before it, and the launch queue drains. On a CPU those
calls cost nothing special, but *which* calls a step makes is the same on both, so counting them here is a
deterministic proxy for the syncs a GPU would pay (``torch.cuda.set_sync_debug_mode("warn")`` reports them there).

:class:`SyncCounter` is a :class:`torch.overrides.TorchFunctionMode` that counts those calls while it is active; the
test suite asserts counts per method (:mod:`tests.test_syncs`) and ``bench`` reports syncs per step.

Example::

    from hf_specdec.syncs import SyncCounter

    with SyncCounter() as syncs:
        model.generate(input_ids, max_new_tokens=32, custom_generate=hf_specdec.decoding_method("prompt_lookup"))
    print(syncs.count, syncs.by_name.most_common(3))
"""

from __future__ import annotations

import collections
import traceback

import torch
from torch.overrides import TorchFunctionMode

_TENSOR = torch.Tensor
# calls that always read a tensor's value on the host
_ALWAYS = {
    _TENSOR.item: "item",
    _TENSOR.tolist: "tolist",
    _TENSOR.__bool__: "bool",
    _TENSOR.__int__: "int",
    _TENSOR.__float__: "float",
    _TENSOR.__index__: "index",
    _TENSOR.cpu: "cpu",
    _TENSOR.numpy: "numpy",
    _TENSOR.nonzero: "nonzero",
    torch.nonzero: "nonzero",
    _TENSOR.masked_select: "masked_select",
    torch.masked_select: "masked_select",
    _TENSOR.unique: "unique",
    torch.unique: "unique",
    torch.unique_consecutive: "unique",
    torch.equal: "equal",
}


def _reads_value(func, args, kwargs) -> str | None:
    """The name of the host read ``func(*args, **kwargs)`` makes, or ``None`` when it makes none."""
    name = _ALWAYS.get(func)
    if name is not None:
        return name
    if func is _TENSOR.__getitem__ or func is _TENSOR.__setitem__:
        index = args[1] if len(args) > 1 else None
        items = index if isinstance(index, tuple) else (index,)
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items):
            return "bool_mask_index"
        return None
    if func is torch.where and len(args) == 1 and not kwargs:
        return "where_1arg"
    if func in (_TENSOR.repeat_interleave, torch.repeat_interleave):
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        if isinstance(repeats, torch.Tensor) and repeats.numel() > 1 and kwargs.get("output_size") is None:
            return "repeat_interleave"
    return None


class SyncCounter(TorchFunctionMode):
    """Counts host reads of tensor values while active (see the module docstring).

    Attributes:
        count: the number of reads.
        by_name: a :class:`collections.Counter` of reads per kind (``"item"``, ``"tolist"``, ``"nonzero"``, ...).
        by_site: with ``sites=True``, a Counter of reads per calling ``file:line`` (the first frame outside torch).
    """

    def __init__(self, sites: bool = False):
        super().__init__()
        self.sites = sites
        self.count = 0
        self.by_name: collections.Counter = collections.Counter()
        self.by_site: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _reads_value(func, args, kwargs)
        if name is not None:
            self.count += 1
            self.by_name[name] += 1
            if self.sites:
                self.by_site[_caller()] += 1
        return func(*args, **kwargs)

    def reset(self) -> None:
        self.count = 0
        self.by_name.clear()
        self.by_site.clear()


def _caller() -> str:
    for frame in reversed(traceback.extract_stack()):
        if "/torch/" not in frame.filename and not frame.filename.endswith("hf_specdec/syncs.py"):
            return f"{frame.filename.rsplit('/', 2)[-2]}/{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}"
    return "?"


def host_side(fn):
    """Mark ``fn`` as host bookkeeping (Python lists of ints, caches keyed by them) that a compiled proposal never
    traces: ``compile=True`` runs the proposers' ``propose`` through ``torch.compile``, and dynamo would guard on the
    length and values of every host list such code reads (the committed tokens grow every step, the rows' budgets
    shrink at the end of a call): a new graph each step, until its recompile limit. A marked function runs eagerly,
    the compiled proposal split around its call (``torch.compiler.disable``; outside compiled code its wrapper costs
    well under a microsecond a call). Only functions that compiled code calls need the mark: what they call is not
    traced either."""
    return torch.compiler.disable(fn)


@host_side
def to_device(data, device, dtype=torch.long) -> torch.Tensor:
    """``torch.tensor(data)`` on ``device`` without a synchronisation: on CUDA a copy from pageable host memory
    waits for the stream, so the values go through pinned memory with a non-blocking copy (torch's caching host
    allocator keeps the pinned block until the copy has run). Elsewhere a plain ``torch.tensor``."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(data, dtype=dtype, device=device)
    return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
