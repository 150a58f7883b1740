"""Aggregation at the shard owners over real gRPC (in one process): every aggregator, with and
without compression, a NaN-sending peer, multi-chunk shards; plus the pure pieces around it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from shoal.coordinator.rounds import EngineConfig, ReadyInfo, RoundEngine, SendPlan
from shoal.peer.testing.byzantine import ATTACKS, forge
from shoal.common.plan import Plan

from shoal.peer.dataplane import Session
from shoal.common.errors import InvalidArgument
from shoal.peer.reduction import OwnerReduction, ReductionSpec
from shoal.peer.training import RunConfig
from shoal.v1 import shoal_pb2 as pb


def test_owner_reduction_norm_bound_and_dp_noise():
    rows = np.stack([np.full(100, 1.0, np.float32), np.full(100, 100.0, np.float32)])
    red = OwnerReduction(ReductionSpec("mean", max_norm=10.0), np.ones(2), 100)
    v, rejected = red.reduce(rows, 0, 100)
    assert rejected == () and np.all(v <= (1.0 + 1.0) / 2 + 1e-4)  # both rows clipped to norm 10
    red = OwnerReduction(ReductionSpec("mean", max_norm=10.0, on_norm="reject"), np.ones(2), 100)
    v, rejected = red.reduce(rows, 0, 100)
    assert rejected == (1,) and np.allclose(v, 1.0)
    noisy = OwnerReduction(ReductionSpec("mean", max_norm=10.0, dp_sigma=1.0), np.ones(1), 100,
                           rng=np.random.default_rng(0))
    v, _ = noisy.reduce(rows[:1], 0, 100)
    assert np.isfinite(v).all() and 5 < np.std(v) < 20  # sigma * max_norm / p = 10
    with pytest.raises(InvalidArgument, match="dp_sigma"):
        ReductionSpec("mean", dp_sigma=1.0).check()
    with pytest.raises(InvalidArgument, match="aggregator"):
        RunConfig(aggregator="nope")
    with pytest.raises(InvalidArgument, match="codec"):
        RunConfig(compression="zip")


def test_attacks():
    x = np.linspace(-1, 1, 50, dtype=np.float32)
    rng = np.random.default_rng(0)
    for name in ATTACKS:
        y = forge(name, x, rng)
        assert y.dtype == np.float32 and y.shape == x.shape
    assert np.isnan(forge("nan", x, rng)).all()
    np.testing.assert_allclose(forge("scale", x, rng, 3.0), 3 * x)
    np.testing.assert_allclose(forge("sign-flip", x, rng, 1.0), -x)
    with pytest.raises(InvalidArgument):
        forge("bogus", x, rng)


@pytest.mark.parametrize("aggregator,expected", [("mean", "ring"), ("krum", "butterfly"),
                                                 ("trimmed-mean", "butterfly")])
def test_engine_plans_the_butterfly_for_robust_aggregators(aggregator, expected):
    eng = RoundEngine(EngineConfig(min_peers=2, collective="ring", aggregator=aggregator, compression="int8"))
    for i, pid in enumerate(("a", "b")):
        eng.join(pid, b"k", f"127.0.0.1:{9000 + i}", 10, now=0.0)
    actions = []
    for pid in ("a", "b"):
        actions += eng.ready(pid, 0, ReadyInfo(100, pb.FLOAT32, 10, b"", 0, 0.0), now=0.1)
    plans = [a.plan for a in actions if isinstance(a, SendPlan)]
    assert plans and plans[0].collective == expected and plans[0].aggregator == aggregator
    assert plans[0].compression == "int8"


def test_malformed_compressed_chunk_is_refused():
    session = Session(0, 0, frozenset({"x"}), pb.FLOAT32)
    chunk = pb.Chunk(round=0, attempt=0, sender="x", phase=pb.REDUCE_SCATTER, dtype=pb.FLOAT32, shape=[300],
                     data=bytes(300), scale=bytes(4), codec=3)  # int8 needs 2 scales for 300 elements
    with pytest.raises(InvalidArgument, match="scale"):
        session.check_chunk(chunk)
    chunk.codec, chunk.scale = 0, b""
    with pytest.raises(InvalidArgument, match="data"):
        session.check_chunk(chunk)  # raw float32 needs 1200 bytes


def test_fp4_chunk_lengths_are_checked_on_arrival():
    session = Session(0, 0, frozenset({"x"}), pb.FLOAT32)
    chunk = pb.Chunk(round=0, attempt=0, sender="x", phase=pb.REDUCE_SCATTER, dtype=pb.FLOAT32, shape=[301],
                     data=bytes(151), scale=bytes(8), codec=6)  # 301 nibbles in 151 bytes, 2 blocks
    assert session.check_chunk(chunk).count == 301
    chunk.data = bytes(150)
    with pytest.raises(InvalidArgument, match="data"):
        session.check_chunk(chunk)
    chunk.data, chunk.codec = bytes(151), 7
    with pytest.raises(InvalidArgument, match="codec"):
        session.check_chunk(chunk)


def test_auditors_are_the_next_owner_and_absent_with_one_owner():
    plan = Plan(participants=("a", "b", "c", "d"), addresses=("",) * 4, shard_bounds=(0, 1, 2, 3, 4),
                shard_owner=(0, 1, 2, 3), collective="butterfly", audit_owners=True)
    assert plan.auditors() == (1, 2, 3, 0)
    demoted = dataclasses.replace(plan, shard_bounds=(0, 2, 3, 4), shard_owner=(0, 1, 3))  # c owns nothing
    assert demoted.auditors() == (1, 3, 0)
    assert dataclasses.replace(plan, shard_bounds=(0, 4), shard_owner=(2,)).auditors() == (-1,)
    assert dataclasses.replace(plan, audit_owners=False).auditors() == (-1, -1, -1, -1)
