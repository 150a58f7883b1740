"""`shoal swarm` with a lying peer: NaN updates never reach a model; robust aggregation trains on;
a lying vote (a false accusation, a random digest) costs the liar its place, nobody else's."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys

import pytest

from kits.events import aborts_not_from_host_stalls

# Starts `shoal swarm` as a process: the integration tier (pyproject markers).
pytestmark = pytest.mark.integration


@pytest.mark.soak  # default-run budget: 11 s; test_allreduce_processes.py keeps a NaN attacker against every
# aggregator (real processes), test_compression.py the int8 codec
def test_swarm_with_a_nan_peer_and_int8(tmp_path):
    summary, wd = tmp_path / "s.json", tmp_path / "wd"
    proc = subprocess.run(
        [sys.executable, "-m", "shoal.cli", "swarm", "--peers", "4", "--rounds", "3", "--byzantine", "1",
         "--attack", "nan", "--aggregator", "centered-clip", "--clip-tau", "0.5", "--compression", "int8",
         "--summary", str(summary), "--no-progress", "--workdir", str(wd)],
        capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads(summary.read_text())
    assert s["rounds_committed"] == 3 and s["digest_mismatches"] == 0
    assert aborts_not_from_host_stalls(wd, 4) == []
    assert s["rounds_with_flagged"] == 3 and len(s["flagged_peers"]) == 1
    assert s["test_accuracy"] > 0.8
    finals = [json.loads(line) for i in range(4) for line in (wd / f"peer-{i}.jsonl").read_text().splitlines()
              if json.loads(line)["event"] == "finished"]
    assert len(finals) == 4 and all(f["params_finite"] for f in finals)
    # The flagged peer is the attacker (the swarm gives the attack to the last peer).
    attacker = [json.loads(line) for line in (wd / "peer-3.jsonl").read_text().splitlines()][-1]["peer"]
    assert s["flagged_peers"] == [attacker]


# 6 peers with krum: the same audit with another aggregator and more peers, in the long runs only
# (the default run keeps 4 peers with trimmed-mean; the owner audit's unit tests cover krum).
@pytest.mark.parametrize("peers, aggregator", [(4, "trimmed-mean"), pytest.param(6, "krum", marks=pytest.mark.soak)])
def test_swarm_with_a_malicious_owner_is_caught_by_the_audit(tmp_path, peers, aggregator):
    # The last peer contributes honestly but, as a shard owner, publishes -10 x its shard's
    # aggregate. Its auditor catches it in round 0; from then on both own no shard (and Krum's
    # distance matrices go to owners only: the non-owners must not wait for them).
    summary, wd = tmp_path / "s.json", tmp_path / "wd"
    proc = subprocess.run(
        [sys.executable, "-m", "shoal.cli", "swarm", "--peers", str(peers), "--rounds", "4", "--byzantine", "1",
         "--attack", "owner", "--aggregator", aggregator, "--audit-owners",
         "--summary", str(summary), "--no-progress", "--workdir", str(wd)],
        capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads(summary.read_text())
    assert s["rounds_committed"] == 4 and s["digest_mismatches"] == 0
    assert s["abort_reasons"] == {"owner <peer> published an aggregate of": 1} and s["rounds_retried"] == 1
    attacker = [json.loads(line) for line in (wd / f"peer-{peers - 1}.jsonl").read_text().splitlines()][-1]["peer"]
    commits = [e for i in range(peers) for e in map(json.loads, (wd / f"peer-{i}.jsonl").read_text().splitlines())
               if e["event"] == "commit"]
    # Round 0 was retried without the owner and its accuser (which peer audits depends on the ids)...
    assert sorted(c["participants"] for c in commits if c["round"] == 0) == [peers - 2] * (peers - 2)
    # ... who are back later, as non-owners: no second audit failure (abort_reasons above).
    assert any(c["participants"] == peers for c in commits if c["round"] > 0)
    assert "differs from the audit" in (wd / "coordinator.log").read_text()
    assert s["test_accuracy"] > 0.8, attacker


# One attack in the default run (about 40 s each); both under -m soak. The engine-level cases of both,
# with several rounds and both liars at once, are in tests/unit/test_blame_evidence.py.
@pytest.mark.parametrize("attack", ["false-blame", pytest.param("lying-digest", marks=pytest.mark.soak)])
def test_swarm_with_a_lying_voter_benches_the_liar_and_nobody_else(tmp_path, attack):
    # The last peer plays every collective honestly, then lies in its vote: it names an honest
    # participant as the culprit (false-blame) or votes a random digest (lying-digest). Neither
    # lie has evidence: the liar alone is excluded, struck twice (rounds 0 and 1) and benched; the
    # rounds after commit at the first attempt.
    summary, wd = tmp_path / "s.json", tmp_path / "wd"
    proc = subprocess.run(
        [sys.executable, "-m", "shoal.cli", "swarm", "--peers", "4", "--rounds", "6", "--byzantine", "1",
         "--attack", attack, "--summary", str(summary), "--no-progress", "--workdir", str(wd), "--timeout", "150"],
        capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads(summary.read_text())
    assert s["rounds_committed"] == 6 and s["digest_mismatches"] == 0
    attacker = json.loads((wd / "peer-3.jsonl").read_text().splitlines()[0])["peer"]
    con = sqlite3.connect(wd / "coordinator.db")
    try:
        aborts = con.execute("SELECT round, excluded FROM aborts").fetchall()
    finally:
        con.close()
    assert aborts and all(json.loads(ex) == [attacker] for _, ex in aborts), aborts
    assert all(r < 2 for r, _ in aborts), aborts  # benched from round 2: no abort after
    assert f"peer {attacker[:8]} is benched" in (wd / "coordinator.log").read_text()
    assert s["test_accuracy"] > 0.8
