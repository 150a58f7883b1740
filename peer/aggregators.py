"""Shard-level aggregators: the pure numerical reduction a shard owner runs on one shard.

A shard owner holds, for its shard of `m` elements, one contribution per participant: a
`(p, m)` float32 matrix, plus each participant's sample count. This module turns that into the
one `(m,)` float32 vector the owner sends back to everyone (all-gather). It does not move bytes,
does not know about rounds or peers (contributions are identified by their row index), and never
touches the network; `peer.collectives` owns that.

Contract of every aggregator's `reduce`:

- **Validation first.** A row holding any NaN or ±inf is dropped and its index reported in
  `AggregateResult.rejected`. If every row is dropped the result is zeros (nothing is ever
  reduced from non-finite input), with every index rejected. The output is always finite.
- **Deterministic.** Same input bytes, same output bytes: float64 arithmetic in a fixed order, no
  BLAS reductions, stable sorts with ties broken by the lower row index.
- **float64 inside, float32 out.**
- **Raises** `shoal.common.errors.InvalidArgument` (naming the field) only for malformed arguments:
  wrong shape or dtype, negative or non-finite weights, a malformed distance matrix. Bad
  *values* in contributions are never an error; they are rejected.

Whole-vector semantics across shards. The coordinate-wise aggregators (mean, median, trimmed
mean) are exact per shard. The geometric ones (CenteredClip, Krum, Multi-Krum, Bulyan) need
whole-vector distances, which no single owner can see; they take the pairwise squared-distance
matrix of the whole vectors, which every owner gets by summing the per-shard partial matrices:

    x = bound_norms(x, max_norm=..., shard_fraction=...)   # optional, before anything else
    d_part = partial_sq_distances(x)                          # (p, p) float64, on each owner
    d = d_part[0] + d_part[1] + ...                           # summed in shard-index order
    result = aggregator.reduce(x, weights, d)                 # same selection on every owner

With the summed matrix each owner's output is exactly that shard of the whole-vector
aggregate. Sum the partial matrices in the same order on every owner so they all hold the same
bytes. A row that is non-finite in any shard gets +inf on the diagonal of the summed matrix,
and every owner of a distance-based aggregator then rejects it, so a peer is either in on every
shard or out on every shard. For the coordinate-wise aggregators rejection is per shard (a bad
shard of a peer is dropped, its good shards still count); the collective reports the union of
`rejected` over shards (`Commit.flagged`).

Weights are sample counts. Only `mean` (FedAvg) uses them: a Byzantine peer can claim any
sample count, so the robust aggregators weigh every surviving contribution equally.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from shoal.common.errors import InvalidArgument, construct

__all__ = [
    "AggregateResult",
    "Aggregator",
    "Bulyan",
    "CenteredClip",
    "Krum",
    "Mean",
    "Median",
    "MultiKrum",
    "TrimmedMean",
    "AGGREGATORS",
    "add_dp_noise",
    "bound_norms",
    "make_aggregator",
    "partial_sq_distances",
    "validate",
]


@dataclass(frozen=True)
class AggregateResult:
    """What a shard owner sends back, and whom it dropped.

    Attributes:
        values: `(m,)` float32, the reduced shard; always finite.
        rejected: row indices (into the `contributions` given to `reduce`) dropped by
            validation, ascending.
    """

    values: np.ndarray
    rejected: tuple[int, ...]


@runtime_checkable
class Aggregator(Protocol):
    """A shard-level reduction; see the module docstring for the contract."""

    name: str
    needs_distances: bool

    def reduce(
        self,
        contributions: np.ndarray,
        weights: np.ndarray,
        distances: np.ndarray | None = None,
    ) -> AggregateResult:
        """Reduce `(p, m)` float32 contributions to one `(m,)` float32 vector."""
        ...


# --------------------------------------------------------------------------------------------
# Validation and distances


def _check_contributions(contributions: np.ndarray) -> np.ndarray:
    if not isinstance(contributions, np.ndarray):
        raise InvalidArgument(f"contributions: expected a numpy array, got {type(contributions).__name__}")
    if contributions.ndim != 2:
        raise InvalidArgument(f"contributions: expected shape (p, m), got {contributions.shape}")
    if contributions.dtype != np.float32:
        raise InvalidArgument(f"contributions: expected float32, got {contributions.dtype}")
    return contributions


def _check_weights(weights: np.ndarray, p: int) -> np.ndarray:
    w = np.asarray(weights)
    if w.shape != (p,):
        raise InvalidArgument(f"weights: expected shape ({p},), got {w.shape}")
    if not (np.issubdtype(w.dtype, np.floating) or np.issubdtype(w.dtype, np.integer)):
        raise InvalidArgument(f"weights: expected a numeric dtype, got {w.dtype}")
    w = w.astype(np.float64)
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise InvalidArgument("weights: must be finite and >= 0")
    return w


def _check_distances(distances: np.ndarray, p: int) -> np.ndarray:
    d = np.asarray(distances)
    if d.shape != (p, p):
        raise InvalidArgument(f"distances: expected shape ({p}, {p}), got {d.shape}")
    if not np.issubdtype(d.dtype, np.floating):
        raise InvalidArgument(f"distances: expected a float dtype, got {d.dtype}")
    d = d.astype(np.float64)
    if np.any(np.isnan(d)) or np.any(d < 0):
        raise InvalidArgument("distances: entries must be >= 0 or +inf")
    return d


def _finite_rows(x: np.ndarray) -> np.ndarray:
    """(p,) bool: rows of `x` without NaN or inf."""
    if x.shape[1] == 0:
        return np.ones(x.shape[0], dtype=bool)
    return np.isfinite(x).all(axis=1)


def bound_norms(
    contributions: np.ndarray,
    *,
    max_norm: float | None,
    shard_fraction: float,
    on_norm: str = "clip",
) -> np.ndarray:
    """Apply the per-shard norm bound without changing the shape.

    The bound on the whole vector's L2 norm is `max_norm`; on a shard holding `shard_fraction`
    of the elements it is `max_norm * sqrt(shard_fraction)` (what an isotropic vector of norm
    `max_norm` has on that fraction). A finite row whose shard norm exceeds it is scaled down to
    the bound (`on_norm="clip"`) or replaced by NaN (`on_norm="reject"`), so that every later
    step, including `partial_sq_distances`, treats it as rejected. Rows that are already
    non-finite are left as they are.

    Args:
        contributions: `(p, m)` float32.
        max_norm: whole-vector L2 bound, > 0; None disables the bound (returns a copy).
        shard_fraction: this shard's elements / all elements, in (0, 1].
        on_norm: "clip" or "reject".

    Returns:
        A new `(p, m)` float32 array; the input is not modified. A clipped row's norm may
        exceed the bound by float32 rounding (relative 1e-7).

    Raises:
        InvalidArgument: malformed `contributions`, `max_norm`, `shard_fraction` or `on_norm`.
    """
    x = _check_contributions(contributions)
    if on_norm not in ("clip", "reject"):
        raise InvalidArgument(f"on_norm: expected 'clip' or 'reject', got {on_norm!r}")
    if not (math.isfinite(shard_fraction) and 0.0 < shard_fraction <= 1.0):
        raise InvalidArgument(f"shard_fraction: must be in (0, 1], got {shard_fraction}")
    out = x.copy()
    if max_norm is None:
        return out
    if not (math.isfinite(max_norm) and max_norm > 0):
        raise InvalidArgument(f"max_norm: must be finite and > 0, got {max_norm}")
    bound = float(max_norm) * math.sqrt(shard_fraction)
    finite = _finite_rows(x)
    x64 = x.astype(np.float64)
    norms = np.sqrt((x64 * x64).sum(axis=1))
    over = finite & (norms > bound)
    for i in np.flatnonzero(over):
        if on_norm == "clip":
            out[i] = (x64[i] * (bound / norms[i])).astype(np.float32)
        else:
            out[i] = np.nan
    return out


def validate(
    contributions: np.ndarray,
    *,
    max_norm: float | None,
    shard_fraction: float,
    on_norm: str = "clip",
) -> tuple[np.ndarray, tuple[int, ...]]:
    """Drop non-finite rows and apply the optional per-shard norm bound.

    Args:
        contributions: `(p, m)` float32, one row per participant.
        max_norm: whole-vector L2 bound; the shard bound is `max_norm * sqrt(shard_fraction)`
            (see `bound_norms`). None: no norm bound.
        shard_fraction: this shard's share of the vector's elements, in (0, 1].
        on_norm: "clip" scales an over-long row down to the bound and keeps it; "reject" drops
            it like a non-finite row.

    Returns:
        `(clean, rejected)`: `clean` is `(p - len(rejected), m)` float32 holding the kept rows
        in their original order; `rejected` the dropped row indices, ascending.

    Raises:
        InvalidArgument: malformed arguments (see `bound_norms`).
    """
    bounded = bound_norms(contributions, max_norm=max_norm, shard_fraction=shard_fraction, on_norm=on_norm)
    keep = _finite_rows(bounded)
    rejected = tuple(int(i) for i in np.flatnonzero(~keep))
    return bounded[keep], rejected


def partial_sq_distances(contributions: np.ndarray) -> np.ndarray:
    """Pairwise squared L2 distances between the rows of one shard.

    `D[i, j] = sum_k (x[i, k] - x[j, k])**2` in float64, so summing the matrices of all shards
    gives the whole-vector matrix. A row holding any non-finite value gets +inf in its whole
    row and column, diagonal included: after summing, `D[i, i] == inf` marks a row that was bad
    on some shard, and every owner rejects it. For finite float32 input the sum never
    overflows float64.

    Cost: O(p^2 m) time, O(p m) extra memory; no BLAS, so the result is bit-reproducible.

    Args:
        contributions: `(p, m)` float32.

    Returns:
        `(p, p)` float64, symmetric, zero diagonal for finite rows.

    Raises:
        InvalidArgument: `contributions` is not a 2-D float32 array.
    """
    x = _check_contributions(contributions)
    p = x.shape[0]
    finite = _finite_rows(x)
    x64 = np.where(finite[:, None], x, 0.0).astype(np.float64)
    d = np.zeros((p, p), dtype=np.float64)
    for i in range(p - 1):
        diff = x64[i + 1 :] - x64[i]
        row = (diff * diff).sum(axis=1)
        d[i, i + 1 :] = row
        d[i + 1 :, i] = row
    bad = ~finite
    d[bad, :] = np.inf
    d[:, bad] = np.inf
    return d


def add_dp_noise(values: np.ndarray, *, clip: float, sigma: float, rng: np.random.Generator) -> np.ndarray:
    """Gaussian mechanism: add `N(0, (sigma * clip)^2)` independently to every element.

    The shard owner adds it once, after reducing, so all peers receive the same noisy bytes.
    `sigma` is the *noise multiplier* (Abadi et al. 2016; McMahan et al. 2018, DP-FedAvg): the
    standard deviation is `sigma * clip`, where `clip` is the L2 sensitivity of `values` to one
    participant. If `values` is a sum of contributions each clipped to whole-vector norm `C`,
    pass `clip=C`; if it is their average over `p` participants, pass `clip=C / p`. Per-element
    noise is i.i.d., so adding it shard by shard equals adding it to the whole vector.
    The privacy accounting (epsilon, delta over rounds) is the caller's business.

    Args:
        values: `(m,)` float32, finite.
        clip: sensitivity, finite and > 0.
        sigma: noise multiplier, finite and >= 0 (0 returns a copy).
        rng: the owner's generator; its state advances by `m` normal draws.

    Returns:
        A new `(m,)` float32 array (computed in float64; never non-finite for finite input of
        sane magnitude).

    Raises:
        InvalidArgument: `values` not 1-D finite float32, or bad `clip` / `sigma`.
    """
    v = np.asarray(values)
    if v.ndim != 1 or v.dtype != np.float32:
        raise InvalidArgument(f"values: expected 1-D float32, got shape {v.shape} dtype {v.dtype}")
    if not np.all(np.isfinite(v)):
        raise InvalidArgument("values: must be finite")
    if not (math.isfinite(clip) and clip > 0):
        raise InvalidArgument(f"clip: must be finite and > 0, got {clip}")
    if not (math.isfinite(sigma) and sigma >= 0):
        raise InvalidArgument(f"sigma: must be finite and >= 0, got {sigma}")
    if sigma == 0:
        return v.copy()
    noise = rng.normal(0.0, sigma * clip, size=v.shape)
    return (v.astype(np.float64) + noise).astype(np.float32)


# --------------------------------------------------------------------------------------------
# Shared machinery


@dataclass(frozen=True)
class _Prepared:
    x: np.ndarray  # (n, m) float64, kept rows
    w: np.ndarray  # (n,) float64, their weights
    d: np.ndarray | None  # (n, n) float64, their distances
    rejected: tuple[int, ...]
    m: int


def _prepare(
    contributions: np.ndarray, weights: np.ndarray, distances: np.ndarray | None, *, use_distances: bool
) -> _Prepared:
    x = _check_contributions(contributions)
    p, m = x.shape
    w = _check_weights(weights, p)
    keep = _finite_rows(x)
    d = None
    if distances is not None:
        d_full = _check_distances(distances, p)
        keep &= np.isfinite(np.diagonal(d_full))
        if use_distances:
            d = d_full[np.ix_(keep, keep)]
            if not np.all(np.isfinite(d)):
                raise InvalidArgument("distances: +inf between rows whose diagonal is finite")
    if use_distances and d is None:
        # No summed matrix given: the distances of this shard alone (exact for a single shard).
        x_keep = x[keep]
        d = partial_sq_distances(x_keep)
    rejected = tuple(int(i) for i in np.flatnonzero(~keep))
    return _Prepared(x=x[keep].astype(np.float64), w=w[keep], d=d, rejected=rejected, m=m)


def _empty(prep: _Prepared) -> AggregateResult:
    return AggregateResult(values=np.zeros(prep.m, dtype=np.float32), rejected=prep.rejected)


def _finish(values64: np.ndarray, rejected: tuple[int, ...]) -> AggregateResult:
    # Finite float32 rows give finite float64 results; the only way out of range is a weighted
    # mean of values near float32's max, which saturates instead of becoming inf.
    big = float(np.finfo(np.float32).max)
    out = np.clip(values64, -big, big).astype(np.float32)
    return AggregateResult(values=out, rejected=rejected)


def _krum_scores(d: np.ndarray, f: int) -> np.ndarray:
    """Krum score of each row: sum of its `n - f - 2` smallest distances to the others.

    The neighbour count is clamped to [1, n - 1] (to 0 when n == 1) so small groups still get a
    deterministic answer; Blanchard et al.'s guarantee needs n >= 2f + 3.
    """
    n = d.shape[0]
    k = min(max(1, n - f - 2), n - 1)
    if k <= 0:
        return np.zeros(n, dtype=np.float64)
    scores = np.empty(n, dtype=np.float64)
    for i in range(n):
        others = np.concatenate([d[i, :i], d[i, i + 1 :]])
        scores[i] = np.sort(others)[:k].sum()
    return scores


def _check_int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise InvalidArgument(f"{name}: expected an integer >= {low}, got {value!r}")
    return int(value)


def _check_float(name: str, value: object, low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> float:
    try:
        v = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise InvalidArgument(f"{name}: expected a number, got {value!r}") from None
    ok = math.isfinite(v) and (v > low if low_open else v >= low) and (v < high if high_open else v <= high)
    if not ok:
        raise InvalidArgument(f"{name}: out of range, got {value!r}")
    return v


# --------------------------------------------------------------------------------------------
# Aggregators


class Mean:
    """FedAvg: the sample-weighted mean (McMahan et al. 2017, "Communication-Efficient Learning
    of Deep Networks from Decentralized Data").

    `v = sum_i w_i x_i / sum_i w_i` over the surviving rows; if every surviving weight is 0 the
    rows are weighted equally. Breakdown point 0: one arbitrary contribution moves it anywhere
    (only non-finite rows are stopped). Cost O(p m).
    """

    name = "mean"
    needs_distances = False

    def reduce(self, contributions: np.ndarray, weights: np.ndarray, distances: np.ndarray | None = None) -> AggregateResult:
        """See the module docstring; `distances` only propagates rejections."""
        prep = _prepare(contributions, weights, distances, use_distances=False)
        if prep.x.shape[0] == 0:
            return _empty(prep)
        w = prep.w if prep.w.sum() > 0 else np.ones_like(prep.w)
        acc = (prep.x * w[:, None]).sum(axis=0)
        return _finish(acc / w.sum(), prep.rejected)


class Median:
    """Coordinate-wise median (Yin et al. 2018, "Byzantine-Robust Distributed Learning: Towards
    Optimal Statistical Rates").

    `v_k = median_i x_{i,k}` (mean of the two middle values for an even count), unweighted.
    Breakdown point 1/2: fewer than half the rows arbitrary keep every coordinate inside the
    honest range. Cost O(p m log p).
    """

    name = "median"
    needs_distances = False

    def reduce(self, contributions: np.ndarray, weights: np.ndarray, distances: np.ndarray | None = None) -> AggregateResult:
        """See the module docstring; weights are checked but unused."""
        prep = _prepare(contributions, weights, distances, use_distances=False)
        if prep.x.shape[0] == 0:
            return _empty(prep)
        return _finish(np.median(prep.x, axis=0), prep.rejected)


class TrimmedMean:
    """Coordinate-wise trimmed mean (Yin et al. 2018).

    Per coordinate, sort the n surviving values, drop the `k = floor(beta * n)` smallest and
    `k` largest (k clamped so at least one value remains), average the rest, unweighted.
    Breakdown point `beta` (tolerates fewer than `beta * n` arbitrary rows). Cost O(p m log p).

    Args:
        beta: fraction trimmed from *each* side, in [0, 0.5).
    """

    name = "trimmed-mean"
    needs_distances = False

    def __init__(self, beta: float = 0.2) -> None:
        self.beta = _check_float("beta", beta, 0.0, 0.5, high_open=True)

    def reduce(self, contributions: np.ndarray, weights: np.ndarray, distances: np.ndarray | None = None) -> AggregateResult:
        """See the module docstring; weights are checked but unused."""
        prep = _prepare(contributions, weights, distances, use_distances=False)
        n = prep.x.shape[0]
        if n == 0:
            return _empty(prep)
        k = min(int(math.floor(self.beta * n)), (n - 1) // 2)
        s = np.sort(prep.x, axis=0)
        return _finish(s[k : n - k].mean(axis=0), prep.rejected)


class CenteredClip:
    """CenteredClip (Karimireddy, He and Jaggi 2021, "Learning from History for Byzantine Robust
    Optimization"), iterated `iterations` times:

        v <- v + (1/n) sum_i (x_i - v) * min(1, tau / ||x_i - v||)

    with whole-vector norms, unweighted. The starting point `v_0` is the medoid (the row with
    the least sum of distances to the others, lowest index on ties); the paper starts from the
    previous round's momentum, which a stateless owner does not have.

    Sharding: every iterate stays an affine combination `v = sum_j c_j x_j` (sum c = 1), and
    `||x_i - v||^2 = (D c)_i - c^T D c / 2` for the squared-distance matrix D. So the
    coefficients are computed from the summed D alone, identically on every owner, and each
    owner applies them to its shard: the concatenation equals the whole-vector algorithm up to
    float rounding. The coefficients stay in the simplex, so the result is a convex combination
    of the surviving rows. Without `distances` the shard's own matrix is used (exact for one shard).

    Breakdown point: below 1/2 for a suitable tau (each outlier moves v by at most tau/n per
    iteration; Karimireddy et al. Thm. 3). Cost O(p^2 m) for the distances (by the caller) plus
    O(iterations p^2 + p m) here.

    Args:
        tau: clipping radius (whole-vector L2), > 0; pick it near the honest spread.
        iterations: number of clipping iterations, >= 1.
    """

    name = "centered-clip"
    needs_distances = True

    def __init__(self, tau: float = 1.0, iterations: int = 5) -> None:
        self.tau = _check_float("tau", tau, 0.0, math.inf, low_open=True, high_open=True)
        self.iterations = _check_int("iterations", iterations, 1)

    def coefficients(self, d: np.ndarray) -> np.ndarray:
        """`(n,)` float64 affine coefficients of the result, from the `(n, n)` distance matrix."""
        n = d.shape[0]
        medoid = int(np.argmin(np.sqrt(d).sum(axis=1)))
        c = np.zeros(n, dtype=np.float64)
        c[medoid] = 1.0
        for _ in range(self.iterations):
            dc = (d * c[None, :]).sum(axis=1)
            sq = np.maximum(dc - 0.5 * float((c * dc).sum()), 0.0)
            norms = np.sqrt(sq)
            with np.errstate(divide="ignore"):
                s = np.where(norms > self.tau, self.tau / np.where(norms > 0, norms, 1.0), 1.0)
            s = s / n
            c = c * (1.0 - s.sum()) + s
        return c

    def reduce(self, contributions: np.ndarray, weights: np.ndarray, distances: np.ndarray | None = None) -> AggregateResult:
        """See the module docstring; weights are checked but unused."""
        prep = _prepare(contributions, weights, distances, use_distances=True)
        if prep.x.shape[0] == 0:
            return _empty(prep)
        assert prep.d is not None
        c = self.coefficients(prep.d)
        return _finish((prep.x * c[:, None]).sum(axis=0), prep.rejected)


class Krum:
    """Krum (Blanchard et al. 2017, "Machine Learning with Adversaries: Byzantine Tolerant
    Gradient Descent").

    Score each row by the sum of its squared distances to its `n - f - 2` nearest other rows and
    output the row with the least score (lowest index on ties). Tolerates `f` arbitrary rows out
    of `n >= 2f + 3`; below that it still answers (neighbour count clamped to >= 1) but the
    guarantee is void. Needs the whole-vector distance matrix. Cost O(p^2 m) for distances
    (caller) plus O(p^2 log p) here.

    Args:
        f: number of Byzantine rows tolerated, >= 0.
    """

    name = "krum"
    needs_distances = True

    def __init__(self, f: int = 1) -> None:
        self.f = _check_int("f", f, 0)

    def select(self, d: np.ndarray) -> np.ndarray:
        """Indices (into the surviving rows) that are averaged; here exactly one."""
        return np.array([int(np.argmin(_krum_scores(d, self.f)))])

    def reduce(self, contributions: np.ndarray, weights: np.ndarray, distances: np.ndarray | None = None) -> AggregateResult:
        """See the module docstring; weights are checked but unused."""
        prep = _prepare(contributions, weights, distances, use_distances=True)
        if prep.x.shape[0] == 0:
            return _empty(prep)
        assert prep.d is not None
        chosen = self.select(prep.d)
        return _finish(prep.x[chosen].mean(axis=0), prep.rejected)


class MultiKrum(Krum):
    """Multi-Krum (Blanchard et al. 2017): the unweighted mean of the `m` rows with the least
    Krum scores (stable order, lowest index on ties).

    `m` defaults to `n - f` of the surviving rows and is clamped to [1, n]. Same tolerance and
    cost as Krum; more rows averaged, less variance.

    Args:
        f: number of Byzantine rows tolerated, >= 0.
        m: rows averaged, >= 1, or None for `n - f`.
    """

    name = "multi-krum"

    def __init__(self, f: int = 1, m: int | None = None) -> None:
        super().__init__(f)
        self.m = None if m is None else _check_int("m", m, 1)

    def select(self, d: np.ndarray) -> np.ndarray:
        n = d.shape[0]
        m = n - self.f if self.m is None else self.m
        m = min(max(1, m), n)
        order = np.argsort(_krum_scores(d, self.f), kind="stable")
        return np.sort(order[:m])


class Bulyan:
    """Bulyan (El Mhamdi, Guerraoui and Rouault 2018, "The Hidden Vulnerability of Distributed
    Learning in Byzantium") over Krum.

    1. Select `theta = n - 2f` rows by running Krum `theta` times, each time removing the winner
       from the candidate set (scores recomputed on the remaining rows).
    2. Per coordinate, average (unweighted) the `beta = theta - 2f` selected values closest to
       the selected values' median (stable order, lower selection rank on ties).

    Tolerates `f` arbitrary rows out of `n >= 4f + 3`. Below that it still answers, with
    `theta = max(1, n - 2f)` and `beta = max(1, theta - 2f)`, but the guarantee is void.
    Needs the whole-vector distance matrix. Cost O(p^2 m) distances (caller) plus
    O(p^3 log p + p m log p) here.

    Args:
        f: number of Byzantine rows tolerated, >= 0.
    """

    name = "bulyan"
    needs_distances = True

    def __init__(self, f: int = 1) -> None:
        self.f = _check_int("f", f, 0)

    def select(self, d: np.ndarray) -> np.ndarray:
        """Indices (into the surviving rows) picked by iterated Krum, in pick order."""
        n = d.shape[0]
        theta = max(1, n - 2 * self.f)
        remaining = list(range(n))
        picked: list[int] = []
        for _ in range(theta):
            sub = d[np.ix_(remaining, remaining)]
            winner = remaining[int(np.argmin(_krum_scores(sub, self.f)))]
            picked.append(winner)
            remaining.remove(winner)
        return np.array(picked, dtype=np.int64)

    def reduce(self, contributions: np.ndarray, weights: np.ndarray, distances: np.ndarray | None = None) -> AggregateResult:
        """See the module docstring; weights are checked but unused."""
        prep = _prepare(contributions, weights, distances, use_distances=True)
        if prep.x.shape[0] == 0:
            return _empty(prep)
        assert prep.d is not None
        sel = prep.x[self.select(prep.d)]
        theta = sel.shape[0]
        beta = max(1, theta - 2 * self.f)
        med = np.median(sel, axis=0)
        order = np.argsort(np.abs(sel - med[None, :]), axis=0, kind="stable")[:beta]
        closest = np.take_along_axis(sel, order, axis=0)
        return _finish(closest.mean(axis=0), prep.rejected)


AGGREGATORS: dict[str, type] = {
    "mean": Mean,
    "median": Median,
    "trimmed-mean": TrimmedMean,
    "centered-clip": CenteredClip,
    "krum": Krum,
    "multi-krum": MultiKrum,
    "bulyan": Bulyan,
}


def make_aggregator(name: str, **params: object) -> Aggregator:
    """Build the aggregator named in the plan (`Plan.aggregator`).

    Names and parameters: "mean" (none; "fedavg", removed in 0.3, is refused naming it), "median" (none), "trimmed-mean"
    (beta=0.2), "centered-clip" (tau=1.0, iterations=5), "krum" (f=1), "multi-krum" (f=1,
    m=None), "bulyan" (f=1).

    Raises:
        InvalidArgument: unknown name ("aggregator"), unknown or out-of-range parameter (named).
    """
    return construct(AGGREGATORS, name, "aggregator", {"fedavg": "mean"}, **params)
