"""Measured forward costs and the draft-length rule built on them.

A verification forward over ``q`` new tokens costs ``c(q)`` times a one-token decoding step: close to 1 up to dozens
of tokens on a GPU; on a CPU well above 1 with the model's own kernels and below 1 for 2-4 tokens with the CPU
kernel runner (:mod:`hf_specdec.kernels`; figures in benchmarks/RESULTS.md). Costs below one step are kept as
measured: there a short verification is cheaper than the plain step it replaces. A draft of ``k`` tokens, each
accepted with probability ``alpha`` given the previous one was, commits on average ``1 + alpha + ... + alpha^k``
tokens. The loop measures ``c(q)`` while it runs (:class:`ForwardCostModel`, one per target runner and batch size,
so later calls start from what earlier ones measured; minima of recent times, so that other work on the machine does
not turn speculation off) and a proposer picks the ``k`` that maximises tokens per unit
of time (:func:`best_draft_length`), drafting nothing when no ``k`` beats a plain step: that is what keeps a method
from slowing down text it cannot predict. A call reads the kept model through :class:`CallCosts`, under the call's
adaptive rules (:mod:`hf_specdec.adaptive`).
"""

from __future__ import annotations

import collections
import math
import weakref

from .adaptive import ALL_ON, Rules

# Relative cost of a q-token forward over a ~256-token cache vs q=1, used until the loop has measured its own.
# SmolLM2-135M fp32 on the 2-core CPU with the CPU kernel runner (hf_specdec.kernels), and with the model's own kernels
# (benchmarks/RESULTS.md); accelerators.
_CPU_PRIOR = {1: 1.0, 2: 1.05, 4: 1.1, 8: 1.6, 16: 2.1, 32: 2.5, 64: 3.4}
_CPU_OWN_PRIOR = {1: 1.0, 2: 1.65, 4: 1.5, 8: 1.7, 16: 1.85, 32: 2.6, 64: 3.6}
# bf16 on a CPU with AMX / AVX512-BF16 and the CPU kernel runner, one row's verification rounding as plain decoding's
# steps (kernels._ExactRows): nearly flat up to 8 tokens (benchmarks/RESULTS.md, "bfloat16 on the CPU")
_CPU_HALF_PRIOR = {1: 1.0, 2: 1.0, 4: 1.03, 8: 1.1, 16: 1.3, 32: 1.7, 64: 2.6}
_GPU_PRIOR = {1: 1.0, 2: 1.01, 4: 1.02, 8: 1.04, 16: 1.08, 32: 1.15, 64: 1.4}
ONE_PRIOR = _GPU_PRIOR  # every runner, device and dtype, where the rule device_priors is off (hf_specdec.adaptive)


