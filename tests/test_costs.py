"""The draft-length and back-off rules under noisy timings (a busy machine), with synthetic times: nothing is timed."""

import gc
import random

import torch

import pytest

from hf_specdec.adaptive import Rules
from hf_specdec.costs import CallCosts, ForwardCostModel, RecentMinimum, batch_cap, best_draft_length
from hf_specdec.proposers.base import BackOff

TRUE = {1: 0.070, 2: 0.074, 4: 0.080, 8: 0.11}  # seconds of a q-token forward on a quiet machine


def _disturbed(seconds, rng):
    """A forward time as a shared machine gives it: often a little slower, now and then 2-4x (another process)."""
    return seconds * (1 + 0.15 * rng.random()) * (rng.uniform(2, 4) if rng.random() < 0.3 else 1.0)


def test_relative_costs_are_those_of_a_quiet_machine():
    rng = random.Random(0)
    cost = ForwardCostModel("cpu")
    for _ in range(40):
        for q, s in TRUE.items():
            cost.record(q, _disturbed(s, rng))
    for q, s in TRUE.items():
        assert cost.relative(q) == pytest.approx(s / TRUE[1], rel=0.1)
    quiet = ForwardCostModel("cpu")
    for q, s in TRUE.items():
        quiet.record(q, s)
    assert best_draft_length(0.7, 7, cost) == best_draft_length(0.7, 7, quiet) > 0


def test_a_spike_does_not_turn_speculation_off():
    cost = ForwardCostModel("cpu")
    for q, s in TRUE.items():
        cost.record(q, s)
    cost.record(2, 0.5)  # one 2-token verification while another process had the cores
    cost.record(4, 0.6)
    assert best_draft_length(0.6, 3, cost) > 0


def test_the_unit_is_measured_again_under_the_same_conditions():
    """A load that starts after the one-token cost was measured slows every verification: once the one-token
    measurement is old the loop asks for a plain step, and the ratio is that of the loaded machine again."""
    cost = ForwardCostModel("cpu")
    for q, s in TRUE.items():
        cost.record(q, s)
    steps = 0
    while not cost.probe_due():
        cost.record(4, TRUE[4] * 1.8)  # the machine is now loaded
        steps += 1
    assert steps == ForwardCostModel.PROBE_EVERY - 3  # the calibration's other sizes counted too
    cost.record(1, TRUE[1] * 1.8)
    for _ in range(ForwardCostModel.HORIZON):
        cost.record(4, TRUE[4] * 1.8)
        if cost.probe_due():
            cost.record(1, TRUE[1] * 1.8)
    assert cost.relative(4) == pytest.approx(TRUE[4] / TRUE[1], rel=0.05)


def test_a_stale_cost_does_not_keep_speculation_off():
    """A loaded round leaves slow verification times behind; the machine turns quiet and the one-token unit is
    measured again, fast. Drafting now looks unprofitable and, drafting nothing, would never be measured again: an
    exploratory one-draft proposal now and then measures it, and drafting resumes."""
    cost = ForwardCostModel("cpu")
    for q, s in TRUE.items():
        cost.record(q, s * 2.2)  # loaded
    cost.record(1, TRUE[1])  # quiet again
    decisions = []
    for _ in range(2 * ForwardCostModel.EXPLORE_EVERY):
        k = best_draft_length(0.5, 3, cost)
        decisions.append(k)
        cost.record(k + 1, TRUE.get(k + 1, TRUE[4]))
    assert decisions[0] == 0
    first = decisions.index(1)
    assert first <= ForwardCostModel.EXPLORE_EVERY
    assert all(k > 0 for k in decisions[first:])
    # and exploration is rare while drafting really does not pay
    cost = ForwardCostModel("cpu")
    for q, s in TRUE.items():
        cost.record(q, s * (3.0 if q > 1 else 1.0))
    tried = sum(best_draft_length(0.3, 3, cost) > 0 for _ in range(64) if cost.record(1, TRUE[1]) is None)
    assert 1 <= tried <= 64 // ForwardCostModel.EXPLORE_EVERY + 1


