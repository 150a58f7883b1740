"""The relay's admission, limits and recovery (shoal/relay/server.py, peer/lanes/relay.py;
docs/nat.md, "Relays"), with the relay and the peers' relay links in this event loop on real
loopback sockets: a stranger (no relay ticket, a foreign one, an expired one) cannot register,
a registration line replays at no second relay, a connection flood from one dialling address
leaves the others' dials through, a registration without a control connection is forgotten, a
relay started again on its port gives a returning peer the same relayed address, and a peer
whose relay dies moves to the next relay and says so (`on_registered`)."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.common.identity import public_bytes
from shoal.peer.lanes.relay import RelayLink
from shoal.relay.protocol import RelayRefused, issue_relay_ticket, register_line
from shoal.relay.server import Limits, Relay

pytestmark = pytest.mark.timeout(60)


async def _echo_server() -> tuple[asyncio.base_events.Server, str]:
    async def echo(r, w):
        while data := await r.read(1 << 16):
            w.write(data)
            await w.drain()
        w.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    return server, f"127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def _line(address: str, line: bytes) -> str:
    host, port = address.rsplit(":", 1)
    r, w = await asyncio.open_connection(host, int(port))
    w.write(line)
    await w.drain()
    answer = (await asyncio.wait_for(r.readline(), 10)).decode()
    w.close()
    return answer


async def _echoes(address: str, source: str = "127.0.0.1") -> bool:
    """A dial of `address` from `source` gets its bytes echoed through the tunnel."""
    host, port = address.rsplit(":", 1)
    try:
        r, w = await asyncio.wait_for(asyncio.open_connection(host, int(port), local_addr=(source, 0)), 5)
        w.write(b"ping")
        await w.drain()
        ok = await asyncio.wait_for(r.readexactly(4), 5) == b"ping"
        w.close()
        return ok
    except (OSError, asyncio.IncompleteReadError, TimeoutError):
        return False


async def test_only_a_coordinator_ticket_holder_registers_and_a_line_replays_at_no_other_relay():
    coordinator, stranger_coordinator = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    relay = Relay("127.0.0.1:0", coordinator_keys=(public_bytes(coordinator),))
    other = Relay("127.0.0.1:0", coordinator_keys=(public_bytes(coordinator),))
    a, b = await relay.start(), await other.start()
    try:
        key = Ed25519PrivateKey.generate()
        pub = public_bytes(key)
        assert "relay ticket required" in await _line(a, register_line(key, a))
        foreign = issue_relay_ticket(stranger_coordinator, pub, 60)
        assert "not signed by this relay's coordinator" in await _line(a, register_line(key, a, ticket=foreign))
        expired = issue_relay_ticket(coordinator, pub, 60, now=0.0)
        assert "expired" in await _line(a, register_line(key, a, ticket=expired))
        someone_else = issue_relay_ticket(coordinator, public_bytes(Ed25519PrivateKey.generate()), 60)
        assert "not for this key" in await _line(a, register_line(key, a, ticket=someone_else))
        ticket = issue_relay_ticket(coordinator, pub, 60)
        line = register_line(key, a, ticket=ticket)
        assert (await _line(a, line)).startswith("OK ")
        assert "is for relay" in await _line(b, line)  # the same line at a second relay
        huge = register_line(key, a).decode().split()
        huge[4] = "9" * 700  # a 700-digit timestamp: refused in one line, no OverflowError
        assert (await _line(a, (" ".join(huge) + "\n").encode())).startswith("ERR ts_ns")
        assert relay.refused == 5 and len(relay.peers) == 1
    finally:
        await relay.close()
        await other.close()


async def test_a_connection_flood_from_one_address_leaves_other_diallers_through():
    coordinator = Ed25519PrivateKey.generate()
    relay = Relay("127.0.0.1:0", coordinator_keys=(public_bytes(coordinator),),
                  limits=Limits(per_dialler_connections=8, per_peer_connections=40))
    address = await relay.start()
    server, local = await _echo_server()
    key = Ed25519PrivateKey.generate()
    link = RelayLink(address, key, local)
    link.ticket = issue_relay_ticket(coordinator, public_bytes(key), 60)
    flood: list[socket.socket] = []
    try:
        relayed = await link.start(10)
        host, port = relayed.rsplit(":", 1)
        for _ in range(200):  # one client (127.0.0.2) opens and holds 200 connections
            s = socket.socket()
            s.bind(("127.0.0.2", 0))
            s.setblocking(False)
            try:
                await asyncio.get_running_loop().sock_connect(s, (host, int(port)))
            except OSError:
                s.close()
                continue
            flood.append(s)
        await asyncio.sleep(0.5)
        assert await _echoes(relayed, "127.0.0.1"), "a dial from another address did not get through"
        assert relay.dials_refused >= 200 - 8
        assert link.tunnels <= 8 + 1  # the member held at most the limit's tunnels for the flood
    finally:
        for s in flood:
            s.close()
        await link.close()
        server.close()
        await relay.close()


async def test_a_restarted_relay_gives_the_same_address_and_an_idle_registration_is_forgotten():
    relay = Relay("127.0.0.1:0", limits=Limits(idle_seconds=0.5))
    address = await relay.start()
    server, local = await _echo_server()
    link = RelayLink(address, Ed25519PrivateKey.generate(), local)
    try:
        relayed = await link.start(10)
        assert await _echoes(relayed)
        await relay.close()  # the relay goes; a new one comes up on the same port
        await asyncio.sleep(0.3)
        relay = Relay(address, limits=Limits(idle_seconds=0.5))
        await relay.start()
        for _ in range(100):
            if link.registrations >= 2:
                break
            await asyncio.sleep(0.1)
        assert link.registrations >= 2 and link.address == relayed  # the port it held, bound again
        assert await _echoes(relayed)
        await link.close()
        await asyncio.sleep(0.2)
        assert relay.peers and not relay.expire(time.monotonic())  # not idle long enough yet
        await asyncio.sleep(0.6)
        assert relay.expire(time.monotonic()) and not relay.peers
    finally:
        await link.close()
        server.close()
        await relay.close()


async def test_a_peer_whose_relay_dies_moves_to_the_next_one_and_says_so():
    first, second = Relay("127.0.0.1:0"), Relay("127.0.0.1:0")
    a, b = await first.start(), await second.start()
    server, local = await _echo_server()
    moved = asyncio.Event()

    async def on_registered(changed: bool) -> None:
        if changed:
            moved.set()

    link = RelayLink(f"{a},{b}", Ed25519PrivateKey.generate(), local, on_registered=on_registered)
    try:
        relayed = await link.start(10)
        assert link.relay == a and await _echoes(relayed)
        await first.close()
        await asyncio.wait_for(moved.wait(), 10)
        assert link.relay == b and link.address != relayed and await _echoes(link.address)
    finally:
        await link.close()
        server.close()
        await first.close()
        await second.close()


async def test_every_relay_refusing_is_one_error_naming_the_reason():
    coordinator = Ed25519PrivateKey.generate()
    relay = Relay("127.0.0.1:0", coordinator_keys=(public_bytes(coordinator),))
    address = await relay.start()
    link = RelayLink(address, Ed25519PrivateKey.generate(), "127.0.0.1:1")
    try:
        with pytest.raises(RelayRefused, match="relay ticket required"):
            await link.start(5)
    finally:
        await link.close()
        await relay.close()
