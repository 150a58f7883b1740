"""The eager outer update (Kale et al. 2025, arXiv 2502.12996): the estimate of a round's
all-reduce on small vectors, the merge and its correction, the agent-side estimate of the PyTorch
integration through its real queues, and the committed state left exactly as without it."""

from __future__ import annotations


import numpy as np
import pytest

from shoal.common.errors import InvalidArgument
from shoal.config import ConfigError, RunSection
from shoal.peer.fragments import FragmentedOuter, eager_correct, eager_gradient, merge
from shoal.peer.outer import DiLoCo
from shoal.peer.training import RunConfig


def test_the_eager_gradient_is_the_own_fresh_term_plus_the_pending_delayed_ones():
    """M = 4 equal peers (share 1/4). In the paper's setting the others' terms of the previous
    all-reduce are still pending: (1/M) Delta_m(t) + (1/M) sum_{j != m} Delta_j(t - 1). On Shoal's
    committed parameters nothing is pending: the own fresh term alone."""
    d = [np.array(v, np.float32) for v in ([1, 2, 3], [0, -1, 4], [2, 2, 2], [-3, 1, 0])]
    fresh = np.array([5, -5, 1], np.float32)
    pending = ((d[1] + d[2] + d[3]) / 4).astype(np.float32)
    got = eager_gradient(fresh, 0.25, pending)
    assert got.dtype == np.float32 and got.shape == (3,)
    np.testing.assert_allclose(got, (fresh + d[1] + d[2] + d[3]) / 4, rtol=0, atol=1e-6)
    assert np.array_equal(eager_gradient(fresh, 0.25), (fresh / 4).astype(np.float32))
    # Weighted shares (n = 1, 3): the own term weighs 1/4.
    np.testing.assert_allclose(eager_gradient(np.array([4, 8], np.float32), 0.25), [1, 2], rtol=0, atol=0)
    # Every term is applied once: the eager step's own term plus the correction's rest is the
    # all-reduce (1/M) sum_j Delta_j(t).
    full = np.mean([fresh, *d[1:]], axis=0)
    np.testing.assert_allclose(eager_gradient(fresh, 0.25) + pending, full, rtol=0, atol=1e-6)


def test_bad_eager_inputs_name_the_field():
    x = np.zeros(3, np.float32)
    with pytest.raises(InvalidArgument, match="^pending:"):
        eager_gradient(x, 0.5, np.zeros(4, np.float32))
    with pytest.raises(InvalidArgument, match="^share:"):
        eager_gradient(x, 1.5)


def test_merge_then_correct_ends_on_the_committed_merge_plus_the_steps_since():
    rng = np.random.default_rng(0)
    sub, est, com, steps = (rng.standard_normal(6).astype(np.float32) for _ in range(4))
    for alpha in (0.0, 0.5, 0.9):
        working = merge(sub, est, alpha) + steps  # the eager merge at the hand-over, then tau steps
        fixed = eager_correct(working, com, est, alpha)
        np.testing.assert_allclose(fixed, alpha * sub + (1 - alpha) * com + steps, rtol=0, atol=1e-5)
        # An exact estimate needs no correction.
        assert np.array_equal(eager_correct(working, est, est, alpha), working)
    # alpha = 0 (the whole-model --overlap): theta_c + (theta - theta_e).
    np.testing.assert_allclose(eager_correct(est + steps, com, est, 0.0), com + steps, atol=1e-6)


def test_preview_steps_a_copy_of_the_fragments_optimizer():
    outer = FragmentedOuter(DiLoCo, 2)
    p, g = np.ones(3, np.float32), np.full(3, 0.1, np.float32)
    outer.step_fragment(1, p, g)  # some momentum in fragment 1
    before = {k: v.copy() for k, v in outer.state().items()}
    seen = outer.preview_fragment(1, p, g)
    assert all(np.array_equal(outer.state()[k], v) for k, v in before.items())
    assert seen.tobytes() == outer.step_fragment(1, p, g).tobytes()
    with pytest.raises(InvalidArgument, match="^fragment:"):
        outer.preview_fragment(2, p, g)


def test_eager_needs_a_delayed_update():
    with pytest.raises(InvalidArgument, match="^eager:"):
        RunConfig(inner_steps=8, fragments=4, eager=True)
    with pytest.raises(InvalidArgument, match="^eager:"):
        RunConfig(inner_steps=8, eager=True)
    RunConfig(inner_steps=8, fragments=4, fragment_overlap=1, eager=True)
    RunConfig(inner_steps=8, overlap=True, eager=True)
    with pytest.raises(ConfigError) as err:
        RunSection(inner_steps=8, fragments=4, eager=True).validate()
    assert err.value.setting == "run.eager"
    assert RunSection(inner_steps=8, fragments=4, fragment_overlap=2, eager=True).to_run_config(4).eager
    assert RunSection().to_run_config(4).error_feedback and not RunSection(error_feedback=False).to_run_config(4).error_feedback
