"""Differential privacy in a real swarm (processes, gRPC on loopback): the ε the summary reports
after every committed round is what dp-accounting computes for the run's noise multiplier,
sampling and rounds (in the clear and under secure aggregation, where the distributed noise is
what hides each contribution's 1/p share), and an ε budget stops the run before the round that
would exceed it."""

from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("dp_accounting", reason="the privacy extra (dp-accounting) is not installed")
from dp_accounting import dp_event  # noqa: E402
from dp_accounting.rdp import RdpAccountant  # noqa: E402

from kits.procs import run_to_end
from shoal.common.privacy import RDP_ORDERS  # noqa: E402


def library_epsilon(sigma: float, rounds: int, delta: float) -> float:
    acc = RdpAccountant(RDP_ORDERS)
    acc.compose(dp_event.GaussianDpEvent(sigma), rounds)
    return acc.get_epsilon(delta)


def swarm(tmp_path, *args: str) -> dict:
    summary = tmp_path / "s.json"
    proc = run_to_end(
        [sys.executable, "-m", "shoal.cli", "swarm", "--peers", "3", "--algorithm", "fedavg", "--inner-steps", "10",
         "--max-norm", "2", "--dp-mode", "distributed", "--summary", str(summary), "--no-progress",
         "--workdir", str(tmp_path / "wd"), *args],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(summary.read_text())


@pytest.mark.soak
@pytest.mark.parametrize("secure", [(), ("--secure-aggregation",)], ids=["clear", "secure-aggregation"])
def test_reported_epsilon_is_the_library_s_after_every_round(tmp_path, secure):
    s = swarm(tmp_path, "--rounds", "4", "--dp-sigma", "0.8", "--dp-delta", "1e-6", *secure)
    assert s["rounds_committed"] == 4 and s["digest_mismatches"] == 0
    assert s.get("secure_aggregation", False) == bool(secure)
    assert s["epsilon_by_round"] == {str(r): library_epsilon(0.8, r + 1, 1e-6) for r in range(4)}
    assert s["epsilon"] == library_epsilon(0.8, 4, 1e-6)


@pytest.mark.soak
def test_an_epsilon_budget_stops_the_run_before_it_is_exceeded(tmp_path):
    budget = library_epsilon(1.0, 2, 1e-5) + 1e-6  # room for two rounds, not three
    s = swarm(tmp_path, "--rounds", "6", "--dp-sigma", "1.0", "--dp-epsilon-budget", str(budget))
    assert s["rounds_committed"] == 2 and s["epsilon"] <= budget and s["privacy_budget_spent"] and s["ok"]
