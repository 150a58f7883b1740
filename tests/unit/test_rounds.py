"""The round state machine, without sockets: events in, actions out."""

from __future__ import annotations

import dataclasses

import pytest

from shoal.coordinator.planner import SETUP_ROUND_TRIPS
from shoal.coordinator.rounds import (
    EngineConfig, ErrorKind, MemberState, PersistUntrusted, ReadyInfo, RoundEngine, RoundError, SendAbort, SendCommit,
    SendFinished, SendPlan, SendSync, WaitReason, sync_plan,
)

from kits.engine import engine

KEY = bytes(32)


def info(n=10, digest=b"", rounds=0, at=0.0, samples=1):
    return ReadyInfo(n, 1, samples, digest, rounds, at)


def joined(e: RoundEngine, *peers: str, now=0.0) -> None:
    for p in peers:
        e.join(p, KEY, f"127.0.0.1:{1000 + len(p)}", 1, now)
        e.connected(p, now)


def of(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


def accuse(e: RoundEngine, suspect: str, now: float, error: str = "no chunk") -> list:
    """Every participant but `suspect` votes failed accusing it; `suspect` stays silent until the
    blame window closes (the engine's actions until then, the abort included)."""
    run = e.running
    acts = []
    for p in run.plan.participants:
        if p != suspect:
            acts += e.vote(p, run.plan.round, run.plan.attempt, False, b"", b"", now, suspects=(suspect,),
                           error=error)
    assert of(acts, SendAbort) == []  # the suspect has not voted: the window is open
    return acts + e.tick(run.blame_at)


def test_round_opens_when_all_ready_and_commits_on_equal_digests():
    e = engine()
    joined(e, "a", "b", "c")
    assert e.ready("a", 0, info(), 0.1) == []
    assert e.ready("b", 0, info(), 0.2) == []  # c is live and not ready yet: wait
    acts = e.ready("c", 0, info(), 0.3)
    (plan,) = of(acts, SendPlan)
    assert plan.plan.participants == ("a", "b", "c")
    assert plan.plan.shard_bounds == (0, 3, 6, 10)
    assert e.epoch == 1  # pending joiners became members at the boundary
    for p in ("a", "b"):
        assert e.vote(p, 0, 0, True, b"r", b"s", 1.0) == []
    (commit,) = of(e.vote("c", 0, 0, True, b"r", b"s", 1.1), SendCommit)
    assert commit.record.round == 0 and commit.record.state_digest == b"s"
    assert e.committed_rounds == 1 and e.running is None


def test_straggler_left_out_after_ready_timeout_keeps_lease():
    e = engine()
    joined(e, "a", "b", "c")
    e.ready("a", 0, info(), 0.0)
    e.ready("b", 0, info(), 0.0)
    assert of(e.tick(4.9), SendPlan) == []
    e.heartbeat("c", 4.9)
    (plan,) = of(e.tick(5.0), SendPlan)
    assert plan.plan.participants == ("a", "b")
    assert "c" in e.members


def test_failed_vote_aborts_excludes_suspect_and_retries_with_survivors():
    e = engine()
    joined(e, "a", "b", "c")
    for p in "abc":
        e.ready(p, 0, info(), 0.0)
    acts = accuse(e, "b", 1.0, error="stream broke")
    (abort,) = of(acts, SendAbort)
    assert abort.record.excluded == ("b",) and abort.record.will_retry
    (plan,) = of(acts, SendPlan)  # the tick that aborted opened the retry
    assert plan.plan.attempt == 1 and plan.plan.participants == ("a", "c")
    assert e.vote("b", 0, 0, True, b"r", b"s", 1.1) == []  # late vote of the old attempt is ignored
    e.vote("a", 0, 1, True, b"r", b"s", 1.2)
    (commit,) = of(e.vote("c", 0, 1, True, b"r", b"s", 1.3), SendCommit)
    assert commit.record.participants == ("a", "c") and commit.record.attempt == 1


def test_digest_mismatch_aborts_and_excludes_minority():
    e = engine()
    joined(e, "a", "b", "c")
    for p in "abc":
        e.ready(p, 0, info(), 0.0)
    e.vote("a", 0, 0, True, b"r", b"s", 1.0)
    e.vote("b", 0, 0, True, b"r", b"s", 1.0)
    (abort,) = of(e.vote("c", 0, 0, True, b"X", b"s", 1.0), SendAbort)
    assert abort.record.excluded == ("c",) and abort.record.reason == "digest mismatch"
    assert e.committed_rounds == 0


def test_collective_deadline_aborts_silent_participants():
    e = engine(collective_timeout=2.0)
    joined(e, "a", "b", "c")
    for p in "abc":
        e.ready(p, 0, info(), 0.0)
    e.vote("a", 0, 0, True, b"r", b"s", 1.0)
    for p in "abc":
        e.heartbeat(p, 2.0)
    (abort,) = of(e.tick(2.5), SendAbort)
    assert abort.record.excluded == ("b", "c")
    assert not abort.record.will_retry  # only one survivor < min_peers: the round is given up
    assert e.said_ready == {} and e.tries == 0


def test_lease_expiry_drops_member_and_aborts_its_round():
    e = engine(lease_seconds=1.0)
    joined(e, "a", "b", "c")
    for p in "abc":
        e.ready(p, 0, info(), 0.0)
    e.heartbeat("a", 0.9)
    e.heartbeat("b", 0.9)
    acts = e.tick(1.0)
    (abort,) = of(acts, SendAbort)
    assert abort.record.excluded == ("c",) and "c" not in e.members
    with pytest.raises(RoundError) as err:
        e.heartbeat("c", 1.1)
    assert err.value.kind is ErrorKind.NOT_FOUND


def test_stale_peer_gets_sync_order_from_last_committers():
    e = engine()
    joined(e, "a", "b")
    e.ready("a", 0, info(), 0.0)
    e.ready("b", 0, info(), 0.0)
    e.vote("a", 0, 0, True, b"r", b"s1", 0.5)
    e.vote("b", 0, 0, True, b"r", b"s1", 0.5)
    joined(e, "c", now=0.6)
    # Its join answer carries a sync order: rounds wait for that download (bounded by sync_hold).
    assert e.members["c"].state is MemberState.CATCHING_UP and e.members["c"].state.label == "syncing"
    (sync,) = of(e.ready("c", 1, info(rounds=0), 0.7), SendSync)
    assert sync.donors == ("a", "b") and sync.state_digest == b"s1" and sync.round == 1
    # After syncing it is ready like anyone else, and a wrong digest is another sync order.
    assert of(e.ready("c", 1, info(rounds=1, digest=b"bad"), 0.8), SendSync)
    e.ready("a", 1, info(rounds=1, digest=b"s1"), 0.8)
    e.ready("b", 1, info(rounds=1, digest=b"s1"), 0.8)
    (plan,) = of(e.ready("c", 1, info(rounds=1, digest=b"s1"), 0.9), SendPlan)
    assert plan.plan.participants == ("a", "b", "c")


def test_a_joiner_during_an_attempt_gets_its_order_when_the_attempt_ends_not_a_stale_head():
    # A joiner's order for the head while an attempt is in flight would be stale at its commit:
    # a slow joiner downloaded the state twice. The order follows the attempt's end instead.
    e = engine(sync_hold=60.0, lease_seconds=1000.0)
    round_0_committed(e, "a", "b")
    assert e.join_sync("a", 0.2).round == 1  # nothing in flight: the order is for the head at once
    for p in "ab":
        e.ready(p, 1, info(rounds=1, digest=b"s1"), 0.2)
    assert e.running is not None
    joined(e, "c", now=0.3)
    assert e.join_sync("c", 0.3) is None  # its join answer orders nothing yet
    assert e.ready("c", 1, info(rounds=0), 0.4) == []  # nor does its Ready while the attempt runs
    acts = []
    for p in "ab":
        acts += e.vote(p, 1, e.running.plan.attempt, True, b"r", b"s2", 0.5)
    (commit,) = of(acts, SendCommit)
    (sync,) = of(acts, SendSync)
    assert (sync.peer_id, sync.round, sync.state_digest) == ("c", 2, b"s2") and "c" in commit.synced
    # The rounds after wait for its download (the hold of a joiner), its Ready ends the wait.
    for p in "ab":
        e.ready(p, 2, info(rounds=2, digest=b"s2"), 0.6)
    assert of(e.tick(30.0), SendPlan) == []
    (plan,) = of(e.ready("c", 2, info(rounds=2, digest=b"s2"), 31.0), SendPlan)
    assert plan.plan.participants == ("a", "b", "c")


def test_a_peer_behind_during_an_attempt_it_is_not_in_gets_its_order_when_the_attempt_ends():
    # Excluded at a link cut, peer c said Ready holding round 1 while a 0.7 s attempt of the
    # others ran: an order for the head then was stale at its commit (three downloads in a row).
    e = engine(sync_hold=60.0, lease_seconds=1000.0)
    round_0_committed(e, "a", "b", "c")
    for p in "ab":
        e.ready(p, 1, info(rounds=1, digest=b"s1"), 0.2)
    of(e.tick(5.3), SendPlan)  # c missed the ready deadline: a and b play round 1
    commit_all(e, 5.4, b"s2")
    acts = [a for p in "ab" for a in e.ready(p, 2, info(rounds=2, digest=b"s2"), 5.5) + e.tick(10.6)]
    assert of(acts, SendPlan) and e.running.plan.participants == ("a", "b")
    assert e.ready("c", 2, info(rounds=1, digest=b"s1"), 10.7) == []  # behind: no order mid-attempt
    acts = []
    for p in "ab":
        acts += e.vote(p, 2, e.running.plan.attempt, True, b"r", b"s3", 11.0)
    (sync,) = of(acts, SendSync)
    assert (sync.peer_id, sync.round, sync.state_digest) == ("c", 3, b"s3") and not e.sync_owed


def test_a_joiner_is_waited_for_from_its_join_before_its_stream_opens():
    # The fast peers' Readys for the next round came before the joiner's stream opened: that
    # round opened without it and committed during its download (a second full download).
    e = engine(sync_hold=60.0, lease_seconds=1000.0)
    round_0_committed(e, "a", "b")
    e.join("c", KEY, "127.0.0.1:2000", 1, 0.2)  # no stream yet
    for p in "ab":
        e.ready(p, 1, info(rounds=1, digest=b"s1"), 0.3)
    assert e.running is None and of(e.tick(30.0), SendPlan) == []  # waiting for c's download
    e.connected("c", 1.0)
    (plan,) = of(e.ready("c", 1, info(rounds=1, digest=b"s1"), 40.0), SendPlan)
    assert plan.plan.participants == ("a", "b", "c")
    commit_all(e, 41.0, b"s2")
    # Once its stream was open, a broken one means it is gone: nobody waits for it.
    e.disconnected("c", 42.0)
    acts = [a for p in "ab" for a in e.ready(p, 2, info(rounds=2, digest=b"s2"), 42.1)]
    (plan,) = of(acts, SendPlan)
    assert plan.plan.participants == ("a", "b")


def test_a_joiner_during_an_attempt_that_aborts_gets_its_order_at_the_abort():
    e = engine(sync_hold=60.0, max_attempts=1)
    round_0_committed(e, "a", "b", "c")
    for p in "abc":
        e.ready(p, 1, info(rounds=1, digest=b"s1"), 0.2)
    joined(e, "d", now=0.3)
    assert e.join_sync("d", 0.3) is None
    acts = e.vote("a", 1, e.running.plan.attempt, False, b"", b"", 0.4, error="raised")  # a confession
    assert of(acts, SendAbort)
    (sync,) = of(acts, SendSync)
    assert (sync.peer_id, sync.round, sync.state_digest) == ("d", 1, b"s1") and not e.sync_owed


def test_when_no_live_member_holds_the_committed_state_status_and_ready_say_so():
    # A finished run restarted with fresh peer processes (same keys): nobody holds round 0's
    # state any more; status said only "waiting for 2 more ready peers" and peers retried silently.
    e = engine(lease_seconds=1000.0)
    round_0_committed(e, "a", "b")
    for p in "ab":
        e.disconnected(p, 1.0)
    joined(e, "c", now=2.0)
    with pytest.raises(RoundError, match="no live member holds the committed state of round 0"):
        e.ready("c", 1, info(rounds=0), 2.1)
    w = e.waiting(2.2)
    assert w.reason is WaitReason.QUORUM and "no live member holds the committed state of round 0" in w.message


def test_initial_peers_quorum_and_size_mismatch():
    e = engine(initial_peers=3)
    joined(e, "a", "b")
    e.ready("a", 0, info(), 0.0)
    e.ready("b", 0, info(), 0.0)
    assert of(e.tick(6.0), SendPlan) == []  # round 0 waits for 3, even past the ready timeout
    joined(e, "c", now=6.0)
    with pytest.raises(RoundError) as err:
        e.ready("c", 0, info(n=11), 6.0)
    assert err.value.kind is ErrorKind.INVALID and "num_elements" in str(err.value)


def test_finishes_after_total_rounds_and_restart_keeps_commits():
    e = engine(rounds=1)
    joined(e, "a", "b")
    e.ready("a", 0, info(), 0.0)
    e.ready("b", 0, info(), 0.0)
    e.vote("a", 0, 0, True, b"r", b"s", 0.1)
    e.vote("b", 0, 0, True, b"r", b"s", 0.1)
    assert of(e.tick(0.2), SendFinished)
    again = RoundEngine(e.config, committed=e.commits, members=list(e.members.values()), epoch=e.epoch, now=50.0)
    assert again.committed_rounds == 1 and again.last_state_digest == b"s"
    assert again.members["a"].lease_expiry == 60.0  # fresh lease to reconnect after a restart


def commit_all(e: RoundEngine, now: float, digest=b"s") -> None:
    run = e.running
    assert run is not None
    for p in run.plan.participants:
        e.vote(p, run.plan.round, run.plan.attempt, True, b"r", digest, now)


def round_0_committed(e: RoundEngine, *peers: str) -> None:
    """`peers` join, say ready for round 0 at 0.0 and commit it at 0.1 (state digest b"s1")."""
    joined(e, *peers)
    for p in peers:
        e.ready(p, 0, info(), 0.0)
    commit_all(e, 0.1, b"s1")


def test_straggler_delays_at_most_one_round():
    e = engine()
    joined(e, "a", "b", "c")
    e.ready("a", 0, info(), 0.0)
    e.ready("b", 0, info(), 0.0)
    e.heartbeat("c", 5.0)
    assert of(e.tick(5.0), SendPlan)  # left out after the ready timeout
    commit_all(e, 5.1, b"s1")
    e.ready("a", 1, info(rounds=1, digest=b"s1"), 5.2)
    (plan,) = of(e.ready("b", 1, info(rounds=1, digest=b"s1"), 5.2), SendPlan)  # no second wait for c
    assert plan.plan.participants == ("a", "b")
    commit_all(e, 5.3, b"s2")
    # Once it says ready again (stale: it gets a sync order), it is waited on again.
    assert of(e.ready("c", 2, info(rounds=0), 5.4), SendSync)
    e.ready("a", 2, info(rounds=2, digest=b"s2"), 5.5)
    assert of(e.ready("b", 2, info(rounds=2, digest=b"s2"), 5.5), SendPlan) == []
    (plan,) = of(e.ready("c", 2, info(rounds=2, digest=b"s2"), 5.6), SendPlan)
    assert plan.plan.participants == ("a", "b", "c")


def test_disconnected_participant_aborts_at_once_and_is_not_waited_on():
    e = engine()
    joined(e, "a", "b", "c")
    for p in "abc":
        e.ready(p, 0, info(), 0.0)
    (abort,) = of(e.disconnected("b", 0.5), SendAbort)
    assert abort.record.excluded == ("b",) and abort.record.will_retry
    (plan,) = of(e.tick(0.6), SendPlan)
    assert plan.plan.participants == ("a", "c")
    commit_all(e, 0.7, b"s1")
    e.ready("a", 1, info(rounds=1, digest=b"s1"), 0.8)
    (plan,) = of(e.ready("c", 1, info(rounds=1, digest=b"s1"), 0.8), SendPlan)  # b is gone: no wait
    assert plan.plan.participants == ("a", "c")


def test_restarted_peer_with_same_identity_rejoins_through_sync():
    e = engine(lease_seconds=1000.0)  # no heartbeats here
    round_0_committed(e, "a", "b", "c")
    e.disconnected("c", 0.2)
    e.join("c", KEY, "127.0.0.1:9999", 1, 0.3)  # same identity, new process and address
    e.connected("c", 0.3)
    # Its join answer orders a sync: the round waits for that download (bounded by sync_hold).
    assert e.members["c"].state is MemberState.CATCHING_UP and e.members["c"].sync_until == 0.3 + 60.0
    e.ready("a", 1, info(rounds=1, digest=b"s1"), 0.4)
    assert of(e.ready("b", 1, info(rounds=1, digest=b"s1"), 0.4), SendPlan) == []
    assert of(e.tick(10.0), SendPlan) == []  # past the ready timeout: the download may take longer
    (plan,) = of(e.ready("c", 1, info(rounds=1, digest=b"s1"), 11.0), SendPlan)
    assert plan.plan.participants == ("a", "b", "c")


def test_a_joiner_that_keeps_restarting_holds_the_rounds_once():
    # A restart policy that restarts a crashing peer: each new process joins again. The rounds wait
    # for its download at most one sync_hold from its first join, not one per join.
    e = engine(lease_seconds=1000.0, sync_hold=60.0)
    round_0_committed(e, "a", "b")
    for t in (1.0, 30.0, 55.0):
        e.join("c", KEY, "127.0.0.1:9999", 1, t)
        e.connected("c", t)
        assert e.members["c"].sync_until == 61.0
    e.ready("a", 1, info(rounds=1, digest=b"s1"), 56.0)
    assert of(e.ready("b", 1, info(rounds=1, digest=b"s1"), 56.0), SendPlan) == []  # still waiting for c
    (plan,) = of(e.tick(61.0), SendPlan)
    assert plan.plan.participants == ("a", "b")
    # Once it has synced (or its hold ran out and it joins anew later), a new catch-up gets a new hold.
    e.join("c", KEY, "127.0.0.1:9999", 1, 200.0)
    assert e.members["c"].sync_until == 260.0


def test_simultaneous_joiners_start_at_different_donors():
    e = engine()
    round_0_committed(e, "a", "b", "c")
    firsts = []
    for j in ("j1", "j2", "j3", "j4", "j5", "j6"):
        joined(e, j, now=0.2)
        (sync,) = of(e.ready(j, 1, info(rounds=0), 0.3), SendSync)
        assert sorted(sync.donors) == ["a", "b", "c"]
        firsts.append(sync.donors[0])
    assert sorted(firsts) == ["a", "a", "b", "b", "c", "c"]  # spread evenly, never all on one donor


def test_attempt_ids_are_never_reused():
    e = engine(max_attempts=2, min_peers=2)
    joined(e, "a", "b", "c")
    for p in "abc":
        e.ready(p, 0, info(), 0.0)
    (plan,) = of(accuse(e, "c", 0.1), SendPlan)  # retry 1 with a, b
    assert plan.plan.attempt == 1
    t = e.running.started
    e.vote("a", 0, 1, False, b"", b"", t, suspects=())  # given up: everyone says ready again
    acts = []
    for p in "abc":
        e.heartbeat(p, t + 0.1)
        acts += e.ready(p, 0, info(), t + 0.1)
    (plan,) = of(acts + e.tick(t + 0.2), SendPlan)
    assert plan.plan.attempt == 2  # not 0 again
    # A restarted coordinator (incarnation 1) numbers its attempts from 1000.
    again = RoundEngine(e.config, members=list(e.members.values()), now=1.0, attempt_base=1000)
    acts = []
    for p in "abc":
        again.connected(p, 1.0)
        acts += again.ready(p, 0, info(), 1.0)
    (plan,) = of(acts + again.tick(1.0), SendPlan)
    assert plan.plan.attempt == 1000


def test_non_finite_loss_never_blocks_a_commit():
    e = engine()
    joined(e, "a", "b")
    e.ready("a", 0, info(), 0.0)
    e.ready("b", 0, info(), 0.0)
    e.vote("a", 0, 0, True, b"r", b"s", 0.1, loss=float("nan"))
    (commit,) = of(e.vote("b", 0, 0, True, b"r", b"s", 0.1, loss=float("inf")), SendCommit)
    assert commit.record.train_loss == 0.0


def test_peer_behind_at_the_end_can_still_fetch_the_final_state():
    e = engine(rounds=1)
    joined(e, "a", "b", "c")
    for p in "abc":
        e.ready(p, 0, info(), 0.0)
    accuse(e, "c", 0.1)
    t = e.running.started
    e.heartbeat("c", t)
    commit_all(e, t + 0.1, b"s1")
    assert of(e.tick(t + 0.2), SendFinished)
    (sync,) = of(e.ready("c", 1, info(rounds=0), t + 0.3), SendSync)
    assert set(sync.donors) == {"a", "b"} and sync.state_digest == b"s1"
    assert of(e.ready("a", 1, info(rounds=1, digest=b"s1"), t + 0.3), SendFinished)


def test_a_peer_still_behind_after_a_download_is_waited_for_all_of_sync_hold():
    # c fell behind; its first order is held for as long as its rate says (1.5x + the ready
    # timeout). It downloads, but the head moved on meanwhile: from its next Ready it is catching
    # up (not busy elsewhere), so the rounds wait up to sync_hold and its Ready ends the wait.
    e = engine(lease_seconds=1000.0, sync_hold=60.0)
    round_0_committed(e, "a", "b", "c")
    for p in "ab":
        e.ready(p, 1, info(rounds=1, digest=b"s1"), 0.2)
    of(e.tick(5.3), SendPlan)  # c, busy, missed the ready deadline
    commit_all(e, 5.4, b"s2")
    slow = dict(state_bytes=10_000_000, sync_bytes_per_s=1_000_000.0)
    behind = ReadyInfo(10, 1, 1, b"s1", 1, 6.0, **slow)
    (sync,) = of(e.ready("c", 2, behind, 6.0), SendSync)
    assert e.members["c"].sync_until == 6.0 + 1.5 * 10 + 5.0  # from its rate
    for p in "ab":
        e.ready(p, 2, info(rounds=2, digest=b"s2"), 6.1)
    assert of(e.tick(26.0), SendPlan)  # the hold ran out just before its download ended
    commit_all(e, 26.1, b"s3")
    again = ReadyInfo(10, 1, 1, b"s2", 2, 27.0, **slow)  # it holds round 2's state: the head moved on
    (sync,) = of(e.ready("c", 3, again, 27.0), SendSync)
    assert e.members["c"].sync_until == 27.0 + 60.0
    for p in "ab":
        e.ready(p, 3, info(rounds=3, digest=b"s3"), 27.1)
    assert of(e.tick(45.0), SendPlan) == []  # waiting for c's download
    (plan,) = of(e.ready("c", 3, info(rounds=3, digest=b"s3"), 48.0), SendPlan)
    assert plan.plan.participants == ("a", "b", "c")


def test_a_peer_that_just_synced_is_waited_for_during_its_local_update():
    # c downloads the committed state while a and b train; it says so at once (the training
    # notice) and trains: the round waits about one local phase for it (2x the last one + the
    # ready timeout), not just the ready timeout, so it is not outrun the moment it caught up.
    e = engine(lease_seconds=1000.0, ready_timeout=1.0)
    round_0_committed(e, "a", "b", "c")
    for p in "ab":
        e.ready(p, 1, info(rounds=1, digest=b"s1"), 3.1)  # a local phase of 3 s
    assert e.local_seconds == pytest.approx(3.0)
    of(e.tick(4.2), SendPlan)  # c was busy: left out
    commit_all(e, 4.3, b"s2")
    (sync,) = of(e.ready("c", 2, info(rounds=1, digest=b"s1"), 4.4), SendSync)
    notice = ReadyInfo(10, 1, 1, b"s2", 2, 7.0, training=True)
    assert e.ready("c", 2, notice, 7.0) == []  # synced: it trains now
    assert e.members["c"].sync_until == pytest.approx(7.0 + 2 * 3.0 + 1.0)
    for p in "ab":
        e.ready(p, 2, info(rounds=2, digest=b"s2"), 7.4)
    assert of(e.tick(12.0), SendPlan) == []  # waiting for c's local update
    (plan,) = of(e.ready("c", 2, info(rounds=2, digest=b"s2"), 12.1), SendPlan)
    assert plan.plan.participants == ("a", "b", "c")


def test_a_training_notice_of_an_old_state_is_a_stale_ready():
    e = engine(lease_seconds=1000.0)
    round_0_committed(e, "a", "b", "c")
    (sync,) = of(e.ready("c", 1, ReadyInfo(10, 1, 1, b"", 0, 0.2, training=True), 0.2), SendSync)
    assert sync.state_digest == b"s1"


def test_holds_ready_covers_the_ready_set_and_the_running_attempt_only():
    e = engine()
    joined(e, "a", "b", "c")
    assert not e.holds_ready("a")
    e.ready("a", 0, info(), 0.1)
    assert e.holds_ready("a") and not e.holds_ready("b")
    e.ready("b", 0, info(), 0.2)
    of(e.tick(5.1), SendPlan)  # c missed the ready deadline: a and b play
    assert e.holds_ready("a") and e.holds_ready("b") and not e.holds_ready("c")
    e.vote("a", 0, 0, True, b"r", b"s", 5.2)
    e.vote("b", 0, 0, True, b"r", b"s", 5.3)  # committed: a new round, nobody is ready for it yet
    assert e.committed_rounds == 1 and not any(e.holds_ready(p) for p in "abc")


def test_failed_owner_audit_strips_owner_and_auditor_of_ownership_for_the_run():
    e = engine(audit_owners=True, collective="butterfly")
    joined(e, "a", "b", "c", "d")
    acts = [a for p in "abcd" for a in e.ready(p, 0, info(), 0.1)]
    (plan,) = of(acts, SendPlan)
    assert plan.plan.audit_owners and plan.plan.shard_owner == (0, 1, 2, 3)
    # c's auditor (d) blames c: both are excluded from the retry and never own a shard again.
    acts = e.vote("d", 0, plan.plan.attempt, False, b"", b"", 0.2, suspects=("c",), audit=True)
    (abort,) = of(acts, SendAbort)
    assert set(abort.record.excluded) == {"c", "d"} and e.untrusted == {"c", "d"}
    assert of(acts, PersistUntrusted)[0].peers == ("c", "d")  # durable: a restarted coordinator keeps it
    assert RoundEngine(EngineConfig(), untrusted=("c", "d")).untrusted == {"c", "d"}
    (retry,) = of(e.tick(1.0), SendPlan)
    assert set(retry.plan.participants) == {"a", "b"}
    for p in ("a", "b"):
        e.vote(p, 0, retry.plan.attempt, True, b"r", b"s", 1.1)
    acts = [a for p in "abcd" for a in e.ready(p, 1, info(digest=b"s", rounds=1), 1.2)]
    (nxt,) = of(acts, SendPlan)
    owners = {nxt.plan.participants[o] for o in nxt.plan.shard_owner}
    assert set(nxt.plan.participants) == {"a", "b", "c", "d"} and owners == {"a", "b"}
    assert set(nxt.plan.demoted) >= {"c", "d"}
    # A failed vote that is not an audit strips nobody.
    e2 = engine(audit_owners=True, collective="butterfly")
    joined(e2, "a", "b", "c")
    (p2,) = of([a for p in "abc" for a in e2.ready(p, 0, info(), 0.1)], SendPlan)
    e2.vote("a", 0, p2.plan.attempt, False, b"", b"", 0.2, suspects=("b",))
    assert e2.untrusted == set()


def test_an_audit_vote_strips_only_the_owner_its_voter_audits():
    e = engine(audit_owners=True, collective="butterfly")
    joined(e, "a", "b", "c", "d", "e", "f")
    (plan,) = of([a for p in "abcdef" for a in e.ready(p, 0, info(), 0.1)], SendPlan)
    # a audits f's shard (the next owner after f, cyclically): naming b..e is not an audit claim.
    e.vote("a", 0, plan.plan.attempt, False, b"", b"", 0.2, suspects=tuple("bcde"), audit=True)
    assert e.untrusted == set()
    e2 = engine(audit_owners=True, collective="butterfly")
    joined(e2, "a", "b", "c", "d", "e", "f")
    (plan2,) = of([a for p in "abcdef" for a in e2.ready(p, 0, info(), 0.1)], SendPlan)
    e2.vote("c", 0, plan2.plan.attempt, False, b"", b"", 0.2, suspects=("a",), audit=True)  # c does not audit a
    assert e2.untrusted == set()
    e2b = engine(audit_owners=True, collective="butterfly")
    joined(e2b, "a", "b", "c", "d", "e", "f")
    (plan3,) = of([a for p in "abcdef" for a in e2b.ready(p, 0, info(), 0.1)], SendPlan)
    e2b.vote("b", 0, plan3.plan.attempt, False, b"", b"", 0.2, suspects=("a", "b"), audit=True)  # b audits a
    assert e2b.untrusted == {"a", "b"}


def test_with_no_trusted_owner_left_no_round_opens():
    # Two peers, one accused by the other: nobody can tell who lied. No round opens (instead of
    # aborting in a loop) until a trusted peer joins.
    e = engine(audit_owners=True, collective="butterfly", min_peers=2)
    joined(e, "a", "b")
    (plan,) = of([a for p in "ab" for a in e.ready(p, 0, info(), 0.1)], SendPlan)
    e.vote("b", 0, plan.plan.attempt, False, b"", b"", 0.2, suspects=("a", "b"), audit=True)
    assert e.untrusted == {"a", "b"}
    acts = [a for p in "ab" for a in e.ready(p, 0, info(), 1.0)] + e.tick(2.0)
    assert of(acts, SendPlan) == [] and e.running is None
    joined(e, "c", now=3.0)
    acts = [a for p in "abc" for a in e.ready(p, 0, info(), 9.0)] + e.tick(14.5)
    (nxt,) = of(acts, SendPlan)
    assert {nxt.plan.participants[o] for o in nxt.plan.shard_owner} == {"c"}
    assert not nxt.plan.audit_owners  # one owner: nobody to audit it, and the plan says so


# ---------------------------------------------------------------- why a round does not open


def test_waiting_for_the_quorum_then_for_a_straggler_then_running():
    e = engine(initial_peers=5)
    joined(e, "a", "b", "c", "d", "e")
    for p in "abc":
        e.ready(p, 0, info(), 1.0)
    w = e.waiting(1.5)
    assert w.reason is WaitReason.QUORUM and w.peers == ("d", "e")
    assert w.message == "waiting for 2 more ready peers (3/5 ready, quorum 5)"
    e.ready("d", 0, info(), 2.0)
    e.ready("e", 0, info(), 2.0)
    assert e.waiting(2.0).reason is WaitReason.RUNNING
    # A quorum of 2 out of 3 live members: the round waits up to the ready timeout for the third.
    e = engine()
    joined(e, "a", "b", "c")
    e.ready("a", 0, info(), 1.0)
    e.ready("b", 0, info(), 1.5)
    w = e.waiting(2.8)
    assert w.reason is WaitReason.STRAGGLERS and w.peers == ("c",) and w.until == 6.0
    assert w.message == "waiting up to 3.2 s for 1 straggler"
    assert e.waiting(6.0).reason is WaitReason.OPENING and e.running is None  # a query changes nothing
    (plan,) = of(e.tick(6.0), SendPlan)
    w = e.waiting(6.1)
    assert w.reason is WaitReason.RUNNING and w.peers == ("a", "b") and w.until == 36.0
    assert w.message == "round 0 attempt 0 is running with 2 participants"


def test_waiting_for_a_syncing_member():
    e = engine(lease_seconds=1000.0)  # no heartbeats here
    joined(e, "a", "b")
    e.ready("a", 0, info(), 0.0)
    e.ready("b", 0, info(), 0.0)
    commit_all(e, 0.5, b"s1")
    joined(e, "c", now=1.0)
    assert e.members["c"].state is MemberState.CATCHING_UP  # its join answer ordered a sync
    assert of(e.ready("c", 1, info(rounds=0), 1.0), SendSync)  # alive: it is waited on while it downloads
    assert e.members["c"].state is MemberState.CATCHING_UP
    e.ready("a", 1, info(rounds=1, digest=b"s1"), 2.0)
    e.ready("b", 1, info(rounds=1, digest=b"s1"), 2.0)
    w = e.waiting(3.0)
    assert w.reason is WaitReason.SYNCING and w.peers == ("c",) and w.message == "syncing 1 member: waiting up to 58.0 s"
    assert of(e.tick(7.0), SendPlan) == []
    # It does not finish within the sync hold: the round opens without it, and the next one does
    # not wait for it.
    (plan,) = of(e.tick(61.0), SendPlan)
    assert plan.plan.participants == ("a", "b") and e.members["c"].state is MemberState.SYNCING


def test_a_catching_up_peer_is_waited_on_for_its_measured_download_time():
    e = engine(lease_seconds=1000.0)  # no heartbeats here
    joined(e, "a", "b")
    e.ready("a", 0, info(), 0.0)
    e.ready("b", 0, info(), 0.0)
    commit_all(e, 0.5, b"s1")
    e.members["a"].state = e.members["b"].state = MemberState.MEMBER
    joined(e, "c", now=1.0)
    e.members["c"].state, e.members["c"].sync_until = MemberState.SYNCING, 0.0  # its join hold ran out
    # It comes back holding an older state it downloaded at 0.5 MB/s: 10 MB take 20 s, so the round
    # waits 1.5 * 20 + ready_timeout = 35 s, and its permit (donors keep the state) lasts 60 s.
    ready = ReadyInfo(10, 1, 1, b"s0", 0, 100.0, state_bytes=10_000_000, sync_bytes_per_s=500_000.0)
    (sync,) = of(e.ready("c", 1, ready, 100.0), SendSync)
    assert sync.permit_seconds == 60.0 and e.members["c"].sync_until == 135.0
    e.ready("a", 1, info(rounds=1, digest=b"s1"), 100.0)
    e.ready("b", 1, info(rounds=1, digest=b"s1"), 100.0)
    assert of(e.tick(120.0), SendPlan) == []
    (plan,) = of(e.tick(135.0), SendPlan)
    assert plan.plan.participants == ("a", "b")


def test_sync_plan_sizes_hold_and_permit_from_the_rate():
    cfg = EngineConfig(ready_timeout=5.0, sync_hold=60.0)
    assert sync_plan(0, 0.0, cfg) == (5.0, 300.0)  # unknown: the ready timeout, the default permit
    assert sync_plan(0, 0.0, cfg, joining=True) == (60.0, 300.0)  # a joiner says ready once done
    assert sync_plan(10_000_000, 500_000.0, cfg) == (35.0, 60.0)
    assert sync_plan(10_000_000, 50_000.0, cfg) == (60.0, 600.0)  # 200 s: hold capped, permit 3x
    assert sync_plan(10_000_000, 10_000.0, cfg) == (60.0, 900.0)  # 1000 s: permit capped
    assert sync_plan(10_000_000, 100e6, cfg)[1] == 60.0  # a fast link: the shortest permit


def test_waiting_out_the_retry_backoff():
    e = engine(retry_backoff=1.0)
    joined(e, "a", "b", "c")
    for p in "abc":
        e.ready(p, 0, info(), 0.0)
    e.vote("a", 0, 0, False, b"", b"", 2.0, suspects=("c",), error="stream broke")
    e.vote("b", 0, 0, False, b"", b"", 2.0, suspects=("c",), error="stream broke")
    t = e.running.blame_at
    e.tick(t)  # c never voted: blamed when the window closes
    w = e.waiting(t + 0.5)
    assert w.reason is WaitReason.BACKOFF and w.until == t + 1.0 and w.peers == ("a", "b")
    assert "retry backoff" in w.message and "stream broke" in w.message
    assert of(e.tick(t + 0.9), SendPlan) == []
    assert e.waiting(t + 1.0).reason is WaitReason.OPENING
    (plan,) = of(e.tick(t + 1.0), SendPlan)
    assert plan.plan.participants == ("a", "b")


def test_waiting_for_a_trusted_owner_and_for_nothing_once_finished():
    e = engine(audit_owners=True, collective="butterfly", rounds=1)
    joined(e, "a", "b")
    (plan,) = of([a for p in "ab" for a in e.ready(p, 0, info(), 0.1)], SendPlan)
    e.vote("b", 0, plan.plan.attempt, False, b"", b"", 0.2, suspects=("a", "b"), audit=True)
    for p in "ab":
        e.ready(p, 0, info(), 1.0)
    w = e.waiting(2.0)
    assert w.reason is WaitReason.NO_TRUSTED_OWNER and w.until == 6.0 and set(w.peers) == {"a", "b"}
    assert w.message == "no trusted shard owner among the ready peers"
    joined(e, "c", now=3.0)
    acts = [a for p in "abc" for a in e.ready(p, 0, info(), 6.5)]  # a and b again first: held once more
    assert e.waiting(6.5).reason is WaitReason.NO_TRUSTED_OWNER
    (nxt,) = of(acts + e.tick(11.5), SendPlan)
    commit_all(e, 12.0)
    assert of(e.tick(12.1), SendFinished)
    w = e.waiting(13.0)
    assert w.reason is WaitReason.FINISHED and w.message == "run finished: 1 round committed"


def test_member_state_transitions_and_stored_labels():
    S = MemberState
    # Saying ready in sync: members stay (or become again) members, joiners before the first
    # commit stay pending, syncing peers catch up; out of sync: everyone catches up.
    assert [s.after_ready(in_sync=True) for s in S] == [S.PENDING, S.PENDING, S.CATCHING_UP, S.CATCHING_UP,
                                                        S.MEMBER, S.MEMBER]
    assert {s.after_ready(in_sync=False) for s in S} == {S.CATCHING_UP}
    assert [s.after_missed_deadline() for s in S] == [S.PENDING_LAGGING, S.PENDING_LAGGING, S.SYNCING, S.SYNCING,
                                                      S.LAGGING, S.LAGGING]
    assert [s for s in S if s.waited_on] == [S.PENDING, S.CATCHING_UP, S.MEMBER]
    assert [s.label for s in S] == ["pending", "pending", "syncing", "syncing", "member", "member"]
    # The stored labels of older state files read back as the states they were.
    assert [S.from_label(x) for x in ("pending", "syncing", "member")] == [S.PENDING, S.SYNCING, S.MEMBER]


def test_stale_readys_without_progress_never_delay_a_round():
    """A member back from a long local phase may send Readys for rounds long committed (a backlog).
    The first gets a sync order and the round waits for it (it is alive and syncing); the
    ones after it that hold no newer state get the sync order again and delay nothing, however
    many rounds committed meanwhile (a peer back from a long local phase)."""
    e = engine()
    round_0_committed(e, "a", "b", "c")
    t, digest = 0.2, b"s1"
    for r in range(1, 40):  # c works locally for 40 rounds: a and b commit without it
        e.ready("a", r, info(rounds=r, digest=digest), t)
        acts = e.ready("b", r, info(rounds=r, digest=digest), t)
        if r == 1:
            assert acts == [] and e.members["c"].state is MemberState.MEMBER
            acts = e.tick(t + 5.0)  # c missed one ready deadline: a straggler from now on
            t += 5.0
        (plan,) = of(acts, SendPlan)
        assert plan.plan.participants == ("a", "b")
        digest = b"s%d" % (r + 1)
        commit_all(e, t + 0.01, digest)
        t += 0.1
    assert e.members["c"].state is MemberState.LAGGING
    # c comes back: its first (stale) Ready gets a sync order and the round waits for it.
    assert of(e.ready("c", 1, info(rounds=1, digest=b"s1"), t), SendSync)
    assert e.members["c"].state.waited_on
    # The rest of its backlog (older rounds, no newer state): sync orders, no waiting, no delay.
    for r in range(2, 40):
        (sync,) = of(e.ready("c", r, info(rounds=1, digest=b"s1"), t), SendSync)
        assert sync.round == e.committed_rounds
    # The one wait: c never says ready for round 40 (still busy), so the round opens without it
    # at the ready deadline, and c is not waited on again until it shows progress.
    e.ready("a", 40, info(rounds=40, digest=digest), t + 0.1)
    assert of(e.ready("b", 40, info(rounds=40, digest=digest), t + 0.1), SendPlan) == []
    (plan,) = of(e.tick(t + 5.1), SendPlan)
    assert plan.plan.participants == ("a", "b")
    assert not e.members["c"].state.waited_on
    for _ in range(100):  # however many stale Readys follow, the next round opens at once
        e.ready("c", 3, info(rounds=1, digest=b"s1"), t + 5.2)
    commit_all(e, t + 5.3, b"s41")
    e.ready("a", 41, info(rounds=41, digest=b"s41"), t + 5.4)
    (plan,) = of(e.ready("b", 41, info(rounds=41, digest=b"s41"), t + 5.4), SendPlan)
    assert plan.plan.participants == ("a", "b")
    # Progress (c synced to a newer state, still one round behind): waited on again, so a fast
    # swarm cannot outrun a syncing peer for ever; current, it joins the next round.
    commit_all(e, t + 5.5, b"s42")
    assert of(e.ready("c", 42, info(rounds=41, digest=b"s41"), t + 5.6), SendSync)
    assert e.members["c"].state.waited_on
    e.ready("a", 42, info(rounds=42, digest=b"s42"), t + 5.7)
    assert of(e.ready("b", 42, info(rounds=42, digest=b"s42"), t + 5.7), SendPlan) == []
    (plan,) = of(e.ready("c", 42, info(rounds=42, digest=b"s42"), t + 5.8), SendPlan)
    assert plan.plan.participants == ("a", "b", "c")


def test_a_peer_holding_no_committed_state_is_waited_on_as_a_joiner_even_after_playing():
    e = engine(lease_seconds=1000.0)
    joined(e, "a", "b", "c")
    for p in "abc":
        e.ready(p, 0, info(), 0.0)
    e.members["c"].state = MemberState.MEMBER  # it played an attempt of round 0, then was excluded
    commit_all(e, 0.5, b"s1")
    (sync,) = of(e.ready("c", 1, info(rounds=0), 1.0), SendSync)  # still the initial state
    assert e.members["c"].sync_until == 1.0 + 60.0 and sync.permit_seconds == 300.0


def paced(steps, seconds, digest=b""):
    return ReadyInfo(10, 1, 1, digest, 0, 0.0, local_steps=steps, local_seconds=seconds)


def test_a_commit_carries_the_fast_participants_pace():
    """Commit.step_seconds (local_work = "time"): the fastest participant's seconds per inner step;
    with three or more paces the second fastest, so one peer claiming an absurd pace cannot shrink
    everybody's local phase; peers that said nothing do not count; 0 when nobody said."""
    for paces, expected in ((((10, 1.0), (10, 3.0)), 0.1),
                            (((10, 1.0), (10, 1.2), (10, 3.3), (1000, 0.001)), 0.1),
                            (((10, 1.0), (0, 0.0), (10, 3.0)), 0.1),
                            (((0, 0.0), (0, 0.0)), 0.0)):
        e = engine()
        peers = tuple("abcd"[:len(paces)])
        joined(e, *peers)
        acts = []
        for p, (steps, seconds) in zip(peers, paces):
            acts += e.ready(p, 0, paced(steps, seconds), 0.1)
        (plan,) = of(acts, SendPlan)
        acts = []
        for p in plan.plan.participants:
            acts += e.vote(p, 0, 0, True, b"r", b"s", 1.0)
        (commit,) = of(acts, SendCommit)
        assert commit.step_seconds == pytest.approx(expected), paces


def test_round_0_syncs_a_peer_with_other_initial_parameters_to_the_first_ready_state():
    """Step-0 sync: the first Ready of round 0 fixes the initial state; a peer ready with another
    digest (another seed) gets an order for that state from the peers holding it, the round waits
    for it, and opens once it says ready with the initial digest."""
    e = engine()
    joined(e, "a", "b", "c")
    assert e.ready("a", 0, info(digest=b"A"), 0.1) == []
    assert e.ready("b", 0, info(digest=b"A"), 0.2) == []
    (sync,) = of(e.ready("c", 0, info(digest=b"C"), 0.3), SendSync)
    assert (sync.peer_id, sync.round, sync.state_digest) == ("c", 0, b"A")
    assert set(sync.donors) == {"a", "b"}
    assert of(e.tick(6.0), SendPlan) == []  # past the ready timeout: c is still waited on while it syncs
    (plan,) = of(e.ready("c", 0, info(digest=b"A"), 6.1), SendPlan)
    assert plan.plan.participants == ("a", "b", "c")


def test_round_0_initial_state_passes_on_when_its_holders_are_gone():
    e = engine()
    joined(e, "a", "b")
    e.ready("a", 0, info(digest=b"A"), 0.1)
    e.leave("a", 0.2)
    assert of(e.ready("b", 0, info(digest=b"B"), 0.3), SendSync) == []  # nobody holds A: B is the initial state
    assert e.initial_digest == b"B"


def test_round_0_a_ready_that_names_no_state_takes_no_part_in_the_initial_state():
    """A client that says no state digest (a hand-driven or foreign participant) neither fixes the
    initial state nor is ordered to sync; the peers that name one agree among themselves."""
    e = engine()
    joined(e, "a", "b", "c")
    assert of(e.ready("a", 0, info(digest=b""), 0.1), SendSync) == []
    assert of(e.ready("b", 0, info(digest=b"B"), 0.2), SendSync) == []
    assert e.initial_digest == b"B"
    (plan,) = of(e.ready("c", 0, info(digest=b"B"), 0.3), SendPlan)
    assert plan.plan.participants == ("a", "b", "c")


def secure_ready(e: RoundEngine, peers: str, now: float = 0.0, rounds: int = 0, digest: bytes = b"") -> SendPlan:
    """Every peer says Ready with (made-up) secure-aggregation keys: the plan is a secure attempt."""
    acts = []
    for p in peers:
        acts += e.ready(p, rounds, dataclasses.replace(info(rounds=rounds, digest=digest), secagg_keys=bytes(128)), now)
    (plan,) = of(acts + e.tick(now), SendPlan)
    assert plan.plan.secagg_seed
    return plan


@pytest.mark.parametrize("loss", ["disconnected", "lease", "deadline"])
def test_a_secure_attempt_commits_without_a_participant_lost_after_sending(loss):
    """SecAgg+: the survivors unmask the sum with the lost participant's row in it, so they commit
    the attempt without its vote (disconnected, lease expired or silent at the deadline)."""
    e = engine(lease_seconds=2.0, collective_timeout=3.0, checkpointers=0)
    joined(e, "a", "b", "c", "d")
    secure_ready(e, "abcd")
    for p in "abc":
        e.heartbeat(p, 1.5)
        assert e.vote(p, 0, 0, True, b"r", b"s", 1.5) == []
    if loss == "disconnected":
        acts = e.disconnected("d", 1.6)
    elif loss == "lease":
        acts = e.tick(2.1)  # d's lease (from its Ready at 0) ran out
    else:
        e.heartbeat("d", 1.5)
        acts = e.tick(3.2)
    (commit,) = of(acts, SendCommit)
    assert commit.record.attempt == 0 and commit.record.participants == ("a", "b", "c", "d")
    assert of(acts, SendAbort) == [] and e.rounds_aborted == 0 and e.committed_rounds == 1
    assert commit.checkpointers == ("a", "b", "c")  # a lost participant uploads no checkpoint


def test_a_secure_attempt_commits_a_grace_after_every_vote_but_the_silent_ones_agreed():
    """A stopped participant (streams open, lease live) holds the commit for the grace only: twice
    the chunk deadline or the blame window, not its lease."""
    e = engine(lease_seconds=100.0, blame_window=1.0)
    joined(e, "a", "b", "c", "d")
    plan = secure_ready(e, "abcd").plan
    for p in "abc":
        e.vote(p, 0, 0, True, b"r", b"s", 1.0)
    grace = max(1.0, 2 * plan.chunk_timeout_seconds)
    assert e.running.grace_at == pytest.approx(1.0 + grace)
    assert of(e.tick(0.99 + grace), SendCommit) == []
    (commit,) = of(e.tick(1.0 + grace), SendCommit)
    assert commit.record.participants == ("a", "b", "c", "d") and e.rounds_aborted == 0
    assert "d" in e.members  # silent, not evicted: its next Ready of an old round gets a sync order


def test_a_late_vote_within_the_grace_counts_like_any_other():
    e = engine(blame_window=1.0)
    joined(e, "a", "b", "c")
    secure_ready(e, "abc")
    e.vote("a", 0, 0, True, b"r", b"s", 1.0)
    e.vote("b", 0, 0, True, b"r", b"s", 1.0)
    (abort,) = of(e.vote("c", 0, 0, True, b"X", b"s", 1.5), SendAbort)
    assert abort.record.reason == "digest mismatch" and abort.record.excluded == ("c",)


def test_a_secure_attempt_waits_for_the_survivors_then_commits_or_aborts_on_their_votes():
    e = engine()
    joined(e, "a", "b", "c", "d")
    secure_ready(e, "abcd")
    assert e.disconnected("d", 0.5) == []  # it may have sent its row: the survivors will tell
    assert e.running is not None and e.running.lost == {"d"}
    e.vote("a", 0, 0, True, b"r", b"s", 1.0)
    (abort,) = of(e.vote("b", 0, 0, False, b"", b"", 1.1, suspects=("d",), error="no chunk from d"), SendAbort)
    assert abort.record.excluded == ("d",) and abort.record.will_retry and "d lost before voting" in abort.record.reason


def test_a_secure_attempt_with_a_lost_participant_and_a_digest_disagreement_aborts():
    e = engine()
    joined(e, "a", "b", "c", "d")
    secure_ready(e, "abcd")
    e.vote("a", 0, 0, True, b"r", b"s", 1.0)
    e.vote("b", 0, 0, True, b"r", b"s", 1.0)
    e.vote("c", 0, 0, True, b"X", b"s", 1.0)
    (abort,) = of(e.disconnected("d", 1.1), SendAbort)
    assert abort.record.excluded == ("c", "d") and abort.record.reason == "digest mismatch"
    assert e.committed_rounds == 0


def test_a_secure_attempt_commits_only_with_at_least_min_peers_votes():
    e = engine(min_peers=3)
    joined(e, "a", "b", "c")
    secure_ready(e, "abc")
    e.vote("a", 0, 0, True, b"r", b"s", 1.0)
    e.disconnected("b", 1.1)
    (abort,) = of(e.disconnected("c", 1.2), SendAbort)
    assert "1 votes left, fewer than 3" in abort.record.reason and abort.record.excluded == ("b", "c")


def test_a_plain_attempt_still_aborts_at_once_on_a_lost_participant():
    e = engine()
    joined(e, "a", "b", "c")
    for p in "abc":
        e.ready(p, 0, info(), 0.0)
    e.vote("a", 0, 0, True, b"r", b"s", 0.4)
    e.vote("b", 0, 0, True, b"r", b"s", 0.4)
    (abort,) = of(e.disconnected("c", 0.5), SendAbort)
    assert abort.record.excluded == ("c",)


def test_a_secure_run_opens_no_round_and_retries_none_with_fewer_than_three_participants():
    """The sum of two contributions shows each to the other: secure rounds need three."""
    e = engine(secure_aggregation=True)
    joined(e, "a", "b")
    for p in "ab":
        e.ready(p, 0, dataclasses.replace(info(), secagg_keys=bytes(128)), 0.0)
    assert of(e.tick(6.0), SendPlan) == []
    w = e.waiting(6.0)
    assert w.reason is WaitReason.QUORUM and "secure aggregation needs 3" in w.message, w.message
    joined(e, "c", now=6.0)
    (plan,) = of(e.ready("c", 0, dataclasses.replace(info(), secagg_keys=bytes(128)), 6.1), SendPlan)
    assert plan.plan.size == 3
    (abort,) = of(e.vote("a", 0, 0, False, b"", b"", 7.0, error="own failure"), SendAbort)
    assert not abort.record.will_retry  # two survivors: the round starts over when three are ready


def test_the_plan_predicts_the_attempt_with_the_participants_round_trips_to_the_coordinator():
    e = engine()
    joined(e, "a", "b", "c")
    for p, rtt in zip("abc", (0.03, 0.2, 0.0)):  # c has not measured its own
        e.report_links(p, 1e6, 1e6, 0.05, coordinator_rtt=rtt)
    acts = []
    for p in "abc":
        acts += e.ready(p, 0, info(n=1000), 0.0)
    (plan,) = of(acts, SendPlan)
    setup = SETUP_ROUND_TRIPS * 0.05  # the first plan: no pair has a warm connection yet
    assert plan.plan.predicted_round_seconds == pytest.approx(plan.plan.predicted_seconds + 0.2 + setup)
    e.report_links("a", 1e6, 1e6, 0.05, coordinator_rtt=0.0)  # a report without one keeps the last
    assert e.members["a"].coordinator_rtt_seconds == 0.03


def test_only_pairs_without_a_warm_connection_add_the_set_up_to_the_prediction():
    """A peer warms its connections to the participants of its last plan before each Ready: the
    first plan pays SETUP_ROUND_TRIPS of the longest pair round trip, a plan of the same
    participants nothing, and a joiner's plan the set-up of the joiner's pairs."""
    e = engine()
    joined(e, "a", "b", "c")
    for p, rtt in zip("abc", (0.1, 0.3, 0.1)):
        e.report_links(p, 1e6, 1e6, rtt)

    def next_plan(*peers, rnd):
        acts = []
        for p in peers:
            acts += e.ready(p, rnd, info(n=1000, digest=b"s" if rnd else b"", rounds=rnd), 1.0 + rnd)
        (plan,) = of(acts, SendPlan)
        extra = plan.plan.predicted_round_seconds - plan.plan.predicted_seconds
        for p in peers:
            acts = e.vote(p, rnd, 0, True, b"r", b"s", 1.5 + rnd)
        assert of(acts, SendCommit)
        return extra

    assert next_plan("a", "b", "c", rnd=0) == pytest.approx(SETUP_ROUND_TRIPS * (0.1 + 0.3) / 2)
    assert next_plan("a", "b", "c", rnd=1) == pytest.approx(0.0)
    joined(e, "d", now=3.0)
    e.report_links("d", 1e6, 1e6, 0.2)
    assert next_plan("a", "b", "c", "d", rnd=2) == pytest.approx(SETUP_ROUND_TRIPS * (0.3 + 0.2) / 2)
