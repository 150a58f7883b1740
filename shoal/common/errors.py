"""gRPC status mapping, in one place.

Library code raises `ShoalError` subclasses; servicers use `grpc_errors` so every refusal reaches
the caller as the right status code with a one-line message that names the offending field.
`DecodeErrors` (a server interceptor) answers INVALID_ARGUMENT to bytes that do not decode as the
method's request message, where gRPC itself would answer INTERNAL.

Codes used across both planes: INVALID_ARGUMENT (malformed field, wrong shape/dtype/size against
the plan), UNAUTHENTICATED (missing/bad/replayed signature, bad join token), PERMISSION_DENIED
(not on the allow-list, no valid round ticket, not a participant), RESOURCE_EXHAUSTED (rate
limit, message too large, buffers full), FAILED_PRECONDITION (wrong round/state), NOT_FOUND
(unknown peer), DEADLINE_EXCEEDED (a stream outlived its plan's deadline).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TypeVar

import grpc

T = TypeVar("T")


class ShoalError(Exception):
    """Base of every error that maps to a gRPC status."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgument(ShoalError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class Unauthenticated(ShoalError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(ShoalError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(ShoalError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(ShoalError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class AlreadyExists(ShoalError):
    code = grpc.StatusCode.ALREADY_EXISTS


class NotFound(ShoalError):
    code = grpc.StatusCode.NOT_FOUND


class Aborted(ShoalError):
    code = grpc.StatusCode.ABORTED


class DeadlineExceeded(ShoalError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


@contextlib.asynccontextmanager
async def grpc_errors(context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
    """Translate a `ShoalError` raised inside the block into `context.abort(code, message)`."""
    try:
        yield
    except ShoalError as exc:
        await context.abort(exc.code, str(exc))


class _Undecodable:
    """Stand-in for a request message that did not decode (see DecodeErrors)."""

    def __init__(self, why: str):
        self.why = why


def _tolerant(deserializer):
    def decode(data: bytes):
        try:
            return deserializer(data)
        except Exception as exc:  # protobuf raises DecodeError, but also others on odd input
            return _Undecodable(type(exc).__name__)
    return decode


class DecodeErrors(grpc.aio.ServerInterceptor):
    """Answer INVALID_ARGUMENT ("request: does not decode as <Message>") to undecodable requests.

    Install it first (outermost) on every server, so later interceptors and handlers only ever
    see well-formed messages.
    """

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        what = f"request: does not decode as the request message of {handler_call_details.method}"

        async def refuse(context) -> None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, what)

        h = handler._replace(request_deserializer=_tolerant(handler.request_deserializer))
        if h.unary_unary is not None:
            inner = h.unary_unary

            async def unary_unary(request, context):
                if isinstance(request, _Undecodable):
                    await refuse(context)
                return await inner(request, context)

            return h._replace(unary_unary=unary_unary)
        if h.unary_stream is not None:
            inner_s = h.unary_stream

            async def unary_stream(request, context):
                if isinstance(request, _Undecodable):
                    await refuse(context)
                async for item in inner_s(request, context):
                    yield item

            return h._replace(unary_stream=unary_stream)
        if h.stream_unary is not None:
            inner_c = h.stream_unary

            async def checked(request_iterator):
                async for request in request_iterator:
                    if isinstance(request, _Undecodable):
                        raise InvalidArgument(what)
                    yield request

            async def stream_unary(request_iterator, context):
                return await inner_c(checked(request_iterator), context)

            return h._replace(stream_unary=stream_unary)
        return h


def require(condition: bool, field: str, why: str) -> None:
    """Raise InvalidArgument("<field>: <why>") unless `condition` holds."""
    if not condition:
        raise InvalidArgument(f"{field}: {why}")


def construct(registry: Mapping[str, Callable[..., T]], name: str, field: str, removed: Mapping[str, str] | None = None,
              **params: object) -> T:
    """`registry[name](**params)`.

    `removed` maps spellings that 0.3 removed to their names (e.g. aggregator "fedavg" for "mean":
    FedAvg names the training algorithm); a removed one is refused with the name to use. Raises
    InvalidArgument naming `field`: a removed or unknown name, or parameters the constructor refuses
    (a TypeError: unknown keyword) — the class raises InvalidArgument itself for bad values.
    """
    if removed and name in removed:
        raise InvalidArgument(f"{field}: {name!r} was removed in 0.3; use {removed[name]!r}")
    cls = registry.get(name)
    if cls is None:
        raise InvalidArgument(f"{field}: unknown {name!r}; expected one of {sorted(registry)}")
    try:
        return cls(**params)
    except TypeError as exc:
        raise InvalidArgument(f"{field}: bad parameters for {name!r}: {exc}") from None
