"""Collectives over gRPC streams: butterfly (direct) all-reduce and ring all-reduce.

Both are reduce-scatter followed by all-gather, pipelined per chunk: a chunk is forwarded as
soon as it is reduced, never store-and-forward of a whole shard. Each tensor shard has exactly
one peer that produces its final value (the shard owner in the butterfly, the last hop of the
ring) and everyone else receives those exact bytes, so every participant ends with a
bit-identical result (checked by the digest vote).

This module is the stream loop: it opens the streams (`_Stream`), sends chunks, feeds the chunks
it receives to the pure parts, publishes reduced shards and assembles the result. The parts:
`peer.partition.ShardPartition` (shards, chunks, who sends what to whom), `peer.reduction`
(`OwnerAccumulator`: a shard owner's rows and their reduction; `final_encoding`) and
`peer.audit.OwnerAudit` (an auditor's recomputation and verdict). One butterfly attempt is a
`_Butterfly` (tasks: scatter, reduce the owned shards, audit, gather), one ring attempt a `_Ring`.

Failure semantics (all collectives): the caller's input array is never modified. On any failure
(a stream to a peer breaks, a chunk does not arrive within `chunk_timeout_seconds`, the whole
collective exceeds `deadline_seconds`, a peer sends malformed data) the coroutine raises
`CollectiveError` naming the peers it suspects; nothing partial is returned, and the caller
votes "failed" so the coordinator aborts and retries the round without the suspects.

Aggregation and compression. In the butterfly, a shard owner may run an `OwnerReducer` (robust
aggregator, norm bound, DP noise; see peer.reduction) on the contributions in place of the sum;
for distance-based aggregators the owners first exchange their shard's partial (p, p) distance
matrix (phase DISTANCES) and sum them in shard order, so every owner selects the same rows.
`plan.compression` encodes chunks per hop (peer.compression): a sender compresses its own
contribution (with error feedback when given an `ErrorFeedback`, whose updates the caller applies
only after the round commits: `CollectiveResult.feedback`); the peer that produces a shard's
final value encodes it once, keeps the decoding of its own encoding, and everyone else receives
(and relays) those same bytes. A peer receiving a non-finite value where only finite ones can be
(a partial sum on the ring, a reduced shard) blames the sender, so a NaN never enters a result.

References: ring all-reduce (Patarasuk & Yuan 2009, as in Horovod/NCCL); butterfly/direct
all-reduce with owner-side reduction (hivemind's AllReduceRunner, Ryabinin et al. 2021).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from shoal.common.errors import InvalidArgument, ShoalError
from shoal.common.plan import Plan
from shoal.common.relaying import RELAY_ALTERED
from shoal.common.tensors import dtype_code, result_digest
from shoal.peer import faults, tcplane
from shoal.peer.audit import AuditVerdict, OwnerAudit
from shoal.peer.compression import Encoded, ErrorFeedback, codec_id, decode, encode
from shoal.peer.dataplane import SHARED_POOL, Inbox, Payload, ReplyLane, SenderGone, Transport, take_replies
from shoal.peer.partition import ChunkSpan, ShardPartition
from shoal.peer.reduction import OwnerAccumulator, OwnerReducer, distance_matrix, final_encoding
from shoal.peer.result_digest import ResultDigest
from shoal.peer.shm import MAX_SEGMENT_BYTES, SegmentWriter, release
from shoal.peer.stream_end import StreamEnd
from shoal.v1 import shoal_pb2 as pb

log = logging.getLogger("shoal.peer.collectives")

RS, AG, DIST = pb.REDUCE_SCATTER, pb.ALL_GATHER, pb.DISTANCES
SEND_QUEUE_CHUNKS = 16
# Shared-memory reduce-scatter chunks whose consumption the receiver signals (`_Laps`): the bytes
# of one lap (or one chunk, if larger); a stream's slabs hold at most two laps, whatever the
# tensor and chunk size. In bytes, not chunks, so that a lap writer fits every chunk size: the
# warm-up round (1 MiB chunks, lanes not yet reported) leaves the slabs that the next rounds
# (4 MiB chunks on the lane) reuse, instead of each new chunk size growing new ones.
LAP_BYTES = 16 << 20

__all__ = ["CollectiveError", "CollectiveResult", "OwnerReducer", "all_reduce"]


class CollectiveError(Exception):
    """A collective attempt failed; `suspects` are the peer ids blamed for it; `audit` marks an
    owner audit that failed (suspects: the owner and the auditor); `relay` names the relay that
    altered a chunk (its end-to-end signature failed, a message no longer decodes, the receiver
    took fewer chunks than were written, or one stalled in an open stream; docs/nat.md): no peer
    is to blame."""

    def __init__(self, message: str, suspects: Sequence[str] = (), *, audit: bool = False, relay: str = ""):
        super().__init__(message)
        self.suspects = tuple(suspects)
        self.audit = audit
        self.relay = relay


@dataclass(frozen=True)
class CollectiveResult:
    """values: (n,) array, same dtype as the input; digest: `shoal.common.tensors.result_digest` of it
    (32 bytes, the vote digest); seconds: the whole collective, digest included."""

    values: np.ndarray
    digest: bytes
    bytes_sent: int
    seconds: float
    flagged: tuple[str, ...] = ()
    # Error-feedback updates (key, compensated, decoded) to apply once the round commits.
    feedback: tuple[tuple[object, np.ndarray, np.ndarray], ...] = ()


class _Codec:
    """Per-hop encoding of one collective attempt (see the module docstring)."""

    def __init__(self, name: str, dtype: np.dtype, feedback: ErrorFeedback | None):
        self.on = codec_id(name) != 0 and dtype == np.float32
        self.name = name if self.on else "none"  # what final values are encoded with
        self.feedback = feedback
        self.pending: list[tuple[object, np.ndarray, np.ndarray]] = []

    def own(self, key: Hashable, values: np.ndarray) -> Payload:
        """Encode this peer's contribution (error-compensated); the decoding is kept for feedback."""
        if not self.on:
            return values
        c = self.feedback.compensate(key, values) if self.feedback is not None else values
        if self.name == "int8" and not np.isfinite(c).all():
            return values  # int8 cannot carry NaN/inf: sent raw, and the owner rejects it
        enc = encode(c, self.name)
        if self.feedback is not None:
            self.pending.append((key, c, decode(enc)))
        return enc

    def final(self, values: np.ndarray) -> tuple[Payload, np.ndarray]:
        """Encode a final shard value once: (what is sent, what this peer keeps = what others decode)."""
        return final_encoding(values, self.name)


