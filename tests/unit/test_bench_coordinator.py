"""`shoal bench coordinator`: one JSON object, complete and self-consistent (a small run: the
benchmark measures; these tests check the report, never timings), and its pure parts."""

from __future__ import annotations


import pytest

from shoal.bench.coordinator import (CoordinatorBenchOptions, Histogram, _beats_at, _coordinator_argv,
                                     all_drawn_round, growth_per_round, growth_stderr, steady_growth)


def test_histogram_quantiles_are_within_two_percent():
    h = Histogram()
    for i in range(1, 1001):
        h.add(i / 1000)  # 1 ms .. 1 s
    assert h.count == 1000
    assert h.quantile(0.5) == pytest.approx(0.5, rel=0.025)
    assert h.quantile(0.99) == pytest.approx(0.99, rel=0.025)
    merged = Histogram(h.bins)
    merged.merge(h)
    assert merged.count == 2000 and merged.quantile(0.5) == h.quantile(0.5)
    assert Histogram().quantile(0.99) == 0.0


def test_growth_per_round_is_the_slope_of_the_second_half():
    samples = [(r, 1000 + (0 if r < 50 else 40 * r)) for r in range(100)]
    assert growth_per_round(samples, 100) == pytest.approx(40.0)
    assert growth_per_round([(60, 5), (60, 6)], 100) == 0.0  # one round only: no slope
    # Samples after the last commit (the members told the run finished, leaving) are no round's.
    ending = samples + [(100, 10**9)] * 5
    assert growth_per_round(ending, 100) == pytest.approx(40.0)


def test_growth_stderr_is_zero_on_a_line_and_grows_with_the_swing():
    line = [(r, 1000 + 40 * r) for r in range(50, 100)]
    assert growth_stderr(line, 100) == pytest.approx(0.0, abs=1e-6)
    swing = [(r, 1000 + (5000 if r % 2 else -5000)) for r in range(50, 100)]
    assert growth_per_round(swing, 100) == pytest.approx(0.0, abs=20.0)
    assert growth_stderr(swing, 100) > 20.0  # ~5000 B swings over 50 rounds: ~50 B/round
    assert growth_stderr([(60, 5), (61, 6)], 100) == 0.0  # two samples: no spread to measure


def test_the_coordinator_runs_under_cprofile_only_when_asked(tmp_path):
    plain = _coordinator_argv(CoordinatorBenchOptions(), tmp_path)
    assert plain[1:4] == ["-m", "shoal.cli", "coordinator"] and "cProfile" not in plain
    profiled = _coordinator_argv(CoordinatorBenchOptions(coordinator_profile=str(tmp_path / "c.prof")), tmp_path)
    assert profiled[1:4] == ["-m", "cProfile", "-o"] and profiled[4] == str(tmp_path / "c.prof")
    assert profiled[5:] == plain[1:]


def test_accept_loops_reach_the_coordinator_only_when_given(tmp_path):
    plain = _coordinator_argv(CoordinatorBenchOptions(), tmp_path)
    assert "--accept-loops" not in plain  # the coordinator's own default
    argv = _coordinator_argv(CoordinatorBenchOptions(accept_loops=1), tmp_path)
    assert argv[argv.index("--accept-loops") + 1] == "1"


def test_the_members_seconds_are_summed_and_kept_per_process():
    a = {"beats_at": {"10": [5, 1, 3, 0], "11": [4, 0, 2, 1]}}
    b = {"beats_at": {"11": [6, 2, 40, 35]}}
    assert _beats_at([a, b]) == {10: (5, 1, "1/0", "3/0", "0/0"), 11: (10, 2, "0/2", "2/40", "1/35")}
    assert _beats_at([{}]) == {}  # a process that measured nothing


def test_every_member_is_drawn_after_the_round_that_draws_the_last_one():
    rounds = [(2, ("c", "d")), (0, ("a", "b")), (1, ("a", "c")), (3, ("e", "a"))]  # any order
    assert all_drawn_round(rounds, 4) == 3  # a, b, c, d by round 2: from round 3 on
    assert all_drawn_round(rounds, 5) == 4
    assert all_drawn_round(rounds, 6) is None  # one member never took part


def test_steady_growth_is_the_slope_from_the_round_every_member_was_drawn():
    samples = [(r, 1000 + (50 * r if r < 300 else 50 * 300)) for r in range(600)]  # a warm-up, then flat
    assert growth_per_round(samples, 600) == pytest.approx(0.0)  # the second half: flat here too
    assert steady_growth(samples, 600, 300) == pytest.approx((0.0, 0.0))
    assert steady_growth(samples, 600, 200)[0] > 0  # from inside the warm-up: it shows
    assert steady_growth(samples, 600, None) is None  # some member never drawn
    assert steady_growth(samples, 600, 560) is None  # fewer than 50 rounds left after it
