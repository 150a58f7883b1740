"""An in-memory lane: the collectives' algorithms in one process, without sockets (unit tests).

`MemoryNet` holds one `peer.dataplane.Inbox` per participant; `MemoryNet.lanes(plan, me)` is
participant `me`'s `Lanes` (peer.lanes.base) for one attempt of `plan`. A chunk sent on a
`MemoryLane` is serialised as on gRPC (its bytes copied into `data`), checked by the receiver
against the plan exactly as a network chunk is (`Session.check_chunk`: sender, dtype, shape,
shard bounds, phase, step, codec) and delivered to the receiver's inbox; a refused chunk fails
the receiver's waits on that sender and the sender's lane (CollectiveError blaming the
receiver), as a refused stream does. Tickets and signatures are the network's (there is no
stream to authenticate here). A participant that never runs its collective is silent: the
others' waits on it end at the plan's chunk deadline.

Results live in this process's memory (no shared segments), so the collectives read
all-gather chunks in place (`Inbox.post`), as on the network without shared memory.
"""

from __future__ import annotations

import asyncio

import numpy as np

from shoal.common.errors import ShoalError
from shoal.common.plan import Plan
from shoal.common.tensors import to_numpy_dtype
from shoal.peer.dataplane import Inbox, Session
from shoal.peer.lanes.base import Body, CollectiveError, Credit, Lane, Placement
from shoal.v1 import shoal_pb2 as pb

QUEUE_CHUNKS = 16


class MemoryNet:
    """The inboxes of a set of participants in this process, by peer id (made at first use)."""

    def __init__(self) -> None:
        self.inboxes: dict[str, Inbox] = {}
        self.chunks = 0  # chunks delivered, all lanes together

    def inbox(self, peer_id: str) -> Inbox:
        if peer_id not in self.inboxes:
            self.inboxes[peer_id] = Inbox()
        return self.inboxes[peer_id]

    def start(self, plan: Plan) -> None:
        """Open `plan`'s attempt on every participant's inbox (as each peer's round client does
        when the plan arrives): only its participants may send, only chunks that fit it."""
        dtype = plan.dtype or pb.FLOAT32
        session = Session(plan.round, plan.attempt, frozenset(plan.participants), dtype, None,
                          tuple(plan.shard_bounds), max(1, plan.chunk_bytes // to_numpy_dtype(dtype).itemsize),
                          plan.deadline_seconds, collective=plan.collective)
        for peer in plan.participants:
            self.inbox(peer).start(session)

    def lanes(self, plan: Plan, me: str) -> MemoryLanes:
        return MemoryLanes(self, plan, me)


class MemoryLane:
    """`me`'s chunks of one attempt to `peer_id`, delivered into its inbox by `run`."""

    def __init__(self, net: MemoryNet, plan: Plan, me: str, peer_id: str):
        self.net, self.plan, self.me, self.peer_id = net, plan, me, peer_id
        self.queue: asyncio.Queue[pb.Chunk | None] = asyncio.Queue(QUEUE_CHUNKS)
        self.bytes_sent = 0

    async def send(self, chunk: pb.Chunk, body: Body, placed: Placement | None = None) -> None:
        chunk.data = body if isinstance(body, bytes) else body.tobytes()
        self.bytes_sent += len(chunk.data) + len(chunk.scale)
        await self.queue.put(pb.Chunk.FromString(chunk.SerializeToString()))  # the bytes a wire carries

    async def close(self) -> None:
        await self.queue.put(None)

    async def run(self) -> None:
        inbox = self.net.inbox(self.peer_id)
        session = inbox.session
        while (c := await self.queue.get()) is not None:
            try:
                if session is None or (session.round, session.attempt) != (c.round, c.attempt):
                    raise CollectiveError(f"{self.peer_id[:8]} holds no plan for {c.round}.{c.attempt}")
                values = session.check_chunk(c)
                inbox.deliver((c.round, c.attempt, c.phase, c.step, c.shard, c.offset, c.sender), values)
            except ShoalError as exc:
                inbox.fail_sender(c.round, c.attempt, self.me, f"stream from {self.me[:8]} refused: {exc}")
                raise CollectiveError(f"stream to {self.peer_id[:8]} failed: {exc}", [self.peer_id]) from None
            self.net.chunks += 1
            await asyncio.sleep(0)  # let the receiver run, as a socket would


class _PrivateResult:
    """A result buffer in this process's memory: nothing to point a receiver at."""

    private = True

    def __init__(self, x: np.ndarray):
        self.values = np.empty_like(x)

    def placement(self, span, payload) -> None:
        return None


class _Unshared:
    """No shared segments: a shard owner's final chunks are copied to each receiver."""

    def placement(self, key: tuple[int, int], body: Body) -> Placement:
        return lambda: ("", 0)  # never called: a memory lane ignores placements

    def finish(self, ok: bool) -> None:
        pass


class MemoryLanes:
    """Participant `me`'s lanes for one attempt of `plan` on a `MemoryNet` (peer.lanes.base `Lanes`)."""

    def __init__(self, net: MemoryNet, plan: Plan, me: str):
        self.net, self.plan, self.me = net, plan, me
        self.receiver = net.inbox(me)

    async def choose(self) -> None:
        pass

    def open(self, j: int, *, solo: bool = False) -> Lane:
        return MemoryLane(self.net, self.plan, self.me, self.plan.participants[j])

    def bound(self, lanes: dict[int, Lane], credits: dict[int, Credit], lap_bytes: int) -> bool:
        return False

    def result(self, x: np.ndarray) -> _PrivateResult:
        return _PrivateResult(x)

    def shared(self) -> _Unshared:
        return _Unshared()
