"""The lanes over the network: which lane reaches each participant, per stream.

`DataLanes` is a peer's `Lanes` (peer.lanes.base) for one plan attempt over a
`peer.dataplane.Transport` (channels, lane probes, writer and buffer pools) and its `Inbox`.
`open(j)` gives a `DialedLane` to a participant this peer can dial, an `ExchangeLane` from an
outbound-only peer, a `ReplyStream` to an outbound-only one (peer.lanes.streams).

A `DialedLane` chooses its lane at its first chunk (cached per address by the transport):
the shared-memory lane when a probe showed that the receiver reads this peer's segments
(peer.lanes.shm; the chunks then go as pointers on a PushChunks call), else the bulk TCP lane
when the receiver advertises it and the connection opens (peer.lanes.bulk), else inline on
PushChunks (peer.lanes.streams). A relayed participant is reached through its relay's gRPC
splice only (the relay forwards one port, and every chunk must carry its end-to-end signature:
peer.lanes.relay). A shared-memory stream whose segment cannot be written (/dev/shm full) sends
that chunk and every later one inline on the same call.
"""

from __future__ import annotations

import asyncio

import numpy as np

from shoal.common.plan import Plan
from shoal.peer.dataplane import Inbox, Transport
from shoal.peer.lanes import bulk, streams
from shoal.peer.lanes.base import Body, CollectiveError, Credit, Lane, Placement
from shoal.peer.lanes.shm import ResultBuffer, SharedSlabs, StreamSlabs
from shoal.v1 import shoal_pb2 as pb


class DialedLane:
    """One outgoing stream to a participant this peer dials, fed through a bounded queue.

    `send` fixes where a chunk's bytes come from: inline in `data` (a copy), or, on the
    shared-memory lane, pointed at where they already are in a shared segment (`placed`: the
    result buffer or an owner's shared slabs), else copied once into a segment
    (`StreamSlabs`), or, on the bulk TCP lane, written from where they are (`bulk.ChunkFrame`:
    like the shared-memory lane's `placed`, this relies on the collective not writing them
    before they left) on a raw TCP connection.
    """

    def __init__(self, transport: Transport, address: str, peer_id: str, plan: Plan, timeout: float,
                 links=None):
        self.transport, self.address, self.peer_id = transport, address, peer_id
        self.plan, self.timeout = plan, timeout
        self.queue: asyncio.Queue = asyncio.Queue(streams.SEND_QUEUE_CHUNKS)
        self.bytes_sent = 0
        self.links = links  # peer.links.LinkMeter: one passive upload sample per stream
        self.solo = False  # the sender's only stream (ring): its goodput while queued is the link's
        self.lane: str | None = None  # "shm", "tcp" or "socket", chosen at the first chunk
        self._choosing = asyncio.Lock()
        self.slabs: StreamSlabs | None = None  # on the shared-memory lane, until the stream ended
        self._credit: tuple[Credit, int] | None = None  # bounded reduce-scatter slabs (`bound`)
        # Through a relay (docs/nat.md): every chunk signed end to end, never shared memory.
        self.relay = plan.relay_of(plan.position(peer_id)) if plan.relays else ""
        self.bulk: bulk.BulkConnection | None = None
        self.bulk_extra: list[bulk.BulkConnection] = []  # the pool's other connections (peer.lanes.pool)

    def bound(self, credit: Credit, lap_bytes: int) -> None:
        """Write this stream's reduce-scatter chunks on the shared-memory lane in laps of
        `lap_bytes` whose `credit((shard, offset))` returns once the receiver consumed that chunk
        (the caller guarantees that every such chunk's consumption can be awaited without this
        stream's sender waiting on anything else)."""
        self._credit = (credit, lap_bytes)
        if self.slabs is not None:
            self.slabs.bound(credit, lap_bytes)

    async def _choose(self, msg: pb.Chunk) -> None:
        async with self._choosing:  # scatter and publish may both open the stream (butterfly)
            if self.lane is not None:
                return
            shared = not self.relay and await self.transport.shm_lane(self.address, self.peer_id)
            if shared:
                self.slabs = StreamSlabs(lambda size: self.transport.take_writer(self.address, size), self.peer_id)
                if self._credit is not None:
                    self.slabs.bound(*self._credit)
            direct = not shared and not self.relay
            conns = await self.transport.bulk_pool(self.address, self.peer_id) if direct else []
            self.bulk, self.bulk_extra = (conns[0], conns[1:]) if conns else (None, [])
            self.lane = "shm" if shared else "tcp" if self.bulk is not None else "socket"
            if self.bulk is not None:
                msg.ticket = self.plan.ticket  # the first chunk opens the stream (bulk.carry)

    async def send(self, chunk: pb.Chunk, body: Body, placed: Placement | None = None) -> None:
        if self.lane is None:
            await self._choose(chunk)
        if self.lane == "tcp":
            # Not copied: the collectives never write these bytes before the stream wrote them
            # (a ring's partial sum changes only when its final value comes back, after the
            # successor took the partial; final values, the caller's input and encodings never).
            frame = bulk.ChunkFrame(chunk, body)
            self.bytes_sent += frame.payload.nbytes + len(chunk.scale)
            await self.queue.put((chunk, frame))
            return
        if self.lane == "shm":
            if self.slabs is None:
                raise CollectiveError(f"stream to {self.peer_id[:8]} closed", [self.peer_id])
            try:
                await self.slabs.place(chunk, body, placed, chunk.phase == pb.REDUCE_SCATTER)
            except OSError as exc:  # e.g. /dev/shm full: this and every later chunk inline
                self.transport.lane_failed(self.address, exc)
                self.lane = "socket"
        if self.lane != "shm":
            chunk.data = body if isinstance(body, bytes) else body.tobytes()
        self.bytes_sent += (len(body) if isinstance(body, bytes) else body.nbytes) + len(chunk.scale)
        await self.queue.put(chunk)

    async def close(self) -> None:
        await self.queue.put(None)

    def end_shared(self) -> list:
        """End the shared-memory side of the stream: its writers, to give back or close. Drops
        the credit too: it refers to the collective, whose result buffer is reused (a pooled
        segment, `Transport.take_result`) only once nothing refers to it any more."""
        self._credit = None
        if self.slabs is None:
            return []
        out = self.slabs.end()
        self.slabs = None
        return out

    async def run(self) -> None:
        try:
            msg = await self.queue.get()
        except BaseException:  # cancelled before the first chunk: a connection `send` chose is not used
            for conn in [self.bulk, *self.bulk_extra]:
                if conn is not None:
                    conn.close()
            raise
        if isinstance(msg, tuple):  # the bulk TCP lane (`send` chose it)
            await bulk.carry(self, msg)
        else:
            await streams.push(self, msg)


