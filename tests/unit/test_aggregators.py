"""Aggregators: sharded reduction equals a plain whole-vector reference, robustness against one
attacker out of six, no non-finite output ever, determinism, validation, DP noise."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.peer.aggregators import (
    AGGREGATORS,
    AggregateResult,
    Aggregator,
    add_dp_noise,
    bound_norms,
    make_aggregator,
    partial_sq_distances,
    validate,
)
from shoal.common.errors import InvalidArgument

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)

# (name, params) of every aggregator under test.
CONFIGS = [
    ("mean", {}),
    ("median", {}),
    ("trimmed-mean", {"beta": 0.2}),
    ("trimmed-mean", {"beta": 0.4}),
    ("centered-clip", {"tau": 1.0, "iterations": 5}),
    ("centered-clip", {"tau": 0.3, "iterations": 12}),
    ("krum", {"f": 1}),
    ("krum", {"f": 0}),
    ("multi-krum", {"f": 1}),
    ("multi-krum", {"f": 1, "m": 2}),
    ("bulyan", {"f": 1}),
    ("bulyan", {"f": 0}),
]
ROBUST = [c for c in CONFIGS if c[0] != "mean" and c[1].get("f") != 0]


# --------------------------------------------------------------------------------------------
# Plain whole-vector references (deliberately written differently from the module).


def ref_sq_dist(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return ((x[:, None, :] - x[None, :, :]) ** 2).sum(axis=2)


def ref_krum_scores(d: np.ndarray, f: int) -> list[float]:
    n = len(d)
    k = min(max(1, n - f - 2), n - 1)
    scores = []
    for i in range(n):
        others = sorted(d[i][j] for j in range(n) if j != i)
        scores.append(sum(others[:k]))
    return scores


def ref_aggregate(name: str, params: dict, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Whole-vector reference on already-clean rows (n, m); returns float64."""
    x = x.astype(np.float64)
    n = len(x)
    if name == "mean":
        ww = w if w.sum() > 0 else np.ones(n)
        return sum(ww[i] * x[i] for i in range(n)) / ww.sum()
    if name == "median":
        return np.median(x, axis=0)
    if name == "trimmed-mean":
        k = min(int(math.floor(params["beta"] * n)), (n - 1) // 2)
        out = []
        for col in x.T:
            s = sorted(col)
            out.append(np.mean(s[k : n - k]))
        return np.array(out)
    d = ref_sq_dist(x)
    if name == "centered-clip":
        tau, iters = params["tau"], params["iterations"]
        v = x[int(np.argmin([sum(math.sqrt(d[i][j]) for j in range(n)) for i in range(n)]))].copy()
        for _ in range(iters):
            step = np.zeros_like(v)
            for i in range(n):
                diff = x[i] - v
                norm = np.linalg.norm(diff)
                step += diff * (min(1.0, tau / norm) if norm > 0 else 1.0)
            v = v + step / n
        return v
    f = params["f"]
    if name == "krum":
        s = ref_krum_scores(d, f)
        return x[min(range(n), key=lambda i: (s[i], i))]
    if name == "multi-krum":
        s = ref_krum_scores(d, f)
        m = params.get("m") or n - f
        m = min(max(1, m), n)
        chosen = sorted(sorted(range(n), key=lambda i: (s[i], i))[:m])
        return x[chosen].mean(axis=0)
    if name == "bulyan":
        theta = max(1, n - 2 * f)
        remaining = list(range(n))
        picked = []
        for _ in range(theta):
            sub = d[np.ix_(remaining, remaining)]
            s = ref_krum_scores(sub, f)
            best = min(range(len(remaining)), key=lambda i: (s[i], i))
            picked.append(remaining.pop(best))
        sel = x[picked]
        beta = max(1, theta - 2 * f)
        out = []
        for col in sel.T:
            med = np.median(col)
            order = sorted(range(len(col)), key=lambda i: (abs(col[i] - med), i))[:beta]
            out.append(np.mean(col[order]))
        return np.array(out)
    raise AssertionError(name)


def reduce_sharded(agg: Aggregator, x: np.ndarray, w: np.ndarray, cuts: list[int]) -> tuple[np.ndarray, set[int]]:
    """What the collective does: partial distances per shard, summed in shard order, reduce each."""
    bounds = [0, *cuts, x.shape[1]]
    shards = [x[:, a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    d = None
    if agg.needs_distances:
        d = np.zeros((x.shape[0], x.shape[0]))
        for s in shards:
            d = d + partial_sq_distances(s)
    parts, rejected = [], set()
    for s in shards:
        r = agg.reduce(s, w, d)
        assert isinstance(r, AggregateResult)
        assert r.values.dtype == np.float32 and r.values.shape == (s.shape[1],)
        assert np.all(np.isfinite(r.values))
        parts.append(r.values)
        rejected |= set(r.rejected)
    return np.concatenate(parts), rejected


@st.composite
def problems(draw, max_p: int = 8, max_m: int = 40):
    p = draw(st.integers(1, max_p))
    m = draw(st.integers(1, max_m))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    scale = draw(st.sampled_from([1e-3, 1.0, 50.0]))
    x = (rng.standard_normal((p, m)) * scale + rng.standard_normal(m)).astype(np.float32)
    w = rng.integers(0, 100, size=p).astype(np.float64)
    ncuts = draw(st.integers(0, min(4, m - 1)))
    cuts = sorted(draw(st.lists(st.integers(1, m - 1), min_size=ncuts, max_size=ncuts, unique=True))) if m > 1 else []
    bad = draw(st.lists(st.integers(0, p - 1), max_size=2, unique=True))
    for i in bad:  # a whole row bad on every shard
        x[i, :] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    return x, w, cuts, set(bad)


# --------------------------------------------------------------------------------------------
# Sharded == whole-vector reference


@pytest.mark.parametrize("name,params", CONFIGS, ids=lambda v: str(v))
@SETTINGS
@given(prob=problems())
def test_sharded_equals_whole_vector_reference(name, params, prob):
    x, w, cuts, bad = prob
    agg = make_aggregator(name, **params)
    got, rejected = reduce_sharded(agg, x, w, cuts)
    assert rejected == bad
    keep = [i for i in range(len(x)) if i not in bad]
    if not keep:
        assert np.array_equal(got, np.zeros(x.shape[1], dtype=np.float32))
        return
    want = ref_aggregate(name, params, x[keep], w[keep]).astype(np.float32)
    # Coordinate-wise rules and the Krum family reproduce the reference up to summation order;
    # CenteredClip goes through the distance matrix, hence a slightly looser tolerance.
    rtol = 1e-4 if name == "centered-clip" else 1e-6
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * (1 + float(np.abs(want).max())))


@pytest.mark.parametrize("name,params", [c for c in CONFIGS if c[0] in ("mean", "median", "trimmed-mean")], ids=str)
@SETTINGS
@given(prob=problems())
def test_coordinatewise_sharding_is_bit_exact(name, params, prob):
    x, w, cuts, _ = prob
    agg = make_aggregator(name, **params)
    got, _ = reduce_sharded(agg, x, w, cuts)
    whole = agg.reduce(x, w).values
    assert got.tobytes() == whole.tobytes()


@pytest.mark.parametrize("name", ["centered-clip", "krum", "multi-krum", "bulyan"])
def test_row_bad_on_one_shard_is_rejected_on_every_shard(name):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((7, 30)).astype(np.float32)
    x[3, 2] = np.nan  # only in the first shard
    agg = make_aggregator(name, f=1) if name != "centered-clip" else make_aggregator(name)
    got, rejected = reduce_sharded(agg, x, np.ones(7), [10, 20])
    assert rejected == {3}
    keep = [0, 1, 2, 4, 5, 6]
    params = {"f": 1} if name != "centered-clip" else {"tau": 1.0, "iterations": 5}
    want = ref_aggregate(name, params, x[keep], np.ones(6)).astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------------------------
# Robustness: one attacker out of six


def _attack(kind: str, honest: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    mean = honest.mean(axis=0)
    if kind == "scaled":
        return (100.0 * honest[0]).astype(np.float32)
    if kind == "sign-flip":
        return (-10.0 * mean).astype(np.float32)
    if kind == "huge":
        return np.full_like(mean, 3e38)
    if kind == "random":
        return (rng.standard_normal(mean.shape) * 1e4).astype(np.float32)
    return np.full_like(mean, np.nan)


@pytest.mark.parametrize("name,params", ROBUST, ids=str)
@SETTINGS
@given(
    seed=st.integers(0, 2**32 - 1),
    kind=st.sampled_from(["scaled", "sign-flip", "huge", "random", "nan"]),
    where=st.integers(0, 5),
    cuts=st.lists(st.integers(1, 31), max_size=3, unique=True),
)
def test_one_attacker_of_six_stays_near_honest_mean(name, params, seed, kind, where, cuts):
    rng = np.random.default_rng(seed)
    center = rng.standard_normal(32) * 3
    honest = (center + 0.1 * rng.standard_normal((5, 32))).astype(np.float32)
    x = np.insert(honest, where, _attack(kind, honest, rng), axis=0)
    w = np.full(6, 10.0)
    w[where] = 1e6  # lying about the sample count must not help against robust rules
    got, rejected = reduce_sharded(make_aggregator(name, **params), x, w, sorted(cuts))
    hmean = honest.astype(np.float64).mean(axis=0)
    radius = max(np.linalg.norm(h - hmean) for h in honest.astype(np.float64))
    assert np.linalg.norm(got - hmean) <= 3 * radius
    if kind == "nan":
        assert rejected == {where}


def test_mean_is_not_robust_but_rejects_nan():
    rng = np.random.default_rng(1)
    honest = rng.standard_normal((5, 16)).astype(np.float32)
    x = np.vstack([honest, 100 * honest[:1]])
    r = make_aggregator("mean").reduce(x, np.ones(6))
    assert np.linalg.norm(r.values - honest.mean(axis=0)) > 10
    x[5, 3] = np.nan
    r = make_aggregator("mean").reduce(x, np.ones(6))
    assert r.rejected == (5,)
    np.testing.assert_allclose(r.values, honest.astype(np.float64).mean(axis=0), rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------------------------
# Never non-finite, always deterministic


@st.composite
def hostile(draw):
    p = draw(st.integers(1, 7))
    m = draw(st.integers(0, 20))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    mag = draw(st.sampled_from([1.0, 1e20, 3e38]))
    x = (rng.uniform(-1, 1, (p, m)) * mag).astype(np.float32)
    specials = [np.nan, np.inf, -np.inf, 3.4028235e38, -3.4028235e38, 1e-45, 0.0]
    for _ in range(draw(st.integers(0, 6))):
        if m:
            x[rng.integers(p), rng.integers(m)] = specials[rng.integers(len(specials))]
    w = rng.integers(0, 3, size=p).astype(np.float64)
    return x, w


@pytest.mark.parametrize("name,params", CONFIGS, ids=str)
@SETTINGS
@given(prob=hostile())
def test_output_always_finite_and_deterministic(name, params, prob):
    x, w = prob
    agg = make_aggregator(name, **params)
    d = partial_sq_distances(x) if agg.needs_distances else None
    r1 = agg.reduce(x, w, d)
    r2 = make_aggregator(name, **params).reduce(x.copy(), w.copy(), None if d is None else d.copy())
    assert r1.values.dtype == np.float32 and r1.values.shape == (x.shape[1],)
    assert np.all(np.isfinite(r1.values))
    assert r1.values.tobytes() == r2.values.tobytes() and r1.rejected == r2.rejected
    bad = set(np.flatnonzero(~np.isfinite(x).all(axis=1)).tolist()) if x.shape[1] else set()
    assert set(r1.rejected) == bad
    assert list(r1.rejected) == sorted(r1.rejected)


@pytest.mark.parametrize("name,params", CONFIGS, ids=str)
def test_all_rows_rejected_gives_zeros(name, params):
    x = np.full((4, 5), np.nan, dtype=np.float32)
    x[1, 0] = 1.0
    x[2] = np.inf
    r = make_aggregator(name, **params).reduce(x, np.ones(4))
    assert r.values.tobytes() == np.zeros(5, dtype=np.float32).tobytes()
    assert r.rejected == (0, 1, 2, 3)


@pytest.mark.parametrize("name,params", CONFIGS, ids=str)
def test_inputs_not_mutated_and_protocol(name, params):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 9)).astype(np.float32)
    x[2, 1] = np.nan
    w = np.arange(5, dtype=np.float64)
    x0, w0 = x.copy(), w.copy()
    agg = make_aggregator(name, **params)
    assert isinstance(agg, Aggregator) and agg.name == name
    agg.reduce(x, w)
    assert np.array_equal(x, x0, equal_nan=True) and np.array_equal(w, w0)


def test_needs_distances_flags():
    flags = {n: make_aggregator(n).needs_distances for n in AGGREGATORS}
    assert flags == {
        "mean": False,
        "median": False,
        "trimmed-mean": False,
        "centered-clip": True,
        "krum": True,
        "multi-krum": True,
        "bulyan": True,
    }


# --------------------------------------------------------------------------------------------
# Weights, distances and argument checking


def test_mean_weights_and_zero_weight_fallback():
    x = np.array([[0.0, 2.0], [4.0, 6.0]], dtype=np.float32)
    r = make_aggregator("mean").reduce(x, np.array([3.0, 1.0]))
    np.testing.assert_array_equal(r.values, np.array([1.0, 3.0], dtype=np.float32))
    with pytest.raises(InvalidArgument, match="aggregator: 'fedavg' was removed in 0.3; use 'mean'"):
        make_aggregator("fedavg")
    r = make_aggregator("mean").reduce(x, np.array([0.0, 0.0]))
    np.testing.assert_array_equal(r.values, np.array([2.0, 4.0], dtype=np.float32))


def test_partial_distances_sum_to_whole_and_mark_bad_rows():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((5, 20)).astype(np.float32)
    total = partial_sq_distances(x[:, :7]) + partial_sq_distances(x[:, 7:])
    np.testing.assert_allclose(total, ref_sq_dist(x), rtol=1e-12)
    assert np.array_equal(total, total.T) and np.all(np.diag(total) == 0)
    x[1, 15] = np.inf
    d = partial_sq_distances(x[:, 7:])
    assert np.all(np.isinf(d[1])) and np.all(np.isinf(d[:, 1]))
    assert np.all(np.isfinite(np.delete(np.delete(d, 1, 0), 1, 1)))


def test_bad_arguments_raise_invalid_argument():
    x = np.zeros((3, 4), dtype=np.float32)
    agg = make_aggregator("krum", f=0)
    cases = [
        (lambda: agg.reduce(x.astype(np.float64), np.ones(3)), "contributions"),
        (lambda: agg.reduce(x[0], np.ones(3)), "contributions"),
        (lambda: agg.reduce(x, np.ones(2)), "weights"),
        (lambda: agg.reduce(x, np.array([1.0, -1.0, 1.0])), "weights"),
        (lambda: agg.reduce(x, np.array([1.0, np.nan, 1.0])), "weights"),
        (lambda: agg.reduce(x, np.ones(3), np.zeros((2, 2))), "distances"),
        (lambda: agg.reduce(x, np.ones(3), np.full((3, 3), np.nan)), "distances"),
        (lambda: agg.reduce(x, np.ones(3), np.array([[0, np.inf, 0], [np.inf, 0, 0], [0, 0, 0]])), "distances"),
        (lambda: make_aggregator("nope"), "aggregator"),
        (lambda: make_aggregator("median", beta=0.1), "aggregator"),
        (lambda: make_aggregator("trimmed-mean", beta=0.5), "beta"),
        (lambda: make_aggregator("centered-clip", tau=0), "tau"),
        (lambda: make_aggregator("centered-clip", iterations=0), "iterations"),
        (lambda: make_aggregator("krum", f=-1), "f"),
        (lambda: make_aggregator("multi-krum", m=0), "m"),
    ]
    for call, field in cases:
        with pytest.raises(InvalidArgument, match=f"^{field}"):
            call()


# --------------------------------------------------------------------------------------------
# validate / bound_norms


def test_validate_drops_non_finite_and_clips_to_shard_bound():
    x = np.array([[3.0, 4.0], [np.nan, 0.0], [0.3, 0.4], [30.0, 40.0]], dtype=np.float32)
    clean, rejected = validate(x, max_norm=2.0, shard_fraction=0.25)  # shard bound 1.0
    assert rejected == (1,)
    norms = np.linalg.norm(clean.astype(np.float64), axis=1)
    np.testing.assert_allclose(norms, [1.0, 0.5, 1.0], rtol=1e-6)
    np.testing.assert_allclose(clean[0], [0.6, 0.8], rtol=1e-6)
    clean, rejected = validate(x, max_norm=2.0, shard_fraction=0.25, on_norm="reject")
    assert rejected == (0, 1, 3) and clean.shape == (1, 2)
    clean, rejected = validate(x, max_norm=None, shard_fraction=1.0)
    assert rejected == (1,) and np.array_equal(clean, x[[0, 2, 3]])


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), max_norm=st.floats(1e-3, 1e3), frac=st.floats(0.01, 1.0))
def test_clipped_rows_respect_bound(seed, max_norm, frac):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((6, 17)) * rng.choice([1e-3, 1, 1e3])).astype(np.float32)
    clean, rejected = validate(x, max_norm=max_norm, shard_fraction=frac)
    assert rejected == () and clean.shape == x.shape
    bound = max_norm * math.sqrt(frac)
    norms = np.linalg.norm(clean.astype(np.float64), axis=1)
    assert np.all(norms <= bound * (1 + 1e-6))
    under = np.linalg.norm(x.astype(np.float64), axis=1) <= bound
    assert np.array_equal(clean[under], x[under])


