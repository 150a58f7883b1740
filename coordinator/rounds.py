"""The round state machine: membership, leases, readiness, plans, votes, commit and abort.

This module is pure: `RoundEngine` holds the coordinator's in-memory state and every method takes
the current time explicitly and returns the `Action`s the server must carry out (persist a
commit, send an event to some peers). It never touches sockets, clocks or files, so the whole
protocol of the design notes (§3) is tested without a network (tests/test_rounds.py).

It is not responsible for moving tensors (peers do that), for admission (coordinator.admission)
or for durability (the server persists `PersistCommit`/`PersistAbort` before it sends events).

Protocol summary:
- A joiner is *pending*; it becomes a *member* only when a round opens (the epoch changes only
  at round boundaries).
- A peer says *ready* for round r with the digest of the committed state it holds. A peer whose
  state is not the last committed one gets a `SyncOrder` instead of a place in the round.
- Round r opens when at least `min_peers` peers are ready and either every live member is ready
  or the ready deadline (`ready_timeout`, started by the first ready) has passed. Stragglers are
  left out and keep their lease.
- The round commits when every participant voted ok with the same result and state digests.
  Any failed vote, a digest disagreement or the collective deadline aborts the attempt; the
  blamed peers are excluded and the survivors retry (same inputs) after a backoff, up to
  `max_attempts` attempts.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import Counter
from dataclasses import dataclass, field

log = logging.getLogger("shoal.coordinator")


@dataclass(frozen=True)
class EngineConfig:
    """Timing and quorum settings (seconds). See docs/fault-tolerance.md for how they relate.

    lease_seconds: a peer that has not heartbeated for this long is dropped.
    ready_timeout: after the first ready of a round, wait at most this long for the other
        members (the straggler timeout) before opening the round with those ready.
    collective_timeout: hard deadline of one collective attempt, from plan to the last vote.
    chunk_timeout: floor of the per-chunk deadline; the plan's deadline is
        max(chunk_timeout, chunk_safety * chunk_bytes / slowest measured link + 2 * max RTT).
    max_attempts: attempts of one round (first try + retries) before it is given up.
    retry_backoff: delay before retry k is planned is retry_backoff * 2**(k-1).
    total_rounds: stop (Finished) after this many committed rounds; 0 = run forever.
    """

    min_peers: int = 2
    initial_peers: int = 0  # round 0 waits for this many ready peers (0 = min_peers)
    lease_seconds: float = 10.0
    ready_timeout: float = 5.0
    collective_timeout: float = 30.0
    chunk_timeout: float = 2.0
    chunk_safety: float = 4.0
    max_attempts: int = 5
    retry_backoff: float = 0.05
    total_rounds: int = 0
    chunk_bytes: int = 1 << 20  # largest chunk through sockets; see plan_layout
    # Chunk size when every participant reaches every other through shared memory (peer.shm):
    # no socket to keep busy, and every chunk costs CPU on both sides.
    shm_chunk_bytes: int = 4 << 20
    algorithm: str = "auto"  # "auto" (planner), "ring" or "butterfly"; see plan_layout
    link_cap_bytes_per_s: float = 100e6  # measured rates above this count as this (plan_layout)
    plan_min_gain: float = 0.25  # uneven shards only when predicted this much faster (plan_layout)
    aggregator: str = "mean"
    audit_owners: bool = False  # a second owner recomputes every shard's aggregate (butterfly)
    compression: str = "none"


@dataclass
class Member:
    peer_id: str
    public_key: bytes
    address: str
    num_samples: int
    lease_expiry: float
    state: str = "pending"  # "pending" | "syncing" | "member"
    up_bytes_per_s: float = 0.0
    down_bytes_per_s: float = 0.0
    rtt_seconds: float = 0.0
    connected: bool = True  # holds an open WatchRounds stream (a broken stream = gone at once)
    lagging: bool = False  # missed a ready deadline: not waited on until it says ready again
    catching_up: bool = False  # a syncing peer that has shown it is alive: waited on
    shm_peers: frozenset[str] = frozenset()  # reached through shared memory (LinkReport.shm_peers)


@dataclass(frozen=True)
class ReadyInfo:
    num_elements: int
    dtype: int
    num_samples: int
    state_digest: bytes
    state_round: int
    at: float


@dataclass(frozen=True)
class PlanSpec:
    """A round attempt's plan, before it is rendered to the wire (shoal.v1.Plan)."""

    round: int
    attempt: int
    epoch: int
    participants: tuple[str, ...]  # collective order
    algorithm: str
    shard_bounds: tuple[int, ...]
    shard_owner: tuple[int, ...]
    num_elements: int
    dtype: int
    deadline_seconds: float
    chunk_timeout_seconds: float
    chunk_bytes: int
    aggregator: str
    compression: str
    predicted_seconds: float = 0.0
    bound_seconds: float = 0.0  # lower bound for these links (0 when links are unknown)
    demoted: tuple[str, ...] = ()  # participants that own no shard (too slow to own one)
    audit_owners: bool = False


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


