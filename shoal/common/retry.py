"""The one retry policy of every control-plane call (peer -> coordinator).

`RetryPolicy.call(fn, what)` runs `fn` (one gRPC call) until it succeeds, fails with a status that
is not transient, or the policy's bound passes. Transient means exactly `RETRYABLE`: UNAVAILABLE
(no connection, a restarting coordinator), DEADLINE_EXCEEDED (a call that took too long) and
RESOURCE_EXHAUSTED (a rate limit). Never UNKNOWN or INTERNAL: a server bug surfaces at once
instead of being retried for minutes. CANCELLED is transient only where the caller says it
means a broken connection (the round-event stream, `BROKEN_STREAM`).

Backoff: exponential with full jitter (the n-th retry sleeps uniform(0, min(maximum, initial *
2^(n-1))) seconds), never past the bound: the last try happens at the deadline, then the last
error is raised as it came (the original `grpc.aio.AioRpcError`, never a wrapper). Every retry is
logged at debug; a call that keeps failing (`warn_after` attempts) logs one warning.

Named recoveries: statuses that are not transient in general but mean "do this, then try again"
for one call (e.g. Ready answered NOT_FOUND: the lease is gone, join again first) are handled by
`recover={code: coroutine function}`: the recovery runs, then the call is retried under the same
bound. `also` adds statuses that are transient for one call only (e.g. Ready answered
FAILED_PRECONDITION: no donor is live yet, "retry later").

Built on tenacity (jittered exponential wait, stop after a delay, before-sleep hook).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TypeVar

import grpc
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_delay, wait_random_exponential

log = logging.getLogger("shoal.retry")
T = TypeVar("T")

RETRYABLE: frozenset[grpc.StatusCode] = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED})
BROKEN_STREAM: frozenset[grpc.StatusCode] = frozenset({grpc.StatusCode.CANCELLED})
# The coordinator refuses this identity (no admission, fenced, revoked, a live holder elsewhere):
# never retried; the process ends with one line naming why (shoal.peer.diagnosis).
REFUSED: frozenset[grpc.StatusCode] = frozenset({
    grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.ALREADY_EXISTS})


def is_transient(exc: BaseException, also: Collection[grpc.StatusCode] = ()) -> bool:
    """True for a `grpc.aio.AioRpcError` whose status is in `RETRYABLE` or `also`; False for
    anything else (other statuses, other exceptions, cancellation)."""
    return isinstance(exc, grpc.aio.AioRpcError) and (exc.code() in RETRYABLE or exc.code() in also)


@dataclass(frozen=True)
class RetryPolicy:
    """Backoff bounds and the default bound of one call, in seconds (see the module docstring).

    initial: the first retry's window; maximum: the largest window; deadline: give up this long
    after the first try (a call may pass its own); warn_after: attempts after which a call that
    keeps failing logs a warning (once).
    """

    initial: float = 0.05
    maximum: float = 2.0
    deadline: float = 120.0
    warn_after: int = 8

    def __post_init__(self) -> None:
        if not (0 < self.initial <= self.maximum) or self.deadline < 0 or self.warn_after < 1:
            raise ValueError(f"retry policy: need 0 < initial <= maximum, deadline >= 0, warn_after >= 1: {self}")

    async def call(self, fn: Callable[[], Awaitable[T]], what: str, *, deadline: float | None = None,
                   also: Collection[grpc.StatusCode] = (),
                   recover: Mapping[grpc.StatusCode, Callable[[], Awaitable[object]]] | None = None,
                   sleep: Callable[[float], Awaitable[None]] | None = None) -> T:
        """`await fn()` under this policy; returns its result.

        Raises the last `grpc.aio.AioRpcError` when its status is not transient for this call (at
        once) or when the bound passed; any other exception of `fn` (or of a recovery) at once.
        `recover[code]()` runs before the retry of a call that failed with `code` (a recovery's
        own transient errors count as a failed try). `sleep` replaces asyncio.sleep (tests).
        """
        bound = self.deadline if deadline is None else deadline
        recover = recover or {}
        retryable = set(also) | set(recover)

        async def attempt() -> T:
            try:
                return await fn()
            except grpc.aio.AioRpcError as exc:
                fix = recover.get(exc.code())
                if fix is None:
                    raise
                log.info("%s: %s (%s); recovering before the retry", what, exc.code().name, exc.details())
                await fix()
                raise

        jitter = wait_random_exponential(multiplier=self.initial, max=self.maximum)

        def wait(state: RetryCallState) -> float:
            # Never sleep past the bound: the last try happens at the deadline, not a backoff later.
            return max(0.0, min(jitter(state), bound - (state.seconds_since_start or 0.0)))

        kwargs = {} if sleep is None else {"sleep": sleep}
        retrying = AsyncRetrying(
            retry=retry_if_exception(lambda e: is_transient(e, retryable)), wait=wait,
            stop=stop_after_delay(bound), before_sleep=self._logger(what, bound), reraise=True, **kwargs)
        return await retrying(attempt)

    def _logger(self, what: str, bound: float) -> Callable[[RetryCallState], None]:
        def before_sleep(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome is not None else None
            code = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else type(exc).__name__
            sleep = state.next_action.sleep if state.next_action is not None else 0.0
            log.debug("%s: %s; retry %d in %.2fs", what, code, state.attempt_number, sleep)
            if state.attempt_number == self.warn_after:
                log.warning("%s keeps failing (%s, %d tries in %.1fs); retrying for up to %.0fs in all", what,
                            code, state.attempt_number, state.seconds_since_start or 0.0, bound)
        return before_sleep
