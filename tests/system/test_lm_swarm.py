"""The language-model workload (`shoal swarm --workload lm`, docs/training.md): corpus split,
model, summary keys, plot, the refusal without PyTorch, and a short swarm with the ddp baseline.

Tests that need PyTorch skip without it; the pure ones (summary, refusal) always run.
"""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

from shoal.bench import lm_job

HAVE_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(not HAVE_TORCH, reason="PyTorch is not installed (pip install 'shoal[torch]')")

TINY = lm_job.LMSettings(d_model=32, layers=1, heads=2, context=32, batch_size=8, eval_windows=32)


@needs_torch
@pytest.mark.integration
@pytest.mark.torch
@pytest.mark.soak  # default-run budget (577 s of 600 in CI): 12 s; torch stays in the default run through
# test_time_budgeted_local_work_and_overlap and tests/system/test_torch_example.py, the baseline's ranks through test_procexit
def test_short_lm_swarm_with_ddp_baseline(tmp_path):
    """2 peers, a tiny model, 4 rounds: the validation loss falls, every peer ends on the same
    committed state, the summary has the LM and baseline keys, and the baseline sends H times
    Shoal's bytes per step (one all-reduce per step instead of one per round)."""
    from shoal.testbeds.swarm import SwarmOptions, run_swarm

    summary_path = tmp_path / "s.json"
    s = run_swarm(SwarmOptions(peers=2, rounds=4, inner_steps=10, workload="lm", lm=TINY, baseline="ddp",
                               workdir=str(tmp_path / "wd"), progress=False, min_peers=2, timeout=400,
                               summary_path=str(summary_path), warm_start_steps=5))
    assert s["ok"], (s.get("error"), s.get("baseline_error"), s)
    assert json.loads(summary_path.read_text())["val_loss"] == s["val_loss"]
    assert s["digest_mismatches"] == 0 and s["peers_up_to_date"] == 2
    curve = s["val_curve"]
    assert [p["round"] for p in curve] == [1, 2, 3, 4]
    assert curve[-1]["val_loss"] < curve[0]["val_loss"] < math.log(256)
    assert s["val_loss"] == curve[-1]["val_loss"] and s["val_bits_per_byte"] == pytest.approx(
        s["val_loss"] / math.log(2), abs=1e-4)
    assert len(s["compute_utilization_per_peer"]) == 2
    assert 0 < s["compute_utilization"] == min(s["compute_utilization_per_peer"]) <= 1
    assert s["baseline_steps"] == 40 and s["baseline_val_loss"] < math.log(256)
    # The warm start: both start from it (the baseline's step-0 evaluation is the warm model's).
    assert s["warm_start_steps"] == 5 and s["warm_start_seconds"] > 0
    # ... counted in neither run's seconds: the swarm's clock starts once the warm model is written.
    warm_written = (tmp_path / "wd" / "warm-start.pt").stat().st_mtime
    first_commit = min(e["t"] for i in range(2) for e in map(json.loads, (tmp_path / "wd" / f"peer-{i}.jsonl")
                       .read_text().splitlines()) if e.get("event") == "commit" and int(e["round"]) == 0)
    assert curve[0]["seconds"] <= first_commit - warm_written + 0.5
    assert s["baseline_curve"][0]["step"] == 0
    assert s["baseline_curve"][0]["val_loss"] == pytest.approx(s["warm_start_val_loss"], abs=1e-4)
    # local_work = "steps": every peer runs H steps per local phase (4 rounds, and the phase after
    # the last one, which the end of the run discards).
    assert s["local_work"] == "steps" and s["inner_steps_per_peer"] == [50, 50]
    assert s["overlap"] is False and s["overlapped_steps_per_peer"] == [0, 0]
    assert s["target_val_loss"] == pytest.approx(1.05 * s["baseline_val_loss"], abs=1e-4)
    assert "seconds_to_target" in s and "baseline_seconds_to_target" in s
    assert s["baseline_wall_seconds"] > 0
    # Shoal sends once per round what the baseline sends every step (no compression, 2 peers).
    assert s["baseline_bytes_sent_total"] >= 5 * s["bytes_sent_total"]