def test_recent_minimum_forgets_old_samples():
    m = RecentMinimum(window=4, horizon=10)
    m.add(1.0, tick=0)
    m.add(2.0, tick=5)
    assert m.value(now=5) == 1.0
    assert m.value(now=12) == 2.0  # the first sample is past the horizon
    assert m.value(now=100) is None  # all past it: measured under other conditions, not an estimate of now


class _State:
    def __init__(self, cost):
        self.cost_model = cost


class _Tree:
    def __init__(self, valid):
        import torch

        self.valid = torch.tensor(valid)


class _Result:
    def __init__(self, new_tokens):
        self.new_tokens = new_tokens


def test_back_off_needs_two_misses_and_spares_an_accepted_drafter():
    cost = ForwardCostModel("cpu")
    cost.record(1, 0.07)
    state = _State(cost)
    off = BackOff()
    off.judge(state, 0.02, 1.2, 1.1)  # expected 1.2 tokens for 1.1 + 0.29 steps: does not pay
    assert not off.skipping()  # one miss: no skip yet (hysteresis)
    off.judge(state, 0.02, 1.2, 1.1)
    assert off.skipping()
    # a drafter whose drafts are being accepted keeps proposing although its predictions are timid
    kept = BackOff()
    for _ in range(5):
        kept.observe(_Tree([[True, True, True]]), _Result([[5, 6, 7]]))  # 3 tokens committed per verification
        kept.judge(state, 0.02, 1.2, 1.1)
        assert not kept.skipping()
    # and the drafting time is the undisturbed one
    noisy = BackOff()
    for seconds in (0.02, 0.2, 0.02, 0.3):
        noisy.judge(state, seconds, None, None)
    assert noisy.draft_cost == pytest.approx(0.02 / 0.07)


def test_batch_cap_weighs_the_whole_batch():
    """Rows of a batch share one forward as wide as the widest row: on a large batch's steep cost curve, one row's
    long draft must not make the other rows pay for it."""
    steep = ForwardCostModel("cpu")  # 16 rows: a forward's cost grows with its width
    for q, s in {1: 0.20, 2: 0.23, 3: 0.30, 4: 0.35, 5: 0.43, 9: 0.65}.items():
        steep.record(q, s)
    one_good = [[0.9] * 8] + [[] for _ in range(15)]
    assert batch_cap(one_good, steep) == 0  # 1 row gaining ~7 tokens does not pay 16 rows' wider forward
    assert batch_cap(one_good[:1], steep) == 8  # alone, the row's own rule stands
    everyone = [[0.9, 0.8, 0.7, 0.5]] * 16
    assert batch_cap(everyone, steep) in (2, 3, 4)  # every row gains: the batch drafts
    assert batch_cap([[0.9] * 8] * 2 + [[]] * 14, steep, active=[True, True] + [False] * 14) == 8  # finished rows
    assert batch_cap([[], []], steep) == 0


@pytest.mark.gated
def test_speculation_gate_closes_backs_off_and_reopens():
    from hf_specdec.costs import SpeculationGate

    gate = SpeculationGate()
    for _ in range(gate.WINDOW):  # drafts that commit 1.1 tokens for 1.3 steps: a loss of 15 %
        assert gate.open()
        gate.record(1.1, 1.2, 0.1)
    first = gate.pause  # long enough that a 2-step retry at that loss costs <= 2 % of the steps
    assert first >= gate.FIRST_PAUSE and gate.RETRY_WINDOW * (1.3 / 1.1 - 1) / first <= gate.RETRY_SHARE + 1e-9
    closed = [gate.open() for _ in range(first)]
    assert not any(closed) and gate.open()
    for _ in range(gate.RETRY_WINDOW):  # the retry (judged on its own two steps) loses again: a longer pause
        gate.record(1.0, 1.1, 0.0)
    assert gate.pause >= 2 * first
    assert sum(not gate.open() for _ in range(3 * gate.pause)) == gate.pause
    for _ in range(gate.RETRY_WINDOW):  # now it pays: open, and the pause is reset
        gate.record(2.0, 1.2, 0.2)
    assert gate.open() and gate.pause == 0 and not gate.retrying


