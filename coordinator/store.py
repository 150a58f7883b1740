"""Durable coordinator state behind a small interface: members, epoch, commits, aborts, run config.

Two backends share one contract (tests/test_store.py runs the same tests on both):
`MemoryStore` (tests, ephemeral runs) and `SQLiteStore` (WAL mode, synchronous=FULL, one
transaction per write; a write returns only once it is durable, so the server may acknowledge
what it has written). Model state never lives here: peers hold it.

`batch(durable=...)` groups writes into one transaction (one fsync for a round boundary's members
and epoch). `durable=False` skips the fsync (synchronous=NORMAL in WAL mode): the transaction
survives a crash of the process, not of the machine; the coordinator uses it for joins and
departures only, which a peer repeats if they are lost (it joins again on NOT_FOUND).

Other processes (`shoal swarm`, tests) read a live coordinator's state file through
`SQLiteStore.reader` (read-only, never blocks the coordinator's writes), never with raw SQL.
A member's state is stored as its `MemberState.label` ("pending", "syncing", "member").

Opening a state file for writing checks it first (`PRAGMA quick_check`, the application id and the
schema version): a damaged file, a file of another application or of a newer schema raises
`StateFileError`, whose message is one line naming the file, what is wrong and what the operator
can do. A coordinator never starts afresh over a file it cannot read. Backup and recovery of the
file are in `coordinator.state_file`.

`rewind(rounds)` drops the commits of the rounds a whole-swarm restart lost (RoundEngine's
`Rewind`): the rounds after the newest checkpoint a peer came back with are played again.

The whole commit history stays in the store; the coordinator keeps only a recent window in memory
and reads older rounds with `recent_commits` / `recent_aborts`.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import sqlite3
import threading
from collections.abc import Iterator
from typing import ContextManager, Protocol

from shoal.coordinator.admitted_keys import Membership
from shoal.coordinator.rounds import AbortRecord, CommitRecord, Durable, Member, MemberState


PAGE_CACHE_KIB = 256  # SQLite's page cache of a writing coordinator (below)
SCHEMA_VERSION = 2  # PRAGMA user_version of the files this code writes (2: memberships)
APPLICATION_ID = 0x53484F4C  # PRAGMA application_id ("SHOL"): a Shoal coordinator state file
TABLES = ("meta", "members", "commits", "aborts", "memberships")

DAMAGED_OPTIONS = ("restore a backup (made with `shoal coordinator --state-backup PATH`), or copy what can still be "
                   "read into a new file with `shoal coordinator --state {path} --state-recover`")
FOREIGN_OPTIONS = "pass the coordinator's own state file with --state, or move this file away to start a new run"


class StateFileError(Exception):
    """A state file the coordinator must not use: damaged, another application's, or of a newer
    schema. `str()` is one line: the file, what is wrong, and the operator's options. Nothing was
    written to the file."""

    def __init__(self, path: str, problem: str, options: str):
        self.path, self.problem, self.options = str(path), problem, options.format(path=path)
        super().__init__(f"state file {self.path} {self.problem}; {self.options}")


REWINDS_META = "rewinds"  # meta key: the run's rewinds (`recorded_rewinds`)
DURABLE_META = "durable"  # meta key: the newest committed round a peer's checkpoint holds (`recorded_durable`)


def durable_json(d: Durable) -> str:
    return json.dumps({"round": d.round, "digest": d.state_digest.hex(), "peers": list(d.peers)})


def recorded_durable(store: Store) -> Durable | None:
    """The durable round `store` recorded (RoundEngine.durable), None before any."""
    raw = store.get_meta(DURABLE_META)
    if not raw:
        return None
    d = json.loads(raw)
    return Durable(int(d["round"]), bytes.fromhex(d["digest"]), tuple(d["peers"]))


def recorded_rewinds(store: Store) -> list[dict]:
    """The rewinds `store` recorded, oldest first, each {"from", "to", "lost", "digest",
    "holders", "wall"}: committed rounds before and after, the rounds lost, the hex state digest
    gone back to, the peers that held it, unix time of the rewind."""
    return json.loads(store.get_meta(REWINDS_META) or "[]")


class Store(Protocol):
    def load_members(self) -> list[Member]: ...
    def save_member(self, m: Member) -> None: ...
    def forget_member(self, peer_id: str) -> None: ...
    def load_memberships(self) -> list[Membership]: ...
    def save_membership(self, m: Membership) -> None: ...
    def forget_membership(self, peer_id: str) -> None: ...
    def load_epoch(self) -> int: ...
    def save_epoch(self, epoch: int) -> None: ...
    def load_commits(self) -> list[CommitRecord]: ...
    def recent_commits(self, n: int) -> list[CommitRecord]: ...
    def recent_aborts(self, n: int) -> list[AbortRecord]: ...
    def save_commit(self, rec: CommitRecord) -> None: ...
    def rewind(self, rounds: int) -> int: ...
    def count_commits(self) -> int: ...
    def last_commit(self) -> CommitRecord | None: ...
    def count_aborts(self) -> int: ...
    def save_abort(self, rec: AbortRecord) -> None: ...
    def get_meta(self, key: str) -> str | None: ...
    def set_meta(self, key: str, value: str) -> None: ...
    def batch(self, durable: bool = True) -> ContextManager[None]: ...
    def close(self) -> None: ...


class MemoryStore:
    """In-memory `Store` (no durability)."""

    def __init__(self) -> None:
        self.members: dict[str, Member] = {}
        self.epoch = 0
        self.commits: list[CommitRecord] = []
        self.aborts: list[AbortRecord] = []
        self.meta: dict[str, str] = {}
        self.memberships: dict[str, Membership] = {}

    def load_members(self) -> list[Member]:
        return list(self.members.values())

    def save_member(self, m: Member) -> None:
        # What SQLiteStore keeps: the identity, the address and the state's label.
        self.members[m.peer_id] = Member(m.peer_id, m.public_key, m.address, m.num_samples, 0.0,
                                         MemberState.from_label(m.state.label))

    def forget_member(self, peer_id: str) -> None:
        self.members.pop(peer_id, None)

    def load_memberships(self) -> list[Membership]:
        return list(self.memberships.values())

    def save_membership(self, m: Membership) -> None:
        self.memberships[m.peer_id] = m

    def forget_membership(self, peer_id: str) -> None:
        self.memberships.pop(peer_id, None)

    def load_epoch(self) -> int:
        return self.epoch

    def save_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def load_commits(self) -> list[CommitRecord]:
        return list(self.commits)

    def save_commit(self, rec: CommitRecord) -> None:
        if any(c.round == rec.round for c in self.commits):
            raise ValueError(f"round {rec.round} already committed")
        self.commits.append(rec)

    def rewind(self, rounds: int) -> int:
        kept = [c for c in self.commits if c.round < rounds]
        dropped, self.commits = len(self.commits) - len(kept), kept
        return dropped

    def recent_commits(self, n: int) -> list[CommitRecord]:
        return sorted(self.commits, key=lambda c: c.round)[-n:] if n > 0 else []

    def recent_aborts(self, n: int) -> list[AbortRecord]:
        return list(self.aborts[-n:]) if n > 0 else []

    def count_commits(self) -> int:
        return len(self.commits)

    def last_commit(self) -> CommitRecord | None:
        return max(self.commits, key=lambda c: c.round, default=None)

    def count_aborts(self) -> int:
        return len(self.aborts)

    def save_abort(self, rec: AbortRecord) -> None:
        self.aborts.append(rec)

    def get_meta(self, key: str) -> str | None:
        return self.meta.get(key)

    def set_meta(self, key: str, value: str) -> None:
        self.meta[key] = value

    def batch(self, durable: bool = True) -> ContextManager[None]:
        return contextlib.nullcontext()

    def close(self) -> None:
        pass


_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS members (
    peer_id TEXT PRIMARY KEY, public_key BLOB NOT NULL, address TEXT NOT NULL,
    num_samples INTEGER NOT NULL, state TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS commits (
    round INTEGER PRIMARY KEY, attempt INTEGER NOT NULL, result_digest BLOB NOT NULL,
    state_digest BLOB NOT NULL, participants TEXT NOT NULL, train_loss REAL NOT NULL,
    seconds REAL NOT NULL, flagged TEXT NOT NULL, at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS aborts (
    id INTEGER PRIMARY KEY AUTOINCREMENT, round INTEGER NOT NULL, attempt INTEGER NOT NULL,
    reason TEXT NOT NULL, excluded TEXT NOT NULL, will_retry INTEGER NOT NULL, at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS memberships (
    peer_id TEXT PRIMARY KEY, public_key BLOB NOT NULL, label TEXT NOT NULL, admitted_at REAL NOT NULL,
    last_seen REAL NOT NULL, revoked_at REAL NOT NULL);
"""


