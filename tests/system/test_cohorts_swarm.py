"""Cohorts: each round's participants are K peers drawn from the ready ones; the others stay
members, learn of the commit and sync. Pure engine, explicit times, no sockets."""

from __future__ import annotations

import pytest

from kits.procs import run_to_end


@pytest.mark.integration
def test_swarm_with_cohorts_commits_every_round_with_k_participants(tmp_path):
    import json
    import sys

    from shoal.coordinator.store import SQLiteStore

    summary = tmp_path / "s.json"
    proc = run_to_end(
        [sys.executable, "-m", "shoal.cli", "swarm", "--peers", "5", "--cohort-size", "3", "--rounds", "8",
         "--algorithm", "fedavg", "--summary", str(summary), "--no-progress", "--workdir", str(tmp_path / "wd")],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads(summary.read_text())
    assert s["rounds_committed"] == 8 and s["digest_mismatches"] == 0
    assert s["cohort_size"] == 3 and s["cohort_sizes"] == {"3": 8}
    assert s["state_syncs"] < 2 * 8  # only drawn peers that hold an older state sync
    with SQLiteStore.reader(str(tmp_path / "wd" / "coordinator.db")) as store:
        played = {p for c in store.load_commits() for p in c.participants}
    assert len(played) >= 4  # the draw varies (5 peers, 8 rounds: all 5 with high probability)
