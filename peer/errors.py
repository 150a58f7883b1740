"""gRPC status mapping, in one place.

Library code raises `ShoalError` subclasses; servicers call `abort_with(context, exc)` (or use
`grpc_errors`) so every refusal reaches the caller as the right status code with a one-line
message that names the offending field.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc


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


def require(condition: bool, field: str, why: str) -> None:
    """Raise InvalidArgument("<field>: <why>") unless `condition` holds."""
    if not condition:
        raise InvalidArgument(f"{field}: {why}")