class _Laps:
    """A stream's shared-memory chunks whose consumption the collective can await (`credit(key)`
    returns once the receiver consumed chunk `key`), written in two alternating laps of at most
    `lap_bytes` bytes each (at least one chunk), each lap in its own writer (from `take()`, one
    slab of `lap_bytes`): a lap's slab is rewritten (rewound) only once every chunk written
    there in its previous turn was consumed, so the slabs hold at most 2 x `lap_bytes` however
    large the tensor, and a receiver never reads a rewritten chunk. `credit` raises what the
    collective raises for a receiver that never consumes (CollectiveError at the chunk
    deadline)."""

    def __init__(self, take, credit, lap_bytes: int = LAP_BYTES):
        self.take, self.credit, self.lap_bytes = take, credit, lap_bytes
        self.writers: list[SegmentWriter] = []
        self.keys: tuple[list, list] = ([], [])  # per lap: the chunks written in its current turn
        self.used = [0, 0]  # per lap: bytes written in its current turn
        self.lap = 0
        self.closed = False  # the stream ended: its writers went back or were closed

    async def put(self, key: Hashable, body) -> tuple[str, int]:
        """Write `body` (chunk `key`) into the current lap; (segment name, offset)."""
        n = memoryview(body).nbytes
        if self.keys[self.lap] and self.used[self.lap] + n > self.lap_bytes:
            self.lap ^= 1
            for k in self.keys[self.lap]:  # the other lap's last turn: consumed before it is rewritten
                await self.credit(k)
            self.keys[self.lap].clear()
            self.used[self.lap] = 0
            if self.lap < len(self.writers):
                self.writers[self.lap].rewind()
        if self.closed:
            raise CollectiveError("stream closed while a chunk waited for room")
        if self.lap == len(self.writers):
            self.writers.append(self.take())
        self.keys[self.lap].append(key)
        self.used[self.lap] += n
        return self.writers[self.lap].put(body)


class _Stream:
    """One outgoing PushChunks stream, fed through a bounded queue by the collective.

    `put` fixes where a chunk's bytes come from: inline in `data` (a copy), or, on the shared-memory lane (a co-located receiver, see peer.shm
    and `Transport.shm_lane`), pointed at where they already are in a shared segment (`placed`:
    the result buffer, `_Result`, or an owner's shared slabs), else copied once into a segment of
    a writer reused across streams (reduce-scatter chunks of a bounded butterfly in `_Laps`), or,
    on the bulk lane (a receiver on another host, peer.tcplane, `Transport.bulk_lane`), written
    from where they are (`tcplane.ChunkFrame`: like the shared-memory lane's `placed`, this relies
    on the collective not writing them before they left) on a raw TCP connection. With neither,
    the stream is PushChunks.
    """

    def __init__(self, transport: Transport, address: str, peer_id: str, plan: Plan, timeout: float,
                 links=None):
        self.transport, self.address, self.peer_id = transport, address, peer_id
        self.plan, self.timeout = plan, timeout
        self.queue: asyncio.Queue[pb.Chunk | None] = asyncio.Queue(SEND_QUEUE_CHUNKS)
        self.bytes_sent = 0
        self.links = links  # peer.links.LinkMeter: one passive upload sample per stream
        self.solo = False  # the sender's only stream (ring): its goodput while queued is the link's
        self.lane: str | None = None  # "shm", "tcp" or "socket", chosen at the first chunk
        self._choosing = asyncio.Lock()
        self.shm_open = False  # on the shared-memory lane, until the stream ended
        self.writer: SegmentWriter | None = None  # taken at its first chunk: bounded streams may need none
        self.laps: _Laps | None = None  # reduce-scatter chunks on the shared-memory lane, when `bound`
        # Through a relay (docs/nat.md): every chunk signed end to end, never shared memory.
        self.relay = plan.relay_of(plan.position(peer_id)) if plan.relays else ""
        self.bulk: tcplane.BulkConnection | None = None

    def bound(self, credit, lap_bytes: int) -> None:
        """Write this stream's reduce-scatter chunks on the shared-memory lane in `_Laps` of
        `lap_bytes` whose `credit((shard, offset))` returns once the receiver consumed that chunk
        (the caller guarantees that every such chunk's consumption can be awaited without this
        stream's sender waiting on anything else)."""
        self.laps = _Laps(lambda: self.transport.take_writer(self.address, lap_bytes), credit, lap_bytes)

    async def put(self, item: tuple[pb.Chunk, bytes | np.ndarray] | None, placed=None) -> None:
        """Queue (chunk without data, its bytes), or None to close the stream. `placed` (optional):
        a callable returning (segment name, offset) of the same bytes already written into a
        shared-memory segment (`_SharedChunks`), used instead of copying them again on that lane."""
        if item is None:
            await self.queue.put(None)
            return
        msg, body = item
        async with self._choosing:  # scatter and publish may both open the stream (butterfly)
            if self.lane is None:
                shared = not self.relay and await self.transport.shm_lane(self.address, self.peer_id)
                self.shm_open = shared
                # A relayed participant is reached through its relay's gRPC splice only (the relay
                # forwards one port, and every chunk must carry its end-to-end signature).
                direct = not shared and not self.relay
                self.bulk = await self.transport.bulk_lane(self.address, self.peer_id) if direct else None
                self.lane = "shm" if shared else "tcp" if self.bulk is not None else "socket"
                if self.bulk is not None:
                    msg.ticket = self.plan.ticket  # the first chunk opens the stream (see _run_bulk)
        if self.lane == "tcp":
            # Not copied: the collectives never write these bytes before the stream wrote them
            # (a ring's partial sum changes only when its final value comes back, after the
            # successor took the partial; final values, the caller's input and encodings never).
            frame = tcplane.ChunkFrame(msg, body)
            self.bytes_sent += frame.payload.nbytes + len(msg.scale)
            await self.queue.put((msg, frame))
            return
        if self.lane == "shm":
            if not self.shm_open:
                raise CollectiveError(f"stream to {self.peer_id[:8]} closed", [self.peer_id])
            try:
                if placed is not None:
                    msg.shm_name, msg.shm_offset = placed()
                elif self.laps is not None and msg.phase == RS:
                    msg.shm_name, msg.shm_offset = await self.laps.put((msg.shard, msg.offset), body)
                else:
                    if self.writer is None:
                        self.writer = self.transport.take_writer(self.address)
                    msg.shm_name, msg.shm_offset = self.writer.put(body)
            except OSError as exc:  # e.g. /dev/shm full: this and every later chunk inline
                self.transport.lane_failed(self.address, exc)
                self.lane = "socket"
        if self.lane != "shm":
            msg.data = body if isinstance(body, bytes) else body.tobytes()
        self.bytes_sent += (len(body) if isinstance(body, bytes) else body.nbytes) + len(msg.scale)
        await self.queue.put(msg)

    async def run(self) -> None:
        try:
            msg = await self.queue.get()
        except BaseException:  # cancelled before the first chunk: a connection put chose is not used
            if self.bulk is not None:
                self.bulk.close()
            raise
        if isinstance(msg, tuple):  # the bulk lane (put chose it)
            await self._run_bulk(msg)
            return
        call = None
        written = 0
        try:
            busy_bytes, busy_s = 0, 0.0  # written while more chunks were queued behind (peer.links)
            while msg is not None:
                if call is None:  # the stream opens with the ticket, signed with the first chunk
                    msg.ticket = self.plan.ticket
                if self.relay:  # before the first chunk's stream signature, which covers it
                    self.transport.sign_relayed(msg)
                if call is None:
                    call = self.transport.stub(self.address, self.peer_id).PushChunks(
                        timeout=self.timeout, metadata=self.transport.push_metadata(msg))
                    end = StreamEnd(call)
                    t0 = time.perf_counter()
                queued, tw = not self.queue.empty(), time.perf_counter()
                await call.write(msg)
                written += 1
                if queued and self.solo:
                    busy_bytes, busy_s = busy_bytes + len(msg.data), busy_s + time.perf_counter() - tw
                msg = await self.queue.get()
            if call is not None:
                await call.done_writing()
                ack = await call  # the receiver took every chunk: the writer may be reused
                if self.relay and ack.chunks != written:
                    # A changed gRPC length prefix can make the receiver's gRPC end the call
                    # cleanly without the last message: nobody sees an error, the receiver
                    # waits out the chunk deadline and would blame this (healthy) sender.
                    raise CollectiveError(f"relay {self.relay} lost chunks to {self.peer_id[:8]}: it took "
                                          f"{ack.chunks} of the {written} written: {RELAY_ALTERED}",
                                          relay=self.relay)
                if self.links is not None and self.lane != "shm":  # shared memory says nothing of links
                    self.links.observe_send(self.peer_id, self.bytes_sent, time.perf_counter() - t0,
                                            busy_bytes=busy_bytes, busy_seconds=busy_s)
            for w in self._writers():
                self.transport.give_back_writer(self.address, w)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            # The receiver's status, not grpc.aio's INTERNAL of a write that raced the call's end;
            # InvalidStateError: a write after the call had ended (its status says why).
            # (Both come only from the call's own methods: `call` and `end` exist here.)
            rpc_error = exc if isinstance(exc, grpc.aio.AioRpcError) else None
            code, details = await end.status(rpc_error)
            if rpc_error is not None:
                await self.transport.forget(self.address)
            if self.relay and RELAY_ALTERED in details:  # did a check fail in transit?
                raise CollectiveError(f"relay {self.relay} altered a chunk to {self.peer_id[:8]}: {details}",
                                      relay=self.relay) from None
            raise CollectiveError(f"stream to {self.peer_id[:8]} failed: {code.name} {details}",
                                  [self.peer_id]) from None
        finally:
            for w in self._writers():  # a failed stream: its slabs are never written again
                w.close()

    def _writers(self) -> list[SegmentWriter]:
        """End the shared-memory side of the stream: its writers, to give back or close."""
        out = [self.writer] if self.writer is not None else []
        if self.laps is not None:
            self.laps.closed = True
            out += self.laps.writers
        self.shm_open, self.writer, self.laps = False, None, None
        return out

    async def _run_bulk(self, item: tuple[pb.Chunk, memoryview]) -> None:
        """Write the queued frames on the bulk connection; fails like a PushChunks stream:
        CollectiveError blaming the receiver when it refuses or the connection breaks."""
        conn, peer = self.bulk, self.peer_id
        assert conn is not None
        t0 = time.perf_counter()
        busy = [0, 0.0, 0.0, 0]  # bytes and seconds written while more were queued; last start, last size

        async def frames():
            nonlocal item
            if busy[3]:
                busy[0], busy[1], busy[3] = busy[0] + busy[3], busy[1] + time.perf_counter() - busy[2], 0
            nxt, item = item, None
            nxt = nxt if nxt is not None else await self.queue.get()
            if nxt is not None and self.solo and not self.queue.empty():
                busy[2], busy[3] = time.perf_counter(), len(nxt[1])
            return nxt

        try:
            header, frame = item
            if not header.ticket:  # another chunk won the race to the queue: it opens the stream
                header.ticket = self.plan.ticket
                item = (header, tcplane.ChunkFrame(header, frame.payload))
            await conn.send_stream(frames, self.transport.bulk_metadata)
        except tcplane.BulkRefused as exc:
            raise CollectiveError(f"stream to {peer[:8]} failed: {exc.code} {exc.message}", [peer]) from None
        except OSError as exc:
            await self.transport.forget(self.address)
            raise CollectiveError(f"stream to {peer[:8]} failed: bulk lane broke: {exc}", [peer]) from None
        finally:
            self.transport.give_back_bulk(self.address, conn)
        if self.links is not None:
            self.links.observe_send(peer, self.bytes_sent, time.perf_counter() - t0,
                                    busy_bytes=busy[0], busy_seconds=busy[1])


