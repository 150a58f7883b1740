"""The peer agent: joins a swarm, keeps its lease, plays rounds, syncs state, trains.

`PeerAgent.run()` owns every task it starts (data-plane server, heartbeat, the round-event
watch) in one TaskGroup and returns when the coordinator says the run is finished (or raises
if the peer cannot continue). Failure semantics:
- The coordinator is unreachable or restarted: calls are retried with exponential backoff and
  jitter; the watch stream reconnects; an expired lease is re-acquired by joining again with the
  same identity. A round in flight at that moment is treated as aborted and played again.
- A collective fails: the peer votes "failed" naming the suspects; its committed state is
  untouched (the collective never mutates inputs) and it plays the retry if not excluded.
- Its state is stale (excluded from a committed round, restarted, joined late, digest
  disagrees): it downloads the committed state from donors and verifies its digest first.
- The workload is closed by its owner (`WorkloadClosed` from `local_update`, e.g. a PyTorch
  loop that stopped): the agent leaves the swarm cleanly and `run()` returns.

What is trained is pluggable: `PeerAgent(config, workload_factory=...)` takes any
peer.workload.Workload (default: peer.training.DigitsWorkload on the peer's data shard).
Metrics (shoal.metrics.PeerMetrics) are always recorded and served when `metrics_port` is set;
the data-plane server also carries gRPC health checking and reflection.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import pathlib
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc
import numpy as np

from shoal.peer import faults
from shoal.peer.byzantine import ATTACKS, OWNER_ATTACKS, forge, tamper
from shoal.common.plan import Plan as CollectivePlan
from shoal.peer.collectives import CollectiveError, all_reduce
from shoal.peer.compression import ErrorFeedback
from shoal.peer.dataplane import Inbox, PeerService, Session, StateSource, Transport, channel_options, serve_data_plane
from shoal.common.identity import load_or_create_key, public_bytes
from shoal.peer.links import LinkMeter, probe_missing
from shoal.peer.reduction import OwnerReduction
from shoal.common.security import Security, open_channel, signing_interceptors
from shoal.peer.state_sync import SyncError, download_state
from shoal.peer.training import CommittedState, DigitsWorkload, RunConfig
from shoal.peer.workload import Workload, WorkloadClosed
from shoal.common.health import PEER_SERVICE, attach
from shoal.common.metrics import PeerMetrics
from shoal.v1 import shoal_pb2 as pb
from shoal.v1 import shoal_pb2_grpc as pb_grpc

log = logging.getLogger("shoal.peer")
T = TypeVar("T")

LINK_MEASURE_SECONDS = 30.0  # probes + report between two rounds, at most
HELD_STATES = 3  # committed states a donor keeps serving (the newest and two before it)
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
             grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.RESOURCE_EXHAUSTED}


@dataclass(frozen=True)
class PeerConfig:
    """Settings of `shoal peer` (see docs/configuration.md).

    rpc_timeout: per control-plane call, seconds. backoff_initial / backoff_max: reconnect
    backoff bounds, seconds (exponential with full jitter). round_silence: if no round event
    arrives for this long while waiting, the peer re-announces itself (covers a coordinator that
    restarted and forgot the ready set). sync_donors: donors used in parallel for state sync.
    advertise: the data-plane HOST:PORT other peers dial (default: the bound address; set it
    behind NAT or in containers). metrics_port: Prometheus /metrics port, 0 = off.
    """

    coordinator: str = "127.0.0.1:7070"
    listen: str = "127.0.0.1:0"
    key_path: str = "shoal-peer.key"
    shard: int = 0
    events_path: str | None = None
    ready_file: str | None = None
    rpc_timeout: float = 5.0
    backoff_initial: float = 0.05
    backoff_max: float = 2.0
    round_silence: float = 15.0
    sync_donors: int = 3
    sync_range_bytes: int = 256 << 10
    finish_linger: float = 1.0  # seconds the data plane keeps serving the final state after the run ends
    connect_timeout: float = 120.0
    security: Security = Security(insecure=True)
    join_token: str = ""
    advertise: str | None = None
    metrics_port: int = 0
    metrics_host: str = "0.0.0.0"
    shared_memory: bool = True  # the shared-memory lane to peers on this host (peer.shm)
    attack: str = ""  # testing only: send forged updates (peer.byzantine); "" = honest
    attack_scale: float | None = None


class _Reconnected:
    """Marker event: the watch stream was re-established (the coordinator may have restarted)."""


class _Forgotten:
    """Marker event: two heartbeats in a row say the coordinator does not hold this waiting peer's
    Ready (or has committed past its round): the Ready or the events that answer it were lost."""


class PeerAgent(StateSource):
    """One peer of a swarm; see the module docstring."""

    def __init__(self, config: PeerConfig, workload_factory: Callable[[RunConfig], Workload] | None = None,
                 metrics: PeerMetrics | None = None):
        self.config = config
        self.workload_factory = workload_factory or (lambda cfg: DigitsWorkload(cfg, config.shard))
        self.metrics = metrics or PeerMetrics()
        self.key = load_or_create_key(config.key_path)
        self.public_key = public_bytes(self.key)
        self.peer_id = ""
        self.inbox = Inbox()
        self.transport = Transport(config.security, self.key, shared_memory=config.shared_memory)
        self.links = LinkMeter()  # passive from the collectives' streams, probes when no history
        self._last_plan: CollectivePlan | None = None
        self.coordinator_public_key = b""
        self.events: asyncio.Queue[pb.RoundEvent | _Reconnected] = asyncio.Queue()
        self.workload: Workload | None = None
        self.address = ""
        self.channel: grpc.aio.Channel | None = None
        self.stub: pb_grpc.CoordinatorStub | None = None
        self.lease_seconds = 10.0
        self.heartbeat_interval = 2.5
        self.pending_sync: pb.SyncOrder | None = None
        self.tentative: dict[tuple[int, int], CommittedState] = {}
        self.feedback = ErrorFeedback()  # compression residuals, updated only on commit
        self.pending_feedback: dict[tuple[int, int], tuple] = {}
        self.attack_rng = np.random.default_rng()
        self.bytes_sent = 0
        self.bytes_received = 0
        self.state_syncs = 0
        self.finished = False
        self.waiting_round: int | None = None  # the round _play_round waits in, None elsewhere
        self.last_announce = 0.0  # monotonic time of the last Ready sent
        self.service: PeerService | None = None
        self._held: dict[int, tuple[bytes, bytes]] = {}
        self._events_file = open(config.events_path, "a", buffering=1) if config.events_path else None

    # ------------------------------------------------------------ state source (donor side)

    def committed_state(self) -> tuple[int, bytes, bytes]:
        assert self.workload is not None
        st = self.workload.state
        blob, dig = st.to_bytes(), st.digest()  # computed once per state object
        if self._held.get(st.rounds, (None, None))[1] != dig:
            self._held[st.rounds] = (blob, dig)
            for old in sorted(self._held)[:-HELD_STATES]:
                del self._held[old]
        return st.rounds, blob, dig

    def state_for(self, rounds: int) -> tuple[bytes, bytes] | None:
        self.committed_state()
        return self._held.get(rounds)

    # ------------------------------------------------------------ helpers

    def _emit(self, event: str, **fields) -> None:
        if self._events_file is not None:
            rec = {"event": event, "peer": self.peer_id, "t": time.time(), **fields}
            self._events_file.write(json.dumps(rec) + "\n")

    async def _call(self, fn: Callable[[], Awaitable[T]], what: str, *, deadline: float | None = None) -> T:
        """Retry a control-plane call on transient errors with exponential backoff and jitter."""
        delay = self.config.backoff_initial
        end = time.monotonic() + (deadline if deadline is not None else self.config.connect_timeout)
        while True:
            try:
                return await fn()
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in RETRYABLE or time.monotonic() > end:
                    raise
                log.debug("%s: %s; retrying in %.2fs", what, exc.code().name, delay)
            # Never sleep past the deadline: the last try is at `end`, not a backoff later.
            await asyncio.sleep(min(random.uniform(0, delay), max(0.0, end - time.monotonic())))
            delay = min(self.config.backoff_max, delay * 2)

    # ------------------------------------------------------------ membership

    async def _join(self) -> pb.JoinResponse:
        assert self.stub is not None
        samples = self.workload.num_samples if self.workload else 0
        req = pb.JoinRequest(public_key=self.public_key, data_address=self.address, num_samples=samples,
                             version="0.1.0", join_token=self.config.join_token)
        resp = await self._call(lambda: self.stub.Join(req, timeout=self.config.rpc_timeout), "join")
        self.peer_id = resp.peer_id
        self.coordinator_public_key = resp.coordinator_public_key
        if self.service is not None:
            self.service.coordinator_public_key = resp.coordinator_public_key
        self.lease_seconds = resp.lease_seconds
        self.heartbeat_interval = resp.heartbeat_interval_seconds
        if resp.HasField("sync") and resp.sync.donors:
            self.pending_sync = resp.sync
        return resp

    async def _heartbeat_loop(self) -> None:
        """Renew the lease; also the safety net for a lost Ready: a peer waiting in a round that
        the coordinator does not count as ready (or that it has committed past) twice in a row,
        with no Ready of its own in between, gets a `_Forgotten` event and announces again (so a
        lost message costs one or two heartbeats, not `round_silence`)."""
        assert self.stub is not None
        suspicious: int | None = None  # the waiting round the previous heartbeat found forgotten
        while not self.finished:
            await asyncio.sleep(self.heartbeat_interval)
            try:
                sent = time.monotonic()
                resp = await self.stub.Heartbeat(pb.HeartbeatRequest(peer_id=self.peer_id),
                                                 timeout=self.config.rpc_timeout)
                r = self.waiting_round
                forgotten = r is not None and self.last_announce < sent and (resp.round > r or not resp.ready)
                if forgotten and suspicious == r:
                    log.info("the coordinator holds no Ready of this peer for round %d (it is at %d); "
                             "announcing again", r, resp.round)
                    self.events.put_nowait(_Forgotten())
                    suspicious = None
                else:
                    suspicious = r if forgotten else None
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    log.warning("lease lost; joining again")
                    try:
                        await self._join()
                    except grpc.aio.AioRpcError:
                        pass
                else:
                    log.debug("heartbeat failed: %s", exc.code().name)

    async def _watch_loop(self) -> None:
        assert self.stub is not None
        delay = self.config.backoff_initial
        first = True
        while not self.finished:
            try:
                call = self.stub.WatchRounds(pb.WatchRequest(peer_id=self.peer_id))
                if not first:
                    await self.events.put(_Reconnected())
                async for ev in call:
                    delay = self.config.backoff_initial
                    if first:
                        first = False
                    if ev.HasField("commit") and faults.dropped("commit-event", ev.commit.round):
                        log.warning("fault injection: commit of round %d lost", ev.commit.round)
                        continue
                    await self.events.put(ev)
                    if ev.HasField("finished"):
                        return
                first = False
            except grpc.aio.AioRpcError as exc:
                first = False
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    try:
                        await self._join()
                    except grpc.aio.AioRpcError:
                        pass
                log.debug("watch stream broke: %s; reconnecting", exc.code().name)
            await asyncio.sleep(random.uniform(0, delay))
            delay = min(self.config.backoff_max, delay * 2)

    # ------------------------------------------------------------ rounds

    async def _announce(self, round_: int, n: int) -> None:
        """Say ready; a sync order in the reply is handled like one on the event stream (which may
        be reconnecting at that moment, and is closed once the run finished)."""
        # Stamped before and after the call: a heartbeat sent before the Ready was processed, or
        # answered while it was in flight, must not count as "the coordinator forgot this peer".
        self.last_announce = time.monotonic()
        resp = await self._ready(round_, n)
        self.last_announce = time.monotonic()
        if resp is not None and resp.HasField("sync") and resp.sync.donors:
            self.events.put_nowait(pb.RoundEvent(sync=resp.sync))

    async def _ready(self, round_: int, n: int) -> pb.ReadyResponse:
        assert self.stub is not None and self.workload is not None
        st = self.workload.state
        req = pb.ReadyRequest(peer_id=self.peer_id, round=round_, num_elements=n, dtype=pb.FLOAT32,
                              num_samples=self.workload.num_samples, state_digest=self.committed_state()[2],
                              state_round=st.rounds)

        async def call() -> pb.ReadyResponse:
            try:
                return await self.stub.Ready(req, timeout=self.config.rpc_timeout)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    await self._join()
                    raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, exc.initial_metadata(),
                                               exc.trailing_metadata(), "rejoined") from None
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, exc.initial_metadata(),
                                               exc.trailing_metadata(), exc.details()) from None
                raise

        return await self._call(call, "ready")

    async def _vote(self, req: pb.VoteRequest) -> None:
        assert self.stub is not None
        try:
            await self._call(lambda: self.stub.Vote(req, timeout=self.config.rpc_timeout), "vote", deadline=10.0)
        except grpc.aio.AioRpcError as exc:
            log.warning("vote for round %d.%d not delivered: %s", req.round, req.attempt, exc.code().name)

    def _already_holds(self, order: pb.SyncOrder) -> bool:
        """True when `order` names the state this peer holds or an older one (nothing to do)."""
        held = self.workload.state.rounds
        return order.round < held or (order.round == held and order.state_digest == self.committed_state()[2])

    async def _sync(self, order: pb.SyncOrder) -> bool:
        """Adopt the committed state named by `order`: from a matching tentative state, or by download.

        An order for a state this peer already holds, or for an older one (a duplicate or late
        order), is ignored: a peer never moves back to an older committed state.
        """
        assert self.workload is not None
        if self._already_holds(order):
            log.debug("sync order for round %d ignored: this peer holds round %d", order.round,
                      self.workload.state.rounds)
            return False
        for key, st in list(self.tentative.items()):
            if st.rounds == order.round and st.digest() == order.state_digest:
                self.workload.apply(st)
                self.tentative.clear()
                log.info("state for round %d adopted from the local tentative copy", order.round)
                return True
        t0 = time.monotonic()
        res = await download_state(order, me=self.peer_id, transport=self.transport, k=self.config.sync_donors,
                                   range_bytes=self.config.sync_range_bytes)
        st = self.workload.state_from_bytes(res.blob)
        self.workload.apply(st)
        self.tentative.clear()
        self.state_syncs += 1
        self.bytes_received += len(res.blob)
        self.metrics.on_received(len(res.blob))
        self.metrics.on_sync(st.rounds, len(res.blob))
        log.info("state synced: round %d, %d bytes from %d donors in %.2fs (failed donors: %d)", st.rounds,
                 len(res.blob), len(res.donors_used), res.seconds, len(res.donors_failed))
        self._emit("state_sync", round=st.rounds, bytes=len(res.blob), seconds=time.monotonic() - t0,
                   donors=list(res.donors_used), donors_failed=list(res.donors_failed))
        return True

    async def _play_round(self, update_grad: np.ndarray, loss: float) -> str:
        """Play the current round until it commits or this peer must resync.

        Returns "committed" (the new state is applied), "synced" (the committed state was
        downloaded instead) or "finished". The collective of an attempt runs as a task owned
        here, so an Abort for that attempt cancels it at once instead of waiting for deadlines.
        """
        wl = self.workload
        assert wl is not None
        r = wl.state.rounds
        collective: asyncio.Task | None = None
        attempt = -1

        async def stop_collective() -> None:
            if collective is not None and not collective.done():
                collective.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await collective

        t_ready = time.monotonic()
        self.waiting_round = r
        await self._announce(r, update_grad.size)
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(self.events.get(), timeout=self.config.round_silence)
                except TimeoutError:
                    log.info("no round event for %.0fs; announcing readiness again", self.config.round_silence)
                    await self._announce(r, update_grad.size)
                    continue
                if isinstance(ev, _Reconnected):
                    await stop_collective()
                    await self._announce(r, update_grad.size)
                    continue
                if isinstance(ev, _Forgotten):
                    if collective is None or collective.done():
                        await self._announce(r, update_grad.size)
                    continue
                kind = ev.WhichOneof("event")
                if kind == "finished":
                    if wl.state.rounds < ev.finished.rounds_committed:
                        await stop_collective()
                        await self._final_sync(ev.finished.rounds_committed, update_grad.size)
                    self.finished = True
                    return "finished"
                if kind == "sync":
                    if self._already_holds(ev.sync):
                        continue  # a duplicate or late order: nothing to do, a running collective goes on
                    await stop_collective()
                    try:
                        if not await self._sync(ev.sync):
                            continue  # a duplicate or late order: nothing to do
                    except SyncError as exc:
                        log.warning("state sync failed: %s; asking for another order", exc)
                        self._emit("state_sync_failed", round=ev.sync.round, reason=str(exc),
                                   donors_failed=list(exc.donors_failed))
                        await asyncio.sleep(random.uniform(0.05, 0.2))
                        await self._announce(r + 1, update_grad.size)
                        continue
                    return "synced"
                if kind == "plan" and ev.plan.round == r:
                    await stop_collective()
                    attempt = ev.plan.attempt
                    collective = asyncio.create_task(self._run_collective(ev.plan, update_grad, loss))
                elif kind == "commit" and ev.commit.round == r:
                    if collective is not None and not collective.done() and ev.commit.attempt == attempt:
                        await collective  # our vote is in (the round committed): let it finish
                    st = self.tentative.get((r, ev.commit.attempt))
                    self.tentative.clear()
                    fb = self.pending_feedback.get((r, ev.commit.attempt))
                    self.pending_feedback.clear()
                    if self.peer_id in ev.commit.participants and st is not None and st.digest() == ev.commit.state_digest:
                        wl.apply(st)
                        if fb is not None:
                            self._commit_feedback(fb)
                        acc = wl.evaluate()
                        self._emit("commit", round=r, attempt=ev.commit.attempt, loss=loss, test_accuracy=acc,
                                   state_digest=ev.commit.state_digest.hex(), participants=len(ev.commit.participants),
                                   bytes_sent=self.bytes_sent, flagged=list(ev.commit.flagged))
                        self.metrics.on_commit(r + 1, len(ev.commit.participants), time.monotonic() - t_ready, loss,
                                               acc)
                        return "committed"
                    # Committed without this peer (excluded, late, or a digest disagreement): its
                    # state is stale. Announce it at once; the coordinator answers with a sync order.
                    await stop_collective()
                    log.info("round %d committed without this peer; asking for state sync", r)
                    await self._announce(r + 1, update_grad.size)
                elif kind == "commit" and ev.commit.round > r:
                    # A later round committed: this peer missed the commit of its own round (or
                    # was left out since). It is behind; the coordinator answers with a sync order.
                    await stop_collective()
                    log.info("round %d committed while this peer waits in round %d; asking for state sync",
                             ev.commit.round, r)
                    await self._announce(r, update_grad.size)
                elif kind == "abort" and ev.abort.round == r:
                    if ev.abort.attempt == attempt:
                        await stop_collective()
                    self.tentative.pop((r, ev.abort.attempt), None)
                    self.metrics.on_abort(ev.abort.will_retry)
                    self._emit("abort", round=r, attempt=ev.abort.attempt, reason=ev.abort.reason,
                               excluded=list(ev.abort.excluded), will_retry=ev.abort.will_retry)
                    if self.peer_id in ev.abort.excluded or not ev.abort.will_retry:
                        await self._announce(r, update_grad.size)
        finally:
            self.waiting_round = None
            await stop_collective()

    async def _final_sync(self, rounds: int, n: int) -> None:
        """The run finished while this peer was behind: fetch the final state if a donor still
        serves it (peers linger `finish_linger` seconds after the end), within a bounded time."""
        wl = self.workload
        assert wl is not None
        try:
            async with asyncio.timeout(self.config.finish_linger + 2.0):
                resp = await self._ready(wl.state.rounds, n)
                if resp is not None and resp.HasField("sync") and resp.sync.donors:
                    await self._sync(resp.sync)
                    log.info("run finished at round %d; final state synced", rounds)
        except (TimeoutError, SyncError, grpc.aio.AioRpcError) as exc:
            log.warning("run finished at round %d; this peer stays at round %d (%s)", rounds, wl.state.rounds,
                        type(exc).__name__)

    async def _run_collective(self, plan: pb.Plan, update_grad: np.ndarray, loss: float) -> None:
        wl = self.workload
        assert wl is not None
        cp = self._last_plan = CollectivePlan.from_proto(plan)
        if self.peer_id not in cp.participants:
            return
        self.inbox.start(Session.from_plan(plan, self.coordinator_public_key))
        contribution, reducer = self._contribution(plan, cp, update_grad)
        vote = pb.VoteRequest(peer_id=self.peer_id, round=plan.round, attempt=plan.attempt, train_loss=loss)
        received_before = self.bytes_received
        try:
            owner_attack = None
            if self.config.attack in OWNER_ATTACKS:
                owner_attack = functools.partial(tamper, scale=self.config.attack_scale)
            res = await all_reduce(contribution, cp, me=self.peer_id, transport=self.transport, inbox=self.inbox,
                                   reducer=reducer, feedback=self.feedback, links=self.links, tamper=owner_attack)
            if not np.isfinite(res.values).all():  # never reached with honest owners; never applied
                raise CollectiveError("the aggregate holds non-finite values")
            st = wl.tentative(res.values)
            self.tentative[(plan.round, plan.attempt)] = st
            self.pending_feedback[(plan.round, plan.attempt)] = res.feedback
            self.bytes_sent += res.bytes_sent
            vote.ok = True
            vote.result_digest = res.digest
            vote.state_digest = st.digest()
            vote.bytes_sent = res.bytes_sent
            vote.collective_seconds = res.seconds
            vote.flagged.extend(res.flagged)
            up, down = self.metrics.on_collective(res.seconds, res.bytes_sent, self.bytes_received - received_before)
            await self._report_links(up, down)
        except CollectiveError as exc:
            log.warning("round %d.%d collective failed: %s", plan.round, plan.attempt, exc)
            vote.ok = False
            vote.error = str(exc)[:500]
            vote.suspects.extend(exc.suspects)
            vote.audit_failure = exc.audit
        finally:
            self.inbox.finish(plan.round, plan.attempt)
        await self._vote(vote)

    async def _report_links(self, up: float, down: float) -> None:
        """Tell the coordinator the passive link estimates (best effort: never fails a round)."""
        assert self.stub is not None
        try:
            await self.stub.ReportLinks(pb.LinkReport(peer_id=self.peer_id, up_bytes_per_s=up, down_bytes_per_s=down,
                                                      shm_peers=self._shm_peers()),
                                        timeout=self.config.rpc_timeout)
        except grpc.aio.AioRpcError as exc:
            log.debug("link report not delivered: %s", exc.code().name)
    def _shm_peers(self) -> list[str]:
        """Participants of the last plan this peer reaches through shared memory."""
        plan = self._last_plan
        return self.transport.shm_peers(zip(plan.participants, plan.addresses)) if plan is not None else []

    def _contribution(self, plan: pb.Plan, cp: CollectivePlan, update_grad: np.ndarray) -> tuple[np.ndarray, OwnerReduction | None]:
        """What this peer sends, and the owner-side reduction (docs/aggregation.md).

        Butterfly: the unweighted pseudo-gradient; owners run the run's aggregator with the
        plan's sample counts as weights. Ring (plain sum): the pseudo-gradient pre-weighted by
        n_i / sum n, so the sum is FedAvg's weighted mean.
        """
        cfg = self.workload.cfg
        grad = update_grad.astype(np.float32)
        if self.config.attack in ATTACKS:
            grad = forge(self.config.attack, grad, self.attack_rng, self.config.attack_scale)
        if cp.collective == "butterfly":
            name = plan.aggregator or cfg.aggregator
            spec = cfg.reduction_spec()
            if name != spec.aggregator:
                spec = dataclasses.replace(spec, aggregator=name, params={})
            weights = np.array([p.num_samples or 1 for p in plan.participants], dtype=np.float64)
            return grad, OwnerReduction(spec, weights, grad.size)
        total = sum(p.num_samples for p in plan.participants) or len(plan.participants)
        mine = next(p.num_samples for p in plan.participants if p.peer_id == self.peer_id)
        return (grad * np.float32((mine or 1) / total)).astype(np.float32), None

    def _commit_feedback(self, updates: tuple) -> None:
        """Keep exactly the compression residuals of the committed attempt."""
        self.feedback.reset()
        for key, compensated, decoded in updates:
            self.feedback.update(key, compensated, decoded)

    # ------------------------------------------------------------ main

    async def run(self) -> dict:
        """Join, train until the coordinator finishes the run, leave. Returns a summary dict."""
        self.service = PeerService(self.inbox, self, on_bytes=self._count_received, links=self.links,
                                   shared_memory=self.config.shared_memory)
        health_box: list = []
        server, bound = await serve_data_plane(
            self.service, self.config.listen, self.config.security,
            before_start=lambda s: health_box.append(attach(s, (PEER_SERVICE,))))
        self.address = self.config.advertise or bound
        health = health_box[0]
        await health.serving()
        self.metrics.serve(self.config.metrics_port, self.config.metrics_host)
        self.channel = open_channel(self.config.coordinator, self.config.security, channel_options(),
                                    signing_interceptors(self.key))
        self.stub = pb_grpc.CoordinatorStub(self.channel)
        try:
            resp = await self._join()
            cfg = RunConfig.from_json(resp.run_config_json)
            self.workload = await asyncio.to_thread(self.workload_factory, cfg)
            log.info("joined as %s (data %s, %d samples, %d params)", self.peer_id[:8], self.address,
                     self.workload.num_samples, self.workload.num_params)
            if self.config.ready_file:
                pathlib.Path(self.config.ready_file).write_text(self.address)
            async with asyncio.TaskGroup() as tg:
                hb = tg.create_task(self._heartbeat_loop())
                watch = tg.create_task(self._watch_loop())
                try:
                    await self._main_loop()
                finally:
                    self.finished = True
                    hb.cancel()
                    watch.cancel()
            acc = self.workload.evaluate()
            summary = {"peer": self.peer_id, "rounds": self.workload.state.rounds, "test_accuracy": acc,
                       "state_digest": self.committed_state()[2].hex(), "bytes_sent": self.bytes_sent,
                       "bytes_received": self.bytes_received, "state_syncs": self.state_syncs,
                       "params_finite": bool(np.isfinite(self.workload.state.params).all())}
            self._emit("finished", **{k: v for k, v in summary.items() if k != "peer"})
            # Serve the final state a little longer, for a peer that fell behind at the end.
            await asyncio.sleep(self.config.finish_linger)
            try:
                await self.stub.Leave(pb.LeaveRequest(peer_id=self.peer_id), timeout=2.0)
            except grpc.aio.AioRpcError:
                pass
            return summary
        finally:
            await health.shutdown()
            await self.transport.close()
            await self.channel.close()
            await server.stop(grace=0.5)
            self.service.close()
            self.metrics.close()

    def _count_received(self, n: int) -> None:
        self.bytes_received += n
        self.metrics.on_received(n)

    async def _main_loop(self) -> None:
        wl = self.workload
        assert wl is not None
        while not self.finished:
            if self.pending_sync is not None:
                order, self.pending_sync = self.pending_sync, None
                try:
                    await self._sync(order)
                except SyncError as exc:
                    log.warning("state sync failed: %s; asking again", exc)
                    self._emit("state_sync_failed", round=order.round, reason=str(exc),
                               donors_failed=list(exc.donors_failed))
            faults.hit("train", wl.state.rounds)
            measuring = asyncio.create_task(self._measure_links())  # probes run while the model trains
            try:
                update = await asyncio.to_thread(wl.local_update)
            except WorkloadClosed:
                measuring.cancel()
                await asyncio.gather(measuring, return_exceptions=True)
                log.info("workload closed by its owner; leaving the swarm")
                self.finished = True
                return
            except BaseException:
                measuring.cancel()
                await asyncio.gather(measuring, return_exceptions=True)
                raise
            await measuring
            await self._play_round(update.pseudo_grad, update.loss)

    async def _measure_links(self) -> None:
        """Probe the last round's participants without link history, report to the coordinator.

        Never raises: a failed probe or report only leaves the coordinator with older estimates
        (bounded by LINK_MEASURE_SECONDS in all).
        """
        plan = self._last_plan
        if plan is None or self.stub is None:
            return
        try:
            async with asyncio.timeout(LINK_MEASURE_SECONDS):
                await probe_missing(self.links, self.transport, zip(plan.participants, plan.addresses), self.peer_id)
                await self.transport.probe_lanes(a for pid, a in zip(plan.participants, plan.addresses)
                                                 if pid != self.peer_id)
                report = self.links.report(self.peer_id)
                report.shm_peers.extend(self._shm_peers())
                await self.stub.ReportLinks(report, timeout=self.config.rpc_timeout)
        except (grpc.aio.AioRpcError, TimeoutError) as exc:
            log.debug("link report not delivered: %s", exc)


async def run_peer(config: PeerConfig, workload_factory: Callable[[RunConfig], Workload] | None = None) -> dict:
    """Run one peer to completion (see PeerAgent)."""
    return await PeerAgent(config, workload_factory).run()
