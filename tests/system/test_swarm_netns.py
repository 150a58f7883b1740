"""`shoal swarm --scenario` in network namespaces: shaping is real, a shape event takes effect
mid-run, the summary's tables are there, and nothing is left behind (also after SIGTERM).

The assertions on round times are lower bounds from the shaped rates (a round cannot move its
bytes faster than the link allows; a loaded machine only makes it slower), never upper bounds.
"""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys
import time

import pytest

from kits.procs import finish

pytestmark = [
    pytest.mark.integration,
    pytest.mark.netns,
    pytest.mark.usefixtures("netbed_available"),  # skips where namespaces cannot be made
]

HIDDEN = 2048
# The pseudo-gradient of the default MLP (64 -> HIDDEN -> 10), float32, no compression.
PAYLOAD_BYTES = 4 * (64 * HIDDEN + HIDDEN + HIDDEN * 10 + 10)
# Generous collective deadlines: these tests are about the test bed, not about slow-link deadlines.
# Every round waits for all 3 peers (--min-peers 3): none falls behind and needs a state sync.
SLOW_LINK_FLAGS = ["--chunk-timeout", "60", "--collective-timeout", "300", "--ready-timeout", "5", "--min-peers", "3"]


def _namespaces_of(pid: int) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"shls-{pid}-")]


def _links_of(pid: int) -> list[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=10).stdout
    return [line for line in out.splitlines() if f"shoal-netbed:shls:{pid}" in line]


def _swarm(tmp_path, scenario: str, *args: str) -> subprocess.Popen:
    path = tmp_path / "scenario.toml"
    path.write_text(scenario)
    return subprocess.Popen(
        [sys.executable, "-m", "shoal.cli", "swarm", "--scenario", str(path), "--summary", str(tmp_path / "s.json"),
         "--workdir", str(tmp_path / "wd"), "--no-progress", "--hidden", str(HIDDEN), "--inner-steps", "5",
         *SLOW_LINK_FLAGS, *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _bound(rate_mbit: float, bytes_: float) -> float:
    return bytes_ * 8 / (rate_mbit * 1e6)


@pytest.mark.soak  # half a minute; the default run keeps the shape-event case (same bed, same tables)
@pytest.mark.timeout(900)
def test_shaped_run_follows_its_links_and_reports_the_tables(tmp_path):
    """3 peers at 4 Mbit/s up and down: every committed round takes at least the time its bytes
    need on those links (2(p-1)/p of the payload through each upload, whatever the plan), the
    summary has per_peer / rounds / wrongful_exclusions, and the namespaces are gone after."""
    peer = "[[peer]]\nup_mbit = 4\ndown_mbit = 4\n"
    proc = _swarm(tmp_path, peer * 3, "--peers", "3", "--rounds", "4")
    out = finish(proc, 840)
    assert proc.returncode == 0, out[-3000:]
    assert _namespaces_of(proc.pid) == [] and _links_of(proc.pid) == []
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["network"] == "netns" and s["rounds_committed"] == 4 and s["digest_mismatches"] == 0
    committed = [r for r in s["rounds"] if r["status"] == "committed"]
    assert [r["round"] for r in committed] == [0, 1, 2, 3]
    for r in s["rounds"]:
        assert set(r) >= {"round", "attempt", "status", "participants", "collective_algorithm", "demoted",
                          "predicted_seconds", "seconds", "excluded"}
        assert r["collective_algorithm"] in ("ring", "butterfly")
    assert all(r["participants"] == [0, 1, 2] for r in committed)
    bound = _bound(4, 2 * 2 / 3 * PAYLOAD_BYTES)
    assert statistics.median(r["seconds"] for r in committed) >= 0.7 * bound, (bound, committed)
    assert [p["rounds_committed"] for p in s["per_peer"]] == [4, 4, 4]
    assert all(p["first_commit_after_start_seconds"] > 0 and p["times_excluded"] == 0 for p in s["per_peer"])
    assert s["wrongful_exclusions"] == 0 and s["wrongful_exclusion_list"] == []


@pytest.mark.soak  # default-run budget (10 min): a minutes-class process run; test_netbed keeps shaping a live link
@pytest.mark.timeout(900)
def test_a_shape_event_slows_one_peer_mid_run(tmp_path):
    """Peer 2 goes from 16 to 4 Mbit/s up and down at 10 s: the rounds planned after that cannot
    beat 4 Mbit/s for the payload its upload must carry (at least the whole payload: its
    contribution out to the owners plus, as an owner, the reduced shard to the others), 4x the
    bound before the change."""
    scenario = ("[[peer]]\n[[peer]]\n[[peer]]\nup_mbit = 16\ndown_mbit = 16\n"
                "[[event]]\nat = 10.0\naction = \"shape\"\npeer = 2\nup_mbit = 4\ndown_mbit = 4\n")
    proc = _swarm(tmp_path, scenario, "--peers", "3", "--rounds", "14")
    out = finish(proc, 840)
    assert proc.returncode == 0, out[-3000:]
    assert _namespaces_of(proc.pid) == []
    s = json.loads((tmp_path / "s.json").read_text())
    (ev,) = s["events"]
    assert ev["action"] == "shape" and ev["peer"] == 2 and ev["up_mbit"] == 4.0 and ev["done_after_start_seconds"] >= 10
    after = [r for r in s["rounds"] if r["status"] == "committed" and 2 in r["participants"]
             and r["at_seconds"] - r["seconds"] > ev["done_after_start_seconds"] + 1.0]
    assert after, s["rounds"]
    assert statistics.median(r["seconds"] for r in after) >= 0.7 * _bound(4, PAYLOAD_BYTES), after


@pytest.mark.timeout(300)
def test_sigterm_mid_run_leaves_no_namespace_or_process(tmp_path):
    peer = "[[peer]]\nup_mbit = 8\ndown_mbit = 8\n"
    proc = _swarm(tmp_path, peer * 2, "--peers", "3", "--rounds", "500")
    try:
        end = time.monotonic() + 120
        while not (tmp_path / "wd" / "peer-2.jsonl").exists():  # the peers are up in their namespaces
            assert time.monotonic() < end and proc.poll() is None
            time.sleep(0.2)
        assert _namespaces_of(proc.pid), "the swarm should run in namespaces"
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert proc.returncode != 0
    assert _namespaces_of(proc.pid) == [] and _links_of(proc.pid) == []
    ps = subprocess.run(["pgrep", "-f", str(tmp_path / "wd")], capture_output=True, text=True)
    assert ps.stdout.strip() == "", "processes left behind"