class _Exchange(_Stream):
    """An outbound-only peer's stream to a shard owner (docs/nat.md): its chunks go out on an
    Exchange call it opens, and the owner's reduced shards come back on the same call
    (`take_replies` checks and delivers them into this peer's inbox). Always the socket lane.

    Failure: a broken call fails every wait on the owner at once and raises CollectiveError
    naming every owner this peer exchanges with (`owners`): when this peer's own link broke (its
    NAT forgot the mapping) all its calls break at once and the coordinator's blame sees a peer
    cut off from the others (coordinator.blame), while an owner that died is blamed by its
    silence. A reply that fails a check raises CollectiveError blaming its owner alone.
    """

    def __init__(self, transport: Transport, address: str, peer_id: str, plan: Plan, timeout: float,
                 inbox: Inbox, owners: tuple[str, ...], links=None):
        super().__init__(transport, address, peer_id, plan, timeout, links)
        self.inbox, self.owners = inbox, owners
        self.lane = "socket"

    async def run(self) -> None:
        first = await self.queue.get()
        if first is None:
            return
        first.ticket = self.plan.ticket
        call = self.transport.stub(self.address, self.peer_id).Exchange(
            timeout=self.timeout, metadata=self.transport.exchange_metadata(first))
        end = StreamEnd(call)
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._write(call, first))
                tg.create_task(take_replies(call, self.inbox, self.transport.reply_verifier, self.peer_id))
        except BaseExceptionGroup as group:
            exc = next(iter(_flatten(group)))
            self.inbox.fail_sender(self.plan.round, self.plan.attempt, self.peer_id, f"exchange broke: {exc}")
            if isinstance(exc, grpc.aio.AioRpcError):
                code, details = await end.status(exc)  # not grpc.aio's INTERNAL of a racing write
                await self.transport.forget(self.address)
                raise CollectiveError(f"exchange with {self.peer_id[:8]} failed: {code.name} {details}",
                                      [self.peer_id, *(o for o in self.owners if o != self.peer_id)]) from None
            if isinstance(exc, ShoalError):
                raise CollectiveError(f"reply from {self.peer_id[:8]} refused: {exc}", [self.peer_id]) from None
            raise

    async def _write(self, call, msg: pb.Chunk) -> None:
        t0 = time.perf_counter()
        while msg is not None:
            await call.write(msg)
            msg = await self.queue.get()
        await call.done_writing()
        if self.links is not None:
            self.links.observe_send(self.peer_id, self.bytes_sent, time.perf_counter() - t0)


