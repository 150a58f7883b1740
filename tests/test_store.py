"""One contract for every Store backend (in memory, SQLite on disk)."""

from __future__ import annotations

import pytest

from shoal.coordinator.rounds import AbortRecord, CommitRecord, Member
from shoal.coordinator.store import MemoryStore, SQLiteStore


@pytest.fixture(params=["memory", "sqlite"])
def make_store(request, tmp_path):
    path = str(tmp_path / "state.db")
    if request.param == "memory":
        shared = MemoryStore()
        yield lambda: shared
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


def test_double_commit_of_a_round_is_refused(make_store):
    s = make_store()
    s.save_commit(rec(0))
    with pytest.raises(ValueError):
        s.save_commit(rec(0))
    assert len(make_store().load_commits()) == 1


def test_members_epoch_and_meta(make_store):
    s = make_store()
    s.save_member(Member("a", b"k" * 32, "h:1", 5, 0.0, "member"))
    s.save_member(Member("b", b"j" * 32, "h:2", 6, 0.0, "pending"))
    s.forget_member("b")
    s.save_epoch(7)
    s.set_meta("run_config", "{}")
    s2 = make_store()
    (m,) = s2.load_members()
    assert (m.peer_id, m.public_key, m.address, m.num_samples, m.state) == ("a", b"k" * 32, "h:1", 5, "member")
    assert s2.load_epoch() == 7 and s2.get_meta("run_config") == "{}" and s2.get_meta("nope") is None


def test_sqlite_uses_wal(tmp_path):
    s = SQLiteStore(str(tmp_path / "x.db"))
    try:
        assert s._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        s.close()