def check_state_file(db: sqlite3.Connection, path: str) -> bool:
    """Check an open state file before anything is written to it; True when it is new (empty).

    Raises StateFileError when the file is damaged (`PRAGMA quick_check` fails or finds a
    problem; a file truncated by a full disk or a bad copy), is not a SQLite database, belongs to
    another application (its application id, or tables that are not a coordinator's), or was
    written by a newer schema. A coordinator file of an earlier version (no application id, only
    coordinator tables) passes: opening it stamps it.
    """
    try:
        problems = [r[0] for r in db.execute("PRAGMA quick_check(5)").fetchall()]
        app_id = db.execute("PRAGMA application_id").fetchone()[0]
        version = db.execute("PRAGMA user_version").fetchone()[0]
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.DatabaseError as exc:
        if "file is not a database" in str(exc):
            raise StateFileError(path, "is not a SQLite database (not a Shoal coordinator state file)",
                                 FOREIGN_OPTIONS) from None
        if "unable to open" in str(exc):
            raise StateFileError(path, f"cannot be opened ({exc})", "check the path and its permissions") from None
        raise StateFileError(path, f"is damaged ({exc})", DAMAGED_OPTIONS) from None
    if problems != ["ok"]:
        raise StateFileError(path, f"is damaged (integrity check: {problems[0]})", DAMAGED_OPTIONS)
    if app_id not in (0, APPLICATION_ID):
        raise StateFileError(path, f"belongs to another application (application_id {app_id:#x}, not a Shoal "
                                   f"coordinator state file)", FOREIGN_OPTIONS)
    others = sorted(tables - set(TABLES) - {"sqlite_sequence"})
    if others or (app_id == 0 and tables and not tables & set(TABLES)):
        raise StateFileError(path, f"holds tables {', '.join(others or sorted(tables))} (not a Shoal coordinator "
                                   f"state file)", FOREIGN_OPTIONS)
    if version > SCHEMA_VERSION:
        raise StateFileError(path, f"was written by a newer Shoal (schema version {version}; this one reads up to "
                                   f"{SCHEMA_VERSION})", "run a newer shoal, or restore a backup of this version's")
    return not tables


