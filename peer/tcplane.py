"""The bulk lane of the data plane: tensor chunks between hosts on a plain TCP connection.

gRPC in Python costs far more CPU per byte than the link on 1-10 Gbit/s networks (protobuf
copies, HTTP/2 framing, a thread hop per message). On this lane a chunk is a 16-byte frame header,
the chunk's protobuf header (`pb.Chunk` without `data`: ~60 bytes) and its raw bytes, written with
one `sock_sendall` and read with `sock_recv_into` straight into the array the inbox will hold.
gRPC stays the control lane and the fallback: a sender uses this lane only when the receiver
advertises its port (`ProbeResponse.bulk_port`) and the connection opens; otherwise, or with TLS
on (the listener is not started then), its stream goes on PushChunks.

Authorisation is PushChunks' (docs/security.md), by the same functions: a stream opens with a
HELLO frame carrying the signature metadata (`shoal.common.security` fields) over the first
chunk's header for the method `BULK_METHOD` (the first chunk carries the coordinator-signed
ticket), then that chunk; the receiver runs `PeerService._admit` (signature, nonce, ticket, the
plan this peer holds) before it reads a payload byte, bounds every payload by the plan's chunk
size, and runs every chunk through `PeerService._receive` (`Session.check_chunk`: sender, dtype,
shape, bounds, phase, step, codec) before a value reaches the inbox. The signature covers the
first chunk's header, not its payload; later chunks are bound to the stream by the connection,
exactly as later messages of a PushChunks stream are.

Frames (`HEADER`, little-endian): kind u8, 3 pad bytes, meta length u32, payload length u64.
HELLO: meta = JSON list of [key, value] signature pairs. CHUNK: meta = `pb.Chunk` header bytes,
payload = the chunk's bytes. END: the sender is done. ACK (receiver): meta = JSON {"chunks": n},
every chunk was delivered. ERROR (receiver): meta = JSON {"code": status name, "message": ...},
the stream was refused; the receiver then reads and drops until the sender closes. A connection
carries one stream at a time and is reused, per remote address, for the next ones.

Failure semantics. Sender: a refused stream raises `BulkRefused` (code, message), a broken or
closed connection `ConnectionError`/`OSError`; the connection is then never reused. Receiver: a
stream broken before END fails every wait on its sender (`Inbox.fail_sender`), as on gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import struct
import time
from collections.abc import Callable

import numpy as np

from shoal.common.errors import InvalidArgument, ShoalError
from shoal.v1 import shoal_pb2 as pb

log = logging.getLogger("shoal.peer.tcplane")

BULK_METHOD = "/shoal.v1.Peer/PushChunks#tcp"  # what the HELLO's signature is made for
HEADER = struct.Struct("<B3xIQ")
HELLO, CHUNK, END, ACK, ERROR = 1, 2, 3, 4, 5
MAX_META_BYTES = 64 << 10  # a chunk header, a ticket, signature metadata: far below
HELLO_SECONDS = 10.0  # a HELLO must be followed by its first chunk within this
IDLE_SECONDS = 300.0  # a connection (opened ahead of a round, or between streams) idle this long is closed
REUSE_SECONDS = IDLE_SECONDS / 2  # a sender reuses only connections idle less than this (never racing the close)
MAX_CONNECTIONS = 256  # accepted connections held at once; more are closed at once
CONNECT_SECONDS = 3.0
DOWN_SECONDS = 300.0  # after a failed connect, PushChunks to that address for this long


class BulkRefused(Exception):
    """The receiver refused the stream: `code` is the gRPC status name it would have answered."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code} {message}")
        self.code, self.message = code, message


# ------------------------------------------------------------------------------- frame codec


def encode_frame(kind: int, meta: bytes = b"", payload_len: int = 0) -> bytes:
    """The header and meta of one frame (the payload, if any, is written after them)."""
    return HEADER.pack(kind, len(meta), payload_len) + meta


