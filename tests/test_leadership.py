"""Standby coordinators on etcd: one leader at a time, fenced writes, failover; against a real
etcd server (skipped when the `etcd` binary is not installed)."""

from __future__ import annotations

import asyncio

import pytest

from shoal.coordinator.etcd_store import EtcdStore, EtcdTarget, NotLeader
from shoal.coordinator.leadership import Leadership
from shoal.coordinator.rounds import CommitRecord

from etcdserver import etcd_server  # noqa: F401 - the fixture

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
