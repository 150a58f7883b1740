"""Every peer behind NAT, plus a relay (docs/nat.md, "Relays"): `shoal swarm` with
examples/scenarios/nat-all-relay.toml in network namespaces (root). Nobody can dial anybody, so
the swarm starts a relay on the bed's public side and the peers with --relay; they join through
it, rounds commit with every digest equal, and the relay's byte count matches the chunk bytes the
plans sent through it. Nothing is left behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.integration,
    pytest.mark.netns,
    pytest.mark.timeout(600),
    pytest.mark.usefixtures("netbed_available"),  # skips where namespaces cannot be made
]

SCENARIO = Path(__file__).resolve().parent.parent / "examples" / "scenarios" / "nat-all-relay.toml"


def test_all_peers_behind_nat_train_through_a_relay(tmp_path):
    summary, wd = tmp_path / "s.json", tmp_path / "wd"
    proc = subprocess.Popen(
        [sys.executable, "-m", "shoal.cli", "swarm", "--peers", "4", "--rounds", "8", "--scenario", str(SCENARIO),
         "--summary", str(summary), "--workdir", str(wd), "--no-progress", "--timeout", "400"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=540)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert proc.returncode == 0, out[-3000:]
    s = json.loads(summary.read_text())
    assert s["rounds_committed"] == 8 and s["digest_mismatches"] == 0
    assert s["relayed_plan_bytes"] > 0
    # Both count the same chunks; the relay also carries gRPC framing, handshakes and dial-backs.
    assert s["relayed_plan_bytes"] <= s["relayed_bytes"] <= 1.25 * s["relayed_plan_bytes"]
    log = (wd / "coordinator.log").read_text()
    assert log.count(f"relayed via {s['relay']}") >= 4  # every peer joined through the relay
    leftovers = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    assert f"shls-{proc.pid}-" not in leftovers
