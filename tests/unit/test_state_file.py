"""The state file's operator tools (online backup, recovery of a damaged file) and what the
coordinator command does with a damaged file: one line naming it, exit code 2, never a fresh start."""

from __future__ import annotations

import os

import pytest

from shoal.cli import main
from shoal.coordinator.rounds import AbortRecord, CommitRecord, Member, MemberState
from shoal.coordinator.state_file import backup_state, recover_state
from shoal.coordinator.store import SQLiteStore

from test_store import filled


def test_backup_of_a_live_state_file_is_a_consistent_copy(tmp_path):
    path, copy = str(tmp_path / "live.db"), str(tmp_path / "backup.db")
    live = SQLiteStore(path)
    try:
        for r in range(50):
            live.save_commit(CommitRecord(r, 0, b"r", b"s%d" % r, ("a", "b"), 0.5, 0.1))
        live.save_member(Member("a", b"k" * 32, "h:1", 3, 0.0, MemberState.MEMBER))
        summary = backup_state(path, copy)  # the writer stays open: an online backup
        live.save_commit(CommitRecord(50, 0, b"r", b"s50", ("a", "b"), 0.5, 0.1))
    finally:
        live.close()
    assert (summary.last_round, summary.commits, summary.members, summary.path) == (49, 50, 1, copy)
    with SQLiteStore(copy) as s:  # opens for writing: it passes the coordinator's checks
        assert s.last_commit().state_digest == b"s49" and [m.peer_id for m in s.load_members()] == ["a"]
    with pytest.raises(FileExistsError):
        backup_state(path, copy)


def test_recovery_of_a_half_truncated_file_keeps_a_prefix_and_reports_its_last_round(tmp_path):
    path, out = str(tmp_path / "state.db"), str(tmp_path / "recovered.db")
    filled(path, commits=400)
    with SQLiteStore(path) as s:
        s.save_abort(AbortRecord(400, 1, "x", ("a",), True, 2.0))
    os.truncate(path, os.path.getsize(path) // 2)
    report = recover_state(path, out)
    last = report.summary.last_round
    assert last is not None and 0 < last < 399  # the later rounds were in the lost half
    assert report.summary.missing_rounds == 0 and report.rows["commits"] == last + 1
    assert report.summary.members == 10 and report.summary.has_run_config
    assert any("commits" in line for line in report.lost)
    with SQLiteStore(out) as s:
        assert s.last_commit().round == last and s.count_commits() == last + 1
        assert int(s.get_meta("incarnation")) >= 10  # no attempt id of the old coordinator is reused
    with pytest.raises(FileExistsError):
        recover_state(path, out)


def test_coordinator_refuses_a_damaged_file_and_recover_reports_the_last_round(tmp_path, capsys):
    path = str(tmp_path / "state.db")
    filled(path, commits=300)
    size = os.path.getsize(path)
    os.truncate(path, size // 2)
    assert main(["coordinator", "--insecure", "--state", path, "--listen", "127.0.0.1:0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    line = [x for x in err if x.startswith("shoal coordinator:")]
    assert len(line) == 1 and f"state file {path} is damaged" in line[0] and "--state-recover" in line[0]
    assert os.path.getsize(path) == size // 2  # untouched, no fresh start over it

    assert main(["coordinator", "--state", path, "--state-recover"]) == 0
    out = capsys.readouterr().out
    recovered = str(tmp_path / "state.recovered.db")
    with SQLiteStore(recovered) as s:
        last = s.last_commit().round
    assert f"the last committed round kept is round {last}" in out and recovered in out
    # A second recovery never overwrites the first one.
    assert main(["coordinator", "--state", path, "--state-recover"]) == 2
    assert "exists" in capsys.readouterr().err

    assert main(["coordinator", "--state", recovered, "--state-backup", str(tmp_path / "b.db")]) == 0
    assert f"last committed round {last}" in capsys.readouterr().out