def decode_header(raw: bytes | memoryview) -> tuple[int, int, int]:
    """(kind, meta length, payload length) of a frame header. Raises InvalidArgument for an
    unknown kind or a meta longer than MAX_META_BYTES."""
    kind, meta_len, payload_len = HEADER.unpack(raw)
    if kind not in (HELLO, CHUNK, END, ACK, ERROR):
        raise InvalidArgument(f"frame: unknown kind {kind}")
    if meta_len > MAX_META_BYTES:
        raise InvalidArgument(f"frame: {meta_len} bytes of header, at most {MAX_META_BYTES}")
    return kind, meta_len, payload_len


def chunk_frame(header: pb.Chunk, body) -> memoryview:
    """One CHUNK frame, the payload copied in once (so later writes to `body` never reach the
    wire): the only copy the sender makes (into uninitialised memory: no zeroing pass).
    `header` must not carry `data`."""
    view = memoryview(body).cast("B")
    meta = header.SerializeToString()
    out = memoryview(np.empty(HEADER.size + len(meta) + view.nbytes, dtype=np.uint8))
    HEADER.pack_into(out, 0, CHUNK, len(meta), view.nbytes)
    out[HEADER.size:HEADER.size + len(meta)] = meta
    out[HEADER.size + len(meta):] = view
    return out


def split_chunk_frame(frame) -> tuple[pb.Chunk, memoryview]:
    """Inverse of `chunk_frame` (tests, and re-signing the first chunk's header)."""
    kind, meta_len, payload_len = decode_header(memoryview(frame)[:HEADER.size])
    if kind != CHUNK or len(frame) != HEADER.size + meta_len + payload_len:
        raise InvalidArgument("frame: not one whole CHUNK frame")
    c = pb.Chunk.FromString(bytes(frame[HEADER.size:HEADER.size + meta_len]))
    return c, memoryview(frame)[HEADER.size + meta_len:]


def hello_frame(metadata) -> bytes:
    return encode_frame(HELLO, json.dumps([[k, v if isinstance(v, str) else v.decode()] for k, v in metadata]).encode())


def parse_hello(meta: bytes) -> tuple[tuple[str, str], ...]:
    """The signature metadata pairs of a HELLO. Raises InvalidArgument if malformed."""
    try:
        pairs = json.loads(meta)
        return tuple((str(k), str(v)) for k, v in pairs)
    except (ValueError, TypeError):
        raise InvalidArgument("frame: HELLO is not a list of [key, value] pairs") from None


def parse_chunk_header(meta: bytes) -> pb.Chunk:
    """A CHUNK frame's `pb.Chunk` header. Raises InvalidArgument if it does not decode or carries data."""
    try:
        c = pb.Chunk.FromString(meta)
    except Exception:  # protobuf's DecodeError
        raise InvalidArgument("frame: chunk header does not decode") from None
    if c.data or c.shm_name:
        raise InvalidArgument("frame: a bulk chunk's bytes follow its header (data and shm_name empty)")
    return c


# ------------------------------------------------------------------------------- socket I/O


