"""The bulk TCP lane of the data plane: tensor chunks between hosts on a plain TCP connection.

gRPC in Python costs far more CPU per byte than the link on 1-10 Gbit/s networks (protobuf
copies, HTTP/2 framing, a thread hop per message). On this lane a chunk is a 16-byte frame header,
the chunk's protobuf header (`pb.Chunk` without `data`: ~60 bytes) and its raw bytes, written with
one `sendmsg` straight from the collective's array (`ChunkFrame`, no copy) and read with
`sock_recv_into` straight into the array the inbox will hold (a fresh one, or the place in the
result the collective posted for that chunk: `_Frames.read`, `peer.dataplane.Inbox.claim`), the
reader woken per RCVLOWAT_BYTES rather than per segment.
gRPC stays the control lane and the fallback: a sender uses this lane only when the receiver
advertises its port (`ProbeResponse.bulk_port`) and the connection opens; otherwise its stream goes
on PushChunks.

TLS. When the data plane is TLS with a certificate issued at join (`shoal.common.certs.PeerTLS`),
every connection of this lane is mutual TLS 1.3 with that same certificate: the sender checks
that the receiver's certificate is issued for the peer id the plan names (`<id>.peer.shoal` and
`shoal://peer/<id>`), whatever its address; the receiver demands a client certificate from the
peer CA and `_admit` checks that it names the stream's signer (`tls_sender_check`, as on TLS
gRPC). A TLS peer never opens or accepts a plaintext bulk connection: if the handshake fails the
stream goes on PushChunks over TLS gRPC. The socket is a non-blocking `ssl.SSLSocket` driven by
the event loop (`tls_sendall`, `recv_into`): SSL_write encrypts straight from the frame,
SSL_read decrypts straight into the inbox's array (AES-GCM in OpenSSL, with the GIL released).
Against asyncio's SSL transport, a blocking SSLSocket in a worker thread and an SSLObject over
memory BIOs (scripts/tls_lane_speed.py, docs/performance.md) its CPU per byte is within the
noise (~1 CPU-s per GB for both ends, AES-GCM and 16 KiB records dominate); it is the plaintext
lane's own structure, with no thread hop and no copy into a transport buffer.

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
import dataclasses
import contextlib
import json
import logging
import socket
import ssl
import struct
import time
import weakref
from collections.abc import Callable

import numpy as np
from cryptography import x509

from shoal.common.certs import PeerTLS, certificate_peer_id, peer_dns_name, peer_uri
from shoal.common.errors import InvalidArgument, ShoalError
from shoal.peer.lanes import pool
from shoal.peer.lanes.base import CollectiveError
from shoal.peer.pooled import Pooled, anonymous, take_pooled
from shoal.v1 import shoal_pb2 as pb

log = logging.getLogger("shoal.peer.lanes.bulk")

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
# A payload read wakes the event loop once this many bytes are queued (SO_RCVLOWAT), not for
# every segment that lands: on a 1 Gbit/s link a 1 MiB payload otherwise took ~7-15 wake-ups
# (each a readiness wait, a recv and a task step in Python), on 10 Gbit/s fewer but as costly.
RCVLOWAT_BYTES = 256 << 10
_LOWAT_MIN = 64 << 10  # reads shorter than this wake at the first byte, as usual


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
    """One CHUNK frame in one contiguous buffer, the payload copied in (tests, and the frames a
    test writes by hand). The lane itself sends `ChunkFrame`s, which copy nothing. `header` must
    not carry `data`."""
    view = memoryview(body).cast("B")
    meta = header.SerializeToString()
    out = memoryview(np.empty(HEADER.size + len(meta) + view.nbytes, dtype=np.uint8))
    HEADER.pack_into(out, 0, CHUNK, len(meta), view.nbytes)
    out[HEADER.size:HEADER.size + len(meta)] = meta
    out[HEADER.size + len(meta):] = view
    return out


class ChunkFrame:
    """One CHUNK frame as two buffers, written with one `sendmsg` (`send_frame`): `head`, the
    frame header and the chunk's protobuf header (`header` without `data`), and `payload`, a view
    of the caller's bytes (`body`, C-contiguous), not a copy. The caller promises that `body`
    does not change until the frame was written (peer.collectives: the collectives send
    final values, the caller's input and partial sums that change only after the receiver took
    them); a copy of 1 MiB per chunk (and its fresh pages) was the sender's largest cost per byte
    after the kernel's own (docs/performance.md, "Lanes")."""

    __slots__ = ("head", "payload")

    def __init__(self, header: pb.Chunk, body):
        self.payload = memoryview(body).cast("B")
        meta = header.SerializeToString()
        self.head = HEADER.pack(CHUNK, len(meta), self.payload.nbytes) + meta

    def __len__(self) -> int:
        return len(self.head) + self.payload.nbytes

    def joined(self) -> memoryview:
        """The frame in one buffer (a copy: tests)."""
        return memoryview(self.head + self.payload.tobytes())


