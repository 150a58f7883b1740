"""Cohorts: each round's participants are K peers drawn from the ready ones; the others stay
members, learn of the commit and sync. Pure engine, explicit times, no sockets."""

from __future__ import annotations

from collections import Counter

import pytest

from shoal.config import ConfigError, load
from shoal.coordinator.cohorts import draw_cohort
from shoal.coordinator.rounds import (
    EngineConfig, MemberState, ReadyInfo, RoundEngine, SendAbort, SendCommit, SendPlan, SendSync, WaitReason,
)

from kits.engine import admit, engine as base_engine
from kits.service import service

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
    """PEERS admitted to a test engine that draws cohorts of k."""
    return admit(base_engine(**{"lease_seconds": 1e6, "cohort_size": k, "cohort_seed": 3, "cohort_timeout": 20.0,
                                **kw}), PEERS, key=KEY)


class Peer:
    """What a peer holds and does, as the engine sees it (state round and digest)."""

    def __init__(self, e: RoundEngine, name: str):
        self.e, self.name, self.round, self.digest = e, name, 0, b""

    def ready(self, now: float) -> list:
        return self.e.ready(self.name, self.round, ReadyInfo(10, 1, 1, self.digest, self.round, now), now)

    def sync(self, order: SendSync) -> None:
        self.round, self.digest = order.round, order.state_digest


def commit(e: RoundEngine, now: float) -> list:
    run = e.running
    acts = []
    for p in run.plan.participants:
        acts = e.vote(p, run.plan.round, run.plan.attempt, True, b"r", b"s%d" % run.plan.round, now)
    return acts


def test_the_round_waits_for_a_cohort_then_draws_k_of_the_ready_peers():
    e = engine(4)
    peers = {p: Peer(e, p) for p in PEERS}
    for p in "abc":
        assert peers[p].ready(0.1) == []
    w = e.waiting(0.2)
    assert w.reason is WaitReason.QUORUM and "quorum 4 = cohort size" in w.message
    for p in "defgh":
        acts = peers[p].ready(0.3)
    (plan,) = [a for a in acts if isinstance(a, SendPlan)]
    assert len(plan.plan.participants) == 4
    assert plan.plan.participants == draw_cohort(PEERS, 4, seed=3, round_=0, attempt=0)
    left = set(PEERS) - set(plan.plan.participants)
    assert left <= set(e.said_ready) and all(e.members[p].state is MemberState.PENDING for p in left)


def test_only_drawn_peers_sync_the_others_wait_in_the_pool_and_everyone_takes_part():
    e = engine(4)
    peers = {p: Peer(e, p) for p in PEERS}
    now = 0.0
    for p in PEERS:
        acts = peers[p].ready(now)
    played: Counter[str] = Counter()
    syncs = 0
    for r in range(40):
        plan = next(a for a in acts if isinstance(a, SendPlan)).plan
        assert plan.round == r and len(plan.participants) == 4
        played.update(plan.participants)
        now += 1.0
        acts = commit(e, now)
        (c,) = [a for a in acts if isinstance(a, SendCommit)]
        assert c.to == plan.participants  # the pool is told nothing
        assert not [a for a in acts if isinstance(a, SendSync)]
        assert set(PEERS) - set(plan.participants) <= set(e.said_ready)  # still pooled, with their old state
        # The cohort applies the commit and says ready again; then the next cohort is drawn.
        acts = []
        for p in plan.participants:
            peers[p].round, peers[p].digest = r + 1, c.record.state_digest
            acts += peers[p].ready(now)
        orders = [a for a in acts if isinstance(a, SendSync)]
        syncs += len(orders)
        cohort = e.cohort.members if e.cohort else next(a for a in acts if isinstance(a, SendPlan)).plan.participants
        # Exactly the drawn peers that hold an older state are told to sync.
        assert {o.peer_id for o in orders} == {p for p in cohort if peers[p].round != r + 1}
        for o in orders:
            assert o.round == r + 1 and set(o.donors) <= set(plan.participants)
            peers[o.peer_id].sync(o)
            acts += peers[o.peer_id].ready(now)
    assert set(played) == set(PEERS) and all(n >= 10 for n in played.values()), played
    assert syncs < 40 * 4  # only drawn peers sync: never the 4 left out of every round


def test_a_drawn_peer_that_does_not_come_is_replaced_after_the_cohort_timeout():
    e = engine(4, cohort_timeout=20.0)
    peers = {p: Peer(e, p) for p in PEERS}
    for p in PEERS:
        acts = peers[p].ready(0.0)
    first = next(a for a in acts if isinstance(a, SendPlan)).plan
    acts = commit(e, 1.0)
    c = next(a for a in acts if isinstance(a, SendCommit))
    acts = []
    for p in first.participants:
        peers[p].round, peers[p].digest = 1, c.record.state_digest
        acts += peers[p].ready(1.0)
    orders = [a for a in acts if isinstance(a, SendSync)]
    if not orders:
        pytest.skip("this draw picked only up-to-date peers")
    slow = orders[0].peer_id
    for o in orders[1:]:
        peers[o.peer_id].sync(o)
        peers[o.peer_id].ready(2.0)
    w = e.waiting(5.0)
    assert w.reason is WaitReason.SYNCING and w.peers == (slow,) and w.until == 21.0
    acts = e.tick(21.0)
    assert slow not in e.cohort.members if e.cohort else True
    drawn = [a for a in acts if isinstance(a, SendSync)]
    plans = [a for a in acts if isinstance(a, SendPlan)]
    # Its place went to another peer: an up-to-date one opens the round at once, a stale one is told to sync.
    assert plans or drawn
    if plans:
        assert slow not in plans[0].plan.participants and len(plans[0].plan.participants) == 4


