"""`shoal relay`: a TCP relay for peers nobody can dial (docs/nat.md, "Relays").

An operator runs it on a public host. A NATed peer started with `--relay HOST:PORT` registers
over an outbound control connection (signed with its identity key, shoal.relay.protocol) and
gets a relayed address: a port of its own on this relay (`--advertise` host). A connection to
that port is spliced, byte for byte, with a fresh connection the peer opens to the relay when
asked (OPEN / ACCEPT): a TURN-like reverse tunnel. The relay parses nothing past the header
lines: with TLS on it forwards TLS records between the two peers (peer-id-bound certificates, end
to end) and reads nothing; with TLS off every chunk to a relayed participant is signed by its
sender, so a change is detected (the round aborts, the relay is blamed).

What it counts: `relayed_bytes` (every byte it forwarded, both directions; the Prometheus counter
`shoal_relay_relayed_bytes_total` and the JSON stats file `--stats`, rewritten every second and at
exit), connections and registrations.

Admission and limits (`Limits`): started with the coordinator's public key (`--coordinator-key`)
the relay admits only keys holding an unexpired relay ticket of that coordinator (issued at
Join to admitted members); without one it is open to any key (logged as a warning at start).
Each client address may hold `per_client_connections` connections to the relay's own port and, at an open relay,
`per_client_peers` registrations; each registered peer `per_peer_connections` spliced
connections to its relayed port, of which `per_dialler_connections` from one dialling address
(so that one client filling a peer's port leaves room for the others). A registration whose
control connection stayed closed for `idle_seconds` is forgotten (its port closed).

Failure semantics: a dial of a relayed port while its peer has no control connection waits
`REGISTER_WAIT` seconds for it to register again (a NAT rebind), then is closed; a peer that does
not answer an OPEN within `ACCEPT_WAIT` seconds gets the dial closed. Registrations are refused
(`ERR`) for a bad signature, a stale timestamp, a replayed nonce, another relay's name, a missing,
expired or foreign ticket, or a limit. A peer keeps its relayed port while the relay runs, and a
restarted relay binds a returning peer's previous port again when it is free (the peer says which
in its REGISTER line), so its relayed address survives the restart.

Test-only hooks (environment): ``SHOAL_FAULT_RELAY=flip@K`` flips one bit in the middle of the
K-th (0-based) large gRPC message that fills one HTTP/2 DATA frame (>= `FLIP_MIN_FRAME` bytes:
inside a tensor chunk's values, not in framing, where a flip would merely break the stream) and is
not its call's first message (a PushChunks chunk after the first: `_H2Frames`) forwarded towards a
registered peer, once (``prefix@K``: a bit of that message's gRPC length prefix instead, so
that the receiver's gRPC waits for bytes that never come or ends the call without the message), reading plaintext h2 frames (with TLS on there are
none to find); ``SHOAL_FAULT_RELAY_RECORD=PATH`` appends the
first 64 MiB it forwards (both directions) to PATH.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import pathlib
import secrets
import time
from dataclasses import dataclass, field

from shoal.common.metrics import RelayMetrics
from shoal.relay.protocol import MAGIC, MAX_LINE, REGISTER_SKEW_SECONDS, check_register, check_relay_ticket

log = logging.getLogger("shoal.relay.server")

REGISTER_WAIT = 5.0  # a dial waits this long for its peer's control connection
ACCEPT_WAIT = 10.0  # and this long for the peer's ACCEPT
HEADER_WAIT = 10.0  # a new connection must send its header line within this
PIPE_BYTES = 1 << 16
RECORD_LIMIT = 64 << 20
FLIP_MIN_FRAME = 4096


@dataclass(frozen=True)
class Limits:
    """What one client and one registered peer may hold at the relay (module docstring)."""

    max_peers: int = 4096  # registered peer ids (one port each); more are refused
    per_client_peers: int = 16  # registrations from one client address, at an open relay (no coordinator key)
    per_client_connections: int = 256  # open connections to the relay's own port from one client address
    per_peer_connections: int = 128  # spliced connections to one peer's relayed port
    per_dialler_connections: int = 32  # of those, from one dialling address
    idle_seconds: float = 120.0  # a registration without a control connection this long is forgotten


@dataclass
class _Registration:
    peer_id: str
    address: str
    server: asyncio.base_events.Server
    token: str = ""
    control: asyncio.StreamWriter | None = None
    registered: asyncio.Event = field(default_factory=asyncio.Event)
    relayed_bytes: int = 0
    client: str = ""  # the address its control connection comes from (`Limits.per_client_peers`)
    idle_since: float = 0.0  # monotonic time its control connection closed (0: open)
    ticket_expires: float = 0.0  # unix s (0: no ticket needed)
    diallers: dict[str, int] = field(default_factory=dict)  # dialling address -> open connections
    # Both ends of every splice opened under the current registration: a new registration (the
    # peer's NAT mapping changed) closes them, so the diallers see their connection drop at once
    # instead of writing into a tunnel whose far end is gone until a keepalive notices.
    splices: set[asyncio.StreamWriter] = field(default_factory=set)


@dataclass
class _GrpcFraming:
    """Where one HTTP/2 stream's gRPC message framing stands (`_H2Frames`)."""

    messages: int = 0  # messages begun
    prefix_left: int = 5  # bytes of the current 5-byte prefix still to read (0: in a message)
    message_left: int = 0  # bytes of the current message still to read
    prefix: int = 0  # the prefix read so far, as a big-endian integer

    @property
    def at_boundary(self) -> bool:
        return self.prefix_left == 5 and self.message_left == 0


