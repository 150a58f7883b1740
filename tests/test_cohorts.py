"""Cohorts: each round's participants are K peers drawn from the ready ones; the others stay
members, learn of the commit and sync. Pure engine, explicit times, no sockets."""

from __future__ import annotations

from collections import Counter

import pytest

from shoal.config import ConfigError, load
from shoal.coordinator.rounds import (
    EngineConfig, MemberState, ReadyInfo, RoundEngine, SendAbort, SendCommit, SendPlan, SendSync, WaitReason,
    draw_cohort,
)

KEY = bytes(32)
PEERS = tuple("abcdefgh")


def test_a_draw_is_k_distinct_ready_peers_and_reproducible():
    pool = [f"p{i}" for i in range(20)]
    one = draw_cohort(pool, 5, seed=1, round_=3, attempt=0)
    assert len(set(one)) == 5 and set(one) <= set(pool) and list(one) == sorted(one)
    assert draw_cohort(reversed(pool), 5, seed=1, round_=3, attempt=0) == one  # order of the pool does not matter
    assert len({draw_cohort(pool, 5, seed=1, round_=r, attempt=0) for r in range(20)}) > 15
    assert draw_cohort(pool, 0, seed=1, round_=3, attempt=0) == tuple(sorted(pool))
    assert draw_cohort(pool[:3], 5, seed=1, round_=3, attempt=0) == tuple(sorted(pool[:3]))


def test_draws_are_uniform():
    pool = [f"p{i}" for i in range(10)]
    counts = Counter(p for r in range(2000) for p in draw_cohort(pool, 3, seed=7, round_=r, attempt=0))
    # Each peer is drawn with probability 3/10: 600 of 2000 expected, sd ~20.5.
    assert all(500 < counts[p] < 700 for p in pool), counts


def test_a_retry_keeps_the_survivors_and_refills_the_cohort():
    pool = [f"p{i}" for i in range(10)]
    first = draw_cohort(pool, 4, seed=0, round_=0, attempt=0)
    survivors = first[1:]
    retry = draw_cohort([p for p in pool if p != first[0]], 4, seed=0, round_=0, attempt=1, keep=survivors)
    assert len(retry) == 4 and set(survivors) < set(retry) and first[0] not in retry


def engine(k: int, **kw) -> RoundEngine:
    cfg = dict(min_peers=2, lease_seconds=1e6, ready_timeout=5.0, collective_timeout=30.0, max_attempts=3,
               retry_backoff=0.0, cohort_size=k, cohort_seed=3)
    cfg.update(kw)
    e = RoundEngine(EngineConfig(**cfg))
    for i, p in enumerate(PEERS):
        e.join(p, KEY, f"127.0.0.1:{1000 + i}", 1, 0.0)
        e.connected(p, 0.0)
    return e


def ready(e: RoundEngine, p: str, now: float, *, rounds: int | None = None, digest: bytes | None = None):
    r = e.committed_rounds if rounds is None else rounds
    d = e.last_state_digest if digest is None else digest
    return e.ready_(p, e.committed_rounds, ReadyInfo(10, 1, 1, d, r, now), now)


def commit(e: RoundEngine, now: float) -> tuple[SendCommit, list[SendSync]]:
    run = e.running
    acts = []
    for p in run.plan.participants:
        acts = e.vote(p, run.plan.round, run.plan.attempt, True, b"r", b"s%d" % run.plan.round, now)
    (c,) = [a for a in acts if isinstance(a, SendCommit)]
    return c, [a for a in acts if isinstance(a, SendSync)]


def test_the_round_waits_for_a_cohort_then_draws_k_of_the_ready_peers():
    e = engine(4)
    for p in "abc":
        assert ready(e, p, 0.1) == []
    w = e.waiting(0.2)
    assert w.reason is WaitReason.QUORUM and "quorum 4 = cohort size" in w.message
    for p in "defgh":
        acts = ready(e, p, 0.3)
    (plan,) = [a for a in acts if isinstance(a, SendPlan)]
    assert len(plan.plan.participants) == 4
    assert plan.plan.participants == draw_cohort(PEERS, 4, seed=3, round_=0, attempt=0)
    # The others stay ready (a retry may draw them) and keep their lease and state.
    left = set(PEERS) - set(plan.plan.participants)
    assert left <= set(e.ready) and all(e.members[p].state is MemberState.PENDING for p in left)


