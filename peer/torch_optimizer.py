"""The swarm optimizers of `shoal.torch`: a user's PyTorch loop trains with a Shoal swarm.

This module is the implementation; `shoal.torch` is the public module (its docstring is the
user's guide: an example, and a configuration guide that ties each setting to what a user
observes). It holds the `torch.optim.Optimizer` subclasses (`SwarmOptimizer`, `DiLoCoOptimizer`,
`FedAvgOptimizer`), the bridge between the trainer's thread and the peer agent's thread
(`TorchWorkload`), the host buffers the parameters travel through (`HostBuffer`), and the
adapter that applies a user's own torch outer optimizer bit-identically on every peer
(`TorchOuter`). It does not play rounds (peer.rounds), aggregate (peer.collectives) or decide
who takes part (the coordinator).

Threads: the trainer calls `step()` in its own thread; a `PeerAgent` runs in a background thread
(its own asyncio loop) and talks to the trainer through two queues. Every committed state is
computed in the agent's thread from the all-reduced pseudo-gradient, bit-identical on every peer
(checked by the vote's state digest), and loaded into the model in the trainer's thread.

With the run's `local_work = "time"` a local phase is not H steps but a time budget: H times
the swarm's pace (the fast participants' seconds per inner step in the last committed round,
`Commit.step_seconds`), so a slow peer runs fewer steps and nobody waits for it; its update is
then weighted by the samples it processed (`step(samples=...)`), FedAvg's weighting of each
client's update by its data (McMahan et al. 2017), here per round.

With the run's `overlap`, `step()` does not wait for the round: the local parameters of round r
are handed over and the next local phase starts from them at once, while the all-reduce runs in
the agent's thread. When round r's committed parameters θ_c arrive (checked at every step), the
model becomes θ_c + (θ - θ_sub), θ_sub the parameters handed over: the one-step-delayed outer
update of overlapped DiLoCo (Kale et al. 2025, "Eager updates for overlapped communication and
computation in DiLoCo"; Douillard et al. 2025, "Streaming DiLoCo"). At most one round is in
flight: a phase that reaches its end before the round in flight landed goes on with inner steps
until it lands, then hands over.

With the run's `fragments` F > 1 (Streaming DiLoCo, Douillard et al. 2025, arXiv 2501.18512;
`peer.fragments`) a local phase is H / F steps and its round carries one fragment, `round mod F`:
the pseudo-gradient is that fragment's (committed - local), and when the committed fragment
arrives only it is merged, `alpha * local + (1 - alpha) * committed` (`fragment_alpha`); the other
fragments keep their local values until their own round. With `fragment_overlap` τ > 0 the
hand-over returns at once and the merge happens at the first step at least τ steps later at which
the round has landed (a phase that ends first trains on, as with overlap); with τ = 0 `step()`
waits for the round. A state sync (a missed round, a joiner) loads every parameter.

With the run's `eager` (Kale et al. 2025, "Eager updates for overlapped communication and
computation in DiLoCo", arXiv 2502.12996), the hand-over does not leave the outer update to the
delayed round: the agent's thread runs the outer step of a copy of the committed optimizer on
this peer's own fresh term (`share * pseudo-gradient`, `peer.fragments.eager_gradient`) from
the committed parameters, which already hold every delayed all-reduce; the trainer merges that
estimate θ_e at once (`alpha * local + (1 - alpha) * θ_e` on the fragment, or θ_e itself with `overlap`)
and trains on. When the round lands, the estimate is replaced by the committed result, the steps
taken since kept: `+ (1 - alpha) * (θ_c - θ_e)` on the fragment, `θ_c + (θ - θ_e)` with
`overlap`. Only the trainer's working parameters see the estimate; the committed state (the
vote's digest) is computed from the all-reduce alone, bit-identical on every peer as without it.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import math
import os
import pathlib
import queue
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from shoal.common.errors import InvalidArgument
from shoal.common.identity import KeyInUse
from shoal.common.security import Security
from shoal.peer.agent import PeerAgent, PeerConfig
from shoal.peer.compute_accounting import ComputeLedger, TrainerTimes
from shoal.peer.fragments import Fragments, eager_correct, eager_gradient, merge
from shoal.peer.training import CommittedState, LocalUpdate, RunConfig, make_outer_for
from shoal.peer.workloads.base import FlatStateWorkload, WorkloadClosed

log = logging.getLogger("shoal.torch")

POLL_SECONDS = 0.2
JOIN_TOKEN_ENV = "SHOAL_JOIN_TOKEN"
# PeerConfig fields the optimizer sets itself from its own arguments (never through **peer_config).
_OWN_FIELDS = ("join_token", "coordinator", "listen", "advertise", "key_path", "name",
               "outbound_only", "relay", "connect_timeout")


class SwarmError(RuntimeError):
    """The peer agent behind a swarm optimizer failed, or the swarm refused it; the message says why.
    The model keeps its last committed parameters."""


class RoundTimeout(SwarmError):
    """No round committed within `round_timeout` seconds of the hand-over. The round stays in
    flight: `step()` goes on training locally and lands it when it arrives (the steps taken
    meanwhile are kept with the run's `overlap`, dropped without), `outer_step()` waits for it
    again, `close()` leaves the swarm."""


class InsecureWarning(UserWarning):
    """`insecure=True`: the optimizer talks plaintext gRPC (anyone on the path can read and alter it)."""


def security_of(tls_dir: str | os.PathLike[str] | None, insecure: bool) -> Security:
    """The transport security of a swarm optimizer: TLS from `tls_dir` (it must hold the
    coordinator's ca.pem), or plaintext when `insecure` is True (then one InsecureWarning).

    Raises:
        ValueError: neither or both are given; `tls_dir` is not a directory or lacks ca.pem.
            One line saying what to pass.
    """
    if tls_dir and insecure:
        raise ValueError("tls_dir and insecure=True exclude each other: pass one of them")
    if not tls_dir and not insecure:
        raise ValueError("pass tls_dir=DIR (a directory holding the coordinator's ca.pem, from `shoal certs init`) "
                         "or insecure=True for plaintext gRPC")
    if insecure:
        warnings.warn("insecure=True: plaintext gRPC to the coordinator and the other peers; anyone on the path "
                      "can read and alter the traffic", InsecureWarning, stacklevel=3)
        return Security(insecure=True)
    d = pathlib.Path(tls_dir)
    if not d.is_dir():
        raise ValueError(f"tls_dir {tls_dir}: no such directory (copy the coordinator's tls/ca.pem into one)")
    if not (d / "ca.pem").is_file():
        raise ValueError(f"tls_dir {tls_dir}: missing ca.pem (copy the coordinator's tls/ca.pem there)")
    return Security(tls_dir=str(d))


# ---------------------------------------------------------------- parameters <-> host vector


def flatten(model: torch.nn.Module) -> np.ndarray:
    """The model's parameters as one new (n,) float32 numpy vector (a CPU copy), in
    `model.parameters()` order."""
    return HostBuffer(list(model.parameters())).gather().copy()


def unflatten_into(model: torch.nn.Module, params: np.ndarray) -> None:
    """Copy (n,) float32 `params` into the model's parameters, in place (device and dtype kept).

    Raises:
        ValueError: `params` does not have one element per model parameter element.
    """
    HostBuffer(list(model.parameters())).scatter(params)


def layout_of(model: torch.nn.Module) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(name, shape) of each parameter in `flatten`'s order (`named_parameters`, shared ones once)."""
    return tuple((name, tuple(p.shape)) for name, p in model.named_parameters())


class HostBuffer:
    """One float32 host vector for a list of parameters, allocated once and reused.

    `gather()` copies the parameters (any device, any floating dtype) into it and returns it as
    a (n,) float32 numpy view (overwritten by the next gather or scatter: copy it to keep it);
    `scatter(params)` copies a (n,) vector back into the parameters, each in its own device and
    dtype. With a parameter on CUDA the vector is in pinned (page-locked) memory and the copies
    are asynchronous, then synchronized once per call: one device-to-host transfer per
    parameter, no allocation per call. Parameters on the CPU are copied with no transfer.
    """

    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.cuda = any(p.device.type == "cuda" for p in params) and torch.cuda.is_available()
        self.buffer = torch.empty(self.numel, dtype=torch.float32, pin_memory=self.cuda)
        self.array = self.buffer.numpy()

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def gather(self) -> np.ndarray:
        with torch.no_grad():
            offset = 0
            for p in self.params:
                n = p.numel()
                self.buffer[offset:offset + n].copy_(p.detach().reshape(-1), non_blocking=self.cuda)
                offset += n
            self._sync()
        return self.array

    def scatter(self, params: np.ndarray) -> None:
        params = np.asarray(params)
        if params.size != self.numel:
            raise ValueError(f"params: {params.size} elements for a model of {self.numel}")
        if params is not self.array:
            np.copyto(self.array, params.reshape(-1), casting="same_kind")
        with torch.no_grad():
            offset = 0
            for p in self.params:
                n = p.numel()
                p.copy_(self.buffer[offset:offset + n].view_as(p), non_blocking=self.cuda)
                offset += n
            self._sync()


# ---------------------------------------------------------------- the user's own outer optimizer


class TorchOuter:
    """A user's torch optimizer as Shoal's outer optimizer (the peer.outer.OuterOptimizer protocol).

    Built from `template`, a torch optimizer over the model's parameters (torchft's DiLoCo takes
    one: Douillard et al. 2023 use SGD with Nesterov momentum, lr 0.7, momentum 0.9): the same
    class with the same parameter groups and hyper-parameters runs on CPU float32 copies of the
    parameters ("shadows"), never on the model itself. `step(params, pseudo_grad)` loads
    `params` (n,) float32 into the shadows, sets their gradients to `pseudo_grad` (n,) float32
    (committed - local, a gradient's sign) and runs one step: every peer applies the same
    deterministic CPU arithmetic to the same inputs, so the results are bit-identical (checked by
    the vote's state digest; a disagreement aborts the attempt as for the run's outer).
    `state()` holds the optimizer's per-parameter state ("<index>.<key>" -> array) and `"step"`.

    Raises (constructor): ValueError when `template` does not cover exactly `params`, or its
    class cannot be rebuilt from its parameter groups and defaults.
    """

    def __init__(self, template: torch.optim.Optimizer, params: list[torch.Tensor]):
        index = {id(p): i for i, p in enumerate(params)}
        covered = [index.get(id(p)) for g in template.param_groups for p in g["params"]]
        if None in covered or sorted(covered) != list(range(len(params))):
            raise ValueError("outer_optimizer: must be built over exactly the model's parameters "
                             "(e.g. torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True))")
        self.cls = type(template)
        self.defaults = dict(template.defaults)
        self.groups = [({k: v for k, v in g.items() if k not in ("params", "initial_lr")},
                        [index[id(p)] for p in g["params"]]) for g in template.param_groups]
        self.shapes = [tuple(p.shape) for p in params]
        self.name = f"torch.{self.cls.__name__}"
        self._build()
        if template.state:
            self.opt.load_state_dict(template.state_dict())

    def _build(self) -> None:
        self.shadows = [torch.zeros(s, dtype=torch.float32, requires_grad=True) for s in self.shapes]
        groups = [{**opts, "params": [self.shadows[i] for i in idx]} for opts, idx in self.groups]
        try:
            self.opt = self.cls(groups, **self.defaults)
        except TypeError as exc:
            raise ValueError(f"outer_optimizer: {self.cls.__name__} cannot be rebuilt from its parameter groups "
                             f"and defaults ({exc})") from None
        self._step = 0
        self.numel = sum(int(np.prod(s)) for s in self.shapes)

    def __deepcopy__(self, memo) -> "TorchOuter":
        twin = copy.copy(self)
        twin._build()
        twin.load_state(self.state())
        return twin

    def step(self, params: np.ndarray, pseudo_grad: np.ndarray) -> np.ndarray:
        """New (n,) float32 parameters after one step; the inputs are not mutated.

        Raises:
            InvalidArgument: shapes/dtypes wrong or non-finite input; nothing changes then.
        """
        for what, a in (("params", params), ("pseudo_grad", pseudo_grad)):
            if not isinstance(a, np.ndarray) or a.shape != (self.numel,) or a.dtype != np.float32:
                raise InvalidArgument(f"{what}: expected ({self.numel},) float32, got {getattr(a, 'shape', None)} "
                                      f"{getattr(a, 'dtype', type(a).__name__)}")
            if not np.all(np.isfinite(a)):
                raise InvalidArgument(f"{what}: must be finite")
        offset = 0
        with torch.no_grad():
            for s in self.shadows:
                n = s.numel()
                s.copy_(torch.from_numpy(params[offset:offset + n]).view_as(s))
                s.grad = torch.from_numpy(pseudo_grad[offset:offset + n].copy()).view_as(s)
                offset += n
        self.opt.step()
        out = np.empty(self.numel, dtype=np.float32)
        offset = 0
        for s in self.shadows:
            n = s.numel()
            out[offset:offset + n] = s.detach().reshape(-1).numpy()
            s.grad = None
            offset += n
        self._step += 1
        return out

    def state(self) -> dict[str, np.ndarray]:
        out = {"step": np.array(self._step, dtype=np.int64)}
        for i, st in self.opt.state_dict()["state"].items():
            for k, v in st.items():
                if v is None:
                    continue
                arr = v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else np.asarray(v)
                out[f"{i}.{k}"] = np.array(arr, copy=True)
        return out

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        """Replace the state with `state` (as `state()` returns it). Raises InvalidArgument on
        a key that names no parameter; the old state is kept then."""
        if "step" not in state:
            raise InvalidArgument("state.step: missing")
        per: dict[int, dict[str, torch.Tensor]] = {}
        for key, v in state.items():
            if key == "step":
                continue
            i, _, name = key.partition(".")
            if not i.isdigit() or int(i) >= len(self.shapes) or not name:
                raise InvalidArgument(f"state.{key}: names no parameter of this outer optimizer")
            per.setdefault(int(i), {})[name] = torch.from_numpy(np.array(v, copy=True))
        sd = self.opt.state_dict()
        sd["state"] = per
        self.opt.load_state_dict(sd)
        self._step = int(np.asarray(state["step"]))


# ---------------------------------------------------------------- the agent's side


@dataclass(frozen=True)
class _Phase:
    """What the trainer did in one local phase: inner steps, samples, wall seconds."""

    steps: int
    samples: int
    seconds: float


class _Bridge:
    """The two queues between the trainer's thread and the agent's. to_agent carries
    ("update", (local params, loss, _Phase)) and ("load", CommittedState); to_trainer
    ("start" | "params" | "fragment" | "eager" | "finished" | "error", value)."""

    def __init__(self) -> None:
        self.to_agent: queue.Queue[tuple[str, object]] = queue.Queue()
        self.to_trainer: queue.Queue[tuple[str, object]] = queue.Queue()
        self.closed = threading.Event()
        # The swarm's pace, set by the agent before it answers with new params (the queue orders it).
        self.step_seconds = 0.0


class TorchWorkload(FlatStateWorkload):
    """A peer.workloads.base.Workload whose inner training is a user's PyTorch loop in another thread.

    Called from the agent's thread; talks to the trainer through the bridge's two queues:
    `local_update()` waits for the trainer's local parameters (one submission per round; a
    "load" message installs a newer committed state meanwhile, `SwarmOptimizer.load_state_dict`);
    `apply()` answers the outstanding submission with the new committed parameters.
    `outer`: builds the outer optimizer (default: the run's, `[run] outer`).
    """

    def __init__(self, cfg: RunConfig, initial: np.ndarray, num_samples: int, bridge: _Bridge,
                 evaluate: Callable[[np.ndarray], float] | None = None,
                 outer: Callable[[], object] | None = None):
        self.cfg = cfg
        self.outer_factory = outer
        self.state = CommittedState(initial.astype(np.float32, copy=True), self.new_outer(), 0)
        self._num_samples = max(1, int(num_samples))
        self.bridge = bridge
        self.evaluate_fn = evaluate
        self.outstanding = False
        self.started = False
        self.time_budgeted = cfg.local_work == "time"
        self.partition: Fragments | None = None  # streaming: the run's fragments (SwarmOptimizer sets it)
        # eager: this peer's weight in the last committed all-reduce (0 = none yet), its own term's.
        self._share = 0.0

    def new_outer(self):
        return self.outer_factory() if self.outer_factory is not None else make_outer_for(self.cfg)

    @property
    def num_samples(self) -> int:
        return self._num_samples

    def local_update(self) -> LocalUpdate:
        """The trainer's next local parameters as a pseudo-gradient `(n,)` float32 (committed -
        local); streaming: only the round's fragment, `(sizes[f],)`."""
        if not self.started:
            self.started = True
            self.bridge.to_trainer.put(("start", self.state.params.copy()))
        while True:
            if self.bridge.closed.is_set():
                raise WorkloadClosed()
            try:
                kind, value = self.bridge.to_agent.get(timeout=POLL_SECONDS)
            except queue.Empty:
                continue
            if kind == "load":
                if value.rounds > self.state.rounds:
                    self.state = value
                continue
            local, loss, work = value
            break
        self.outstanding = True
        weight = max(1, work.samples) if self.time_budgeted else self._num_samples
        f = self.fragment()
        committed, local = (self.state.params, local) if f < 0 else (self.partition.take(self.state.params, f),
                                                                    self.partition.take(local, f))
        grad = (committed - local).astype(np.float32)
        if self.cfg.eager:  # before any commit the weight is unknown: no eager merge (None)
            estimate = self.eager_params(f, committed, grad) if self._share > 0 else None
            self.bridge.to_trainer.put(("eager", None if estimate is None else (estimate, f)))
        return LocalUpdate(grad, loss, weight, work.steps, work.seconds)

    def eager_params(self, fragment: int, committed: np.ndarray, fresh: np.ndarray) -> np.ndarray:
        """The eager update's parameters θ_e for the round `state.rounds`: the outer step of a
        copy of the committed state's optimizer from `committed` (the fragment's `(sizes[f],)`
        or the whole `(n,)` float32) on this peer's own term `eager_gradient(fresh, share)`, the
        share of the last committed all-reduce. The committed state is unchanged."""
        estimate = eager_gradient(fresh, self._share)
        outer = self.state.outer
        if fragment < 0:
            return copy.deepcopy(outer).step(committed, estimate)
        return outer.preview_fragment(fragment, committed, estimate)

    def pace(self, step_seconds: float) -> None:
        """The swarm's pace (seconds per inner step); the trainer reads it with the next params."""
        self.bridge.step_seconds = step_seconds if math.isfinite(step_seconds) and step_seconds > 0 else 0.0

    def apply(self, state: CommittedState) -> None:
        """Make `state` committed and answer the trainer's submission: "params" (a whole state:
        the trainer loads every parameter) or "fragment" (a streaming round's: it merges that one)."""
        self.state = state
        if state.share > 0:
            self._share = state.share
        if self.outstanding:
            self.outstanding = False
            if state.fragment >= 0 and self.partition is not None:
                self.bridge.to_trainer.put(("fragment", (state.params.copy(), state.fragment)))
            else:
                self.bridge.to_trainer.put(("params", state.params.copy()))

    def state_from_bytes(self, blob: bytes) -> CommittedState:
        return CommittedState.from_bytes(blob, self.cfg, self.new_outer)

    def evaluate(self) -> float:
        return float(self.evaluate_fn(self.state.params)) if self.evaluate_fn else math.nan


# ---------------------------------------------------------------- the optimizer


class SwarmOptimizer(torch.optim.Optimizer):
    """A torch optimizer that trains `model` with a Shoal swarm: `inner_optimizer` steps locally,
    every `inner_steps` steps one round averages the pseudo-gradients across the swarm and an
    outer optimizer applies the result (docs in `shoal.torch`).

    A real `torch.optim.Optimizer`: `param_groups` and `state` are the inner optimizer's (an LR
    scheduler attached to this optimizer sets the inner learning rate), `zero_grad()`,
    `state_dict()` / `load_state_dict()`, step hooks and `isinstance` checks work as for any
    torch optimizer. The constructor joins the swarm (blocking up to `join_timeout`).

    Args:
        model: the torch.nn.Module to train; its parameters (`model.parameters()`, any device
            and floating dtype) are exchanged as one float32 vector. On CUDA they are gathered
            into a pinned host buffer allocated once (`HostBuffer`).
        inner_optimizer: a torch optimizer over `model.parameters()` (e.g. AdamW): the local steps.
        coordinator: the coordinator's HOST:PORT.
        inner_steps: H, inner steps per round; None: the coordinator's `[run] inner_steps`.
        tls_dir: a directory holding the coordinator's ca.pem (`shoal certs init` made it):
            TLS on both planes, with the data-plane certificate the coordinator issues at join.
        insecure: plaintext gRPC instead of TLS (one InsecureWarning). One of `tls_dir` and
            `insecure=True` is required.
        join_token: the token admitting this key at its first join (`shoal token create`);
            default `$SHOAL_JOIN_TOKEN`, else none (a member rejoins without one).
        key_path: this trainer's Ed25519 identity key file (created 0600 if absent), locked
            while in use (one process per identity: a second one gets SwarmError naming the
            file). Default: the key the CLI's `shoal peer` uses, `~/.local/share/shoal/peer-NAME.key`
            (`$XDG_DATA_HOME/shoal`), NAME from `name`, else the listen port when fixed, else the
            first free of 1, 2, ...: a trainer restarted with the same arguments rejoins as the
            same member.
        name: names the default key file (peer-NAME.key).
        listen: the data-plane HOST:PORT this trainer serves on (other peers dial it); default
            "127.0.0.1:0" as `shoal peer`. Across hosts listen on "0.0.0.0:PORT": the coordinator
            fills in the address it sees. A trainer nobody can dial takes part outbound-only.
        advertise: the HOST:PORT others dial when it is not the bound address (NAT, containers).
        outbound_only: take part without being dialled (behind NAT; docs/nat.md).
        relay: HOST:PORT of a `shoal relay` to be reached through (docs/nat.md).
        num_samples: this peer's training samples: its update's weight (FedAvg).
        outer_optimizer: a torch optimizer over `model.parameters()` applied to the all-reduced
            pseudo-gradient instead of the coordinator's `[run] outer` (`TorchOuter`: a copy on
            CPU shadows, the model's own parameters are never touched by it). Every peer of the
            run must pass the same one (else the state digests disagree and the round aborts).
        round_timeout: seconds a round may take from the hand-over to its commit before
            `step()` / `outer_step()` raise RoundTimeout; None: wait as long as the swarm
            retries (bounded by its own timeouts).
        join_timeout: seconds for the join and the first state; also how long a coordinator
            outage is retried (`connect_timeout`) before SwarmError.
        evaluate: optional fn(params (n,) float32 numpy) -> float, run in the agent's thread on
            every committed state (events and metrics).
        **peer_config: further `shoal.peer.agent.PeerConfig` fields: `checkpoint_dir`
            (checkpoints of the committed state every `checkpoint_every` rounds, resumed at a
            restart; docs/checkpoints.md), `events_path`, `metrics_port`, `rpc_timeout`, ...;
            `security`: a shoal.common.security.Security in place of `tls_dir` / `insecure`
            (e.g. a legacy directory with a shared peer.key and `mtls`).

    Raises:
        ValueError: bad arguments (security, inner_steps, outer_optimizer, a PeerConfig field
            set twice). SwarmError: the key is in use, the join failed or timed out, the
            coordinator runs another algorithm.
    """

    algorithm: str | None = None

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer, *, coordinator: str,
                 inner_steps: int | None = None, tls_dir: str | os.PathLike[str] | None = None, insecure: bool = False,
                 join_token: str | None = None, key_path: str | os.PathLike[str] | None = None, name: str | None = None,
                 listen: str = "127.0.0.1:0", advertise: str | None = None, outbound_only: bool = False,
                 relay: str | None = None, num_samples: int = 1, outer_optimizer: torch.optim.Optimizer | None = None,
                 round_timeout: float | None = None, join_timeout: float = 120.0,
                 evaluate: Callable[[np.ndarray], float] | None = None, **peer_config):
        if inner_steps is not None and inner_steps < 1:
            raise ValueError("inner_steps: must be >= 1")
        if round_timeout is not None and not round_timeout > 0:
            raise ValueError("round_timeout: must be > 0 seconds (or None)")
        twice = sorted(set(peer_config) & set(_OWN_FIELDS))
        if twice:
            raise ValueError(f"{twice[0]}: an argument of the optimizer itself, not a **peer_config field")
        security = peer_config.pop("security", None)
        if security is None:
            security = security_of(tls_dir, insecure)
        elif tls_dir or insecure:
            raise ValueError("security: give either a Security or tls_dir / insecure=True, not both")
        params = list(model.parameters())
        super().__init__(params, dict(inner_optimizer.defaults))
        # The inner optimizer's groups and state, shared: a scheduler on this optimizer sets its lr.
        self.param_groups = inner_optimizer.param_groups
        self.state = inner_optimizer.state
        self.defaults = inner_optimizer.defaults
        self.model = model
        self.inner = inner_optimizer
        self.inner_steps = inner_steps or 0  # 0 until joined when the run's configuration sets it
        self.round_timeout = round_timeout
        self.run_config: RunConfig | None = None
        self.local_step = 0
        self.rounds = 0  # rounds this trainer took part in that committed (or synced it)
        self._host = HostBuffer(params)
        self._phase_steps = 0
        self._phase_samples = 0
        self._phase_start = 0.0
        self._budget = 0.0  # seconds of this local phase (local_work = "time", pace known); 0 = H steps
        self._submitted: np.ndarray | None = None  # the parameters of the round in flight
        # What the model's progress since the hand-over is measured from: the submitted
        # parameters, or those right after the eager merge; and (fragment, θ_e) of that merge.
        self._base: np.ndarray | None = None
        self._eager: tuple[int, np.ndarray] | None = None
        self._since_handover = 0  # inner steps since the round in flight was handed over
        self._partition: Fragments | None = None  # streaming: the run's fragments (set at join)
        self.overlapped_steps = 0  # inner steps run while a round was in flight (overlap)
        self.times = TrainerTimes()
        self.ledger = ComputeLedger()
        self.finished = False
        self.summary: dict = {}
        self._losses: list[float] = []
        self._bridge = _Bridge()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        outer = (lambda: TorchOuter(outer_optimizer, params)) if outer_optimizer is not None else None
        if outer is not None:
            outer()  # its errors here, in the caller's thread
        initial = self._host.gather().copy()
        expected = self.algorithm

        def factory(cfg: RunConfig) -> TorchWorkload:
            if expected is not None and cfg.algorithm != expected:
                raise SwarmError(f"the coordinator runs {cfg.algorithm!r}, this optimizer is {expected!r}")
            self.run_config = cfg
            if inner_steps is None:
                self.inner_steps = cfg.inner_steps
            workload = TorchWorkload(cfg, initial, num_samples, self._bridge, evaluate, outer)
            workload.layout = layout_of(model)  # checkpoints name the parameters (peer.checkpoints)
            if cfg.fragments > 1:
                workload.partition = self._partition = Fragments(workload.layout, cfg.fragments,
                                                                 cfg.fragment_partition)
            return workload

        config = PeerConfig(coordinator=coordinator, listen=listen, advertise=advertise,
                            key_path=str(key_path) if key_path is not None else None, name=name,
                            security=security, join_token=os.environ.get(JOIN_TOKEN_ENV, "") if join_token is None
                            else join_token, outbound_only=outbound_only, relay=relay,
                            connect_timeout=join_timeout, **peer_config)
        try:
            self.agent = PeerAgent(config, factory)
        except KeyInUse as exc:
            raise SwarmError(str(exc).replace("--key FILE or --name NAME", "key_path=FILE or name=NAME")) from None
        except (OSError, ValueError) as exc:
            raise SwarmError(f"key: {exc}") from None
        self._thread = threading.Thread(target=self._run_agent, name="shoal-peer-agent", daemon=True)
        self._thread.start()
        try:
            kind, value = self._wait(join_timeout, "join")
        except BaseException:
            self.close()
            raise
        if kind == "start":
            self._host.scatter(value)
            self._new_phase()
            log.info("joined the swarm at %s as %s", coordinator, self.agent.peer_id[:8])
        else:
            self._finish(value)
        self._returned = time.monotonic()  # a step's default start: the previous step() returned

    # ------------------------------------------------------------ agent thread

    def _run_agent(self) -> None:
        try:
            self.summary = asyncio.run(self.agent.run())
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer thread
            self._error = exc
            self._bridge.to_trainer.put(("error", exc))
            return
        wl = self.agent.workload
        self._bridge.to_trainer.put(("finished", wl.state.params.copy() if wl is not None else None))

    def _wait(self, timeout: float | None, what: str) -> tuple[str, object]:
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                kind, value = self._bridge.to_trainer.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if not self._thread.is_alive() and self._bridge.to_trainer.empty():
                    raise SwarmError(f"{what}: the peer agent stopped") from self._error
                if end is not None and time.monotonic() > end:
                    if what == "round":
                        raise RoundTimeout(f"round: no commit within round_timeout={timeout:g}s; the round stays "
                                           f"in flight (step() or outer_step() lands it, close() leaves)") from None
                    raise SwarmError(f"{what}: no answer within {timeout:g}s") from None
                continue
            if kind == "error":
                raise SwarmError(f"{what}: {type(value).__name__}: {value}") from value
            return kind, value

    def _finish(self, params) -> None:
        if params is not None:
            self._host.scatter(params)
        self.finished = True
        log.info("the swarm finished the run after %d rounds here", self.rounds)

    @property
    def committed_rounds(self) -> int:
        """Rounds of the swarm's committed state this trainer holds (0 before the first commit):
        the same on every peer in the same round, and it jumps ahead after a state sync; key a
        round-based LR schedule on it. Read from the agent's thread (e.g. in `evaluate`) it is
        the state being evaluated."""
        wl = self.agent.workload
        return wl.state.rounds if wl is not None else 0

    # ------------------------------------------------------------ torch.optim API

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "inner", None) is None:  # torch.optim.Optimizer.__init__ building its groups
            return super().add_param_group(param_group)
        raise ValueError("add_param_group: the swarm exchanges the parameters the model had when the optimizer "
                         "was built; build the model completely first")

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        """{"inner": the inner optimizer's state_dict, "shoal": Shoal's state}: `local_step`,
        `rounds` (played here), `phase_steps` (inner steps into the current local phase), and the
        committed state this trainer holds: `committed_rounds`, `committed_params` ((n,) float32
        tensor, the outer step's base), `outer` (its name and state: name -> tensor). Read
        without blocking; with a round in flight the committed state is the one before it."""
        st = self.agent.workload.state if self.agent.workload is not None else None
        shoal: dict = {"local_step": self.local_step, "rounds": self.rounds, "phase_steps": self._phase_steps}
        if st is not None:
            shoal.update(committed_rounds=st.rounds, committed_params=torch.from_numpy(st.params.copy()),
                         outer={"name": st.outer.name,
                                "state": {k: torch.from_numpy(np.array(v, copy=True)) for k, v in st.outer.state().items()}})
        return {"inner": self.inner.state_dict(), "shoal": shoal}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load what `state_dict()` returned: the inner optimizer's state, the counters, and the
        committed state when it is newer than the one this trainer holds (a restart that
        resumes a run the coordinator still holds: no download when it matches the swarm's);
        an older or equal one is skipped (the swarm's state wins). The model's parameters are
        the caller's (`model.load_state_dict`), as with any torch optimizer.

        Raises:
            ValueError: not a dict of this optimizer's form, a committed state of another
                size or outer optimizer; RuntimeError: a round is in flight (load between rounds).
        """
        if not isinstance(state_dict, dict) or "inner" not in state_dict or "shoal" not in state_dict:
            raise ValueError("state_dict: expected {'inner': ..., 'shoal': ...} from SwarmOptimizer.state_dict()")
        if self._submitted is not None:
            raise RuntimeError("load_state_dict: a round is in flight; load between rounds")
        shoal = state_dict["shoal"]
        wl = self.agent.workload
        committed = None
        if "committed_params" in shoal and wl is not None:
            params = shoal["committed_params"].detach().cpu().numpy().astype(np.float32)
            if params.shape != wl.state.params.shape:
                raise ValueError(f"state_dict.shoal.committed_params: {params.size} elements, the model has "
                                 f"{wl.state.params.size}")
            outer = wl.new_outer()
            if shoal["outer"]["name"] != outer.name:
                raise ValueError(f"state_dict.shoal.outer: {shoal['outer']['name']!r}, this run's is {outer.name!r}")
            try:
                outer.load_state({k: v.detach().cpu().numpy() for k, v in shoal["outer"]["state"].items()})
            except InvalidArgument as exc:
                raise ValueError(f"state_dict.shoal.outer: {exc}") from None
            committed = CommittedState(params, outer, int(shoal["committed_rounds"]))
        self.inner.load_state_dict(state_dict["inner"])
        self.local_step = int(shoal.get("local_step", 0))
        self.rounds = int(shoal.get("rounds", 0))
        self._phase_steps = int(shoal.get("phase_steps", 0))
        if committed is not None:
            if committed.rounds > wl.state.rounds:
                self._bridge.to_agent.put(("load", committed))
            else:
                log.info("load_state_dict: the committed state of round %d is not newer than the swarm's (%d); kept "
                         "the swarm's", committed.rounds, wl.state.rounds)

    def step(self, closure=None, *, loss: float | None = None, samples: int = 1,
             work_seconds: float | None = None):
        """One inner step on a batch of `samples` samples; the call that ends the local phase
        (the `inner_steps`-th, or with local_work = "time" the first past the phase's time
        budget) also plays one round (blocking; with the run's `overlap` it hands the round over
        and returns, or while a round is still in flight lets the phase go on).

        Args:
            closure: as for any torch optimizer (passed to the inner one).
            loss: this step's training loss (a float), averaged over the phase into the round's loss.
            samples: the batch's samples (the weight with local_work = "time").
            work_seconds: the seconds the caller spent on this step before calling (batch,
                forward, backward), for the compute accounting (`times`, `ledger`); None: the
                time since the previous `step()` returned.

        Returns the inner optimizer's result. Raises SwarmError when the agent failed (the model
        keeps its last committed parameters), RoundTimeout past `round_timeout`. Once
        `finished`, it only runs the inner optimizer."""
        entry = time.monotonic()
        work = entry - self._returned if work_seconds is None else max(0.0, float(work_seconds))
        result = self.inner.step(closure) if closure is not None else self.inner.step()
        spent = time.monotonic() - entry
        self.times.inner_optimizer += spent
        self.times.steps += work + spent
        self.ledger.step(entry - work, work + spent)
        if loss is not None:
            self._losses.append(float(loss))
        elif isinstance(result, (float, int, torch.Tensor)):
            self._losses.append(float(result))
        self.local_step += 1
        self._phase_steps += 1
        self._phase_samples += max(0, int(samples))
        if self._submitted is not None and not self.finished:
            self.overlapped_steps += 1  # this step ran while the round's all-reduce was in flight
            self._since_handover += 1
            if self._since_handover >= self._merge_after:
                self._poll_round()
        if not self.finished and self._phase_over():
            if self._submitted is None:
                self.outer_step()
            # else (overlap, or a round past round_timeout): the round in flight has not landed
            # yet; rather than idle until it does, the phase goes on (polled after every step).
        self._returned = time.monotonic()
        return result

    @property
    def _overlapped(self) -> bool:
        cfg = self.run_config
        return cfg is not None and (cfg.overlap or (cfg.fragments > 1 and cfg.fragment_overlap > 0))

    @property
    def _merge_after(self) -> int:
        """Inner steps after a hand-over before the round's result is merged: streaming's tau
        (fragment_overlap), else 0 (as soon as it arrives)."""
        cfg = self.run_config
        return cfg.fragment_overlap if cfg is not None and cfg.fragments > 1 else 0

    @property
    def phase_steps(self) -> int:
        """Inner steps per local phase: H, or H / F when streaming (each fragment every H steps)."""
        cfg = self.run_config
        return self.inner_steps // cfg.fragments if cfg is not None and cfg.fragments > 1 else self.inner_steps

    def _phase_over(self) -> bool:
        if self._budget > 0:
            return time.monotonic() - self._phase_start >= self._budget
        return self._phase_steps >= self.phase_steps

    def _new_phase(self) -> None:
        timed = self.run_config is not None and self.run_config.local_work == "time"
        self._budget = self.phase_steps * self._bridge.step_seconds if timed else 0.0
        self._phase_steps = self._phase_samples = 0
        self._phase_start = time.monotonic()

    def outer_step(self) -> None:
        """Hand this peer's local parameters to the swarm and load the committed ones; with the
        run's `overlap`, return at once and keep training (the committed parameters are folded in
        when they arrive). At most one round is in flight: called while one is, it first waits
        for that round. Raises SwarmError, RoundTimeout (see `step`)."""
        if self._submitted is not None:
            self._land(*self._wait_round())
            if self.finished:
                return
        t = time.monotonic()
        loss = float(np.mean(self._losses)) if self._losses else 0.0
        self._losses.clear()
        work = _Phase(self._phase_steps, self._phase_samples, t - self._phase_start)
        self._submitted = self._base = self._host.gather().copy()
        self._since_handover = 0
        self._bridge.to_agent.put(("update", (self._submitted, loss, work)))
        self.ledger.handed_over(t)
        if self._overlapped:
            if self.run_config.eager:
                self._eager_merge()
            self.times.handover += time.monotonic() - t
            self._new_phase()
            return
        self.times.handover += time.monotonic() - t
        self._land(*self._wait_round())

    def _eager_merge(self) -> None:
        """The eager update at the hand-over (module docstring): merge the agent's estimate θ_e
        of the round's result into the working parameters now."""
        kind, value = self._wait(self.round_timeout, "eager")
        if kind != "eager":  # the run finished meanwhile
            self._land(kind, value)
            return
        if value is None:  # no all-reduce committed yet: nothing to weigh its own term by
            return
        estimate, fragment = value
        local = self._host.gather().copy()
        if fragment >= 0:
            part = self._partition
            local = part.put(local, fragment, merge(part.take(local, fragment), estimate, self.run_config.fragment_alpha))
        else:
            local = estimate.astype(np.float32, copy=True)
        self._host.scatter(local)
        self._base, self._eager = local, (fragment, estimate)

    def _wait_round(self) -> tuple[str, object]:
        t = time.monotonic()
        try:
            return self._wait(self.round_timeout, "round")
        finally:
            self.times.wait += time.monotonic() - t

    def _poll_round(self) -> None:
        """A round in flight: fold in its result if it has arrived (never blocks)."""
        try:
            kind, value = self._bridge.to_trainer.get_nowait()
        except queue.Empty:
            return
        if kind == "error":
            raise SwarmError(f"round: {type(value).__name__}: {value}") from value
        self._land(kind, value)

    def _land(self, kind: str, params) -> None:
        """The in-flight round ended: `params` are the committed (or synced) parameters."""
        t = time.monotonic()
        self._submitted = None
        base, self._base = self._base, None
        eager, self._eager = self._eager, None
        self.ledger.answered(kind in ("params", "fragment"))
        if kind == "fragment":
            if eager is not None and eager[0] == params[1]:
                self._correct_fragment(params[0], *eager)
            else:
                self._merge_fragment(*params)
            if not self._overlapped:
                self._new_phase()
            self.rounds += 1
        elif kind == "params":
            if self._overlapped:
                # Keep what this phase learnt since the submission (or the eager merge), on top of
                # the committed parameters (the one-step-delayed outer update; module docstring).
                self._host.scatter(params + (self._host.gather() - base))
            else:
                self._host.scatter(params)
                self._new_phase()
            self.rounds += 1
        elif kind == "finished":
            self._finish(params)
        else:  # pragma: no cover - protocol error
            raise SwarmError(f"round: unexpected message {kind!r}")
        self.times.land += time.monotonic() - t

    def _merge_fragment(self, committed: np.ndarray, fragment: int) -> None:
        """Streaming DiLoCo's merge of a committed fragment (Douillard et al. 2025, arXiv
        2501.18512): `alpha * local + (1 - alpha) * committed` on that fragment's parameters, the
        local values elsewhere (the other fragments keep training until their own round)."""
        part = self._partition
        local = self._host.gather().copy()
        mixed = merge(part.take(local, fragment), part.take(committed, fragment), self.run_config.fragment_alpha)
        self._host.scatter(part.put(local, fragment, mixed))

    def _correct_fragment(self, committed: np.ndarray, fragment: int, estimate: np.ndarray) -> None:
        """The eager update's correction when fragment `fragment`'s round lands: the merge used
        the estimate θ_e, the committed θ_c replaces it, the steps since kept:
        `local + (1 - alpha) * (θ_c - θ_e)` on that fragment."""
        part = self._partition
        local = self._host.gather().copy()
        fixed = eager_correct(part.take(local, fragment), part.take(committed, fragment), estimate,
                              self.run_config.fragment_alpha)
        self._host.scatter(part.put(local, fragment, fixed))

    def close(self, timeout: float = 10.0) -> None:
        """Leave the swarm and stop the agent thread (bounded by `timeout` seconds); the model
        keeps the parameters it has. Idempotent."""
        self._bridge.closed.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("peer agent did not stop within %.0fs", timeout)

    def __enter__(self) -> "SwarmOptimizer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class DiLoCoOptimizer(SwarmOptimizer):
    """DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of
    Language Models", arXiv:2311.08455): H inner steps, then the all-reduced pseudo-gradient is
    applied by the outer optimizer: the run's (`[run] outer`, default Nesterov momentum, lr 0.7,
    momentum 0.9, in numpy) or `outer_optimizer`. The coordinator must run `algorithm = "diloco"`.
    Arguments: see SwarmOptimizer."""

    algorithm = "diloco"


class FedAvgOptimizer(SwarmOptimizer):
    """FedAvg (McMahan et al. 2017, "Communication-Efficient Learning of Deep Networks from
    Decentralized Data"): H local steps, then the sample-weighted mean of the local models (outer
    SGD with lr 1 on the weighted mean pseudo-gradient). Pass `num_samples`. The coordinator must
    run `algorithm = "fedavg"`. Arguments: see SwarmOptimizer."""

    algorithm = "fedavg"