class _H2Frames:
    """Follows the HTTP/2 frames of one plaintext client-to-server byte stream (preface, then
    9-byte headers) and the gRPC messages (5-byte prefix, then the message) in each HTTP/2
    stream's DATA, to find a byte inside a tensor chunk for the flip hook: the middle of a DATA
    frame that holds exactly one whole gRPC message of at least `FLIP_MIN_FRAME` bytes (a Chunk is
    mostly its `data` field; a flip in framing or a length prefix would only break the stream)
    that is not its call's first message. Only later chunks are candidates: a call's first
    message is the one its stream signature and ticket cover, and streams of other kinds
    (Exchange, FetchState, Probe...) carry one small request or none past the first, so the
    flip lands in a PushChunks chunk after the first, every run alike."""

    def __init__(self) -> None:
        self.preface = 24  # "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
        self.header = b""
        self.length = self.pos = 0  # the current frame's payload length, and how much of it passed
        self.stream: _GrpcFraming | None = None  # the current DATA frame's stream: `streams` entry
        self.whole = False  # the current DATA frame starts at a message boundary and is large
        self.target = -1  # payload offset of the byte to flip (-1: none)
        self.streams: dict[int, _GrpcFraming] = {}  # HTTP/2 stream id -> its gRPC message framing
        self.broken: set[int] = set()  # streams whose framing this parser cannot follow (padding)

    def flip(self, data: bytes, hooks: "_Hooks") -> bytes:
        buf = bytearray(data)
        i = 0
        while i < len(buf):
            if self.preface:
                step = min(self.preface, len(buf) - i)
                self.preface -= step
            elif self.pos >= self.length:
                step = min(9 - len(self.header), len(buf) - i)
                self.header += bytes(buf[i:i + step])
                if len(self.header) == 9:
                    self._frame(self.header)
                    self.header = b""
            else:
                step = min(self.length - self.pos, len(buf) - i)
                if self.stream is not None:
                    self._messages(buf, i, step, hooks)
                if self.pos <= self.target < self.pos + step:
                    buf[i + self.target - self.pos] ^= 0x01
                    log.warning("fault injection: flipped a bit in a relayed DATA frame")
                    self.target = -1
                self.pos += step
            i += step
        return bytes(buf)

    def _frame(self, header: bytes) -> None:
        self.length, kind, flags = int.from_bytes(header[:3], "big"), header[3], header[4]
        sid = int.from_bytes(header[5:9], "big") & 0x7FFFFFFF
        self.pos, self.target, self.stream, self.whole = 0, -1, None, False
        if kind != 0 or sid in self.broken:
            return
        if flags & 0x08:  # PADDED: gRPC does not pad; give up on this stream rather than misparse
            self.broken.add(sid)
            self.streams.pop(sid, None)
            return
        self.stream = self.streams.setdefault(sid, _GrpcFraming())
        self.whole = self.stream.at_boundary and self.length >= FLIP_MIN_FRAME

    def _messages(self, buf: bytearray, i: int, step: int, hooks: "_Hooks") -> None:
        """Advance the current stream's message framing over `buf[i:i + step]`."""
        st = self.stream
        assert st is not None
        end = i + step
        while i < end:
            if st.prefix_left:
                take = min(st.prefix_left, end - i)
                for b in buf[i:i + take]:
                    st.prefix = (st.prefix << 8) | b
                st.prefix_left -= take
                i += take
                if st.prefix_left == 0:
                    st.messages += 1
                    st.message_left = st.prefix & 0xFFFFFFFF  # the length; the top byte was the compressed flag
                    compressed = st.prefix >> 32
                    if self.whole and self.pos + (i - (end - step)) == 5 and compressed == 0 \
                            and st.message_left == self.length - 5 and st.messages > 1 and hooks.large_frame():
                        self.target = 2 if hooks.prefix else self.length // 2
                    st.prefix = 0
                    if st.message_left == 0:
                        st.prefix_left = 5
            else:
                take = min(st.message_left, end - i)
                st.message_left -= take
                i += take
                if st.message_left == 0:
                    st.prefix_left = 5