def _interp(table: dict[int, float], q: int) -> float:
    keys = sorted(table)
    if q <= keys[0]:
        return table[keys[0]]
    if q >= keys[-1]:
        return table[keys[-1]] * q / keys[-1]
    for lo, hi in zip(keys, keys[1:]):
        if lo <= q <= hi:
            t = (math.log2(q) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
            return table[lo] + t * (table[hi] - table[lo])
    return table[keys[-1]]  # pragma: no cover


def _relative(q: int, seconds: dict[int, float], prior: dict[int, float]) -> float:
    """Cost of a ``q``-token forward in one-token forwards from ``seconds`` (``{size: estimated seconds}``, the
    measured sizes), sizes between two measured ones interpolated in log q, past the largest following ``prior``'s
    shape; ``prior`` alone while the one-token cost is not measured."""
    if q <= 1:
        return 1.0
    base = seconds.get(1)
    if not base:
        return _interp(prior, q)
    # not floored at 1: where the verification kernels make a 2-4-token forward cheaper than the model's own
    # one-token step (this project's CPU), a short verification *is* cheaper than the plain step it replaces
    known = {k: v / base for k, v in seconds.items()}
    if q in known:
        return known[q]
    lower = max(k for k in known if k < q)  # 1 is always known here
    upper = [k for k in known if k > q]
    if upper:
        hi = min(upper)
        t = (math.log2(q) - math.log2(lower)) / (math.log2(hi) - math.log2(lower))
        return known[lower] + t * (known[hi] - known[lower])
    return known[lower] * _interp(prior, q) / _interp(prior, lower)


class RecentMinimum:
    """The minimum of a time's recent samples: a robust estimate of what something costs when the machine is not
    disturbing it. Other processes only ever make a forward *slower*, so a spike never lowers the minimum, and it
    drops out after ``window`` samples or ``horizon`` ticks of the caller's clock; a lasting change (a longer cache, a
    lasting load) replaces the estimate as fast."""

    def __init__(self, window: int = 12, horizon: int | None = None):
        self.samples: collections.deque = collections.deque(maxlen=window)  # (tick, seconds)
        self.horizon = horizon

    def add(self, seconds: float, tick: int = 0) -> None:
        self.samples.append((tick, seconds))

    @property
    def latest(self) -> float | None:
        """The last sample, however old (``None``: none yet)."""
        return self.samples[-1][1] if self.samples else None

    def value(self, now: int = 0) -> float | None:
        """The minimum over the samples of the last ``horizon`` ticks; ``None`` when there are none (every sample
        is older: it was measured under other conditions and says nothing reliable about now)."""
        recent = [s for t, s in self.samples if self.horizon is None or t >= now - self.horizon]
        return min(recent) if recent else None

    @property
    def last_tick(self) -> int | None:
        return self.samples[-1][0] if self.samples else None


class ForwardCostModel:
    """Estimate of the time of a target forward over ``q`` new tokens, robust to a busy machine.

    Each size keeps the minimum of its samples of the last :attr:`HORIZON` forwards (:class:`RecentMinimum`), so a
    relative cost is a ratio of undisturbed times measured under the same conditions, not of whatever else the
    machine was doing at the time. The one-token cost is the unit of every ratio (measured by the plain steps the loop
    takes anyway: steps without drafts, the gate's and the back-off's pauses). Sizes not measured yet are interpolated
    (in log q) between the nearest measured ones, or follow the shape of the ``prior`` curve (relative costs by ``q``;
    default by ``device_type``) from the nearest measured size. The target runner
    (:class:`~hf_specdec.runners.TargetRunner`) keeps one per batch size across ``generate`` calls.
    """

    HORIZON = 96  # forwards (of any size) a sample counts for
    EXPLORE_EVERY = 16  # forwards between exploratory one-draft proposals while drafting looks unprofitable

    def __init__(self, device_type: str = "cpu", window: int = 12, prior: dict[int, float] | None = None):
        self.prior = prior if prior is not None else (_CPU_PRIOR if device_type == "cpu" else _GPU_PRIOR)
        self.window = window
        self.times: dict[int, RecentMinimum] = {}
        self.clock = 0  # forwards recorded
        self._estimates: tuple[int, dict[int, float]] = (-1, {})  # (clock, seconds): read many times per step
        self._explored = 0  # clock of the last exploratory proposal
        self.gates: dict[str, SpeculationGate] = {}  # per method: whether speculating pays at this batch size
        # a drafter (module) -> one drafter token's measured cost in this target's one-token steps at this batch size
        # (universal drafting: a call starts from what the calls before it measured)
        self.drafter_steps: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    def gate_for(self, method: str) -> "SpeculationGate":
        """The :class:`SpeculationGate` of ``method`` at this batch size (created on first use)."""
        if method not in self.gates:
            self.gates[method] = SpeculationGate()
        return self.gates[method]

    def record(self, q: int, seconds: float) -> None:
        self.clock += 1
        self.times.setdefault(q, RecentMinimum(self.window, self.HORIZON)).add(seconds, self.clock)

    @property
    def seconds(self) -> dict[int, float]:
        """``{q: estimated seconds}`` of every measured size (computed once per recorded forward)."""
        if self._estimates[0] != self.clock:
            values = {q: t.value(self.clock) for q, t in self.times.items()}
            self._estimates = (self.clock, {q: v for q, v in values.items() if v is not None})
        return self._estimates[1]

    @property
    def latest_seconds(self) -> dict[int, float]:
        """``{q: seconds}`` of every measured size's latest sample, however old (the rule ``recent_minimum`` off)."""
        return {q: t.latest for q, t in self.times.items() if t.latest is not None}

    def relative(self, q: int) -> float:
        """Cost of a ``q``-token forward in units of a one-token forward."""
        return _relative(q, self.seconds, self.prior)

    def step_seconds(self) -> float | None:
        return self.seconds.get(1)

    def explore_due(self) -> bool:
        """Whether a proposer that found drafting unprofitable should draft one token anyway (and the clock of that
        decision is taken): at most once per :attr:`EXPLORE_EVERY` forwards. A cost measured while the machine was
        busy, or an acceptance estimate from another passage, is otherwise never measured again once it says "do
        not draft", and a method stays off for good; one two-token forward now and then costs a few percent of a
        step and re-measures both."""
        if self.clock - self._explored < self.EXPLORE_EVERY:
            return False
        self._explored = self.clock
        return True


class CallCosts:
    """One call's view of a kept :class:`ForwardCostModel` (``model``): the queries the loop, the runner and the
    proposers make, answered under the call's :class:`~hf_specdec.adaptive.Rules` (``rules``); measurements go into
    the kept model as they are. The kept model outlives the call and never holds its rules: with every cost rule on,
    each query is the model's own. The call's :class:`~hf_specdec.state.DecodingState` holds it as ``cost_model``.

    Example::

        costs = CallCosts(runner.cost_model(batch_size), Rules().without("measured_costs"))
        costs.relative(8)  # the prior table's cost of an 8-token forward, whatever was measured
    """

    EXPLORE_EVERY = ForwardCostModel.EXPLORE_EVERY

    def __init__(self, model: ForwardCostModel, rules: Rules = ALL_ON):
        self.model, self.rules = model, rules

    # ---- queries, under the rules
    @property
    def seconds(self) -> dict[int, float]:
        """``{q: estimated seconds}`` of every measured size: recent minima, or the latest samples (recent_minimum
        off)."""
        return self.model.seconds if self.rules.recent_minimum else self.model.latest_seconds

    def relative(self, q: int) -> float:
        """Cost of a ``q``-token forward in one-token forwards: measured (measured_costs), from the recent minima
        (recent_minimum), sizes not measured after the runner's prior (device_priors) or else :data:`ONE_PRIOR`."""
        rules = self.rules
        if rules.measured_costs and rules.device_priors and rules.recent_minimum:
            return self.model.relative(q)
        prior = self.model.prior if rules.device_priors else ONE_PRIOR
        return _relative(q, self.seconds if rules.measured_costs else {}, prior)

    def step_seconds(self) -> float | None:
        """The one-token forward's seconds: the unit of drafting times, measured also with measured_costs off."""
        return self.model.step_seconds() if self.rules.recent_minimum else self.model.latest_seconds.get(1)

    def explore_due(self) -> bool:
        return self.rules.exploration and self.model.explore_due()  # off: the model's clock is not taken

    def gate_for(self, method: str) -> "SpeculationGate":
        return self.model.gate_for(method)

    # ---- what the loop and the runner record, as they are
    def record(self, q: int, seconds: float) -> None:
        self.model.record(q, seconds)

    @property
    def drafter_steps(self) -> "weakref.WeakKeyDictionary":
        return self.model.drafter_steps


class AcceptanceEstimator:
    """Per-key estimate of ``alpha``, the probability that a draft is accepted given the previous one was.

    Counts decay so that the estimate follows the text (a copied passage, then free prose).
    """

    def __init__(self, prior_alpha: float = 0.4, prior_weight: float = 2.0, decay: float = 0.9):
        self.prior_alpha = prior_alpha
        self.prior_weight = prior_weight
        self.decay = decay
        self.counts: dict[object, list[float]] = {}

    def alpha(self, key, prior_alpha: float | None = None) -> float:
        prior = self.prior_alpha if prior_alpha is None else prior_alpha
        acc, tried = self.counts.get(key, (0.0, 0.0))
        return (acc + prior * self.prior_weight) / (tried + self.prior_weight)

    def update(self, key, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        entry = self.counts.setdefault(key, [0.0, 0.0])
        entry[0] = entry[0] * self.decay + accepted
        entry[1] = entry[1] * self.decay + min(accepted + 1, proposed)


def best_count(expected, cost: ForwardCostModel, draft_cost: float = 0.0, min_gain: float = 1.0) -> int:
    """The number ``n`` of drafts to verify: ``expected[n - 1]`` is the expected number of tokens committed when
    the best ``n`` are verified (the target's own token included). Maximises expected tokens per unit of time (a
    verification of ``n + 1`` nodes plus ``n`` drafts at ``draft_cost`` one-token steps each); 0 (a plain step)
    unless some ``n`` beats a plain step by the factor ``min_gain`` -- except for an exploratory ``n = 1`` now and
    then (:meth:`ForwardCostModel.explore_due`), so that a method never turns itself off for good on stale figures.
    """
    best_n, best_rate = 0, 1.0 * min_gain
    for n, tokens in enumerate((float(e) for e in expected), start=1):
        rate = tokens / (cost.relative(n + 1) + n * draft_cost)
        if rate > best_rate:
            best_n, best_rate = n, rate
    if best_n == 0 and len(expected) and cost.explore_due():
        return 1
    return best_n


def best_draft_length(alpha: float, max_len: int, cost: ForwardCostModel, draft_cost: float = 0.0,
                      min_gain: float = 1.0) -> int:
    """The draft length ``k`` in ``0..max_len`` for drafts each accepted with probability ``alpha`` given the
    previous one was (:func:`best_count`). ``draft_cost`` is the cost of drafting one token in units of a one-token
    target forward."""
    alpha = min(max(alpha, 0.0), 0.999)
    expected, total, term = [], 1.0, 1.0
    for _ in range(max_len):
        term *= alpha
        total += term
        expected.append(total)
    return best_count(expected, cost, draft_cost, min_gain)


class SpeculationGate:
    """Whether speculating pays at all, judged by what it realised: the loop's last resort for a batch size where no
    draft length is cheap enough (a large batch on a CPU, where a forward's cost grows with its width and a drafter's
    forward costs a sizeable part of a step).

    After each step that asked the proposer for drafts, the loop reports the tokens a row committed on average, the
    verification's cost ``c(q)`` (measured, in one-token steps: robust to a busy machine) and the proposal's time in
    one-token steps. The *efficiency* of the recent such steps is their tokens over their costs (plain decoding: 1).
    A first judgement reads :attr:`WINDOW` steps; a retry after a pause reads only :attr:`RETRY_WINDOW`, since it only
    asks whether anything changed. Below :attr:`THRESHOLD` (a 5 % margin: the costs are minima of undisturbed
    forwards, and a step's own work beside the forward, accepting a tree and the proposer's bookkeeping, is not in
    them) the gate closes: the next ``pause`` steps are plain, with no proposal at all. The pause is long enough
    that retrying at the measured loss costs at most :attr:`RETRY_SHARE` of the steps (a drafter that costs as much
    as a step is retried rarely, one that nearly pays often), at least :attr:`FIRST_PAUSE`, at most
    :attr:`MAX_PAUSE`, and at least double the last one while retries keep losing; a retry that pays opens the gate
    and resets the pause.

    One gate per target runner, batch size and method (:meth:`ForwardCostModel.gate_for`), kept across calls: a
    method that lost at a batch size starts its next call at that size plain, and retries now and then.

    Example::

        gate = SpeculationGate()
        if gate.open():
            ...  # propose, verify, then
            gate.record(tokens_per_row=1.1, verify_cost=1.2, draft_cost=0.4)  # 1.1 tokens for 1.6 steps: a loss
    """

    WINDOW = 6
    RETRY_WINDOW = 2
    THRESHOLD = 1.05
    FIRST_PAUSE = 8
    MAX_PAUSE = 256
    RETRY_SHARE = 0.02

    def __init__(self):
        self.steps: collections.deque = collections.deque(maxlen=self.WINDOW)  # (tokens per row, cost in steps)
        self.closed_for = 0
        self.pause = 0  # the last pause (0: none yet, or the last retry paid)
        self.retrying = False

    def open(self) -> bool:
        """Whether this step may speculate (counts a closed step down)."""
        if self.closed_for > 0:
            self.closed_for -= 1
            return False
        return True

    def efficiency(self, rules: Rules = ALL_ON) -> float | None:
        """Tokens per step-cost of the steps read so far, once there are enough of them to judge (a retry: only
        :attr:`RETRY_WINDOW`, unless the rule gate_quick_retry is off)."""
        quick = self.retrying and rules.gate_quick_retry
        if len(self.steps) < (self.RETRY_WINDOW if quick else self.WINDOW):
            return None
        return sum(t for t, _ in self.steps) / sum(c for _, c in self.steps)

    def record(self, tokens_per_row: float, verify_cost: float, draft_cost: float, rules: Rules = ALL_ON) -> None:
        """One step that asked for drafts: ``tokens_per_row`` committed, a verification of ``verify_cost`` and a
        proposal of ``draft_cost`` one-token steps; ``rules``: the call's (the gate is kept across calls; the rules
        gate_loss_pause and gate_quick_retry off: every pause :attr:`FIRST_PAUSE` steps, a retry judged on
        :attr:`WINDOW` steps)."""
        self.steps.append((tokens_per_row, verify_cost + draft_cost))
        value = self.efficiency(rules)
        if value is None:
            return
        if value < self.THRESHOLD:
            pause = self.FIRST_PAUSE
            if rules.gate_loss_pause:
                # a retry of RETRY_WINDOW steps at this efficiency loses RETRY_WINDOW * (1 / value - 1) steps
                loss = self.RETRY_WINDOW * (1.0 / max(value, 1e-3) - 1.0)
                pause = max(self.FIRST_PAUSE, math.ceil(loss / self.RETRY_SHARE), 2 * self.pause)
            self.closed_for = self.pause = min(pause, self.MAX_PAUSE)
            self.retrying = True
            self.steps.clear()  # a retry is judged on its own steps
        else:
            self.pause, self.retrying = 0, False
