"""How much of a grpc.aio server stream's C heap depends on the messages it sent (diagnostic).

Starts a grpc.aio server in a subprocess with N server-streaming calls open (one connection
each, as the coordinator's members have) and sends every stream the same messages in turn,
printing after each step the server's C heap in use per stream (glibc's mallinfo2, after a
collection and a malloc_trim). Modes: `none` (the stream sends nothing until the first
message), `md` (initial metadata sent at open), `empty` (an empty message sent at open),
`twice` (two empty messages sent at open: what the coordinator's round-event streams do).

Measured with grpcio 1.85: a stream's first message sets up ~0.8 KB in gRPC and its second ~0.3 KB (once each, kept
until the stream ends; `empty`: +~280 B per stream at the first message after the opening one,
`twice`: +~17); and gRPC's asyncio server keeps
the last message a stream's handler yielded (its `async for response_message` loop) until the
next one: with a message object of its own per stream ("each"), ~its size per stream stays
(a 50-byte message after a 1,800-byte one gives ~1.7 KB per stream back); one object shared
by every stream costs once.

    python scripts/grpc_stream_retention.py [N] [none|md|empty|twice]
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable

import grpc


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                 "fsmblks", "uordblks", "fordblks", "keepcost")]


def _in_use() -> int:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallinfo2.restype = _MallInfo2
    gc.collect()
    libc.malloc_trim(0)
    m = libc.mallinfo2()
    return m.uordblks + m.hblkhd


async def _server(mode: str, port_file: str) -> None:
    queues: list[asyncio.Queue] = []

    async def stream(request, context):
        q: asyncio.Queue = asyncio.Queue()
        queues.append(q)
        if mode == "md":
            await context.send_initial_metadata(())
        elif mode == "empty":
            yield b""
        elif mode == "twice":
            yield b""
            yield b""
        while True:
            yield await q.get()

    async def control(request, context):
        if request.startswith(b"send"):  # "send N": one message shared by all; "sendeach N": one each
            size = int(request.split()[1])
            shared = os.urandom(size)
            for q in queues:
                q.put_nowait(os.urandom(size) if request.startswith(b"sendeach") else shared)
            return b"ok"
        return json.dumps({"in_use": _in_use()}).encode()

    handlers = {"S": grpc.unary_stream_rpc_method_handler(stream), "C": grpc.unary_unary_rpc_method_handler(control)}
    await serve(handlers, port_file, [("grpc.http2.bdp_probe", 0)])


async def serve(handlers: dict[str, grpc.RpcMethodHandler], port_file: str, options: list[tuple[str, object]]) -> None:
    """Serve `handlers` (method name -> handler) as service `t.T` on a free loopback port with
    gRPC `options`, write the port to `port_file` (what `with_server` waits for), and run until
    killed."""
    server = grpc.aio.server(options=options)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    with open(port_file, "w") as f:
        f.write(str(port))
    await server.wait_for_termination()


async def open_streams(addr: str, n: int, settle: float = 2.0) -> tuple[list[grpc.aio.Channel], list[asyncio.Future]]:
    """`n` connections to `addr` (a channel each), each with a `/t.T/S` server stream open (its
    request: the connection's index, b"0" .. b"n-1") and drained, then `settle` seconds for them
    to open; returns the channels and the draining tasks (cancel them to end)."""
    channels = [grpc.aio.insecure_channel(addr, options=[("t.k", i)]) for i in range(n)]  # a connection each
    calls = [ch.unary_stream("/t.T/S")(str(i).encode()) for i, ch in enumerate(channels)]

    async def drain(call) -> None:
        async for _ in call:
            pass

    tasks = [asyncio.ensure_future(drain(c)) for c in calls]
    await asyncio.sleep(settle)
    return channels, tasks


def server_in_use(addr: str) -> Callable[[], Awaitable[int]]:
    """An async function reading the server's C heap in use (bytes) over its `/t.T/C` method."""
    control = grpc.aio.insecure_channel(addr, options=[("t.k", -1)]).unary_unary("/t.T/C")

    async def in_use() -> int:
        return json.loads(await control(b"stats"))["in_use"]

    return in_use


def with_server(argv: list[str], client: Callable[[int], Awaitable[None]]) -> None:
    """Start `argv` + [a port file] (a server that writes its port there), run `client(port)`,
    kill the server."""
    port_file = tempfile.mktemp()
    server = subprocess.Popen([*argv, port_file])
    try:
        deadline = time.monotonic() + 30
        while not (os.path.exists(port_file) and open(port_file).read()):
            if time.monotonic() > deadline or server.poll() is not None:
                sys.exit("the server did not start")
            time.sleep(0.1)
        asyncio.run(client(int(open(port_file).read())))
    finally:
        server.kill()
        server.wait(timeout=10)
        if os.path.exists(port_file):
            os.unlink(port_file)


async def _client(port: int, n: int, mode: str) -> None:
    addr = f"127.0.0.1:{port}"
    control = grpc.aio.insecure_channel(addr, options=[("t.k", -1)]).unary_unary("/t.T/C")
    in_use = server_in_use(addr)
    before = await in_use()
    _, tasks = await open_streams(addr, n)
    last = await in_use()
    print(f"{mode}: {(last - before) / n:.0f} B per open stream")
    for how, size in (("send", 700), ("send", 700), ("sendeach", 700), ("sendeach", 1800), ("sendeach", 50)):
        await control(f"{how} {size}".encode())
        await asyncio.sleep(1.5)
        now = await in_use()
        kind = "one shared" if how == "send" else "one per stream"
        print(f"{mode}: a {size}-byte message ({kind}): {(now - last) / n:+.0f} B per stream")
        last = now
    for t in tasks:
        t.cancel()


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 500
    mode = sys.argv[2] if len(sys.argv) > 2 else "none"
    if len(sys.argv) > 3 and sys.argv[3] == "--server":
        asyncio.run(_server(mode, sys.argv[4]))
        return
    with_server([sys.executable, __file__, str(n), mode, "--server"], lambda port: _client(port, n, mode))


if __name__ == "__main__":
    main()
