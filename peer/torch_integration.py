"""PyTorch integration: an existing training loop joins a Shoal swarm in a few lines.

    import shoal.peer.torch_integration as shoal_torch

    torch.manual_seed(0)                       # every peer must start from the same parameters
    model = Net()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt = shoal_torch.DiLoCoOptimizer(model, inner, coordinator="coord.example.org:7070", inner_steps=50)
    while not opt.finished:
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step(loss=loss.item())             # inner step; every 50th call also plays a round
        opt.zero_grad()
    opt.close()

With the run's `local_work = "time"` a local phase is not H steps but a time budget: H times
the swarm's pace (the fast participants' seconds per inner step in the last committed round,
`Commit.step_seconds`, set by the coordinator), so a slow peer runs fewer steps and nobody waits
for it; its update is then weighted by the samples it processed (`step(samples=...)`, default 1
per step), FedAvg's weighting of each client's update by its data (McMahan et al. 2017), here per
round. A phase whose pace is not known yet (the first, or after a state sync) runs H steps.

With the run's `overlap`, `step()` does not wait for the round: the local parameters of round r
are handed over and the next local phase starts from them at once, while the all-reduce runs in
the agent's thread. When round r's committed parameters θ_c arrive (checked at every step), the
model becomes θ_c + (θ - θ_sub), θ_sub the parameters handed over: the steps taken meanwhile are
kept on top of the committed state, and the next pseudo-gradient (θ_c - local) covers them. The
outer update thus reaches the local model one phase late (the one-step-delayed outer update of
overlapped DiLoCo: Kale et al. 2025, "Eager updates for overlapped communication and computation
in DiLoCo"; Douillard et al. 2025, "Streaming DiLoCo"). Every committed state is still computed by
the agent from the all-reduced pseudo-gradients, bit-identical on every peer. At most one round
is in flight: a phase that reaches its end (H steps, or its time budget) before the round in
flight landed does not idle; it goes on with inner steps until the round lands, then hands over
(so with overlap a phase runs at least H steps: a fast peer does not wait for the slowest one,
it trains meanwhile, and its next pseudo-gradient covers those steps).

Compute accounting: `times` (TrainerTimes) says where the trainer's time inside the wrapper
went, `ledger` (ComputeLedger) gives the training window's compute and length (the
`compute_utilization` of shoal.lm_worker); `step(work_seconds=...)` tells both how long the
caller's part of the step took.

This plays the role of hivemind.Optimizer and torchft's wrappers. `step()` runs the inner
optimizer; every `inner_steps` calls it flattens the parameters, hands the pseudo-gradient
(committed - local, float32) to a `PeerAgent` running in a background thread, waits for the
round, and loads the committed parameters (after the outer step, bit-identical on every peer)
into the model. The outer optimizer and the aggregation are Shoal's (peer.outer, peer.collectives):
which one is set by the coordinator's run configuration (`[run] algorithm`, `outer`), so every
peer applies the same one; `DiLoCoOptimizer` / `FedAvgOptimizer` check that it matches.

Failure semantics (see peer.agent for the round protocol):
- A round that aborts is retried by the swarm; `step()` keeps waiting (bounded by the swarm's
  timeouts). If this peer is left out of a committed round, or joins a running swarm, it
  downloads the committed state and `step()` returns with the model set to it: the local work of
  that round is dropped (it was based on stale parameters), the inner optimizer state is kept.
- The coordinator finishes the run: `finished` becomes True, the model holds the last committed
  parameters, and later `step()` calls only run the inner optimizer.
- The agent fails (coordinator unreachable past `connect_timeout`, bind error, a run
  configuration that does not match): the constructor or the next `step()` raises `SwarmError`;
  the model keeps its last committed parameters.
- `close()` (or leaving a `with` block) makes the agent leave the swarm and joins its thread
  within `timeout`.

Requires `pip install shoal[torch]`. Parameters are exchanged as one float32 vector; the model
may live on any device and dtype (it is copied to CPU float32 and back).
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shoal.peer.agent import PeerAgent, PeerConfig
from shoal.peer.training import CommittedState, LocalUpdate, RunConfig, make_outer_for
from shoal.peer.workload import FlatStateWorkload, WorkloadClosed

log = logging.getLogger("shoal.torch")

POLL_SECONDS = 0.2


class SwarmError(RuntimeError):
    """The peer agent behind a SwarmOptimizer failed; the message says why."""


def flatten(model: torch.nn.Module) -> np.ndarray:
    """The model's parameters as one (n,) float32 numpy vector (CPU copy)."""
    with torch.no_grad():
        return torch.nn.utils.parameters_to_vector(model.parameters()).detach().to("cpu", torch.float32).numpy().copy()


