"""The engine's rewind: after every process of a swarm died, the run goes back to the newest
committed round a restarted peer holds (a checkpoint), and only then. Events in, actions out."""

from __future__ import annotations

from shoal.coordinator.rounds import (
    EngineConfig, ErrorKind, MemberState, PersistDurable, ReadyInfo, Rewind, RoundEngine, RoundError, SendCommit, SendPlan, SendSync,
)

from kits.engine import TEST_SETTINGS

KEY = bytes(32)


def digest(r: int) -> bytes:
    """The state digest after `r` committed rounds in these tests."""
    return b"s%d" % r


def ready(e: RoundEngine, p: str, rounds: int, now: float, d: bytes | None = None) -> list:
    """`p` says ready holding the state of `rounds` committed rounds; the engine's actions, [] for
    the PRECONDITION answer (no donor yet: the peer retries)."""
    try:
        return e.ready(p, rounds, ReadyInfo(10, 1, 1, digest(rounds) if d is None else d, rounds, now), now)
    except RoundError as exc:
        assert exc.kind is ErrorKind.PRECONDITION and "no live member holds" in str(exc)
        return []


def commit(e: RoundEngine, now: float) -> SendCommit:
    run = e.running
    acts = [a for p in run.plan.participants
            for a in e.vote(p, run.plan.round, run.plan.attempt, True, b"r", digest(run.plan.round + 1), now)]
    (c,) = [a for a in acts if isinstance(a, SendCommit)]
    return c


