"""The sparse reduce-scatter (peer.collectives, "sparse_rs" plans) over the in-memory lane: each
shard owner merges the sparse contributions of its range and sends it back as float32; every
participant ends with the bytes the sparse all-gather gives for the same inputs and accumulators,
and the same digest; a lying or silent sender is named; the accumulators only propose."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from shoal.common.errors import InvalidArgument
from shoal.common.plan import Plan, sparse_shard_bounds
from shoal.common.tensors import result_digest
from shoal.coordinator.planner import LinkSpec, PlanPolicy, plan_round, predict_allgather, predict_sparse_rs
from shoal.peer import sparse
from shoal.peer.collectives import CollectiveError, SparseRound, all_reduce
from shoal.peer.dataplane import Session
from shoal.peer.lanes.memory import MemoryNet
from shoal.peer.sparse import ErrorAccumulator, SparseCodec
from shoal.v1 import shoal_pb2 as pb

CHUNK = 512


def _ids(p: int) -> tuple[str, ...]:
    return tuple(f"{c * 16}" for c in "abcdefgh"[:p])


def _plan(ids, n: int, collective: str, *, chunk_timeout: float = 5.0, chunk_bytes: int = 1024) -> Plan:
    p = len(ids)
    bounds, owners = ((0, n), (0,)) if collective == "allgather" else (sparse_shard_bounds(n, CHUNK, p), tuple(range(p)))
    return Plan(participants=ids, collective=collective, shard_bounds=bounds, shard_owner=owners,
                addresses=tuple(f"mem:{i}" for i in range(p)), chunk_bytes=chunk_bytes, num_elements=n,
                chunk_timeout_seconds=chunk_timeout, deadline_seconds=10.0, compression="topk")


async def _run(plan, xs, accs, *, silent=(), weights=None):
    net = MemoryNet()
    net.start(plan)
    ids = plan.participants
    live = [i for i in range(len(ids)) if i not in silent]
    out = await asyncio.gather(*[all_reduce(xs[i], plan, me=ids[i], lanes=net.lanes(plan, ids[i]),
                                            sparse=SparseRound(accs[i], weights)) for i in live],
                               return_exceptions=True)
    return dict(zip(live, out)), net


def _accumulators(p: int, n: int, codec: SparseCodec, seed: int) -> list[ErrorAccumulator]:
    """Accumulators with a committed round behind them (e != 0), the same for both collectives."""
    rng = np.random.default_rng(seed + 100)
    accs = []
    for _ in range(p):
        acc = ErrorAccumulator(n, codec, 0.9)
        acc.propose(rng.standard_normal(n).astype(np.float32), attempt="warm")
        acc.commit("warm")
        accs.append(acc)
    return accs


def _clone(accs: list[ErrorAccumulator]) -> list[ErrorAccumulator]:
    out = []
    for a in accs:
        b = ErrorAccumulator(a.accumulator.size, a.codec, a.beta)
        b._e[...] = a.accumulator
        out.append(b)
    return out


def test_shard_bounds_are_whole_chunks_as_even_as_possible():
    assert sparse_shard_bounds(10_007, 512, 3) == (0, 3584, 7168, 10_007)  # 20 chunks: 7, 7, 6
    assert sparse_shard_bounds(4096, 1024, 4) == (0, 1024, 2048, 3072, 4096)
    assert sparse_shard_bounds(1000, 512, 3) == (0, 512, 1000, 1000)  # fewer chunks than shards: one empty
    with pytest.raises(ValueError):
        sparse_shard_bounds(10, 0, 2)


@pytest.mark.parametrize("p", [3, 4, 5])
@pytest.mark.parametrize("weighted", [False, True])
async def test_the_result_is_the_allgather_result_bit_for_bit(p, weighted, monkeypatch):
    """Same inputs, same accumulator states (e != 0): "sparse_rs" and "allgather" give the same
    bytes on every participant (the same float32 additions in the same participant order), with
    several segments per shard (segments of 1,024 elements) and a partial last chunk."""
    monkeypatch.setattr(sparse, "SEGMENT_ELEMENTS", 1024)
    n, codec, ids = 10_007 + 1000 * p, SparseCodec("topk", CHUNK, 16, 3), _ids(p)
    rng = np.random.default_rng(p)
    xs = [rng.standard_normal(n).astype(np.float32) for _ in ids]
    copies = [x.copy() for x in xs]
    weights = tuple(float(w) for w in rng.uniform(0.1, 1.0, p)) if weighted else None
    base = _accumulators(p, n, codec, seed=p)
    rs_accs, ag_accs = _clone(base), _clone(base)
    plan = _plan(ids, n, "sparse_rs")
    assert all(len(sparse.segment_bounds(hi - lo, CHUNK)) >= 2 for lo, hi in zip(plan.shard_bounds, plan.shard_bounds[1:]))
    rs, _ = await _run(plan, xs, rs_accs, weights=weights)
    ag, _ = await _run(_plan(ids, n, "allgather"), xs, ag_accs, weights=weights)
    expected = ag[0].values.tobytes()
    assert all(not isinstance(r, BaseException) for r in rs.values()), rs
    assert all(rs[i].values.tobytes() == expected for i in range(p))
    assert {rs[i].digest for i in range(p)} == {result_digest(ag[0].values)} == {ag[i].digest for i in range(p)}
    assert all(x.tobytes() == c.tobytes() for x, c in zip(xs, copies))  # inputs never modified
    assert {rs[i].sparse_attempt for i in range(p)} == {(0, 0)}
    # The proposals are the same: committing both leaves the same accumulators.
    for a, b in zip(rs_accs, ag_accs):
        assert a.pending and b.pending
        a.commit((0, 0))
        b.commit((0, 0))
        assert a.accumulator.tobytes() == b.accumulator.tobytes()


async def test_fewer_chunks_than_owners_leave_a_shard_empty():
    """1,000 elements in chunks of 512 over 3 owners: the last shard is empty, its owner merges
    and sends nothing, and the result is still the all-gather's."""
    p, n, codec, ids = 3, 1000, SparseCodec("topk", CHUNK, 16, 3), _ids(3)
    plan = _plan(ids, n, "sparse_rs")
    assert plan.shard_bounds == (0, 512, 1000, 1000)
    xs = [np.random.default_rng(i).standard_normal(n).astype(np.float32) for i in range(p)]
    base = _accumulators(p, n, codec, seed=5)
    rs, _ = await _run(plan, xs, _clone(base))
    ag, _ = await _run(_plan(ids, n, "allgather"), xs, _clone(base))
    assert all(rs[i].values.tobytes() == ag[0].values.tobytes() for i in range(p)), rs
    assert rs[2].bytes_sent == codec.payload_bytes(512) + codec.payload_bytes(488)


