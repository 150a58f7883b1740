"""The coordinator's gRPC service: translates between shoal.v1.Coordinator and `RoundEngine`.

Thin by design: every decision is made by the pure `coordinator.rounds.RoundEngine`; this module
validates requests, carries out the engine's actions (durable writes first, then events to the
peers' WatchRounds streams) and runs one ticker task that applies deadlines. The daemon around it
(opening the state, binding, serving, shutting down) is `coordinator.daemon`.

Time: the engine runs on `shoal.common.pauses.RunClock`, the coordinator's own time (a stall of
the coordinator is left out of every lease and deadline); after a detected pause the ticker
gives every member a grace period (`RoundEngine.resumed`). Round tickets and sync permits carry
wall time, which the peers check.

Reachability: Join dials the peer's advertised data address back (`shoal.common.reach`, nonce
challenge, `reach_timeout`; a dial-back that timed out is made once more) before the engine
admits it; a peer that does not answer (or that joins with `outbound_only`, which is not
dialled) takes part outbound-only (owns no shard, is no donor; docs/nat.md); an unreachable one
is told why in its JoinResponse.

Durability: a commit is written to the store (SQLite WAL, synchronous=FULL) before any peer is
told about it, so a committed round is never lost by a coordinator crash.

Security (docs/security.md): TLS or explicit plaintext (`shoal.common.security.Security`); before any
handler, undecodable requests get INVALID_ARGUMENT, callers are rate limited per host (joins
more strictly) and every call but GetStatus must carry a valid request signature
(`shoal.common.security.SignedCalls`); Join then applies admission (join token and/or allow-list) once per
key: the admitted key is a membership that joins again without a token (`coordinator.admitted_keys`),
one process per identity. Every other call of a peer is refused once its membership is revoked or
another process of its key took over (`MemberCalls`). Every plan carries a round ticket signed with
the coordinator's Ed25519 key, every sync order a permit. The operator's calls (ListMembers,
RevokeMember) must be signed with that same key.
Operations: the service records shoal.metrics.CoordinatorMetrics; the daemon serves them on
`metrics_port` when it is set (0 = off) and carries gRPC health checking (grpc.health.v1;
NOT_SERVING from the moment shutdown starts).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator

import grpc

from shoal.common.attempts import shown_attempt
from shoal.common.errors import (Aborted, FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, ShoalError,
                                 grpc_errors, require)
from shoal.common.identity import MD_INSTANCE, MD_PUBKEY, peer_id_of, public_bytes
from shoal.common.limits import (CONTROL_MAX_RECEIVE_BYTES, LINK_BYTES_PER_S_BOUNDS, LINK_RTT_MAX_SECONDS, RateLimiter,
                                 host_of)
from shoal.common.metrics import CoordinatorMetrics
from shoal.common.plan import Plan
from shoal.common.reach import Reachability
from shoal.common.throttle import Throttle, more
from shoal.common.tickets import SYNC_ATTEMPT, issue_ticket, plan_digest
from shoal.coordinator.admission import Admission
from shoal.coordinator.ca import CertificateAuthority, Issued
from shoal.coordinator.etcd_store import NotLeader
from shoal.coordinator.admitted_keys import Membership, Memberships
from shoal.coordinator.rounds import (AbortRecord, Action, CommitRecord, ErrorKind, ForgetMember, PersistEpoch,
                                      PersistDurable, PersistMember, PersistUntrusted, ReadyInfo, Rewind, RoundEngine, RoundError, SendAbort,
                                      SendCommit, SendFinished, SendPlan, SendSync, WaitReason)
from shoal.relay.protocol import issue_relay_ticket
from shoal.coordinator.store import DURABLE_META, REWINDS_META, Store, durable_json, recorded_rewinds
from shoal.coordinator.secagg_relay import SecAggRelay
from shoal.v1 import shoal_pb2 as pb
from shoal.v1 import shoal_pb2_grpc as pb_grpc

REDIAL_SECONDS = 10.0  # a member suspected by failed votes is dialled back at most this often
# A relay ticket's life (a member joins again for a fresh one; a revoked member's lasts at most this).
RELAY_TICKET_SECONDS = 3600.0
log = logging.getLogger("shoal.coordinator")

MAX_MESSAGE_BYTES = CONTROL_MAX_RECEIVE_BYTES
TICK_SECONDS = 0.05
SERVICE_PREFIX = "/shoal.v1.Coordinator/"
JOIN = SERVICE_PREFIX + "Join"
GET_STATUS = SERVICE_PREFIX + "GetStatus"
HEARTBEAT = SERVICE_PREFIX + "Heartbeat"
# Unsigned: the operator view (read-only; protect it with mTLS or a firewall).
UNSIGNED_METHODS = frozenset({GET_STATUS})
# A member's calls after its Join: refused once it is revoked or fenced (MemberCalls).
MEMBER_METHODS = frozenset(SERVICE_PREFIX + m for m in
                           ("Heartbeat", "Leave", "Ready", "WatchRounds", "Vote", "ReportLinks",
                            "PostSecAgg", "FetchSecAgg"))
MEMBER_RETENTION_SECONDS = 7 * 86400.0
# A ticket outlives its plan's deadline by this much (clock skew between peers, seconds).
TICKET_SLACK_SECONDS = 60.0
METRICS_EVERY_SECONDS = 1.0
RUN_OVER_POLL_SECONDS = 0.2
# A coordinator Probe moves at most this much each way (a joiner's first estimate; below the
# control plane's 1 MiB message limit).
PROBE_MAX_BYTES = 512 << 10
# Dial-backs of joiners per caller host: a burst (a swarm's peers on one machine start together),
# then a steady rate; past it a Join is refused with RESOURCE_EXHAUSTED (peers retry it).
DIAL_BACK_BURST = 32
DIAL_BACKS_PER_S = 2.0
RESOLVE_SECONDS = 2.0  # resolving an advertised host name, before a dial-back
COMMIT_LOG_SECONDS = 1.0  # at most one INFO "round N committed" line per second (the rest at debug)
# An event with nothing set: what a round-event stream sends when it opens and after each burst of
# events. gRPC's asyncio server keeps the last message a stream's handler yielded (its
# `async for response_message in ...` loop) until the next one, and so did the handler's own
# variable: a commit event, one object shared by the round's cohort (~1-2 KB of protobuf in C,
# unseen by tracemalloc), lived as long as any of its participants had no newer event, i.e. until
# the last of them was drawn again (hundreds of rounds with N/K in the tens): the resident size
# grew with the rounds until that many commits were held (docs/performance.md, "Coordinator
# scale"). Ending every burst with this one (0 bytes on the wire) lets each event
# go once sent. Receivers skip it (peer.rounds.event_of).
EMPTY_EVENT = pb.RoundEvent()
# Messages a round-event stream sends when it opens (empty events, or a running round's plan
# first): gRPC's per-stream setup for a stream's first two messages is then paid at connect,
# once per member, and not at each member's first cohort draw, which at 1,000-3,000 members
# spreads over the first ~N/K ln N rounds and made the resident size grow with them.
OPENING_EVENTS = 2
# The one place where the engine's refusals become gRPC status codes.
_ERROR_KINDS = {ErrorKind.NOT_FOUND: NotFound, ErrorKind.INVALID: InvalidArgument,
                ErrorKind.PRECONDITION: FailedPrecondition}


# The actions that write to the store.
_WRITES = (PersistMember, ForgetMember, PersistEpoch, PersistUntrusted, SendCommit, SendAbort, Rewind, PersistDurable)



def advertised_address(data_address: str, context) -> str:
    """`data_address` with a wildcard host (a peer listening on 0.0.0.0 or [::] that advertised no
    address) replaced by the host its Join came from (`context.peer()`), so `--listen 0.0.0.0:PORT`
    works without `--advertise` wherever the coordinator sees the peer's own address (no NAT)."""
    host, _, port = data_address.rpartition(":")
    if host.strip("[]") not in ("0.0.0.0", "::") or context is None:
        return data_address
    grpc_peer = context.peer() or ""
    seen = host_of(grpc_peer)
    if not seen or seen == grpc_peer:  # not an IP peer (e.g. a unix socket): leave it as it was
        return data_address
    return f"[{seen}]:{port}" if ":" in seen else f"{seen}:{port}"