def of(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


def swarm(peers="abc", rounds=5, **kw) -> RoundEngine:
    """An engine that committed `rounds` rounds with `peers`."""
    e = RoundEngine(EngineConfig(**{**TEST_SETTINGS, **kw}))
    for i, p in enumerate(peers):
        e.join(p, KEY, f"127.0.0.1:{1000 + i}", 1, 0.0)
        e.connected(p, 0.0)
    t = 0.0
    for r in range(rounds):
        for p in peers:
            ready(e, p, r, t)
        commit(e, t + 0.1)
        t += 0.2
    assert e.committed_rounds == rounds
    return e


def restarted(e: RoundEngine, now: float, peers="abc", port=2000) -> RoundEngine:
    """The coordinator restarted on `e`'s durable state (as coordinator.daemon.open_state does),
    and `peers` restarted as new processes (new addresses), joined and connected at `now`."""
    e2 = RoundEngine(e.config, committed=list(e.commits), members=list(e.members.values()), now=now)
    for i, p in enumerate(peers):
        e2.join(p, KEY, f"127.0.0.1:{port + i}", 1, now)
        e2.connected(p, now)
    return e2


def test_a_restarted_swarm_goes_back_to_the_newest_recorded_round_a_peer_holds():
    e = restarted(swarm(), 100.0)
    assert ready(e, "a", 4, 100.1) == [] and ready(e, "b", 2, 100.2) == []  # c not heard yet: wait
    acts = ready(e, "c", 0, 100.3, d=b"fresh")
    (rw,) = of(acts, Rewind)
    assert (rw.rounds, rw.lost, rw.state_digest, rw.holders) == (4, 1, digest(4), ("a",))
    assert e.committed_rounds == 4 and e.last_state_digest == digest(4) and e.commits[-1].round == 3
    orders = {o.peer_id: o for o in of(acts, SendSync)}
    assert sorted(orders) == ["b", "c"] and all(o.donors == ("a",) and o.round == 4 for o in orders.values())
    # The synced peers say ready with round 4's state; round 4 is played again and commits.
    for p in "bc":
        acts = ready(e, p, 4, 101.0)
    (plan,) = of(acts, SendPlan)
    assert plan.plan.round == 4 and plan.plan.participants == ("a", "b", "c")
    assert commit(e, 101.5).record.round == 4 and e.committed_rounds == 5 and not e.behind


def test_no_rewind_while_a_live_member_holds_the_committed_state():
    e = swarm()
    e.join("c", KEY, "127.0.0.1:3000", 1, 10.0)  # c restarted from an old checkpoint; a and b live on
    e.connected("c", 10.0)
    acts = ready(e, "c", 2, 10.1)
    (order,) = of(acts, SendSync)
    assert order.round == 5 and set(order.donors) == {"a", "b"} and not of(acts, Rewind)
    assert e.committed_rounds == 5


def test_a_state_no_commit_recorded_is_no_target():
    e = restarted(swarm(), 100.0)
    for p in "abc":
        assert ready(e, p, 3, 100.1, d=b"another run") == []
    assert not of(e.tick(200.0), Rewind)
    assert e.committed_rounds == 5 and e.rewind_target(200.0) is None


def test_the_rewind_waits_for_silent_members_up_to_the_ready_timeout():
    e = restarted(swarm(), 100.0)
    assert ready(e, "a", 2, 100.1) == [] and ready(e, "b", 4, 100.2) == []
    # c's process is back (connected) but has not said where it stands: wait up to the ready timeout.
    assert not of(e.tick(102.0), Rewind)
    (rw,) = of(e.tick(100.1 + TEST_SETTINGS["ready_timeout"]), Rewind)
    assert (rw.rounds, rw.holders) == (4, ("b",))


def test_no_rewind_with_fewer_behind_than_the_quorum():
    e = restarted(swarm(min_peers=2), 100.0, peers="a")
    # b and c have not come back: until their leases (restored at the restart) end they may.
    assert [o.donors for o in of(ready(e, "a", 4, 100.1), SendSync)] == [("b", "c")]
    e.heartbeat("a", 109.0)
    e.tick(111.0)  # their leases ended; a's sync failed and it says ready again
    assert ready(e, "a", 4, 111.1) == [] and "a" in e.behind
    assert not of(e.tick(130.0), Rewind) and e.committed_rounds == 5


def test_a_restarted_member_on_the_same_address_is_no_donor_once_it_says_it_is_behind():
    e = swarm()
    e2 = RoundEngine(e.config, committed=list(e.commits), members=list(e.members.values()), now=100.0)
    for i, p in enumerate("abc"):  # the same addresses: each rejoins as the member it was
        e2.join(p, KEY, f"127.0.0.1:{1000 + i}", 1, 100.0)
        e2.connected(p, 100.0)
    assert e2.members["a"].state is MemberState.MEMBER
    # a, then b, get sync orders from the members that still look like donors; c finds none.
    assert of(ready(e2, "a", 3, 100.1), SendSync) and of(ready(e2, "b", 3, 100.1), SendSync)
    assert ready(e2, "c", 1, 100.1) == [] and e2.members["a"].state is not MemberState.MEMBER
    assert ready(e2, "a", 3, 100.5) == []  # its sync failed: nobody held that state
    (rw,) = of(ready(e2, "b", 3, 100.6), Rewind)
    assert (rw.rounds, rw.holders) == (3, ("a", "b"))


def ready_with_checkpoint(e: RoundEngine, p: str, rounds: int, now: float, ckpt: int, d: bytes | None = None):
    info = ReadyInfo(10, 1, 1, digest(rounds), rounds, now, checkpoint_round=ckpt,
                     checkpoint_digest=digest(ckpt) if d is None else d)
    return e.ready(p, rounds, info, now)


def test_a_checkpoint_of_a_committed_round_becomes_the_durable_round_once():
    e = swarm()
    ready_with_checkpoint(e, "a", 5, 10.0, 4)
    (d,) = e.durable_changed()
    assert (d.durable.round, d.durable.state_digest, d.durable.peers) == (4, digest(4), ("a",))
    assert e.durable_changed() == []  # said once
    ready_with_checkpoint(e, "a", 5, 10.1, 4)
    assert e.durable_changed() == []  # nothing new
    ready_with_checkpoint(e, "b", 5, 10.2, 4)
    assert e.durable_changed()[0].durable.peers == ("a", "b")
    ready_with_checkpoint(e, "c", 5, 10.3, 2)  # older: not the newest durable round
    ready_with_checkpoint(e, "c", 5, 10.3, 5, d=b"not the committed digest")
    assert e.durable_changed() == [] and e.durable.round == 4


def test_a_rewind_makes_the_state_it_goes_back_to_durable():
    e = restarted(swarm(), 100.0)
    ready(e, "a", 3, 100.1)
    ready(e, "b", 3, 100.2)
    acts = ready(e, "c", 3, 100.3)
    (rw,) = of(acts, Rewind)
    (d,) = of(acts, PersistDurable)
    assert (d.durable.round, d.durable.peers) == (3, ("a", "b", "c")) and e.durable == d.durable


def test_each_commit_elects_the_participants_with_the_best_upload_as_checkpointers():
    e = swarm(checkpointers=2)
    for p, up in zip("abc", (1e6, 9e6, 5e6)):
        e.report_links(p, up, 1e7, 0.01)
    for p in "abc":
        ready(e, p, 5, 10.0)
    assert commit(e, 10.1).checkpointers == ("b", "c")
    e.members["b"].outbound_only = True  # nobody dials it: others first
    assert e.elect_checkpointers(("a", "b", "c")) == ("a", "c")
    assert RoundEngine(EngineConfig(**{**TEST_SETTINGS, "checkpointers": 0})).elect_checkpointers(("x", "y")) == ("x", "y")
