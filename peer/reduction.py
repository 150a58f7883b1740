"""What a shard owner does with the contributions it received: collect, bound, aggregate, add
noise, encode once.

`OwnerAccumulator` collects, chunk by chunk, the rows (contributions) of every participant for
the tensor shards one peer reduces, knows when a chunk is complete, and reduces it: the plain sum,
or an `OwnerReducer`. `final_encoding` is how an owner encodes its aggregate once, so that every
peer (the owner included) holds the same decoded values. The auditor of a shard uses the same
pieces to recompute the owner's aggregate (`peer.audit`). None of it touches a stream or an event
loop: `peer.collectives` feeds it the rows it received.

`OwnerReduction` turns the run's aggregation settings (`ReductionSpec`: aggregator and its
parameters, optional norm bound, optional differential-privacy noise) into the two calls the
butterfly collective makes at a shard owner, for one slice `[lo, hi)` of the flat vector:

- `partial_distances(rows, lo, hi)`: `(p, p)` float64 squared distances of the (norm-bounded)
  rows over that slice; only for aggregators with `needs_distances`. The owners exchange these
  and sum them in shard order (`peer.collectives`), so every owner holds the same bytes.
- `reduce(rows, lo, hi, distances)`: the `(m,)` float32 aggregate and the rejected row indices.

It is pure (arrays in, arrays out; no sockets), and does not decide who owns what. Rows are
the participants' *unweighted* pseudo-gradients in plan order; `weights` (sample counts from the
plan) are given to the aggregator, which only FedAvg's mean uses.

Norm bound: the whole-vector L2 bound `max_norm` applies to a slice as
`max_norm * sqrt((hi - lo) / n)` (`peer.aggregators.bound_norms`). Differential privacy: with
`dp_sigma > 0` (requires `max_norm`) the owner adds `N(0, (dp_sigma * max_norm / p)^2)` to every
element of its aggregate, once, before the all-gather: the Gaussian mechanism with noise
multiplier `dp_sigma` for the mean of `p` contributions clipped to `max_norm` (DP-FedAvg,
McMahan et al. 2018). For the robust aggregators that sensitivity is a heuristic (their output
is not a plain mean). The accounting over rounds is the coordinator's (`shoal.common.privacy`);
with contributor noise (dp_mode distributed or local) the owners neither bound nor add noise.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from shoal.common.errors import InvalidArgument
from shoal.peer.aggregators import add_dp_noise, bound_norms, make_aggregator, partial_sq_distances
from shoal.peer.compression import Encoded, codec_id, decode, encode
from shoal.peer.partition import ChunkSpan, ShardPartition


class OwnerReducer(Protocol):
    """The reduction a butterfly shard owner runs in place of the sum (`OwnerReduction`).

    Rows are `(p, hi - lo)` float32, one per participant in plan order, for the slice [lo, hi).
    """

    needs_distances: bool

    def partial_distances(self, rows: np.ndarray, lo: int, hi: int) -> np.ndarray: ...

    def reduce(self, rows: np.ndarray, lo: int, hi: int,
               distances: np.ndarray | None = None) -> tuple[np.ndarray, tuple[int, ...]]: ...


@dataclass(frozen=True)
class ReductionSpec:
    """The run's aggregation settings (from RunConfig). max_norm 0 = no bound; dp_sigma 0 = no noise."""

    aggregator: str = "mean"
    params: dict = field(default_factory=dict)
    max_norm: float = 0.0
    on_norm: str = "clip"
    dp_sigma: float = 0.0

    def check(self) -> None:
        """Raises InvalidArgument (naming the field) for an unusable spec."""
        make_aggregator(self.aggregator, **self.params)
        if not (math.isfinite(self.max_norm) and self.max_norm >= 0):
            raise InvalidArgument(f"max_norm: must be finite and >= 0, got {self.max_norm}")
        if self.on_norm not in ("clip", "reject"):
            raise InvalidArgument(f"on_norm: expected 'clip' or 'reject', got {self.on_norm!r}")
        if not (math.isfinite(self.dp_sigma) and self.dp_sigma >= 0):
            raise InvalidArgument(f"dp_sigma: must be finite and >= 0, got {self.dp_sigma}")
        if self.dp_sigma > 0 and self.max_norm <= 0:
            raise InvalidArgument("dp_sigma: differential privacy needs a clipping bound (max_norm > 0)")


