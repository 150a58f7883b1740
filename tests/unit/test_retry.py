"""The one retry policy of the control plane (shoal.common.retry), without a network: fake calls
that raise real grpc.aio.AioRpcError instances."""

from __future__ import annotations

import logging
import time

import grpc
import pytest

from shoal.common.retry import BROKEN_STREAM, RETRYABLE, RetryPolicy, is_transient

S = grpc.StatusCode


def rpc_error(code: grpc.StatusCode, details: str = "test") -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class Flaky:
    """Fails with `codes` in turn, then returns "ok"; counts calls."""

    def __init__(self, *codes: grpc.StatusCode):
        self.codes = list(codes)
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.codes:
            raise rpc_error(self.codes.pop(0))
        return "ok"


FAST = RetryPolicy(initial=0.001, maximum=0.004, deadline=5.0)


def test_the_predicate_names_exactly_the_transient_statuses():
    assert RETRYABLE == {S.UNAVAILABLE, S.DEADLINE_EXCEEDED, S.RESOURCE_EXHAUSTED}
    for code in S:
        assert is_transient(rpc_error(code)) == (code in RETRYABLE), code
    # A server bug is never retried; CANCELLED only where the caller says it is a broken stream.
    assert not is_transient(rpc_error(S.UNKNOWN)) and not is_transient(rpc_error(S.INTERNAL))
    assert not is_transient(rpc_error(S.CANCELLED)) and is_transient(rpc_error(S.CANCELLED), BROKEN_STREAM)
    assert not is_transient(ValueError("not an RPC")) and not is_transient(TimeoutError())


@pytest.mark.parametrize("code", sorted(RETRYABLE, key=lambda c: c.name))
async def test_transient_failures_are_retried_until_success(code):
    fn = Flaky(code, code, code)
    assert await FAST.call(fn, "test") == "ok"
    assert fn.calls == 4


@pytest.mark.parametrize("code", [S.UNKNOWN, S.INTERNAL, S.INVALID_ARGUMENT, S.UNAUTHENTICATED,
                                  S.PERMISSION_DENIED, S.NOT_FOUND, S.FAILED_PRECONDITION, S.CANCELLED])
async def test_other_statuses_raise_at_once_as_they_came(code):
    fn = Flaky(code)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await FAST.call(fn, "test")
    assert e.value.code() == code and fn.calls == 1


async def test_other_exceptions_raise_at_once():
    calls = []

    async def boom():
        calls.append(1)
        raise ValueError("bug")

    with pytest.raises(ValueError):
        await FAST.call(boom, "test")
    assert len(calls) == 1


async def test_also_makes_a_status_transient_for_one_call():
    fn = Flaky(S.FAILED_PRECONDITION, S.CANCELLED)
    assert await FAST.call(fn, "test", also=(S.FAILED_PRECONDITION, *BROKEN_STREAM)) == "ok"
    assert fn.calls == 3


async def test_a_named_recovery_runs_before_the_retry():
    order: list[str] = []
    fn = Flaky(S.NOT_FOUND)

    async def call():
        order.append("call")
        return await fn()

    async def rejoin():
        order.append("rejoin")

    assert await FAST.call(call, "test", recover={S.NOT_FOUND: rejoin}) == "ok"
    assert order == ["call", "rejoin", "call"]


async def test_a_failing_recovery_counts_as_a_failed_try():
    fn = Flaky(S.NOT_FOUND)
    recoveries = Flaky(S.UNAVAILABLE)  # the rejoin meets a restarting coordinator once, then works
    assert await FAST.call(fn, "test", recover={S.NOT_FOUND: recoveries}) == "ok"
    assert fn.calls == 2 and recoveries.calls == 1


async def test_the_bound_gives_up_with_the_last_error_and_never_sleeps_past_it():
    fn = Flaky(*[S.UNAVAILABLE] * 10_000)
    policy = RetryPolicy(initial=0.01, maximum=0.05, deadline=0.3)
    t0 = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await policy.call(fn, "test")
    assert e.value.code() == S.UNAVAILABLE
    assert fn.calls > 3
    # The last try happens at the deadline (it is not cut short by a backoff window) ...
    assert time.monotonic() - t0 >= 0.3
    # ... and a per-call deadline overrides the policy's.
    fn2 = Flaky(*[S.UNAVAILABLE] * 10_000)
    with pytest.raises(grpc.aio.AioRpcError):
        await policy.call(fn2, "test", deadline=0.0)
    assert fn2.calls == 1


async def test_backoff_is_jittered_exponential_and_capped():
    sleeps: list[float] = []

    async def sleep(s: float) -> None:
        sleeps.append(s)

    policy = RetryPolicy(initial=0.1, maximum=0.8, deadline=1000.0)
    for _ in range(20):
        await policy.call(Flaky(*[S.UNAVAILABLE] * 8), "test", sleep=sleep)
    assert len(sleeps) == 20 * 8
    for i, s in enumerate(sleeps):
        assert 0.0 <= s <= min(0.8, 0.1 * 2 ** (i % 8)), (i, s)
    # Full jitter: the waits are spread, not a fixed ladder.
    assert len({round(s, 6) for s in sleeps}) > 100


async def test_each_retry_logs_at_debug_and_a_call_that_keeps_failing_warns_once(caplog):
    policy = RetryPolicy(initial=0.001, maximum=0.002, deadline=5.0, warn_after=3)
    with caplog.at_level(logging.DEBUG, logger="shoal.retry"):
        assert await policy.call(Flaky(*[S.UNAVAILABLE] * 6), "heartbeat", sleep=_no_sleep) == "ok"
    debug = [r for r in caplog.records if r.levelno == logging.DEBUG]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(debug) == 6 and all("heartbeat: UNAVAILABLE" in r.getMessage() for r in debug)
    assert len(warnings) == 1 and "heartbeat keeps failing" in warnings[0].getMessage()


async def _no_sleep(_: float) -> None:
    return None


def test_a_policy_refuses_nonsense_bounds():
    for bad in (dict(initial=0.0), dict(initial=2.0, maximum=1.0), dict(deadline=-1.0), dict(warn_after=0)):
        with pytest.raises(ValueError):
            RetryPolicy(**bad)
