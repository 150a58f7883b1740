"""Collectives between peers: butterfly (direct) all-reduce, ring all-reduce, and the sparse collectives.

Both are reduce-scatter followed by all-gather, pipelined per chunk: a chunk is forwarded as
soon as it is reduced, never store-and-forward of a whole shard. Each tensor shard has exactly
one peer that produces its final value (the shard owner in the butterfly, the last hop of the
ring) and everyone else receives those exact bytes, so every participant ends with a
bit-identical result (checked by the digest vote).

This module holds the algorithms and nothing of the transports: `_Butterfly` and `_Ring` send
chunks on the `Lane`s of a `peer.lanes.base.Lanes` (the network's, `peer.lanes.network.DataLanes`:
shared memory, the bulk TCP lane, gRPC streams, relays; or the in-memory one of the unit tests,
`peer.lanes.memory`), feed the chunks they receive to the pure parts, publish reduced shards and
assemble the result. The parts: `peer.partition.ShardPartition` (shards, chunks, who sends what
to whom), `peer.reduction` (`OwnerAccumulator`: a shard owner's rows and their reduction;
`final_encoding`) and `peer.audit.OwnerAudit` (an auditor's recomputation and verdict). One
butterfly attempt is a `_Butterfly` (tasks: scatter, reduce the owned shards, audit, gather),
one ring attempt a `_Ring`.

Sparse contributions (peer.sparse payloads of each peer's error-feedback accumulator) do not sum
in place: the sparse all-gather (`_SparseGather`, "allgather") sends each whole contribution to
every peer; the sparse reduce-scatter (`_SparseReduceScatter`, "sparse_rs") sends each index
range's part only to its shard owner, and the owner sends the merged range back as float32.

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
import contextlib
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from shoal.common.errors import InvalidArgument
from shoal.common.plan import Plan, is_sparse_collective
from shoal.relay.protocol import RELAY_ALTERED
from shoal.common.tensors import dtype_code, result_digest
from shoal.peer.testing import faults
from shoal.peer.audit import AuditVerdict, OwnerAudit
from shoal.peer.compression import Encoded, ErrorFeedback, codec_id, decode, encode
from shoal.peer.dataplane import Inbox, Payload, SenderGone, Transport
from shoal.peer.lanes import relay as relay_lane
from shoal.peer.lanes.base import CollectiveError, Lane, Lanes, Receiver
from shoal.peer.lanes.network import DataLanes
from shoal.peer.lanes.shm import lap_bytes, release
from shoal.peer.partition import ChunkSpan, ShardPartition
from shoal.peer.reduction import OwnerAccumulator, OwnerReducer, distance_matrix, final_encoding
from shoal.peer.result_digest import ResultDigest, off_loop
from shoal.peer.sparse import (DecodedSegment, ErrorAccumulator, SegmentReader, SparseEncoded, decode_segment,
                               range_end, segment_bounds, sum_contributions, sum_range, sum_segments, weights_of)
from shoal.v1 import shoal_pb2 as pb

log = logging.getLogger("shoal.peer.collectives")

RS, AG, DIST = pb.REDUCE_SCATTER, pb.ALL_GATHER, pb.DISTANCES

__all__ = ["CollectiveError", "CollectiveResult", "OwnerReducer", "SparseRound", "all_reduce"]


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
    # Sparse all-gather: the attempt key of this peer's pending `ErrorAccumulator` proposal,
    # which the caller commits once the round commits (None for dense collectives).
    sparse_attempt: Hashable | None = None


@dataclass(frozen=True)
class SparseRound:
    """What a peer brings to a sparse all-gather ("allgather" plans).

    accumulator: this peer's SparseLoCo error-feedback accumulator (peer.sparse); the collective
    calls `propose(x, attempt=(round, attempt))` and never commits: the caller commits the
    returned `CollectiveResult.sparse_attempt` once the round commits, and does nothing on abort.
    weights: one float per participant (plan order) multiplying its decoded contribution
    (FedAvg: n_i / sum n); None = the plain sum.
    """

    accumulator: ErrorAccumulator
    weights: tuple[float, ...] | None = None


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
        if self.name in ("int8", "fp4") and not np.isfinite(c).all():
            return values  # int8 / fp4 cannot carry NaN/inf: sent raw, and the owner rejects it
        enc = encode(c, self.name)
        if self.feedback is not None:
            self.pending.append((key, c, decode(enc)))
        return enc

    def final(self, values: np.ndarray) -> tuple[Payload, np.ndarray]:
        """Encode a final shard value once: (what is sent, what this peer keeps = what others decode)."""
        return final_encoding(values, self.name)


class _Wire:
    """One attempt's chunks as this peer sees them: the headers it sends, the chunks it awaits.

    Every wait is bounded by the plan's `chunk_timeout_seconds`; a chunk that does not come, a
    broken stream and a malformed chunk raise CollectiveError blaming its sender.
    """

    def __init__(self, plan: Plan, me: str, inbox: Receiver):
        self.plan, self.me, self.inbox = plan, me, inbox

    def message(self, phase: int, step: int, shard: int, off: int,
                values: Payload) -> tuple[pb.Chunk, bytes | np.ndarray]:
        """A new chunk header (data left for the lane, which fills in where the bytes travel) and its bytes."""
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
                # not come (docs/nat.md, "Relays").
                raise relay_lane.stalled(relay, sender, plan.chunk_timeout_seconds, where) from None
            raise CollectiveError(
                f"no chunk from {sender[:8]} within {plan.chunk_timeout_seconds:.1f}s {where}", [sender]) from None
        except SenderGone as exc:
            if RELAY_ALTERED in str(exc):  # the chunk changed on its way through this peer's relay
                relay = plan.relay_of(plan.position(self.me))
                raise CollectiveError(f"relay {relay}: {exc}", relay=relay) from None
            raise CollectiveError(str(exc), [sender]) from None

    async def received(self, phase: int, step: int, span: ChunkSpan, sender: str) -> tuple[Payload, np.ndarray]:
        """A reduce-scatter or all-gather chunk: as it arrived, and its decoded `(span.size,)` values.

        A raw payload may be a view of the sender's shared-memory slab (peer.lanes.shm): value checks
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