def split_chunk_frame(frame) -> tuple[pb.Chunk, memoryview]:
    """Inverse of `chunk_frame` (tests)."""
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


async def _ready(loop: asyncio.AbstractEventLoop, sock: socket.socket, write: bool) -> None:
    """Wait until `sock` is writable (`write`) or readable. One waiter per direction and socket:
    the lane reads on one task and writes on another, never two of either (a TLS 1.3 write that
    asks to read, or a read that asks to write, does not happen between our two ends: no
    renegotiation, no key update is requested)."""
    fut = loop.create_future()
    fd = sock.fileno()

    def wake() -> None:
        if not fut.done():
            fut.set_result(None)

    (loop.add_writer if write else loop.add_reader)(fd, wake)
    try:
        await fut
    finally:
        (loop.remove_writer if write else loop.remove_reader)(fd)


async def _tls_retry(loop, sock: ssl.SSLSocket, op: Callable[[], int]) -> int:
    """Run a non-blocking TLS operation on `sock` until OpenSSL stops asking for the socket."""
    while True:
        try:
            return op()
        except ssl.SSLWantReadError:
            await _ready(loop, sock, write=False)
        except ssl.SSLWantWriteError:
            await _ready(loop, sock, write=True)


async def tls_wrap(loop, sock: socket.socket, ctx: ssl.SSLContext, *, server_side: bool = False,
                   server_hostname: str | None = None) -> ssl.SSLSocket:
    """The TLS handshake on the connected non-blocking `sock` (which it takes over), driven by
    the event loop. Raises ssl.SSLError (a certificate refused, a protocol error), OSError."""
    tls = ctx.wrap_socket(sock, server_side=server_side, server_hostname=server_hostname,
                          do_handshake_on_connect=False)
    try:
        await _tls_retry(loop, tls, lambda: tls.do_handshake() or 0)
    except BaseException:
        tls.close()
        raise
    return tls


async def tls_sendall(loop, sock: ssl.SSLSocket, data) -> None:
    """Write all of `data` on a non-blocking TLS socket: SSL_write encrypts straight from the
    caller's buffer (no copy into a transport buffer), retried with the same buffer while the
    socket is full."""
    view = memoryview(data).cast("B")
    while view.nbytes:
        k = await _tls_retry(loop, sock, lambda: sock.send(view))
        view = view[k:]


_lowat: weakref.WeakKeyDictionary[socket.socket, int] = weakref.WeakKeyDictionary()  # SO_RCVLOWAT set, when not 1


