"""Outer optimizers: each rule against a plain float64 reference, FedAvg identity, no mutation,
bit-identical replicas, state round trip, refusal of bad input without side effects."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.common.errors import InvalidArgument
from shoal.peer.outer import OUTER_OPTIMIZERS, OuterOptimizer, fedprox_grad, make_outer

SETTINGS = settings(max_examples=30, deadline=None, derandomize=True)
NAMES = sorted(OUTER_OPTIMIZERS)


class Reference:
    """The update rules written out in float64, straight from the papers."""

    def __init__(self, name: str, **p: float) -> None:
        self.name, self.p, self.state = name, p, None

    def step(self, x: np.ndarray, g: np.ndarray) -> np.ndarray:
        x, g, p = x.astype(np.float64), g.astype(np.float64), self.p
        if self.name == "sgd":
            return x - p.get("lr", 1.0) * g
        if self.name in ("fedavgm", "diloco"):
            lr = p.get("lr", 1.0 if self.name == "fedavgm" else 0.7)
            mu = p.get("momentum", 0.9)
            v = mu * (self.state if self.state is not None else 0.0) + g
            self.state = v
            return x - lr * v if self.name == "fedavgm" else x - lr * (g + mu * v)
        lr, tau = p.get("lr", 0.1), p.get("tau", 1e-3)
        b1 = p.get("beta1", 0.0 if self.name == "fedadagrad" else 0.9)
        b2 = p.get("beta2", 0.99)
        if self.state is None:
            self.state = (np.zeros_like(g), np.full_like(g, tau * tau))
        m, v = self.state
        m = b1 * m + (1 - b1) * g
        if self.name == "fedadagrad":
            v = v + g * g
        elif self.name == "fedadam":
            v = b2 * v + (1 - b2) * g * g
        else:
            v = v - (1 - b2) * g * g * np.sign(v - g * g)
        self.state = (m, v)
        return x - lr * m / (np.sqrt(v) + tau)


@pytest.mark.parametrize("name", NAMES)
@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 50), steps=st.integers(1, 6), scale=st.sampled_from([1e-3, 1.0, 10.0]))
def test_matches_float64_reference(name, seed, n, steps, scale):
    rng = np.random.default_rng(seed)
    opt, ref = make_outer(name), Reference(name)
    x = rng.standard_normal(n).astype(np.float32)
    xr = x.astype(np.float64)
    for _ in range(steps):
        g = (rng.standard_normal(n) * scale).astype(np.float32)
        x = opt.step(x, g)
        xr = ref.step(xr, g)
        assert x.dtype == np.float32 and x.shape == (n,) and np.all(np.isfinite(x))
        np.testing.assert_allclose(x, xr, rtol=2e-4, atol=2e-4 * (1 + float(np.abs(xr).max())))


def test_sgd_lr1_is_fedavg():
    rng = np.random.default_rng(0)
    before = rng.standard_normal(100).astype(np.float32)
    after = [(before - 0.01 * rng.standard_normal(100)).astype(np.float32) for _ in range(4)]
    delta = np.mean([before - a for a in after], axis=0).astype(np.float32)
    new = make_outer("sgd").step(before, delta)
    assert new.tobytes() == (before - delta).tobytes()
    np.testing.assert_allclose(new, np.mean(after, axis=0), rtol=1e-5, atol=1e-6)
    with pytest.raises(InvalidArgument, match="outer: 'fedavg' was removed in 0.3; use 'sgd'"):
        make_outer("fedavg")


def test_diloco_defaults_and_first_step():
    opt = make_outer("diloco")
    assert float(opt.lr) == pytest.approx(0.7) and float(opt.momentum) == pytest.approx(0.9)
    x, g = np.ones(3, dtype=np.float32), np.full(3, 0.1, dtype=np.float32)
    # v = g; update = lr * (g + mu * g) = 0.7 * 0.19
    np.testing.assert_allclose(opt.step(x, g), 1 - 0.7 * 0.19, rtol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_no_mutation_replicas_bit_identical_and_state_round_trip(name):
    rng = np.random.default_rng(42)
    a, b = make_outer(name), make_outer(name)
    assert isinstance(a, OuterOptimizer) and a.name == name
    xa = xb = rng.standard_normal(64).astype(np.float32)
    grads = [rng.standard_normal(64).astype(np.float32) for _ in range(6)]
    for g in grads[:3]:
        prev, x0, g0 = xa, xa.copy(), g.copy()
        xa, xb = a.step(xa, g), b.step(xb, g)
        assert np.array_equal(prev, x0) and np.array_equal(g, g0)
        assert xa.tobytes() == xb.tobytes()
    state = a.state()
    assert int(state["step"]) == 3
    for k, v in state.items():
        if k != "step":
            v += 1  # state() hands out copies
    c = make_outer(name)
    c.load_state(a.state())
    xc = xa.copy()
    for g in grads[3:]:
        xa, xc = a.step(xa, g), c.step(xc, g)
        assert xa.tobytes() == xc.tobytes()
    assert {k: v.tobytes() for k, v in a.state().items()} == {k: v.tobytes() for k, v in c.state().items()}


@pytest.mark.parametrize("name", NAMES)
def test_step_does_not_mutate_inputs(name):
    x = np.linspace(-1, 1, 9, dtype=np.float32)
    g = np.linspace(1, -1, 9, dtype=np.float32)
    x0, g0 = x.copy(), g.copy()
    out = make_outer(name).step(x, g)
    assert out is not x and np.array_equal(x, x0) and np.array_equal(g, g0)


@pytest.mark.parametrize("name", NAMES)
def test_bad_input_raises_and_leaves_state(name):
    opt = make_outer(name)
    x = np.ones(4, dtype=np.float32)
    opt.step(x, np.full(4, 0.5, dtype=np.float32))
    before = {k: v.tobytes() for k, v in opt.state().items()}
    bad = [
        (x, np.ones(5, dtype=np.float32), "pseudo_grad"),
        (x, np.ones(4, dtype=np.float64), "pseudo_grad"),
        (x.reshape(2, 2), np.ones((2, 2), dtype=np.float32), "params"),
        (x, np.array([1, np.nan, 1, 1], dtype=np.float32), "pseudo_grad"),
        (np.array([1, np.inf, 1, 1], dtype=np.float32), x, "params"),
    ]
    for p, g, field in bad:
        with pytest.raises(InvalidArgument, match=f"^{field}"):
            opt.step(p, g)
    if OUTER_OPTIMIZERS[name]._buffers:
        with pytest.raises(InvalidArgument, match="^params"):
            opt.step(np.ones(5, dtype=np.float32), np.ones(5, dtype=np.float32))
    assert {k: v.tobytes() for k, v in opt.state().items()} == before


def test_load_state_validation():
    opt = make_outer("fedadam")
    good = {"m": np.zeros(3, np.float32), "v": np.ones(3, np.float32), "step": np.array(2, np.int64)}
    opt.load_state(good)
    assert int(opt.state()["step"]) == 2
    cases = [
        ({**good, "extra": np.zeros(3, np.float32)}, "state"),
        ({"m": good["m"], "v": good["v"]}, "state.step"),
        ({"m": good["m"], "step": good["step"]}, "state.v"),
        ({**good, "v": np.ones(4, np.float32)}, "state.v"),
        ({**good, "m": np.zeros(3, np.float64)}, "state.m"),
        ({**good, "m": np.array([0, np.nan, 0], np.float32)}, "state.m"),
        ({**good, "step": np.array(-1)}, "state.step"),
    ]
    for state, field in cases:
        with pytest.raises(InvalidArgument, match=f"^{field}"):
            opt.load_state(state)
    assert int(opt.state()["step"]) == 2
    fresh = make_outer("diloco")
    fresh.load_state({"step": np.array(0)})  # before the first step: no buffers yet
    assert set(fresh.state()) == {"step"}


def test_make_outer_errors():
    with pytest.raises(InvalidArgument, match="^outer"):
        make_outer("adamw")
    with pytest.raises(InvalidArgument, match="^outer"):
        make_outer("sgd", momentum=0.9)
    with pytest.raises(InvalidArgument, match="^lr"):
        make_outer("diloco", lr=0)
    with pytest.raises(InvalidArgument, match="^momentum"):
        make_outer("fedavgm", momentum=1.5)
    with pytest.raises(InvalidArgument, match="^tau"):
        make_outer("fedyogi", tau=0.0)


def test_fedprox_grad():
    w = np.array([1.0, 2.0, -3.0], dtype=np.float32)
    wg = np.array([0.5, 2.0, 1.0], dtype=np.float32)
    out = fedprox_grad(w, wg, 0.1)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, [0.05, 0.0, -0.4], rtol=1e-6)
    assert np.array_equal(fedprox_grad(w, wg, 0.0), np.zeros(3, np.float32))
    with pytest.raises(InvalidArgument, match="^global_params"):
        fedprox_grad(w, wg[:2], 0.1)
    with pytest.raises(InvalidArgument, match="^mu"):
        fedprox_grad(w, wg, -1.0)
