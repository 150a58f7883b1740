"""What the peer agent trains: the `Workload` protocol, and the flat-parameter base class.

The agent (peer.agent) drives rounds and never looks inside the model. Per round it calls
`local_update()` (inner training, returns the pseudo-gradient), all-reduces it, calls
`tentative(aggregate)` (the new state, committed state untouched), and `apply(state)` only once
the coordinator committed that state's digest. For state sync it serializes the committed state
(`state.to_bytes()`) and rebuilds a downloaded one (`state_from_bytes`).

Three implementations: `peer.workloads.digits.DigitsWorkload` (the default numpy MLP on the digits
data) and `peer.torch_optimizer.TorchWorkload` (a user's PyTorch model, driven by its own loop)
keep their committed state as a `FlatStateWorkload`: one float32 parameter vector plus the outer
optimizer, so the outer step is the same numpy code, bit-identical on every peer.
`ArrayWorkload` trains nothing: it all-reduces a given tensor every round and its committed
state is the last result (the all-reduce benchmark job, shoal.bench.collective_job).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import blake3
import numpy as np

from shoal.common.errors import InvalidArgument
from shoal.common.tensors import DIGEST_BYTES, digest, result_digest
from shoal.peer.training import CommittedState, FlatStateWorkload, LocalUpdate, RunConfig  # noqa: F401 (re-export)


class WorkloadClosed(Exception):
    """Raised by `local_update` when the workload's owner stopped training; the agent leaves."""


class State(Protocol):
    """A committed state: `rounds` committed rounds, `params` the `(n,)` committed tensor,
    `to_bytes()` its deterministic serialization, `digest()` BLAKE3-256 of that. Immutable once
    built (both are computed once and reused)."""

    rounds: int
    params: np.ndarray

    def to_bytes(self) -> bytes: ...

    def digest(self) -> bytes: ...


@runtime_checkable
class Workload(Protocol):
    """The contract between the agent and a model. All methods are called from the agent.

    state: the committed state (a `State`); `state.rounds` is the number of committed rounds it
        reflects, `state.to_bytes()` its deterministic serialization, `state.digest()` BLAKE3-256 of it.
    num_samples: this peer's training samples (the FedAvg weight).
    local_update(): blocking (run in a worker thread); inner training from the committed
        parameters; returns the pseudo-gradient (n,) float32 (ArrayWorkload: its input, any
        float dtype) and the mean loss. It must not change the committed state.
    tentative(aggregate, aggregate_digest): the state after the outer step on `aggregate` (n,)
        float32, on copies; the committed state is untouched (an abort leaves nothing to undo).
        `aggregate_digest` is `shoal.common.tensors.result_digest(aggregate)` (the vote digest,
        already computed by the collective): a state whose digest covers the aggregate's bytes
        as they are (`ArrayState`) reuses it instead of hashing them again; others ignore it.
        `share`: this peer's weight in the aggregate (n_i / sum n of the plan), kept by a workload
        that applies eager outer updates (the PyTorch integration), ignored by the others.
    apply(state): make `state` the committed one (after a commit or a verified state sync).
    pace(step_seconds): called before `apply` of a committed round with the swarm's pace, the fast
        participants' seconds per inner step in that round (Commit.step_seconds, 0 = unknown); a
        workload with local_work = "time" sizes its next local phase from it, others ignore it.
    state_from_bytes(blob): inverse of `state.to_bytes()`; raises InvalidArgument when malformed.
    evaluate(): held-out accuracy of the committed state in [0, 1], or NaN when there is none.
    """

    cfg: RunConfig
    state: State

    @property
    def num_samples(self) -> int: ...

    @property
    def num_params(self) -> int: ...

    def local_update(self) -> LocalUpdate: ...

    def tentative(self, aggregate: np.ndarray, aggregate_digest: bytes = b"", share: float = 0.0) -> State: ...

    def apply(self, state: State) -> None: ...

    def pace(self, step_seconds: float) -> None: ...

    def state_from_bytes(self, blob: bytes) -> State: ...

    def evaluate(self) -> float: ...


_ARRAY_MAGIC = b"SHOALAR1"
_ARRAY_DIGEST_CONTEXT = "shoal.v1 array state digest: header and result digest"


def array_state_digest(header: bytes, params_digest: bytes) -> bytes:
    """The state digest of an `ArrayState` (32 bytes): BLAKE3 in key-derivation mode with the
    context string _ARRAY_DIGEST_CONTEXT over the header's byte length (8 bytes, little-endian),
    the header (magic, u32 length, JSON) and the `result_digest` of the params' bytes
    (`params_digest`, 32 bytes). The state after a round is that round's result, so its digest
    costs one hash of a few hundred bytes on top of the vote digest instead of a second pass over
    the tensor (docs/protocol.md, "State digest"). Key-derivation mode, not a prefix in plain
    BLAKE3: every other state's digest is plain BLAKE3 of its serialization, and a plain hash of
    the bytes this construction hashes would otherwise equal it (a 162-byte blob a donor could
    serve in place of the state)."""
    h = blake3.blake3(derive_key_context=_ARRAY_DIGEST_CONTEXT, max_threads=1)
    for part in (len(header).to_bytes(8, "little"), header, params_digest):
        h.update(part)
    return h.digest(length=DIGEST_BYTES)


