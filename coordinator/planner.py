"""Collective planning: which all-reduce to run, in which order, with which shard sizes.

This module is the pure core of round planning (the design notes (§4)). Given one `LinkSpec` per
participant (upload and download bandwidth in bytes/s and a typical round-trip time) and the size
of the tensor, `plan_collective` chooses the algorithm (ring, butterfly or tree / recursive
doubling), the participant order, the shard boundaries and owners, and predicts how long the
collective takes under an α-β cost model with asymmetric links. It opens no sockets, reads no
clocks and keeps no state: arrays in, a frozen `CollectivePlan` out. Measuring links, choosing the
participants and publishing the plan belong to the coordinator's round logic, not here.

Cost model
----------
Peer *i* has upload ``u_i`` and download ``d_i`` (bytes/s) and one-way latency
``α_i = rtt_i / 2``. A transfer i→j runs at ``min(u_i, d_j)`` (or the measured pairwise rate
when a ``pairwise`` matrix is given, capped by both ends) and starts after
``α_ij = (α_i + α_j) / 2``, so uniform round-trip times ``r`` give ``α = r/2``. Peers that
transfer to several others at once share their own upload/download (fluid model): a phase that
moves ``out_i`` bytes up and ``in_i`` bytes down at every peer lasts ``max_i max(out_i/u_i,
in_i/d_i)``. For a payload of ``n`` bytes over ``p`` peers:

* **ring** (Patarasuk & Yuan 2009): ``2(p-1)`` lock-step steps, each moving ``n/p`` bytes over
  every ring link ``i → next(i)``:
  ``T = 2(p-1) · max_i (α_{i,next} + (n/p) / min(u_i, d_next))``. Equal shards.
* **butterfly** (direct reduce-scatter then all-gather; hivemind's "butterfly all-reduce") with
  shard fractions ``w`` (Σw = 1). Peer *i* uploads ``n(1-w_i)`` and downloads ``n(p-1)w_i`` in the
  reduce-scatter, uploads ``n(p-1)w_i`` and downloads ``n(1-w_i)`` in the all-gather.

  - phased (``overlap=False``; the LP of the design notes (§4), literally): the all-gather starts after the
    reduce-scatter, ``T = T_rs + T_ag + 2(p-1)·α_max`` with
    ``T_rs = max_i max(n(1-w_i)/u_i, n(p-1)w_i/d_i)`` and
    ``T_ag = max_i max(n(p-1)w_i/u_i, n(1-w_i)/d_i)``;
  - pipelined (``overlap=True``, the default; hivemind's load-balancing model): the tensor moves
    in parts and an owner sends each reduced part back as soon as it has it, so both phases share
    the links: ``T = max_i n(1 + (p-2)w_i) / min(u_i, d_i) + 2(p-1)·α_max``.

  The latency term charges ``α`` per message as in Thakur, Rabenseifner & Gropp 2005 (pairwise
  exchange: ``p-1`` messages per phase); ``α_max`` is the largest pairwise one-way latency.

  The fractions come from a linear program (`butterfly_fractions`). Note the difference: in the
  phased model a peer's own reduce-scatter and all-gather loads pull ``w_i`` in opposite
  directions, so a peer that is uniformly slow (``u_i = d_i``) still gets exactly ``1/p``; only
  the pipelined model shrinks (or zeroes) its shard. Use the model that matches the data plane.
* **tree** (recursive doubling): ``⌈log2 p⌉`` exchange steps of the whole ``n`` bytes between
  partners (plus one fold-in and one fold-out step when ``p`` is not a power of two), each step
  costing ``max_pairs (α + n / min(u_a, d_b))``. Few steps, much traffic: for small payloads.

Lower bound
-----------
Without compression and when bytes are only combined by the reduction (no network coding), every
all-reduce obeys (derivation in `allreduce_lower_bound`)::

    T ≥ max( n / min_i u_i,  n / min_i d_i,  2(p-1)n / Σ_i u_i,  2(p-1)n / Σ_i d_i )

The first two terms are the design notes' floor ``n / min_i min(u_i, d_i)`` (every peer must send its
whole input and receive the whole result at least once); the last two are Patarasuk & Yuan's
``2(p-1)/p · n`` bytes per peer, generalised to unequal links by summing over peers. The
pipelined butterfly with a non-owner slowest peer reaches the floor; with uniform links, ring and
butterfly reach the ``2(p-1)n/(p·B)`` term.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import scipy.optimize

__all__ = [
    "ALGORITHMS",
    "CollectivePlan",
    "LinkSpec",
    "allreduce_lower_bound",
    "best_ring_order",
    "butterfly_fractions",
    "plan_collective",
    "predict_butterfly",
    "predict_ring",
    "predict_tree",
    "ring_link_seconds",
    "shard_bounds_from_fractions",
    "simple_floor",
]

ALGORITHMS = ("butterfly", "ring", "tree")  # also the tie-break preference, best first

# Fractions below this are treated as zero (LP solvers return 1e-17 noise instead of 0).
_FRACTION_EPS = 1e-9
# Permutations are enumerated exactly up to this many participants ((p-1)! orders).
_EXACT_RING_LIMIT = 8


@dataclass(frozen=True)
class LinkSpec:
    """What the planner knows about one participant's access link.

    ``up_bytes_per_s``/``down_bytes_per_s`` must be finite and > 0 (a peer that cannot send or
    receive cannot take part in an all-reduce; leave it out of the participants).
    ``rtt_seconds`` is the peer's typical round trip to the other peers (0 if unknown).
    """

    peer_id: str
    up_bytes_per_s: float
    down_bytes_per_s: float
    rtt_seconds: float = 0.0


@dataclass(frozen=True)
class CollectivePlan:
    """The planner's answer. Indices refer to the ``links`` list given to `plan_collective`.

    ``order``: all participants in collective order (ring order for "ring"; for "tree", the
    recursive-doubling positions, slowest peers last so they are the ones folded in; identity for
    "butterfly"). ``shard_bounds``: element offsets ``[0, ..., num_elements]``, one shard per
    owner, possibly empty when ``num_elements`` is smaller than the number of owners.
    ``shard_owner[k]``: participant owning ``[shard_bounds[k], shard_bounds[k+1])``. For "ring",
    shard k is owned by ``order[k-1 mod p]`` (ring position i ends the reduce-scatter holding
    shard i+1, as `peer.collectives` runs it); for "tree" there is one shard, owned by ``order[0]`` (every
    peer computes the same sum; the owner matters only for aggregators other than a sum).
    ``predicted_seconds``: model time of the chosen algorithm. ``bound_seconds``: the lower bound
    of `allreduce_lower_bound` (no algorithm can beat it); ``floor_seconds``: the design notes' simple
    floor ``n / min_i min(u_i, d_i)`` (≤ bound). ``demoted``: participants that send and receive
    but own no shard because any shard would raise the time.
    """

    algorithm: str
    order: tuple[int, ...]
    shard_bounds: tuple[int, ...]
    shard_owner: tuple[int, ...]
    predicted_seconds: float
    bound_seconds: float
    demoted: tuple[int, ...]
    floor_seconds: float = 0.0
    overlap: bool = True

    def owner_positions(self) -> tuple[int, ...]:
        """``shard_owner`` as positions in ``order`` (the wire `Plan.shard_owner` convention,
        where participants are listed in collective order)."""
        pos = {idx: k for k, idx in enumerate(self.order)}
        return tuple(pos[o] for o in self.shard_owner)


# ---------------------------------------------------------------------------------------------
# helpers


def _as_rates(up: Sequence[float], down: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    u = np.asarray(up, dtype=np.float64).reshape(-1)
    d = np.asarray(down, dtype=np.float64).reshape(-1)
    if u.shape != d.shape:
        raise ValueError(f"up and down differ in length: {u.size} != {d.size}")
    if u.size == 0:
        raise ValueError("no participants")
    if not (np.all(np.isfinite(u)) and np.all(np.isfinite(d)) and np.all(u > 0) and np.all(d > 0)):
        raise ValueError("bandwidths must be finite and > 0; leave unreachable peers out")
    return u, d


def _alpha_matrix(rtt: Sequence[float] | None, p: int) -> np.ndarray:
    """One-way latency of each link i→j: (rtt_i + rtt_j) / 4."""
    if rtt is None:
        return np.zeros((p, p))
    r = np.asarray(rtt, dtype=np.float64).reshape(-1)
    if r.size != p or np.any(r < 0) or not np.all(np.isfinite(r)):
        raise ValueError("rtt must hold one finite, non-negative value per participant")
    a = r / 2.0
    return (a[:, None] + a[None, :]) / 2.0


def _link_bw(u: np.ndarray, d: np.ndarray, pairwise: np.ndarray | None) -> np.ndarray:
    """Bandwidth of each link i→j in bytes/s: min(u_i, d_j), further capped by a measured
    pairwise rate where one is known (non-finite or ≤ 0 entries mean "unknown")."""
    bw = np.minimum(u[:, None], d[None, :])
    if pairwise is not None:
        m = np.asarray(pairwise, dtype=np.float64)
        if m.shape != bw.shape:
            raise ValueError(f"pairwise must be {bw.shape}, got {m.shape}")
        known = np.isfinite(m) & (m > 0)
        bw = np.where(known, np.minimum(bw, np.where(known, m, np.inf)), bw)
    return bw


def _off_diagonal_max(a: np.ndarray) -> float:
    p = a.shape[0]
    if p < 2:
        return 0.0
    return float(np.max(a[~np.eye(p, dtype=bool)]))


# ---------------------------------------------------------------------------------------------
# bounds


def simple_floor(up: Sequence[float], down: Sequence[float], n_bytes: float) -> float:
    """the design notes' floor ``n / min_i min(u_i, d_i)`` (0 for a single participant)."""
    u, d = _as_rates(up, down)
    if u.size < 2:
        return 0.0
    return float(n_bytes / min(u.min(), d.min()))