def unflatten_into(model: torch.nn.Module, params: np.ndarray) -> None:
    """Copy (n,) float32 `params` into the model's parameters, in place (device and dtype kept)."""
    with torch.no_grad():
        flat = torch.from_numpy(np.ascontiguousarray(params, dtype=np.float32))
        total = sum(p.numel() for p in model.parameters())
        if flat.numel() != total:
            raise ValueError(f"params: {flat.numel()} elements for a model of {total}")
        offset = 0
        for p in model.parameters():
            n = p.numel()
            p.copy_(flat[offset:offset + n].view_as(p).to(p.device, p.dtype))
            offset += n


class TorchWorkload(FlatStateWorkload):
    """A peer.workload.Workload whose inner training is a user's PyTorch loop in another thread.

    Called from the agent's thread; talks to the trainer through two queues:
    `local_update()` waits for the trainer's local parameters (one submission per round);
    `apply()` answers the outstanding submission with the new committed parameters.
    """

    def __init__(self, cfg: RunConfig, initial: np.ndarray, num_samples: int, bridge: "_Bridge",
                 evaluate: Callable[[np.ndarray], float] | None = None):
        self.cfg = cfg
        self.state = CommittedState(initial.astype(np.float32, copy=True), make_outer_for(cfg), 0)
        self._num_samples = max(1, int(num_samples))
        self.bridge = bridge
        self.evaluate_fn = evaluate
        self.outstanding = False
        self.started = False
        self.time_budgeted = cfg.local_work == "time"

    @property
    def num_samples(self) -> int:
        return self._num_samples

    def local_update(self) -> LocalUpdate:
        if not self.started:
            self.started = True
            self.bridge.to_trainer.put(("start", self.state.params.copy()))
        while True:
            if self.bridge.closed.is_set():
                raise WorkloadClosed()
            try:
                local, loss, work = self.bridge.to_agent.get(timeout=POLL_SECONDS)
                break
            except queue.Empty:
                continue
        self.outstanding = True
        weight = max(1, work.samples) if self.time_budgeted else self._num_samples
        return LocalUpdate((self.state.params - local).astype(np.float32), loss, weight, work.steps, work.seconds)

    def pace(self, step_seconds: float) -> None:
        """The swarm's pace (seconds per inner step); the trainer reads it with the next params."""
        self.bridge.step_seconds = step_seconds if math.isfinite(step_seconds) and step_seconds > 0 else 0.0

    def apply(self, state: CommittedState) -> None:
        self.state = state
        if self.outstanding:
            self.outstanding = False
            self.bridge.to_trainer.put(("params", state.params.copy()))

    def evaluate(self) -> float:
        return float(self.evaluate_fn(self.state.params)) if self.evaluate_fn else math.nan


@dataclass
class TrainerTimes:
    """Where the trainer thread's time inside the wrapper went, seconds (monotonic clock).

    steps: the inner steps, whole (the caller's batch, forward and backward as measured by
        `step()`, see there, plus the inner optimizer's step); inner_optimizer: the part of
        `steps` in the inner optimizer's step; handover: flattening the local parameters and
        handing them to the agent; wait: blocked on a round (without overlap the whole round;
        with it only `outer_step()` called directly while a round is in flight); land: loading the
        committed parameters into the model (with overlap: folding them in)."""

    steps: float = 0.0
    inner_optimizer: float = 0.0
    handover: float = 0.0
    wait: float = 0.0
    land: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in vars(self).items()}