class _Reply:
    """A shard owner's stream to an outbound-only participant (docs/nat.md): nobody dials that
    participant, so its chunks wait in its `ReplyLane` for the Exchange call it opened, which
    carries them back (peer.dataplane `PeerService.Exchange`). Same `put`/`run` as `_Stream`.

    Failure (CollectiveError blaming the participant): its call ended before taking every chunk;
    a chunk waits longer than the plan's chunk deadline for room in the lane, or the last one for
    the call to take it (a participant whose link died, e.g. its NAT forgot the mapping, takes
    nothing, and the owner must vote within the blame window). `run` returns at once when
    nothing was ever put (an empty shard: the participant may never open a call for it).
    """

    def __init__(self, lane: ReplyLane, peer_id: str, plan: Plan):
        self.lane, self.peer_id, self.plan = lane, peer_id, plan
        self.bytes_sent = 0
        self.sent_any = False
        self._first_put = asyncio.Event()  # a chunk or the closing None was put
        self._closed = asyncio.Event()  # the closing None was put

    async def put(self, item: tuple[pb.Chunk, bytes | np.ndarray] | None, placed=None) -> None:
        """As `_Stream.put`; `placed` is ignored (replies are inline)."""
        self._first_put.set()
        if self.lane.done.done() and not self.lane.done.result():
            raise CollectiveError(f"exchange with {self.peer_id[:8]} broke", [self.peer_id])
        msg: pb.Chunk | None = None
        if item is not None:
            msg, body = item
            msg.data = body if isinstance(body, bytes) else body.tobytes()
            if not self.sent_any:  # the owner's ticket on its first reply (checked by take_replies)
                msg.ticket = self.plan.ticket
                self.sent_any = True
            self.bytes_sent += len(msg.data) + len(msg.scale)
        try:
            async with asyncio.timeout(self.plan.chunk_timeout_seconds):
                await self.lane.queue.put(msg)
        except TimeoutError:
            raise CollectiveError(f"{self.peer_id[:8]} took no reply within {self.plan.chunk_timeout_seconds:.1f}s",
                                  [self.peer_id]) from None
        if msg is None:
            self._closed.set()

    async def run(self) -> None:
        await self._first_put.wait()
        if not self.sent_any:
            return
        await self._closed.wait()
        try:
            async with asyncio.timeout(self.plan.chunk_timeout_seconds):
                delivered = await asyncio.shield(self.lane.done)
        except TimeoutError:
            delivered = False
        if not delivered:
            raise CollectiveError(f"exchange with {self.peer_id[:8]} ended before the reduced shards", [self.peer_id])


class _Wire:
    """One attempt's chunks as this peer sees them: the headers it sends, the chunks it awaits.

    Every wait is bounded by the plan's `chunk_timeout_seconds`; a chunk that does not come, a
    broken stream and a malformed chunk raise CollectiveError blaming its sender.
    """

    def __init__(self, plan: Plan, me: str, inbox: Inbox):
        self.plan, self.me, self.inbox = plan, me, inbox

    def message(self, phase: int, step: int, shard: int, off: int,
                values: Payload) -> tuple[pb.Chunk, bytes | np.ndarray]:
        """A new chunk header (data left for `_Stream.put`, which fills it in) and its bytes."""
        plan = self.plan
        if isinstance(values, Encoded):
            return pb.Chunk(round=plan.round, attempt=plan.attempt, sender=self.me, phase=phase, step=step,
                            shard=shard, offset=off, dtype=pb.FLOAT32, shape=[values.count], scale=values.scale,
                            codec=values.codec), values.data
        return pb.Chunk(round=plan.round, attempt=plan.attempt, sender=self.me, phase=phase, step=step, shard=shard,
                        offset=off, dtype=dtype_code(values.dtype), shape=[values.size]), np.ascontiguousarray(values)

    def post(self, phase: int, step: int, span: ChunkSpan, sender: str, dest: np.ndarray) -> None:
        """Let the chunk `sender` sends at (phase, step, span) be read straight into `dest`
        (`Inbox.post`): the collective's own slice of its result, written by nothing else."""
        plan = self.plan
        self.inbox.post((plan.round, plan.attempt, phase, step, span.shard, span.offset, sender), dest)

    async def arrived(self, phase: int, step: int, shard: int, off: int, sender: str) -> None:
        """Return once the chunk `sender` sends this peer at (phase, step, shard, offset) arrived
        (taken or not); fails as `payload` does."""
        await self.payload(phase, step, shard, off, sender, take=False)

    async def payload(self, phase: int, step: int, shard: int, off: int, sender: str,
                      take: bool = True) -> Payload:
        """The chunk `sender` sends this peer at (phase, step, shard, offset), as it arrived."""
        plan = self.plan
        try:
            key = (plan.round, plan.attempt, phase, step, shard, off, sender)
            if not take:
                return await self.inbox.arrived(key, plan.chunk_timeout_seconds)
            return await self.inbox.get(key, plan.chunk_timeout_seconds)
        except TimeoutError:
            where = f"(phase {phase}, step {step}, shard {shard}, offset {off})"
            relay = plan.relay_of(plan.position(self.me))
            if relay and self.inbox.streaming(plan.round, plan.attempt, sender):
                # Its stream reaches this peer through the relay and is open, yet the chunk did
                # not come: a relay that changed a gRPC length prefix leaves the message waiting
                # for bytes that never come, with no error at either end (docs/nat.md, "Relays").
                raise CollectiveError(f"relay {relay}: no chunk from {sender[:8]} within "
                                      f"{plan.chunk_timeout_seconds:.1f}s {where} although its stream through "
                                      f"the relay is open: stalled in transit", relay=relay) from None
            raise CollectiveError(
                f"no chunk from {sender[:8]} within {plan.chunk_timeout_seconds:.1f}s {where}", [sender]) from None
        except SenderGone as exc:
            if RELAY_ALTERED in str(exc):  # the chunk changed on its way through this peer's relay
                relay = plan.relay_of(plan.position(self.me))
                raise CollectiveError(f"relay {relay}: {exc}", relay=relay) from None
            raise CollectiveError(str(exc), [sender]) from None

    async def received(self, phase: int, step: int, span: ChunkSpan, sender: str) -> tuple[Payload, np.ndarray]:
        """A reduce-scatter or all-gather chunk: as it arrived, and its decoded `(span.size,)` values.

        A raw payload may be a view of the sender's shared-memory slab (peer.shm): value checks
        (finiteness) belong on this peer's own copy, after the values were added or copied into it.
        """
        payload = await self.payload(phase, step, span.shard, span.offset, sender)
        v = _decoded(payload, sender)
        faults.hit("rs" if phase == RS else "ag", self.plan.round)
        if v.size != span.size:
            raise CollectiveError(f"chunk from {sender[:8]} has {v.size} elements", [sender])
        return payload, v

    async def values(self, phase: int, step: int, span: ChunkSpan, sender: str) -> np.ndarray:
        """The decoded `(span.size,)` values of a reduce-scatter or all-gather chunk (`received`)."""
        return (await self.received(phase, step, span, sender))[1]


def _decoded(payload: Payload, sender: str) -> np.ndarray:
    """Decode a received payload; raises CollectiveError blaming `sender` if malformed."""
    if isinstance(payload, Encoded):
        try:
            return decode(payload)
        except InvalidArgument as exc:
            raise CollectiveError(f"chunk from {sender[:8]} is malformed: {exc}", [sender]) from None
    return payload


