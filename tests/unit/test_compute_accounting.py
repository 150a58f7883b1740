"""The compute-utilization accounting of the LM workload (docs/training.md, "Summary keys"):
the training window of shoal.peer.compute_accounting.ComputeLedger, the summary keys built from
the peers' result files, the round timing from the events, and the evaluations file. Pure: no
processes, no sockets."""

from __future__ import annotations

import json
import math

import pytest

from shoal.bench import lm_job


def _ledger():
    from shoal.peer import compute_accounting as ca

    return ca.ComputeLedger(), ca.utilization


def test_window_runs_from_the_first_step_to_the_hand_over_of_the_last_committed_phase():
    ledger, utilization = _ledger()
    assert ledger.window() == (0.0, 0.0)  # nothing committed yet
    ledger.step(10.0, 1.0)  # phase 1: two steps of 1 s from t = 10
    ledger.step(11.0, 1.0)
    ledger.handed_over(12.0)
    ledger.answered(committed=True)  # round 1 committed after 2 s blocked
    ledger.step(14.0, 1.0)  # phase 2
    ledger.step(15.0, 1.0)
    ledger.handed_over(16.0)
    ledger.answered(committed=True)
    ledger.step(18.0, 1.0)  # phase 3: the run finished instead of committing it
    ledger.handed_over(19.0)
    ledger.answered(committed=False)
    compute, window = ledger.window()
    assert (compute, window) == (4.0, 6.0)  # phases 1 and 2 from t = 10 to their hand-over at 16
    assert utilization(compute, window) == round(4 / 6, 4)
    assert ledger.compute == 5.0  # the discarded phase still counts in the whole-life figure


def test_overlapped_steps_count_in_the_phase_handed_over_after_them():
    """With overlap the steps run while round r is in flight belong to phase r+1: they count once
    that phase's round commits, and the hand-over time of the last committed phase ends the window."""
    ledger, _ = _ledger()
    ledger.step(0.0, 1.0)
    ledger.handed_over(1.0)
    ledger.step(1.0, 1.0)  # in flight: phase 2's first step
    ledger.answered(committed=True)  # round 1 lands during phase 2
    ledger.step(2.0, 1.0)
    ledger.handed_over(3.0)
    assert ledger.window() == (1.0, 1.0)  # only phase 1 is committed so far
    ledger.answered(committed=True)
    assert ledger.window() == (3.0, 3.0)


def test_utilization_of_an_empty_window_is_zero():
    _, utilization = _ledger()
    assert utilization(1.0, 0.0) == 0.0 and utilization(0.0, -1.0) == 0.0


