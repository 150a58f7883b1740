"""A user-space TCP proxy that adds latency and stalls, for tests (the design notes (§8)).

The kernel's ``netem`` qdisc is not available on our test machines, so latency and faults are
injected here: `DelayProxy` listens on one address and forwards every accepted connection to a
target, delaying each direction by ``delay_s`` (one way) without limiting throughput: bytes are
read as soon as they arrive, stamped, queued, and written once their time has come, so a stream
keeps its rate and only gains latency (a round trip through the proxy gains ``2·delay_s``).
`DelayProxy.blackhole` freezes every connection (nothing is read or written, connections stay
open, new ones are accepted but not connected onward) like a path that silently drops packets;
`DelayProxy.resume` lets everything flow again with no byte lost, as TCP would after the path
heals. `DelayProxy.sever` resets every connection, like a crash. Shaping bandwidth is
`shoal.netbed`'s job, not this module's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Self

__all__ = ["DelayProxy"]

log = logging.getLogger(__name__)

_READ_BYTES = 64 * 1024
# Bytes queued per direction before the proxy stops reading (backpressure to the sender). Large
# enough to hold the bandwidth-delay product of a test link (1 Gbit/s × 0.5 s ≈ 64 MiB).
_MAX_QUEUED_BYTES = 64 * 1024 * 1024
_CONNECT_TIMEOUT_S = 10.0
_EOF = b""


class DelayProxy:
    """Forward ``listen`` → ``target`` with ``delay_s`` of one-way latency per direction.

    ``listen`` is ``(host, port)``; port 0 picks a free port, read it from `address` after start.
    Use as ``async with DelayProxy(...) as proxy:``. On exit the listener closes and every
    connection is aborted (both sockets closed, queued bytes dropped). If the target refuses a
    connection, the accepted client connection is closed at once; errors on one connection never
    affect the others or the proxy.
    """

    def __init__(self, listen: tuple[str, int], target: tuple[str, int], delay_s: float = 0.0) -> None:
        if delay_s < 0:
            raise ValueError("delay_s must be ≥ 0")
        self.listen = listen
        self.target = target
        self.delay_s = delay_s
        self._server: asyncio.Server | None = None
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._handlers: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self.connections_total = 0

    @property
    def address(self) -> tuple[str, int]:
        """The address actually listened on (host, port)."""
        if self._server is None:
            raise RuntimeError("proxy not started")
        host, port = self._server.sockets[0].getsockname()[:2]
        return host, port

    @property
    def blackholed(self) -> bool:
        return not self._flowing.is_set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.listen[0], self.listen[1])

    async def stop(self) -> None:
        """Close the listener and abort every connection; waits for all handlers to finish."""
        if self._server is not None:
            self._server.close()
        self._flowing.set()  # wake anything parked on the blackhole so it can be cancelled cleanly
        for task in list(self._handlers):
            task.cancel()
        for writer in list(self._writers):
            writer.transport.abort()
        if self._handlers:
            await asyncio.gather(*self._handlers, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), timeout=2.0)
            self._server = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def blackhole(self) -> None:
        """Stop forwarding in both directions; keep every connection open."""
        self._flowing.clear()

    def resume(self) -> None:
        """Forward again; bytes held during the blackhole are delivered (their delay counts from
        when they were read, so they go out at once if it has passed)."""
        self._flowing.set()

    def sever(self) -> None:
        """Reset every open connection (both sides see a connection reset / EOF)."""
        for writer in list(self._writers):
            writer.transport.abort()

    # --- per connection ----------------------------------------------------------------------

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self._writers.add(client_w)
        self.connections_total += 1
        upstream_w: asyncio.StreamWriter | None = None
        clean = False
        try:
            await self._flowing.wait()
            try:
                upstream_r, upstream_w = await asyncio.wait_for(
                    asyncio.open_connection(*self.target), timeout=_CONNECT_TIMEOUT_S
                )
            except (OSError, asyncio.TimeoutError) as e:
                log.debug("proxy: target %s unreachable: %s", self.target, e)
                return
            self._writers.add(upstream_w)
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._pipe(client_r, upstream_w))
                tg.create_task(self._pipe(upstream_r, client_w))
            clean = True  # both directions reached EOF: flush what is buffered, then close
        except* (ConnectionError, OSError) as eg:
            log.debug("proxy: connection ended: %s", eg.exceptions)
        finally:
            for w in (client_w, upstream_w):
                if w is None:
                    continue
                self._writers.discard(w)
                if clean:
                    w.close()
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(w.wait_closed(), timeout=_CONNECT_TIMEOUT_S)
                else:
                    w.transport.abort()
            self._handlers.discard(task)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One direction: a reader task stamps and queues, a writer task releases on time."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        room = asyncio.Condition()
        queued = 0

        async def read() -> None:
            nonlocal queued
            while True:
                await self._flowing.wait()
                data = await reader.read(_READ_BYTES)
                queue.put_nowait((time.monotonic() + self.delay_s, data))
                if not data:
                    return
                async with room:
                    queued += len(data)
                    await room.wait_for(lambda: queued < _MAX_QUEUED_BYTES)

        async def write() -> None:
            nonlocal queued
            while True:
                due, data = await queue.get()
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                await self._flowing.wait()
                if data == _EOF:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()
                async with room:
                    queued -= len(data)
                    room.notify_all()

        async with asyncio.TaskGroup() as tg:
            tg.create_task(read())
            tg.create_task(write())
