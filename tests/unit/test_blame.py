"""Blame: the rule (coordinator.blame) and the engine's use of it, without sockets.

The shapes of failure come from real runs (docs/fault-tolerance.md, "Blame"): a peer stalled
in the reduce-scatter or the all-gather, whose healthy neighbours accuse each other, and a
peer nobody can dial, which accuses everyone.
"""

from __future__ import annotations

from shoal.coordinator.blame import blame
from shoal.coordinator.rounds import EngineConfig, ReadyInfo, RoundEngine, SendAbort, SendPlan

KEY = bytes(32)
ABCD = ("a", "b", "c", "d")


# ---------------------------------------------------------------- the rule


def test_the_silent_participant_is_blamed_not_the_healthy_peer_others_waited_on():
    # d stalled (SIGSTOP) in the reduce-scatter: b, a shard owner, waited for d's rows and
    # timed out; a and c waited for b's reduced shard and timed out on b first.
    votes = {"a": ("b",), "b": ("d",), "c": ("b", "d")}
    assert blame(ABCD, votes) == ("d",)


def test_a_stalled_peer_is_blamed_even_when_nobody_accuses_it():
    # A ring: c waited for d (stalled), b waited for c (which stopped forwarding).
    assert blame(ABCD, {"a": (), "b": ("c",), "c": ("d",)}) == ("d",)


def test_the_peer_nobody_reaches_is_blamed_not_the_peers_it_accuses():
    # d's address drops packets: every stream to d fails, d hears from nobody.
    votes = {"a": ("d",), "b": ("d",), "c": ("d",), "d": ("a", "b", "c")}
    assert blame(ABCD, votes) == ("d",)


def test_an_accuser_of_many_is_blamed_even_when_accused_once():
    # Only a got as far as dialling d; d reports the three others silent.
    votes = {"a": ("d",), "b": (), "c": (), "d": ("a", "b", "c")}
    assert blame(ABCD, votes) == ("d",)


def test_one_accusation_among_many_voters_blames_only_the_accused():
    assert blame(ABCD, {"a": ("c",), "b": (), "c": (), "d": ()}) == ("c",)


def test_a_tie_is_broken_by_stale_leases_and_failed_dial_backs():
    votes = {"a": ("b",), "b": ("a",)}
    assert blame(("a", "b"), votes) == ("a", "b")
    assert blame(("a", "b"), votes, stale=("b",)) == ("b",)
    assert blame(("a", "b"), votes, unreachable=("a",)) == ("a",)


def test_votes_and_suspects_outside_the_attempt_are_ignored():
    votes = {"a": ("x", "c"), "b": ("c", "b"), "c": (), "x": ("a",)}
    assert blame(("a", "b", "c"), votes) == ("c",)


def test_no_accusation_at_all_falls_back_to_stale_peers_then_everyone():
    assert blame(("a", "b"), {"a": (), "b": ()}, stale=("b",)) == ("b",)
    assert blame(("a", "b"), {"a": (), "b": ()}) == ("a", "b")


# ---------------------------------------------------------------- in the engine


def _running(peers=ABCD, **kw) -> RoundEngine:
    cfg = dict(min_peers=2, lease_seconds=10.0, ready_timeout=5.0, collective_timeout=30.0, max_attempts=3,
               retry_backoff=0.0, chunk_timeout=2.0)
    cfg.update(kw)
    e = RoundEngine(EngineConfig(**cfg))
    for p in peers:
        e.join(p, KEY, f"127.0.0.1:{1000 + ord(p)}", 1, 0.0)
        e.connected(p, 0.0)
    acts = [a for p in peers for a in e.ready(p, 0, ReadyInfo(100, 1, 1, b"", 0, 0.0), 0.0)]
    assert [a for a in acts if isinstance(a, SendPlan)]
    return e


def _aborts(acts) -> list[SendAbort]:
    return [a for a in acts if isinstance(a, SendAbort)]


