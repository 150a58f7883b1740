"""`shoal swarm --compression topk`: real processes train with sparse, error-fed pseudo-gradients
on the sparse all-gather; every peer ends with the same state, at a small fraction of the bytes."""

from __future__ import annotations

import json
import sys

import pytest

from kits.procs import run_to_end
from shoal.peer.sparse import SparseCodec
from kits.events import aborts_not_from_host_stalls

# Starts `shoal swarm` as a process: the integration tier (pyproject markers).
pytestmark = pytest.mark.integration


def test_swarm_with_topk_payloads_commits_every_round_at_the_payload_bytes(tmp_path):
    summary, wd = tmp_path / "s.json", tmp_path / "wd"
    peers, rounds = 3, 2
    proc = run_to_end(
        [sys.executable, "-m", "shoal.cli", "swarm", "--peers", str(peers), "--rounds", str(rounds),
         "--compression", "topk", "--sparse-k", "64", "--sparse-bits", "2", "--summary", str(summary),
         "--no-progress", "--workdir", str(wd)],
        capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads(summary.read_text())
    assert s["rounds_committed"] == rounds and s["digest_mismatches"] == 0
    assert aborts_not_from_host_stalls(wd, peers) == []
    assert s["compression"] == "topk" and s["peers_up_to_date"] == peers
    # Each peer sends its one payload to each other peer per round, nothing else.
    finals = [json.loads(line) for i in range(peers) for line in (wd / f"peer-{i}.jsonl").read_text().splitlines()
              if json.loads(line)["event"] == "finished"]
    n = 64 * 64 + 64 + 64 * 10 + 10  # the digits MLP (hidden 64)
    payload = SparseCodec("topk", 4096, 64, 2).payload_bytes(n)
    assert s["bytes_sent_total"] == peers * rounds * (peers - 1) * payload
    assert len({f["state_digest"] for f in finals}) == 1
    assert s["test_accuracy"] > 0.5  # two rounds of 1.5 % of the update: training, not noise


def test_swarm_on_the_sparse_reduce_scatter_commits_every_round_at_its_bytes(tmp_path):
    """`--collective sparse_rs` forces the sparse reduce-scatter: each peer sends each other owner
    the payload of that owner's range and its own merged range back as float32."""
    from shoal.common.plan import sparse_shard_bounds

    summary, wd = tmp_path / "s.json", tmp_path / "wd"
    peers, rounds = 3, 2
    proc = run_to_end(
        [sys.executable, "-m", "shoal.cli", "swarm", "--peers", str(peers), "--rounds", str(rounds),
         "--compression", "topk", "--sparse-k", "64", "--sparse-bits", "2", "--sparse-chunk", "1024",
         "--collective", "sparse_rs", "--summary", str(summary), "--no-progress", "--workdir", str(wd)],
        capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads(summary.read_text())
    assert s["rounds_committed"] == rounds and s["digest_mismatches"] == 0
    assert aborts_not_from_host_stalls(wd, peers) == []
    finals = [json.loads(line) for i in range(peers) for line in (wd / f"peer-{i}.jsonl").read_text().splitlines()
              if json.loads(line)["event"] == "finished"]
    n = 64 * 64 + 64 + 64 * 10 + 10
    bounds = sparse_shard_bounds(n, 1024, peers)
    codec = SparseCodec("topk", 1024, 64, 2)
    per_round = sum((peers - 1) * (codec.payload_bytes(hi - lo) + 4 * (hi - lo))
                    for lo, hi in zip(bounds, bounds[1:]) if hi > lo)
    assert s["bytes_sent_total"] == rounds * per_round
    assert len({f["state_digest"] for f in finals}) == 1
