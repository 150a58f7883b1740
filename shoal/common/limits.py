"""Limits that keep a server up under hostile or broken callers: sizes, rates, buffers.

One place for the numbers every server and client of both planes uses (message sizes, concurrent
calls) and for the per-caller token bucket (`RateLimiter`, keyed by `host_of(context.peer())`).
Pure and synchronous; the servers map the raised `ShoalError`s to gRPC status codes
(`shoal.common.errors`). Who may call at all is `shoal.common.security` / `shoal.coordinator.admission`.
"""

from __future__ import annotations

import collections
import math
import time

from shoal.common.errors import ResourceExhausted

# Control plane: requests are small (the largest is a Vote or a LinkReport); responses carry
# plans and status listings, which grow with the swarm.
CONTROL_MAX_RECEIVE_BYTES = 1 << 20
CONTROL_MAX_SEND_BYTES = 16 << 20
# Data plane: a chunk is at most Plan.chunk_bytes (1 MiB by default) plus a ticket (< 1 MiB).
DATA_MAX_MESSAGE_BYTES = 8 << 20
# The largest chunk planned for the bulk TCP lane (rounds.bulk_chunk_bytes): a lane that fails
# falls back to gRPC, where the chunk must still fit one message with its ticket.
MAX_BULK_CHUNK_BYTES = DATA_MAX_MESSAGE_BYTES - (1 << 20)
# Concurrent calls a server runs; past it new calls get RESOURCE_EXHAUSTED. The coordinator holds
# one long-lived WatchRounds stream per peer, so its bound must exceed the swarm size.
COORDINATOR_MAX_CONCURRENT_RPCS = 20_000
PEER_MAX_CONCURRENT_RPCS = 512
# Physical bounds of a link estimate (LinkReport, JoinRequest): a rate below 1 kB/s or above
# 1 TB/s, or a round trip above a minute, is no measurement (a planner fed one plans deadlines of
# hours or chunks of nothing). The coordinator refuses a report outside them; 0 = "not measured".
LINK_BYTES_PER_S_BOUNDS = (1e3, 1e12)
LINK_RTT_MAX_SECONDS = 60.0


def host_of(grpc_peer: str) -> str:
    """The caller's host from `context.peer()` ("ipv4:1.2.3.4:5678" -> "1.2.3.4",
    "ipv6:[::1]:5678" -> "::1"); other forms (e.g. "unix:/path") are returned unchanged.

    Key the rate limiter by host, not by the full peer string: the port changes with every
    connection, so keying by it lets a caller reset its bucket by reconnecting.
    """
    kind, _, rest = grpc_peer.partition(":")
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    if kind == "ipv6":
        host = rest.rsplit(":", 1)[0] if rest.startswith("[") else rest
        return host.strip("[]")
    return grpc_peer



class RateLimiter:
    """Token bucket per caller key: `burst` requests at once, refilled at `rate_per_s`.

    Memory is bounded by `max_keys` buckets; when full, the least recently used bucket is
    dropped (a dropped caller starts again with a full bucket, so `max_keys` should exceed the
    number of concurrently active callers). Not thread-safe; one instance per event loop.
    """

    def __init__(self, rate_per_s: float, burst: int, max_keys: int = 10_000) -> None:
        if not (rate_per_s > 0 and math.isfinite(rate_per_s)):
            raise ValueError("rate_per_s: must be positive and finite")
        if burst < 1:
            raise ValueError("burst: must be >= 1")
        if max_keys < 1:
            raise ValueError("max_keys: must be >= 1")
        self.rate_per_s = float(rate_per_s)
        self.burst = int(burst)
        self.max_keys = int(max_keys)
        # key -> (tokens, last refill time in seconds); ordered least recently used first.
        self._buckets: collections.OrderedDict[str, tuple[float, float]] = collections.OrderedDict()

    def __len__(self) -> int:
        """Buckets currently held."""
        return len(self._buckets)

    def check(self, key: str, now: float | None = None) -> None:
        """Take one token from `key`'s bucket. `now` is seconds on any monotonic clock
        (default time.monotonic()); use the same clock for every call.

        Raises:
            ResourceExhausted: the bucket is empty; the message says when to retry.
        """
        t = time.monotonic() if now is None else now
        tokens, last = self._buckets.pop(key, (float(self.burst), t))
        tokens = min(float(self.burst), tokens + max(0.0, t - last) * self.rate_per_s)
        if tokens < 1.0:
            self._buckets[key] = (tokens, t)
            self._evict()
            wait = (1.0 - tokens) / self.rate_per_s
            raise ResourceExhausted(
                f"rate limit: {key} over {self.rate_per_s:g}/s, retry in {wait:.2f} s"
            )
        self._buckets[key] = (tokens - 1.0, t)
        self._evict()

    def _evict(self) -> None:
        while len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)
