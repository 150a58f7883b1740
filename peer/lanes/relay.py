"""The relayed lane: a NATed peer's link to a relay (`shoal peer --relay HOST:PORT`; docs/nat.md,
"Relays"), and the checks a sender makes on streams that go through a relay.

Nobody can dial a peer behind NAT, but it can dial out. `RelayLink` keeps one outbound control
connection to the relay, registered under the peer's identity (shoal.relay.protocol: the
registration is signed with its Ed25519 key), and gets a relayed address on the relay in return,
which the peer advertises. Whenever someone dials that address the relay says OPEN on the control
connection; the link then opens a fresh outbound connection to the relay (ACCEPT) and pipes it,
byte for byte, into the peer's own data-plane listener: a reverse tunnel. The gRPC server, its
tickets, signatures and TLS (end to end: the relay only sees TLS records) are unchanged.

Several relays (`--relay A,B`): the peer registers at the first that takes it. Failure
semantics: `start` raises `RelayRefused` (every relay said no, e.g. a bad signature or no
ticket) or `RelayUnreachable` (an OSError: no relay there) after trying for `timeout` seconds.
Afterwards a broken control connection (the relay died or restarted, the NAT mapping changed) is
registered again with backoff, for ever, until `close`: at the same relay first (asking for the
relayed port it held, which a restarted relay binds again when it is free: the address is
unchanged), then at the next relays in turn (fail-over). When the address moved (another relay,
another port) the peer joins again to advertise it (`on_registered`), with no operator involved. A
tunnel whose either end breaks closes both ends (the gRPC client sees the connection drop and
the round's usual failure handling applies).

Sending to a relayed participant (peer.lanes.network): its chunks go on gRPC streams only
(the relay forwards one port), each signed end to end (`Transport.sign_relayed`), never on
shared memory or the bulk TCP lane. What a relay can do to them is caught at one end or the
other and blames the relay, never a peer (`CollectiveError.relay`): a chunk whose signature
fails (the receiver refuses the stream with `RELAY_ALTERED`: `altered`), a stream the receiver's
gRPC ended early because a length prefix changed (it acknowledges fewer chunks than were
written: `check_ack`), a chunk stalled in an open stream (`stalled`, on the receiving side).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.relay.protocol import (MAGIC, MAX_LINE, PING_SECONDS, RELAY_ALTERED, TICKET_REFUSED, RelayRefused,
                                  RelayUnreachable, register_line)
from shoal.peer.lanes.base import CollectiveError

log = logging.getLogger("shoal.peer.lanes.relay")

PIPE_BYTES = 1 << 16
CONNECT_TIMEOUT = 5.0


def _rate(word: str) -> float:
    """The relay's declared capacity (bytes/s) from its answer; 0 when unusable."""
    try:
        v = float(word)
    except ValueError:
        return 0.0
    return v if math.isfinite(v) and v > 0 else 0.0


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def local_target(bound: str) -> str:
    """Where the tunnel reaches this peer's data-plane listener bound at `bound` (a wildcard
    host is reached on loopback)."""
    host, port = _split(bound)
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host in ("::", "[::]"):
        host = "::1"
    return f"{host}:{port}"


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> int:
    """Copy `reader` into `writer` until EOF; returns the bytes copied. Half-closes the writer
    at EOF (the other direction may still be running)."""
    n = 0
    try:
        while data := await reader.read(PIPE_BYTES):
            writer.write(data)
            n += len(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError, RuntimeError):  # RuntimeError: uvloop's write on a closed transport
        writer.close()
    return n