def allreduce_lower_bound(up: Sequence[float], down: Sequence[float], n_bytes: float) -> float:
    """Lower bound on the time of any all-reduce of ``n_bytes`` over these links (seconds).

    ``max(n/min u, n/min d, 2(p-1)n/Σu, 2(p-1)n/Σd)``; 0 for ``p = 1``. Latency is ignored.

    Derivation (model: no compression, bytes are only ever combined by the reduction itself):

    * Cut around one peer *i*: the others' results depend on all of ``x_i``, so ``n`` bytes must
      leave *i* (``T ≥ n/u_i``); *i*'s result depends on all of the others' inputs, so ``n`` bytes
      must reach *i* (``T ≥ n/d_i``). This is the design notes' floor ``n / min_i min(u_i, d_i)``.
    * Whole system (Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms for clusters
      of workstations"): every element needs ``p-1`` transfers to combine the ``p`` inputs into one
      sum and ``p-1`` more to bring that sum to the other peers, ``2(p-1)n`` bytes in all. With
      equal links this is their ``2n(p-1)/p`` bytes per peer; with unequal links all uploads
      together run at most at ``Σ u_i`` and all downloads at ``Σ d_i``.

    The bound is tight for uniform links (ring and butterfly reach ``2(p-1)n/(pB)``) and, in the
    pipelined butterfly model, when one slow peer dominates (it is demoted and reaches the floor).
    Between those cases the butterfly LP optimum is the best *achievable* time in this model.
    """
    u, d = _as_rates(up, down)
    p = u.size
    if p < 2:
        return 0.0
    n = float(n_bytes)
    return float(max(n / u.min(), n / d.min(), 2 * (p - 1) * n / u.sum(), 2 * (p - 1) * n / d.sum()))


