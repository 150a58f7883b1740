"""A whole swarm killed with kill -9 (every peer and the coordinator at once) and restarted comes
back from its checkpoints: the coordinator rewinds to the newest committed round the peers hold,
at most `--checkpoint-every` rounds are lost, and the run finishes as a run without a crash does.
Real processes on loopback (`shoal swarm --crash-all-after R`); minutes on a loaded 2-core host,
so under -m soak."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kits.s3server import s3server  # noqa: F401 - fixture

pytestmark = [pytest.mark.integration, pytest.mark.soak]

EVERY = 4


def crash_swarm(tmp_path, *extra: str, env: dict | None = None) -> tuple[dict, str, str]:
    """`shoal swarm` of 3 peers, 16 rounds, a checkpoint every EVERY rounds, every process killed
    after round 10; (summary, the coordinator's log, the peers' logs)."""
    wd = tmp_path / "wd"
    proc = subprocess.run(
        [sys.executable, "-m", "shoal.cli", "swarm", "--peers", "3", "--rounds", "16", "--inner-steps", "20",
         "--checkpoint-every", str(EVERY), "--crash-all-after", "10", *extra, "--workdir", str(wd),
         "--summary", str(tmp_path / "s.json"), "--no-progress", "--timeout", "400"],
        capture_output=True, text=True, timeout=480, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    peers = "".join((wd / f"peer-{i}.log").read_text() for i in range(3))
    return json.loads((tmp_path / "s.json").read_text()), (wd / "coordinator.log").read_text(), peers


def test_a_swarm_killed_whole_goes_on_from_its_newest_checkpoint(tmp_path):
    s, coordinator, _ = crash_swarm(tmp_path)
    crash = s["crash_all"]
    assert crash["crashed"] and crash["committed_at_crash"] >= 10
    (rw,) = s["rewinds"]
    # The newest checkpoint at the crash is that of round 8 (or 12 when round 12 committed first).
    assert rw["from"] == crash["committed_at_crash"] and rw["to"] % EVERY == 0
    assert 0 <= s["rounds_lost"] == rw["lost"] <= EVERY and len(rw["holders"]) >= 1  # the others sync from them
    assert f"rewinding the run from {rw['from']} to {rw['to']} committed rounds" in coordinator
    assert f"{rw['lost']} committed rounds are lost" in coordinator
    assert s["ok"] and s["rounds_committed"] == 16 and s["digest_mismatches"] == 0
    assert s["test_accuracy"] >= 0.95 and s["resumed_from_checkpoint"] == 3


def test_a_truncated_newest_checkpoint_is_skipped_for_the_previous_one(tmp_path):
    s, coordinator, peers = crash_swarm(tmp_path, "--crash-disk", "truncate")
    crash = s["crash_all"]
    assert len(crash["truncated"]) == 3
    for path in crash["truncated"]:  # each restarted peer names the damaged file and takes the previous one
        assert f"skipping damaged checkpoint: {path}" in peers
    (rw,) = s["rewinds"]
    newest = max(int(p.split("round-")[1][:8]) for p in crash["truncated"])
    assert rw["to"] == newest - EVERY and rw["lost"] <= 2 * EVERY
    assert s["ok"] and s["rounds_committed"] == 16 and s["digest_mismatches"] == 0 and s["test_accuracy"] >= 0.95


def test_a_swarm_that_lost_its_disks_goes_on_from_the_s3_checkpoint_store(tmp_path, s3server):
    """Every process killed and every peer's checkpoint directory gone (new machines): the peers
    take the newest checkpoint the elected checkpointers uploaded to SeaweedFS."""
    s, coordinator, peers = crash_swarm(tmp_path, "--checkpoint-url", s3server.url("run"), "--crash-disk", "lose",
                                        env=s3server.env)
    crash = s["crash_all"]
    assert len(crash["lost_directories"]) == 3 and s["checkpoints_uploaded"] >= 2
    assert "from the checkpoint store s3://" in peers
    (rw,) = s["rewinds"]
    assert rw["to"] % EVERY == 0 and rw["to"] > 0 and rw["lost"] <= EVERY and len(rw["holders"]) >= 1  # the others sync from them
    assert s["ok"] and s["rounds_committed"] == 16 and s["digest_mismatches"] == 0 and s["test_accuracy"] >= 0.95
