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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
import numpy as np

from shoal.peer import faults
from shoal.peer.compression import Encoded, ErrorFeedback, codec_id, decode, encode, max_abs_error
from shoal.peer.dataplane import Inbox, Payload, SenderGone, Transport
from shoal.common.errors import InvalidArgument
from shoal.peer.shm import SegmentWriter
from shoal.common.tensors import digest, dtype_code
from shoal.v1 import shoal_pb2 as pb

log = logging.getLogger("shoal.peer.collectives")

RS, AG, DIST = pb.REDUCE_SCATTER, pb.ALL_GATHER, pb.DISTANCES
SEND_QUEUE_CHUNKS = 16


class CollectiveError(Exception):
    """A collective attempt failed; `suspects` are the peer ids blamed for it; `audit` marks an
    owner audit that failed (suspects: the owner and the auditor)."""

    def __init__(self, message: str, suspects: Sequence[str] = (), *, audit: bool = False):
        super().__init__(message)
        self.suspects = tuple(suspects)
        self.audit = audit


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
    compression: str = "none"
    audit: bool = False  # butterfly: a second owner recomputes each shard's aggregate

    def auditors(self) -> tuple[int, ...]:
        """Per shard, the participant index that audits its owner (`auditor_positions`); all -1
        when the plan is not audited."""
        return auditor_positions(self.shard_owner) if self.audit else tuple(-1 for _ in self.shard_owner)

    @staticmethod
    def from_proto(plan: pb.Plan) -> "CollectivePlan":
        return CollectivePlan(
            round=plan.round, attempt=plan.attempt,
            participants=tuple(p.peer_id for p in plan.participants),
            addresses=tuple(p.address for p in plan.participants),
            shard_bounds=tuple(plan.shard_bounds), shard_owner=tuple(plan.shard_owner),
            algorithm=plan.collective or "ring", chunk_bytes=plan.chunk_bytes or (1 << 20),
            chunk_timeout_seconds=plan.chunk_timeout_seconds or 5.0,
            deadline_seconds=plan.deadline_seconds or 30.0, ticket=plan.ticket,
            compression=plan.compression or "none", audit=plan.audit_owners,
        )


def auditor_positions(shard_owner: Sequence[int]) -> tuple[int, ...]:
    """Per shard, the participant index that audits its owner: the next owner after it (in
    participant order, cyclically); -1 for every shard when fewer than two peers own shards.
    The coordinator uses the same function to check that an audit vote comes from the auditor."""
    owners = sorted(set(shard_owner))
    if len(owners) < 2:
        return tuple(-1 for _ in shard_owner)
    return tuple(owners[(owners.index(o) + 1) % len(owners)] for o in shard_owner)


@dataclass(frozen=True)
class CollectiveResult:
    """values: (n,) array, same dtype as the input; digest: `shoal.common.tensors.digest` of it (BLAKE3-256,
    the vote digest); seconds: the whole collective, digest included."""

    values: np.ndarray
    digest: bytes
    bytes_sent: int
    seconds: float
    flagged: tuple[str, ...] = ()
    # Error-feedback updates (key, compensated, decoded) to apply once the round commits.
    feedback: tuple[tuple[object, np.ndarray, np.ndarray], ...] = ()


class OwnerReducer(Protocol):
    """The reduction a butterfly shard owner runs in place of the sum (see peer.reduction).

    Rows are `(p, hi - lo)` float32, one per participant in plan order, for the slice [lo, hi).
    """

    needs_distances: bool

    def partial_distances(self, rows: np.ndarray, lo: int, hi: int) -> np.ndarray: ...

    def reduce(self, rows: np.ndarray, lo: int, hi: int,
               distances: np.ndarray | None = None) -> tuple[np.ndarray, tuple[int, ...]]: ...


