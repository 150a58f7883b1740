"""Every peer behind NAT, plus a relay (docs/nat.md, "Relays"): `shoal swarm` with
examples/scenarios/nat-all-relay.toml in network namespaces (root). Nobody can dial anybody, so
the swarm starts a relay on the bed's public side and the peers with --relay; they join through
it, rounds commit with every digest equal, and the relay's byte count matches the chunk bytes the
plans sent through it. Nothing is left behind. Under -m soak: the relay killed and started again
(nat-relay-restart.toml), one of two relays killed (nat-relay-failover.toml), and a direct
peer whose data ports go dark mid-run (black-hole-at-30s.toml: reachability followed during the
run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kits.requires import needs_iptables

from kits.procs import scenario_swarm

pytestmark = [
    pytest.mark.integration,
    pytest.mark.netns,
    pytest.mark.timeout(600),
    pytest.mark.usefixtures("netbed_available"),  # skips where namespaces cannot be made
]

SCENARIO = Path(__file__).resolve().parents[2] / "examples" / "scenarios" / "nat-all-relay.toml"


@needs_iptables
def test_all_peers_behind_nat_train_through_a_relay(tmp_path):
    s, wd = scenario_swarm(tmp_path, SCENARIO, "--peers", "4", "--rounds", "8")
    assert s["rounds_committed"] == 8 and s["digest_mismatches"] == 0
    assert s["relayed_plan_bytes"] > 0
    # Both count the same chunks; the relay also carries gRPC framing, handshakes and dial-backs.
    assert s["relayed_plan_bytes"] <= s["relayed_bytes"] <= 1.25 * s["relayed_plan_bytes"]
    log = (wd / "coordinator.log").read_text()
    assert log.count(f"relayed via {s['relay']}") >= 4  # every peer joined through the relay


RESTART = SCENARIO.parent / "nat-relay-restart.toml"
FAILOVER = SCENARIO.parent / "nat-relay-failover.toml"


@needs_iptables
@pytest.mark.soak
def test_a_relay_killed_and_started_again_on_its_port_carries_the_rounds_again(tmp_path):
    """Every peer behind NAT, the one relay kill -9 at 40 s and started again 5 s later: the peers
    register again by themselves (the same relayed ports), the first commit follows within 15 s of
    the restart, and the outage excludes nobody (the aborts blame the relay)."""
    s, wd = scenario_swarm(tmp_path, RESTART, "--peers", "4", "--rounds", "150")
    assert s["rounds_committed"] == 150 and s["digest_mismatches"] == 0
    start = next(e for e in s["events"] if e["action"] == "relay-start")
    assert start["next_commit_seconds"] is not None, start
    assert start["done_after_start_seconds"] + start["next_commit_seconds"] <= start["at"] + 15.0, start
    assert s["wrongful_exclusions"] == 0
    assert all(not r["excluded"] for r in s["rounds"] if r["status"] == "aborted"), s["rounds"]


@needs_iptables
@pytest.mark.soak
def test_with_two_relays_killing_one_moves_its_peers_to_the_other(tmp_path):
    """Every peer behind NAT, two relays, relay 0 kill -9 at 40 s for good: its peers register at
    relay 1, join again with the new address, and the commits go on (the longest gap after the
    kill under 10 s); nobody is excluded for the move."""
    # 150 rounds: the run must still be going at the kill (40 s) however fast the machine is
    s, wd = scenario_swarm(tmp_path, FAILOVER, "--peers", "4", "--rounds", "150", "--relays", "2")
    assert s["rounds_committed"] == 150 and s["digest_mismatches"] == 0
    kill = next(e for e in s["events"] if e["action"] == "relay-kill")
    assert kill["max_commit_gap_seconds_30s"] is not None and kill["max_commit_gap_seconds_30s"] < 10.0, kill
    assert s["wrongful_exclusions"] == 0
    moved = [p for p in range(4) if "advertising the relayed address" in (wd / f"peer-{p}.log").read_text()]
    assert len(moved) == 2, moved  # the two peers that preferred relay 0


BLACK_HOLE = SCENARIO.parent / "black-hole-at-30s.toml"


@needs_iptables
@pytest.mark.soak
def test_a_peer_whose_data_ports_go_dark_mid_run_is_made_outbound_only(tmp_path):
    """Four direct peers, peer 3's listening ports black-holed at 30 s (every inbound packet to
    them dropped, established connections too): the failed votes name it, the coordinator dials it
    back, finds its address dead and plans it outbound-only; at most 3 aborts, all within 15 s of
    the black hole, and the peer still takes part in the last round."""
    s, wd = scenario_swarm(tmp_path, BLACK_HOLE, "--peers", "4", "--rounds", "80")
    assert s["rounds_committed"] == 80 and s["digest_mismatches"] == 0
    assert s["rounds_aborted"] <= 3, [r for r in s["rounds"] if r["status"] == "aborted"]
    log = (wd / "coordinator.log").read_text()
    assert "stopped answering at its data address" in log
    aborts = [r for r in s["rounds"] if r["status"] == "aborted"]
    assert all(r["at_seconds"] is not None and r["at_seconds"] < 30.0 + 15.0 for r in aborts), aborts
    last = [r for r in s["rounds"] if r["status"] == "committed"][-1]
    assert 3 in last["participants"], last  # it goes on training, outbound-only