class _Hooks:
    """The test-only fault and record hooks (module docstring)."""

    def __init__(self, fault: str = "", record: str = ""):
        self.flip_at = int(fault.split("@", 1)[1]) if fault.startswith(("flip@", "prefix@")) else -1
        self.prefix = fault.startswith("prefix@")  # flip the length prefix (+/- 64 KiB), not a value
        self.large_frames = 0  # large DATA frames seen towards registered peers so far
        self.record = open(record, "ab") if record else None
        self.recorded = 0

    def large_frame(self) -> bool:
        """Count a large DATA frame; True for the one to flip."""
        self.large_frames += 1
        return self.large_frames - 1 == self.flip_at

    def forward(self, data: bytes, frames: _H2Frames | None) -> bytes:
        if frames is not None and self.flip_at >= 0 and self.large_frames <= self.flip_at + 1:
            data = frames.flip(data, self)
        if self.record is not None and self.recorded < RECORD_LIMIT:
            self.record.write(data)
            self.recorded += len(data)
        return data

    def close(self) -> None:
        if self.record is not None:
            self.record.close()


class Relay:
    """The relay on `listen` (HOST:PORT, port 0 = any); relayed ports are bound on the same host
    and advertised under `advertise` (a host name or IP; default the listen host)."""

    def __init__(self, listen: str, advertise: str = "", *, stats_path: str | None = None,
                 metrics: RelayMetrics | None = None, capacity_bytes_per_s: float = 0.0,
                 coordinator_keys: tuple[bytes, ...] = (), limits: Limits = Limits()):
        self.capacity_bytes_per_s = capacity_bytes_per_s  # declared by the operator; 0 = not said
        self.coordinator_keys = coordinator_keys  # raw Ed25519 keys whose relay tickets admit (): open
        self.limits = limits
        self.clients: dict[str, int] = {}  # client address -> open connections to the front port
        self.host, port = listen.rsplit(":", 1)
        self.port = int(port)
        self.advertise = advertise or self.host
        self.stats_path = stats_path
        self.metrics = metrics or RelayMetrics()
        self.hooks = _Hooks(os.environ.get("SHOAL_FAULT_RELAY", ""), os.environ.get("SHOAL_FAULT_RELAY_RECORD", ""))
        self.peers: dict[str, _Registration] = {}
        self.pending: dict[str, tuple[str, asyncio.Future]] = {}  # conn id -> (peer id, future of the peer's side)
        self.nonces: dict[bytes, float] = {}
        self.relayed_bytes = 0
        self.towards_peers = 0  # of relayed_bytes: from the diallers to the registered peers
        self.connections = 0
        self.refused = 0
        self.dials_refused = 0  # dials of a relayed port over a limit
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    @property
    def address(self) -> str:
        return f"{self.advertise}:{self.port}"

    async def start(self) -> str:
        """Bind the front port; returns the relay's advertised HOST:PORT. Raises OSError."""
        self._server = await asyncio.start_server(self._front, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("relay listening on %s:%d (advertised as %s; declared capacity %s)", self.host, self.port,
                 self.address, f"{self.capacity_bytes_per_s * 8 / 1e6:g} Mbit/s each way"
                 if self.capacity_bytes_per_s else "none")
        if not self.coordinator_keys:
            log.warning("open relay: any key may register (pass --coordinator-key to admit only the coordinator's "
                        "members)")
        return self.address

    @property
    def names(self) -> frozenset[str]:
        """The addresses a registration may name this relay by (its advertised and listen HOST:PORT)."""
        return frozenset({self.address, f"{self.host}:{self.port}"})

    def stats(self) -> dict:
        """What the swarm and operators read: relayed_bytes (both directions), per peer too."""
        return {"address": self.address, "capacity_bytes_per_s": self.capacity_bytes_per_s,
                "relayed_bytes": self.relayed_bytes,
                "relayed_bytes_to_peers": self.towards_peers, "connections": self.connections,
                "registrations_refused": self.refused, "dials_refused": self.dials_refused,
                "peers": {p: {"address": r.address, "relayed_bytes": r.relayed_bytes,
                              "registered": r.control is not None} for p, r in self.peers.items()}}

    def write_stats(self) -> None:
        if self.stats_path:
            tmp = pathlib.Path(self.stats_path + ".tmp")
            tmp.write_text(json.dumps(self.stats(), indent=1))
            tmp.replace(self.stats_path)

    async def serve_forever(self, stop: asyncio.Event) -> None:
        """Write the stats every second until `stop` is set; then close everything."""
        try:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 1.0)
                self.expire(time.monotonic())
                self.write_stats()
        finally:
            await self.close()
            self.write_stats()

    async def close(self) -> None:
        for s in [self._server, *(r.server for r in self.peers.values())]:
            if s is not None:
                s.close()
        for r in self.peers.values():
            if r.control is not None:
                r.control.close()
        for t in list(self._tasks):
            t.cancel()
        self.hooks.close()

    def expire(self, now: float) -> list[str]:
        """Forget the registrations whose control connection stayed closed `idle_seconds` up to
        `now` (monotonic); returns their peer ids. (A ticket admits a registration; the open
        control connection keeps it.)"""
        gone = [p for p, r in self.peers.items()
                if r.control is None and r.idle_since and now - r.idle_since >= self.limits.idle_seconds]
        for p in gone:
            r = self.peers.pop(p)
            r.server.close()
            for w in r.splices:
                w.close()
            log.info("peer %s: registration forgotten (no control connection for %.0fs)", p[:8],
                     self.limits.idle_seconds)
        return gone

    def _spawn(self, coro) -> None:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------ connections

    async def _front(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A connection to the relay's own port: a REGISTER (control) or an ACCEPT (tunnel)."""
        client = _host_of(writer)
        if self.clients.get(client, 0) >= self.limits.per_client_connections:
            self.refused += 1
            writer.close()
            return
        self.clients[client] = self.clients.get(client, 0) + 1
        try:
            try:
                line = await asyncio.wait_for(reader.readline(), HEADER_WAIT)
            except (TimeoutError, OSError, ValueError):
                writer.close()
                return
            words = line.decode("ascii", "replace").split()
            if len(line) > MAX_LINE or " ".join(words[:2]) != MAGIC:
                writer.close()
                return
            if words[2:3] == ["REGISTER"]:
                await self._register(words[2:], client, reader, writer)
                return
            if words[2:3] == ["ACCEPT"] and len(words) == 5 and self._accept(words[3], words[4], reader, writer):
                # An accepted tunnel counts against its registration's limits, not its client's.
                return
            writer.close()
        finally:
            _release(self.clients, client)

    async def _refuse(self, writer: asyncio.StreamWriter, why: str) -> None:
        self.refused += 1
        log.warning("registration refused from %s: %s", writer.get_extra_info("peername"), why)
        writer.write(f"ERR {why}\n".encode())
        with contextlib.suppress(OSError):
            await writer.drain()
        writer.close()

    async def _bind(self, peer_id: str, port: int) -> asyncio.base_events.Server:
        """A relayed port for `peer_id`: `port` again when given and free, else any."""
        taken = {int(r.address.rsplit(":", 1)[1]) for r in self.peers.values()}
        if port and port not in taken and port != self.port:
            with contextlib.suppress(OSError):
                return await asyncio.start_server(lambda r, w: self._dial(peer_id, r, w), self.host, port)
        return await asyncio.start_server(lambda r, w: self._dial(peer_id, r, w), self.host, 0)

    async def _register(self, words: list[str], client: str, reader: asyncio.StreamReader,
                        writer: asyncio.StreamWriter) -> None:
        now = time.time()
        if len(self.nonces) > 4 * self.limits.max_peers:  # prune only when it grows: O(1) per registration
            self.nonces = {n: t for n, t in self.nonces.items() if t > now - 2 * REGISTER_SKEW_SECONDS}
        try:
            got = check_register(words, self.names, now)
            if got.nonce in self.nonces:
                raise ValueError("nonce already used")
            expires = check_relay_ticket(got.ticket, self.coordinator_keys, got.public_key, now) \
                if self.coordinator_keys else 0.0
        except ValueError as exc:
            await self._refuse(writer, str(exc))
            return
        self.nonces[got.nonce] = now
        peer_id = got.peer_id
        reg = self.peers.get(peer_id)
        if reg is None and len(self.peers) >= self.limits.max_peers:
            self.expire(time.monotonic())
        if reg is None and len(self.peers) >= self.limits.max_peers:
            await self._refuse(writer, f"relay full: {self.limits.max_peers} peers registered")
            return
        if reg is None and not self.coordinator_keys \
                and sum(r.client == client for r in self.peers.values()) >= self.limits.per_client_peers:
            await self._refuse(writer, f"{client} holds {self.limits.per_client_peers} registrations already")
            return
        if reg is None:
            try:
                server = await self._bind(peer_id, got.port)
            except OSError as exc:
                await self._refuse(writer, f"no port for the peer: {exc}")
                return
            reg = _Registration(peer_id, f"{self.advertise}:{server.sockets[0].getsockname()[1]}", server)
            self.peers[peer_id] = reg
        else:
            if reg.control is not None:
                reg.control.close()  # the newer registration wins (a NAT rebind, a restart)
            for w in reg.splices:  # tunnels through the old path: dead, or about to be
                w.close()
            reg.splices = set()
        reg.token, reg.control = secrets.token_hex(16), writer
        reg.client, reg.idle_since, reg.ticket_expires = client, 0.0, expires
        reg.registered.set()
        self.metrics.observe_registered(sum(1 for r in self.peers.values() if r.control is not None))
        log.info("peer %s registered from %s: relayed as %s", peer_id[:8], writer.get_extra_info("peername"),
                 reg.address)
        # The 4th word, the declared capacity (bytes/s each way), goes into the peer's Join: the
        # planner counts the relay as a link its relayed participants share.
        writer.write(f"OK {reg.address} {reg.token} {self.capacity_bytes_per_s:.0f}\n".encode())
        try:
            await writer.drain()
            while line := await reader.readline():  # PINGs, answered: the peer's liveness check
                if line.strip() == b"PING":
                    writer.write(b"PONG\n")
                    await writer.drain()
        except OSError:
            pass
        finally:
            if reg.control is writer:
                reg.control = None
                reg.idle_since = time.monotonic()
                reg.registered.clear()
                log.info("peer %s: control connection closed", peer_id[:8])
            self.metrics.observe_registered(sum(1 for r in self.peers.values() if r.control is not None))
            writer.close()

    def _accept(self, conn_id: str, token: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Hand an ACCEPT connection to the dial waiting for it; False (the caller closes it) for an
        unknown conn id or a wrong token."""
        entry = self.pending.get(conn_id)
        reg = self.peers.get(entry[0]) if entry is not None else None
        if entry is None or reg is None or not secrets.compare_digest(token, reg.token) or entry[1].done():
            return False
        entry[1].set_result((reader, writer))
        return True

    async def _dial(self, peer_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Someone dialled `peer_id`'s relayed port: ask the peer for a tunnel, splice the two
        (within the peer's connection limits: over one, the dial is closed at once)."""
        reg = self.peers.get(peer_id)
        dialler = _host_of(writer)
        if reg is None or sum(reg.diallers.values()) >= self.limits.per_peer_connections \
                or reg.diallers.get(dialler, 0) >= self.limits.per_dialler_connections:
            self.dials_refused += 1
            writer.close()
            return
        reg.diallers[dialler] = reg.diallers.get(dialler, 0) + 1
        try:
            await self._spliced(reg, reader, writer)
        finally:
            _release(reg.diallers, dialler)

    async def _spliced(self, reg: _Registration, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer_id = reg.peer_id
        conn_id = secrets.token_hex(12)
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self.pending[conn_id] = (peer_id, fut)
        try:
            await asyncio.wait_for(reg.registered.wait(), REGISTER_WAIT)
            assert reg.control is not None
            reg.control.write(f"OPEN {conn_id}\n".encode())
            peer_side = await asyncio.wait_for(fut, ACCEPT_WAIT)
        except (TimeoutError, OSError, AssertionError):
            log.info("dial of %s (%s) closed: the peer opened no tunnel in time", reg.address, peer_id[:8])
            writer.close()
            return
        finally:
            self.pending.pop(conn_id, None)
        self.connections += 1
        self.metrics.on_connection()
        ends = reg.splices
        ends.update((writer, peer_side[1]))
        try:
            await asyncio.gather(self._pipe(reader, peer_side[1], reg, True),
                                 self._pipe(peer_side[0], writer, reg, False))
        finally:
            writer.close()
            peer_side[1].close()
            ends.discard(writer)
            ends.discard(peer_side[1])

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, reg: _Registration,
                    towards_peer: bool) -> None:
        frames = _H2Frames() if towards_peer else None
        try:
            while data := await reader.read(PIPE_BYTES):
                data = self.hooks.forward(data, frames)
                writer.write(data)
                n = len(data)
                self.relayed_bytes += n
                reg.relayed_bytes += n
                if towards_peer:
                    self.towards_peers += n
                self.metrics.on_relayed(n)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()
        except (ConnectionError, OSError, RuntimeError):  # RuntimeError: uvloop's write on a closed transport
            writer.close()


def _host_of(writer: asyncio.StreamWriter) -> str:
    """The remote host of a connection ("" when the socket has none)."""
    peer = writer.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else ""


async def run_relay(listen: str, advertise: str = "", *, stats_path: str | None = None, ready_file: str | None = None,
                    metrics_port: int = 0, metrics_host: str = "0.0.0.0", stop: asyncio.Event | None = None,
                    capacity_bytes_per_s: float = 0.0, coordinator_keys: tuple[bytes, ...] = (),
                    limits: Limits = Limits()) -> dict:
    """Run a relay until `stop` is set (SIGTERM/SIGINT in the CLI); returns its final stats.
    capacity_bytes_per_s: what the operator declares the relay's link carries each way (0 = not
    said), told to every peer at registration. coordinator_keys: raw Ed25519 public keys whose
    relay tickets admit a registration (empty: an open relay). limits: `Limits`."""
    metrics = RelayMetrics()
    metrics.serve(metrics_port, metrics_host)
    relay = Relay(listen, advertise, stats_path=stats_path, metrics=metrics, capacity_bytes_per_s=capacity_bytes_per_s,
                  coordinator_keys=coordinator_keys, limits=limits)
    try:
        address = await relay.start()
        relay.write_stats()
        if ready_file:
            pathlib.Path(ready_file).write_text(address)
        await relay.serve_forever(stop or asyncio.Event())
    finally:
        metrics.close()
    log.info("relay stopped: %d bytes relayed over %d connections", relay.relayed_bytes, relay.connections)
    return relay.stats()


def _release(counts: dict[str, int], key: str) -> None:
    """One connection of `key` ended: its count drops by one, and the key goes at zero (the
    counts of connections per client and per dialler stay as small as the live connections)."""
    n = counts.get(key, 1) - 1
    if n:
        counts[key] = n
    else:
        counts.pop(key, None)