def _give(resp: pb.JoinResponse | pb.RenewCertificateResponse, issued: Issued | None) -> None:
    """Put an issued data-plane certificate (if any) into a Join or RenewCertificate answer."""
    if issued is not None:
        resp.tls_certificate, resp.tls_ca, resp.tls_not_after = issued.certificate, issued.ca, issued.not_after


class StoreFailed(ShoalError):
    """A write of the state store failed: this leader's term ends; callers retry (UNAVAILABLE)."""

    code = grpc.StatusCode.UNAVAILABLE


def _raise(exc: RoundError) -> ShoalError:
    return _ERROR_KINDS[exc.kind](str(exc))


class CoordinatorService(pb_grpc.CoordinatorServicer):
    """shoal.v1.Coordinator over a `RoundEngine` and a `Store`."""

    def __init__(self, engine: RoundEngine, store: Store, run_config_json: str, signing_key, *, clock=time.time,
                 admission: Admission | None = None, metrics: CoordinatorMetrics | None = None, wall=None,
                 reach: Callable[[str, bytes], Awaitable[Reachability]] | None = None,
                 ca: CertificateAuthority | None = None, memberships: Memberships | None = None):
        """clock: the engine's time (a `RunClock` when served; tests pass a fake). wall: the time
        stamped on tickets and permits (default `clock`). reach: the dial-back of a joiner's
        (address, public key); None: addresses are not checked. ca: issues data-plane
        certificates (None: this coordinator issues none). memberships: the admitted keys."""
        self.engine = engine
        self.wall = wall or clock
        self.reach = reach
        self.ca = ca
        self.admission = admission or Admission(None, None)
        self.memberships = memberships or Memberships(
            [], retention=MEMBER_RETENTION_SECONDS,
            live_seconds=engine.config.lease_seconds / 2 if engine is not None else 5.0)
        self.metrics = metrics or CoordinatorMetrics()
        self.store = store
        self.run_config_json = run_config_json
        self.key = signing_key
        self.clock = clock
        # A str on a queue closes that stream with PERMISSION_DENIED and that message (revoked, fenced).
        self.watchers: dict[str, asyncio.Queue[pb.RoundEvent | str]] = {}
        self.finished_event: pb.RoundEvent | None = None
        self.secagg = SecAggRelay()  # secure aggregation: the running attempt's encrypted shares and reveals
        self.vote_bytes: dict[tuple[int, int], int] = {}  # data-plane bytes voted per attempt (metrics)
        self.commit_lines = Throttle(COMMIT_LOG_SECONDS)  # INFO "round N committed" lines
        self.dial_backs = RateLimiter(DIAL_BACKS_PER_S, DIAL_BACK_BURST)  # per caller host (`_dial_back_of`)
        self.refusal_lines = Throttle(10.0)  # WARNING lines for Joins of peers too old
        self.redialled: dict[str, float] = {}  # suspect -> when it was last dialled back (`_suspected`)
        self.redials: set[asyncio.Task] = set()
        self.finished_at: float | None = None  # when the run finished (clock)
        # Set when a store write failed (etcd unreachable, or fenced): this term ends (serve steps down).
        self.store_lost = asyncio.Event()
        self.store_lost_why = ""
        self.settled_at: float | None = None  # when, after that, no member was left
        self.rounds_lost = sum(int(rw["lost"]) for rw in recorded_rewinds(store)) if store is not None else 0

    # ------------------------------------------------------------ actions

    @contextlib.contextmanager
    def _writing(self, durable: bool = True) -> Iterator[None]:
        """A store batch. When it fails (an etcd store unreachable, or a fenced write refused)
        nothing is written, `store_lost` is set (this leader's term ends: `serve` steps down and
        stands by again) and StoreFailed (UNAVAILABLE to the caller) is raised; so are all later
        writes of this term, whose engine may be ahead of its store."""
        if self.store_lost.is_set():
            raise StoreFailed(self.store_lost_why)
        try:
            with self.store.batch(durable=durable):
                yield
        except (grpc.RpcError, NotLeader) as exc:
            what = exc.code().name if isinstance(exc, grpc.RpcError) else str(exc)
            self.store_lost_why = f"the coordinator's state store failed ({what}); it steps down as leader"
            log.error("%s", self.store_lost_why)
            self.store_lost.set()
            raise StoreFailed(self.store_lost_why) from None

    def _send(self, peer_id: str, event: pb.RoundEvent) -> None:
        q = self.watchers.get(peer_id)
        if q is not None:
            q.put_nowait(event)

    def _ticketed(self, plan: pb.Plan) -> pb.Plan:
        """`plan` with its round ticket: (round, attempt, participants, plan digest) signed."""
        plan.ticket = issue_ticket(self.key, plan.round, plan.attempt, [p.peer_id for p in plan.participants],
                                   plan_digest(plan), plan.deadline_seconds + TICKET_SLACK_SECONDS, now=self.wall())
        return plan

    def _wire_plan(self, plan: Plan) -> pb.Plan:
        """The engine's plan on the wire, with a fresh round ticket."""
        return self._ticketed(plan.to_proto())

    def apply(self, actions: list[Action], *, replying_to: str = "") -> None:
        """Carry out engine actions: persist first (all of them in one transaction), then notify.
        `replying_to`: the peer whose Ready produced them; its sync order goes in the reply, not on
        its event stream. Joins and departures alone are written without an fsync (a peer repeats
        a lost join); anything else (a commit, an abort, a round boundary) durably."""
        writes = [a for a in actions if isinstance(a, _WRITES)]
        if writes:
            lazy = all(isinstance(a, (PersistMember, ForgetMember)) for a in actions)
            with self._writing(durable=not lazy):
                for a in writes:
                    self._persist(a)
        for a in actions:
            self._notify(a, replying_to)

    def _persist(self, a: Action) -> None:
        if isinstance(a, PersistMember):
            self.store.save_member(a.member)
        elif isinstance(a, ForgetMember):
            self.store.forget_member(a.peer_id)
            self.metrics.forget_link(a.peer_id)
            log.info("member %s dropped (lease expired or left)", a.peer_id[:8])
        elif isinstance(a, PersistEpoch):
            self.store.save_epoch(a.epoch)
        elif isinstance(a, PersistUntrusted):
            self.store.set_meta("untrusted", json.dumps(list(a.peers)))
            log.warning("peers that may no longer own shards (failed owner audits): %s",
                        [p[:8] for p in a.peers])
        elif isinstance(a, SendCommit):
            self.store.save_commit(a.record)
        elif isinstance(a, SendAbort):
            self.store.save_abort(a.record)
        elif isinstance(a, PersistDurable):
            self.store.set_meta(DURABLE_META, durable_json(a.durable))
        elif isinstance(a, Rewind):
            # Before the engine's next commit is written: the rounds it plays again are free.
            self.store.rewind(a.rounds)
            done = recorded_rewinds(self.store) + [{"from": a.rounds + a.lost, "to": a.rounds, "lost": a.lost,
                                           "digest": a.state_digest.hex(), "holders": list(a.holders),
                                           "wall": self.wall()}]
            self.store.set_meta(REWINDS_META, json.dumps(done))
            self.rounds_lost += a.lost

    def _notify(self, a: Action, replying_to: str) -> None:
        if isinstance(a, SendPlan):
            plan = self._wire_plan(a.plan)
            # Per attempt: debug (the commit line below says what a person needs, rate-limited).
            log.debug("round %d.%d planned: %d participants, %s, predicted %.3fs (bound %.3fs)%s", plan.round,
                      shown_attempt(plan.attempt), len(plan.participants), plan.collective, a.plan.predicted_seconds,
                      a.plan.bound_seconds,
                      f", non-owners {[d[:8] for d in a.plan.demoted]}" if a.plan.demoted else "")
            ev = pb.RoundEvent(plan=plan)
            for p in a.plan.participants:
                self._send(p, ev)
        elif isinstance(a, SendCommit):
            r = a.record
            self.metrics.on_commit(r.seconds, self.vote_bytes.pop((r.round, r.attempt), 0),
                                   rounds_committed=self.engine.committed_rounds, epsilon=a.epsilon)
            self.vote_bytes = {k: v for k, v in self.vote_bytes.items() if k[0] > r.round}
            held = self.commit_lines.due()
            log.log(logging.DEBUG if held is None else logging.INFO,
                    "round %d committed (attempt %d, %d participants, %.3fs, loss %.4f)%s", r.round,
                    shown_attempt(r.attempt), len(r.participants), r.seconds, r.train_loss, more(held or 0))
            ev = pb.RoundEvent(commit=pb.Commit(
                round=r.round, attempt=r.attempt, result_digest=r.result_digest, state_digest=r.state_digest,
                epoch=a.epoch, participants=r.participants, flagged=r.flagged, step_seconds=a.step_seconds,
                epsilon=a.epsilon, checkpointers=a.checkpointers))
            for p in list(self.watchers) if a.to is None else a.to:
                if p not in a.synced:  # those get their sync order (a following action) instead
                    self._send(p, ev)
        elif isinstance(a, SendAbort):
            r = a.record
            self.metrics.on_abort(r.will_retry)
            log.warning("round %d.%d aborted: %s; excluded %s; retry=%s", r.round, shown_attempt(r.attempt), r.reason,
                        [p[:8] for p in r.excluded], r.will_retry)
            ev = pb.RoundEvent(abort=pb.Abort(round=r.round, attempt=r.attempt, reason=r.reason,
                                              excluded=r.excluded, will_retry=r.will_retry))
            for p in a.to:  # the participants and the ready peers: nobody else waits on it
                self._send(p, ev)
        elif isinstance(a, Rewind):
            self.metrics.on_rewind(a.lost, rounds_committed=self.engine.committed_rounds)
            self.finished_event = None
            self.finished_at = None
        elif isinstance(a, SendSync):
            self.metrics.on_sync()
            if a.peer_id != replying_to:  # a Ready's own order travels in its reply
                self._send(a.peer_id, pb.RoundEvent(sync=self._sync_order(a, to=a.peer_id)))
        elif isinstance(a, SendFinished):
            # The engine answers every late Ready with SendFinished again; say it once.
            if self.finished_event is None:
                log.info("run finished after %d committed rounds", a.rounds_committed)
                self.finished_at = self.clock()
            self.finished_event = pb.RoundEvent(finished=pb.Finished(rounds_committed=a.rounds_committed,
                                                                       reason=a.reason))
            for p in list(self.watchers):
                self._send(p, self.finished_event)

    def _sync_order(self, a: SendSync, *, to: str) -> pb.SyncOrder:
        # The permit is what donors ask for before serving state: proof that `to` is a member.
        # Donors keep the state for `to` until it expires (its length follows `to`'s rate).
        round_, digest, donors = a.round, a.state_digest, a.donors
        permit = issue_ticket(self.key, round_, SYNC_ATTEMPT, [to], digest, a.permit_seconds, now=self.wall())
        return pb.SyncOrder(round=round_, state_digest=digest, permit=permit, donors=[
            pb.Participant(peer_id=d, address=self.engine.members[d].address,
                           public_key=self.engine.members[d].public_key)
            for d in donors if d in self.engine.members
        ])

    def run_over(self, linger: float) -> bool:
        """True once the run finished, every member has been told and left (or its lease expired,
        at the latest one lease after the finish) and `linger` more seconds passed, in which
        `shoal status` still answers."""
        if self.finished_at is None:
            return False
        now = self.clock()
        if self.engine.members and now < self.finished_at + self.engine.config.lease_seconds:
            return False
        if self.settled_at is None:
            self.settled_at = now
            log.info("every member has left; exiting in %gs", linger)
        return now >= self.settled_at + linger

    async def until_run_over(self, linger: float) -> None:
        """Return once `run_over(linger)` (never while the run goes on)."""
        while not self.run_over(linger):
            await asyncio.sleep(RUN_OVER_POLL_SECONDS)

    async def ticker(self) -> None:
        """Apply deadlines every TICK_SECONDS, and refresh the gauges every second per thousand
        members (at least every METRICS_EVERY_SECONDS; a refresh reads every member: ~25 ms at
        10,000), until cancelled."""
        next_gauges = 0.0
        take_pause = getattr(self.clock, "take_pause", None)  # a RunClock detects the coordinator's pauses
        while True:
            now = self.clock()
            paused = take_pause() if take_pause is not None else 0.0
            try:
                if paused:
                    self.apply(self.engine.resumed(now, paused))
                self.apply(self.engine.tick(now))
            except StoreFailed:
                return  # serve ends this term (store_lost)
            if now >= next_gauges:
                self.observe()
                next_gauges = now + max(METRICS_EVERY_SECONDS, len(self.engine.members) / 1000)
            await asyncio.sleep(TICK_SECONDS)

    def observe(self) -> None:
        """Copy the engine's membership counts and wait reason into the metric gauges (each member's
        links are set when it reports them)."""
        e = self.engine
        counts: dict[str, int] = {}
        for m in e.members.values():
            counts[m.state.label] = counts.get(m.state.label, 0) + 1
        self.metrics.observe_members(e.epoch, e.committed_rounds, counts)
        self.metrics.observe_waiting(e.waiting(self.clock()).reason.value, [r.value for r in WaitReason])

    # ------------------------------------------------------------ RPCs

    async def Join(self, request: pb.JoinRequest, context: grpc.aio.ServicerContext) -> pb.JoinResponse:
        async with grpc_errors(context):
            require(len(request.public_key) == 32, "public_key", "must be a raw 32-byte Ed25519 key")
            require(":" in request.data_address, "data_address", "must be HOST:PORT")
            require(math.isfinite(request.relay_bytes_per_s) and request.relay_bytes_per_s >= 0, "relay_bytes_per_s",
                    "must be a finite rate >= 0 (bytes/s)")
            _check_rate(request.up_bytes_per_s, "up_bytes_per_s")
            _check_rate(request.down_bytes_per_s, "down_bytes_per_s")
            try:
                _check_version(request.version)
            except FailedPrecondition:
                held = self.refusal_lines.due()
                log.log(logging.DEBUG if held is None else logging.WARNING, "refused a Join from a peer of "
                        "version %s (older than %d.%d.0: result digests differ)%s", request.version,
                        *MIN_PEER_VERSION, more(held or 0))
                raise
            request.data_address = advertised_address(request.data_address, context)
            peer_id = peer_id_of(request.public_key)
            asked = self.clock()
            rec = self.memberships.admit(self.admission, peer_id, request.public_key, request.join_token, asked)
            held = peer_id in self.engine.members  # the previous process still had a lease
            if self.finished_event is not None and not held:
                # A latecomer: the run is over (and the coordinator exits once its members left).
                log.info("peer %s joined after the run finished; told so", peer_id[:8])
                return pb.JoinResponse(peer_id=peer_id, coordinator_public_key=public_bytes(self.key),
                                       finished=self.finished_event.finished)
            instance = _instance(context)
            fenced = self.memberships.claim(peer_id, instance, self._live(peer_id, asked))
            issued = self._issue(peer_id, request.tls_csr)  # a bad CSR refuses the join before it counts
            # Without an fsync, like the member row (a 10,000-member start must not fsync each join):
            # a machine crash (not a process crash) may lose a fresh admission; that peer then needs
            # its token once more. A revocation is written durably.
            with self._writing(durable=False):
                self.store.save_membership(rec)
            if fenced is not None:
                # A restart after a crash is routine (info); a holder that still had a lease is worth a look.
                log.log(logging.WARNING if held else logging.INFO, "peer %s: a new process took over the identity "
                        "(the old one %s); the old process is fenced", peer_id[:8],
                        "stopped renewing its lease" if held else "is gone")
                self._close_watch(peer_id, f"peer {peer_id}: another process with this key took over the identity; "
                                           f"this one is fenced")
            # A peer that says it is outbound-only is not dialled: nobody will dial it anyway.
            reach = await self._dial_back_of(request, context) \
                if self.reach is not None and not request.outbound_only else None
            if not self.memberships.holds(peer_id, instance):
                # Another process of this key joined during the dial-back: it holds the identity,
                # and this stale Join must not overwrite its address.
                raise Aborted(f"peer {peer_id[:8]}: another process with this key took over the identity while "
                              f"this Join was dialled back; this Join is void")
            if reach is not None and not reach.reachable:
                log.warning("peer %s cannot be reached at its data address: %s; it takes part outbound-only",
                            peer_id[:8], reach.reason)
            now = self.clock()
            # A stream that stayed open across this rejoin (e.g. the lease ran out while the
            # coordinator stalled) still delivers its events: the member is connected.
            self.apply(self.engine.join(peer_id, request.public_key, request.data_address, request.num_samples, now,
                                        request.up_bytes_per_s, request.down_bytes_per_s,
                                        reachable=reach.reachable if reach is not None else None,
                                        connected=peer_id in self.watchers, outbound_only=request.outbound_only,
                                        relay=request.relay, relay_bytes_per_s=request.relay_bytes_per_s))
            if request.up_bytes_per_s or request.down_bytes_per_s:
                self.metrics.observe_link(peer_id, request.up_bytes_per_s, request.down_bytes_per_s, 0.0)
            log.info("peer %s joined from %s%s%s (%s)", peer_id[:8], request.data_address,
                     ", outbound-only" if request.outbound_only or (reach is not None and not reach.reachable) else "",
                     f", relayed via {request.relay}" if request.relay else "",
                     f"admitted: {rec.label}" if rec.admitted_at == asked else "member since "
                     + time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(rec.admitted_at)))
            resp = pb.JoinResponse(
                peer_id=peer_id, lease_seconds=self.engine.config.lease_seconds,
                heartbeat_interval_seconds=self.engine.config.lease_seconds / 4, epoch=self.engine.epoch,
                next_round=self.engine.committed_rounds, run_config_json=self.run_config_json,
                coordinator_public_key=public_bytes(self.key),
                unreachable=reach.reason if reach is not None and not reach.reachable else "",
            )
            _give(resp, issued)
            if request.relay:  # a relay started with this coordinator's key registers only ticket holders
                resp.relay_ticket = issue_relay_ticket(self.key, request.public_key, RELAY_TICKET_SECONDS)
            # With cohorts a joiner fetches the state when a draw picks it (coordinator.cohorts);
            # while an attempt is in flight, its order comes when the attempt ends (on the stream).
            order = self.engine.join_sync(peer_id, now)
            if order is not None:
                resp.sync.CopyFrom(self._sync_order(order, to=peer_id))
            return resp

    def _live(self, peer_id: str, now: float) -> bool:
        """The process holding `peer_id` is live: its round-event stream is open and it renewed its
        lease within `memberships.live_seconds` (a newcomer with the same key is refused)."""
        m = self.engine.members.get(peer_id)
        if m is None or not m.connected or m.lease_expiry <= now:
            return False
        return m.lease_expiry - self.engine.config.lease_seconds >= now - self.memberships.live_seconds

    def _close_watch(self, peer_id: str, why: str) -> None:
        """End `peer_id`'s round-event stream with PERMISSION_DENIED and `why`."""
        q = self.watchers.pop(peer_id, None)
        if q is not None:
            q.put_nowait(why)

    def check_member(self, peer_id: str, instance: str) -> None:
        """Before a member's call: refuse it when revoked or fenced (PermissionDenied); note its
        use (the membership's last use is written at most hourly)."""
        self.memberships.check(peer_id, instance)
        rec = self.memberships.touch(peer_id, self.clock())
        if rec is not None:
            with self._writing(durable=False):
                self.store.save_membership(rec)

    def _operator(self, context) -> None:
        """Operator calls are signed (SignedCalls checked the signature) with the coordinator's key."""
        md = dict(context.invocation_metadata() or ())
        if md.get(MD_PUBKEY, "") != public_bytes(self.key).hex():
            raise PermissionDenied("operator calls must be signed with the coordinator's key (`shoal member "
                                   "--admin-key` the coordinator's --key file)")

    def _membership_info(self, rec: Membership, now: float) -> pb.MembershipInfo:
        m = self.engine.members.get(rec.peer_id)
        live = m is not None and m.lease_expiry > now
        return pb.MembershipInfo(member=rec.peer_id, label=rec.label, admitted_at=rec.admitted_at,
                                 last_seen=now if live else rec.last_seen, revoked_at=rec.revoked_at,
                                 status=rec.status(now, self.memberships.retention), live=live,
                                 address=m.address if live else "")

    async def ListMembers(self, request: pb.ListMembersRequest, context) -> pb.ListMembersResponse:
        async with grpc_errors(context):
            self._operator(context)
            now = self.clock()
            return pb.ListMembersResponse(
                members=[self._membership_info(r, now) for r in self.memberships.listing()],
                retention_seconds=self.memberships.retention)

    async def RevokeMember(self, request: pb.RevokeMemberRequest, context) -> pb.RevokeMemberResponse:
        async with grpc_errors(context):
            self._operator(context)
            now = self.clock()
            try:
                rec = self.memberships.revoke(request.member, now)
            except ValueError as exc:
                raise NotFound(str(exc)) from None
            with self._writing():
                self.store.save_membership(rec)
            log.warning("membership of peer %s (%s) revoked by the operator", rec.peer_id[:8], rec.label)
            self._close_watch(rec.peer_id, f"peer {rec.peer_id}: membership revoked by the operator")
            self.apply(self.engine.leave(rec.peer_id, now))
            return pb.RevokeMemberResponse(member=self._membership_info(rec, now))

    async def Heartbeat(self, request: pb.HeartbeatRequest, context) -> pb.HeartbeatResponse:
        async with grpc_errors(context):
            try:
                self.engine.heartbeat(request.peer_id, self.clock())
            except RoundError as exc:
                raise _raise(exc) from None
            return pb.HeartbeatResponse(lease_seconds=self.engine.config.lease_seconds, epoch=self.engine.epoch,
                                        round=self.engine.committed_rounds,
                                        ready=self.engine.holds_ready(request.peer_id),
                                        pooled=self.engine.pooled(request.peer_id))

    async def Leave(self, request: pb.LeaveRequest, context) -> pb.LeaveResponse:
        async with grpc_errors(context):
            self.apply(self.engine.leave(request.peer_id, self.clock()))
            return pb.LeaveResponse()

    async def Ready(self, request: pb.ReadyRequest, context) -> pb.ReadyResponse:
        async with grpc_errors(context):
            require(request.num_elements > 0, "num_elements", "must be positive")
            require(request.dtype != pb.DTYPE_UNSPECIFIED, "dtype", "must be set")
            require(math.isfinite(request.local_seconds) and request.local_seconds >= 0, "local_seconds",
                    "must be a finite number of seconds >= 0")
            info = ReadyInfo(request.num_elements, request.dtype, request.num_samples, request.state_digest,
                             request.state_round, self.clock(), request.state_bytes, request.sync_bytes_per_s,
                             request.training, request.local_steps, request.local_seconds,
                             request.checkpoint_round, request.checkpoint_digest,
                             _secagg_keys(request))
            try:
                actions = self.engine.ready(request.peer_id, request.round, info, self.clock())
            except RoundError as exc:
                self.apply(self.engine.durable_changed())
                raise _raise(exc) from None
            actions += self.engine.durable_changed()
            self.apply(actions, replying_to=request.peer_id)
            resp = pb.ReadyResponse(round=self.engine.committed_rounds, pooled=self.engine.pooled(request.peer_id))
            for a in actions:
                if isinstance(a, SendSync) and a.peer_id == request.peer_id:
                    # In the reply only (after the run finished, the event stream is closed).
                    resp.sync.CopyFrom(self._sync_order(a, to=a.peer_id))
            return resp

    def _issue(self, peer_id: str, csr: bytes) -> Issued | None:
        """A data-plane certificate for `peer_id` (the signer of the call) when it sent a CSR and
        this coordinator holds a CA key; None otherwise. Raises InvalidArgument for a bad CSR."""
        return self.ca.issue(peer_id, csr) if csr and self.ca is not None else None

    async def RenewCertificate(self, request: pb.RenewCertificateRequest, context) -> pb.RenewCertificateResponse:
        """A new certificate for a live member (the signature check made `peer_id` the signer)."""
        async with grpc_errors(context):
            require(bool(request.tls_csr), "tls_csr", "missing")
            if self.ca is None:
                raise FailedPrecondition("tls_csr: this coordinator issues no certificates (no ca.key)")
            m = self.engine.members.get(request.peer_id)
            if m is None or m.lease_expiry <= self.clock():
                raise NotFound(f"peer_id: no live lease for {request.peer_id[:8]}; join again")
            resp = pb.RenewCertificateResponse()
            _give(resp, self._issue(request.peer_id, request.tls_csr))
            return resp

    async def _dial_back_of(self, request: pb.JoinRequest, context) -> Reachability:
        """The joiner's reachability, dialling back only the address it advertises for itself:
        one on the host its Join came from (or on its relay's host, for a relayed address). Any
        other address is not dialled (the dial-back must not tell anyone whether some host's port
        is open) and counts as unreachable: the joiner takes part outbound-only. Dial-backs are
        rate limited per caller host (RESOURCE_EXHAUSTED past DIAL_BACK_BURST, DIAL_BACKS_PER_S)."""
        caller = host_of(context.peer() or "") if context is not None and hasattr(context, "peer") else ""
        if caller and caller != (context.peer() or ""):
            self.dial_backs.check(caller)
            host = request.data_address.rpartition(":")[0].strip("[]")
            relay_host = request.relay.rpartition(":")[0].strip("[]") if request.relay else ""
            if not await _same_host(host, caller) and not (relay_host and await _same_host(host, relay_host)):
                return Reachability(False, f"the data address is not on the host this Join came from ({caller}); "
                                           f"it was not dialled back")
        return await self._dial_back(request.data_address, request.public_key)

    async def _dial_back(self, address: str, public_key: bytes) -> Reachability:
        """Whether `public_key`'s peer answers at `address` (`self.reach`, which must be set): a
        dial-back that timed out is made once more before the answer counts, so this takes up to
        twice reach_timeout. An unreachable member stays outbound-only until it joins again, and a
        peer too busy to answer in time once is not NATed: after a coordinator restart every member
        reconnects (and is dialled back) at once, and under load one such member stayed
        outbound-only (seen in the compose test). A refusal or a wrong answer is final at once."""
        assert self.reach is not None
        reach = await self.reach(address, public_key)
        if not reach.reachable and reach.timed_out:
            reach = await self.reach(address, public_key)
        return reach

    async def _recheck_reach(self, peer_id: str) -> None:
        """Dial back a member whose reachability is unknown (restored from the store: a restarted
        or newly leading coordinator does not keep it) before its stream counts as connected, so
        a NATed member is not made a shard owner until it joins again (`_dial_back`)."""
        m = self.engine.members.get(peer_id)
        if self.reach is None or m is None or m.reachable is not None or m.outbound_only:
            return
        reach = await self._dial_back(m.address, m.public_key)
        if self.engine.members.get(peer_id) is not m:
            return  # the member joined again meanwhile (another address, maybe): its own Join dialled it
        self.engine.set_reachable(peer_id, reach.reachable)
        if not reach.reachable:
            log.warning("peer %s (restored member) cannot be reached at its data address: %s; it takes part "
                        "outbound-only", peer_id[:8], reach.reason)

    async def WatchRounds(self, request: pb.WatchRequest, context) -> AsyncIterator[pb.RoundEvent]:
        if request.peer_id not in self.engine.members:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"peer_id: unknown peer {request.peer_id[:8]}; join first")
        await self._recheck_reach(request.peer_id)
        q: asyncio.Queue[pb.RoundEvent | str] = asyncio.Queue()
        self.watchers[request.peer_id] = q
        self.apply(self.engine.connected(request.peer_id, self.clock()))
        try:
            if self.finished_event is not None:
                yield self.finished_event
                return
            run = self.engine.running
            sent = 0
            if run is not None and request.peer_id in run.plan.participants:
                yield pb.RoundEvent(plan=self._wire_plan(run.plan))
                sent = 1
            # gRPC sets up ~0.8 KB for a stream's first message (sent with the headers) and ~0.3 KB
            # for its second (the first sent alone), kept until the stream ends: both now, at its
            # start, not at the member's first cohort draw (scripts/grpc_stream_retention.py).
            for _ in range(sent, OPENING_EVENTS):
                yield EMPTY_EVENT
            while True:
                ev = await q.get()
                if isinstance(ev, str):
                    await context.abort(grpc.StatusCode.PERMISSION_DENIED, ev)
                yield ev
                if ev.HasField("finished"):
                    return
                ev = None  # not kept while waiting (EMPTY_EVENT)
                if q.empty():
                    yield EMPTY_EVENT  # nor by gRPC's server loop (EMPTY_EVENT)
        finally:
            if self.watchers.get(request.peer_id) is q:
                del self.watchers[request.peer_id]
                if self.finished_event is None:
                    log.info("peer %s disconnected (round-event stream closed)", request.peer_id[:8])
                    self.apply(self.engine.disconnected(request.peer_id, self.clock()))

    def _suspected(self, suspects: Iterable[str]) -> None:
        """Dial back the members a failed vote names (in tasks of their own; each at most once per
        REDIAL_SECONDS): reachability is followed during the run, not only at Join."""
        if self.reach is None:
            return
        now = self.clock()
        for p in suspects:
            m = self.engine.members.get(p)
            if m is None or m.outbound_only or m.relay or m.reachable is False \
                    or self.redialled.get(p, -REDIAL_SECONDS) > now - REDIAL_SECONDS:
                continue
            self.redialled[p] = now
            t = asyncio.get_running_loop().create_task(self._redial(p, m))
            self.redials.add(t)
            t.add_done_callback(self.redials.discard)

    async def _redial(self, peer_id: str, m) -> None:
        """A suspect's dial-back: unreachable (its data address stopped answering: a firewall, a
        black hole) makes it outbound-only from the next plan on, with a warning naming it."""
        reach = await self._dial_back(m.address, m.public_key)
        if self.engine.members.get(peer_id) is not m or reach.reachable:
            return  # it joined again meanwhile, or it answers: the failure was elsewhere
        self.engine.set_reachable(peer_id, False)
        log.warning("peer %s stopped answering at its data address %s (%s): it takes part outbound-only from "
                    "the next round on", peer_id[:8], m.address, reach.reason)

    async def Vote(self, request: pb.VoteRequest, context) -> pb.VoteResponse:
        async with grpc_errors(context):
            if not request.ok and request.suspects:
                self._suspected(s for s in request.suspects[:64] if s != request.peer_id)
            key = (request.round, request.attempt)
            self.vote_bytes[key] = self.vote_bytes.get(key, 0) + request.bytes_sent
            try:
                self.apply(self.engine.vote(
                    request.peer_id, request.round, request.attempt, request.ok, request.result_digest,
                    request.state_digest, self.clock(), loss=request.train_loss, suspects=tuple(request.suspects),
                    flagged=tuple(request.flagged), error=request.error, audit=request.audit_failure,
                    relay_failure=request.relay_failure))
            except RoundError as exc:
                raise _raise(exc) from None
            return pb.VoteResponse()

    def _secure_attempt(self, peer_id: str, round_: int, attempt: int) -> tuple[str, ...]:
        """The participants of the running secure attempt (round_, attempt), of which `peer_id`
        must be one; raises FailedPrecondition otherwise."""
        run = self.engine.running
        if run is None or (run.plan.round, run.plan.attempt) != (round_, attempt) or not run.plan.secagg_seed:
            raise FailedPrecondition(f"round {round_} attempt {attempt} is not the running secure attempt")
        if peer_id not in run.plan.participants:
            raise FailedPrecondition(f"peer_id: {peer_id[:8]} is not a participant of round {round_}.{attempt}")
        return run.plan.participants

    async def PostSecAgg(self, request: pb.SecAggPost, context) -> pb.SecAggPostResponse:
        async with grpc_errors(context):
            self.secagg.post(request, self._secure_attempt(request.peer_id, request.round, request.attempt))
            return pb.SecAggPostResponse()

    async def FetchSecAgg(self, request: pb.SecAggFetch, context) -> pb.SecAggFetchResponse:
        async with grpc_errors(context):
            require(math.isfinite(request.wait_seconds), "wait_seconds", "must be finite")
            return await self.secagg.fetch(request, self._secure_attempt(request.peer_id, request.round,
                                                                          request.attempt))

    async def ReportLinks(self, request: pb.LinkReport, context) -> pb.LinkReportResponse:
        async with grpc_errors(context):
            check_link_report(request)
            rtts = [l.rtt_seconds for l in request.links if l.rtt_seconds > 0]
            try:
                require(len(request.shm_peers) <= 4096, "shm_peers", "at most 4096 peers")
                require(len(request.bulk_peers) <= 4096, "bulk_peers", "at most 4096 peers")
                self.engine.report_links(request.peer_id, request.up_bytes_per_s, request.down_bytes_per_s,
                                         sum(rtts) / len(rtts) if rtts else 0.0,
                                         tuple(request.shm_peers), now=self.clock(),
                                         bulk_peers=tuple(request.bulk_peers),
                                         coordinator_rtt=request.coordinator_rtt_seconds)
                self.metrics.observe_link(request.peer_id, request.up_bytes_per_s, request.down_bytes_per_s,
                                          sum(rtts) / len(rtts) if rtts else 0.0)
            except RoundError as exc:
                raise _raise(exc) from None
            log.debug("links of %s: up %.2f Mbit/s, down %.2f Mbit/s, rtt %.2f ms (%d remote peers)",
                     request.peer_id[:8], request.up_bytes_per_s * 8e-6, request.down_bytes_per_s * 8e-6,
                     1e3 * (sum(rtts) / len(rtts) if rtts else 0.0), len(request.links))
            return pb.LinkReportResponse()

    async def Probe(self, request: pb.ProbeRequest, context) -> pb.ProbeResponse:
        """A member's first link estimate (peer.links.probe_peer against the coordinator): echo
        `reply_bytes` zero bytes. Members only (the signature names the caller), both directions
        at most PROBE_MAX_BYTES; rate limited like every signed call."""
        async with grpc_errors(context):
            require(request.reply_bytes <= PROBE_MAX_BYTES, "reply_bytes", f"at most {PROBE_MAX_BYTES}")
            require(len(request.payload) <= PROBE_MAX_BYTES, "payload", f"at most {PROBE_MAX_BYTES} bytes")
            pub = next((v for k, v in (context.invocation_metadata() or ()) if k == MD_PUBKEY), "")
            try:
                caller = peer_id_of(bytes.fromhex(pub))
            except ValueError:
                caller = ""
            if caller not in self.engine.members:
                raise NotFound(f"caller: {caller[:8] or 'unsigned'} is not a member; only members may probe the "
                               "coordinator (join first)")
            return pb.ProbeResponse(payload=bytes(request.reply_bytes))

    def recent(self, k: int) -> tuple[list[CommitRecord], list[AbortRecord]]:
        """The last `k` commits and aborts, oldest first: from memory when the engine's window
        holds them, else from the store (the whole history is there)."""
        e = self.engine
        if k <= e.config.history_window:
            return list(e.commits)[-k:], list(e.aborts)[-k:]
        return self.store.recent_commits(k), self.store.recent_aborts(k)

    async def GetStatus(self, request: pb.StatusRequest, context) -> pb.StatusResponse:
        now = self.clock()
        e = self.engine
        members = [
            pb.MemberInfo(peer_id=m.peer_id, address=m.address, state=m.state.label,
                          lease_remaining_seconds=max(0.0, m.lease_expiry - now), num_samples=m.num_samples,
                          up_bytes_per_s=m.up_bytes_per_s, down_bytes_per_s=m.down_bytes_per_s,
                          rtt_seconds=m.rtt_seconds, untrusted=m.peer_id in e.untrusted, shm_peers=len(m.shm_peers),
                          reachability={True: "reachable", False: "unreachable", None: "unchecked"}[m.reachable],
                          links_age_seconds=-1.0 if m.links_at is None else max(0.0, now - m.links_at),
                          outbound_only=m.outbound_only, relay=m.relay)
            for m in sorted(e.members.values(), key=lambda m: m.peer_id)
        ]
        k = request.recent_rounds or 10
        commits, aborts = self.recent(k)
        rounds = [
            pb.RoundInfo(round=c.round, attempt=c.attempt, status="committed", state_digest=c.state_digest,
                         participants=len(c.participants), seconds=c.seconds, train_loss=c.train_loss)
            for c in commits
        ]
        rounds += [
            pb.RoundInfo(round=a.round, attempt=a.attempt, status="aborted", reason=a.reason)
            for a in aborts
        ]
        if e.running is not None:
            rounds.append(pb.RoundInfo(round=e.running.plan.round, attempt=e.running.plan.attempt, status="running",
                                       participants=len(e.running.plan.participants)))
        rounds.sort(key=lambda r: (r.round, r.attempt, r.status != "aborted"))
        w = e.waiting(now)
        waiting = pb.Waiting(reason=w.reason.value, message=w.message, peers=w.peers,
                             seconds_left=max(0.0, w.until - now) if w.until is not None else 0.0)
        d = e.durable
        return pb.StatusResponse(epoch=e.epoch, round=e.committed_rounds, members=members, rounds=rounds[-k:],
                                 rounds_committed=e.committed_rounds, rounds_aborted=e.rounds_aborted,
                                 run_config_json=self.run_config_json, waiting=waiting, epsilon=e.epsilon,
                                 dp_delta=e.config.privacy.delta if e.config.privacy.enabled else 0.0,
                                 durable_round=d.round if d else 0, durable_digest=d.state_digest if d else b"",
                                 durable_peers=d.peers if d else (), rounds_lost=self.rounds_lost)


