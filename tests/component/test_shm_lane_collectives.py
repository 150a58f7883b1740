"""The shared-memory lane (peer/lanes/shm.py): segments, checks, and all-reduces that use it.

Segments are real files in /dev/shm; the all-reduces run over real gRPC streams on loopback in
this event loop, with real Ed25519 identities and coordinator-signed tickets.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from shoal.peer.lanes import shm
from shoal.peer.dataplane import Session
from shoal.common.tensors import result_digest
from shoal.v1 import shoal_pb2 as pb
from kits.swarmlet import Swarmlet

pytestmark = pytest.mark.skipif(not shm.available(), reason="no writable /dev/shm on this machine")

# Per test process (the slab names' 16-hex prefix): parallel test workers share /dev/shm.


def _mine(peer_id: str) -> set[str]:
    return {n for n in os.listdir(shm.SHM_DIR) if n.startswith(f"shoal-{peer_id[:16]}-")}


@pytest.mark.parametrize("algorithm", ["ring", "butterfly"])
async def test_all_reduce_over_the_lane_is_exact_bit_identical_and_leaves_no_segment(algorithm):
    p, n = 4, 3_000_001  # several chunks per shard, n not divisible by p
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(p)]
    async with Swarmlet(p, [True] * p) as peers:
        for attempt in range(2):  # the second attempt reuses the slabs of the first
            results = await peers.run(xs, attempt=attempt, algorithm=algorithm, chunk_bytes=256 << 10)
            assert all(set(t.lanes().values()) == {"shm"} for t in peers.transports)
            assert len({r.values.tobytes() for r in results}) == 1
            assert all(r.digest == result_digest(r.values) for r in results)
            np.testing.assert_allclose(results[0].values, np.sum(np.stack(xs).astype(np.float64), axis=0),
                                       rtol=1e-5, atol=1e-4)
            assert all(r.bytes_sent > 0 for r in results)
        ids = peers.ids
    assert not any(_mine(i) for i in ids), "a segment outlived its transport"


async def test_the_sparse_reduce_scatter_over_the_lane_gives_the_sparse_all_gather_bits():
    """"sparse_rs" and "allgather" on the shared-memory lane, the same inputs and accumulators:
    every peer holds the same bytes, and no segment outlives the transports."""
    from shoal.common.plan import sparse_shard_bounds
    from shoal.peer.collectives import SparseRound
    from shoal.peer.sparse import ErrorAccumulator, SparseCodec

    p, n, codec = 4, 300_001, SparseCodec("topk", 1024, 16, 2)
    xs = [np.random.default_rng(40 + i).standard_normal(n).astype(np.float32) for i in range(p)]

    def rounds():
        return [SparseRound(ErrorAccumulator(n, codec, 0.9)) for _ in range(p)]

    async with Swarmlet(p, [True] * p) as peers:
        rs = await peers.run(xs, attempt=0, algorithm="sparse_rs", chunk_bytes=64 << 10, sparse=rounds(),
                             shard_bounds=sparse_shard_bounds(n, 1024, p))
        assert all(set(t.lanes().values()) == {"shm"} for t in peers.transports)
        ag = await peers.run(xs, attempt=1, algorithm="allgather", chunk_bytes=64 << 10, sparse=rounds(),
                             shard_bounds=(0, n), shard_owner=(0,))
        ids = peers.ids
    assert len({r.values.tobytes() for r in rs + ag}) == 1 and len({r.digest for r in rs + ag}) == 1
    assert not any(_mine(i) for i in ids), "a segment outlived its transport"


async def test_a_peer_without_the_lane_gets_sockets_and_the_result_is_the_same():
    p, n = 3, 200_003
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(p)]
    async with Swarmlet(3, [True, True, False]) as peers:
        mixed = await peers.run(xs, attempt=0, algorithm="butterfly", chunk_bytes=64 << 10)
        lanes = [t.lanes() for t in peers.transports]
    to_2 = peers.addresses[2]
    assert lanes[0][to_2] == lanes[1][to_2] == "socket"  # peer 2 refused the probe
    assert lanes[0][peers.addresses[1]] == "shm" and set(lanes[2].values()) == {"socket"}
    async with Swarmlet(p, [False] * p) as peers:
        plain = await peers.run(xs, attempt=0, algorithm="butterfly", chunk_bytes=64 << 10)
    assert mixed[0].values.tobytes() == plain[0].values.tobytes()
    assert mixed[0].digest == plain[0].digest


async def test_ring_peers_probe_every_participant_so_they_can_report_all_shm_peers():
    p, n = 3, 30_000
    xs = [np.full(n, i, dtype=np.float32) for i in range(p)]
    async with Swarmlet(p, [True] * p) as peers:
        await peers.run(xs, attempt=0, algorithm="ring", chunk_bytes=16 << 10)
        t = peers.transports[0]
        assert set(t.lanes()) == {peers.addresses[1]}  # the ring streams only to the successor
        await t.probe_lanes(list(zip(peers.ids, peers.addresses))[1:])
        assert t.shm_peers(zip(peers.ids, peers.addresses)) == peers.ids[1:]


async def test_an_owner_writes_each_reduced_chunk_once_for_all_its_receivers(monkeypatch):
    p, n = 4, 1_000_003
    rng = np.random.default_rng(11)
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(p)]
    places: dict[tuple[str, int, int], set] = {}  # (owner, shard, offset) -> where its bytes were
    check = Session.check_chunk

    def recording(self, c, shm_reader=None, body=None):
        if c.phase == pb.ALL_GATHER:
            places.setdefault((c.sender, c.shard, c.offset), set()).add((c.shm_name, c.shm_offset))
        return check(self, c, shm_reader, body)

    monkeypatch.setattr(Session, "check_chunk", recording)
    async with Swarmlet(p, [True] * p) as peers:
        for attempt in range(2):  # the second attempt reuses the shared writers of the first
            places.clear()
            results = await peers.run(xs, attempt=attempt, algorithm="butterfly", chunk_bytes=64 << 10)
            assert len({r.values.tobytes() for r in results}) == 1
            assert all(r.digest == result_digest(r.values) for r in results)
            np.testing.assert_allclose(results[0].values, np.sum(np.stack(xs).astype(np.float64), axis=0),
                                       rtol=1e-5, atol=1e-4)
            # every reduced chunk went to the three other peers from one place of one segment
            assert len(places) > p and all(len(v) == 1 and next(iter(v))[0] for v in places.values())
    async with Swarmlet(p, [False] * p) as peers:  # the socket lane: the same bits
        plain = await peers.run(xs, attempt=0, algorithm="butterfly", chunk_bytes=64 << 10)
    assert plain[0].values.tobytes() == results[0].values.tobytes()


async def test_bounded_reduce_scatter_slabs_give_the_same_bits(monkeypatch):
    per_lap = 4
    monkeypatch.setattr(shm, "LAP_BYTES", per_lap * (64 << 10))
    p, n = 3, 1_200_007  # shards of ~400k elements: 25 chunks of 64 KiB per owner
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(p)]
    places: dict[tuple[str, int], set] = {}  # (sender, owner) -> slab places of its reduce-scatter chunks
    sent: dict[tuple[str, int], int] = {}
    check = Session.check_chunk

    def recording(self, c, shm_reader=None, body=None):
        if c.phase == pb.REDUCE_SCATTER:
            places.setdefault((c.sender, c.shard), set()).add((c.shm_name, c.shm_offset))
            sent[(c.sender, c.shard)] = sent.get((c.sender, c.shard), 0) + 1
        return check(self, c, shm_reader, body)

    monkeypatch.setattr(Session, "check_chunk", recording)
    async with Swarmlet(p, [True] * p) as socket_free:
        results = []
        for attempt in range(3):  # lanes probed before the first attempt: bounded from the start
            places.clear()
            sent.clear()
            results.append(await socket_free.run(xs, attempt=attempt, algorithm="butterfly", chunk_bytes=64 << 10))
            assert min(sent.values()) > 2 * per_lap
            assert places and all(len(v) <= 2 * per_lap for v in places.values())
    async with Swarmlet(p, [False] * p) as peers:  # the socket lane: the same bits
        plain = await peers.run(xs, attempt=0, algorithm="butterfly", chunk_bytes=64 << 10)
    assert all(r.values.tobytes() == plain[0].values.tobytes() for rs in results for r in rs)
