"""The benchmark job's memory: one reused input buffer (shoal.bench.collective_job.JobInputs) and the
bench's peak-RSS accounting per memory window (shoal.bench.allreduce._memory). No processes."""

from __future__ import annotations

import numpy as np
import pytest

from shoal.bench.allreduce import _memory
from shoal.bench.collective_job import JobInputs, _base_input, make_input

MB = 1_000_000


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_job_inputs_are_make_inputs_bits_in_one_buffer(dtype):
    inputs = JobInputs(3, 1, 10_001, dtype)
    first = inputs(0)
    for r in (0, 1, 5, 2):
        x = inputs(r)
        assert x is first and x.dtype == np.dtype(dtype)  # one buffer, rewritten
        # The draw plus the round's offset, summed in float32 and rounded once to `dtype`.
        expected = (_base_input(3, 1, 10_001) + np.float32(0.01 * r)).astype(dtype)
        assert x.tobytes() == expected.tobytes() == make_input(3, 1, r, 10_001, dtype).tobytes()


def _job(windows, first_plan=1000 * MB, lifetime=None):
    peak = lifetime if lifetime is not None else max(w[2] for w in windows)
    return {"rss_baseline_bytes": 100 * MB, "rss_before_collective_bytes": first_plan, "peak_rss_bytes": peak,
            "memory_windows": [{"round": i, "attempt": 0, "rss_at_plan_bytes": rss, "peak_rss_bytes": pk,
                                "held_state_bytes": held, "peak_reset": reset}
                               for i, (rss, held, pk, reset) in enumerate(windows)]}


def test_ratio_subtracts_the_committed_state_held_in_each_window():
    size = 500 * MB
    # round 0: result (1x) + 0.5x of buffers; round 1: the committed state (1x) on top of the same
    job = _job([(1000 * MB, 0, 1750 * MB, True), (2250 * MB, 500 * MB, 2300 * MB, True)])
    m = _memory([job], size)
    assert m["peak_rss_ratio"] == pytest.approx(1.6)  # round 1: 2300 - 1000 - 500 held
    assert m["peak_rss_ratio_first_plan"] == pytest.approx(2.6)  # the old measure: the state counted
    assert m["peak_rss_ratio_from_start"] == pytest.approx(4.4)
    assert m["peak_rss_bytes_max"] == 2300 * MB and m["peak_rss_ratios"] == [pytest.approx(1.6)]


def test_without_a_per_window_peak_nothing_is_subtracted():
    job = _job([(1000 * MB, 0, 1750 * MB, False), (2250 * MB, 500 * MB, 2300 * MB, False)])
    assert _memory([job], 500 * MB)["peak_rss_ratio"] == pytest.approx(2.6)


def test_reports_without_windows_use_the_lifetime_peak():
    gloo = {"rss_baseline_bytes": 0, "rss_before_collective_bytes": 100 * MB, "peak_rss_bytes": 250 * MB}
    assert _memory([gloo], 100 * MB)["peak_rss_ratio"] == pytest.approx(1.5)
