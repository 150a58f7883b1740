"""A NATed peer's link to a relay (`shoal peer --relay HOST:PORT`; docs/nat.md, "Relays").

Nobody can dial a peer behind NAT, but it can dial out. `RelayLink` keeps one outbound control
connection to the relay, registered under the peer's identity (shoal.common.relaying: the
registration is signed with its Ed25519 key), and gets a relayed address on the relay in return,
which the peer advertises. Whenever someone dials that address the relay says OPEN on the control
connection; the link then opens a fresh outbound connection to the relay (ACCEPT) and pipes it,
byte for byte, into the peer's own data-plane listener: a reverse tunnel. The gRPC server, its
tickets, signatures and TLS (end to end: the relay only sees TLS records) are unchanged.

Failure semantics: `start` raises `RelayRefused` (the relay said no, e.g. a bad signature) or
`RelayUnreachable` (an OSError: no relay there) after trying for `timeout` seconds. Afterwards a broken control
connection (the relay restarted, the NAT mapping changed) is dialled again with backoff, for
ever, until `close`; the relay keeps the same relayed address for the same peer id while it runs
(a relay that restarted hands out a new one, logged as a warning: the peer must rejoin to
advertise it). A tunnel whose either end breaks closes both ends (the gRPC client sees the
connection drop and the round's usual failure handling applies).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.common.relaying import MAGIC, MAX_LINE, PING_SECONDS, RelayRefused, RelayUnreachable, register_line

log = logging.getLogger("shoal.peer.relay")

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
    """The peer's registration at `relay` (HOST:PORT) under `key`; tunnels into `local`
    (HOST:PORT of its own data-plane listener). `address` is the relayed address once started."""

    def __init__(self, relay: str, key: Ed25519PrivateKey, local: str):
        self.relay, self.key, self.local = relay, key, local_target(local)
        self.address = ""
        self.token = ""
        self.capacity = 0.0  # the relay's declared capacity, bytes/s each way (0: not declared), from registering
        self.tunnels = 0  # tunnels opened so far
        self.bytes_in = self.bytes_out = 0  # through the tunnels: into / out of this peer
        self._task: asyncio.Task | None = None
        self._tunnels: set[asyncio.Task] = set()

    async def start(self, timeout: float = 30.0) -> str:
        """Register (retrying connection errors up to `timeout` s) and serve OPEN requests in
        the background; returns the relayed address. Raises RelayRefused or RelayUnreachable."""
        deadline = time.monotonic() + timeout
        delay = 0.2
        told = False
        while True:
            try:
                ctl = await self._register()
                break
            except (OSError, ConnectionError) as exc:
                if time.monotonic() + delay > deadline:
                    raise RelayUnreachable(f"relay {self.relay} unreachable for {timeout:.0f}s: {exc}") from exc
                if not told:  # once, at once: the operator sees why nothing happens
                    log.warning("relay %s: cannot register (%s); retrying for up to %.0fs (is `shoal relay` "
                                "running there, and is its port open?)", self.relay, exc, timeout)
                    told = True
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 2)
        log.info("registered at relay %s: reachable as %s", self.relay, self.address)
        self._task = asyncio.create_task(self._serve(ctl))
        return self.address

    async def _register(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        host, port = _split(self.relay)
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_TIMEOUT)
        try:
            writer.write(register_line(self.key))
            await writer.drain()
            words = await asyncio.wait_for(_read_line(reader), CONNECT_TIMEOUT)
        except BaseException:
            writer.close()
            raise
        if words[:1] == ["ERR"]:
            writer.close()
            raise RelayRefused(f"relay {self.relay} refused the registration: {' '.join(words[1:])}")
        if len(words) not in (3, 4) or words[0] != "OK":
            writer.close()
            raise RelayRefused(f"relay {self.relay}: unexpected answer {' '.join(words)[:80]!r}")
        if self.address and words[1] != self.address:
            log.warning("relay %s now gives the relayed address %s (was %s): the peer must rejoin to advertise it",
                        self.relay, words[1], self.address)
        self.address, self.token = words[1], words[2]
        self.capacity = _rate(words[3]) if len(words) == 4 else 0.0
        return reader, writer

    async def _serve(self, ctl: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> None:
        """Answer OPEN requests; dial the relay again whenever the control connection breaks."""
        delay = 0.2
        while True:
            try:
                await self._control(*ctl)
            except (OSError, ConnectionError, RelayRefused, asyncio.IncompleteReadError) as exc:
                log.warning("relay %s: control connection lost (%s); registering again", self.relay, exc)
            ctl[1].close()
            while True:
                await asyncio.sleep(delay)
                try:
                    ctl = await self._register()
                    delay = 0.2
                    log.info("registered at relay %s again: %s", self.relay, self.address)
                    break
                except (OSError, ConnectionError, RelayRefused) as exc:
                    delay = min(5.0, delay * 2)
                    log.debug("relay %s: registration failed (%s)", self.relay, exc)

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
        lhost, lport = _split(self.local)
        try:
            out = await asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_TIMEOUT)
        except (OSError, TimeoutError) as exc:
            log.debug("relay %s: tunnel %s not opened (%s)", self.relay, conn_id, exc)
            return
        try:
            out[1].write(f"{MAGIC} ACCEPT {conn_id} {self.token}\n".encode())
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
