"""The shard partition (peer/partition.py): pure bookkeeping of who reduces, audits, sends and
receives which chunk of a plan. No sockets."""

from __future__ import annotations

import dataclasses

import pytest

from shoal.common.plan import Plan
from shoal.peer.partition import ShardPartition, chunk_elements

IDS = ("a", "b", "c", "d", "e")


def _plan(n: int, shard_owner: tuple[int, ...], *, p: int = 4, chunk_bytes: int = 64, audit: bool = False,
          collective: str = "butterfly") -> Plan:
    shards = len(shard_owner)
    return Plan(participants=IDS[:p], collective=collective, shard_bounds=tuple(n * k // shards for k in range(shards + 1)),
                shard_owner=shard_owner, chunk_bytes=chunk_bytes, audit_owners=audit)


PLANS = [
    _plan(203, (0, 1, 2, 3)),
    _plan(203, (0, 1, 2, 3), audit=True),
    _plan(160, (0, 1, 3), audit=True),  # position 2 owns nothing (a demoted peer)
    _plan(97, (2, 0, 2, 1), audit=True),  # several shards per owner, out of order
    _plan(3, (0, 1, 2, 3)),  # empty shards: no chunks
    _plan(1000, (4, 3, 2, 1, 0), p=5, chunk_bytes=4096),
]


def test_chunk_elements_is_the_uncompressed_dtype_bound_and_at_least_one():
    assert chunk_elements(1 << 20, 4) == 262144
    assert chunk_elements(1 << 20, 2) == 524288
    assert chunk_elements(3, 4) == 1


@pytest.mark.parametrize("plan", PLANS)
def test_chunks_tile_every_shard_in_order_within_the_chunk_bound(plan):
    part = ShardPartition(plan, plan.participants[0], 4)
    assert part.chunk_elems == plan.chunk_bytes // 4
    covered = []
    for k in range(part.num_shards):
        lo, hi = part.shard_span(k)
        spans = part.chunks(k)
        assert [s.lo for s in spans] == list(range(lo, hi, part.chunk_elems))
        for s in spans:
            assert s.shard == k and s.offset == s.lo - lo and 1 <= s.size <= part.chunk_elems and s.hi <= hi
        covered += [i for s in spans for i in range(s.lo, s.hi)]
    assert covered == list(range(part.num_elements))


def test_roles_of_each_participant():
    plan = _plan(160, (0, 1, 3), audit=True)  # auditors: shard 0 -> 1, shard 1 -> 3, shard 2 (owner 3) -> 0
    assert plan.auditors() == (1, 3, 0)
    roles = {pid: ShardPartition(plan, pid, 4) for pid in plan.participants}
    assert [roles[p].owned for p in "abcd"] == [(0,), (1,), (), (2,)]
    assert [roles[p].audited for p in "abcd"] == [(2,), (0,), (), (1,)]
    assert roles["c"].gathered == (0, 1, 2) and roles["a"].gathered == (1, 2)
    assert roles["a"].recipients(0) == (1,)  # its own shard goes only to its auditor
    assert roles["c"].recipients(1) == (1, 3)  # owner, then auditor
    assert roles["a"].other_owners() == (1, 3) and roles["c"].other_owners() == (0, 1, 3)
    unaudited = ShardPartition(dataclasses.replace(plan, audit_owners=False), "a", 4)
    assert unaudited.audited == () and unaudited.recipients(0) == () and unaudited.recipients(1) == (1,)
    with pytest.raises(ValueError):
        ShardPartition(plan, "z", 4)


def test_scatter_starts_with_its_own_shards_then_the_next_owner():
    plan = _plan(100, (0, 1, 2, 3))
    assert ShardPartition(plan, "b", 4).scatter_order() == (1, 2, 3, 0)
    assert ShardPartition(plan, "d", 4).scatter_order() == (3, 0, 1, 2)
    two = _plan(100, (2, 0, 2, 1))
    assert ShardPartition(two, "b", 4).scatter_order() == (3, 0, 2, 1)  # then owner 2 (both shards, in order)


@pytest.mark.parametrize("plan", PLANS)
def test_what_one_side_sends_is_what_the_other_side_expects(plan):
    parts = [ShardPartition(plan, pid, 4) for pid in plan.participants]
    for i, a in enumerate(parts):
        out = a.sends()
        for j, b in enumerate(parts):
            if i != j:
                assert out.chunks[j] == b.receives().chunks[i], (i, j)
                assert out.nbytes[j] == b.receives().nbytes[i], (i, j)


@pytest.mark.parametrize("plan", [pl for pl in PLANS if not pl.audit_owners])
def test_received_bytes_without_audit(plan):
    # Unaudited: the other p-1 rows of the shards it owns, and every shard it does not own, once.
    p, n = plan.size, plan.shard_bounds[-1]
    for pid in plan.participants:
        part = ShardPartition(plan, pid, 4)
        mine = sum(part.shard_span(k)[1] - part.shard_span(k)[0] for k in part.owned)
        assert part.receives().total_bytes == 4 * ((p - 1) * mine + (n - mine))


@pytest.mark.parametrize("p", [2, 3, 5])
def test_ring_schedule_passes_each_shard_once_around(p):
    plan = _plan(100, tuple(range(p)), p=p, collective="ring")
    parts = [ShardPartition(plan, pid, 4) for pid in plan.participants]
    for i, me in enumerate(parts):
        prev = parts[(i - 1) % p]
        # What this position adds at step s is what its predecessor sent it: its first shard at
        # step 0, the shard it added at step s-1 afterwards.
        assert me.ring_reduced(0) == prev.ring_first()
        assert all(me.ring_reduced(s) == prev.ring_reduced(s - 1) for s in range(1, p - 1))
        # The all-gather starts from the shard the predecessor finished, then relays.
        assert me.ring_gathered(0) == prev.ring_reduced(p - 2)
        assert all(me.ring_gathered(s) == prev.ring_gathered(s - 1) for s in range(1, p - 1))
        # Over both phases it holds every shard once reduced: finished here or received.
        assert {me.ring_reduced(p - 2)} | {me.ring_gathered(s) for s in range(p - 1)} == set(range(p))
    for k in range(p):  # every position contributes to every shard exactly once
        adders = [i for i, me in enumerate(parts) if me.ring_first() == k]
        adders += [i for i, me in enumerate(parts) for s in range(p - 1) if me.ring_reduced(s) == k]
        assert sorted(adders) == list(range(p))
