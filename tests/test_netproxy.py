"""DelayProxy on loopback: latency per direction, throughput kept, blackhole/resume, sever."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator

import pytest

from shoal.netproxy import DelayProxy

pytestmark = pytest.mark.timeout(30)

STEP_TIMEOUT_S = 5.0


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


@pytest.fixture
async def echo_server() -> AsyncIterator[tuple[str, int]]:
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    async with server:
        yield server.sockets[0].getsockname()[:2]


async def _round_trip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, payload: bytes) -> float:
    t0 = time.monotonic()
    writer.write(payload)
    await writer.drain()
    async with asyncio.timeout(STEP_TIMEOUT_S):
        got = await reader.readexactly(len(payload))
    assert got == payload
    return time.monotonic() - t0


async def test_delay_adds_latency_each_way(echo_server: tuple[str, int]) -> None:
    delay = 0.15
    async with DelayProxy(("127.0.0.1", 0), echo_server, delay_s=delay) as proxy:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(*proxy.address), STEP_TIMEOUT_S)
        try:
            rtts = [await _round_trip(reader, writer, b"ping%d" % k) for k in range(3)]
        finally:
            writer.close()
    # A round trip crosses the proxy once each way: + 2 * delay, at least. (No upper bound: how
    # much later a reply comes depends on the machine's load, not on the proxy.)
    assert min(rtts) >= 2 * delay


async def test_delay_keeps_throughput() -> None:
    """Pipelined: bytes are read as they arrive and wait out their delay together, so the whole
    payload has crossed to the server before the first echoed byte is back at the client. A proxy
    paying one delay per read would by then have let through about 2 of its 64 reads. Checked by
    the order of the two events, not by timing the transfer."""
    delay = 0.25  # far longer than reading 4 MiB on loopback takes, even on a busy machine
    payload = bytes(range(256)) * (16 * 1024)  # 4 MiB, i.e. 64 reads of 64 KiB
    order: list[str] = []  # one event loop: the events' order is the order they happened in
    received = 0

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal received
        try:
            while data := await reader.read(65536):
                received += len(data)
                if received == len(payload):
                    order.append("server has the whole payload")
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    async with server, DelayProxy(("127.0.0.1", 0), server.sockets[0].getsockname()[:2], delay_s=delay) as proxy:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(*proxy.address), STEP_TIMEOUT_S)
        try:
            t0 = time.monotonic()

            async def send() -> None:
                writer.write(payload)
                await writer.drain()

            async with asyncio.timeout(STEP_TIMEOUT_S), asyncio.TaskGroup() as tg:
                tg.create_task(send())
                first = await reader.readexactly(1)
                order.append("client has the first echoed byte")
                got = first + await reader.readexactly(len(payload) - 1)
            elapsed = time.monotonic() - t0
        finally:
            writer.close()
    assert got == payload
    assert order == ["server has the whole payload", "client has the first echoed byte"]
    assert elapsed >= 2 * delay  # the round trip's latency is paid, once


async def test_blackhole_stalls_and_resume_continues(echo_server: tuple[str, int]) -> None:
    async with DelayProxy(("127.0.0.1", 0), echo_server) as proxy:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(*proxy.address), STEP_TIMEOUT_S)
        try:
            await _round_trip(reader, writer, b"before")
            proxy.blackhole()
            assert proxy.blackholed
            writer.write(b"during")
            await writer.drain()
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.5):
                    await reader.readexactly(6)
            assert not writer.is_closing()  # the connection stays open
            proxy.resume()
            async with asyncio.timeout(STEP_TIMEOUT_S):
                assert await reader.readexactly(6) == b"during"  # nothing was lost
            await _round_trip(reader, writer, b"after")
        finally:
            writer.close()


async def test_blackhole_holds_new_connections(echo_server: tuple[str, int]) -> None:
    async with DelayProxy(("127.0.0.1", 0), echo_server) as proxy:
        proxy.blackhole()
        reader, writer = await asyncio.wait_for(asyncio.open_connection(*proxy.address), STEP_TIMEOUT_S)
        try:
            writer.write(b"x")
            await writer.drain()
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.3):
                    await reader.readexactly(1)
            proxy.resume()
            async with asyncio.timeout(STEP_TIMEOUT_S):
                assert await reader.readexactly(1) == b"x"
        finally:
            writer.close()


async def test_sever_resets_connections(echo_server: tuple[str, int]) -> None:
    async with DelayProxy(("127.0.0.1", 0), echo_server) as proxy:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(*proxy.address), STEP_TIMEOUT_S)
        try:
            await _round_trip(reader, writer, b"hello")
            proxy.sever()
            async with asyncio.timeout(STEP_TIMEOUT_S):
                try:
                    assert await reader.read(10) == b""
                except ConnectionError:
                    pass
            # The proxy itself keeps serving.
            r2, w2 = await asyncio.wait_for(asyncio.open_connection(*proxy.address), STEP_TIMEOUT_S)
            await _round_trip(r2, w2, b"again")
            w2.close()
        finally:
            writer.close()


async def test_unreachable_target_closes_client() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[:2]
    async with DelayProxy(("127.0.0.1", 0), dead) as proxy:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(*proxy.address), STEP_TIMEOUT_S)
        async with asyncio.timeout(STEP_TIMEOUT_S):
            try:
                assert await reader.read(10) == b""
            except ConnectionError:
                pass
        writer.close()


async def test_stop_aborts_open_connections(echo_server: tuple[str, int]) -> None:
    proxy = DelayProxy(("127.0.0.1", 0), echo_server, delay_s=0.05)
    await proxy.start()
    reader, writer = await asyncio.wait_for(asyncio.open_connection(*proxy.address), STEP_TIMEOUT_S)
    await _round_trip(reader, writer, b"x")
    proxy.blackhole()  # a stalled connection must not keep stop() waiting
    async with asyncio.timeout(STEP_TIMEOUT_S):
        await proxy.stop()
        try:
            assert await reader.read(10) == b""
        except ConnectionError:
            pass
    writer.close()