def _instance(context) -> str:
    """The caller's process instance id (metadata x-shoal-instance; "" when it sends none)."""
    for k, v in (context.invocation_metadata() if context is not None else None) or ():
        if k == MD_INSTANCE:
            return v[:64]
    return ""


class MemberCalls(grpc.aio.ServerInterceptor):
    """Server interceptor (after SignedCalls, so the signer is authenticated): a member's calls
    (MEMBER_METHODS) are refused with PERMISSION_DENIED once its membership is revoked or
    another process of its key took over (`CoordinatorService.check_member`)."""

    def __init__(self, service: CoordinatorService):
        self.service = service

    def _check(self, context) -> None:
        md = dict(context.invocation_metadata() or ())
        try:
            peer_id = peer_id_of(bytes.fromhex(md.get(MD_PUBKEY, "")))
        except ValueError:
            return  # unsigned: SignedCalls refused it already
        self.service.check_member(peer_id, md.get(MD_INSTANCE, "")[:64])

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method not in MEMBER_METHODS:
            return handler
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary_unary(request, context):
                async with grpc_errors(context):
                    self._check(context)
                return await inner(request, context)

            return handler._replace(unary_unary=unary_unary)
        if handler.unary_stream is not None:
            inner_s = handler.unary_stream

            async def unary_stream(request, context):
                async with grpc_errors(context):
                    self._check(context)
                async for item in inner_s(request, context):
                    yield item

            return handler._replace(unary_stream=unary_stream)
        return handler


