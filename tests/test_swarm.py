"""`shoal swarm` end to end: real coordinator and peer processes, few rounds."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# Starts `shoal swarm` as a process: the integration tier (pyproject markers).
pytestmark = pytest.mark.integration


def test_swarm_end_to_end(tmp_path):
    summary = tmp_path / "s.json"
    proc = subprocess.run(
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
