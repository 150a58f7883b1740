"""What a shard owner does with the contributions it received: bound, aggregate, add noise.

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
is not a plain mean). Privacy accounting over rounds is not done here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from shoal.peer.aggregators import add_dp_noise, bound_norms, make_aggregator, partial_sq_distances
from shoal.common.errors import InvalidArgument


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
