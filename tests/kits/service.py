"""The coordinator's gRPC service in this process, without a server: the handlers are called
directly (a test passes None or a fake for the context)."""

from __future__ import annotations

from typing import Callable

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.coordinator.rounds import EngineConfig, RoundEngine
from shoal.coordinator.server import CoordinatorService
from shoal.coordinator.store import MemoryStore


def service(engine: RoundEngine | None = None, *, store=None, clock: list[float] | float | Callable | None = None,
            **kw) -> CoordinatorService:
    """A CoordinatorService over `engine` (default: RoundEngine(EngineConfig())), `store`
    (default: a MemoryStore), a fresh signing key and an empty run config. clock: a one-item
    list the test moves (read at each call), a fixed time, a callable, or None for the service's
    own clock (wall time). Other keywords go to CoordinatorService."""
    if isinstance(clock, list):
        now = clock
        kw["clock"] = lambda: now[0]
    elif isinstance(clock, (int, float)):
        fixed = float(clock)
        kw["clock"] = lambda: fixed
    elif clock is not None:
        kw["clock"] = clock
    return CoordinatorService(engine if engine is not None else RoundEngine(EngineConfig()),
                              store if store is not None else MemoryStore(), "{}", Ed25519PrivateKey.generate(),
                              **kw)