async def test_shards_off_the_codec_chunks_are_refused():
    ids, n = _ids(2), 2048
    plan = dataclasses.replace(_plan(ids, n, "sparse_rs"), shard_bounds=(0, 1000, n))
    net = MemoryNet()
    net.start(plan)
    with pytest.raises(CollectiveError, match="plan: sparse_rs shard bounds"):
        await all_reduce(np.zeros(n, np.float32), plan, me=ids[0], lanes=net.lanes(plan, ids[0]),
                         sparse=SparseRound(ErrorAccumulator(n, SparseCodec("topk", CHUNK, 8, 2), 0.9)))


async def test_dct_matches_the_allgather_result():
    """"dct" inverts per range (the same per-chunk transforms in other batches): on this build
    the bytes are the all-gather's too; the vote digest would catch a build where they are not."""
    p, n, codec, ids = 4, 9_000, SparseCodec("dct", CHUNK, 16, 3), _ids(4)
    rng = np.random.default_rng(11)
    xs = [rng.standard_normal(n).astype(np.float32) for _ in ids]
    base = _accumulators(p, n, codec, seed=11)
    rs, _ = await _run(_plan(ids, n, "sparse_rs"), xs, _clone(base))
    ag, _ = await _run(_plan(ids, n, "allgather"), xs, _clone(base))
    assert len({rs[i].digest for i in range(p)}) == 1
    np.testing.assert_allclose(rs[0].values, ag[0].values, rtol=0, atol=1e-5)
    assert rs[0].values.tobytes() == ag[0].values.tobytes()


async def test_bytes_per_peer_are_a_shard_stream_per_owner_and_the_merged_ranges():
    p, n, codec, ids = 4, 8192, SparseCodec("topk", CHUNK, 16, 3), _ids(4)
    xs = [np.random.default_rng(i).standard_normal(n).astype(np.float32) for i in range(p)]
    plan = _plan(ids, n, "sparse_rs")
    out, _ = await _run(plan, xs, [ErrorAccumulator(n, codec, 0.9) for _ in ids])
    shard = n // p
    stream = codec.payload_bytes(shard)  # one segment per shard (SEGMENT_ELEMENTS is 4M)
    assert all(out[i].bytes_sent == (p - 1) * stream + (p - 1) * 4 * shard for i in range(p))