def test_non_participants_sync_and_every_peer_takes_part_over_the_rounds():
    e = engine(4)
    now = 0.0
    played: Counter[str] = Counter()
    for _ in range(30):
        r = e.committed_rounds
        for p in PEERS:
            acts = ready(e, p, now)
        plan = e.running.plan
        assert len(plan.participants) == 4 and plan.round == r
        played.update(plan.participants)
        c, syncs = commit(e, now + 0.5)
        assert c.record.participants == plan.participants
        # The ready peers left out hear of the commit as a sync order to it (fetch the new state
        # from the cohort), the others as the commit itself; nobody hears both.
        left_out = set(PEERS) - set(plan.participants)
        assert {s.peer_id for s in syncs} == left_out == set(c.synced)
        assert all(s.round == r + 1 and s.state_digest == c.record.state_digest
                   and set(s.donors) <= set(plan.participants) for s in syncs)
        assert all(e.members[p].state.waited_on for p in left_out)  # the next round waits for them
        now += 1.0
        # A stale Ready (the order was lost) gets the order again.
        p = sorted(left_out)[0]
        (again,) = [a for a in ready(e, p, now, rounds=r, digest=b"old") if isinstance(a, SendSync)]
        assert again.round == r + 1
    assert set(played) == set(PEERS) and all(n >= 5 for n in played.values()), played


def test_an_abort_retries_with_the_survivors_and_a_refilled_cohort():
    e = engine(4)
    for p in PEERS:
        ready(e, p, 0.0)
    first = e.running.plan.participants
    acts = e.vote(first[0], 0, e.running.plan.attempt, False, b"", b"", 1.0, error="boom")
    (abort,) = [a for a in acts if isinstance(a, SendAbort)]
    assert abort.record.will_retry and abort.record.excluded == (first[0],)
    (plan,) = [a for a in e.tick(1.0) if isinstance(a, SendPlan)]
    assert len(plan.plan.participants) == 4 and set(first[1:]) < set(plan.plan.participants)
    assert first[0] not in plan.plan.participants


def test_cohort_size_zero_is_every_ready_peer():
    e = engine(0)
    for p in PEERS:
        acts = ready(e, p, 0.0)
    (plan,) = [a for a in acts if isinstance(a, SendPlan)]
    assert plan.plan.participants == PEERS


def test_cohort_size_is_a_rounds_setting_seeded_by_the_run_seed():
    cfg = load(None, {"SHOAL_ROUNDS_COHORT_SIZE": "4", "SHOAL_RUN_SEED": "9"}, {})
    engine_cfg = cfg.rounds.to_engine_config(cfg.run)
    assert (engine_cfg.cohort_size, engine_cfg.cohort_seed) == (4, 9)
    with pytest.raises(ConfigError, match="cohort"):
        load(None, {}, {"rounds": {"cohort_size": -1}})


@pytest.mark.integration
def test_swarm_with_cohorts_commits_every_round_with_k_participants(tmp_path):
    import json
    import subprocess
    import sys

    from shoal.coordinator.store import SQLiteStore

    summary = tmp_path / "s.json"
    proc = subprocess.run(
        [sys.executable, "-m", "shoal.cli", "swarm", "--peers", "5", "--cohort-size", "3", "--rounds", "8",
         "--algorithm", "fedavg", "--summary", str(summary), "--no-progress", "--workdir", str(tmp_path / "wd")],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads(summary.read_text())
    assert s["rounds_committed"] == 8 and s["digest_mismatches"] == 0
    assert s["cohort_size"] == 3 and s["cohort_sizes"] == {"3": 8}
    assert s["state_syncs"] >= 2 * 7  # the two peers left out of a round sync to its commit
    with SQLiteStore.reader(str(tmp_path / "wd" / "coordinator.db")) as store:
        played = {p for c in store.load_commits() for p in c.participants}
    assert len(played) >= 4  # the draw varies (5 peers, 8 rounds: all 5 with high probability)