class _Handoff:
    """Values one task of an attempt hands to another, by key (a future per key, made on first
    use). A wait is bounded by the collective's deadline, and ends when the TaskGroup fails."""

    def __init__(self) -> None:
        self._futures: dict[Hashable, asyncio.Future] = {}

    def _future(self, key: Hashable) -> asyncio.Future:
        if key not in self._futures:
            self._futures[key] = asyncio.get_running_loop().create_future()
        return self._futures[key]

    def put(self, key: Hashable, value: object) -> None:
        self._future(key).set_result(value)

    async def get(self, key: Hashable):
        return await self._future(key)


class _Contribution:
    """This peer's own rows, each chunk encoded once (its error feedback registered once).

    In an audited plan the owner uses its own row as the auditor sees it (encoded, then decoded),
    so that the auditor can recompute the aggregate exactly; otherwise the raw input.
    """

    def __init__(self, x: np.ndarray, codec: _Codec, audited: bool, me: str):
        self.x, self.codec, self.audited, self.me = x, codec, audited, me
        self._sent: dict[tuple[int, int], Payload] = {}

    def payload(self, span: ChunkSpan) -> Payload:
        key = (span.shard, span.offset)
        if key not in self._sent:
            self._sent[key] = self.codec.own(("bf", span.lo, span.hi), self.x[span.lo:span.hi])
        return self._sent[key]

    def row(self, span: ChunkSpan) -> np.ndarray:
        if not self.audited:
            return self.x[span.lo:span.hi]
        return _decoded(self.payload(span), self.me)


class _SharedChunks:
    """A shard owner's reduced chunks for its co-located receivers (the shared-memory lane),
    written once into one writer's slabs that all of them read: one copy per chunk instead of one
    per receiver, and 1/p of the tensor in slabs instead of (p-1)/p. The writer comes from the
    transport's shared pool (`take_writer(SHARED_POOL)`, its pages already touched) at the first
    chunk placed, and goes back by `finish(True)` only once every stream of the attempt completed
    (each receiver took every chunk, and reads them before its next vote: peer.shm); after a
    failure it is closed, never rewritten."""

    def __init__(self, transport: Transport):
        self.transport = transport
        self.writer: SegmentWriter | None = None
        self._placed: dict[tuple[int, int], tuple[str, int]] = {}

    def placement(self, key: tuple[int, int], body: bytes | np.ndarray):
        """A callable placing `body` (chunk `key` = (shard, offset)) once; (segment, offset)."""
        def place() -> tuple[str, int]:
            if key not in self._placed:
                if self.writer is None:
                    self.writer = self.transport.take_writer(SHARED_POOL)
                self._placed[key] = self.writer.put(body)
            return self._placed[key]
        return place

    def finish(self, ok: bool) -> None:
        if self.writer is not None:
            if ok:
                self.transport.give_back_writer(SHARED_POOL, self.writer)
            else:
                self.writer.close()
            self.writer = None


class _Result:
    """One attempt's result buffer `values` `(n,)` of x's dtype: in a shared-memory segment of
    this peer (`Transport.take_result`, reused once the array on it is gone) when the transport
    already reaches a participant through shared memory, so that chunks sent from it (an owner's
    aggregates, the ring's partial sums and relayed final chunks) need neither a slab nor a copy:
    `placement` says where they are. Else (no co-located participant, lanes not chosen yet,
    /dev/shm full, a tensor larger than a receiver maps) this process's memory. Receivers read it
    until they voted, and the segment is rewritten only once the array is gone, so in a later
    collective (as slabs are: peer.shm)."""

    def __init__(self, x: np.ndarray, plan: Plan, transport: Transport, copy: bool):
        self.name = ""
        lanes = transport.lanes()
        if (transport.shared_memory and 0 < x.nbytes <= MAX_SEGMENT_BYTES
                and any(lanes.get(a) == "shm" for a in plan.addresses)):
            try:
                self.name, self.values = transport.take_result(x.size, x.dtype)
            except OSError as exc:  # /dev/shm full: this process's memory, the chunks through slabs
                log.info("result buffer in this process's memory: %s", exc)
        if not self.name:
            take = getattr(transport, "take_buffer", None)
            self.values = take(x.size, x.dtype) if take is not None else np.empty_like(x)
        if copy:
            self.values[...] = x

    @property
    def private(self) -> bool:
        """Whether the buffer is in this process's memory, not a shared segment co-located
        receivers read. (It may be reused by a later collective too, `Transport.take_buffer`, but
        only once no array on it is alive: a bulk lane still reading into a place the inbox
        handed out holds a view of it.)"""
        return not self.name

    def placement(self, span: ChunkSpan, payload):
        """A callable giving (segment, byte offset) of `payload` when it is this buffer's own
        slice of `span` (so the shared-memory lane can point at it); None otherwise."""
        if not self.name or not isinstance(payload, np.ndarray) or payload.size != span.size:
            return None
        lo = span.lo * self.values.itemsize
        if payload.__array_interface__["data"][0] != self.values.__array_interface__["data"][0] + lo:
            return None
        return lambda: (self.name, lo)


