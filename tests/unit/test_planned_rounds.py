"""The planner inside the round engine, without sockets: reported links in, planned rounds out."""

from __future__ import annotations

import math

import pytest

from shoal.coordinator.planner import LinkSpec, PlanPolicy, plan_collective, plan_layout
from shoal.coordinator.rounds import EngineConfig, ReadyInfo, RoundEngine, SendPlan

from kits.engine import engine

KEY = bytes(32)
MBIT = 1e6 / 8


def open_round(e: RoundEngine, links: dict[str, tuple[float, float, float]], n: int = 1_000_000,
               peers=("a", "b", "c", "d")):
    for p in peers:
        e.join(p, KEY, f"10.0.0.{len(p)}:1", 1, 0.0)
        e.connected(p, 0.0)
    for p, (up, down, rtt) in links.items():
        e.report_links(p, up, down, rtt)
    acts = []
    for p in peers:
        acts += e.ready(p, 0, ReadyInfo(n, 1, 1, b"", 0, 0.0), 0.1)
    (plan,) = [a.plan for a in acts if isinstance(a, SendPlan)]
    return plan


def fractions(plan) -> dict[str, float]:
    n = plan.shard_bounds[-1]
    out = {p: 0.0 for p in plan.participants}
    for k, owner in enumerate(plan.shard_owner):
        out[plan.participants[owner]] += (plan.shard_bounds[k + 1] - plan.shard_bounds[k]) / n
    return out


def test_no_links_gives_static_equal_butterfly():
    plan = open_round(engine(), {}, n=10)
    assert plan.collective == "butterfly"
    assert plan.participants == ("a", "b", "c", "d")
    assert plan.shard_bounds == (0, 2, 5, 7, 10)
    assert plan.shard_owner == (0, 1, 2, 3)
    assert plan.predicted_seconds == 0.0 and plan.demoted == ()


def test_explicit_algorithm_without_links_is_kept():
    plan = open_round(engine(collective="ring"), {}, n=10)
    assert plan.collective == "ring" and plan.shard_bounds == (0, 2, 5, 7, 10)


def test_uniform_links_equal_shards_and_prediction_matches_model():
    links = {p: (100 * MBIT, 100 * MBIT, 0.0) for p in "abcd"}
    plan = open_round(engine(), links, n=4_000_000)
    # Even links: the ring (one flow per direction per peer) is preferred to an equally fast butterfly.
    assert plan.collective == "ring"
    assert all(math.isclose(f, 0.25) for f in fractions(plan).values())
    n_bytes = 16e6
    # Ring: 2(p-1) steps of n/p bytes, which here is also the bound 2(p-1)n/(pB).
    assert plan.predicted_seconds == pytest.approx(n_bytes * 1.5 / (100 * MBIT))
    assert plan.bound_seconds == pytest.approx(plan.predicted_seconds)


def test_slow_peer_is_demoted_to_non_owner():
    links = {"a": (100 * MBIT,) * 2 + (0.0,), "b": (100 * MBIT,) * 2 + (0.0,), "c": (100 * MBIT,) * 2 + (0.0,),
             "d": (10 * MBIT, 10 * MBIT, 0.0)}
    plan = open_round(engine(), links, n=4_000_000)
    f = fractions(plan)
    assert plan.collective == "butterfly"
    assert f["d"] == 0.0 and plan.demoted == ("d",)
    assert sorted(plan.participants) == ["a", "b", "c", "d"]
    assert all(plan.participants[o] != "d" for o in plan.shard_owner)
    # The slow peer still sends its whole input and receives the whole result: the floor n / 10 Mbit.
    assert plan.predicted_seconds == pytest.approx(16e6 / (10 * MBIT), rel=1e-6)
    assert plan.bound_seconds == pytest.approx(16e6 / (10 * MBIT), rel=1e-6)
    # Chunks sized to cross the slowest link in ~0.15 s (a short pipeline fill and drain).
    assert plan.chunk_bytes == int(10 * MBIT * 0.15) < EngineConfig().chunk_bytes


