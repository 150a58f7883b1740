"""gRPC streams: the data plane's fallback lane and the only one to outbound-only peers.

`push` carries a dialled lane's chunks (peer.lanes.network.DialedLane) on one PushChunks call:
inline in `data`, or, on the shared-memory lane, as `shm_name`/`shm_offset` pointers (the call
is the same, only the bytes travel apart), each chunk signed end to end when the receiver is
relayed (peer.lanes.relay). The call opens with the plan's ticket on its first chunk and the
signature metadata over it (`Transport.push_metadata`).

Outbound-only participants (docs/nat.md; nobody can dial them) get `ExchangeLane` (theirs, to
each owner: an Exchange call that brings the owner's reduced shards back) and `ReplyStream`
(an owner's, to them: chunks wait in the participant's `ReplyLane` for its Exchange call).

Failure semantics: a refused or broken call raises CollectiveError blaming the receiver (its
status, not grpc.aio's INTERNAL of a write that raced the call's end; the channel is forgotten
so the next use reconnects), or the relay when a check failed in transit.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np

from shoal.common.errors import ShoalError
from shoal.common.plan import Plan
from shoal.peer.dataplane import Inbox, ReplyLane, take_replies
from shoal.peer.lanes import relay
from shoal.peer.lanes.base import Body, CollectiveError, Placement
from shoal.peer.stream_end import StreamEnd
from shoal.v1 import shoal_pb2 as pb

SEND_QUEUE_CHUNKS = 16


def inline(msg: pb.Chunk, body: Body) -> int:
    """Put `body` into `msg.data` (a copy); the chunk bytes it counts for `bytes_sent`."""
    msg.data = body if isinstance(body, bytes) else body.tobytes()
    return len(msg.data) + len(msg.scale)


async def push(lane, msg: pb.Chunk) -> None:
    """Write `msg`, then `lane.queue` until None, on one PushChunks call to `lane.address`;
    then give the lane's shared-memory writers back (a completed stream) or close them."""
    call, end, written, t0 = None, None, 0, 0.0
    try:
        busy_bytes, busy_s = 0, 0.0  # written while more chunks were queued behind (peer.links)
        while msg is not None:
            if call is None:  # the stream opens with the ticket, signed with the first chunk
                msg.ticket = lane.plan.ticket
            if lane.relay:  # before the first chunk's stream signature, which covers it
                lane.transport.sign_relayed(msg)
            if call is None:
                call = lane.transport.stub(lane.address, lane.peer_id).PushChunks(
                    timeout=lane.timeout, metadata=lane.transport.push_metadata(msg))
                end = StreamEnd(call)
                t0 = time.perf_counter()
            queued, tw = not lane.queue.empty(), time.perf_counter()
            await call.write(msg)
            written += 1
            if queued and lane.solo:
                busy_bytes, busy_s = busy_bytes + len(msg.data), busy_s + time.perf_counter() - tw
            msg = await lane.queue.get()
        if call is not None:
            await call.done_writing()
            ack = await call  # the receiver took every chunk: the writer may be reused
            if lane.relay:
                relay.check_ack(lane.relay, lane.peer_id, ack.chunks, written)
            if lane.links is not None and lane.lane != "shm":  # shared memory says nothing of links
                lane.links.observe_send(lane.peer_id, lane.bytes_sent, time.perf_counter() - t0,
                                        busy_bytes=busy_bytes, busy_seconds=busy_s)
        for w in lane.end_shared():
            lane.transport.give_back_writer(lane.address, w)
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
        # InvalidStateError: a write after the call had ended (its status says why). Both come
        # only from the call's own methods: `call` and `end` exist here.
        raise await _failed(lane, end, exc) from None
    finally:
        for w in lane.end_shared():  # a failed stream: its slabs are never written again
            w.close()


async def _failed(lane, end: StreamEnd, exc: Exception) -> CollectiveError:
    """The CollectiveError of a PushChunks call that failed with `exc`."""
    rpc_error = exc if isinstance(exc, grpc.aio.AioRpcError) else None
    code, details = await end.status(rpc_error)
    if rpc_error is not None:
        await lane.transport.forget(lane.address)
    return (relay.altered(lane.relay, lane.peer_id, details) or relay.down(lane.relay, lane.peer_id, code.name, details)
            or CollectiveError(f"stream to {lane.peer_id[:8]} failed: {code.name} {details}", [lane.peer_id]))


class ExchangeLane:
    """An outbound-only peer's lane to a shard owner (docs/nat.md): its chunks go out on an
    Exchange call it opens, and the owner's reduced shards come back on the same call
    (`take_replies` checks and delivers them into this peer's inbox). Chunks travel inline.

    Failure: a broken call fails every wait on the owner at once and raises CollectiveError
    naming every owner this peer exchanges with (`owners`): when this peer's own link broke (its
    NAT forgot the mapping) all its calls break at once and the coordinator's blame sees a peer
    cut off from the others (coordinator.blame), while an owner that died is blamed by its
    silence. A reply that fails a check raises CollectiveError blaming its owner alone.
    """

    def __init__(self, transport, address: str, peer_id: str, plan: Plan, timeout: float,
                 inbox: Inbox, owners: tuple[str, ...], links=None):
        self.transport, self.address, self.peer_id = transport, address, peer_id
        self.plan, self.timeout, self.links = plan, timeout, links
        self.inbox, self.owners = inbox, owners
        self.queue: asyncio.Queue[pb.Chunk | None] = asyncio.Queue(SEND_QUEUE_CHUNKS)
        self.bytes_sent = 0
        self.lane = "socket"

    async def send(self, chunk: pb.Chunk, body: Body, placed: Placement | None = None) -> None:
        self.bytes_sent += inline(chunk, body)
        await self.queue.put(chunk)

    async def close(self) -> None:
        await self.queue.put(None)

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
            exc = group.exceptions[0]
            while isinstance(exc, BaseExceptionGroup):
                exc = exc.exceptions[0]
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


class ReplyStream:
    """A shard owner's lane to an outbound-only participant (docs/nat.md): nobody dials that
    participant, so its chunks wait in its `ReplyLane` for the Exchange call it opened, which
    carries them back (peer.dataplane `PeerService.Exchange`). Chunks travel inline.

    Failure (CollectiveError blaming the participant): its call ended before taking every chunk;
    a chunk waits longer than the plan's chunk deadline for room in the lane, or the last one for
    the call to take it (a participant whose link died, e.g. its NAT forgot the mapping, takes
    nothing, and the owner must vote within the blame window). `run` returns at once when
    nothing was ever sent (an empty shard: the participant may never open a call for it).
    """

    def __init__(self, lane: ReplyLane, peer_id: str, plan: Plan):
        self.lane, self.peer_id, self.plan = lane, peer_id, plan
        self.bytes_sent = 0
        self.sent_any = False
        self._first_put = asyncio.Event()  # a chunk or the end was queued
        self._closed = asyncio.Event()  # the end was queued

    async def send(self, chunk: pb.Chunk, body: Body, placed: Placement | None = None) -> None:
        """Queue a reply (`placed` is ignored: replies are inline)."""
        await self._put(chunk, body)

    async def close(self) -> None:
        await self._put(None, None)

    async def _put(self, msg: pb.Chunk | None, body: Body | np.ndarray | None) -> None:
        self._first_put.set()
        if self.lane.done.done() and not self.lane.done.result():
            raise CollectiveError(f"exchange with {self.peer_id[:8]} broke", [self.peer_id])
        if msg is not None:
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