async def splice(a: tuple[asyncio.StreamReader, asyncio.StreamWriter],
                 b: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> tuple[int, int]:
    """Pipe a -> b and b -> a until both directions ended; close both. Returns (a->b, b->a) bytes."""
    try:
        ab, ba = await asyncio.gather(pipe(a[0], b[1]), pipe(b[0], a[1]))
        return ab, ba
    finally:
        for w in (a[1], b[1]):
            w.close()


async def _read_line(reader: asyncio.StreamReader) -> list[str]:
    line = await reader.readline()
    if not line:
        raise ConnectionError("relay closed the connection")
    if len(line) > MAX_LINE or not line.endswith(b"\n"):
        raise RelayRefused("relay: header line too long or cut")
    return line.decode("ascii", "replace").split()


class RelayLink:
    """The peer's registration at one of `relays` (HOST:PORT each, in order of preference) under
    `key`; tunnels into `local` (HOST:PORT of its own data-plane listener). `address` is the
    relayed address once started, `relay` the relay it is on.

    ticket: the coordinator's relay ticket to present (set from the JoinResponse; b"" = none).
    on_registered: awaited (in a task of its own) after every re-registration, with True when it
    changed `address` or a fresh ticket was taken (another relay, a relay that restarted and could
    not bind the port again): the peer joins again to advertise it when it moved, or when the
    coordinator could not dial it meanwhile.
    on_ticket: awaited when a relay refuses the ticket (expired, none yet): the peer joins again,
    which gives it a fresh one."""

    def __init__(self, relays: str | list[str], key: Ed25519PrivateKey, local: str, *,
                 on_registered: Callable[[bool], Awaitable[None]] | None = None,
                 on_ticket: Callable[[], Awaitable[None]] | None = None):
        self.relays = relays.split(",") if isinstance(relays, str) else list(relays)
        self.key, self.local = key, local_target(local)
        self.on_registered, self.on_ticket = on_registered, on_ticket
        self.relay = self.relays[0]
        self.address = ""
        self.token = ""
        self.ticket = b""
        self.capacity = 0.0  # the relay's declared capacity, bytes/s each way (0: not declared), from registering
        self.tunnels = 0  # tunnels opened so far
        self.registrations = 0  # successful registrations so far (the first one included)
        self.bytes_in = self.bytes_out = 0  # through the tunnels: into / out of this peer
        self._ports: dict[str, int] = {}  # relay -> the relayed port it gave this peer last
        self._task: asyncio.Task | None = None
        self._tunnels: set[asyncio.Task] = set()

    async def start(self, timeout: float = 30.0) -> str:
        """Register at the first relay that takes this peer (each in turn, retrying connection
        errors up to `timeout` s) and serve OPEN requests in the background; returns the relayed
        address. Raises RelayRefused (every relay refused) or RelayUnreachable."""
        deadline = time.monotonic() + timeout
        delay = 0.2
        told = False
        while True:
            try:
                ctl = await self._register_any()
                break
            except (OSError, ConnectionError) as exc:
                if time.monotonic() + delay > deadline:
                    raise RelayUnreachable(f"relay {','.join(self.relays)} unreachable for {timeout:.0f}s: "
                                           f"{exc}") from exc
                if not told:  # once, at once: the operator sees why nothing happens
                    log.warning("relay %s: cannot register (%s); retrying for up to %.0fs (is `shoal relay` "
                                "running there, and is its port open?)", ",".join(self.relays), exc, timeout)
                    told = True
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 2)
        log.info("registered at relay %s: reachable as %s", self.relay, self.address)
        self._task = asyncio.create_task(self._serve(ctl))
        return self.address

    async def _register_any(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Register at the current relay, else at the next ones in turn; raises the last error
        (RelayRefused when one refused, else the connection error)."""
        order = self.relays[self.relays.index(self.relay):] + self.relays[:self.relays.index(self.relay)]
        last: Exception | None = None
        refused: RelayRefused | None = None
        for relay in order:
            try:
                return await self._register(relay)
            except RelayRefused as exc:
                refused = exc
            except (OSError, ConnectionError) as exc:
                last = exc
        raise refused if refused is not None and last is None else last  # type: ignore[misc]

    async def _register(self, relay: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        host, port = _split(relay)
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_TIMEOUT)
        try:
            writer.write(register_line(self.key, relay, self._ports.get(relay, 0), self.ticket))
            await writer.drain()
            words = await asyncio.wait_for(_read_line(reader), CONNECT_TIMEOUT)
        except BaseException:
            writer.close()
            raise
        if words[:1] == ["ERR"]:
            writer.close()
            raise RelayRefused(f"relay {relay} refused the registration: {' '.join(words[1:])}")
        if len(words) not in (3, 4) or words[0] != "OK" or ":" not in words[1]:
            writer.close()
            raise RelayRefused(f"relay {relay}: unexpected answer {' '.join(words)[:80]!r}")
        if self.address and (words[1] != self.address or relay != self.relay):
            log.warning("relay %s now gives the relayed address %s (was %s at %s): advertising it", relay, words[1],
                        self.address, self.relay)
        self.relay, self.address, self.token = relay, words[1], words[2]
        self._ports[relay] = _split(words[1])[1]
        self.capacity = _rate(words[3]) if len(words) == 4 else 0.0
        self.registrations += 1
        return reader, writer

    async def _serve(self, ctl: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> None:
        """Answer OPEN requests; register again (this relay first, then the others) whenever the
        control connection breaks, and tell the peer when its address moved."""
        try:
            while True:
                try:
                    await self._control(*ctl)
                except (OSError, ConnectionError, RelayRefused, asyncio.IncompleteReadError) as exc:
                    log.warning("relay %s: control connection lost (%s); registering again", self.relay, exc)
                ctl[1].close()
                before = (self.relay, self.address)
                ctl, refreshed = await self._again()
                log.info("registered at relay %s again: %s", self.relay, self.address)
                if self.on_registered is not None:
                    # A task of its own: the Join it makes is dialled back through this relay, and
                    # the OPEN of that dial comes on the control connection this task serves.
                    t = asyncio.create_task(self._registered((self.relay, self.address) != before or refreshed))
                    self._tunnels.add(t)
                    t.add_done_callback(self._tunnels.discard)
        finally:
            ctl[1].close()

    async def _registered(self, moved: bool) -> None:
        try:
            await self.on_registered(moved)
        except Exception as exc:  # noqa: BLE001 - logged; the next lease loss joins again anyway
            log.warning("relay %s: advertising the relayed address %s failed: %s", self.relay, self.address, exc)

    async def _again(self) -> tuple[tuple[asyncio.StreamReader, asyncio.StreamWriter], bool]:
        """Register again, for ever, with backoff (0.2 s doubling to 2 s between rounds over the
        relays); a refused ticket asks the peer for a fresh one first. Returns the control
        connection and whether a fresh ticket was asked for."""
        delay = 0.2
        refreshed = False
        while True:
            try:
                return await self._register_any(), refreshed
            except RelayRefused as exc:
                log.warning("%s", exc)
                if TICKET_REFUSED in str(exc) and self.on_ticket is not None:
                    try:
                        await self.on_ticket()
                        refreshed = True
                    except Exception as err:  # noqa: BLE001 - retried with the backoff
                        log.warning("relay %s: no fresh relay ticket: %s", self.relay, err)
            except (OSError, ConnectionError) as exc:
                log.debug("relay %s: registration failed (%s)", ",".join(self.relays), exc)
            await asyncio.sleep(delay)
            delay = min(2.0, delay * 2)

    async def _control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async def ping() -> None:
            while True:
                await asyncio.sleep(PING_SECONDS)
                writer.write(b"PING\n")
                await writer.drain()

        pinger = asyncio.create_task(ping())
        try:
            while True:
                # The relay answers every PING: silence for three of them is a dead path.
                words = await asyncio.wait_for(_read_line(reader), 3 * PING_SECONDS)
                if len(words) == 2 and words[0] == "OPEN":
                    t = asyncio.create_task(self._tunnel(words[1]))
                    self._tunnels.add(t)
                    t.add_done_callback(self._tunnels.discard)
        except TimeoutError:
            raise ConnectionError(f"no word from the relay for {3 * PING_SECONDS:.0f}s") from None
        finally:
            pinger.cancel()

    async def _tunnel(self, conn_id: str) -> None:
        """One dial of the relayed address: a fresh connection to the relay, piped into the
        local data-plane listener."""
        host, port = _split(self.relay)
        token = self.token
        lhost, lport = _split(self.local)
        try:
            out = await asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_TIMEOUT)
        except (OSError, TimeoutError) as exc:
            log.debug("relay %s: tunnel %s not opened (%s)", self.relay, conn_id, exc)
            return
        try:
            out[1].write(f"{MAGIC} ACCEPT {conn_id} {token}\n".encode())
            await out[1].drain()
            local = await asyncio.wait_for(asyncio.open_connection(lhost, lport), CONNECT_TIMEOUT)
        except (OSError, TimeoutError) as exc:
            out[1].close()
            log.debug("relay %s: tunnel %s not opened (%s)", self.relay, conn_id, exc)
            return
        self.tunnels += 1
        into, out_of = await splice(out, local)
        self.bytes_in += into
        self.bytes_out += out_of

    async def close(self) -> None:
        """Stop serving: the control connection and every tunnel close."""
        tasks = [t for t in (self._task, *self._tunnels) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t


def check_ack(relay: str, peer_id: str, acknowledged: int, written: int) -> None:
    """Raise CollectiveError naming `relay` when the receiver took fewer chunks than were
    written: a changed gRPC length prefix can make the receiver's gRPC end the call cleanly
    without the last message, nobody sees an error, and the receiver would wait out the chunk
    deadline and blame this (healthy) sender."""
    if acknowledged != written:
        raise CollectiveError(f"relay {relay} lost chunks to {peer_id[:8]}: it took "
                              f"{acknowledged} of the {written} written: {RELAY_ALTERED}", relay=relay)


def altered(relay: str, peer_id: str, details: str) -> CollectiveError | None:
    """The error of a stream through `relay` that the receiver refused because a check failed
    in transit (`RELAY_ALTERED` in its status details); None for any other refusal."""
    if relay and RELAY_ALTERED in details:
        return CollectiveError(f"relay {relay} altered a chunk to {peer_id[:8]}: {details}", relay=relay)
    return None


def down(relay: str, peer_id: str, code: str, details: str) -> CollectiveError | None:
    """The error of a stream through `relay` whose connection the relay's host refused (status
    `code` UNAVAILABLE, "Connection refused" in `details`): nothing listens on the relayed port, so
    the relay is down (a relay whose peer is gone accepts the dial and closes it later); None for
    any other failure."""
    if relay and code == "UNAVAILABLE" and "connection refused" in details.lower():
        return CollectiveError(f"relay {relay} is down: the stream to {peer_id[:8]} through it was refused "
                               f"({details[:160]})", relay=relay)
    return None


def stalled(relay: str, sender: str, timeout: float, where: str) -> CollectiveError:
    """A chunk from `sender` that did not come within `timeout` s although its stream through
    `relay` is open: a relay that changed a gRPC length prefix leaves the message waiting for
    bytes that never come, with no error at either end."""
    return CollectiveError(f"relay {relay}: no chunk from {sender[:8]} within {timeout:.1f}s {where} although its "
                           f"stream through the relay is open: stalled in transit", relay=relay)