def state_blob_digest(blob: bytes | memoryview) -> bytes:
    """The state digest (32 bytes) of a serialized committed state (`State.to_bytes()`), as its
    `digest()` computes it: `array_state_digest` for an array state (magic SHOALAR1 with a
    header that fits the blob), BLAKE3-256 of the bytes for every other state. A download is
    verified with it (peer.state_sync): a blob that is not what it claims gets a digest of the
    other construction (plain BLAKE3 against key-derivation mode), which matches no committed
    one."""
    view = memoryview(blob).cast("B")
    hl = _array_header_length(view)
    if hl is not None and 12 + hl <= len(view):
        return array_state_digest(bytes(view[:12 + hl]), result_digest(np.frombuffer(view[12 + hl:], np.uint8)))
    return digest(view)


def _array_header_length(blob: bytes | memoryview) -> int | None:
    """The JSON header's byte length of an array-state blob (magic SHOALAR1, u32 little-endian
    length, header, tensor bytes), or None when `blob` does not start so."""
    if len(blob) < 12 or blob[:8] != _ARRAY_MAGIC:
        return None
    return struct.unpack("<I", blob[8:12])[0]


@dataclass
class ArrayState:
    """The committed state of an `ArrayWorkload`: `params` `(n,)` (any dtype), the result of the
    last committed round, and the number of committed rounds. Treated as immutable; the
    serialization (magic | u32 header length | JSON header | raw bytes) is built only when a
    donor serves it. The digest is `array_state_digest`: the params' `result_digest` is given by
    `ArrayWorkload.tentative` (the collective's vote digest of the same bytes) or hashed in place
    once (no copy of a large tensor)."""

    params: np.ndarray
    rounds: int
    params_digest: bytes = field(default=b"", repr=False, compare=False)
    _header: bytes | None = field(default=None, init=False, repr=False, compare=False)
    _blob: bytes | None = field(default=None, init=False, repr=False, compare=False)
    _digest: bytes | None = field(default=None, init=False, repr=False, compare=False)

    def header(self) -> bytes:
        if self._header is None:
            h = json.dumps({"rounds": self.rounds, "dtype": self.params.dtype.str, "n": int(self.params.size)},
                           sort_keys=True).encode()
            self._header = _ARRAY_MAGIC + struct.pack("<I", len(h)) + h
        return self._header

    def to_bytes(self) -> bytes:
        if self._blob is None:
            self._blob = self.header() + np.ascontiguousarray(self.params).tobytes()
        return self._blob

    def digest(self) -> bytes:
        """`array_state_digest` of the header and the params (`state_blob_digest(to_bytes())`)."""
        if self._digest is None:
            self._digest = array_state_digest(self.header(), self.params_digest or result_digest(self.params))
        return self._digest

    @staticmethod
    def from_bytes(blob: bytes) -> "ArrayState":
        """Inverse of `to_bytes`. Raises InvalidArgument on a malformed blob."""
        hl = _array_header_length(blob)
        if hl is None:
            raise InvalidArgument("state: bad magic")
        try:
            header = json.loads(blob[12:12 + hl])
            dtype, n, rounds = np.dtype(header["dtype"]), int(header["n"]), int(header["rounds"])
        except (ValueError, KeyError, TypeError):
            raise InvalidArgument("state: bad header") from None
        body = blob[12 + hl:]
        if len(body) != n * dtype.itemsize:
            raise InvalidArgument(f"state: {len(body)} bytes for {n} elements of {dtype}")
        return ArrayState(np.frombuffer(body, dtype=dtype).copy(), rounds)


class ArrayWorkload:
    """A `Workload` that all-reduces `inputs(round)` `(size,)` of `dtype` every round.

    The committed state is the last committed result (`ArrayState`); `tentative(aggregate)` is
    the aggregate itself, so a round commits the digest of exactly what the collective computed.
    There is no training and no model: `evaluate()` is NaN and the loss is 0.
    """

    def __init__(self, cfg: RunConfig, inputs: Callable[[int], np.ndarray], size: int, dtype: str | np.dtype,
                 num_samples: int = 1):
        self.cfg = cfg
        self.inputs = inputs
        self.size = int(size)
        self.state = ArrayState(np.zeros(0, dtype=np.dtype(dtype)), 0)
        self._num_samples = num_samples

    @property
    def num_samples(self) -> int:
        return self._num_samples

    @property
    def num_params(self) -> int:
        return self.size

    def local_update(self) -> LocalUpdate:
        return LocalUpdate(self.inputs(self.state.rounds), 0.0, self._num_samples)

    def tentative(self, aggregate: np.ndarray, aggregate_digest: bytes = b"", share: float = 0.0) -> ArrayState:
        return ArrayState(aggregate, self.state.rounds + 1, aggregate_digest)

    def apply(self, state: ArrayState) -> None:
        self.state = state

    def pace(self, step_seconds: float) -> None:
        """No training: the swarm's pace changes nothing."""

    def state_from_bytes(self, blob: bytes) -> ArrayState:
        return ArrayState.from_bytes(blob)

    def evaluate(self) -> float:
        return math.nan