def _lap_bytes(chunk_bytes: int, tensor_bytes: int, participants: int) -> int:
    """A lap's bytes for reduce-scatter chunks of at most `chunk_bytes` of a tensor of
    `tensor_bytes` shared by `participants`: the power of two that holds an even shard, at most
    `LAP_BYTES`, at least one chunk. Not from this round's shards: the planner moves shard
    bounds and owners from one round to the next, and a lap size that followed them would make
    new slabs (fresh pages) in rounds that differ only in a shard bound; nor from the chunk size
    alone, which changes once the lanes are known (the warm-up round's chunks are smaller)."""
    even = -(-tensor_bytes // max(1, participants))
    return max(chunk_bytes, min(LAP_BYTES, 1 << max(0, even - 1).bit_length()))


def _into(dst: np.ndarray, src: np.ndarray) -> None:
    """`dst[:] = src`, skipped when `src` already is `dst` (a sum computed in place)."""
    if src.__array_interface__["data"][0] != dst.__array_interface__["data"][0] or src.shape != dst.shape:
        dst[...] = src


def _release(rows: Sequence[np.ndarray]) -> None:
    """Received chunks the collective consumed: their shared-memory pages leave this process's
    resident set (peer.shm.release; a no-op for chunks in this process's own memory)."""
    for r in rows:
        release(r)


@dataclass(frozen=True)
class _Outcome:
    """What one participant's collective produced: the result, its digest, bytes sent (on the
    wire) and received (uncompressed, for the link meter), and the rows its owners rejected."""

    values: np.ndarray
    digest: bytes
    sent: int
    received: int
    flagged: tuple[str, ...] = ()


class _Butterfly:
    """One butterfly attempt from one participant: direct reduce-scatter to the shard owners,
    owner-side reduction, direct all-gather; four tasks (`_scatter`, `_reduce_owned`, `_gather`,
    `_audit`) beside one task per outgoing stream, all in one TaskGroup.

    With `plan.audit_owners`, every peer also sends its part of shard k to the shard's auditor
    (the next owner, `Plan.auditors`), which recomputes the aggregate from the same rows and
    checks the owner's partial distance matrix (`peer.audit.OwnerAudit`); a difference blames the
    owner and the auditor (one of the two lies; both sit out the retry). A failed audit lets the
    collective finish (so that the other peers, seeing nothing wrong, vote normally and no broken
    stream shifts the blame to this auditor), then fails it. `tamper` (testing only,
    peer.byzantine "owner") corrupts what this peer publishes as owner.
    """

    def __init__(self, x: np.ndarray, plan: Plan, me: str, transport: Transport, inbox: Inbox,
                 reducer: OwnerReducer | None, codec: _Codec, links=None, tamper=None):
        self.part = part = ShardPartition(plan, me, x.itemsize)
        self.plan = plan
        self.me, self.dtype, self.wire = me, x.dtype, _Wire(plan, me, inbox)
        self.reducer, self.codec, self.tamper = reducer, codec, tamper
        self.with_distances = reducer is not None and reducer.needs_distances
        self.streams = {j: self._stream(j, transport, inbox, links) for j in range(part.size) if j != part.me}
        self.bounded = self._bound(transport)
        # Every element is written: own shards by the sums (or publish), the others by gather.
        self.result = _Result(x, plan, transport, copy=False)
        self.buf = self.result.values
        self.hashed = ResultDigest(self.buf)  # the vote digest, fed as chunks become final
        self.digest = b""  # set once the last chunk is hashed
        self.own = _Contribution(x, codec, plan.audit_owners, me)
        # The plain sum of an owned chunk is computed straight into its slice of the result.
        self.owned = OwnerAccumulator(part, part.owned, reducer, x.dtype, out=self.buf)
        self.shared = _SharedChunks(transport)
        if self.result.private and not codec.on:  # the all-gather's chunks read in place (`_Wire.post`)
            for k in part.gathered:
                for span in part.chunks(k):
                    self.wire.post(AG, 0, span, part.peer_id(part.owner[k]), self.buf[span.lo:span.hi])
        self.audit = OwnerAudit(part, reducer, x.dtype, codec.name) if part.audited else None
        self.handoff = _Handoff()  # audited shards: the owners' distance matrices, the expected values
        self.mismatches: list[CollectiveError] = []

    def _stream(self, j: int, transport: Transport, inbox: Inbox, links) -> _Stream | _Reply:
        """The stream to participant j: dialled, or (docs/nat.md) the reply lane of an
        outbound-only one, or, from an outbound-only peer, an Exchange that brings replies back."""
        plan, peer = self.plan, self.part.peer_id(j)
        me_outbound = not plan.dialable(self.part.me)
        if not plan.dialable(j) and not me_outbound:
            return _Reply(inbox.reply_lane(plan.round, plan.attempt, peer), peer, plan)
        if me_outbound:
            owners = tuple(self.part.peer_id(o) for o in plan.owners())
            return _Exchange(transport, plan.addresses[j], peer, plan, plan.deadline_seconds, inbox, owners, links)
        return _Stream(transport, plan.addresses[j], peer, plan, plan.deadline_seconds, links)

    def _bound(self, transport: Transport) -> bool:
        """Bound the reduce-scatter slabs (`_Laps`) when every stream is on the shared-memory lane
        (chosen in an earlier round) and every chunk sent to an owner is consumed before the
        owner publishes that chunk's aggregate to this peer: the plain sum or a reducer without
        distances (which reduces chunk by chunk), no audit (an auditor publishes nothing),
        nobody outbound-only. The credit of a chunk is then the arrival of its aggregate."""
        plan, part = self.plan, self.part
        lanes = transport.lanes()
        if (self.with_distances or plan.audit_owners or plan.outbound_only or any(plan.relays)
                or any(type(st) is not _Stream or lanes.get(st.address) != "shm" for st in self.streams.values())):
            return False
        for j, st in self.streams.items():
            if j in plan.shard_owner:
                owner = part.peer_id(j)
                st.bound(lambda key, owner=owner: self.wire.arrived(AG, 0, key[0], key[1], owner),
                         _lap_bytes(part.chunk_elems * part.itemsize, part.num_elements * part.itemsize, part.size))
        return True

    async def run(self) -> _Outcome:
        ok = False
        try:
            async with asyncio.TaskGroup() as tg:
                for st in self.streams.values():
                    tg.create_task(st.run())
                tg.create_task(self._work())
            ok = True
        finally:
            self.shared.finish(ok)
        if self.mismatches:
            raise self.mismatches[0]
        flagged = tuple(sorted(self.part.peer_id(j) for j in self.owned.rejected))
        return _Outcome(self.buf, self.digest, sum(s.bytes_sent for s in self.streams.values()),
                        self.part.receives().total_bytes, flagged)

    async def _work(self) -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._scatter())
            tg.create_task(self._reduce_owned())
            tg.create_task(self._gather())
            if self.audit is not None:
                tg.create_task(self._audit())
        for st in self.streams.values():
            await st.put(None)
        self.digest = await self.hashed.finish()  # while the streams drain

    async def _scatter(self) -> None:
        """Send this peer's part of every shard to the shard's owner (and auditor): in the
        scatter order, or, with bounded slabs, one task per owner (a send that waits for its
        owner's credit must not hold back the chunks every other owner needs to give credit)."""
        if not self.bounded:
            await self._scatter_shards(self.part.scatter_order())
            return
        by_owner: dict[tuple[int, ...], list[int]] = {}
        for k in self.part.scatter_order():
            by_owner.setdefault(self.part.recipients(k), []).append(k)
        async with asyncio.TaskGroup() as tg:
            for shards in by_owner.values():
                tg.create_task(self._scatter_shards(shards))

    async def _scatter_shards(self, shards: Sequence[int]) -> None:
        for k in shards:
            targets = self.part.recipients(k)
            for span in self.part.chunks(k) if targets else ():
                payload = self.own.payload(span)
                for t in targets:
                    await self.streams[t].put(self.wire.message(RS, 0, k, span.offset, payload))

    async def _collect(self, acc: OwnerAccumulator, span: ChunkSpan) -> list[np.ndarray]:
        """Every participant's row of chunk `span` into `acc`, awaited in plan order; returns the
        received rows (to `_release` once `acc` no longer needs them)."""
        got = []
        for j in range(self.part.size):
            if j == self.part.me:
                acc.add(span, j, self.own.row(span))
            else:
                got.append(await self.wire.values(RS, 0, span, self.part.peer_id(j)))
                acc.add(span, j, got[-1])
        return got

    async def _reduce_owned(self) -> None:
        """Reduce and publish every chunk of the shards this peer owns, each as soon as its rows
        are in (with distances: once every owner's matrices are summed)."""
        if not self.part.owned:
            return  # a non-owner reduces nothing (and gets no distance matrices: owners send them to owners)
        spans = [span for k in self.part.owned for span in self.part.chunks(k)]
        if not self.with_distances:
            for span in spans:
                got = await self._collect(self.owned, span)
                red = self.owned.reduce(span)
                _release(got)
                await self._publish(span, red)
            return
        for span in spans:
            _release(await self._collect(self.owned, span))  # the reducer holds its own (p, m) copy
        total = await self._exchange_distances({k: self.owned.partial_distances(k) for k in self.part.owned})
        for span in spans:
            await self._publish(span, self.owned.reduce(span, total))

    async def _publish(self, span: ChunkSpan, red: np.ndarray) -> None:
        """Encode an owned chunk's aggregate once, keep its decoding, send it to everyone."""
        if self.tamper is not None:
            red = self.tamper(red)
        payload, final = self.codec.final(red.astype(self.dtype, copy=False))
        _into(self.buf[span.lo:span.hi], final)  # the plain sum is already there
        self.hashed.filled(span.lo, span.hi)
        place = None
        for st in self.streams.values():
            item = self.wire.message(AG, 0, span.shard, span.offset, payload)
            place = (place or self.result.placement(span, item[1])
                     or self.shared.placement((span.shard, span.offset), item[1]))
            await st.put(item, place)

    async def _exchange_distances(self, mine: dict[int, np.ndarray]) -> np.ndarray:
        """Send this owner's partial matrices to the other owners; sum every shard's in shard
        order (the same bytes on every owner). Hands the audited owners' matrices to `_audit`."""
        for k, d in mine.items():
            for o in self.part.other_owners():
                await self.streams[o].put(self.wire.message(DIST, 0, k, 0, np.ascontiguousarray(d, dtype="<f8")))
        p = self.part.size
        total = np.zeros((p, p), dtype=np.float64)
        for k, owner in enumerate(self.part.owner):
            matrix = mine[k] if owner == self.part.me else await self._distances_from(k, self.part.peer_id(owner))
            if k in self.part.audited:
                self.handoff.put(("distances", k), matrix)
            total = total + matrix
        self.handoff.put("total", total)
        return total

    async def _distances_from(self, k: int, sender: str) -> np.ndarray:
        values = _decoded(await self.wire.payload(DIST, 0, k, 0, sender), sender)
        try:
            return distance_matrix(values, self.part.size)
        except ValueError:
            raise CollectiveError(f"distance matrix from {sender[:8]} is malformed", [sender]) from None

    async def _audit(self) -> None:
        """Recompute every chunk of the shards this peer audits; hand each to `_gather`."""
        assert self.audit is not None
        for k in self.part.audited:
            total = await self._audit_distances(k) if self.with_distances else None
            for span in self.part.chunks(k):
                got = await self._collect(self.audit.rows, span) if not self.with_distances else []
                self.handoff.put(("expected", k, span.offset), self.audit.expected(span, total))
                _release(got)

    async def _audit_distances(self, k: int) -> np.ndarray:
        """Collect shard k's rows, check its owner's distance matrix; the summed matrix."""
        assert self.audit is not None
        for span in self.part.chunks(k):
            _release(await self._collect(self.audit.rows, span))  # the reducer's own (p, m) copy holds them
        self._note(self.audit.check_distances(k, await self.handoff.get(("distances", k))))
        return await self.handoff.get("total")

    async def _gather(self) -> None:
        """Receive every shard this peer does not own from its owner (checking the audited ones)."""
        for k in self.part.gathered:
            sender = self.part.peer_id(self.part.owner[k])
            for span in self.part.chunks(k):
                final = self.buf[span.lo:span.hi]
                values = await self.wire.values(AG, 0, span, sender)
                _into(final, values)  # (read in place when it came on the bulk lane)
                release(values)
                self.hashed.filled(span.lo, span.hi)
                # A robust owner never publishes a non-finite value; checked in this peer's memory.
                if self.reducer is not None and not np.isfinite(final).all():
                    raise CollectiveError(f"chunk from {sender[:8]} holds non-finite values", [sender])
                if self.audit is not None and k in self.part.audited:
                    expected = await self.handoff.get(("expected", k, span.offset))
                    self._note(self.audit.check_aggregate(span, final, expected))

    def _note(self, verdict: AuditVerdict) -> None:
        if not verdict.ok:
            self.mismatches.append(CollectiveError(verdict.message, [verdict.owner, self.me], audit=True))