def test_engine_waits_for_the_other_votes_before_blaming():
    e = _running()
    t = 1.0
    assert e.vote("a", 0, 0, False, b"", b"", t, suspects=("b",), error="no chunk from b") == []
    assert e.vote("b", 0, 0, False, b"", b"", t + 0.1, suspects=("d",), error="no chunk from d") == []
    assert e.vote("c", 0, 0, False, b"", b"", t + 0.2, suspects=("b",)) == []
    window = e.running.blame_at
    assert window >= t + 2 * e.running.plan.chunk_timeout_seconds
    assert _aborts(e.tick(window - 0.01)) == []
    (abort,) = _aborts(e.tick(window))
    assert abort.record.excluded == ("d",) and abort.record.will_retry
    assert "no vote from" in abort.record.reason
    retry = e.running
    assert retry is not None and set(retry.plan.participants) == {"a", "b", "c"}


def test_engine_decides_at_once_when_every_participant_voted():
    e = _running()
    acts = []
    for p in "abc":
        acts += e.vote(p, 0, 0, False, b"", b"", 1.0, suspects=("d",), error="stream to d broke")
    assert _aborts(acts) == []
    (abort,) = _aborts(e.vote("d", 0, 0, False, b"", b"", 1.1, suspects=("a", "b", "c"), error="no chunk"))
    assert abort.record.excluded == ("d",)


def test_engine_blames_a_confessing_voter_at_once():
    e = _running()
    (abort,) = _aborts(e.vote("c", 0, 0, False, b"", b"", 1.0, error="aggregator raised"))
    assert abort.record.excluded == ("c",)


def test_a_late_ok_vote_counts_in_the_window():
    # b finished before d stalled (it had everything it needed): its ok vote is a vote.
    e = _running()
    e.vote("a", 0, 0, False, b"", b"", 1.0, suspects=("d",))
    e.vote("b", 0, 0, True, b"r", b"s", 1.0)
    (abort,) = _aborts(e.vote("c", 0, 0, False, b"", b"", 1.1, suspects=("b",)) + e.tick(e.running.blame_at))
    assert abort.record.excluded == ("d",)


def test_a_stale_lease_settles_a_tie_between_two_accusers():
    e = _running(("a", "b", "c"))
    t = 6.0  # a and c renewed their leases; b went quiet after its Ready at 0
    for p in "ac":
        e.heartbeat(p, t)
    e.vote("a", 0, 0, False, b"", b"", t, suspects=("b",))
    e.vote("c", 0, 0, True, b"r", b"s", t)
    (abort,) = _aborts(e.vote("b", 0, 0, False, b"", b"", t, suspects=("a",)))
    assert abort.record.excluded == ("b",)


def test_an_unreachable_member_takes_part_outbound_only_and_is_no_donor():
    e = RoundEngine(EngineConfig(min_peers=2, ready_timeout=5.0, retry_backoff=0.0))
    for p in ABCD:
        e.join(p, KEY, f"127.0.0.1:{1000 + ord(p)}", 1, 0.0, reachable=p != "d")
        e.connected(p, 0.0)
    acts = [a for p in "abcd" for a in e.ready(p, 0, ReadyInfo(100, 1, 1, b"", 0, 0.0), 0.1)]
    (plan,) = [a for a in acts if isinstance(a, SendPlan)]  # d is waited on: it takes part
    assert set(plan.plan.participants) == set(ABCD)
    d = plan.plan.position("d")
    assert plan.plan.outbound_only == (d,) and d not in plan.plan.shard_owner
    assert plan.plan.collective == "butterfly"
    for p in ABCD:
        e.vote(p, 0, plan.plan.attempt, True, b"r", b"s", 0.2)
    assert "d" not in e.donors(0.3) and set(e.donors(0.3)) == {"a", "b", "c"}


def test_round_zero_waits_for_an_unreachable_initial_peer_which_takes_part():
    e = RoundEngine(EngineConfig(min_peers=2, initial_peers=4, ready_timeout=5.0))
    for p in ABCD:
        e.join(p, KEY, f"127.0.0.1:{1000 + ord(p)}", 1, 0.0, reachable=p != "d")
        e.connected(p, 0.0)
    acts = [a for p in "abc" for a in e.ready(p, 0, ReadyInfo(100, 1, 1, b"", 0, 0.0), 0.1)]
    assert not [a for a in acts if isinstance(a, SendPlan)]  # d counts towards initial_peers
    acts = e.ready("d", 0, ReadyInfo(100, 1, 1, b"", 0, 0.0), 0.1)
    (plan,) = [a for a in acts if isinstance(a, SendPlan)]
    assert set(plan.plan.participants) == set(ABCD)
    assert [plan.plan.participants[i] for i in plan.plan.outbound_only] == ["d"]
    # The same peer from an address that answers counts again.
    e2 = RoundEngine(EngineConfig(min_peers=2, initial_peers=4, ready_timeout=5.0))
    for p in ABCD:
        e2.join(p, KEY, f"127.0.0.1:{1000 + ord(p)}", 1, 0.0, reachable=False)
        e2.join(p, KEY, f"127.0.0.1:{2000 + ord(p)}", 1, 0.0, reachable=True)
        e2.connected(p, 0.0)
    assert not e2.unreachable


