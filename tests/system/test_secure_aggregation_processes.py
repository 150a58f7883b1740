"""Secure aggregation (SecAgg+) in real rounds: a coordinator and collective jobs as processes on
loopback, real gRPC. Every committed round's result is exactly the fixed-point sum of the
participants' quantized inputs (computed here from the jobs' seeded inputs), identical on every
peer. A participant lost after sending its masked row costs no retry (its round commits with its
contribution, without its vote); one killed after handing out its shares but before sending costs
its round one retry, and the retry commits the survivors' sum."""

from __future__ import annotations

import json
import os
import pathlib
import sys

import numpy as np
import pytest

from kits.cli import one_line_error, shoal
from kits.procs import read_json, run_to_end
from shoal import cli
from shoal.bench.collective_job import make_input
from shoal.peer.secagg import SecAggParams, dequantize, quantize

pytestmark = pytest.mark.integration

SIZE = 3001
PARAMS = SecAggParams(degree=4, threshold=3, clip=4.0, frac_bits=20)
SCENARIOS = pathlib.Path(__file__).resolve().parents[2] / "examples" / "scenarios"


def secure_sum(ranks, round_: int) -> np.ndarray:
    """What a secure round of `ranks` must commit: the sum in Z_2^32 of their quantized inputs."""
    total = np.zeros(SIZE, dtype=np.uint32)
    for r in ranks:
        total += quantize(make_input(0, r, round_, SIZE, "float32"), PARAMS)
    return dequantize(total, PARAMS)


def _run(procs, p: int, rounds: int, faults: dict[int, str] | None = None,
         collective: str = "butterfly") -> tuple[list[dict], str]:
    """Run `rounds` secure rounds of `p` jobs (rank r with SHOAL_FAULT=faults[r]); the reports of
    the jobs without a fault, and the coordinator's log. A stopped job is killed at the end."""
    coord, addr = procs.coordinator(
        "--rounds", str(rounds), "--min-peers", str(p - len(faults or {})), "--initial-peers", str(p),
        "--collective", collective, "--secure-aggregation", "--secagg-degree", str(PARAMS.degree),
        "--secagg-threshold", str(PARAMS.threshold), "--secagg-clip", str(PARAMS.clip),
        "--secagg-frac-bits", str(PARAMS.frac_bits), "--lease-seconds", "10", "--retry-backoff", "0.2",
        "--ready-timeout", "3")
    jobs = []
    for r in range(p):
        out = procs.workdir / f"job-{r}.json"
        env = dict(os.environ, SHOAL_FAULT=(faults or {}).get(r, ""))
        jobs.append((r, procs.start(f"job-{r}", [
            sys.executable, "-m", "shoal.bench.collective_job", "--coordinator", addr, "--rank", str(r),
            "--size", str(SIZE), "--key", str(procs.workdir / f"job-{r}.key"), "--out", str(out),
            "--timeout", "100"], env=env), out))
    reports = []
    for r, proc, out in sorted(jobs, key=lambda j: ":stop" in (faults or {}).get(j[0], "")):
        if ":stop" in (faults or {}).get(r, ""):
            assert proc.poll() is None  # still stopped at its fault point
            proc.kill()
            procs.wait_exit(proc, 10)
            continue
        code = procs.wait_exit(proc, 120)
        if r in (faults or {}):
            assert code != 0  # killed itself at its fault point
            continue
        assert code == 0, procs.log(proc.name)
        reports.append(read_json(out))
    return reports, procs.log(coord.name)


def _results(rep: dict, workdir, rank: int) -> dict:
    return dict(np.load(str(workdir / f"job-{rank}.json") + ".npz"))