@needs_torch
@pytest.mark.integration
@pytest.mark.torch
def test_time_budgeted_local_work_and_overlap(tmp_path):
    """--local-work time with one peer at a third of the speed, and --overlap, in one swarm:
    after the first round (H steps for everybody: no pace yet) every local phase lasts H of the
    fast peers' steps, so the slow peer runs fewer inner steps than the fast ones; every peer runs
    inner steps while its round's all-reduce is in flight and folds the committed update in when
    it arrives; updates weighted by samples still give every peer the same committed state, and
    every round commits. (Steps without overlap: test_short_lm_swarm_with_ddp_baseline.)"""
    from shoal.testbeds.swarm import SwarmOptions, run_swarm

    s = run_swarm(SwarmOptions(peers=3, rounds=5, inner_steps=20, workload="lm", lm=TINY, min_peers=3,
                               peer_speed=(1.0, 1.0, 0.33), run_extra=(("local_work", "time"), ("overlap", True)),
                               target_val_loss=math.log(256), workdir=str(tmp_path / "wd"), progress=False,
                               timeout=300))
    assert s["ok"], (s.get("error"), s)
    assert s["local_work"] == "time" and s["overlap"] is True and s["rounds_committed"] == 5
    assert s["digest_mismatches"] == 0 and s["peers_up_to_date"] == 3
    fast, slow = min(s["inner_steps_per_peer"][:2]), s["inner_steps_per_peer"][2]
    assert slow < fast, s["inner_steps_per_peer"]
    assert all(n and n > 0 for n in s["overlapped_steps_per_peer"]), s["overlapped_steps_per_peer"]
    curve = s["val_curve"]
    assert curve[-1]["val_loss"] < curve[0]["val_loss"] < math.log(256)
    assert s["target_val_loss"] == pytest.approx(math.log(256), abs=1e-4)
    assert s["seconds_to_target"] == curve[0]["seconds"]  # the first committed model beats uniform


@needs_torch
@pytest.mark.integration
@pytest.mark.torch
@pytest.mark.soak  # about a minute of 3 LM processes; the pure parts are in tests/unit/test_fragments.py
def test_streaming_fragments_in_fp4_with_a_time_budget(tmp_path):
    """Streaming DiLoCo (--fragments 4 --fragment-overlap 1) with 4-bit outer gradients and
    --local-work time: every round carries the fragment round mod 4 (each fragment commits twice
    in 8 rounds), every peer ends on the same committed state, a round moves a quarter of the
    model in about 0.13x its float32 bytes, and the summary has the traffic figures."""
    from shoal.testbeds.swarm import SwarmOptions, run_swarm

    extra = (("fragments", 4), ("fragment_overlap", 1), ("local_work", "time"), ("compression", "fp4"))
    s = run_swarm(SwarmOptions(peers=3, rounds=8, inner_steps=8, workload="lm", lm=TINY, min_peers=3,
                               compression="fp4", run_extra=extra, workdir=str(tmp_path / "wd"), progress=False,
                               timeout=300))
    assert s["ok"], (s.get("error"), s)
    assert s["digest_mismatches"] == 0 and s["peers_up_to_date"] == 3
    assert s["fragments"] == 4 and s["rounds_per_fragment"] == {"0": 2, "1": 2, "2": 2, "3": 2}
    from shoal.peer.workloads import lm

    n = lm.num_params(lm.TinyGPT(lm.LMShape(TINY.d_model, TINY.layers, TINY.heads, TINY.context)))
    ring_float32 = 3 * 2 * (3 - 1) / 3 * 4 * n / 4  # a ring all-reduce of a quarter of the model, all peers
    assert s["bytes_per_round_median"] <= 0.14 * ring_float32
    assert len(s["peak_bytes_per_s_per_peer"]) == 3 and s["peak_bytes_per_s"] > 0
    assert all(n > 0 for n in s["overlapped_steps_per_peer"])


@needs_torch
@pytest.mark.integration
@pytest.mark.torch
@pytest.mark.soak  # about a minute of 3 LM processes; the math is in tests/unit/test_eager.py
@pytest.mark.parametrize("extra", [(("fragments", 4), ("fragment_overlap", 1)), (("overlap", True),)],
                         ids=["fragments", "overlap"])
def test_eager_updates_keep_the_committed_state_bit_identical(tmp_path, extra):
    """--eager with streaming fragments (tau = 1) and with the whole-model --overlap: every peer
    merges its own estimate of each round at the hand-over, yet every round commits with the same
    state digest on every peer (0 mismatches, no state sync), as without eager."""
    from shoal.testbeds.swarm import SwarmOptions, run_swarm

    s = run_swarm(SwarmOptions(peers=3, rounds=8, inner_steps=8, workload="lm", lm=TINY, min_peers=3,
                               run_extra=(*extra, ("eager", True)), workdir=str(tmp_path / "wd"), progress=False,
                               timeout=300))
    assert s["ok"], (s.get("error"), s)
    assert s["eager"] is True and s["rounds_committed"] == 8
    assert s["digest_mismatches"] == 0 and s["peers_up_to_date"] == 3
    if dict(extra).get("fragments"):
        assert s["rounds_per_fragment"] == {"0": 2, "1": 2, "2": 2, "3": 2}
    assert all(n > 0 for n in s["overlapped_steps_per_peer"])
    assert s["val_curve"][-1]["val_loss"] < s["val_curve"][0]["val_loss"]
