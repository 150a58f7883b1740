"""The peer's data plane: the shoal.v1.Peer server, the chunk inbox and outgoing channels.

`Inbox` holds tensor chunks that arrived from other peers until the collective asks for them
(arrival may precede the local plan by a few milliseconds: chunks are buffered, within bounds).
`PeerService` is the gRPC servicer: it validates each chunk against the running collective and
hands it to the inbox; it serves committed state to joiners and answers link probes.
`Transport` owns the outgoing channels, one per remote address, reused across rounds.

Who may push (docs/security.md): a PushChunks stream is accepted only when its first chunk is
signed by the sender's key (metadata over the chunk, `shoal.common.security.push_metadata`) and carries a
coordinator-signed round ticket naming the sender, this round attempt and the plan this peer
holds; every chunk must then match the plan (dtype, 1-D shape within the shard bounds, chunk
size) and the first chunk's sender/round/attempt. Anything else is refused before a single value
reaches the inbox. FetchState needs a signed request and a ticket or sync permit naming the
requester (proof of membership) for the round it asks for (a permit serves only the state of
the sync it was issued for: a member revoked since cannot fetch a newer one); Probe a signed request. Reach (the coordinator's reachability
dial-back, shoal.common.reach) is unsigned: it only signs a nonce under its own context. With a
certificate issued at join
(`shoal.common.certs.PeerTLS`) the server is mutual TLS and every call's client certificate must
name the peer that signed it (`shoal.common.security.tls_sender_check`): a peer holding another
peer's certificate is refused (UNAUTHENTICATED). `Transport` dials a peer by the id the plan names
(the server's certificate must be issued for that id), whatever its address.

Outbound-only participants (docs/nat.md; nobody can dial them) open `Exchange` to every shard
owner instead of being pushed to: what they send is admitted exactly as on PushChunks (signature
over the first chunk, for the Exchange method; the ticket; the plan's checks), and the owner's
reduced shards go back on the same stream from the participant's `ReplyLane` (filled by the
owner's collective). The owner signs its first reply (initial metadata, `EXCHANGE_REPLY`) and it
carries the owner's ticket; `take_replies` checks both, then every reply against the plan, before
a single value reaches the participant's inbox.

Relayed participants (docs/nat.md, "Relays"; `Plan.relays`): every chunk pushed to one carries
`chunk_signature` (`Transport.sign_relayed`), and such a participant checks it on every chunk
before anything else (`PeerService._check_relayed`): a relay cannot change a chunk unseen. A
failed check refuses the stream with `RELAY_ALTERED` in its details and fails the waits on that
sender with it, so both ends vote the relay's fault (no peer is excluded): on a stream's first
chunk too, once its ticket names the sender (`PeerService._first_altered`), and on a later
message that no longer decodes. The inbox counts each sender's open streams (`Inbox.streaming`)
so that a relayed receiver can tell a chunk stalled in an open stream (the relay's doing) from a
sender that never sent it. Exchange streams are
not covered: a relayed peer that is planned outbound-only dials the owners directly.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.peer.lanes import bulk, pool, shm
from shoal.peer.testing import faults
from shoal.peer.compression import FP4, Encoded, data_bytes, scale_bytes
from shoal.peer.sparse import SEGMENT_ELEMENTS as SPARSE_SEGMENT_ELEMENTS
from shoal.peer.sparse import SPARSE_CODECS
from shoal.common.errors import (DeadlineExceeded, DecodeErrors, FailedPrecondition, InvalidArgument, PermissionDenied,
                         ResourceExhausted, ShoalError, grpc_errors, require)
from shoal.common.identity import MD_PUBKEY, RequestVerifier, peer_id_of, public_bytes, sign_metadata
from shoal.peer.lanes.shm import SHARED_POOL, SegmentReader
from shoal.common import reach
from shoal.relay.protocol import RELAY_ALTERED, chunk_signature_ok, sign_chunk
from shoal.common.limits import DATA_MAX_MESSAGE_BYTES, PEER_MAX_CONCURRENT_RPCS, RateLimiter
from shoal.common.certs import PeerTLS
from shoal.common.security import (MD_TICKET, PUSH_CHUNKS, Security, SignedCalls, add_port, open_peer_channel,
                           push_metadata, signing_interceptors, tls_sender_check)
from shoal.common.tensors import decode_chunk, to_numpy_dtype
from shoal.common.tickets import plan_digest, verify_membership, verify_ticket
from shoal.v1 import shoal_pb2 as pb
from shoal.v1 import shoal_pb2_grpc as pb_grpc

log = logging.getLogger("shoal.peer.dataplane")

MAX_MESSAGE_BYTES = DATA_MAX_MESSAGE_BYTES
STATE_CHUNK_BYTES = 1 << 20
# A stream whose first chunk arrives before the local plan waits this long for it (seconds).
SESSION_WAIT_SECONDS = 10.0
REACH = "/shoal.v1.Peer/Reach"  # unsigned: the coordinator's dial-back (shoal.common.reach)
MAX_WAITING_STREAMS = 64
MAX_SHM_SENDERS = 64  # senders whose shared-memory segments stay mapped (least recently used dropped)
EXCHANGE = "/shoal.v1.Peer/Exchange"  # an outbound-only participant signs its first chunk for this
EXCHANGE_REPLY = "/shoal.v1.Peer/Exchange#reply"  # and the owner its first reply for this
REPLY_QUEUE_CHUNKS = 16  # an owner's replies waiting for the outbound-only participant's stream
IDLE_RESULT_SEGMENTS = 2  # result segments kept for reuse once their arrays are gone (Transport.take_result)
IDLE_RESULT_BUFFERS = 1  # the same for result buffers in this process's memory (Transport.take_buffer)

ChunkKey = tuple[int, int, int, int, int, int, str]  # round, attempt, phase, step, shard, offset, sender
# What the inbox holds per chunk: the raw values (codec 0, a read-only view) or the still-encoded
# payload (codecs 1-3), which the collective decodes, and forwards verbatim where it relays.
Payload = np.ndarray | Encoded


SPARSE_CODEC_IDS = frozenset(SPARSE_CODECS.values())


def payload_nbytes(v: Payload) -> int:
    return v.nbytes if isinstance(v, np.ndarray) else len(v.data) + len(v.scale)


def check_encoded(codec: int, count: int, data: bytes, scale: bytes) -> Encoded:
    """Structure check of a compressed chunk (lengths only; values are checked when decoded).

    Raises InvalidArgument naming the field.
    """
    require(codec in (1, 2, 3, FP4), "codec", f"unknown codec id {codec}")
    want = data_bytes(codec, count)
    require(len(data) == want, "data", f"{len(data)} bytes, expected {want} for {count} elements")
    want_scale = scale_bytes(codec, count)
    require(len(scale) == want_scale, "scale", f"{len(scale)} bytes, expected {want_scale}")
    return Encoded(codec, data, scale, count)


@dataclass(frozen=True)
class Session:
    """What the receiving side knows of the running collective: who may send, what sizes.

    `ticket_check(ticket, sender)` raises PermissionDenied/InvalidArgument unless the ticket
    admits `sender` to this attempt; a session without one accepts no stream. shard_bounds
    (element offsets, len shards+1), chunk_elems (largest chunk, elements) and deadline_seconds
    (longest life of one stream) come from the plan; empty/0 disables the matching check.
    """

    round: int
    attempt: int
    participants: frozenset[str]
    dtype: int
    ticket_check: Callable[[bytes, str], None] | None = None
    shard_bounds: tuple[int, ...] = ()
    chunk_elems: int = 0
    deadline_seconds: float = 0.0
    outbound_only: frozenset[str] = frozenset()  # participants that open Exchange instead of being dialled
    relayed: frozenset[str] = frozenset()  # participants reached through a relay: every chunk to them is signed
    collective: str = ""  # the plan's collective: where sparse pieces travel ("sparse_rs": the reduce-scatter)

    @classmethod
    def from_plan(cls, plan: pb.Plan, coordinator_public_key: bytes) -> Session:
        """The session of `plan`: only its participants, holding its ticket, may push, and only
        chunks that fit its dtype and shard bounds."""
        digest = plan_digest(plan)

        def ticket_check(ticket: bytes, sender: str) -> None:
            if not ticket:
                raise PermissionDenied("ticket: missing; a stream must open with the round ticket")
            verify_ticket(coordinator_public_key, ticket, round=plan.round, attempt=plan.attempt, sender=sender,
                          expected_plan_digest=digest)

        itemsize = to_numpy_dtype(plan.dtype).itemsize if plan.dtype else 1
        return cls(plan.round, plan.attempt, frozenset(p.peer_id for p in plan.participants), plan.dtype,
                   ticket_check, tuple(plan.shard_bounds), max(1, (plan.chunk_bytes or (1 << 20)) // itemsize),
                   plan.deadline_seconds, frozenset(p.peer_id for p in plan.participants if p.outbound_only),
                   frozenset(p.peer_id for p in plan.participants if p.relay), plan.collective)

    def check_chunk(self, c: pb.Chunk, shm: SegmentReader | None = None, body=None) -> "Payload":
        """Check `c` against the plan; returns its payload (an array, or an `Encoded` chunk).

        A chunk on the shared-memory lane (`shm_name` set) has its bytes read from the sender's
        segment through `shm` only after every structural check passed, and only as many as
        the checked shape needs. A chunk of the bulk lane (peer.lanes.bulk) carries no `data`: its
        bytes are `body` (a buffer), held to the same length checks.

        Raises:
            PermissionDenied: the sender is not a participant.
            InvalidArgument: dtype, shape, phase, step, shard, offset, codec or lengths do not
                fit the plan; a shared-memory chunk on a stream without the lane, or whose
                segment name or range is wrong.
        """

        def data(n: int) -> bytes:
            if body is not None:
                require(not c.data and not c.shm_name, "data", "a bulk chunk's bytes follow its header")
                return body
            if not c.shm_name:
                return c.data
            require(not c.data, "data", "must be empty when shm_name is set")
            require(shm is not None, "shm_name", "this peer does not accept the shared-memory lane")
            return shm.read(c.shm_name, c.shm_offset, n)

        if c.sender not in self.participants:
            raise PermissionDenied(f"sender: {c.sender[:8]} is not a participant of round {c.round}")
        require(len(c.shape) == 1, "shape", "chunks are 1-D")
        count = int(c.shape[0])
        if c.phase == pb.DISTANCES:
            require(c.dtype == pb.FLOAT64 and c.codec == 0, "dtype", "distance matrices are raw float64")
            p = len(self.participants)
            require(count == p * p, "shape", f"[{count}] is not a {p}x{p} distance matrix")
            return decode_chunk(data(8 * count), c.dtype, count)
        require(c.dtype == self.dtype, "dtype", f"{c.dtype} differs from the plan's {self.dtype}")
        if c.codec in SPARSE_CODEC_IDS:
            return self._sparse_piece(c, count, data)
        require(c.phase in (pb.REDUCE_SCATTER, pb.ALL_GATHER), "phase", f"unknown phase {c.phase}")
        require(self.collective != "sparse_rs" or c.phase == pb.ALL_GATHER, "phase",
                "a sparse_rs plan's dense chunks are the merged ranges of the all-gather")
        require(c.step < max(1, len(self.participants) - 1), "step", f"{c.step} past the plan's steps")
        if self.chunk_elems:
            require(0 < count <= self.chunk_elems, "shape", f"[{count}] outside 1..{self.chunk_elems} elements")
        if self.shard_bounds:
            shards = len(self.shard_bounds) - 1
            require(c.shard < shards, "shard", f"{c.shard} past the plan's {shards} shards")
            size = self.shard_bounds[c.shard + 1] - self.shard_bounds[c.shard]
            require(c.offset + count <= size, "shape",
                    f"[{count}] at offset {c.offset} exceeds shard {c.shard} of {size} elements")
        if c.codec == 0:
            require(not c.scale, "scale", "must be empty for raw chunks")
            return decode_chunk(data(count * to_numpy_dtype(c.dtype).itemsize), c.dtype, count)
        require(c.dtype == pb.FLOAT32, "dtype", "compressed chunks carry float32 tensors")
        require(c.codec in (1, 2, 3, FP4), "codec", f"unknown codec id {c.codec}")
        # Compressed bytes are relayed verbatim on the ring: copied out of a shared segment (small).
        return check_encoded(c.codec, count, bytes(data(data_bytes(c.codec, count))), c.scale)


    def _sparse_piece(self, c: pb.Chunk, count: int, data: Callable[[int], bytes]) -> Encoded:
        """A piece of a sparse contribution (its segment payloads one after another, peer.sparse
        wire form; the sparse collectives of peer.collectives): `count` bytes at byte `offset` of
        the sender's stream. In the sparse all-gather ("allgather" plans) the stream is the whole
        contribution, in the all-gather phase, step 0, shard 0; in the sparse reduce-scatter
        ("sparse_rs" plans) one stream per tensor shard, the sender's contribution to that
        shard, in the reduce-scatter phase, step 0, shard < the plan's shards (the merged ranges
        come back as plain float32 chunks, checked as any dense chunk). At most 5 bytes per
        element of the stream's elements plus 64 bytes per segment. Its contents are checked
        segment by segment once each is whole (`peer.sparse.SegmentReader`)."""
        require(c.dtype == pb.FLOAT32, "dtype", "sparse payloads carry float32 tensors")
        if self.collective == "sparse_rs":
            require(c.phase == pb.REDUCE_SCATTER and c.step == 0, "phase",
                    "a sparse_rs payload travels in the reduce-scatter, step 0")
            shards = len(self.shard_bounds) - 1
            require(not self.shard_bounds or c.shard < shards, "shard", f"{c.shard} past the plan's {shards} shards")
        else:
            require(c.phase == pb.ALL_GATHER and c.step == 0 and c.shard == 0, "phase",
                    "a sparse payload travels in the all-gather, step 0, shard 0")
        require(not c.scale, "scale", "must be empty for sparse payloads (their scales are inside)")
        if self.chunk_elems:
            require(0 < count <= 4 * self.chunk_elems, "shape",
                    f"[{count}] bytes outside 1..{4 * self.chunk_elems} per piece")
        if self.shard_bounds:  # no sparse stream holds more than 5 bytes per element, plus per
            # segment its header, a chunk's scale and padding (peer.sparse): 64 bytes is ample
            n = (self.shard_bounds[c.shard + 1] - self.shard_bounds[c.shard] if self.collective == "sparse_rs"
                 else self.shard_bounds[-1])
            most = 5 * n + 64 * (n // SPARSE_SEGMENT_ELEMENTS + 1)
            require(c.offset + count <= most, "shape",
                    f"[{count}] bytes at offset {c.offset} exceed the {most} bytes a sparse payload can have")
        return Encoded(c.codec, bytes(data(count)), b"", count)


class SenderGone(Exception):
    """The stream from a sender broke before it delivered the awaited chunk."""


class ReplyLane:
    """A shard owner's chunks for one outbound-only participant of one attempt: the owner's
    collective puts them (`queue`, bounded: a slow reader slows the owner as a slow stream
    would), the Exchange stream that participant opened writes them back. `done` resolves True
    once the stream wrote the closing None, False when it broke first. One stream per lane."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[pb.Chunk | None] = asyncio.Queue(REPLY_QUEUE_CHUNKS)
        self.done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self.claimed = False


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
        self._changed = asyncio.Event()
        self._waiting = 0
        self._broken: dict[tuple[int, int, str], str] = {}
        self._lanes: dict[tuple[int, int, str], ReplyLane] = {}  # per outbound-only participant (ReplyLane)
        self._streams: dict[tuple[int, int, str], int] = {}  # open streams per (round, attempt, sender)
        self._taken: set[ChunkKey] = set()  # chunks the collective took (`arrived` answers them)
        self._posted: dict[ChunkKey, np.ndarray] = {}  # where a chunk's bytes may land (`post`)

    def streaming(self, round_: int, attempt: int, sender: str) -> bool:
        """Whether a stream of `sender`'s chunks for this attempt is open here right now."""
        return self._streams.get((round_, attempt, sender), 0) > 0

    def count_stream(self, origin: tuple[int, int, str], delta: int) -> None:
        """A stream from origin = (round, attempt, sender) opened (+1) or ended (-1)."""
        n = self._streams.get(origin, 0) + delta
        if n > 0:
            self._streams[origin] = n
        else:
            self._streams.pop(origin, None)

    def reply_lane(self, round_: int, attempt: int, peer_id: str) -> ReplyLane:
        """The lane of `peer_id`'s replies in this round attempt, made at first use (by the owner's
        collective or by the participant's Exchange stream, whichever comes first). Raises
        FailedPrecondition for an attempt older than the running one."""
        if (round_, attempt) < self.floor:
            raise FailedPrecondition(f"round: {round_}.{attempt} is older than the running {self.floor}")
        key = (round_, attempt, peer_id)
        if key not in self._lanes:
            self._lanes[key] = ReplyLane()
        return self._lanes[key]

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def start(self, session: Session) -> None:
        """Open a collective session; drops everything buffered for older attempts."""
        self.session = session
        self.floor = (session.round, session.attempt)
        for k in [k for k in self._futures if (k[0], k[1]) < self.floor]:
            self._drop(k)
        self._taken = {k for k in self._taken if (k[0], k[1]) >= self.floor}
        self._posted = {k: v for k, v in self._posted.items() if (k[0], k[1]) >= self.floor}
        self._broken = {k: v for k, v in self._broken.items() if (k[0], k[1]) >= self.floor}
        self._lanes = {k: v for k, v in self._lanes.items() if (k[0], k[1]) >= self.floor}
        self._wake()

    async def wait_session(self, round_: int, attempt: int, timeout: float) -> Session:
        """The session of `round_`/`attempt`, waiting up to `timeout` s for the local plan.

        Raises:
            FailedPrecondition: the attempt is older than the running one, or no such session
                started in time.
            ResourceExhausted: too many streams are already waiting.
        """
        if self._waiting >= MAX_WAITING_STREAMS:
            raise ResourceExhausted(f"round: {self._waiting} streams already wait for a plan")
        self._waiting += 1
        try:
            async with asyncio.timeout(timeout):
                while True:
                    s = self.session
                    if s is not None and (s.round, s.attempt) == (round_, attempt):
                        return s
                    if (round_, attempt) < self.floor:
                        raise FailedPrecondition(f"round: {round_}.{attempt} is older than the running {self.floor}")
                    await self._changed.wait()
        except TimeoutError:
            raise FailedPrecondition(f"round: no plan for {round_}.{attempt} here within {timeout:.0f}s") from None
        finally:
            self._waiting -= 1

    def finish(self, round_: int, attempt: int) -> None:
        for k in [k for k in self._futures if (k[0], k[1]) == (round_, attempt)]:
            self._drop(k)
        self._taken = {k for k in self._taken if (k[0], k[1]) != (round_, attempt)}
        self._posted = {k: v for k, v in self._posted.items() if (k[0], k[1]) != (round_, attempt)}
        if self.session is not None and (self.session.round, self.session.attempt) == (round_, attempt):
            self.session = None
            self.floor = (round_, attempt + 1)
        self._wake()

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

    def post(self, key: ChunkKey, dest: np.ndarray) -> None:
        """Offer `dest` (a C-contiguous array the collective owns, e.g. its slice of the result)
        as the place where chunk `key`'s raw bytes may be read when they come on a lane that
        reads in place (peer.lanes.bulk): the collective then finds the chunk already there
        (`get` returns a view of `dest`) and copies nothing. Only for an attempt not older than
        the running one; dropped with its attempt."""
        if (key[0], key[1]) >= self.floor:
            self._posted[key] = dest

    def claim(self, key: ChunkKey, nbytes: int) -> memoryview | None:
        """The place posted for chunk `key` as a byte view, when it holds exactly `nbytes`,
        handed out once (a second chunk with the same key, which `deliver` refuses as a
        duplicate, must never overwrite bytes the collective already took); None otherwise
        (the lane reads into a fresh buffer). The bytes the lane writes there are the chunk's
        only once `deliver` took it: until then the collective does not read that place, and a
        chunk refused by its checks leaves its bytes there for the next arrival to overwrite."""
        dest = self._posted.pop(key, None)
        if dest is None or dest.nbytes != nbytes:
            return None
        return memoryview(dest).cast("B")

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
        values = await self._wait(key, timeout)
        self._futures.pop(key, None)
        self._taken.add(key)
        self._bytes -= payload_nbytes(values)
        return values

    async def arrived(self, key: ChunkKey, timeout: float) -> None:
        """Return once the chunk `key` arrived (taken by `get` or still held); raises as `get`
        (TimeoutError, SenderGone) and takes nothing."""
        if key in self._taken:
            return
        await self._wait(key, timeout)

    async def _wait(self, key: ChunkKey, timeout: float) -> Payload:
        """The chunk `key` once it arrived, left where it is. Raises SenderGone when its sender's
        stream broke before it came, TimeoutError after `timeout` seconds."""
        f = self._futures.get(key)
        if f is None:
            f = self._futures[key] = asyncio.get_running_loop().create_future()
        broken = self._broken.get((key[0], key[1], key[6]))
        if broken is not None and not f.done():
            raise SenderGone(broken)
        async with asyncio.timeout(timeout):
            return await asyncio.shield(f)


