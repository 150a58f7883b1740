"""The link rules of docs/performance.md ("Links"), one test each, without sockets: deadlines from
rates (never a floor a slow link cannot meet), deadlines that grow for a round that keeps timing
out, estimates that passive samples can lower, and the re-probe after a slow collective."""

from __future__ import annotations

import pytest

from shoal.common.plan import Plan
from shoal.coordinator.planner import (MAX_DEADLINE_SCALE, LinkSpec, PlanPolicy, attempt_deadline, chunk_deadline,
                                       conservative_seconds, plan_round)
from shoal.coordinator.rounds import DeadlineGrowth, EngineConfig, ReadyInfo, RoundEngine, SendAbort, SendPlan
from shoal.peer.links import REPROBE_SECONDS, LinkMeter

MBIT = 1e6 / 8
STATE = 2_457_620  # float32 elements: the 9.8 MB state of `--hidden 16384`


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


# ------------------------------------------------------------------ deadlines from rates


def test_slow_links_get_deadlines_their_transfers_can_meet():
    """3 peers at 20 Mbit/s and a 9.8 MB state: a butterfly's first all-gather chunk waits behind
    its owner's whole reduce-scatter (more than 2 s at this rate); the deadline covers it."""
    policy = PlanPolicy()
    slow = [LinkSpec(p, 20 * MBIT, 20 * MBIT, 0.01) for p in "abc"]
    plan = plan_round(slow, STATE, 1, policy)
    assert isinstance(plan, Plan)
    owner_rs = STATE * 4 * (2 / 3) / (20 * MBIT)  # what one peer uploads in the reduce-scatter
    assert owner_rs > policy.chunk_timeout  # the old fixed floor could not be met
    assert plan.chunk_timeout_seconds > owner_rs
    assert plan.deadline_seconds >= max(policy.collective_timeout, policy.chunk_safety * plan.predicted_seconds)
    # Slower links, longer deadlines: no fixed value caps them.
    slower = plan_round([LinkSpec(p, 4 * MBIT, 4 * MBIT, 0.01) for p in "abc"], STATE, 1, policy)
    assert slower.chunk_timeout_seconds > 4 * plan.chunk_timeout_seconds
    assert slower.deadline_seconds > plan.deadline_seconds


def test_unreported_links_count_as_slow_for_deadlines_only():
    policy = PlanPolicy()
    unknown = [LinkSpec(p, 0.0, 0.0) for p in "abc"]
    plan = plan_round(unknown, STATE, 1, policy)
    assert plan.predicted_seconds == 0.0 and plan.collective == "butterfly"  # the layout is the static one
    expected = conservative_seconds(unknown, STATE, 4, policy)
    assert expected == pytest.approx(STATE * 4 * (1 + 1 / 3) / policy.assumed_link)
    assert plan.chunk_timeout_seconds == pytest.approx(
        chunk_deadline(unknown, policy, plan.chunk_bytes, expected_seconds=expected))
    # One unreported peer among fast ones: its link is assumed slow, not the median of the others.
    mixed = [LinkSpec("a", 1e9, 1e9), LinkSpec("b", 1e9, 1e9), LinkSpec("c", 0.0, 0.0)]
    assert chunk_deadline(mixed, policy, 1 << 20) == pytest.approx(policy.chunk_safety * (1 << 20) / policy.assumed_link)
    assert chunk_deadline(mixed[:2], policy, 1 << 20) == policy.chunk_timeout  # fast and measured: the floor


def test_deadline_scale_is_bounded():
    policy = PlanPolicy()
    links = [LinkSpec(p, 20 * MBIT, 20 * MBIT) for p in "ab"]
    base = chunk_deadline(links, policy, 1 << 20)
    assert chunk_deadline(links, policy, 1 << 20, scale=2.0) == pytest.approx(2 * base)
    assert chunk_deadline(links, policy, 1 << 20, scale=1000.0) == pytest.approx(MAX_DEADLINE_SCALE * base)
    assert attempt_deadline(policy, 1.0, base, scale=0.1) == attempt_deadline(policy, 1.0, base)


