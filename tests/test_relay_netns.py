"""Every peer behind NAT, plus a relay (docs/nat.md, "Relays"): `shoal swarm` with
examples/scenarios/nat-all-relay.toml in network namespaces (root). Nobody can dial anybody, so
the swarm starts a relay on the bed's public side and the peers with --relay; they join through
it, rounds commit with every digest equal, and the relay's byte count matches the chunk bytes the
plans sent through it. Nothing is left behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from procs import scenario_swarm

pytestmark = [
    pytest.mark.integration,
    pytest.mark.netns,
    pytest.mark.timeout(600),
    pytest.mark.usefixtures("netbed_available"),  # skips where namespaces cannot be made
]

SCENARIO = Path(__file__).resolve().parent.parent / "examples" / "scenarios" / "nat-all-relay.toml"


def test_all_peers_behind_nat_train_through_a_relay(tmp_path):
    s, wd = scenario_swarm(tmp_path, SCENARIO, "--peers", "4", "--rounds", "8")
    assert s["rounds_committed"] == 8 and s["digest_mismatches"] == 0
    assert s["relayed_plan_bytes"] > 0
    # Both count the same chunks; the relay also carries gRPC framing, handshakes and dial-backs.
    assert s["relayed_plan_bytes"] <= s["relayed_bytes"] <= 1.25 * s["relayed_plan_bytes"]
    log = (wd / "coordinator.log").read_text()
    assert log.count(f"relayed via {s['relay']}") >= 4  # every peer joined through the relay