class StateSource:
    """What a donor serves: the serialized committed state for a round (see peer.state_sync)."""

    def committed_state(self) -> tuple[int, bytes, bytes]:  # (rounds, blob, digest)
        raise NotImplementedError

    def state_for(self, rounds: int, holder: str = "", until: float = 0.0) -> tuple[bytes, bytes] | None:
        """(blob, digest) of the committed state after `rounds` rounds, if still held. Donors keep
        the last few, and one `holder` is fetching until `until` (unix seconds, its permit's
        expiry), so a download in flight survives the swarm committing other rounds."""
        held, blob, dig = self.committed_state()
        return (blob, dig) if held == rounds else None


class PeerService(pb_grpc.PeerServicer):
    """shoal.v1.Peer: receives chunks, serves committed state, answers probes (see the module
    docstring for who may call what). `coordinator_public_key` is set once the peer has joined;
    until then every stream and state request is refused (FAILED_PRECONDITION)."""

    def __init__(self, inbox: Inbox, state: StateSource | None = None, *, on_bytes: Callable[[int], None] | None = None,
                 verifier: RequestVerifier | None = None, coordinator_public_key: bytes = b"",
                 session_wait: float = SESSION_WAIT_SECONDS, links=None, shared_memory: bool = True,
                 key: Ed25519PrivateKey | None = None):
        self.key = key  # answers the coordinator's reachability dial-back (Reach); None: UNIMPLEMENTED
        self.links = links  # peer.links.LinkMeter: one passive download sample per stream
        self.shared_memory = shared_memory and shm.available()  # accept the shared-memory lane
        self._readers: dict[str, SegmentReader] = {}  # per sender, kept across its streams
        self.inbox = inbox
        self.state = state
        self.on_bytes = on_bytes or (lambda n: None)
        self.chunks_received = 0
        self.verifier = verifier or RequestVerifier()
        self.coordinator_public_key = coordinator_public_key
        self.session_wait = session_wait
        self.tls_identity = False  # set by serve_data_plane with an issued certificate
        self.peer_id = peer_id_of(public_bytes(key)) if key is not None else ""
        self.bulk: bulk.BulkServer | None = None  # the bulk lane's listener (TLS when the data plane is)

    def _coordinator_key(self) -> bytes:
        if len(self.coordinator_public_key) != 32:
            raise FailedPrecondition("round: this peer has not joined a swarm yet")
        return self.coordinator_public_key

    async def PushChunks(self, request_iterator: AsyncIterator[pb.Chunk], context) -> pb.PushAck:
        """Receive one sender's chunks for one round attempt into the inbox.

        If the stream breaks before the sender closes it (the sender crashed, its connection
        reset), every wait on that sender fails at once (`Inbox.fail_sender`), so a dead peer is
        detected in milliseconds rather than at the chunk deadline.
        """
        async with grpc_errors(context):
            it = aiter(request_iterator)
            try:
                first = await anext(it)
            except StopAsyncIteration:
                return pb.PushAck(chunks=0)
            try:
                pub = self._check_relayed(first, context)
            except InvalidArgument as exc:
                await self._first_altered(first, str(exc))
                raise
            s = await self._admit(first, context, PUSH_CHUNKS)
            return pb.PushAck(chunks=await self._receive(first, it, s, pub if self.peer_id in s.relayed else None))

    def _check_relayed(self, c: pb.Chunk, context, pub: bytes | None = None) -> bytes:
        """The stream's signer key (from its metadata, checked by `_admit`); raises
        InvalidArgument (`RELAY_ALTERED`) when `c` carries a chunk signature that fails, or none
        while `pub` is given (this peer is relayed in the running plan: every chunk is signed)."""
        if pub is None:
            md = dict(context.invocation_metadata() or ())
            try:
                pub = bytes.fromhex(str(md.get(MD_PUBKEY, "")))
            except ValueError:
                pub = b""
            if not c.chunk_signature:
                return pub
        if len(pub) != 32 or peer_id_of(pub) != c.sender or not chunk_signature_ok(pub, c):
            raise InvalidArgument(f"chunk_signature: chunk {c.phase}/{c.step}/{c.shard}@{c.offset} from "
                                  f"{c.sender[:8]} fails its sender's signature: {RELAY_ALTERED}")
        return pub

    async def _first_altered(self, first: pb.Chunk, reason: str) -> None:
        """A stream's first chunk failed its chunk signature (`reason` names `RELAY_ALTERED`): fail
        every wait on its sender with `reason` when this peer is relayed in the running attempt,
        so the collective blames the relay at once. Without this the refusal ends only this call
        (the stream signature covers the changed chunk: `_admit` could not authenticate it
        either), the sender learns of it only at its next write, which may never come (it awaits
        its own chunks first), and this peer's wait ran into the chunk deadline and blamed the
        sender: a healthy peer excluded for the relay's change. Who may fail a sender's waits:
        a ticket the coordinator signed for this sender and attempt (the stream signature cannot
        be checked on changed bytes); a chunk with no valid ticket fails nothing."""
        try:
            verify_ticket(self._coordinator_key(), first.ticket, round=first.round, attempt=first.attempt,
                          sender=first.sender)
            s = await self.inbox.wait_session(first.round, first.attempt, self.session_wait)
            if s.ticket_check is None or self.peer_id not in s.relayed:
                return
            s.ticket_check(first.ticket, first.sender)
        except (ShoalError, ValueError):  # ValueError: no valid coordinator key here
            return
        self.inbox.fail_sender(first.round, first.attempt, first.sender, reason)

    async def Exchange(self, request_iterator: AsyncIterator[pb.Chunk], context) -> None:
        """An outbound-only participant's stream (see the module docstring): its chunks into the
        inbox as on PushChunks, and this owner's replies for it (its `ReplyLane`) back, until
        both sides are done. Refused (PERMISSION_DENIED) for a sender the plan does not mark
        outbound-only: a dialable participant is pushed to, so one stream per pair and direction."""
        async with grpc_errors(context):
            it = aiter(request_iterator)
            try:
                first = await anext(it)
            except StopAsyncIteration:
                return
            s = await self._admit(first, context, EXCHANGE)
            if first.sender not in s.outbound_only:
                raise PermissionDenied(f"sender: {first.sender[:8]} is not outbound-only in this plan; "
                                       f"it is dialled (PushChunks)")
            if self.key is None:
                raise FailedPrecondition("Exchange: this data-plane server has no identity key to sign replies")
            lane = self.inbox.reply_lane(first.round, first.attempt, first.sender)
            if lane.claimed:
                raise FailedPrecondition(f"round: {first.sender[:8]} already holds this attempt's exchange")
            lane.claimed = True
            try:
                async with asyncio.timeout(s.deadline_seconds or None), asyncio.TaskGroup() as tg:
                    tg.create_task(self._receive(first, it, s))
                    tg.create_task(self._reply(lane, context))
            except TimeoutError:
                raise DeadlineExceeded(f"round: stream outlived the plan's {s.deadline_seconds:.0f}s deadline") from None
            except BaseExceptionGroup as group:
                raise group.exceptions[0] from None
            finally:
                if not lane.done.done():
                    lane.done.set_result(False)

    async def _reply(self, lane: ReplyLane, context) -> None:
        """Write the lane's chunks on the Exchange stream; the first is signed (initial metadata)."""
        assert self.key is not None
        first = True
        while (msg := await lane.queue.get()) is not None:
            if first:
                await context.send_initial_metadata(sign_metadata(self.key, EXCHANGE_REPLY, msg))
                first = False
            await context.write(msg)
        lane.done.set_result(True)

    async def _admit(self, first: pb.Chunk, context, method: str) -> Session:
        """Authenticate a stream by its first chunk; the session it belongs to.

        Who: the signature (for `method`) binds the stream to the sender's key (peer id = hash of
        it), and with an issued certificate the connection's is the sender's own. May they: a
        coordinator-signed ticket naming them for this attempt, checked before any waiting so a
        stranger holds no buffer and no waiting slot. Raises the ShoalError that refuses it.
        """
        require(bool(first.sender), "sender", "missing")
        self.verifier.verify(context.invocation_metadata() or (), method, first)
        if self.tls_identity:
            tls_sender_check(context, first.sender)
        key = self._coordinator_key()
        if not first.ticket:
            raise PermissionDenied("ticket: missing; a stream must open with the round ticket")
        verify_ticket(key, first.ticket, round=first.round, attempt=first.attempt, sender=first.sender)
        s = await self.inbox.wait_session(first.round, first.attempt, self.session_wait)
        if s.ticket_check is None:
            raise FailedPrecondition("round: the running session accepts no streams (no ticket check)")
        s.ticket_check(first.ticket, first.sender)
        return s

    async def _receive(self, first: pb.Chunk, it: AsyncIterator[pb.Chunk], s: Session,
                       signer: bytes | None = None, body: Callable[[], object] | None = None) -> int:
        """Check and deliver an authenticated stream's chunks (`first`, then the rest of `it`)
        into the inbox; returns how many. On the bulk lane (peer.lanes.bulk) `body()` is the
        payload of the chunk last yielded. A refused chunk (wrong shape, dtype...) delivers
        nothing and does not count as a broken stream: the sender is alive, and if it never
        sends valid chunks the chunk deadline blames it. Anything else that ends the stream early
        fails every wait on the sender (`Inbox.fail_sender`). With `signer` (this peer is relayed)
        every chunk's signature is checked first; a failure, or a later message that does not
        decode at all (bytes changed in its protobuf framing), fails the waits with
        `RELAY_ALTERED` and ends the call INVALID_ARGUMENT naming it, so both ends blame the relay.
        (A participant that writes garbage on purpose thus gets the relay blamed instead of
        itself: the round aborts, nobody is excluded; the coordinator's attempt limit bounds it.)"""
        origin = (first.round, first.attempt, first.sender)
        n = 0
        refused = False
        t_first = t_last = 0.0
        first_bytes = total_bytes = 0
        any_shm = False  # a stream that used shared memory says nothing about the link
        reader = self._reader(first.sender) if self.shared_memory else None
        self.inbox.count_stream(origin, +1)
        try:
            try:
                async with asyncio.timeout(s.deadline_seconds or None):
                    c = first
                    while True:
                        if signer is not None:  # first: it also covers the round, attempt and sender
                            try:
                                self._check_relayed(c, None, signer)
                            except InvalidArgument as exc:
                                self.inbox.fail_sender(*origin, str(exc))
                                raise
                        if c is not first and (c.round, c.attempt, c.sender) != origin:
                            raise InvalidArgument("sender: one stream carries one sender's chunks of one round attempt")
                        values = s.check_chunk(c, reader, body() if body is not None else None)
                        any_shm = any_shm or bool(c.shm_name)
                        self.inbox.deliver((c.round, c.attempt, c.phase, c.step, c.shard, c.offset, c.sender), values)
                        nb = payload_nbytes(values)
                        self.on_bytes(nb)
                        t_last = time.perf_counter()
                        if n == 0:
                            t_first, first_bytes = t_last, nb
                        total_bytes += nb
                        n += 1
                        try:
                            c = await anext(it)
                        except StopAsyncIteration:
                            break
                        except InvalidArgument as exc:  # a message that does not decode (DecodeErrors)
                            if signer is None:
                                raise
                            # The sender's gRPC wrote a Chunk; through the relay it no longer
                            # decodes, so there is no signature to check: the relay changed it.
                            why = f"{exc} (a relayed stream, past its signed first chunk): {RELAY_ALTERED}"
                            self.inbox.fail_sender(*origin, why)
                            raise InvalidArgument(why) from None
            except TimeoutError:
                raise DeadlineExceeded(f"round: stream outlived the plan's {s.deadline_seconds:.0f}s deadline") from None
            except ShoalError:
                refused = True
                raise
        except BaseException as exc:
            if not refused:
                self.inbox.fail_sender(*origin, f"stream from {origin[2][:8]} broke: {type(exc).__name__}")
            raise
        finally:
            self.chunks_received += n
            self.inbox.count_stream(origin, -1)
        if self.links is not None and n > 1 and not any_shm:
            # The first chunk's own transfer time is unknown: count the bytes after it.
            self.links.observe_receive(origin[2], total_bytes - first_bytes, t_last - t_first)
        return n

    def _reader(self, sender: str) -> SegmentReader:
        r = self._readers.pop(sender, None) or SegmentReader(sender)
        self._readers[sender] = r  # most recently used last
        while len(self._readers) > MAX_SHM_SENDERS:
            self._readers.pop(next(iter(self._readers))).close()
        return r

    def close(self) -> None:
        """Unmap every shared-memory segment this service still maps."""
        for r in self._readers.values():
            r.close()
        self._readers.clear()
        if self.bulk is not None:
            self.bulk.close()

    async def FetchState(self, request: pb.StateRequest, context) -> AsyncIterator[pb.StateChunk]:
        async with grpc_errors(context):
            require(bool(request.peer_id), "peer_id", "missing")
            permit = next((v for k, v in (context.invocation_metadata() or ()) if k == MD_TICKET), b"")
            if not permit:
                raise PermissionDenied(f"{MD_TICKET}: missing; FetchState needs a round ticket or sync permit")
            ticket = verify_membership(self._coordinator_key(), permit, peer_id=request.peer_id)
            if ticket.round != request.round:
                # A permit (or ticket) is for the sync (or round) it was issued for: a member that
                # was revoked since cannot fetch a newer state with the last one it got.
                raise PermissionDenied(f"round: the ticket is for round {ticket.round}, not {request.round}; "
                                       f"a newer state needs the coordinator's permit for it")
            if self.state is None:
                raise FailedPrecondition("round: this peer serves no state")
            # The state stays held for the requester while its permit lasts (peer.state_sync).
            found = self.state.state_for(request.round, request.peer_id, ticket.expires_unix)
            if found is None:
                held = self.state.committed_state()[0]
                raise FailedPrecondition(f"round: this peer holds state of round {held}, not {request.round}")
            blob, dig = found
            rounds = request.round
            require(request.offset <= len(blob), "offset", f"{request.offset} past {len(blob)} bytes")
        end = len(blob) if request.length == 0 else min(len(blob), request.offset + request.length)
        for off in range(request.offset, end, STATE_CHUNK_BYTES):
            piece = blob[off:min(end, off + STATE_CHUNK_BYTES)]
            if request.offset > 0:
                faults.hit("serve-state")
            yield pb.StateChunk(round=rounds, offset=off, total_bytes=len(blob), data=piece, state_digest=dig)

    async def Probe(self, request: pb.ProbeRequest, context) -> pb.ProbeResponse:
        async with grpc_errors(context):
            require(request.reply_bytes <= MAX_MESSAGE_BYTES // 2, "reply_bytes", f"at most {MAX_MESSAGE_BYTES // 2}")
            resp = pb.ProbeResponse(payload=bytes(request.reply_bytes), bulk_port=self.bulk.port if self.bulk else 0)
            if request.shm_name and self.shared_memory:
                # The signature was verified by the interceptor: the key in it names the caller.
                pub = next((v for k, v in (context.invocation_metadata() or ()) if k == MD_PUBKEY), "")
                try:
                    resp.shm_nonce = shm.answer_probe(request.shm_name, peer_id_of(bytes.fromhex(pub)))
                except (InvalidArgument, ValueError):
                    pass  # not readable from here: the caller keeps the socket lane
            return resp


    async def Reach(self, request: pb.ReachRequest, context) -> pb.ReachResponse:
        """The coordinator's dial-back (shoal.common.reach): sign its nonce. Unsigned, rate limited."""
        async with grpc_errors(context):
            if self.key is None:
                raise FailedPrecondition("Reach: this data-plane server has no identity key")
            try:
                return reach.answer(self.key, request.nonce)
            except ValueError as exc:
                raise InvalidArgument(str(exc)) from None


async def take_replies(call, inbox: Inbox, verifier: RequestVerifier, owner: str) -> int:
    """Read a shard owner's replies on an Exchange stream this (outbound-only) peer opened, into
    `inbox`; returns how many. The first reply must be signed by `owner` (the stream's initial
    metadata, `EXCHANGE_REPLY`) and carry a ticket admitting it to the running attempt; every
    reply is an all-gather chunk of that owner and attempt that fits the plan
    (`Session.check_chunk`).

    Raises ShoalError (Unauthenticated, PermissionDenied, InvalidArgument, FailedPrecondition)
    for a reply that fails a check (nothing of it reaches the inbox), grpc.aio.AioRpcError when
    the stream breaks.
    """
    n = 0
    s: Session | None = None
    while (c := await call.read()) is not grpc.aio.EOF:
        if s is None:
            require(c.sender == owner, "sender", f"{c.sender[:8]} replies on a stream to {owner[:8]}")
            verifier.verify(await call.initial_metadata() or (), EXCHANGE_REPLY, c)
            s = inbox.session
            if s is None or (s.round, s.attempt) != (c.round, c.attempt) or s.ticket_check is None:
                raise FailedPrecondition(f"round: a reply for {c.round}.{c.attempt}, which is not running here")
            if not c.ticket:
                raise PermissionDenied("ticket: missing; an owner's first reply carries its round ticket")
            s.ticket_check(c.ticket, c.sender)
        require((c.round, c.attempt, c.sender) == (s.round, s.attempt, owner), "sender",
                "one stream carries one owner's replies of one round attempt")
        require(c.phase == pb.ALL_GATHER and not c.shm_name, "phase", "an owner replies with reduced shards, inline")
        inbox.deliver((c.round, c.attempt, c.phase, c.step, c.shard, c.offset, c.sender), s.check_chunk(c))
        n += 1
    return n


async def serve_data_plane(service: PeerService, listen: str, security: Security, *,
                           rate_per_s: float = 2000.0, burst: int = 4000,
                           before_start: Callable[[grpc.aio.Server], object] | None = None,
                           peer_tls: PeerTLS | None = None, tcp_lane: bool = False,
                           ) -> tuple[grpc.aio.Server, str]:
    """Start the data-plane server for `service` on `listen` (TLS per `security`); returns the
    started server and its HOST:PORT. Calls are rate limited per host and FetchState/Probe must
    be signed (PushChunks is checked by the handler). With `peer_tls` (TLS and a certificate
    issued at join) the server presents its newest installed certificate, demands the client's
    and checks that it names the signer. With `tcp_lane` (plaintext, or TLS with `peer_tls`: the
    lane is then mutual TLS with the same certificate and checks) it also listens for the bulk
    lane (peer.lanes.bulk) on an ephemeral port of the same host, advertised by Probe. Raises
    OSError when `listen` cannot be bound."""
    bound = security.tls_dir is not None and peer_tls is not None
    service.tls_identity = bound
    interceptors = [DecodeErrors(), SignedCalls("/shoal.v1.Peer/", service.verifier, unsigned=(REACH,),
                                                default_limit=RateLimiter(rate_per_s, burst), tls_identity=bound)]
    server = grpc.aio.server(options=channel_options(), interceptors=interceptors,
                             maximum_concurrent_rpcs=PEER_MAX_CONCURRENT_RPCS)
    pb_grpc.add_PeerServicer_to_server(service, server)
    if before_start is not None:
        before_start(server)  # e.g. add the health and reflection services
    port = add_port(server, listen, security, "peer", peer_tls if bound else None)
    if tcp_lane and (security.tls_dir is None or bound):  # a legacy shared peer.key: TLS gRPC only
        service.bulk = bulk.BulkServer(service, peer_tls if bound else None)
        await service.bulk.start(listen.rsplit(":", 1)[0].strip("[]"))
    await server.start()
    return server, f"{listen.rsplit(':', 1)[0]}:{port}"


def channel_options() -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),  # as a server: accept those pings
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]