class _Codec:
    """Per-hop encoding of one collective attempt (see the module docstring)."""

    def __init__(self, name: str, dtype: np.dtype, feedback: ErrorFeedback | None):
        self.name = name
        self.on = codec_id(name) != 0 and dtype == np.float32
        self.feedback = feedback
        self.pending: list[tuple[object, np.ndarray, np.ndarray]] = []

    def own(self, key: object, values: np.ndarray) -> Payload:
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
        if not self.on:
            return values, values
        enc = encode(np.ascontiguousarray(values), self.name)
        return enc, decode(enc)


def _values(payload: Payload, sender: str) -> np.ndarray:
    """Decode a received payload; raises CollectiveError blaming `sender` if malformed.

    A raw payload may be a view of the sender's shared-memory slab (peer.shm): value checks
    (finiteness) belong on this peer's own copy, after the values were added or copied into it.
    """
    if isinstance(payload, Encoded):
        try:
            return decode(payload)
        except InvalidArgument as exc:
            raise CollectiveError(f"chunk from {sender[:8]} is malformed: {exc}", [sender]) from None
    return payload


class _Stream:
    """One outgoing PushChunks stream, fed through a bounded queue by the collective.

    `put` fixes a chunk's bytes at once (so later writes to the caller's buffer never reach the
    wire): inline in `data`, or, on the shared-memory lane (a co-located receiver, see peer.shm
    and `Transport.shm_lane`), copied once into a segment of a writer reused across streams.
    """

    def __init__(self, transport: Transport, address: str, peer_id: str, plan: CollectivePlan, timeout: float,
                 links=None):
        self.transport, self.address, self.peer_id = transport, address, peer_id
        self.plan, self.timeout = plan, timeout
        self.queue: asyncio.Queue[pb.Chunk | None] = asyncio.Queue(SEND_QUEUE_CHUNKS)
        self.bytes_sent = 0
        self.links = links  # peer.links.LinkMeter: one passive upload sample per stream
        self.lane: str | None = None  # "shm" or "socket", chosen at the first chunk
        self._choosing = asyncio.Lock()
        self.writer: SegmentWriter | None = None

    async def put(self, item: tuple[pb.Chunk, bytes | np.ndarray] | None) -> None:
        """Queue (chunk without data, its bytes), or None to close the stream."""
        if item is None:
            await self.queue.put(None)
            return
        msg, body = item
        async with self._choosing:  # scatter and publish may both open the stream (butterfly)
            if self.lane is None:
                shared = await self.transport.shm_lane(self.address)
                self.writer = self.transport.take_writer(self.address) if shared else None
                self.lane = "shm" if shared else "socket"
        if self.lane == "shm":
            if self.writer is None:
                raise CollectiveError(f"stream to {self.peer_id[:8]} closed", [self.peer_id])
            try:
                msg.shm_name, msg.shm_offset = self.writer.put(body)
            except OSError as exc:  # e.g. /dev/shm full: this and every later chunk inline
                self.transport.lane_failed(self.address, exc)
                self.lane = "socket"
        if self.lane != "shm":
            msg.data = body if isinstance(body, bytes) else body.tobytes()
        self.bytes_sent += (len(body) if isinstance(body, bytes) else body.nbytes) + len(msg.scale)
        await self.queue.put(msg)

    async def run(self) -> None:
        call = None
        try:
            while (msg := await self.queue.get()) is not None:
                if call is None:  # the stream opens with the ticket, signed with the first chunk
                    msg.ticket = self.plan.ticket
                    call = self.transport.stub(self.address).PushChunks(
                        timeout=self.timeout, metadata=self.transport.push_metadata(msg))
                    t0 = time.perf_counter()
                await call.write(msg)
            if call is not None:
                await call.done_writing()
                await call  # the receiver took every chunk: the writer may be reused
                if self.links is not None and self.lane != "shm":  # shared memory says nothing of links
                    self.links.observe_send(self.peer_id, self.bytes_sent, time.perf_counter() - t0)
            if self.writer is not None:
                self.transport.give_back_writer(self.address, self.writer)
                self.writer = None
        except grpc.aio.AioRpcError as exc:
            await self.transport.forget(self.address)
            raise CollectiveError(f"stream to {self.peer_id[:8]} failed: {exc.code().name} {exc.details()}",
                                  [self.peer_id]) from None
        except asyncio.InvalidStateError:
            raise CollectiveError(f"stream to {self.peer_id[:8]} closed", [self.peer_id]) from None
        finally:
            if self.writer is not None:  # a failed stream: its slabs are never written again
                self.writer.close()
                self.writer = None


