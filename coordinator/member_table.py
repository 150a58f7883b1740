"""The member table: who is connected to the coordinator, with which lease, links and state.

Responsible for the coordinator's record of every joined peer (`Member`, its `MemberState` and
the transitions between states), their lease deadlines in time order (`coordinator.leases`), the
members whose address failed the coordinator's dial-back, and the set of members a round waits
for that have not said ready (`unready`), kept up to date at every change so that deciding
whether a round may open costs O(1) instead of a scan of every member. Also picks state donors
(`donors`): the live members that took part in the last commit.

Not responsible for rounds: the engine (`coordinator.rounds.RoundEngine`) owns the table, says
which members have said ready or are excluded from the current round (`refresh`), and turns the
table's changes into actions. Pure: times are passed in, nothing is written anywhere.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from shoal.coordinator.leases import LeaseSchedule
from shoal.coordinator.planner import LinkSpec


class MemberState(enum.Enum):
    """Where a peer stands in the membership, and whether the next round waits for it.

    A round waits (up to the ready timeout) for every connected peer in a state that is
    `waited_on`: a joiner before the first commit, a syncing peer that has shown it is alive (so
    a fast swarm never outruns a joiner), and a member. It does not wait for a peer that must
    sync and has not said ready, nor for a straggler that missed a ready deadline (so it delays
    at most one round) until it says ready again.

    Transitions (RoundEngine): join -> PENDING (no commit yet) | SYNCING | MEMBER (same member
    process, same address); `after_ready` when it says ready; `after_missed_deadline` when a
    round opens without it; MEMBER when it plays a round. The store keeps `label` (pending,
    syncing, member), which `from_label` reads back.
    """

    PENDING = "pending"  # joined before the first commit: waited on
    PENDING_LAGGING = "pending_lagging"  # a pending joiner that missed a ready deadline: not waited on
    SYNCING = "syncing"  # must fetch the committed state (or missed a deadline syncing): not waited on
    CATCHING_UP = "catching_up"  # a syncing peer that said ready (alive): waited on
    MEMBER = "member"  # has played a round: waited on
    LAGGING = "lagging"  # a member that missed a ready deadline: not waited on

    @property
    def is_member(self) -> bool:
        return self in (MemberState.MEMBER, MemberState.LAGGING)

    @property
    def waited_on(self) -> bool:
        return self in (MemberState.PENDING, MemberState.CATCHING_UP, MemberState.MEMBER)

    @property
    def label(self) -> str:
        """The coarse state operators see and the store keeps: "pending", "syncing" or "member"."""
        if self.is_member:
            return "member"
        return "pending" if self in (MemberState.PENDING, MemberState.PENDING_LAGGING) else "syncing"

    @staticmethod
    def from_label(label: str) -> MemberState:
        """Read a stored state (a `label`, or any value of this enum); unknown -> SYNCING."""
        try:
            return MemberState(label)
        except ValueError:
            return MemberState.SYNCING

    def after_ready(self, in_sync: bool) -> MemberState:
        """The state after the peer said ready, holding the last committed state (`in_sync`) or
        not (it gets a sync order, and is waited on while it downloads)."""
        if not in_sync:
            return MemberState.CATCHING_UP
        if self.is_member:
            return MemberState.MEMBER
        if self in (MemberState.PENDING, MemberState.PENDING_LAGGING):
            return MemberState.PENDING
        return MemberState.CATCHING_UP

    def after_missed_deadline(self) -> MemberState:
        """The state of a peer a round opened without (it was waited on and did not say ready)."""
        return {MemberState.MEMBER: MemberState.LAGGING, MemberState.PENDING: MemberState.PENDING_LAGGING,
                MemberState.CATCHING_UP: MemberState.SYNCING}.get(self, self)


@dataclass
class Member:
    peer_id: str
    public_key: bytes
    address: str
    num_samples: int
    # Engine time its lease ends. Renewals move it later freely; moving it earlier must go
    # through `MemberTable.end_lease` or `add`, which note it in the lease schedule, or expiry
    # misses it.
    lease_expiry: float
    state: MemberState = MemberState.PENDING
    up_bytes_per_s: float = 0.0
    down_bytes_per_s: float = 0.0
    rtt_seconds: float = 0.0
    coordinator_rtt_seconds: float = 0.0  # its smallest recent round trip to the coordinator (0 = not measured)
    connected: bool = True  # holds an open WatchRounds stream (a broken stream = gone at once)
    streamed: bool = False  # its stream was open at some point since it joined (see `waited_on`)
    shm_peers: frozenset[str] = frozenset()  # reached through shared memory (LinkReport.shm_peers)
    bulk_peers: frozenset[str] = frozenset()  # reached through the bulk TCP lane (LinkReport.bulk_peers)
    links_at: float | None = None  # engine time of its last link report (None: never reported)
    # The state round of this peer's last out-of-date Ready (None: none since it was last in sync).
    # A later out-of-date Ready holding no newer state shows no progress (a backlog of old
    # messages, a peer still busy elsewhere): it gets the sync order again, nothing else.
    stale_state_round: int | None = None
    # Whether its advertised data address answered the coordinator's dial-back (None: not
    # checked). A peer nobody can dial takes part outbound-only (below).
    reachable: bool | None = None
    # Nobody dials it (unreachable, or it joined with --outbound-only): placed in rounds as a
    # participant that owns no shard and is never a state donor (docs/nat.md).
    outbound_only: bool = False
    # The relay it is reached through (joined with --relay; `address` is on that relay), "" if
    # dialled directly. The planner prefers direct owners (`RoundEngine._outbound_in`).
    relay: str = ""
    relay_bytes_per_s: float = 0.0  # that relay's declared capacity each way (0 = not declared)
    state_bytes: int = 0  # size of its serialized state (its Ready): what a sync downloads
    sync_bytes_per_s: float = 0.0  # rate of its last state download (its Ready; 0 = unknown)
    sync_until: float = 0.0  # rounds wait for its download until then (set with each sync order)

    def link(self) -> LinkSpec:
        """Its reported links, as the planner reads them."""
        return LinkSpec(self.peer_id, self.up_bytes_per_s, self.down_bytes_per_s, self.rtt_seconds, self.shm_peers,
                        self.bulk_peers)


def waited_on(m: Member) -> bool:
    """Whether a round waits (up to the ready timeout) for this live peer to say ready
    (`MemberState.waited_on` and its round-event stream is open; a joiner catching up is
    waited on from its Join, before its stream opens: the fast peers' Readys for the next
    round came first, that round committed during its download, and it downloaded twice)."""
    return m.state.waited_on and (m.connected or (m.state is MemberState.CATCHING_UP and not m.streamed))


class MemberTable:
    """Every joined peer by id, their leases in time order, and the members a round waits for.

    `members` is the table itself (peer id -> `Member`); a caller may change a member's fields
    in place, except moving its lease earlier, which goes through `add` or `end_lease` (the
    lease schedule must see it). After any change of a member's state, stream, readiness or
    exclusion the owner calls `refresh(peer_id, counted)`, where `counted` says whether the
    current round still lacks that member's Ready (it has not said ready and is not excluded).
    """

    def __init__(self) -> None:
        self.members: dict[str, Member] = {}
        self.unreachable: set[str] = set()  # members whose address failed the dial-back (Member.reachable)
        # Lease deadlines in time order: expiry looks at the expiring ones only. A lease that moves
        # earlier (`end_lease`, `add`) is noted there; renewals need not be (coordinator.leases).
        self.leases = LeaseSchedule()
        # Members a round waits for that have not said ready (connected, waited_on, not excluded,
        # not ready; lease not checked): kept up to date at every change (`refresh`), so that a
        # Ready or a tick decides in O(1) whether the round may open instead of scanning every
        # member (10,000 members: 20,000 Ready calls a round).
        self.unready: set[str] = set()
        self._donor_rotation = 0

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self.members

    def get(self, peer_id: str) -> Member | None:
        return self.members.get(peer_id)

    def add(self, m: Member) -> None:
        """Put `m` in the table (a join, or a member restored from the store), replacing any
        record of its peer id, with its lease scheduled."""
        self.members[m.peer_id] = m
        self.leases.note(m.peer_id, m.lease_expiry)
        self.note_reachable(m.peer_id, m.reachable)

    def drop(self, peer_id: str) -> None:
        """Forget `peer_id` (its lease ran out, or it was found without one)."""
        self.members.pop(peer_id, None)
        self.unreachable.discard(peer_id)

    def end_lease(self, peer_id: str, now: float) -> None:
        """End `peer_id`'s lease at `now` (it left); `expired` returns it from then on."""
        self.members[peer_id].lease_expiry = now
        self.leases.note(peer_id, now)

    def expired(self, now: float) -> list[str]:
        """The members whose lease ran out by `now`, removed from the table (O(expiring))."""
        gone = self.leases.expired(now, self._lease_of)
        for p in gone:
            self.drop(p)
        return gone

    def _lease_of(self, peer_id: str) -> float | None:
        m = self.members.get(peer_id)
        return m.lease_expiry if m is not None else None

    def is_live(self, peer_id: str, now: float) -> bool:
        m = self.members.get(peer_id)
        return m is not None and m.lease_expiry > now

    def live(self, now: float) -> list[Member]:
        return [m for m in self.members.values() if m.lease_expiry > now]

    def note_reachable(self, peer_id: str, reachable: bool | None) -> None:
        """Keep `unreachable` (the members whose dial-back failed) in step with a member's result."""
        if reachable is False:
            self.unreachable.add(peer_id)
        else:
            self.unreachable.discard(peer_id)

    def refresh(self, peer_id: str, counted: bool) -> None:
        """Put `peer_id` in `unready` or take it out, after any change of its membership, state,
        stream, readiness or exclusion; `counted`: it has not said ready for the current round
        and is not excluded from it."""
        m = self.members.get(peer_id)
        if m is not None and counted and waited_on(m):
            self.unready.add(peer_id)
        else:
            self.unready.discard(peer_id)

    def refresh_all(self, not_counted: Collection[str]) -> None:
        """Rebuild `unready` from scratch; `not_counted`: the peers that said ready or are excluded."""
        self.unready = {p for p, m in self.members.items() if waited_on(m) and p not in not_counted}

    def holders(self, last_participants: Iterable[str], now: float, exclude: str = "") -> list[str]:
        """The live, connected members among `last_participants` (the last commit's: they hold
        the committed state) that others can dial, sorted: the donor candidates."""
        # A participant that joined again from another address since is a new process: it no
        # longer holds the committed state (its state is no longer a member's).
        members = self.members
        return sorted(p for p in set(last_participants) if p != exclude and p in members
                      and members[p].lease_expiry > now and members[p].connected and members[p].state.is_member
                      and not members[p].outbound_only)

    def donors(self, last_participants: Iterable[str], now: float, exclude: str = "") -> tuple[str, ...]:
        """`holders`, rotated by one position per call so that simultaneous joiners start at
        different donors."""
        alive = self.holders(last_participants, now, exclude)
        if not alive:
            return ()
        k = self._donor_rotation % len(alive)
        self._donor_rotation += 1
        return tuple(alive[k:] + alive[:k])
