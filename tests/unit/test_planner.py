"""The collective planner: LP optimality against brute force, closed forms, edge cases, and the
coordinator's planning policy (`plan_round`) on reported links. No sockets, no grpc."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest

from shoal.common.plan import Plan
from shoal.coordinator.planner import (
    LinkSpec,
    NoPlan,
    PlanPolicy,
    allreduce_lower_bound,
    best_ring_order,
    butterfly_fractions,
    control_seconds,
    chunk_deadline,
    conservative_seconds,
    plan_collective,
    plan_round,
    predict_butterfly,
    predict_ring,
    shard_bounds_from_fractions,
    simple_floor,
    without_untrusted_owners,
)

MBIT = 1e6 / 8  # bytes/s


def _simplex_grid(p: int, steps: int) -> np.ndarray:
    """All fraction vectors with entries in multiples of 1/steps summing to 1."""
    out = []
    for c in itertools.product(range(steps + 1), repeat=p - 1):
        if sum(c) <= steps:
            out.append((*c, steps - sum(c)))
    return np.array(out, dtype=np.float64) / steps


def _random_links(rng: np.random.Generator, p: int) -> tuple[np.ndarray, np.ndarray]:
    return rng.uniform(1, 100, p) * MBIT, rng.uniform(1, 100, p) * MBIT


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("p,steps", [(2, 40), (3, 30), (4, 20), (5, 12)])
def test_butterfly_lp_beats_every_grid_point(p: int, steps: int, overlap: bool) -> None:
    rng = np.random.default_rng(p * 10 + overlap)
    grid = _simplex_grid(p, steps)
    for _ in range(4):
        u, d = _random_links(rng, p)
        n = 1e8
        w = butterfly_fractions(u, d, overlap=overlap)
        assert w.shape == (p,) and np.all(w >= 0) and math.isclose(w.sum(), 1.0)
        t_lp = predict_butterfly(u, d, n, w, overlap=overlap)
        t_grid = min(predict_butterfly(u, d, n, g, overlap=overlap) for g in grid)
        assert t_lp <= t_grid * (1 + 1e-7)
        assert t_lp >= allreduce_lower_bound(u, d, n) * (1 - 1e-9)


@pytest.mark.parametrize("p", [3, 4, 5])
def test_ring_order_is_optimal_over_all_permutations(p: int) -> None:
    rng = np.random.default_rng(p)
    n = 4e7
    for _ in range(5):
        u, d = _random_links(rng, p)
        rtt = rng.uniform(0, 0.2, p)
        pairwise = rng.uniform(1, 120, (p, p)) * MBIT
        order = best_ring_order(u, d, rtt=rtt, segment_bytes=n / p, pairwise=pairwise)
        assert sorted(order) == list(range(p))
        got = predict_ring(u, d, n, order, rtt, pairwise=pairwise)
        brute = min(predict_ring(u, d, n, perm, rtt, pairwise=pairwise) for perm in itertools.permutations(range(p)))
        assert got == pytest.approx(brute, rel=1e-12)


def test_ring_order_heuristic_beyond_exact_limit() -> None:
    rng = np.random.default_rng(7)
    p = 7
    u, d = _random_links(rng, p)
    pairwise = rng.uniform(1, 120, (p, p)) * MBIT
    exact = best_ring_order(u, d, pairwise=pairwise)
    heur = best_ring_order(u, d, pairwise=pairwise, exact_limit=3)
    assert sorted(heur) == list(range(p))
    t_exact = predict_ring(u, d, 1e6, exact, pairwise=pairwise)
    t_heur = predict_ring(u, d, 1e6, heur, pairwise=pairwise)
    assert t_exact <= t_heur
    assert t_heur <= predict_ring(u, d, 1e6, range(p), pairwise=pairwise)
    # 40 peers: bounded time, a valid permutation.
    big_u, big_d = _random_links(rng, 40)
    assert sorted(best_ring_order(big_u, big_d, pairwise=rng.uniform(1, 9, (40, 40)))) == list(range(40))


def test_per_peer_ring_bottleneck_does_not_depend_on_order() -> None:
    u = np.array([10.0, 50, 30, 80]) * MBIT
    d = np.array([70.0, 20, 90, 40]) * MBIT
    times = {predict_ring(u, d, 1e6, perm) for perm in itertools.permutations(range(4))}
    expected = 2 * 3 * (1e6 / 4) / (10 * MBIT)
    assert all(t == pytest.approx(expected) for t in times)


def test_closed_forms() -> None:
    u = np.array([4.0, 2.0, 8.0])
    d = np.array([6.0, 3.0, 1.0])
    rtt = np.array([0.2, 0.4, 0.0])
    n = 12.0
    # ring 0→1→2→0: links min(4,3)=3, min(2,1)=1, min(8,6)=6; alphas (0.1+0.2)/2, (0.2+0)/2, (0+0.1)/2
    assert predict_ring(u, d, n, (0, 1, 2), rtt) == pytest.approx(2 * 2 * max(0.15 + 4 / 3, 0.1 + 4 / 1, 0.05 + 4 / 6))
    w = np.array([0.5, 0.25, 0.25])
    t_rs = max(max(n * (1 - w) / u), max(n * 2 * w / d))
    t_ag = max(max(n * 2 * w / u), max(n * (1 - w) / d))
    lat = 2 * 2 * 0.15  # 2(p-1) · max pairwise one-way latency
    assert predict_butterfly(u, d, n, w, rtt, overlap=False) == pytest.approx(t_rs + t_ag + lat)
    t_pipe = max(n * (1 + w) / np.minimum(u, d))
    assert predict_butterfly(u, d, n, w, rtt, overlap=True) == pytest.approx(t_pipe + lat)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("p", [2, 3, 4, 7])
def test_uniform_links_equal_shards_ring_equals_butterfly(p: int, overlap: bool) -> None:
    b = 50 * MBIT
    n = 1e8
    w = butterfly_fractions([b] * p, [b] * p, overlap=overlap)
    np.testing.assert_allclose(w, np.full(p, 1 / p), rtol=1e-9)
    ring = predict_ring([b] * p, [b] * p, n)
    bfly = predict_butterfly([b] * p, [b] * p, n, w, overlap=overlap)
    optimal = 2 * (p - 1) / p * n / b
    assert ring == pytest.approx(optimal) and bfly == pytest.approx(optimal)
    assert allreduce_lower_bound([b] * p, [b] * p, n) == pytest.approx(optimal)  # tight
    plan = plan_collective([LinkSpec(f"p{i}", b, b) for i in range(p)], 1000 * p, overlap=overlap)
    assert np.all(np.diff(plan.shard_bounds) == 1000)
    assert plan.predicted_seconds == pytest.approx(optimal * 1000 * p * 4 / n)


def test_one_slow_peer_pipelined_gets_no_shard_and_beats_uniform() -> None:
    rates = [100 * MBIT, 100 * MBIT, 100 * MBIT, 10 * MBIT]
    n = 1e8
    w = butterfly_fractions(rates, rates, overlap=True)
    assert w[3] < 0.25 and w[3] == 0.0
    np.testing.assert_allclose(w[:3], 1 / 3)
    t_opt = predict_butterfly(rates, rates, n, w, overlap=True)
    t_uniform = predict_butterfly(rates, rates, n, None, overlap=True)
    assert t_opt < t_uniform
    assert t_opt == pytest.approx(n / (10 * MBIT))  # reaches the simple floor n / min(u, d) exactly
    assert t_opt == pytest.approx(simple_floor(rates, rates, n))
    plan = plan_collective([LinkSpec(f"p{i}", r, r) for i, r in enumerate(rates)], 25_000_000)
    assert plan.collective == "butterfly" and plan.demoted == ("p3",)
    assert plan.participants == ("p0", "p1", "p2", "p3")  # the butterfly keeps the given order
    assert plan.shard_owner == (0, 1, 2) and len(plan.shard_bounds) == 4
    assert plan.predicted_seconds == pytest.approx(plan.bound_seconds)
    assert plan.predicted_seconds < predict_ring(rates, rates, n)


def test_one_slow_peer_phased_model() -> None:
    rates = [100 * MBIT, 100 * MBIT, 100 * MBIT, 10 * MBIT]
    n = 1e8
    # Symmetric slow peer: its reduce-scatter and all-gather loads balance at w = 1/p exactly,
    # so in the phased model the uniform split is optimal (a smaller shard would be slower).
    w = butterfly_fractions(rates, rates, overlap=False)
    np.testing.assert_allclose(w, 0.25)
    smaller = np.array([0.3, 0.3, 0.3, 0.1])
    assert predict_butterfly(rates, rates, n, smaller, overlap=False) > predict_butterfly(rates, rates, n, w, overlap=False)
    # A slow *uploader* does get a smaller shard, and it beats the uniform split.
    up = [100 * MBIT, 100 * MBIT, 100 * MBIT, 10 * MBIT]
    down = [100 * MBIT] * 4
    w = butterfly_fractions(up, down, overlap=False)
    assert w[3] < 0.25
    assert predict_butterfly(up, down, n, w, overlap=False) < predict_butterfly(up, down, n, None, overlap=False)


def test_num_elements_smaller_than_participants() -> None:
    links = [LinkSpec(f"p{i}", (i + 1) * MBIT, (i + 1) * MBIT) for i in range(5)]
    for collective in ("ring", "butterfly"):
        plan = plan_collective(links, 3, collective=collective)
        b = plan.shard_bounds
        assert b[0] == 0 and b[-1] == 3 and all(x <= y for x, y in zip(b, b[1:]))
        assert len(b) == len(plan.shard_owner) + 1 and plan.num_elements == 3
        assert sorted(plan.participants) == [f"p{i}" for i in range(5)]
        assert all(0 <= o < 5 for o in plan.shard_owner)
    plan = plan_collective(links, 0)
    assert plan.shard_bounds[-1] == 0 and plan.predicted_seconds == 0.0


def test_single_participant() -> None:
    plan = plan_collective([LinkSpec("solo", MBIT, MBIT, 0.1)], 1000)
    assert plan.participants == ("solo",) and plan.shard_bounds == (0, 1000) and plan.shard_owner == (0,)
    assert plan.predicted_seconds == 0.0 and plan.bound_seconds == 0.0 and plan.demoted == ()
    assert plan_collective([LinkSpec("solo", MBIT, MBIT)], 10, collective="ring").collective == "ring"


def test_bound_below_every_prediction() -> None:
    rng = np.random.default_rng(0)
    for p in range(2, 9):
        u, d = _random_links(rng, p)
        n = 1e7
        lb = allreduce_lower_bound(u, d, n)
        assert lb >= simple_floor(u, d, n) * (1 - 1e-12)
        for overlap in (False, True):
            assert predict_butterfly(u, d, n, butterfly_fractions(u, d, overlap=overlap), overlap=overlap) >= lb * (1 - 1e-9)
        assert predict_ring(u, d, n) >= lb * (1 - 1e-9)


def test_collective_is_planned_as_asked_and_predicted_by_its_model() -> None:
    rng = np.random.default_rng(11)
    u, d = _random_links(rng, 5)
    rtt = rng.uniform(0, 0.1, 5)
    links = [LinkSpec(f"p{i}", u[i], d[i], rtt[i]) for i in range(5)]
    idx = {f"p{i}": i for i in range(5)}
    n = 1_000_000
    ring = plan_collective(links, n, collective="ring")
    order = [idx[p] for p in ring.participants]
    assert ring.collective == "ring" and ring.demoted == ()
    assert ring.predicted_seconds == pytest.approx(predict_ring(u, d, 4 * n, order, rtt))
    bfly = plan_collective(links, n, collective="butterfly")
    w = np.zeros(5)
    w[list(bfly.shard_owner)] = np.diff(bfly.shard_bounds) / n
    assert bfly.collective == "butterfly"
    assert bfly.predicted_seconds == pytest.approx(predict_butterfly(u, d, 4 * n, w, rtt))
    for plan in (ring, bfly):
        assert plan.bound_seconds == pytest.approx(allreduce_lower_bound(u, d, 4 * n))
        assert plan.floor_seconds == pytest.approx(simple_floor(u, d, 4 * n))
    with pytest.raises(ValueError):
        plan_collective(links, 64, collective="tree")  # the data plane has no tree
    with pytest.raises(ValueError):
        plan_collective([LinkSpec("a", 0.0, 1.0), LinkSpec("b", 1.0, 1.0)], 10)
    with pytest.raises(ValueError):
        plan_collective([], 10)


def test_ring_plan_shapes_and_owner_positions() -> None:
    links = [LinkSpec(f"p{i}", r * MBIT, r * MBIT, 0.01 * i) for i, r in enumerate([10, 20, 30, 40, 50])]
    plan = plan_collective(links, 1003, collective="ring")
    assert isinstance(plan, Plan)
    # Shard k is owned by ring position k-1: the peer before it in collective order.
    assert plan.shard_owner == (4, 0, 1, 2, 3)
    assert tuple(plan.participants[o] for o in plan.shard_owner) == plan.participants[-1:] + plan.participants[:-1]
    assert sorted(plan.participants) == [l.peer_id for l in links]
    assert np.diff(plan.shard_bounds).tolist() in ([201, 201, 201, 200, 200],)
    bfly = plan_collective(links, 1003, collective="butterfly")
    assert bfly.participants == tuple(l.peer_id for l in links)  # the butterfly keeps the given order
    assert bfly.shard_owner == tuple(i for i in range(5) if bfly.participants[i] not in bfly.demoted)


def test_shard_bounds_from_fractions() -> None:
    assert shard_bounds_from_fractions([0.5, 0.5], 3) == (0, 2, 3)
    assert shard_bounds_from_fractions([0.0, 1.0, 0.0], 5) == (0, 0, 5, 5)
    assert shard_bounds_from_fractions([1 / 3] * 3, 2) == (0, 1, 2, 2)
    rng = np.random.default_rng(3)
    for _ in range(50):
        w = rng.dirichlet(np.ones(6))
        n = int(rng.integers(0, 1000))
        b = shard_bounds_from_fractions(w, n)
        counts = np.diff(b)
        assert b[0] == 0 and b[-1] == n and np.all(counts >= 0)
        assert np.all(np.abs(counts - w * n) < 1.0 + 1e-9)


def test_pairwise_caps_butterfly() -> None:
    u = d = np.full(3, 100 * MBIT)
    pairwise = np.full((3, 3), np.nan)
    pairwise[0, 1] = 1 * MBIT  # one congested path
    for overlap in (False, True):
        w = butterfly_fractions(u, d, overlap=overlap, pairwise=pairwise)
        t = predict_butterfly(u, d, 1e7, w, overlap=overlap, pairwise=pairwise)
        t_uniform = predict_butterfly(u, d, 1e7, None, overlap=overlap, pairwise=pairwise)
        assert t < t_uniform


# ---------------------------------------------------------------------------------------------
# the coordinator's policy: plan_round over reported links


def test_plan_round_without_measurements_is_static_and_carries_the_policy() -> None:
    links = [LinkSpec(p, 0.0, 0.0) for p in "abc"]  # nothing measured yet
    policy = PlanPolicy(collective="auto", aggregator="median", compression="int8", chunk_bytes=1 << 18)
    plan = plan_round(links, 10, 1, policy)
    assert isinstance(plan, Plan)
    assert plan.participants == ("a", "b", "c") and plan.collective == "butterfly"  # median: owners reduce
    assert plan.shard_bounds == (0, 3, 6, 10) and plan.shard_owner == (0, 1, 2) and plan.demoted == ()
    assert (plan.aggregator, plan.compression, plan.dtype, plan.num_elements) == ("median", "int8", 1, 10)
    # Nothing measured: deadlines from the assumed slow link, not the floor (docs/performance.md, "Links").
    assert plan.chunk_bytes == 1 << 18 and plan.chunk_timeout_seconds == policy.chunk_timeout  # 40 bytes
    big = plan_round(links, 1_000_000, 1, policy)
    expected = conservative_seconds(links, 1_000_000, 4, policy)
    assert big.chunk_timeout_seconds == chunk_deadline(links, policy, 1 << 18, expected_seconds=expected)
    assert big.chunk_timeout_seconds > 4.0 * (1 << 18) / policy.assumed_link > policy.chunk_timeout
    assert not plan.audit_owners and plan.predicted_seconds == 0.0
    ring = plan_round(links, 10, 1, PlanPolicy(collective="ring"))
    assert ring.collective == "ring" and ring.shard_bounds == (0, 3, 6, 10)


def test_untrusted_peers_own_no_shard_and_none_trusted_is_no_plan() -> None:
    links = [LinkSpec(p, 0.0, 0.0) for p in "abcd"]
    policy = PlanPolicy(collective="butterfly", audit_owners=True)
    plan = plan_round(links, 8, 1, policy, untrusted={"b", "d"})
    assert plan.shard_owner == (0, 2, 2, 0)  # b's shard to c (the next trusted owner), d's to a (cyclically)
    assert plan.demoted == ("b", "d") and plan.audit_owners  # two owners left: audited
    one = plan_round(links, 8, 1, policy, untrusted={"a", "b", "c"})
    assert set(one.shard_owner) == {3} and not one.audit_owners  # one owner has nobody to audit it
    none = plan_round(links, 8, 1, policy, untrusted=set("abcd"))
    assert isinstance(none, NoPlan) and "no trusted shard owner" in none.reason
    # The ring has no owner-side reduction: untrusted peers play it unchanged.
    ring = plan_round(links, 8, 1, PlanPolicy(collective="ring"), untrusted=set("abcd"))
    assert isinstance(ring, Plan) and ring.collective == "ring"


def test_without_untrusted_owners_moves_shards_to_trusted_peers() -> None:
    plan = Plan(("p0", "p1", "p2", "p3"), "butterfly", (0, 1, 2), (0, 1))
    moved = without_untrusted_owners(plan, {"p0", "p1"})  # no owner trusted: the trusted non-owners
    assert moved is not None and moved.shard_owner == (2, 2) and moved.demoted == ("p0", "p1", "p3")
    assert without_untrusted_owners(plan, {"p0", "p1", "p2", "p3"}) is None
    assert without_untrusted_owners(plan, set()).shard_owner == (0, 1)


def test_chunks_follow_the_slowest_link_or_shared_memory() -> None:
    policy = PlanPolicy()
    slow = [LinkSpec(p, 10 * MBIT, 10 * MBIT, 0.01) for p in "abcd"]
    plan = plan_round(slow, 4_000_000, 1, policy)
    assert plan.chunk_bytes == int(10 * MBIT * 0.15)
    expected = max(plan.predicted_seconds, conservative_seconds(slow, 4_000_000, 4, policy))
    assert plan.chunk_timeout_seconds == pytest.approx(
        max(2.0, 4.0 * plan.chunk_bytes / (10 * MBIT) + 0.02 + expected))
    assert plan.chunk_timeout_seconds == chunk_deadline(slow, policy, plan.chunk_bytes, expected_seconds=expected)
    assert chunk_deadline([LinkSpec("a", 0.0, 0.0)], policy, 1 << 20) == 4.0 * (1 << 20) / policy.assumed_link
    one_host = [LinkSpec(p, 2e9, 2e9, 1e-4, frozenset(set("abcd") - {p})) for p in "abcd"]
    assert plan_round(one_host, 4_000_000, 1, policy).chunk_bytes == policy.shm_chunk_bytes
    almost = [dataclasses.replace(l, shm_peers=l.shm_peers - {"a"}) if l.peer_id == "d" else l for l in one_host]
    assert plan_round(almost, 4_000_000, 1, policy).chunk_bytes == policy.chunk_bytes


def test_bulk_lane_pairs_get_larger_chunks_still_sized_to_the_slowest_link() -> None:
    """Every pair on the bulk TCP lane (or shared memory): the cap is bulk_chunk_bytes instead of
    chunk_bytes; one pair without it (a gRPC lane, in either direction) keeps chunk_bytes; slow
    links still get ~CHUNK_SECONDS of the slowest link per chunk."""
    policy = PlanPolicy(chunk_bytes=1 << 20, bulk_chunk_bytes=4 << 20)
    others = {p: frozenset(set("abcd") - {p}) for p in "abcd"}
    fast = [LinkSpec(p, 1.2e9, 1.2e9, 1e-4, bulk_peers=others[p]) for p in "abcd"]
    assert plan_round(fast, 16 << 20, 1, policy).chunk_bytes == 4 << 20
    # Two on one host (shared memory), the rest on the bulk lane: still every pair without gRPC.
    mixed = [dataclasses.replace(l, shm_peers=frozenset({"b"}) if l.peer_id == "a" else frozenset({"a"}),
                                 bulk_peers=others[l.peer_id] - {"a", "b"}) if l.peer_id in "ab" else l for l in fast]
    assert plan_round(mixed, 16 << 20, 1, policy).chunk_bytes == 4 << 20
    one_way = [dataclasses.replace(l, bulk_peers=l.bulk_peers - {"a"}) if l.peer_id == "c" else l for l in fast]
    assert plan_round(one_way, 16 << 20, 1, policy).chunk_bytes == 1 << 20
    slow = [dataclasses.replace(l, up_bytes_per_s=10 * MBIT, down_bytes_per_s=10 * MBIT) for l in fast]
    assert plan_round(slow, 16 << 20, 1, policy).chunk_bytes == int(10 * MBIT * 0.15)
    unmeasured = [dataclasses.replace(l, up_bytes_per_s=0.0, down_bytes_per_s=0.0) for l in fast]
    assert plan_round(unmeasured, 16 << 20, 1, policy).chunk_bytes == 4 << 20  # the static layout's, capped


def test_chunks_on_a_long_path_are_cut_so_that_a_shard_fills_the_pool() -> None:
    """A bandwidth-delay product above a chunk (100 ms at 1 Gbit/s: 12.5 MB) cuts each shard into
    PIPELINE_CHUNKS chunks at least; a short path keeps the slowest-link chunk."""
    from shoal.coordinator.planner import MIN_CHUNK_BYTES, PIPELINE_CHUNKS

    policy = PlanPolicy(chunk_bytes=1 << 20, bulk_chunk_bytes=4 << 20)
    others = {p: frozenset(set("abcd") - {p}) for p in "abcd"}
    n = 16_000_000  # float32: 64 MB, 16 MB shards
    lan = [LinkSpec(p, 125e6, 125e6, 2e-4, bulk_peers=others[p]) for p in "abcd"]
    assert plan_round(lan, n, 1, policy).chunk_bytes == 4 << 20
    far = [dataclasses.replace(l, rtt_seconds=0.1) for l in lan]
    plan = plan_round(far, n, 1, policy)
    shard = min(b - a for a, b in zip(plan.shard_bounds, plan.shard_bounds[1:])) * 4
    assert plan.chunk_bytes == shard // PIPELINE_CHUNKS < 4 << 20
    small = plan_round(far, 400_000, 1, policy)  # 1.6 MB: the floor holds
    assert small.chunk_bytes == MIN_CHUNK_BYTES


def test_control_seconds_is_the_farthest_participants_round_trip_and_five_of_them_when_secure():
    assert control_seconds([0.03, 0.1, 0.2, 0.24]) == 0.24  # plan out and vote back: one round trip
    assert control_seconds([0.03, 0.1, 0.2, 0.24], secure=True) == pytest.approx(1.2)  # + shares + reveals
    assert control_seconds([0.0, 0.05, float("nan")]) == 0.05  # not measured: left out
    assert control_seconds([]) == 0.0 and control_seconds([0.0, 0.0]) == 0.0