def _into(dst: np.ndarray, src: np.ndarray) -> None:
    """`dst[:] = src`, skipped when `src` already is `dst` (a sum computed in place)."""
    if src.__array_interface__["data"][0] != dst.__array_interface__["data"][0] or src.shape != dst.shape:
        dst[...] = src


def _release(rows: Sequence[np.ndarray]) -> None:
    """Received chunks the collective consumed: their shared-memory pages leave this process's
    resident set (peer.lanes.shm.release; a no-op for chunks in this process's own memory)."""
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
    peer.testing.byzantine "owner") corrupts what this peer publishes as owner.
    """

    def __init__(self, x: np.ndarray, plan: Plan, me: str, lanes: Lanes, reducer: OwnerReducer | None,
                 codec: _Codec, tamper=None):
        self.part = part = ShardPartition(plan, me, x.itemsize)
        self.plan = plan
        self.me, self.dtype, self.wire = me, x.dtype, _Wire(plan, me, lanes.receiver)
        self.reducer, self.codec, self.tamper = reducer, codec, tamper
        self.with_distances = reducer is not None and reducer.needs_distances
        self.streams: dict[int, Lane] = {j: lanes.open(j) for j in range(part.size) if j != part.me}
        self.bounded = self._bound(lanes)
        # Every element is written: own shards by the sums (or publish), the others by gather.
        self.result = lanes.result(x)
        self.buf = self.result.values
        self.hashed = ResultDigest(self.buf)  # the vote digest, fed as chunks become final
        self.digest = b""  # set once the last chunk is hashed
        self.complete = False  # this peer's result is whole (`_run_streams`)
        self.own = _Contribution(x, codec, plan.audit_owners, me)
        # The plain sum of an owned chunk is computed straight into its slice of the result.
        self.owned = OwnerAccumulator(part, part.owned, reducer, x.dtype, out=self.buf)
        self.shared = lanes.shared()
        if self.result.private and not codec.on:  # the all-gather's chunks read in place (`_Wire.post`)
            for k in part.gathered:
                for span in part.chunks(k):
                    self.wire.post(AG, 0, span, part.peer_id(part.owner[k]), self.buf[span.lo:span.hi])
        self.audit = OwnerAudit(part, reducer, x.dtype, codec.name) if part.audited else None
        self.handoff = _Handoff()  # audited shards: the owners' distance matrices, the expected values
        self.mismatches: list[CollectiveError] = []

    def _bound(self, lanes: Lanes) -> bool:
        """Bound the reduce-scatter slabs (`Lanes.bound`: every stream on the shared-memory lane,
        chosen in an earlier round) when every chunk sent to an owner is consumed before the
        owner publishes that chunk's aggregate to this peer: the plain sum or a reducer without
        distances (which reduces chunk by chunk), no audit (an auditor publishes nothing). The
        credit of a chunk is then the arrival of its aggregate."""
        plan, part = self.plan, self.part
        if self.with_distances or plan.audit_owners:
            return False
        credits = {j: (lambda key, owner=part.peer_id(j): self.wire.arrived(AG, 0, key[0], key[1], owner))
                   for j in self.streams if j in plan.shard_owner}
        return lanes.bound(self.streams, credits,
                           lap_bytes(part.chunk_elems * part.itemsize, part.num_elements * part.itemsize, part.size))

    async def run(self) -> _Outcome:
        ok = False
        try:
            await _run_streams(self.plan, self.streams, self._work, lambda: self.complete)
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
        self.complete = True  # every chunk this peer needs is in, every chunk it sends is queued
        for st in self.streams.values():
            await st.close()
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
                    await self.streams[t].send(*self.wire.message(RS, 0, k, span.offset, payload))

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
            await st.send(*item, place)

    async def _exchange_distances(self, mine: dict[int, np.ndarray]) -> np.ndarray:
        """Send this owner's partial matrices to the other owners; sum every shard's in shard
        order (the same bytes on every owner). Hands the audited owners' matrices to `_audit`."""
        for k, d in mine.items():
            for o in self.part.other_owners():
                await self.streams[o].send(*self.wire.message(DIST, 0, k, 0, np.ascontiguousarray(d, dtype="<f8")))
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

    def __init__(self, x: np.ndarray, plan: Plan, me: str, lanes: Lanes, codec: _Codec):
        self.part = part = ShardPartition(plan, me, x.itemsize)
        self.plan = plan
        self.x, self.codec, self.wire = x, codec, _Wire(plan, me, lanes.receiver)
        # Not a copy of x: every element is written by a sum (x + the predecessor's partial) or by
        # its final value, chunk by chunk, so the first chunk leaves without a whole-tensor pass
        # (64 MB into fresh pages: 20-40 ms before the first byte on this machine).
        self.result = lanes.result(x)
        self.buf = self.result.values
        self.hashed = ResultDigest(self.buf)  # the vote digest, fed as chunks become final
        self.digest = b""  # set once the last chunk is hashed
        self.complete = False  # this peer's result is whole (`_run_streams`)
        self.prev = part.peer_id((part.me - 1) % part.size)
        self.out = lanes.open((part.me + 1) % part.size, solo=True)
        if self.result.private and not codec.on:  # the all-gather's chunks read in place (`_Wire.post`)
            for s in range(part.size - 1):
                for span in part.chunks(part.ring_gathered(s)):
                    self.wire.post(AG, s, span, self.prev, self.buf[span.lo:span.hi])

    async def run(self) -> _Outcome:
        await _run_streams(self.plan, {(self.part.me + 1) % self.part.size: self.out}, self._schedule,
                           lambda: self.complete)
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
        self.complete = True
        await self.out.close()
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
        # From the result buffer itself when it is shared (peer.lanes.shm): the successor reads this
        # peer's partial sum or final chunk there; neither changes before the successor took it
        # (a partial is overwritten only by its final value, which exists only after every
        # later hop, the successor's first, consumed it).
        await self.out.send(*self.wire.message(phase, step, span.shard, span.offset, payload),
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
        # memory (a received view may still change: peer.lanes.shm). A peer whose own input is
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


class _SparseGather:
    """One sparse all-gather attempt from one participant: this peer's whole contribution,
    encoded by its error-feedback accumulator (`SparseRound`) in segments of whole chunks
    (`peer.sparse.segment_bounds`, on the codec threads, `_CODEC`), goes to every other
    participant as consecutive segment payloads, each sent as soon as it is encoded, in pieces of
    at most `plan.chunk_bytes` (phase ALL_GATHER, step 0, shard 0, offset = byte offset in the
    stream; `peer.dataplane.Session._sparse_piece` checks each), one outgoing stream per
    participant, all in one TaskGroup. It receives every other participant's stream, checks and
    decodes each segment as it completes (`SegmentReader`, `decode_segment`; a malformed one
    blames its sender), so the links and the codec work at once. As soon as every participant's
    segments cover a range of elements, it sums the range's decoded contributions in participant
    order (`peer.sparse.sum_range`, weighted by `SparseRound.weights`) into the attempt's result
    buffer and hashes it (`ResultDigest`): the sum and the digest run while later segments are
    still on the wire, not after the last one. Every participant adds the same float32 numbers in
    the same order (however the ranges fall), so all hold the same bytes and the vote digest
    proves it.

    Failure semantics as for every collective: a piece that does not come within the chunk
    deadline, a broken stream or a payload that does not parse (wrong codec, chunk or count for
    this plan; a field malformed) raises CollectiveError naming its sender; `x` is never
    modified and the accumulator only holds a proposal (the caller commits it on commit).
    """

    def __init__(self, x: np.ndarray, plan: Plan, me: str, lanes: Lanes, sparse: SparseRound):
        self.x, self.plan, self.me, self.sparse = x, plan, me, sparse
        self.position = plan.position(me)
        self.wire = _Wire(plan, me, lanes.receiver)
        self.streams: dict[int, Lane] = {j: lanes.open(j) for j in range(plan.size) if j != self.position}
        self.result = lanes.result(x)  # a pooled buffer: a fresh one faults in every page the sum touches
        self.hashed = ResultDigest(self.result.values)  # the vote digest, fed range by range as sums finish
        self.piece = max(4, plan.chunk_bytes // 4 * 4)  # what Session admits: chunk_bytes // 4 elements' worth
        # participant -> its segments decoded so far, in element order, and the elements they cover
        self.decoded: dict[int, list[DecodedSegment]] = {j: [] for j in range(plan.size)}
        self.covered = [0] * plan.size
        self.summed = 0  # elements [0, summed) are summed (or being summed)
        self.weights = weights_of(sparse.weights, plan.size)
        self.received = 0  # payload bytes received
        self.sent = asyncio.Event()  # every segment is queued on every stream
        self.complete = False  # every payload is in (`_run_streams`)
        self.tg: asyncio.TaskGroup | None = None

    async def run(self) -> _Outcome:
        await _run_streams(self.plan, self.streams, self._work, lambda: self.complete)
        digest = await self.hashed.finish()
        sent = sum(s.bytes_sent for s in self.streams.values())
        return _Outcome(self.result.values, digest, sent, self.received)

    async def _work(self) -> None:
        ready: asyncio.Queue[bytes | None] = asyncio.Queue()
        async with asyncio.TaskGroup() as tg:
            self.tg = tg
            tg.create_task(self._encode(ready))
            tg.create_task(self._send(ready))
            for j in self.streams:
                tg.create_task(self._receive(j))
        self.complete = True
        for st in self.streams.values():
            await st.close()

    def _add(self, j: int, segment: DecodedSegment) -> None:
        """Participant j's next decoded segment; sums the elements every participant now covers."""
        self.decoded[j].append(segment)
        self.covered[j] = segment.first + segment.parsed.count
        hi = range_end(min(self.covered), self.x.size, self.sparse.accumulator.codec)
        if hi > self.summed:
            assert self.tg is not None
            self.tg.create_task(self._sum(self.summed, hi))
            self.summed = hi

    async def _sum(self, lo: int, hi: int) -> None:
        """Sum elements [lo, hi) in participant order (`peer.sparse.sum_range`), then hash them."""
        parts = [list(self.decoded[j]) for j in range(self.plan.size)]
        await _on_codec(sum_range, parts, lo, hi, self.sparse.accumulator.codec, self.weights, self.result.values)
        self.hashed.filled(lo, hi)

    async def _encode(self, ready: asyncio.Queue) -> None:
        """Encode the segments (several at once on the codec threads), queue each for sending
        in order as it is done, then record the proposal with the accumulator."""
        acc, loop = self.sparse.accumulator, asyncio.get_running_loop()
        bounds = segment_bounds(self.x.size, acc.codec.chunk)
        jobs = [loop.run_in_executor(_CODEC, self._encode_one, lo, hi) for lo, hi in bounds]
        segments = []
        try:
            for job in jobs:
                enc, decoded = await job
                segments.append((decoded.first, enc))
                ready.put_nowait(enc.to_bytes())
                self._add(self.position, decoded)
        except InvalidArgument as exc:
            raise CollectiveError(f"this peer's contribution cannot be encoded: {exc}", []) from None
        finally:
            for job in jobs:
                job.cancel()  # those not started yet, when one failed or the attempt was cancelled
                if job.done() and not job.cancelled():
                    job.exception()  # retrieved: a later segment's failure is not logged as lost
        acc.proposed(self.x, segments, attempt=(self.plan.round, self.plan.attempt))
        ready.put_nowait(None)

    def _encode_one(self, lo: int, hi: int) -> tuple[SparseEncoded, DecodedSegment]:
        enc = self.sparse.accumulator.propose_segment(self.x, lo, hi)
        return enc, decode_segment(lo, enc)

    async def _send(self, ready: asyncio.Queue) -> None:
        """Every segment to every other participant as it is encoded, piece by piece (each piece
        to all before the next: the slowest receiver holds back no one's first bytes)."""
        off = 0
        while (data := await ready.get()) is not None:
            for at in range(0, len(data), self.piece):
                piece = data[at:at + self.piece]
                for st in self.streams.values():
                    chunk = pb.Chunk(round=self.plan.round, attempt=self.plan.attempt, sender=self.me,
                                     phase=AG, step=0, shard=0, offset=off, dtype=pb.FLOAT32,
                                     shape=[len(piece)], codec=self.sparse.accumulator.codec.codec_id)
                    await st.send(chunk, piece)
                off += len(piece)
        self.sent.set()

    async def _receive(self, j: int) -> None:
        sender = self.plan.participants[j]
        reader = SegmentReader(self.sparse.accumulator.codec, self.x.size)
        try:
            while not reader.done:
                for first, enc in reader.feed(await self._piece(sender, reader.nbytes)):
                    self._add(j, await _on_codec(decode_segment, first, enc))
        except InvalidArgument as exc:
            # Wait (at most a chunk deadline) until this peer's own contribution is queued on
            # every stream before failing: the other receivers then judge the malformed payload
            # themselves, instead of waiting a chunk timeout on a stream this peer abandoned.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.plan.chunk_timeout_seconds):
                    await self.sent.wait()
            raise CollectiveError(f"sparse payload from {sender[:8]} is malformed: {exc}", [sender]) from None
        faults.hit("ag", self.plan.round)
        self.received += reader.nbytes

    async def _piece(self, sender: str, off: int) -> bytes:
        payload = await self.wire.payload(AG, 0, 0, off, sender)
        if not isinstance(payload, Encoded) or payload.codec != self.sparse.accumulator.codec.codec_id:
            raise CollectiveError(f"chunk from {sender[:8]} at byte {off} is not a piece of this round's "
                                  "sparse payload", [sender])
        return payload.data


class _SparseReduceScatter:
    """One sparse reduce-scatter attempt ("sparse_rs" plans) from one participant: a sparse
    reduce-scatter by index range, then a dense float32 all-gather of the merged ranges.

    Reduce-scatter: this peer's contribution is encoded by its error-feedback accumulator
    (`SparseRound`) shard by shard (the plan's `shard_bounds`, whole codec chunks:
    `shoal.common.plan.sparse_shard_bounds`), each shard in segments of whole chunks from the
    shard's start (`peer.sparse.segment_bounds` of the shard, on the codec threads), and the
    proposal is recorded once as `_SparseGather` records it. Shard k's segment payloads go only
    to its shard owner ``participants[shard_owner[k]]``, as one byte stream in pieces of at most
    `plan.chunk_bytes` (phase REDUCE_SCATTER, step 0, shard k, offset = byte offset in that
    shard's stream; `peer.dataplane.Session._sparse_piece` checks each). An owner reads every
    other participant's stream of each shard it owns (`SegmentReader` of the shard's length,
    `decode_segment` with element indices relative to the shard's start; a malformed one blames
    its sender) and sums the p contributions of the shard in participant order
    (`peer.sparse.sum_segments`, weighted by `SparseRound.weights`) into its slice of the result.

    All-gather: the owner sends its merged range to every other participant as plain float32
    chunks (phase ALL_GATHER, step 0, `peer.partition.ShardPartition` chunk spans, as the
    butterfly's), and every participant copies the other owners' ranges into its result; a
    non-finite value in a merged range blames its owner. Float32, not sparse: a merged range
    holds up to p·k of every C elements, so at the p where this collective beats the all-gather
    (the dense range costs 4 bytes an element against (p-1)·S for the all-gather) it is dense,
    and float32 is lossless: every participant holds the owner's sum, bit for bit. That sum is
    the same float32 additions in the same order, element by element, as `_SparseGather`'s (the
    ranges start on chunk boundaries, so the segments hold the same chunks), so for the same
    inputs and accumulators both collectives give the same bytes (for "dct" the per-chunk
    transforms run in other batches; equal on the builds tested, and every participant holds
    the owner's bytes either way). The vote digest is fed as ranges become final (`ResultDigest`).

    Failure semantics as for every collective: a piece or chunk that does not come within the
    chunk deadline, a broken stream or a payload that does not parse raises CollectiveError
    naming its sender; so a contributor whose stream to an owner is missing is blamed by that
    owner, and the peers waiting on that owner's merged range blame the owner after the chunk
    deadline, as in the butterfly's all-gather. The coordinator's blame (coordinator.blame)
    follows the waits to their end: a silent contributor is excluded; a contributor that withholds
    its stream from one owner only, and itself waits on that owner's range, makes a cycle that
    the accusation counts resolve against the owner, as in the butterfly. `x` is never modified
    and the accumulator only holds a proposal (the caller commits it on commit).
    """

    def __init__(self, x: np.ndarray, plan: Plan, me: str, lanes: Lanes, sparse: SparseRound):
        self.x, self.plan, self.me, self.sparse = x, plan, me, sparse
        self.part = ShardPartition(plan, me, 4)  # the all-gather's float32 chunk spans
        self.position = plan.position(me)
        self.wire = _Wire(plan, me, lanes.receiver)
        self.streams: dict[int, Lane] = {j: lanes.open(j) for j in range(plan.size) if j != self.position}
        self.result = lanes.result(x)
        self.buf = self.result.values
        self.hashed = ResultDigest(self.buf)  # the vote digest, fed as ranges become final
        self.digest = b""
        self.piece = max(4, plan.chunk_bytes // 4 * 4)  # what Session admits: chunk_bytes // 4 elements' worth
        chunk = sparse.accumulator.codec.chunk
        # Per shard, its segments [lo, hi) in the whole vector (whole chunks from the shard's start);
        # an empty shard (fewer chunks than owners) has none: nothing is sent, merged or gathered.
        self.segments = {k: [(lo + a, lo + b) for a, b in segment_bounds(hi - lo, chunk)] if hi > lo else []
                         for k, (lo, hi) in enumerate(zip(plan.shard_bounds, plan.shard_bounds[1:]))}
        self.mine: dict[int, asyncio.Future] = {}  # owned shard -> this peer's decoded segments of it
        self.received = 0  # payload bytes received (sparse streams and merged ranges)
        self.sent = asyncio.Event()  # every shard's stream is queued to its owner
        self.complete = False  # every range is in, every chunk this peer sends is queued (`_run_streams`)

    async def run(self) -> _Outcome:
        await _run_streams(self.plan, self.streams, self._work, lambda: self.complete)
        return _Outcome(self.buf, self.digest, sum(s.bytes_sent for s in self.streams.values()), self.received)

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        self.mine = {k: loop.create_future() for k in self.part.owned}
        # Encoded on the codec threads in the order this peer scatters them: the next owners'
        # shards first (me+1, me+2, ...: not every peer at one owner at once), its own last (it
        # is summed only once the others' streams are in).
        p = self.plan.size
        order = sorted(range(len(self.plan.shard_owner)),
                       key=lambda k: ((self.plan.shard_owner[k] - self.position - 1) % p, k))
        jobs = {k: [loop.run_in_executor(_CODEC, self.sparse.accumulator.propose_segment, self.x, lo, hi)
                    for lo, hi in self.segments[k]] for k in order}
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._propose(jobs))
                scatter = [tg.create_task(self._scatter(k, jobs[k])) for k in order
                           if self.plan.shard_owner[k] != self.position]
                tg.create_task(self._sent_all(scatter))
                for k in self.part.owned:
                    tg.create_task(self._reduce(k))
                for k in self.part.gathered:
                    tg.create_task(self._gather(k))
        finally:
            for job in (j for js in jobs.values() for j in js):
                job.cancel()  # those not started yet, when one failed or the attempt was cancelled
                if job.done() and not job.cancelled():
                    job.exception()  # retrieved: a later segment's failure is not logged as lost
        self.complete = True
        for st in self.streams.values():
            await st.close()
        self.digest = await self.hashed.finish()  # while the streams drain

    async def _propose(self, jobs: dict[int, list[asyncio.Future]]) -> None:
        """Await every segment's encoding, record the whole proposal with the accumulator (in
        element order), hand this peer's decoded segments of its owned shards to `_reduce`."""
        acc, bounds = self.sparse.accumulator, self.plan.shard_bounds
        try:
            encoded = {k: [await job for job in js] for k, js in jobs.items()}
        except InvalidArgument as exc:
            raise CollectiveError(f"this peer's contribution cannot be encoded: {exc}", []) from None
        segments = [(lo, enc) for k in sorted(encoded) for (lo, _), enc in zip(self.segments[k], encoded[k])]
        acc.proposed(self.x, segments, attempt=(self.plan.round, self.plan.attempt))
        for k, fut in self.mine.items():
            fut.set_result([await _on_codec(decode_segment, lo - bounds[k], enc)
                            for (lo, _), enc in zip(self.segments[k], encoded[k])])

    async def _scatter(self, k: int, jobs: list[asyncio.Future]) -> None:
        """Shard k's segments to its owner as each is encoded, piece by piece."""
        st, off = self.streams[self.plan.shard_owner[k]], 0
        for job in jobs:
            try:
                data = (await job).to_bytes()
            except InvalidArgument:
                return  # `_propose` reports it
            for at in range(0, len(data), self.piece):
                piece = data[at:at + self.piece]
                chunk = pb.Chunk(round=self.plan.round, attempt=self.plan.attempt, sender=self.me,
                                 phase=RS, step=0, shard=k, offset=off, dtype=pb.FLOAT32,
                                 shape=[len(piece)], codec=self.sparse.accumulator.codec.codec_id)
                await st.send(chunk, piece)
                off += len(piece)

    async def _sent_all(self, tasks: Sequence[asyncio.Task]) -> None:
        await asyncio.gather(*tasks)
        self.sent.set()

    async def _reduce(self, k: int) -> None:
        """Shard k (owned): every participant's contribution of it, the fixed-order sum into this
        peer's result, then the merged range to every other participant."""
        lo, hi = self.plan.shard_bounds[k], self.plan.shard_bounds[k + 1]
        if hi == lo:
            return
        others: dict[int, asyncio.Task] = {}
        async with asyncio.TaskGroup() as tg:
            for j in self.streams:
                others[j] = tg.create_task(self._contribution(k, j, hi - lo))
        parts = [await self.mine[k] if j == self.position else others[j].result() for j in range(self.plan.size)]
        await _on_codec(sum_segments, parts, hi - lo, self.sparse.accumulator.codec, self.sparse.weights,
                        self.buf[lo:hi])
        self.hashed.filled(lo, hi)
        for span in self.part.chunks(k):
            for st in self.streams.values():
                await st.send(*self.wire.message(AG, 0, k, span.offset, self.buf[span.lo:span.hi]))

    async def _contribution(self, k: int, j: int, count: int) -> list[DecodedSegment]:
        """Participant j's stream of shard k, checked and decoded segment by segment."""
        sender = self.plan.participants[j]
        reader = SegmentReader(self.sparse.accumulator.codec, count)
        parts: list[DecodedSegment] = []
        try:
            while not reader.done:
                for first, enc in reader.feed(await self._piece(k, sender, reader.nbytes)):
                    parts.append(await _on_codec(decode_segment, first, enc))
        except InvalidArgument as exc:
            # As in the all-gather: first let this peer's own streams reach the other owners (at
            # most a chunk deadline), so they judge their ranges themselves.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.plan.chunk_timeout_seconds):
                    await self.sent.wait()
            raise CollectiveError(f"sparse payload of shard {k} from {sender[:8]} is malformed: {exc}",
                                  [sender]) from None
        faults.hit("rs", self.plan.round)
        self.received += reader.nbytes
        return parts

    async def _piece(self, k: int, sender: str, off: int) -> bytes:
        payload = await self.wire.payload(RS, 0, k, off, sender)
        if not isinstance(payload, Encoded) or payload.codec != self.sparse.accumulator.codec.codec_id:
            raise CollectiveError(f"chunk from {sender[:8]} at byte {off} of shard {k} is not a piece of this "
                                  "round's sparse payload", [sender])
        return payload.data

    async def _gather(self, k: int) -> None:
        """Shard k's merged range from its owner, chunk by chunk, into this peer's result."""
        owner = self.plan.participants[self.plan.shard_owner[k]]
        for span in self.part.chunks(k):
            final = self.buf[span.lo:span.hi]
            values = await self.wire.values(AG, 0, span, owner)
            _into(final, values)
            release(values)
            if not np.isfinite(final).all():  # checked in this peer's memory
                raise CollectiveError(f"chunk from {owner[:8]} holds non-finite values", [owner])
            self.hashed.filled(span.lo, span.hi)
            self.received += final.nbytes


CODEC_THREADS = max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))
"""Threads of a process's sparse codec work (encode and decode segments, the sum): numpy releases
the GIL in it, so a peer with cores to spare encodes several segments at once."""
_CODEC = ThreadPoolExecutor(max_workers=CODEC_THREADS, thread_name_prefix="shoal-codec")


