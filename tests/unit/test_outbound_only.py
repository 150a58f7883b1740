"""Outbound-only participants (docs/nat.md): the planner never makes them shard owners and forces
the butterfly; in the data plane (real gRPC in one process) they push to the owners on streams
they open and get the reduced shards back on them, bit-identical, and nobody dials them."""

from __future__ import annotations

import pytest

from shoal.common.plan import Plan

from shoal.coordinator.blame import blame
from shoal.coordinator.planner import (LinkSpec, NoPlan, PlanPolicy, eligible_fractions, plan_round,
                                      without_outbound_owners)
from shoal.coordinator.rounds import EngineConfig, ReadyInfo, RoundEngine, SendAbort, SendPlan
from shoal.cli.status import render_table
from shoal.v1 import shoal_pb2 as pb

from kits.service import service

MB = 1e6


def _links(rates):
    return [LinkSpec(f"p{i}", up * MB, down * MB, 0.02) for i, (up, down) in enumerate(rates)]


@pytest.mark.parametrize("collective", ["auto", "ring", "butterfly"])
def test_outbound_only_peers_own_no_shard_and_force_the_butterfly(collective):
    # p1 and p3 are the fastest links: without NAT the planner would give them the most.
    links = _links([(10, 10), (100, 100), (10, 10), (100, 100), (10, 10)])
    policy = PlanPolicy(collective=collective)
    plan = plan_round(links, 1_000_000, pb.FLOAT32, policy, outbound_only={"p1", "p3"})
    assert isinstance(plan, Plan)
    assert plan.collective == "butterfly"
    assert plan.outbound_only == (1, 3)
    assert not {1, 3} & set(plan.shard_owner)
    assert set(plan.shard_owner) <= {0, 2, 4}
    assert plan.shard_bounds[0] == 0 and plan.shard_bounds[-1] == 1_000_000
    assert list(plan.shard_bounds) == sorted(plan.shard_bounds)
    assert {"p1", "p3"} <= set(plan.demoted)
    back = Plan.from_proto(plan.to_proto())
    assert back.outbound_only == (1, 3) and not back.dialable(1) and back.dialable(0)


def test_the_prediction_is_that_of_the_plan_around_outbound_peers():
    """predicted_seconds is the pipelined butterfly's model time of the shares the plan actually
    gives (outbound-only peers send and receive the whole tensor, owners carry the rest), not the
    layout's before they were taken out; a slower outbound-only link makes the round slower."""
    from shoal.coordinator.planner import predict_butterfly

    n = 1_000_000
    fast = plan_round(_links([(100, 100)] * 4), n, pb.FLOAT32, PlanPolicy(), outbound_only={"p3"})
    slow = plan_round(_links([(100, 100)] * 3 + [(5, 5)]), n, pb.FLOAT32, PlanPolicy(), outbound_only={"p3"})
    for plan, rates in ((fast, [100] * 4), (slow, [100, 100, 100, 5])):
        assert isinstance(plan, Plan) and 3 not in plan.shard_owner
        w = [0.0] * 4
        for k, o in enumerate(plan.shard_owner):
            w[o] += (plan.shard_bounds[k + 1] - plan.shard_bounds[k]) / n
        r = [x * MB for x in rates]
        assert plan.predicted_seconds == pytest.approx(predict_butterfly(r, r, 4.0 * n, w, [0.02] * 4))
    # p3 sends its whole input and receives the whole result over 5 MB/s: at least 0.8 s.
    assert slow.predicted_seconds >= 4.0 * n / (5 * MB) > fast.predicted_seconds


def test_without_outbound_peers_the_plan_is_unchanged():
    links = _links([(10, 10)] * 4)
    a = plan_round(links, 4000, pb.FLOAT32, PlanPolicy())
    b = plan_round(links, 4000, pb.FLOAT32, PlanPolicy(), outbound_only={"nobody"})
    assert a == b and a.outbound_only == ()


def test_no_reachable_trusted_owner_is_no_plan():
    links = _links([(10, 10)] * 3)
    assert isinstance(plan_round(links, 4000, pb.FLOAT32, PlanPolicy(), outbound_only={"p0", "p1", "p2"}), NoPlan)
    # The only reachable one is untrusted: nobody may own shards.
    got = plan_round(links, 4000, pb.FLOAT32, PlanPolicy(), outbound_only={"p0", "p1"}, untrusted={"p2"})
    assert isinstance(got, NoPlan)
    ok = plan_round(links, 4000, pb.FLOAT32, PlanPolicy(), outbound_only={"p0"}, untrusted={"p2"})
    assert isinstance(ok, Plan) and set(ok.shard_owner) == {1}


