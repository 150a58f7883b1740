"""One contract for every Store backend (in memory, SQLite on disk)."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import sqlite3

import pytest

from shoal.coordinator.rounds import AbortRecord, CommitRecord, Member, MemberState
from shoal.coordinator.etcd_store import EtcdStore, EtcdTarget
from shoal.coordinator.store import (APPLICATION_ID, PAGE_CACHE_KIB, SCHEMA_VERSION, MemoryStore, SQLiteStore,
                                    StateFileError)

from etcdserver import etcd_server  # noqa: F401 - the fixture


@pytest.fixture(params=["memory", "sqlite", pytest.param("etcd", marks=pytest.mark.integration)])
def make_store(request, tmp_path):
    path = str(tmp_path / "state.db")
    if request.param == "memory":
        shared = MemoryStore()
        yield lambda: shared
    elif request.param == "etcd":  # a real etcd server (skipped when etcd is not installed)
        server = request.getfixturevalue("etcd_server")
        target = EtcdTarget.parse(server.url())
        opened = []

        def make():
            s = EtcdStore(target)
            opened.append(s)
            return s

        yield make
        for s in opened:
            s.close()
    else:
        opened = []

        def make():
            s = SQLiteStore(path)
            opened.append(s)
            return s

        yield make
        for s in opened:
            s.close()


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


def test_sqlite_uses_wal(tmp_path):
    s = SQLiteStore(str(tmp_path / "x.db"))
    try:
        assert s._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        s.close()


def test_state_file_of_an_earlier_version_loads(tmp_path):
    """The stored form is unchanged: a file written by the raw SQL of an earlier version loads."""
    path = str(tmp_path / "old.db")
    SQLiteStore(path).close()
    db = sqlite3.connect(path)
    with db:
        db.execute("INSERT INTO members VALUES ('a', ?, 'h:1', 3, 'member'), ('b', ?, 'h:2', 4, 'syncing'), "
                   "('c', ?, 'h:3', 5, 'pending')", (b"k" * 32,) * 3)
        db.execute("INSERT INTO commits VALUES (0, 2, ?, ?, '[\"a\", \"b\"]', 0.5, 0.1, '[]', 1.0)", (b"r", b"s"))
    db.close()
    s = SQLiteStore(path)
    try:
        assert {m.peer_id: m.state for m in s.load_members()} == {
            "a": MemberState.MEMBER, "b": MemberState.SYNCING, "c": MemberState.PENDING}
        assert s.load_commits() == [CommitRecord(0, 2, b"r", b"s", ("a", "b"), 0.5, 0.1, (), 1.0)]
    finally:
        s.close()


def test_reader_sees_a_live_writer_and_cannot_write(tmp_path):
    path = str(tmp_path / "live.db")
    writer = SQLiteStore(path)
    try:
        writer.save_commit(rec(0))
        with SQLiteStore.reader(path) as reader:
            assert reader.count_commits() == 1
            writer.save_commit(rec(1))  # the reader never blocks the coordinator's writes
            writer.save_abort(AbortRecord(2, 0, "x", ("a",), True, 2.0))
            assert (reader.count_commits(), reader.count_aborts()) == (2, 1) and reader.last_commit() == rec(1)
            with pytest.raises(sqlite3.OperationalError):
                reader.save_epoch(3)
    finally:
        writer.close()
    with pytest.raises(sqlite3.OperationalError):
        SQLiteStore.reader(str(tmp_path / "missing.db"))


def test_recent_commits_and_aborts_are_the_newest_oldest_first(make_store):
    s = make_store()
    for r in range(5):
        s.save_commit(rec(r))
        s.save_abort(AbortRecord(r, 1, f"x{r}", ("a",), True, 2.0))
    s2 = make_store()
    assert s2.recent_commits(2) == [rec(3), rec(4)] and s2.recent_commits(99) == [rec(r) for r in range(5)]
    assert [a.reason for a in s2.recent_aborts(3)] == ["x2", "x3", "x4"] and s2.recent_aborts(0) == []


# ------------------------------------------------------------------ a state file the coordinator must refuse


def filled(path: str, commits: int = 300) -> None:
    s = SQLiteStore(path)
    for i in range(10):
        s.save_member(Member(f"{i:064x}", b"k" * 32, f"h:{i}", 5, 0.0, MemberState.MEMBER))
    for r in range(commits):
        s.save_commit(CommitRecord(r, 0, b"r" * 32, b"s" * 32, tuple(f"{i:064x}" for i in range(4)), 0.5, 0.1))
    s.set_meta("run_config", "{}")
    s.close()


def test_a_state_file_truncated_to_half_is_refused_naming_the_file(tmp_path):
    path = str(tmp_path / "state.db")
    filled(path)
    size = os.path.getsize(path)
    os.truncate(path, size // 2)
    with pytest.raises(StateFileError) as err:
        SQLiteStore(path)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"state file {path} is damaged")
    assert "--state-backup" in msg and "--state-recover" in msg
    assert os.path.getsize(path) == size // 2  # nothing written to it


@pytest.mark.parametrize("make, problem", [
    (lambda p: pathlib.Path(p).write_text("not sqlite at all " * 100), "is not a SQLite database"),
    (lambda p: _sql(p, "CREATE TABLE invoices (id INTEGER)"), "holds tables invoices"),
    (lambda p: _sql(p, "PRAGMA application_id = 42"), "belongs to another application"),
    (lambda p: (SQLiteStore(p).close(), _sql(p, "PRAGMA user_version = 99")), "newer Shoal (schema version 99"),
])
def test_a_foreign_or_newer_file_is_refused(tmp_path, make, problem):
    path = str(tmp_path / "x.db")
    make(path)
    with pytest.raises(StateFileError) as err:
        SQLiteStore(path)
    assert problem in str(err.value) and path in str(err.value)


def _sql(path: str, sql: str) -> None:
    db = sqlite3.connect(path)
    db.execute(sql)
    db.commit()
    db.close()


def test_a_file_of_an_earlier_version_is_stamped_with_the_schema(tmp_path):
    path = str(tmp_path / "old.db")
    _sql(path, "CREATE TABLE commits (round INTEGER PRIMARY KEY, attempt INTEGER NOT NULL, result_digest BLOB "
               "NOT NULL, state_digest BLOB NOT NULL, participants TEXT NOT NULL, train_loss REAL NOT NULL, "
               "seconds REAL NOT NULL, flagged TEXT NOT NULL, at REAL NOT NULL)")
    SQLiteStore(path).close()
    db = sqlite3.connect(path)
    assert (db.execute("PRAGMA application_id").fetchone()[0], db.execute("PRAGMA user_version").fetchone()[0]) == (
        APPLICATION_ID, SCHEMA_VERSION)
    db.close()


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
    from shoal.coordinator.membership import Membership

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


def test_a_schema_1_state_file_opens_and_gains_the_memberships_table(tmp_path):
    import sqlite3

    path = str(tmp_path / "old.db")
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE members (peer_id TEXT PRIMARY KEY, public_key BLOB NOT NULL, address TEXT NOT NULL,
            num_samples INTEGER NOT NULL, state TEXT NOT NULL);
        CREATE TABLE commits (round INTEGER PRIMARY KEY, attempt INTEGER NOT NULL, result_digest BLOB NOT NULL,
            state_digest BLOB NOT NULL, participants TEXT NOT NULL, train_loss REAL NOT NULL,
            seconds REAL NOT NULL, flagged TEXT NOT NULL, at REAL NOT NULL);
        CREATE TABLE aborts (id INTEGER PRIMARY KEY AUTOINCREMENT, round INTEGER NOT NULL, attempt INTEGER NOT NULL,
            reason TEXT NOT NULL, excluded TEXT NOT NULL, will_retry INTEGER NOT NULL, at REAL NOT NULL);
        PRAGMA user_version = 1;
        INSERT INTO meta VALUES ('epoch', '4');
    """)
    db.close()
    with SQLiteStore.reader(path) as r:
        assert r.load_memberships() == []  # a read-only view of the old file: none, no error
    s = SQLiteStore(path)
    assert s.load_epoch() == 4 and s.load_memberships() == []
    s.close()
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    db.close()


def test_a_writing_store_keeps_a_small_page_cache_a_reader_the_default(tmp_path):
    path = str(tmp_path / "c.db")
    with SQLiteStore(path) as store:
        assert store._db.execute("PRAGMA cache_size").fetchone()[0] == -PAGE_CACHE_KIB
        with SQLiteStore.reader(path) as reader:
            assert reader._db.execute("PRAGMA cache_size").fetchone()[0] == -2000  # SQLite's default
