"""The peer's data plane: the shoal.v1.Peer server, the chunk inbox and outgoing channels.

`Inbox` holds tensor chunks that arrived from other peers until the collective asks for them
(arrival may precede the local plan by a few milliseconds: chunks are buffered, within bounds).
`PeerService` is the gRPC servicer: it validates each chunk against the running collective and
hands it to the inbox; it serves committed state to joiners and answers link probes.
`Transport` owns the outgoing channels, one per remote address, reused across rounds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
import numpy as np

from peer import faults
from peer.compression import BLOCK, Encoded
from peer.errors import FailedPrecondition, InvalidArgument, PermissionDenied, ResourceExhausted, grpc_errors, require
from peer.tensors import decode_chunk
from shoal.v1 import shoal_pb2 as pb
from shoal.v1 import shoal_pb2_grpc as pb_grpc

log = logging.getLogger("shoal.peer.dataplane")

MAX_MESSAGE_BYTES = 8 << 20
STATE_CHUNK_BYTES = 1 << 20

ChunkKey = tuple[int, int, int, int, int, int, str]  # round, attempt, phase, step, shard, offset, sender
# What the inbox holds per chunk: the raw values (codec 0, a read-only view) or the still-encoded
# payload (codecs 1-3), which the collective decodes, and forwards verbatim where it relays.
Payload = np.ndarray | Encoded


def payload_nbytes(v: Payload) -> int:
    return v.nbytes if isinstance(v, np.ndarray) else len(v.data) + len(v.scale)


def check_encoded(codec: int, count: int, data: bytes, scale: bytes) -> Encoded:
    """Structure check of a compressed chunk (lengths only; values are checked when decoded).

    Raises InvalidArgument naming the field.
    """
    require(codec in (1, 2, 3), "codec", f"unknown codec id {codec}")
    item = 1 if codec == 3 else 2
    require(len(data) == count * item, "data", f"{len(data)} bytes, expected {count} x {item}")
    want_scale = 4 * (-(-count // BLOCK)) if codec == 3 else 0
    require(len(scale) == want_scale, "scale", f"{len(scale)} bytes, expected {want_scale}")
    return Encoded(codec, data, scale, count)


@dataclass(frozen=True)
class Session:
    """What the receiving side knows of the running collective: who may send, what sizes."""

    round: int
    attempt: int
    participants: frozenset[str]
    dtype: int
    ticket_check: Callable[[bytes, str], None] | None = None


class SenderGone(Exception):
    """The stream from a sender broke before it delivered the awaited chunk."""


class Inbox:
    """Chunks keyed by (round, attempt, phase, step, shard, offset, sender), awaited by the collective.

    Bounded: at most `max_bytes` of undelivered payload. Chunks for a round attempt older than the
    current session are refused (FAILED_PRECONDITION), so a late sender cannot fill memory.
    """

    def __init__(self, max_bytes: int = 1 << 30):
        self.max_bytes = max_bytes
        self._futures: dict[ChunkKey, asyncio.Future] = {}
        self._bytes = 0
        self.session: Session | None = None
        self.floor: tuple[int, int] = (0, 0)
        self._broken: dict[tuple[int, int, str], str] = {}

    def start(self, session: Session) -> None:
        """Open a collective session; drops everything buffered for older attempts."""
        self.session = session
        self.floor = (session.round, session.attempt)
        for k in [k for k in self._futures if (k[0], k[1]) < self.floor]:
            self._drop(k)
        self._broken = {k: v for k, v in self._broken.items() if (k[0], k[1]) >= self.floor}

    def finish(self, round_: int, attempt: int) -> None:
        for k in [k for k in self._futures if (k[0], k[1]) == (round_, attempt)]:
            self._drop(k)
        if self.session is not None and (self.session.round, self.session.attempt) == (round_, attempt):
            self.session = None
            self.floor = (round_, attempt + 1)

    def _drop(self, k: ChunkKey) -> None:
        f = self._futures.pop(k)
        if f.done() and not f.cancelled() and f.exception() is None:
            self._bytes -= payload_nbytes(f.result())
        elif not f.done():
            f.cancel()

    def fail_sender(self, round_: int, attempt: int, sender: str, reason: str) -> None:
        """The stream from `sender` broke: every pending and future wait on it fails at once."""
        if (round_, attempt) < self.floor:
            return
        self._broken[(round_, attempt, sender)] = reason
        for k, f in self._futures.items():
            if (k[0], k[1], k[6]) == (round_, attempt, sender) and not f.done():
                f.set_exception(SenderGone(reason))

    def deliver(self, key: ChunkKey, values: Payload) -> None:
        """Store an arrived chunk. Raises FailedPrecondition (stale), ResourceExhausted (full)."""
        if (key[0], key[1]) < self.floor:
            raise FailedPrecondition(f"round: chunk for {key[0]}.{key[1]} is older than the running {self.floor}")
        if self._bytes + payload_nbytes(values) > self.max_bytes:
            raise ResourceExhausted(f"data: inbox holds {self._bytes} bytes, limit {self.max_bytes}")
        f = self._futures.get(key)
        if f is None:
            f = self._futures[key] = asyncio.get_running_loop().create_future()
        if f.done():
            raise InvalidArgument(f"offset: duplicate chunk {key[2:]}")
        f.set_result(values)
        self._bytes += payload_nbytes(values)

    async def get(self, key: ChunkKey, timeout: float) -> Payload:
        """Wait up to `timeout` seconds for a chunk. Raises TimeoutError."""
        f = self._futures.get(key)
        if f is None:
            f = self._futures[key] = asyncio.get_running_loop().create_future()
        broken = self._broken.get((key[0], key[1], key[6]))
        if broken is not None and not f.done():
            raise SenderGone(broken)
        async with asyncio.timeout(timeout):
            values = await asyncio.shield(f)
        self._futures.pop(key, None)
        self._bytes -= payload_nbytes(values)
        return values


class StateSource:
    """What a donor serves: the serialized committed state for a round (see peer.state_sync)."""

    def committed_state(self) -> tuple[int, bytes, bytes]:  # (rounds, blob, digest)
        raise NotImplementedError


class PeerService(pb_grpc.PeerServicer):
    """shoal.v1.Peer: receives chunks, serves committed state, answers probes."""

    def __init__(self, inbox: Inbox, state: StateSource | None = None, *, on_bytes: Callable[[int], None] | None = None):
        self.inbox = inbox
        self.state = state
        self.on_bytes = on_bytes or (lambda n: None)
        self.chunks_received = 0

    async def PushChunks(self, request_iterator: AsyncIterator[pb.Chunk], context) -> pb.PushAck:
        """Receive one sender's chunks for one round attempt into the inbox.

        If the stream breaks before the sender closes it (the sender crashed, its connection
        reset), every wait on that sender fails at once (`Inbox.fail_sender`), so a dead peer is
        detected in milliseconds rather than at the chunk deadline.
        """
        n = 0
        origin: tuple[int, int, str] | None = None
        try:
            async with grpc_errors(context):
                s = self.inbox.session
                async for c in request_iterator:
                    if origin is None:
                        origin = (c.round, c.attempt, c.sender)
                        s = self.inbox.session
                        if s is not None and s.ticket_check is not None and (c.round, c.attempt) == (s.round, s.attempt):
                            s.ticket_check(c.ticket, c.sender)
                    elif (c.round, c.attempt, c.sender) != origin:
                        raise InvalidArgument("sender: one stream carries one sender's chunks of one round attempt")
                    if s is None or (s.round, s.attempt) != (c.round, c.attempt):
                        s = self.inbox.session
                    if s is not None and (c.round, c.attempt) == (s.round, s.attempt):
                        if c.sender not in s.participants:
                            raise PermissionDenied(f"sender: {c.sender[:8]} is not a participant of round {c.round}")
                        if c.phase == pb.DISTANCES:
                            require(c.dtype == pb.FLOAT64 and c.codec == 0, "dtype", "distance matrices are raw float64")
                        else:
                            require(c.dtype == s.dtype, "dtype", f"{c.dtype} differs from the plan's {s.dtype}")
                    require(len(c.shape) == 1, "shape", "chunks are 1-D")
                    if c.codec == 0:
                        require(not c.scale, "scale", "must be empty for raw chunks")
                        values: Payload = decode_chunk(c.data, c.dtype, int(c.shape[0]))
                    else:
                        require(c.dtype == pb.FLOAT32, "dtype", "compressed chunks carry float32 tensors")
                        values = check_encoded(c.codec, int(c.shape[0]), c.data, c.scale)
                    self.inbox.deliver((c.round, c.attempt, c.phase, c.step, c.shard, c.offset, c.sender), values)
                    self.on_bytes(len(c.data) + len(c.scale))
                    n += 1
        except BaseException as exc:
            if origin is not None:
                self.inbox.fail_sender(*origin, f"stream from {origin[2][:8]} broke: {type(exc).__name__}")
            raise
        finally:
            self.chunks_received += n
        return pb.PushAck(chunks=n)

    async def FetchState(self, request: pb.StateRequest, context) -> AsyncIterator[pb.StateChunk]:
        if self.state is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "round: this peer serves no state")
        rounds, blob, dig = self.state.committed_state()
        if request.round != rounds:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"round: this peer holds state of round {rounds}, not {request.round}")
        if request.offset > len(blob):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"offset: {request.offset} past {len(blob)} bytes")
        end = len(blob) if request.length == 0 else min(len(blob), request.offset + request.length)
        for off in range(request.offset, end, STATE_CHUNK_BYTES):
            piece = blob[off:min(end, off + STATE_CHUNK_BYTES)]
            if request.offset > 0:
                faults.hit("serve-state")
            yield pb.StateChunk(round=rounds, offset=off, total_bytes=len(blob), data=piece, state_digest=dig)

    async def Probe(self, request: pb.ProbeRequest, context) -> pb.ProbeResponse:
        async with grpc_errors(context):
            require(request.reply_bytes <= MAX_MESSAGE_BYTES // 2, "reply_bytes", f"at most {MAX_MESSAGE_BYTES // 2}")
            return pb.ProbeResponse(payload=bytes(request.reply_bytes))


def channel_options() -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]


class Transport:
    """Outgoing data-plane channels, one per remote address, reused across rounds."""

    def __init__(self, credentials: grpc.ChannelCredentials | None = None):
        self.credentials = credentials
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.bytes_sent = 0
        self.created = time.monotonic()

    def stub(self, address: str) -> pb_grpc.PeerStub:
        ch = self._channels.get(address)
        if ch is None:
            if self.credentials is not None:
                ch = grpc.aio.secure_channel(address, self.credentials, options=channel_options())
            else:
                ch = grpc.aio.insecure_channel(address, options=channel_options())
            self._channels[address] = ch
        return pb_grpc.PeerStub(ch)

    async def forget(self, address: str) -> None:
        """Close the channel to `address` (after a failure, so the next use reconnects fresh)."""
        ch = self._channels.pop(address, None)
        if ch is not None:
            await ch.close(grace=None)

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close(grace=None)
        self._channels.clear()
