"""Round planning: which collective to run, in which order, with which tensor shards and chunks.

This module is the pure core of round planning (docs/concepts.md, "Bandwidth and the lower bound"); it opens no sockets,
reads no clocks and keeps no state. Two levels:

* The model: given one `LinkSpec` per participant (upload and download bandwidth in bytes/s and
  a typical round-trip time) and the size of the tensor, `plan_collective` shapes one collective
  ("butterfly" or "ring", `shoal.common.plan.COLLECTIVES`): participant order, shard bounds and
  owners, and the time it predicts under an α-β cost model with asymmetric links.
* The sparse collectives: with a sparse compression each peer either sends its whole sparse
  contribution to every other (the sparse all-gather, "allgather", `predict_allgather`) or sends
  each index range's part to that range's shard owner, which sends the merged range back as
  float32 (the sparse reduce-scatter, "sparse_rs", `predict_sparse_rs`); `plan_round` takes the
  all-gather unless the sparse reduce-scatter or the dense all-reduce is predicted clearly faster.
* The policy: `plan_round` is what the coordinator's round engine calls when a round opens. From
  the participants' *reported* links (noisy, partly unmeasured) and a `PlanPolicy` (the
  coordinator's settings) it decides the collective ("auto": butterfly or ring, whichever the
  model predicts clearly faster), damps measurement noise, keeps untrusted peers from owning
  shards, sizes the chunks and their deadline, and returns the `shoal.common.plan.Plan` that goes
  on the wire, or a `NoPlan` that says why no round can be planned.

Measuring links, choosing the participants and stamping the plan with its round, attempt and
deadline belong to the round engine (`shoal.coordinator.rounds`), not here.

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

  - phased (``overlap=False``; the LP of docs/concepts.md, literally): the all-gather starts after the
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

There is no tree / recursive doubling: the data plane runs only the butterfly and the ring, and a
planner path that production never takes would be a model nobody checks.

Lower bound
-----------
Without compression and when bytes are only combined by the reduction (no network coding), every
all-reduce obeys (derivation in `allreduce_lower_bound`)::

    T ≥ max( n / min_i u_i,  n / min_i d_i,  2(p-1)n / Σ_i u_i,  2(p-1)n / Σ_i d_i )

The first two terms are the floor ``n / min_i min(u_i, d_i)`` (every peer must send its
whole input and receive the whole result at least once); the last two are Patarasuk & Yuan's
``2(p-1)/p · n`` bytes per peer, generalised to unequal links by summing over peers. The
pipelined butterfly with a non-owner slowest peer reaches the floor; with uniform links, ring and
butterfly reach the ``2(p-1)n/(p·B)`` term.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import types
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import numpy as np

from shoal.common.plan import COLLECTIVES, SPARSE_COLLECTIVES, Plan, sparse_shard_bounds
from shoal.coordinator.settings import DEFAULTS as ROUND_DEFAULTS


def load_solver() -> types.ModuleType:
    """scipy.optimize, imported on first use: the import takes ~0.5 s of CPU, which every
    process that only parses the command line (`shoal --help`, `shoal peer`, the bench's parser)
    paid at start. The coordinator calls this before it serves (coordinator.daemon.serve), so
    no round's planning waits for the import."""
    import scipy.optimize

    return scipy.optimize

__all__ = [
    "CHUNK_SECONDS",
    "CPU_BOUND_LINK_BYTES_PER_S",
    "ITEMSIZE",
    "MIN_CHUNK_BYTES",
    "LinkSpec",
    "NoPlan",
    "PlanPolicy",
    "allreduce_lower_bound",
    "best_ring_order",
    "butterfly_fractions",
    "attempt_deadline",
    "chunk_deadline",
    "conservative_seconds",
    "deadline_links",
    "eligible_fractions",
    "plan_collective",
    "plan_layout",
    "plan_round",
    "control_seconds",
    "predict_allgather",
    "predict_sparse_rs",
    "predict_butterfly",
    "predict_ring",
    "ring_link_seconds",
    "shard_bounds_from_fractions",
    "simple_floor",
    "setup_seconds",
    "sparse_payload_bytes",
    "without_outbound_owners",
    "without_untrusted_owners",
]

# Fractions below this are treated as zero (LP solvers return 1e-17 noise instead of 0).
_FRACTION_EPS = 1e-9
# Permutations are enumerated exactly up to this many participants ((p-1)! orders).
_EXACT_RING_LIMIT = 8


@dataclass(frozen=True)
class LinkSpec:
    """What the planner knows about one participant's access link.

    ``up_bytes_per_s``/``down_bytes_per_s``: for `plan_collective`, finite and > 0 (a peer that
    cannot send or receive cannot take part in an all-reduce; leave it out of the participants);
    for `plan_round`, as reported (0, NaN or negative = not measured yet).
    ``rtt_seconds`` is the peer's typical round trip to the other peers (0 if unknown).
    ``shm_peers``: the participants it reaches through shared memory (same host);
    ``bulk_peers``: those it reaches through the bulk TCP lane (peer.lanes.bulk).
    """

    peer_id: str
    up_bytes_per_s: float
    down_bytes_per_s: float
    rtt_seconds: float = 0.0
    shm_peers: frozenset[str] = frozenset()
    bulk_peers: frozenset[str] = frozenset()

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
    """the floor ``n / min_i min(u_i, d_i)`` (0 for a single participant)."""
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
      must reach *i* (``T ≥ n/d_i``). This is the floor ``n / min_i min(u_i, d_i)``.
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


def control_seconds(coordinator_rtts: Sequence[float], *, secure: bool = False) -> float:
    """The control plane's share of an attempt as the coordinator times it (seconds): the plan
    reaches the farthest participant half a round trip after it leaves, and that participant's
    vote comes back half a round trip after its collective ends, so ``max_i rtt_i`` from the
    participants' round trips to the coordinator (0 = not measured, left out). A secure attempt
    (SecAgg+) adds its two relayed phases, shares and reveals, each a post and a fetch: about
    two round trips of the farthest participant each, ``4 · max_i rtt_i`` more."""
    known = [r for r in coordinator_rtts if r > 0 and math.isfinite(r)]
    if not known:
        return 0.0
    return max(known) * (5.0 if secure else 1.0)


SETUP_ROUND_TRIPS = 6
"""Round trips before the first byte between two peers with no warm connection: the gRPC channel
(TCP handshake, TLS 1.3 handshake, HTTP/2 settings), the Probe that asks for the bulk port, and
the bulk connection (TCP and TLS handshakes). A peer warms its connections to the participants
of its last plan before each Ready (`Transport.probe_lanes`), so only new pairs pay it."""


def setup_seconds(rtts: Sequence[tuple[float, float]]) -> float:
    """The connection set-up an attempt adds for its cold pairs (seconds): SETUP_ROUND_TRIPS of
    the longest pair round trip among them, each pair's estimated as the mean of its two peers'
    typical round trips (`LinkSpec.rtt_seconds`; pairs with an unmeasured side are left out)."""
    known = [(a + b) / 2.0 for a, b in rtts if a > 0 and b > 0 and math.isfinite(a + b)]
    return SETUP_ROUND_TRIPS * max(known) if known else 0.0


def predict_allgather(
    up: Sequence[float],
    down: Sequence[float],
    payload_bytes: float,
    rtt: Sequence[float] | None = None,
) -> float:
    """Sparse all-gather time (the "allgather" collective): every peer sends its whole payload of
    ``S = payload_bytes`` to each of the ``p-1`` others and receives theirs, all flows at once
    (fluid model, as the butterfly): ``T = max_i (p-1)·S / min(u_i, d_i) + (p-1)·α_max``.
    Nothing is reduced on the way, so the bytes per peer grow with p (``(p-1)·S`` up and down)
    where a dense all-reduce's stay near ``2n``: past some p the dense one wins (`plan_round`).
    """
    u, d = _as_rates(up, down)
    p = u.size
    if p < 2:
        return 0.0
    load = (p - 1) * float(payload_bytes)
    return max(float(np.max(load / u)), float(np.max(load / d))) + (p - 1) * _off_diagonal_max(_alpha_matrix(rtt, p))


def predict_sparse_rs(
    up: Sequence[float],
    down: Sequence[float],
    payload_bytes: float,
    num_elements: int,
    rtt: Sequence[float] | None = None,
) -> float:
    """Sparse reduce-scatter time (the "sparse_rs" collective), equal shards of whole codec chunks.

    Reduce-scatter: each peer sends its sparse payload of every other owner's range to that
    owner, ``(p-1)/p·S`` up (``S = payload_bytes``), and receives the other p-1 peers' payloads
    of its own range, ``(p-1)·S/p`` down. All-gather: each owner sends its merged range, float32,
    to the p-1 others, ``(p-1)·4n/p`` up (``n = num_elements``), and receives the other ranges,
    ``(p-1)/p·4n`` down. Phased, fluid model as the butterfly's (all flows of a phase at once,
    sharing each peer's upload and download):
    ``T = max_i (p-1)/p·S / min(u_i, d_i) + max_i (p-1)/p·4n / min(u_i, d_i) + 2(p-1)·α_max``.
    Per peer ``(p-1)/p·(S + 4n)`` each way, against the all-gather's ``(p-1)·S``: it is faster
    once ``p - 1 > (S + 4n)/S``, about ``4 / b`` peers for b bytes per element of a payload
    (~215 at 0.0186 B/element: chunks of 1,024, 10 kept, 2 bits), and it never moves more than
    a dense float32 all-reduce's ``2·(p-1)/p·4n``. 0 for fewer than two peers.
    """
    u, d = _as_rates(up, down)
    p = u.size
    if p < 2:
        return 0.0
    def phase(load: float) -> float:  # every peer moves `load` bytes up and as many down
        return max(float(np.max(load / u)), float(np.max(load / d)))

    rs = (p - 1) / p * float(payload_bytes)
    ag = (p - 1) / p * 4.0 * float(num_elements)
    return phase(rs) + phase(ag) + 2 * (p - 1) * _off_diagonal_max(_alpha_matrix(rtt, p))


def sparse_payload_bytes(num_elements: int, bytes_per_element: float) -> float:
    """Bytes of one sparse contribution of `num_elements` elements at `bytes_per_element`
    (peer.sparse's limit for large n) plus its 20-byte header."""
    return num_elements * bytes_per_element + 20.0


def butterfly_fractions(
    up: Sequence[float],
    down: Sequence[float],
    *,
    overlap: bool = True,
    pairwise: np.ndarray | None = None,
) -> np.ndarray:
    """Optimal butterfly shard fractions: shape (p,), float64, ≥ 0, summing to 1.

    Phased (``overlap=False``), the LP of docs/concepts.md (n = 1 without loss of generality)::

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
    first = load_solver().linprog(c, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=[1.0], bounds=bounds, method="highs")
    if first.status != 0:
        raise RuntimeError(f"butterfly LP failed: {first.message}")
    w_lp = np.clip(np.asarray(first.x[:p], dtype=np.float64), 0.0, 1.0)
    w = w_lp if pairwise is not None else _spread_slack(w_lp, first.x[p:], u, d, overlap=overlap)
    w[w < _FRACTION_EPS] = 0.0
    return w / w.sum()


def _spread_slack(w_lp: np.ndarray, times: np.ndarray, u: np.ndarray, d: np.ndarray, *,
                  overlap: bool) -> np.ndarray:
    """`butterfly_fractions`' second stage: the LP optimum is rarely unique (peers off the
    critical path have slack), and a vertex `w_lp` puts the slack anywhere. With the optimal
    `times` fixed (pipelined: T; phased: T_rs, T_ag), each peer's constraints reduce to a box
    lo_i ≤ w_i ≤ hi_i; fill it in proportion to the peer's capacity min(u_i, d_i):
    w_i = clip(λ·c_i, lo_i, hi_i) with Σw = 1. Equal links give exactly equal shards, and the
    answer does not depend on the solver's pivoting. Falls back to `w_lp` when the boxes do not
    admit Σw = 1. Shape (p,), float64."""
    p = u.size
    slack = 1 + 1e-10
    if overlap:
        t = float(times[0]) * slack
        hi = np.minimum(1.0, (t * np.minimum(u, d) - 1.0) / (p - 2)) if p > 2 else np.ones(p)
        lo = np.zeros(p)
    else:
        t_rs, t_ag = float(times[0]) * slack, float(times[1]) * slack
        lo = np.maximum.reduce([np.zeros(p), 1.0 - t_rs * u, 1.0 - t_ag * d])
        hi = np.minimum.reduce([np.ones(p), t_rs * d / (p - 1), t_ag * u / (p - 1)])
    w = _water_fill(np.minimum(u, d), lo, np.maximum(hi, lo))
    return w_lp if abs(w.sum() - 1.0) > 1e-6 else w


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
# one collective


def plan_collective(
    links: Sequence[LinkSpec],
    num_elements: int,
    itemsize: int = 4,
    *,
    collective: str = "butterfly",
    overlap: bool = True,
    pairwise: np.ndarray | None = None,
) -> Plan:
    """Shape the all-reduce `collective` ("butterfly" | "ring") for these participants.

    Returns a `shoal.common.plan.Plan` with ``participants`` (the links' peer ids) in collective
    order: the bottleneck-optimal ring order (`best_ring_order`) for "ring", the given order for
    "butterfly". ``shard_bounds``: element offsets ``(0, ..., num_elements)``, one tensor shard
    per owner, possibly empty when ``num_elements`` is smaller than the number of owners.
    ``shard_owner[k]``: the *position* in ``participants`` of the owner of shard k. For "ring",
    shard k is owned by position k-1 (mod p): position i ends the reduce-scatter holding shard
    i+1, as `shoal.peer.collectives` runs it. For "butterfly", the owners are the peers with a
    non-zero LP fraction (`butterfly_fractions`); ``demoted`` lists the others (peer ids): they
    send and receive but own no shard because any shard would raise the time.
    ``predicted_seconds``: model time (with the rounded shards actually published);
    ``bound_seconds``: `allreduce_lower_bound` (no collective can beat it); ``floor_seconds``: the
    floor ``n / min_i min(u_i, d_i)`` (≤ bound). Every other field keeps `Plan`'s
    default (the round engine stamps them).

    ``overlap`` selects the butterfly cost model (see the module doc) and must match the data
    plane. ``pairwise`` (p×p bytes/s, i→j; NaN or ≤ 0 = unknown) refines the link rates. Raises
    ValueError for an empty participant list, invalid rates, negative sizes or an unknown
    collective; RuntimeError when the LP solver fails; never returns a partial plan.
    """
    if collective not in COLLECTIVES or collective in SPARSE_COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; expected butterfly or ring (the sparse collectives: "
                         "plan_round)")
    if num_elements < 0 or itemsize <= 0:
        raise ValueError("num_elements must be ≥ 0 and itemsize > 0")
    u, d = _as_rates([l.up_bytes_per_s for l in links], [l.down_bytes_per_s for l in links])
    ids = tuple(l.peer_id for l in links)
    rtt = [l.rtt_seconds for l in links]
    p = u.size
    if p == 1:
        return Plan(ids, collective, (0, num_elements), (0,), num_elements=num_elements)
    n_bytes = float(num_elements) * itemsize
    model = dict(num_elements=num_elements, bound_seconds=allreduce_lower_bound(u, d, n_bytes),
                 floor_seconds=simple_floor(u, d, n_bytes))
    if collective == "butterfly":
        w = butterfly_fractions(u, d, overlap=overlap, pairwise=pairwise)
        owners = [i for i in range(p) if w[i] > 0]
        bounds = shard_bounds_from_fractions(w[owners], num_elements)
        # Predict with the rounded shards actually published.
        w_real = np.zeros(p)
        w_real[owners] = np.diff(bounds) / num_elements if num_elements > 0 else w[owners]
        t = predict_butterfly(u, d, n_bytes, w_real, rtt, overlap=overlap, pairwise=pairwise)
        plan = Plan(ids, "butterfly", bounds, tuple(owners), predicted_seconds=t,
                    demoted=tuple(ids[i] for i in range(p) if w[i] == 0), **model)
    else:
        order = best_ring_order(u, d, rtt=rtt, segment_bytes=n_bytes / p, pairwise=pairwise)
        t = predict_ring(u, d, n_bytes, order, rtt, pairwise=pairwise)
        bounds = shard_bounds_from_fractions(np.full(p, 1.0 / p), num_elements)
        # Position k finishes the reduce-scatter holding shard k+1 (the data plane's ring sends
        # its own shard first), so shard k belongs to position k-1.
        plan = Plan(tuple(ids[i] for i in order), "ring", bounds, tuple((k - 1) % p for k in range(p)),
                    predicted_seconds=t, **model)
    if not math.isfinite(plan.predicted_seconds):
        raise ValueError("no finite plan")
    return plan


# ---------------------------------------------------------------------------------------------
# the coordinator's policy: reported links in, the wire plan out

# Bytes per element of each shoal.v1.DType code (FLOAT32, FLOAT16, BFLOAT16, INT8, FLOAT64, UINT8).
ITEMSIZE = {1: 4, 2: 2, 3: 2, 4: 1, 5: 8, 6: 1}
# A chunk should cross the slowest link in about this long: the pipeline fills and drains one
# chunk per hop, so big chunks on a slow link leave the other links idle at the start and end.
CHUNK_SECONDS = 0.15
MIN_CHUNK_BYTES = 64 * 1024
# On a path whose bandwidth-delay product exceeds a chunk, a shard's stream is cut into at least
# this many chunks (`pipelined_chunk_bytes`): the bulk lane's largest connection pool (16,
# peer.lanes.pool) and a stream's send queue (16 chunks) each need that many to fill the path.
PIPELINE_CHUNKS = 16
# Between hosts, links whose slowest measured rate reaches this (bytes/s, 1.4 Gbit/s) leave the
# peers' CPU, not the wire, as the limit: there the butterfly's parallel streams are kept over
# the ring, whose every hop's processing delay is on the critical path (docs/performance.md:
# at 10 Gbit/s on the bulk lane). Measured 1 Gbit/s links read 40-150 MB/s at their slowest
# (a line rate of 125 MB/s, tbf's burst above it); 10 Gbit/s ones 300 MB/s and more on a fast
# 2-core machine, 196-292 MB/s on a slower one, where the probes read the CPU, not the wire,
# and the ring's own streams read the lowest (so 250 MB/s kept that machine on the ring, at
# 0.47-0.49 s per 64 MB round against 0.34-0.37 s for the butterfly).
CPU_BOUND_LINK_BYTES_PER_S = 175e6
# What a participant that never reported its links is assumed to reach (4 Mbit/s, a slow home
# link): deadlines derive from this until it is measured, so a slow first round is not cut short.
ASSUMED_LINK_BYTES_PER_S = 0.5e6
# Deadlines of a round that keeps timing out grow by at most this factor (`chunk_deadline`'s scale).
MAX_DEADLINE_SCALE = 8.0
# Aggregators that are a plain (weighted) mean: any collective can compute them; every other one
# runs at the shard owners (the butterfly).
_MEAN_AGGREGATORS = ("mean",)
# Compressions whose payload is a whole sparse contribution (peer.sparse): the sparse all-gather.
SPARSE_COMPRESSIONS = ("topk", "dct")
# Seconds per element a peer may spend encoding (or decoding and summing) a sparse contribution,
# for deadlines: ~3x the 37 ns/element "topk" encodes on one core of the 2-core development
# machine (scripts/sparse_codec_speed.py --sizes 1e7).
SPARSE_CODEC_SECONDS_PER_ELEMENT = 1e-7


@dataclass(frozen=True)
class PlanPolicy:
    """The coordinator's planning settings (`shoal.coordinator.rounds.EngineConfig.plan_policy`
    fills every field of the same name; the [rounds] ones default to `RoundSettings`').

    collective: "auto" (the model's choice, see `plan_layout`), "ring", "butterfly", or "sparse_rs" (below).
    aggregator, compression: what the plan's shard owners compute and how chunks are encoded; an
        aggregator other than the plain mean runs at the shard owners, which forces the butterfly.
    audit_owners: a second owner recomputes every shard's aggregate (butterfly only; forces it).
    link_cap_bytes_per_s: rates above this (bytes/s) count as this (faster than the data plane moves bytes).
    plan_min_gain: uneven shards (or the butterfly over the ring) only when predicted this fraction faster.
    noise: rates within this factor of the median count as the median.
    chunk_bytes: the largest chunk through sockets, bytes; shm_chunk_bytes: the chunk when every
        participant reaches every other through shared memory (one host); bulk_chunk_bytes: the
        largest chunk when every participant reaches every other through the bulk TCP lane or
        shared memory (in place of chunk_bytes: `plan_round`).
    chunk_timeout: floor of the per-chunk deadline, seconds; chunk_safety: its factor over the
        chunk's transfer time on the slowest link (`chunk_deadline`).
    assumed_link: bytes/s assumed for a participant that has not reported its links (a slow
        home link: deadlines must hold on it; `chunk_deadline`). Never used to lay out a plan.
    collective_timeout: the least deadline of one attempt, seconds (`attempt_deadline`).
    sparse_bytes_per_element: with a sparse compression ("topk", "dct"), the bytes per element of
        one peer's payload (peer.sparse `SparseCodec.bytes_per_element()`): the sparse collectives' model.
    sparse_chunk: the sparse codec's chunk C (elements): the sparse reduce-scatter's shards are
        whole chunks (`shoal.common.plan.sparse_shard_bounds`); 0 = unknown, no "sparse_rs" plan.
    With a sparse compression, collective "sparse_rs" forces the sparse reduce-scatter whenever
    it can be planned (every participant trusted and dialable); any other value lets the model
    choose among the sparse all-gather, the sparse reduce-scatter and the dense all-reduce.
    """

    collective: str = ROUND_DEFAULTS.collective
    aggregator: str = "mean"
    compression: str = "none"
    audit_owners: bool = False
    link_cap_bytes_per_s: float = 100e6
    plan_min_gain: float = 0.25
    noise: float = 1.5
    chunk_bytes: int = ROUND_DEFAULTS.chunk_bytes
    shm_chunk_bytes: int = ROUND_DEFAULTS.shm_chunk_bytes
    bulk_chunk_bytes: int = ROUND_DEFAULTS.bulk_chunk_bytes
    chunk_timeout: float = ROUND_DEFAULTS.chunk_timeout
    chunk_safety: float = ROUND_DEFAULTS.chunk_safety
    assumed_link: float = ASSUMED_LINK_BYTES_PER_S
    collective_timeout: float = ROUND_DEFAULTS.collective_timeout
    sparse_bytes_per_element: float = 0.0
    sparse_chunk: int = 0

    @property
    def sparse(self) -> bool:
        """Whether the run's compression is a sparse codec (sent to every peer by the sparse all-gather)."""
        return self.compression in SPARSE_COMPRESSIONS

    @property
    def owner_reduces(self) -> bool:
        """Whether every contribution must reach a shard owner (robust aggregator or audit)."""
        return self.aggregator not in _MEAN_AGGREGATORS or self.audit_owners


@dataclass(frozen=True)
class NoPlan:
    """Why `plan_round` cannot plan a round for these participants (a sentence for operators)."""

    reason: str


def _denoised(links: Sequence[LinkSpec], cap: float, noise: float) -> list[LinkSpec] | None:
    """The links as the model should see them, or None when none is measured (up and down > 0).

    A link without a measurement gets the median of the measured ones; rates above `cap` count
    as `cap`; rates within a factor `noise` of the median count as the median (probes of peers
    probing each other at the same time share links, so small differences are noise).
    """
    known = [l for l in links if l.up_bytes_per_s > 0 and l.down_bytes_per_s > 0]
    if not known:
        return None
    measured = {l.peer_id for l in known}
    med_up = sorted(l.up_bytes_per_s for l in known)[len(known) // 2]
    med_down = sorted(l.down_bytes_per_s for l in known)[len(known) // 2]
    rtts = sorted(l.rtt_seconds for l in known if l.rtt_seconds > 0)
    med_rtt = rtts[len(rtts) // 2] if rtts else 0.0

    def denoise(rate: float, median: float) -> float:
        rate = min(cap, rate)
        return min(cap, median) if median / noise <= rate <= median * noise else rate

    return [
        LinkSpec(l.peer_id, denoise(l.up_bytes_per_s if l.peer_id in measured else med_up, med_up),
                 denoise(l.down_bytes_per_s if l.peer_id in measured else med_down, med_down),
                 l.rtt_seconds if l.rtt_seconds > 0 else med_rtt)
        for l in links
    ]


def plan_layout(links: Sequence[LinkSpec], num_elements: int, itemsize: int = 4,
                policy: PlanPolicy = PlanPolicy()) -> Plan:
    """Lay out a collective over `links` (the participants, in the engine's order) as reported.

    With no measured link among them, the layout is static: the given order, equal shards
    ``n·i//p``, participant i owns shard i, "auto" means butterfly, chunks of
    `policy.chunk_bytes`. Otherwise the links, denoised (`_denoised`), go to `plan_collective`:
    "ring"/"butterfly" keep the collective and plan its order and shards; "auto" takes the
    butterfly with LP shards when it is predicted `plan_min_gain` faster than the ring ordered for
    the bottleneck, else that ring (or, when every link is at `link_cap_bytes_per_s` and the CPU is
    the limit, `_cpu_bound`, the butterfly with equal shards); peers below the floor are demoted to
    non-owners. Uneven butterfly shards are used only when predicted `plan_min_gain` faster than
    equal ones on the same links. A planned layout's
    chunk is what the slowest link carries in CHUNK_SECONDS (at least MIN_CHUNK_BYTES, at most
    `policy.chunk_bytes`).

    `policy.owner_reduces` forces the butterfly, the only collective with owner-side reduction.
    Never raises for bad measurements: it falls back to the static layout.
    """
    collective = "butterfly" if policy.owner_reduces else policy.collective
    ids = tuple(l.peer_id for l in links)
    p = len(ids)
    static = Plan(ids, "butterfly" if collective == "auto" else collective,
                  tuple(num_elements * i // p for i in range(p + 1)), tuple(range(p)),
                  num_elements=num_elements, chunk_bytes=policy.chunk_bytes)
    model = _denoised(links, policy.link_cap_bytes_per_s, policy.noise) if p >= 2 else None
    if model is None:
        return static
    up, down = [l.up_bytes_per_s for l in model], [l.down_bytes_per_s for l in model]
    n_bytes = float(num_elements) * itemsize
    try:
        plan = _model_choice(model, num_elements, itemsize, collective, policy, static.shard_bounds,
                             cpu_bound=_cpu_bound(links))
        if plan is None:  # the butterfly, and uneven shards are not worth it: equal ones
            return dataclasses.replace(
                static, collective="butterfly", bound_seconds=allreduce_lower_bound(up, down, n_bytes),
                predicted_seconds=predict_butterfly(up, down, n_bytes, None, [l.rtt_seconds for l in model]))
    except (ValueError, RuntimeError):
        return static
    slowest = min(min(l.up_bytes_per_s, l.down_bytes_per_s) for l in model)
    chunk = min(policy.chunk_bytes, max(MIN_CHUNK_BYTES, int(slowest * CHUNK_SECONDS)))
    return dataclasses.replace(plan, chunk_bytes=pipelined_chunk_bytes(chunk, plan, itemsize, model))


def pipelined_chunk_bytes(chunk: int, plan: Plan, itemsize: int, links: Sequence[LinkSpec]) -> int:
    """`chunk`, made smaller on a long path so that one shard's stream holds PIPELINE_CHUNKS
    chunks: when a link's bandwidth-delay product (its rate times the largest RTT) is larger than
    what the chunks of the smallest shard keep in flight at a chunk each per connection, the bulk
    lane's connection pool (peer.lanes.pool) and the stream's queue need that many chunks to fill
    the path; at least MIN_CHUNK_BYTES. Paths of a short RTT keep `chunk`."""
    rtt = max((l.rtt_seconds for l in links), default=0.0)
    fastest = max((min(l.up_bytes_per_s, l.down_bytes_per_s) for l in links), default=0.0)
    bdp = fastest * rtt
    sizes = np.diff(np.asarray(plan.shard_bounds, dtype=np.int64))
    shard = int(sizes[sizes > 0].min()) * itemsize if (sizes > 0).any() else 0
    if bdp <= chunk or shard <= 0 or shard // chunk >= PIPELINE_CHUNKS:
        return chunk
    return max(MIN_CHUNK_BYTES, min(chunk, shard // PIPELINE_CHUNKS))


def _model_choice(links: list[LinkSpec], num_elements: int, itemsize: int, collective: str, policy: PlanPolicy,
                  equal_bounds: tuple[int, ...], *, cpu_bound: bool = False) -> Plan | None:
    """`plan_layout`'s choice on denoised links: the plan, or None for the equal-shard butterfly.
    `cpu_bound`: the data plane's CPU, not the links, limits the collective (`_cpu_bound`)."""
    n_bytes = float(num_elements) * itemsize
    plan: Plan | None = plan_collective(links, num_elements, itemsize,
                                        collective="ring" if collective == "ring" else "butterfly")
    equal = math.inf
    if plan.collective == "butterfly":
        equal = predict_butterfly([l.up_bytes_per_s for l in links], [l.down_bytes_per_s for l in links], n_bytes,
                                  None, [l.rtt_seconds for l in links])
        if plan.shard_bounds != equal_bounds and plan.predicted_seconds > (1 - policy.plan_min_gain) * equal:
            plan = None  # not worth uneven shards
    if collective == "auto":
        # On (nearly) even links the ring moves the same bytes with one flow per direction per
        # peer, which shaped links carry better than the butterfly's p-1 concurrent flows
        # (measured in docs/performance.md), also at 1 Gbit/s between hosts on the bulk lane,
        # where the capped rates look "fast". Where the CPU is the limit (one host, or links of
        # CPU_BOUND_LINK_BYTES_PER_S and more) the butterfly's parallel streams win.
        cap = policy.link_cap_bytes_per_s
        all_fast = all(l.up_bytes_per_s >= cap and l.down_bytes_per_s >= cap for l in links)
        ring = plan_collective(links, num_elements, itemsize, collective="ring")
        best = plan.predicted_seconds if plan is not None else equal
        if not (all_fast and cpu_bound) and ring.predicted_seconds * (1 - policy.plan_min_gain) <= best:
            plan = ring
    return plan


def without_untrusted_owners(plan: Plan, untrusted: Collection[str]) -> Plan | None:
    """`plan` with the shards of untrusted owners given to the trusted owner after them
    (cyclically; to the trusted non-owners when no owner is trusted), `demoted` updated. None
    when no participant is trusted."""
    trusted = [i for i, p in enumerate(plan.participants) if p not in untrusted]
    owners = sorted({o for o in plan.shard_owner if o in trusted}) or trusted
    if not owners:
        return None
    moved = tuple(o if o in owners else next((q for q in owners if q > o), owners[0]) for o in plan.shard_owner)
    demoted = tuple(p for i, p in enumerate(plan.participants) if i not in set(moved))
    return dataclasses.replace(plan, shard_owner=moved, demoted=demoted)


def eligible_fractions(capacity: Sequence[float], eligible: Sequence[int]) -> list[float]:
    """Pipelined-butterfly shard fractions (module docstring) when only the `eligible` positions
    may own shards: ``min T s.t. 1 + (p-2)w_i ≤ T·c_i`` for the owners, ``1 ≤ T·c_j`` for every
    other participant (it still sends its whole input and receives the whole result), ``Σw = 1``.

    capacity: per participant ``c_i = min(u_i, d_i)`` (bytes/s, > 0), all of them in plan order.
    Returns one fraction per eligible position (≥ 0, summing to 1; 0 = a non-owner). Water-filling:
    ``w_i = max(0, (T·c_i − 1)/(p − 2))`` at the least T whose fractions sum to at least 1 (and not
    below the other participants' ``1/c_j``), then scaled to sum 1. With p ≤ 2, equal shares.
    """
    p = len(capacity)
    if p <= 2 or not eligible:
        return [1.0 / max(1, len(eligible))] * len(eligible)
    others = [1.0 / capacity[j] for j in range(p) if j not in set(eligible)]
    floor = max(others, default=0.0)

    def shares(t: float) -> list[float]:
        return [max(0.0, (t * capacity[i] - 1.0) / (p - 2)) for i in eligible]

    lo, hi = floor, max(floor, max(1.0 / capacity[i] for i in eligible))
    while sum(shares(hi)) < 1.0:
        hi *= 2.0
    if sum(shares(lo)) < 1.0:
        for _ in range(100):
            mid = (lo + hi) / 2.0
            lo, hi = (mid, hi) if sum(shares(mid)) < 1.0 else (lo, mid)
    w = shares(hi)
    total = sum(w)
    return [x / total for x in w]


def relay_links(links: Sequence[LinkSpec], relays: Sequence[tuple[str, float]]) -> list[LinkSpec]:
    """The links as the planner should see them when some participants are reached through a relay.

    `relays`: per participant (in `links`' order), the relay it is reached through ("" = direct)
    and that relay's declared capacity in bytes/s each way (0 = not declared). Every byte to or
    from a relayed participant crosses its relay's link in both directions, so the k participants
    of one relay share its capacity C: each gets ``min(own rate, C/k)`` up and down (a rate not
    reported yet becomes C/k, a measurement). Direct participants, and those of a relay without
    a declared capacity, keep their links. Pure; raises nothing.
    """
    shared: dict[str, int] = {}
    for relay, capacity in relays:
        if relay and capacity > 0 and math.isfinite(capacity):
            shared[relay] = shared.get(relay, 0) + 1
    out = []
    for link, (relay, capacity) in zip(links, relays):
        if relay in shared:
            cap = capacity / shared[relay]
            link = dataclasses.replace(link, up_bytes_per_s=min(link.up_bytes_per_s, cap) if link.up_bytes_per_s > 0 else cap,
                                       down_bytes_per_s=min(link.down_bytes_per_s, cap) if link.down_bytes_per_s > 0 else cap)
        out.append(link)
    return out


def _predicted(plan: Plan, model: Sequence[LinkSpec], itemsize: int) -> float:
    """The pipelined butterfly's model time (seconds) for `plan`'s shard ownership as it stands
    (owners' fractions of the tensor, 0 for non-owners) on the denoised links `model`, for a
    tensor of `itemsize`-byte elements."""
    fractions = [0.0] * plan.size
    total = plan.shard_bounds[-1]
    for k, o in enumerate(plan.shard_owner):
        fractions[o] += (plan.shard_bounds[k + 1] - plan.shard_bounds[k]) / total
    return predict_butterfly([l.up_bytes_per_s for l in model], [l.down_bytes_per_s for l in model],
                             float(total) * itemsize, fractions, [l.rtt_seconds for l in model])


def without_outbound_owners(plan: Plan, outbound_only: Collection[str],
                            untrusted: Collection[str] = frozenset(),
                            capacity: Sequence[float] | None = None) -> Plan | None:
    """`plan` (a butterfly) with no tensor shard owned by an outbound-only participant (nobody can
    dial it, so nobody could send it a contribution; docs/nat.md), nor by an `untrusted` one.

    With `capacity` (per participant ``min(up, down)`` in bytes/s, as the model sees the links)
    the shares are `eligible_fractions`: the pipelined model solved again with those peers as
    non-owners (a peer without a share is demoted). Without it, the element shares the layout
    gave the other owners are kept and renormalised over the whole tensor; when none of them had
    a share, the eligible participants split it equally. `outbound_only` (ids) becomes the plan's
    positions, `demoted` every non-owner. None when no participant is both reachable and trusted.
    """
    out = {i for i, p in enumerate(plan.participants) if p in outbound_only}
    eligible = [i for i, p in enumerate(plan.participants) if i not in out and p not in untrusted]
    if not eligible:
        return None
    if capacity is not None:
        fractions = eligible_fractions(capacity, eligible)
        owners = [i for i, w in zip(eligible, fractions) if w > _FRACTION_EPS]
        weights = [w for w in fractions if w > _FRACTION_EPS]
    else:
        share = [0] * plan.size
        for k, o in enumerate(plan.shard_owner):
            share[o] += plan.shard_bounds[k + 1] - plan.shard_bounds[k]
        owners = [i for i in eligible if share[i] > 0] or eligible
        weights = [float(share[i]) for i in owners]
    if sum(weights) <= 0:
        owners, weights = eligible, [1.0] * len(eligible)
    bounds = shard_bounds_from_fractions(weights, plan.shard_bounds[-1])
    demoted = tuple(p for i, p in enumerate(plan.participants) if i not in owners)
    return dataclasses.replace(plan, shard_bounds=bounds, shard_owner=tuple(owners), demoted=demoted,
                               outbound_only=tuple(sorted(out)))


def deadline_links(links: Sequence[LinkSpec], policy: PlanPolicy) -> list[LinkSpec]:
    """The links deadlines are computed on: as reported, with `policy.assumed_link` for a rate a
    participant has not reported (0, negative or NaN). Conservative by construction: an
    unmeasured link is taken as slow, never as the median of the others."""
    def rate(r: float) -> float:
        return r if r > 0 and math.isfinite(r) else policy.assumed_link

    return [LinkSpec(l.peer_id, rate(l.up_bytes_per_s), rate(l.down_bytes_per_s), max(0.0, l.rtt_seconds), l.shm_peers)
            for l in links]


def conservative_seconds(links: Sequence[LinkSpec], num_elements: int, itemsize: int, policy: PlanPolicy) -> float:
    """Model time (seconds) of an equal-shard butterfly over `deadline_links`: what a collective
    over these participants may take when nothing better is known (the static layout's plan
    predicts nothing). 0 for fewer than two participants."""
    if len(links) < 2:
        return 0.0
    dl = deadline_links(links, policy)
    return predict_butterfly([l.up_bytes_per_s for l in dl], [l.down_bytes_per_s for l in dl],
                             float(num_elements) * itemsize, None, [l.rtt_seconds for l in dl])


def chunk_deadline(links: Sequence[LinkSpec], policy: PlanPolicy, chunk_bytes: int, *,
                   expected_seconds: float = 0.0, scale: float = 1.0) -> float:
    """Per-chunk deadline (seconds): how long a participant waits for any one chunk.

    ``chunk_safety`` times the chunk's transfer time on the slowest of `deadline_links` (an
    unreported link counts as `policy.assumed_link`, never as fast), plus two round trips, plus
    `expected_seconds` (the collective's model time: a chunk may wait behind everything its
    sender must move first, e.g. the first all-gather chunk of a butterfly behind the owner's
    whole reduce-scatter); at least `policy.chunk_timeout`. Times `scale` (>= 1, the growth of a
    round that keeps timing out, at most MAX_DEADLINE_SCALE). Never a fixed value a slow link
    cannot meet: every term grows as the links get slower.
    """
    dl = deadline_links(links, policy)
    rtt = max((l.rtt_seconds for l in dl), default=0.0)
    slowest = min((r for l in dl for r in (l.up_bytes_per_s, l.down_bytes_per_s)), default=policy.assumed_link)
    t = policy.chunk_safety * chunk_bytes / slowest + 2 * rtt + max(0.0, expected_seconds)
    return min(MAX_DEADLINE_SCALE, max(1.0, scale)) * max(policy.chunk_timeout, t)


def attempt_deadline(policy: PlanPolicy, expected_seconds: float, chunk_seconds: float, scale: float = 1.0) -> float:
    """Deadline of one collective attempt (seconds, plan to last vote): `policy.collective_timeout`,
    or `chunk_safety` times the expected model time plus one chunk deadline when that is longer;
    times `scale` as in `chunk_deadline`."""
    t = max(policy.collective_timeout, policy.chunk_safety * max(0.0, expected_seconds) + chunk_seconds)
    return min(MAX_DEADLINE_SCALE, max(1.0, scale)) * t


def _cpu_bound(links: Sequence[LinkSpec]) -> bool:
    """Whether the data plane's CPU rather than the links limits a collective among `links` (as
    reported): all on one host, or the slowest measured rate at least CPU_BOUND_LINK_BYTES_PER_S."""
    rates = [min(l.up_bytes_per_s, l.down_bytes_per_s) for l in links if l.up_bytes_per_s > 0 and l.down_bytes_per_s > 0]
    return _one_host(links) or (bool(rates) and min(rates) >= CPU_BOUND_LINK_BYTES_PER_S)


def _every_pair(links: Sequence[LinkSpec], reached: Callable[[LinkSpec], frozenset[str]]) -> bool:
    """More than one participant, and each reaches every other through the lanes `reached(l)`
    names (as each reported the lanes it sends on)."""
    return len(links) > 1 and all(q.peer_id in r for l in links for r in (reached(l),) for q in links if q is not l)


def _all_bulk(links: Sequence[LinkSpec]) -> bool:
    """Every participant reaches every other through the bulk TCP lane or shared memory."""
    return _every_pair(links, lambda l: l.bulk_peers | l.shm_peers)


def _one_host(links: Sequence[LinkSpec]) -> bool:
    """Every participant reaches every other through shared memory."""
    return _every_pair(links, lambda l: l.shm_peers)


def _plan_sparse(links: Sequence[LinkSpec], num_elements: int, dtype: int, policy: PlanPolicy,
                 outbound: Collection[str], untrusted: Collection[str], deadline_scale: float) -> Plan | None:
    """The sparse collective's plan for these participants, or None when the dense all-reduce of
    the same round (float32, the layout `plan_layout` gives) is the model's choice, or when a
    participant is outbound-only (the sparse collectives dial every participant; the dense
    butterfly brings results back on streams such a peer opens).

    The choice: the sparse all-gather ("allgather", `predict_allgather`), unless the sparse
    reduce-scatter ("sparse_rs", `predict_sparse_rs`) or the dense all-reduce is predicted
    `plan_min_gain` faster than it; then the faster of those two. "sparse_rs" needs the codec's
    chunk (`policy.sparse_chunk`) and every participant trusted (each owns a range); with
    `policy.collective` "sparse_rs" it is taken whenever it can be planned.
    """
    ids = tuple(l.peer_id for l in links)
    if outbound and len(links) > 1:
        return None
    p = len(links)
    payload = sparse_payload_bytes(num_elements, policy.sparse_bytes_per_element)
    rs_ok = p >= 2 and policy.sparse_chunk > 0 and not set(untrusted) & set(ids)
    forced = rs_ok and policy.collective == "sparse_rs"
    model = _denoised(links, policy.link_cap_bytes_per_s, policy.noise) if p >= 2 else None
    collective, predicted, bound = "allgather", 0.0, 0.0
    if model is not None:
        up, down, rtt = ([l.up_bytes_per_s for l in model], [l.down_bytes_per_s for l in model],
                         [l.rtt_seconds for l in model])
        gather = predict_allgather(up, down, payload, rtt)
        scatter = predict_sparse_rs(up, down, payload, num_elements, rtt) if rs_ok else math.inf
        dense = 0.0 if forced else plan_layout(
            links, num_elements, ITEMSIZE.get(dtype, 4),
            dataclasses.replace(policy, compression="none",
                                collective="auto" if policy.collective == "sparse_rs" else policy.collective),
        ).predicted_seconds
        rivals = {"sparse_rs": scatter, "dense": dense if dense > 0 else math.inf}
        faster = {c: t for c, t in rivals.items() if t < (1 - policy.plan_min_gain) * gather}
        collective, predicted = "allgather", gather
        if forced:
            collective, predicted = "sparse_rs", scatter
        elif faster:
            collective = min(faster, key=faster.__getitem__)
            if collective == "dense":
                return None
            predicted = faster[collective]
        slowest = max(min(min(l.up_bytes_per_s, l.down_bytes_per_s) for l in model), 1.0)
        bound = ((p - 1) * payload if collective == "allgather"
                 else (p - 1) / p * (payload + 4.0 * num_elements)) / slowest
    chunk = policy.shm_chunk_bytes if _one_host(links) else (
        policy.bulk_chunk_bytes if _all_bulk(links) else policy.chunk_bytes)
    dl = deadline_links(links, policy)
    predict = predict_allgather if collective == "allgather" else (
        lambda u, d, s, r: predict_sparse_rs(u, d, s, num_elements, r))
    conservative = predict([l.up_bytes_per_s for l in dl], [l.down_bytes_per_s for l in dl], payload,
                           [l.rtt_seconds for l in dl]) if p >= 2 else 0.0
    # A first piece leaves only once its sender encoded its whole contribution: the codec's CPU
    # time is part of every wait, on one host too.
    codec = SPARSE_CODEC_SECONDS_PER_ELEMENT * num_elements
    expected = (0.0 if _one_host(links) else max(predicted, conservative)) + codec
    if collective == "allgather":
        bounds, owners, largest = (0, num_elements), (0,), int(min(chunk, payload))
    else:
        bounds, owners = sparse_shard_bounds(num_elements, policy.sparse_chunk, p), tuple(range(p))
        largest = int(min(chunk, 4 * max(hi - lo for lo, hi in zip(bounds, bounds[1:]))))
    per_chunk = chunk_deadline(links, policy, max(1, largest), expected_seconds=expected, scale=deadline_scale)
    return Plan(ids, collective, bounds, owners, num_elements=num_elements, dtype=dtype,
                chunk_bytes=chunk, chunk_timeout_seconds=per_chunk,
                deadline_seconds=attempt_deadline(policy, expected, per_chunk, deadline_scale),
                aggregator=policy.aggregator, compression=policy.compression, predicted_seconds=predicted,
                bound_seconds=bound)


def plan_round(links: Sequence[LinkSpec], num_elements: int, dtype: int, policy: PlanPolicy, *,
               untrusted: Collection[str] = frozenset(), deadline_scale: float = 1.0,
               outbound_only: Collection[str] = frozenset()) -> Plan | NoPlan:
    """The plan of one round's collective over these participants (in the engine's order). Pure.

    With a sparse compression (`policy.sparse`: "topk", "dct") the plan is a sparse collective
    (`_plan_sparse`): the sparse all-gather (one shard, `predict_allgather`'s time), or the sparse
    reduce-scatter (one range of whole codec chunks per participant, `predict_sparse_rs`'s time)
    when it is predicted `plan_min_gain` faster (many peers: the all-gather's bytes per peer grow
    as (p-1)·S, the reduce-scatter's stay near (S + 4n)); or the dense plan below, with compression
    "none", when the dense float32 all-reduce is predicted `plan_min_gain` faster than the
    all-gather and faster than the reduce-scatter, or an outbound-only participant is among them;
    then every peer sends its whole error-fed accumulator.

    `links` as reported by the peers; `num_elements` and `dtype` (a `shoal.v1.DType` code) of the
    tensor. The layout is `plan_layout`'s. On a butterfly, `untrusted` peers (failed owner audits)
    own no shard (`without_untrusted_owners`); when none of the participants is trusted, returns
    `NoPlan` instead (nobody can tell which of them lied: no round until a trusted peer is among
    them). `outbound_only` peers (nobody can dial them: behind NAT, or `--outbound-only`) force the
    butterfly (the only collective whose results can come back on streams they open) and own no
    shard (`without_outbound_owners`); with no reachable, trusted participant, `NoPlan` (relays
    are not built yet). The plan is audited (`audit_owners`) when the policy asks for it and at least two peers
    own shards (one owner has nobody to audit it). Chunks: `policy.shm_chunk_bytes` when every
    participant reaches every other through shared memory, else the layout's (at most
    `policy.bulk_chunk_bytes` instead of `policy.chunk_bytes` when every pair has the bulk TCP
    lane or shared memory). Deadlines: the
    expected time is the larger of the plan's prediction and `conservative_seconds` (unreported
    links count as `policy.assumed_link`); the chunk deadline is `chunk_deadline`'s and the
    attempt deadline (`deadline_seconds`) `attempt_deadline`'s, both times `deadline_scale`
    (the engine grows it for a round that keeps timing out). The result carries the collective, participants, tensor shards,
    prediction, chunking, deadlines, aggregator, compression and tensor; round, attempt, epoch and
    the participants' addresses, sample counts and keys are the engine's to stamp.
    """
    outbound = set(outbound_only) & {l.peer_id for l in links}
    if policy.sparse:
        sparse = _plan_sparse(links, num_elements, dtype, policy, outbound, untrusted, deadline_scale)
        if sparse is not None:
            return sparse
        # The dense all-reduce is predicted faster (or an outbound-only peer needs the
        # butterfly): each peer sends its whole error-fed accumulator in float32 (peer.rounds).
        policy = dataclasses.replace(policy, compression="none")
    if policy.collective == "sparse_rs":  # forced, but not plannable here: the model's dense choice
        policy = dataclasses.replace(policy, collective="auto")
    if outbound and len(links) > 1:
        policy = dataclasses.replace(policy, collective="butterfly")
    if _all_bulk(links):
        # No gRPC message per chunk: larger chunks cost less CPU per byte on both sides (1 and 10
        # Gbit/s, docs/performance.md); the layout still sizes them to the slowest link.
        policy = dataclasses.replace(policy, chunk_bytes=policy.bulk_chunk_bytes)
    plan = plan_layout(links, num_elements, ITEMSIZE.get(dtype, 4), policy)
    if outbound and len(links) > 1:
        model = _denoised(links, policy.link_cap_bytes_per_s, policy.noise)
        capacity = [min(l.up_bytes_per_s, l.down_bytes_per_s) for l in model] if model is not None else None
        kept = without_outbound_owners(plan, outbound, untrusted, capacity)
        if kept is None:
            return NoPlan("no reachable, trusted shard owner among the ready peers (the others are outbound-only; "
                          "a peer behind NAT owns shards through a relay: shoal peer --relay, docs/nat.md)")
        plan = kept
        if model is not None:
            plan = dataclasses.replace(plan, predicted_seconds=_predicted(plan, model, ITEMSIZE.get(dtype, 4)))
    elif plan.collective == "butterfly" and set(untrusted) & set(plan.participants):
        stripped = without_untrusted_owners(plan, untrusted)
        if stripped is None:
            return NoPlan("no trusted shard owner among the ready peers")
        plan = stripped
    chunk = policy.shm_chunk_bytes if _one_host(links) else plan.chunk_bytes
    audit = policy.audit_owners and plan.collective == "butterfly" and len(set(plan.shard_owner)) >= 2
    expected = max(plan.predicted_seconds, conservative_seconds(links, num_elements, ITEMSIZE.get(dtype, 4), policy))
    if _one_host(links):
        expected = 0.0  # shared memory: no link to wait on
    # A chunk is never larger than the tensor: a small tensor is not waited on as if it were big.
    largest = min(chunk, plan.num_elements * ITEMSIZE.get(dtype, 4))
    per_chunk = chunk_deadline(links, policy, largest, expected_seconds=expected, scale=deadline_scale)
    return dataclasses.replace(plan, dtype=dtype, chunk_bytes=chunk, chunk_timeout_seconds=per_chunk,
                               deadline_seconds=attempt_deadline(policy, expected, per_chunk, deadline_scale),
                               aggregator=policy.aggregator, compression=policy.compression, audit_owners=audit)
