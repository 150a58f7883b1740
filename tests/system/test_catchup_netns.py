"""A joiner behind a 4 Mbit/s link (kernel tbf, network namespaces) catches up with three unshaped
peers training a 9.8 MB model (`--hidden 16384`): it downloads the state once (donors keep it for
it, rounds wait for it), then commits, with no restarted downloads and no "holds state of round
N, not M" refusals. scripts/catchup_bed.py is the
same run by hand; its JSON line gives the figures (docs/fault-tolerance.md, "Slow joiners")."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.integration,
    pytest.mark.netns,
    pytest.mark.soak,  # a 4 Mbit/s joiner of a 9.8 MB state: minutes; the rules are in tests/unit/test_state_sync.py
    pytest.mark.timeout(420),
    pytest.mark.usefixtures("netbed_available"),  # skips where namespaces cannot be made
]

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "catchup_bed.py"


def test_a_joiner_on_a_4_mbit_link_downloads_the_state_once_and_commits(tmp_path):
    # --chunk-timeout 10: the per-chunk deadline floor (2 s) is below what a 1 MiB chunk needs at
    # 4 Mbit/s until deadlines follow measured links.
    proc = subprocess.run([sys.executable, str(SCRIPT), "--timeout", "240", "--workdir", str(tmp_path),
                           "--extra-coordinator-args", "--chunk-timeout 10"],
                          capture_output=True, text=True, timeout=400)
    assert proc.stdout.strip(), proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0 and out["joiner_commits"] >= 1, (out, (tmp_path / "peer-3.log").read_text()[-3000:])
    # It got the state in whole downloads (no restart at byte 0 chasing the head), and the donors
    # did not turn it away round after round.
    assert 1 <= len(out["state_syncs"]) <= 3 and out["state_syncs_failed"] <= 2
    assert out["donor_precondition_lines"] <= 3
