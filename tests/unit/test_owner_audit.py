"""The owner audit (peer/audit.py): an auditor recomputes a shard owner's aggregate from the same
rows and accuses an owner that publishes something else. Honest and lying owners, with and
without compression and robust aggregators; no streams."""

from __future__ import annotations

import numpy as np
import pytest

from shoal.common.plan import Plan
from shoal.peer.audit import OwnerAudit
from shoal.peer.compression import decode, encode
from shoal.peer.partition import ShardPartition
from shoal.peer.reduction import OwnerAccumulator, OwnerReduction, ReductionSpec, final_encoding

IDS = ("a", "b", "c", "d")
P, N = 4, 203  # shards of ~50 elements, chunks of 16: several chunks per shard
PLAN = Plan(participants=IDS, collective="butterfly", shard_bounds=tuple(N * k // P for k in range(P + 1)),
            shard_owner=(0, 1, 2, 3), chunk_bytes=64, audit_owners=True)
SHARD = 1  # owned by b, audited by c


def _sent_rows(compression: str, seed: int = 0) -> np.ndarray:
    """(p, n) float32: every participant's contribution as the others decode it (encoded once)."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(N) + 0.1 * rng.standard_normal((P, N))).astype(np.float32)
    if compression == "none":
        return x
    return np.stack([decode(encode(row, compression)) for row in x])


def _reducer(name: str | None):
    if name is None:
        return None
    return OwnerReduction(ReductionSpec(name, {"f": 1} if name == "krum" else {}), np.ones(P), N)


def _feed(acc: OwnerAccumulator, part: ShardPartition, k: int, rows: np.ndarray) -> None:
    for span in part.chunks(k):
        for j in range(P):
            acc.add(span, j, rows[j, span.lo:span.hi])


def _total_distances(rows: np.ndarray, reducer) -> np.ndarray | None:
    """The summed matrix the owners agree on (each owner's partial matrix, in shard order)."""
    if reducer is None or not reducer.needs_distances:
        return None
    total = np.zeros((P, P))
    for k, owner in enumerate(PLAN.shard_owner):
        part = ShardPartition(PLAN, IDS[owner], 4)
        acc = OwnerAccumulator(part, (k,), reducer, np.float32)
        _feed(acc, part, k, rows)
        total = total + acc.partial_distances(k)
    return total


def _owner_publishes(rows: np.ndarray, reducer, compression: str, total, tamper=None) -> np.ndarray:
    """What every peer decodes from the owner of SHARD: its aggregate, encoded once."""
    part = ShardPartition(PLAN, "b", 4)
    acc = OwnerAccumulator(part, part.owned, reducer, np.float32)
    _feed(acc, part, SHARD, rows)
    out = np.empty(N, dtype=np.float32)
    for span in part.chunks(SHARD):
        red = acc.reduce(span, total)
        if tamper is not None:
            red = tamper(red)
        out[span.lo:span.hi] = final_encoding(red.astype(np.float32), compression)[1]
    return out


def _audit(rows: np.ndarray, reducer, compression: str, total, published: np.ndarray, owner_matrix=None):
    """The auditor c's verdicts on SHARD, fed the same rows."""
    part = ShardPartition(PLAN, "c", 4)
    assert part.audited == (SHARD,)
    audit = OwnerAudit(part, reducer, np.float32, compression)
    _feed(audit.rows, part, SHARD, rows)
    verdicts = []
    if owner_matrix is not None:
        verdicts.append(audit.check_distances(SHARD, owner_matrix))
    for span in part.chunks(SHARD):
        verdicts.append(audit.check_aggregate(span, published[span.lo:span.hi], audit.expected(span, total)))
    return verdicts


CASES = [(None, "none"), (None, "int8"), ("trimmed-mean", "int8"), ("krum", "none"), ("krum", "int8")]


@pytest.mark.parametrize("aggregator, compression", CASES)
def test_an_honest_owner_passes(aggregator, compression):
    rows, reducer = _sent_rows(compression), _reducer(aggregator)
    total = _total_distances(rows, reducer)
    published = _owner_publishes(rows, reducer, compression, total)
    verdicts = _audit(rows, reducer, compression, total, published)
    assert verdicts and all(v.ok for v in verdicts), verdicts


# int8 cannot carry NaN: an owner that tries fails to encode and publishes nothing.
LIES = [(a, c, lie) for a, c in CASES for lie in ("negate", "one element", "nan") if (lie, c) != ("nan", "int8")]


@pytest.mark.parametrize("aggregator, compression, lie", LIES)
def test_a_lying_owner_is_accused(aggregator, compression, lie):
    rows, reducer = _sent_rows(compression, seed=1), _reducer(aggregator)
    total = _total_distances(rows, reducer)

    def tamper(v: np.ndarray) -> np.ndarray:
        v = np.array(v, dtype=np.float32)
        if lie == "negate":
            return -10 * v
        v[0] += 1.0 if lie == "one element" else np.nan
        return v

    published = _owner_publishes(rows, reducer, compression, total, tamper)
    verdicts = _audit(rows, reducer, compression, total, published)
    bad = [v for v in verdicts if not v.ok]
    assert bad, verdicts
    # "negate" changes every chunk; the others only each chunk's first element: every chunk.
    assert len(bad) == len(verdicts)
    assert all(v.owner == "b" and v.shard == SHARD for v in bad)
    assert "owner b published an aggregate of shard 1 that differs from the audit" in bad[0].message


def test_an_owner_that_reduces_other_rows_than_it_was_sent_is_accused():
    # Owner and auditor reduce the rows as sent (each encoded once by its sender); an owner that
    # uses other rows (here: its own raw row, not as the others decode it) fails the audit.
    rows = _sent_rows("int8", seed=2)
    raw = rows.copy()
    raw[1] += 0.5  # the owner's own row, not as the others decode it
    published = _owner_publishes(raw, None, "int8", None)
    assert not all(v.ok for v in _audit(rows, None, "int8", None, published))


@pytest.mark.parametrize("compression", ["none", "int8"])
def test_the_owner_s_distance_matrix_is_checked(compression):
    rows, reducer = _sent_rows(compression, seed=3), _reducer("krum")
    total = _total_distances(rows, reducer)
    part = ShardPartition(PLAN, "b", 4)
    acc = OwnerAccumulator(part, part.owned, reducer, np.float32)
    _feed(acc, part, SHARD, rows)
    honest = acc.partial_distances(SHARD)
    published = _owner_publishes(rows, reducer, compression, total)
    ok = _audit(rows, reducer, compression, total, published, owner_matrix=honest)
    assert all(v.ok for v in ok)
    lied = honest.copy()
    lied[0, 2] = lied[2, 0] = 0.5 * honest[0, 2]  # makes rows 0 and 2 look closer than they are
    verdicts = _audit(rows, reducer, compression, total, published, owner_matrix=lied)
    assert not verdicts[0].ok and all(v.ok for v in verdicts[1:])  # only the matrix lied
    assert verdicts[0].owner == "b" and verdicts[0].difference == pytest.approx(0.5 * honest[0, 2])
    assert "owner b sent distances of shard 1 that differ from the audit" in verdicts[0].message
