"""The CPU kernel runner: the target's multi-token verification forwards with other library calls, same arithmetic.

Speculative decoding pays off when scoring ``q`` drafted tokens costs about as much as scoring one. On a GPU it
does. On a CPU two library paths break that for the small ``q`` a verification uses (figures for this project's
2-core CPU in benchmarks/RESULTS.md):

* ``F.linear(x, W)`` with 2-4 rows takes MKL's general GEMM path and costs 1.3-3x the one-row path; the same product
  written as ``(W @ x.T).T`` reads the weight once and costs about as much as one row.
* transformers' ``sdpa`` attention copies the whole key/value cache once per layer to repeat its grouped-query
  heads as soon as there is more than one query token and a mask. Folding the query heads of one key/value group
  into the query length instead (what transformers already does for a single query token) leaves the cache where
  it is.

:class:`CpuKernelRunner` is the :class:`~hf_specdec.runners.TargetRunner` that uses both:
:func:`~hf_specdec.runner_choice.runner_for` picks it for every target on the CPU whose weights are plain dense
tensors (a quantized target keeps its own forward: :mod:`hf_specdec.quantization`; ``HF_SPECDEC_VERIFY_KERNELS=0`` or
``runner_for(model, kernels=False)`` turn it off),
because there it is what makes a 2-4-token verification cheaper than the model's own one-token step (the forward-cost
curves in benchmarks/RESULTS.md). It keeps its timing cache on the runner, one per model, and installs
:class:`VerifyKernels` for each call: the kernels run for the forwards the session marks as verification (``q >= 2``)
and for everything inside a proposal; the prefill and a single row's one-token steps stay on the model's own code
path, and a batch's one-token steps take only the faster linear product (as ``plain_kernels`` does). A drafter's
linear layers (an EAGLE-3 / DFlash drafter, a draft model) take the faster product in all their forwards, one-row
ones padded to two. Where ``(W @ x.T).T`` over 2 rows beats the one-row path itself (it does on this project's CPU),
plain decoding could gain from padding its row to two as well:
:func:`padded_plain_decoding` does exactly that for plain ``generate()``, and the benchmark runs it as the method
``plain_kernels``, so that a speedup over stock ``generate()`` splits into the kernels' share and speculation's.

Which of the two linear kernels is faster is measured per weight shape and row count while decoding (the medians of
seven interleaved calls each; the transposed product must win by 10 %), not assumed: on another CPU the GEMM path may
win, and then it is kept. Only plain ``nn.Linear`` modules with plain dense weights on the CPU without hooks are
touched (a quantized drafter's layers keep their own forward), and only for the duration of one ``generate`` call.
The results are the same products summed in another order: as with any batched verification, greedy output equals
plain decoding except where two logits tie to the last bit.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time

import torch
import torch.nn.functional as F

from ._transformers import attention_implementation, switch_attention
from .costs import _CPU_HALF_PRIOR, _CPU_PRIOR
from .dtypes import HALF
from .quantization import not_dense, plain_dense, say_once
from .runners import TargetRunner, TargetSession, device_type_of, kept_runner

ATTN_NAME = "hf_specdec_packed_sdpa"
_MAX_ROWS = 32
_MAX_EXACT_ROWS = 256
_TRIALS = 7  # timed calls of each product per shape before the faster is kept
_CHECK_ROWS = 64  # rows a product must give one-row bits for (half precision, _LinearChoice._rounding)
_CHECK_CALLS = 8  # rounding="exact": real calls per shape also checked row by row (_LinearChoice._checked)


class _LinearChoice:
    """Per (weight shape, rows, dtype, threads, rounding): which product computes ``x @ W.T``. Timed in place.

    One per :class:`CpuKernelRunner` (so per model), kept across calls. A choice is ``"linear"`` (``F.linear``),
    ``"mm"`` (``(W @ x.T).T``) or ``"rows"`` (one ``F.linear`` per row: the bits of plain decoding's one-row steps
    where no product over several rows has them; only with ``rounding="exact"``)."""

    force: bool | None = None  # tests: always (True) or never (False) the transposed product

    def __init__(self):
        self.times: dict[tuple, tuple[list[float], list[float]]] = {}
        self.choice: dict[tuple, str] = {}
        self.checked: dict[tuple, int] = {}  # rounding="exact": real calls of a key whose rows were checked

    def __call__(self, x2: torch.Tensor, weight: torch.Tensor, bias, rounding: str | None = None) -> torch.Tensor:
        """``x2 [rows, in] @ weight.T (+ bias)`` by the faster product. ``rounding`` (a target layer in half
        precision, see :class:`VerifyKernels`): ``"auto"`` only by a product whose rows round as plain decoding's
        one-row ``F.linear`` where one does (else ``F.linear``), ``"exact"`` by one row at a time where none does."""
        key = (tuple(weight.shape), x2.shape[0], weight.dtype, torch.get_num_threads(), rounding)
        use = self.choice.get(key) if self.force is None else ("mm" if self.force else "linear")
        if use is not None:
            out = _product(use, x2, weight, bias)
            return self._checked(key, x2, weight, bias, out) if rounding == "exact" and use != "rows" else out
        plain, mm = self.times.setdefault(key, ([], []))
        if rounding is not None and not plain:
            out = self._rounding(key, x2, weight, bias, rounding)
            if out is not None:
                return out
        try_mm = len(mm) < len(plain)
        t0 = time.perf_counter()
        out = _mm_t(x2, weight, bias) if try_mm else F.linear(x2, weight, bias)
        (mm if try_mm else plain).append(time.perf_counter() - t0)
        if len(mm) >= _TRIALS:  # medians of interleaved calls: one disturbed call does not decide
            self.choice[key] = "mm" if statistics.median(mm) < 0.9 * statistics.median(plain) else "linear"
        return self._checked(key, x2, weight, bias, out) if rounding == "exact" else out

    def _checked(self, key, x2, weight, bias, out) -> torch.Tensor:
        """``rounding="exact"``: the first :data:`_CHECK_CALLS` real calls of a key are compared with one row at a
        time, and a product that rounds a row otherwise is never used again (this call returns the one-row result):
        real activations find what random ones may not."""
        seen = self.checked.get(key, 0)
        if seen >= _CHECK_CALLS:
            return out
        single = _one_row_each(x2, weight, bias)
        if torch.equal(out, single):
            self.checked[key] = seen + 1
            return out
        self.choice[key], self.checked[key] = "rows", _CHECK_CALLS
        return single

    def _rounding(self, key, x2, weight, bias, rounding: str) -> torch.Tensor | None:
        """First call of a shape: does each product give every row the bits of plain decoding's one-row
        ``F.linear``? With AMX in bf16 both do up to 32 rows (past 32 neither always does: the caller splits); with
        AVX512-BF16 alone they sum in another order, which rounds a row otherwise for some inputs only (often once
        the input is wider than 1024; at a width of 32 too, for activations of a wide range). So a product is checked
        on this input and on random ones of a wide range of magnitudes, at least :data:`_CHECK_ROWS` rows in all.
        Where only one product holds, it is chosen now (and its output returned); where neither does, ``F.linear``
        (``"auto"``) or one row at a time (``"exact"``); where both do, ``None``: the timing decides."""
        rows, gen = x2.shape[0], torch.Generator().manual_seed(0)
        scale = x2.float().std().nan_to_num(1.0).item() or 1.0

        def wide():  # normal values times log-normal magnitudes: partial sums that need every bit
            x = torch.randn(rows, x2.shape[1], generator=gen) * torch.exp(2 * torch.randn(rows, x2.shape[1],
                                                                                             generator=gen))
            return (x * scale).to(x2.dtype).to(x2.device)

        inputs = [x2] + [wide() for _ in range(-(-_CHECK_ROWS // rows) - 1)]
        singles = [_one_row_each(x, weight, bias) for x in inputs]
        outs = {name: [_product(name, x, weight, bias) for x in inputs] for name in ("linear", "mm")}
        exact = [name for name, out in outs.items() if all(map(torch.equal, out, singles))]
        if len(exact) == 2:
            return None
        self.choice[key] = exact[0] if exact else "rows" if rounding == "exact" else "linear"
        return singles[0] if self.choice[key] == "rows" else outs[self.choice[key]][0]


def _one_row_each(x2: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    """``F.linear`` of each row alone: what plain decoding's one-token steps compute, row by row."""
    return torch.cat([F.linear(x2[i:i + 1], weight, bias) for i in range(x2.shape[0])])