@pytest.mark.parametrize("collective", ["butterfly", "ring"])
def test_secure_rounds_commit_the_exact_fixed_point_sum(procs, collective):
    reports, _ = _run(procs, 4, 2, collective=collective)
    assert len({r["last_digest"] for r in reports}) == 1
    for rep in reports:
        assert rep["committed"] == 2
        res = _results(rep, procs.workdir, rep["rank"])
        for rnd in range(2):
            np.testing.assert_array_equal(res[f"r{rnd}"], secure_sum(range(4), rnd))


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_participant_lost_after_sending_costs_no_retry_and_one_lost_before_sending_one(procs, how):
    """Rank 5 dies (SIGKILL) or stops (SIGSTOP: silent, its streams open) in round 1 once its
    masked row is summed: after sending, so the survivors unmask the sum from its neighbours'
    shares, vote it, and the coordinator commits that attempt without rank 5's vote, its
    contribution in the sum. Rank 4
    dies (SIGKILL) in round 2 once it holds its neighbours' shares, before sending: the all-reduce
    cannot complete, so the round is retried once and commits exactly the survivors' secure sum."""
    reports, coord_log = _run(procs, 6, 3, faults={5: f"secagg-sent:{how}@1", 4: "secagg-shared:kill@2"})
    assert len({r["last_digest"] for r in reports}) == 1
    # Round 1's first attempt: every survivor unmasked the sum from the 5 survivors' reveals (rank 5
    # vanished after sending, so its self mask came off with its neighbours' shares), and voted it.
    first = [x for rep in reports for x in rep["rounds"] if (x["round"], x["attempt"]) == (1, 0)]
    assert len(first) == 4 and {x["secure_revealed"] for x in first} == {5}
    assert "round 1.0 commits without the votes of" in coord_log, coord_log[-3000:]
    for rep in reports:
        assert rep["committed"] == 3
        res = _results(rep, procs.workdir, rep["rank"])
        np.testing.assert_array_equal(res["r0"], secure_sum(range(6), 0))
        np.testing.assert_array_equal(res["r1"], secure_sum(range(6), 1))  # rank 5's row is in
        np.testing.assert_array_equal(res["r2"], secure_sum(range(4), 2))
        attempts = {(x["round"], x["attempt"]) for x in rep["rounds"]}
        assert [a for a in attempts if a[0] == 1] == [(1, 0)], attempts
        assert len([a for a in attempts if a[0] == 2]) <= 2, attempts


def test_a_peer_requiring_secure_aggregation_leaves_a_run_without_it(procs, tmp_path):
    _, addr = procs.coordinator("--rounds", "1")
    out = shoal("peer", "--insecure", "--coordinator", addr, "--key", str(tmp_path / "p.key"),
                "--require-secure-aggregation", "--connect-timeout", "10", timeout=60)
    assert out.returncode == cli.EXIT_USAGE, out.stderr
    line = one_line_error(out)
    assert "secure_aggregation off" in line and "--require-secure-aggregation" in line, line


def test_a_secure_fedavg_swarm_goes_on_through_a_drop_after_and_one_before_sending(tmp_path):
    """`shoal swarm --algorithm fedavg --peers 6 --secure-aggregation` on
    examples/scenarios/secure-dropouts.toml: peer 5 kills itself after sending in round 3, peer 4
    before sending in round 6. Round 3 commits in its first attempt with all six contributions,
    round 6 after one retry with four; the swarm carries on without them (a peer killed as its
    scenario says is no failure of the run) and commits all 10 rounds, 0 digest mismatches."""
    summary = tmp_path / "s.json"
    proc = run_to_end(
        [sys.executable, "-m", "shoal.cli", "swarm", "--algorithm", "fedavg", "--peers", "6", "--rounds", "10",
         "--secure-aggregation", "--scenario", str(SCENARIOS / "secure-dropouts.toml"), "--summary", str(summary),
         "--workdir", str(tmp_path / "wd"), "--no-progress", "--timeout", "240"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads(summary.read_text())
    assert s["ok"] and s["rounds_committed"] == 10 and s["digest_mismatches"] == 0
    by_round = {}
    for r in s["rounds"]:
        by_round.setdefault(r["round"], []).append(r)
    assert [(r["attempt"], r["status"], r["participants"]) for r in by_round[3]] == [
        (0, "committed", [0, 1, 2, 3, 4, 5])]
    assert [r["status"] for r in by_round[6]] == ["aborted", "committed"] and by_round[6][1]["participants"] == [0, 1, 2, 3]
    assert "lost before voting" in by_round[6][0]["reason"]