def test_a_short_stall_in_a_ring_blames_the_stalled_peer_not_the_chain_behind_it():
    # Seen on a loaded machine: peer 2 stopped ~2 s in the all-gather of a ring 0 <- 3 <- 1 <- 2,
    # resumed within the window and voted last, accusing peer 1 (which had given up already).
    votes = {"p1": ("p2",), "p3": ("p1",), "p0": ("p3",), "p2": ("p1",)}
    at = {"p1": 1.0, "p3": 1.1, "p0": 1.2, "p2": 3.5}
    assert blame(("p0", "p1", "p2", "p3"), votes, voted_at=at) == ("p2",)
    assert blame(("p0", "p1", "p2", "p3"), votes) != ("p2",)  # by counts alone, peer 1 would pay


def test_a_waiting_owner_is_excused_by_its_own_earlier_accusation():
    # Butterfly: a waited for owner b's shard, b waited for d's rows; d resumed and voted last.
    votes = {"a": ("b",), "b": ("d",), "c": ("d",), "d": ("a", "b")}
    at = {"a": 1.0, "b": 1.05, "c": 1.1, "d": 2.9}
    assert blame(ABCD, votes, voted_at=at) == ("d",)


def test_a_cut_off_peer_is_blamed_whatever_the_order_of_votes():
    votes = {"a": ("d",), "b": ("d",), "c": ("d",), "d": ("a", "b", "c")}
    for order in (("d", "a", "b", "c"), ("a", "d", "b", "c"), ("a", "b", "c", "d")):
        at = {p: float(i) for i, p in enumerate(order)}
        assert blame(ABCD, votes, voted_at=at) == ("d",), order


def test_among_silent_peers_the_one_that_stopped_heartbeating_is_blamed():
    # Seen on a loaded machine: p0 was blocked sending to the stalled p2 (flow control) and did
    # not vote within the window either; it kept heartbeating, p2 did not.
    votes = {"p1": ("p2",), "p3": ("p1",)}
    peers = ("p0", "p1", "p2", "p3")
    assert blame(peers, votes, stale=("p2",)) == ("p2",)
    assert blame(peers, votes) == ("p2",)  # no lease signal yet: the accused among the silent
    assert blame(peers, {"p1": (), "p3": ()}) == ("p0", "p2")  # nothing else to go on


def test_engine_blames_the_silent_peer_whose_heartbeats_stopped():
    e = _running()
    for t in (2.5, 5.0):  # a, b, c renew their leases; d stalled after its Ready at 0
        for p in "abc":
            e.heartbeat(p, t)
    e.vote("b", 0, 0, False, b"", b"", 5.5, suspects=("d",))
    e.vote("c", 0, 0, False, b"", b"", 5.6, suspects=("b",))
    (abort,) = _aborts(e.tick(e.running.blame_at))  # a is silent too (blocked sending to d)
    assert abort.record.excluded == ("d",)


def test_the_first_cascade_of_failures_is_credible_in_any_order():
    # Seen on a loaded machine (ring, rs:stop): p3 waited on p1, p1 on p0, p0 on the stalled p2;
    # the three voted within ms, p1 last of them; p2 came back 3 s later accusing p3.
    votes = {"p0": ("p2",), "p3": ("p1",), "p1": ("p0",), "p2": ("p3",)}
    at = {"p0": 1.00, "p3": 1.01, "p1": 1.02, "p2": 4.0}
    peers = ("p0", "p1", "p2", "p3")
    assert blame(peers, votes, voted_at=at, cascade=2.0) == ("p2",)
    assert blame(peers, votes, voted_at=at) != ("p2",)  # by arrival order alone, p1 would pay
