"""The round state machine: membership, leases, readiness, plans, votes, commit and abort.

This module is pure: `RoundEngine` holds the coordinator's in-memory state and every method takes
the current time explicitly and returns the `Action`s the server must carry out (persist a
commit, send an event to some peers). It never touches sockets, clocks or files, and imports
neither grpc nor the data plane, so the whole protocol of the design notes (§3) is tested
without a network (tests/test_rounds.py).

It is not responsible for moving tensors (peers do that), for laying out the collective
(`shoal.coordinator.planner.plan_round`: the engine picks the participants and stamps the plan
with round, attempt, epoch and deadline), for admission (coordinator.admission) or for
durability (the server persists `PersistCommit`/`PersistAbort` before it sends events).

Protocol summary:
- A joiner is *pending* (or *syncing* once a round has committed); it becomes a *member* only
  when a round opens (the epoch changes only at round boundaries). `MemberState` names every
  state and its transitions.
- A peer says *ready* for round r with the digest of the committed state it holds. A peer whose
  state is not the last committed one gets a `SyncOrder` instead of a place in the round.
- Round r opens when at least `min_peers` peers are ready and either every live member is ready
  or the ready deadline (`ready_timeout`, started by the first ready) has passed. Stragglers are
  left out and keep their lease. While it does not open, `RoundEngine.waiting` says why.
- With a cohort size K > 0 (`coordinator.cohorts`) every peer that says ready, whatever state it
  holds, waits in a pool; when at least K are in it (and the members the round waits for, or the
  ready deadline), K are drawn (uniform, seeded, no peer twice). Only the drawn peers that hold an
  older state get a sync order; the round opens once every drawn peer holds the last committed
  state and said ready (a drawn peer that has not after `cohort_timeout` is replaced by another
  draw). The others are told nothing and keep what they have. K = 0: every ready peer takes part.
- The round commits when every participant voted ok with the same result and state digests.
  Any failed vote, a digest disagreement or the collective deadline aborts the attempt; the
  blamed peers are excluded and the survivors retry (same inputs) after a backoff, up to
  `max_attempts` attempts. A failed vote that accuses other peers does not abort at once: the
  engine waits (the blame window) for the other participants' votes and excludes whom
  `coordinator.blame.blame` names from all of them (the silent ones first).
- Time is the coordinator's own: the server passes a clock that stops while the coordinator
  does not run (`shoal.common.pauses.RunClock`), and after a detected pause `resumed` gives
  every member a grace period to renew its lease.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from shoal.common.plan import Plan, auditor_positions
from shoal.coordinator.blame import blame
from shoal.coordinator.cohorts import Cohort, draw_cohort
from shoal.coordinator.leases import LeaseSchedule
from shoal.coordinator.planner import MAX_DEADLINE_SCALE, LinkSpec, NoPlan, PlanPolicy, plan_round, relay_links

__all__ = ["draw_cohort"]  # re-exported: the draw is part of the engine's rules

log = logging.getLogger("shoal.coordinator")


@dataclass(frozen=True)
class EngineConfig:
    """Timing and quorum settings (seconds). See docs/fault-tolerance.md for how they relate.

    lease_seconds: a peer that has not heartbeated for this long is dropped.
    ready_timeout: after the first ready of a round, wait at most this long for the other
        members (the straggler timeout) before opening the round with those ready.
    collective_timeout: least deadline of one collective attempt, from plan to the last vote
        (longer when the links are slow: planner.attempt_deadline).
    chunk_timeout: floor of the per-chunk deadline; the plan's deadline is
        max(chunk_timeout, chunk_safety * chunk_bytes / slowest link + 2 * max RTT + expected
        collective time), an unreported link counting as slow (planner.chunk_deadline). A round
        that keeps timing out grows both (`DeadlineGrowth`).
    max_attempts: attempts of one round (first try + retries) before it is given up.
    blame_window: after a failed vote that accuses other peers, wait this long (at least twice
        the plan's chunk deadline) for the other participants' votes before deciding whom to
        exclude (`coordinator.blame`); healthy peers vote within a chunk deadline of a failure.
    retry_backoff: delay before retry k is planned is retry_backoff * 2**(k-1).
    total_rounds: stop (Finished) after this many committed rounds; 0 = run forever.
    history_window: committed rounds (and aborted attempts) kept in memory; the store keeps all
        of them. Bounds the coordinator's memory however long it runs.
    cohort_size: participants per round, drawn from the ready peers (`coordinator.cohorts`); also
        the least number of ready peers a round waits for. 0 = every ready peer (no draw).
    cohort_seed: seeds the draws (with the round and draw), so a run's cohorts are reproducible.
    cohort_timeout: a drawn peer that holds an older state has this long to fetch the committed
        state, train and say ready; then its place is drawn again. Longer than one state sync plus
        one round of local work.
    sync_hold: the most a round waits for a peer downloading the committed state (`sync_plan`:
        its expected download time, from its measured rate, when known); past it the swarm goes
        on and the peer catches up from the state it fetched with a second order.
    The planning settings (collective .. compression) are `PlanPolicy`'s (`plan_policy`).
    """

    min_peers: int = 2
    initial_peers: int = 0  # round 0 waits for this many ready peers (0 = min_peers)
    lease_seconds: float = 10.0
    ready_timeout: float = 5.0
    collective_timeout: float = 30.0
    chunk_timeout: float = 2.0
    chunk_safety: float = 4.0
    max_attempts: int = 5
    blame_window: float = 3.0
    retry_backoff: float = 0.05
    total_rounds: int = 0
    history_window: int = 100
    cohort_size: int = 0
    cohort_seed: int = 0
    cohort_timeout: float = 60.0
    sync_hold: float = 60.0  # longest a round waits for a catching-up peer's state download (seconds)
    chunk_bytes: int = 1 << 20  # largest chunk through sockets; see planner.plan_layout
    # Chunk size when every participant reaches every other through shared memory (peer.shm):
    # no socket to keep busy, and every chunk costs CPU on both sides.
    shm_chunk_bytes: int = 4 << 20
    # Largest chunk when every participant reaches every other through the bulk TCP lane (or
    # shared memory): per chunk one frame, one wake-up and one check, no gRPC message.
    bulk_chunk_bytes: int = 4 << 20
    collective: str = "auto"  # "auto" (planner), "ring" or "butterfly"; see planner.plan_layout
    link_cap_bytes_per_s: float = 100e6  # measured rates above this count as this (plan_layout)
    plan_min_gain: float = 0.25  # uneven shards only when predicted this much faster (plan_layout)
    aggregator: str = "mean"
    audit_owners: bool = False  # a second owner recomputes every shard's aggregate (butterfly)
    compression: str = "none"

    def plan_policy(self) -> PlanPolicy:
        """The planner's view of these settings."""
        return PlanPolicy(collective=self.collective, aggregator=self.aggregator, compression=self.compression,
                          audit_owners=self.audit_owners, link_cap=self.link_cap_bytes_per_s,
                          min_gain=self.plan_min_gain, chunk_bytes=self.chunk_bytes,
                          shm_chunk_bytes=self.shm_chunk_bytes, bulk_chunk_bytes=self.bulk_chunk_bytes,
                          chunk_timeout=self.chunk_timeout,
                          chunk_safety=self.chunk_safety, collective_timeout=self.collective_timeout)


SYNC_PERMIT_SECONDS = 300.0  # a sync permit when the peer's download rate is unknown
SYNC_PERMIT_BOUNDS = (60.0, 900.0)  # seconds; a permit sized from a measured rate stays within


def sync_plan(state_bytes: int, bytes_per_s: float, config: EngineConfig, *,
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
    # through the engine (`leave`), which notes it in `RoundEngine.leases`, or the tick misses it.
    lease_expiry: float
    state: MemberState = MemberState.PENDING
    up_bytes_per_s: float = 0.0
    down_bytes_per_s: float = 0.0
    rtt_seconds: float = 0.0
    connected: bool = True  # holds an open WatchRounds stream (a broken stream = gone at once)
    streamed: bool = False  # its stream was open at some point since it joined (see `_waited_on`)
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
    # dialled directly. The planner prefers direct owners (`_outbound_in`).
    relay: str = ""
    relay_bytes_per_s: float = 0.0  # that relay's declared capacity each way (0 = not declared)
    state_bytes: int = 0  # size of its serialized state (its Ready): what a sync downloads
    sync_bytes_per_s: float = 0.0  # rate of its last state download (its Ready; 0 = unknown)
    sync_until: float = 0.0  # rounds wait for its download until then (set with each sync order)

    def link(self) -> LinkSpec:
        """Its reported links, as the planner reads them."""
        return LinkSpec(self.peer_id, self.up_bytes_per_s, self.down_bytes_per_s, self.rtt_seconds, self.shm_peers,
                        self.bulk_peers)


@dataclass(frozen=True)
class ReadyInfo:
    num_elements: int
    dtype: int
    num_samples: int
    state_digest: bytes
    state_round: int
    at: float
    state_bytes: int = 0  # size of the serialized state (0 = not said)
    sync_bytes_per_s: float = 0.0  # the peer's last state download rate (0 = unknown)
    training: bool = False  # a notice, not a Ready: it just synced and runs its local update now
    local_steps: int = 0  # inner steps of the local phase behind this Ready (0 = not said)
    local_seconds: float = 0.0  # wall seconds of that local phase (0 = not said)

    @property
    def step_seconds(self) -> float:
        """This peer's pace: seconds per inner step of its last local phase (0 = unknown)."""
        return self.local_seconds / self.local_steps if self.local_steps and self.local_seconds > 0 else 0.0


@dataclass(frozen=True)
class Vote:
    """One participant's vote on an attempt (shoal.v1.VoteRequest).

    ok: the collective succeeded. result_digest: `shoal.common.tensors.result_digest` of the
    all-reduced result (BLAKE3-256 over its 1 MiB blocks' digests); state_digest: BLAKE3-256 of
    the state it leads to. loss: mean inner training loss (may be non-finite: never
    recorded). suspects: peers the failure points at. flagged: contributions rejected by the
    aggregator. error: why it failed. audit: the failure is a failed owner audit.
    """

    ok: bool
    result_digest: bytes = b""
    state_digest: bytes = b""
    loss: float = 0.0
    suspects: tuple[str, ...] = ()
    flagged: tuple[str, ...] = ()
    error: str = ""
    audit: bool = False

    @property
    def digests(self) -> tuple[bytes, bytes]:
        return self.result_digest, self.state_digest


@dataclass(frozen=True)
class CommitRecord:
    round: int
    attempt: int
    result_digest: bytes
    state_digest: bytes
    participants: tuple[str, ...]
    train_loss: float
    seconds: float
    flagged: tuple[str, ...] = ()
    at: float = 0.0


@dataclass(frozen=True)
class AbortRecord:
    round: int
    attempt: int
    reason: str
    excluded: tuple[str, ...]
    will_retry: bool
    at: float = 0.0


class WaitReason(enum.Enum):
    """Why the next round is not open (`Waiting.reason`)."""

    RUNNING = "running"  # an attempt is in flight
    FINISHED = "finished"  # total_rounds committed
    BACKOFF = "backoff"  # after an abort: the retry (or the fresh start) waits a moment
    NO_TRUSTED_OWNER = "no_trusted_owner"  # every ready peer lost shard ownership in owner audits
    QUORUM = "quorum"  # fewer ready peers than the quorum
    STRAGGLERS = "stragglers"  # quorum reached: waiting (up to the ready timeout) for live members
    SYNCING = "syncing"  # the same, and every peer waited for is fetching the committed state
    OPENING = "opening"  # nothing holds it back: the next event or tick opens it


@dataclass(frozen=True)
class Waiting:
    """Why the next round is not open, for operators (`shoal status`, a metric).

    message: one sentence, e.g. "waiting for 2 more ready peers (3/5 ready, quorum 5)".
    peers: whom it concerns (the stragglers or syncing members waited for, the participants of a
    running attempt, the ready peers without a trusted owner). until: engine time at which this
    wait ends at the latest (None: when something happens).
    """

    reason: WaitReason
    message: str
    peers: tuple[str, ...] = ()
    until: float | None = None


def _plural(k: int, noun: str) -> str:
    return f"{k} {noun}" if k == 1 else f"{k} {noun}s"


# ---------------------------------------------------------------- actions


@dataclass(frozen=True)
class SendPlan:
    plan: Plan


@dataclass(frozen=True)
class SendCommit:
    """Tell the round's commit to `to` (None: every watcher) except `synced`.

    `synced`: the ready peers that did not take part (without cohorts); each gets its `SendSync`
    (in the same action list) instead, which names the new round and its digest, so it need not
    announce itself stale first. With cohorts `to` is the participants: the pool's other members
    are told nothing until a draw picks them (`coordinator.cohorts`).
    `step_seconds`: the fastest participant's seconds per inner step in the committed round's
    local phase (0 = nobody said), the pace of the next local phase with local_work = "time".
    """

    record: CommitRecord
    epoch: int
    synced: frozenset[str] = frozenset()
    to: tuple[str, ...] | None = None
    step_seconds: float = 0.0


@dataclass(frozen=True)
class SendAbort:
    record: AbortRecord
    to: tuple[str, ...]


@dataclass(frozen=True)
class SendSync:
    """A sync order; permit_seconds: how long its permit lasts (donors keep the state that long)."""

    peer_id: str
    round: int
    state_digest: bytes
    donors: tuple[str, ...]
    permit_seconds: float = 300.0


@dataclass(frozen=True)
class SendFinished:
    rounds_committed: int
    reason: str


@dataclass(frozen=True)
class PersistMember:
    member: Member


@dataclass(frozen=True)
class ForgetMember:
    peer_id: str


@dataclass(frozen=True)
class PersistEpoch:
    epoch: int


@dataclass(frozen=True)
class PersistUntrusted:
    """Peers that may never own a shard again (failed owner audits): kept across restarts."""

    peers: tuple[str, ...]


Action = (SendPlan | SendCommit | SendAbort | SendSync | SendFinished | PersistMember | ForgetMember | PersistEpoch
          | PersistUntrusted)


class ErrorKind(enum.Enum):
    """What a refused request did wrong; coordinator.server maps each to one gRPC status."""

    NOT_FOUND = "not_found"  # no live lease / unknown peer: join again
    INVALID = "invalid"  # contradicts the round (wrong round, tensor size)
    PRECONDITION = "precondition"  # fine, but not now (no live donor; not a participant)


class RoundError(Exception):
    """A request that the engine refuses; `kind` picks the gRPC status (see coordinator.server)."""

    def __init__(self, kind: ErrorKind, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass
class _Running:
    plan: Plan
    started: float
    votes: dict[str, Vote] = field(default_factory=dict)
    blame_at: float | None = None  # a failed vote accused others: decide whom to exclude by then
    voted_at: dict[str, float] = field(default_factory=dict)  # when each vote arrived (blame's order)


@dataclass(frozen=True)
class _Opening:
    """`RoundEngine._decide`'s answer when a round can open: with whom, and whom it leaves out."""

    participants: tuple[str, ...]
    left_out: tuple[str, ...] = ()  # stragglers past the ready deadline
    ready: int = 0  # ready peers the participants were drawn from (a cohort: more than participants)


@dataclass(frozen=True)
class _Draw:
    """`RoundEngine._decide`'s answer when a cohort is to be drawn (or refilled): `cohort` is
    the new one; `left_out` the members not waited for any longer (stragglers past the ready
    deadline, drawn members past the cohort deadline)."""

    cohort: Cohort | None  # None: drop the cohort (the pool has too few peers to fill it)
    left_out: tuple[str, ...] = ()
    ready: int = 0


# An abort reason that says a deadline passed: a chunk that did not come (peer.collectives) or
# the attempt's deadline (the peer's or the engine's own `tick`).
_TIMEOUT_MARKERS = ("no chunk from", "deadline")


@dataclass
class DeadlineGrowth:
    """How much longer than planned the next attempt's deadlines are (`scale`, 1..MAX_DEADLINE_SCALE).

    One timeout abort may be a stalled peer (excluded on the retry); a round that times out
    again is more likely held by links slower than their estimates: from the second consecutive
    timeout abort of a round on, every further one doubles the scale, up to the cap. Another
    abort breaks the streak (the scale stays); a commit halves the scale (a link that needed it
    may still be slow), down to 1. `on_abort` returns the line to log when the scale grows.
    """

    scale: float = 1.0
    streak: int = 0  # consecutive timeout aborts of `round`
    round: int = -1

    def on_abort(self, round_: int, reason: str) -> str | None:
        if round_ != self.round:
            self.round, self.streak = round_, 0
        if not any(m in reason for m in _TIMEOUT_MARKERS):
            self.streak = 0
            return None
        self.streak += 1
        if self.streak < 2 or self.scale >= MAX_DEADLINE_SCALE:
            return None
        self.scale = min(MAX_DEADLINE_SCALE, 2 * self.scale)
        return (f"round {round_} timed out {self.streak} times in a row ({reason}): the links are slower "
                f"than their estimates; deadlines of its next attempts x{self.scale:g} (at most "
                f"x{MAX_DEADLINE_SCALE:g})")

    def on_commit(self) -> None:
        self.scale, self.streak, self.round = max(1.0, self.scale / 2), 0, -1


class RoundEngine:
    """The coordinator's state and the protocol's rules; see the module docstring.

    `committed_rounds` is the number of committed rounds, i.e. the index of the round being
    played. `last_state_digest` is the digest every up-to-date peer's state has. `commits` and
    `aborts` hold the last `config.history_window` records only (the store has all of them);
    `committed` given to the constructor may likewise be the tail of the history (its last record
    is the last committed round).
    """

    def __init__(self, config: EngineConfig, *, committed: list[CommitRecord] | None = None,
                 members: list[Member] | None = None, epoch: int = 0, aborted: int = 0, now: float = 0.0,
                 attempt_base: int = 0, untrusted: tuple[str, ...] = ()):
        self.config = config
        self.policy = config.plan_policy()
        self.members: dict[str, Member] = {}
        self.unreachable: set[str] = set()  # members whose address failed the dial-back (Member.reachable)
        # Lease deadlines in time order: a tick looks at the expiring ones only. A lease that moves
        # earlier (`leave`, `join`) is noted there; renewals need not be (coordinator.leases).
        self.leases = LeaseSchedule()
        for m in members or []:
            # A restarted coordinator (or a standby taking over) gives every known member a fresh
            # lease to reconnect, and counts its stream as open until it is seen closed: the first
            # round waits (up to the ready deadline) for the members to come back, instead of
            # opening with the first two and leaving the others to chase it.
            self.members[m.peer_id] = dataclasses.replace(m, lease_expiry=now + config.lease_seconds,
                                                          connected=True)
            self.leases.note(m.peer_id, now + config.lease_seconds)
        self.epoch = epoch
        window = max(1, config.history_window)
        self.commits: deque[CommitRecord] = deque(committed or [], maxlen=window)
        self.aborts: deque[AbortRecord] = deque(maxlen=window)
        self._committed = self.commits[-1].round + 1 if self.commits else 0
        self.rounds_aborted = aborted
        self.rounds_retried = 0
        self.ready: dict[str, ReadyInfo] = {}
        self.first_ready_at: float | None = None
        # Attempt ids are never reused within a round, not even across a coordinator restart
        # (attempt_base = 1000 x restarts), so no chunk of an old attempt can join a new one.
        self.attempt_base = attempt_base
        self.attempt = attempt_base
        self.tries = 0  # attempts in the current try cycle (bounded by max_attempts)
        self.excluded: set[str] = set()
        # Members a round waits for that have not said ready (connected, waited_on, not excluded,
        # not ready; lease not checked): kept up to date at every change (`_refresh`), so that a
        # Ready or a tick decides in O(1) whether the round may open instead of scanning every
        # member (10,000 members: 20,000 Ready calls a round).
        self._unready: set[str] = set()
        self.cohort: Cohort | None = None  # drawn for the round being prepared (cohort_size > 0)
        self.untrusted: set[str] = set(untrusted)  # never shard owners again (failed owner audits, see vote)
        self.running: _Running | None = None
        # Peers whose sync order waits for the attempt in flight to end (`join_sync`, `ready_`):
        # peer id -> the state round it holds.
        self.sync_owed: dict[str, int] = {}
        self.local_seconds = 0.0  # last local phase: last commit -> first Ready after it (`_pool`)
        self.not_before = 0.0
        self._held = Waiting(WaitReason.BACKOFF, "backoff")  # why not_before is in the future
        self._last_wait: WaitReason | None = None  # for logging changes only
        self._no_trusted_logged = False
        self.finished = False
        self._donor_rotation = 0
        self.growth = DeadlineGrowth()
        self._refresh_all()

    # ------------------------------------------------------------ queries

    @property
    def committed_rounds(self) -> int:
        return self._committed

    @property
    def last_state_digest(self) -> bytes:
        return self.commits[-1].state_digest if self.commits else b""

    def pooled(self, peer_id: str) -> bool:
        """With cohorts: this peer's Ready waits in the pool, not in the cohort being prepared nor
        in the running attempt (it need not announce itself again until an event comes)."""
        return (bool(self.config.cohort_size) and peer_id in self.ready
                and not (self.cohort is not None and peer_id in self.cohort.members)
                and not (self.running is not None and peer_id in self.running.plan.participants))

    def holds_ready(self, peer_id: str) -> bool:
        """Whether this peer's Ready for the current round is recorded, or it plays the running attempt."""
        return peer_id in self.ready or (self.running is not None and peer_id in self.running.plan.participants)

    def live(self, now: float) -> list[Member]:
        return [m for m in self.members.values() if m.lease_expiry > now]

    def donors(self, now: float, exclude: str = "") -> tuple[str, ...]:
        """Live, connected peers that took part in the last commit (they hold the committed state),
        rotated by one position per call so that simultaneous joiners start at different donors."""
        alive = self._holders(now, exclude)
        if not alive:
            return ()
        k = self._donor_rotation % len(alive)
        self._donor_rotation += 1
        return tuple(alive[k:] + alive[:k])

    def _holders(self, now: float, exclude: str = "") -> list[str]:
        """The donor candidates of `donors`, sorted, not rotated."""
        if not self.commits:
            return []
        last = set(self.commits[-1].participants)
        # A participant that joined again from another address since is a new process: it no
        # longer holds the committed state (its state is no longer a member's).
        return sorted(p for p in last if p != exclude and p in self.members and self.members[p].lease_expiry > now
                      and self.members[p].connected and self.members[p].state.is_member
                      and not self.members[p].outbound_only)

    def waiting(self, now: float) -> Waiting:
        """Why the next round is not open at `now` (RUNNING while an attempt is in flight;
        OPENING when nothing holds it back and the next event or tick opens it). Changes nothing."""
        decision = self._decide(now)
        if isinstance(decision, Waiting):
            return decision
        if isinstance(decision, _Draw):
            drawn = decision.cohort.members if decision.cohort is not None else ()
            return Waiting(WaitReason.OPENING, f"drawing a cohort of {len(drawn)} for round "
                                               f"{self.committed_rounds} from {decision.ready} ready peers", drawn)
        with_ = (f"its cohort of {len(decision.participants)}" if self.config.cohort_size
                 else _plural(len(decision.participants), 'ready peer'))
        return Waiting(WaitReason.OPENING, f"opening round {self.committed_rounds} with {with_}",
                       decision.participants)

    # ------------------------------------------------------------ membership

    def set_reachable(self, peer_id: str, reachable: bool) -> None:
        """The outcome of a dial-back made after the join: a member restored from the store by a
        restarted (or newly leading) coordinator, which does not keep reachability, is checked
        again when its stream reconnects. An unreachable one takes part outbound-only from the
        next plan on (it owns no shard, is no donor); a reachable one keeps what it said."""
        m = self.members.get(peer_id)
        if m is None:
            return
        m.reachable = reachable
        m.outbound_only = m.outbound_only or not reachable
        self._note_reachable(peer_id, reachable)
        self._refresh(peer_id)

    def _note_reachable(self, peer_id: str, reachable: bool | None) -> None:
        """Keep `unreachable` (the members whose dial-back failed) in step with a member's result."""
        if reachable is False:
            self.unreachable.add(peer_id)
        else:
            self.unreachable.discard(peer_id)

    def join(self, peer_id: str, public_key: bytes, address: str, num_samples: int, now: float,
             up: float = 0.0, down: float = 0.0, *, reachable: bool | None = None,
             connected: bool = False, outbound_only: bool = False, relay: str = "",
             relay_bytes_per_s: float = 0.0) -> list[Action]:
        """Admit (or re-admit, same identity) a peer with a fresh lease; pending until a boundary.

        reachable: the outcome of the coordinator's dial-back of `address` (None: not checked);
        a peer that is not reachable (or says `outbound_only`) takes part outbound-only: it owns no
        shard and is no donor (the planner's `outbound_only`).
        connected: its round-event stream is open (it stayed open across this rejoin). relay: the
        relay `address` is on ("" = direct; docs/nat.md); relay_bytes_per_s: its declared capacity
        each way (0 = not declared), a link the round's relayed participants share (`relay_links`).
        """
        old = self.members.get(peer_id)
        state = MemberState.SYNCING if self.commits else MemberState.PENDING
        if old is not None and old.state.is_member and old.address == address:
            state = MemberState.MEMBER
        m = Member(peer_id, public_key, address, num_samples, now + self.config.lease_seconds, state, up, down,
                   connected=connected or (old.connected if old is not None else False), reachable=reachable,
                   streamed=connected or (old.connected if old is not None else False),
                   outbound_only=outbound_only or reachable is False, relay=relay,
                   relay_bytes_per_s=relay_bytes_per_s if math.isfinite(relay_bytes_per_s) else 0.0)
        if state is MemberState.SYNCING:
            # Its join answer orders a sync: rounds wait for that download (up to sync_hold; it
            # says ready once done), so the state it fetches is still the head when it is done,
            # however slow its link.
            # A rejoin while it was still catching up (a crash loop, a restart policy) keeps the
            # first deadline: one sync_hold per catch-up, not one per join, or rounds never resume.
            again = old is not None and old.state is MemberState.CATCHING_UP and old.sync_until > now
            m.state, m.sync_until = MemberState.CATCHING_UP, old.sync_until if again else now + self.config.sync_hold
        self.members[peer_id] = m
        self.leases.note(peer_id, m.lease_expiry)
        self._note_reachable(peer_id, reachable)
        # A restarted peer's previous stream/participation is void.
        self.ready.pop(peer_id, None)
        self._refresh(peer_id)
        actions: list[Action] = [PersistMember(m)]
        if self.running is not None and peer_id in self.running.plan.participants and old is not None and old.address != address:
            actions += self._abort(now, f"participant {peer_id[:8]} restarted", (peer_id,))
        return actions

    def resumed(self, now: float, paused: float) -> list[Action]:
        """The coordinator did not run for `paused` seconds (detected by its clock, which left
        them out): every member gets a full lease from `now` to renew, since its heartbeats went
        unanswered through no fault of its own. Nothing is evicted for the pause.

        An attempt running across the pause is aborted without excluding anyone and retried with
        the same participants: votes sent while the coordinator did not answer may be lost (a
        peer gives a vote up after its RPC deadline), and waiting for them would cost the whole
        collective deadline."""
        for m in self.members.values():
            m.lease_expiry = max(m.lease_expiry, now + self.config.lease_seconds)
        log.warning("the coordinator did not run for %.1f s (paused or starved); %d members get %.0f s to renew "
                    "their leases", paused, len(self.members), self.config.lease_seconds)
        if self.running is None:
            return []
        return self._abort(now, f"the coordinator did not run for {paused:.1f} s during the attempt", ())

    def heartbeat(self, peer_id: str, now: float) -> Member:
        m = self.members.get(peer_id)
        if m is None or m.lease_expiry <= now:
            self.members.pop(peer_id, None)
            self.unreachable.discard(peer_id)
            self.ready.pop(peer_id, None)
            self._refresh(peer_id)
            raise RoundError(ErrorKind.NOT_FOUND, f"peer_id: no live lease for {peer_id[:8]}; join again")
        m.lease_expiry = now + self.config.lease_seconds
        return m

    def join_sync(self, peer_id: str, now: float) -> SendSync | None:
        """The sync order a joiner's Join answer carries: the last committed state; None when
        there is nothing to fetch (no commit yet; with cohorts a draw orders it) or while an
        attempt is in flight. Its commit would make that state stale before a slow joiner is done:
        one more full download (a 4 Mbit/s joiner of a 9.8 MB state fetched it twice, 21 s each,
        because a 0.1 s round committed meanwhile). So the order follows when the attempt ends
        (`_commit`, `_abort`); a Ready it sends meanwhile gets no order, and the rounds after wait
        for its download (the hold `join` set)."""
        m = self.members.get(peer_id)
        if m is None or not self.commits or self.config.cohort_size:
            return None
        if self.running is not None:
            self.sync_owed[peer_id] = 0
            return None
        return SendSync(peer_id, self.committed_rounds, self.last_state_digest, self.donors(now, exclude=peer_id))

    def _owed_orders(self, now: float, skip: Iterable[str] = ()) -> list[SendSync]:
        """The sync orders put off while the attempt ran (`join_sync`, `ready_`), now that it
        ended (the owed set empties)."""
        owed, self.sync_owed, skip = self.sync_owed, {}, set(skip)
        orders = [self._order_sync(self.members[p], held, now) for p, held in sorted(owed.items())
                  if p in self.members and p not in skip]
        return [o for o in orders if o is not None]

    def leave(self, peer_id: str, now: float) -> list[Action]:
        if peer_id not in self.members:
            return []
        self.members[peer_id].lease_expiry = now
        self.leases.note(peer_id, now)
        return self._expire(now)

    def report_links(self, peer_id: str, up: float, down: float, rtt: float,
                     shm_peers: tuple[str, ...] | None = None, now: float | None = None,
                     bulk_peers: tuple[str, ...] | None = None) -> None:
        """Record a peer's measured links (bytes/s, seconds) and, when given, the peers it reaches
        through shared memory and through the bulk TCP lane; `now` (engine time) dates the
        estimate (`Member.links_at`). The next plan uses them: a report replaces the previous
        one, lower or higher."""
        m = self.members.get(peer_id)
        if m is None:
            raise RoundError(ErrorKind.NOT_FOUND, f"peer_id: unknown peer {peer_id[:8]}")
        m.up_bytes_per_s, m.down_bytes_per_s, m.rtt_seconds = up, down, rtt
        if now is not None:
            m.links_at = now
        if shm_peers is not None:
            m.shm_peers = frozenset(shm_peers)
        if bulk_peers is not None:
            m.bulk_peers = frozenset(bulk_peers)

    def connected(self, peer_id: str, now: float) -> list[Action]:
        """The peer opened its round-event stream."""
        m = self.members.get(peer_id)
        if m is not None:
            m.connected = m.streamed = True
            self._refresh(peer_id)
        return []

    def disconnected(self, peer_id: str, now: float) -> list[Action]:
        """The peer's round-event stream broke: the fastest sign that its process died.

        It keeps its lease (it may reconnect), but no round waits for it, and a round it is
        playing is aborted at once without it.
        """
        m = self.members.get(peer_id)
        if m is None:
            return []
        m.connected = False
        self.ready.pop(peer_id, None)
        self._refresh(peer_id)
        if self.running is not None and peer_id in self.running.plan.participants and peer_id not in self.running.votes:
            return self._abort(now, f"participant {peer_id[:8]} disconnected", (peer_id,))
        return self._maybe_open(now)

    # ------------------------------------------------------------ rounds

    def ready_(self, peer_id: str, round_: int, info: ReadyInfo, now: float) -> list[Action]:
        """Record that `peer_id` is ready for `round_` holding the state `info.state_digest`.

        Returns a SendSync when the peer's state is not the last committed one (it must
        download it first). Raises RoundError NOT_FOUND without a lease, INVALID when the round
        or the tensor size disagrees with the round's, PRECONDITION when it must sync and no
        donor is live.
        """
        m = self.members.get(peer_id)
        if self.finished:
            # A peer that fell behind at the very end may still fetch the final state.
            stale = info.state_round != self.committed_rounds or info.state_digest != self.last_state_digest
            donors = self.donors(now, exclude=peer_id) if stale and m is not None else ()
            if donors:
                return [SendSync(peer_id, self.committed_rounds, self.last_state_digest, donors)]
            return [SendFinished(self.committed_rounds, "run complete")]
        if m is None or m.lease_expiry <= now:
            raise RoundError(ErrorKind.NOT_FOUND, f"peer_id: no live lease for {peer_id[:8]}; join again")
        m.lease_expiry = now + self.config.lease_seconds
        m.num_samples = info.num_samples
        m.state_bytes = info.state_bytes or m.state_bytes
        m.sync_bytes_per_s = info.sync_bytes_per_s or m.sync_bytes_per_s
        in_sync = self._in_sync(info)
        if info.training and in_sync:
            return self._training(m, now)
        if not in_sync and self.config.cohort_size and not (self.cohort and peer_id in self.cohort.members):
            # A cohort's pool: it waits, with the state it has, until a draw picks it.
            self._check_size(info)
            self._pool(peer_id, info, now)
            return self._maybe_open(now)
        if not in_sync:
            if self.running is not None and peer_id not in self.running.plan.participants and self.commits:
                # Behind while an attempt it is not in runs: the head it would fetch now is stale
                # at that attempt's commit (seen: a peer excluded at a link cut downloaded the
                # state three times, 8 s each, while 0.7 s rounds committed). Its order follows
                # when the attempt ends (`_owed_orders`); until then it holds what it holds.
                self.sync_owed[peer_id] = max(self.sync_owed.get(peer_id, 0), info.state_round)
                return []
            order = self._order_sync(m, info.state_round, now)
            if order is None:
                raise RoundError(ErrorKind.PRECONDITION, f"state_round: no live member holds the committed state of round "
                                                         f"{self.committed_rounds - 1} to sync from; retry later")
            return [order]
        m.stale_state_round = None
        m.sync_until = 0.0
        if round_ != self.committed_rounds:
            raise RoundError(ErrorKind.INVALID, f"round: expected {self.committed_rounds}, got {round_}")
        self._check_size(info)
        m.state = m.state.after_ready(in_sync=True)
        self._pool(peer_id, info, now)
        return self._maybe_open(now)

    def _training(self, m: Member, now: float) -> list[Action]:
        """A peer that just downloaded the committed state says so before its local update: the
        next round waits for it about as long as the others' last local phase took (twice that,
        plus the ready timeout, at most sync_hold). Without this notice its download's hold ended
        with the download and the round opened while it trained (a slow joiner chased the head,
        one full download per round)."""
        m.stale_state_round = None
        m.state = m.state.after_ready(in_sync=False)  # waited on, as while it downloaded
        local = self.local_seconds if self.local_seconds > 0 else self.config.ready_timeout
        m.sync_until = now + min(self.config.sync_hold, 2.0 * local + self.config.ready_timeout)
        self._refresh(m.peer_id)
        return []

    def _in_sync(self, info: ReadyInfo) -> bool:
        """Whether a Ready's state is the last committed one."""
        return info.state_round == self.committed_rounds and (
            not self.commits or info.state_digest == self.last_state_digest)

    def _check_size(self, info: ReadyInfo) -> None:
        other = next(iter(self.ready.values()), None)  # any other: they all agree
        if other is not None and (other.num_elements != info.num_elements or other.dtype != info.dtype):
            raise RoundError(
                ErrorKind.INVALID,
                f"num_elements: {info.num_elements} (dtype {info.dtype}) disagrees with the round's "
                f"{other.num_elements} (dtype {other.dtype})",
            )

    def _pool(self, peer_id: str, info: ReadyInfo, now: float) -> None:
        self.ready[peer_id] = info
        self._refresh(peer_id)
        if self.first_ready_at is None:
            self.first_ready_at = now
            if self.commits and not self.config.cohort_size:
                # The local phase: from the last commit to the first Ready after it (seconds).
                self.local_seconds = max(0.0, now - self.commits[-1].at)

    def _order_sync(self, m: Member, held_round: int, now: float) -> SendSync | None:
        """The sync order for member `m`, which holds the state of round `held_round` (not the
        last committed one), or None when no up-to-date donor is live."""
        self.sync_owed.pop(m.peer_id, None)
        donors = self.donors(now, exclude=m.peer_id)
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
        self._refresh(m.peer_id)
        return SendSync(m.peer_id, self.committed_rounds, self.last_state_digest, donors, permit)

    def vote(self, peer_id: str, round_: int, attempt: int, ok: bool, result_digest: bytes,
             state_digest: bytes, now: float, *, loss: float = 0.0, suspects: tuple[str, ...] = (),
             flagged: tuple[str, ...] = (), error: str = "", audit: bool = False,
             relay_failure: str = "") -> list[Action]:
        """Record a participant's vote (the fields of `Vote`); commit when all agree, abort on any failure.

        A late vote for an attempt already decided is ignored. A failed vote naming no suspect
        among the participants blames the voter and aborts at once; one that accuses others opens
        the blame window: the attempt is aborted when every participant voted or the window
        passed (`tick`), excluding whom `coordinator.blame.blame` names. A failed owner audit (`audit`)
        also costs the accused owner and the accusing auditor their shard ownership for the rest
        of the run (`untrusted`): a lying owner is caught once, not every round, and a false
        accuser pays as much as its victim. A failed vote blaming a relay (`relay_failure`: a chunk
        through it failed its end-to-end check; only a relay of this plan counts) aborts at once
        excluding nobody: the peers are healthy, the path between them is not. Raises RoundError PRECONDITION when the voter is not a
        participant of that attempt.
        """
        run = self.running
        if run is None or run.plan.round != round_ or run.plan.attempt != attempt:
            return []  # a late vote for an attempt already decided
        if peer_id not in run.plan.participants:
            raise RoundError(ErrorKind.PRECONDITION,
                             f"peer_id: {peer_id[:8]} is not a participant of round {round_}.{attempt}")
        v = Vote(ok, result_digest, state_digest, loss, suspects, flagged, error, audit)
        run.votes[peer_id] = v
        run.voted_at[peer_id] = now
        if not v.ok and relay_failure and relay_failure in run.plan.relays:
            return self._abort(now, f"relay {relay_failure} altered a chunk ({peer_id[:8]}: "
                                    f"{v.error or 'chunk signature'})", ())
        if not v.ok:
            accused = self._audited_owner(run.plan, peer_id, v.suspects) if v.audit else None
            if accused is not None:
                self.untrusted.update((accused, peer_id))
                return [PersistUntrusted(tuple(sorted(self.untrusted))),
                        *self._abort(now, f"{peer_id[:8]} failed: {v.error or 'collective error'}",
                                     (accused, peer_id))]
            if not any(s in run.plan.participants and s != peer_id for s in v.suspects) \
                    or self._cut_off_outbound(run.plan, peer_id, v.suspects):
                return self._abort(now, f"{peer_id[:8]} failed: {v.error or 'collective error'}", (peer_id,))
            if run.blame_at is None:
                window = max(self.config.blame_window, 2.0 * run.plan.chunk_timeout_seconds)
                run.blame_at = now + window
        if run.blame_at is not None:
            return self._blame(now) if len(run.votes) == len(run.plan.participants) else []
        if len(run.votes) < len(run.plan.participants):
            return []
        digests = Counter(v.digests for v in run.votes.values())
        if len(digests) > 1:
            majority, _ = digests.most_common(1)[0]
            dissent = tuple(p for p, v in run.votes.items() if v.digests != majority)
            return self._abort(now, "digest mismatch", dissent)
        return self._commit(now)

    @staticmethod
    def _cut_off_outbound(plan: Plan, voter: str, suspects: tuple[str, ...]) -> bool:
        """Whether a failed vote is an outbound-only participant's own link failing (docs/nat.md):
        it names every shard owner (at least two), as when all the calls it opened broke at once
        (its NAT forgot the mapping). It then sits out the retry alone, at once: the owners cannot
        see its link break (their side of each call just goes quiet) and would accuse it and each
        other a chunk deadline later. An owner that really died is silent, and its lease or the
        retry's blame excludes it; the outbound-only peer is back in the round after."""
        if voter not in plan.participants or plan.dialable(plan.position(voter)):
            return False
        owners = {plan.participants[o] for o in plan.owners()}
        return len(owners) >= 2 and owners <= set(suspects)

    @staticmethod
    def _audited_owner(plan: Plan, voter: str, suspects: tuple[str, ...]) -> str | None:
        """The owner a failed audit vote accuses, if the claim fits the plan: an audited plan, one
        accused peer besides the voter, and the voter audits a shard that peer owns. Otherwise
        None: the vote counts as an ordinary failure (no peer loses ownership on a peer's say-so
        beyond what the plan lets that peer check)."""
        if not plan.audit_owners or voter not in plan.participants:
            return None
        accused = [s for s in dict.fromkeys(suspects) if s != voter]
        if len(accused) != 1 or accused[0] not in plan.participants:
            return None
        me, owner = plan.position(voter), plan.position(accused[0])
        audits = auditor_positions(plan.shard_owner)
        if any(o == owner and a == me for o, a in zip(plan.shard_owner, audits)):
            return accused[0]
        return None

    def _blame(self, now: float) -> list[Action]:
        """Abort the running attempt after a failed vote that accused others, excluding whom
        `coordinator.blame.blame` names from the votes so far and what the engine knows."""
        run = self.running
        assert run is not None
        accusations = {p: (v.suspects if not v.ok else ()) for p, v in run.votes.items()}
        renewed_by = now - self.config.lease_seconds / 2  # heartbeats come every lease / 4
        stale = [p for p in run.plan.participants
                 if p in self.members and self.members[p].lease_expiry - self.config.lease_seconds < renewed_by]
        # Outbound-only participants were planned as such: nobody had to dial them.
        unreachable = [p for i, p in enumerate(run.plan.participants) if p in self.members
                       and self.members[p].reachable is False and run.plan.dialable(i)]
        blamed = blame(run.plan.participants, accusations, voted_at=run.voted_at,
                       cascade=run.plan.chunk_timeout_seconds, stale=stale, unreachable=unreachable)
        failed = [(p, v) for p, v in run.votes.items() if not v.ok]
        first, vote = failed[0]
        silent = [p for p in run.plan.participants if p not in run.votes]
        why = f"{first[:8]} failed: {vote.error or 'collective error'}"
        if silent:
            why += f"; no vote from {[p[:8] for p in silent]}"
        return self._abort(now, why, blamed)

    def tick(self, now: float) -> list[Action]:
        """Apply deadlines: lease expiry, the blame window, the ready deadline, the collective
        deadline, retries."""
        actions = self._expire(now)
        run = self.running
        if run is not None and run.blame_at is not None and now >= run.blame_at:
            actions += self._blame(now)
        run = self.running
        if run is not None and now - run.started > run.plan.deadline_seconds:
            silent = tuple(p for p in run.plan.participants if p not in run.votes)
            actions += self._abort(now, "collective deadline passed", silent)
        actions += self._maybe_open(now)
        return actions

    # ------------------------------------------------------------ internals

    def _lease_of(self, peer_id: str) -> float | None:
        m = self.members.get(peer_id)
        return m.lease_expiry if m is not None else None

    def _expire(self, now: float) -> list[Action]:
        """Drop the members whose lease ran out (O(expiring), coordinator.leases)."""
        gone = self.leases.expired(now, self._lease_of)
        actions: list[Action] = []
        for p in gone:
            del self.members[p]
            self.unreachable.discard(p)
            self.ready.pop(p, None)
            self._refresh(p)
            actions.append(ForgetMember(p))
        if gone and self.running is not None:
            hit = tuple(p for p in gone if p in self.running.plan.participants)
            if hit:
                actions += self._abort(now, "lease expired", hit)
        return actions

    def _decide(self, now: float) -> Waiting | _Opening | _Draw:
        """Whether a round can open (or a cohort be drawn) at `now`, with whom, or why not.
        Changes nothing."""
        if self.running is not None:
            plan = self.running.plan
            return Waiting(WaitReason.RUNNING, f"round {plan.round} attempt {plan.attempt} is running with "
                                               f"{_plural(plan.size, 'participant')}",
                           plan.participants, self.running.started + plan.deadline_seconds)
        done = Waiting(WaitReason.FINISHED, f"run finished: {_plural(self.committed_rounds, 'round')} committed")
        if self.finished:
            return done
        if now < self.not_before:
            return self._held
        if self.config.total_rounds and self.committed_rounds >= self.config.total_rounds:
            return done
        if self.cohort is not None:
            return self._decide_drawn(now, self.cohort)
        live = {m.peer_id for m in self.live(now)}
        candidates = tuple(sorted(p for p in self.ready if p in live and p not in self.excluded))
        quorum = self._quorum()
        if len(candidates) < quorum:
            why = " = cohort size" if quorum == self.config.cohort_size else ""
            # The committed state lives on the peers: with none of its holders live, nobody can sync.
            lost = (f"; no live member holds the committed state of round {self.committed_rounds - 1}: "
                    f"a peer that took part in it must rejoin") if self.commits and not self._holders(now) else ""
            return Waiting(WaitReason.QUORUM, f"waiting for {_plural(quorum - len(candidates), 'more ready peer')} "
                                              f"({len(candidates)}/{len(live)} ready, quorum {quorum}{why}){lost}",
                           tuple(sorted(live - set(candidates))))
        # Every live peer is waited on (syncing joiners included, or a fast swarm would outrun a
        # joiner forever); the ready timeout bounds the wait for a straggler. A retry waits for
        # nobody: its participants are the survivors.
        waiting_on = tuple(sorted(p for p in self._unready if p in live))
        until = (self.first_ready_at if self.first_ready_at is not None else now) + self.config.ready_timeout
        # A peer downloading the committed state is waited on while its download should last.
        until = max([until] + [self.members[p].sync_until for p in waiting_on
                               if self.members[p].state is MemberState.CATCHING_UP])
        late = self.first_ready_at is not None and now >= until
        if not waiting_on or self.tries > 0 or late:
            left_out = waiting_on if late and self.tries == 0 else ()
            if self.config.cohort_size:
                drawn = draw_cohort(candidates, self.config.cohort_size, seed=self.config.cohort_seed,
                                    round_=self.committed_rounds, attempt=0)
                return _Draw(Cohort(drawn, now), left_out, ready=len(candidates))
            return _Opening(candidates, left_out, ready=len(candidates))
        syncing = sum(self.members[p].state is MemberState.CATCHING_UP for p in waiting_on)
        if syncing == len(waiting_on):
            return Waiting(WaitReason.SYNCING, f"syncing {_plural(syncing, 'member')}: waiting up to "
                                                f"{until - now:.1f} s", waiting_on, until)
        return Waiting(WaitReason.STRAGGLERS, f"waiting up to {until - now:.1f} s for "
                                              f"{_plural(len(waiting_on), 'straggler')}", waiting_on, until)

    def _live(self, peer_id: str, now: float) -> bool:
        m = self.members.get(peer_id)
        return m is not None and m.lease_expiry > now

    def _ready_in_sync(self, peer_id: str, now: float) -> bool:
        """Said ready holding the last committed state, is live and not excluded."""
        info = self.ready.get(peer_id)
        m = self.members.get(peer_id)
        return (info is not None and m is not None and m.lease_expiry > now and peer_id not in self.excluded
                and self._in_sync(info))

    def _decide_drawn(self, now: float, cohort: Cohort) -> Waiting | _Opening | _Draw:
        """A cohort is drawn: open once every member of it holds the last committed state and said
        ready; past the cohort deadline, draw again the places of those that have not. O(K) until
        then (each Ready of the pool asks)."""
        ready = tuple(p for p in cohort.members if self._ready_in_sync(p, now))
        quorum = max(1, self.config.min_peers)
        if len(ready) == len(cohort.members) and len(ready) >= quorum:
            return _Opening(ready, ready=len(ready))
        missing = tuple(p for p in cohort.members if p not in ready)
        until = cohort.drawn_at + self.config.cohort_timeout
        if now < until:
            return Waiting(WaitReason.SYNCING, f"waiting up to {until - now:.1f} s for "
                                                f"{_plural(len(missing), 'drawn peer')} to fetch the committed state "
                                                f"and say ready", missing, until)
        pool = [p for p in self.ready if self._live(p, now) and p not in self.excluded]
        refill = cohort.refill(ready, pool, self.config.cohort_size, seed=self.config.cohort_seed,
                               round_=self.committed_rounds, now=now)
        if set(refill.members) != set(cohort.members) and len(refill.members) >= quorum:
            return _Draw(refill, left_out=missing, ready=len(pool))
        if len(ready) >= quorum:
            return _Opening(ready, left_out=missing, ready=len(ready))
        return _Draw(None, left_out=missing)  # nobody left to draw: back to waiting for a full pool

    def _quorum(self) -> int:
        """Fewest ready peers a round opens with: min_peers, initial_peers for round 0 (outbound-only
        members count: they take part), and at least the cohort size (a cohort is drawn from the
        ready peers, never smaller than K)."""
        quorum = max(1, self.config.min_peers, self.config.cohort_size)
        if self.committed_rounds == 0 and self.tries == 0:
            quorum = max(quorum, self.config.initial_peers)
        return quorum

    @staticmethod
    def _waited_on(m: Member) -> bool:
        """Whether a round waits (up to the ready timeout) for this live peer to say ready
        (`MemberState.waited_on` and its round-event stream is open; a joiner catching up is
        waited on from its Join, before its stream opens: the fast peers' Readys for the next
        round came first, that round committed during its download, and it downloaded twice)."""
        return m.state.waited_on and (m.connected or (m.state is MemberState.CATCHING_UP and not m.streamed))

    def _refresh(self, peer_id: str) -> None:
        """Put `peer_id` in `_unready` or take it out, after any change of its membership, state,
        stream, readiness or exclusion."""
        m = self.members.get(peer_id)
        if (m is not None and self._waited_on(m) and peer_id not in self.ready
                and peer_id not in self.excluded):
            self._unready.add(peer_id)
        else:
            self._unready.discard(peer_id)

    def _refresh_all(self) -> None:
        self._unready = {p for p, m in self.members.items()
                         if self._waited_on(m) and p not in self.ready and p not in self.excluded}

    def _cannot_open(self, now: float) -> bool:
        """A cheap, exact "no": True only when `_decide` would certainly not open a round now
        (too few ready peers, or a waited-for peer not ready before the ready deadline). O(1) in
        the common case; False means "ask `_decide`"."""
        if self.running is not None or self.finished or now < self.not_before:
            return True
        if self.config.total_rounds and self.committed_rounds >= self.config.total_rounds:
            return False  # `_decide` says FINISHED
        if self.cohort is not None:
            return False  # `_decide_drawn` looks at the cohort only: O(K)
        if len(self.ready) < self._quorum():
            return True
        if self.tries > 0:
            return False
        if self.first_ready_at is not None and now - self.first_ready_at >= self.config.ready_timeout:
            return False
        return any(self.members[p].lease_expiry > now for p in self._unready)

    def _maybe_open(self, now: float) -> list[Action]:
        if self._cannot_open(now):
            return []
        decision = self._decide(now)
        if isinstance(decision, _Draw):
            return self._draw(now, decision)
        if isinstance(decision, _Opening):
            return self._open(now, decision)
        if decision.reason is not self._last_wait:
            self._last_wait = decision.reason
            log.debug("round %d not open: %s", self.committed_rounds, decision.message)
        if decision.reason is WaitReason.FINISHED and not self.finished:
            self.finished = True
            return [SendFinished(self.committed_rounds, "run complete")]
        return []

    def _draw(self, now: float, d: _Draw) -> list[Action]:
        """Make `d.cohort` the round's cohort: order a sync for each drawn member that holds an
        older state, stop waiting for `d.left_out`, and open the round if every member is ready."""
        for p in d.left_out:
            m = self.members.get(p)
            if m is not None:
                m.state = m.state.after_missed_deadline()
            if self.cohort is not None and p in self.cohort.members:
                self.ready.pop(p, None)  # a drawn peer that did not come: back to the pool when it says ready
            self._refresh(p)
        self.cohort = d.cohort
        if d.cohort is None:
            return self._maybe_open(now)
        log.info("round %d: a cohort of %d drawn from %d ready peers%s", self.committed_rounds, len(d.cohort.members),
                 d.ready, f" (replacing {len(d.left_out)})" if d.left_out else "")
        actions: list[Action] = []
        for p in d.cohort.members:
            if not self._ready_in_sync(p, now) and p in self.members:
                info = self.ready.get(p)
                order = self._order_sync(self.members[p], info.state_round if info else -1, now)
                if order is not None:
                    actions.append(order)
        return actions + self._maybe_open(now)

    def _open(self, now: float, opening: _Opening) -> list[Action]:
        """Plan the round, apply the membership boundary, start the attempt; or hold when it
        cannot be planned (no trusted shard owner: no round until a trusted peer is among them)."""
        participants = opening.participants
        info = self.ready[participants[0]]
        links = relay_links([self.members[p].link() for p in participants],
                            [(self.members[p].relay, self.members[p].relay_bytes_per_s) for p in participants])
        planned = plan_round(links, info.num_elements, info.dtype,
                             self.policy, untrusted=self.untrusted, deadline_scale=self.growth.scale,
                             outbound_only=self._outbound_in(participants))
        if isinstance(planned, NoPlan):
            self._unplannable(now, planned, participants)
            return []
        self._no_trusted_logged = False
        if self.config.audit_owners and not planned.audit_owners:
            log.warning("round %d is not audited: fewer than two shard owners", self.committed_rounds)
        for p in opening.left_out:  # stragglers: not waited on until they say ready again
            self.members[p].state = self.members[p].state.after_missed_deadline()
            self._refresh(p)
        actions: list[Action] = []
        changed = False
        for p in participants:  # the round boundary: joiners become members
            m = self.members[p]
            joins = not m.state.is_member
            m.state = MemberState.MEMBER
            if joins:
                changed = True
                actions.append(PersistMember(m))
        if changed:
            self.epoch += 1
            actions.append(PersistEpoch(self.epoch))
        plan = dataclasses.replace(
            planned, round=self.committed_rounds, attempt=self.attempt, epoch=self.epoch,
            deadline_seconds=planned.deadline_seconds,
            addresses=tuple(self.members[p].address for p in planned.participants),
            num_samples=tuple(self.ready[p].num_samples for p in planned.participants),
            public_keys=tuple(self.members[p].public_key for p in planned.participants),
            relays=tuple(self.members[p].relay for p in planned.participants)
            if any(self.members[p].relay for p in planned.participants) else ())
        self.running = _Running(plan, now)
        actions.append(SendPlan(plan))
        return actions

    def _unplannable(self, now: float, planned: NoPlan, participants: tuple[str, ...]) -> None:
        """`_open` could not plan a round of `participants`: hold the next opening, with the peers
        this round's aborts excluded taken back when there are any, else until another peer."""
        if self.excluded & self.ready.keys():
            # What the round lacks may be the peers its aborts excluded (e.g. its only reachable
            # owners); they come back only in the next round, which this one would then never
            # reach. Let them back in; the attempt limit still bounds the round.
            log.warning("round %d: %s without the peers its aborts excluded %s: taking them back",
                        self.committed_rounds, planned.reason, sorted(p[:8] for p in self.excluded))
            self.excluded = set()
            self._refresh_all()
            self._hold(now + self.config.retry_backoff, Waiting(
                WaitReason.BACKOFF, f"{planned.reason}: the excluded peers are taken back", participants))
            return
        # E.g. two peers, one of them lying in an owner audit: nobody can tell which.
        if not self._no_trusted_logged:
            log.warning("%s %s: waiting for another peer", planned.reason, [p[:8] for p in participants])
            self._no_trusted_logged = True
        self._hold(now + self.config.ready_timeout, Waiting(WaitReason.NO_TRUSTED_OWNER, planned.reason,
                                                            participants))

    def _hold(self, until: float, why: Waiting) -> None:
        """No round opens before `until` (engine time), for the reason `why`."""
        self.not_before = until
        self._held = dataclasses.replace(why, until=until)

    def _commit(self, now: float) -> list[Action]:
        run = self.running
        assert run is not None
        votes = run.votes
        any_vote = next(iter(votes.values()))
        # A peer may report a non-finite loss (diverged, or lying): it never reaches the record.
        losses = [v.loss for v in votes.values() if math.isfinite(v.loss)]
        flagged = tuple(sorted({f for v in votes.values() for f in v.flagged}))
        rec = CommitRecord(
            round=run.plan.round,
            attempt=run.plan.attempt,
            result_digest=any_vote.result_digest,
            state_digest=any_vote.state_digest,
            participants=run.plan.participants,
            train_loss=float(sum(losses) / len(losses)) if losses else 0.0,
            seconds=now - run.started,
            flagged=flagged,
            at=now,
        )
        self.commits.append(rec)
        self._committed += 1
        self.growth.on_commit()
        pace = self._fastest_pace(rec.participants)
        if self.config.cohort_size:
            # The pool stays; the participants re-enter it when they say ready with the new state.
            for p in rec.participants:
                self.ready.pop(p, None)
            self._reset_round(keep_pool=True)
            if self.ready:
                self.first_ready_at = now  # the pool is ready already: the ready deadline runs
            return [SendCommit(rec, self.epoch, to=rec.participants, step_seconds=pace), *self._owed_orders(now)]
        # The ready peers that did not take part (peers excluded on a retry, stragglers whose
        # Ready came during the attempt) hold the previous state: order their sync now, as their
        # next Ready would.
        orders = [self._order_sync(self.members[p], rec.round, now) for p in self.ready
                  if p not in set(rec.participants) and p in self.members]
        syncs = [o for o in orders if o is not None]
        syncs += self._owed_orders(now, skip=[o.peer_id for o in syncs])
        self._reset_round()
        return [SendCommit(rec, self.epoch, frozenset(o.peer_id for o in syncs), step_seconds=pace), *syncs]

    def _fastest_pace(self, participants: tuple[str, ...]) -> float:
        """The fast participants' seconds per inner step (`ReadyInfo.step_seconds`), 0 when none
        said: the fastest, or with three or more paces the second fastest (one peer that lies
        about its pace cannot shrink everybody's local phase). Not a mean: with local_work =
        "time" the next local phase lasts H of these steps, so the fast peers run about H steps
        and nobody waits for a slow one."""
        paces = sorted(s for s in (self.ready[p].step_seconds for p in participants if p in self.ready) if s > 0)
        return paces[1] if len(paces) >= 3 else paces[0] if paces else 0.0

    def _outbound_in(self, participants) -> set[str]:
        """The participants planned outbound-only: those that are, and the relayed ones while a
        directly reachable participant can own the shards (a relay is a detour and a bottleneck:
        it is used only when nobody else can be dialled; docs/nat.md, "Relays")."""
        out = {p for p in participants if self.members[p].outbound_only}
        relayed = {p for p in participants if self.members[p].relay and p not in out}
        direct = set(participants) - out - relayed
        return out | relayed if direct else out

    def _abort(self, now: float, reason: str, excluded: tuple[str, ...]) -> list[Action]:
        run = self.running
        if run is None:
            return []
        self.excluded.update(excluded)
        for p in excluded:
            self._refresh(p)
        self.running = None
        grew = self.growth.on_abort(run.plan.round, reason)
        if grew is not None:  # the reason once, at the streak's first growth; the later ones quieter
            log.log(logging.WARNING if self.growth.streak == 2 else logging.INFO, "%s", grew)
        self.rounds_aborted += 1
        survivors = [p for p in run.plan.participants if p not in self.excluded and p in self.ready]
        will_retry = self.tries + 1 < self.config.max_attempts and len(survivors) >= self.config.min_peers
        rec = AbortRecord(run.plan.round, run.plan.attempt, reason, tuple(sorted(excluded)), will_retry, now)
        self.aborts.append(rec)
        cohort = self.cohort
        if cohort is not None:  # the pool is not told: only the cohort waits on this round
            to = tuple(sorted(set(run.plan.participants) | set(cohort.members)))
        else:
            to = tuple(sorted(set(run.plan.participants) | set(self.ready)))
        self.attempt += 1
        if will_retry and cohort is not None:
            # The retry keeps the survivors and fills the excluded places from the pool's peers
            # that hold the last state (they can start at once; fewer than K if there are none).
            in_sync = [p for p in self.ready if self._ready_in_sync(p, now)]
            self.cohort = cohort.refill(survivors, in_sync, self.config.cohort_size, seed=self.config.cohort_seed,
                                        round_=run.plan.round, now=now)
        if will_retry:
            self.tries += 1
            self.rounds_retried += 1
            self._hold(now + self.config.retry_backoff * 2 ** (self.tries - 1), Waiting(
                WaitReason.BACKOFF, f"retry backoff: attempt {self.attempt} of round {run.plan.round} "
                                    f"after an abort ({reason})", tuple(survivors)))
        else:
            # Give the round up: everyone (the excluded included) starts it over by saying ready.
            if cohort is not None:
                for p in to:
                    self.ready.pop(p, None)
            self._reset_round(next_attempt=self.attempt, keep_pool=cohort is not None)
            self._hold(now + self.config.retry_backoff, Waiting(
                WaitReason.BACKOFF, f"retry backoff: round {run.plan.round} given up after an abort ({reason}); "
                                    f"it starts over when peers say ready"))
        return [SendAbort(rec, to), *self._owed_orders(now)]

    def _reset_round(self, next_attempt: int | None = None, *, keep_pool: bool = False) -> None:
        """A new round (or a round started over): nobody excluded, no cohort, no Ready kept
        (with cohorts, `keep_pool`: the pool's Readys stay)."""
        self.running = None
        if not keep_pool:
            self.ready = {}
        self.first_ready_at = None
        self.attempt = self.attempt_base if next_attempt is None else next_attempt
        self.tries = 0
        self.excluded = set()
        self.cohort = None
        self._refresh_all()
