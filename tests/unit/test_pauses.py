"""The coordinator's own time (shoal.common.pauses) and what the engine does after a pause."""

from __future__ import annotations

import pytest

from shoal.common.pauses import RunClock
from shoal.coordinator.rounds import ForgetMember, ReadyInfo, RoundEngine

from kits.engine import admit, engine


class FakeTime:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_gap_between_readings_is_taken_out_of_the_clock():
    mono = FakeTime()
    clock = RunClock(1.0, monotonic=mono, wall=lambda: 5000.0)
    assert clock() == pytest.approx(5000.0)
    for _ in range(10):  # a ticker reading every 0.05 s
        mono.t += 0.05
        clock()
    assert clock() == pytest.approx(5000.5)
    assert clock.take_pause() == 0.0
    mono.t += 20.0  # SIGSTOP for 20 s
    assert clock() == pytest.approx(5000.5)
    assert clock.pauses == 1 and clock.paused_seconds == pytest.approx(20.0)
    assert clock.take_pause() == pytest.approx(20.0)
    assert clock.take_pause() == 0.0  # taken once
    mono.t += 0.05
    assert clock() == pytest.approx(5000.55)


def test_gaps_below_the_threshold_are_time_lived():
    mono = FakeTime()
    clock = RunClock(1.0, monotonic=mono, wall=lambda: 0.0)
    start = clock()
    mono.t += 0.9
    assert clock() - start == pytest.approx(0.9)
    assert clock.pauses == 0


def _engine(lease=10.0) -> RoundEngine:
    return admit(engine(lease_seconds=lease), "abc")


def test_no_member_is_evicted_for_the_coordinators_pause():
    """Leases judged on the run clock: a 20 s SIGSTOP at 9 s (lease 10 s) is left out, and
    the grace after it gives every member a full lease to renew."""
    mono = FakeTime()
    clock = RunClock(1.0, monotonic=mono, wall=lambda: 0.0)
    e = _engine()
    t0 = clock()
    e2 = RoundEngine(e.config, members=list(e.members.values()), now=t0)  # leases from t0
    while mono.t < 109.0:
        mono.t += 0.05
        assert not [a for a in e2.tick(clock()) if isinstance(a, ForgetMember)]
    mono.t += 20.0
    now = clock()
    e2.resumed(now, clock.take_pause())
    for _ in range(int(9.5 / 0.05)):  # peers need a few heartbeat intervals to get through again
        mono.t += 0.05
        assert not [a for a in e2.tick(clock()) if isinstance(a, ForgetMember)]
    assert set(e2.members) == {"a", "b", "c"}


def test_a_member_that_stays_silent_after_the_grace_is_evicted():
    e = _engine(lease=10.0)
    e.resumed(5.0, 20.0)
    assert not [a for a in e.tick(14.9) if isinstance(a, ForgetMember)]
    e.heartbeat("a", 14.9)
    e.heartbeat("b", 14.9)
    gone = [a.peer_id for a in e.tick(15.0) if isinstance(a, ForgetMember)]
    assert gone == ["c"]


def test_a_rejoin_with_the_stream_still_open_is_connected_and_a_donor():
    e = _engine()
    for p in "abc":
        e.ready(p, 0, ReadyInfo(10, 1, 1, b"", 0, 0.0), 0.0)
    for p in "abc":
        e.vote(p, 0, e.running.plan.attempt, True, b"r", b"s", 0.1)
    e.tick(20.0)  # every lease ran out (e.g. judged on wall time after a stall)
    assert not e.members
    e.join("a", bytes(32), "127.0.0.1:1097", 1, 20.0, connected=True)
    e.join("b", bytes(32), "127.0.0.1:1098", 1, 20.0, connected=False)
    assert e.members["a"].connected and not e.members["b"].connected


def test_an_attempt_running_across_a_pause_is_retried_with_everyone():
    from shoal.coordinator.rounds import SendAbort, SendPlan

    e = _engine()
    for p in "abc":
        e.ready(p, 0, ReadyInfo(10, 1, 1, b"", 0, 0.0), 0.0)
    first = e.running.plan
    e.vote("a", 0, first.attempt, True, b"r", b"s", 0.1)  # b's and c's votes were lost in the pause
    acts = e.resumed(0.2, 20.0) + e.tick(0.3)  # after the retry backoff
    (abort,) = [a for a in acts if isinstance(a, SendAbort)]
    assert abort.record.excluded == () and abort.record.will_retry
    (retry,) = [a for a in acts if isinstance(a, SendPlan)]
    assert retry.plan.participants == first.participants and retry.plan.attempt == first.attempt + 1
