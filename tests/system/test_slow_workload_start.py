"""A peer whose workload takes longer than a lease to build (a dataset to read, a model to
allocate, a busy machine) keeps its membership: it renews its lease from Join on, so the
coordinator drops nobody and the run commits with the members it admitted."""

from __future__ import annotations

import sys
import textwrap

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

PEER = textwrap.dedent("""
    import asyncio, sys, time
    from shoal.peer.agent import PeerAgent, PeerConfig
    from shoal.peer.workloads.digits import DigitsWorkload

    def slow(cfg, shard=int(sys.argv[3])):
        time.sleep(float(sys.argv[4]))  # longer than the coordinator's lease
        return DigitsWorkload(cfg, shard)

    config = PeerConfig(coordinator=sys.argv[1], key_path=sys.argv[2], data_shard=int(sys.argv[3]))
    summary = asyncio.run(PeerAgent(config, slow).run())
    print("rounds", summary["rounds"])
""")


def test_a_workload_slower_than_a_lease_to_build_keeps_the_membership(procs, tmp_path):
    _, addr = procs.coordinator("--lease-seconds", "2", "--min-peers", "2", "--rounds", "2", "--inner-steps", "5")
    peers = [procs.start(f"peer-{i}", [sys.executable, "-c", PEER, addr, str(tmp_path / f"peer-{i}.key"), str(i), "4"])
             for i in range(2)]
    for p in peers:
        assert procs.wait_exit(p, 90) == 0, procs.log(p.name)[-2000:]
        assert "rounds 2" in procs.log(p.name), procs.log(p.name)[-2000:]
    log = procs.log("coordinator")
    assert "run finished" in log, log[-3000:]
    assert "dropped (lease expired or left)" not in log.split("run finished")[0], log[-3000:]
