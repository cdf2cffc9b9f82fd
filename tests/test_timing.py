"""StepTimer (hf_specdec.timing): region times come back in order, only once the device says the region's end has
completed, without ever synchronising in the hot path; on a CPU at once. A fake event clock stands in for CUDA
events; nothing here measures real time."""

import pytest
import torch

from hf_specdec.costs import ForwardCostModel
from hf_specdec.timing import StepTimer


class FakeClock:
    """A device clock the test advances by hand: events record the time at which they are recorded; an event
    completes once the test marks the device as having got that far (``done_up_to``)."""

    def __init__(self):
        self.now = 0.0  # ms
        self.done_up_to = -1  # index of the last completed event
        self.events = []
        self.syncs = 0
        self.queries = 0

    def event(self):
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, clock: FakeClock):
        self.clock, self.index, self.time = clock, None, None

    def record(self):
        self.index, self.time = len(self.clock.events), self.clock.now
        self.clock.events.append(self)

    def query(self) -> bool:
        self.clock.queries += 1
        return self.index is not None and self.index <= self.clock.done_up_to

    def elapsed_time(self, end: "FakeEvent") -> float:
        assert self.query() and end.query(), "elapsed_time read before both events completed"
        return end.time - self.time

    def synchronize(self):
        self.clock.syncs += 1
        self.clock.done_up_to = max(self.clock.done_up_to, self.index)


@pytest.fixture()
def no_sync(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("StepTimer synchronised the device")

    monkeypatch.setattr(torch.cuda, "synchronize", fail)


def _region(timer, clock, tag, ms):
    timer.start()
    clock.now += ms
    timer.stop(tag)


def test_results_arrive_only_after_query_is_true_in_order(no_sync):
    clock = FakeClock()
    timer = StepTimer("cuda", event_factory=clock.event)
    assert timer.uses_events
    _region(timer, clock, 4, 10.0)
    _region(timer, clock, 8, 30.0)
    assert timer.ready() == []  # nothing completed yet
    clock.done_up_to = 2  # the second region's start, not its end: the first region only
    assert timer.ready() == [(4, pytest.approx(0.010))]
    assert timer.ready() == []  # handed back once
    _region(timer, clock, 1, 5.0)
    clock.done_up_to = len(clock.events) - 1
    assert timer.ready() == [(8, pytest.approx(0.030)), (1, pytest.approx(0.005))]
    assert clock.syncs == 0


def test_a_later_region_waits_for_an_earlier_one(no_sync):
    """Events complete in stream order; a fake whose later event says done first still gets results in order."""
    clock = FakeClock()
    timer = StepTimer("cuda", event_factory=clock.event)
    _region(timer, clock, "a", 1.0)
    _region(timer, clock, "b", 2.0)
    first_end = clock.events[1]
    first_end.query = lambda: False  # the first region's end has not completed
    clock.done_up_to = len(clock.events) - 1
    assert timer.ready() == []
    del first_end.query
    assert [tag for tag, _ in timer.ready()] == ["a", "b"]
    assert clock.syncs == 0


def test_flush_waits_once_and_hands_back_everything():
    clock = FakeClock()
    timer = StepTimer("cuda", event_factory=clock.event)
    for q in (1, 2, 4):
        _region(timer, clock, q, float(q))
    assert timer.flush() == [(1, pytest.approx(0.001)), (2, pytest.approx(0.002)), (4, pytest.approx(0.004))]
    assert clock.syncs == 1
    assert timer.flush() == [] and clock.syncs == 1  # nothing pending: no wait


def test_feeds_the_cost_model(no_sync):
    clock = FakeClock()
    timer, cost = StepTimer("cuda", event_factory=clock.event), ForwardCostModel("cuda")
    _region(timer, clock, 1, 2.0)
    _region(timer, clock, 4, 3.0)
    clock.done_up_to = len(clock.events) - 1
    for q, seconds in timer.ready():
        cost.record(q, seconds)
    assert cost.seconds == {1: pytest.approx(0.002), 4: pytest.approx(0.003)}


def test_cpu_results_at_once(monkeypatch, no_sync):
    readings = iter([10.0, 10.25, 11.0, 11.5])
    monkeypatch.setattr("hf_specdec.timing.time.perf_counter", lambda: next(readings))
    timer = StepTimer(torch.device("cpu"))
    assert not timer.uses_events
    timer.start()
    timer.stop(2)
    assert timer.ready() == [(2, 0.25)]
    timer.start()
    timer.stop(3)
    assert timer.flush() == [(3, 0.5)]
    assert timer.ready() == []


def test_pending_regions_are_bounded_and_stop_needs_start():
    clock = FakeClock()
    timer = StepTimer("cuda", event_factory=clock.event, max_pending=2)
    for q in range(5):
        _region(timer, clock, q, 1.0)
    clock.done_up_to = len(clock.events) - 1
    assert [q for q, _ in timer.ready()] == [3, 4]  # the oldest were dropped, never read
    with pytest.raises(RuntimeError, match="call timer.start"):
        timer.stop(1)
