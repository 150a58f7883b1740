"""The coordinator's accept loops (`coordinator.daemon._bind_servers`): several grpc.aio servers of
one service on one port (SO_REUSEPORT), over real loopback sockets."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest

from shoal.coordinator.rounds import EngineConfig, RoundEngine
from shoal.coordinator.daemon import CoordinatorConfig, _bind_servers, _port_free
from shoal.coordinator.server import CoordinatorService
from shoal.v1 import shoal_pb2 as pb
from shoal.v1 import shoal_pb2_grpc as pb_grpc

from kits.service import service as coordinator_service

pytestmark = pytest.mark.timeout(60)
RPC_TIMEOUT_S = 5.0


def service() -> CoordinatorService:
    return coordinator_service(RoundEngine(EngineConfig(min_peers=2)))


async def statuses(port: int, channels: int) -> list[pb.StatusResponse]:
    """GetStatus over `channels` connections of their own (distinct channel arguments)."""
    out = []
    for i in range(channels):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("test.channel", i)]) as ch:
            out.append(await pb_grpc.CoordinatorStub(ch).GetStatus(pb.StatusRequest(), timeout=RPC_TIMEOUT_S))
    return out


async def test_several_servers_share_the_port_and_each_answers():
    config = CoordinatorConfig(listen="127.0.0.1:0", accept_loops=3)
    servers, healths, port = _bind_servers(config, service(), [])
    assert len(servers) == len(healths) == 3 and port > 0
    for s in servers:
        await s.start()
    try:
        assert not _port_free(f"127.0.0.1:{port}")
        assert [r.rounds_committed for r in await statuses(port, 12)] == [0] * 12
        # Another process's coordinator (or anything else) must not join the port's group.
        with pytest.raises(OSError, match="already in use"):
            _bind_servers(dataclasses.replace(config, listen=f"127.0.0.1:{port}"), service(), [])
        # Each server listens on its own: with the first one gone, the others take new connections.
        await servers[0].stop(grace=None)
        assert len(await statuses(port, 6)) == 6
        await servers[1].stop(grace=None)
        assert len(await statuses(port, 3)) == 3
    finally:
        for s in servers:
            await s.stop(grace=None)
    assert _port_free(f"127.0.0.1:{port}")


async def test_one_loop_binds_without_reuseport():
    servers, _, port = _bind_servers(CoordinatorConfig(listen="127.0.0.1:0", accept_loops=1), service(), [])
    assert len(servers) == 1
    await servers[0].start()
    try:
        # A listener with SO_REUSEPORT cannot share a port whose listener did not set it.
        with pytest.raises(OSError):
            _bind_servers(CoordinatorConfig(listen=f"127.0.0.1:{port}", accept_loops=2), service(), [])
        assert [r.rounds_committed for r in await statuses(port, 2)] == [0, 0]
    finally:
        await servers[0].stop(grace=None)


def _server_settings(port: int) -> dict[int, int]:
    """The HTTP/2 SETTINGS the coordinator's server sends first, read over a raw socket (the
    client preface, then frames until the server's non-ACK SETTINGS frame: 9-byte headers,
    6-byte entries). Every read is bounded (socket timeout, an overall deadline, end of file)."""
    import socket
    import struct
    import time

    deadline = time.monotonic() + RPC_TIMEOUT_S
    with socket.create_connection(("127.0.0.1", port), timeout=RPC_TIMEOUT_S) as s:
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + struct.pack(">I", 0)[1:] + b"\x04\x00" + b"\x00" * 4)
        buf = b""

        def need(n: int) -> None:
            nonlocal buf
            while len(buf) < n:
                assert time.monotonic() < deadline, "no SETTINGS frame from the server in time"
                chunk = s.recv(4096)
                assert chunk, "connection closed before the server's SETTINGS"
                buf += chunk

        while True:
            need(9)
            length, kind, flags = int.from_bytes(buf[:3], "big"), buf[3], buf[4]
            need(9 + length)
            payload, buf = buf[9:9 + length], buf[9 + length:]
            if kind == 0x4 and not flags & 0x1:
                return {k: v for k, v in (struct.unpack(">HI", payload[i:i + 6]) for i in range(0, length, 6))}


async def test_members_connections_carry_no_hpack_tables():
    """SETTINGS_HEADER_TABLE_SIZE (0x1) 0: members' encoders index nothing, so the coordinator
    holds no per-connection header table that grows with a member's first cohort draw."""
    servers, _, port = _bind_servers(CoordinatorConfig(listen="127.0.0.1:0", accept_loops=1), service(), [])
    await servers[0].start()
    try:
        assert (await asyncio.to_thread(_server_settings, port)).get(0x1) == 0
        assert [r.rounds_committed for r in await statuses(port, 2)] == [0, 0]  # calls still work
    finally:
        await servers[0].stop(grace=None)
