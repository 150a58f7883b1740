"""The engine's O(1) checks agree with the full rules: after any sequence of events, the set of
members a round waits for (`MemberTable.unready`) is what the full scan finds, the cheap "cannot open" never
says no where `_decide` would open a round, and a round (a cohort's too) is never empty."""

from __future__ import annotations

import random

import pytest

from shoal.coordinator.rounds import EngineConfig, MemberState, ReadyInfo, RoundEngine, RoundError, _Opening

KEY = bytes(32)


def slow_unready(e: RoundEngine) -> set[str]:
    return {p for p, m in e.members.items()
            if (m.connected or (m.state is MemberState.CATCHING_UP and not m.streamed)) and m.state.waited_on
            and p not in e.said_ready and p not in e.excluded}


@pytest.mark.parametrize("seed", range(100))
def test_incremental_waiting_set_matches_the_full_scan(seed):
    rng = random.Random(seed)
    peers = [f"p{i}" for i in range(8)]
    e = RoundEngine(EngineConfig(min_peers=2, lease_seconds=3.0, ready_timeout=1.0, collective_timeout=2.0,
                                 max_attempts=3, retry_backoff=0.0, cohort_size=rng.choice([0, 3]), cohort_timeout=1.5,
                                 rounds=rng.choice([0, 6])))
    now = 0.0
    for _ in range(600):
        now += rng.choice([0.0, 0.01, 0.1, 0.5])
        p = rng.choice(peers)
        op = rng.random()
        try:
            if op < 0.1:
                e.join(p, KEY, f"h:{rng.randrange(2)}", 1, now)
            elif op < 0.2:
                e.connected(p, now)
            elif op < 0.25:
                e.disconnected(p, now)
            elif op < 0.3:
                e.leave(p, now)
            elif op < 0.45:
                e.heartbeat(p, now)
            elif op < 0.7:
                stale = rng.random() < 0.2
                digest = b"old" if stale else e.last_state_digest
                e.ready(p, e.committed_rounds, ReadyInfo(10, 1, 1, digest, e.committed_rounds, now), now)
            elif op < 0.85 and e.running is not None:
                run = e.running
                voter = rng.choice(run.plan.participants)
                ok = rng.random() < 0.9
                e.vote(voter, run.plan.round, run.plan.attempt, ok, b"r", b"s%d" % run.plan.round, now)
            else:
                e.tick(now)
                # The lease schedule drops exactly what a scan of every lease would.
                assert all(m.lease_expiry > now for m in e.members.values())
        except RoundError:
            pass
        assert all(p in e.leases for p in e.members)
        assert e.table.unready == slow_unready(e)
        if e.running is not None:
            k = e.config.cohort_size
            assert 0 < len(e.running.plan.participants) and (not k or len(e.running.plan.participants) <= k)
        if e._cannot_open(now):
            assert not isinstance(e._decide(now), _Opening)
