"""`shoal swarm` end to end: real coordinator and peer processes, few rounds."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kits.procs import run_to_end

# Starts `shoal swarm` as a process: the integration tier (pyproject markers).
pytestmark = pytest.mark.integration


def test_swarm_end_to_end(tmp_path):
    summary = tmp_path / "s.json"
    proc = run_to_end(
        [sys.executable, "-m", "shoal.cli", "swarm", "--peers", "3", "--rounds", "5", "--summary", str(summary),
         "--no-progress", "--workdir", str(tmp_path / "wd")],
        capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads(summary.read_text())
    for key in ("test_accuracy", "baseline_accuracy", "rounds_committed", "rounds_aborted", "digest_mismatches",
                "peers", "wall_seconds", "bytes_sent_total"):
        assert key in s
    assert s["rounds_committed"] == 5 and s["digest_mismatches"] == 0 and s["peers"] == 3
    assert s["test_accuracy"] > 0.8 and s["bytes_sent_total"] > 0
    assert "test accuracy" in proc.stderr
    # every process the swarm started is gone
    ps = subprocess.run(["pgrep", "-f", str(tmp_path / "wd")], capture_output=True, text=True)
    assert ps.stdout.strip() == ""


@pytest.mark.soak  # default-run budget: 12 s; tests/system/test_swarm_netns.py (SIGTERM mid-run leaves no process or
# namespace) and tests/system/test_graceful_stop.py keep the case
def test_sigterm_stops_every_process(tmp_path):
    import signal
    import time

    wd = tmp_path / "wd"
    proc = subprocess.Popen(
        [sys.executable, "-m", "shoal.cli", "swarm", "--peers", "3", "--rounds", "200", "--no-progress",
         "--workdir", str(wd)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        end = time.monotonic() + 60
        while not (wd / "peer-2.jsonl").exists():  # the swarm is training
            assert time.monotonic() < end and proc.poll() is None
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
    ps = subprocess.run(["pgrep", "-f", str(wd)], capture_output=True, text=True)
    assert ps.stdout.strip() == "", "processes left behind"


@pytest.mark.soak  # two minutes (1,200 rounds); the unit case is test_round_client's long-local-update test
@pytest.mark.timeout(900)
def test_scenario_a_peer_back_from_local_work_syncs_once_and_commits_again(tmp_path):
    """`shoal swarm --scenario`: peer 2 spends 8 s in one local update while the others commit
    dozens of rounds (after one ready deadline of 1 s); back, it syncs once, takes part in
    commits again, and nothing disagrees."""
    scenario = tmp_path / "local-work.toml"
    # at 20 s: after the first rounds (round 0 waits for every initial peer, and a peer's first local
    # update comes after its start-up, which took over 12 s on a machine at load 40); 1,200 rounds so
    # that on a quiet machine the others are still committing when it comes back
    scenario.write_text('[[event]]\nat = 20.0\naction = "local-work"\npeer = 2\nseconds = 8.0\n')
    summary, wd = tmp_path / "s.json", tmp_path / "wd"
    proc = run_to_end(
        [sys.executable, "-m", "shoal.cli", "swarm", "--peers", "3", "--rounds", "1200", "--ready-timeout", "1", "--scenario", str(scenario),
         "--summary", str(summary), "--no-progress", "--workdir", str(wd), "--log-level", "warning"],
        capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads(summary.read_text())
    (ev,) = s["events"]
    assert ev["action"] == "local-work" and ev["peer"] == 2 and ev["seconds"] == 8.0
    assert ev["done_after_start_seconds"] >= 28.0  # the end of the local work, as the peer reported it
    assert ev["peer_next_commit_seconds"] is not None, s["events"]
    assert ev["max_commit_gap_seconds_30s"] is not None
    assert s["digest_mismatches"] == 0 and s["rounds_committed"] == 1200
    events = [json.loads(line) for line in (wd / "peer-2.jsonl").read_text().splitlines()]
    back = next(e["t"] for e in events if e["event"] == "local_work")
    missed = [e for e in events if e["event"] == "commit" and e["t"] > back]
    syncs = [e for e in events if e["event"] == "state_sync" and e["t"] > back]
    # One sync to the head; at most one more, small, when the round in flight at its return
    # committed during the download (seen once on a loaded CI machine): never one per missed round.
    assert missed and len(syncs) <= 2, syncs
    # it missed rounds while it worked: the others went on without it
    others = [json.loads(line) for line in (wd / "peer-0.jsonl").read_text().splitlines()]
    assert sum(1 for e in others if e["event"] == "commit" and e["t"] < back and e["participants"] == 2) >= 3


def test_scenario_errors_name_the_field(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[[event]]\nat = 1.0\naction = "local-work"\npeer = 7\nseconds = 5\n')
    proc = subprocess.run([sys.executable, "-m", "shoal.cli", "swarm", "--peers", "3", "--scenario", str(bad)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "event[0].peer" in proc.stderr and "Traceback" not in proc.stderr
