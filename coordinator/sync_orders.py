"""Sync orders: which peer fetches the committed state, from whom, and how long rounds wait for it.

Responsible for the orders the engine sends to a peer whose state is not the last committed one
(`SendSync`: the round, its digest and the donors to fetch it from), for sizing how long rounds
wait for that download and how long donors keep the state for it (`sync_plan`), and for the
orders put off while an attempt runs (`owe`, `settle`): an attempt's commit makes the head a peer
would fetch stale, so a peer that falls behind (or joins) during an attempt is ordered when the
attempt ends.

Not responsible for deciding that a peer is behind (the engine compares its Ready with the head)
nor for moving the state (peers fetch it from the donors, `peer.state_sync`). Pure: times are
passed in; an order changes only the ordered member's record (its state and how long rounds wait
for it).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from shoal.coordinator.member_table import Member, MemberTable
from shoal.coordinator.settings import RoundSettings

SYNC_PERMIT_SECONDS = 300.0  # a sync permit when the peer's download rate is unknown
SYNC_PERMIT_BOUNDS = (60.0, 900.0)  # seconds; a permit sized from a measured rate stays within


def sync_plan(state_bytes: int, bytes_per_s: float, config: RoundSettings, *,
              joining: bool = False) -> tuple[float, float]:
    """(hold, permit) seconds for a peer about to download `state_bytes` at `bytes_per_s` (its
    last state download, else its measured download link; 0 = unknown).

    hold: how long rounds wait for it: 1.5x the expected download plus the ready timeout, at most
    `config.sync_hold` (when the rate is unknown: all of it for a peer `joining` (holding no
    committed state yet: it says ready once done, which ends the wait), the ready timeout for a
    member that fell behind, which may still be busy elsewhere). permit: how long its sync permit lasts,
    which is how long donors keep that state for it: 3x the expected download, within
    SYNC_PERMIT_BOUNDS (SYNC_PERMIT_SECONDS when unknown). Pure.
    """
    if state_bytes <= 0 or bytes_per_s <= 0:
        return config.sync_hold if joining else config.ready_timeout, SYNC_PERMIT_SECONDS
    expected = state_bytes / bytes_per_s
    hold = min(config.sync_hold, 1.5 * expected + config.ready_timeout)
    lo, hi = SYNC_PERMIT_BOUNDS
    return hold, min(hi, max(lo, 3.0 * expected))


@dataclass(frozen=True)
class SendSync:
    """A sync order; permit_seconds: how long its permit lasts (donors keep the state that long)."""

    peer_id: str
    round: int
    state_digest: bytes
    donors: tuple[str, ...]
    permit_seconds: float = 300.0


@dataclass(frozen=True)
class Head:
    """The last committed state: the round a peer holding it plays next, its digest, and who
    holds it (the participants of its commit, the donor candidates)."""

    round: int
    state_digest: bytes
    holders: tuple[str, ...]


class SyncOrders:
    """Orders to fetch the committed state, and the ones owed once the running attempt ends.

    `owed`: peer id -> the state round it holds, for peers whose order waits for the attempt in
    flight to end (a joiner's, or a Ready that was behind while the attempt ran).
    """

    def __init__(self, config: RoundSettings, table: MemberTable):
        self.config = config
        self.table = table
        self.owed: dict[str, int] = {}

    def owe(self, peer_id: str, held_round: int) -> None:
        """Order `peer_id` (holding the state of `held_round`) to sync once the attempt ends."""
        self.owed[peer_id] = max(self.owed.get(peer_id, 0), held_round)

    def owe_joiner(self, peer_id: str) -> None:
        """Order a joiner (a new process: it holds no committed state) to sync once the attempt ends."""
        self.owed[peer_id] = 0

    def order(self, m: Member, held_round: int, now: float, head: Head) -> SendSync | None:
        """The sync order for member `m`, which holds the state of round `held_round` (not the
        head), or None when no up-to-date donor is live. Rounds wait for its download while it
        makes progress (see below); the caller refreshes the member's place in the table."""
        self.owed.pop(m.peer_id, None)
        donors = self.table.donors(head.holders, now, exclude=m.peer_id)
        if not donors:
            return None
        # Holding no committed state yet (round 0 after a commit), it is a joiner whatever it played.
        hold, permit = sync_plan(m.state_bytes, m.sync_bytes_per_s or m.down_bytes_per_s, self.config,
                                 joining=held_round == 0)
        if m.stale_state_round is None or held_round > m.stale_state_round:
            # Progress (first word since it fell behind, or a newer state than last time): wait
            # for it while it syncs (up to `hold`), so a fast swarm does not outrun it for ever.
            if m.stale_state_round is not None:
                # It downloaded a state since its last order and the head moved on meanwhile: it
                # is catching up, not busy elsewhere, and its Ready ends the wait. A hold sized
                # from its rate ended just before its download did (a slow joiner chased the head
                # for minutes, one full download per round): wait all of sync_hold.
                hold = max(hold, self.config.sync_hold)
            m.state = m.state.after_ready(in_sync=False)
            m.sync_until = max(m.sync_until, now + hold)
        m.stale_state_round = held_round
        return SendSync(m.peer_id, head.round, head.state_digest, donors, permit)

    def settle(self, now: float, head: Head, skip: Iterable[str] = ()) -> list[SendSync]:
        """The orders put off while the attempt ran, now that it ended (the owed set empties);
        `skip`: peers already ordered."""
        owed, self.owed, skip = self.owed, {}, set(skip)
        orders = [self.order(self.table.members[p], held, now, head) for p, held in sorted(owed.items())
                  if p in self.table and p not in skip]
        return [o for o in orders if o is not None]

    def hold_for_training(self, m: Member, now: float, local_seconds: float) -> None:
        """A peer that just downloaded the committed state says so before its local update: the
        next round waits for it about as long as the others' last local phase took
        (`local_seconds`; twice that, plus the ready timeout, at most sync_hold). Without this
        notice its download's hold ended with the download and the round opened while it
        trained (a slow joiner chased the head, one full download per round)."""
        m.stale_state_round = None
        m.state = m.state.after_ready(in_sync=False)  # waited on, as while it downloaded
        local = local_seconds if local_seconds > 0 else self.config.ready_timeout
        m.sync_until = now + min(self.config.sync_hold, 2.0 * local + self.config.ready_timeout)