def _chunk_offsets(size: int, chunk_elems: int) -> range:
    return range(0, size, chunk_elems)


async def all_reduce(x: np.ndarray, plan: CollectivePlan, *, me: str, transport: Transport, inbox: Inbox,
                     reducer: OwnerReducer | None = None, feedback: ErrorFeedback | None = None,
                     links=None, tamper=None) -> CollectiveResult:
    """Sum `x` (1-D, float32 or float16) across the plan's participants; see the module docstring.

    `reducer` (butterfly only) replaces the plain sum at the shard owner, e.g. a robust
    aggregator; its rejections come back as `flagged`. `feedback` is read (never written): the
    pending updates are returned in `CollectiveResult.feedback`. `links` (a peer.links.LinkMeter)
    receives the passive throughput of every outgoing stream and of the whole collective (see
    peer.links; measurement never changes the result). `tamper` (testing only: the "owner"
    attack of peer.byzantine) replaces what this peer publishes as a butterfly shard owner; an
    audited plan (`plan.audit`) catches it. Returns the result and its digest. Raises CollectiveError on any failure; `x` and `feedback` are never modified.
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
        out, flagged = x.copy(), ()
        if reducer is not None:
            red, rejected = reducer.reduce(x[None, :], 0, x.size, None)
            out, flagged = red.astype(x.dtype, copy=False), tuple(plan.participants[r] for r in rejected)
        return CollectiveResult(out, digest(out), 0, time.monotonic() - t0, flagged)
    try:
        codec = _Codec(plan.compression, x.dtype, feedback)
    except InvalidArgument as exc:
        raise CollectiveError(f"plan: {exc}", []) from None
    try:
        async with asyncio.timeout(plan.deadline_seconds):
            if plan.algorithm == "butterfly":
                out, sent, flagged, dig = await _butterfly(x, plan, me, transport, inbox, reducer, codec, links,
                                                           tamper)
            else:
                if reducer is not None:
                    raise CollectiveError("ring all-reduce supports only the sum; use butterfly for aggregators")
                out, sent, dig = await _ring(x, plan, me, transport, inbox, codec, links)
                flagged = ()
    except TimeoutError:
        raise CollectiveError(f"collective deadline of {plan.deadline_seconds:.1f}s passed", []) from None
    except BaseExceptionGroup as group:
        if any(isinstance(e, CollectiveError) for e in _flatten(group)):
            raise _first(group) from None
        raise
    seconds = time.monotonic() - t0
    if links is not None:
        received = sent if plan.algorithm != "butterfly" else _butterfly_received(plan, me, x.itemsize)
        links.observe_collective(sent, received, seconds)
    return CollectiveResult(out, dig, sent, seconds, flagged, tuple(codec.pending))


def _butterfly_received(plan: CollectivePlan, me: str, itemsize: int) -> int:
    """Bytes a butterfly participant receives (uncompressed): the others' parts of its shards and
    the others' shards."""
    i = plan.participants.index(me)
    p = len(plan.participants)
    b = plan.shard_bounds
    mine = sum(b[k + 1] - b[k] for k, o in enumerate(plan.shard_owner) if o == i)
    return itemsize * ((p - 1) * mine + (b[-1] - mine))


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


