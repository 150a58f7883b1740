"""One contract for every Store backend: the tests here take a `make_store` fixture (each call
opens the store again on the same data) and run wherever it is defined: in memory and SQLite on
disk in tests/unit/test_store.py, a real etcd server in tests/system/test_store_etcd.py. A module
collects them with `from kits.store_contract import *`."""

from __future__ import annotations

import dataclasses

import pytest

from shoal.coordinator.rounds import AbortRecord, CommitRecord, Member, MemberState
from shoal.coordinator.store import MemoryStore

def rec(r: int) -> CommitRecord:
    return CommitRecord(r, 0, b"r%d" % r, b"s%d" % r, ("a", "b"), 0.5, 0.1, ("b",), 1.0)


def test_commits_survive_reopen_in_order(make_store):
    s = make_store()
    for r in range(3):
        s.save_commit(rec(r))
    s.save_abort(AbortRecord(3, 0, "x", ("a",), True, 2.0))
    s2 = make_store()
    assert s2.load_commits() == [rec(0), rec(1), rec(2)]
    assert s2.count_aborts() == 1
    assert s2.count_commits() == 3 and s2.last_commit() == rec(2)


def test_an_empty_store_has_no_last_commit(make_store):
    s = make_store()
    assert s.count_commits() == 0 and s.last_commit() is None and s.count_aborts() == 0


def test_double_commit_of_a_round_is_refused(make_store):
    s = make_store()
    s.save_commit(rec(0))
    with pytest.raises(ValueError):
        s.save_commit(rec(0))
    assert len(make_store().load_commits()) == 1


def test_members_epoch_and_meta(make_store):
    s = make_store()
    s.save_member(Member("a", b"k" * 32, "h:1", 5, 0.0, MemberState.MEMBER))
    s.save_member(Member("b", b"j" * 32, "h:2", 6, 0.0, MemberState.PENDING))
    s.forget_member("b")
    s.save_epoch(7)
    s.set_meta("run_config", "{}")
    s2 = make_store()
    (m,) = s2.load_members()
    assert (m.peer_id, m.public_key, m.address, m.num_samples, m.state) == ("a", b"k" * 32, "h:1", 5,
                                                                             MemberState.MEMBER)
    assert s2.load_epoch() == 7 and s2.get_meta("run_config") == "{}" and s2.get_meta("nope") is None


def test_member_states_are_stored_as_their_labels(make_store):
    s = make_store()
    for i, state in enumerate(MemberState):
        s.save_member(Member(f"p{i}", b"k" * 32, "h:1", 1, 0.0, state))
    got = {m.peer_id: m.state for m in make_store().load_members()}
    # A restarted coordinator forgets who was lagging or catching up: every peer reconnects anyway.
    assert [got[f"p{i}"] for i in range(len(MemberState))] == [MemberState.from_label(s.label) for s in MemberState]
    assert set(got.values()) == {MemberState.PENDING, MemberState.SYNCING, MemberState.MEMBER}


def test_a_rewind_drops_the_commits_of_the_rounds_it_goes_back_over(make_store):
    s = make_store()
    for r in range(12):
        s.save_commit(rec(r))
    s.save_abort(AbortRecord(11, 0, "x", ("a",), True, 2.0))
    assert s.rewind(10) == 2
    s2 = make_store()
    assert s2.load_commits() == [rec(r) for r in range(10)] and s2.last_commit() == rec(9)
    assert s2.count_commits() == 10 and s2.count_aborts() == 1
    s2.save_commit(rec(10))  # the round is played again
    assert make_store().recent_commits(2) == [rec(9), rec(10)] and s2.rewind(11) == 0


def test_recent_commits_and_aborts_are_the_newest_oldest_first(make_store):
    s = make_store()
    for r in range(5):
        s.save_commit(rec(r))
        s.save_abort(AbortRecord(r, 1, f"x{r}", ("a",), True, 2.0))
    s2 = make_store()
    assert s2.recent_commits(2) == [rec(3), rec(4)] and s2.recent_commits(99) == [rec(r) for r in range(5)]
    assert [a.reason for a in s2.recent_aborts(3)] == ["x2", "x3", "x4"] and s2.recent_aborts(0) == []


# ------------------------------------------------------------------ a state file the coordinator must refuse


def test_a_batch_is_one_transaction(make_store):
    s = make_store()
    with s.batch():
        s.save_commit(rec(0))
        s.save_epoch(3)
    with pytest.raises(RuntimeError):
        with s.batch(durable=False):
            s.save_member(Member("a", b"k" * 32, "h:1", 5, 0.0, MemberState.MEMBER))
            raise RuntimeError("boom")
    with s.batch(durable=False):
        s.save_member(Member("b", b"k" * 32, "h:2", 5, 0.0, MemberState.MEMBER))
    s2 = make_store()
    assert s2.count_commits() == 1 and s2.load_epoch() == 3
    if not isinstance(s2, MemoryStore):  # the in-memory store has no transactions to roll back
        assert [m.peer_id for m in s2.load_members()] == ["b"]


def test_memberships_survive_reopen_and_revocation_sticks(make_store):
    from shoal.coordinator.admitted_keys import Membership

    s = make_store()
    a = Membership("a" * 32, b"\x01" * 32, "alice", 10.0, 20.0)
    b = Membership("b" * 32, b"\x02" * 32, "open", 11.0, 11.0)
    with s.batch():
        s.save_membership(a)
        s.save_membership(b)
    s.save_membership(dataclasses.replace(a, revoked_at=30.0))
    s.forget_membership(b.peer_id)
    s2 = make_store()
    assert s2.load_memberships() == [dataclasses.replace(a, revoked_at=30.0)]
    assert s2.load_members() == []  # memberships are not live members


