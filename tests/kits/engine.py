"""A round engine for tests: `engine(**kw)` is a `RoundEngine` on the test settings below (two
peers make a round, no retry backoff), any of them overridden by keyword; `admit` joins and
connects peers the way a coordinator would."""

from __future__ import annotations

from shoal.coordinator.rounds import EngineConfig, RoundEngine

TEST_SETTINGS = dict(min_peers=2, lease_seconds=10.0, ready_timeout=5.0, collective_timeout=30.0, max_attempts=3,
                     retry_backoff=0.0)


def engine(**kw) -> RoundEngine:
    """A fresh engine on TEST_SETTINGS updated with `kw` (EngineConfig's field names)."""
    return RoundEngine(EngineConfig(**{**TEST_SETTINGS, **kw}))


def admit(e: RoundEngine, peers, now: float = 0.0, key: bytes = bytes(32)) -> RoundEngine:
    """Join and connect each peer at `now`, peer i at 127.0.0.1:(1000 + i); returns `e`."""
    for i, p in enumerate(peers):
        e.join(p, key, f"127.0.0.1:{1000 + i}", 1, now)
        e.connected(p, now)
    return e