def test_an_abort_retries_with_the_survivors_and_up_to_date_peers_of_the_pool():
    e = engine(4)
    peers = {p: Peer(e, p) for p in PEERS}
    for p in PEERS:
        peers[p].ready(0.0)
    first = e.running.plan.participants
    acts = e.vote(first[0], 0, e.running.plan.attempt, False, b"", b"", 1.0, error="boom")
    (abort,) = [a for a in acts if isinstance(a, SendAbort)]
    assert abort.record.will_retry and abort.record.excluded == (first[0],)
    assert set(abort.to) == set(first)  # the pool is not told
    (plan,) = [a for a in e.tick(1.0) if isinstance(a, SendPlan)]
    assert len(plan.plan.participants) == 4 and set(first[1:]) < set(plan.plan.participants)
    assert first[0] not in plan.plan.participants


def test_cohort_size_zero_is_every_ready_peer():
    e = engine(0)
    for p in PEERS:
        acts = Peer(e, p).ready(0.0)
    (plan,) = [a for a in acts if isinstance(a, SendPlan)]
    assert plan.plan.participants == PEERS


def test_cohort_size_is_a_rounds_setting_seeded_by_the_run_seed():
    cfg = load(None, {"SHOAL_ROUNDS_COHORT_SIZE": "4", "SHOAL_RUN_SEED": "9"}, {})
    engine_cfg = cfg.rounds.to_engine_config(cfg.run)
    assert (engine_cfg.cohort_size, engine_cfg.cohort_seed) == (4, 9)
    with pytest.raises(ConfigError, match="cohort"):
        load(None, {}, {"rounds": {"cohort_size": -1}})


# ------------------------------------------------------------------ the servicer: who is told what


async def test_the_servicer_tells_the_cohort_and_leaves_the_pool_alone():
    import asyncio

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from shoal.v1 import shoal_pb2 as pb

    now = [0.0]
    e = RoundEngine(EngineConfig(min_peers=2, lease_seconds=1e6, ready_timeout=5.0, cohort_size=3, cohort_seed=1,
                                 retry_backoff=0.0))
    svc = service(e, clock=now)
    peers = [f"{i:064x}" for i in range(6)]
    queues = {p: asyncio.Queue() for p in peers}
    for i, p in enumerate(peers):
        svc.apply(e.join(p, bytes([i + 1]) * 32, f"10.0.0.{i}:1", 1, 0.0))
        svc.watchers[p] = queues[p]
        e.connected(p, 0.0)

    async def ready(p: str, rounds: int, digest: bytes) -> pb.ReadyResponse:
        return await svc.Ready(pb.ReadyRequest(peer_id=p, round=rounds, num_elements=10, dtype=pb.FLOAT32,
                                               num_samples=1, state_digest=digest, state_round=rounds), None)

    for p in peers:
        await ready(p, 0, b"")
    cohort = e.running.plan.participants
    for p in cohort:
        svc.apply(e.vote(p, 0, e.running.plan.attempt, True, b"r", b"s0", 1.0))
    got = {p: [queues[p].get_nowait().WhichOneof("event") for _ in range(queues[p].qsize())] for p in peers}
    assert all(got[p] == ["plan", "commit"] for p in cohort)
    assert all(got[p] == [] for p in peers if p not in cohort)  # the pool hears nothing
    # A pooled peer that says ready with its old state is not told to sync (it waits to be drawn).
    pooled = next(p for p in peers if p not in cohort)
    answer = await ready(pooled, 0, b"")
    assert not answer.HasField("sync") and answer.pooled
    beat = await svc.Heartbeat(pb.HeartbeatRequest(peer_id=pooled), None)
    assert beat.pooled and beat.ready and beat.round == 1  # held in the pool: no need to announce again
    assert not (await svc.Heartbeat(pb.HeartbeatRequest(peer_id=cohort[0]), None)).pooled
    # The cohort comes back; the draw for round 1 orders the drawn stale peers to sync, on their
    # streams; a stale Ready of a drawn peer gets its order in the reply only.
    for p in cohort:
        await ready(p, 1, b"s0")
    drawn = e.cohort.members if e.cohort is not None else e.running.plan.participants
    stale = [p for p in drawn if p not in cohort]
    for p in stale:
        (ev,) = [queues[p].get_nowait() for _ in range(queues[p].qsize())]
        assert ev.WhichOneof("event") == "sync" and ev.sync.round == 1 and ev.sync.state_digest == b"s0"
        resp = await ready(p, 0, b"")
        assert resp.HasField("sync") and queues[p].empty()  # in the reply, not also on the stream
    # A joiner is not sent the state at join: it fetches it when drawn.
    joiner = Ed25519PrivateKey.generate()
    from shoal.common.identity import public_bytes

    resp = await svc.Join(pb.JoinRequest(public_key=public_bytes(joiner), data_address="10.0.0.9:1"), None)
    assert not resp.HasField("sync")
