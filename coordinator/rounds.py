"""The round state machine: membership, leases, readiness, plans, votes, commit and abort.

This module is pure: `RoundEngine` holds the coordinator's in-memory state and every method takes
the current time explicitly and returns the `Action`s the server must carry out (persist a
commit, send an event to some peers). It never touches sockets, clocks or files, and imports
neither grpc nor the data plane, so the whole round protocol (docs/concepts.md, "Rounds") is tested
without a network (tests/test_rounds.py).

`RoundEngine` is the one entry point; its parts are small classes of their own: the member
table (`coordinator.member_table`: members, leases, whom a round waits for), the sync orders
(`coordinator.sync_orders`: who fetches the committed state from whom, and the orders owed
until an attempt ends) and the running attempt (`coordinator.attempt`: votes, blame, the
commit record). The engine decides when rounds open and what each event leads to; its
settings are `EngineConfig`, the [rounds] settings (`coordinator.settings`) plus the few it
takes from elsewhere.

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
  Round 0 has no committed state: the first peer ready for it defines the initial state (its
  digest); a peer ready with another one (a model built from another seed) gets a `SyncOrder`
  for that initial state from the peers ready with it, so every participant of round 0 starts
  from the same parameters (torchft's `init_sync`). Not with cohorts: their pool takes any state.
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
import hashlib
import logging
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from shoal.common.plan import Plan
from shoal.common.privacy import DpSettings, PrivacyAccountant
from shoal.coordinator.attempt import Abort, Attempt, CommitRecord, DeadlineGrowth, Tally, Vote
from shoal.coordinator.blame import Strikes
from shoal.coordinator.cohorts import Cohort, draw_cohort
from shoal.coordinator.leases import LeaseSchedule
from shoal.coordinator.member_table import Member, MemberState, MemberTable
from shoal.coordinator.member_table import waited_on as waited_on_member
from shoal.coordinator.planner import NoPlan, PlanPolicy, control_seconds, plan_round, relay_links, setup_seconds
from shoal.coordinator.settings import RoundSettings
from shoal.coordinator.sync_orders import SYNC_PERMIT_BOUNDS, SYNC_PERMIT_SECONDS, Head, SendSync, SyncOrders, sync_plan

# Re-exported: the engine's events, records and rules, importable from the engine's module.
__all__ = ["SYNC_PERMIT_BOUNDS", "SYNC_PERMIT_SECONDS", "CommitRecord", "DeadlineGrowth", "Member", "MemberState",
           "SendSync", "Vote", "draw_cohort", "sync_plan"]

log = logging.getLogger("shoal.coordinator")


_POLICY = PlanPolicy()


SECURE_MIN_PEERS = 3  # fewest participants of a secure round (EngineConfig.min_participants)


@dataclass(frozen=True)
class EngineConfig(RoundSettings):
    """The engine's settings: every [rounds] setting (`RoundSettings`, where each is declared and
    explained once), plus what the engine takes from elsewhere. See docs/fault-tolerance.md for how
    the timeouts relate.

    rounds: here 0 by default (run forever): an engine stops only when told how many rounds to
        commit, whatever the [rounds] table's default.
    aggregator, compression, audit_owners: the [run] settings the plans carry;
    sparse_bytes_per_element, sparse_chunk: the sparse codec's payload size and chunk (the [run]
        sparse_* settings).
    fragments: the [run] fragments F; round r's plan says it carries fragment r mod F.
    cohort_seed: seeds the cohort draws (with the round and draw): the [run] seed.
    privacy: the [run] differential-privacy settings: the engine accounts ε after every commit
        and opens no round that would spend more than the budget (`shoal.common.privacy`).
    history_window: committed rounds (and aborted attempts) kept in memory (the [coordinator]
        setting); the store keeps all of them.
    link_cap_bytes_per_s, plan_min_gain: the planner's (`PlanPolicy`), not user settings.
    Every field whose name is a `PlanPolicy` field reaches the planner (`plan_policy`).
    """

    rounds: int = 0
    aggregator: str = _POLICY.aggregator
    compression: str = _POLICY.compression
    audit_owners: bool = _POLICY.audit_owners
    fragments: int = 1
    cohort_seed: int = 0
    privacy: DpSettings = DpSettings()
    history_window: int = 100
    link_cap_bytes_per_s: float = _POLICY.link_cap_bytes_per_s
    plan_min_gain: float = _POLICY.plan_min_gain
    sparse_bytes_per_element: float = _POLICY.sparse_bytes_per_element
    sparse_chunk: int = _POLICY.sparse_chunk
    secure_aggregation: bool = False  # the [run] setting: a round needs SECURE_MIN_PEERS participants

    @property
    def min_participants(self) -> int:
        """Fewest participants a round (or its retry) runs with: min_peers, and with secure
        aggregation at least SECURE_MIN_PEERS (the sum of two contributions shows each one's to
        the other, and SecAgg+'s threshold t >= 2 needs a neighbour graph of degree >= 2)."""
        return max(1, self.min_peers, SECURE_MIN_PEERS if self.secure_aggregation else 1)

    @classmethod
    def from_settings(cls, settings: RoundSettings, **others: object) -> EngineConfig:
        """The engine config holding every field of `settings`, with `others` (any field of this
        class) set on top."""
        values = {f.name: getattr(settings, f.name) for f in dataclasses.fields(RoundSettings)}
        return cls(**{**values, **others})  # type: ignore[arg-type]

    def plan_policy(self) -> PlanPolicy:
        """The planner's view of these settings: every `PlanPolicy` field this config has."""
        mine = {f.name for f in dataclasses.fields(self)}
        return PlanPolicy(**{f.name: getattr(self, f.name) for f in dataclasses.fields(PlanPolicy)
                             if f.name in mine})


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
    checkpoint_round: int = 0  # committed rounds of the newest checkpoint the peer holds (0 = none)
    checkpoint_digest: bytes = b""  # its state digest
    secagg_keys: bytes = b""  # secure aggregation: the round's mask + box public keys and their signature (128 bytes)

    @property
    def step_seconds(self) -> float:
        """This peer's pace: seconds per inner step of its last local phase (0 = unknown)."""
        return self.local_seconds / self.local_steps if self.local_steps and self.local_seconds > 0 else 0.0


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
    FINISHED = "finished"  # config.rounds committed
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
    epsilon: float = 0.0  # ε spent by the committed rounds so far (0 without DP)
    checkpointers: tuple[str, ...] = ()  # elected to upload a due checkpoint (`elect_checkpointers`)


@dataclass(frozen=True)
class SendAbort:
    record: AbortRecord
    to: tuple[str, ...]


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
class Durable:
    """The newest committed round a checkpoint holds: `round` committed rounds, the state digest
    the coordinator committed for it, and the peers that said (in their Ready) they hold it."""

    round: int
    state_digest: bytes
    peers: tuple[str, ...]


@dataclass(frozen=True)
class PersistDurable:
    """Record `durable` in the store (`shoal status` shows it; a restarted coordinator keeps it)."""

    durable: Durable


@dataclass(frozen=True)
class Rewind:
    """Roll the commit log back: keep the first `rounds` committed rounds, drop the `lost` after
    them (the store drops every commit of a round >= `rounds`), because no live member holds the
    last committed state and `holders` hold the state of round `rounds` (digest `state_digest`,
    the one the coordinator recorded at that commit): a whole swarm restarted from its checkpoints
    (`RoundEngine.rewind_target`, docs/checkpoints.md)."""

    rounds: int
    lost: int
    state_digest: bytes
    holders: tuple[str, ...]


@dataclass(frozen=True)
class PersistUntrusted:
    """Peers that may never own a shard again (failed owner audits): kept across restarts."""

    peers: tuple[str, ...]


Action = (SendPlan | SendCommit | SendAbort | SendSync | SendFinished | PersistMember | ForgetMember | PersistEpoch
          | PersistUntrusted | PersistDurable | Rewind)


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
                 attempt_base: int = 0, untrusted: tuple[str, ...] = (), durable: Durable | None = None):
        self.config = config
        self.policy = config.plan_policy()
        self.table = MemberTable()
        for m in members or []:
            # A restarted coordinator (or a standby taking over) gives every known member a fresh
            # lease to reconnect, and counts its stream as open until it is seen closed: the first
            # round waits (up to the ready deadline) for the members to come back, instead of
            # opening with the first two and leaving the others to chase it.
            self.table.add(dataclasses.replace(m, lease_expiry=now + config.lease_seconds, connected=True))
        self.syncs = SyncOrders(config, self.table)
        self.epoch = epoch
        window = max(1, config.history_window)
        self.commits: deque[CommitRecord] = deque(committed or [], maxlen=window)
        self.aborts: deque[AbortRecord] = deque(maxlen=window)
        self._committed = self.commits[-1].round + 1 if self.commits else 0
        self.rounds_aborted = aborted
        self.rounds_retried = 0
        self.said_ready: dict[str, ReadyInfo] = {}  # peer id -> its Ready for the round being prepared
        # Round 0, before any commit: the initial state's digest (the first Ready's) and who holds it.
        self.initial_digest: bytes | None = None
        self.initial_holders: list[str] = []
        self.first_ready_at: float | None = None
        # Attempt ids are never reused within a round, not even across a coordinator restart
        # (attempt_base = 1000 x restarts), so no chunk of an old attempt can join a new one.
        self.attempt_base = attempt_base
        self.attempt = attempt_base
        self.tries = 0  # attempts in the current try cycle (bounded by max_attempts)
        self.excluded: set[str] = set()
        self.cohort: Cohort | None = None  # drawn for the round being prepared (cohort_size > 0)
        self.untrusted: set[str] = set(untrusted)  # never shard owners again (failed owner audits, see vote)
        self.strikes = Strikes()  # unproven accusations, lying digests: benched for whole rounds (see vote)
        self.running: Attempt | None = None
        # peer id -> the participants of the last plan it was in (one set shared by all of them):
        # the peers it keeps warm connections to (its warm-up before each Ready), for the
        # prediction's set-up term
        self._partners: dict[str, frozenset[str]] = {}
        self.local_seconds = 0.0  # last local phase: last commit -> first Ready after it (`_pool`)
        self.not_before = 0.0
        self._held = Waiting(WaitReason.BACKOFF, "backoff")  # why not_before is in the future
        self._last_wait: WaitReason | None = None  # for logging changes only
        self._no_trusted_logged = False
        self.finished = False
        self.growth = DeadlineGrowth()
        # Privacy accounting: rounds committed before a restart count as sampled at rate 1 (their
        # rates are not persisted; an upper bound on ε).
        self.accountant = PrivacyAccountant(config.privacy)
        for _ in range(self._committed):
            self.accountant.add_round(1.0)
        self._sampling = 1.0  # sampling rate of the round being prepared (cohort / ready pool)
        self._epsilon = self.accountant.epsilon()  # cached: the accountant takes milliseconds
        self._next_epsilon = self.accountant.epsilon_after(1.0)  # ε once the next round commits
        self._budget_warned = False
        # Peers whose Ready held an older state than the last committed one while no live member
        # held that one (nobody to sync from): peer id -> (its round, its Ready). The candidates
        # of a rewind (`rewind_target`); emptied by a commit or a rewind.
        self.behind: dict[str, tuple[int, ReadyInfo]] = {}
        self.first_behind_at: float | None = None
        # After a rewind, until the next commit: who holds the state rewound to (the donors).
        self._rewound: tuple[str, ...] | None = None
        self.durable = durable  # the newest committed round a peer's checkpoint holds (`_note_checkpoint`)
        self._durable_dirty = False
        self._refresh_all()

    # ------------------------------------------------------------ queries

    @property
    def members(self) -> dict[str, Member]:
        """Every joined peer by id (the member table's)."""
        return self.table.members

    @property
    def unreachable(self) -> set[str]:
        """The members whose address failed the dial-back (`Member.reachable`)."""
        return self.table.unreachable

    @property
    def leases(self) -> LeaseSchedule:
        return self.table.leases

    @property
    def sync_owed(self) -> dict[str, int]:
        """Peers whose sync order waits for the attempt in flight to end: peer id -> the state
        round it holds (`join_sync`, `ready`)."""
        return self.syncs.owed

    @property
    def epsilon(self) -> float:
        """ε of the (ε, δ = privacy.delta) guarantee of the committed rounds (0 without DP)."""
        return self._epsilon

    def _budget_spent(self) -> bool:
        dp = self.config.privacy
        return bool(dp.enabled and dp.epsilon_budget and self._next_epsilon > dp.epsilon_budget)

    @property
    def committed_rounds(self) -> int:
        return self._committed

    @property
    def last_state_digest(self) -> bytes:
        return self.commits[-1].state_digest if self.commits else b""

    def pooled(self, peer_id: str) -> bool:
        """With cohorts: this peer's Ready waits in the pool, not in the cohort being prepared nor
        in the running attempt (it need not announce itself again until an event comes)."""
        return (bool(self.config.cohort_size) and peer_id in self.said_ready
                and not (self.cohort is not None and peer_id in self.cohort.members)
                and not (self.running is not None and peer_id in self.running.plan.participants))

    def holds_ready(self, peer_id: str) -> bool:
        """Whether this peer's Ready for the current round is recorded, or it plays the running attempt."""
        return peer_id in self.said_ready or (self.running is not None and peer_id in self.running.plan.participants)

    def live(self, now: float) -> list[Member]:
        return self.table.live(now)

    def donors(self, now: float, exclude: str = "") -> tuple[str, ...]:
        """Live, connected peers that took part in the last commit (they hold the committed state),
        rotated by one position per call so that simultaneous joiners start at different donors."""
        return self.table.donors(self._head().holders, now, exclude)

    def _head(self) -> Head:
        """The last committed state; before the first commit the initial state (see `_initial`)."""
        if not self.commits and self.initial_digest is not None:
            return Head(0, self.initial_digest, tuple(self.initial_holders))
        holders = self._rewound if self._rewound is not None else self.commits[-1].participants if self.commits else ()
        return Head(self.committed_rounds, self.last_state_digest, holders)

    def _initial(self, peer_id: str, info: ReadyInfo, now: float) -> None:
        """Round 0, no commit yet: the first Ready's state is the initial one (again when none of
        its holders is live any more); a later Ready with the same digest holds it too. A Ready
        that names no digest (a client that does not say its state) takes no part in the rule."""
        if self.commits or self.config.cohort_size or info.state_round != 0 or info.training or not info.state_digest:
            return
        if info.state_digest != self.initial_digest and peer_id in self.initial_holders:
            self.initial_holders.remove(peer_id)  # a new process of that key: it holds another state now
        if self.initial_digest is None or not self._initial_donors(now):
            self.initial_digest, self.initial_holders = info.state_digest, []
        if info.state_digest == self.initial_digest and peer_id not in self.initial_holders:
            self.initial_holders.append(peer_id)

    def _initial_donors(self, now: float, exclude: str = "") -> tuple[str, ...]:
        """The live, connected, dialable peers ready with the initial state (not members yet:
        `MemberTable.holders` counts only members)."""
        ms = self.members
        return tuple(p for p in self.initial_holders if p != exclude and p in ms and ms[p].lease_expiry > now
                     and ms[p].connected and not ms[p].outbound_only)

    def _initial_sync(self, m: Member, now: float) -> list[Action]:
        """The order for a peer ready for round 0 with another initial state than the first
        Ready's: download that state (its digest) from the peers holding it; it is waited on."""
        m.state = m.state.after_ready(in_sync=False)
        m.sync_until = max(m.sync_until, now + self.config.sync_hold)
        self._refresh(m.peer_id)
        log.info("peer %s starts from other parameters than the first peer ready for round 0: it syncs to "
                 "their initial state", m.peer_id[:8])
        return [SendSync(m.peer_id, 0, self.initial_digest, self._initial_donors(now, exclude=m.peer_id))]

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
        self.table.note_reachable(peer_id, reachable)
        self._refresh(peer_id)

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
        self.table.add(m)
        # A restarted peer's previous stream/participation is void.
        self.said_ready.pop(peer_id, None)
        self._refresh(peer_id)
        actions: list[Action] = [PersistMember(m)]
        if self.running is not None and peer_id in self.running.plan.participants and old is not None and old.address != address:
            if old.relay and relay and old.relay != relay:
                # The same peer moved to another relay (its relay died): the path changed, the peer did not.
                actions += self._abort(now, f"participant {peer_id[:8]} moved from relay {old.relay} to {relay}", ())
            else:
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
            self.table.drop(peer_id)
            self.said_ready.pop(peer_id, None)
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
            self.syncs.owe_joiner(peer_id)
            return None
        return SendSync(peer_id, self.committed_rounds, self.last_state_digest, self.donors(now, exclude=peer_id))

    def _owed_orders(self, now: float, skip: Iterable[str] = ()) -> list[SendSync]:
        """The sync orders put off while the attempt ran (`join_sync`, `ready`), now that it
        ended (the owed set empties); `skip`: peers already ordered."""
        orders = self.syncs.settle(now, self._head(), skip)
        for o in orders:
            self._refresh(o.peer_id)
        return orders

    def leave(self, peer_id: str, now: float) -> list[Action]:
        if peer_id not in self.members:
            return []
        self.table.end_lease(peer_id, now)
        return self._expire(now)

    def report_links(self, peer_id: str, up: float, down: float, rtt: float,
                     shm_peers: tuple[str, ...] | None = None, now: float | None = None,
                     bulk_peers: tuple[str, ...] | None = None, coordinator_rtt: float = 0.0) -> None:
        """Record a peer's measured links (bytes/s, seconds) and, when given, the peers it reaches
        through shared memory and through the bulk TCP lane, and its round trip to the coordinator
        (seconds, 0 = not measured: the last measured one stays); `now` (engine time) dates the
        estimate (`Member.links_at`). The next plan uses them: a report replaces the previous
        one, lower or higher."""
        m = self.members.get(peer_id)
        if m is None:
            raise RoundError(ErrorKind.NOT_FOUND, f"peer_id: unknown peer {peer_id[:8]}")
        m.up_bytes_per_s, m.down_bytes_per_s, m.rtt_seconds = up, down, rtt
        if coordinator_rtt > 0:
            m.coordinator_rtt_seconds = coordinator_rtt
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
        playing is aborted at once without it (a secure attempt waits for the others' votes
        instead: `_lost`).
        """
        m = self.members.get(peer_id)
        if m is None:
            return []
        m.connected = False
        self.said_ready.pop(peer_id, None)
        self._refresh(peer_id)
        if self.running is not None and peer_id in self.running.plan.participants and peer_id not in self.running.votes:
            return self._lost(now, (peer_id,), f"participant {peer_id[:8]} disconnected")
        return self._maybe_open(now)

    # ------------------------------------------------------------ rounds

    def ready(self, peer_id: str, round_: int, info: ReadyInfo, now: float) -> list[Action]:
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
        self._note_checkpoint(peer_id, info)
        m.num_samples = info.num_samples
        m.state_bytes = info.state_bytes or m.state_bytes
        m.sync_bytes_per_s = info.sync_bytes_per_s or m.sync_bytes_per_s
        self._initial(peer_id, info, now)
        in_sync = self._in_sync(info)
        if info.training and in_sync:
            return self._training(m, now)
        if not in_sync and not self.commits and self.initial_digest is not None and not self.config.cohort_size:
            return self._initial_sync(m, now)
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
                self.syncs.owe(peer_id, info.state_round)
                return []
            order = self._order_sync(m, info.state_round, now)
            if order is None:
                # Nobody to sync from: this peer may hold a state a rewind goes back to.
                rewound = self._fell_behind(m, round_, info, now)
                if rewound:
                    return rewound
                raise RoundError(ErrorKind.PRECONDITION, f"state_round: no live member holds the committed state of round "
                                                         f"{self.committed_rounds - 1} to sync from; retry later")
            return [order]
        self.behind.pop(peer_id, None)
        m.stale_state_round = None
        m.sync_until = 0.0
        if round_ != self.committed_rounds:
            raise RoundError(ErrorKind.INVALID, f"round: expected {self.committed_rounds}, got {round_}")
        self._check_size(info)
        m.state = m.state.after_ready(in_sync=True)
        self._pool(peer_id, info, now)
        return self._maybe_open(now)

    def _note_checkpoint(self, peer_id: str, info: ReadyInfo) -> None:
        """Make the checkpoint this Ready names the durable one when it is a committed round (its
        digest the one committed for it, within the in-memory window) newer than the durable one,
        or add the peer to the durable one's holders; `durable_changed` then says so once."""
        r, digest = info.checkpoint_round, info.checkpoint_digest
        if r <= 0 or not digest or not self.commits or not 0 <= r - 1 - self.commits[0].round < len(self.commits):
            return
        rec = self.commits[r - 1 - self.commits[0].round]
        if rec.round != r - 1 or rec.state_digest != digest:
            return
        cur = self.durable
        if cur is not None and (r < cur.round or (r == cur.round and peer_id in cur.peers)):
            return
        peers = (*cur.peers, peer_id) if cur is not None and r == cur.round else (peer_id,)
        self.durable = Durable(r, digest, tuple(sorted(peers)))
        self._durable_dirty = True

    def durable_changed(self) -> list[Action]:
        """[PersistDurable] once after a Ready changed the durable round (`_note_checkpoint`; the
        server asks after every Ready, whatever its answer), else []."""
        if not self._durable_dirty or self.durable is None:
            return []
        self._durable_dirty = False
        return [PersistDurable(self.durable)]

    def _fell_behind(self, m: Member, round_: int, info: ReadyInfo, now: float) -> list[Action]:
        """Note that `m` holds the older state `info` while no live member holds the last committed
        one (it is no donor of that state from now on: a restarted process whose address did not
        change was still counted as one); the rewind's actions when this makes one due, else []."""
        if m.state.is_member:
            m.state = m.state.after_ready(in_sync=False)
            self._refresh(m.peer_id)
        self.behind[m.peer_id] = (round_, info)
        if self.first_behind_at is None:
            self.first_behind_at = now
        return self._maybe_rewind(now)

    def rewind_target(self, now: float) -> tuple[int, bytes, tuple[str, ...]] | None:
        """The round to roll the commit log back to, now: (rounds kept, the state digest of that
        round, the peers holding it), or None while no rewind is due.

        The rule: a rewind is due when no attempt runs, no live member holds the last committed
        state (`MemberTable.holders`: live, connected members that took part in the last commit
        and have not said they hold another state), at least `min_peers` live peers said ready
        holding an older state (`behind`), and either every live, connected member has or the
        ready timeout passed since the first of them. It goes back to the newest state among
        theirs whose round and digest are a commit the coordinator recorded (its in-memory window
        of `history_window` rounds): a checkpoint a restarted peer resumed from. A state no
        commit recorded (another run's, or a round past the window) never is a target; a peer
        holding it syncs from the holders afterwards. Changes nothing."""
        if self.running is not None or not self.behind or not self.commits:
            return None
        if self.table.holders(self._head().holders, now):
            return None
        live = {m.peer_id for m in self.live(now) if m.connected}
        behind = {p: info for p, (_, info) in self.behind.items() if p in live}
        if len(behind) < max(1, self.config.min_peers):
            return None
        late = self.first_behind_at is not None and now - self.first_behind_at >= self.config.ready_timeout
        if not late and any(p not in behind and waited_on_member(self.members[p]) for p in live):
            return None
        recorded = {c.round + 1: c.state_digest for c in self.commits}
        held = [(info.state_round, p) for p, info in behind.items()
                if info.state_round < self.committed_rounds and recorded.get(info.state_round) == info.state_digest]
        if not held:
            return None
        target = max(r for r, _ in held)
        return target, recorded[target], tuple(sorted(p for r, p in held if r == target))

    def _maybe_rewind(self, now: float) -> list[Action]:
        target = self.rewind_target(now)
        return self._rewind(now, *target) if target is not None else []

    def _rewind(self, now: float, rounds: int, digest: bytes, holders: tuple[str, ...]) -> list[Action]:
        """Roll back to `rounds` committed rounds (`rewind_target`): the holders take part in the
        next round with the state they hold, the other peers that were behind sync from them."""
        lost = self.committed_rounds - rounds
        log.warning("rewinding the run from %d to %d committed rounds: no live member holds the state of round %d; "
                    "%s hold the state of round %d (digest %s); %d committed rounds are lost", self.committed_rounds,
                    rounds, self.committed_rounds - 1, _plural(len(holders), "peer"), rounds, digest.hex()[:16], lost)
        while self.commits and self.commits[-1].round >= rounds:
            self.commits.pop()
        self._committed = rounds
        self.finished = False
        self._rewound = holders
        if self.durable is None or self.durable.round > rounds:
            self.durable = Durable(rounds, digest, holders)
        self._durable_dirty = False
        behind, self.behind, self.first_behind_at = self.behind, {}, None
        self._reset_round()
        self.not_before = 0.0
        actions: list[Action] = [Rewind(rounds, lost, digest, holders), PersistDurable(self.durable)]
        for p in holders:
            m = self.members[p]
            m.state, m.stale_state_round, m.sync_until = MemberState.MEMBER, None, 0.0
            actions.append(PersistMember(m))
            round_, info = behind[p]
            if round_ == rounds:
                self._pool(p, info, now)
        for p, (_, info) in sorted(behind.items()):
            if p not in holders and self.table.is_live(p, now):
                order = self._order_sync(self.members[p], info.state_round, now)
                if order is not None:
                    actions.append(order)
        self._refresh_all()
        return actions + self._maybe_open(now)

    def _training(self, m: Member, now: float) -> list[Action]:
        """A peer that just downloaded the committed state trains now: the next round waits for
        it about as long as the others' last local phase took (`SyncOrders.hold_for_training`)."""
        self.syncs.hold_for_training(m, now, self.local_seconds)
        self._refresh(m.peer_id)
        return []

    def _in_sync(self, info: ReadyInfo) -> bool:
        """Whether a Ready's state is the last committed one (before any commit: the initial one)."""
        if not self.commits and self.initial_digest is not None and not self.config.cohort_size and info.state_digest:
            return info.state_round == 0 and info.state_digest == self.initial_digest
        return info.state_round == self.committed_rounds and (
            not self.commits or info.state_digest == self.last_state_digest)

    def _check_size(self, info: ReadyInfo) -> None:
        other = next(iter(self.said_ready.values()), None)  # any other: they all agree
        if other is not None and (other.num_elements != info.num_elements or other.dtype != info.dtype):
            raise RoundError(
                ErrorKind.INVALID,
                f"num_elements: {info.num_elements} (dtype {info.dtype}) disagrees with the round's "
                f"{other.num_elements} (dtype {other.dtype})",
            )

    def _pool(self, peer_id: str, info: ReadyInfo, now: float) -> None:
        self.said_ready[peer_id] = info
        self._refresh(peer_id)
        if self.first_ready_at is None:
            self.first_ready_at = now
            if self.commits and not self.config.cohort_size:
                # The local phase: from the last commit to the first Ready after it (seconds).
                self.local_seconds = max(0.0, now - self.commits[-1].at)

    def _order_sync(self, m: Member, held_round: int, now: float) -> SendSync | None:
        """The sync order for member `m`, which holds the state of round `held_round` (not the
        last committed one), or None when no up-to-date donor is live (`SyncOrders.order`)."""
        order = self.syncs.order(m, held_round, now, self._head())
        self._refresh(m.peer_id)
        return order

    def vote(self, peer_id: str, round_: int, attempt: int, ok: bool, result_digest: bytes,
             state_digest: bytes, now: float, *, loss: float = 0.0, suspects: tuple[str, ...] = (),
             flagged: tuple[str, ...] = (), error: str = "", audit: bool = False,
             relay_failure: str = "") -> list[Action]:
        """Record a participant's vote (the fields of `Vote`); commit when all agree, abort on any failure.

        A late vote for an attempt already decided is ignored. A failed vote naming no suspect
        among the participants blames the voter and aborts at once; one that accuses others opens
        the blame window: the attempt is aborted when every participant voted or the window
        passed (`tick`), excluding whom `coordinator.blame.blame` names; an accusation without
        evidence (the accused voted ok and nobody else accuses it) excludes its accuser, and so do
        digests against a quorum of identical ones: such a voter is struck, and benched for whole
        rounds after repeated strikes (`coordinator.blame.Strikes`). A failed owner audit (`audit`)
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
        verdict = run.record(peer_id, v, now, blame_window=self.config.blame_window, relay_failure=relay_failure)
        if verdict is Tally.PENDING:
            return []
        if verdict is Tally.BLAME:
            return self._blame(now)
        if verdict is Tally.COMMIT:
            return self._commit(now)
        return self._fail(now, verdict)

    def _fail(self, now: float, verdict: Abort) -> list[Action]:
        """Abort the running attempt as `verdict` says; peers it makes untrusted are persisted first;
        a peer it strikes for the `Strikes.limit`-th time sits out the next rounds (benched)."""
        actions: list[Action] = []
        for p in verdict.struck:
            until = self.strikes.strike(p, self.committed_rounds)
            if until is not None:
                log.warning("peer %s is benched until round %d: %d faults of its own without a commit between "
                            "(%s)", p[:8], until, self.strikes.counts[p], verdict.reason)
        if verdict.untrusted:
            self.untrusted.update(verdict.untrusted)
            actions.append(PersistUntrusted(tuple(sorted(self.untrusted))))
        actions += self._abort(now, verdict.reason, verdict.excluded)
        if verdict.relay and self.not_before < now + self.config.relay_backoff:
            self._hold(now + self.config.relay_backoff, Waiting(
                WaitReason.BACKOFF, f"relay backoff: {verdict.reason}", self._held.peers))
        return actions

    def _blame(self, now: float) -> list[Action]:
        """Abort the running attempt after a failed vote that accused others, excluding whom
        `coordinator.blame.blame` names from the votes so far and what the engine knows: whose
        lease renewals are late, and whom others had to dial but the dial-back did not reach."""
        run = self.running
        assert run is not None
        renewed_by = now - self.config.lease_seconds / 2  # heartbeats come every lease / 4
        stale = [p for p in run.plan.participants
                 if p in self.members and self.members[p].lease_expiry - self.config.lease_seconds < renewed_by]
        # Outbound-only participants were planned as such: nobody had to dial them.
        unreachable = [p for i, p in enumerate(run.plan.participants) if p in self.members
                       and self.members[p].reachable is False and run.plan.dialable(i)]
        return self._fail(now, run.blame(stale, unreachable))

    def tick(self, now: float) -> list[Action]:
        """Apply deadlines: lease expiry, the blame window, the ready deadline, the collective
        deadline, retries."""
        actions = self._expire(now)
        run = self.running
        if run is not None and run.blame_at is not None and now >= run.blame_at:
            actions += self._blame(now)
        run = self.running
        if run is not None and run.grace_at is not None and now >= run.grace_at:
            actions += self._lost(now, run.silent(), "no vote within the grace after the others' votes agreed")
        run = self.running
        if run is not None and run.timed_out(now):
            actions += self._lost(now, run.silent(), "collective deadline passed")
        if self.behind:
            actions += self._maybe_rewind(now)
        actions += self._maybe_open(now)
        return actions

    # ------------------------------------------------------------ internals

    def _expire(self, now: float) -> list[Action]:
        """Drop the members whose lease ran out (O(expiring), coordinator.leases)."""
        gone = self.table.expired(now)
        actions: list[Action] = []
        for p in gone:
            self.said_ready.pop(p, None)
            self._refresh(p)
            actions.append(ForgetMember(p))
        if gone and self.running is not None:
            run = self.running
            # A secure attempt keeps the vote of a participant whose lease ran out after voting.
            hit = tuple(p for p in gone if p in run.plan.participants and not (run.secure and p in run.votes))
            if hit:
                actions += self._lost(now, hit, "lease expired")
        return actions

    def _lost(self, now: float, peers: tuple[str, ...], why: str) -> list[Action]:
        """Participants `peers` of the running attempt are gone before voting (`why`). A plain
        attempt aborts at once without them. A secure attempt (SecAgg+) commits without their
        votes when every other participant votes ok with the same digests: the survivors unmask
        the sum with the lost participants' contributions in it (`Attempt.lose`), so a
        participant that drops after sending costs no retry."""
        run = self.running
        assert run is not None
        if not run.secure:
            return self._abort(now, why, peers)
        verdict = run.lose(peers, why)
        if verdict is Tally.PENDING:
            log.info("round %d.%d: %s (%s); waiting for the other participants' votes (secure aggregation: "
                     "the sum holds its contribution if they unmask it)", run.plan.round, run.plan.attempt,
                     ", ".join(p[:8] for p in peers), why)
            return []
        if verdict is Tally.COMMIT:
            return self._commit(now)
        return self._fail(now, verdict)

    def _decide(self, now: float) -> Waiting | _Opening | _Draw:
        """Whether a round can open (or a cohort be drawn) at `now`, with whom, or why not.
        Changes nothing."""
        if self.running is not None:
            plan = self.running.plan
            return Waiting(WaitReason.RUNNING, f"round {plan.round} attempt {plan.attempt} is running with "
                                               f"{_plural(plan.size, 'participant')}",
                           plan.participants, self.running.started + plan.deadline_seconds)
        done = Waiting(WaitReason.FINISHED, f"run finished: {_plural(self.committed_rounds, 'round')} committed")
        spent = self._budget_spent() and self.config.privacy.on_budget == "stop"
        if spent:
            done = Waiting(WaitReason.FINISHED, f"run finished: privacy budget spent (epsilon {self._epsilon:.3f} "
                                                f"after {_plural(self.committed_rounds, 'round')}; the next round "
                                                f"would make it {self._next_epsilon:.3f} > "
                                                f"{self.config.privacy.epsilon_budget})")
        if self.finished:
            return done
        if now < self.not_before:
            return self._held
        if spent or (self.config.rounds and self.committed_rounds >= self.config.rounds):
            return done
        if self.cohort is not None:
            return self._decide_drawn(now, self.cohort)
        live = {m.peer_id for m in self.live(now)}
        candidates = tuple(sorted(p for p in self.said_ready if p in live and p not in self.excluded))
        quorum = self._quorum()
        if len(candidates) < quorum:
            why = " = cohort size" if quorum == self.config.cohort_size else ""
            if self.config.secure_aggregation and quorum == SECURE_MIN_PEERS > max(self.config.min_peers,
                                                                                 self.config.cohort_size):
                why = f": secure aggregation needs {SECURE_MIN_PEERS}"
            # The committed state lives on the peers: with none of its holders live, nobody can sync.
            lost = (f"; no live member holds the committed state of round {self.committed_rounds - 1}: "
                    f"a peer that took part in it must rejoin") if self.commits and not self.table.holders(self._head().holders, now) else ""
            return Waiting(WaitReason.QUORUM, f"waiting for {_plural(quorum - len(candidates), 'more ready peer')} "
                                              f"({len(candidates)}/{len(live)} ready, quorum {quorum}{why}){lost}",
                           tuple(sorted(live - set(candidates))))
        # Every live peer is waited on (syncing joiners included, or a fast swarm would outrun a
        # joiner forever); the ready timeout bounds the wait for a straggler. A retry waits for
        # nobody: its participants are the survivors.
        waiting_on = tuple(sorted(p for p in self.table.unready if p in live))
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

    def _ready_in_sync(self, peer_id: str, now: float) -> bool:
        """Said ready holding the last committed state, is live and not excluded."""
        info = self.said_ready.get(peer_id)
        m = self.members.get(peer_id)
        return (info is not None and m is not None and m.lease_expiry > now and peer_id not in self.excluded
                and self._in_sync(info))

    def _decide_drawn(self, now: float, cohort: Cohort) -> Waiting | _Opening | _Draw:
        """A cohort is drawn: open once every member of it holds the last committed state and said
        ready; past the cohort deadline, draw again the places of those that have not. O(K) until
        then (each Ready of the pool asks)."""
        ready = tuple(p for p in cohort.members if self._ready_in_sync(p, now))
        quorum = self.config.min_participants
        if len(ready) == len(cohort.members) and len(ready) >= quorum:
            return _Opening(ready, ready=len(ready))
        missing = tuple(p for p in cohort.members if p not in ready)
        until = cohort.drawn_at + self.config.cohort_timeout
        if now < until:
            return Waiting(WaitReason.SYNCING, f"waiting up to {until - now:.1f} s for "
                                                f"{_plural(len(missing), 'drawn peer')} to fetch the committed state "
                                                f"and say ready", missing, until)
        pool = [p for p in self.said_ready if self.table.is_live(p, now) and p not in self.excluded]
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
        quorum = max(self.config.min_participants, self.config.cohort_size)
        if self.committed_rounds == 0 and self.tries == 0:
            quorum = max(quorum, self.config.initial_peers)
        return quorum

    def _refresh(self, peer_id: str) -> None:
        """Keep `peer_id`'s place in the member table's `unready` after any change of its
        membership, state, stream, readiness or exclusion."""
        self.table.refresh(peer_id, counted=peer_id not in self.said_ready and peer_id not in self.excluded)

    def _refresh_all(self) -> None:
        self.table.refresh_all(self.said_ready.keys() | self.excluded)

    def _cannot_open(self, now: float) -> bool:
        """A cheap, exact "no": True only when `_decide` would certainly not open a round now
        (too few ready peers, or a waited-for peer not ready before the ready deadline). O(1) in
        the common case; False means "ask `_decide`"."""
        if self.running is not None or self.finished or now < self.not_before:
            return True
        if self.config.rounds and self.committed_rounds >= self.config.rounds:
            return False  # `_decide` says FINISHED
        if self.config.privacy.on_budget == "stop" and self._budget_spent():
            return False  # `_decide` says FINISHED (also for a coordinator resumed with its budget spent)
        if self.cohort is not None:
            return False  # `_decide_drawn` looks at the cohort only: O(K)
        if len(self.said_ready) < self._quorum():
            return True
        if self.tries > 0:
            return False
        if self.first_ready_at is not None and now - self.first_ready_at >= self.config.ready_timeout:
            return False
        return any(self.members[p].lease_expiry > now for p in self.table.unready)

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
            reason = "privacy budget spent" if self._budget_spent() else "run complete"
            if self._budget_spent():
                log.warning("%s", decision.message)
            return [SendFinished(self.committed_rounds, reason)]
        return []

    def _draw(self, now: float, d: _Draw) -> list[Action]:
        """Make `d.cohort` the round's cohort: order a sync for each drawn member that holds an
        older state, stop waiting for `d.left_out`, and open the round if every member is ready."""
        for p in d.left_out:
            m = self.members.get(p)
            if m is not None:
                m.state = m.state.after_missed_deadline()
            if self.cohort is not None and p in self.cohort.members:
                self.said_ready.pop(p, None)  # a drawn peer that did not come: back to the pool when it says ready
            self._refresh(p)
        self.cohort = d.cohort
        if d.cohort is None:
            return self._maybe_open(now)
        if d.cohort.draws == 1 and d.ready:
            self._sampling = min(1.0, len(d.cohort.members) / d.ready)
        log.info("round %d: a cohort of %d drawn from %d ready peers%s", self.committed_rounds, len(d.cohort.members),
                 d.ready, f" (replacing {len(d.left_out)})" if d.left_out else "")
        actions: list[Action] = []
        for p in d.cohort.members:
            if not self._ready_in_sync(p, now) and p in self.members:
                info = self.said_ready.get(p)
                order = self._order_sync(self.members[p], info.state_round if info else -1, now)
                if order is not None:
                    actions.append(order)
        return actions + self._maybe_open(now)

    def _open(self, now: float, opening: _Opening) -> list[Action]:
        """Plan the round, apply the membership boundary, start the attempt; or hold when it
        cannot be planned (no trusted shard owner: no round until a trusted peer is among them)."""
        participants = opening.participants
        info = self.said_ready[participants[0]]
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
            num_samples=tuple(self.said_ready[p].num_samples for p in planned.participants),
            public_keys=tuple(self.members[p].public_key for p in planned.participants),
            relays=tuple(self.members[p].relay for p in planned.participants)
            if any(self.members[p].relay for p in planned.participants) else (),
            fragments=max(1, self.config.fragments), fragment=self.committed_rounds % max(1, self.config.fragments))
        plan = self._secure(plan)
        plan = dataclasses.replace(plan, predicted_round_seconds=plan.predicted_seconds + control_seconds(
            [self.members[p].coordinator_rtt_seconds for p in plan.participants if p in self.members],
            secure=bool(plan.secagg_seed)) + self._setup_seconds(plan.participants))
        self.running = Attempt(plan, now, quorum=max(2, self.config.min_participants))
        actions.append(SendPlan(plan))
        return actions

    def _setup_seconds(self, participants: Sequence[str]) -> float:
        """The connection set-up this attempt adds (`planner.setup_seconds`): a sender dials its
        own connections, so the pair a -> b is cold when b was not in the last plan a was in
        (a's warm-up before its Ready reaches the participants of that plan); records this plan
        as each participant's last. Memory: one shared set per plan still referred to; time:
        one set difference per distinct previous plan among the participants."""
        known = self._partners
        for gone in [p for p in known if p not in self.members]:
            del known[gone]
        plan_set = frozenset(p for p in participants if p in self.members)
        groups: dict[int, tuple[frozenset[str], list[str]]] = {}
        for a in plan_set:
            last = known.get(a, frozenset())
            groups.setdefault(id(last), (last, []))[1].append(a)
        cold = []
        for last, senders in groups.values():
            new = plan_set - last  # the participants none of these senders has warmed
            if not new:
                continue
            top = sorted(((self.members[b].rtt_seconds, b) for b in new), reverse=True)[:2]
            for a in senders:
                far = next((r for r, b in top if b != a), None)  # the farthest cold partner but itself
                if far is not None:
                    cold.append((self.members[a].rtt_seconds, far))
        for p in plan_set:
            known[p] = plan_set
        return setup_seconds(cold)

    def _secure(self, plan: Plan) -> Plan:
        """With secure aggregation (every participant's Ready carries its round's public keys),
        the plan carries those keys and the attempt's public graph seed (a hash of the round,
        attempt, run seed and keys: fresh for every attempt; shoal.peer.secure_round)."""
        keys = tuple(self.said_ready[p].secagg_keys for p in plan.participants)
        if not all(len(k) == 128 for k in keys):
            return plan
        h = hashlib.sha256(b"shoal-secagg-graph|%d|%d|%d|%d|" % (plan.round, plan.attempt, plan.epoch,
                                                                   self.config.cohort_seed))
        for k in keys:
            h.update(k)
        return dataclasses.replace(plan, secagg_keys=keys, secagg_seed=h.digest())

    def _unplannable(self, now: float, planned: NoPlan, participants: tuple[str, ...]) -> None:
        """`_open` could not plan a round of `participants`: hold the next opening, with the peers
        this round's aborts excluded taken back when there are any, else until another peer."""
        if self.excluded & self.said_ready.keys():
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
        rec = run.commit_record(now)
        self.commits.append(rec)
        self._committed += 1
        self._rewound = None
        self.behind, self.first_behind_at = {}, None
        self.growth.on_commit()
        self.strikes.cleared(rec.participants)
        pace = self._fastest_pace(rec.participants)
        epsilon = self._account(rec.round)
        if run.lost:
            log.info("round %d.%d commits without the votes of %s, lost after sending (secure aggregation: "
                     "the survivors unmasked the sum with their contributions)", rec.round, rec.attempt,
                     ", ".join(sorted(p[:8] for p in run.lost)))
        elected = self.elect_checkpointers(tuple(p for p in rec.participants if p not in run.lost))
        if self.config.cohort_size:
            # The pool stays; the participants re-enter it when they say ready with the new state.
            for p in rec.participants:
                self.said_ready.pop(p, None)
            self._reset_round(keep_pool=True)
            if self.said_ready:
                self.first_ready_at = now  # the pool is ready already: the ready deadline runs
            return [SendCommit(rec, self.epoch, to=rec.participants, step_seconds=pace, epsilon=epsilon,
                               checkpointers=elected),
                    *self._owed_orders(now)]
        # The ready peers that did not take part (peers excluded on a retry, stragglers whose
        # Ready came during the attempt) hold the previous state: order their sync now, as their
        # next Ready would.
        orders = [self._order_sync(self.members[p], rec.round, now) for p in self.said_ready
                  if p not in set(rec.participants) and p in self.members]
        syncs = [o for o in orders if o is not None]
        syncs += self._owed_orders(now, skip=[o.peer_id for o in syncs])
        self._reset_round()
        return [SendCommit(rec, self.epoch, frozenset(o.peer_id for o in syncs), step_seconds=pace, epsilon=epsilon,
                           checkpointers=elected), *syncs]

    def _account(self, round_: int) -> float:
        """Record the committed round with the privacy accountant; returns ε so far. Caches ε
        after one more round at the same sampling rate (what `_decide` compares with the budget)
        and warns once when that exceeds the budget with on_budget = "warn"."""
        dp = self.config.privacy
        if not dp.enabled:
            return 0.0
        q, self._sampling = self._sampling, 1.0
        self.accountant.add_round(q)
        epsilon = self._epsilon = self.accountant.epsilon()
        self._next_epsilon = self.accountant.epsilon_after(q)
        log.info("round %d: privacy spent epsilon %.4f at delta %g (sigma %g, sampling %.3f, %s noise)",
                 round_, epsilon, dp.delta, dp.sigma, q, dp.mode)
        if self._budget_spent() and dp.on_budget == "warn" and not self._budget_warned:
            self._budget_warned = True
            log.warning("privacy budget: the next round makes epsilon %.3f > %g; going on (dp_on_budget = warn)",
                        self._next_epsilon, dp.epsilon_budget)
        return epsilon

    def elect_checkpointers(self, participants: tuple[str, ...]) -> tuple[str, ...]:
        """The participants that upload this round's checkpoint to the shared store when one is
        due: the `checkpointers` setting's count (0 = all) with the best reported upload rate
        (ties and unknown rates by peer id), never an outbound-only one while another is there.
        Psyche elects a share of its clients as checkpointers per epoch; here each commit does."""
        k = self.config.checkpointers or len(participants)
        def rank(p: str):
            m = self.members.get(p)
            return (m is None or m.outbound_only, -(m.up_bytes_per_s if m is not None else 0.0), p)
        return tuple(sorted(sorted(participants, key=rank)[:k]))

    def _fastest_pace(self, participants: tuple[str, ...]) -> float:
        """The fast participants' seconds per inner step (`ReadyInfo.step_seconds`), 0 when none
        said: the fastest, or with three or more paces the second fastest (one peer that lies
        about its pace cannot shrink everybody's local phase). Not a mean: with local_work =
        "time" the next local phase lasts H of these steps, so the fast peers run about H steps
        and nobody waits for a slow one."""
        paces = sorted(s for s in (self.said_ready[p].step_seconds for p in participants if p in self.said_ready) if s > 0)
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
        survivors = [p for p in run.plan.participants if p not in self.excluded and p in self.said_ready]
        will_retry = self.tries + 1 < self.config.max_attempts and len(survivors) >= self.config.min_participants
        rec = AbortRecord(run.plan.round, run.plan.attempt, reason, tuple(sorted(excluded)), will_retry, now)
        self.aborts.append(rec)
        cohort = self.cohort
        if cohort is not None:  # the pool is not told: only the cohort waits on this round
            to = tuple(sorted(set(run.plan.participants) | set(cohort.members)))
        else:
            to = tuple(sorted(set(run.plan.participants) | set(self.said_ready)))
        self.attempt += 1
        if will_retry and cohort is not None:
            # The retry keeps the survivors and fills the excluded places from the pool's peers
            # that hold the last state (they can start at once; fewer than K if there are none).
            in_sync = [p for p in self.said_ready if self._ready_in_sync(p, now)]
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
                    self.said_ready.pop(p, None)
            self._reset_round(next_attempt=self.attempt, keep_pool=cohort is not None)
            self._hold(now + self.config.retry_backoff, Waiting(
                WaitReason.BACKOFF, f"retry backoff: round {run.plan.round} given up after an abort ({reason}); "
                                    f"it starts over when peers say ready"))
        return [SendAbort(rec, to), *self._owed_orders(now)]

    def _reset_round(self, next_attempt: int | None = None, *, keep_pool: bool = False) -> None:
        """A new round (or a round started over): nobody excluded but the benched peers
        (`Strikes`), no cohort, no Ready kept (with cohorts, `keep_pool`: the pool's Readys stay)."""
        self.running = None
        if not keep_pool:
            self.said_ready = {}
        self.first_ready_at = None
        self.attempt = self.attempt_base if next_attempt is None else next_attempt
        self.tries = 0
        self.excluded = self.strikes.benched(self.committed_rounds)
        self.cohort = None
        self._refresh_all()
