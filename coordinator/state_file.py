"""Operator tools for the coordinator's SQLite state file: online backup and recovery.

`backup_state` copies a state file with SQLite's online backup API: the coordinator may be running
and writing meanwhile (WAL mode; the copy is one consistent snapshot, checked before it is kept).
`recover_state` copies out of a damaged file (truncated by a full disk or a bad copy, pages
overwritten) every row SQLite can still read, table by table, into a new, valid state file, and
reports what it kept: above all the last committed round, which the operator compares with the
rounds the peers hold before starting a coordinator on the recovered file.

Neither tool ever writes to the source file, nor overwrites an existing destination. The
coordinator itself never starts over a damaged file (`coordinator.store.check_state_file`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import pathlib
import sqlite3
from collections.abc import Iterator

from shoal.coordinator.store import TABLES, SQLiteStore, StateFileError, check_state_file, create_private

log = logging.getLogger("shoal.coordinator")

# Columns copied per table (rowid tables; `aborts.id` is its rowid and is copied as such).
_COLUMNS = {
    "meta": "key, value",
    "members": "peer_id, public_key, address, num_samples, state",
    "commits": "round, attempt, result_digest, state_digest, participants, train_loss, seconds, flagged, at",
    "aborts": "id, round, attempt, reason, excluded, will_retry, at",
    "memberships": "peer_id, public_key, label, admitted_at, last_seen, revoked_at",
}
_BATCH = 256  # rows per read
_MAX_SKIPS = 64  # unreadable stretches skipped per table before giving the rest of it up


@dataclasses.dataclass(frozen=True)
class StateSummary:
    """What a state file holds (of a backup or a recovered copy)."""

    path: str
    members: int
    commits: int
    aborts: int
    last_round: int | None  # the last committed round, None when none is recorded
    missing_rounds: int  # committed rounds below last_round that are not in the file
    has_run_config: bool

    def describe(self) -> str:
        last = "no committed round" if self.last_round is None else f"last committed round {self.last_round}"
        gaps = f" ({self.missing_rounds} earlier rounds missing)" if self.missing_rounds else ""
        return (f"{self.path}: {last}{gaps}, {self.commits} commits, {self.aborts} aborts, {self.members} members"
                f"{'' if self.has_run_config else ', run configuration lost (the flags given at start are used)'}")


@dataclasses.dataclass(frozen=True)
class RecoveryReport:
    """The result of `recover_state`: the new file's `summary`, the source's readable rows per
    table, and the tables (or parts of them) that could not be read (`lost`, one line each)."""

    summary: StateSummary
    rows: dict[str, int]
    lost: tuple[str, ...]


def summarize(path: str) -> StateSummary:
    """What the (healthy) state file at `path` holds. Raises StateFileError when it is not one."""
    with _open_source(path, salvage=False) as db:
        check_state_file(db, path)
        present = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        count = {t: db.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] if t in present else 0 for t in TABLES}
        last = db.execute("SELECT MAX(round) FROM commits").fetchone()[0]
        run_config = db.execute("SELECT 1 FROM meta WHERE key = 'run_config'").fetchone() is not None
    missing = 0 if last is None else last + 1 - count["commits"]
    return StateSummary(str(path), count["members"], count["commits"], count["aborts"], last, missing, run_config)


def backup_state(src: str, dst: str) -> StateSummary:
    """Copy the state file `src` to the new file `dst` with SQLite's online backup API.

    `src` may be in use by a running coordinator: the copy is a consistent snapshot of its last
    committed transaction, taken without blocking its writes for longer than one page step.
    The copy is checked (`check_state_file`) before it is kept; `dst` is written through a
    temporary file and renamed, so a failed backup leaves no file at `dst`.

    Raises:
        FileExistsError: `dst` exists (a backup never overwrites anything).
        FileNotFoundError: `src` does not exist.
        StateFileError: `src` (or the copy) is damaged or not a coordinator state file.
    """
    src_p, dst_p = pathlib.Path(src), pathlib.Path(dst)
    if not src_p.exists():
        raise FileNotFoundError(f"state file {src} does not exist")
    if dst_p.exists():
        raise FileExistsError(f"{dst} exists; a backup never overwrites a file")
    tmp = dst_p.with_name(dst_p.name + ".tmp")
    tmp.unlink(missing_ok=True)
    try:
        with _open_source(src, salvage=False) as source:
            check_state_file(source, src)
            create_private(str(tmp))
            target = sqlite3.connect(tmp)
            try:
                source.backup(target, pages=256)  # steps of 256 pages: the writer is never held up long
            finally:
                target.close()
        summary = summarize(str(tmp))
        os.replace(tmp, dst_p)
    finally:
        tmp.unlink(missing_ok=True)
    return dataclasses.replace(summary, path=str(dst))


def recover_state(src: str, dst: str) -> RecoveryReport:
    """Copy every row still readable in the (damaged) state file `src` into a new state file `dst`.

    Each table is read in rowid order; where a page cannot be read (SQLITE_CORRUPT, a truncated
    file) the reader skips ahead to the next readable row, so one bad page costs the rows on it,
    not the rest of the table. `src` is opened read-only and never written. The new file gets a
    fresh incarnation count above the old one (so no attempt id of the old coordinator is reused).

    Raises:
        FileExistsError: `dst` exists.
        FileNotFoundError: `src` does not exist.
        StateFileError: nothing at all can be read from `src` (not even its table list).
    """
    if not pathlib.Path(src).exists():
        raise FileNotFoundError(f"state file {src} does not exist")
    if pathlib.Path(dst).exists():
        raise FileExistsError(f"{dst} exists; recovery never overwrites a file")
    rows: dict[str, list[tuple]] = {}
    lost: list[str] = []
    with _open_source(src, salvage=True) as db:
        try:
            tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        except sqlite3.DatabaseError as exc:
            raise StateFileError(src, f"cannot be recovered: not even its table list can be read ({exc})",
                                 "restore a backup") from None
        for table in TABLES:
            if table not in tables:
                if table != "memberships":  # a schema-1 file has none: nothing lost
                    lost.append(f"table {table}: not in the file")
                continue
            got, skipped = _salvage(db, table)
            rows[table] = got
            if skipped:
                lost.append(f"table {table}: {skipped} unreadable stretch{'es' if skipped > 1 else ''} skipped")
    tmp = pathlib.Path(dst).with_name(pathlib.Path(dst).name + ".tmp")
    tmp.unlink(missing_ok=True)
    try:
        _write_recovered(str(tmp), rows, source=src)
        summary = summarize(str(tmp))
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    return RecoveryReport(dataclasses.replace(summary, path=str(dst)), {t: len(r) for t, r in rows.items()},
                          tuple(lost))


@contextlib.contextmanager
def _open_source(path: str, *, salvage: bool) -> Iterator[sqlite3.Connection]:
    """A read-only connection to `path`. With `salvage`, SQLite reads past a header that promises
    more pages than the file has (a truncated file) instead of refusing the whole file; the
    connection still never writes (writable_schema only relaxes that check)."""
    db = sqlite3.connect(f"{pathlib.Path(path).absolute().as_uri()}?mode=ro", uri=True)
    try:
        if salvage:
            db.execute("PRAGMA writable_schema = ON")
        yield db
    finally:
        db.close()


def _salvage(db: sqlite3.Connection, table: str) -> tuple[list[tuple], int]:
    """(readable rows of `table` in rowid order, unreadable stretches skipped).

    Reads in bounded batches (a LIMIT query never steps past its last row, so a failing page
    costs no row read before it); where a batch fails, row by row up to the bad page, then
    `_next_readable` past it."""
    rows: list[tuple] = []
    after = -(1 << 63)  # rows with rowid > after are still to read
    skips = 0
    while True:
        for limit in (_BATCH, 1):
            try:
                while True:
                    got = db.execute(f"SELECT rowid, {_COLUMNS[table]} FROM {table} WHERE rowid > ? "
                                     f"ORDER BY rowid LIMIT {limit}", (after,)).fetchall()
                    if not got:
                        return rows, skips
                    for r in got:
                        if r[0] <= after:
                            # A rowid that does not increase: a damaged interior page sent the
                            # seek back into the table. Treated like an unreadable page.
                            raise sqlite3.DatabaseError("rowids out of order")
                        rows.append(r[1:])
                        after = r[0]
            except sqlite3.DatabaseError:
                continue  # the batch held a bad page: again row by row, then skip
        skips += 1
        nxt = _next_readable(db, table, after) if skips <= _MAX_SKIPS else None
        if nxt is None:
            return rows, skips
        after = nxt - 1


def _first_at(db: sqlite3.Connection, table: str, lo: int) -> int | None:
    """The first rowid >= lo when it can be read; raises sqlite3.DatabaseError when it cannot."""
    row = db.execute(f"SELECT rowid FROM {table} WHERE rowid >= ? ORDER BY rowid LIMIT 1", (lo,)).fetchone()
    if row is not None and row[0] < lo:
        raise sqlite3.DatabaseError("rowids out of order")  # a damaged interior page
    return None if row is None else row[0]


def _next_readable(db: sqlite3.Connection, table: str, after: int) -> int | None:
    """The smallest rowid > `after` from which a scan can start again, or None (nothing past it).

    Probes rowids after+1, after+2, after+4, ... until a seek succeeds, then narrows the gap
    between the last failed and the first good probe by bisection (rows are dense in these tables:
    rounds, autoincrement ids)."""
    base = max(after, -1)
    bad, step = base, 1
    while True:
        probe = base + step
        if probe > (1 << 62):
            return None
        try:
            if _first_at(db, table, probe) is None:
                return None
            good = probe
            break
        except sqlite3.DatabaseError:
            bad, step = probe, step * 2
    while good - bad > 1:  # a seek from `good` works and one from `bad` does not
        mid = (good + bad) // 2
        try:
            _first_at(db, table, mid)
            good = mid
        except sqlite3.DatabaseError:
            bad = mid
    return good


def _write_recovered(path: str, rows: dict[str, list[tuple]], *, source: str) -> None:
    """A new state file at `path` holding `rows` (per table, in `_COLUMNS` order)."""
    store = SQLiteStore(path)
    store.close()
    db = sqlite3.connect(path)
    try:
        with db:
            for table, got in rows.items():
                cols = _COLUMNS[table]
                marks = ", ".join("?" * len(cols.split(",")))
                db.executemany(f"INSERT OR IGNORE INTO {table} ({cols}) VALUES ({marks})", got)
            old = dict(rows.get("meta", []))
            # The next start must not reuse an attempt id of the damaged file's coordinator: jump
            # well past its incarnation (an unreadable count starts over half-way round the ids).
            incarnation = int(old["incarnation"]) + 10 if old.get("incarnation", "").isdigit() else 2000
            db.execute("INSERT OR REPLACE INTO meta VALUES ('incarnation', ?)", (str(incarnation),))
            db.execute("INSERT OR REPLACE INTO meta VALUES ('recovered_from', ?)",
                       (json.dumps({"path": str(pathlib.Path(source).absolute())}),))
    finally:
        db.close()