class OwnerReduction:
    """The owner-side reduction of one round; see the module docstring.

    Args:
        spec: aggregation settings.
        weights: `(p,)` sample counts of the participants, plan order.
        num_elements: `n`, the length of the whole flat vector.
        rng: generator for the DP noise (default: fresh OS entropy, so peers cannot predict it).
    """

    def __init__(self, spec: ReductionSpec, weights: np.ndarray, num_elements: int,
                 rng: np.random.Generator | None = None):
        spec.check()
        self.spec = spec
        self.aggregator = make_aggregator(spec.aggregator, **spec.params)
        self.needs_distances = bool(self.aggregator.needs_distances)
        self.weights = np.asarray(weights, dtype=np.float64)
        self.n = int(num_elements)
        self.rng = rng if rng is not None else np.random.default_rng()

    def _bounded(self, rows: np.ndarray, lo: int, hi: int) -> np.ndarray:
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        if self.spec.max_norm <= 0 or hi <= lo:
            return rows
        return bound_norms(rows, max_norm=self.spec.max_norm, shard_fraction=(hi - lo) / self.n,
                           on_norm=self.spec.on_norm)

    def partial_distances(self, rows: np.ndarray, lo: int, hi: int) -> np.ndarray:
        """`(p, p)` float64 partial squared distances of `rows` `(p, hi - lo)` float32 (after the bound)."""
        return partial_sq_distances(self._bounded(rows, lo, hi))

    def reduce(self, rows: np.ndarray, lo: int, hi: int,
               distances: np.ndarray | None = None) -> tuple[np.ndarray, tuple[int, ...]]:
        """`(hi - lo,)` float32 aggregate of `rows` `(p, hi - lo)` float32, and the rejected rows.

        Always finite. Raises InvalidArgument only for malformed arguments.
        """
        res = self.aggregator.reduce(self._bounded(rows, lo, hi), self.weights, distances)
        values = res.values
        if self.spec.dp_sigma > 0 and values.size:
            p = max(1, rows.shape[0] - len(res.rejected))
            values = add_dp_noise(values, clip=self.spec.max_norm / p, sigma=self.spec.dp_sigma, rng=self.rng)
        return values, res.rejected


def final_encoding(values: np.ndarray, compression: str) -> tuple[np.ndarray | Encoded, np.ndarray]:
    """Encode a shard owner's final values once: (what it sends, what every peer decodes from it).

    `values` `(m,)`; with `compression` "none" both are `values` itself. Otherwise `values` must
    be float32 and the second item is a new float32 array. Raises InvalidArgument for an unknown
    codec, or non-finite values under "int8".
    """
    if codec_id(compression) == 0:
        return values, values
    enc = encode(np.ascontiguousarray(values), compression)
    return enc, decode(enc)


def distance_matrix(values: np.ndarray, p: int) -> np.ndarray:
    """A received partial distance matrix as this peer's own `(p, p)` float64 copy.

    Raises ValueError unless `values` holds p*p non-negative, non-NaN float64 values (+inf marks
    a non-finite row, `peer.aggregators.partial_sq_distances`).
    """
    part = np.array(values)
    if part.size != p * p or part.dtype != np.float64 or np.isnan(part).any() or (part < 0).any():
        raise ValueError("malformed distance matrix")
    return part.reshape(p, p)


class _ChunkRows:
    """The rows of one chunk received so far (see `OwnerAccumulator`)."""

    def __init__(self, p: int, m: int, dtype: np.dtype, keep: bool, out: np.ndarray | None = None):
        self.rows = np.empty((p, m), dtype=dtype) if keep else None  # (p, m): for a reducer
        self.out = out  # sum: where the running sum goes (a slice of the caller's result), or None
        self.total: np.ndarray | None = None  # the running plan-order sum: without a reducer
        self.pending: dict[int, np.ndarray] = {}  # sum: rows that arrived before their turn
        self.folded = 0  # sum: rows 0..folded-1 are in `total`
        self.seen: set[int] = set()

    def add(self, j: int, row: np.ndarray, dtype: np.dtype) -> None:
        self.seen.add(j)
        if self.rows is not None:
            self.rows[j] = row
            return
        self.pending[j] = row
        while self.folded in self.pending:
            v = self.pending.pop(self.folded)
            if self.folded == 0:
                self.total = v  # not copied yet: the next row's addition writes the sum (one pass, not two)
            elif self.folded == 1 and self.out is not None:
                self.total = np.add(self.total, v, out=self.out)
            elif self.folded == 1:
                self.total = np.add(self.total, v, dtype=dtype)
            else:
                self.total += v
            self.folded += 1

    def result(self, dtype: np.dtype) -> np.ndarray:
        """The complete sum: in `out` when given, else an array of this chunk's own."""
        assert self.total is not None
        if self.folded > 1:
            return self.total
        # One participant: its row, copied (it may be a received view or the caller's input).
        if self.out is None:
            return self.total.astype(dtype, copy=True)
        np.copyto(self.out, self.total)
        return self.out


