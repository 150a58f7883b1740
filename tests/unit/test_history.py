"""Bounded memory: the engine keeps a window of the history, the store all of it, and GetStatus
(`shoal status --recent N`) reads what the window does not hold from the store."""

from __future__ import annotations


from shoal.coordinator.rounds import EngineConfig, ReadyInfo, RoundEngine, SendAbort, SendCommit
from shoal.coordinator.daemon import CoordinatorConfig, open_state
from shoal.coordinator.server import CoordinatorService
from shoal.coordinator.store import MemoryStore, SQLiteStore
from shoal.v1 import shoal_pb2 as pb

from kits.service import service as coordinator_service

KEY = bytes(32)


def play(svc: CoordinatorService, rounds: int, t: float = 0.0) -> float:
    """Commit `rounds` rounds of peers a and b (one aborted attempt before each), applying every action."""
    e = svc.engine
    for _ in range(rounds):
        r = e.committed_rounds
        for p in "ab":
            svc.apply(e.ready(p, r, ReadyInfo(10, pb.FLOAT32, 1, e.last_state_digest, r, t), t))
        run = e.running
        acts = e.vote("a", r, run.plan.attempt, False, b"", b"", t, error="boom")
        assert any(isinstance(a, SendAbort) for a in acts)
        svc.apply(acts)
        t += 1.0
        for p in "ab":
            svc.apply(e.ready(p, r, ReadyInfo(10, pb.FLOAT32, 1, e.last_state_digest, r, t), t))
        run = e.running
        for p in run.plan.participants:
            acts = e.vote(p, r, run.plan.attempt, True, b"r", b"s%d" % r, t)
            svc.apply(acts)
        assert any(isinstance(a, SendCommit) for a in acts)
        t += 1.0
    return t


def service(store, window: int) -> CoordinatorService:
    e = RoundEngine(EngineConfig(min_peers=2, max_attempts=1, retry_backoff=0.0, lease_seconds=1e9,
                                 history_window=window))
    svc = coordinator_service(e, store=store, clock=0.0)
    for p in "ab":
        svc.apply(e.join(p, KEY, f"10.0.0.{p}:1", 1, 0.0))
        e.connected(p, 0.0)
    return svc


async def test_the_engine_keeps_a_window_and_status_reads_older_rounds_from_the_store():
    store = MemoryStore()
    svc = service(store, window=5)
    play(svc, 30)
    e = svc.engine
    assert e.committed_rounds == 30 and e.last_state_digest == b"s29"
    assert len(e.commits) == 5 and len(e.aborts) == 5  # bounded, however many rounds ran
    assert store.count_commits() == 30 and store.count_aborts() == 30  # the store has everything
    recent = await svc.GetStatus(pb.StatusRequest(recent_rounds=3), None)
    assert [(r.round, r.status) for r in recent.rounds] == [(28, "committed"), (29, "aborted"), (29, "committed")]
    deep = await svc.GetStatus(pb.StatusRequest(recent_rounds=20), None)
    committed = [r.round for r in deep.rounds if r.status == "committed"]
    assert len(deep.rounds) == 20 and committed == list(range(20, 30))  # beyond the window: from the store
    assert [r.state_digest for r in deep.rounds if r.status == "committed"][0] == b"s20"


def test_a_restarted_coordinator_loads_only_the_window(tmp_path):
    path = str(tmp_path / "state.db")
    store = SQLiteStore(path)
    play(service(store, window=4), 12)
    store.close()
    cfg = CoordinatorConfig(state_path=path, engine=EngineConfig(history_window=4))
    engine, store, _ = open_state(cfg, now=100.0)
    try:
        assert engine.committed_rounds == 12 and engine.last_state_digest == b"s11"
        assert [c.round for c in engine.commits] == [8, 9, 10, 11]
        assert store.count_commits() == 12
    finally:
        store.close()


def test_a_restarted_coordinator_waits_for_its_members_and_a_restarted_peer_is_no_donor():
    from shoal.coordinator.rounds import Member, MemberState, SendPlan

    cfg = EngineConfig(min_peers=2, ready_timeout=5.0, lease_seconds=60.0)
    known = [Member(p, KEY, f"10.0.0.{i}:1", 1, 0.0, MemberState.MEMBER) for i, p in enumerate("abcd")]
    e = RoundEngine(cfg, members=known, committed=[], now=100.0)
    for p in "ab":  # the first two back say ready: the round waits for c and d (they reconnect)
        acts = e.ready(p, 0, ReadyInfo(10, pb.FLOAT32, 1, b"", 0, 100.0), 100.0)
    assert not [a for a in acts if isinstance(a, SendPlan)] and e.waiting(101.0).peers == ("c", "d")
    # Up to the ready deadline only: then the round opens without them.
    (plan,) = [a for a in e.tick(105.0) if isinstance(a, SendPlan)]
    assert plan.plan.participants == ("a", "b")
    for p in "ab":
        e.vote(p, 0, plan.plan.attempt, True, b"r", b"s0", 105.5)
    assert e.donors(106.0) in (("a", "b"), ("b", "a"))
    # b is restarted (a new process: another data address): it no longer holds the state.
    e.join("b", KEY, "10.0.0.9:2", 1, 107.0)
    assert e.donors(107.0) == ("a",)