async def test_a_malformed_stream_to_an_owner_blames_its_sender():
    """Peer 2 encodes with another chunk size: each owner it sends a shard to names it."""
    p, n, ids = 4, 8192, _ids(4)
    accs = [ErrorAccumulator(n, SparseCodec("topk", CHUNK if i != 2 else 256, 8, 2), 0.9) for i in range(p)]
    xs = [np.random.default_rng(i).standard_normal(n).astype(np.float32) for i in range(p)]
    out, _ = await _run(_plan(ids, n, "sparse_rs"), xs, accs)
    for i in (0, 1, 3):
        e = out[i]
        assert isinstance(e, CollectiveError) and ids[2] in e.suspects and "malformed" in str(e), (i, e)
    assert isinstance(out[2], CollectiveError)


async def test_a_silent_peer_is_the_suspect_at_the_chunk_deadline():
    """Peer 0 never runs: the owners miss its streams, everyone misses its merged range; all
    name it, within the chunk deadline (0.3 s) and well before the attempt's (10 s)."""
    p, n, ids = 4, 8192, _ids(4)
    codec = SparseCodec("topk", CHUNK, 8, 2)
    xs = [np.random.default_rng(i).standard_normal(n).astype(np.float32) for i in range(p)]
    t0 = asyncio.get_running_loop().time()
    out, _ = await _run(_plan(ids, n, "sparse_rs", chunk_timeout=0.3), xs,
                        [ErrorAccumulator(n, codec, 0.9) for _ in ids], silent=(0,))
    assert asyncio.get_running_loop().time() - t0 < 3.0
    assert all(isinstance(e, CollectiveError) and ids[0] in e.suspects and "no chunk from" in str(e)
               for e in out.values()), out


async def test_a_non_finite_merged_range_blames_its_owner(monkeypatch):
    """An owner whose merged range holds a NaN (here its sum is tampered with) is named by every
    peer that receives the range."""
    from shoal.peer import collectives

    p, n, ids = 3, 6 * CHUNK + 100, _ids(3)  # shards of 1,536, 1,024 and 612 elements
    plan = _plan(ids, n, "sparse_rs")
    assert plan.shard_bounds == (0, 1536, 2560, n)
    real = collectives.sum_segments

    def poisoned(parts, count, codec, weights, out):
        real(parts, count, codec, weights, out)
        if count == 1024:  # shard 1, owned by participant 1
            out[0] = np.nan
        return out

    monkeypatch.setattr(collectives, "sum_segments", poisoned)
    codec = SparseCodec("topk", CHUNK, 8, 2)
    xs = [np.random.default_rng(i).standard_normal(n).astype(np.float32) for i in range(p)]
    out, _ = await _run(plan, xs, [ErrorAccumulator(n, codec, 0.9) for _ in ids])
    for i in (0, 2):
        assert isinstance(out[i], CollectiveError) and ids[1] in out[i].suspects and "non-finite" in str(out[i]), out


def _rs_session() -> Session:
    return Session(0, 0, frozenset({"a", "b"}), pb.FLOAT32, None, (0, 4096, 8192, 10_000), 256, 10.0,
                   collective="sparse_rs")


def test_the_data_plane_admits_sparse_pieces_in_the_reduce_scatter_of_a_sparse_rs_plan():
    s = _rs_session()
    ok = s.check_chunk(pb.Chunk(sender="a", phase=pb.REDUCE_SCATTER, shard=2, dtype=pb.FLOAT32, shape=[100],
                                codec=4, offset=1024, data=b"x" * 100))
    assert (ok.codec, ok.count, ok.data) == (4, 100, b"x" * 100)
    cap = 5 * 1808 + 64  # shard 2: 1,808 elements, one segment
    bad = [({"phase": pb.ALL_GATHER}, "phase"), ({"step": 1}, "phase"), ({"shard": 3}, "shard"),
           ({"scale": b"1234"}, "scale"), ({"offset": cap - 99}, "shape"), ({"shape": [1025], "data": b"x" * 1025}, "shape"),
           ({"dtype": pb.FLOAT16}, "dtype")]
    for change, field in bad:
        msg = dict(sender="a", phase=pb.REDUCE_SCATTER, shard=2, dtype=pb.FLOAT32, shape=[100], codec=4,
                   data=b"x" * 100)
        msg.update(change)
        with pytest.raises(InvalidArgument, match=field):
            s.check_chunk(pb.Chunk(**msg))
    assert s.check_chunk(pb.Chunk(sender="a", phase=pb.REDUCE_SCATTER, shard=2, dtype=pb.FLOAT32, shape=[100],
                                  codec=5, offset=cap - 100, data=b"x" * 100)).count == 100  # the last byte fits