def _message(plan: CollectivePlan, me: str, phase: int, step: int, shard: int, off: int,
             values: Payload) -> tuple[pb.Chunk, bytes | np.ndarray]:
    """The chunk header (data left for `_Stream.put`) and its bytes."""
    if isinstance(values, Encoded):
        return pb.Chunk(round=plan.round, attempt=plan.attempt, sender=me, phase=phase, step=step, shard=shard,
                        offset=off, dtype=pb.FLOAT32, shape=[values.count], scale=values.scale,
                        codec=values.codec), values.data
    return pb.Chunk(round=plan.round, attempt=plan.attempt, sender=me, phase=phase, step=step, shard=shard,
                    offset=off, dtype=dtype_code(values.dtype), shape=[values.size]), np.ascontiguousarray(values)


async def _receive(inbox: Inbox, plan: CollectivePlan, key: tuple[int, int, int, int, str]) -> Payload:
    phase, step, shard, off, sender = key
    try:
        return await inbox.get((plan.round, plan.attempt, phase, step, shard, off, sender), plan.chunk_timeout_seconds)
    except TimeoutError:
        raise CollectiveError(
            f"no chunk from {sender[:8]} within {plan.chunk_timeout_seconds:.1f}s "
            f"(phase {phase}, step {step}, shard {shard}, offset {off})", [sender]) from None
    except SenderGone as exc:
        raise CollectiveError(str(exc), [sender]) from None


