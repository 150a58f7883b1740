"""`shoal bench coordinator`: one JSON object, complete and self-consistent (a small run: the
benchmark measures; these tests check the report, never timings), and its pure parts."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from shoal.coordinator.loopwatch import COLUMNS

ROOT = pathlib.Path(__file__).resolve().parents[2]
KEYS = ("members", "joins_per_second", "heartbeat_p50_seconds", "heartbeat_p99_seconds",
        "round_open_to_plan_p99_seconds", "rss_bytes", "rss_growth_bytes_per_round", "cpu_seconds_per_second",
        "members_cpu_seconds_per_second", "bounds", "within_bounds", "all_members_drawn_round",
        "rss_growth_steady_bytes_per_round", "rss_growth_steady_stderr_bytes_per_round")


@pytest.mark.integration
def test_a_small_run_reports_every_figure(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "shoal.cli", "bench", "coordinator", "--members", "40",
                           "--rounds", "6", "--cohort-size", "4", "--processes", "2", "--train-seconds", "0.5",
                           "--lease-seconds", "4", "--workdir", str(tmp_path), "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [l for l in proc.stdout.splitlines() if l.strip()]
    assert len(lines) == 1, proc.stdout
    rep = json.loads(lines[0])
    for k in KEYS:
        assert k in rep, k
    assert rep["members"] == 40 and rep["members_finished"] == 40
    assert rep["votes"] == 6 * 4  # every round's cohort voted once (no abort)
    assert rep["joins_per_second"] > 0 and rep["rss_bytes"] > 0 and rep["cpu_seconds_per_second"] > 0
    assert rep["members_cpu_seconds_per_second"] > 0
    assert 0 < rep["heartbeat_p50_seconds"] <= rep["heartbeat_p99_seconds"]
    assert rep["within_bounds"] == (rep["heartbeat_p99_seconds"] < 0.1 and rep["rss_bytes"] < 1 << 30
                                    and rep["rss_growth_bytes_per_round"] < 100)
    assert not [e for e in rep["errors"] if "UNAUTHENTICATED" in e or "INVALID" in e]
    # The traces next to the report: the coordinator's seconds, the members' seconds, its memory.
    loop = (tmp_path / "loop.csv").read_text().splitlines()
    assert loop[0].split(",") == list(COLUMNS) and len(loop) > 2
    assert sum(int(l.split(",")[COLUMNS.index("heartbeats")]) for l in loop[1:]) > 0
    beats = (tmp_path / "heartbeats.csv").read_text().splitlines()
    assert beats[0] == "t,sent,slow,slow_by_process,lag_max_ms_by_process,gc_max_ms_by_process" and len(beats) > 1
    assert all(len(l.split(",")[3].split("/")) == 2 for l in beats[1:])  # two member processes
    rss = (tmp_path / "rss.csv").read_text().splitlines()
    assert rss[0].startswith("rounds,rss_bytes,t,anon_bytes") and int(rss[-1].split(",")[3]) > 0
