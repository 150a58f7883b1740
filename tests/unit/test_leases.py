"""coordinator.leases: the lease schedule returns exactly the members a full scan would drop,
renewals cost it nothing, and superseded entries never drop a member early."""

from __future__ import annotations

import random

import pytest

from shoal.coordinator.leases import LeaseSchedule


def test_returns_expired_members_earliest_first_and_forgets_them():
    s = LeaseSchedule()
    deadlines = {"b": 3.0, "a": 1.0, "c": 3.0, "d": 9.0}
    for p, t in deadlines.items():
        s.note(p, t)
    assert s.expired(0.5, deadlines.get) == []
    assert s.expired(3.0, deadlines.get) == ["a", "b", "c"]  # by deadline, ties by peer id
    assert len(s) == 1 and "d" in s and "a" not in s
    assert s.expired(3.0, deadlines.get) == []


def test_a_renewal_needs_no_note_and_pushes_one_entry_per_period():
    s = LeaseSchedule()
    deadline = {"a": 10.0}
    s.note("a", 10.0)
    for now in range(1, 100):  # a heartbeat every second, lease 10 s
        deadline["a"] = now + 10.0
        assert s.expired(float(now), deadline.get) == []
        assert s.entries == 1  # renewals never add entries
    assert s.expired(108.9, deadline.get) == []
    assert s.expired(109.0, deadline.get) == ["a"]


def test_a_deadline_moved_earlier_is_noted_and_the_old_entry_is_ignored():
    s = LeaseSchedule()
    deadline = {"a": 10.0}
    s.note("a", 10.0)
    deadline["a"] = 2.0  # e.g. the member left
    s.note("a", 2.0)
    assert s.expired(2.0, deadline.get) == ["a"]
    # It joins again with a lease to 10.0: the stale entry at 10.0 and the new one coincide.
    deadline["a"] = 10.0
    s.note("a", 10.0)
    deadline["a"] = 20.0  # renewed
    assert s.expired(10.0, deadline.get) == []
    assert "a" in s
    assert s.expired(20.0, deadline.get) == ["a"]
    assert s.entries == 0


def test_a_gone_member_leaves_the_schedule_silently():
    s = LeaseSchedule()
    s.note("a", 1.0)
    assert s.expired(5.0, lambda p: None) == []
    assert len(s) == 0 and s.entries == 0


@pytest.mark.parametrize("seed", range(50))
def test_agrees_with_a_full_scan(seed):
    rng = random.Random(seed)
    s = LeaseSchedule()
    deadline: dict[str, float] = {}
    now = 0.0
    for _ in range(2000):
        now += rng.choice([0.0, 0.1, 0.5, 2.0])
        p = f"p{rng.randrange(30)}"
        op = rng.random()
        if op < 0.2:  # join (or rejoin): a fresh lease
            deadline[p] = now + rng.choice([1.0, 5.0])
            s.note(p, deadline[p])
        elif op < 0.6 and p in deadline and deadline[p] > now:  # renewal (only ever later): not noted
            deadline[p] = max(deadline[p], now + rng.choice([1.0, 5.0]))
        elif op < 0.65 and p in deadline:  # leave: moved earlier, noted
            deadline[p] = now
            s.note(p, now)
        elif op < 0.7:
            deadline.pop(p, None)  # dropped elsewhere (e.g. a heartbeat without a live lease)
        full = sorted((t, q) for q, t in deadline.items() if t <= now)
        got = s.expired(now, deadline.get)
        assert got == [q for _, q in full]
        for q in got:
            del deadline[q]
        assert all(q in s for q in deadline)