# ------------------------------------------------------------------ growth on repeated timeouts


def test_growth_starts_at_the_second_consecutive_timeout_and_is_capped():
    g = DeadlineGrowth()
    timeout = "a1b2c3d4 failed: no chunk from e5f6a7b8 within 2.0s (phase 2, step 0, shard 0, offset 0)"
    assert g.on_abort(0, timeout) is None and g.scale == 1.0  # one timeout may be a stalled peer
    line = g.on_abort(0, timeout)
    assert g.scale == 2.0 and line is not None and "timed out 2 times" in line and "x2" in line
    assert g.on_abort(0, "collective deadline passed") is not None and g.scale == 4.0
    g.on_abort(0, timeout)
    assert g.scale == 8.0
    assert g.on_abort(0, timeout) is None and g.scale == MAX_DEADLINE_SCALE  # capped, not logged again
    assert g.on_abort(0, "digest mismatch") is None and g.scale == MAX_DEADLINE_SCALE  # other aborts: streak broken
    assert g.on_abort(0, timeout) is None  # a new streak: its first timeout does not grow
    g.on_commit()
    assert g.scale == 4.0  # a commit halves it: the slow link may still be slow
    assert g.on_abort(1, timeout) is None and g.on_abort(1, timeout) is not None and g.scale == 8.0


def test_engine_plans_retries_of_a_timing_out_round_with_longer_deadlines():
    e = RoundEngine(EngineConfig(min_peers=2, lease_seconds=600.0, ready_timeout=5.0, max_attempts=10,
                                 retry_backoff=0.0))
    for p in "abcd":
        e.join(p, bytes(32), f"127.0.0.1:{1000 + ord(p)}", 1, 0.0)
        e.connected(p, 0.0)
        e.report_links(p, 20 * MBIT, 20 * MBIT, 0.01, now=0.0)
    acts = []
    for p in "abcd":
        acts += e.ready(p, 0, ReadyInfo(STATE, 1, 1, b"", 0, 0.0), 0.0)
    now, seen = 0.0, []
    for _ in range(3):
        plans = [a.plan for a in acts if isinstance(a, SendPlan)]
        now += 1.0
        (plan,) = plans or [a.plan for a in e.tick(now) if isinstance(a, SendPlan)]
        seen.append(plan)
        silent = plan.participants[-1]
        acts = []
        for voter in plan.participants[:-1]:  # everyone but the silent peer accuses it
            acts += e.vote(voter, 0, plan.attempt, False, b"", b"", now, suspects=(silent,),
                           error=f"no chunk from {silent[:8]} within 9.9s")
        if not acts:  # an accusation opens the blame window (coordinator/blame.py); it closes at a tick
            now += max(e.config.blame_window, 2.0 * plan.chunk_timeout_seconds) + 0.1
            acts = e.tick(now)
        assert [a for a in acts if isinstance(a, SendAbort)]
        acts = [a for a in acts if isinstance(a, SendPlan)]  # a retry planned in the same tick
    # After one timeout abort the retry is planned as usual; after a second one, twice as long.
    for plan, scale in zip(seen, (1.0, 1.0, 2.0)):
        links = [e.members[p].link() for p in plan.participants]
        expected = plan_round(links, STATE, 1, e.policy, deadline_scale=scale)
        assert plan.chunk_timeout_seconds == pytest.approx(expected.chunk_timeout_seconds)
        assert plan.deadline_seconds == pytest.approx(expected.deadline_seconds)
        unscaled = plan_round(links, STATE, 1, e.policy)
        assert plan.chunk_timeout_seconds == pytest.approx(scale * unscaled.chunk_timeout_seconds)


# ------------------------------------------------------------------ estimates that follow the link


