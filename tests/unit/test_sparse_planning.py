"""Sparse compression in the planner, the data plane's checks and the settings: the sparse
all-gather is planned (or the dense all-reduce when the model predicts it faster), its pieces
are checked against the plan, and aggregators that cannot combine with it are refused."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from shoal.common.errors import InvalidArgument
from shoal.config import ConfigError, RunSection
from shoal.coordinator.planner import LinkSpec, NoPlan, PlanPolicy, plan_round, predict_allgather
from shoal.peer.dataplane import Session
from shoal.peer.sparse import SparseCodec, encode
from shoal.peer.training import RunConfig
from shoal.v1 import shoal_pb2 as pb

MBIT = 1e6 / 8
BPE = SparseCodec("topk", 4096, 64, 2).bytes_per_element()  # 0.02832 B/element
SPARSE = PlanPolicy(compression="topk", sparse_bytes_per_element=BPE)


def _links(p: int, mbit: float = 100.0) -> list[LinkSpec]:
    return [LinkSpec(f"peer{i:02d}", mbit * MBIT, mbit * MBIT, 0.02) for i in range(p)]


def test_allgather_time_is_p_minus_1_payloads_through_the_slowest_link():
    up, down = [10.0, 10.0, 5.0], [10.0, 2.0, 10.0]
    assert predict_allgather(up, down, 100.0) == pytest.approx(2 * 100.0 / 2.0)
    assert predict_allgather(up, down, 100.0, [0.2, 0.2, 0.2]) == pytest.approx(100.0 + 2 * 0.1)
    assert predict_allgather([1.0], [1.0], 100.0) == 0.0


def test_a_sparse_run_plans_the_allgather_of_one_shard():
    n = 100_000_000  # 400 MB of float32
    plan = plan_round(_links(4), n, pb.FLOAT32, SPARSE)
    assert not isinstance(plan, NoPlan)
    assert (plan.collective, plan.shard_bounds, plan.compression) == ("allgather", (0, n), "topk")
    payload = n * BPE + 20
    assert plan.predicted_seconds == pytest.approx(3 * payload / (100 * MBIT) + 3 * 0.01)
    # The same round dense: ~48 s on a ring; the all-gather ~0.7 s.
    dense = plan_round(_links(4), n, pb.FLOAT32, PlanPolicy())
    assert dense.collective in ("ring", "butterfly") and dense.predicted_seconds > 50 * plan.predicted_seconds
    assert plan.deadline_seconds >= plan.predicted_seconds and plan.chunk_timeout_seconds > 0


def test_many_peers_fall_back_to_the_dense_all_reduce_the_model_predicts_faster():
    """The all-gather's bytes per peer grow as (p-1)·S; the ring's stay near 2·4n: at 0.028
    B/element the ring wins past ~280 peers, so with a denser codec (1 B/element) already at 16."""
    dense_codec = dataclasses.replace(SPARSE, sparse_bytes_per_element=1.0)
    plan = plan_round(_links(16), 1_000_000, pb.FLOAT32, dense_codec)
    assert plan.collective in ("ring", "butterfly") and plan.compression == "none"
    assert plan_round(_links(16), 1_000_000, pb.FLOAT32, SPARSE).collective == "allgather"


def test_an_outbound_only_participant_gets_the_dense_butterfly():
    links = _links(3)
    plan = plan_round(links, 10_000, pb.FLOAT32, SPARSE, outbound_only={links[2].peer_id})
    assert plan.collective == "butterfly" and plan.compression == "none" and plan.outbound_only == (2,)


def _session(n: int = 10_000) -> Session:
    return Session(0, 0, frozenset({"a", "b"}), pb.FLOAT32, None, (0, n), 256, 10.0)


def test_a_sparse_piece_is_checked_against_the_plan():
    s = _session()
    ok = s.check_chunk(pb.Chunk(sender="a", phase=pb.ALL_GATHER, dtype=pb.FLOAT32, shape=[100], codec=4,
                                offset=1024, data=b"x" * 100))
    assert (ok.codec, ok.count, ok.data) == (4, 100, b"x" * 100)
    bad = [({"phase": pb.REDUCE_SCATTER}, "phase"), ({"shard": 1}, "phase"), ({"scale": b"1234"}, "scale"),
           ({"shape": [2000], "data": b"x" * 2000}, "shape"), ({"offset": 60_000}, "shape")]
    for change, field in bad:
        msg = dict(sender="a", phase=pb.ALL_GATHER, dtype=pb.FLOAT32, shape=[100], codec=5, data=b"x" * 100)
        msg.update(change)
        with pytest.raises(InvalidArgument, match=field):
            s.check_chunk(pb.Chunk(**msg))
    one = encode(np.ones(1, np.float32), SparseCodec("topk", 4096, 64, 2)).to_bytes()  # 27 bytes for 1 element
    got = _session(1).check_chunk(pb.Chunk(sender="a", phase=pb.ALL_GATHER, dtype=pb.FLOAT32, shape=[len(one)],
                                           codec=4, data=one))
    assert got.data == one


def test_sparse_compression_refuses_the_aggregators_it_cannot_combine_with():
    for section, setting in ((RunSection(compression="topk", aggregator="median"), "run.aggregator"),
                             (RunSection(compression="dct", max_norm=1.0), "run.max_norm"),
                             (RunSection(compression="topk", sparse_k=5000), "run.sparse_k")):
        with pytest.raises(ConfigError) as got:
            section.validate()
        assert got.value.setting == setting
    with pytest.raises(ConfigError, match="run.compression = 'topk'"):
        RunSection(compression="topk", aggregator="median").validate()
    with pytest.raises(InvalidArgument, match="compression.*aggregator = median"):
        RunConfig(compression="topk", aggregator="median")
    with pytest.raises(InvalidArgument, match="sparse_bits"):
        RunConfig(compression="topk", sparse_bits=9)
    cfg = RunConfig(compression="dct", sparse_chunk=1024, sparse_k=16, sparse_bits=3, sparse_beta=0.5)
    assert cfg.sparse_settings().codec == SparseCodec("dct", 1024, 16, 3) and cfg.sparse_settings().beta == 0.5
    assert RunConfig().sparse_settings() is None
    assert RunSection(compression="topk").sparse_bytes_per_element() == pytest.approx(BPE)