def _set_lowat(sock: socket.socket, want: int) -> None:
    """Wake readers of `sock` once `want` bytes are queued (1: at the first byte). Linux grows
    the receive buffer and clamps the TCP window to a low-water mark above half of it
    (`tcp_set_rcvlowat`), so the mark stays at a quarter of the buffer at most: it never
    limits the window. Raises OSError (a closed socket)."""
    if want > 1:
        want = max(1, min(want, socket.socket.getsockopt(sock, socket.SOL_SOCKET, socket.SO_RCVBUF) // 4))
    if _lowat.get(sock, 1) != want:
        socket.socket.setsockopt(sock, socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
        if want == 1:
            _lowat.pop(sock, None)
        else:
            _lowat[sock] = want


async def _tls_recv_into(loop, sock: ssl.SSLSocket, view: memoryview) -> None:
    """`recv_into` on TLS: SSL_read decrypts straight into `view`, one record (16 KiB) per call,
    so the loop stays tight (no await) while records are buffered. While more than
    RCVLOWAT_BYTES + two records of plaintext are still due, a wait for the socket wakes only
    once RCVLOWAT_BYTES raw bytes are queued (they will come: the sender writes whole frames);
    for the tail, at the first byte (a mark above what is left would never wake)."""
    got, n = 0, view.nbytes
    try:
        while got < n:
            try:
                k = sock.recv_into(view[got:])
            except ssl.SSLWantReadError:
                _set_lowat(sock, RCVLOWAT_BYTES if n - got >= RCVLOWAT_BYTES + (32 << 10) else 1)
                await _ready(loop, sock, write=False)
                continue
            except ssl.SSLWantWriteError:
                await _ready(loop, sock, write=True)
                continue
            if k == 0:
                raise ConnectionError(f"connection closed after {got} of {n} bytes")
            got += k
    finally:
        if sock in _lowat and sock.fileno() >= 0:
            _set_lowat(sock, 1)


async def _recv_some(loop, sock: socket.socket, view: memoryview) -> int:
    if isinstance(sock, ssl.SSLSocket):
        return await _tls_retry(loop, sock, lambda: sock.recv_into(view))
    return await loop.sock_recv_into(sock, view)


async def sendall(loop, sock: socket.socket, data) -> None:
    """Write all of `data` on `sock`, plaintext or TLS (`tls_sendall`)."""
    if isinstance(sock, ssl.SSLSocket):
        await tls_sendall(loop, sock, data)
    else:
        await loop.sock_sendall(sock, data)


async def send_frame(loop, sock: socket.socket, frame: ChunkFrame) -> None:
    """Write a `ChunkFrame`: plaintext, one `sendmsg` of its two buffers (the kernel copies
    the payload straight from the caller's array), the rest with `sock_sendall` when the socket
    was full; TLS, SSL_write of each."""
    if isinstance(sock, ssl.SSLSocket):
        await tls_sendall(loop, sock, frame.head)
        await tls_sendall(loop, sock, frame.payload)
        return
    try:
        k = sock.sendmsg((frame.head, frame.payload))
    except (BlockingIOError, InterruptedError):
        k = 0
    for part in (memoryview(frame.head), frame.payload):
        if k >= part.nbytes:
            k -= part.nbytes
            continue
        await loop.sock_sendall(sock, part[k:])
        k = 0


async def recv_into(loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from `sock` (plaintext or TLS). Raises ConnectionError when the peer closes
    first. A long read waits for RCVLOWAT_BYTES at a time (at most what is left), not for every
    segment."""
    if isinstance(sock, ssl.SSLSocket):
        return await _tls_recv_into(loop, sock, view)
    got, n = 0, view.nbytes
    try:
        while got < n:
            left = n - got
            if left >= _LOWAT_MIN or sock in _lowat:
                _set_lowat(sock, min(left, RCVLOWAT_BYTES) if left >= _LOWAT_MIN else 1)
            k = await loop.sock_recv_into(sock, view[got:])
            if k == 0:
                raise ConnectionError(f"connection closed after {got} of {n} bytes")
            got += k
    finally:
        if sock in _lowat and sock.fileno() >= 0:
            _set_lowat(sock, 1)


async def read_frame_head(loop, sock) -> tuple[int, bytes, int]:
    """(kind, meta bytes, payload length) of the next frame; the payload is left to the caller."""
    raw = bytearray(HEADER.size)
    await recv_into(loop, sock, memoryview(raw))
    kind, meta_len, payload_len = decode_header(raw)
    meta = bytearray(meta_len)
    if meta_len:
        await recv_into(loop, sock, memoryview(meta))
    return kind, bytes(meta), payload_len


# Payloads of at least this many bytes are read into pooled buffers (`recv_payload`); smaller
# ones into fresh ones (malloc reuses its own small blocks, and a mapping per small buffer would
# cost more than it saves).
POOLED_PAYLOAD_BYTES = 256 << 10
# Idle pooled payload buffers a process keeps (the least recently used go first): a round's
# payloads in flight at once, e.g. an owner's rows of a 64 MB butterfly among 4 (12 of 4 MiB).
IDLE_PAYLOAD_BUFFERS = 16
_payloads: list[Pooled] = []  # this process's payload buffers, shared by its event loops (peer.pooled's lock)


async def recv_payload(loop, sock, n: int) -> memoryview:
    """`n` payload bytes in a buffer that is uninitialised, then filled (no zeroing pass). From
    POOLED_PAYLOAD_BYTES on, the buffer is pooled (`peer.pooled`): reused once nothing refers to
    the array on it any more (the chunk was consumed), since a fresh 4 MiB buffer per chunk
    costs its page faults and zeroing inside `recv` (~9 % of all the CPU of a 10 Gbit/s
    butterfly, docs/performance.md); at most IDLE_PAYLOAD_BUFFERS idle ones are kept."""
    if n >= POOLED_PAYLOAD_BYTES:
        buf = memoryview(take_pooled(_payloads, n, np.uint8, IDLE_PAYLOAD_BUFFERS, anonymous, _payloads.remove)[1])
    else:
        buf = memoryview(np.empty(n, dtype=np.uint8))
    if n:
        await recv_into(loop, sock, buf)
    return buf


def _nonblocking(sock: socket.socket) -> socket.socket:
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def tls_peer_of(sock: ssl.SSLSocket) -> str:
    """The peer id the certificate presented on `sock` names ("" for none)."""
    der = sock.getpeercert(binary_form=True)
    return certificate_peer_id(x509.load_der_x509_certificate(der)) if der else ""


# ------------------------------------------------------------------------------- sender


class BulkConnection:
    """The sender's end of one connection; one stream at a time (`send_stream`). `generation`:
    the certificate generation a TLS connection was opened with (0: plaintext)."""

    def __init__(self, sock: socket.socket, generation: int = 0):
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self.broken = False
        self.idle_since = time.monotonic()
        self.generation = generation

    @property
    def tls(self) -> bool:
        return isinstance(self.sock, ssl.SSLSocket)

    @property
    def lane(self) -> str:
        """The lane's name in reports (`Transport.lanes`): "tcp-tls" over mutual TLS, else "tcp"."""
        return "tcp-tls" if self.tls else "tcp"

    @classmethod
    async def open(cls, host: str, port: int, tls: PeerTLS | None = None, peer_id: str = "",
                   sndbuf: int = 0) -> BulkConnection:
        """Connect within CONNECT_SECONDS; with `tls` (an issued certificate) over mutual TLS,
        the receiver's certificate checked for `peer_id` (`<peer_id>.peer.shoal` and its URI),
        whatever `host` is, exactly as `open_peer_channel` checks a gRPC server. `sndbuf` > 0:
        the socket's SO_SNDBUF, set before connecting (`peer.lanes.pool.send_buffer_bytes`).

        Raises OSError/TimeoutError when it cannot connect, ssl.SSLError (an OSError) when the
        handshake fails or the certificate names another peer, RuntimeError (no certificate)."""
        loop = asyncio.get_running_loop()
        ctx = generation = None
        if tls is not None:
            if not peer_id:
                raise ValueError("bulk lane: a TLS connection needs the peer id the plan names")
            generation = tls.generation
            ctx = tls.ssl_context(server=False)
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, _, _, _, addr = infos[0]
        sock = _nonblocking(socket.socket(family, socket.SOCK_STREAM))
        if sndbuf:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        try:
            async with asyncio.timeout(CONNECT_SECONDS):
                await loop.sock_connect(sock, addr)
                if ctx is not None:
                    sock = await tls_wrap(loop, sock, ctx, server_hostname=peer_dns_name(peer_id))
                    if tls_peer_of(sock) != peer_id:  # the DNS name matched; the URI must name it too
                        raise ssl.SSLError(f"bulk lane: {host}:{port} presented a certificate for "
                                           f"{tls_peer_of(sock)[:8]!r}, not {peer_id[:8]}")
        except BaseException:
            sock.close()
            raise
        return cls(sock, generation or 0)

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
        try:
            if not nxt.done():
                await asyncio.wait((nxt, reply), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the stream is cancelled (its attempt aborted): so is the wait for a frame
            nxt.cancel()       # (left pending, it was logged "Task was destroyed but it is pending!")
            raise
        if nxt.done():
            return nxt.result()
        nxt.cancel()
        return None

    def notsent_lowat(self, nbytes: int) -> None:
        """Hold this connection's unsent bytes in the kernel below `nbytes` (TCP_NOTSENT_LOWAT; 0:
        the host's default, unbounded): a write waits until the data before it is nearly on the
        wire. Ignored where the option is missing."""
        with contextlib.suppress(OSError, AttributeError):
            socket.socket.setsockopt(self.sock, socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, nbytes)

    async def send_stream(self, frames, hello: Callable[[pb.Chunk], object]) -> int:
        """Write one stream: `frames` yields (header, frame) pairs, a frame a `ChunkFrame` or
        one buffer as made by `chunk_frame` (or None to stop), the first header already holding the ticket; `hello(first header)` is
        its signature metadata. Returns the chunks the receiver acknowledged.

        Raises BulkRefused (the receiver's refusal, which it may send at any time),
        ConnectionError/OSError (broken). Either way this connection is broken for good."""
        reply: asyncio.Future | None = None
        try:
            while (item := await self._next(frames, reply)) is not None:
                header, frame = item
                if reply is None:
                    await sendall(self.loop, self.sock, hello_frame(hello(header)))
                    reply = asyncio.ensure_future(self._reply())
                if reply.done():
                    break  # refused or broken mid-stream: the reason is in the reply
                if isinstance(frame, ChunkFrame):
                    await send_frame(self.loop, self.sock, frame)
                else:
                    await sendall(self.loop, self.sock, frame)
            if reply is None:
                return 0
            if reply.done():  # answered before the END: a refusal, a break, or a receiver out of step
                n = reply.result()  # raises the refusal or the break
                raise ConnectionError(f"frame: {n} chunks acknowledged before the stream ended")
            await sendall(self.loop, self.sock, encode_frame(END))
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
        if self.tls and self.sock.pending():
            return False
        try:
            socket.socket.recv(self.sock, 1, socket.MSG_PEEK)  # the raw stream (TLS: no session tickets come)
            return False
        except BlockingIOError:
            return True
        except OSError:
            return False

    def close(self) -> None:
        self.sock.close()


class BulkClient:
    """A sender's bulk lane: the receiver's bulk port per address (asked once with `Probe`,
    cached; asked again when a connection to the cached port fails, since a peer restarted at the
    same address listens on a new one) and idle connections per address, reused stream after
    stream. `link_bytes_per_s`: this sender's uplink, bytes/s, when it is known (0: not known),
    what a pool sized at the handshake aims at (`pool.initial_pool_size`)."""

    def __init__(self, probe: Callable[[str, str], object], tls: PeerTLS | None = None,
                 max_connections: int = pool.POOL_MAX, link_bytes_per_s: float = 0.0):
        self._probe = probe  # async (address, peer_id) -> bulk port, 0 when none
        self.tls = tls  # mutual TLS with the certificate issued at join; None: plaintext
        if max_connections < 1:
            raise ValueError(f"bulk_connections: must be >= 1, got {max_connections}")
        self.max_connections = max_connections
        self.link_bytes_per_s = link_bytes_per_s
        self.window = pool.window_bytes()
        self.sndbuf = pool.send_buffer_bytes()  # twice autotuning's window, no sysctl (peer.lanes.pool)
        self._pool: dict[str, int] = {}  # address -> connections its next stream gets (peer.lanes.pool)
        self._first = 1  # a peer not streamed to yet: the size last chosen for another (peer.lanes.pool)
        self._sized: dict[str, int] = {}  # address -> the size its first connection's handshake asks for
        self.paths: dict[str, pool.TcpPath] = {}  # address -> what the kernel measured on the last stream
        self._ports: dict[str, asyncio.Task[int]] = {}
        self._idle: dict[str, list[BulkConnection]] = {}
        self._down: dict[str, float] = {}  # address -> monotonic time until which it is not tried

    async def connect(self, address: str, peer_id: str) -> BulkConnection | None:
        """An open connection to the bulk lane of the peer at `address`, or None when it has
        none or the connection fails (the caller uses PushChunks; a failure is logged and the
        port asked again next time).

        The first connection opened to an address sizes its pool from the handshake's RTT
        (`_size_from_handshake`, peer.lanes.pool) and opens the pool's other connections
        alongside, into the idle ones, before it returns: the warm-up before a round
        (`Transport.probe_lanes`) then leaves the whole pool open, and a first stream finds it
        so. One of those that fails to open is left out (the stream opens it again or goes on
        fewer); if the caller is cancelled meanwhile, every connection opened here is closed."""
        idle = self._idle.get(address, [])
        generation = self.tls.generation if self.tls is not None else 0
        while idle:
            conn = idle.pop()
            if time.monotonic() - conn.idle_since < REUSE_SECONDS and conn.generation == generation and conn.alive():
                return conn
            conn.close()  # idle too long, the receiver closed it (a restart), or opened before a renewal
        if self._down.get(address, 0.0) > time.monotonic():
            return None
        cached = address in self._ports
        port = await self._port(address, peer_id)
        host = address.rsplit(":", 1)[0].strip("[]")
        while port:
            try:
                conn = await BulkConnection.open(host, port, self.tls, peer_id, self.sndbuf)
            except (OSError, TimeoutError, RuntimeError, ValueError) as exc:
                self._ports.pop(address, None)
                if cached and isinstance(exc, ConnectionRefusedError):
                    # The host answered, the port is closed: a peer restarted at this address
                    # listens on a new one. Ask it, once (a silent host is not asked: NAT, gone).
                    cached, stale = False, port
                    if (port := await self._port(address, peer_id)) != stale:
                        continue
                # Refused, unreachable (NAT), a TLS handshake or certificate refused: PushChunks (on
                # TLS gRPC when TLS is on: never plaintext) for a while.
                log.warning("bulk lane to %s unavailable (%s: %s); using PushChunks%s for %.0f s", address,
                            type(exc).__name__, exc, " (TLS gRPC)" if self.tls is not None else "", DOWN_SECONDS)
                self._down[address] = time.monotonic() + DOWN_SECONDS
                return None
            more = self._size_from_handshake(address, conn) - 1
            # Bounded for the whole client: a peer warming its lanes to many participants keeps
            # at most WARM_CONNECTIONS_MAX idle (file descriptors); the rest open with their streams.
            more = min(more, pool.WARM_CONNECTIONS_MAX - sum(len(v) for v in self._idle.values()))
            if more > 0:
                try:
                    await self._open_idle(address, host, port, peer_id, more)
                except BaseException:
                    conn.close()
                    raise
            return conn
        return None

    def _size_from_handshake(self, address: str, conn: BulkConnection) -> int:
        """Size the pool of an address not sized yet from the RTT the kernel measured on `conn`'s
        handshake (`pool.initial_pool_size` with `link_bytes_per_s`); returns how many
        connections its next stream gets when this call sized it, else 0 (sized before, or
        nothing measured: then the pool starts as it would without, at `_first`)."""
        if address in self._sized or address in self._pool:
            return 0
        path = pool.tcp_path([conn.sock])
        if path is None or path.rtt_seconds <= 0:
            return 0
        # The RTT only: a handshake (TCP, TLS records) that needed a retransmission says nothing
        # of the path's loss rate, and a few segments' ratio would read as a huge one.
        path = dataclasses.replace(path, loss=0.0)
        self._sized[address] = pool.initial_pool_size(path, self.window, self.link_bytes_per_s, self.max_connections)
        k = self.pool_size(address)
        if self._sized[address] > 1:
            log.info("bulk lane to %s: %d connection(s) from the handshake (RTT %.1f ms, %.1f MiB window, %s)",
                     address, k, path.rtt_seconds * 1e3, self.window / (1 << 20),
                     f"{self.link_bytes_per_s * 8e-6:.0f} Mbit/s uplink" if self.link_bytes_per_s > 0
                     else "uplink not known")
        return k

    async def _open_idle(self, address: str, host: str, port: int, peer_id: str, n: int) -> None:
        """Open `n` connections to `host`:`port` at once and keep them idle for `address`'s next
        stream. One that fails is left out (logged); when this is cancelled, those already
        open are closed."""
        async def one() -> BulkConnection | None:
            try:
                return await BulkConnection.open(host, port, self.tls, peer_id, self.sndbuf)
            except (OSError, TimeoutError, RuntimeError, ValueError) as exc:
                log.info("bulk lane to %s: a pool connection did not open (%s: %s)", address, type(exc).__name__, exc)
                return None

        tasks: list[asyncio.Task] = []
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(one()) for _ in range(n)]
        except BaseException:
            for t in tasks:
                if t.done() and not t.cancelled() and t.exception() is None and t.result() is not None:
                    t.result().close()
            raise
        for t in tasks:
            if (c := t.result()) is not None:
                self.give_back(address, c)

    async def _port(self, address: str, peer_id: str) -> int:
        """The bulk port the peer at `address` advertises (asked once, then cached), 0 when it has
        none or the Probe failed (not cached: PushChunks this time, and that stream says why)."""
        task = self._ports.get(address)
        if task is None:
            task = self._ports[address] = asyncio.ensure_future(self._probe(address, peer_id))
        try:
            return await asyncio.shield(task)
        except Exception as exc:
            log.info("bulk lane to %s: probe failed (%s)", address, type(exc).__name__)
            if self._ports.get(address) is task:
                del self._ports[address]
            return 0

    def has_idle(self, address: str) -> bool:
        return bool(self._idle.get(address))

    def pool_size(self, address: str) -> int:
        """How many connections the next stream to `address` goes out on (peer.lanes.pool): as the
        last stream to it chose, else the larger of the size last chosen for another peer and
        its handshake's (`_size_from_handshake`)."""
        k = self._pool[address] if address in self._pool else max(self._first, self._sized.get(address, 1))
        return min(k, self.max_connections)

    def observe_stream(self, address: str, conns: list[BulkConnection], goodput: float | None) -> pool.TcpPath | None:
        """A stream to `address` went out over `conns` at `goodput` bytes/s (its bytes over its
        seconds; None when its connections waited on its producer a good part of it,
        `pool.stream_goodput`): record the path the kernel measured on them, size the
        next stream's pool (`pool.next_pool_size`; kept as is when `goodput` is None) and return
        the path (None when TCP_INFO is unreadable)."""
        path = pool.tcp_path([c.sock for c in conns if not c.broken])
        if path is None:
            return path
        self.paths[address] = path
        if goodput is None or goodput <= 0:
            return path
        k = len(conns)
        # Never below the handshake's size: that many connections are what the window and the
        # RTT ask for, and a stream's goodput (fresh connections in slow start, a ring step
        # coupled to the others) can read low for reasons no fewer connections would fix.
        nxt = max(pool.next_pool_size(k, goodput, path, self.window, self.max_connections),
                  min(self._sized.get(address, 1), self.max_connections))
        if nxt != k:
            log.info("bulk lane to %s: %d connection(s) next (RTT %.0f ms, loss %.2g %%, %.1f Mbit/s on %d)",
                     address, nxt, path.rtt_seconds * 1e3, path.loss * 100, goodput * 8e-6, k)
        self._pool[address] = self._first = nxt
        return path

    def give_back(self, address: str, conn: BulkConnection) -> None:
        """Return a connection whose stream was acknowledged (or close a broken one)."""
        if conn.broken:
            conn.close()
        else:
            conn.idle_since = time.monotonic()
            self._idle.setdefault(address, []).append(conn)

    def forget(self, address: str) -> None:
        self._ports.pop(address, None)
        self._pool.pop(address, None)
        self._sized.pop(address, None)
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
    """What `PeerService._admit` reads of a gRPC context: the signature metadata, and on a TLS
    connection the peer id its client certificate names (as gRPC's auth context shows it to
    `shoal.common.security.tls_sender_check`: the URI `shoal://peer/<id>`)."""

    def __init__(self, pairs: tuple[tuple[str, str], ...], tls_peer: str | None = None):
        self.pairs = pairs
        self.tls_peer = tls_peer  # None: plaintext connection; "": a certificate naming no peer

    def invocation_metadata(self):
        return self.pairs

    def auth_context(self) -> dict[str, list[bytes]]:
        if self.tls_peer is None:
            return {}
        return {"x509_pem_cert": [b"(bulk lane)"], "peer_uri": [peer_uri(self.tls_peer).encode()] if self.tls_peer else []}


class _Frames:
    """The chunks of one stream: an async iterator of `pb.Chunk` headers (after the first, which
    `read` takes) whose payloads (`body()`) are read into fresh buffers bounded by the plan, or,
    for a raw chunk of this stream's own sender and attempt (`origin`) whose place the
    collective posted (`claim`: `peer.dataplane.Inbox.claim`), straight into that place. END
    stops it."""

    def __init__(self, loop, sock, max_payload: int, claim: Callable[[tuple, int], memoryview | None] | None = None):
        self.loop, self.sock, self.max_payload = loop, sock, max_payload
        self.claim = claim
        self.origin: tuple[int, int, str] | None = None  # (round, attempt, sender) of the first chunk
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
        await self.read(c, payload_len)
        return c

    async def read(self, c: pb.Chunk, n: int) -> None:
        """Read chunk `c`'s payload of `n` bytes (`body()`). Raises InvalidArgument past the
        plan's bound, ConnectionError/OSError."""
        if n > self.max_payload:
            raise InvalidArgument(f"frame: payload of {n} bytes, the plan's chunks hold at most {self.max_payload}")
        if self.origin is None:
            self.origin = (c.round, c.attempt, c.sender)
        dest = None
        if self.claim is not None and not c.codec and n and (c.round, c.attempt, c.sender) == self.origin:
            dest = self.claim((c.round, c.attempt, c.phase, c.step, c.shard, c.offset, c.sender), n)
        if dest is None:
            self.current = await recv_payload(self.loop, self.sock, n)
        else:
            await recv_into(self.loop, self.sock, dest)
            self.current = dest


def max_payload(session) -> int:
    """The largest payload a chunk of `session` may carry: a raw chunk of the plan's size at the
    widest itemsize, or a distance matrix (p x p float64)."""
    p = len(session.participants)
    return max((session.chunk_elems or (1 << 20)) * 8, 8 * p * p)


class BulkServer:
    """The receiver's bulk lane: accepts connections on a TCP port and runs each stream through
    `service` (`PeerService._admit` then `_receive`, see the module docstring). With `tls` (the
    certificate issued at join) every connection is mutual TLS: a client without a certificate
    from the peer CA fails the handshake, and the one it presents must name the stream's signer
    (`_admit`'s `tls_sender_check`, as on TLS gRPC)."""

    def __init__(self, service, tls: PeerTLS | None = None):
        self.service = service
        self.tls = tls
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
        tls_peer: str | None = None
        try:
            if self.tls is not None:  # the newest certificate at each handshake, as the gRPC server
                try:
                    async with asyncio.timeout(HELLO_SECONDS):
                        sock = await tls_wrap(loop, sock, self.tls.ssl_context(server=True), server_side=True)
                except (OSError, TimeoutError, RuntimeError) as exc:
                    log.warning("bulk lane: TLS handshake refused (%s: %s)", type(exc).__name__, exc)
                    return
                tls_peer = tls_peer_of(sock)
            while True:
                try:
                    async with asyncio.timeout(wait):
                        kind, meta, payload_len = await read_frame_head(loop, sock)
                except (ConnectionError, TimeoutError):
                    return  # closed (or idle) between streams: nothing was in flight
                try:
                    n = await self._stream(loop, sock, kind, meta, payload_len, tls_peer)
                except ShoalError as exc:
                    await self._refuse(loop, sock, exc)
                    return
                await sendall(loop, sock, encode_frame(ACK, json.dumps({"chunks": n}).encode()))
        except (OSError, ConnectionError, TimeoutError, InvalidArgument):
            return  # a broken stream already failed its sender's waits (PeerService._receive)
        finally:
            sock.close()

    async def _stream(self, loop, sock, kind: int, meta: bytes, payload_len: int, tls_peer: str | None) -> int:
        if kind != HELLO or payload_len:
            raise InvalidArgument("frame: a stream opens with a HELLO")
        ctx = _Metadata(parse_hello(meta), tls_peer)
        async with asyncio.timeout(HELLO_SECONDS):
            kind, meta, payload_len = await read_frame_head(loop, sock)
        if kind != CHUNK:
            raise InvalidArgument("frame: the HELLO is followed by the first chunk")
        first = parse_chunk_header(meta)
        s = await self.service._admit(first, ctx, BULK_METHOD)  # signature, ticket, plan: before any payload
        inbox = getattr(self.service, "inbox", None)
        frames = _Frames(loop, sock, max_payload(s), inbox.claim if inbox is not None else None)
        await frames.read(first, payload_len)
        return await self.service._receive(first, frames, s, body=frames.body)

    async def _refuse(self, loop, sock, exc: ShoalError) -> None:
        """Tell the sender why (ERROR), then drop what it still sends until it closes (so the
        ERROR is read, not lost to a reset)."""
        with contextlib.suppress(OSError, ConnectionError, TimeoutError):
            await sendall(loop, sock, encode_frame(ERROR, json.dumps(
                {"code": exc.code.name, "message": str(exc)[:2000]}).encode()))
            if not isinstance(sock, ssl.SSLSocket):  # (TLS: shutdown would drop the session; the sender closes)
                sock.shutdown(socket.SHUT_WR)
            scratch = memoryview(bytearray(1 << 16))
            async with asyncio.timeout(HELLO_SECONDS):
                while await _recv_some(loop, sock, scratch):
                    pass

    def close(self) -> None:
        """Stop listening and end every connection (streams in flight break)."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for t in list(self._tasks):
            t.cancel()


class _Stripe:
    """One connection's side of a striped stream (`carry`): the frames it takes from the lane's
    queue, and what it measured meanwhile: `busy_bytes` / `busy_seconds`, written while more
    frames were queued behind them (the link meter's busy throughput of a lone connection), and
    `starved_seconds`, waiting on an empty queue for a frame that came (the stream's producer,
    not the connection, was the bound then)."""

    def __init__(self, lane, pending: list):
        self.lane, self.pending = lane, pending
        self.busy_bytes, self.busy_seconds, self.starved_seconds = 0, 0.0, 0.0
        self.frames_taken = 0
        self._start, self._size = 0.0, 0

    def _opened(self, item):
        header, frame = item
        if header.ticket or not isinstance(frame, ChunkFrame):
            return item
        header.ticket = self.lane.plan.ticket  # the first chunk of every stream carries the ticket
        return header, ChunkFrame(header, frame.payload)

    async def frames(self):
        queue = self.lane.queue
        if self._size:
            self.busy_bytes += self._size
            self.busy_seconds += time.perf_counter() - self._start
            self._size = 0
        if self.pending:
            nxt = self.pending.pop()
        elif queue.empty():
            waited = time.perf_counter()
            nxt = await queue.get()
            if nxt is not None:
                self.starved_seconds += time.perf_counter() - waited
        else:
            nxt = queue.get_nowait()
        if nxt is None:
            queue.put_nowait(None)  # the end, for the next connection waiting on the queue
            return None
        self.frames_taken += 1
        if not queue.empty():
            self._start, self._size = time.perf_counter(), len(nxt[1])
        if self.frames_taken == 1:  # this connection's stream opens with it
            nxt = self._opened(nxt)
        return nxt


async def carry(lane, first: tuple[pb.Chunk, ChunkFrame]) -> None:
    """Write a dialled lane's queued frames (`first`, then `lane.queue` until None) on its bulk
    connections (`lane.bulk` and the pool's others, `lane.bulk_extra`, chosen by
    peer.lanes.network.DialedLane): one stream per connection, each taking the next queued frame
    when it wrote its last (peer.lanes.pool); every stream opens with its own HELLO and first
    chunk carrying the ticket, admitted on its own. Fails like a PushChunks stream:
    CollectiveError blaming the receiver when it refuses or a connection breaks (its channel is
    then forgotten; the other streams are cancelled). The connections go back to the transport
    either way (closed when broken); the lane's link meter gets the passive throughput, and the
    transport the stream's outcome for the next pool size."""
    conns, peer = [lane.bulk, *getattr(lane, "bulk_extra", [])], lane.peer_id
    assert conns[0] is not None
    pending: list = [first]
    t0 = time.perf_counter()
    stripes = [_Stripe(lane, pending) for _ in conns]
    for c in conns:  # striped: a connection takes the next chunk only once it sent most of its last
        c.notsent_lowat(pool.STRIPE_NOTSENT_LOWAT if len(conns) > 1 else 0)
    tasks = [asyncio.ensure_future(c.send_stream(st.frames, lane.transport.bulk_metadata))
             for c, st in zip(conns, stripes)]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in tasks:
            if t.done() and t.exception() is not None:
                raise t.exception()
        seconds = time.perf_counter() - t0
        # A stream whose connections all waited for frames a good part of it (a ring step's
        # stream waits for its predecessor's chunks) went at the collective's pace: its goodput
        # says nothing about what the connections can carry, and the pool keeps its size.
        carried = [st.starved_seconds for st in stripes if st.frames_taken]
        goodput = pool.stream_goodput(lane.bytes_sent, seconds, min(carried) if carried else 0.0)
        observe = getattr(lane.transport, "observe_bulk", None)
        path = observe(lane.address, conns, goodput) if observe is not None else None
        if path is not None and lane.links is not None:  # (before the connections go back: their TCP_INFO)
            lane.links.observe_path(peer, path.min_rtt_seconds, path.loss)
    except BulkRefused as exc:
        raise CollectiveError(f"stream to {peer[:8]} failed: {exc.code} {exc.message}", [peer]) from None
    except OSError as exc:
        await lane.transport.forget(lane.address)
        raise CollectiveError(f"stream to {peer[:8]} failed: bulk lane broke: {exc}", [peer]) from None
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in conns:
            lane.transport.give_back_bulk(lane.address, c)
    if lane.links is not None:
        lone = stripes[0] if lane.solo and len(conns) == 1 else None
        lane.links.observe_send(peer, lane.bytes_sent, seconds, busy_bytes=lone.busy_bytes if lone else 0,
                                busy_seconds=lone.busy_seconds if lone else 0.0)