def test_the_merged_ranges_are_checked_as_dense_all_gather_chunks():
    s = _rs_session()
    values = np.arange(200, dtype=np.float32)
    got = s.check_chunk(pb.Chunk(sender="b", phase=pb.ALL_GATHER, shard=2, offset=1600, dtype=pb.FLOAT32,
                                 shape=[200], data=values.tobytes()))
    assert np.array_equal(got, values)
    bad = [({"phase": pb.REDUCE_SCATTER}, "phase"), ({"shard": 3}, "shard"), ({"offset": 1700}, "shape"),
           ({"shape": [300], "data": b"\0" * 1200}, "shape")]
    for change, field in bad:
        msg = dict(sender="b", phase=pb.ALL_GATHER, shard=2, offset=1600, dtype=pb.FLOAT32, shape=[200],
                   data=values.tobytes())
        msg.update(change)
        with pytest.raises(InvalidArgument, match=field):
            s.check_chunk(pb.Chunk(**msg))


# ---------------------------------------------------------------------------------------------
# The planner's choice

MBIT = 1e6 / 8
ONE_PERCENT = SparseCodec("topk", 1024, 10, 8)  # 1 % of the elements, 8-bit values: 0.02588 B/element


def _links(p: int, mbit: float = 100.0) -> list[LinkSpec]:
    return [LinkSpec(f"peer{i:03d}", mbit * MBIT, mbit * MBIT, 0.02) for i in range(p)]


def _policy(codec: SparseCodec = ONE_PERCENT, **kw) -> PlanPolicy:
    return PlanPolicy(compression="topk", sparse_bytes_per_element=codec.bytes_per_element(),
                      sparse_chunk=codec.chunk, **kw)


def test_sparse_rs_time_is_both_phases_through_the_slowest_links():
    """p = 3, S = 90 B, n = 30 (120 B of float32): the reduce-scatter moves 2/3·90 = 60 B per peer
    each way (slowest: 2 B/s down), the all-gather 2/3·120 = 80 B (2 B/s): 30 + 40 s, plus
    2(p-1)·α = 4 · 0.1 s with round trips of 0.2 s."""
    up, down = [10.0, 10.0, 5.0], [10.0, 2.0, 10.0]
    assert predict_sparse_rs(up, down, 90.0, 30) == pytest.approx(30.0 + 40.0)
    assert predict_sparse_rs(up, down, 90.0, 30, [0.2, 0.2, 0.2]) == pytest.approx(70.0 + 0.4)
    assert predict_sparse_rs([1.0], [1.0], 90.0, 30) == 0.0
    # Per peer (p-1)/p·(S + 4n) against the all-gather's (p-1)·S: at p = 300 and 0.0259 B/element
    # 4.03 n bytes against 7.74 n.
    n, s = 1e8, 1e8 * ONE_PERCENT.bytes_per_element() + 20
    rate = [100 * MBIT] * 300
    assert predict_sparse_rs(rate, rate, s, n) == pytest.approx(299 / 300 * (s + 4 * n) / (100 * MBIT))
    assert predict_allgather(rate, rate, s) == pytest.approx(299 * s / (100 * MBIT))


def test_few_peers_keep_the_sparse_all_gather():
    n = 100_000_000
    plan = plan_round(_links(4), n, pb.FLOAT32, _policy())
    assert (plan.collective, plan.shard_bounds, plan.shard_owner) == ("allgather", (0, n), (0,))