def test_bound_norms_reject_marks_row_for_distances():
    x = np.array([[3.0, 4.0], [0.1, 0.1], [0.2, 0.0]], dtype=np.float32)
    b = bound_norms(x, max_norm=1.0, shard_fraction=1.0, on_norm="reject")
    assert np.all(np.isnan(b[0])) and np.array_equal(b[1:], x[1:])
    assert np.isinf(partial_sq_distances(b)[0, 0])
    with pytest.raises(InvalidArgument, match="^shard_fraction"):
        bound_norms(x, max_norm=1.0, shard_fraction=0.0)
    with pytest.raises(InvalidArgument, match="^max_norm"):
        bound_norms(x, max_norm=-1.0, shard_fraction=1.0)
    with pytest.raises(InvalidArgument, match="^on_norm"):
        bound_norms(x, max_norm=1.0, shard_fraction=1.0, on_norm="drop")


# --------------------------------------------------------------------------------------------
# DP noise


def test_dp_noise_std_and_determinism():
    v = np.zeros(200_000, dtype=np.float32)
    a = add_dp_noise(v, clip=0.5, sigma=2.0, rng=np.random.default_rng(9))
    b = add_dp_noise(v, clip=0.5, sigma=2.0, rng=np.random.default_rng(9))
    assert a.dtype == np.float32 and a.tobytes() == b.tobytes()
    assert abs(float(a.std()) - 1.0) < 0.01 and abs(float(a.mean())) < 0.01
    assert np.array_equal(add_dp_noise(v[:5] + 1, clip=1.0, sigma=0.0, rng=np.random.default_rng()), v[:5] + 1)
    with pytest.raises(InvalidArgument, match="^clip"):
        add_dp_noise(v, clip=0.0, sigma=1.0, rng=np.random.default_rng())
    with pytest.raises(InvalidArgument, match="^sigma"):
        add_dp_noise(v, clip=1.0, sigma=-1.0, rng=np.random.default_rng())
    with pytest.raises(InvalidArgument, match="^values"):
        add_dp_noise(np.array([np.nan], dtype=np.float32), clip=1.0, sigma=1.0, rng=np.random.default_rng())
