"""The butterfly and the ring over the in-memory lane (peer.lanes.memory): the algorithms alone,
no sockets and no processes. Every participant ends with the same bytes, a silent peer is
named by the others, a lying shard owner is caught by the owner audit."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from shoal.common.plan import Plan
from shoal.common.tensors import result_digest
from shoal.peer.testing.byzantine import tamper as corrupt_aggregate
from shoal.peer.collectives import CollectiveError, all_reduce
from shoal.peer.lanes.memory import MemoryNet

IDS = tuple(f"{c * 16}" for c in "abcd")


def _plan(algorithm: str, n: int, *, attempt: int = 0, chunk_timeout: float = 5.0, audit: bool = False,
          compression: str = "none") -> Plan:
    p = len(IDS)
    return Plan(participants=IDS, collective=algorithm, shard_bounds=tuple(n * i // p for i in range(p + 1)),
                shard_owner=tuple(range(p)), attempt=attempt, addresses=tuple(f"mem:{i}" for i in range(p)),
                chunk_bytes=4096, chunk_timeout_seconds=chunk_timeout, deadline_seconds=10.0,
                audit_owners=audit, compression=compression)


async def _run(plan: Plan, xs, *, silent=(), tampers=None):
    net = MemoryNet()
    net.start(plan)
    live = [i for i in range(len(IDS)) if i not in silent]
    out = await asyncio.gather(*[all_reduce(xs[i], plan, me=IDS[i], lanes=net.lanes(plan, IDS[i]),
                                            tamper=(tampers or {}).get(i)) for i in live],
                               return_exceptions=True)
    return dict(zip(live, out)), net


def _inputs(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n).astype(np.float32) for _ in IDS]


@pytest.mark.parametrize("algorithm", ["butterfly", "ring"])
@pytest.mark.parametrize("compression", ["none", "fp16"])
async def test_every_participant_ends_with_the_same_bytes(algorithm, compression):
    n = 10_007  # shards of ~2,500 elements: several chunks of 4 KiB each, a short last one
    xs = _inputs(n)
    copies = [x.copy() for x in xs]
    results, net = await _run(_plan(algorithm, n, compression=compression), xs)
    values = [results[i].values for i in range(len(IDS))]
    assert all(v.tobytes() == values[0].tobytes() for v in values)
    assert all(results[i].digest == result_digest(values[0]) for i in results)
    np.testing.assert_allclose(values[0], np.sum(xs, axis=0), rtol=1e-2 if compression != "none" else 1e-5,
                               atol=1e-2 if compression != "none" else 1e-5)
    assert all(x.tobytes() == c.tobytes() for x, c in zip(xs, copies))  # inputs never modified
    assert net.chunks > 4 * len(IDS)


@pytest.mark.parametrize("algorithm", ["butterfly", "ring"])
async def test_fp4_gives_every_participant_the_same_bytes_near_the_sum(algorithm):
    """4-bit floats per hop: the owners accumulate the decoded contributions in float32 and
    quantize once, so every participant holds the same bytes; the error is that of a few E2M1
    roundings (under a third of the sum's RMS), and 4.125 bits travel per element."""
    n = 10_007
    xs = _inputs(n, seed=4)
    results, net = await _run(_plan(algorithm, n, compression="fp4"), xs)
    values = [results[i].values for i in range(len(IDS))]
    assert all(v.tobytes() == values[0].tobytes() for v in values)
    exact = np.sum(xs, axis=0, dtype=np.float64)
    rel = np.sqrt(np.mean((values[0] - exact) ** 2) / np.mean(exact ** 2))
    assert 0.01 < rel < 0.33, rel
    sent = sum(results[i].bytes_sent for i in results)
    raw, _ = await _run(_plan(algorithm, n), xs)
    assert sent < 0.15 * sum(raw[i].bytes_sent for i in raw)


@pytest.mark.parametrize("algorithm", ["butterfly", "ring"])
async def test_a_silent_peer_is_the_suspect_at_the_chunk_deadline(algorithm):
    """Peer 0 never sends. In the butterfly every peer's first wait is on it (its rows, its
    shard), in the ring its successor's: they name it at the chunk deadline. (Each peer names
    the sender its first expired wait was on; the coordinator's blame combines the votes.)"""
    n = 4_000
    results, _ = await _run(_plan(algorithm, n, chunk_timeout=0.2), _inputs(n), silent=(0,))
    assert all(isinstance(e, CollectiveError) for e in results.values()), results
    waiting = results.values() if algorithm == "butterfly" else [results[1]]
    assert all(e.suspects == (IDS[0],) and "no chunk from" in str(e) for e in waiting), results


async def test_a_lying_owner_is_caught_by_its_auditor():
    n = 8_000
    xs = _inputs(n, seed=1)
    liar = 1
    results, _ = await _run(_plan("butterfly", n, audit=True), xs, tampers={liar: corrupt_aggregate})
    auditor = (liar + 1) % len(IDS)  # the next owner audits shard `liar`
    failed = {i: r for i, r in results.items() if isinstance(r, CollectiveError)}
    assert set(failed) == {auditor}
    assert failed[auditor].audit and set(failed[auditor].suspects) == {IDS[liar], IDS[auditor]}


async def test_a_lying_owner_unaudited_publishes_the_same_wrong_bytes_to_everyone():
    """Without the audit the owner's lie reaches every participant alike (the digests agree and
    the round would commit it): what `audit_owners` is for."""
    n = 8_000
    xs = _inputs(n, seed=2)
    results, _ = await _run(_plan("butterfly", n), xs, tampers={1: corrupt_aggregate})
    digests = {r.digest for r in results.values()}
    assert len(digests) == 1
    lo, hi = n // 4, n // 2
    assert not np.allclose(results[0].values[lo:hi], np.sum(xs, axis=0)[lo:hi], atol=1e-3)


async def test_a_chunk_that_does_not_fit_the_plan_is_refused_and_its_sender_named():
    """Peer 3 sends float64 chunks to a float32 plan: every receiver refuses its first chunk
    (`Session.check_chunk`, as on the network), fails its waits on peer 3 at once and names it;
    peer 3's own lanes fail on the refusal."""
    n = 4_000
    plan = _plan("butterfly", n, chunk_timeout=5.0)
    xs = _inputs(n)
    xs[3] = xs[3].astype(np.float64)
    results, _ = await _run(plan, xs)
    assert all(isinstance(e, CollectiveError) for e in results.values()), results
    assert all(results[i].suspects == (IDS[3],) for i in range(3)), results
    assert all("within" not in str(results[i]) for i in range(3))  # at once, not at the deadline
