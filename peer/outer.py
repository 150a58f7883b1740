"""Outer optimizers: how a committed round's aggregate moves the shared parameters.

In federated / DiLoCo training each peer runs an *inner* optimizer locally for some steps, then
the swarm all-reduces the *pseudo-gradient* `delta = params_before - params_after_local` (the
aggregate of every participant's delta, produced by `peer.aggregators`). Every peer then applies
the same *outer* optimizer step to the same parameters with the same aggregate, so every peer
ends the round with bit-identical parameters: all arithmetic here is elementwise float32 with
float32 constants, no reductions, no BLAS, no randomness.

This module owns the update rules and their state; it does not decide when a round commits
(apply `step` only after commit; on abort do nothing) and does not serialize state to the wire
(`peer.state_sync` does, from `state()`).

Sign convention: `delta` points *away* from where training went (params_before - params_after),
like a gradient, so every rule subtracts. With `"sgd"` and `lr=1.0` the step returns exactly
`params - delta`, the average of the participants' locally trained parameters (FedAvg).
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

import numpy as np

from shoal.common.errors import InvalidArgument, construct

__all__ = [
    "DiLoCo",
    "FedAdagrad",
    "FedAdam",
    "FedAvgM",
    "FedYogi",
    "OUTER_OPTIMIZERS",
    "OuterOptimizer",
    "OuterSGD",
    "fedprox_grad",
    "make_outer",
]

_F32 = np.float32


@runtime_checkable
class OuterOptimizer(Protocol):
    """An outer update rule with explicit, serializable state.

    `step(params, pseudo_grad)` returns the new `(n,)` float32 parameters and advances the
    state; it never mutates its inputs. On error (`InvalidArgument`) neither the inputs nor the
    state change. `state()` returns copies of every buffer (names -> arrays, including a 0-d
    int64 `"step"` counter); `load_state(state())` on a fresh instance with the same
    hyper-parameters reproduces the same future steps bit for bit.
    """

    name: str

    def step(self, params: np.ndarray, pseudo_grad: np.ndarray) -> np.ndarray: ...

    def state(self) -> dict[str, np.ndarray]: ...

    def load_state(self, state: dict[str, np.ndarray]) -> None: ...


def _check_pair(params: np.ndarray, pseudo_grad: np.ndarray) -> None:
    for field, a in (("params", params), ("pseudo_grad", pseudo_grad)):
        if not isinstance(a, np.ndarray) or a.ndim != 1 or a.dtype != np.float32:
            shape = getattr(a, "shape", None)
            dtype = getattr(a, "dtype", type(a).__name__)
            raise InvalidArgument(f"{field}: expected a 1-D float32 array, got shape {shape} dtype {dtype}")
    if params.shape != pseudo_grad.shape:
        raise InvalidArgument(f"pseudo_grad: shape {pseudo_grad.shape} != params shape {params.shape}")
    if not np.all(np.isfinite(pseudo_grad)):
        raise InvalidArgument("pseudo_grad: must be finite")
    if not np.all(np.isfinite(params)):
        raise InvalidArgument("params: must be finite")


def _hyper(name: str, value: object, low: float, high: float, *, low_open: bool = False) -> np.float32:
    try:
        v = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise InvalidArgument(f"{name}: expected a number, got {value!r}") from None
    if not (math.isfinite(v) and (v > low if low_open else v >= low) and v <= high):
        raise InvalidArgument(f"{name}: out of range, got {value!r}")
    return _F32(v)


class _Base:
    """Buffers keyed by name, all `(n,)` float32, created on the first step."""

    name = ""
    _buffers: tuple[str, ...] = ()

    def __init__(self) -> None:
        self._state: dict[str, np.ndarray] = {}
        self._step = 0

    def _init_buffers(self, n: int) -> dict[str, np.ndarray]:
        return {k: np.zeros(n, dtype=_F32) for k in self._buffers}

    def _update(self, params: np.ndarray, g: np.ndarray, buf: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        raise NotImplementedError

    def step(self, params: np.ndarray, pseudo_grad: np.ndarray) -> np.ndarray:
        """New parameters `(n,)` float32 after one outer step on `pseudo_grad` `(n,)` float32.

        Raises:
            InvalidArgument: shapes/dtypes wrong, non-finite input, or `n` differs from the
                size the state was built for. Nothing changes then.
        """
        _check_pair(params, pseudo_grad)
        n = params.shape[0]
        buf = self._state if self._state else self._init_buffers(n)
        for k, v in buf.items():
            if v.shape != (n,):
                raise InvalidArgument(f"params: size {n} != optimizer state size {v.shape[0]} ({k})")
        new_params, new_buf = self._update(params, pseudo_grad, buf)
        self._state = new_buf
        self._step += 1
        return new_params

    def state(self) -> dict[str, np.ndarray]:
        """Copies of the buffers plus `"step"` (0-d int64); buffers absent before the first step."""
        out = {k: v.copy() for k, v in self._state.items()}
        out["step"] = np.array(self._step, dtype=np.int64)
        return out

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        """Replace the state with (copies of) `state`, as produced by `state()`.

        Raises:
            InvalidArgument: missing/unknown key, wrong dtype, buffers of different sizes,
                non-finite values, negative step. The old state is kept then.
        """
        if not isinstance(state, dict):
            raise InvalidArgument("state: expected a dict")
        extra = set(state) - set(self._buffers) - {"step"}
        if extra:
            raise InvalidArgument(f"state: unknown keys {sorted(extra)} for {self.name}")
        if "step" not in state:
            raise InvalidArgument("state.step: missing")
        step = np.asarray(state["step"])
        if step.shape != () or not np.issubdtype(step.dtype, np.integer) or int(step) < 0:
            raise InvalidArgument("state.step: expected a 0-d non-negative integer")
        present = [k for k in self._buffers if k in state]
        if present and len(present) != len(self._buffers):
            missing = sorted(set(self._buffers) - set(present))
            raise InvalidArgument(f"state.{missing[0]}: missing")
        new: dict[str, np.ndarray] = {}
        size = None
        for k in present:
            v = state[k]
            if not isinstance(v, np.ndarray) or v.ndim != 1 or v.dtype != _F32:
                raise InvalidArgument(f"state.{k}: expected a 1-D float32 array")
            if size is not None and v.shape[0] != size:
                raise InvalidArgument(f"state.{k}: size {v.shape[0]} != {size}")
            if not np.all(np.isfinite(v)):
                raise InvalidArgument(f"state.{k}: must be finite")
            size = v.shape[0]
            new[k] = v.copy()
        self._state = new
        self._step = int(step)


class OuterSGD(_Base):
    """Plain outer SGD: `params - lr * delta`. With lr = 1 this is FedAvg (McMahan et al. 2017):
    the new parameters are the participants' (aggregated) locally trained parameters.

    Args:
        lr: outer learning rate, > 0 (default 1.0).
    """

    name = "sgd"

    def __init__(self, lr: float = 1.0) -> None:
        super().__init__()
        self.lr = _hyper("lr", lr, 0.0, math.inf, low_open=True)

    def _update(self, params, g, buf):
        return params - self.lr * g, buf  # lr * g == g exactly when lr == 1


class FedAvgM(_Base):
    """FedAvgM, server momentum (Hsu, Qi and Brown 2019, "Measuring the Effects of Non-Identical
    Data Distribution for Federated Visual Classification"):

        v <- momentum * v + delta;   params <- params - lr * v

    Args:
        lr: > 0 (default 1.0).  momentum: in [0, 1] (default 0.9).
    """

    name = "fedavgm"
    _buffers = ("momentum",)

    def __init__(self, lr: float = 1.0, momentum: float = 0.9) -> None:
        super().__init__()
        self.lr = _hyper("lr", lr, 0.0, math.inf, low_open=True)
        self.momentum = _hyper("momentum", momentum, 0.0, 1.0)

    def _update(self, params, g, buf):
        v = self.momentum * buf["momentum"] + g
        return params - self.lr * v, {"momentum": v}


class DiLoCo(_Base):
    """DiLoCo's outer optimizer, SGD with Nesterov momentum (Douillard et al. 2023, "DiLoCo:
    Distributed Low-Communication Training of Language Models"), in PyTorch's form:

        v <- momentum * v + delta;   params <- params - lr * (delta + momentum * v)

    Args:
        lr: > 0 (default 0.7).  momentum: in [0, 1] (default 0.9), the paper's values.
    """

    name = "diloco"
    _buffers = ("momentum",)

    def __init__(self, lr: float = 0.7, momentum: float = 0.9) -> None:
        super().__init__()
        self.lr = _hyper("lr", lr, 0.0, math.inf, low_open=True)
        self.momentum = _hyper("momentum", momentum, 0.0, 1.0)

    def _update(self, params, g, buf):
        v = self.momentum * buf["momentum"] + g
        return params - self.lr * (g + self.momentum * v), {"momentum": v}


class _Adaptive(_Base):
    """Shared shape of Reddi et al. 2021's Algorithm 2 (FedAdagrad / FedAdam / FedYogi):

        m <- beta1 * m + (1 - beta1) * delta
        v <- rule(v, delta^2)
        params <- params - lr * m / (sqrt(v) + tau)

    with `m_0 = 0`, `v_0 = tau^2` (the paper's `v_{-1} >= tau^2`) and no bias correction.
    `tau` is the adaptivity: large tau behaves like momentum SGD, small tau like sign descent.
    """

    _buffers = ("m", "v")

    def __init__(self, lr: float, beta1: float, beta2: float, tau: float) -> None:
        super().__init__()
        self.lr = _hyper("lr", lr, 0.0, math.inf, low_open=True)
        self.beta1 = _hyper("beta1", beta1, 0.0, 1.0)
        self.beta2 = _hyper("beta2", beta2, 0.0, 1.0)
        self.tau = _hyper("tau", tau, 0.0, math.inf, low_open=True)

    def _init_buffers(self, n: int) -> dict[str, np.ndarray]:
        return {"m": np.zeros(n, dtype=_F32), "v": np.full(n, self.tau * self.tau, dtype=_F32)}

    def _second_moment(self, v: np.ndarray, g2: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _update(self, params, g, buf):
        one = _F32(1.0)
        m = self.beta1 * buf["m"] + (one - self.beta1) * g
        v = self._second_moment(buf["v"], g * g)
        return params - self.lr * m / (np.sqrt(v) + self.tau), {"m": m, "v": v}


class FedAdagrad(_Adaptive):
    """FedAdagrad (Reddi et al. 2021, "Adaptive Federated Optimization"): `v <- v + delta^2`.

    Args:
        lr: > 0 (default 0.1).  beta1: in [0, 1] (default 0.0, no momentum).
        tau: adaptivity, > 0 (default 1e-3).
    """

    name = "fedadagrad"

    def __init__(self, lr: float = 0.1, beta1: float = 0.0, tau: float = 1e-3) -> None:
        super().__init__(lr, beta1, 0.0, tau)

    def _second_moment(self, v, g2):
        return v + g2


class FedAdam(_Adaptive):
    """FedAdam (Reddi et al. 2021): `v <- beta2 * v + (1 - beta2) * delta^2`.

    Args:
        lr: > 0 (default 0.1).  beta1: (default 0.9).  beta2: (default 0.99).
        tau: adaptivity, > 0 (default 1e-3).
    """

    name = "fedadam"

    def __init__(self, lr: float = 0.1, beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3) -> None:
        super().__init__(lr, beta1, beta2, tau)

    def _second_moment(self, v, g2):
        return self.beta2 * v + (_F32(1.0) - self.beta2) * g2


class FedYogi(_Adaptive):
    """FedYogi (Reddi et al. 2021; Yogi: Zaheer et al. 2018):
    `v <- v - (1 - beta2) * delta^2 * sign(v - delta^2)`.

    Args:
        lr: > 0 (default 0.1).  beta1: (default 0.9).  beta2: (default 0.99).
        tau: adaptivity, > 0 (default 1e-3).
    """

    name = "fedyogi"

    def __init__(self, lr: float = 0.1, beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3) -> None:
        super().__init__(lr, beta1, beta2, tau)

    def _second_moment(self, v, g2):
        return v - (_F32(1.0) - self.beta2) * g2 * np.sign(v - g2)


OUTER_OPTIMIZERS: dict[str, type] = {
    "sgd": OuterSGD,
    "fedavgm": FedAvgM,
    "fedadam": FedAdam,
    "fedyogi": FedYogi,
    "fedadagrad": FedAdagrad,
    "diloco": DiLoCo,
}


def make_outer(name: str, **params: object) -> OuterOptimizer:
    """Build an outer optimizer by name: "sgd" ("fedavg", removed in 0.3, is refused naming it), "fedavgm", "fedadam",
    "fedyogi", "fedadagrad", "diloco"; `params` are the class's keyword arguments.

    Raises:
        InvalidArgument: unknown name ("outer") or bad parameter (named).
    """
    return construct(OUTER_OPTIMIZERS, name, "outer", {"fedavg": "sgd"}, **params)


def fedprox_grad(params: np.ndarray, global_params: np.ndarray, mu: float) -> np.ndarray:
    """Gradient of FedProx's proximal term `mu/2 * ||w - w_global||^2` (Li et al. 2020,
    "Federated Optimization in Heterogeneous Networks"): `mu * (w - w_global)`.

    The peer's inner loop adds it to the loss gradient; `global_params` are the parameters at
    the start of the round.

    Args:
        params: `(n,)` float32, current local parameters `w`.
        global_params: `(n,)` float32.
        mu: proximal strength, finite and >= 0.

    Returns:
        A new `(n,)` float32 array.

    Raises:
        InvalidArgument: shapes/dtypes differ or `mu` is out of range.
    """
    for field, a in (("params", params), ("global_params", global_params)):
        if not isinstance(a, np.ndarray) or a.ndim != 1 or a.dtype != np.float32:
            raise InvalidArgument(f"{field}: expected a 1-D float32 array")
    if params.shape != global_params.shape:
        raise InvalidArgument(f"global_params: shape {global_params.shape} != params shape {params.shape}")
    m = _hyper("mu", mu, 0.0, math.inf)
    return m * (params - global_params)
