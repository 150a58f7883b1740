"""The status a streaming call really ended with, when grpc.aio reports a racing write instead.

A receiver that refuses a stream (a bad ticket: PERMISSION_DENIED; a chunk past its shard:
INVALID_ARGUMENT naming the field) ends the call while the sender may still be writing. grpc.aio
(grpcio 1.62 to at least 1.85.3) then fails the sender's next write and *overwrites* the call's
status with INTERNAL "Internal error from Core" (grpc/grpc#36066; a fix is proposed in
grpc/grpc#43486), so the sender's error said "INTERNAL" where the receiver said why. Measured with
grpcio 1.85.3 on loopback, a server aborting a 64 x 64 KiB client stream at its first message:
200 of 200 calls ended INTERNAL; in 16 the server's status had arrived first (and was
overwritten), in 184 the failed write came first (and the server's status replaced it a moment
later). `StreamEnd` covers both orders: a done callback records the first status a call gets
(callbacks run once, before any overwrite), and when both what the write raised and that first
status are INTERNAL, it waits briefly for the server's status to replace it.

Used by the collectives' PushChunks and Exchange streams (peer.collectives). No I/O of its own.
"""

from __future__ import annotations

import asyncio
import time

import grpc

__all__ = ["StreamEnd", "status_now"]

# How long a failed stream waits for the server's status to replace grpc.aio's INTERNAL (seconds).
# It arrives within a loop turn or two on loopback; a genuine INTERNAL waits this long once.
STATUS_WAIT_S = 0.5
_POLL_S = 0.01


def status_now(call: grpc.aio.Call) -> tuple[grpc.StatusCode, str] | None:
    """`(code, details)` of a call that has ended, read without waiting; None while it runs.

    grpc.aio exposes a call's status only through coroutines (`code()`, `details()`), which
    complete without suspending once the status is set: they are driven here synchronously, so a
    done callback can read the status at the moment it is set."""
    out = []
    for get in (call.code, call.details):
        coro = get()
        try:
            coro.send(None)
        except StopIteration as stop:
            out.append(stop.value)
        else:  # it would have to wait: the call has not ended
            coro.close()
            return None
    return out[0], out[1] or ""


class StreamEnd:
    """Watches one streaming call from its start; `status(exc)` says why it ended.

    Create it right after opening the call (before the first write)."""

    __slots__ = ("call", "first")

    def __init__(self, call: grpc.aio.Call):
        self.call = call
        self.first: tuple[grpc.StatusCode, str] | None = None  # the first status the call got
        call.add_done_callback(self._done)

    def _done(self, call) -> None:
        if self.first is None:
            self.first = status_now(call)

    async def status(self, exc: grpc.aio.AioRpcError | None = None,
                     wait: float = STATUS_WAIT_S) -> tuple[grpc.StatusCode, str]:
        """The call's real `(code, details)`: what `exc` (the error a write or read raised)
        says, unless it is grpc.aio's INTERNAL for a racing write; then the status the call got
        first, or the one that replaces it within `wait` seconds. Without `exc` (a write refused
        as the call had already ended: asyncio.InvalidStateError), the call's status."""
        if exc is not None and exc.code() is not grpc.StatusCode.INTERNAL:
            return exc.code(), exc.details() or ""
        if self.first is not None and self.first[0] is not grpc.StatusCode.INTERNAL:
            return self.first
        deadline = time.monotonic() + wait
        while True:
            now = status_now(self.call)
            if now is not None and now[0] is not grpc.StatusCode.INTERNAL:
                return now
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(_POLL_S)
        if now is not None:
            return now
        return (exc.code(), exc.details() or "") if exc is not None else (grpc.StatusCode.UNKNOWN, "the call has not ended")