class ComputeLedger:
    """Inner-step seconds against the training window, from times it is given (pure, no clock).

    The training window runs from the start of the first inner step to the hand-over of the last
    local phase that a committed state answered (the end of the last phase whose work reached a
    commit); the compute in it is the seconds of the inner steps of those phases. Steps of a
    phase the run discarded (the phase after the last commit, answered by the end of the run)
    are outside it, with or without overlap; so are the join and the end of the run. This is
    the figure INTELLECT-1 reports (Jaghouar et al. 2024, arXiv:2412.01152, 83-96 %: the share of
    the training time spent computing rather than blocked in the outer step's all-reduce).

    step(start, seconds): an inner step that began at `start` and computed `seconds`.
    handed_over(t): the current phase ended, its parameters handed over at `t` (one in flight).
    answered(committed): the round in flight ended: with a committed state (its phase counts)
        or not (the run finished; its phase does not).
    """

    def __init__(self) -> None:
        self.first_start: float | None = None
        self.compute = 0.0  # all inner steps so far
        self._in_flight: tuple[float, float] | None = None  # (hand-over time, compute at it)
        self._last: tuple[float, float] | None = None  # the same, of the last committed phase

    def step(self, start: float, seconds: float) -> None:
        if self.first_start is None:
            self.first_start = start
        self.compute += seconds

    def handed_over(self, t: float) -> None:
        self._in_flight = (t, self.compute)

    def answered(self, committed: bool) -> None:
        if self._in_flight is not None and committed:
            self._last = self._in_flight
        self._in_flight = None

    def window(self) -> tuple[float, float]:
        """(compute seconds, window seconds) of the training window; (0, 0) before a commit."""
        if self._last is None or self.first_start is None:
            return 0.0, 0.0
        end, compute = self._last
        return compute, max(0.0, end - self.first_start)


def utilization(compute_seconds: float, wall_seconds: float) -> float:
    """compute / wall, rounded to 4 digits; 0.0 for an empty or negative wall time."""
    return round(compute_seconds / wall_seconds, 4) if wall_seconds > 0 else 0.0


@dataclass(frozen=True)
class _Phase:
    """What the trainer did in one local phase: inner steps, samples, wall seconds."""

    steps: int
    samples: int
    seconds: float


class _Bridge:
    def __init__(self) -> None:
        self.to_agent: queue.Queue[tuple[np.ndarray, float, _Phase]] = queue.Queue()
        self.to_trainer: queue.Queue[tuple[str, object]] = queue.Queue()
        self.closed = threading.Event()
        # The swarm's pace, set by the agent before it answers with new params (the queue orders it).
        self.step_seconds = 0.0