def test_many_peers_take_the_sparse_reduce_scatter():
    """p = 300 at 100 Mbit/s, 10^8 elements: the all-gather moves 299·S = 7.7 GB per peer (~62 s),
    the reduce-scatter (S + 4n)·299/300 = 4.0 GB (~32 s, + 2·299·10 ms); a dense all-reduce 8n."""
    n, p = 100_000_000, 300
    plan = plan_round(_links(p), n, pb.FLOAT32, _policy())
    s = n * ONE_PERCENT.bytes_per_element() + 20
    assert plan.collective == "sparse_rs" and plan.compression == "topk"
    assert plan.shard_bounds == sparse_shard_bounds(n, 1024, p) and plan.shard_owner == tuple(range(p))
    assert all(b % 1024 == 0 for b in plan.shard_bounds[:-1])
    assert plan.predicted_seconds == pytest.approx(299 / 300 * (s + 4 * n) / (100 * MBIT) + 2 * 299 * 0.01)
    assert plan.bound_seconds == pytest.approx(299 / 300 * (s + 4 * n) / (100 * MBIT))
    assert plan.deadline_seconds >= plan.predicted_seconds and plan.chunk_timeout_seconds > plan.predicted_seconds
    assert plan.predicted_seconds < 0.75 * predict_allgather([100 * MBIT] * p, [100 * MBIT] * p, s, [0.02] * p)


def test_a_forced_sparse_rs_needs_trusted_dialable_owners():
    links = _links(4)
    forced = _policy(collective="sparse_rs")
    plan = plan_round(links, 1_000_000, pb.FLOAT32, forced)
    assert plan.collective == "sparse_rs" and plan.shard_bounds == sparse_shard_bounds(1_000_000, 1024, 4)
    assert plan.predicted_seconds == pytest.approx(
        predict_sparse_rs([100 * MBIT] * 4, [100 * MBIT] * 4, 1e6 * ONE_PERCENT.bytes_per_element() + 20, 1e6,
                          [0.02] * 4))
    assert plan_round(links, 1_000_000, pb.FLOAT32, forced, untrusted={links[1].peer_id}).collective == "allgather"
    out = plan_round(links, 1_000_000, pb.FLOAT32, forced, outbound_only={links[1].peer_id})
    assert out.collective == "butterfly" and out.compression == "none"
    # A dense run ignores it: the model's dense choice.
    assert plan_round(links, 1_000_000, pb.FLOAT32, PlanPolicy(collective="sparse_rs")).collective in ("ring", "butterfly")


def test_the_dense_all_reduce_wins_where_the_sparse_collectives_move_more():
    """1 B/element at 16 peers: the all-gather moves 15 n, a dense all-reduce ~7.5 n; with an
    untrusted peer (no range for it to own) there is no sparse reduce-scatter, so dense. With
    every peer trusted the reduce-scatter's 15/16·5 n is the least."""
    dense_codec = dataclasses.replace(_policy(), sparse_bytes_per_element=1.0)
    links = _links(16)
    plan = plan_round(links, 1_000_000, pb.FLOAT32, dense_codec, untrusted={links[3].peer_id})
    assert plan.collective in ("ring", "butterfly") and plan.compression == "none"
    assert plan_round(links, 1_000_000, pb.FLOAT32, dense_codec).collective == "sparse_rs"


async def test_a_stream_missing_at_one_owner_is_blamed_by_that_owner(monkeypatch):
    """Peer 3 sends every shard but owner 1's: owner 1 names peer 3 at the chunk deadline; the
    others (peer 3 too), waiting on owner 1's merged range, name owner 1, as in the butterfly's
    all-gather."""
    from shoal.peer import collectives

    p, n, ids = 4, 8192, _ids(4)
    codec = SparseCodec("topk", CHUNK, 8, 2)
    real = collectives._SparseReduceScatter._scatter

    async def scatter(self, k, jobs):
        if self.me == ids[3] and self.plan.shard_owner[k] == 1:
            return
        await real(self, k, jobs)

    monkeypatch.setattr(collectives._SparseReduceScatter, "_scatter", scatter)
    xs = [np.random.default_rng(i).standard_normal(n).astype(np.float32) for i in range(p)]
    out, _ = await _run(_plan(ids, n, "sparse_rs", chunk_timeout=0.3), xs,
                        [ErrorAccumulator(n, codec, 0.9) for _ in ids])
    assert isinstance(out[1], CollectiveError) and ids[3] in out[1].suspects and "no chunk from" in str(out[1]), out
    for i in (0, 2, 3):
        assert isinstance(out[i], CollectiveError) and ids[1] in out[i].suspects, out
