"""What the peer agent trains: the `Workload` protocol, and the flat-parameter base class.

The agent (peer.agent) drives rounds and never looks inside the model. Per round it calls
`local_update()` (inner training, returns the pseudo-gradient), all-reduces it, calls
`tentative(aggregate)` (the new state, committed state untouched), and `apply(state)` only once
the coordinator committed that state's digest. For state sync it serializes the committed state
(`state.to_bytes()`) and rebuilds a downloaded one (`state_from_bytes`).

Two implementations: `peer.training.DigitsWorkload` (the default numpy MLP on the digits data)
and `peer.torch_integration.TorchWorkload` (a user's PyTorch model, driven by its own loop).
Both keep their committed state as a `FlatStateWorkload`: one float32 parameter vector plus the
outer optimizer, so the outer step is the same numpy code, bit-identical on every peer.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from shoal.peer.training import CommittedState, FlatStateWorkload, LocalUpdate, RunConfig  # noqa: F401 (re-export)


class WorkloadClosed(Exception):
    """Raised by `local_update` when the workload's owner stopped training; the agent leaves."""


@runtime_checkable
class Workload(Protocol):
    """The contract between the agent and a model. All methods are called from the agent.

    state: the committed state; `state.rounds` is the number of committed rounds it reflects,
        `state.to_bytes()` its deterministic serialization, `state.digest()` BLAKE3-256 of it.
    num_samples: this peer's training samples (the FedAvg weight).
    local_update(): blocking (run in a worker thread); inner training from the committed
        parameters; returns the pseudo-gradient (n,) float32 and the mean loss. It must not
        change the committed state.
    tentative(aggregate): the state after the outer step on `aggregate` (n,) float32, on
        copies; the committed state is untouched (an abort leaves nothing to undo).
    apply(state): make `state` the committed one (after a commit or a verified state sync).
    state_from_bytes(blob): inverse of `state.to_bytes()`; raises InvalidArgument when malformed.
    evaluate(): held-out accuracy of the committed state in [0, 1], or NaN when there is none.
    """

    cfg: RunConfig
    state: CommittedState

    @property
    def num_samples(self) -> int: ...

    @property
    def num_params(self) -> int: ...

    def local_update(self) -> LocalUpdate: ...

    def tentative(self, aggregate: np.ndarray) -> CommittedState: ...

    def apply(self, state: CommittedState) -> None: ...

    def state_from_bytes(self, blob: bytes) -> CommittedState: ...

    def evaluate(self) -> float: ...
