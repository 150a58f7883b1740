"""The coordinator's relay of secure-aggregation messages between the participants of an attempt.

Responsible for: holding what the participants of the running attempt post in each phase of a
secure round (SecAgg+, shoal.peer.secure_round) and handing each participant what is addressed
to it once every participant posted (or the caller's wait is over). In the SHARES phase an item is
one participant's Shamir shares for one neighbour, encrypted end to end for that neighbour
(X25519 + HKDF + ChaCha20-Poly1305): the coordinator relays ciphertext and never holds a share's
plaintext. In the REVEAL phase an item is a survivor's revealed shares, for every participant
(SecAgg+'s server sees them too; they only unmask the sum, docs/security.md).

Not responsible for who may call (the server checks the signer is the item's sender and a
participant of the running attempt), nor for durability: the mailboxes live in memory, and a
coordinator restart aborts the attempt anyway. Bounded: only the running attempt's mailboxes are
kept, at most one post per participant and phase, at most `MAX_ITEM_BYTES` per item.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from shoal.common.errors import FailedPrecondition, InvalidArgument
from shoal.v1 import shoal_pb2 as pb

MAX_ITEM_BYTES = 4096  # one encrypted share pair is ~180 bytes, one reveal ~70 bytes per neighbour
MAX_WAIT_SECONDS = 60.0
PHASES = (pb.SECAGG_SHARES, pb.SECAGG_REVEAL)


@dataclass
class _Mailbox:
    posted: dict[str, list[pb.SecAggItem]] = field(default_factory=dict)
    complete: asyncio.Event = field(default_factory=asyncio.Event)


class SecAggRelay:
    """The mailboxes of the running attempt, per phase (module docstring)."""

    def __init__(self) -> None:
        self._key: tuple[int, int] | None = None
        self._participants: frozenset[str] = frozenset()
        self._boxes: dict[int, _Mailbox] = {}

    def _box(self, round_: int, attempt: int, participants: tuple[str, ...], phase: int) -> _Mailbox:
        if phase not in PHASES:
            raise InvalidArgument(f"phase: expected SECAGG_SHARES or SECAGG_REVEAL, got {phase}")
        if self._key != (round_, attempt):
            for box in self._boxes.values():
                box.complete.set()  # wake the waiters of an older attempt: they find it gone
            self._key, self._participants, self._boxes = (round_, attempt), frozenset(participants), {}
        return self._boxes.setdefault(phase, _Mailbox())

    def post(self, req: pb.SecAggPost, participants: tuple[str, ...]) -> None:
        """Keep `req` (a participant of the running attempt `participants`, checked by the caller).
        Raises InvalidArgument for an item not from the caller, to a non-participant, or too large."""
        for it in req.items:
            if it.from_peer != req.peer_id:
                raise InvalidArgument(f"items.from_peer: {it.from_peer[:8]} is not the caller {req.peer_id[:8]}")
            if it.to_peer and it.to_peer not in participants:
                raise InvalidArgument(f"items.to_peer: {it.to_peer[:8]} is not a participant")
            if len(it.data) > MAX_ITEM_BYTES:
                raise InvalidArgument(f"items.data: {len(it.data)} bytes, at most {MAX_ITEM_BYTES}")
        if len(req.items) > len(participants):
            raise InvalidArgument(f"items: {len(req.items)}, at most one per participant ({len(participants)})")
        box = self._box(req.round, req.attempt, participants, req.phase)
        box.posted[req.peer_id] = list(req.items)
        if self._participants <= box.posted.keys():
            box.complete.set()

    async def fetch(self, req: pb.SecAggFetch, participants: tuple[str, ...]) -> pb.SecAggFetchResponse:
        """What was posted to the caller in `req.phase` (SHARES: items addressed to it; REVEAL:
        all), once every participant posted or `req.wait_seconds` (at most MAX_WAIT_SECONDS)
        passed. Raises FailedPrecondition when the attempt was superseded meanwhile."""
        box = self._box(req.round, req.attempt, participants, req.phase)
        wait = min(MAX_WAIT_SECONDS, max(0.0, req.wait_seconds))
        try:
            await asyncio.wait_for(box.complete.wait(), wait)
        except TimeoutError:
            pass
        if self._key != (req.round, req.attempt):
            raise FailedPrecondition(f"round {req.round} attempt {req.attempt} is no longer running")
        items = [it for sent in box.posted.values() for it in sent
                 if req.phase == pb.SECAGG_REVEAL or it.to_peer == req.peer_id]
        return pb.SecAggFetchResponse(items=items, posted=sorted(box.posted))
