"""The training side of a peer: run configuration, local (inner) training, the committed state.

One round of DiLoCo (Douillard et al. 2023) or FedAvg (McMahan et al. 2017), seen from a peer:
1. `local_update()` runs `inner_steps` optimizer steps on the peer's own data from the committed
   parameters and returns the pseudo-gradient `delta = params - params_local`, (n,) float32.
2. The swarm all-reduces the sample-weighted deltas (weights n_i / sum n).
3. `tentative(aggregate)` applies the outer optimizer (DiLoCo: Nesterov momentum; FedAvg: SGD
   with lr 1, i.e. the weighted average of the local models) to copies and returns the new state
   and its digest, without changing the committed state.
4. `apply(tentative)` makes it the committed state, only after the coordinator committed it.

The committed state (parameters, outer optimizer state, committed round count) serializes to a
deterministic byte string; its BLAKE3-256 digest (shoal.common.tensors.digest) is what peers vote on and joiners verify.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import struct
import time
from dataclasses import dataclass, field

import numpy as np

from shoal.peer.data import NUM_CLASSES, NUM_FEATURES, Dataset, load_digits_split, partition
from shoal.common.errors import InvalidArgument
from shoal.peer.model import Adam, MLPShape, init_params, loss_and_grad, predict
from shoal.peer.compression import codec_id
from shoal.peer.outer import OuterOptimizer, fedprox_grad, make_outer
from shoal.peer.reduction import ReductionSpec
from shoal.common.tensors import digest

_MAGIC = b"SHOALST1"


@dataclass(frozen=True)
class RunConfig:
    """The run's training configuration, set on the coordinator and given to every peer at join.

    algorithm: "diloco" or "fedavg". inner_steps: local optimizer steps per round (H).
    lr: inner Adam learning rate. outer / outer_params: outer optimizer (default by algorithm:
    diloco -> Nesterov lr 0.7 momentum 0.9; fedavg -> sgd lr 1.0). num_data_shards: how many
    data shards the training data is cut into (a peer picks its own with --data-shard).
    Aggregation (docs/aggregation.md): aggregator / aggregator_params: what shard owners run
    ("mean" = FedAvg; any other forces the butterfly collective); max_norm: whole-vector L2 bound
    on each contribution, 0 = none; on_norm: "clip" or "reject" beyond it; dp_sigma: Gaussian
    noise multiplier added once by each owner (needs max_norm); compression: per-hop wire codec
    ("none", "fp16", "bf16", "int8"); fedprox_mu: FedProx proximal term of the inner loss.
    local_work: "steps" (every local phase runs inner_steps steps) or "time" (it lasts inner_steps
    of the fast peers' steps in seconds, the swarm's pace, and the update is weighted by the
    samples it processed; the PyTorch integration, docs/training.md; the digits workload always
    runs inner_steps). overlap: the next local phase starts while the round's all-reduce runs and
    the committed update is folded in when it arrives (the PyTorch integration, docs/training.md).
    """

    algorithm: str = "diloco"
    seed: int = 0
    inner_steps: int = 50
    batch_size: int = 32
    lr: float = 3e-3
    hidden: int = 64
    outer: str = ""
    outer_params: dict = field(default_factory=dict)
    num_data_shards: int = 4
    non_iid: bool = False
    fedprox_mu: float = 0.0
    aggregator: str = "mean"
    aggregator_params: dict = field(default_factory=dict)
    compression: str = "none"
    max_norm: float = 0.0
    on_norm: str = "clip"
    dp_sigma: float = 0.0
    local_work: str = "steps"
    overlap: bool = False

    def __post_init__(self) -> None:
        if self.algorithm not in ("diloco", "fedavg"):
            raise InvalidArgument(f"algorithm: {self.algorithm!r} is not diloco or fedavg")
        if self.inner_steps < 1:
            raise InvalidArgument("inner_steps: must be >= 1")
        if self.local_work not in ("steps", "time"):
            raise InvalidArgument(f"local_work: {self.local_work!r} is not steps or time")
        if self.batch_size < 1:
            raise InvalidArgument("batch_size: must be >= 1")
        if self.hidden < 1:
            raise InvalidArgument("hidden: must be >= 1")
        if not (self.lr > 0):
            raise InvalidArgument("lr: must be > 0")
        if not (0 <= self.seed < 2 ** 32):
            raise InvalidArgument("seed: must be in 0..2**32-1")
        if self.num_data_shards < 1:
            raise InvalidArgument("num_data_shards: must be >= 1")
        if not (self.fedprox_mu >= 0):
            raise InvalidArgument("fedprox_mu: must be >= 0")
        self.reduction_spec().check()
        codec_id(self.compression)
        make_outer(self.outer_name, **self.outer_params)

    def reduction_spec(self) -> ReductionSpec:
        return ReductionSpec(self.aggregator, dict(self.aggregator_params), self.max_norm, self.on_norm, self.dp_sigma)

    @property
    def outer_name(self) -> str:
        return self.outer or ("diloco" if self.algorithm == "diloco" else "sgd")

    @staticmethod
    def from_json(text: str) -> "RunConfig":
        raw = json.loads(text) if text else {}
        if "num_shards" in raw:  # the name before 0.2 (a coordinator of the previous release)
            raw.setdefault("num_data_shards", raw.pop("num_shards"))
        known = {f.name for f in dataclasses.fields(RunConfig)}
        return RunConfig(**{k: v for k, v in raw.items() if k in known})


def make_outer_for(cfg: RunConfig) -> OuterOptimizer:
    return make_outer(cfg.outer_name, **cfg.outer_params)


@dataclass
class CommittedState:
    """params (n,) float32, the outer optimizer, and the number of committed rounds it reflects.

    Treated as immutable once built (training copies `params`; the outer step runs on a copy of
    `outer`), so its serialization and digest are computed once and reused: the vote, the commit
    check, readiness and every donor request all ask for them.
    """

    params: np.ndarray
    outer: OuterOptimizer
    rounds: int
    _blob: bytes | None = field(default=None, init=False, repr=False, compare=False)
    _digest: bytes | None = field(default=None, init=False, repr=False, compare=False)

    def to_bytes(self) -> bytes:
        """Deterministic serialization: magic | u32 header length | JSON header | raw arrays."""
        if self._blob is None:
            self._blob = self._serialize()
        return self._blob

    def _serialize(self) -> bytes:
        arrays = {"params": self.params, **{f"outer.{k}": v for k, v in sorted(self.outer.state().items())}}
        header = {"rounds": self.rounds, "outer": self.outer.name,
                  "arrays": [[k, str(v.dtype), list(v.shape)] for k, v in arrays.items()]}
        h = json.dumps(header, sort_keys=True).encode()
        return b"".join([_MAGIC, struct.pack("<I", len(h)), h] + [np.ascontiguousarray(v).tobytes() for v in arrays.values()])

    def digest(self) -> bytes:
        """BLAKE3-256 of `to_bytes()` (shoal.common.tensors.digest)."""
        if self._digest is None:
            self._digest = digest(self.to_bytes())
        return self._digest

    @staticmethod
    def from_bytes(blob: bytes, cfg: RunConfig) -> "CommittedState":
        """Inverse of `to_bytes`. Raises InvalidArgument on a malformed blob."""
        if blob[:8] != _MAGIC or len(blob) < 12:
            raise InvalidArgument("state: bad magic")
        (hl,) = struct.unpack("<I", blob[8:12])
        try:
            header = json.loads(blob[12:12 + hl])
        except ValueError:
            raise InvalidArgument("state: bad header") from None
        off = 12 + hl
        arrays: dict[str, np.ndarray] = {}
        for name, dt, shape in header["arrays"]:
            count = int(np.prod(shape)) if shape else 1
            nbytes = count * np.dtype(dt).itemsize
            if off + nbytes > len(blob):
                raise InvalidArgument(f"state: truncated at {name}")
            arrays[name] = np.frombuffer(blob[off:off + nbytes], dtype=dt).reshape(shape).copy()
            off += nbytes
        outer = make_outer_for(cfg)
        outer.load_state({k[6:]: v for k, v in arrays.items() if k.startswith("outer.")})
        return CommittedState(arrays["params"], outer, int(header["rounds"]))


@dataclass(frozen=True)
class LocalUpdate:
    pseudo_grad: np.ndarray  # (n,) float32
    loss: float  # mean training loss over the inner steps
    num_samples: int  # the contribution's weight (the peer's samples, or those this phase processed)
    steps: int = 0  # inner steps run (0 = not counted)
    seconds: float = 0.0  # wall seconds of the local phase (0 = not measured)


class FlatStateWorkload:
    """Committed state as one float32 vector + the run's outer optimizer; subclasses train."""

    cfg: RunConfig
    state: CommittedState

    def tentative(self, aggregate: np.ndarray, aggregate_digest: bytes = b"") -> CommittedState:
        outer = copy.deepcopy(self.state.outer)
        params = outer.step(self.state.params, aggregate.astype(np.float32, copy=False))
        return CommittedState(params, outer, self.state.rounds + 1)

    def apply(self, state: CommittedState) -> None:
        self.state = state

    def pace(self, step_seconds: float) -> None:
        """A fixed H inner steps per round (local_work = "steps"): the swarm's pace changes nothing."""

    def state_from_bytes(self, blob: bytes) -> CommittedState:
        return CommittedState.from_bytes(blob, self.cfg)

    @property
    def num_params(self) -> int:
        return int(self.state.params.size)