def _mm_t(x2: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    if x2.shape[0] == 1:  # one row: padded to two, which takes the GEMM path instead of GEMV
        out = torch.mm(weight, torch.cat([x2, x2]).t())[:, :1].t().contiguous()
    else:
        out = torch.mm(weight, x2.t()).t().contiguous()
    return out if bias is None else out + bias


def _product(name: str, x2: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    """``x2 @ weight.T (+ bias)`` by the product ``name`` of :class:`_LinearChoice`."""
    if name == "mm":
        return _mm_t(x2, weight, bias)
    return _one_row_each(x2, weight, bias) if name == "rows" else F.linear(x2, weight, bias)


class _MaskRepeats:
    """The last attention mask seen and it repeated for the packed query rows: every layer of one forward gets the
    same mask, so it is repeated once per forward (one tuple: safe across threads)."""

    def __init__(self):
        self.last: tuple = (None, 0, None)

    def get(self, attention_mask: torch.Tensor, groups: int) -> torch.Tensor:
        last = self.last
        if last[0] is attention_mask and last[1] == groups:
            return last[2]
        mask = attention_mask.repeat(1, 1, groups, 1)
        self.last = (attention_mask, groups, mask)
        return mask

    def clear(self) -> None:
        self.last = (None, 0, None)


class _ExactRows:
    """Half-precision attention for one row that gives each query token the bits of a one-token decoding step.

    In bf16 / fp16 a verification forward diverges from plain decoding unless every product rounds as in the
    one-token step: the CPU's flash-attention kernel gives a query different bits depending on how many query rows
    it processes together and on how many keys its call spans (masked ones included: a query grouped with longer ones
    rounds otherwise for some real keys, seen on an AVX512-BF16 CPU past 130 keys); the linear layers' products are
    checked by :class:`_LinearChoice`. So each query token runs as plain decoding runs it -- one query over exactly its
    own keys (``enable_gqa``, no repeated heads, no mask) -- with the queries that have the same number of keys as
    rows of the batch dimension of one call (siblings of a draft tree; a chain of ``q`` tokens: ``q`` calls per
    layer, which cost no more than grouped ones in ``benchmarks/RESULTS.md``). A query whose keys are not a prefix of
    the cache (a branch of a draft tree) gets its keys gathered into the order plain decoding would hold them in.

    One per :class:`VerifyKernels`; the plan is computed once per forward (every layer gets the same mask).
    """

    def __init__(self):
        self.last: tuple = (None, None)  # (mask, plan)

    def plan(self, attention_mask: torch.Tensor):
        """``[(rows [n], width, columns [n, width] or None)]`` for the query rows of ``attention_mask [1, 1, q, K]``:
        each group's queries see ``width`` keys, the first ``width`` of the cache or the gathered ``columns``."""
        if self.last[0] is attention_mask:
            return self.last[1]
        allowed = attention_mask[0, 0] == 0  # [q, K]
        counts = allowed.sum(1)  # [q]
        last = allowed.shape[1] - allowed.flip(1).to(torch.uint8).argmax(1)  # [q]: one past the last allowed key
        prefix = (last == counts).tolist()
        plan = []
        groups: dict[tuple, list[int]] = {}
        for i, n in enumerate(counts.tolist()):
            groups.setdefault((prefix[i], n), []).append(i)
        for (is_prefix, width), rows in groups.items():
            index = torch.tensor(rows, device=attention_mask.device)
            # consecutive rows: a slice, read and written without copies
            where = slice(rows[0], rows[-1] + 1) if rows == list(range(rows[0], rows[-1] + 1)) else index
            columns = None
            if not is_prefix:  # the allowed keys of each row, in cache order (ancestors follow their parents)
                order = torch.sort(torch.where(allowed[index], 0, 1), dim=1, stable=True).indices
                columns = order[:, :width].contiguous()
            plan.append((where, width, columns))
        self.last = (attention_mask, plan)
        return plan

    def clear(self) -> None:
        self.last = (None, None)


def _exact_attention(query, key, value, plan, scaling, groups: int) -> torch.Tensor:
    """Attention of ``query [1, H, q, D]`` over ``key`` / ``value [1, Hkv, K, D]`` row group by row group of
    ``plan`` (:meth:`_ExactRows.plan`); returns ``[1, q, H, D]`` as transformers' attention functions do."""
    heads, q_len = query.shape[1], query.shape[2]
    gqa = {"enable_gqa": True} if groups > 1 else {}
    out = None
    for rows, width, columns in plan:
        sliced = isinstance(rows, slice)
        q = (query[0, :, rows] if sliced else query[0].index_select(1, rows)).transpose(0, 1)[:, :, None]
        n = q.shape[0]  # q: [n, H, 1, D]
        if columns is None:
            k = key[:, :, :width].expand(n, -1, -1, -1)  # [n, Hkv, width, D]: a view
            v = value[:, :, :width].expand(n, -1, -1, -1)
        else:  # [n, Hkv, width, D]: gathered
            k = key[0].index_select(1, columns.view(-1)).view(key.shape[1], n, width, -1).transpose(0, 1)
            v = value[0].index_select(1, columns.view(-1)).view(value.shape[1], n, width, -1).transpose(0, 1)
        o = F.scaled_dot_product_attention(q, k, v, scale=scaling, **gqa)[:, :, 0]  # [n, H, Dv]
        if n == q_len:
            return o[None]  # one group: every row, in order
        if out is None:
            out = query.new_empty(q_len, heads, value.shape[-1])  # [q, H, Dv]
        if sliced:
            out[rows] = o
        else:
            out.index_copy_(0, rows, o)
    return out[None]


def _packed_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                 mask_repeats: _MaskRepeats | None = None, exact: _ExactRows | None = None, **kwargs):
    """``sdpa`` attention that folds the query heads of each key/value group into the query length; in half
    precision, for one row, the query tokens as plain decoding computes them (:class:`_ExactRows`)."""
    from ._transformers import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    q_len = query.shape[2]
    if (exact is not None and query.dtype in HALF and query.shape[0] == 1 and isinstance(attention_mask, torch.Tensor)
            and attention_mask.dim() == 4 and not module.training
            and all(kwargs.get(name) is None for name in ("softcap", "position_bias", "s_aux", "sinks"))):
        return _exact_attention(query, key, value, exact.plan(attention_mask), scaling, groups), None
    plain = (
        groups <= 1 or q_len <= 1 or attention_mask is None or not isinstance(attention_mask, torch.Tensor)
        or attention_mask.dim() != 4 or attention_mask.shape[1] != 1 or module.training
        or key.shape[1] * groups != query.shape[1]
        or any(kwargs.get(name) is not None for name in ("softcap", "position_bias", "s_aux", "sinks"))
    )
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    bsz, heads, _, dim = query.shape
    # head h reads key/value head h // groups (transformers' repeat_kv): row r * q_len + i of the packed query is
    # query token i of head (kv_head * groups + r)
    packed = query.reshape(bsz, heads // groups, groups * q_len, dim)
    mask = mask_repeats.get(attention_mask, groups) if mask_repeats is not None else attention_mask.repeat(
        1, 1, groups, 1)
    out = F.scaled_dot_product_attention(packed, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(bsz, heads, q_len, value.shape[-1]).transpose(1, 2).contiguous(), None


_THREAD = threading.local()  # .kernels: the VerifyKernels this thread is inside (None: none)
_ATTENTION: dict = {}  # "interface": transformers' attention functions, once ATTN_NAME is registered
_ATTENTION_LOCK = threading.Lock()


def _register_attention() -> bool:
    """Register :func:`_switched_attention` under :data:`ATTN_NAME` with transformers (once per process)."""
    if _ATTENTION:
        return True
    with _ATTENTION_LOCK:
        if not _ATTENTION:
            try:
                from transformers import AttentionInterface
                from ._transformers import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
            except ImportError:  # pragma: no cover - older transformers
                return False
            ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, sdpa_mask)
            AttentionInterface.register(ATTN_NAME, _switched_attention)
            _ATTENTION["interface"] = AttentionInterface()
    return True


def _switched_attention(module, *args, **kwargs):
    """The attention of a layer whose config a :class:`VerifyKernels` switched to :data:`ATTN_NAME`: that
    VerifyKernels' packed (or exact) attention in the thread it runs in; in any other thread (a plain ``generate()``
    of the same model meanwhile) transformers' own ``sdpa``, so that the switch changes nothing there."""
    kernels = getattr(_THREAD, "kernels", None)
    if kernels is None or id(getattr(module, "config", None)) not in kernels.config_ids:
        return _ATTENTION["interface"]["sdpa"](module, *args, **kwargs)
    return _packed_sdpa(module, *args, mask_repeats=kernels.mask_repeats, exact=kernels.exact, **kwargs)


class VerifyKernels:
    """The CPU kernels installed on ``model`` for one ``generate`` call (a context manager); the component
    :class:`CpuKernelSession` uses.

    Inside, :meth:`verifying` marks one forward as a verification of ``q`` tokens per row; the kernels are used
    only there and only when ``q >= 2``. A no-op for models not on the CPU, or with ``enabled=False``.

    ``drafters``: modules that only drafting runs (an EAGLE-3 / DFlash drafter, a draft model). Their linear layers
    use the faster of the two products in *every* forward, one-row ones included (padded to two rows): drafting is
    speculation's own cost, so making it cheaper is not a gain plain decoding is denied. Layers a drafter shares
    with the target (DFlash's use of the target's LM head, a student's head) take it only inside :meth:`drafting`,
    which the loop wraps around every proposal; the target's own forwards keep the rule above.

    ``choice``: the timing cache deciding between the two products (:class:`CpuKernelRunner` passes its own, kept
    across calls; default: a fresh one).

    ``rounding`` (half precision only; the ``rounding`` option of every method): ``"auto"`` -- one row's tokens get
    the attention of plain decoding's one-token steps (:class:`_ExactRows`) and the products whose rows round as one
    row where this CPU has one (with AMX: every verification is bit-identical to plain decoding; with AVX512-BF16
    alone, not the products wider than 1024); ``"exact"`` -- also one row at a time where no product over several
    rows rounds as one row (bit-identical on every CPU, slower where it is needed); ``"fast"`` -- the packed attention
    and the faster products (identical to plain decoding up to rounding).

    Example::

        with VerifyKernels(model) as kernels:
            with kernels.verifying(4):
                out = model(input_ids=tokens, attention_mask=mask4d, position_ids=pos, past_key_values=cache)
    """

    def __init__(self, model, enabled: bool = True, drafters=(), choice: _LinearChoice | None = None,
                 rounding: str = "auto"):
        self.model = model
        self.drafters = [d for d in drafters if isinstance(d, torch.nn.Module)]
        self.choice = choice if choice is not None else _LinearChoice()
        self.mask_repeats = _MaskRepeats()
        # half precision: one row's tokens get the bits of plain decoding's one-token steps (see _ExactRows)
        self.exact = _ExactRows() if rounding != "fast" and model.dtype in HALF else None
        self.rounding = rounding if self.exact is not None else None  # the target's products (_LinearChoice)
        # rows past which a product keeps F.linear (a batch's one-token steps); in exact half precision a draft tree
        # of more than 32 tokens still needs products that round as one row: 32 rows at a time
        self.max_rows = _MAX_ROWS if self.exact is None else _MAX_EXACT_ROWS
        self.active = False
        self.drafting_now = False
        self.linears: list[torch.nn.Linear] = []
        self.configs: list = []
        self.config_ids: set[int] = set()  # of self.configs: the layers _switched_attention runs our attention for
        self.thread: int | None = None  # the thread that installed the kernels: the only one whose forwards use them
        self.outer = None  # the VerifyKernels this thread was inside before (restored at exit)
        self.enabled = enabled and device_type_of(model) == "cpu"

    def __enter__(self) -> "VerifyKernels":
        if not self.enabled:
            return self
        self.thread = threading.get_ident()
        self.outer, _THREAD.kernels = getattr(_THREAD, "kernels", None), self
        for module in plain_cpu_linears(self.model):
            module.forward = self._linear_forward(module)
            self.linears.append(module)
        for drafter in self.drafters:
            for module in plain_cpu_linears(drafter):  # skips the target's (already replaced) shared layers
                module.forward = self._linear_forward(module, always=True)
                self.linears.append(module)
        if _register_attention():
            for module in self.model.modules():
                config = getattr(module, "config", None)
                if (hasattr(module, "num_key_value_groups") and config is not None and id(config) not in self.config_ids
                        and attention_implementation(config) == "sdpa"):
                    self.config_ids.add(id(config))
                    self.configs.append(config)
        return self

    def __exit__(self, *exc) -> None:
        for module in self.linears:
            module.__dict__.pop("forward", None)
        self.linears = []
        self.configs = []
        self.config_ids = set()
        if self.thread is not None:
            _THREAD.kernels, self.outer, self.thread = self.outer, None, None

    def _linear_forward(self, module: torch.nn.Linear, always: bool = False):
        def forward(x: torch.Tensor) -> torch.Tensor:
            weight = module.weight
            if threading.get_ident() != self.thread:  # another thread's forward (a plain generate() meanwhile)
                return F.linear(x, weight, module.bias)
            rows = x.numel() // weight.shape[1] if x.dim() else 0
            any_rows = always or self.drafting_now  # drafting: one row too (padded to two)
            if (not (any_rows or self.active) or rows < (1 if any_rows else 2)
                    or rows > (_MAX_ROWS if always else self.max_rows) or x.dtype != weight.dtype):
                return F.linear(x, weight, module.bias)
            x2, rounding = x.reshape(rows, weight.shape[1]), None if always else self.rounding
            if rounding and rows > _MAX_ROWS:  # past 32 rows oneDNN's products round rows differently (split sums)
                out = torch.cat([self.choice(part, weight, module.bias, rounding) for part in x2.split(_MAX_ROWS)])
            else:
                out = self.choice(x2, weight, module.bias, rounding)
            return out.reshape(*x.shape[:-1], weight.shape[0])
        return forward

    @contextlib.contextmanager
    def drafting(self):
        """Inside, every patched linear layer (the target's too: a drafter may borrow its head) is drafting cost and
        takes the faster product for any row count. In half precision the target's own layers run by a proposal
        (LayerSkip's early exit, whose activations its verification resumes from) round as plain decoding does."""
        if not self.linears and self.exact is None:
            yield
            return
        self.drafting_now = True
        configs = self.configs if self.exact is not None else []
        for config in configs:
            switch_attention(config, ATTN_NAME)
        try:
            yield
        finally:
            self.drafting_now = False
            for config in configs:
                switch_attention(config, "sdpa")
            if self.exact is not None:
                self.exact.clear()

    @contextlib.contextmanager
    def verifying(self, tokens_per_row: int):
        """Use the kernels for the forward inside when it scores ``tokens_per_row >= 2`` tokens per row; a one-token
        step of a batch (2 rows or more) takes the faster linear product only, as ``plain_kernels`` does, so that a
        batch the loop does not speculate on decodes as fast as plain decoding with the same kernels."""
        if not self.enabled or not (self.linears or self.configs):
            yield
            return
        self.active = True  # the linear product; a single row keeps F.linear (see _linear_forward)
        # the packed attention only for several tokens per row (one query token: transformers already folds the
        # heads); switched per forward: transformers' set_attn_implementation walks every module, too slow per step
        # (half precision: one token too, as plain decoding computes it, see _ExactRows)
        configs = self.configs if tokens_per_row >= 2 or self.exact is not None else []
        for config in configs:
            switch_attention(config, ATTN_NAME)
        try:
            yield
        finally:
            self.active = False
            self.mask_repeats.clear()
            if self.exact is not None:
                self.exact.clear()
            for config in configs:
                switch_attention(config, "sdpa")


class CpuKernelSession(TargetSession):
    """A :class:`~hf_specdec.runners.TargetSession` with :class:`VerifyKernels` installed for the call."""

    def __enter__(self) -> "CpuKernelSession":
        super().__enter__()  # first: the kernels take over the attention it may have switched to sdpa
        self.kernels = VerifyKernels(self.model, drafters=self.drafters, choice=self.runner.choice,
                                     rounding=self.rounding).__enter__()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.kernels.__exit__(*exc)
        finally:
            super().__exit__(*exc)

    def drafting(self):
        return self.kernels.drafting()

    def forward_context(self, tokens_per_row: int):
        return self.kernels.verifying(tokens_per_row)


class CpuKernelRunner(TargetRunner):
    """The target runner for models on the CPU: verification forwards and drafting take the CPU kernels (module
    docstring). Keeps its timing cache (``choice``) across calls."""

    name = "cpu_kernels"
    session_class = CpuKernelSession

    def __init__(self, model):
        super().__init__(model)
        self.choice = _LinearChoice()

    @classmethod
    def applies_to(cls, model) -> bool:
        """A model on the CPU whose weights are all plain dense tensors (:func:`~hf_specdec.quantization.not_dense`):
        a quantized one (torchao, quanto, bitsandbytes, GPTQ, AWQ) keeps its own forward, said once per model in a
        log line; its output is the same either way, its verification costs what its own forward costs."""
        if device_type_of(model) != "cpu":
            return False
        reason = not_dense(model)
        if reason is not None:
            say_once(model, f"hf_specdec: the CPU verification kernels leave {type(model).__name__} to its own "
                            f"forward: {reason}, and they multiply only plain dense weights. Outputs are the same; "
                            "see docs/quantization.md.")
        return reason is None

    @property
    def cost_prior(self) -> dict[int, float]:
        return _CPU_HALF_PRIOR if self.model.dtype in HALF else _CPU_PRIOR


def plain_cpu_linears(model) -> list[torch.nn.Linear]:
    """The ``nn.Linear`` modules (exact type) of ``model`` on the CPU with plain dense float weights (not quantized:
    :func:`~hf_specdec.quantization.plain_dense`) and no hooks or replaced ``forward`` (Accelerate's, a user's): the
    only ones a kernel may take over."""
    return [m for m in model.modules()
            if type(m) is torch.nn.Linear and "forward" not in m.__dict__ and not hasattr(m, "_hf_hook")
            and plain_dense(m.weight) and (m.bias is None or plain_dense(m.bias)) and m.weight.device.type == "cpu"
            and not m._forward_hooks and not m._forward_pre_hooks]


@contextlib.contextmanager
def padded_plain_decoding(model):
    """Plain decoding with the loop's CPU product: inside, every plain ``nn.Linear`` of ``model`` takes the faster
    of ``F.linear`` and ``(W @ x.T).T`` for any row count, one row padded to two -- what a drafter's layers get in
    :class:`VerifyKernels` (its :meth:`~VerifyKernels.drafting` rule, here for every forward of ``model``), with
    the timing cache of the model's :class:`CpuKernelRunner`.

    This is the kernel-matched baseline of the benchmark (method ``plain_kernels``): the speed plain greedy
    ``generate()`` would have if it took the same kernel trick the speculative loop takes. Dividing a speedup over
    stock ``generate()`` by this one's gives speculation's own share.

    Example::

        with padded_plain_decoding(model):
            out = model.generate(**inputs, max_new_tokens=64, do_sample=False)
    """
    runner = kept_runner(model, CpuKernelRunner)
    # no exact half-precision rounding: plain decoding's own attention and prefill (only its products change); a
    # model the kernel runner leaves to its own forward (quantized) decodes as it is, as the loop verifies it
    kernels = VerifyKernels(model, enabled=CpuKernelRunner.applies_to(model), choice=getattr(runner, "choice", None),
                            rounding="fast")
    with kernels, kernels.drafting():
        yield model
