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
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from shoal.common.errors import InvalidArgument
from shoal.common.privacy import DpSettings, PrivacyError
from shoal.peer.compression import codec_id
from shoal.peer.fragments import FRAGMENT_MODES, FragmentedOuter, Fragments, fragment_of
from shoal.peer.sparse import DEFAULT_CHUNK, SparseCodec, SparseSettings, is_sparse
from shoal.peer.outer import OuterOptimizer, make_outer
from shoal.peer.reduction import ReductionSpec
from shoal.peer.secagg import SecAggParams, refused_with
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
    noise multiplier (needs max_norm); dp_mode: who adds the noise, "owner" (each shard owner,
    once), "distributed" (each participant its share) or "local" (each participant all of it;
    shoal.common.privacy); compression: per-hop wire codec ("none", "fp16", "bf16", "int8",
    "fp4") or a sparse codec of the whole error-fed pseudo-gradient ("topk", "dct": peer.sparse,
    the sparse all-gather; sparse_chunk C, sparse_k kept per chunk, sparse_bits per value,
    sparse_beta the accumulator's decay; mean aggregation only); fedprox_mu: FedProx proximal
    term of the inner loss.
    local_work: "steps" (every local phase runs inner_steps steps) or "time" (it lasts inner_steps
    of the fast peers' steps in seconds, the swarm's pace, and the update is weighted by the
    samples it processed; the PyTorch integration, docs/training.md; the digits workload always
    runs inner_steps). overlap: the next local phase starts while the round's all-reduce runs and
    the committed update is folded in when it arrives (the PyTorch integration, docs/training.md).
    Streaming DiLoCo (docs/training.md, peer.fragments): fragments F splits the parameters
    (fragment_partition "contiguous" or "strided"), round r carries fragment r mod F and local
    phases last inner_steps / F steps, so each fragment is synchronised every inner_steps steps;
    fragment_overlap tau: inner steps the trainer runs while its round is in flight before it
    merges the committed fragment (0 = it waits); fragment_alpha: the merge
    `alpha * local + (1 - alpha) * committed` of that fragment. With fragments > 1, `overlap` is
    refused (fragment_overlap says how far rounds overlap). eager: the trainer applies an eager
    outer update to its own working parameters at the hand-over, its own fresh term on the
    committed parameters that hold the delayed all-reduces (Kale et al. 2025, arXiv 2502.12996;
    `peer.fragments.eager_gradient`), and corrects it to the committed update when the round lands; it needs `overlap` or
    fragment_overlap > 0 (without either nothing is delayed). The committed state is unchanged.
    error_feedback: int8 / fp4 contributions carry the previous committed round's quantization
    residual of the same parameters (per fragment); False sends each round's values alone.
    Secure aggregation (SecAgg+, peer.secure_round; docs/security.md): secure_aggregation on
    masks every contribution so that only the sum is revealed; secagg_degree k (neighbours, even),
    secagg_threshold t (shares that unmask), secagg_clip (elements clipped to +-clip) and
    secagg_frac_bits (fixed-point fractional bits in Z_2^32). Refused with robust aggregators,
    owner-side max_norm or DP noise and compression (`peer.secagg.refused_with`).
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
    dp_mode: str = "owner"
    local_work: str = "steps"
    overlap: bool = False
    fragments: int = 1
    fragment_partition: str = "contiguous"
    fragment_overlap: int = 0
    fragment_alpha: float = 0.5
    eager: bool = False
    error_feedback: bool = True
    sparse_chunk: int = DEFAULT_CHUNK
    sparse_k: int = 64
    sparse_bits: int = 2
    sparse_beta: float = 0.95
    secure_aggregation: bool = False
    secagg_degree: int = 4
    secagg_threshold: int = 3
    secagg_clip: float = 4.0
    secagg_frac_bits: int = 20

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
        if self.fragments < 1 or self.inner_steps % self.fragments:
            raise InvalidArgument(f"fragments: must be >= 1 and divide inner_steps {self.inner_steps}, "
                                  f"got {self.fragments}")
        if self.fragment_partition not in FRAGMENT_MODES:
            raise InvalidArgument(f"fragment_partition: {self.fragment_partition!r} is not one of {FRAGMENT_MODES}")
        if not 0 <= self.fragment_overlap <= self.phase_steps:
            raise InvalidArgument(f"fragment_overlap: must be in 0..inner_steps / fragments = {self.phase_steps}, "
                                  f"got {self.fragment_overlap}")
        if not 0 <= self.fragment_alpha <= 1:
            raise InvalidArgument(f"fragment_alpha: must be in [0, 1], got {self.fragment_alpha}")
        if self.fragments > 1 and self.overlap:
            raise InvalidArgument("overlap: not with fragments > 1 (fragment_overlap sets how far rounds overlap)")
        if self.eager and not (self.overlap or (self.fragments > 1 and self.fragment_overlap > 0)):
            raise InvalidArgument("eager: needs overlap, or fragments > 1 with fragment_overlap > 0 (otherwise the "
                                  "outer update is not delayed and there is nothing to apply eagerly)")
        self.reduction_spec().check()
        try:
            self.dp_settings().check(accounting=False)
        except PrivacyError as e:
            raise InvalidArgument(str(e)) from None
        if self.dp_settings().at_contributor and self.aggregator != "mean":
            raise InvalidArgument(f"dp_mode: {self.dp_mode} noise needs aggregator mean, got {self.aggregator!r}")
        if is_sparse(self.compression):
            self.sparse_settings()
            spec = self.reduction_spec()
            if spec.aggregator != "mean" or spec.max_norm > 0 or spec.dp_sigma > 0 or self.dp_settings().at_contributor:
                raise InvalidArgument(f"compression: {self.compression} (sparse payloads) combines only with "
                                      f"aggregator = mean, max_norm = 0 and dp_sigma = 0; got aggregator = "
                                      f"{spec.aggregator}, max_norm = {spec.max_norm}, dp_sigma = {self.dp_sigma}")
        else:
            codec_id(self.compression)
        make_outer(self.outer_name, **self.outer_params)
        if self.secure_aggregation:
            refused = refused_with(aggregator=self.aggregator, audit_owners=False, compression=self.compression,
                                   max_norm=self.max_norm, dp_sigma=self.dp_sigma, dp_mode=self.dp_mode)
            if refused is not None:
                raise InvalidArgument(f"{refused[0]}: {refused[1]}; it does not combine with secure_aggregation")
            self.secagg_params().check_settings()

    def secagg_params(self) -> SecAggParams | None:
        """Secure aggregation's parameters (peer.secagg), or None when it is off."""
        if not self.secure_aggregation:
            return None
        return SecAggParams(self.secagg_degree, self.secagg_threshold, self.secagg_clip, self.secagg_frac_bits)

    def sparse_settings(self) -> SparseSettings | None:
        """The sparse codec and error-feedback decay when `compression` is "topk" or "dct", else
        None. Raises InvalidArgument naming a setting out of range."""
        if not is_sparse(self.compression):
            return None
        try:
            return SparseSettings(SparseCodec(self.compression, self.sparse_chunk, self.sparse_k, self.sparse_bits),
                                  self.sparse_beta)
        except InvalidArgument as exc:
            raise InvalidArgument(f"sparse_{exc}") from None

    def reduction_spec(self) -> ReductionSpec:
        """What the shard owners run. With contributor noise (dp_mode distributed or local) the
        participants clip and add noise themselves, so the owners neither bound nor add noise."""
        if self.dp_settings().at_contributor:
            return ReductionSpec(self.aggregator, dict(self.aggregator_params))
        sigma = self.dp_sigma if self.dp_mode == "owner" else 0.0
        return ReductionSpec(self.aggregator, dict(self.aggregator_params), self.max_norm, self.on_norm, sigma)

    def dp_settings(self) -> DpSettings:
        """The peer's view of the run's DP settings (the budget is the coordinator's)."""
        return DpSettings(sigma=self.dp_sigma, clip=self.max_norm, mode=self.dp_mode)

    @property
    def phase_steps(self) -> int:
        """Inner steps per local phase: inner_steps, or inner_steps / fragments when streaming."""
        return self.inner_steps // max(1, self.fragments)

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
    """The run's outer optimizer; with fragments > 1 one per fragment (`FragmentedOuter`)."""
    if cfg.fragments > 1:
        return FragmentedOuter(lambda: make_outer(cfg.outer_name, **cfg.outer_params), cfg.fragments)
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
    # The fragment the round that made this state carried (streaming, set by `tentative`); -1 for
    # a whole state (the initial one, a download): the trainer then takes every parameter.
    fragment: int = field(default=-1, compare=False)
    # This peer's weight in the all-reduce of the round that made this state (set by `tentative`;
    # 0 for a whole state). Not serialised: the eager update's weight of its own term.
    share: float = field(default=0.0, compare=False)
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
    def from_bytes(blob: bytes, cfg: RunConfig, outer: Callable[[], OuterOptimizer] | None = None) -> "CommittedState":
        """Inverse of `to_bytes`; `outer` builds the outer optimizer whose state the blob holds
        (default: the run's, `make_outer_for(cfg)`). Raises InvalidArgument on a malformed blob."""
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
        outer = outer() if outer is not None else make_outer_for(cfg)
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
    """Committed state as one float32 vector + the run's outer optimizer; subclasses train.

    With the run's fragments F > 1 (streaming) `partition` is the `Fragments` of the parameters
    (set by the subclass, which knows the layout) and round r's aggregate is fragment
    `r mod F`'s pseudo-gradient `(sizes[f],)`: `tentative` steps that fragment's outer optimizer
    and leaves the other parameters as they are."""

    cfg: RunConfig
    state: CommittedState
    partition: Fragments | None = None

    def fragment(self) -> int:
        """The fragment the round in play carries (-1 without fragments)."""
        return fragment_of(self.state.rounds, self.cfg.fragments) if self.partition is not None else -1

    def tentative(self, aggregate: np.ndarray, aggregate_digest: bytes = b"", share: float = 0.0) -> CommittedState:
        """The state after round `state.rounds`'s outer step on `aggregate` (float32), on copies.
        `share`: this peer's weight in the aggregate (kept with the state for the run's eager).

        Raises:
            InvalidArgument: the aggregate's size is not the round's fragment's (or the model's).
        """
        outer = copy.deepcopy(self.state.outer)
        g = aggregate.astype(np.float32, copy=False)
        f = self.fragment()
        if f < 0:
            return CommittedState(outer.step(self.state.params, g), outer, self.state.rounds + 1, share=float(share))
        part = self.partition
        new = outer.step_fragment(f, part.take(self.state.params, f), g)
        return CommittedState(part.put(self.state.params, f, new), outer, self.state.rounds + 1, fragment=f,
                              share=float(share))

    def apply(self, state: CommittedState) -> None:
        self.state = state

    def pace(self, step_seconds: float) -> None:
        """A fixed H inner steps per round (local_work = "steps"): the swarm's pace changes nothing."""

    def state_from_bytes(self, blob: bytes) -> CommittedState:
        return CommittedState.from_bytes(blob, self.cfg)

    @property
    def num_params(self) -> int:
        return int(self.state.params.size)
