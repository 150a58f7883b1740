"""The round engine's parts alone, without the engine: the running attempt's verdicts
(`coordinator.attempt`), the member table's waiting set and donors (`coordinator.member_table`),
and the sync orders owed until an attempt ends (`coordinator.sync_orders`)."""

from __future__ import annotations

from shoal.common.plan import Plan
from shoal.coordinator.attempt import Abort, Attempt, Tally, Vote
from shoal.coordinator.member_table import Member, MemberState, MemberTable
from shoal.coordinator.settings import RoundSettings
from shoal.coordinator.sync_orders import Head, SyncOrders

PEERS = ("a", "b", "c")
OK = Vote(True, b"r", b"s")


def attempt(**kw) -> Attempt:
    plan = Plan(PEERS, "butterfly", (0, 4, 8, 12), (0, 1, 2), num_elements=12, chunk_timeout_seconds=1.0, **kw)
    return Attempt(plan, started=0.0)


def test_an_attempt_commits_when_every_vote_agrees():
    a = attempt()
    assert a.record("a", OK, 0.1, blame_window=3.0) is Tally.PENDING
    assert a.record("b", OK, 0.2, blame_window=3.0) is Tally.PENDING
    assert a.record("c", OK, 0.3, blame_window=3.0) is Tally.COMMIT
    rec = a.commit_record(0.5)
    assert (rec.participants, rec.result_digest, rec.seconds) == (PEERS, b"r", 0.5)


def test_a_digest_disagreement_excludes_the_dissenter():
    a = attempt()
    a.record("a", OK, 0.1, blame_window=3.0)
    a.record("b", Vote(True, b"x", b"s"), 0.1, blame_window=3.0)
    # Two identical digests of three are a quorum: the dissenter is at fault beyond doubt (struck).
    assert a.record("c", OK, 0.1, blame_window=3.0) == Abort("digest mismatch", ("b",), struck=("b",))


def test_a_failure_naming_nobody_else_blames_the_voter_at_once():
    verdict = attempt().record("b", Vote(False, error="boom"), 0.1, blame_window=3.0)
    assert verdict == Abort("b failed: boom", ("b",))


def test_an_accusation_waits_for_the_blame_window_then_names_the_silent_peer():
    a = attempt()
    assert a.record("a", Vote(False, suspects=("c",), error="no chunk from c"), 1.0, blame_window=3.0) is Tally.PENDING
    assert a.blame_at == 4.0  # max(blame window, 2 x chunk deadline) after the accusation
    assert a.silent() == ("b", "c")
    verdict = a.blame(stale=(), unreachable=())
    assert "c" in verdict.excluded and "a" not in verdict.excluded and "no vote from" in verdict.reason


def test_a_relay_that_altered_a_chunk_excludes_nobody():
    a = attempt(relays=("", "r1", ""))
    verdict = a.record("a", Vote(False, suspects=("b",)), 0.1, blame_window=3.0, relay_failure="r1")
    assert isinstance(verdict, Abort) and verdict.excluded == () and "relay r1" in verdict.reason


def member(p: str, state=MemberState.MEMBER, lease=10.0) -> Member:
    return Member(p, b"k", f"{p}:1", 1, lease, state)


def test_the_table_waits_for_the_members_not_ready_and_forgets_expired_leases():
    t = MemberTable()
    for p in PEERS:
        t.add(member(p))
    t.refresh_all(not_counted={"a"})
    assert t.unready == {"b", "c"}
    t.refresh("b", counted=False)  # b said ready
    assert t.unready == {"c"}
    t.end_lease("c", 5.0)
    assert t.expired(5.0) == ["c"] and "c" not in t and t.live(5.0) == [t.members["a"], t.members["b"]]


def test_donors_rotate_over_the_live_holders_of_the_last_commit():
    t = MemberTable()
    for p in PEERS:
        t.add(member(p))
    t.members["c"].outbound_only = True  # nobody dials it: never a donor
    assert [t.donors(PEERS, 1.0, exclude="") for _ in range(3)] == [("a", "b"), ("b", "a"), ("a", "b")]
    assert t.donors(PEERS, 1.0, exclude="a") == ("b",)
    assert t.donors(PEERS, 20.0) == ()  # every lease ran out


def test_sync_orders_owed_during_an_attempt_follow_when_it_ends():
    t = MemberTable()
    for p in PEERS:
        t.add(member(p))
    t.add(member("late", MemberState.SYNCING))
    syncs = SyncOrders(RoundSettings(), t)
    syncs.owe("late", 2)
    syncs.owe("late", 1)  # an older Ready after a newer one: the newer state counts
    assert syncs.owed == {"late": 2}
    head = Head(3, b"d", PEERS)
    (order,) = syncs.settle(1.0, head)
    assert (order.peer_id, order.round, order.state_digest, set(order.donors)) == ("late", 3, b"d", set(PEERS))
    assert syncs.owed == {} and t.members["late"].state is MemberState.CATCHING_UP
    assert t.members["late"].sync_until > 1.0  # rounds wait for its download
    assert syncs.order(t.members["late"], 3, 1.0, Head(4, b"e", ())) is None  # no donor holds the head
