"""Standby coordinators on etcd: one leader at a time, fenced writes, failover; against a real
etcd server (skipped when the `etcd` binary is not installed)."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys

import pytest

from shoal.coordinator.etcd_store import EtcdStore, EtcdTarget, NotLeader
from shoal.coordinator.leadership import Leadership
from shoal.coordinator.rounds import CommitRecord

from kits.etcdserver import etcd_server  # noqa: F401 - the fixture

# Starts an etcd server process: the integration tier.
pytestmark = pytest.mark.integration


def test_target_parsing():
    t = EtcdTarget.parse("etcd://10.0.0.1:2379,10.0.0.2:2379/shoal/run1")
    assert t.endpoints == ("10.0.0.1:2379", "10.0.0.2:2379") and t.prefix == "/shoal/run1"
    assert t.leader_key == b"/shoal/run1/leader"
    for bad in ("etcd://host/prefix", "etcd://h:1", "file.db", "etcd://h:x/p"):
        with pytest.raises(ValueError):
            EtcdTarget.parse(bad)


async def test_one_leader_a_standby_takes_over_and_the_deposed_leader_writes_nothing(etcd_server):
    target = EtcdTarget.parse(etcd_server.url())
    a = Leadership(target, "127.0.0.1:7001", ttl=1.0, poll=0.05)
    b = Leadership(target, "127.0.0.1:7002", ttl=1.0, poll=0.05)
    try:
        await asyncio.wait_for(a.campaign(), 10)
        standby = asyncio.create_task(b.campaign())
        await asyncio.sleep(0.5)
        assert not standby.done() and b.leader_address == "127.0.0.1:7001"
        old = EtcdStore(target, fence=a.fence)
        old.save_commit(CommitRecord(0, 0, b"r", b"s0", ("p",), 0.1, 0.1))
        # The leader stops renewing its lease (a stalled process): within the TTL the standby leads.
        await asyncio.wait_for(standby, 10)
        assert b.revision > a.revision
        new = EtcdStore(target, fence=b.fence)
        assert new.last_commit().state_digest == b"s0"  # the new leader sees the old leader's commits
        with pytest.raises(NotLeader):  # fenced: the deposed leader can write nothing
            old.save_commit(CommitRecord(1, 0, b"r", b"stale", ("p",), 0.1, 0.1))
        new.save_commit(CommitRecord(1, 0, b"r", b"s1", ("p",), 0.1, 0.1))
        assert [c.state_digest for c in new.load_commits()] == [b"s0", b"s1"]
        with pytest.raises(ValueError):
            new.save_commit(CommitRecord(1, 0, b"r", b"again", ("p",), 0.1, 0.1))
        old.close()
        new.close()
    finally:
        for x in (a, b):
            await x.resign()
            await x.close()


async def test_a_leader_that_renews_keeps_it_and_resigning_hands_over_at_once(etcd_server):
    target = EtcdTarget.parse(etcd_server.url())
    a = Leadership(target, "a:1", ttl=1.0, poll=0.05)
    b = Leadership(target, "b:1", ttl=1.0, poll=0.05)
    try:
        await asyncio.wait_for(a.campaign(), 10)
        keep = asyncio.create_task(a.keep())
        standby = asyncio.create_task(b.campaign())
        await asyncio.sleep(2.5)  # more than two TTLs: the renewals hold the lease
        assert not standby.done() and not keep.done()
        keep.cancel()
        await a.resign()
        await asyncio.wait_for(standby, 5)
        assert b.leader_address == "b:1"
    finally:
        for x in (a, b):
            await x.resign()
            await x.close()


def test_coordinators_of_a_prefix_must_share_the_ticket_key():
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from shoal.coordinator.daemon import _check_ticket_key
    from shoal.coordinator.store import MemoryStore, StateFileError

    store, key = MemoryStore(), Ed25519PrivateKey.generate()
    _check_ticket_key(store, key, "etcd://h:1/p")  # the first leader records its key
    _check_ticket_key(store, key, "etcd://h:1/p")
    with pytest.raises(StateFileError, match="same --key"):
        _check_ticket_key(store, Ed25519PrivateKey.generate(), "etcd://h:1/p")


@pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed (apt-get install etcd-server)")
@pytest.mark.soak  # half a minute; failover itself is test_one_leader_a_standby_takes_over... (default run)
@pytest.mark.timeout(900)
def test_swarm_with_two_coordinators_survives_the_leader_killed(tmp_path):

    summary = tmp_path / "s.json"
    proc = subprocess.run(
        [sys.executable, "-m", "shoal.cli", "swarm", "--coordinators", "2", "--chaos", "--rounds", "150",
         "--summary", str(summary), "--no-progress", "--workdir", str(tmp_path / "wd")],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads(summary.read_text())
    assert s["coordinators"] == 2 and s["coordinator_failovers"] >= 1 and s["failover_seconds_max"] > 0
    assert s["rounds_committed"] == 150 and s["digest_mismatches"] == 0
    # No committed round lost: every peer that committed a round recorded the same state for it,
    # and the rounds the peers committed are the coordinators' (0..59, none missing).
    rounds: dict[int, set[str]] = {}
    for f in (tmp_path / "wd").glob("peer-*.jsonl"):
        for line in f.read_text().splitlines():
            e = json.loads(line)
            if e["event"] == "commit":
                rounds.setdefault(e["round"], set()).add(e["state_digest"])
    assert sorted(rounds) == list(range(150)) and all(len(d) == 1 for d in rounds.values())


@pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed (apt-get install etcd-server)")
@pytest.mark.soak  # two minutes; the list's TLS name is tests/unit/test_relay_units.py
@pytest.mark.timeout(900)
def test_swarm_with_two_coordinators_over_tls_fails_over_within_seconds(tmp_path):
    """`shoal swarm --coordinators 2 --tls --chaos`: the peers dial the list of coordinators over
    TLS (each certificate checked against the list's first host), the leader is killed, a standby
    takes over within 10 s (4.6 s measured on an idle machine; docs/fault-tolerance.md) and every
    round commits with one digest."""
    summary = tmp_path / "s.json"
    proc = subprocess.run(
        [sys.executable, "-m", "shoal.cli", "swarm", "--coordinators", "2", "--tls", "--chaos", "--peers", "4",
         "--rounds", "40", "--summary", str(summary), "--no-progress", "--workdir", str(tmp_path / "wd")],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads(summary.read_text())
    assert s["coordinator_failovers"] >= 1 and 0 < s["failover_seconds_max"] < 10.0, s
    assert s["rounds_committed"] == 40 and s["digest_mismatches"] == 0