# ---------------------------------------------------------------- actions


@dataclass(frozen=True)
class SendPlan:
    plan: PlanSpec


@dataclass(frozen=True)
class SendCommit:
    record: CommitRecord
    epoch: int


@dataclass(frozen=True)
class SendAbort:
    record: AbortRecord
    to: tuple[str, ...]


@dataclass(frozen=True)
class SendSync:
    peer_id: str
    round: int
    state_digest: bytes
    donors: tuple[str, ...]


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


class RoundError(Exception):
    """A request that the engine refuses; `kind` picks the gRPC status (see coordinator.server)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind  # "not_found" | "invalid" | "precondition"


@dataclass
class _Running:
    plan: PlanSpec
    started: float
    votes: dict[str, tuple[bool, bytes, bytes, float, tuple[str, ...], tuple[str, ...], str]] = field(default_factory=dict)


def chunk_deadline(members: list[Member], config: EngineConfig, chunk_bytes: int) -> float:
    """Per-chunk deadline (seconds) from the slowest measured link of the participants.

    A chunk of `chunk_bytes` (the plan's) must arrive within chunk_safety times its transfer time
    at the slowest measured rate, plus two round trips; never less than the `chunk_timeout` floor
    (also the value when no link has been measured yet).
    """
    rates = [r for m in members for r in (m.up_bytes_per_s, m.down_bytes_per_s) if r > 0]
    rtt = max((m.rtt_seconds for m in members), default=0.0)
    if not rates:
        return config.chunk_timeout
    return max(config.chunk_timeout, config.chunk_safety * chunk_bytes / min(rates) + 2 * rtt)


# Bytes per element of each shoal.v1.DType code (FLOAT32, FLOAT16, BFLOAT16, INT8, FLOAT64, UINT8).
_ITEMSIZE = {1: 4, 2: 2, 3: 2, 4: 1, 5: 8, 6: 1}
# What the data plane (peer.collectives) implements; the planner's tree is not among them yet.
DATA_PLANE_ALGORITHMS = ("butterfly", "ring")


@dataclass(frozen=True)
class Layout:
    """How one collective is laid out: participant order, algorithm, shards and their owners
    (positions in `participants`), and the planner's prediction (0 when links are unknown)."""

    participants: tuple[str, ...]
    algorithm: str
    shard_bounds: tuple[int, ...]
    shard_owner: tuple[int, ...]
    predicted_seconds: float = 0.0
    bound_seconds: float = 0.0
    demoted: tuple[str, ...] = ()
    chunk_bytes: int = 0  # 0 = the configured size


# A chunk should cross the slowest link in about this long: the pipeline fills and drains one
# chunk per hop, so big chunks on a slow link leave the other links idle at the start and end.
CHUNK_SECONDS = 0.15
MIN_CHUNK_BYTES = 64 * 1024


def plan_layout(algorithm: str, members: list[Member], num_elements: int, itemsize: int = 4, *,
                owner_reduces: bool = False, link_cap: float = 100e6, min_gain: float = 0.25,
                noise: float = 1.5) -> Layout:
    """Lay out a collective over `members` (in the engine's participant order). Pure.

    With no measured link among them (up and down both > 0), the layout is the static one: the
    given order, equal shards ``n·i//p``, participant i owns shard i, and "auto" means butterfly.
    Otherwise the links go to `coordinator.planner.plan_collective` (a member without a
    measurement is assumed to have the median of the measured ones): "ring"/"butterfly" keep the
    algorithm and plan its order and shard sizes; "auto" takes the butterfly with LP shards when
    it is predicted `min_gain` faster than the ring ordered for the bottleneck, else that ring
    (or, when every link is at `link_cap`, the butterfly with equal shards); peers below the
    floor are demoted to non-owners.

    Measurements are noisy (probes of peers probing each other at the same time share links),
    so three guards keep noise from skewing the shards: rates above `link_cap` bytes/s (faster
    than the data plane itself moves bytes, e.g. loopback or a fast LAN) count as `link_cap`;
    rates within a factor `noise` of the median rate count as the median; and uneven butterfly shards are used only when the model predicts
    them at least `min_gain` (a fraction) faster than equal shards on the same links.

    `owner_reduces` (an aggregator other than the plain mean runs at the shard
    owners) forces the butterfly, the only algorithm with owner-side reduction. Never raises
    for bad measurements: it falls back to the static layout.
    """
    from shoal.coordinator.planner import LinkSpec, allreduce_lower_bound, plan_collective, predict_butterfly

    if owner_reduces:  # robust aggregators need every contribution at a shard owner
        algorithm = "butterfly"
    ids = tuple(m.peer_id for m in members)
    p = len(ids)
    static = Layout(ids, "butterfly" if algorithm == "auto" else algorithm,
                    tuple(num_elements * i // p for i in range(p + 1)), tuple(range(p)))
    known = [m for m in members if m.up_bytes_per_s > 0 and m.down_bytes_per_s > 0]
    measured = {m.peer_id for m in known}
    if p < 2 or not known:
        return static
    med_up = sorted(m.up_bytes_per_s for m in known)[len(known) // 2]
    med_down = sorted(m.down_bytes_per_s for m in known)[len(known) // 2]
    rtts = sorted(m.rtt_seconds for m in known if m.rtt_seconds > 0)
    med_rtt = rtts[len(rtts) // 2] if rtts else 0.0
    def denoise(rate: float, median: float) -> float:
        rate = min(link_cap, rate)
        return min(link_cap, median) if median / noise <= rate <= median * noise else rate

    links = [
        LinkSpec(m.peer_id, denoise(m.up_bytes_per_s if m.peer_id in measured else med_up, med_up),
                 denoise(m.down_bytes_per_s if m.peer_id in measured else med_down, med_down),
                 m.rtt_seconds if m.rtt_seconds > 0 else med_rtt)
        for m in members
    ]
    n_bytes = float(num_elements) * itemsize
    try:
        if algorithm in ("ring", "butterfly"):
            plan = plan_collective(links, num_elements, itemsize, algorithm=algorithm)
        else:
            plan = plan_collective(links, num_elements, itemsize, algorithm="butterfly")
        if plan.algorithm == "butterfly":
            equal = predict_butterfly([l.up_bytes_per_s for l in links], [l.down_bytes_per_s for l in links], n_bytes,
                                      None, [l.rtt_seconds for l in links])
            if plan.shard_bounds != static.shard_bounds and plan.predicted_seconds > (1 - min_gain) * equal:
                plan = None  # not worth uneven shards: equal ones
        if algorithm == "auto" and not owner_reduces:
            # On (nearly) even links the ring moves the same bytes with one flow per direction
            # per peer, which shaped links carry better than the butterfly's p-1 concurrent flows
            # (measured in docs/performance.md). Where every link is at the cap, the data plane's
            # CPU is the limit and the butterfly's parallel streams win.
            all_fast = all(l.up_bytes_per_s >= link_cap and l.down_bytes_per_s >= link_cap for l in links)
            ring = plan_collective(links, num_elements, itemsize, algorithm="ring")
            best = plan.predicted_seconds if plan is not None else equal
            if not all_fast and ring.predicted_seconds * (1 - min_gain) <= best:
                plan = ring
        if plan is None:
            bound = allreduce_lower_bound([l.up_bytes_per_s for l in links], [l.down_bytes_per_s for l in links],
                                          n_bytes)
            return dataclasses.replace(static, algorithm="butterfly", predicted_seconds=equal, bound_seconds=bound)
    except (ValueError, RuntimeError):
        return static
    slowest = min(min(l.up_bytes_per_s, l.down_bytes_per_s) for l in links)
    return Layout(
        participants=tuple(ids[i] for i in plan.order),
        algorithm=plan.algorithm,
        shard_bounds=plan.shard_bounds,
        shard_owner=plan.owner_positions(),
        predicted_seconds=plan.predicted_seconds,
        bound_seconds=plan.bound_seconds,
        demoted=tuple(ids[i] for i in plan.demoted),
        chunk_bytes=max(MIN_CHUNK_BYTES, int(slowest * CHUNK_SECONDS)),
    )


def _without_untrusted_owners(layout: Layout, untrusted: set[str]) -> Layout | None:
    """Give the shards of untrusted owners to the trusted owner after them (cyclically; to the
    trusted non-owners when no owner is trusted). None when no participant is trusted."""
    trusted = [i for i, p in enumerate(layout.participants) if p not in untrusted]
    owners = sorted({o for o in layout.shard_owner if o in trusted}) or trusted
    if not owners:
        return None
    moved = tuple(o if o in owners else next((q for q in owners if q > o), owners[0]) for o in layout.shard_owner)
    demoted = tuple(p for i, p in enumerate(layout.participants) if i not in set(moved))
    return dataclasses.replace(layout, shard_owner=moved, demoted=demoted)


class RoundEngine:
    """The coordinator's state and the protocol's rules; see the module docstring.

    `committed_rounds` is the number of committed rounds, i.e. the index of the round being
    played. `last_state_digest` is the digest every up-to-date peer's state has.
    """

    def __init__(self, config: EngineConfig, *, committed: list[CommitRecord] | None = None,
                 members: list[Member] | None = None, epoch: int = 0, aborted: int = 0, now: float = 0.0,
                 attempt_base: int = 0, untrusted: tuple[str, ...] = ()):
        self.config = config
        self.members: dict[str, Member] = {}
        for m in members or []:
            # A restarted coordinator gives every known member a fresh lease to reconnect.
            self.members[m.peer_id] = dataclasses.replace(m, lease_expiry=now + config.lease_seconds,
                                                          connected=False)
        self.epoch = epoch
        self.commits: list[CommitRecord] = list(committed or [])
        self.aborts: list[AbortRecord] = []
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
        self.untrusted: set[str] = set(untrusted)  # never shard owners again (failed owner audits, see vote)
        self._no_trusted_logged = False
        self.running: _Running | None = None
        self.not_before = 0.0
        self.finished = False
        self._donor_rotation = 0

    # ------------------------------------------------------------ queries

    @property
    def committed_rounds(self) -> int:
        return len(self.commits)

    @property
    def last_state_digest(self) -> bytes:
        return self.commits[-1].state_digest if self.commits else b""

    def holds_ready(self, peer_id: str) -> bool:
        """Whether this peer's Ready for the current round is recorded, or it plays the running attempt."""
        return peer_id in self.ready or (self.running is not None and peer_id in self.running.plan.participants)

    def live(self, now: float) -> list[Member]:
        return [m for m in self.members.values() if m.lease_expiry > now]

    def donors(self, now: float, exclude: str = "") -> tuple[str, ...]:
        """Live, connected peers that took part in the last commit (they hold the committed state),
        rotated by one position per call so that simultaneous joiners start at different donors."""
        if not self.commits:
            return ()
        last = set(self.commits[-1].participants)
        alive = sorted(p for p in last if p != exclude and p in self.members and self.members[p].lease_expiry > now
                       and self.members[p].connected)
        if not alive:
            return ()
        k = self._donor_rotation % len(alive)
        self._donor_rotation += 1
        return tuple(alive[k:] + alive[:k])

    # ------------------------------------------------------------ membership

    def join(self, peer_id: str, public_key: bytes, address: str, num_samples: int, now: float,
             up: float = 0.0, down: float = 0.0) -> list[Action]:
        """Admit (or re-admit, same identity) a peer with a fresh lease; pending until a boundary."""
        old = self.members.get(peer_id)
        state = "syncing" if self.commits else "pending"
        if old is not None and old.state == "member" and old.address == address:
            state = "member"
        m = Member(peer_id, public_key, address, num_samples, now + self.config.lease_seconds, state, up, down,
                   connected=old.connected if old is not None else False)
        self.members[peer_id] = m
        # A restarted peer's previous stream/participation is void.
        self.ready.pop(peer_id, None)
        actions: list[Action] = [PersistMember(m)]
        if self.running is not None and peer_id in self.running.plan.participants and old is not None and old.address != address:
            actions += self._abort(now, f"participant {peer_id[:8]} restarted", (peer_id,))
        return actions

    def heartbeat(self, peer_id: str, now: float) -> Member:
        m = self.members.get(peer_id)
        if m is None or m.lease_expiry <= now:
            self.members.pop(peer_id, None)
            raise RoundError("not_found", f"peer_id: no live lease for {peer_id[:8]}; join again")
        m.lease_expiry = now + self.config.lease_seconds
        return m

    def leave(self, peer_id: str, now: float) -> list[Action]:
        if peer_id not in self.members:
            return []
        self.members[peer_id].lease_expiry = now
        return self._expire(now)

    def report_links(self, peer_id: str, up: float, down: float, rtt: float,
                     shm_peers: tuple[str, ...] | None = None) -> None:
        """Record a peer's measured links (bytes/s, seconds) and, when given, the peers it reaches
        through shared memory."""
        m = self.members.get(peer_id)
        if m is None:
            raise RoundError("not_found", f"peer_id: unknown peer {peer_id[:8]}")
        m.up_bytes_per_s, m.down_bytes_per_s, m.rtt_seconds = up, down, rtt
        if shm_peers is not None:
            m.shm_peers = frozenset(shm_peers)

    def connected(self, peer_id: str, now: float) -> list[Action]:
        """The peer opened its round-event stream."""
        m = self.members.get(peer_id)
        if m is not None:
            m.connected = True
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
        if self.running is not None and peer_id in self.running.plan.participants and peer_id not in self.running.votes:
            return self._abort(now, f"participant {peer_id[:8]} disconnected", (peer_id,))
        return self._maybe_open(now)

    # ------------------------------------------------------------ rounds

    def ready_(self, peer_id: str, round_: int, info: ReadyInfo, now: float) -> list[Action]:
        """Record that `peer_id` is ready for `round_` holding the state `info.state_digest`.

        Returns a SendSync when the peer's state is not the last committed one (it must
        download it first). Raises RoundError("not_found") without a lease, ("invalid") when the
        tensor size disagrees with the round's.
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
            raise RoundError("not_found", f"peer_id: no live lease for {peer_id[:8]}; join again")
        m.lease_expiry = now + self.config.lease_seconds
        m.num_samples = info.num_samples
        up_to_date = info.state_round == self.committed_rounds and (
            not self.commits or info.state_digest == self.last_state_digest
        )
        if not up_to_date:
            donors = self.donors(now, exclude=peer_id)
            if not donors:
                raise RoundError("precondition", "state_round: no up-to-date donor is live; retry later")
            m.state = "syncing"
            m.catching_up = True
            m.lagging = False
            return [SendSync(peer_id, self.committed_rounds, self.last_state_digest, donors)]
        if round_ != self.committed_rounds:
            raise RoundError("invalid", f"round: expected {self.committed_rounds}, got {round_}")
        others = [r for p, r in self.ready.items() if p != peer_id]
        if others and (others[0].num_elements != info.num_elements or others[0].dtype != info.dtype):
            raise RoundError(
                "invalid",
                f"num_elements: {info.num_elements} (dtype {info.dtype}) disagrees with the round's "
                f"{others[0].num_elements} (dtype {others[0].dtype})",
            )
        m.lagging = False
        if m.state != "member":
            m.catching_up = True
        self.ready[peer_id] = info
        if self.first_ready_at is None:
            self.first_ready_at = now
        return self._maybe_open(now)

    def vote(self, peer_id: str, round_: int, attempt: int, ok: bool, result_digest: bytes,
             state_digest: bytes, now: float, *, loss: float = 0.0, suspects: tuple[str, ...] = (),
             flagged: tuple[str, ...] = (), error: str = "", audit: bool = False) -> list[Action]:
        """Record a participant's vote; commit when all agree, abort on any failure.

        A failed owner audit (`audit`) also costs the accused owner and the accusing auditor
        their shard ownership for the rest of the run (`untrusted`): a lying owner is caught once,
        not every round, and a false accuser pays as much as its victim.
        """
        run = self.running
        if run is None or run.plan.round != round_ or run.plan.attempt != attempt:
            return []  # a late vote for an attempt already decided
        if peer_id not in run.plan.participants:
            raise RoundError("precondition", f"peer_id: {peer_id[:8]} is not a participant of round {round_}.{attempt}")
        run.votes[peer_id] = (ok, result_digest, state_digest, loss, suspects, flagged, error)
        if not ok:
            blamed = tuple(s for s in suspects if s in run.plan.participants) or (peer_id,)
            persist: list[Action] = []
            accused = self._audited_owner(run.plan, peer_id, suspects) if audit else None
            if accused is not None:
                blamed = (accused, peer_id)
                self.untrusted.update(blamed)
                persist.append(PersistUntrusted(tuple(sorted(self.untrusted))))
            return persist + self._abort(now, f"{peer_id[:8]} failed: {error or 'collective error'}", blamed)
        if len(run.votes) < len(run.plan.participants):
            return []
        digests = Counter((v[1], v[2]) for v in run.votes.values())
        if len(digests) > 1:
            majority, _ = digests.most_common(1)[0]
            dissent = tuple(p for p, v in run.votes.items() if (v[1], v[2]) != majority)
            return self._abort(now, "digest mismatch", dissent)
        return self._commit(now)

    @staticmethod
    def _audited_owner(plan: "PlanSpec", voter: str, suspects: tuple[str, ...]) -> str | None:
        """The owner a failed audit vote accuses, if the claim fits the plan: an audited plan, one
        accused peer besides the voter, and the voter audits a shard that peer owns. Otherwise
        None: the vote counts as an ordinary failure (no peer loses ownership on a peer's say-so
        beyond what the plan lets that peer check)."""
        from shoal.common.plan import auditor_positions

        if not plan.audit_owners or voter not in plan.participants:
            return None
        accused = [s for s in dict.fromkeys(suspects) if s != voter]
        if len(accused) != 1 or accused[0] not in plan.participants:
            return None
        me, owner = plan.participants.index(voter), plan.participants.index(accused[0])
        audits = auditor_positions(plan.shard_owner)
        if any(o == owner and a == me for o, a in zip(plan.shard_owner, audits)):
            return accused[0]
        return None

    def tick(self, now: float) -> list[Action]:
        """Apply deadlines: lease expiry, the ready deadline, the collective deadline, retries."""
        actions = self._expire(now)
        run = self.running
        if run is not None and now - run.started > run.plan.deadline_seconds:
            silent = tuple(p for p in run.plan.participants if p not in run.votes)
            actions += self._abort(now, "collective deadline passed", silent)
        actions += self._maybe_open(now)
        return actions

    # ------------------------------------------------------------ internals

    def _expire(self, now: float) -> list[Action]:
        gone = [p for p, m in self.members.items() if m.lease_expiry <= now]
        actions: list[Action] = []
        for p in gone:
            del self.members[p]
            self.ready.pop(p, None)
            actions.append(ForgetMember(p))
        if gone and self.running is not None:
            hit = tuple(p for p in gone if p in self.running.plan.participants)
            if hit:
                actions += self._abort(now, "lease expired", hit)
        return actions

    def _maybe_open(self, now: float) -> list[Action]:
        if self.running is not None or self.finished or now < self.not_before:
            return []
        if self.config.total_rounds and self.committed_rounds >= self.config.total_rounds:
            self.finished = True
            return [SendFinished(self.committed_rounds, "run complete")]
        live = {m.peer_id for m in self.live(now)}
        candidates = sorted(p for p in self.ready if p in live and p not in self.excluded)
        quorum = max(1, self.config.min_peers)
        if not self.commits and self.tries == 0:
            quorum = max(quorum, self.config.initial_peers)
        if len(candidates) < quorum:
            return []
        # Every live peer is waited on (syncing joiners included, or a fast swarm would outrun a
        # joiner forever); the ready timeout bounds the wait for a straggler.
        waiting_on = {p for p in live if p not in self.excluded and self._waited_on(self.members[p])} - set(candidates)
        deadline_passed = self.first_ready_at is not None and now - self.first_ready_at >= self.config.ready_timeout
        if waiting_on and not deadline_passed and self.tries == 0:
            return []
        if deadline_passed and self.tries == 0:
            for p in waiting_on:  # stragglers: left out, and not waited on until they say ready again
                self.members[p].lagging = True
        return self._open(now, tuple(candidates))

    def _waited_on(self, m: Member) -> bool:
        """Whether a round waits (up to the ready timeout) for this live peer to say ready.

        Connected members are; a syncing peer is once it has shown it is alive (it said ready),
        so a joiner is never outrun by a fast swarm; a straggler that missed a deadline is not,
        until it says ready again, so it delays at most one round.
        """
        if not m.connected or m.lagging:
            return False
        return m.state != "syncing" or m.catching_up

    def _open(self, now: float, participants: tuple[str, ...]) -> list[Action]:
        actions: list[Action] = []
        # Round boundary: apply membership changes.
        changed = False
        for p in participants:
            m = self.members[p]
            m.catching_up = m.lagging = False
            if m.state != "member":
                m.state = "member"
                changed = True
                actions.append(PersistMember(m))
        if changed:
            self.epoch += 1
            actions.append(PersistEpoch(self.epoch))
        info = self.ready[participants[0]]
        n = info.num_elements
        members = [self.members[p] for p in participants]
        layout = plan_layout(self.config.algorithm, members, n,
                             _ITEMSIZE.get(info.dtype, 4),
                             owner_reduces=self.config.aggregator not in ("mean", "fedavg") or self.config.audit_owners,
                             link_cap=self.config.link_cap_bytes_per_s, min_gain=self.config.plan_min_gain)
        audit = self.config.audit_owners and layout.algorithm == "butterfly"
        if layout.algorithm == "butterfly" and self.untrusted & set(participants):
            stripped = _without_untrusted_owners(layout, self.untrusted)
            if stripped is None:
                # Every candidate lost ownership in an owner audit (e.g. two peers, one of them
                # lying: nobody can tell which). No round until a trusted peer is among them.
                if not self._no_trusted_logged:
                    log.warning("no trusted shard owner among %s: waiting for another peer",
                                [p[:8] for p in participants])
                    self._no_trusted_logged = True
                self.not_before = now + self.config.ready_timeout
                return actions
            layout = stripped
        self._no_trusted_logged = False
        if audit and len(set(layout.shard_owner)) < 2:
            audit = False  # one owner has nobody to audit it
            log.warning("round %d is not audited: fewer than two shard owners", self.committed_rounds)
        if len(members) > 1 and all(q.peer_id in m.shm_peers for m in members for q in members if q is not m):
            chunk = self.config.shm_chunk_bytes  # one host: every pair on the shared-memory lane
        else:
            chunk = min(self.config.chunk_bytes, layout.chunk_bytes or self.config.chunk_bytes)
        plan = PlanSpec(
            round=self.committed_rounds,
            attempt=self.attempt,
            epoch=self.epoch,
            participants=layout.participants,
            # Robust aggregators need every contribution at a shard owner: plan_layout keeps those
            # on the butterfly (owner_reduces).
            algorithm=layout.algorithm,
            shard_bounds=layout.shard_bounds,
            shard_owner=layout.shard_owner,
            num_elements=n,
            dtype=info.dtype,
            deadline_seconds=self.config.collective_timeout,
            chunk_timeout_seconds=chunk_deadline(members, self.config, chunk),
            chunk_bytes=chunk,
            aggregator=self.config.aggregator,
            audit_owners=audit,
            compression=self.config.compression,
            predicted_seconds=layout.predicted_seconds,
            bound_seconds=layout.bound_seconds,
            demoted=layout.demoted,
        )
        self.running = _Running(plan, now)
        actions.append(SendPlan(plan))
        return actions

    def _commit(self, now: float) -> list[Action]:
        run = self.running
        assert run is not None
        votes = run.votes
        any_vote = next(iter(votes.values()))
        # A peer may report a non-finite loss (diverged, or lying): it never reaches the record.
        losses = [v[3] for v in votes.values() if math.isfinite(v[3])]
        flagged = tuple(sorted({f for v in votes.values() for f in v[5]}))
        rec = CommitRecord(
            round=run.plan.round,
            attempt=run.plan.attempt,
            result_digest=any_vote[1],
            state_digest=any_vote[2],
            participants=run.plan.participants,
            train_loss=float(sum(losses) / len(losses)) if losses else 0.0,
            seconds=now - run.started,
            flagged=flagged,
            at=now,
        )
        self.commits.append(rec)
        self._reset_round()
        return [SendCommit(rec, self.epoch)]

    def _abort(self, now: float, reason: str, excluded: tuple[str, ...]) -> list[Action]:
        run = self.running
        if run is None:
            return []
        self.excluded.update(excluded)
        self.running = None
        self.rounds_aborted += 1
        survivors = [p for p in run.plan.participants if p not in self.excluded and p in self.ready]
        will_retry = self.tries + 1 < self.config.max_attempts and len(survivors) >= self.config.min_peers
        rec = AbortRecord(run.plan.round, run.plan.attempt, reason, tuple(sorted(excluded)), will_retry, now)
        self.aborts.append(rec)
        to = tuple(sorted(set(run.plan.participants) | set(self.ready)))
        self.attempt += 1
        if will_retry:
            self.tries += 1
            self.rounds_retried += 1
            self.not_before = now + self.config.retry_backoff * 2 ** (self.tries - 1)
        else:
            # Give the round up: everyone (the excluded included) starts it over by saying ready.
            self._reset_round(next_attempt=self.attempt)
            self.not_before = now + self.config.retry_backoff
        return [SendAbort(rec, to)]

    def _reset_round(self, next_attempt: int | None = None) -> None:
        self.running = None
        self.ready = {}
        self.first_ready_at = None
        self.attempt = self.attempt_base if next_attempt is None else next_attempt
        self.tries = 0
        self.excluded = set()