# ---------------------------------------------------------------------------------------------
# ring


def ring_link_seconds(
    up: Sequence[float],
    down: Sequence[float],
    segment_bytes: float,
    order: Sequence[int],
    rtt: Sequence[float] | None = None,
    *,
    pairwise: np.ndarray | None = None,
) -> np.ndarray:
    """Time of one ring step on each link ``order[k] → order[k+1]``: shape (p,), float64."""
    u, d = _as_rates(up, down)
    o = np.asarray(order, dtype=np.int64)
    nxt = np.roll(o, -1)
    bw = _link_bw(u, d, pairwise)[o, nxt]
    alpha = _alpha_matrix(rtt, u.size)[o, nxt]
    return alpha + segment_bytes / bw


def predict_ring(
    up: Sequence[float],
    down: Sequence[float],
    n_bytes: float,
    order: Sequence[int] | None = None,
    rtt: Sequence[float] | None = None,
    *,
    pairwise: np.ndarray | None = None,
) -> float:
    """Lock-step ring all-reduce: ``2(p-1) · max_i (α_{i,next} + (n/p)/min(u_i, d_next))``."""
    u, _ = _as_rates(up, down)
    p = u.size
    if p < 2:
        return 0.0
    order = range(p) if order is None else order
    _check_order(order, p)
    steps = ring_link_seconds(up, down, n_bytes / p, order, rtt, pairwise=pairwise)
    return float(2 * (p - 1) * steps.max())


