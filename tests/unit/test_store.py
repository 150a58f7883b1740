"""The store contract (kits.store_contract) in memory and on SQLite, and the SQLite state file:
its schema, versions, damage and readers."""

from __future__ import annotations

import os
import pathlib
import sqlite3

import pytest

from shoal.coordinator.rounds import AbortRecord, CommitRecord, Member, MemberState
from shoal.coordinator.store import (APPLICATION_ID, PAGE_CACHE_KIB, SCHEMA_VERSION, MemoryStore, SQLiteStore,
                                    StateFileError)

from kits.store_contract import *  # noqa: F401,F403 - the contract's tests, run on make_store


@pytest.fixture(params=["memory", "sqlite"])
def make_store(request, tmp_path):
    if request.param == "memory":
        shared = MemoryStore()
        yield lambda: shared
        return
    opened = []

    def make():
        s = SQLiteStore(str(tmp_path / "state.db"))
        opened.append(s)
        return s

    yield make
    for s in opened:
        s.close()


def rec(r: int) -> CommitRecord:
    return CommitRecord(r, 0, b"r%d" % r, b"s%d" % r, ("a", "b"), 0.5, 0.1, ("b",), 1.0)


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


def test_a_new_state_file_is_private_to_its_owner(tmp_path):
    import os
    import stat

    from shoal.coordinator.store import SQLiteStore

    path = tmp_path / "shoal.db"
    store = SQLiteStore(str(path))
    try:
        store.save_epoch(1)
    finally:
        store.close()
    for f in tmp_path.iterdir():  # the file, and its -wal/-shm while they exist
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o600, f