async def _same_host(host: str, other: str) -> bool:
    """Whether `host` and `other` (IPs or names, resolved within RESOLVE_SECONDS each) share an IP;
    any two loopback addresses are the same host."""
    a, b = await _ips(host), await _ips(other)
    return bool(a & b) or (any(ip.is_loopback for ip in a) and any(ip.is_loopback for ip in b))


async def _ips(host: str) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The IPs `host` names (itself when it is one; empty when it does not resolve in time)."""
    try:
        return {_ip(host)}
    except ValueError:
        pass
    try:
        infos = await asyncio.wait_for(asyncio.get_running_loop().getaddrinfo(host, None), RESOLVE_SECONDS)
    except (OSError, asyncio.TimeoutError):
        return set()
    out = set()
    for info in infos:
        with contextlib.suppress(ValueError):
            out.add(_ip(str(info[4][0]).split("%")[0]))
    return out


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """The IP `text` names (an IPv4-mapped IPv6 address as its IPv4 one); ValueError if none."""
    ip = ipaddress.ip_address(text)
    mapped = getattr(ip, "ipv4_mapped", None)
    return mapped if mapped is not None else ip


def _secagg_keys(request: pb.ReadyRequest) -> bytes:
    """The Ready's secure-aggregation public keys and signature (mask 32 + box 32 + signature 64
    bytes), b"" when it carries none. Raises InvalidArgument for keys that are not two 32-byte
    X25519 keys or a signature that is not 64 bytes (the participants verify it, not the coordinator)."""
    if not request.secagg_mask_key and not request.secagg_box_key:
        return b""
    require(len(request.secagg_mask_key) == 32, "secagg_mask_key", "must be 32 bytes (X25519)")
    require(len(request.secagg_box_key) == 32, "secagg_box_key", "must be 32 bytes (X25519)")
    require(len(request.secagg_signature) == 64, "secagg_signature", "must be 64 bytes (Ed25519)")
    return request.secagg_mask_key + request.secagg_box_key + request.secagg_signature


def _check_rate(value: float, field: str) -> None:
    """Raise InvalidArgument naming `field` unless `value` is 0 (not measured) or a physical rate
    (bytes/s within LINK_BYTES_PER_S_BOUNDS)."""
    lo, hi = LINK_BYTES_PER_S_BOUNDS
    require(value == 0 or (math.isfinite(value) and lo <= value <= hi), field,
            f"must be 0 (not measured) or a rate of {lo:g} to {hi:g} bytes/s, got {value!r}")


def check_link_report(report: pb.LinkReport) -> None:
    """Raise InvalidArgument naming the first field of `report` outside physical bounds: each
    rate 0 (not measured) or within LINK_BYTES_PER_S_BOUNDS, each round trip 0 (not measured) or
    in (0, LINK_RTT_MAX_SECONDS] seconds; nothing is recorded from a refused report."""
    _check_rate(report.up_bytes_per_s, "up_bytes_per_s")
    _check_rate(report.down_bytes_per_s, "down_bytes_per_s")
    for i, link in enumerate(report.links):
        _check_rate(link.up_bytes_per_s, f"links[{i}].up_bytes_per_s")
        _check_rate(link.down_bytes_per_s, f"links[{i}].down_bytes_per_s")
        _check_rtt(link.rtt_seconds, f"links[{i}].rtt_seconds")
    _check_rtt(report.coordinator_rtt_seconds, "coordinator_rtt_seconds")


def _check_rtt(value: float, field: str) -> None:
    """Raise InvalidArgument naming `field` unless `value` is 0 (not measured) or a round trip in
    (0, LINK_RTT_MAX_SECONDS] seconds."""
    require(value == 0 or (math.isfinite(value) and 0 < value <= LINK_RTT_MAX_SECONDS), field,
            f"must be 0 (not measured) or in (0, {LINK_RTT_MAX_SECONDS:g}] seconds, got {value!r}")


# The oldest peer version whose votes this coordinator's peers can agree with: 0.2.0 changed the
# result digest (shoal.common.tensors.result_digest, over 1 MiB block digests) and 0.3.0 the
# all-reduce job's state digest (shoal.peer.workloads.base.array_state_digest), so an older peer would
# dissent on every round it shares with newer ones.
MIN_PEER_VERSION = (0, 3)


def _check_version(version: str) -> None:
    """Refuse a Join from a Shoal peer older than MIN_PEER_VERSION (FailedPrecondition naming the
    field). A version that is not MAJOR.MINOR[.PATCH] (hand-written clients, tools) or empty is
    let through: only Shoal's own peers vote digests this check is about."""
    parts = version.split(".")
    if len(parts) < 2 or not (parts[0].isdigit() and parts[1].isdigit()):
        return
    if (int(parts[0]), int(parts[1])) < MIN_PEER_VERSION:
        raise FailedPrecondition(
            f"version: peer {version} computes digests that peers of "
            f"{'.'.join(map(str, MIN_PEER_VERSION))}.0 and later do not (their votes would never agree); "
            f"upgrade the peer to the coordinator's version")