def test_shares_of_outbound_owners_go_to_the_others_in_proportion():
    plan = Plan(("a", "b", "c"), "butterfly", (0, 50, 80, 100), (0, 1, 2), num_elements=100)
    out = without_outbound_owners(plan, {"a"})
    assert out is not None and out.shard_owner == (1, 2) and out.shard_bounds == (0, 60, 100)
    assert out.outbound_only == (0,) and out.demoted == ("a",)


def test_the_engine_places_unreachable_and_outbound_only_members_as_outbound_only():
    cfg = EngineConfig(min_peers=3, initial_peers=3, ready_timeout=5.0)
    e = RoundEngine(cfg)
    e.join("a", b"ka", "10.0.0.1:7000", 10, 0.0, reachable=True, connected=True)
    e.join("b", b"kb", "10.0.0.2:7000", 10, 0.0, reachable=False, connected=True)
    e.join("c", b"kc", "10.0.0.3:7000", 10, 0.0, outbound_only=True, connected=True)
    actions = []
    for p in "abc":
        actions += e.ready(p, 0, ReadyInfo(1000, pb.FLOAT32, 10, b"", 0, 1.0), 1.0)
    plans = [a.plan for a in actions if isinstance(a, SendPlan)]
    assert plans, "a round opens with the outbound-only members in it"
    plan = plans[-1]
    assert set(plan.participants) == {"a", "b", "c"}
    assert plan.collective == "butterfly"
    assert {plan.participants[i] for i in plan.outbound_only} == {"b", "c"}
    assert {plan.participants[o] for o in plan.shard_owner} == {"a"}


def test_an_outbound_only_peer_whose_exchanges_all_broke_is_the_one_blamed():
    # Its NAT forgot the mapping: every exchange breaks at once, it names every owner
    # (peer.lanes.streams.ExchangeLane), the owners voted ok: it is cut off from the others.
    votes = {"a": (), "b": (), "c": (), "o": ("a", "b")}
    assert blame(("a", "b", "c", "o"), votes, voted_at={"a": 1.0, "b": 1.0, "c": 1.0, "o": 1.2},
                 cascade=2.0) == ("o",)
    # An owner that died is silent: it is blamed, not the outbound-only peer naming every owner.
    votes = {"b": ("a",), "c": ("a",), "o": ("a", "b")}
    assert blame(("a", "b", "c", "o"), votes, voted_at={"b": 1.0, "c": 1.0, "o": 1.1}, cascade=2.0) == ("a",)


def test_the_engine_excludes_an_outbound_only_peer_whose_calls_to_every_owner_broke():
    e = RoundEngine(EngineConfig(min_peers=2, initial_peers=4, ready_timeout=5.0, retry_backoff=0.0))
    for p in "abcd":
        e.join(p, b"k" + p.encode(), f"10.0.0.{ord(p)}:7000", 10, 0.0, reachable=p != "d", connected=True)
    acts = [a for p in "abcd" for a in e.ready(p, 0, ReadyInfo(1000, pb.FLOAT32, 10, b"", 0, 1.0), 1.0)]
    (plan,) = [a.plan for a in acts if isinstance(a, SendPlan)]
    owners = tuple(plan.participants[o] for o in plan.owners())
    assert len(owners) == 3 and "d" not in owners
    acts = e.vote("d", 0, plan.attempt, False, b"", b"", 1.5, suspects=owners, error="exchange broke")
    (abort,) = [a for a in acts if isinstance(a, SendAbort)]
    assert abort.record.excluded == ("d",)


