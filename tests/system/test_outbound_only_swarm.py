"""Outbound-only peers end to end (docs/nat.md): `shoal swarm` with real processes on 127.0.0.1,
two of four peers started with --outbound-only (scenario `outbound_only = true`): they take part in
the committed rounds, own no shard, and every digest agrees; also with mutual TLS on both planes
(the Exchange streams are then verified by certificate as well as by signature)."""

from __future__ import annotations

import json
import sys

import pytest

from kits.procs import run_to_end

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


# Plaintext outbound-only swarms also run in the default tier through tests/system/test_nat_netns.py (real
# NAT); this plaintext loopback case is kept for the long runs.
@pytest.mark.parametrize("security", [pytest.param("plaintext", marks=pytest.mark.soak), "tls"])
def test_outbound_only_peers_take_part_in_committed_rounds(tmp_path, security):
    path, summary, wd = tmp_path / "scenario.toml", tmp_path / "s.json", tmp_path / "wd"
    path.write_text("[[peer]]\n[[peer]]\noutbound_only = true\n[[peer]]\n[[peer]]\noutbound_only = true\n")
    proc = run_to_end(
        [sys.executable, "-m", "shoal.cli", "swarm", "--scenario", str(path), "--summary", str(summary),
         "--no-progress", "--workdir", str(wd), "--timeout", "400", "--peers", "4", "--rounds", "12",
         *(["--tls"] if security == "tls" else [])],
        capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads(summary.read_text())
    assert s["rounds_committed"] == 12 and s["digest_mismatches"] == 0
    events = {i: [json.loads(line) for line in (wd / f"peer-{i}.jsonl").read_text().splitlines()] for i in range(4)}
    ids = {i: evs[0]["peer"] for i, evs in events.items()}
    for i in (1, 3):
        committed = {e["round"] for e in events[i] if e["event"] == "commit"}
        assert len(committed) >= 11, (i, sorted(committed))
    plans = [e for e in events[0] if e["event"] == "plan"]
    assert plans
    for e in plans:
        assert sorted(e["outbound_only"]) == sorted([ids[1], ids[3]]) and e["collective"] == "butterfly"
        assert {ids[1], ids[3]} <= set(e["demoted"])
    log = (wd / "coordinator.log").read_text()
    assert log.count("outbound-only") >= 2  # the join lines say so