class _Ring:
    """One ring attempt from one participant (Patarasuk & Yuan): p-1 reduce-scatter steps, each
    adding this peer's part to the partial sum from its predecessor and passing it on, then p-1
    all-gather steps relaying the final shards as received; one outgoing stream, to the successor."""

    def __init__(self, x: np.ndarray, plan: Plan, me: str, transport: Transport, inbox: Inbox, codec: _Codec,
                 links=None):
        self.part = part = ShardPartition(plan, me, x.itemsize)
        self.x, self.codec, self.wire = x, codec, _Wire(plan, me, inbox)
        # Not a copy of x: every element is written by a sum (x + the predecessor's partial) or by
        # its final value, chunk by chunk, so the first chunk leaves without a whole-tensor pass
        # (64 MB into fresh pages: 20-40 ms before the first byte on this machine).
        self.result = _Result(x, plan, transport, copy=False)
        self.buf = self.result.values
        self.hashed = ResultDigest(self.buf)  # the vote digest, fed as chunks become final
        self.digest = b""  # set once the last chunk is hashed
        self.prev = part.peer_id((part.me - 1) % part.size)
        nxt = (part.me + 1) % part.size
        self.out = _Stream(transport, plan.addresses[nxt], part.peer_id(nxt), plan, plan.deadline_seconds, links)
        self.out.solo = True
        if self.result.private and not codec.on:  # the all-gather's chunks read in place (`_Wire.post`)
            for s in range(part.size - 1):
                for span in part.chunks(part.ring_gathered(s)):
                    self.wire.post(AG, s, span, self.prev, self.buf[span.lo:span.hi])

    async def run(self) -> _Outcome:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.out.run())
            tg.create_task(self._schedule())
        return _Outcome(self.buf, self.digest, self.out.bytes_sent, self.out.bytes_sent)

    async def _schedule(self) -> None:
        part = self.part
        for span in part.chunks(part.ring_first()):
            await self._send(RS, 0, span)
        for s in range(part.size - 1):  # reduce-scatter
            for span in part.chunks(part.ring_reduced(s)):
                await self._add(s, span)
        for s in range(part.size - 1):  # all-gather
            for span in part.chunks(part.ring_gathered(s)):
                await self._relay(s, span)
        await self.out.put(None)
        self.digest = await self.hashed.finish()  # while the stream drains

    async def _send(self, phase: int, step: int, span: ChunkSpan, payload: Payload | None = None) -> None:
        if payload is None:  # reduce-scatter: this peer's partial sum, compressed per hop
            partial = self.buf[span.lo:span.hi]
            if phase == RS and step == 0:  # this peer's own part of its first shard
                if self.result.private:
                    partial = self.x[span.lo:span.hi]  # sent from the input (never written during the call)
                else:
                    partial[:] = self.x[span.lo:span.hi]  # into the shared result, which the lane points at
            payload = self.codec.own(("rs", span.lo, span.hi), partial)
        # From the result buffer itself when it is shared (peer.shm): the successor reads this
        # peer's partial sum or final chunk there; neither changes before the successor took it
        # (a partial is overwritten only by its final value, which exists only after every
        # later hop, the successor's first, consumed it).
        await self.out.put(self.wire.message(phase, step, span.shard, span.offset, payload),
                           self.result.placement(span, payload))

    async def _add(self, step: int, span: ChunkSpan) -> None:
        """Add the predecessor's partial sum of `span` to this peer's; pass it on, or, at the last
        step, encode the now final chunk once and start the all-gather with it."""
        partial = self.buf[span.lo:span.hi]
        values = await self.wire.values(RS, step, span, self.prev)
        np.add(self.x[span.lo:span.hi], values, out=partial)  # the predecessor's partial plus this peer's part
        release(values)
        # An honest peer never forwards a non-finite partial sum, so the first peer that sees one
        # blames its predecessor: the peer that introduced it. Checked on the sum in this peer's
        # memory (a received view may still change: peer.shm). A peer whose own input is
        # non-finite forwards it, and the next peer blames it.
        if not np.isfinite(partial).all() and np.isfinite(self.x[span.lo:span.hi]).all():
            raise CollectiveError(f"chunk from {self.prev[:8]} holds non-finite values", [self.prev])
        if step < self.part.size - 2:
            await self._send(RS, step + 1, span)
        else:
            payload, final = self.codec.final(partial)
            _into(partial, final)
            self.hashed.filled(span.lo, span.hi)
            await self._send(AG, 0, span, payload)

    async def _relay(self, step: int, span: ChunkSpan) -> None:
        """Take a final chunk from the predecessor; relay the exact bytes received (raw: this
        peer's copy of them) unless this is the last step."""
        payload, values = await self.wire.received(AG, step, span, self.prev)
        final = self.buf[span.lo:span.hi]
        _into(final, values)  # (read in place when it came on the bulk lane)
        release(values)
        self.hashed.filled(span.lo, span.hi)
        if not np.isfinite(final).all():  # checked in this peer's memory, as in the reduce-scatter
            raise CollectiveError(f"chunk from {self.prev[:8]} holds non-finite values", [self.prev])
        if step < self.part.size - 2:
            await self._send(AG, step + 1, span, payload if isinstance(payload, Encoded) else final)