async def test_status_says_which_members_are_outbound_only():
    svc = service(clock=10.0)
    svc.apply(svc.engine.join("a", b"\1" * 32, "10.0.0.1:1", 1, 0.0, reachable=True))
    svc.apply(svc.engine.join("b", b"\2" * 32, "10.0.0.2:1", 1, 0.0, reachable=False))
    svc.apply(svc.engine.join("c", b"\3" * 32, "10.0.0.3:1", 1, 0.0, outbound_only=True))
    resp = await svc.GetStatus(pb.StatusRequest(), None)
    got = {m.peer_id: (m.reachability, m.outbound_only) for m in resp.members}
    assert got == {"a": ("reachable", False), "b": ("unreachable", True), "c": ("unchecked", True)}
    rows = [{"peer_id": m.peer_id * 12, "address": m.address, "state": m.state, "untrusted": False,
             "lease_remaining_seconds": 1.0, "num_samples": 1, "shm_peers": 0, "reachability": m.reachability,
             "outbound_only": m.outbound_only,
             "links": {"up_bytes_per_s": 0, "down_bytes_per_s": 0, "rtt_seconds": 0, "age_seconds": None}}
            for m in resp.members]
    table = render_table({"coordinator": "c", "epoch": 0, "round": 0, "rounds_committed": 0, "rounds_aborted": 0,
                          "run_config": {}, "waiting": {}, "members": rows, "rounds": []})
    lines = {line.split()[0][:1]: line for line in table.splitlines() if line[:1] in "abc" and line.split()}
    assert "reach" in table
    assert "reachable" in lines["a"] and "outbound-only" in lines["b"] and "outbound-only" in lines["c"]


def test_eligible_fractions_solve_the_pipelined_model_without_the_outbound_peers():
    # Two fast reachable peers, two slow NATed ones: the fast ones split the tensor evenly, and
    # the round takes what the slow ones need anyway (n / 50 Mbit/s), the bound on these links.
    assert eligible_fractions([12.5e6, 12.5e6, 6.25e6, 6.25e6], [0, 1]) == pytest.approx([0.5, 0.5])
    # A reachable peer much faster than the other: it owns everything (the other is demoted).
    assert eligible_fractions([10.0, 40.0, 10.0, 10.0], [0, 1]) == pytest.approx([0.0, 1.0])
    # Shares follow capacity where the outbound peers do not bound the round.
    w = eligible_fractions([20.0, 40.0, 100.0, 100.0, 100.0], [0, 1])
    assert sum(w) == pytest.approx(1.0) and w[1] > w[0] > 0
    mb = 1e6 / 8
    links = [LinkSpec(f"p{i}", r * mb, r * mb, 0.001) for i, r in enumerate([100, 100, 50, 50])]
    plan = plan_round(links, 1_000_000, pb.FLOAT32, PlanPolicy(), outbound_only={"p2", "p3"})
    assert plan.shard_owner == (0, 1) and plan.shard_bounds == (0, 500_000, 1_000_000)


def test_a_round_whose_excluded_peers_were_its_only_reachable_owners_takes_them_back():
    """Seen in the compose test (a container restarted with a new address, dial-backs failed under
    load): two members outbound-only, the two reachable ones excluded by the round's aborts. The
    round could then never be planned, and its excluded peers would come back only in the next
    round: it waited for ever. Now it lets them back in (its attempt limit still bounds it)."""
    e = RoundEngine(EngineConfig(min_peers=2, initial_peers=4, ready_timeout=5.0, retry_backoff=0.0,
                                 max_attempts=5))
    for p in "abcd":
        e.join(p, b"k" + p.encode(), f"10.0.0.{ord(p)}:7000", 10, 0.0, reachable=p in "ab", connected=True)
    info = ReadyInfo(1000, pb.FLOAT32, 10, b"", 0, 1.0)
    acts = [a for p in "abcd" for a in e.ready(p, 0, info, 1.0)]
    (plan,) = [a.plan for a in acts if isinstance(a, SendPlan)]
    assert {plan.participants[o] for o in plan.owners()} == {"a", "b"}
    # Owner b fails; then, on the retry, owner a: both reachable owners are excluded.
    abort = _all_vote(e, plan, "b", 1.5)
    assert abort.record.excluded == ("b",) and abort.record.will_retry
    retry = [a.plan for a in e.tick(2.0) if isinstance(a, SendPlan)]
    assert retry and "b" not in retry[0].participants
    abort = _all_vote(e, retry[0], "a", 2.5)
    assert abort.record.excluded == ("a",) and abort.record.will_retry
    plans = [a.plan for t in (3.0, 4.0, 5.0, 10.0) for a in e.tick(t) if isinstance(a, SendPlan)]
    assert plans, "the round is planned again with the excluded owners back"
    assert {"a", "b"} <= set(plans[0].participants)


def _all_vote(e: RoundEngine, plan: Plan, culprit: str, now: float) -> SendAbort:
    """`culprit` votes failed naming nobody (it blames itself); the abort that follows."""
    acts = e.vote(culprit, 0, plan.attempt, False, b"", b"", now, error="reduction raised")
    (abort,) = [a for a in acts if isinstance(a, SendAbort)]
    return abort
