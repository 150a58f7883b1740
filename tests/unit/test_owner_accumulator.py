"""The shard owner's accumulator (peer/reduction.py: OwnerAccumulator): rows in, chunk by chunk,
in any order; the sum, a robust aggregate, partial distance matrices. No streams, no event loop."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from shoal.common.plan import Plan
from shoal.peer.aggregators import make_aggregator, partial_sq_distances
from shoal.peer.partition import ShardPartition
from shoal.peer.reduction import OwnerAccumulator, OwnerReduction, ReductionSpec, distance_matrix

P, N = 4, 50  # two shards of 25 elements, chunks of 8: four chunks per shard (the last of one element)


def _partition(me: str = "a", p: int = P, n: int = N) -> ShardPartition:
    plan = Plan(participants=tuple("abcd")[:p], collective="butterfly", shard_bounds=(0, n // 2, n),
                shard_owner=(0, 1), chunk_bytes=32)
    return ShardPartition(plan, me, 4)


def _rows(seed: int = 0, p: int = P, n: int = N) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # Magnitudes that differ by orders, so that the order of the float32 additions shows in the bits.
    return (rng.standard_normal((p, n)) * 10.0 ** rng.integers(-4, 5, (p, n))).astype(np.float32)


def _plan_order_sum(rows: np.ndarray) -> np.ndarray:
    total = rows[0].copy()
    for r in rows[1:]:
        total += r
    return total


def test_sum_in_any_arrival_order_has_the_bits_of_the_plan_order_sum():
    part, x = _partition(), _rows()
    orders = list(itertools.permutations(range(P)))
    results = set()
    for order in orders:
        acc = OwnerAccumulator(part, part.owned, None, np.float32)
        for span in part.chunks(0):
            for j in order:
                assert not acc.complete(span)
                acc.add(span, j, x[j, span.lo:span.hi])
            assert acc.complete(span)
            got = acc.reduce(span)
            assert got.dtype == np.float32
            assert got.tobytes() == _plan_order_sum(x[:, span.lo:span.hi]).tobytes(), order
            results.add(got.tobytes())
            assert not acc.complete(span)  # released
    assert len(results) == len(part.chunks(0))
    # The check above can fail: another order of the same additions gives other bits here.
    span = part.chunks(0)[0]
    assert _plan_order_sum(x[::-1, span.lo:span.hi]).tobytes() != _plan_order_sum(x[:, span.lo:span.hi]).tobytes()


def test_the_sum_owns_its_result():
    part, x = _partition(), _rows()
    acc = OwnerAccumulator(part, part.owned, None, np.float32)
    span = part.chunks(0)[0]
    for j in range(P):
        acc.add(span, j, x[j, span.lo:span.hi])
    want = _plan_order_sum(x[:, span.lo:span.hi])
    x[:, span.lo:span.hi] = 0  # the caller's rows change after they were added
    assert acc.reduce(span).tobytes() == want.tobytes()


def test_refusals():
    part, x = _partition(), _rows()
    acc = OwnerAccumulator(part, part.owned, None, np.float32)
    span = part.chunks(0)[0]
    with pytest.raises(ValueError, match="shape"):
        acc.add(span, 0, x[0, :span.size + 1])
    with pytest.raises(ValueError, match="position"):
        acc.add(span, P, x[0, span.lo:span.hi])
    with pytest.raises(ValueError, match="not collected"):
        acc.add(part.chunks(1)[0], 0, x[0, part.chunks(1)[0].lo:part.chunks(1)[0].hi])  # shard 1 is b's
    acc.add(span, 2, x[2, span.lo:span.hi])
    with pytest.raises(ValueError, match="second row"):
        acc.add(span, 2, x[2, span.lo:span.hi])
    with pytest.raises(ValueError, match="not every row"):
        acc.reduce(span)


@pytest.mark.parametrize("name, params", [("mean", {}), ("median", {}), ("trimmed-mean", {"beta": 0.25})])
def test_robust_reduction_matches_the_aggregator_and_flags_the_nan_row(name, params):
    part, x = _partition(), _rows(seed=1)
    x[3, 5] = np.nan
    weights = np.arange(1, P + 1, dtype=np.float64)
    acc = OwnerAccumulator(part, part.owned, OwnerReduction(ReductionSpec(name, params), weights, N), np.float32)
    for span in part.chunks(0):
        for j in (3, 1, 0, 2):  # any order
            acc.add(span, j, x[j, span.lo:span.hi])
        got = acc.reduce(span)
        want = make_aggregator(name, **params).reduce(x[:, span.lo:span.hi], weights).values
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert acc.rejected == {3}  # the NaN sits in the first chunk


def test_distance_aggregator_over_chunks_and_shards_matches_the_whole_vector():
    rng = np.random.default_rng(2)
    x = (rng.standard_normal(N) + 0.1 * rng.standard_normal((P, N))).astype(np.float32)
    x[2] += 50.0  # an outlier Krum must not select
    x[1, N - 1] = np.nan  # a non-finite row (in b's shard) every owner must reject
    spec, weights = ReductionSpec("krum", {"f": 1}), np.ones(P)
    owners = {me: _partition(me) for me in "ab"}  # a owns shard 0, b shard 1
    accs = {me: OwnerAccumulator(part, part.owned, OwnerReduction(spec, weights, N), np.float32)
            for me, part in owners.items()}
    for me, part in owners.items():
        (k,) = part.owned
        for span in part.chunks(k):
            for j in range(P):
                accs[me].add(span, j, x[j, span.lo:span.hi])
        assert accs[me].shard_complete(k)
    parts = {me: accs[me].partial_distances(owners[me].owned[0]) for me in "ab"}
    np.testing.assert_allclose(parts["a"], partial_sq_distances(x[:, :N // 2]), rtol=1e-12)
    assert np.isinf(parts["b"][1]).all() and np.isfinite(parts["a"]).all()
    total = parts["a"] + parts["b"]  # shard order, as the owners sum them
    whole = make_aggregator("krum", f=1).reduce(x, weights)
    for me, part in owners.items():
        (k,) = part.owned
        for span in part.chunks(k):
            np.testing.assert_allclose(accs[me].reduce(span, total), whole.values[span.lo:span.hi], rtol=1e-6)
        assert accs[me].rejected == set(whole.rejected) == {1}  # a rejects it too: from b's matrix
    assert np.abs(whole.values).max() < 10  # the outlier was not selected


def test_distances_need_every_row_of_the_shard():
    part, x = _partition(), _rows()
    acc = OwnerAccumulator(part, part.owned, OwnerReduction(ReductionSpec("krum", {"f": 1}), np.ones(P), N),
                           np.float32)
    span = part.chunks(0)[0]
    for j in range(P):
        acc.add(span, j, x[j, span.lo:span.hi])
    with pytest.raises(ValueError, match="every row"):
        acc.partial_distances(0)


def test_received_distance_matrices_are_checked():
    good = np.arange(16, dtype=np.float64)
    out = distance_matrix(good, 4)
    assert out.shape == (4, 4) and out.base is not good
    for bad in (np.arange(15, dtype=np.float64), good.astype(np.float32), -good, np.full(16, np.nan)):
        with pytest.raises(ValueError):
            distance_matrix(bad, 4)
    assert np.isinf(distance_matrix(np.full(16, np.inf), 4)).all()  # +inf marks a non-finite row


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_sum_into_the_callers_buffer_has_the_same_bits_and_reduces_each_chunk_once(dtype):
    part, x = _partition(), _rows().astype(dtype)
    for order in [(0, 1, 2, 3), (3, 1, 0, 2), (2, 3, 1, 0)]:
        out = np.full(N, np.nan, dtype=dtype)
        acc = OwnerAccumulator(part, part.owned, None, dtype, out=out)
        plain = OwnerAccumulator(part, part.owned, None, dtype)
        for span in part.chunks(0):
            for j in order:
                acc.add(span, j, x[j, span.lo:span.hi])
                plain.add(span, j, x[j, span.lo:span.hi])
            got = acc.reduce(span)
            assert np.shares_memory(got, out) and got.tobytes() == out[span.lo:span.hi].tobytes()
            assert got.tobytes() == plain.reduce(span).tobytes() == _plan_order_sum(x[:, span.lo:span.hi]).tobytes()
            with pytest.raises(ValueError, match="not every row"):
                acc.reduce(span)  # released: a chunk is reduced once
            before = out.copy()
            with pytest.raises(ValueError, match="reduced already"):
                acc.add(span, order[0], x[order[0], span.lo:span.hi])  # a late row never rewrites the result
            assert out.tobytes() == before.tobytes()
        assert np.isnan(out[part.chunks(1)[0].lo:].astype(np.float32)).all()  # shard 1 (not owned) untouched


def test_a_reducer_ignores_the_callers_buffer():
    part, x = _partition(), _rows()
    out = np.zeros(N, dtype=np.float32)
    acc = OwnerAccumulator(part, part.owned, OwnerReduction(ReductionSpec("mean"), np.ones(P), N), np.float32, out=out)
    span = part.chunks(0)[0]
    for j in range(P):
        acc.add(span, j, x[j, span.lo:span.hi])
    got = acc.reduce(span)
    assert not np.shares_memory(got, out) and not out.any()
