"""Deprecated alias of `shoal.torch` (the public PyTorch API), kept for one release.

`import shoal.peer.torch_integration` warns (DeprecationWarning) and gives the same optimizers;
import `shoal.torch` instead. The compute-accounting classes moved to shoal.peer.compute_accounting.
"""

from __future__ import annotations

import warnings

from shoal.peer.compute_accounting import ComputeLedger, TrainerTimes, utilization  # noqa: F401
from shoal.peer.torch_optimizer import (DiLoCoOptimizer, FedAvgOptimizer, RoundTimeout, SwarmError,  # noqa: F401
                                        SwarmOptimizer, TorchWorkload, flatten, layout_of, unflatten_into)

warnings.warn("shoal.peer.torch_integration is deprecated: import shoal.torch", DeprecationWarning, stacklevel=2)
