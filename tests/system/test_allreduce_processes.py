"""All-reduce across real processes talking real gRPC on loopback, through a real coordinator."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from kits.procs import read_json
from shoal.bench.collective_job import make_input

# Starts a coordinator and collective jobs as processes: the integration tier (pyproject markers).
pytestmark = pytest.mark.integration

ROUNDS = 2


def _run(procs, p: int, size: int, dtype: str, algorithm: str = "ring") -> list[dict]:
    coord, addr = procs.coordinator("--rounds", str(ROUNDS), "--min-peers", str(p), "--initial-peers", str(p),
                                    "--collective", algorithm)
    jobs = []
    for r in range(p):
        out = procs.workdir / f"job-{r}.json"
        jobs.append((procs.start(f"job-{r}", [
            sys.executable, "-m", "shoal.bench.collective_job", "--coordinator", addr, "--rank", str(r), "--size", str(size),
            "--dtype", dtype, "--key", str(procs.workdir / f"job-{r}.key"), "--out", str(out), "--timeout", "60"]), out))
    reports = []
    for proc, out in jobs:
        assert procs.wait_exit(proc, 90) == 0, procs.log(proc.name)
        rep = read_json(out)
        rep["result"] = np.load(str(out) + ".npy")
        reports.append(rep)
    return reports


# The default run keeps one size per peer count that exercises an edge (1 element, shards that do
# not divide, more chunks than peers); the other sizes run with the soaks (default-run budget).
@pytest.mark.parametrize("p,size", [(2, 1), pytest.param(2, 1001, marks=pytest.mark.soak),
                                    pytest.param(3, 2, marks=pytest.mark.soak),
                                    pytest.param(3, 3000, marks=pytest.mark.soak), (4, 4099),
                                    pytest.param(5, 3, marks=pytest.mark.soak), (5, 70001)])
def test_ring_allreduce_equals_numpy_sum(procs, p, size):
    reports = _run(procs, p, size, "float32")
    expected = sum(make_input(0, r, ROUNDS - 1, size, "float32").astype(np.float64) for r in range(p))
    digests = {r["last_digest"] for r in reports}
    assert len(digests) == 1, "participants ended with different bytes"
    assert all(r["gc_frozen_objects"] > 10_000 for r in reports)  # each job froze its startup heap (freeze_heap)
    first = reports[0]["result"]
    for r in reports:
        assert r["committed"] == ROUNDS
        assert r["result"].dtype == np.float32 and r["result"].shape == (size,)
        assert r["result"].tobytes() == first.tobytes()
    np.testing.assert_allclose(first, expected, rtol=1e-5, atol=1e-5 * p)


@pytest.mark.parametrize("p,size", [pytest.param(3, 5000, marks=pytest.mark.soak), (4, 3)])
def test_float16_allreduce(procs, p, size):
    reports = _run(procs, p, size, "float16")
    expected = sum(make_input(0, r, ROUNDS - 1, size, "float16").astype(np.float64) for r in range(p))
    assert len({r["last_digest"] for r in reports}) == 1
    res = reports[0]["result"]
    assert res.dtype == np.float16
    np.testing.assert_allclose(res.astype(np.float64), expected, rtol=1e-2, atol=1e-2 * p)


@pytest.mark.parametrize("p,size", [pytest.param(3, 1000, marks=pytest.mark.soak), (4, 2)])
def test_butterfly_allreduce_equals_numpy_sum(procs, p, size):
    reports = _run(procs, p, size, "float32", algorithm="butterfly")
    expected = sum(make_input(0, r, ROUNDS - 1, size, "float32").astype(np.float64) for r in range(p))
    assert len({r["last_digest"] for r in reports}) == 1
    assert all(rd["algorithm"] == "butterfly" for r in reports for rd in r["rounds"])
    np.testing.assert_allclose(reports[0]["result"], expected, rtol=1e-5, atol=1e-5 * p)


def test_nan_attacker_never_reaches_a_result_with_any_aggregator(procs):
    """Real processes, real gRPC: one process sends NaN every round; the owners run every
    aggregator in turn (one per round); every result is finite, identical and flags the attacker."""
    from shoal.peer.aggregators import AGGREGATORS

    p, size, attacker = 4, 999, 3
    aggs = list(AGGREGATORS)
    coord, addr = procs.coordinator("--rounds", str(len(aggs)), "--min-peers", str(p), "--initial-peers", str(p),
                                    "--collective", "butterfly", "--compression", "int8")
    jobs = []
    for r in range(p):
        out = procs.workdir / f"job-{r}.json"
        jobs.append((procs.start(f"job-{r}", [
            sys.executable, "-m", "shoal.bench.collective_job", "--coordinator", addr, "--rank", str(r), "--size", str(size),
            "--key", str(procs.workdir / f"job-{r}.key"), "--out", str(out), "--timeout", "60",
            "--aggregators", ",".join(aggs), *(["--attack", "nan"] if r == attacker else [])]), out))
    reports = []
    for proc, out in jobs:
        assert procs.wait_exit(proc, 90) == 0, procs.log(proc.name)
        rep = read_json(out)
        rep["results"] = dict(np.load(str(out) + ".npz"))
        reports.append(rep)
    bad = reports[attacker]["peer_id"]
    for rnd, name in enumerate(aggs):
        values = [rep["results"][f"r{rnd}"] for rep in reports]
        assert all(np.isfinite(v).all() for v in values), name
        assert all(v.tobytes() == values[0].tobytes() for v in values), name
        flagged = {f for rep in reports for rd in rep["rounds"] if rd["round"] == rnd for f in rd["flagged"]}
        assert flagged == {bad}, name
        honest = np.stack([make_input(0, r, rnd, size, "float32") for r in range(p) if r != attacker])
        assert np.abs(values[0]).max() <= np.abs(honest).max() * 1.05, name  # int8 round trips, no blow-up
