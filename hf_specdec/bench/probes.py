"""What the bench measures around a call: the target's forwards (:class:`ForwardProbe`: how many, over how many new
tokens, how long), the process's memory and its peak, and the cost curve ``c(q)`` of a target forward over ``q`` new
tokens (:func:`forward_cost_curve`) by which a run's ceiling is reckoned."""

from __future__ import annotations

import statistics
import time

import torch

from ..runner_choice import runner_for


class ForwardProbe:
    """Counts and times the forwards of a module (hooks); records the number of new tokens of each.

    For a decoder-only model the count and sizes come from its *last decoder layer*: a target forward is what ends
    in it, whether it ran through the model's ``forward`` or in pieces (LayerSkip's verification runs the late
    layers alone; transformers' ``assistant_early_exit`` drafts with the first layers only, which is no target
    forward). The times are those of the model's ``forward`` calls (``seconds`` may then be shorter than ``sizes``):
    with ``time_calls``, wall time (``perf_counter``) on a CPU and, on CUDA, the device time between two events
    recorded around each call (no synchronisation; read once the caller has synchronised, after the call).
    ``by_last_layer=False`` counts the module's own ``forward`` calls only (a drafter; a model sharing its layers
    with another, whose last layer also runs for the other).
    """

    def __init__(self, module, time_calls: bool, by_last_layer: bool = True):
        self.module = module
        self.time_calls = time_calls
        self.cuda = time_calls and next(module.parameters()).device.type == "cuda"
        self.calls: list[int] = []  # new tokens of each forward() call
        self.ends: list[int] = []  # new tokens of each call of the last decoder layer
        self._seconds: list[float] = []
        self._events: list[tuple] = []  # CUDA: (start, end) per call, read by ``seconds``
        self._t0 = None
        self._handles = [
            module.register_forward_pre_hook(self._pre, with_kwargs=True),
            module.register_forward_hook(self._post),
        ]
        layers = getattr(getattr(module, "base_model", None), "layers", None) if by_last_layer else None
        if isinstance(layers, torch.nn.ModuleList) and len(layers):
            self._handles.append(layers[-1].register_forward_pre_hook(self._end, with_kwargs=True))

    @property
    def sizes(self) -> list[int]:
        return self.ends if self.ends else self.calls

    @property
    def seconds(self) -> list[float]:
        """Seconds of each ``forward`` call (zeros without ``time_calls``); on CUDA, read after a synchronisation."""
        if self._events:
            self._seconds += [start.elapsed_time(end) / 1000 for start, end in self._events]
            self._events = []
        return self._seconds

    def _end(self, module, args, kwargs):
        if torch.compiler.is_compiling():  # traced into compiled code (see _pre)
            return
        hidden = args[0] if args else kwargs.get("hidden_states")
        self.ends.append(int(hidden.shape[1]) if hidden is not None else 0)

    def _pre(self, module, args, kwargs):
        if torch.compiler.is_compiling():  # a forward inside compiled code (compile=True's fixed-shape drafting,
            return  # a CUDA graph on a GPU): no hook runs at a replay, and a clock there would break the graph
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds", kwargs.get("hidden_states"))
        self.calls.append(int(ids.shape[1]) if isinstance(ids, torch.Tensor) and ids.dim() > 1 else 0)
        if self.cuda:
            self._t0 = torch.cuda.Event(enable_timing=True)
            self._t0.record()
        else:
            self._t0 = time.perf_counter()

    def _post(self, module, args, output):
        if torch.compiler.is_compiling():  # as in _pre
            return
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._t0, end))
        else:
            self._seconds.append(time.perf_counter() - self._t0 if self.time_calls else 0.0)

    def reset(self):
        self.calls, self.ends, self._seconds, self._events = [], [], [], []

    def remove(self):
        for h in self._handles:
            h.remove()


def _status_mb(field: str) -> float:
    """A memory figure of this process from ``/proc/self/status`` (``VmRSS``, ``VmHWM``) in MiB; 0 where unreadable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _rss_mb() -> float:
    return _status_mb("VmRSS")


def _peak_rss_mb() -> float:
    return _status_mb("VmHWM")


def _reset_peak(device: torch.device) -> float:
    """Reset the peak-memory counter; return the current usage (MB)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device) / 2**20
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM (Linux)
    except OSError:
        pass
    return _rss_mb()


def _peak_since(device: torch.device, start: float) -> tuple[float, float]:
    """``(peak - start, absolute peak)`` in MB since ``_reset_peak``."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        peak = _peak_rss_mb()
    return max(peak - start, 0.0), peak


def forward_cost_curve(model, input_ids, sizes, reps: int = 5, kernels: bool | None = None) -> dict[int, float]:
    """Median time (ms) of a forward over q new tokens after a prefill of ``input_ids`` (sizes interleaved), fed as
    the decoding loop feeds a verification: a 4D mask, through the target runner the loop would use
    (:func:`~hf_specdec.runner_choice.runner_for`: the CPU kernel runner on a CPU unless ``kernels=False`` or
    ``HF_SPECDEC_VERIFY_KERNELS=0``), with the rounding a call with the default ``rounding`` runs."""
    from transformers import DynamicCache

    from ..tree import build_attention_mask

    device = model.device
    text_config = model.config.get_text_config()
    vocab = text_config.vocab_size
    bsz, past = input_ids.shape
    times = {q: [] for q in sizes}
    cache = DynamicCache()
    runner = runner_for(model, kernels=kernels)
    with torch.no_grad(), runner.session(cache, rounding=runner.rounding_for(None)) as target:  # as a default call
        model(input_ids=input_ids.to(device), cache=cache)
        valid = torch.ones(bsz, past, dtype=torch.bool, device=device)
        past_pos = torch.arange(past, device=device)[None].expand(bsz, -1)
        for _ in range(reps):
            for q in sizes:
                x = torch.randint(0, vocab, (bsz, q), device=device)
                pos = torch.arange(past, past + q, device=device)[None].expand(bsz, -1)
                causal = torch.ones(q, q, dtype=torch.bool, device=device).tril().expand(bsz, q, q)
                mask = build_attention_mask(text_config, valid, past_pos, pos, causal, model.dtype)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                target.forward(x, mask, pos)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times[q].append(time.perf_counter() - t0)
                cache.crop(-q)
    return {q: 1000 * statistics.median(v) for q, v in times.items()}


def _relative_cost(curve: dict[int, float], q: int) -> float:
    if q in curve:
        return curve[q] / curve[1]
    keys = sorted(curve)
    lo = max(k for k in keys if k <= q) if q >= keys[0] else keys[0]
    hi = min((k for k in keys if k >= q), default=keys[-1])
    if hi == lo:
        return curve[lo] * (q / lo) / curve[1]
    t = (q - lo) / (hi - lo)
    return (curve[lo] + t * (curve[hi] - curve[lo])) / curve[1]
