"""A swarm that reaches --timeout still reports what it did: the last committed model's accuracy,
the rounds done, `timed_out`, and a baseline for the steps actually done (or none, said so)."""

from __future__ import annotations

import json
import sys
import time

import pytest

from kits.procs import run_to_end
from shoal.coordinator.store import SQLiteStore

# Starts `shoal swarm` as a process: the integration tier (pyproject markers).
pytestmark = pytest.mark.integration

INNER_STEPS = 10


def test_a_timed_out_swarm_summarizes_what_it_did(tmp_path):
    summary, wd = tmp_path / "s.json", tmp_path / "wd"
    t0 = time.monotonic()
    proc = run_to_end(
        [sys.executable, "-m", "shoal.cli", "swarm", "--peers", "2", "--rounds", "100000", "--timeout", "20",
         "--inner-steps", str(INNER_STEPS), "--summary", str(summary), "--no-progress", "--workdir", str(wd)],
        capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    assert proc.returncode == 1, proc.stderr[-3000:]  # documented: the job did not finish (--timeout's help)
    s = json.loads(summary.read_text())
    assert s["timed_out"] is True and s["ok"] is False and "within 20s" in s["error"]
    assert s["rounds_committed"] > 0 and s["digest_mismatches"] == 0
    assert s["bytes_sent_total"] > 0  # counted from the peers' last events, none of which finished
    assert s["test_accuracy"] > 0.5 and s["test_accuracy_of"] in ("last commit", "finished peers")
    with SQLiteStore.reader(str(wd / "coordinator.db")) as store:
        steps = sum(len(c.participants) for c in store.load_commits()) * INNER_STEPS
    assert s["baseline_steps"] == steps
    if s["baseline_accuracy"] is None:
        assert "did not fit" in s["baseline_skipped"]
    else:
        assert 0.0 < s["baseline_accuracy"] <= 1.0
    assert "timed out" in proc.stderr
    # 20 s of swarm, its start and stop, and a baseline of at most a quarter of the timeout
    assert took < 90, took