async def _on_codec(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(_CODEC, fn, *args)


async def all_reduce(x: np.ndarray, plan: Plan, *, me: str, transport: Transport | None = None,
                     inbox: Inbox | None = None, lanes: Lanes | None = None,
                     reducer: OwnerReducer | None = None, feedback: ErrorFeedback | None = None,
                     links=None, tamper=None, sparse: SparseRound | None = None) -> CollectiveResult:
    """Sum `x` (1-D, float32 or float16) across the plan's participants; see the module docstring.

    The chunks travel on `lanes` (peer.lanes.base `Lanes`, for this attempt of `plan`), by
    default the network's: `peer.lanes.network.DataLanes` over `transport` and `inbox`.

    `reducer` (butterfly only) replaces the plain sum at the shard owner, e.g. a robust
    aggregator; its rejections come back as `flagged`. `feedback` is read (never written): the
    pending updates are returned in `CollectiveResult.feedback`. `links` (a peer.links.LinkMeter)
    receives the passive throughput of every outgoing stream and of the whole collective (see
    peer.links; measurement never changes the result). `tamper` (testing only: the "owner"
    attack of peer.testing.byzantine) replaces what this peer publishes as a butterfly shard owner; an
    audited plan (`plan.audit_owners`) catches it. Returns the result and its digest.

    An "allgather" plan (sparse compression) runs the sparse all-gather (`_SparseGather`), a
    "sparse_rs" plan the sparse reduce-scatter by index range (`_SparseReduceScatter`); both
    need `sparse` (this peer's accumulator and the contributions' weights); the result is the
    (weighted) sum of every participant's decoded contribution and `sparse_attempt` the key of
    the accumulator's proposal to commit once the round commits.

    Raises ValueError for an `x` that is not 1-D, CollectiveError on any failure (every wait
    bounded by the plan's chunk timeout and the whole by its deadline); `x` and `feedback` are
    never modified.
    """
    t0 = time.monotonic()
    _check(x, plan, me)
    if is_sparse_collective(plan):
        return await _sparse_all_gather(x, plan, me, transport, inbox, lanes, links, sparse, t0)
    if len(plan.participants) == 1:
        return _alone(x, plan, reducer, t0)
    try:
        codec = _Codec(plan.compression, x.dtype, feedback)
    except InvalidArgument as exc:
        raise CollectiveError(f"plan: {exc}", []) from None
    if lanes is None:
        lanes = DataLanes(transport, inbox, plan, me, links)
    out = await _attempt(x, plan, me, lanes, reducer, codec, tamper)
    seconds = time.monotonic() - t0
    if links is not None:
        links.observe_collective(out.sent, out.received, seconds)
    return CollectiveResult(out.values, out.digest, out.sent, seconds, out.flagged, tuple(codec.pending))


async def _sparse_all_gather(x: np.ndarray, plan: Plan, me: str, transport, inbox, lanes: Lanes | None, links,
                             sparse: SparseRound | None, t0: float) -> CollectiveResult:
    if sparse is None or x.dtype != np.float32:
        raise CollectiveError("plan: the sparse all-gather needs float32 input and this peer's error-feedback "
                              "accumulator (the run's compression must be topk or dct)", [])
    if plan.outbound_only:
        raise CollectiveError("plan: the sparse collectives need every participant dialable", [])
    chunk = sparse.accumulator.codec.chunk
    if plan.collective == "sparse_rs" and any(b % chunk and b != x.size for b in plan.shard_bounds):
        raise CollectiveError(f"plan: sparse_rs shard bounds {plan.shard_bounds[:4]}... are not on chunks of "
                              f"{chunk} elements", [])
    attempt = (plan.round, plan.attempt)
    if plan.size == 1:
        try:
            mine = await off_loop(lambda: sparse.accumulator.propose(x, attempt=attempt))
        except InvalidArgument as exc:
            raise CollectiveError(f"this peer's contribution cannot be encoded: {exc}", []) from None
        values = await off_loop(sum_contributions, [mine], sparse.weights)
        return CollectiveResult(values, result_digest(values), 0, time.monotonic() - t0, sparse_attempt=attempt)
    if lanes is None:
        lanes = DataLanes(transport, inbox, plan, me, links)
    kind = _SparseGather if plan.collective == "allgather" else _SparseReduceScatter
    out = await _within_deadline(plan, lanes, lambda: kind(x, plan, me, lanes, sparse).run())
    # Not fed to the link meter as a whole-collective observation: its time is mostly the codec's
    # CPU (encode, decode, sum), and so few bytes over it would read as a slow link.
    return CollectiveResult(out.values, out.digest, out.sent, time.monotonic() - t0, sparse_attempt=attempt)


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


async def _attempt(x: np.ndarray, plan: Plan, me: str, lanes: Lanes, reducer: OwnerReducer | None,
                   codec: _Codec, tamper) -> _Outcome:
    """Run the plan's collective within its deadline (`_within_deadline`)."""
    if plan.collective == "butterfly":
        return await _within_deadline(plan, lanes, lambda: _Butterfly(x, plan, me, lanes, reducer, codec, tamper).run())
    if reducer is not None:
        raise CollectiveError("ring all-reduce supports only the sum; use butterfly for aggregators")
    return await _within_deadline(plan, lanes, lambda: _Ring(x, plan, me, lanes, codec).run())


async def _run_streams(plan: Plan, streams: dict[int, Lane], work, complete) -> None:
    """Run `streams` (this peer's lanes of the attempt) beside `work()`, this peer's side of the
    collective, which closes the streams and returns once this peer holds its whole result;
    `complete()` says whether every chunk this peer needs has arrived and every chunk it sends is
    queued (set by `work` before it closes the streams and finishes the digest, so always by
    the time `work` returns).

    Until then a failed stream fails the collective. After it a stream only delivers what is
    queued and ends: one that fails, or has not ended a chunk deadline after `work` returned, no
    longer fails this peer's collective (its receiver died or stalled after taking what it needed, or it finds
    a chunk missing and its own vote says so); it is cancelled. So a participant that vanishes
    after sending costs the others nothing they hold: their votes still count (with secure
    aggregation the attempt commits without the vanished one's vote, coordinator.attempt)."""
    async def stream(j: int, st: Lane) -> None:
        try:
            await st.run()
        except CollectiveError as exc:
            if not complete():
                raise
            log.info("round %d.%d: the stream to %s failed after this peer's result was complete (%s)",
                     plan.round, plan.attempt, plan.participants[j][:8], exc)

    async with asyncio.TaskGroup() as tg:
        tasks = {j: tg.create_task(stream(j, st)) for j, st in streams.items()}
        await work()
        if tasks:
            _, late = await asyncio.wait(tasks.values(), timeout=plan.chunk_timeout_seconds)
            for j, t in tasks.items():
                if t in late:
                    t.cancel()
                    log.info("round %d.%d: the stream to %s did not end within %.1fs of this peer's last "
                             "chunk; its result is complete", plan.round, plan.attempt,
                             plan.participants[j][:8], plan.chunk_timeout_seconds)


async def _within_deadline(plan: Plan, lanes: Lanes, run):
    """Choose the lanes, then build and await the collective (`run()`, called after the choice: the
    collectives read the chosen lanes when they are made) within the plan's deadline; the
    CollectiveErrors of its tasks become one, a passed deadline a CollectiveError naming it."""
    try:
        async with asyncio.timeout(plan.deadline_seconds):
            await lanes.choose()
            return await run()
    except TimeoutError:
        raise CollectiveError(f"collective deadline of {plan.deadline_seconds:.1f}s passed", []) from None
    except BaseExceptionGroup as group:
        if any(isinstance(e, CollectiveError) for e in _flatten(group)):
            raise _first(group) from None
        raise


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