def test_saturated_samples_lower_an_estimate_and_waiting_samples_do_not():
    clock = Clock()
    m = LinkMeter(alpha=0.5, clock=clock)
    m.observe_probe("b", rtt=0.001, up=100 * MBIT, down=100 * MBIT)
    m.observe_probe("c", rtt=0.001, up=100 * MBIT, down=100 * MBIT)
    m.observe_collective(20_000_000, 20_000_000, 1.6)  # 100 Mbit/s over the whole collective
    # 10 Mbit/s while waiting on others (most of the stream's time was not spent sending): no change.
    m.observe_send("b", 10_000_000, 8.0, busy_bytes=1_000_000, busy_seconds=0.1)
    assert m.links()[0].up_bytes_per_s == 100 * MBIT
    # 10 Mbit/s while data was queued the whole time: the link is that slow now.
    m.observe_send("b", 10_000_000, 8.0, busy_bytes=9_000_000, busy_seconds=7.2)
    b, c = m.links()
    assert b.up_bytes_per_s == pytest.approx(10 * MBIT) and c.up_bytes_per_s == 100 * MBIT
    # The other link is still fast: the peer's own upload is (the slow end is b's).
    assert m.aggregate()[0] == 100 * MBIT
    m.observe_send("c", 10_000_000, 8.0, busy_bytes=9_000_000, busy_seconds=7.2)
    # Every link slow: so is the peer, and the whole-collective rate from before no longer holds it up.
    assert m.aggregate()[0] == pytest.approx(10 * MBIT)
    # A faster saturated sample moves it back up (both ways), and a probe replaces it.
    m.observe_send("c", 10_000_000, 8.0, busy_bytes=9_000_000, busy_seconds=3.6)
    assert 10 * MBIT < m.links()[1].up_bytes_per_s < 20 * MBIT
    m.observe_probe("c", up=50 * MBIT, down=50 * MBIT)
    assert m.links()[1].up_bytes_per_s == 50 * MBIT


def test_a_probe_lowers_an_estimate_that_passive_samples_raised():
    m = LinkMeter(alpha=0.5, clock=Clock())
    m.observe_probe("b", up=10 * MBIT, down=10 * MBIT)
    m.observe_send("b", 20_000_000, 1.6)  # 100 Mbit/s observed: raises
    assert m.links()[0].up_bytes_per_s == pytest.approx(100 * MBIT)
    m.observe_probe("b", up=10 * MBIT, down=10 * MBIT)  # the link now: 10
    assert m.links()[0].up_bytes_per_s == pytest.approx(10 * MBIT)


def test_a_slow_collective_makes_its_links_due_for_a_probe_at_most_every_reprobe_interval():
    clock = Clock()
    m = LinkMeter(clock=clock)
    for p in "bcd":
        m.observe_probe(p, up=100 * MBIT, down=100 * MBIT)
    clock.t = REPROBE_SECONDS + 1
    assert m.after_collective("abcd", "a", 1.4, 1.0) == []  # within 1.5x of the prediction
    assert m.after_collective("abcd", "a", 9.0, 0.0) == []  # nothing predicted: nothing to compare
    assert m.after_collective("abcd", "a", 0.05, 0.002) == []  # 25x, but milliseconds (loopback): noise
    assert not any(m.needs_probe(p) for p in "bcd")
    assert m.after_collective("abcd", "a", 7.5, 0.9) == ["b", "c", "d"]
    assert all(m.needs_probe(p) for p in "bcd")
    m.observe_probe("b", up=10 * MBIT, down=10 * MBIT)
    assert not m.needs_probe("b")
    assert m.after_collective("abcd", "a", 7.5, 0.9) == []  # b just probed, c and d already due
    clock.t += REPROBE_SECONDS + 1
    assert m.after_collective("ab", "a", 7.5, 0.9) == ["b"]


def test_links_report_their_age():
    clock = Clock()
    m = LinkMeter(clock=clock)
    m.observe_probe("b", up=MBIT, down=MBIT)
    clock.t = 12.0
    assert m.links()[0].age_seconds == 12.0
    e = RoundEngine(EngineConfig())
    e.join("b", bytes(32), "127.0.0.1:1", 1, 0.0)
    assert e.members["b"].links_at is None
    e.report_links("b", MBIT, MBIT, 0.01, now=5.0)
    assert e.members["b"].links_at == 5.0
