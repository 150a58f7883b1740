"""peer.stream_end: a refused stream reports the receiver's status, not grpc.aio's INTERNAL.

A real grpc.aio server on loopback aborts client streams at their first message while the client
keeps writing (what a shard owner does to a sender with a bad ticket). grpc.aio overwrites the
call's status with INTERNAL "Internal error from Core" when the racing write fails (grpc#36066):
on this machine every one of these calls raises INTERNAL, in either order of the two events.
Seen on main: tests/unit/test_outbound_only.py's owner refusal read "INTERNAL Internal error from
Core" under load instead of PERMISSION_DENIED.
"""

from __future__ import annotations

import asyncio

import grpc
from grpc import aio

from shoal.peer.stream_end import StreamEnd, status_now

CALLS = 40


async def _abort_at_first(request_iterator, context):
    async for _ in request_iterator:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, "ticket: not a participant")


async def _server():
    server = aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.Refuse", {
        "Push": grpc.stream_unary_rpc_method_handler(_abort_at_first),
        "Exchange": grpc.stream_stream_rpc_method_handler(_abort_at_first)})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def _write_until_refused(call) -> tuple[grpc.StatusCode, grpc.StatusCode, str]:
    """(what the call raised, the status StreamEnd reports, its details)."""
    end = StreamEnd(call)
    try:
        for _ in range(64):
            await call.write(b"x" * 65536)
        await call.done_writing()
        await asyncio.wait_for(call.read() if hasattr(call, "read") else call, 10)
    except aio.AioRpcError as exc:
        code, details = await end.status(exc)
        return exc.code(), code, details
    except asyncio.InvalidStateError:
        code, details = await end.status()
        return grpc.StatusCode.OK, code, details
    raise AssertionError("the server accepted a stream it aborts")


async def test_refused_streams_report_the_receivers_status():
    server, port = await _server()
    try:
        async with aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            for method in ("/t.Refuse/Push", "/t.Refuse/Exchange"):
                open_call = ch.stream_unary(method) if method.endswith("Push") else ch.stream_stream(method)
                seen = set()
                for _ in range(CALLS):
                    # grpc.aio itself raises INTERNAL for (with grpcio 1.85.3 here: all of) these.
                    _, code, details = await _write_until_refused(open_call(timeout=10))
                    seen.add((code, details))
                assert seen == {(grpc.StatusCode.PERMISSION_DENIED, "ticket: not a participant")}, (method, seen)
    finally:
        await server.stop(0)


async def test_status_now_is_none_while_the_call_runs_and_a_genuine_error_passes_through():
    server, port = await _server()
    try:
        async with aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            call = ch.stream_unary("/t.Refuse/Push")(timeout=10)
            assert status_now(call) is None
            end = StreamEnd(call)
            call.cancel()
            assert (await end.status(wait=0.05))[0] is grpc.StatusCode.CANCELLED
            # A status other than INTERNAL is taken as the error says, without waiting.
            dead = ch.stream_unary("/t.Refuse/Nothing")(timeout=10)
            end = StreamEnd(dead)
            try:
                await dead.write(b"x")
                await dead.done_writing()
                await dead
            except aio.AioRpcError as exc:
                assert (await end.status(exc))[0] is grpc.StatusCode.UNIMPLEMENTED
            else:
                raise AssertionError("an unknown method answered")
    finally:
        await server.stop(0)
