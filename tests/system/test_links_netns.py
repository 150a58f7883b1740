"""Slow links for real: peers in network namespaces behind `tc tbf` shaping (shoal.testbeds.netbed), run
by scripts/links_netbed.py (coordinator in the root namespace, one `shoal peer` per namespace).

The case of docs/performance.md ("Links"): links so slow that one peer's share of a round takes
longer than the old fixed 2 s chunk-deadline floor. Deadlines now come from the links measured
before round 0 (or assumed slow), so every round commits."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
OLD_FLOOR_SECONDS = 2.0  # the chunk deadline main used while no link was measured

# Minutes of shaped rounds: a soak (the rules are in tests/unit/test_link_rules.py, the default run).
pytestmark = [pytest.mark.integration, pytest.mark.netns, pytest.mark.soak]


@pytest.mark.timeout(420)
@pytest.mark.usefixtures("netbed_available")  # skips where namespaces cannot be made
def test_slow_links_commit_every_round_where_the_fixed_floor_could_not(tmp_path):
    mbit, rounds = 2.0, 3
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "links_netbed.py"), "--peers", "3", "--mbit", str(mbit),
         "--hidden", "4096", "--inner-steps", "2", "--rounds", str(rounds), "--timeout", "360",
         "--workdir", str(tmp_path / "run")],
        cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads(proc.stdout)
    assert rep["finished"] and rep["rounds_committed"] == rounds, rep
    assert rep["attempts_aborted"] <= 1, rep["abort_reasons"]
    # What one peer uploads in a round needs longer than the old floor at this rate: a butterfly's
    # first all-gather chunk waits for (at least a part of) that, so 2 s could not be met.
    per_round = [b for b in rep["bytes_sent_per_round"] if b]
    assert per_round and min(per_round) / (mbit * 1e6 / 8) > OLD_FLOOR_SECONDS
    # The first plan already had links: it predicts a time (the static layout predicts 0).
    assert rep["rounds"][0]["predicted_seconds"] > 0, rep["rounds"][0]