class DigitsWorkload(FlatStateWorkload):
    """The default workload (a peer.workload.Workload): an MLP on one part of the UCI digits
    training set."""

    def __init__(self, cfg: RunConfig, data_shard: int):
        self.cfg = cfg
        self.shape = MLPShape((NUM_FEATURES, cfg.hidden, NUM_CLASSES))
        train, self.test = load_digits_split(cfg.seed)
        self.data: Dataset = partition(train, cfg.num_data_shards, data_shard % cfg.num_data_shards, non_iid=cfg.non_iid, seed=cfg.seed)
        self.state = CommittedState(init_params(self.shape, cfg.seed), make_outer_for(cfg), 0)
        self.inner = Adam(self.shape.num_params, lr=cfg.lr)
        self.rng = np.random.default_rng(cfg.seed * 1000 + 17 + data_shard)

    @property
    def num_samples(self) -> int:
        return len(self.data)

    def local_update(self) -> LocalUpdate:
        """Run `inner_steps` local steps from the committed parameters; returns the pseudo-gradient."""
        t0 = time.monotonic()
        start = self.state.params
        w = start.copy()
        losses = []
        for _ in range(self.cfg.inner_steps):
            b = self.rng.integers(0, len(self.data), self.cfg.batch_size)
            loss, g = loss_and_grad(self.shape, w, self.data.x[b], self.data.y[b])
            if self.cfg.fedprox_mu > 0:
                g = g + fedprox_grad(w, start, self.cfg.fedprox_mu)
            self.inner.step(w, g)
            losses.append(loss)
        return LocalUpdate((start - w).astype(np.float32), float(np.mean(losses)), len(self.data),
                           self.cfg.inner_steps, time.monotonic() - t0)

    def evaluate(self) -> float:
        """Held-out accuracy of the committed parameters, in [0, 1]."""
        return float((predict(self.shape, self.state.params, self.test.x) == self.test.y).mean())


def baseline_accuracy(cfg: RunConfig, total_steps: int) -> float:
    """Single-process baseline: the same MLP and inner optimizer on the whole training set for
    `total_steps` steps (the swarm's total optimizer steps)."""
    shape = MLPShape((NUM_FEATURES, cfg.hidden, NUM_CLASSES))
    train, test = load_digits_split(cfg.seed)
    w = init_params(shape, cfg.seed)
    opt = Adam(shape.num_params, lr=cfg.lr)
    rng = np.random.default_rng(cfg.seed + 99)
    for _ in range(total_steps):
        b = rng.integers(0, len(train), cfg.batch_size)
        _, g = loss_and_grad(shape, w, train.x[b], train.y[b])
        opt.step(w, g)
    return float((predict(shape, w, test.x) == test.y).mean())
