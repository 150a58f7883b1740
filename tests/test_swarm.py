"""`shoal swarm` end to end: real coordinator and peer processes, few rounds."""

from __future__ import annotations

import json
import subprocess
import sys


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
