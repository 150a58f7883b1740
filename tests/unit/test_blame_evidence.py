"""Blame that a liar cannot aim (coordinator.blame, "Evidence"): an accusation counts only with
evidence the coordinator can check, repeated faults without evidence bench the liar, and a
digest against a quorum of identical ones is the voter's own fault. Pure engine, explicit times.
"""

from __future__ import annotations

from collections import Counter

from shoal.coordinator.blame import Strikes, digest_dissenters, unproven_accusers
from shoal.coordinator.rounds import EngineConfig, ReadyInfo, RoundEngine, SendAbort, SendCommit, SendPlan

KEY = bytes(32)
ABCD = ("a", "b", "c", "d")


def test_an_accusation_of_a_peer_that_voted_ok_alone_is_unproven():
    assert unproven_accusers(ABCD, {"a": (), "b": (), "c": (), "d": ("a",)}, failed={"d"}) == {"d"}


def test_an_accusation_has_evidence_from_silence_a_failed_vote_or_a_second_witness():
    # the accused did not vote
    assert unproven_accusers(ABCD, {"a": (), "b": (), "d": ("c",)}, failed={"d"}) == set()
    # the accused's own vote failed too (its side of the link broke as well)
    assert unproven_accusers(ABCD, {"a": (), "b": (), "c": ("d",), "d": ("c",)}, failed={"c", "d"}) == set()
    # a second voter accuses the same peer
    assert unproven_accusers(ABCD, {"a": ("c",), "b": (), "c": (), "d": ("c",)}, failed={"a", "d"}) == set()
    # a confession (no participant named) is never unproven
    assert unproven_accusers(ABCD, {"a": (), "b": (), "c": (), "d": ("x",)}, failed={"d"}) == set()


def test_an_accuser_of_many_is_unproven_only_when_every_accusation_is():
    votes = {"a": (), "b": (), "c": ("d",), "d": ("a", "b", "c")}
    assert unproven_accusers(ABCD, votes, failed={"c", "d"}) == set()
    assert unproven_accusers(ABCD, {"a": (), "b": (), "c": (), "d": ("a", "b", "c")}, failed={"d"}) == {"d"}


def test_digest_dissenters_need_a_quorum_to_be_at_fault():
    assert digest_dissenters({"a": 1, "b": 1, "c": 2}) == (("c",), True)
    assert digest_dissenters({"a": 1, "b": 2}) == (("b",), False)
    assert digest_dissenters({"a": 1, "b": 1}) == ((), True)


def test_strikes_bench_after_the_limit_longer_each_time_and_a_commit_forgives():
    s = Strikes(limit=2, bench_rounds=4)
    assert s.strike("x", 0) is None
    s.cleared(["x"])
    assert s.strike("x", 1) is None  # forgiven: the first strike again
    assert s.strike("x", 2) == 2 + 1 + 4 and s.benched(6) == {"x"} and s.benched(7) == set()
    assert s.strike("x", 7) == 7 + 1 + 8  # still at the limit: benched again at once, twice as long


# ---------------------------------------------------------------- in the engine


def _engine(peers=ABCD) -> RoundEngine:
    e = RoundEngine(EngineConfig(min_peers=2, lease_seconds=1e9, ready_timeout=5.0, collective_timeout=30.0,
                                 max_attempts=5, retry_backoff=0.5, chunk_timeout=1.0, blame_window=2.0))
    for p in peers:
        e.join(p, KEY, f"127.0.0.1:{1000 + ord(p)}", 1, 0.0)
        e.connected(p, 0.0)
    return e


def _ballot(peer: str, plan, liars: dict[str, str]) -> dict:
    """What `peer` votes in `plan`: honest, or one of the attacks of peer.testing.byzantine."""
    attack = liars.get(peer, "")
    honest = next(p for p in plan.participants if p not in liars)
    if attack == "false-blame" and honest != peer:
        return dict(ok=False, result_digest=b"", state_digest=b"", suspects=(honest,), error=f"no chunk from {honest}")
    digest = b"lie" + peer.encode() if attack == "lying-digest" else f"r{plan.round}".encode()
    return dict(ok=True, result_digest=digest, state_digest=b"s" + digest)


