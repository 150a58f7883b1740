"""The seam between the collectives and the lanes that carry their chunks.

A collective (peer.collectives: `_Butterfly`, `_Ring`) decides which bytes go to whom; a lane
moves them. The collective sees three things, all defined here:

- `Lanes`: one peer's lanes for one plan attempt. `open(j)` gives the `Lane` to participant j;
  `receiver` is where the chunks of the other participants arrive (`Receiver`); `result` and
  `shared` give the buffers whose bytes a lane may read in place (the shared-memory lane points
  its receivers at them instead of copying). `choose()` settles the lane to each participant
  before the first chunk, so that the buffers are placed right from the first attempt.
- `Lane`: the chunks of one attempt to one participant, in order. `send` queues a chunk (its
  header, `pb.Chunk` without data, and its bytes), `close` queues the end, `run` carries them and
  returns once the receiver took every one.
- `Receiver`: chunks keyed by (round, attempt, phase, step, shard, offset, sender); `post`
  offers the place a chunk's bytes may be read into, `get` waits for a chunk, `arrived` for its
  arrival without taking it (peer.dataplane.Inbox is the one over the network).

Implementations: `network.DataLanes` over a `peer.dataplane.Transport` (the shared-memory lane,
peer.lanes.shm; the bulk TCP lane, peer.lanes.bulk; gRPC streams, peer.lanes.streams; relayed
participants, peer.lanes.relay) and `memory.MemoryLanes` (in one process, for unit tests).

Failure semantics, for every lane: a failure raises `CollectiveError` naming the peers it
suspects (the receiver, when its stream broke or it refused a chunk), or the relay that altered
a chunk (`relay`, no peer suspected). A lane never modifies the bytes it is given, and reads
them until `run` returned: the collective does not write a chunk's bytes before then.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Protocol

import numpy as np

from shoal.peer.compression import Encoded
from shoal.v1 import shoal_pb2 as pb

Body = bytes | np.ndarray  # a chunk's bytes: encoded bytes, or a contiguous array
Placement = Callable[[], tuple[str, int]]  # where a chunk's bytes already are: (segment, byte offset)
Payload = np.ndarray | Encoded  # a received chunk: raw values (a read-only view) or still encoded


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


class Lane(Protocol):
    """One attempt's chunks to one participant (`peer_id`), in the order they are sent.

    `bytes_sent` counts the chunk bytes handed to the lane (payload and scales). `send` may wait
    (a bounded queue: a slow receiver slows its sender) and raises CollectiveError once the lane
    is known to be broken; `run` raises CollectiveError when the receiver refused the stream,
    it broke, or (a reply lane) the receiver took nothing within the chunk deadline.
    """

    peer_id: str
    bytes_sent: int

    async def send(self, chunk: pb.Chunk, body: Body, placed: Placement | None = None) -> None:
        """Queue `chunk` (its header; the lane fills in where its bytes travel) and its bytes.
        `placed`, when given, says where the same bytes already are in a shared-memory segment
        (lanes that cannot use it ignore it)."""
        ...

    async def close(self) -> None:
        """Queue the end of the stream: `run` returns once the receiver took every chunk."""
        ...

    async def run(self) -> None:
        """Carry the queued chunks until the end; raises CollectiveError on failure."""
        ...


class Receiver(Protocol):
    """Where the other participants' chunks arrive (peer.dataplane.Inbox)."""

    def post(self, key: tuple, dest: np.ndarray) -> None:
        """Offer `dest` as the place chunk `key`'s raw bytes may be read into."""
        ...

    async def get(self, key: tuple, timeout: float) -> Payload:
        """The chunk `key`, taken; raises TimeoutError, or peer.dataplane.SenderGone when its
        sender's stream broke first."""
        ...

    async def arrived(self, key: tuple, timeout: float) -> None:
        """Return once chunk `key` arrived (taken or not); raises as `get`."""
        ...

    def streaming(self, round_: int, attempt: int, sender: str) -> bool:
        """Whether a stream from `sender` for this attempt is open right now."""
        ...


class ResultBuffer(Protocol):
    """A collective's result `values` `(n,)`; `private` when only this process reads it."""

    values: np.ndarray
    private: bool

    def placement(self, span, payload) -> Placement | None:
        """Where `payload` is, when it is this buffer's own slice of `span` and receivers can
        read it there; None otherwise."""
        ...


class SharedChunks(Protocol):
    """A shard owner's final chunks, placed once for every receiver that reads them in place."""

    def placement(self, key: tuple[int, int], body: Body) -> Placement:
        ...

    def finish(self, ok: bool) -> None:
        """The attempt ended (`ok`: every stream completed): the place may be reused or not."""
        ...


Credit = Callable[[Hashable], Awaitable[None]]  # returns once the receiver consumed a chunk


class Lanes(Protocol):
    """One peer's lanes for one plan attempt (see the module docstring)."""

    receiver: Receiver

    async def choose(self) -> None:
        """Settle the lane to each participant this peer sends to, before the first chunk."""
        ...

    def open(self, j: int, *, solo: bool = False) -> Lane:
        """The lane to participant `j` (position in the plan) for this attempt; `solo`: the
        sender's only lane (the ring's), whose goodput while chunks are queued is the link's."""
        ...

    def bound(self, lanes: dict[int, Lane], credits: dict[int, Credit], lap_bytes: int) -> bool:
        """Whether the reduce-scatter chunks to the owners in `credits` may reuse a bounded
        region of memory (`credits[j](key)` returns once owner j consumed chunk key, and may be
        awaited without the sender waiting on anything else); if so, `lanes` are set up for it."""
        ...

    def result(self, x: np.ndarray) -> ResultBuffer:
        """A result buffer of `x`'s size and dtype (uninitialised)."""
        ...

    def shared(self) -> SharedChunks:
        """The place of this attempt's final chunks read in place by several receivers."""
        ...