def _check_order(order: Sequence[int], p: int) -> None:
    if sorted(order) != list(range(p)):
        raise ValueError(f"order must be a permutation of range({p}), got {tuple(order)}")


def _ring_cost(link_t: np.ndarray, orders: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(max, sum) of link times for each row of ``orders`` (shape (m, p))."""
    t = link_t[orders, np.roll(orders, -1, axis=1)]
    return t.max(axis=1), t.sum(axis=1)


def best_ring_order(
    up: Sequence[float],
    down: Sequence[float],
    *,
    rtt: Sequence[float] | None = None,
    segment_bytes: float = 0.0,
    pairwise: np.ndarray | None = None,
    exact_limit: int = _EXACT_RING_LIMIT,
) -> tuple[int, ...]:
    """The ring order that minimises the slowest link step, then the sum of link steps.

    A link i→j costs ``α_ij + segment_bytes / bw_ij`` (with ``segment_bytes = 0``, the default,
    ``1 / bw_ij``: pure bandwidth, i.e. maximise the bottleneck link). With only per-peer rates
    (``bw_ij = min(u_i, d_j)``) every ring has the same bottleneck ``min(min u, min d)``, because
    every peer sends once and receives once; the order then only matters through latency, a
    ``pairwise`` matrix of measured rates (PCCL's case), and the secondary sum. This is a
    bottleneck travelling-salesman problem: exact over all ``(p-1)!`` rings (first element fixed)
    for ``p ≤ exact_limit``, greedy construction + 2-opt / swap local search beyond (bounded
    number of passes). Deterministic; the returned tuple starts with 0.
    """
    u, d = _as_rates(up, down)
    p = u.size
    if p <= 2:
        return tuple(range(p))
    bw = _link_bw(u, d, pairwise)
    alpha = _alpha_matrix(rtt, p)
    link_t = alpha + (segment_bytes if segment_bytes > 0 else 1.0) / bw
    np.fill_diagonal(link_t, np.inf)
    if p <= exact_limit:
        rest = np.array(list(itertools.permutations(range(1, p))), dtype=np.int64)
        orders = np.hstack([np.zeros((rest.shape[0], 1), dtype=np.int64), rest])
        mx, sm = _ring_cost(link_t, orders)
        # Lexicographic (max, sum) with a relative tolerance on the max so float noise in equal
        # bottlenecks does not hide a better sum.
        best_max = mx.min()
        ok = mx <= best_max * (1 + 1e-12)
        idx = np.flatnonzero(ok)[np.argmin(sm[ok])]
        return tuple(int(x) for x in orders[idx])
    return _ring_local_search(link_t)


def _ring_local_search(link_t: np.ndarray, max_passes: int = 50) -> tuple[int, ...]:
    p = link_t.shape[0]

    def cost(o: list[int]) -> tuple[float, float]:
        t = link_t[o, o[1:] + o[:1]]
        return float(t.max()), float(t.sum())

    # Greedy: from 0, always continue over the cheapest link to an unvisited peer.
    order = [0]
    left = set(range(1, p))
    while left:
        last = order[-1]
        nxt = min(left, key=lambda j: (link_t[last, j], j))
        order.append(nxt)
        left.remove(nxt)
    best = cost(order)
    for _ in range(max_passes):
        improved = False
        for i in range(1, p - 1):
            for j in range(i + 1, p):
                for cand in (
                    order[:i] + order[i : j + 1][::-1] + order[j + 1 :],  # 2-opt reversal
                    order[:i] + [order[j]] + order[i + 1 : j] + [order[i]] + order[j + 1 :],  # swap
                ):
                    c = cost(cand)
                    if c[0] < best[0] * (1 - 1e-12) or (c[0] <= best[0] * (1 + 1e-12) and c[1] < best[1] * (1 - 1e-12)):
                        order, best, improved = cand, c, True
        if not improved:
            break
    return tuple(order)


# ---------------------------------------------------------------------------------------------
# butterfly


def predict_butterfly(
    up: Sequence[float],
    down: Sequence[float],
    n_bytes: float,
    fractions: Sequence[float] | None = None,
    rtt: Sequence[float] | None = None,
    *,
    overlap: bool = True,
    pairwise: np.ndarray | None = None,
) -> float:
    """Butterfly all-reduce time for shard ``fractions`` (default: equal), see the module doc.

    Phased: ``T_rs + T_ag + 2(p-1)α_max``; pipelined (``overlap``):
    ``max_i n(1+(p-2)w_i)/min(u_i,d_i) + 2(p-1)α_max``. With a ``pairwise`` matrix each flow
    i→j must also fit its link.
    """
    u, d = _as_rates(up, down)
    p = u.size
    if p < 2:
        return 0.0
    w = np.full(p, 1.0 / p) if fractions is None else np.asarray(fractions, dtype=np.float64)
    if w.shape != (p,) or np.any(w < -_FRACTION_EPS) or abs(w.sum() - 1.0) > 1e-6:
        raise ValueError("fractions must be p non-negative numbers summing to 1")
    n = float(n_bytes)
    lat = 2.0 * (p - 1) * _off_diagonal_max(_alpha_matrix(rtt, p))
    off = ~np.eye(p, dtype=bool)
    if pairwise is not None:
        bw = _link_bw(u, d, pairwise)
        flow_rs = np.where(off, n * w[None, :] / bw, 0.0)  # i sends its piece of shard j to j
        flow_ag = np.where(off, n * w[:, None] / bw, 0.0)  # owner i sends shard i to j
    else:
        flow_rs = flow_ag = np.zeros((p, p))
    if overlap:
        load = n * (1.0 + (p - 2) * w)
        t = max(float(np.max(load / u)), float(np.max(load / d)), float(np.max(flow_rs + flow_ag)))
        return t + lat
    t_rs = max(float(np.max(n * (1 - w) / u)), float(np.max(n * (p - 1) * w / d)), float(flow_rs.max()))
    t_ag = max(float(np.max(n * (p - 1) * w / u)), float(np.max(n * (1 - w) / d)), float(flow_ag.max()))
    return t_rs + t_ag + lat


def butterfly_fractions(
    up: Sequence[float],
    down: Sequence[float],
    *,
    overlap: bool = True,
    pairwise: np.ndarray | None = None,
) -> np.ndarray:
    """Optimal butterfly shard fractions: shape (p,), float64, ≥ 0, summing to 1.

    Phased (``overlap=False``), the design notes (§4) (n = 1 without loss of generality)::

        min T_rs + T_ag  s.t.  (1-w_i) ≤ T_rs·u_i,  (p-1)w_i ≤ T_rs·d_i,
                               (p-1)w_i ≤ T_ag·u_i,  (1-w_i) ≤ T_ag·d_i,   Σw = 1, w ≥ 0

    Pipelined (``overlap=True``; hivemind's ``load_balance_peers`` generalised to up ≠ down)::

        min T  s.t.  1 + (p-2)w_i ≤ T·min(u_i, d_i),  Σw = 1, w ≥ 0

    (with ``pairwise``, also ``w_j ≤ T_rs·bw_ij`` and ``w_i ≤ T_ag·bw_ij``, or their sum ≤ T·bw_ij).
    Solved with HiGHS. The optimum is rarely unique; among the optimal fractions we take
    ``w_i = clip(λ·min(u_i, d_i), lo_i, hi_i)``, where ``[lo_i, hi_i]`` is what peer i's
    constraints allow at the optimal times, so shards follow capacity as far as optimality
    allows, equal links give exactly equal shards, and the answer is deterministic (with
    ``pairwise``, the LP vertex is returned as is). Entries below
    1e-9 are set to 0 (those peers are demoted to non-owners). Raises ValueError on invalid rates
    and RuntimeError if HiGHS fails (it should not: the LP is always feasible and bounded).
    """
    u, d = _as_rates(up, down)
    p = u.size
    if p == 1:
        return np.ones(1)
    scale = max(u.max(), d.max())
    u, d = u / scale, d / scale  # keep the LP well-conditioned; T is then in units of n/scale
    bw = _link_bw(u, d, None if pairwise is None else np.asarray(pairwise, dtype=np.float64) / scale)
    off = [(i, j) for i in range(p) for j in range(p) if i != j] if pairwise is not None else []

    # Variables: w_0..w_{p-1}, then the time variables (phased: T_rs, T_ag; pipelined: T).
    nt = 1 if overlap else 2
    nv = p + nt
    rows: list[np.ndarray] = []
    rhs: list[float] = []

    def row(w_coef: dict[int, float], t_coef: dict[int, float], b: float) -> None:
        r = np.zeros(nv)
        for k, v in w_coef.items():
            r[k] += v
        for k, v in t_coef.items():
            r[p + k] += v
        rows.append(r)
        rhs.append(b)

    for i in range(p):
        if overlap:
            row({i: p - 2.0}, {0: -min(u[i], d[i])}, -1.0)  # 1 + (p-2)w_i ≤ T·min(u_i, d_i)
        else:
            row({i: -1.0}, {0: -u[i]}, -1.0)  # (1-w_i) ≤ T_rs·u_i
            row({i: p - 1.0}, {0: -d[i]}, 0.0)  # (p-1)w_i ≤ T_rs·d_i
            row({i: p - 1.0}, {1: -u[i]}, 0.0)  # (p-1)w_i ≤ T_ag·u_i
            row({i: -1.0}, {1: -d[i]}, -1.0)  # (1-w_i) ≤ T_ag·d_i
    for i, j in off:
        if overlap:
            row({j: 1.0, i: 1.0}, {0: -bw[i, j]}, 0.0)
        else:
            row({j: 1.0}, {0: -bw[i, j]}, 0.0)
            row({i: 1.0}, {1: -bw[i, j]}, 0.0)
    a_ub = np.array(rows)
    b_ub = np.array(rhs)
    a_eq = np.zeros((1, nv))
    a_eq[0, :p] = 1.0
    c = np.zeros(nv)
    c[p:] = 1.0
    bounds = [(0.0, 1.0)] * p + [(0.0, None)] * nt
    first = scipy.optimize.linprog(c, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=[1.0], bounds=bounds, method="highs")
    if first.status != 0:
        raise RuntimeError(f"butterfly LP failed: {first.message}")
    w_lp = np.clip(np.asarray(first.x[:p], dtype=np.float64), 0.0, 1.0)
    if pairwise is not None:
        w = w_lp
    else:
        # Second stage: the LP optimum is rarely unique (peers off the critical path have slack),
        # and a vertex puts the slack anywhere. With the times fixed at the optimum, each peer's
        # constraints reduce to a box lo_i ≤ w_i ≤ hi_i; fill it in proportion to the peer's
        # capacity min(u_i, d_i): w_i = clip(λ·c_i, lo_i, hi_i) with Σw = 1. Equal links give
        # exactly equal shards, and the answer does not depend on the solver's pivoting.
        slack = 1 + 1e-10
        if overlap:
            t = float(first.x[p]) * slack
            hi = np.minimum(1.0, (t * np.minimum(u, d) - 1.0) / (p - 2)) if p > 2 else np.ones(p)
            lo = np.zeros(p)
        else:
            t_rs, t_ag = float(first.x[p]) * slack, float(first.x[p + 1]) * slack
            lo = np.maximum.reduce([np.zeros(p), 1.0 - t_rs * u, 1.0 - t_ag * d])
            hi = np.minimum.reduce([np.ones(p), t_rs * d / (p - 1), t_ag * u / (p - 1)])
        w = _water_fill(np.minimum(u, d), lo, np.maximum(hi, lo))
        if abs(w.sum() - 1.0) > 1e-6:  # the boxes did not admit Σw = 1: trust the LP vertex
            w = w_lp
    w[w < _FRACTION_EPS] = 0.0
    return w / w.sum()


def _water_fill(weight: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """``clip(λ·weight, lo, hi)`` with λ chosen so the sum is 1 (bisection; sum is monotone)."""
    lam_lo, lam_hi = 0.0, 1.0
    while np.clip(lam_hi * weight, lo, hi).sum() < 1.0 and lam_hi < 1e300:
        lam_hi *= 2.0
    for _ in range(200):
        mid = (lam_lo + lam_hi) / 2
        if np.clip(mid * weight, lo, hi).sum() < 1.0:
            lam_lo = mid
        else:
            lam_hi = mid
    w = np.clip(lam_hi * weight, lo, hi)
    return w / w.sum() if abs(w.sum() - 1.0) < 1e-6 else w


def shard_bounds_from_fractions(fractions: Sequence[float], num_elements: int) -> tuple[int, ...]:
    """Element offsets ``(0, ..., num_elements)`` for consecutive shards of these fractions.

    Largest-remainder rounding (ties to the lower index): counts sum to ``num_elements`` exactly,
    zero fractions stay empty, and shards may be empty when ``num_elements`` is small.
    """
    w = np.asarray(fractions, dtype=np.float64)
    if num_elements < 0:
        raise ValueError("num_elements must be ≥ 0")
    if w.size == 0:
        raise ValueError("no shards")
    w = w / w.sum()
    exact = w * num_elements
    counts = np.floor(exact).astype(np.int64)
    short = int(num_elements - counts.sum())
    if short > 0:
        rem = np.where(w > 0, exact - counts, -1.0)
        for k in sorted(range(w.size), key=lambda k: (-rem[k], k))[:short]:
            counts[k] += 1
    return (0, *(int(x) for x in np.cumsum(counts)))


# ---------------------------------------------------------------------------------------------
# tree / recursive doubling


def _tree_pairs(p: int) -> list[list[tuple[int, int]]]:
    """Per step, the (sender, receiver) position pairs of recursive doubling with fold-in."""
    q = 1 << (p.bit_length() - 1)  # largest power of two ≤ p
    steps: list[list[tuple[int, int]]] = []
    extras = list(range(q, p))
    if extras:
        steps.append([(k, k - q) for k in extras])
    s = 1
    while s < q:
        steps.append([(k, k ^ s) for k in range(q)])  # both directions appear
        s <<= 1
    if extras:
        steps.append([(k - q, k) for k in extras])
    return steps


def predict_tree(
    up: Sequence[float],
    down: Sequence[float],
    n_bytes: float,
    order: Sequence[int] | None = None,
    rtt: Sequence[float] | None = None,
    *,
    pairwise: np.ndarray | None = None,
) -> float:
    """Recursive doubling: each step exchanges the whole ``n`` bytes between partners.

    ``Σ_steps max_{(a→b) in step} (α_ab + n / bw_ab)`` over ``⌈log2 p⌉`` steps, plus a fold-in
    step (positions ≥ 2^⌊log2 p⌋ send to a partner) and a fold-out step when p is not a power of
    two. Positions are taken in ``order`` (default identity).
    """
    u, d = _as_rates(up, down)
    p = u.size
    if p < 2:
        return 0.0
    o = list(range(p)) if order is None else list(order)
    _check_order(o, p)
    bw = _link_bw(u, d, pairwise)
    alpha = _alpha_matrix(rtt, p)
    n = float(n_bytes)
    total = 0.0
    for step in _tree_pairs(p):
        total += max(alpha[o[a], o[b]] + n / bw[o[a], o[b]] for a, b in step)
    return float(total)


# ---------------------------------------------------------------------------------------------
# the plan


def plan_collective(
    links: Sequence[LinkSpec],
    num_elements: int,
    itemsize: int = 4,
    *,
    algorithm: str | None = None,
    latency_threshold_bytes: int = 256 * 1024,
    overlap: bool = True,
    pairwise: np.ndarray | None = None,
    algorithms: Sequence[str] = ALGORITHMS,
) -> CollectivePlan:
    """Choose and shape the all-reduce for these participants.

    ``algorithm=None`` picks the smallest predicted time among butterfly and ring, and also tree
    when the payload ``num_elements * itemsize`` is at most ``latency_threshold_bytes``; ties go to
    butterfly, then ring, then tree (owners make robust aggregators possible). ``algorithms``
    limits the automatic choice to what the data plane implements (pass ``("butterfly", "ring")``
    while it has no tree). A given ``algorithm`` is planned as asked. ``overlap`` selects the butterfly cost model (see the
    module doc) and must match the data plane. ``pairwise`` (p×p bytes/s, i→j; NaN or ≤ 0 =
    unknown) refines the link rates. Raises ValueError for an empty participant list, invalid
    rates, negative sizes or an unknown algorithm; never returns a partial plan.
    """
    if algorithm is not None and algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; expected one of {ALGORITHMS}")
    if num_elements < 0 or itemsize <= 0:
        raise ValueError("num_elements must be ≥ 0 and itemsize > 0")
    up = [l.up_bytes_per_s for l in links]
    down = [l.down_bytes_per_s for l in links]
    u, d = _as_rates(up, down)
    rtt = [l.rtt_seconds for l in links]
    p = u.size
    n_bytes = float(num_elements) * itemsize
    bound = allreduce_lower_bound(u, d, n_bytes)
    floor = simple_floor(u, d, n_bytes)

    if p == 1:
        return CollectivePlan(
            algorithm=algorithm or "butterfly",
            order=(0,),
            shard_bounds=(0, num_elements),
            shard_owner=(0,),
            predicted_seconds=0.0,
            bound_seconds=0.0,
            demoted=(),
            floor_seconds=0.0,
            overlap=overlap,
        )

    allowed = tuple(algorithms)
    if not allowed or any(a not in ALGORITHMS for a in allowed):
        raise ValueError(f"algorithms must be a non-empty subset of {ALGORITHMS}, got {allowed}")
    candidates = [algorithm] if algorithm else [
        a for a in ALGORITHMS if a in allowed and (a != "tree" or n_bytes <= latency_threshold_bytes)
    ] or [a for a in ALGORITHMS if a in allowed]
    plans: list[CollectivePlan] = []
    for alg in candidates:
        if alg == "butterfly":
            w = butterfly_fractions(u, d, overlap=overlap, pairwise=pairwise)
            owners = [i for i in range(p) if w[i] > 0]
            bounds = shard_bounds_from_fractions(w[owners], num_elements)
            # Predict with the rounded shards actually published.
            w_real = np.zeros(p)
            if num_elements > 0:
                w_real[owners] = np.diff(bounds) / num_elements
            else:
                w_real[owners] = w[owners]
            t = predict_butterfly(u, d, n_bytes, w_real, rtt, overlap=overlap, pairwise=pairwise)
            plans.append(
                CollectivePlan(
                    "butterfly",
                    tuple(range(p)),
                    bounds,
                    tuple(owners),
                    t,
                    bound,
                    tuple(i for i in range(p) if w[i] == 0),
                    floor,
                    overlap,
                )
            )
        elif alg == "ring":
            order = best_ring_order(u, d, rtt=rtt, segment_bytes=n_bytes / p, pairwise=pairwise)
            t = predict_ring(u, d, n_bytes, order, rtt, pairwise=pairwise)
            bounds = shard_bounds_from_fractions(np.full(p, 1.0 / p), num_elements)
            # Position k finishes the reduce-scatter holding shard k+1 (peer.collectives' ring
            # sends its own shard first), so shard k belongs to position k-1.
            owners = tuple(order[(k - 1) % p] for k in range(p))
            plans.append(CollectivePlan("ring", order, bounds, owners, t, bound, (), floor, overlap))
        else:
            # Fastest peers take the power-of-two core; the slowest are folded in.
            order = tuple(sorted(range(p), key=lambda i: (-min(u[i], d[i]), i)))
            t = predict_tree(u, d, n_bytes, order, rtt, pairwise=pairwise)
            plans.append(CollectivePlan("tree", order, (0, num_elements), (order[0],), t, bound, (), floor, overlap))

    best = plans[0]
    for cand in plans[1:]:
        if cand.predicted_seconds < best.predicted_seconds * (1 - 1e-9):
            best = cand
    if not math.isfinite(best.predicted_seconds):
        raise ValueError("no finite plan")
    return best