def _result(path, util, life, steps, parts=None):
    path.with_suffix(".result.json").write_text(json.dumps({
        "compute_utilization": util, "compute_utilization_lifetime": life, "steps": steps,
        "overlapped_steps": steps // 2, "seconds_by_part": parts or {"steps": 1.0}}))


def test_utilization_keys_take_the_minimum_over_peers_and_none_for_a_missing_result(tmp_path):
    paths = [tmp_path / f"peer-{i}.jsonl" for i in range(4)]
    _result(paths[0], 0.9, 0.8, 20)
    _result(paths[1], 0.95, 0.7, 22)
    _result(paths[3], None, 0.5, 10)  # a process restarted at the end: no phase of its own committed
    s = lm_job.utilization(paths)
    assert s["compute_utilization"] == 0.9 and s["compute_utilization_per_peer"] == [0.9, 0.95, None, None]
    assert s["compute_utilization_lifetime"] == 0.5
    assert s["compute_utilization_lifetime_per_peer"] == [0.8, 0.7, None, 0.5]
    assert s["inner_steps_per_peer"] == [20, 22, None, 10] and s["overlapped_steps_per_peer"] == [10, 11, None, 5]
    assert s["seconds_by_part_per_peer"][2] is None
    assert lm_job.utilization([tmp_path / "none.jsonl"])["compute_utilization"] is None


def _ev(kind, r, t, attempt=0):
    return {"event": kind, "round": r, "attempt": attempt, "t": t}


def test_round_timing_takes_the_committed_attempt_and_the_earliest_events():
    peer0 = [_ev("plan", 0, 0.5), _ev("commit", 0, 1.0),
             _ev("plan", 1, 1.5), _ev("plan", 1, 2.2, attempt=1), _ev("commit", 1, 2.5, attempt=1),
             _ev("plan", 2, 3.0), _ev("commit", 2, 3.5)]
    peer1 = [_ev("plan", 1, 2.1, attempt=1), _ev("commit", 1, 2.6, attempt=1), _ev("plan", 2, 3.1),
             _ev("commit", 2, 3.4)]
    t = lm_job.round_timing([peer0, peer1])
    # round 1: 1.5 s after round 0, its all-reduce 2.5 - 2.1 = 0.4 s; round 2: 0.9 s, 3.4 - 3.0 = 0.4 s
    assert t["round_seconds_median"] == pytest.approx(1.2)
    assert t["allreduce_seconds_median"] == pytest.approx(0.4)
    assert t["allreduce_share_median"] == pytest.approx((0.4 / 1.5 + 0.4 / 0.9) / 2, abs=1e-4)
    assert lm_job.round_timing([[_ev("commit", 0, 1.0)]])["allreduce_share_median"] is None


def test_evaluations_file_feeds_the_validation_curve(tmp_path):
    path = tmp_path / "peer-0.jsonl"
    path.with_suffix(".val.jsonl").write_text('{"round": 0, "val_loss": 3.0}\n{"round": 1, "val_loss": 2.5}\n{"rou')
    evaluated = lm_job.evaluations([path, tmp_path / "peer-1.jsonl"])
    assert evaluated == {0: 3.0, 1: 2.5}  # the torn last line and the missing file are skipped
    nan = math.nan
    peer0 = [{"event": "commit", "round": r, "bytes_sent": 100, "test_accuracy": nan, "t": 10.0 + r}
             for r in range(2)] + [{"event": "finished", "rounds": 2, "test_accuracy": nan}]
    s = lm_job.summary([peer0], t0=10.0, evaluated=evaluated)
    assert [p["val_loss"] for p in s["val_curve"]] == [3.0, 2.5] and s["val_loss"] == 2.5


def test_evaluator_writes_one_line_per_committed_state_in_order(tmp_path):
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    from shoal.bench.lm_worker import Evaluator
    from shoal.peer.workloads import lm
    from shoal.torch import flatten

    shape = lm.LMShape(d_model=16, layers=1, heads=2, context=8)
    probe = lm.make_model(shape, 0)
    probe.eval()
    inputs = torch.randint(0, 256, (4, 8), generator=torch.Generator().manual_seed(1))
    windows = (inputs, inputs.roll(-1, dims=1))
    params = flatten(lm.make_model(shape, 0))
    path = tmp_path / "peer-0.val.jsonl"
    ev = Evaluator(probe, windows, path)
    ev.submit(0, params)  # no committed round: skipped
    ev.submit(1, params)
    ev.submit(2, params * 0)
    ev.submit(2, params)  # the final state once more (the agent's end-of-run evaluation): skipped
    assert ev.close() >= 0.0
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1]
    assert rows[1]["val_loss"] == pytest.approx(math.log(256), abs=1e-3)  # zero parameters: uniform
    assert rows[0]["val_loss"] != rows[1]["val_loss"]


def test_a_streaming_evaluator_evaluates_once_per_sweep_and_the_last_state_at_close(tmp_path):
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    from shoal.bench.lm_worker import Evaluator
    from shoal.peer.workloads import lm
    from shoal.peer.torch_integration import flatten

    shape = lm.LMShape(d_model=16, layers=1, heads=2, context=8)
    probe = lm.make_model(shape, 0)
    probe.eval()
    inputs = torch.randint(0, 256, (4, 8), generator=torch.Generator().manual_seed(1))
    path = tmp_path / "peer-0.val.jsonl"
    ev = Evaluator(probe, (inputs, inputs.roll(-1, dims=1)), path)
    ev.every = 4
    params = flatten(lm.make_model(shape, 0))
    for r in range(1, 11):  # 4 and 8 are sweeps; 10, the last, is evaluated at close
        ev.submit(r, params)
    ev.close()
    assert [json.loads(line)["round"] for line in path.read_text().splitlines()] == [3, 7, 9]


def test_an_evaluation_that_fails_is_raised_by_close_not_lost_in_its_thread(tmp_path):
    pytest.importorskip("torch", reason="PyTorch is not installed")
    from shoal.bench.lm_worker import Evaluator
    from shoal.peer.workloads import lm
    from shoal.torch import flatten

    shape = lm.LMShape(d_model=16, layers=1, heads=2, context=8)
    probe = lm.make_model(shape, 0)
    params = flatten(probe)
    ev = Evaluator(probe, windows=None, path=tmp_path / "peer-0.val.jsonl")  # windows=None: evaluate_loss fails
    ev.submit(1, params)
    ev.thread.join(timeout=60)  # the failure stops the thread
    assert ev.error is not None
    ev.submit(2, params)  # not queued behind a thread that is gone
    assert ev.todo.empty()
    with pytest.raises(RuntimeError, match="evaluating committed states failed"):
        ev.close()