async def recv_into(loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from `sock`. Raises ConnectionError when the peer closes first."""
    got, n = 0, view.nbytes
    while got < n:
        k = await loop.sock_recv_into(sock, view[got:])
        if k == 0:
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += k


async def read_frame_head(loop, sock) -> tuple[int, bytes, int]:
    """(kind, meta bytes, payload length) of the next frame; the payload is left to the caller."""
    raw = bytearray(HEADER.size)
    await recv_into(loop, sock, memoryview(raw))
    kind, meta_len, payload_len = decode_header(raw)
    meta = bytearray(meta_len)
    if meta_len:
        await recv_into(loop, sock, memoryview(meta))
    return kind, bytes(meta), payload_len


async def recv_payload(loop, sock, n: int) -> memoryview:
    """`n` payload bytes in a fresh buffer (uninitialised, then filled: no zeroing pass)."""
    buf = memoryview(np.empty(n, dtype=np.uint8))
    if n:
        await recv_into(loop, sock, buf)
    return buf


def _nonblocking(sock: socket.socket) -> socket.socket:
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


# ------------------------------------------------------------------------------- sender


class BulkConnection:
    """The sender's end of one connection; one stream at a time (`send_stream`)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self.broken = False
        self.idle_since = time.monotonic()

    @classmethod
    async def open(cls, host: str, port: int) -> BulkConnection:
        """Connect within CONNECT_SECONDS. Raises OSError/TimeoutError when it cannot."""
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, _, _, _, addr = infos[0]
        sock = _nonblocking(socket.socket(family, socket.SOCK_STREAM))
        try:
            async with asyncio.timeout(CONNECT_SECONDS):
                await loop.sock_connect(sock, addr)
        except BaseException:
            sock.close()
            raise
        return cls(sock)

    async def _reply(self) -> int:
        try:
            kind, meta, payload_len = await read_frame_head(self.loop, self.sock)
        except InvalidArgument as exc:
            raise ConnectionError(str(exc)) from None
        if payload_len:
            raise ConnectionError("frame: a reply carries no payload")
        try:
            body = json.loads(meta or b"{}")
            if kind == ERROR:
                raise BulkRefused(str(body["code"]), str(body.get("message", "")))
            if kind != ACK:
                raise ConnectionError(f"frame: kind {kind} where an ACK or ERROR was due")
            return int(body["chunks"])
        except (ValueError, TypeError, KeyError, AttributeError):
            raise ConnectionError("frame: reply does not decode") from None

    @staticmethod
    async def _next(frames, reply: asyncio.Future | None):
        """The next item of `frames`, or None as soon as the receiver answered (a refusal, or the
        connection broke) while the stream waits for more: a sender idle on a dead connection
        learns it now, not at its next chunk."""
        if reply is None:
            return await frames()
        nxt = asyncio.ensure_future(frames())
        if not nxt.done():
            await asyncio.wait((nxt, reply), return_when=asyncio.FIRST_COMPLETED)
        if nxt.done():
            return nxt.result()
        nxt.cancel()
        return None

    async def send_stream(self, frames, hello: Callable[[pb.Chunk], object]) -> int:
        """Write one stream: `frames` yields (header, frame) pairs as made by `chunk_frame` (or
        None to stop), the first header already holding the ticket; `hello(first header)` is
        its signature metadata. Returns the chunks the receiver acknowledged.

        Raises BulkRefused (the receiver's refusal, which it may send at any time),
        ConnectionError/OSError (broken). Either way this connection is broken for good."""
        reply: asyncio.Future | None = None
        try:
            while (item := await self._next(frames, reply)) is not None:
                header, frame = item
                if reply is None:
                    await self.loop.sock_sendall(self.sock, hello_frame(hello(header)))
                    reply = asyncio.ensure_future(self._reply())
                if reply.done():
                    break  # refused or broken mid-stream: the reason is in the reply
                await self.loop.sock_sendall(self.sock, frame)
            if reply is None:
                return 0
            if reply.done():  # answered before the END: a refusal, a break, or a receiver out of step
                n = reply.result()  # raises the refusal or the break
                raise ConnectionError(f"frame: {n} chunks acknowledged before the stream ended")
            await self.loop.sock_sendall(self.sock, encode_frame(END))
            return await reply
        except BaseException:
            self.broken = True
            if reply is not None and reply.done() and not reply.cancelled():
                exc = reply.exception()
                if isinstance(exc, BulkRefused):
                    raise exc from None  # the receiver's reason beats the write error it caused
            raise
        finally:
            if reply is not None and not reply.done():
                reply.cancel()

    def alive(self) -> bool:
        """Whether an idle connection is still open: nothing to read (the receiver sends nothing
        between streams), no end of file, no error."""
        try:
            self.sock.recv(1, socket.MSG_PEEK)  # end of file, or bytes nobody asked for
            return False
        except BlockingIOError:
            return True
        except OSError:
            return False

    def close(self) -> None:
        self.sock.close()


class BulkClient:
    """A sender's bulk lane: the receiver's bulk port per address (asked once with `Probe`,
    cached) and idle connections per address, reused stream after stream."""

    def __init__(self, probe: Callable[[str, str], object]):
        self._probe = probe  # async (address, peer_id) -> bulk port, 0 when none
        self._ports: dict[str, asyncio.Task[int]] = {}
        self._idle: dict[str, list[BulkConnection]] = {}
        self._down: dict[str, float] = {}  # address -> monotonic time until which it is not tried

    async def connect(self, address: str, peer_id: str) -> BulkConnection | None:
        """An open connection to the bulk lane of the peer at `address`, or None when it has
        none or the connection fails (the caller uses PushChunks; a failure is logged and the
        port asked again next time)."""
        pool = self._idle.get(address, [])
        while pool:
            conn = pool.pop()
            if time.monotonic() - conn.idle_since < REUSE_SECONDS and conn.alive():
                return conn
            conn.close()  # idle too long, or the receiver closed it (a restart)
        if self._down.get(address, 0.0) > time.monotonic():
            return None
        task = self._ports.get(address)
        if task is None:
            task = self._ports[address] = asyncio.ensure_future(self._probe(address, peer_id))
        try:
            port = await asyncio.shield(task)
        except Exception as exc:  # the Probe failed: PushChunks this time (that stream will say why)
            log.info("bulk lane to %s: probe failed (%s)", address, type(exc).__name__)
            if self._ports.get(address) is task:
                del self._ports[address]
            return None
        if not port:
            return None
        try:
            return await BulkConnection.open(address.rsplit(":", 1)[0].strip("[]"), port)
        except (OSError, TimeoutError) as exc:  # refused, unreachable (NAT): PushChunks for a while
            log.warning("bulk lane to %s unavailable (%s: %s); using PushChunks for %.0f s", address,
                        type(exc).__name__, exc, DOWN_SECONDS)
            self._ports.pop(address, None)
            self._down[address] = time.monotonic() + DOWN_SECONDS
            return None

    def has_idle(self, address: str) -> bool:
        return bool(self._idle.get(address))

    def give_back(self, address: str, conn: BulkConnection) -> None:
        """Return a connection whose stream was acknowledged (or close a broken one)."""
        if conn.broken:
            conn.close()
        else:
            conn.idle_since = time.monotonic()
            self._idle.setdefault(address, []).append(conn)

    def forget(self, address: str) -> None:
        self._ports.pop(address, None)
        for c in self._idle.pop(address, []):
            c.close()

    def close(self) -> None:
        for address in list(self._idle):
            self.forget(address)
        for t in self._ports.values():
            t.cancel()
        self._ports.clear()


# ------------------------------------------------------------------------------- receiver


class _Metadata:
    """What `PeerService._admit` reads of a gRPC context: the signature metadata."""

    def __init__(self, pairs: tuple[tuple[str, str], ...]):
        self.pairs = pairs

    def invocation_metadata(self):
        return self.pairs


class _Frames:
    """The chunks of one stream after its first: an async iterator of `pb.Chunk` headers whose
    payloads (`body()`) are read into fresh buffers bounded by the plan. END stops it."""

    def __init__(self, loop, sock, max_payload: int):
        self.loop, self.sock, self.max_payload = loop, sock, max_payload
        self.current: memoryview | None = None

    def body(self) -> memoryview | None:
        return self.current

    def __aiter__(self):
        return self

    async def __anext__(self) -> pb.Chunk:
        kind, meta, payload_len = await read_frame_head(self.loop, self.sock)
        if kind == END:
            raise StopAsyncIteration
        if kind != CHUNK:
            raise InvalidArgument(f"frame: kind {kind} inside a stream")
        c = parse_chunk_header(meta)
        self.current = await self.payload(payload_len)
        return c

    async def payload(self, n: int) -> memoryview:
        if n > self.max_payload:
            raise InvalidArgument(f"frame: payload of {n} bytes, the plan's chunks hold at most {self.max_payload}")
        return await recv_payload(self.loop, self.sock, n)


def max_payload(session) -> int:
    """The largest payload a chunk of `session` may carry: a raw chunk of the plan's size at the
    widest itemsize, or a distance matrix (p x p float64)."""
    p = len(session.participants)
    return max((session.chunk_elems or (1 << 20)) * 8, 8 * p * p)


class BulkServer:
    """The receiver's bulk lane: accepts connections on a TCP port and runs each stream through
    `service` (`PeerService._admit` then `_receive`, see the module docstring)."""

    def __init__(self, service):
        self.service = service
        self.port = 0
        self._listener: socket.socket | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self, host: str) -> int:
        """Listen on `host` (an ephemeral port); returns the port. Raises OSError."""
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host or None, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, addr = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
        sock.setblocking(False)
        self._listener = sock
        self.port = sock.getsockname()[1]
        self._spawn(self._accept(sock))
        return self.port

    def _spawn(self, coro) -> None:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(listener)
            except OSError as exc:
                log.warning("bulk lane: accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            if len(self._tasks) > MAX_CONNECTIONS:
                sock.close()
                continue
            self._spawn(self._serve(_nonblocking(sock)))

    async def _serve(self, sock: socket.socket) -> None:
        """Streams on one connection, one after another, until the sender closes it or one fails."""
        loop = asyncio.get_running_loop()
        wait = IDLE_SECONDS  # senders connect ahead of rounds (Transport.probe_lanes)
        try:
            while True:
                try:
                    async with asyncio.timeout(wait):
                        kind, meta, payload_len = await read_frame_head(loop, sock)
                except (ConnectionError, TimeoutError):
                    return  # closed (or idle) between streams: nothing was in flight
                try:
                    n = await self._stream(loop, sock, kind, meta, payload_len)
                except ShoalError as exc:
                    await self._refuse(loop, sock, exc)
                    return
                await loop.sock_sendall(sock, encode_frame(ACK, json.dumps({"chunks": n}).encode()))
        except (OSError, ConnectionError, TimeoutError, InvalidArgument):
            return  # a broken stream already failed its sender's waits (PeerService._receive)
        finally:
            sock.close()

    async def _stream(self, loop, sock, kind: int, meta: bytes, payload_len: int) -> int:
        if kind != HELLO or payload_len:
            raise InvalidArgument("frame: a stream opens with a HELLO")
        ctx = _Metadata(parse_hello(meta))
        async with asyncio.timeout(HELLO_SECONDS):
            kind, meta, payload_len = await read_frame_head(loop, sock)
        if kind != CHUNK:
            raise InvalidArgument("frame: the HELLO is followed by the first chunk")
        first = parse_chunk_header(meta)
        s = await self.service._admit(first, ctx, BULK_METHOD)  # signature, ticket, plan: before any payload
        frames = _Frames(loop, sock, max_payload(s))
        frames.current = await frames.payload(payload_len)
        return await self.service._receive(first, frames, s, body=frames.body)

    async def _refuse(self, loop, sock, exc: ShoalError) -> None:
        """Tell the sender why (ERROR), then drop what it still sends until it closes (so the
        ERROR is read, not lost to a reset)."""
        with contextlib.suppress(OSError, ConnectionError, TimeoutError):
            await loop.sock_sendall(sock, encode_frame(ERROR, json.dumps(
                {"code": exc.code.name, "message": str(exc)[:2000]}).encode()))
            sock.shutdown(socket.SHUT_WR)
            scratch = memoryview(bytearray(1 << 16))
            async with asyncio.timeout(HELLO_SECONDS):
                while await loop.sock_recv_into(sock, scratch):
                    pass

    def close(self) -> None:
        """Stop listening and end every connection (streams in flight break)."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for t in list(self._tasks):
            t.cancel()
