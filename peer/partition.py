"""How one collective attempt cuts the flat tensor, and who sends which part to whom.

`ShardPartition` is the pure bookkeeping of a plan seen from one participant: the tensor shards
(element ranges ``[shard_bounds[k], shard_bounds[k+1])``), their chunks (`ChunkSpan`: at most
`chunk_elements` elements each, the unit on the wire and of every reduction), which shards this
participant owns (reduces), audits (recomputes, `Plan.auditors`) or gathers, to whom it sends its
part of each shard, and how many chunks and bytes it sends and receives. It moves no bytes
(`peer.collectives` does) and reduces nothing (`peer.reduction` does); it is tested alone
(tests/test_partition.py).

Chunks are sized in elements of the plan's uncompressed dtype (`chunk_elements`), because the
receiving data plane checks exactly that bound (`peer.dataplane.Session.chunk_elems`); a
compressed chunk is therefore smaller than `chunk_bytes` on the wire, never larger.
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal.common.plan import Plan


def chunk_elements(chunk_bytes: int, itemsize: int) -> int:
    """Largest chunk, in elements: `chunk_bytes` of a dtype of `itemsize` bytes, at least 1."""
    return max(1, chunk_bytes // itemsize)


@dataclass(frozen=True)
class ChunkSpan:
    """One chunk of one tensor shard: `offset` elements into shard `shard` (the wire's
    `Chunk.offset`), covering the flat tensor's elements ``[lo, hi)``."""

    shard: int
    offset: int
    lo: int
    hi: int

    @property
    def size(self) -> int:
        """Elements in the chunk (>= 1)."""
        return self.hi - self.lo


@dataclass(frozen=True)
class Traffic:
    """What one participant sends or receives in one butterfly attempt, uncompressed.

    chunks / nbytes: per peer position (this participant's own position absent), counting the
    reduce-scatter (including copies to auditors) and the all-gather, not the distance matrices.
    """

    chunks: dict[int, int]
    nbytes: dict[int, int]

    @property
    def total_bytes(self) -> int:
        return sum(self.nbytes.values())


class ShardPartition:
    """The tensor shards and chunks of `plan`, and the roles of participant `me` in them.

    Args:
        plan: the attempt's plan (`shard_bounds`, `shard_owner`, `chunk_bytes`, `audit_owners`).
        me: a participant's peer id; raises ValueError when it is not one.
        itemsize: bytes per element of the (uncompressed) tensor.

    Shards without elements have no chunks. Positions are indices into `plan.participants`.
    """

    def __init__(self, plan: Plan, me: str, itemsize: int):
        self.participants = plan.participants
        self.size = len(plan.participants)
        self.me = plan.position(me)
        self.bounds = tuple(plan.shard_bounds)
        self.owner = tuple(plan.shard_owner)
        self.auditor = plan.auditors()
        self.itemsize = itemsize
        self.chunk_elems = chunk_elements(plan.chunk_bytes, itemsize)
        self._chunks = tuple(self._cut(k) for k in range(len(self.owner)))
        self.owned = tuple(k for k, o in enumerate(self.owner) if o == self.me)
        self.audited = tuple(k for k, a in enumerate(self.auditor) if a == self.me)
        self.gathered = tuple(k for k, o in enumerate(self.owner) if o != self.me)

    def _cut(self, k: int) -> tuple[ChunkSpan, ...]:
        lo, hi, ce = self.bounds[k], self.bounds[k + 1], self.chunk_elems
        return tuple(ChunkSpan(k, off, lo + off, min(hi, lo + off + ce)) for off in range(0, hi - lo, ce))

    @property
    def num_shards(self) -> int:
        return len(self.owner)

    @property
    def num_elements(self) -> int:
        return self.bounds[-1]

    def shard_span(self, k: int) -> tuple[int, int]:
        """Shard k's element range ``(lo, hi)``."""
        return self.bounds[k], self.bounds[k + 1]

    def chunks(self, k: int) -> tuple[ChunkSpan, ...]:
        """Shard k's chunks in offset order."""
        return self._chunks[k]

    def peer_id(self, position: int) -> str:
        return self.participants[position]

    def other_owners(self) -> tuple[int, ...]:
        """Positions of the shard owners other than `me`, ascending (who gets `me`'s distance
        matrices)."""
        return tuple(sorted({o for o in self.owner if o != self.me}))

    def recipients(self, k: int) -> tuple[int, ...]:
        """Positions `me` sends its part of shard k to in the reduce-scatter: the owner, then the
        auditor (when audited), never `me` itself."""
        return tuple(t for t in dict.fromkeys((self.owner[k], self.auditor[k])) if t not in (self.me, -1))

    def scatter_order(self) -> tuple[int, ...]:
        """Shards in the order `me` scatters them: its own (sent only to their auditors), then those
        of the owner after it (me+1, me+2, ...), so that the owners are not all hit by everyone at
        once; by shard index within one owner."""
        return tuple(sorted(range(self.num_shards), key=lambda k: ((self.owner[k] - self.me) % self.size, k)))

    def sends(self) -> Traffic:
        """Chunks and bytes `me` sends to each other participant (butterfly)."""
        chunks = {j: 0 for j in range(self.size) if j != self.me}
        elems = dict.fromkeys(chunks, 0)
        for k in range(self.num_shards):
            spans = self.chunks(k)
            targets = self.recipients(k) + (tuple(chunks) if self.owner[k] == self.me else ())
            for t in targets:
                chunks[t] += len(spans)
                elems[t] += self.bounds[k + 1] - self.bounds[k]
        return Traffic(chunks, {j: e * self.itemsize for j, e in elems.items()})

    def receives(self) -> Traffic:
        """Chunks and bytes `me` receives from each other participant (butterfly): every
        sender's part of the shards `me` owns or audits, and the aggregate of every shard it
        does not own (from that shard's owner)."""
        chunks = {j: 0 for j in range(self.size) if j != self.me}
        elems = dict.fromkeys(chunks, 0)
        for k in range(self.num_shards):
            senders = list(chunks) if self.me in (self.owner[k], self.auditor[k]) else []
            if self.owner[k] != self.me:
                senders.append(self.owner[k])
            for j in senders:
                chunks[j] += len(self.chunks(k))
                elems[j] += self.bounds[k + 1] - self.bounds[k]
        return Traffic(chunks, {j: e * self.itemsize for j, e in elems.items()})

    # The ring (Patarasuk & Yuan): position i starts the reduce-scatter with shard i, adds shard
    # i-s-1 at step s, ends holding shard i+1 reduced, and relays shard i-s at all-gather step s.

    def ring_first(self) -> int:
        """The shard `me` sends first in the ring's reduce-scatter."""
        return self.me % self.size

    def ring_reduced(self, step: int) -> int:
        """The shard `me` receives (and adds to) at reduce-scatter step `step`."""
        return (self.me - step - 1) % self.size

    def ring_gathered(self, step: int) -> int:
        """The shard `me` receives at all-gather step `step`."""
        return (self.me - step) % self.size