def test_engine_layout_equals_planner_with_owner_positions():
    ups = [40, 100, 70, 25]
    downs = [90, 30, 70, 50]
    links = {p: (u * MBIT, d * MBIT, 0.0) for p, u, d in zip("abcd", ups, downs)}
    plan = open_round(engine(plan_min_gain=0.0), links, n=999_983)
    spec = [LinkSpec(p, u * MBIT, d * MBIT) for p, u, d in zip("abcd", ups, downs)]
    bfly, ring = (plan_collective(spec, 999_983, 4, collective=c) for c in ("butterfly", "ring"))
    ref = ring if ring.predicted_seconds < bfly.predicted_seconds else bfly
    assert plan.collective == ref.collective
    assert plan.participants == ref.participants
    assert plan.shard_bounds == ref.shard_bounds
    assert plan.shard_owner == ref.shard_owner
    assert plan.predicted_seconds == pytest.approx(ref.predicted_seconds)


def test_explicit_ring_is_planned_as_ring_with_consistent_owners():
    ups = [40, 100, 70, 25]
    links = {p: (u * MBIT, u * MBIT, 0.001) for p, u in zip("abcd", ups)}
    plan = open_round(engine(collective="ring"), links, n=1000)
    assert plan.collective == "ring"
    assert sorted(plan.participants) == list("abcd")
    p = len(plan.participants)
    # peer.collectives' ring: position k-1 ends the reduce-scatter holding shard k.
    assert plan.shard_owner == tuple((k - 1) % p for k in range(p))


def test_unmeasured_member_gets_the_median_and_noise_keeps_equal_shards():
    links = [LinkSpec(p, u, u, 0.0) for p, u in
             [("a", 10e6), ("b", 0.0), ("c", 14e6), ("d", 8e6)]]  # 100 Mbit/s links, noisy probes
    lay = plan_layout(links, 1000)
    assert lay.collective == "ring" and lay.shard_bounds == (0, 250, 500, 750, 1000)
    lay = plan_layout(links, 1000, policy=PlanPolicy(collective="butterfly"))
    assert lay.collective == "butterfly" and lay.shard_bounds == (0, 250, 500, 750, 1000)
    assert lay.predicted_seconds > 0


def test_fast_links_above_the_cap_count_as_equal():
    # One host (shared memory): every link faster than the data plane; equal butterfly shards (CPU-bound).
    rates = [("a", 200e6), ("b", 330e6), ("c", 210e6)]
    links = [LinkSpec(p, u, u, 0.0, shm_peers=frozenset("abc") - {p}) for p, u in rates]
    lay = plan_layout(links, 999, policy=PlanPolicy(link_cap_bytes_per_s=100e6))
    assert lay.collective == "butterfly" and lay.shard_bounds == (0, 333, 666, 999) and lay.demoted == ()
    # Separate hosts with 1 Gbit/s links (measured above the cap, tbf's burst included): the ring, equal shards.
    gbit = [("a", 112e6), ("b", 150e6), ("c", 120e6)]
    lay = plan_layout([LinkSpec(p, u, u, 0.0) for p, u in gbit], 999, policy=PlanPolicy(link_cap_bytes_per_s=100e6))
    assert lay.collective == "ring" and lay.shard_bounds == (0, 333, 666, 999)
    # Separate hosts on 10 Gbit/s links (measured at 300 MB/s and more; 196 MB/s and more where the
    # CPU reads lower): the CPU is the limit, the butterfly.
    for measured in ([("a", 320e6), ("b", 900e6), ("c", 400e6)], [("a", 196e6), ("b", 231e6), ("c", 210e6)]):
        fast = [LinkSpec(p, u, u, 0.0) for p, u in measured]
        lay = plan_layout(fast, 999, policy=PlanPolicy(link_cap_bytes_per_s=100e6))
        assert lay.collective == "butterfly" and lay.shard_bounds == (0, 333, 666, 999)


def test_owner_side_aggregator_keeps_butterfly():
    ups = [10, 100, 100, 100]
    links = {p: (u * MBIT, u * MBIT, 0.05) for p, u in zip("abcd", ups)}
    assert open_round(engine(aggregator="median"), links, n=100).collective == "butterfly"


