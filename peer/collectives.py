"""Collectives over gRPC streams: ring all-reduce and butterfly (direct) all-reduce.

Both are reduce-scatter followed by all-gather, pipelined per chunk: a chunk is forwarded as
soon as it is reduced, never store-and-forward of a whole shard. Each shard has exactly one
peer that produces its final value (the last hop of the ring, or the shard owner in the
butterfly) and everyone else receives those exact bytes, so every participant ends with a
bit-identical result (checked by the digest vote).

Failure semantics (all collectives): the caller's input array is never modified. On any failure
(a stream to a peer breaks, a chunk does not arrive within `chunk_timeout_seconds`, the whole
collective exceeds `deadline_seconds`, a peer sends malformed data) the coroutine raises
`CollectiveError` naming the peers it suspects; nothing partial is returned, and the caller
votes "failed" so the coordinator aborts and retries the round without the suspects.

References: ring all-reduce (Patarasuk & Yuan 2009, as in Horovod/NCCL); butterfly/direct
all-reduce with owner-side reduction (hivemind's AllReduceRunner, Ryabinin et al. 2021).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from peer import faults
from peer.dataplane import Inbox, SenderGone, Transport
from peer.tensors import digest, dtype_code
from shoal.v1 import shoal_pb2 as pb

log = logging.getLogger("shoal.peer.collectives")

RS, AG = pb.REDUCE_SCATTER, pb.ALL_GATHER
SEND_QUEUE_CHUNKS = 16


class CollectiveError(Exception):
    """A collective attempt failed; `suspects` are the peer ids blamed for it."""

    def __init__(self, message: str, suspects: Sequence[str] = ()):
        super().__init__(message)
        self.suspects = tuple(suspects)


@dataclass(frozen=True)
class CollectivePlan:
    """The part of a shoal.v1.Plan a collective needs."""

    round: int
    attempt: int
    participants: tuple[str, ...]  # peer ids in collective order
    addresses: tuple[str, ...]
    shard_bounds: tuple[int, ...]  # element offsets, len p+1
    shard_owner: tuple[int, ...]  # participant index per shard
    algorithm: str = "ring"
    chunk_bytes: int = 1 << 20
    chunk_timeout_seconds: float = 5.0
    deadline_seconds: float = 30.0
    ticket: bytes = b""

    @staticmethod
    def from_proto(plan: pb.Plan) -> "CollectivePlan":
        return CollectivePlan(
            round=plan.round, attempt=plan.attempt,
            participants=tuple(p.peer_id for p in plan.participants),
            addresses=tuple(p.address for p in plan.participants),
            shard_bounds=tuple(plan.shard_bounds), shard_owner=tuple(plan.shard_owner),
            algorithm=plan.algorithm or "ring", chunk_bytes=plan.chunk_bytes or (1 << 20),
            chunk_timeout_seconds=plan.chunk_timeout_seconds or 5.0,
            deadline_seconds=plan.deadline_seconds or 30.0, ticket=plan.ticket,
        )


@dataclass(frozen=True)
class CollectiveResult:
    """values: (n,) array, same dtype as the input; digest: BLAKE2b-256 of its bytes."""

    values: np.ndarray
    digest: bytes
    bytes_sent: int
    seconds: float
    flagged: tuple[str, ...] = ()


# Reducer for one shard at its owner: contributions (p, m) and their participant indices ->
# (values (m,), indices of rejected contributions). Default: plain sum.
ShardReducer = Callable[[np.ndarray, int], tuple[np.ndarray, tuple[int, ...]]]


class _Stream:
    """One outgoing PushChunks stream, fed through a bounded queue by the collective."""

    def __init__(self, transport: Transport, address: str, peer_id: str, plan: CollectivePlan, timeout: float):
        self.transport, self.address, self.peer_id = transport, address, peer_id
        self.plan, self.timeout = plan, timeout
        self.queue: asyncio.Queue[pb.Chunk | None] = asyncio.Queue(SEND_QUEUE_CHUNKS)
        self.bytes_sent = 0

    async def run(self) -> None:
        first = True
        try:
            call = self.transport.stub(self.address).PushChunks(timeout=self.timeout)
            while (msg := await self.queue.get()) is not None:
                if first:
                    msg.ticket = self.plan.ticket
                    first = False
                await call.write(msg)
                self.bytes_sent += len(msg.data)
            await call.done_writing()
            await call
        except grpc.aio.AioRpcError as exc:
            await self.transport.forget(self.address)
            raise CollectiveError(f"stream to {self.peer_id[:8]} failed: {exc.code().name} {exc.details()}",
                                  [self.peer_id]) from None
        except asyncio.InvalidStateError:
            raise CollectiveError(f"stream to {self.peer_id[:8]} closed", [self.peer_id]) from None


def _chunk_offsets(size: int, chunk_elems: int) -> range:
    return range(0, size, chunk_elems)


async def all_reduce(x: np.ndarray, plan: CollectivePlan, *, me: str, transport: Transport, inbox: Inbox,
                     reducer: ShardReducer | None = None) -> CollectiveResult:
    """Sum `x` (1-D, float32 or float16) across the plan's participants; see the module docstring.

    `reducer` (butterfly only) replaces the plain sum at the shard owner, e.g. a robust
    aggregator. Returns the result and its digest. Raises CollectiveError on any failure.
    """
    t0 = time.monotonic()
    if x.ndim != 1:
        raise ValueError(f"x: expected a 1-D array, got shape {x.shape}")
    p = len(plan.participants)
    if me not in plan.participants:
        raise CollectiveError(f"{me[:8]} is not a participant", [])
    if len(plan.shard_bounds) != len(plan.shard_owner) + 1 or plan.shard_bounds[-1] != x.size:
        raise CollectiveError(f"plan shard_bounds {plan.shard_bounds[-1:]} do not cover {x.size} elements", [])
    if p == 1:
        out = x.copy()
        return CollectiveResult(out, digest(out), 0, time.monotonic() - t0)
    try:
        async with asyncio.timeout(plan.deadline_seconds):
            if plan.algorithm == "butterfly":
                out, sent, flagged = await _butterfly(x, plan, me, transport, inbox, reducer)
            else:
                if reducer is not None:
                    raise CollectiveError("ring all-reduce supports only the sum; use butterfly for aggregators")
                out, sent = await _ring(x, plan, me, transport, inbox)
                flagged = ()
    except TimeoutError:
        raise CollectiveError(f"collective deadline of {plan.deadline_seconds:.1f}s passed", []) from None
    except BaseExceptionGroup as group:
        if any(isinstance(e, CollectiveError) for e in _flatten(group)):
            raise _first(group) from None
        raise
    return CollectiveResult(out, digest(out), sent, time.monotonic() - t0, flagged)


def _first(group: BaseExceptionGroup) -> CollectiveError:
    excs = [e for e in _flatten(group) if isinstance(e, CollectiveError)]
    suspects = tuple(dict.fromkeys(s for e in excs for s in e.suspects))
    return CollectiveError("; ".join(str(e) for e in excs[:3]), suspects)


def _flatten(e: BaseException):
    if isinstance(e, BaseExceptionGroup):
        for sub in e.exceptions:
            yield from _flatten(sub)
    else:
        yield e


def _message(plan: CollectivePlan, me: str, phase: int, step: int, shard: int, off: int, values: np.ndarray) -> pb.Chunk:
    return pb.Chunk(round=plan.round, attempt=plan.attempt, sender=me, phase=phase, step=step, shard=shard,
                    offset=off, dtype=dtype_code(values.dtype), shape=[values.size], data=values.tobytes())


async def _receive(inbox: Inbox, plan: CollectivePlan, key: tuple[int, int, int, int, str]) -> np.ndarray:
    phase, step, shard, off, sender = key
    try:
        return await inbox.get((plan.round, plan.attempt, phase, step, shard, off, sender), plan.chunk_timeout_seconds)
    except TimeoutError:
        raise CollectiveError(
            f"no chunk from {sender[:8]} within {plan.chunk_timeout_seconds:.1f}s "
            f"(phase {phase}, step {step}, shard {shard}, offset {off})", [sender]) from None
    except SenderGone as exc:
        raise CollectiveError(str(exc), [sender]) from None


async def _ring(x: np.ndarray, plan: CollectivePlan, me: str, transport: Transport, inbox: Inbox) -> tuple[np.ndarray, int]:
    p = len(plan.participants)
    i = plan.participants.index(me)
    nxt, prv = (i + 1) % p, (i - 1) % p
    prv_id = plan.participants[prv]
    buf = x.copy()
    b = plan.shard_bounds
    ce = max(1, plan.chunk_bytes // x.itemsize)
    out = _Stream(transport, plan.addresses[nxt], plan.participants[nxt], plan, plan.deadline_seconds)

    async def schedule() -> None:
        async def send(phase: int, step: int, shard: int, off: int) -> None:
            lo = b[shard] + off
            hi = min(b[shard + 1], lo + ce)
            await out.queue.put(_message(plan, me, phase, step, shard, off, buf[lo:hi]))

        first = i % p
        for off in _chunk_offsets(b[first + 1] - b[first], ce):
            await send(RS, 0, first, off)
        for s in range(p - 1):  # reduce-scatter
            shard = (i - s - 1) % p
            for off in _chunk_offsets(b[shard + 1] - b[shard], ce):
                v = await _receive(inbox, plan, (RS, s, shard, off, prv_id))
                faults.hit("rs", plan.round)
                lo = b[shard] + off
                if v.size != min(b[shard + 1], lo + ce) - lo:
                    raise CollectiveError(f"chunk from {prv_id[:8]} has {v.size} elements", [prv_id])
                buf[lo:lo + v.size] += v
                if s < p - 2:
                    await send(RS, s + 1, shard, off)
                else:  # this shard is final here: start the all-gather with it at once
                    await send(AG, 0, shard, off)
        for s in range(p - 1):  # all-gather
            shard = (i - s) % p
            for off in _chunk_offsets(b[shard + 1] - b[shard], ce):
                v = await _receive(inbox, plan, (AG, s, shard, off, prv_id))
                faults.hit("ag", plan.round)
                lo = b[shard] + off
                if v.size != min(b[shard + 1], lo + ce) - lo:
                    raise CollectiveError(f"chunk from {prv_id[:8]} has {v.size} elements", [prv_id])
                buf[lo:lo + v.size] = v
                if s < p - 2:
                    await send(AG, s + 1, shard, off)
        await out.queue.put(None)

    async with asyncio.TaskGroup() as tg:
        tg.create_task(out.run())
        tg.create_task(schedule())
    return buf, out.bytes_sent


async def _butterfly(x: np.ndarray, plan: CollectivePlan, me: str, transport: Transport, inbox: Inbox,
                     reducer: ShardReducer | None) -> tuple[np.ndarray, int, tuple[str, ...]]:
    """Direct reduce-scatter to shard owners, owner-side reduction, direct all-gather."""
    p = len(plan.participants)
    i = plan.participants.index(me)
    b = plan.shard_bounds
    ce = max(1, plan.chunk_bytes // x.itemsize)
    buf = x.copy()
    streams = {j: _Stream(transport, plan.addresses[j], plan.participants[j], plan, plan.deadline_seconds)
               for j in range(p) if j != i}
    my_shards = [k for k, o in enumerate(plan.shard_owner) if o == i]
    flagged: set[str] = set()

    async def scatter() -> None:
        for k, owner in enumerate(plan.shard_owner):
            if owner == i:
                continue
            for off in _chunk_offsets(b[k + 1] - b[k], ce):
                lo = b[k] + off
                await streams[owner].queue.put(_message(plan, me, RS, 0, k, off, x[lo:min(b[k + 1], lo + ce)]))

    async def reduce_own() -> None:
        for k in my_shards:
            for off in _chunk_offsets(b[k + 1] - b[k], ce):
                lo = b[k] + off
                hi = min(b[k + 1], lo + ce)
                rows = []
                for j in range(p):
                    if j == i:
                        rows.append(x[lo:hi])
                        continue
                    v = await _receive(inbox, plan, (RS, 0, k, off, plan.participants[j]))
                    faults.hit("rs", plan.round)
                    if v.size != hi - lo:
                        raise CollectiveError(f"chunk from {plan.participants[j][:8]} has {v.size} elements",
                                              [plan.participants[j]])
                    rows.append(v)
                stacked = np.stack(rows)
                if reducer is None:
                    red = stacked.sum(axis=0, dtype=x.dtype)
                else:
                    red, rejected = reducer(stacked, k)
                    flagged.update(plan.participants[r] for r in rejected)
                buf[lo:hi] = red.astype(x.dtype, copy=False)
                for j, st in streams.items():
                    await st.queue.put(_message(plan, me, AG, 0, k, off, buf[lo:hi]))

    async def gather() -> None:
        for k, owner in enumerate(plan.shard_owner):
            if owner == i:
                continue
            for off in _chunk_offsets(b[k + 1] - b[k], ce):
                lo = b[k] + off
                hi = min(b[k + 1], lo + ce)
                v = await _receive(inbox, plan, (AG, 0, k, off, plan.participants[owner]))
                faults.hit("ag", plan.round)
                if v.size != hi - lo:
                    raise CollectiveError(f"chunk from {plan.participants[owner][:8]} has {v.size} elements",
                                          [plan.participants[owner]])
                buf[lo:hi] = v

    async def work() -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(scatter())
            tg.create_task(reduce_own())
            tg.create_task(gather())
        for st in streams.values():
            await st.queue.put(None)

    async with asyncio.TaskGroup() as tg:
        for st in streams.values():
            tg.create_task(st.run())
        tg.create_task(work())
    return buf, sum(s.bytes_sent for s in streams.values()), tuple(sorted(flagged))
