"""The peer's control-plane client: every call to the coordinator, under one retry policy.

`CoordinatorClient` wraps the generated stub so that each call has its timeout, its bound and
its named recoveries in one place (shoal.common.retry decides what is transient):

| call        | bound                  | named branches                                              |
| ----------- | ---------------------- | ----------------------------------------------------------- |
| Join        | `connect_timeout`      | —                                                           |
| Ready       | `connect_timeout`      | NOT_FOUND (lease gone): join again, retry; FAILED_PRECONDITION (no up-to-date donor is live yet): retry |
| Heartbeat   | one lease              | NOT_FOUND: join again, retry; gives up quietly (logged): the next heartbeat tries again |
| WatchRounds | `connect_timeout` per outage | CANCELLED counts as a broken stream; NOT_FOUND: join again; a fresh bound after every stream that delivered events |
| Vote        | `VOTE_SECONDS`         | not delivered: logged, returns False (the coordinator decides at its deadline) |
| ReportLinks | `rpc_timeout`          | best effort: logged at debug                                |
| Leave       | `LEAVE_SECONDS`        | best effort                                                 |
| PostSecAgg  | the caller's wait      | raised when it gives up: the secure attempt fails            |
| FetchSecAgg | its wait + `rpc_timeout` | raised when it gives up: the secure attempt fails          |

Joining again keeps the identity (the peer id is the key's hash); the new lease, heartbeat
interval, coordinator key and any sync order of the answer are taken over (`pending_sync`).
A status that is not transient (e.g. UNAUTHENTICATED, INVALID_ARGUMENT, INTERNAL) is raised at
once by Join, Ready, Heartbeat and the watch: a refusal or a server bug surfaces, it is not retried.

Every call carries this process's instance id (metadata `x-shoal-instance`): the coordinator keeps
one process per identity, refusing a second one's Join (ALREADY_EXISTS) and, after a takeover, the
old one's calls (PERMISSION_DENIED).

While the coordinator cannot be reached, `peer.diagnosis.OutageLog` logs one line every 10 s with
the last error (DNS, refused, timeout, TLS and why); Join and the watch, when their bound passes,
raise `CoordinatorUnreachable` whose message is the "gave up" line (the most useful error seen and
its fix; the last gRPC error is its `__cause__`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from shoal.common.identity import MD_INSTANCE
from shoal.common.retry import BROKEN_STREAM, REFUSED, RetryPolicy, is_transient
from shoal.peer.diagnosis import OutageLog
from shoal.v1 import shoal_pb2 as pb
from shoal.v1 import shoal_pb2_grpc as pb_grpc

log = logging.getLogger("shoal.peer.control")

VOTE_SECONDS = 10.0
LEAVE_SECONDS = 2.0
RTT_SAMPLES = 8  # heartbeats whose round trips `ControlClient.coordinator_rtt` takes the smallest of
_NOT_FOUND = grpc.StatusCode.NOT_FOUND
_NO_DONOR_YET = grpc.StatusCode.FAILED_PRECONDITION
T = TypeVar("T")


class CoordinatorClient:
    """This peer's calls to the coordinator (module docstring).

    join_request: builds the JoinRequest (called on every join). on_join: told every JoinResponse
    (e.g. to hand the coordinator's ticket key to the data plane). rpc_timeout: per call, seconds.
    target: the coordinator's address, as dialled (for the messages).
    """

    def __init__(self, stub: pb_grpc.CoordinatorStub, policy: RetryPolicy, *, rpc_timeout: float,
                 join_request: Callable[[], pb.JoinRequest],
                 on_join: Callable[[pb.JoinResponse], None] | None = None, target: str = "coordinator"):
        self.stub, self.policy, self.rpc_timeout = stub, policy, rpc_timeout
        self.instance = secrets.token_hex(16)  # this process's claim on its identity
        self.md = ((MD_INSTANCE, self.instance),)
        self.outage = OutageLog(target)
        self.join_request = join_request
        self.on_join = on_join or (lambda resp: None)
        self.peer_id = ""
        self.coordinator_public_key = b""
        self.lease_seconds = 10.0
        self.heartbeat_interval = 2.5
        self.pending_sync: pb.SyncOrder | None = None  # from the last JoinResponse, until taken
        self._round_trips: collections.deque[float] = collections.deque(maxlen=RTT_SAMPLES)

    async def join(self) -> pb.JoinResponse:
        """Join (or join again); raises the last error when the bound passes or admission refuses.
        A response with `finished` set (the run was over before this peer came) is returned as it
        is: the peer is no member and has nothing to do."""
        req = self.join_request()
        try:
            resp = await self.policy.call(self._reported(lambda: self.stub.Join(req, timeout=self.rpc_timeout,
                                                                               metadata=self.md)), "join")
        except grpc.aio.AioRpcError as exc:
            if is_transient(exc):
                raise self.outage.gave_up(self.policy.deadline) from exc
            raise
        self.peer_id = resp.peer_id
        self.coordinator_public_key = resp.coordinator_public_key
        if resp.HasField("finished"):  # the run was over before this peer came: not a member
            return resp
        self.lease_seconds = resp.lease_seconds
        self.heartbeat_interval = resp.heartbeat_interval_seconds
        if resp.HasField("sync") and resp.sync.donors:
            self.pending_sync = resp.sync
        self.on_join(resp)
        return resp

    def _reported(self, fn: Callable[[], Awaitable[T]]) -> Callable[[], Awaitable[T]]:
        """`fn` with its transient failures noted in the outage log (and success ending an outage)."""
        async def call() -> T:
            try:
                out = await fn()
            except grpc.aio.AioRpcError as exc:
                if is_transient(exc):
                    await self.outage.failed(exc)
                raise
            self.outage.recovered()
            return out
        return call

    def take_sync(self) -> pb.SyncOrder | None:
        """The sync order of the last join, once."""
        order, self.pending_sync = self.pending_sync, None
        return order

    async def ready(self, req: pb.ReadyRequest) -> pb.ReadyResponse:
        """Say ready (module docstring for the named branches)."""
        return await self.policy.call(self._reported(lambda: self.stub.Ready(req, timeout=self.rpc_timeout,
                                                                             metadata=self.md)), "ready",
                                      also=(_NO_DONOR_YET,), recover={_NOT_FOUND: self.join})

    @property
    def coordinator_rtt(self) -> float:
        """The smallest round trip (seconds) of the last RTT_SAMPLES heartbeats that got an answer
        (0 = none yet): the control path's propagation delay, with little of the coordinator's
        own load or of a busy host in it (the planner's control-plane term, LinkReport). Joins
        are not timed: a join's answer waits for admission work (signatures, the state file)."""
        return min(self._round_trips, default=0.0)

    async def _timed(self, call: Awaitable[T]) -> T:
        t0 = time.monotonic()
        out = await call
        self._round_trips.append(time.monotonic() - t0)
        return out

    async def heartbeat(self) -> pb.HeartbeatResponse | None:
        """Renew the lease; None (logged) when the coordinator stayed unreachable for a lease.
        Raises a status that is not transient."""
        req = pb.HeartbeatRequest(peer_id=self.peer_id)
        try:
            return await self.policy.call(self._reported(lambda: self._timed(self.stub.Heartbeat(
                req, timeout=self.rpc_timeout, metadata=self.md))), "heartbeat",
                                          deadline=self.lease_seconds, recover={_NOT_FOUND: self._rejoin})
        except grpc.aio.AioRpcError as exc:
            if not is_transient(exc):
                raise
            log.warning("heartbeat: coordinator unreachable for %.0fs (%s); trying again", self.lease_seconds,
                        exc.code().name)
            return None

    async def _rejoin(self) -> None:
        log.warning("lease lost; joining again")
        await self.join()

    async def watch(self, deliver: Callable[[pb.RoundEvent], Awaitable[bool]],
                    reconnected: Callable[[], Awaitable[None]]) -> None:
        """Stream round events to `deliver` until it returns True (the run finished).

        A broken stream is reopened under the retry policy (CANCELLED counts as broken here;
        NOT_FOUND: join again first); `reconnected()` runs before a reopened stream's events.
        Every stream that delivered events gives the next outage a fresh bound. Raises the last
        error when no stream could be opened within the bound, or a status that is not transient.
        """
        opened = [False]

        async def stream() -> bool:
            if opened[0]:
                await reconnected()
            opened[0] = True
            return await self._stream(deliver)

        while True:
            try:
                done = await self.policy.call(self._reported(stream), "watch", also=BROKEN_STREAM,
                                              recover={_NOT_FOUND: self.join})
            except grpc.aio.AioRpcError as exc:
                if is_transient(exc, BROKEN_STREAM):
                    raise self.outage.gave_up(self.policy.deadline) from exc
                raise
            if done:
                return
            log.debug("watch stream ended; reopening")

    async def _stream(self, deliver: Callable[[pb.RoundEvent], Awaitable[bool]]) -> bool:
        """One WatchRounds stream: True once `deliver` says finished, False when the stream broke
        after delivering events (reopen at once); raises when it broke before any."""
        delivered = False
        try:
            async for msg in self.stub.WatchRounds(pb.WatchRequest(peer_id=self.peer_id), metadata=self.md):
                if not delivered:
                    self.outage.recovered()
                delivered = True
                if await deliver(msg):
                    return True
        except grpc.aio.AioRpcError as exc:
            if not delivered:
                raise
            log.debug("watch stream broke: %s; reopening", exc.code().name)
            return False
        if not delivered:  # closed cleanly before any event: pace the reopening like a failure
            await asyncio.sleep(self.policy.initial)
        return False

    async def vote(self, req: pb.VoteRequest) -> bool:
        """Deliver a ballot; False (logged) when it could not be delivered."""
        try:
            await self.policy.call(lambda: self.stub.Vote(req, timeout=self.rpc_timeout, metadata=self.md), "vote",
                                   deadline=VOTE_SECONDS)
            return True
        except grpc.aio.AioRpcError as exc:
            # A refused identity (fenced, revoked) ends this process with one line naming why
            # (the watch stream and the heartbeat see the same status): not a second error here.
            level = logging.WARNING if is_transient(exc) else logging.INFO if exc.code() in REFUSED else logging.ERROR
            log.log(level, "vote for round %d.%d not delivered: %s %s", req.round, req.attempt, exc.code().name,
                    exc.details())
            return False

    async def secagg_post(self, req: pb.SecAggPost, deadline: float) -> None:
        """Post this participant's secure-aggregation items (shoal.peer.secure_round); retried
        within `deadline` seconds, then the status is raised (the attempt fails)."""
        await self.policy.call(lambda: self.stub.PostSecAgg(req, timeout=self.rpc_timeout, metadata=self.md),
                               "post secure-aggregation items", deadline=deadline)

    async def secagg_fetch(self, req: pb.SecAggFetch) -> pb.SecAggFetchResponse:
        """What the coordinator relays to this participant in `req.phase` (it waits up to
        `req.wait_seconds` for the others); retried within that wait plus one RPC timeout, then
        the status is raised (the attempt fails)."""
        return await self.policy.call(
            lambda: self.stub.FetchSecAgg(req, timeout=req.wait_seconds + self.rpc_timeout, metadata=self.md),
            "fetch secure-aggregation items", deadline=req.wait_seconds + self.rpc_timeout)

    async def report_links(self, report: pb.LinkReport) -> None:
        """Best effort: a lost report only leaves the coordinator with older estimates."""
        try:
            await self.policy.call(lambda: self.stub.ReportLinks(report, timeout=self.rpc_timeout, metadata=self.md),
                                   "report links",
                                   deadline=self.rpc_timeout)
        except grpc.aio.AioRpcError as exc:
            log.debug("link report not delivered: %s", exc.code().name)

    async def leave(self) -> None:
        """Best effort: the lease expires anyway."""
        try:
            await self.policy.call(lambda: self.stub.Leave(pb.LeaveRequest(peer_id=self.peer_id), timeout=LEAVE_SECONDS,
                                                           metadata=self.md), "leave", deadline=LEAVE_SECONDS)
        except grpc.aio.AioRpcError as exc:
            log.debug("leave not delivered: %s", exc.code().name)