def test_odd_measurements_never_break_planning():
    # inf counts as the cap, NaN and negative rates as unmeasured (the median of the others).
    links = [LinkSpec("a", float("inf"), 1e6), LinkSpec("b", 0.0, 0.0), LinkSpec("c", float("nan"), -5.0)]
    lay = plan_layout(links, 10)
    assert sorted(lay.participants) == ["a", "b", "c"]
    assert lay.shard_bounds[0] == 0 and lay.shard_bounds[-1] == 10
    assert math.isfinite(lay.predicted_seconds)


def test_chunk_size_follows_the_slowest_link_and_one_host_gets_big_chunks():
    fast = {p: (2e9, 2e9, 1e-4) for p in "abcd"}
    assert open_round(engine(), {}, n=4_000_000).chunk_bytes == 1 << 20  # links unknown: the configured size
    assert open_round(engine(), fast, n=4_000_000).chunk_bytes == 1 << 20  # capped by the configured size
    slow = {p: (10 * MBIT, 10 * MBIT, 0.0) for p in "abcd"}
    plan = open_round(engine(), slow, n=4_000_000)
    assert plan.chunk_bytes == int(10 * MBIT * 0.15)
    # The chunk deadline uses the plan's chunk, not the configured largest one.
    # (plus the collective's expected time: a chunk may wait behind its sender's whole phase).
    assert plan.chunk_timeout_seconds == pytest.approx(
        max(2.0, 4.0 * plan.chunk_bytes / (10 * MBIT) + plan.predicted_seconds), rel=0.05)
    # Every participant reaches every other through shared memory: the shared-memory chunk size.
    e = engine()
    for p in "abcd":
        e.join(p, KEY, f"10.0.0.{ord(p)}:1", 1, 0.0)
        e.connected(p, 0.0)
    for p in "abcd":
        e.report_links(p, 2e9, 2e9, 1e-4, tuple(q for q in "abcd" if q != p))
    acts = [a for p in "abcd" for a in e.ready(p, 0, ReadyInfo(4_000_000, 1, 1, b"", 0, 0.0), 0.1)]
    (plan,) = [a.plan for a in acts if isinstance(a, SendPlan)]
    assert plan.chunk_bytes == EngineConfig().shm_chunk_bytes == 4 << 20
    # One pair through a socket (d cannot read a's segments): back to the socket rule.
    e2 = engine()
    for p in "abcd":
        e2.join(p, KEY, f"10.0.0.{ord(p)}:1", 1, 0.0)
        e2.connected(p, 0.0)
    for p in "abcd":
        e2.report_links(p, 2e9, 2e9, 1e-4, tuple(q for q in "abcd" if q != p and (p, q) != ("d", "a")))
    acts = [a for p in "abcd" for a in e2.ready(p, 0, ReadyInfo(4_000_000, 1, 1, b"", 0, 0.0), 0.1)]
    (plan,) = [a.plan for a in acts if isinstance(a, SendPlan)]
    assert plan.chunk_bytes == 1 << 20
    # Hosts apart, every pair on the bulk TCP lane (LinkReport.bulk_peers): the bulk lane's cap; a
    # later report without one pair (a lane that fell back to gRPC) brings the socket cap back.
    e3 = engine()
    for p in "abcd":
        e3.join(p, KEY, f"10.0.0.{ord(p)}:1", 1, 0.0)
        e3.connected(p, 0.0)
    for p in "abcd":
        e3.report_links(p, 1.2e9, 1.2e9, 1e-4, (), bulk_peers=tuple(q for q in "abcd" if q != p))
    acts = [a for p in "abcd" for a in e3.ready(p, 0, ReadyInfo(4_000_000, 1, 1, b"", 0, 0.0), 0.1)]
    (plan,) = [a.plan for a in acts if isinstance(a, SendPlan)]
    assert plan.chunk_bytes == EngineConfig().bulk_chunk_bytes == 4 << 20
    assert e3.members["a"].link().bulk_peers == frozenset("bcd")
    e3.report_links("b", 1.2e9, 1.2e9, 1e-4, (), bulk_peers=("c", "d"))
    assert e3.members["b"].link().bulk_peers == frozenset("cd")