def create_private(path: str) -> None:
    """Create the state file `path` empty and readable by its owner only (0600: it holds the
    members' keys and addresses, the admissions) when it does not exist; SQLite gives its -wal
    and -shm files the same mode. An existing file keeps its mode; ":memory:" is no file."""
    if path == ":memory:" or path.startswith("file:") or os.path.exists(path):
        return
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))


class SQLiteStore:
    """`Store` on a SQLite file in WAL mode; each write is one durable transaction.

    Raises:
        StateFileError: (writer) the file is damaged, foreign or of a newer schema
            (`check_state_file`); nothing was written to it.
        sqlite3.OperationalError: (reader) the file does not exist.
    """

    def __init__(self, path: str, *, read_only: bool = False):
        self._lock = threading.RLock()
        self._in_batch = False
        self.path = str(path)
        if read_only:
            self._db = sqlite3.connect(f"{pathlib.Path(path).absolute().as_uri()}?mode=ro", uri=True,
                                       isolation_level=None, check_same_thread=False)
            return
        create_private(self.path)
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        try:
            check_state_file(self._db, self.path)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            # SQLite's page cache (malloc'd, 2 MiB by default) fills as the file grows, ~0.6 KB per
            # commit: a resident size that grows with every round until the file passes 2 MiB
            # (thousands of rounds at 1,000 members). The coordinator writes and rarely reads (a
            # restart, `status --recent`): a small cache is full within minutes and costs
            # reads from the OS's file cache only (docs/performance.md, "Coordinator scale").
            self._db.execute(f"PRAGMA cache_size = -{PAGE_CACHE_KIB}")
            self._db.executescript(_SCHEMA)
            self._db.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        except BaseException:
            self._db.close()
            raise

    @classmethod
    def reader(cls, path: str) -> SQLiteStore:
        """A read-only view of the state file at `path`, e.g. of a running coordinator's: reads
        see the last committed transaction and never block its writes; writes raise
        sqlite3.OperationalError. Raises sqlite3.OperationalError when the file does not exist.
        Close it when done (it is a context manager)."""
        return cls(path, read_only=True)

    def __enter__(self) -> SQLiteStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextlib.contextmanager
    def batch(self, durable: bool = True) -> Iterator[None]:
        """One transaction for every write inside (nested batches join the outer one): committed
        at the end, rolled back when the block raises. durable=False: no fsync (see the module
        docstring)."""
        with self._lock:
            if self._in_batch:
                yield
                return
            self._db.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
            self._db.execute("BEGIN IMMEDIATE")
            self._in_batch = True
            try:
                yield
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            finally:
                self._in_batch = False
                if not durable:
                    self._db.execute("PRAGMA synchronous=FULL")

    def _write(self, sql: str, args: tuple) -> None:
        with self._lock:
            if self._in_batch:
                self._db.execute(sql, args)
                return
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute(sql, args)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def load_members(self) -> list[Member]:
        rows = self._db.execute("SELECT peer_id, public_key, address, num_samples, state FROM members").fetchall()
        return [Member(p, bytes(k), a, n, 0.0, MemberState.from_label(s)) for p, k, a, n, s in rows]

    def save_member(self, m: Member) -> None:
        self._write(
            "INSERT OR REPLACE INTO members VALUES (?, ?, ?, ?, ?)",
            (m.peer_id, m.public_key, m.address, m.num_samples, m.state.label),
        )

    def forget_member(self, peer_id: str) -> None:
        self._write("DELETE FROM members WHERE peer_id = ?", (peer_id,))

    def load_memberships(self) -> list[Membership]:
        """Every admitted key (coordinator.admitted_keys); none in a file of schema 1."""
        try:
            rows = self._db.execute("SELECT peer_id, public_key, label, admitted_at, last_seen, revoked_at "
                                    "FROM memberships").fetchall()
        except sqlite3.OperationalError:  # a read-only view of a schema-1 file: no such table
            return []
        return [Membership(p, bytes(k), lb, a, s, r) for p, k, lb, a, s, r in rows]

    def save_membership(self, m: Membership) -> None:
        self._write("INSERT OR REPLACE INTO memberships VALUES (?, ?, ?, ?, ?, ?)",
                    (m.peer_id, m.public_key, m.label, m.admitted_at, m.last_seen, m.revoked_at))

    def forget_membership(self, peer_id: str) -> None:
        self._write("DELETE FROM memberships WHERE peer_id = ?", (peer_id,))

    def load_epoch(self) -> int:
        v = self.get_meta("epoch")
        return int(v) if v is not None else 0

    def save_epoch(self, epoch: int) -> None:
        self.set_meta("epoch", str(epoch))

    def load_commits(self) -> list[CommitRecord]:
        return self._commits(self._db.execute("SELECT * FROM commits ORDER BY round").fetchall())

    @staticmethod
    def _commits(rows: list[tuple]) -> list[CommitRecord]:
        return [
            CommitRecord(r, a, bytes(rd), bytes(sd), tuple(json.loads(ps)), loss, sec, tuple(json.loads(fl)), at)
            for r, a, rd, sd, ps, loss, sec, fl, at in rows
        ]

    def recent_commits(self, n: int) -> list[CommitRecord]:
        """The last `n` committed rounds, oldest first (one indexed read, whatever the history's length)."""
        rows = self._db.execute("SELECT * FROM commits ORDER BY round DESC LIMIT ?", (max(0, n),)).fetchall()
        return self._commits(rows[::-1])

    def recent_aborts(self, n: int) -> list[AbortRecord]:
        """The last `n` aborted attempts, oldest first."""
        rows = self._db.execute("SELECT round, attempt, reason, excluded, will_retry, at FROM aborts "
                                "ORDER BY id DESC LIMIT ?", (max(0, n),)).fetchall()
        return [AbortRecord(r, a, reason, tuple(json.loads(ex)), bool(w), at) for r, a, reason, ex, w, at in rows[::-1]]

    def save_commit(self, rec: CommitRecord) -> None:
        try:
            self._write(
                "INSERT INTO commits VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (rec.round, rec.attempt, rec.result_digest, rec.state_digest, json.dumps(list(rec.participants)),
                 rec.train_loss, rec.seconds, json.dumps(list(rec.flagged)), rec.at),
            )
        except sqlite3.IntegrityError as exc:
            if "UNIQUE" in str(exc) or "PRIMARY KEY" in str(exc):
                raise ValueError(f"round {rec.round} already committed") from exc
            raise ValueError(f"commit of round {rec.round} refused by the store: {exc}") from exc

    def rewind(self, rounds: int) -> int:
        """Drop every commit of a round >= `rounds` (the run goes back to `rounds` committed
        rounds, RoundEngine's `Rewind`); returns how many were dropped. Aborts stay."""
        with self._lock:
            n = int(self._db.execute("SELECT COUNT(*) FROM commits WHERE round >= ?", (rounds,)).fetchone()[0])
        self._write("DELETE FROM commits WHERE round >= ?", (rounds,))
        return n

    def count_commits(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM commits").fetchone()[0])

    def last_commit(self) -> CommitRecord | None:
        rows = self._db.execute("SELECT * FROM commits ORDER BY round DESC LIMIT 1").fetchall()
        return self._commits(rows)[0] if rows else None

    def count_aborts(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM aborts").fetchone()[0])

    def save_abort(self, rec: AbortRecord) -> None:
        self._write(
            "INSERT INTO aborts (round, attempt, reason, excluded, will_retry, at) VALUES (?, ?, ?, ?, ?, ?)",
            (rec.round, rec.attempt, rec.reason, json.dumps(list(rec.excluded)), int(rec.will_retry), rec.at),
        )

    def get_meta(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def set_meta(self, key: str, value: str) -> None:
        self._write("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))

    def close(self) -> None:
        with self._lock:
            self._db.close()
