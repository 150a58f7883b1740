"""The sparse all-gather (peer.collectives, "allgather" plans) over the in-memory lane: every
participant ends with the same bytes, equal to the fixed-order (weighted) sum of the decoded
contributions; a silent or lying sender is named; the error-feedback accumulator only proposes."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from shoal.common.plan import Plan
from shoal.common.tensors import result_digest
from shoal.peer.collectives import CollectiveError, SparseRound, all_reduce
from shoal.peer.lanes.memory import MemoryNet
from shoal.peer.sparse import ErrorAccumulator, SparseCodec, encode, sum_contributions

IDS = tuple(f"{c * 16}" for c in "abcd")


def _plan(n: int, *, attempt: int = 0, chunk_timeout: float = 5.0, chunk_bytes: int = 1024) -> Plan:
    p = len(IDS)
    return Plan(participants=IDS, collective="allgather", shard_bounds=(0, n), shard_owner=(0,), attempt=attempt,
                addresses=tuple(f"mem:{i}" for i in range(p)), chunk_bytes=chunk_bytes,
                chunk_timeout_seconds=chunk_timeout, deadline_seconds=10.0, compression="topk")


async def _run(plan, xs, accs, *, silent=(), weights=None):
    net = MemoryNet()
    net.start(plan)
    live = [i for i in range(len(IDS)) if i not in silent]
    out = await asyncio.gather(*[all_reduce(xs[i], plan, me=IDS[i], lanes=net.lanes(plan, IDS[i]),
                                            sparse=SparseRound(accs[i], weights)) for i in live],
                               return_exceptions=True)
    return dict(zip(live, out)), net


def _inputs(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n).astype(np.float32) for _ in IDS]


@pytest.mark.parametrize("kind", ["topk", "dct"])
@pytest.mark.parametrize("weights", [None, (0.1, 0.2, 0.3, 0.4)])
async def test_every_participant_ends_with_the_fixed_order_sum(kind, weights):
    n = 10_007  # several pieces of 1 KiB per payload, a partial last chunk
    codec = SparseCodec(kind, 512, 16, 3)
    xs = _inputs(n)
    copies = [x.copy() for x in xs]
    accs = [ErrorAccumulator(n, codec, 0.9) for _ in IDS]
    results, net = await _run(_plan(n), xs, accs, weights=weights)
    values = [results[i].values for i in range(len(IDS))]
    assert all(v.tobytes() == values[0].tobytes() for v in values)
    assert all(results[i].digest == result_digest(values[0]) for i in results)
    expected = sum_contributions([encode(x, codec) for x in xs], weights)  # e = 0: C(Δ) itself
    assert values[0].tobytes() == expected.tobytes()
    assert all(x.tobytes() == c.tobytes() for x, c in zip(xs, copies))  # inputs never modified
    payload = codec.payload_bytes(n)
    assert all(results[i].bytes_sent == 3 * payload for i in results)  # its payload to each other peer
    assert net.chunks == 4 * 3 * -(-payload // 1024)
    # The accumulators only proposed (the round protocol commits): e is still 0.
    assert all(a.pending and not a.accumulator.any() for a in accs)
    assert {results[i].sparse_attempt for i in results} == {(0, 0)}


async def test_commit_of_the_gathered_attempt_keeps_the_unsent_mass():
    n, codec = 4096, SparseCodec("topk", 1024, 8, 2)
    xs = _inputs(n, seed=3)
    accs = [ErrorAccumulator(n, codec, 1.0) for _ in IDS]
    results, _ = await _run(_plan(n), xs, accs)
    for a, r in zip(accs, results.values()):
        a.commit(r.sparse_attempt)
    sent = encode(xs[0], codec)
    assert accs[0].accumulator.tobytes() == (xs[0] - sum_contributions([sent])).tobytes()


async def test_a_silent_peer_is_the_suspect_at_the_chunk_deadline():
    n, codec = 4000, SparseCodec("topk", 512, 8, 2)
    accs = [ErrorAccumulator(n, codec, 0.9) for _ in IDS]
    results, _ = await _run(_plan(n, chunk_timeout=0.2), _inputs(n), accs, silent=(0,))
    assert all(isinstance(e, CollectiveError) and IDS[0] in e.suspects and "no chunk from" in str(e)
               for e in results.values()), results


async def test_a_payload_of_another_codec_blames_its_sender():
    """Peer 2 encodes with another chunk size: its header does not match the round's codec,
    and every other peer names it."""
    n = 4000
    accs = [ErrorAccumulator(n, SparseCodec("topk", 512 if i != 2 else 256, 8, 2), 0.9) for i in range(4)]
    results, _ = await _run(_plan(n), _inputs(n), accs)
    others = [results[i] for i in (0, 1, 3)]
    assert all(isinstance(e, CollectiveError) and e.suspects == (IDS[2],) and "malformed" in str(e)
               for e in others), results


async def test_a_plan_without_an_accumulator_fails_cleanly():
    n = 100
    plan = _plan(n)
    net = MemoryNet()
    net.start(plan)
    with pytest.raises(CollectiveError, match="accumulator"):
        await all_reduce(np.zeros(n, np.float32), plan, me=IDS[0], lanes=net.lanes(plan, IDS[0]))


@pytest.mark.parametrize("kind", ["topk", "dct"])
async def test_a_contribution_streamed_in_segments_gives_the_whole_payloads_sum(kind, monkeypatch):
    """Segments of 2,048 elements (4 chunks): each goes out as soon as it is encoded, and every
    participant still ends with the bytes of the fixed-order sum of the whole payloads."""
    from shoal.peer import sparse

    monkeypatch.setattr(sparse, "SEGMENT_ELEMENTS", 2048)
    n = 10_007
    codec = SparseCodec(kind, 512, 16, 3)
    xs = _inputs(n, seed=7)
    accs = [ErrorAccumulator(n, codec, 0.9) for _ in IDS]
    results, _ = await _run(_plan(n), xs, accs)
    values = [results[i].values for i in range(len(IDS))]
    expected = sum_contributions([encode(x, codec) for x in xs])
    assert all(v.tobytes() == expected.tobytes() for v in values)
    stream = sum(codec.payload_bytes(hi - lo) for lo, hi in sparse.segment_bounds(n, 512))
    assert len(sparse.segment_bounds(n, 512)) == 5
    assert all(results[i].bytes_sent == 3 * stream for i in results)
    for i, acc in enumerate(accs):  # the proposal covers every segment: commit leaves C's residual
        acc.commit(attempt=(0, 0))
        residual = xs[i] - sparse.decode(encode(xs[i], codec))
        assert np.allclose(acc.accumulator, residual, atol=1e-5)