async def all_reduce(x: np.ndarray, plan: Plan, *, me: str, transport: Transport, inbox: Inbox,
                     reducer: OwnerReducer | None = None, feedback: ErrorFeedback | None = None,
                     links=None, tamper=None) -> CollectiveResult:
    """Sum `x` (1-D, float32 or float16) across the plan's participants; see the module docstring.

    `reducer` (butterfly only) replaces the plain sum at the shard owner, e.g. a robust
    aggregator; its rejections come back as `flagged`. `feedback` is read (never written): the
    pending updates are returned in `CollectiveResult.feedback`. `links` (a peer.links.LinkMeter)
    receives the passive throughput of every outgoing stream and of the whole collective (see
    peer.links; measurement never changes the result). `tamper` (testing only: the "owner"
    attack of peer.byzantine) replaces what this peer publishes as a butterfly shard owner; an
    audited plan (`plan.audit_owners`) catches it. Returns the result and its digest.

    Raises ValueError for an `x` that is not 1-D, CollectiveError on any failure (every wait
    bounded by the plan's chunk timeout and the whole by its deadline); `x` and `feedback` are
    never modified.
    """
    t0 = time.monotonic()
    _check(x, plan, me)
    if len(plan.participants) == 1:
        return _alone(x, plan, reducer, t0)
    try:
        codec = _Codec(plan.compression, x.dtype, feedback)
    except InvalidArgument as exc:
        raise CollectiveError(f"plan: {exc}", []) from None
    out = await _attempt(x, plan, me, transport, inbox, reducer, codec, links, tamper)
    seconds = time.monotonic() - t0
    if links is not None:
        links.observe_collective(out.sent, out.received, seconds)
    return CollectiveResult(out.values, out.digest, out.sent, seconds, out.flagged, tuple(codec.pending))


def _check(x: np.ndarray, plan: Plan, me: str) -> None:
    if x.ndim != 1:
        raise ValueError(f"x: expected a 1-D array, got shape {x.shape}")
    if me not in plan.participants:
        raise CollectiveError(f"{me[:8]} is not a participant", [])
    if plan.outbound_only and (plan.collective != "butterfly" or set(plan.outbound_only) & set(plan.shard_owner)):
        raise CollectiveError("plan: outbound-only participants need the butterfly and own no shard", [])
    if len(plan.shard_bounds) != len(plan.shard_owner) + 1 or plan.shard_bounds[-1] != x.size:
        raise CollectiveError(f"plan shard_bounds {plan.shard_bounds[-1:]} do not cover {x.size} elements", [])


def _alone(x: np.ndarray, plan: Plan, reducer: OwnerReducer | None, t0: float) -> CollectiveResult:
    """A plan of one participant: its own input (reduced alone, when a reducer is given)."""
    out, flagged = x.copy(), ()
    if reducer is not None:
        red, rejected = reducer.reduce(x[None, :], 0, x.size, None)
        out, flagged = red.astype(x.dtype, copy=False), tuple(plan.participants[r] for r in rejected)
    return CollectiveResult(out, result_digest(out), 0, time.monotonic() - t0, flagged)


async def _attempt(x: np.ndarray, plan: Plan, me: str, transport: Transport, inbox: Inbox,
                   reducer: OwnerReducer | None, codec: _Codec, links, tamper) -> _Outcome:
    """Run the plan's collective within its deadline; the CollectiveErrors of its tasks become one."""
    try:
        async with asyncio.timeout(plan.deadline_seconds):
            await _choose_lanes(plan, me, transport)
            if plan.collective == "butterfly":
                return await _Butterfly(x, plan, me, transport, inbox, reducer, codec, links, tamper).run()
            if reducer is not None:
                raise CollectiveError("ring all-reduce supports only the sum; use butterfly for aggregators")
            return await _Ring(x, plan, me, transport, inbox, codec, links).run()
    except TimeoutError:
        raise CollectiveError(f"collective deadline of {plan.deadline_seconds:.1f}s passed", []) from None
    except BaseExceptionGroup as group:
        if any(isinstance(e, CollectiveError) for e in _flatten(group)):
            raise _first(group) from None
        raise


async def _choose_lanes(plan: Plan, me: str, transport: Transport) -> None:
    """Probe the shared-memory lane to every participant this peer's collective dials directly
    (the butterfly: all; the ring: its successor), now (cached: after the first attempt a
    lookup), so that the result buffer and the slab bounds know the lanes from the first attempt
    on, not only once a first stream chose them. A failed probe leaves the choice to the stream,
    as before."""
    pos = plan.position(me)
    if not transport.shared_memory or not plan.dialable(pos):
        return
    targets = range(plan.size) if plan.collective == "butterfly" else [(pos + 1) % plan.size]
    peers = [(plan.participants[i], plan.addresses[i]) for i in targets
             if i != pos and plan.dialable(i) and not plan.relay_of(i)]
    await asyncio.gather(*(transport.shm_lane(a, pid) for pid, a in peers), return_exceptions=True)


def _first(group: BaseExceptionGroup) -> CollectiveError:
    excs = [e for e in _flatten(group) if isinstance(e, CollectiveError)]
    suspects = tuple(dict.fromkeys(s for e in excs for s in e.suspects))
    relay = next((e.relay for e in excs if e.relay), "")
    return CollectiveError("; ".join(str(e) for e in excs[:3]), () if relay else suspects, relay=relay)


def _flatten(e: BaseException):
    if isinstance(e, BaseExceptionGroup):
        for sub in e.exceptions:
            yield from _flatten(sub)
    else:
        yield e
