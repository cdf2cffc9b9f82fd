"""The draft-length and back-off rules under noisy timings (a busy machine), with synthetic times: nothing is timed."""

import gc
import random

import torch

import pytest

from hf_specdec.adaptive import Rules
from hf_specdec.costs import CallCosts, ForwardCostModel, RecentMinimum, best_draft_length
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


def test_back_off_counts_the_drafting_time():
    cost = ForwardCostModel("cpu")
    cost.record(1, 0.07)
    state = _State(cost)
    off = BackOff()
    off.judge(state, 0.02, 1.2, 1.1)  # expected 1.2 tokens for 1.1 + 0.29 steps: does not pay
    assert off.skipping()
    kept = BackOff()
    kept.judge(state, 0.02, 1.5, 1.1)  # 1.5 tokens for 1.39 steps: pays
    assert not kept.skipping()
    # and the drafting time is the undisturbed one
    noisy = BackOff()
    for seconds in (0.02, 0.2, 0.02, 0.3):
        noisy.judge(state, seconds, None, None)
    assert noisy.draft_cost == pytest.approx(0.02 / 0.07)


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
    and the output is plain greedy decoding's. The drafter is small (its prior cost says its drafts may pay), so
    that the first call proposes drafts of its own accord, not only exploratory ones."""
    import hf_specdec
    from hf_specdec.runner_choice import runner_for
    from tiny import prompts, tiny_model

    monkeypatch.setattr(ForwardCostModel, "relative", lambda self, q: 1.0 + 0.1 * (q - 1))  # a forward costs

    m = tiny_model("llama", layers=2)
    ids, mask = prompts(3, length=10, seed=1)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False, eos_token_id=None)
    ref = m.generate(**kw)
    method = hf_specdec.decoding_method("assisted", hybrid=False)  # the drafter alone
    small = lambda: tiny_model("llama", seed=5, layers=1, hidden=16)  # noqa: E731
    out = m.generate(**kw, custom_generate=method, drafter=small(), return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    again = m.generate(**kw, custom_generate=method, drafter=small(), return_dict_in_generate=True)
    assert torch.equal(again.sequences, ref)
    gate = runner_for(m).cost_model(3).gate_for("assisted")
    assert gate.pause >= gate.FIRST_PAUSE  # closed at least once
    assert again.speculative_stats["proposed_drafts"] < out.speculative_stats["proposed_drafts"]


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