@pytest.mark.gated
def test_speculation_gate_pause_follows_the_loss():
    """A drafter that costs as much as a step is retried far less often than one that nearly pays; the pause grows
    up to MAX_PAUSE."""
    from hf_specdec.costs import SpeculationGate

    near, costly = SpeculationGate(), SpeculationGate()
    for _ in range(SpeculationGate.WINDOW):
        near.record(1.15, 1.2, 0.0)  # 4 % short
        costly.record(1.2, 1.2, 1.1)  # half: a DFlash block at a large batch on a CPU
    assert near.pause == near.FIRST_PAUSE and costly.pause >= 8 * near.pause
    for _ in range(3):  # retries that keep losing
        for _ in range(costly.pause):
            costly.open()
        for _ in range(costly.RETRY_WINDOW):
            costly.record(1.2, 1.2, 1.1)
    assert costly.pause == costly.MAX_PAUSE


def test_gates_are_per_method(monkeypatch):
    model = ForwardCostModel("cpu")
    assert model.gate_for("eagle3") is model.gate_for("eagle3") is not model.gate_for("prompt_lookup")


@pytest.mark.gated
def test_a_batch_that_cannot_gain_decodes_plainly_and_losslessly(monkeypatch, steady_clock):
    """A random drafter on a batch: the gate turns speculation off after a window of steps, for later calls too,
    and the output is plain greedy decoding's."""
    import hf_specdec
    from hf_specdec.runner_choice import runner_for
    from tiny import prompts, tiny_model

    monkeypatch.setattr(ForwardCostModel, "relative", lambda self, q: 1.0 + 0.1 * (q - 1))  # a forward costs

    m = tiny_model("llama", layers=2)
    ids, mask = prompts(3, length=10, seed=1)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False, eos_token_id=None)
    ref = m.generate(**kw)
    method = hf_specdec.decoding_method("assisted")
    out = m.generate(**kw, custom_generate=method, drafter=tiny_model("llama", seed=5), return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    again = m.generate(**kw, custom_generate=method, drafter=tiny_model("llama", seed=5), return_dict_in_generate=True)
    assert torch.equal(again.sequences, ref)
    gate = runner_for(m).cost_model(3).gate_for("assisted")
    assert gate.pause >= gate.FIRST_PAUSE  # closed at least once
    assert again.speculative_stats["proposed_drafts"] < out.speculative_stats["proposed_drafts"]


def test_calibration_stop_is_the_kept_models_own_whatever_the_calls_rules():
    """The calibration stop is kept across calls, so it is decided from what was measured even in a call whose rules
    answer costs from the prior (measured_costs off): a size measured at 5 steps stops it, one measured cheap does
    not, whatever the prior says."""
    kept = ForwardCostModel("cpu", prior={1: 1.0, 2: 1.0, 4: 1.0, 8: 100.0})
    call = CallCosts(kept, Rules().without("measured_costs"))
    call.record(1, 1.0)
    assert call.calibrated(2, 5.0) and kept.too_costly == 3
    kept = ForwardCostModel("cpu", prior={1: 1.0, 2: 1.0, 4: 1.0, 8: 100.0})
    call = CallCosts(kept, Rules().without("measured_costs"))
    call.record(1, 1.0)
    assert not call.calibrated(8, 1.5) and kept.too_costly is None
    assert call.relative(8) > 50  # the call itself still reads the prior


def test_a_drafters_measured_cost_is_kept_by_the_target_runners_cost_model():
    """Universal drafting's measured drafter cost lives on the kept cost model (per target and batch size), read
    through a call's view, and goes with the drafter."""
    kept = ForwardCostModel("cpu")
    drafter = torch.nn.Linear(1, 1)
    CallCosts(kept).drafter_steps[drafter] = 0.8
    assert CallCosts(kept, Rules().without("exploration")).drafter_steps.get(drafter) == 0.8
    del drafter
    gc.collect()
    assert len(kept.drafter_steps) == 0