class SwarmOptimizer:
    """Wrap `inner_optimizer` of `model` so that the loop trains with a swarm (module docstring).

    coordinator: HOST:PORT. inner_steps: H, inner steps per round (None: the coordinator's run
    configuration `inner_steps`, known once joined). algorithm: the run's
    algorithm this wrapper expects ("diloco" or "fedavg"; None = accept the coordinator's).
    num_samples: this peer's training samples (the FedAvg weight). listen / advertise: the
    data-plane address (other peers connect to it). key_path: identity key (default: a fresh
    one in a temporary directory). evaluate: optional fn(params (n,) float32) -> accuracy, shown
    in events and metrics. join_timeout: seconds to wait for the join (and initial state sync).
    peer_config: further PeerConfig fields (events_path, metrics_port, rpc_timeout, ...).
    """

    algorithm: str | None = None

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer, *, coordinator: str,
                 inner_steps: int | None, num_samples: int = 1, listen: str = "127.0.0.1:0", advertise: str | None = None,
                 key_path: str | None = None, evaluate: Callable[[np.ndarray], float] | None = None,
                 join_timeout: float = 120.0, **peer_config):
        if inner_steps is not None and inner_steps < 1:
            raise ValueError("inner_steps: must be >= 1")
        self.model = model
        self.inner = inner_optimizer
        self.inner_steps = inner_steps or 0  # 0 until joined when the run's configuration sets it
        self.run_config: RunConfig | None = None
        self.local_step = 0
        self.rounds = 0
        self._phase_steps = 0
        self._phase_samples = 0
        self._phase_start = 0.0
        self._budget = 0.0  # seconds of this local phase (local_work = "time", pace known); 0 = H steps
        self._submitted: np.ndarray | None = None  # the parameters of the round in flight
        self.overlapped_steps = 0  # inner steps run while a round was in flight (overlap)
        self.times = TrainerTimes()
        self.ledger = ComputeLedger()
        self.finished = False
        self.summary: dict = {}
        self._losses: list[float] = []
        self._bridge = _Bridge()
        self._error: BaseException | None = None
        if key_path is None:
            self._keydir = tempfile.TemporaryDirectory(prefix="shoal-torch-")
            key_path = str(Path(self._keydir.name) / "peer.key")
        initial = flatten(model)
        expected = self.algorithm

        def factory(cfg: RunConfig) -> TorchWorkload:
            if expected is not None and cfg.algorithm != expected:
                raise SwarmError(f"the coordinator runs {cfg.algorithm!r}, this optimizer is {expected!r}")
            self.run_config = cfg
            if inner_steps is None:
                self.inner_steps = cfg.inner_steps
            return TorchWorkload(cfg, initial, num_samples, self._bridge, evaluate)

        config = PeerConfig(coordinator=coordinator, listen=listen, advertise=advertise, key_path=key_path,
                            connect_timeout=join_timeout, **peer_config)
        self.agent = PeerAgent(config, factory)
        self._thread = threading.Thread(target=self._run_agent, name="shoal-peer-agent", daemon=True)
        self._thread.start()
        kind, params = self._wait(join_timeout, "join")
        if kind == "start":
            unflatten_into(self.model, params)
            self._new_phase()
            log.info("joined the swarm at %s as %s", coordinator, self.agent.peer_id[:8])
        else:
            self._finish(params)
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
        waited = 0.0
        while True:
            try:
                kind, value = self._bridge.to_trainer.get(timeout=POLL_SECONDS)
            except queue.Empty:
                waited += POLL_SECONDS
                if not self._thread.is_alive() and self._bridge.to_trainer.empty():
                    raise SwarmError(f"{what}: the peer agent stopped") from self._error
                if timeout is not None and waited > timeout:
                    raise SwarmError(f"{what}: no answer within {timeout:.0f}s") from None
                continue
            if kind == "error":
                raise SwarmError(f"{what}: {type(value).__name__}: {value}") from value
            return kind, value

    def _finish(self, params) -> None:
        if params is not None:
            unflatten_into(self.model, params)
        self.finished = True
        log.info("the swarm finished the run after %d rounds here", self.rounds)

    @property
    def committed_rounds(self) -> int:
        """Rounds of the agent's committed state (0 before the first commit); read from the
        agent's thread (e.g. in `evaluate`) it is the state being evaluated."""
        wl = self.agent.workload
        return wl.state.rounds if wl is not None else 0

    # ------------------------------------------------------------ torch.optim-like API

    @property
    def param_groups(self):
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"inner": self.inner.state_dict(), "local_step": self.local_step, "rounds": self.rounds}

    def step(self, closure=None, *, loss: float | None = None, samples: int = 1,
             work_seconds: float | None = None):
        """One inner step on a batch of `samples` samples; the call that ends the local phase
        (the `inner_steps`-th, or with local_work = "time" the first past the phase's time budget)
        also plays one round (blocking; with the run's `overlap` it hands the round over and
        returns, or while a round is still in flight lets the phase go on). Raises SwarmError
        when the agent failed (the model keeps its last committed params).

        work_seconds: the seconds the caller spent on this step before calling (batch, forward,
        backward), for the compute accounting (`times`, `ledger`); None: the time since the
        previous `step()` (or the constructor) returned."""
        entry = time.monotonic()
        work = entry - self._returned if work_seconds is None else max(0.0, float(work_seconds))
        result = self.inner.step(closure) if closure is not None else self.inner.step()
        spent = time.monotonic() - entry
        self.times.inner_optimizer += spent
        self.times.steps += work + spent
        self.ledger.step(entry - work, work + spent)
        if loss is not None:
            self._losses.append(float(loss))
        elif result is not None:
            self._losses.append(float(result))
        self.local_step += 1
        self._phase_steps += 1
        self._phase_samples += max(0, int(samples))
        if self._submitted is not None and not self.finished:
            self.overlapped_steps += 1  # this step ran while the round's all-reduce was in flight
            self._poll_round()
        if not self.finished and self._phase_over():
            if self._submitted is None:
                self.outer_step()
            # else (overlap): the round in flight has not landed yet; rather than idle until it
            # does, the phase goes on (its result is polled after every step, module docstring).
        self._returned = time.monotonic()
        return result

    @property
    def _overlapped(self) -> bool:
        return self.run_config is not None and self.run_config.overlap

    def _phase_over(self) -> bool:
        if self._budget > 0:
            return time.monotonic() - self._phase_start >= self._budget
        return self._phase_steps >= self.inner_steps

    def _new_phase(self) -> None:
        timed = self.run_config is not None and self.run_config.local_work == "time"
        self._budget = self.inner_steps * self._bridge.step_seconds if timed else 0.0
        self._phase_steps = self._phase_samples = 0
        self._phase_start = time.monotonic()

    def outer_step(self) -> None:
        """Hand this peer's local parameters to the swarm and load the committed ones; with the
        run's `overlap`, return at once and keep training (the committed parameters are folded in
        when they arrive, module docstring). At most one round is in flight: called while one is
        (only directly: `step()` keeps training instead), it first waits for that round."""
        if self._submitted is not None:
            self._land(*self._wait_round())
            if self.finished:
                return
        t = time.monotonic()
        loss = float(np.mean(self._losses)) if self._losses else 0.0
        self._losses.clear()
        work = _Phase(self._phase_steps, self._phase_samples, t - self._phase_start)
        self._submitted = flatten(self.model)
        self._bridge.to_agent.put((self._submitted, loss, work))
        self.ledger.handed_over(t)
        self.times.handover += time.monotonic() - t
        if self._overlapped:
            self._new_phase()
            return
        self._land(*self._wait_round())

    def _wait_round(self) -> tuple[str, object]:
        t = time.monotonic()
        try:
            return self._wait(None, "round")
        finally:
            self.times.wait += time.monotonic() - t

    def _poll_round(self) -> None:
        """Overlap: fold in the round's result if it has arrived (never blocks)."""
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
        submitted, self._submitted = self._submitted, None
        self.ledger.answered(kind == "params")
        if kind == "params":
            if self._overlapped:
                # Keep what this phase learnt since the submission, on top of the committed
                # parameters (the one-step-delayed outer update; module docstring).
                unflatten_into(self.model, params + (flatten(self.model) - submitted))
            else:
                unflatten_into(self.model, params)
                self._new_phase()
            self.rounds += 1
        elif kind == "finished":
            self._finish(params)
        else:  # pragma: no cover - protocol error
            raise SwarmError(f"round: unexpected message {kind!r}")
        self.times.land += time.monotonic() - t

    def close(self, timeout: float = 10.0) -> None:
        """Leave the swarm and stop the agent thread (bounded by `timeout`)."""
        self._bridge.closed.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("peer agent did not stop within %.0fs", timeout)
        if hasattr(self, "_keydir"):
            self._keydir.cleanup()

    def __enter__(self) -> "SwarmOptimizer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class DiLoCoOptimizer(SwarmOptimizer):
    """DiLoCo (Douillard et al. 2023): H inner steps, then the all-reduced pseudo-gradient is
    applied by the run's outer optimizer (Nesterov momentum, default lr 0.7, momentum 0.9).
    The coordinator must run `algorithm = "diloco"`."""

    algorithm = "diloco"


class FedAvgOptimizer(SwarmOptimizer):
    """FedAvg (McMahan et al. 2017): H local steps, then the sample-weighted mean of the local
    models (outer SGD with lr 1 on the weighted mean pseudo-gradient). Pass `num_samples`.
    The coordinator must run `algorithm = "fedavg"`."""

    algorithm = "fedavg"
