"""The plan of one collective attempt: the one type from the planner to the wire to the peers.

The coordinator's planner lays a collective out (participants in collective order, the
collective algorithm, tensor-shard bounds and owners, chunking, the prediction), the round
engine stamps it with the round, attempt, epoch and deadlines, the server renders it to the wire
(`to_proto`, then signs a round ticket over `shoal.common.tickets.plan_digest` of that message),
and every peer reads it back with `from_proto`. Nothing else describes a plan.

Vocabulary: the *collective* (collective algorithm) is "butterfly" (direct reduce-scatter to
shard owners + all-gather, hivemind's butterfly all-reduce), "ring" (Patarasuk & Yuan 2009),
"allgather" (the sparse all-gather: every participant sends its whole sparse contribution to
every other, each decodes and sums them in participant order; one shard, `(0, num_elements)`) or
"sparse_rs" (the sparse reduce-scatter by index range: each participant owns one range of whole
codec chunks, `sparse_shard_bounds`; every participant sends the sparse payload of each range
only to its shard owner, the owner decodes and sums the contributions of its range in
participant order and sends the merged range back to everyone as plain float32: per peer
(p-1)/p·(S + 4n) bytes each way for payloads of S bytes and n elements, against the
all-gather's (p-1)·S). "allgather" and "sparse_rs" are the sparse collectives
(`is_sparse_collective`). Never to be confused with the *training* algorithm (DiLoCo, FedAvg). A *tensor shard* is the
element range ``[shard_bounds[k], shard_bounds[k+1])`` reduced by its *shard owner*
``participants[shard_owner[k]]``; a *data shard* is the part of the training data a peer holds
(not described here).

Pure: no grpc, no sockets; the wire module `shoal.v1.shoal_pb2` is plain protobuf.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shoal.v1 import shoal_pb2 as pb

COLLECTIVES = ("butterfly", "ring", "allgather", "sparse_rs")  # what the data plane runs (shoal.peer.collectives)
SPARSE_COLLECTIVES = ("allgather", "sparse_rs")  # the collectives of sparse payloads (peer.sparse)


def is_sparse_collective(plan: Plan | str) -> bool:
    """Whether `plan` (or a collective's name) moves sparse contributions (peer.sparse payloads,
    encoded by each peer's error-feedback accumulator): "allgather" or "sparse_rs"."""
    return (plan if isinstance(plan, str) else plan.collective) in SPARSE_COLLECTIVES


def sparse_shard_bounds(num_elements: int, chunk: int, shards: int) -> tuple[int, ...]:
    """The tensor shards of a "sparse_rs" plan: ``shards + 1`` element offsets from 0 to
    `num_elements`, every inner one a multiple of the sparse codec's `chunk` C (a shard is whole
    codec chunks; the last may end at `num_elements`), as even as possible: the
    ``ceil(num_elements / C)`` chunks split so that shard sizes differ by at most one chunk
    (earlier shards take the extra ones). Shards are empty when there are fewer chunks than
    shards. Raises ValueError for a chunk < 1, shards < 1 or num_elements < 0."""
    if chunk < 1 or shards < 1 or num_elements < 0:
        raise ValueError(f"sparse_shard_bounds: chunk {chunk}, shards {shards}, num_elements {num_elements}")
    chunks = -(-num_elements // chunk)
    per, extra = divmod(chunks, shards)
    bounds, at = [0], 0
    for k in range(shards):
        at += per + (1 if k < extra else 0)
        bounds.append(min(num_elements, at * chunk))
    return tuple(bounds)


def auditor_positions(shard_owner: Sequence[int]) -> tuple[int, ...]:
    """Per tensor shard, the participant position that audits its owner: the next owner after it
    (in participant order, cyclically); -1 for every shard when fewer than two peers own shards.

    Peers (who audits what) and the coordinator (does an audit vote come from the auditor?) use
    this same function.
    """
    owners = sorted(set(shard_owner))
    if len(owners) < 2:
        return tuple(-1 for _ in shard_owner)
    return tuple(owners[(owners.index(o) + 1) % len(owners)] for o in shard_owner)


@dataclass(frozen=True)
class Plan:
    """One collective attempt (docs/protocol.md, `Plan`).

    participants: peer ids in collective order (ring order for "ring"). addresses, num_samples,
    public_keys: per participant, same order (empty until the engine fills them in).
    collective: "butterfly" | "ring" | "allgather" | "sparse_rs". shard_bounds: element offsets ``(0, ..., num_elements)``,
    one tensor shard per owner. shard_owner: per shard, the owner's position in `participants`.
    demoted: participants that own no shard. chunk_bytes: largest chunk on the wire, bytes.
    deadline_seconds: the whole attempt; chunk_timeout_seconds: one chunk (derived from the
    slowest measured link, see `shoal.coordinator.planner.chunk_deadline`).
    predicted_seconds / bound_seconds / floor_seconds: the planner's α-β prediction, the lower
    bound of any all-reduce on these links and the simple floor (0 when links are unknown).
    predicted_round_seconds: the whole attempt as the coordinator sees it, predicted_seconds plus
    the control plane's round trips (`shoal.coordinator.planner.control_seconds`; 0 = unknown).
    num_elements / dtype: the tensor (dtype: a `shoal.v1.DType` code). aggregator, compression:
    what shard owners compute and how chunks are encoded. audit_owners: a second owner recomputes
    every shard's aggregate (`auditor_positions`). ticket: the coordinator-signed round ticket
    (empty before the server signs it). outbound_only: positions of participants nobody dials
    (behind NAT, or `--outbound-only`; docs/nat.md): never shard owners, only in a butterfly; each
    opens a stream to every owner and gets the reduced shards back on it. relays: per participant,
    the relay it is reached through ("" = dialled directly; empty tuple: nobody is relayed);
    chunks sent to a relayed participant are signed one by one (shoal.relay.protocol).
    fragments / fragment: the run's Streaming DiLoCo fragments F (1 = the whole model) and the
    one this round carries (round mod F; docs/training.md).
    secagg_keys: per participant, its round's secure-aggregation public keys and their signature
    by its identity key (mask key 32 + box key 32 + Ed25519 signature 64 bytes; empty tuple
    without secure aggregation); secagg_seed: the attempt's public graph seed
    (32 bytes; b"" = not a secure attempt; shoal.peer.secure_round).
    """

    participants: tuple[str, ...]
    collective: str
    shard_bounds: tuple[int, ...]
    shard_owner: tuple[int, ...]
    round: int = 0
    attempt: int = 0
    epoch: int = 0
    addresses: tuple[str, ...] = ()
    num_samples: tuple[int, ...] = ()
    public_keys: tuple[bytes, ...] = ()
    num_elements: int = 0
    dtype: int = 0
    deadline_seconds: float = 30.0
    chunk_timeout_seconds: float = 5.0
    chunk_bytes: int = 1 << 20
    aggregator: str = ""  # "" = the run's aggregator (RunConfig)
    compression: str = "none"
    audit_owners: bool = False
    predicted_seconds: float = 0.0
    predicted_round_seconds: float = 0.0
    bound_seconds: float = 0.0
    floor_seconds: float = 0.0
    demoted: tuple[str, ...] = ()
    ticket: bytes = b""
    outbound_only: tuple[int, ...] = ()
    relays: tuple[str, ...] = ()
    fragment: int = 0
    fragments: int = 1
    secagg_keys: tuple[bytes, ...] = ()
    secagg_seed: bytes = b""

    @property
    def size(self) -> int:
        """Number of participants."""
        return len(self.participants)

    def position(self, peer_id: str) -> int:
        """`peer_id`'s position in `participants`; raises ValueError when it is not one."""
        return self.participants.index(peer_id)

    def dialable(self, position: int) -> bool:
        """Whether other participants may dial the participant at `position` (not outbound-only)."""
        return position not in self.outbound_only

    def relay_of(self, position: int) -> str:
        """The relay the participant at `position` is reached through, "" when dialled directly."""
        return self.relays[position] if position < len(self.relays) else ""

    def owners(self) -> tuple[int, ...]:
        """Positions that own at least one tensor shard, ascending."""
        return tuple(sorted(set(self.shard_owner)))

    def auditors(self) -> tuple[int, ...]:
        """Per tensor shard, the position that audits its owner (`auditor_positions`); all -1
        when the plan is not audited."""
        return auditor_positions(self.shard_owner) if self.audit_owners else tuple(-1 for _ in self.shard_owner)

    def to_proto(self) -> pb.Plan:
        """The wire form (without demoted/bound/floor, which only the coordinator logs)."""
        owners = set(self.shard_owner)
        parts = [
            pb.Participant(peer_id=p,
                           address=self.addresses[i] if i < len(self.addresses) else "",
                           num_samples=self.num_samples[i] if i < len(self.num_samples) else 0,
                           owner=i in owners,
                           public_key=self.public_keys[i] if i < len(self.public_keys) else b"",
                           outbound_only=i in self.outbound_only, relay=self.relay_of(i),
                           secagg_mask_key=self.secagg_keys[i][:32] if i < len(self.secagg_keys) else b"",
                           secagg_box_key=self.secagg_keys[i][32:64] if i < len(self.secagg_keys) else b"",
                           secagg_signature=self.secagg_keys[i][64:] if i < len(self.secagg_keys) else b"")
            for i, p in enumerate(self.participants)
        ]
        return pb.Plan(round=self.round, attempt=self.attempt, epoch=self.epoch, participants=parts,
                       collective=self.collective, shard_bounds=self.shard_bounds, shard_owner=self.shard_owner,
                       num_elements=self.num_elements, dtype=self.dtype, deadline_seconds=self.deadline_seconds,
                       chunk_timeout_seconds=self.chunk_timeout_seconds, chunk_bytes=self.chunk_bytes,
                       ticket=self.ticket, aggregator=self.aggregator, compression=self.compression,
                       predicted_seconds=self.predicted_seconds, audit_owners=self.audit_owners,
                       predicted_round_seconds=self.predicted_round_seconds,
                       fragment=self.fragment, fragments=self.fragments if self.fragments > 1 else 0,
                       secagg_seed=self.secagg_seed)

    @staticmethod
    def from_proto(msg: pb.Plan) -> Plan:
        """Read a wire plan (missing optional fields take the defaults above)."""
        return Plan(
            participants=tuple(p.peer_id for p in msg.participants),
            collective=msg.collective or "ring",
            shard_bounds=tuple(msg.shard_bounds),
            shard_owner=tuple(msg.shard_owner),
            round=msg.round, attempt=msg.attempt, epoch=msg.epoch,
            addresses=tuple(p.address for p in msg.participants),
            num_samples=tuple(p.num_samples for p in msg.participants),
            public_keys=tuple(p.public_key for p in msg.participants),
            num_elements=msg.num_elements, dtype=msg.dtype,
            deadline_seconds=msg.deadline_seconds or 30.0,
            chunk_timeout_seconds=msg.chunk_timeout_seconds or 5.0,
            chunk_bytes=msg.chunk_bytes or (1 << 20),
            aggregator=msg.aggregator, compression=msg.compression or "none",
            audit_owners=msg.audit_owners, predicted_seconds=msg.predicted_seconds,
            predicted_round_seconds=msg.predicted_round_seconds,
            demoted=tuple(p.peer_id for i, p in enumerate(msg.participants) if i not in set(msg.shard_owner)),
            ticket=msg.ticket,
            outbound_only=tuple(i for i, p in enumerate(msg.participants) if p.outbound_only),
            relays=tuple(p.relay for p in msg.participants) if any(p.relay for p in msg.participants) else (),
            fragment=msg.fragment, fragments=max(1, msg.fragments),
            secagg_keys=tuple(p.secagg_mask_key + p.secagg_box_key + p.secagg_signature for p in msg.participants)
            if msg.secagg_seed
            else (),
            secagg_seed=msg.secagg_seed,
        )
