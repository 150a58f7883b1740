"""How much of a grpc.aio server's C heap a connection keeps after the calls it carried (diagnostic).

Starts a grpc.aio server in a subprocess (the coordinator's server options,
`shoal.coordinator.daemon.grpc_options`) and N client connections, each with a server stream open that has sent two
messages (as the coordinator's round-event streams do), then makes unary calls on every
connection and prints after each step the server's C heap in use per connection (glibc's
mallinfo2, after a collection and a malloc_trim): k calls at once per connection, then calls of
methods the connection never called before, with larger requests and replies.

Measured with grpcio 1.85, 300
connections, five runs: +24-101 B per connection after 2 calls at once and +77-139 B more after
3 (140-220 B in all, four streams open on the connection), kept; new methods and 1-4 KB messages add 0-7 B. So a connection's state
grows with the most streams it has had open at once, and does not shrink: a member's first cohort
draw (its Ready, Vote or heartbeat beside its stream) pays it once.

    python scripts/grpc_connection_retention.py [N]
"""

from __future__ import annotations

import asyncio
import json
import sys

import grpc

# This directory is on sys.path when the script runs.
from grpc_stream_retention import _in_use, open_streams, serve, server_in_use, with_server

from shoal.coordinator.daemon import grpc_options

async def _server(port_file: str) -> None:
    async def stream(request, context):
        yield b""
        yield b""
        await asyncio.Event().wait()

    async def unary(request, context):
        return request[:3000 if request[:1] == b"B" else 10]

    async def control(request, context):
        return json.dumps({"in_use": _in_use()}).encode()

    handlers = {"S": grpc.unary_stream_rpc_method_handler(stream), "C": grpc.unary_unary_rpc_method_handler(control)}
    for m in ("H", "R", "V", "X"):
        handlers[m] = grpc.unary_unary_rpc_method_handler(unary)
    await serve(handlers, port_file, grpc_options())


async def _client(port: int, n: int) -> None:
    addr = f"127.0.0.1:{port}"
    in_use = server_in_use(addr)
    channels, tasks = await open_streams(addr, n)

    async def each(method: str, payload: bytes, k: int = 1) -> None:
        await asyncio.gather(*(ch.unary_unary(f"/t.T/{method}")(payload) for ch in channels for _ in range(k)))

    for _ in range(3):
        await each("H", b"h" * 200)
    last = await in_use()
    steps = [(f"{k} calls at once per connection", "H", b"h" * 200, k) for k in (1, 2, 3)]
    steps += [("a new method, 300 B", "R", b"r" * 300, 1), ("a new method, 1 KB", "V", b"v" * 1000, 1),
              ("a new method, 4 KB in, 3 KB back", "X", b"B" * 4000, 1), ("the first method again", "H", b"h" * 200, 1)]
    for label, method, payload, k in steps:
        await each(method, payload, k)
        await asyncio.sleep(0.5)
        now = await in_use()
        print(f"{label}: {(now - last) / n:+.0f} B per connection")
        last = now
    for t in tasks:
        t.cancel()


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    if len(sys.argv) > 2 and sys.argv[2] == "--server":
        asyncio.run(_server(sys.argv[3]))
        return
    with_server([sys.executable, __file__, str(n), "--server"], lambda port: _client(port, n))


if __name__ == "__main__":
    main()
