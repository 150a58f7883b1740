"""The peer's side of the round protocol: one object, one method per phase.

`RoundClient.play(update)` plays one round for this peer and returns a typed `RoundOutcome`
(COMMITTED, SYNCED or FINISHED). The phases, each a method (the wire events: docs/protocol.md,
"Round events"):

1. `announce`: say Ready for the round, holding the committed state's digest. A sync order in
   the reply (this peer is stale) is handled like one from the event stream.
2. `next_event`: wait for the coordinator's next round event (typed: `PlanReceived`,
   `Committed`, `Aborted`, `SyncOrdered`, `RunFinished`, plus `Reconnected` / `Forgotten` from
   the watch and heartbeat, `Silence` when nothing came for `round_silence` seconds).
3. `run_collective`: all-reduce this peer's contribution (a `Contribution` policy decides what
   is sent and what a shard owner computes) and build the tentative state. Never raises: any
   failure (a `CollectiveError` naming suspects, or any other exception, e.g. an aggregator
   refusing its input) becomes a "failed" ballot carrying the reason.
4. `vote`: deliver the ballot (success + digests, or failure + reason + suspects).
5. `commit` / `abort`: apply the tentative state of the committed attempt (and its compression
   residuals; with sparse compression, commit its SparseLoCo accumulator proposal), or drop
   the aborted attempt's (the accumulator is untouched: the retry proposes from the same e).
6. `sync`: adopt the committed state named by a sync order, from a matching tentative copy or
   downloaded from donors and verified (peer.state_sync).

Who does what: the collective of an attempt runs as a task of the round's TaskGroup (an abort
cancels it at once; a crash inside it surfaces at once instead of being lost), and all
per-round state (the attempt in flight, tentative results per attempt with their compression
residuals) is one `RoundState`. This module does not own the lifecycle (server, join, lease,
the event watch): `peer.agent.PeerAgent` does, and feeds `events`. What happened is reported to
`RoundListener`s (events file, metrics, the benchmark job's report).

Failure semantics of `play`: the workload's committed state changes only on a commit of this
peer's tentative state (digest checked against the coordinator's) or a verified sync; an abort
leaves it untouched (the collective never mutates the input). Control-plane calls are retried
by the one policy of shoal.common.retry (peer.control); when one gives up, `play` raises it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np

from shoal.common.attempts import shown_attempt
from shoal.common.errors import InvalidArgument
from shoal.common.pauses import RunClock
from shoal.common.plan import Plan, is_sparse_collective
from shoal.common.tensors import dtype_code
from shoal.common.throttle import Throttle, more
from shoal.peer.testing import faults
from shoal.peer.collectives import CollectiveError, OwnerReducer, SparseRound, all_reduce
from shoal.peer.compression import ErrorFeedback
from shoal.peer.contribution import Contribution
from shoal.peer.control import CoordinatorClient
from shoal.peer.dataplane import Inbox, Session, Transport
from shoal.peer.links import LinkMeter
from shoal.peer.result_digest import off_loop
from shoal.peer.secure_round import SecureAggregation, SecureCost
from shoal.peer.sparse import ErrorAccumulator, SparseSettings
from shoal.peer.state_sync import Download, SyncError, SyncResult, download_state
from shoal.peer.workloads.base import State, Workload
from shoal.v1 import shoal_pb2 as pb

log = logging.getLogger("shoal.peer.rounds")

SYNC_LOG_SECONDS = 10.0  # at most one "state sync failed" line per this many seconds (the rest at debug)
NOTICE_SECONDS = 5.0  # the most a training notice after a state sync may take (it is best effort)
# A download at least this far along is finished even when a newer order comes (the donors keep
# it for this peer while its permit lasts): a second, later order then catches up from it.
RESUME_OLDER_FRACTION = 0.5


def _share(plan: Plan, me: str) -> float:
    """`me`'s weight in the plan's weighted mean: n_me / sum n (counts of 0 as 1, as the
    contribution weights them)."""
    counts = [n or 1 for n in plan.num_samples] or [1] * plan.size
    try:
        return counts[plan.position(me)] / float(sum(counts))
    except (ValueError, IndexError):
        return 0.0


# ------------------------------------------------------------------------------ outcomes


class Outcome(enum.Enum):
    COMMITTED = "committed"  # this peer's tentative state was committed and applied
    SYNCED = "synced"  # the committed state was adopted from donors (or a matching tentative copy)
    FINISHED = "finished"  # the coordinator finished the run


@dataclass(frozen=True)
class RoundOutcome:
    """How one `play` ended. round: the round played (the committed round count at its start);
    rounds: committed rounds held afterwards. COMMITTED only: attempt, participants (count),
    flagged (peers whose contribution owners rejected), state_digest, loss, epsilon (DP spent so
    far, the coordinator's accountant; 0 without DP). seconds: from the first Ready to the outcome."""

    kind: Outcome
    round: int
    rounds: int
    seconds: float
    attempt: int = -1
    participants: int = 0
    flagged: tuple[str, ...] = ()
    state_digest: bytes = b""
    loss: float = 0.0
    epsilon: float = 0.0


# ------------------------------------------------------------------------------ events


@dataclass(frozen=True)
class PlanReceived:
    msg: pb.Plan  # the wire plan (its ticket and digest authorise the data-plane session)
    plan: Plan


@dataclass(frozen=True)
class Committed:
    round: int
    attempt: int
    state_digest: bytes
    participants: tuple[str, ...]
    flagged: tuple[str, ...]
    step_seconds: float = 0.0  # the swarm's pace (pb.Commit.step_seconds)
    epsilon: float = 0.0  # DP: epsilon spent by the committed rounds (pb.Commit.epsilon; 0 without DP)
    checkpointers: tuple[str, ...] = ()  # elected to upload a due checkpoint (pb.Commit.checkpointers)


@dataclass(frozen=True)
class Aborted:
    round: int
    attempt: int
    reason: str
    excluded: tuple[str, ...]
    will_retry: bool


@dataclass(frozen=True)
class SyncOrdered:
    order: pb.SyncOrder


@dataclass(frozen=True)
class RunFinished:
    rounds_committed: int


@dataclass(frozen=True)
class Reconnected:
    """The watch stream was re-established (the coordinator may have restarted)."""


@dataclass(frozen=True)
class Forgotten:
    """Two heartbeats in a row say the coordinator holds no Ready of this waiting peer (or has
    committed past its round): the Ready or the events that answer it were lost."""


@dataclass(frozen=True)
class Silence:
    """No round event for `seconds` while waiting."""

    seconds: float


RoundEvent = PlanReceived | Committed | Aborted | SyncOrdered | RunFinished | Reconnected | Forgotten | Silence


def event_of(msg: pb.RoundEvent) -> RoundEvent | None:
    """The typed form of a wire event (None for an empty one)."""
    kind = msg.WhichOneof("event")
    if kind == "plan":
        return PlanReceived(msg.plan, Plan.from_proto(msg.plan))
    if kind == "commit":
        c = msg.commit
        return Committed(c.round, c.attempt, c.state_digest, tuple(c.participants), tuple(c.flagged),
                         c.step_seconds, c.epsilon, tuple(c.checkpointers))
    if kind == "abort":
        a = msg.abort
        return Aborted(a.round, a.attempt, a.reason, tuple(a.excluded), a.will_retry)
    if kind == "sync":
        return SyncOrdered(msg.sync)
    if kind == "finished":
        return RunFinished(msg.finished.rounds_committed)
    return None


def _key(ev: RoundEvent) -> tuple[int, int]:
    """(round, attempt) of a round-scoped event (commits of round r order after its attempts)."""
    if isinstance(ev, PlanReceived):
        return ev.plan.round, ev.plan.attempt
    if isinstance(ev, Aborted):
        return ev.round, ev.attempt
    if isinstance(ev, Committed):
        return ev.round, 1 << 30
    return -1, -1


def supersedes(new: RoundEvent, old: RoundEvent) -> bool:
    """Whether `new` makes the queued `old` useless to a peer that has not read it yet.

    The newest commit replaces older commits and the plans and aborts of older rounds; a sync
    order replaces older sync orders; a plan or an abort replaces plans and aborts of earlier
    attempts (or rounds); the end of the run replaces every plan, abort and commit; markers
    (reconnected, forgotten, silence) are kept once. Events of the same attempt are kept (a plan
    and its abort are both read, in order).
    """
    if type(new) is type(old) and isinstance(new, (Reconnected, Forgotten, Silence, RunFinished)):
        return True
    if isinstance(new, SyncOrdered):
        return isinstance(old, SyncOrdered) and old.order.round <= new.order.round
    if isinstance(new, RunFinished):
        return isinstance(old, (PlanReceived, Aborted, Committed))
    if isinstance(new, Committed):
        return (isinstance(old, Committed) and old.round <= new.round) or (
            isinstance(old, (PlanReceived, Aborted)) and _key(old)[0] < new.round)
    if isinstance(new, (PlanReceived, Aborted)):
        return isinstance(old, (PlanReceived, Aborted)) and _key(old) < _key(new)
    return False


class EventMailbox:
    """The round events a peer has not read yet, coalesced: the newest state of the world, not
    a backlog (a peer busy in a long local update for N rounds comes back to one commit, one sync
    order and the plans that still matter, not to N of each). Bounded: at most one event of each
    kind per attempt (`supersedes`), whatever the number of rounds missed.

    The agent's watch and heartbeat `put` events; the RoundClient `get`s them in arrival order.
    `delivered_at` is the arrival time (monotonic) of the event `get` returned last.
    """

    def __init__(self) -> None:
        self._items: list[tuple[float, RoundEvent]] = []
        self._arrived = asyncio.Event()
        self.delivered_at = 0.0

    def put_nowait(self, ev: RoundEvent) -> None:
        self._items = [(t, old) for t, old in self._items if not supersedes(ev, old)]
        self._items.append((time.monotonic(), ev))
        self._arrived.set()

    async def put(self, ev: RoundEvent) -> None:
        self.put_nowait(ev)

    async def get(self) -> RoundEvent:
        while not self._items:
            self._arrived.clear()
            await self._arrived.wait()
        self.delivered_at, ev = self._items.pop(0)
        return ev

    def qsize(self) -> int:
        return len(self._items)


# ------------------------------------------------------------------------------ records for listeners


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective attempt that produced a result. bytes_received: data-plane bytes received
    meanwhile; cpu_seconds: this process's CPU time (all threads); lanes: data lanes used so far;
    started_at / ended_at: wall-clock time (time.time(), comparable between processes of one
    host) this peer entered the collective (its plan in hand) and held the result and its digest.
    bytes_sent / bytes_received are the data plane's; a secure attempt's shares and reveals (sent
    through the coordinator) are in `secure`."""

    plan: Plan
    seconds: float
    bytes_sent: int
    bytes_received: int
    cpu_seconds: float
    flagged: tuple[str, ...]
    lanes: tuple[str, ...]
    started_at: float = 0.0
    ended_at: float = 0.0
    secure: SecureCost | None = None  # a secure attempt: its control-plane bytes, seconds and reveals


@dataclass(frozen=True)
class VoteRecord:
    """A ballot and its delivery. reason/suspects: why it failed (ok False); failed_at: wall time
    (time.time) the failure was caught; voted_at: wall time the delivery ended."""

    round: int
    attempt: int
    ok: bool
    reason: str
    suspects: tuple[str, ...]
    delivered: bool
    failed_at: float
    voted_at: float


@dataclass(frozen=True)
class SyncRecord:
    rounds: int
    bytes: int
    seconds: float
    donors: tuple[str, ...]
    donors_failed: tuple[str, ...]


class RoundListener:
    """Told what happened (no-op defaults; called in the event loop, must not block)."""

    def on_plan(self, plan: Plan) -> None: ...

    def on_collective(self, rec: CollectiveRecord) -> None: ...

    def on_vote(self, rec: VoteRecord) -> None: ...

    def on_outcome(self, outcome: RoundOutcome) -> None: ...

    def on_abort(self, ev: Aborted) -> None: ...

    def on_sync(self, rec: SyncRecord) -> None: ...

    def on_sync_failed(self, order: pb.SyncOrder, exc: SyncError) -> None: ...


@dataclass
class Traffic:
    """Data-plane bytes of this peer (collectives and state downloads) and completed syncs."""

    bytes_sent: int = 0
    bytes_received: int = 0
    state_syncs: int = 0


# ------------------------------------------------------------------------------ per-round state


@dataclass(frozen=True)
class Tentative:
    """The state an attempt would commit, and its compression residual updates (kept on commit)."""

    state: State
    feedback: tuple
    sparse_attempt: object = None  # the accumulator proposal to commit (sparse collectives), or None
    fragment: int = 0  # the fragment the attempt carried (0 without fragments): whose residuals


@dataclass
class RoundState:
    """Everything one round in play holds. update: this peer's `(n,)` update (contribution input);
    attempt: the attempt whose collective runs (or ran last); collective: its task; voting:
    its ballot is in flight (delivered or not, it is never cancelled: the coordinator may hold it).
    num_samples / local_steps / local_seconds: what the Ready says of the local phase behind
    `update` (its weight, inner steps and wall seconds; 0 = the workload's num_samples / not said)."""

    round: int
    update: np.ndarray
    loss: float
    started: float
    tasks: asyncio.TaskGroup
    attempt: int = -1
    collective: asyncio.Task | None = None
    voting: bool = False
    tentative: dict[int, Tentative] = field(default_factory=dict)
    num_samples: int = 0
    local_steps: int = 0
    local_seconds: float = 0.0

    @property
    def collective_running(self) -> bool:
        return self.collective is not None and not self.collective.done()


@dataclass(frozen=True)
class SyncSettings:
    """donors: donors used in parallel; range_bytes: bytes per request."""

    donors: int = 3
    range_bytes: int = 256 << 10


class _FaultyReducer:
    """The shard-owner reduction behind the "reduce" fault point (SHOAL_FAULT=reduce:raise@R):
    raises `faults.InjectedFault` in round R, as a failing aggregator would."""

    def __init__(self, inner: OwnerReducer, round_: int):
        self.inner, self.round = inner, round_
        self.needs_distances = inner.needs_distances

    def partial_distances(self, rows: np.ndarray, lo: int, hi: int) -> np.ndarray:
        faults.fail("reduce", self.round)
        return self.inner.partial_distances(rows, lo, hi)

    def reduce(self, rows: np.ndarray, lo: int, hi: int, distances: np.ndarray | None = None):
        faults.fail("reduce", self.round)
        return self.inner.reduce(rows, lo, hi, distances)


def describe(exc: BaseException) -> str:
    """One line naming what failed: the message of a CollectiveError, else "Type: message" of
    the (first three) leaf exceptions (exception groups from TaskGroups are flattened)."""
    if isinstance(exc, CollectiveError):
        return str(exc)
    leaves: list[BaseException] = []
    stack = [exc]
    while stack:
        e = stack.pop(0)
        if isinstance(e, BaseExceptionGroup):
            stack[:0] = list(e.exceptions)
        else:
            leaves.append(e)
    return "; ".join(f"{type(e).__name__}: {e}" for e in leaves[:3])


# ------------------------------------------------------------------------------ the protocol object


class RoundClient:
    """One peer's side of the round protocol (module docstring).

    control: the coordinator client (peer.control); workload: the trained thing (its `state` is
    the committed state); contribution: what is sent and reduced; inbox / transport / links:
    this peer's data plane; events: the queue the agent's watch and heartbeat feed.
    round_silence: seconds without any event after which the peer announces itself again.
    finish_linger: seconds peers keep serving the final state after the run (bounds final_sync).
    tamper: testing only (peer.testing.byzantine "owner"): what a malicious shard owner publishes.
    forge_vote: testing only (peer.testing.byzantine "false-blame", "lying-digest"): forges each ballot in
    place before it is sent.
    secure: secure aggregation (peer.secure_round): the Ready carries the round's public keys and
    the contribution is all-reduced as masked fixed-point rows; None = in the clear.
    clock: this process's `RunClock` (read continually by the agent); a failed attempt during
    which this peer itself did not run for a chunk deadline is voted as its own fault.
    """

    def __init__(self, control: CoordinatorClient, workload: Workload, contribution: Contribution, *,
                 inbox: Inbox, transport: Transport, links: LinkMeter | None, events: EventMailbox | asyncio.Queue,
                 round_silence: float = 15.0, finish_linger: float = 1.0, sync: SyncSettings = SyncSettings(),
                 listeners: Sequence[RoundListener] = (), traffic: Traffic | None = None,
                 tamper: Callable[[np.ndarray], np.ndarray] | None = None, clock: RunClock | None = None,
                 forge_vote: Callable[[pb.VoteRequest, Plan], None] | None = None,
                 sparse: SparseSettings | None = None, secure: SecureAggregation | None = None):
        self.control, self.workload, self.contribution = control, workload, contribution
        self.clock = clock
        self.inbox, self.transport, self.links = inbox, transport, links
        self.events = events
        self.round_silence = round_silence
        self.finish_linger = finish_linger
        self.sync_settings = sync
        self.listeners = list(listeners)
        self.traffic = traffic or Traffic()
        self.tamper = tamper
        self.forge_vote = forge_vote
        # Compression residuals per fragment (0 without fragments), updated only on commit: a
        # fragment's residual is re-sent with that fragment's next round, never another's.
        self.feedbacks: dict[int, ErrorFeedback] = {}
        self.sparse = sparse  # the run's sparse codec and decay (compression topk / dct), or None
        self.secure = secure  # secure aggregation (peer.secure_round), or None
        self.accumulator: ErrorAccumulator | None = None  # SparseLoCo's e, made at the first sparse round
        self.last_plan: Plan | None = None  # the last plan received (link probes, shm peers)
        self.last_announce = 0.0  # monotonic time of the last Ready sent
        self._asked_at = 0.0  # monotonic time the last Ready left (before its reply)
        self._waiting: RoundState | None = None  # the round `play` waits in
        self._suspicious: int | None = None  # the waiting round the previous heartbeat found forgotten
        self._pooled = False  # the coordinator holds this peer's Ready in its cohort pool (last answer)
        self._download: Download | None = None  # the state download in progress (kept across orders)
        self._last_sync_stale = False  # the last sync failed because its order was out of date
        self._syncing = False  # a state download is running (heartbeats then do not re-announce)
        self._sync_lines = Throttle(SYNC_LOG_SECONDS)
        self.sync_rate = 0.0  # bytes/s of the last state download (told to the coordinator: its hold)
        self._state_bytes = 0  # size of the serialized state (`_state_size`)
        # (committed rounds, state digest) of the newest checkpoint this peer wrote or resumed
        # from (peer.checkpoints; (0, b"") = none): each Ready says it, the coordinator records it.
        self.checkpoint: tuple[int, bytes] = (0, b"")
        self.elected = False  # named a checkpointer by the last commit it applied (pb.Commit.checkpointers)

    @property
    def me(self) -> str:
        return self.control.peer_id

    def _tell(self, hook: str, *args) -> None:
        for listener in self.listeners:
            getattr(listener, hook)(*args)

    # -------------------------------------------------------------- the round

    async def play(self, update: np.ndarray, loss: float, *, num_samples: int = 0, local_steps: int = 0,
                   local_seconds: float = 0.0) -> RoundOutcome:
        """Play the current round with `update` `(n,)` until it commits, this peer syncs, or the
        run finishes (see the module docstring for what happens on failure). num_samples: the
        update's weight (0 = the workload's `num_samples`); local_steps / local_seconds: the local
        phase behind it (the coordinator's pace, docs/training.md; 0 = not said)."""
        async with asyncio.TaskGroup() as tg:
            rs = RoundState(self.workload.state.rounds, update, loss, time.monotonic(), tg,
                            num_samples=num_samples, local_steps=local_steps, local_seconds=local_seconds)
            self._waiting = rs
            try:
                await self.announce(rs)
                outcome = None
                while outcome is None:
                    outcome = await self._handle(rs, await self.next_event())
            finally:
                self._waiting = None
                await self._stop_collective(rs)
        return outcome

    async def _handle(self, rs: RoundState, ev: RoundEvent) -> RoundOutcome | None:
        """One event in round `rs`; an outcome ends the round, None keeps waiting."""
        match ev:
            case PlanReceived():
                await self._on_plan(rs, ev)
            case Committed():
                return await self._on_commit(rs, ev)
            case Aborted():
                await self.abort(rs, ev)
            case SyncOrdered(order):
                return await self._on_sync(rs, order)
            case RunFinished(rounds_committed):
                return await self._on_finished(rs, rounds_committed)
            case Reconnected() | Forgotten() if self._answered():
                pass  # a Ready left after this arrived: the coordinator has heard from this peer
            case Reconnected():
                await self._stop_collective(rs)  # the coordinator may have restarted: the attempt is gone
                await self.announce(rs)
            case Forgotten() if not rs.collective_running:
                await self.announce(rs)
            case Silence(seconds) if self._pooled:
                log.debug("no round event for %.0fs; waiting in the cohort pool", seconds)
            case Silence(seconds):
                log.info("no round event for %.0fs; announcing readiness again", seconds)
                await self.announce(rs)
        return None

    def _answered(self) -> bool:
        """Whether a Ready left after the event just read arrived (a backlog read after a long
        local update): that Ready already told the coordinator where this peer stands."""
        return getattr(self.events, "delivered_at", math.inf) < self._asked_at

    # -------------------------------------------------------------- phase 1: announce

    async def announce(self, rs: RoundState, round_: int | None = None) -> None:
        """Say Ready for `round_` (default: the round in play) holding the committed state; a
        sync order in the reply goes on the event queue (the stream may be reconnecting now,
        and is closed once the run finished). Raises the control-plane error when the retry
        policy gives up."""
        req = self._ready_request(rs, rs.round if round_ is None else round_)
        # Stamped before and after the call: a heartbeat sent before the Ready was processed, or
        # answered while it was in flight, must not count as "the coordinator forgot this peer".
        self.last_announce = self._asked_at = time.monotonic()
        resp = await self.control.ready(req)
        self.last_announce = time.monotonic()
        self._pooled = resp.pooled
        if resp.HasField("sync") and resp.sync.donors:
            self.events.put_nowait(SyncOrdered(resp.sync))

    def _ready_request(self, rs: RoundState, round_: int) -> pb.ReadyRequest:
        st = self.workload.state
        req = pb.ReadyRequest(peer_id=self.me, round=round_, num_elements=rs.update.size,
                              dtype=dtype_code(rs.update.dtype), num_samples=rs.num_samples or self.workload.num_samples,
                              state_digest=st.digest(), state_round=st.rounds,
                              state_bytes=self._state_size(st), sync_bytes_per_s=self.sync_rate,
                              local_steps=rs.local_steps, local_seconds=rs.local_seconds,
                              checkpoint_round=self.checkpoint[0], checkpoint_digest=self.checkpoint[1])
        if self.secure is not None:  # the masked rows are uint32; the round's public keys go in the plan
            keys = self.secure.keys_for(round_)
            req.dtype, req.secagg_mask_key, req.secagg_box_key = pb.UINT32, keys.public[:32], keys.public[32:]
            req.secagg_signature = keys.signature
        return req

    def _state_size(self, st: State) -> int:
        """Bytes of the serialized state, measured once (the layout does not change between
        rounds; serializing every committed state just to say its size would cost a copy each)."""
        if not self._state_bytes:
            self._state_bytes = len(st.to_bytes())
        return self._state_bytes

    def heard(self, resp: pb.HeartbeatResponse, sent: float) -> None:
        """A heartbeat answer (sent at monotonic `sent`): the safety net for a lost Ready. A peer
        waiting in a round that the coordinator does not count as ready (or has committed past)
        twice in a row, with no Ready of its own in between, gets a `Forgotten` event and
        announces again (a lost message costs one or two heartbeats, not `round_silence`); one
        whose Ready waits in a cohort pool (`resp.pooled`) neither, nor after `round_silence`."""
        rs = self._waiting
        r = rs.round if rs is not None else None
        if self.last_announce < sent:
            self._pooled = resp.pooled
        # Waiting in the cohort pool (resp.pooled), a peer's Ready is held whatever `round` says.
        # Downloading the state (`_syncing`), it is not ready by design: the coordinator ordered it.
        forgotten = (r is not None and self.last_announce < sent and not resp.pooled and not self._syncing
                     and (resp.round > r or not resp.ready))
        if forgotten and self._suspicious == r:
            log.info("the coordinator holds no Ready of this peer for round %d (it is at %d); announcing again",
                     r, resp.round)
            self.events.put_nowait(Forgotten())
            self._suspicious = None
        else:
            self._suspicious = r if forgotten else None

    # -------------------------------------------------------------- phase 2: await the plan

    async def next_event(self) -> RoundEvent:
        """The next round event; `Silence` when none came within `round_silence` seconds."""
        try:
            return await asyncio.wait_for(self.events.get(), timeout=self.round_silence)
        except TimeoutError:
            return Silence(self.round_silence)

    async def _on_plan(self, rs: RoundState, ev: PlanReceived) -> None:
        if ev.plan.round != rs.round:
            return
        await self._stop_collective(rs)
        rs.attempt = ev.plan.attempt
        self.last_plan = ev.plan
        self._tell("on_plan", ev.plan)
        rs.collective = rs.tasks.create_task(self._attempt(rs, ev))

    async def _attempt(self, rs: RoundState, ev: PlanReceived) -> None:
        """Phases 3 and 4 of one attempt (a task of the round's TaskGroup)."""
        if self.me not in ev.plan.participants:
            return
        ballot, failed_at = await self.run_collective(rs, ev)
        if self.forge_vote is not None:
            self.forge_vote(ballot, ev.plan)
        rs.voting = True
        try:
            await self.vote(ballot, failed_at)
        finally:
            rs.voting = False

    async def _stop_collective(self, rs: RoundState) -> None:
        """Cancel the running attempt. One whose ballot is in flight is awaited instead: the
        coordinator may already hold that ballot (an abort it caused can arrive before the Vote
        call returns), and the vote RPC is bounded by VOTE_SECONDS."""
        task = rs.collective
        if task is not None and not task.done():
            if rs.voting:
                await task
                return
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # -------------------------------------------------------------- phase 3: the collective

    async def run_collective(self, rs: RoundState, ev: PlanReceived) -> tuple[pb.VoteRequest, float]:
        """All-reduce this peer's contribution in `ev`'s attempt; returns the ballot and, for a
        failed one, the wall time of the failure (else 0).

        Never raises an Exception: a CollectiveError becomes a failed ballot naming its suspects;
        anything else (an aggregator raising at this shard owner, a bug) a failed ballot naming
        the exception and no suspect (this peer failed). On success the tentative state and its
        compression residuals are kept in `rs` for the commit; the committed state is untouched.
        """
        plan = ev.plan
        self.inbox.start(Session.from_plan(ev.msg, self.control.coordinator_public_key))
        received, cpu0 = self.traffic.bytes_received, time.process_time()
        paused0 = self._paused()
        try:
            self._check_fragment(plan)
            update, sparse_attempt = self._error_fed(rs.update, plan)
            prepared = self.contribution.prepare(update, plan, self.me)
            reducer = prepared.reducer
            if reducer is not None and faults.armed("reduce"):
                reducer = _FaultyReducer(reducer, plan.round)
            started_at = time.time()
            res = await self._reduce(prepared, reducer, plan)
            ended_at = time.time()
            self.contribution.check(res.values)
            st = self.workload.tentative(res.values, res.digest, share=_share(plan, self.me))
            rs.tentative[plan.attempt] = Tentative(st, res.feedback, sparse_attempt, plan.fragment)
        except Exception as exc:  # noqa: BLE001 - every failure before the vote is voted, with its reason
            ballot = self._failed_ballot(rs, plan, exc)
            stalled = self._paused() - paused0
            if stalled >= plan.chunk_timeout_seconds:
                # This process did not run (SIGSTOP, a suspended VM, a long GC pause): whatever it
                # saw break afterwards, the others' deadlines expired waiting for it.
                log.warning("round %d.%d: this peer did not run for %.1f s during the attempt; voting it "
                            "its own fault", plan.round, shown_attempt(plan.attempt), stalled)
                del ballot.suspects[:]
                ballot.error = f"this peer did not run for {stalled:.1f} s ({ballot.error})"[:500]
            return ballot, time.time()
        finally:
            self.inbox.finish(plan.round, plan.attempt)
        self.traffic.bytes_sent += res.bytes_sent
        cpu = time.process_time() - cpu0
        # The state's digest (a whole pass over the state, 15 ms for 64 MB) off the event loop: a
        # peer done early keeps acknowledging the chunks the others still stream to it, instead
        # of holding their collectives up for the length of the hash.
        state_digest = await off_loop(st.digest)
        lanes = tuple(sorted(set(self.transport.lanes().values())))
        self._tell("on_collective", CollectiveRecord(plan, res.seconds, res.bytes_sent,
                                                     self.traffic.bytes_received - received,
                                                     cpu, res.flagged, lanes,
                                                     started_at, ended_at,
                                                     self.secure.cost if self.secure is not None else None))
        return pb.VoteRequest(peer_id=self.me, round=plan.round, attempt=plan.attempt, train_loss=rs.loss, ok=True,
                              result_digest=res.digest, state_digest=state_digest, bytes_sent=res.bytes_sent,
                              collective_seconds=res.seconds, flagged=res.flagged), 0.0

    async def _reduce(self, prepared, reducer, plan: Plan):
        """All-reduce the prepared contribution: as it is, or, in a secure run, as masked fixed-point
        rows summed mod 2^32 and unmasked (peer.secure_round; the owners can only sum then)."""
        if self.secure is None:
            return await all_reduce(prepared.values, plan, me=self.me, transport=self.transport, inbox=self.inbox,
                                    reducer=reducer, feedback=self._feedback(plan), links=self.links, tamper=self.tamper,
                                    sparse=self._sparse_round(plan, prepared))
        if reducer is not None or prepared.weights is not None or is_sparse_collective(plan):
            raise CollectiveError("secure aggregation: shard owners only sum masked rows (no aggregator, audit, "
                                  "norm bound or sparse payload)", [])
        values = np.ascontiguousarray(prepared.values, dtype=np.float32)
        return await self.secure.all_reduce(values, plan, lambda masked: all_reduce(
            masked, plan, me=self.me, transport=self.transport, inbox=self.inbox, links=self.links, tamper=self.tamper))

    def _check_fragment(self, plan: Plan) -> None:
        """Refuse a plan whose fragment is not the one this peer's run carries in that round
        (Streaming DiLoCo: round r carries fragment r mod F; peer.fragments)."""
        frags = max(1, int(getattr(getattr(self.workload, "cfg", None), "fragments", 1)))
        if plan.fragments != frags or plan.fragment != plan.round % frags:
            raise InvalidArgument(f"fragment: the plan carries fragment {plan.fragment} of {plan.fragments}, this "
                                  f"run's round {plan.round} carries {plan.round % frags} of {frags}")
    def _accumulator_for(self, n: int) -> ErrorAccumulator:
        """This peer's accumulator for an `(n,)` pseudo-gradient (made at the first round, e = 0)."""
        assert self.sparse is not None
        if self.accumulator is None or self.accumulator.accumulator.size != n:
            self.accumulator = self.sparse.accumulator(n)
        return self.accumulator

    def _error_fed(self, update: np.ndarray, plan: Plan) -> tuple[np.ndarray, object]:
        """What goes into this attempt, and the accumulator proposal its commit commits (None
        without sparse compression). A sparse collective ("allgather", "sparse_rs") encodes C(β·e + Δ) itself
        (`_sparse_round`); a dense plan in a sparse run (the planner found the dense all-reduce
        faster) sends the whole β·e + Δ, and its commit sets e to 0."""
        if self.sparse is None:
            return update, None
        key = (plan.round, plan.attempt)
        if is_sparse_collective(plan):
            return update, key
        try:
            acc = self._accumulator_for(update.size)
            return acc.propose_dense(np.ascontiguousarray(update, dtype=np.float32), attempt=key), key
        except InvalidArgument as exc:
            raise CollectiveError(f"this peer's contribution: {exc}", []) from None

    def _sparse_round(self, plan: Plan, prepared) -> SparseRound | None:
        """This peer's part of a sparse collective ("allgather", "sparse_rs"): its accumulator and the contributions'
        weights; None for dense collectives. Raises CollectiveError when the run has no sparse
        codec (the plan and the run disagree)."""
        if not is_sparse_collective(plan):
            return None
        if self.sparse is None:
            raise CollectiveError(f"plan: compression {plan.compression} needs the run's sparse codec, "
                                  "which this peer's run configuration does not name", [])
        return SparseRound(self._accumulator_for(prepared.values.size), prepared.weights)

    def _paused(self) -> float:
        """Seconds this process did not run so far (0 without a clock)."""
        if self.clock is None:
            return 0.0
        self.clock()  # a gap since the last reading counts now
        return self.clock.paused_seconds

    def _failed_ballot(self, rs: RoundState, plan: Plan, exc: Exception) -> pb.VoteRequest:
        reason = describe(exc)
        if isinstance(exc, CollectiveError):
            log.warning("round %d.%d collective failed: %s", plan.round, shown_attempt(plan.attempt), reason)
            suspects, audit, relay = exc.suspects, exc.audit, exc.relay
        elif isinstance(exc, InvalidArgument):  # this peer's own input refused (e.g. non-finite values): no bug
            log.warning("round %d.%d: this peer's contribution was refused: %s; voting failed", plan.round,
                        shown_attempt(plan.attempt), reason)
            suspects, audit, relay = (), False, ""
        else:
            log.error("round %d.%d: the collective raised %s; voting failed", plan.round,
                      shown_attempt(plan.attempt), reason, exc_info=exc)
            suspects, audit, relay = (), False, ""
        return pb.VoteRequest(peer_id=self.me, round=plan.round, attempt=plan.attempt, train_loss=rs.loss, ok=False,
                              error=reason[:500], suspects=suspects, audit_failure=audit, relay_failure=relay)

    # -------------------------------------------------------------- phase 4: vote

    async def vote(self, ballot: pb.VoteRequest, failed_at: float = 0.0) -> bool:
        """Deliver `ballot`; True when the coordinator took it. An undelivered ballot is logged;
        the coordinator then decides the attempt at its deadline."""
        delivered = await self.control.vote(ballot)
        self._tell("on_vote", VoteRecord(ballot.round, ballot.attempt, ballot.ok, ballot.error,
                                         tuple(ballot.suspects), delivered, failed_at, time.time()))
        return delivered

    # -------------------------------------------------------------- phase 5: commit or abort

    async def _on_commit(self, rs: RoundState, ev: Committed) -> RoundOutcome | None:
        if ev.round > rs.round:
            # A later round committed: this peer missed the commit of its own round (or was left
            # out since). It is behind; the coordinator answers the Ready with a sync order. A
            # Ready sent after this commit arrived (e.g. when the peer came back from a long local
            # update) already asked: one question, not one per missed round.
            await self._stop_collective(rs)
            if self._answered():
                return None
            log.info("round %d committed while this peer waits in round %d; asking for state sync", ev.round, rs.round)
            await self.announce(rs)
            return None
        if ev.round < rs.round:
            return None
        if rs.collective_running and ev.attempt == rs.attempt:
            await rs.collective  # this peer's vote is in (the round committed): let the attempt finish
        outcome = self.commit(rs, ev)
        if outcome is not None:
            return outcome
        # Committed without this peer (excluded, late, or a digest disagreement): its state is
        # stale. Announce it at once; the coordinator answers with a sync order.
        await self._stop_collective(rs)
        log.info("round %d committed without this peer; asking for state sync", rs.round)
        await self.announce(rs, rs.round + 1)
        return None

    def commit(self, rs: RoundState, ev: Committed) -> RoundOutcome | None:
        """Apply the tentative state of the committed attempt if this peer holds it (same
        digest); None when it does not (it must sync). Tentative states of the round are dropped."""
        t = rs.tentative.get(ev.attempt)
        rs.tentative.clear()
        if self.me not in ev.participants or t is None or t.state.digest() != ev.state_digest:
            return None
        self.elected = self.me in ev.checkpointers  # uploads this round's checkpoint when one is due
        self.workload.pace(ev.step_seconds)  # before apply: a time-budgeted phase starts with it
        self.workload.apply(t.state)
        feedback = self.feedback_for(t.fragment)
        feedback.reset()  # keep exactly the residuals of the committed attempt (of its fragment)
        for key, compensated, decoded in t.feedback:
            feedback.update(key, compensated, decoded)
        if t.sparse_attempt is not None and self.accumulator is not None:
            self.accumulator.commit(t.sparse_attempt)  # e <- β·e + Δ - decode(sent), once per committed round
        outcome = RoundOutcome(Outcome.COMMITTED, rs.round, t.state.rounds, time.monotonic() - rs.started,
                               ev.attempt, len(ev.participants), ev.flagged, ev.state_digest, rs.loss,
                               ev.epsilon)
        self._tell("on_outcome", outcome)
        return outcome

    async def abort(self, rs: RoundState, ev: Aborted) -> None:
        """Drop the aborted attempt (cancel its collective if it still runs); announce again when
        this peer is left out of the retry or there is none."""
        if ev.round != rs.round:
            return
        if ev.attempt == rs.attempt:
            await self._stop_collective(rs)
        rs.tentative.pop(ev.attempt, None)
        self._tell("on_abort", ev)
        if self.me in ev.excluded or not ev.will_retry:
            await self.announce(rs)

    # -------------------------------------------------------------- phase 6: state sync

    async def _on_sync(self, rs: RoundState, order: pb.SyncOrder) -> RoundOutcome | None:
        if self.already_holds(order):
            return None  # a duplicate or late order: nothing to do, a running collective goes on
        await self._stop_collective(rs)
        synced = await self.try_sync(order, rs)
        if synced is None:
            if not self._last_sync_stale:  # a stale order: ask at once; a failure: after a pause
                await asyncio.sleep(random.uniform(0.05, 0.2))
            await self.announce(rs, rs.round + 1)  # asks for another order
            return None
        if not synced:
            return None
        if self.workload.state.rounds == order.round:
            await self.say_training(rs)
        return RoundOutcome(Outcome.SYNCED, rs.round, self.workload.state.rounds, time.monotonic() - rs.started)

    async def say_training(self, rs: RoundState) -> None:
        """Tell the coordinator that this peer holds the committed state it just downloaded and
        now runs its local update (ReadyRequest.training): the next round waits for it. Best
        effort and bounded (NOTICE_SECONDS): without it, the round only waits a ready timeout."""
        req = self._ready_request(rs, self.workload.state.rounds)
        req.training = True
        try:
            await asyncio.wait_for(self.control.ready(req), NOTICE_SECONDS)
        except (TimeoutError, grpc.aio.AioRpcError) as exc:
            log.debug("training notice not delivered: %s", exc)

    def already_holds(self, order: pb.SyncOrder) -> bool:
        """True when `order` names the state this peer holds or an older one (nothing to do)."""
        st = self.workload.state
        return order.round < st.rounds or (order.round == st.rounds and order.state_digest == st.digest())

    async def try_sync(self, order: pb.SyncOrder, rs: RoundState | None = None) -> bool | None:
        """`sync`, with a failed download reported to the listeners: None when it failed. One
        line per failure at most every SYNC_LOG_SECONDS (the others at debug, counted)."""
        try:
            return await self.sync(order, rs)
        except SyncError as exc:
            self._last_sync_stale = exc.stale
            held = self._sync_lines.due()
            what = ("the order is out of date (its donors moved past round %d)" % order.round if exc.stale
                    else str(exc))
            log.log(logging.DEBUG if held is None else logging.WARNING, "state sync failed: %s; asking for another "
                    "order%s", what, more(held or 0))
            self._tell("on_sync_failed", order, exc)
            return None

    def _download_for(self, order: pb.SyncOrder) -> Download:
        """The download that `order` continues: the one kept for the same digest; or an older one
        this peer has mostly fetched (it finishes it, then catches up with a second order rather
        than chase the head from byte 0); else a new one."""
        dl, held = self._download, self.workload.state.rounds
        if dl is not None and (dl.digest == order.state_digest or (
                held < dl.round < order.round and dl.fraction() >= RESUME_OLDER_FRACTION)):
            return dl
        self._download = Download(order.round, order.state_digest, self.sync_settings.range_bytes)
        return self._download

    async def _fetch_state(self, order: pb.SyncOrder) -> tuple[SyncResult, Download]:
        """Download the state `order` (or the older download it continues) names; an older one
        whose donors no longer hold it is dropped and the order's own state fetched."""
        dl = self._download_for(order)
        try:
            return await download_state(order, me=self.me, transport=self.transport, k=self.sync_settings.donors,
                                        range_bytes=self.sync_settings.range_bytes, partial=dl), dl
        except SyncError as exc:
            if dl.digest == order.state_digest or not exc.stale:
                raise
            log.info("the donors no longer hold round %d (%.0f%% fetched); fetching round %d", dl.round,
                     100 * dl.fraction(), order.round)
            self._download = None
            return await self._fetch_state(order)

    async def sync(self, order: pb.SyncOrder, rs: RoundState | None = None) -> bool:
        """Adopt the committed state named by `order`: from a matching tentative state of `rs`,
        or downloaded from its donors and verified; or an older committed state this peer had
        mostly downloaded before (`_download_for`: it then announces it and gets a second
        order). False (nothing done) for an order naming the state this peer holds or an older
        one: a peer never moves back. Raises SyncError when no verified copy could be assembled
        (the committed state is untouched; the bytes received are kept for the next order)."""
        if self.already_holds(order):
            log.debug("sync order for round %d ignored: this peer holds round %d", order.round,
                      self.workload.state.rounds)
            return False
        for t in (rs.tentative.values() if rs is not None else ()):
            if t.state.rounds == order.round and t.state.digest() == order.state_digest:
                self.workload.apply(t.state)
                self._reset_accumulator()
                rs.tentative.clear()
                log.info("state for round %d adopted from the local tentative copy", order.round)
                return True
        t0 = time.monotonic()
        self._syncing = True
        try:
            res, dl = await self._fetch_state(order)
        finally:
            self._syncing = False
        self._download = None
        self.sync_rate = dl.rate() or self.sync_rate
        try:
            st = self.workload.state_from_bytes(res.blob)
        except InvalidArgument as exc:  # bytes that hash to the committed digest but are no state
            raise SyncError(f"the assembled state does not parse ({exc})", res.donors_used) from None
        self.workload.apply(st)
        self._reset_accumulator()
        if rs is not None:
            rs.tentative.clear()
        self.traffic.state_syncs += 1
        self.traffic.bytes_received += len(res.blob) - res.resumed_bytes
        behind = f"; round {order.round} is committed, catching up" if st.rounds < order.round else ""
        log.info("state synced: round %d, %d bytes (%d resumed) from %d donors in %.2fs, %.2f MB/s (failed "
                 "donors: %d)%s", st.rounds, len(res.blob), res.resumed_bytes, len(res.donors_used), res.seconds,
                 self.sync_rate / 1e6, len(res.donors_failed), behind)
        self._tell("on_sync", SyncRecord(st.rounds, len(res.blob), time.monotonic() - t0, res.donors_used,
                                         res.donors_failed))
        return True

    def feedback_for(self, fragment: int) -> ErrorFeedback:
        """The compression residuals of `fragment` (a plan's `fragment`; 0 without fragments):
        streaming rounds carry different parameters in equal-sized payloads, so each fragment
        keeps its own (Seide et al.'s error feedback re-sends what was lost of the same values)."""
        return self.feedbacks.setdefault(int(fragment), ErrorFeedback())

    def _feedback(self, plan: Plan) -> ErrorFeedback | None:
        """The residuals this attempt compensates with: its fragment's, or None when the run
        turned error feedback off (`RunConfig.error_feedback`)."""
        if not getattr(getattr(self.workload, "cfg", None), "error_feedback", True):
            return None
        return self.feedback_for(plan.fragment)

    def _reset_accumulator(self) -> None:
        """A peer that adopted the committed state from elsewhere starts its error feedback at
        e = 0 (SparseLoCo: the accumulator is the peer's own unsent mass, never a donor's)."""
        if self.accumulator is not None:
            self.accumulator.reset()

    async def _on_finished(self, rs: RoundState, rounds_committed: int) -> RoundOutcome:
        if self.workload.state.rounds < rounds_committed:
            await self._stop_collective(rs)
            await self.final_sync(rs, rounds_committed)
        return RoundOutcome(Outcome.FINISHED, rs.round, self.workload.state.rounds, time.monotonic() - rs.started)

    async def final_sync(self, rs: RoundState, rounds_committed: int) -> None:
        """The run finished while this peer was behind: fetch the final state if a donor still
        serves it (peers linger `finish_linger` seconds after the end), within a bounded time;
        else keep the state it holds (logged)."""
        held = self.workload.state.rounds
        try:
            async with asyncio.timeout(self.finish_linger + 2.0):
                resp = await self.control.ready(self._ready_request(rs, held))
                if resp.HasField("sync") and resp.sync.donors:
                    await self.sync(resp.sync, rs)
                    log.info("run finished at round %d; final state synced", rounds_committed)
        except (TimeoutError, SyncError, grpc.aio.AioRpcError) as exc:
            log.warning("run finished at round %d; this peer stays at round %d (%s)", rounds_committed, held,
                        type(exc).__name__)
