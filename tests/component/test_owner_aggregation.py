"""Aggregation at the shard owners over real gRPC (in one process): every aggregator, with and
without compression, a NaN-sending peer, multi-chunk shards; plus the pure pieces around it."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from shoal.peer.aggregators import AGGREGATORS, make_aggregator
from shoal.peer.testing.byzantine import forge
from shoal.peer.collectives import CollectiveError
from shoal.peer.compression import ErrorFeedback, max_abs_error

from shoal.peer.reduction import OwnerReduction, ReductionSpec
from kits.swarmlet import Swarmlet

PARAMS = {"trimmed-mean": {"beta": 0.25}, "centered-clip": {"tau": 2.0}, "krum": {"f": 1},
          "multi-krum": {"f": 1}, "bulyan": {"f": 1}}


def _inputs(p: int, n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    center = rng.standard_normal(n).astype(np.float32)
    return [(center + 0.1 * rng.standard_normal(n)).astype(np.float32) for _ in range(p)]


@pytest.mark.parametrize("compression", ["none", "int8"])
async def test_every_aggregator_at_the_owners_rejects_nan_and_matches_the_reference(compression):
    p, n = 5, 203  # shards of ~40 elements, chunks of 16: several chunks per shard
    xs = _inputs(p, n)
    xs[3] = forge("nan", xs[3], np.random.default_rng(0))
    weights = np.arange(1, p + 1, dtype=np.float64)
    async with Swarmlet(p) as sw:
        for attempt, name in enumerate(AGGREGATORS):
            spec = ReductionSpec(name, PARAMS.get(name, {}))
            reducers = [OwnerReduction(spec, weights, n) for _ in range(p)]
            results = await sw.run(xs, attempt=attempt, compression=compression, reducers=reducers)
            values = results[0].values
            assert all(r.values.tobytes() == values.tobytes() for r in results), f"{name}: peers differ"
            assert np.isfinite(values).all(), name
            assert set().union(*(r.flagged for r in results)) == {sw.ids[3]}, name
            reference = make_aggregator(name, **PARAMS.get(name, {})).reduce(np.stack(xs), weights).values
            if compression == "none":
                np.testing.assert_allclose(values, reference, rtol=1e-5, atol=1e-5, err_msg=name)
            else:  # contributions and the result each quantized once: twice the int8 bound, per element
                bound = 2 * max_abs_error(np.abs(np.stack([x for i, x in enumerate(xs) if i != 3])).max(axis=0), "int8")
                assert np.all(np.abs(values - reference) <= bound + 1e-6), name


@pytest.mark.parametrize("compression", ["fp16", "bf16", "int8"])
async def test_ring_with_compression_is_bit_identical_and_close_to_the_sum(compression):
    p, n = 4, 1001
    xs = _inputs(p, n, seed=1)
    async with Swarmlet(p) as sw:
        results = await sw.run(xs, attempt=0, algorithm="ring", compression=compression, chunk_bytes=1024)
        plain = await sw.run(xs, attempt=1, algorithm="ring", compression="none", chunk_bytes=1024)
    assert len({r.digest for r in results}) == 1
    exact = np.sum(np.stack(xs).astype(np.float64), axis=0)
    tol = {"fp16": 5e-3, "bf16": 4e-2, "int8": 8e-2}[compression]
    np.testing.assert_allclose(results[0].values, exact, atol=tol * p)
    ratio = sum(r.bytes_sent for r in results) / sum(r.bytes_sent for r in plain)
    assert ratio <= {"fp16": 0.5, "bf16": 0.5, "int8": 0.26}[compression]


async def test_ring_blames_the_peer_that_injects_nan():
    p, n = 4, 64
    xs = _inputs(p, n)
    xs[2] = forge("nan", xs[2], np.random.default_rng(0))
    async with Swarmlet(p) as sw:
        out = await sw.run(xs, attempt=0, algorithm="ring", chunk_bytes=4096, return_exceptions=True,
                           chunk_timeout=0.5)
    errors = [r for r in out if isinstance(r, Exception)]
    assert errors and all(isinstance(e, CollectiveError) for e in errors)
    # The NaN sender's successor blames it; the others only time out on the stalled ring.
    assert any(e.suspects == (sw.ids[2],) and "non-finite" in str(e) for e in errors)
    assert all(np.isfinite(r.values).all() for r in out if not isinstance(r, Exception))


async def test_error_feedback_residuals_are_returned_not_applied():
    p, n = 3, 300
    xs = _inputs(p, n, seed=2)
    fbs = [ErrorFeedback() for _ in range(p)]
    reducers = [OwnerReduction(ReductionSpec("mean"), np.ones(p), n) for _ in range(p)]
    async with Swarmlet(p) as sw:
        res = await sw.run(xs, attempt=0, compression="int8", reducers=reducers, feedback=fbs)
    assert all(len(fb) == 0 for fb in fbs), "the collective must not touch the residuals"
    for r, fb in zip(res, fbs):
        assert r.feedback
        for key, c, d in r.feedback:
            fb.update(key, c, d)
        assert len(fb) == len(r.feedback)


@pytest.mark.parametrize("aggregator, compression", [("mean", "none"), ("trimmed-mean", "int8"), ("krum", "none"),
                                                     ("krum", "int8")])
async def test_audit_blames_a_malicious_owner_and_never_an_honest_one(aggregator, compression):
    p, n = 5, 203  # several chunks per shard
    xs = _inputs(p, n, seed=2)
    spec = ReductionSpec(aggregator, PARAMS.get(aggregator, {}))
    weights = np.ones(p)

    def reducers():
        return None if aggregator == "mean" else [OwnerReduction(spec, weights, n) for _ in range(p)]

    async with Swarmlet(p) as sw:
        honest = await sw.run(xs, attempt=0, compression=compression, reducers=reducers(), audit=True)
        assert len({r.digest for r in honest}) == 1  # audited, all honest: commits, no false alarm
        # Peer 2 corrupts the aggregate of the shard it owns. Unaudited, every peer accepts the same
        # corrupted bytes (equal digests: the vote cannot see it) ...
        bad = {2: lambda v: (-10 * v).astype(v.dtype)}
        silent = await sw.run(xs, attempt=1, compression=compression, reducers=reducers(), tampers=bad)
        assert len({r.digest for r in silent}) == 1 and silent[0].digest != honest[0].digest
        # ... audited, its auditor (the next owner, peer 3) blames it.
        out = await sw.run(xs, attempt=2, compression=compression, reducers=reducers(), audit=True, tampers=bad,
                           return_exceptions=True)
    # Only the auditor fails, after the collective completed (nobody else sees a broken stream
    # that would shift the blame), naming the owner and itself: both sit out the retry.
    errors = {j: r for j, r in enumerate(out) if isinstance(r, CollectiveError)}
    assert list(errors) == [3], out
    assert set(errors[3].suspects) == {sw.ids[2], sw.ids[3]}


@pytest.mark.parametrize("audit", [False, True])
async def test_distance_aggregators_with_a_non_owner_participant(audit):
    # Participant 4 owns no shard (a demoted slow peer, or one stripped by an audit): it still
    # contributes and receives the result, and waits for no distance matrix (only owners need them).
    p, n = 5, 160
    xs = _inputs(p, n, seed=4)
    spec = ReductionSpec("krum", {"f": 1})
    async with Swarmlet(p) as sw:
        res = await asyncio.wait_for(sw.run(xs, attempt=0, reducers=[OwnerReduction(spec, np.ones(p), n)
                                                                     for _ in range(p)],
                                            shard_owner=(0, 1, 2, 3), audit=audit), 30)
    assert len({r.digest for r in res}) == 1
    reference = make_aggregator("krum", f=1).reduce(np.stack(xs), np.ones(p)).values
    np.testing.assert_allclose(res[0].values, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("audit", [False, True])
@pytest.mark.parametrize("aggregator", [None, "krum"])
async def test_butterfly_blames_a_silent_owner_and_nobody_else(audit, aggregator):
    # Participant 0 takes no part (its data plane is up and buffers what it is sent): everyone
    # waits for its row or its shard first, times out, and blames it alone.
    p, n = 4, 203
    xs = _inputs(p, n, seed=5)
    reducers = None if aggregator is None else [OwnerReduction(ReductionSpec(aggregator, {"f": 1}), np.ones(p), n)
                                                for _ in range(p)]
    async with Swarmlet(p) as sw:
        out = await sw.run(xs, attempt=0, reducers=reducers, audit=audit, silent={0}, chunk_timeout=0.5,
                           return_exceptions=True)
    assert out[0] is None
    errors = out[1:]
    assert all(isinstance(e, CollectiveError) and not e.audit for e in errors), out
    assert all(e.suspects == (sw.ids[0],) for e in errors), [e.suspects for e in errors]