class OwnerAccumulator:
    """Per chunk of the tensor shards `shards`, every participant's row; the reduction of a
    complete chunk.

    Args:
        partition: the attempt's `ShardPartition` (chunks, participants).
        shards: the shards this accumulator collects (those a peer owns, or audits).
        reducer: None for the plain sum, else the owner's `OwnerReducer`.
        dtype: the tensor's dtype (rows are converted to it; the sum is computed in it).

    Rows may be added in any order. Without a reducer a chunk costs no `(p, m)` copy: rows are
    summed in plan order (row 0 + row 1 + ...) as soon as they are next in line, so the same rows
    always give the same bits; a row is held as given until it is added (a row that arrives
    early, and row 0 until row 1 is in: a received view must stay unchanged until then). With a reducer each chunk's rows are copied into one
    `(p, m)` array; for a reducer that `needs_distances`, they are kept until `reduce`.
    `reduce` releases a chunk. `rejected`: positions the reducer rejected (any chunk).

    `out` (optional, the plain sum only): the caller's `(n,)` result buffer of `dtype`; each
    chunk's sum is then computed straight into `out[span.lo:span.hi]` (row 0 + row 1 written
    there by one addition, the later rows added in place), so a reduced chunk costs no array of
    its own and no copy into the result, and `reduce` returns that slice of `out`. The bits are
    those of the sum without `out` (same additions, same order).
    """

    def __init__(self, partition: ShardPartition, shards: Iterable[int], reducer: OwnerReducer | None,
                 dtype: np.dtype, out: np.ndarray | None = None):
        self.partition = partition
        self.out = out if reducer is None else None
        self.shards = frozenset(shards)
        self.reducer = reducer
        self.dtype = np.dtype(dtype)
        self.rejected: set[int] = set()
        self._chunks: dict[tuple[int, int], _ChunkRows] = {}
        self._reduced: set[tuple[int, int]] = set()  # a reduced chunk takes no row again (nor writes `out`)

    def _rows(self, span: ChunkSpan) -> _ChunkRows:
        key = (span.shard, span.offset)
        c = self._chunks.get(key)
        if c is None:
            if span.shard not in self.shards:
                raise ValueError(f"shard {span.shard} is not collected here")
            if key in self._reduced:
                raise ValueError(f"shard {span.shard} offset {span.offset} was reduced already")
            out = self.out[span.lo:span.hi] if self.out is not None else None
            c = self._chunks[key] = _ChunkRows(self.partition.size, span.size, self.dtype, self.reducer is not None, out)
        return c

    def add(self, span: ChunkSpan, position: int, row: np.ndarray) -> None:
        """Participant `position`'s row `(span.size,)` of chunk `span`.

        Raises ValueError for a row of the wrong size, a position out of range, a second row
        from the same position, or a row of a chunk already reduced (the caller checks what it
        receives before adding it).
        """
        if row.shape != (span.size,):
            raise ValueError(f"row of shape {row.shape} for a chunk of {span.size} elements")
        if not 0 <= position < self.partition.size:
            raise ValueError(f"position {position} outside 0..{self.partition.size - 1}")
        c = self._rows(span)
        if position in c.seen:
            raise ValueError(f"a second row from position {position} for shard {span.shard} offset {span.offset}")
        c.add(position, row, self.dtype)

    def complete(self, span: ChunkSpan) -> bool:
        """Whether every participant's row of `span` is in (False once reduced)."""
        c = self._chunks.get((span.shard, span.offset))
        return c is not None and len(c.seen) == self.partition.size

    def shard_complete(self, k: int) -> bool:
        return all(self.complete(span) for span in self.partition.chunks(k))

    def partial_distances(self, k: int) -> np.ndarray:
        """`(p, p)` float64: the reducer's partial distance matrices of shard k's chunks, summed
        in offset order. Raises ValueError unless every chunk of k is complete and unreduced."""
        if self.reducer is None or not self.shard_complete(k):
            raise ValueError(f"shard {k}: distances need a reducer and every row of the shard")
        p = self.partition.size
        d = np.zeros((p, p), dtype=np.float64)
        for span in self.partition.chunks(k):
            d = d + self.reducer.partial_distances(self._chunks[(k, span.offset)].rows, span.lo, span.hi)
        return d

    def reduce(self, span: ChunkSpan, distances: np.ndarray | None = None) -> np.ndarray:
        """The `(span.size,)` aggregate of a complete chunk, and release it: the sum in `dtype`,
        or the reducer's float32 result (its rejections join `rejected`). `distances`: the summed
        `(p, p)` matrix, for a reducer that needs it. Raises ValueError for an incomplete chunk."""
        if not self.complete(span):
            raise ValueError(f"shard {span.shard} offset {span.offset}: not every row is in")
        c = self._chunks.pop((span.shard, span.offset))
        self._reduced.add((span.shard, span.offset))
        if self.reducer is None:
            return c.result(self.dtype)
        values, rejected = self.reducer.reduce(c.rows, span.lo, span.hi, distances)
        self.rejected.update(rejected)
        return values