class Transport:
    """Outgoing data-plane channels, one per remote address, reused across rounds.

    With a `key`, unary and server-streaming calls are signed with it (PushChunks streams are
    signed by their first chunk, `push_metadata`); `security` picks TLS or plaintext. With
    `peer_tls` holding an issued certificate, a channel verifies the server by the peer id it is
    opened for (`stub(address, peer_id)`); a channel opened before a renewal or for another id at
    that address is replaced at its next use (the old one is closed with the transport, so
    streams still on it finish).
    """

    def __init__(self, security: Security | None = None, key: Ed25519PrivateKey | None = None, *,
                 shared_memory: bool = True, peer_tls: PeerTLS | None = None, tcp_lane: bool = False,
                 bulk_connections: int = pool.POOL_MAX):
        self.security = security or Security(insecure=True)
        self.peer_tls = peer_tls if self.security.tls_dir else None
        self._opened: dict[str, tuple[str, int]] = {}  # per address: (peer id, certificate generation)
        self._retired: list[grpc.aio.Channel] = []
        self.key = key
        self.peer_id = peer_id_of(public_bytes(key)) if key is not None else ""
        # The shared-memory lane needs an identity (segment names carry it, probes are signed).
        self.shared_memory = shared_memory and key is not None and shm.available()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._lanes: dict[str, asyncio.Task[bool]] = {}  # probe result per address
        self._chosen: dict[str, str] = {}  # lane chosen per address
        self.writers = shm.WriterPool(self.peer_id)  # idle shared-memory writers per address
        self._writers = self.writers.idle
        self.results = shm.ResultPool(self.peer_id, IDLE_RESULT_SEGMENTS, IDLE_RESULT_BUFFERS)
        self._results = self.results.segments
        self.bytes_sent = 0
        self.relayed_bytes_sent = 0  # chunk bytes sent to relayed participants (sign_relayed)
        self.created = time.monotonic()
        self.reply_verifier = RequestVerifier()  # owners' signed first replies on Exchange streams
        if self.shared_memory:
            shm.remove_stale(self.peer_id)  # slabs a killed predecessor with this identity left
        # The bulk lane (peer.lanes.bulk) between hosts: an identity, and with TLS an issued certificate.
        self.bulk = bulk.BulkClient(self._probe_bulk, self.peer_tls, bulk_connections) \
            if tcp_lane and key is not None and (self.security.tls_dir is None or self.peer_tls is not None) else None

    async def bulk_lane(self, address: str, peer_id: str = "") -> bulk.BulkConnection | None:
        """A connection to the bulk lane of the peer at `address` (chosen when the shared-memory
        lane is not), or None: PushChunks then."""
        conn = await self.bulk.connect(address, peer_id) if self.bulk is not None else None
        self._chosen[address] = "socket" if conn is None else conn.lane
        return conn

    async def bulk_pool(self, address: str, peer_id: str = "") -> list[bulk.BulkConnection]:
        """The connections of the next stream to the bulk lane of the peer at `address`: as many
        as its pool size (peer.lanes.pool; the first as `bulk_lane` gives it, the others opened
        or reused alongside; those that fail are left out), or [] when it has no bulk lane."""
        first = await self.bulk_lane(address, peer_id)
        if first is None or self.bulk is None:
            return [] if first is None else [first]
        more = self.bulk.pool_size(address) - 1
        extra = await asyncio.gather(*(self.bulk.connect(address, peer_id) for _ in range(more)))
        return [first, *(c for c in extra if c is not None)]

    def observe_bulk(self, address: str, conns: list, goodput: float | None) -> pool.TcpPath | None:
        """A bulk stream's outcome (its goodput, bytes/s; None when it went at its producer's pace,
        `pool.stream_goodput`), for the next stream's pool size (`BulkClient.observe_stream`);
        returns the path the kernel measured (None: unknown)."""
        return self.bulk.observe_stream(address, conns, goodput) if self.bulk is not None else None

    async def _probe_bulk(self, address: str, peer_id: str) -> int:
        return (await self.stub(address, peer_id).Probe(pb.ProbeRequest(), timeout=5.0)).bulk_port

    def give_back_bulk(self, address: str, conn: bulk.BulkConnection) -> None:
        """Return a bulk connection after its stream (closed when broken, else reused)."""
        if self.bulk is not None:
            self.bulk.give_back(address, conn)
        else:
            conn.close()

    def bulk_metadata(self, first_chunk: pb.Chunk) -> tuple[tuple[str, str], ...]:
        """Signature metadata of a bulk-lane stream opening with `first_chunk` (its header)."""
        assert self.key is not None
        return sign_metadata(self.key, bulk.BULK_METHOD, first_chunk)

    async def shm_lane(self, address: str, peer_id: str = "") -> bool:
        """Whether chunks to `address` go through shared memory (peer.lanes.shm): true once a probe
        showed that the receiver reads this peer's segments. Cached per address; an RPC error
        answers false without caching (the stream will tell what is wrong)."""
        ok = False
        if self.shared_memory:
            task = self._lanes.get(address)
            if task is None:
                task = self._lanes[address] = asyncio.ensure_future(self._probe_lane(address, peer_id))
            try:
                ok = await asyncio.shield(task)
            except grpc.aio.AioRpcError:
                if self._lanes.get(address) is task:
                    del self._lanes[address]
        if ok or self.bulk is None:  # otherwise the bulk lane chooses (bulk_lane)
            self._chosen[address] = "shm" if ok else "socket"
        return ok

    async def probe_lanes(self, peers) -> None:
        """Choose the lane to each of `peers` ((peer id, address) pairs) now (probes are cached),
        so that this peer can report every peer it reaches through shared memory, not only those
        it streamed to; open a bulk-lane connection to the others (kept for their next stream)."""
        peers = list(peers)
        shared = await asyncio.gather(*(self.shm_lane(a, pid) for pid, a in peers), return_exceptions=True)
        if self.bulk is not None:  # connect now, off the round: a port that cannot be reached costs nothing there
            await asyncio.gather(*(self._warm_bulk(a, pid) for (pid, a), ok in zip(peers, shared) if ok is False),
                                 return_exceptions=True)

    async def _warm_bulk(self, address: str, peer_id: str) -> None:
        if self.bulk is not None and not self.bulk.has_idle(address):
            conn = await self.bulk.connect(address, peer_id)
            if conn is not None:
                # The lane its next stream takes: reported now (LinkReport.bulk_peers), so a ring's
                # peers name every participant they reach, not only their successor.
                self._chosen[address] = conn.lane
                self.bulk.give_back(address, conn)

    def lane_failed(self, address: str, exc: OSError) -> None:
        """Writing a segment failed (/dev/shm full?): this transport uses sockets from now on."""
        log.warning("shared-memory lane to %s failed (%s); using the socket from now on", address, exc)
        self.shared_memory = False
        self._chosen[address] = "socket"

    def lanes(self) -> dict[str, str]:
        """The lane chosen per remote address so far: "shm", "tcp", "tcp-tls" (the bulk lane over
        mutual TLS) or "socket"."""
        return dict(self._chosen)

    def shm_peers(self, peers) -> list[str]:
        """Of `peers` ((peer id, address) pairs), those reached through shared memory."""
        return [pid for pid, addr in peers if self._chosen.get(addr) == "shm"]

    def bulk_peers(self, peers) -> list[str]:
        """Of `peers` ((peer id, address) pairs), those reached through the bulk TCP lane
        ("tcp" or "tcp-tls")."""
        return [pid for pid, addr in peers if self._chosen.get(addr) in ("tcp", "tcp-tls")]

    def take_writer(self, address: str, slab_bytes: int = 0) -> shm.SegmentWriter:
        """An idle shared-memory writer towards `address` (its slabs already touched), or a new
        one: with `slab_bytes`, one whose slabs have that size (a reduce-scatter lap's writer,
        peer.lanes.shm `Laps`: one slab holds a lap), else one whose slabs grow."""
        return self.writers.take(address, slab_bytes)

    def give_back_writer(self, address: str, writer: shm.SegmentWriter) -> None:
        """Return a writer whose stream completed (the receiver copied every chunk out); for
        `SHARED_POOL`, one whose every receiver did (a shard owner's reduced chunks). Kept for
        an address that was probed (or the shared pool while the lane is on), else closed; idle
        lap writers of another size towards `address` are closed (peer.lanes.shm `WriterPool`)."""
        keep = address in self._lanes or (address == SHARED_POOL and self.shared_memory)
        self.writers.give_back(address, writer, keep)

    def take_result(self, n: int, dtype) -> tuple[str, np.ndarray]:
        """A writable `(n,)` array of `dtype` in a shared-memory segment of this peer (co-located
        receivers read chunks of it by name: a collective's result buffer) and the segment's name.
        A segment is reused once no array on it is alive any more, because a fresh tmpfs page
        costs a fault and a zeroing (~60 ms per 64 MB here, where anonymous memory with
        transparent huge pages costs ~7 ms), and rewriting touched pages is cheap; at most
        IDLE_RESULT_SEGMENTS idle ones are kept, the others unlinked. Raises OSError when
        /dev/shm is full (the caller uses its own memory then)."""
        return self.results.take_result(n, dtype)

    def take_buffer(self, n: int, dtype) -> np.ndarray:
        """A writable `(n,)` array of `dtype` in this process's memory (a collective's result
        buffer when no co-located peer reads it), reused once no array on it is alive any more
        (as `take_result`'s segments): a fresh 64 MB buffer costs its page faults and the
        kernel's zeroing of every page when the lanes first write it (18 % of all the CPU of a
        10 Gbit/s all-reduce here, docs/performance.md), rewriting a touched one does not. At
        most IDLE_RESULT_BUFFERS idle ones are kept. Anonymous memory (`mmap`): its pages are
        the process's own and go with the mapping."""
        return self.results.take_buffer(n, dtype)

    async def _probe_lane(self, address: str, peer_id: str) -> bool:
        name, nonce, seg = shm.make_probe(self.peer_id)
        try:
            resp = await self.stub(address, peer_id).Probe(pb.ProbeRequest(shm_name=name), timeout=5.0)
        finally:
            seg.close()
        ok = hmac.compare_digest(resp.shm_nonce, nonce)
        log.info("data lane to %s: %s", address, "shared memory" if ok else "socket")
        return ok

    def sign_relayed(self, chunk: pb.Chunk) -> None:
        """Sign `chunk` (complete: data filled in) for a relayed receiver and count its bytes."""
        if self.key is not None:
            sign_chunk(self.key, chunk)
        self.relayed_bytes_sent += chunk.ByteSize() + 5  # as gRPC frames it (5-byte message prefix)

    def push_metadata(self, first_chunk: pb.Chunk) -> tuple[tuple[str, str], ...] | None:
        """Signature metadata for a PushChunks stream opening with `first_chunk`."""
        return None if self.key is None else push_metadata(self.key, first_chunk)

    def exchange_metadata(self, first_chunk: pb.Chunk) -> tuple[tuple[str, str], ...] | None:
        """Signature metadata for an Exchange stream opening with `first_chunk`."""
        return None if self.key is None else sign_metadata(self.key, EXCHANGE, first_chunk)

    def stub(self, address: str, peer_id: str = "") -> pb_grpc.PeerStub:
        """A stub on the channel to peer `peer_id` at `address` (opened, or replaced, as needed).

        Raises:
            ValueError: `peer_id` is empty while this transport uses an issued certificate (the
                server could not be verified).
        """
        tls = self.peer_tls
        if tls is not None and tls.issued and not peer_id:
            raise ValueError(f"data plane: dialling {address} needs the peer id the plan names")
        want = (peer_id, tls.generation) if tls is not None and tls.issued else ("", 0)
        ch = self._channels.get(address)
        if ch is not None and self._opened.get(address) != want:
            self._retired.append(self._channels.pop(address))
            ch = None
        if ch is None:
            interceptors = signing_interceptors(self.key) if self.key is not None else None
            ch = open_peer_channel(address, peer_id, self.security, tls, channel_options(), interceptors)
            self._channels[address] = ch
            self._opened[address] = want
        return pb_grpc.PeerStub(ch)

    async def forget(self, address: str) -> None:
        """Close the channel to `address` (after a failure, so the next use reconnects fresh)."""
        self._lanes.pop(address, None)
        self._opened.pop(address, None)
        if self.bulk is not None:
            self.bulk.forget(address)
        self.writers.forget(address)
        ch = self._channels.pop(address, None)
        if ch is not None:
            await ch.close(grace=None)

    async def close(self) -> None:
        if self.bulk is not None:
            self.bulk.close()
        self.writers.close()
        self.results.close()
        for ch in [*self._channels.values(), *self._retired]:
            await ch.close(grace=None)
        self._channels.clear()
        self._retired.clear()