def _play(e: RoundEngine, rounds: int, liars: dict[str, str], peers=ABCD):
    """Drive `rounds` rounds (each attempt: 1 s of collective, every vote at once, the liars last);
    returns the engine time at each commit and every abort record."""
    now, commit_times, aborts = 0.0, [], []
    while e.committed_rounds < rounds:
        acts = []
        for p in peers:
            info = ReadyInfo(100, 1, 1, e.last_state_digest, e.committed_rounds, now)
            if not e.holds_ready(p):
                acts += e.ready(p, e.committed_rounds, info, now)
        acts += e.tick(now)
        plans = [a.plan for a in acts if isinstance(a, SendPlan)]
        if not plans:
            now += 0.1
            acts = e.tick(now)
            plans = [a.plan for a in acts if isinstance(a, SendPlan)]
            if not plans:
                continue
        (plan,) = plans
        now += 1.0
        out = []
        for p in sorted(plan.participants, key=lambda p: p in liars):
            out += e.vote(p, plan.round, plan.attempt, now=now, **_ballot(p, plan, liars))
        aborts += [a.record for a in out if isinstance(a, SendAbort)]
        commit_times += [now for a in out if isinstance(a, SendCommit)]
    return commit_times, aborts


def _check_liars(liars: dict[str, str]) -> None:
    # 10 rounds: the liars' bench (struck in rounds 0 and 1, benched from round 2) lasts past them.
    honest_times, honest_aborts = _play(_engine(), 10, {})
    assert honest_aborts == []
    times, aborts = _play(_engine(), 10, liars)
    excluded = Counter(p for rec in aborts for p in rec.excluded)
    assert set(excluded) == set(liars), aborts  # nobody honest is ever excluded
    assert all(rec.round < 2 for rec in aborts), aborts  # the liars are benched within 3 rounds
    # From round 2 on, rounds commit at the honest rate (>= 90 % of it).
    rate = 7 / (times[9] - times[2])
    honest_rate = 7 / (honest_times[9] - honest_times[2])
    assert rate >= 0.9 * honest_rate, (rate, honest_rate)


def test_a_false_accuser_is_excluded_and_benched_not_its_target():
    _check_liars({"d": "false-blame"})


def test_a_lying_digest_voter_is_excluded_and_benched():
    _check_liars({"d": "lying-digest"})


def test_a_false_accuser_and_a_lying_digest_voter_among_four_peers():
    _check_liars({"c": "lying-digest", "d": "false-blame"})


def test_a_silent_peer_is_still_the_one_excluded_and_nobody_is_struck():
    e = _engine()
    acts = [a for p in ABCD for a in e.ready(p, 0, ReadyInfo(100, 1, 1, b"", 0, 0.0), 0.0)]
    (plan,) = [a.plan for a in acts if isinstance(a, SendPlan)]
    e.vote("a", 0, plan.attempt, False, b"", b"", 1.0, suspects=("d",))
    e.vote("b", 0, plan.attempt, True, b"r", b"s", 1.0)
    e.vote("c", 0, plan.attempt, False, b"", b"", 1.0, suspects=("b",))  # b voted ok, but d is silent
    (abort,) = [a for a in e.tick(e.running.blame_at) if isinstance(a, SendAbort)]
    assert abort.record.excluded == ("d",) and e.strikes.counts == {}


def test_a_benched_peer_comes_back_after_its_bench():
    e = _engine()
    _, aborts = _play(e, 1 + 1 + e.strikes.bench_rounds + 1, {"d": "false-blame"})
    back = [rec for rec in aborts if rec.round > 1]  # struck in rounds 0 and 1, benched after
    assert back and back[0].round == 1 + 1 + e.strikes.bench_rounds and back[0].excluded == ("d",)
    assert e.strikes.benched(e.committed_rounds) == {"d"}  # benched again at once, for longer


def test_the_vote_attacks_forge_only_a_ballot_that_succeeded():
    import numpy as np

    from shoal.common.plan import Plan
    from shoal.peer.testing.byzantine import forge_ballot
    from shoal.v1 import shoal_pb2 as pb

    plan = Plan(("a", "b", "c"), "butterfly", (0, 4, 8, 12), (0, 1, 2), num_elements=12)
    rng = np.random.default_rng(0)
    ballot = pb.VoteRequest(peer_id="a", ok=True, result_digest=b"r", state_digest=b"s")
    forge_ballot("false-blame", ballot, plan, rng)
    assert not ballot.ok and list(ballot.suspects) == ["b"] and ballot.result_digest == b""
    ballot = pb.VoteRequest(peer_id="a", ok=True, result_digest=b"r", state_digest=b"s")
    forge_ballot("lying-digest", ballot, plan, rng)
    assert ballot.ok and ballot.result_digest != b"r" and ballot.state_digest == b"s"
    honest_failure = pb.VoteRequest(peer_id="a", ok=False, error="boom")
    forge_ballot("false-blame", honest_failure, plan, rng)
    assert honest_failure.error == "boom" and not honest_failure.suspects