async def _ring(x: np.ndarray, plan: CollectivePlan, me: str, transport: Transport, inbox: Inbox,
                codec: _Codec, links=None) -> tuple[np.ndarray, int, bytes]:
    p = len(plan.participants)
    i = plan.participants.index(me)
    nxt, prv = (i + 1) % p, (i - 1) % p
    prv_id = plan.participants[prv]
    buf = x.copy()
    b = plan.shard_bounds
    ce = max(1, plan.chunk_bytes // x.itemsize)
    out = _Stream(transport, plan.addresses[nxt], plan.participants[nxt], plan, plan.deadline_seconds, links)

    async def schedule() -> None:
        async def send(phase: int, step: int, shard: int, off: int, payload: Payload | None = None) -> None:
            lo = b[shard] + off
            hi = min(b[shard + 1], lo + ce)
            if payload is None:  # reduce-scatter: this peer's partial sum, compressed per hop
                payload = codec.own(("rs", lo, hi), buf[lo:hi])
            await out.put(_message(plan, me, phase, step, shard, off, payload))

        first = i % p
        for off in _chunk_offsets(b[first + 1] - b[first], ce):
            await send(RS, 0, first, off)
        for s in range(p - 1):  # reduce-scatter
            shard = (i - s - 1) % p
            for off in _chunk_offsets(b[shard + 1] - b[shard], ce):
                v = _values(await _receive(inbox, plan, (RS, s, shard, off, prv_id)), prv_id)
                faults.hit("rs", plan.round)
                lo = b[shard] + off
                hi = min(b[shard + 1], lo + ce)
                if v.size != hi - lo:
                    raise CollectiveError(f"chunk from {prv_id[:8]} has {v.size} elements", [prv_id])
                part = buf[lo:hi]
                part += v
                # An honest peer never forwards a non-finite partial sum, so the first peer that
                # sees one blames its predecessor: the peer that introduced it. Checked on the sum
                # in this peer's memory (a received view may still change: peer.shm). A peer whose
                # own input is non-finite forwards it, and the next peer blames it.
                if not np.isfinite(part).all() and np.isfinite(x[lo:hi]).all():
                    raise CollectiveError(f"chunk from {prv_id[:8]} holds non-finite values", [prv_id])
                if s < p - 2:
                    await send(RS, s + 1, shard, off)
                else:  # this shard is final here: encode it once and start the all-gather with it
                    payload, buf[lo:hi] = codec.final(buf[lo:hi])
                    await send(AG, 0, shard, off, payload)
        for s in range(p - 1):  # all-gather
            shard = (i - s) % p
            for off in _chunk_offsets(b[shard + 1] - b[shard], ce):
                payload = await _receive(inbox, plan, (AG, s, shard, off, prv_id))
                v = _values(payload, prv_id)
                faults.hit("ag", plan.round)
                lo = b[shard] + off
                if v.size != min(b[shard + 1], lo + ce) - lo:
                    raise CollectiveError(f"chunk from {prv_id[:8]} has {v.size} elements", [prv_id])
                final = buf[lo:lo + v.size]
                final[:] = v
                if not np.isfinite(final).all():  # checked in this peer's memory, as in the reduce-scatter
                    raise CollectiveError(f"chunk from {prv_id[:8]} holds non-finite values", [prv_id])
                if s < p - 2:  # relay the exact bytes received (raw: this peer's copy of them)
                    await send(AG, s + 1, shard, off, payload if isinstance(payload, Encoded) else final)
        await out.put(None)

    async with asyncio.TaskGroup() as tg:
        tg.create_task(out.run())
        tg.create_task(schedule())
    return buf, out.bytes_sent, digest(buf)


async def _butterfly(x: np.ndarray, plan: CollectivePlan, me: str, transport: Transport, inbox: Inbox,
                     reducer: OwnerReducer | None, codec: _Codec, links=None,
                     tamper=None) -> tuple[np.ndarray, int, tuple[str, ...], bytes]:
    """Direct reduce-scatter to shard owners, owner-side reduction, direct all-gather.

    With `plan.audit`, every peer also sends its part of shard k to the shard's auditor (the
    next owner, `CollectivePlan.auditors`), which recomputes the aggregate from the same rows
    (its own and the owner's row as the others see them: encoded once) and compares it with what
    the owner publishes, and checks the owner's partial distance matrix the same way; a
    difference blames the owner and the auditor (one of the two lies; both sit out the retry).
    `tamper` (testing only, peer.byzantine "owner") corrupts what this peer publishes as owner.
    """
    p = len(plan.participants)
    i = plan.participants.index(me)
    b = plan.shard_bounds
    ce = max(1, plan.chunk_bytes // x.itemsize)
    buf = np.empty_like(x)  # every element is written: own shards by publish, the others by gather
    streams = {j: _Stream(transport, plan.addresses[j], plan.participants[j], plan, plan.deadline_seconds, links)
               for j in range(p) if j != i}
    my_shards = [k for k, o in enumerate(plan.shard_owner) if o == i]
    flagged: set[str] = set()
    with_distances = reducer is not None and reducer.needs_distances and p > 1
    auditor = plan.auditors()
    audited = [k for k, a in enumerate(auditor) if a == i]
    loop = asyncio.get_running_loop()
    expected = {(k, off): loop.create_future() for k in audited for off in _chunk_offsets(b[k + 1] - b[k], ce)}
    owner_parts = {k: loop.create_future() for k in audited}  # distance matrices the audited owners sent
    total_distances: asyncio.Future[np.ndarray] = loop.create_future()
    own_sent: dict[tuple[int, int], Payload] = {}
    # An audit that fails lets the collective finish (so that the other peers, seeing nothing
    # wrong, vote normally and no broken stream shifts the blame to this auditor), then fails it.
    mismatches: list[CollectiveError] = []

    def span(k: int, off: int) -> tuple[int, int]:
        lo = b[k] + off
        return lo, min(b[k + 1], lo + ce)

    def own(k: int, off: int) -> Payload:
        """This peer's contribution to one chunk, encoded once (error feedback registered once)."""
        if (k, off) not in own_sent:
            lo, hi = span(k, off)
            own_sent[(k, off)] = codec.own(("bf", lo, hi), x[lo:hi])
        return own_sent[(k, off)]

    def own_row(k: int, off: int) -> np.ndarray:
        lo, hi = span(k, off)
        if not plan.audit:
            return x[lo:hi]  # this peer's own row, uncompressed
        return _values(own(k, off), me)  # as the auditor sees it, so that it can recompute exactly

    async def scatter() -> None:
        # Start with the owner after this peer (i+1, i+2, ...): owners are not all hit at once.
        for k in sorted(range(len(plan.shard_owner)), key=lambda k: ((plan.shard_owner[k] - i) % p, k)):
            targets = [t for t in dict.fromkeys((plan.shard_owner[k], auditor[k])) if t not in (i, -1)]
            for off in _chunk_offsets(b[k + 1] - b[k], ce) if targets else ():
                payload = own(k, off)
                for t in targets:
                    await streams[t].put(_message(plan, me, RS, 0, k, off, payload))

    async def contributions(k: int, off: int) -> np.ndarray:
        """(p, m) rows of one chunk of shard k, plan order."""
        lo, hi = span(k, off)
        rows = []
        for j in range(p):
            if j == i:
                rows.append(own_row(k, off))
                continue
            sender = plan.participants[j]
            v = _values(await _receive(inbox, plan, (RS, 0, k, off, sender)), sender)
            faults.hit("rs", plan.round)
            if v.size != hi - lo:
                raise CollectiveError(f"chunk from {sender[:8]} has {v.size} elements", [sender])
            rows.append(v)
        return np.stack(rows)

    async def summed(k: int, off: int) -> np.ndarray:
        """The plain sum of one chunk of shard k, added in plan order (no (p, m) copy)."""
        lo, hi = span(k, off)
        red: np.ndarray | None = None
        for j in range(p):
            if j == i:
                v = own_row(k, off)
            else:
                sender = plan.participants[j]
                v = _values(await _receive(inbox, plan, (RS, 0, k, off, sender)), sender)
                faults.hit("rs", plan.round)
                if v.size != hi - lo:
                    raise CollectiveError(f"chunk from {sender[:8]} has {v.size} elements", [sender])
            if red is None:
                red = v.astype(x.dtype, copy=True)
            else:
                red += v
        assert red is not None
        return red

    async def publish(k: int, off: int, red: np.ndarray) -> None:
        lo = b[k] + off
        hi = lo + red.size
        if tamper is not None:
            red = tamper(red)
        payload, buf[lo:hi] = codec.final(red.astype(x.dtype, copy=False))
        for st in streams.values():
            await st.put(_message(plan, me, AG, 0, k, off, payload))

    async def summed_distances(mine: dict[int, np.ndarray]) -> np.ndarray:
        """Send my shards' partial matrices to the other owners; sum all of them in shard order."""
        owners = sorted({o for o in plan.shard_owner if o != i})
        for k, d in mine.items():
            for o in owners:
                await streams[o].put(_message(plan, me, DIST, 0, k, 0, np.ascontiguousarray(d, dtype="<f8")))
        total = np.zeros((p, p), dtype=np.float64)
        for k, owner in enumerate(plan.shard_owner):
            if owner == i:
                part = mine[k]
            else:
                sender = plan.participants[owner]
                part = np.array(_values(await _receive(inbox, plan, (DIST, 0, k, 0, sender)), sender))  # own copy
                if part.size != p * p or part.dtype != np.float64 or np.isnan(part).any() or (part < 0).any():
                    raise CollectiveError(f"distance matrix from {sender[:8]} is malformed", [sender])
                part = part.reshape(p, p)
                if k in owner_parts:
                    owner_parts[k].set_result(part)
            total = total + part
        total_distances.set_result(total)
        return total

    async def reduce_own() -> None:
        if not my_shards:
            return  # a non-owner reduces nothing (and gets no distance matrices: owners send them to owners)
        if with_distances:
            assert reducer is not None
            held: dict[tuple[int, int], np.ndarray] = {}
            mine: dict[int, np.ndarray] = {}
            for k in my_shards:
                d = np.zeros((p, p), dtype=np.float64)
                for off in _chunk_offsets(b[k + 1] - b[k], ce):
                    rows = held[(k, off)] = await contributions(k, off)
                    d = d + reducer.partial_distances(rows, b[k] + off, b[k] + off + rows.shape[1])
                mine[k] = d
            total = await summed_distances(mine)
            for (k, off), rows in held.items():
                red, rejected = reducer.reduce(rows, b[k] + off, b[k] + off + rows.shape[1], total)
                flagged.update(plan.participants[r] for r in rejected)
                await publish(k, off, red)
            return
        for k in my_shards:
            for off in _chunk_offsets(b[k + 1] - b[k], ce):
                if reducer is None:
                    red = await summed(k, off)
                else:
                    rows = await contributions(k, off)
                    red, rejected = reducer.reduce(rows, b[k] + off, b[k] + off + rows.shape[1], None)
                    flagged.update(plan.participants[r] for r in rejected)
                await publish(k, off, red)

    async def audit() -> None:
        """Recompute the aggregate of every shard this peer audits (see the docstring)."""
        for k in audited:
            owner = plan.participants[plan.shard_owner[k]]
            offs = list(_chunk_offsets(b[k + 1] - b[k], ce))
            total = None
            if with_distances:
                assert reducer is not None
                held = {off: await contributions(k, off) for off in offs}
                d = np.zeros((p, p), dtype=np.float64)
                for off, rows in held.items():
                    d = d + reducer.partial_distances(rows, b[k] + off, b[k] + off + rows.shape[1])
                theirs = await owner_parts[k]
                if not np.allclose(theirs, d, rtol=1e-6, atol=1e-9 * (1.0 + float(np.abs(d).max()))):
                    mismatches.append(CollectiveError(
                        f"owner {owner[:8]} sent distances of shard {k} that differ from the audit by "
                        f"{float(np.abs(theirs - d).max()):.3g}", [owner, me], audit=True))
                total = await total_distances
            for off in offs:
                if reducer is None:
                    red = await summed(k, off)
                else:
                    rows = held[off] if with_distances else await contributions(k, off)
                    red, _ = reducer.reduce(rows, b[k] + off, b[k] + off + rows.shape[1], total)
                expected[(k, off)].set_result(codec.final(red.astype(x.dtype, copy=False))[1])

    async def gather() -> None:
        for k, owner in enumerate(plan.shard_owner):
            if owner == i:
                continue
            sender = plan.participants[owner]
            for off in _chunk_offsets(b[k + 1] - b[k], ce):
                lo, hi = span(k, off)
                v = _values(await _receive(inbox, plan, (AG, 0, k, off, sender)), sender)
                faults.hit("ag", plan.round)
                if v.size != hi - lo:
                    raise CollectiveError(f"chunk from {sender[:8]} has {v.size} elements", [sender])
                buf[lo:hi] = v
                # A robust owner never publishes a non-finite value; checked in this peer's memory.
                if reducer is not None and not np.isfinite(buf[lo:hi]).all():
                    raise CollectiveError(f"chunk from {sender[:8]} holds non-finite values", [sender])
                if (k, off) in expected:
                    want = await expected[(k, off)]
                    # Same rows, same code: equal bits on one platform; the slack covers another
                    # CPU's float rounding (and with it, one quantization step of the codec).
                    slack = 1e-5 * np.abs(want) + 1e-6
                    if codec.on:
                        slack = slack + 2 * max_abs_error(np.abs(want), codec.name)
                    if not (np.abs(buf[lo:hi] - want) <= slack).all():
                        mismatches.append(CollectiveError(
                            f"owner {sender[:8]} published an aggregate of shard {k} that differs from the audit by "
                            f"{float(np.abs(buf[lo:hi] - want).max()):.3g}", [sender, me], audit=True))

    async def work() -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(scatter())
            tg.create_task(reduce_own())
            tg.create_task(gather())
            if audited:
                tg.create_task(audit())
        for st in streams.values():
            await st.put(None)

    async with asyncio.TaskGroup() as tg:
        for st in streams.values():
            tg.create_task(st.run())
        tg.create_task(work())
    if mismatches:
        raise mismatches[0]
    return buf, sum(s.bytes_sent for s in streams.values()), tuple(sorted(flagged)), digest(buf)