class DataLanes:
    """A peer's lanes for one attempt of `plan` over `transport` and `inbox` (peer.lanes.base
    `Lanes`); `links` (a peer.links.LinkMeter) gets each stream's passive throughput."""

    def __init__(self, transport: Transport, inbox: Inbox, plan: Plan, me: str, links=None):
        self.transport, self.receiver, self.plan, self.me, self.links = transport, inbox, plan, me, links
        self.pos = plan.position(me)

    async def choose(self) -> None:
        """Probe the shared-memory lane to every participant this peer's collective dials directly
        (the butterfly and the sparse collectives: all; the ring: its successor), now (cached: after the first attempt a
        lookup), so that the result buffer and the slab bounds know the lanes from the first
        attempt on, not only once a first stream chose them. A failed probe leaves the choice to
        the stream."""
        plan, pos, transport = self.plan, self.pos, self.transport
        if not transport.shared_memory or not plan.dialable(pos):
            return
        targets = range(plan.size) if plan.collective in ("butterfly", "allgather", "sparse_rs") else [(pos + 1) % plan.size]
        peers = [(plan.participants[i], plan.addresses[i]) for i in targets
                 if i != pos and plan.dialable(i) and not plan.relay_of(i)]
        await asyncio.gather(*(transport.shm_lane(a, pid) for pid, a in peers), return_exceptions=True)

    def open(self, j: int, *, solo: bool = False) -> Lane:
        """The lane to participant j: dialled, or (docs/nat.md) the reply lane of an
        outbound-only one, or, from an outbound-only peer, an Exchange that brings replies back.
        `solo`: the sender's only stream (the ring's), whose goodput while queued is the link's."""
        plan, peer = self.plan, self.plan.participants[j]
        me_outbound = not plan.dialable(self.pos)
        if not plan.dialable(j) and not me_outbound:
            return streams.ReplyStream(self.receiver.reply_lane(plan.round, plan.attempt, peer), peer, plan)
        if me_outbound:
            owners = tuple(plan.participants[o] for o in plan.owners())
            return streams.ExchangeLane(self.transport, plan.addresses[j], peer, plan, plan.deadline_seconds,
                                        self.receiver, owners, self.links)
        lane = DialedLane(self.transport, plan.addresses[j], peer, plan, plan.deadline_seconds, self.links)
        lane.solo = solo
        return lane

    def bound(self, lanes: dict[int, Lane], credits: dict[int, Credit], lap_bytes: int) -> bool:
        """Bound the reduce-scatter slabs when every lane is a dialled one on the shared-memory
        lane (chosen in an earlier round) and nobody is outbound-only or relayed."""
        plan, chosen = self.plan, self.transport.lanes()
        if (plan.outbound_only or any(plan.relays)
                or any(type(ln) is not DialedLane or chosen.get(ln.address) != "shm" for ln in lanes.values())):
            return False
        for j, credit in credits.items():
            lanes[j].bound(credit, lap_bytes)
        return True

    def result(self, x: np.ndarray) -> ResultBuffer:
        return ResultBuffer(x, self.plan.addresses, self.transport)

    def shared(self) -> SharedSlabs:
        return SharedSlabs(self.transport)
