"""The peer agent: joins a swarm, keeps its lease, trains, and plays rounds through a RoundClient.

`PeerAgent.run()` owns the lifecycle: the data-plane server, the join, the heartbeat and the
round-event watch (tasks of one TaskGroup: a crash in either surfaces at once), the training loop
(local training with link probes alongside, in a TaskGroup too), the summary, the events file and
the metrics. Each round is played by `peer.rounds.RoundClient` (announce, plan, collective, vote,
commit/abort, sync); every control-plane call goes through `peer.control.CoordinatorClient`
under the one retry policy of shoal.common.retry. `run()` returns when the coordinator says the
run is finished (or raises if the peer cannot continue). Failure semantics:
- The coordinator is unreachable or restarted: calls are retried with exponential backoff and
  jitter up to `connect_timeout`; the watch stream reconnects; an expired lease is re-acquired by
  joining again with the same identity. A round in flight at that moment is treated as aborted
  and played again. A status that is not transient (a refusal, a server bug) ends `run()` with it.
- A collective fails (a stream breaks, an aggregator raises, ...): the peer votes "failed" with
  the reason; its committed state is untouched (the collective never mutates inputs) and it
  plays the retry if not excluded.
- Its state is stale (excluded from a committed round, restarted, joined late, digest
  disagrees): it downloads the committed state from donors and verifies its digest first.
- The workload is closed by its owner (`WorkloadClosed` from `local_update`, e.g. a PyTorch
  loop that stopped): the agent leaves the swarm cleanly and `run()` returns.

What is trained is pluggable: `PeerAgent(config, workload_factory=...)` takes any
peer.workloads.base.Workload (default: peer.workloads.digits.DigitsWorkload on the peer's data shard), and
`contribution=` what it sends (default: FedAvg's weighted mean, peer.contribution). The
all-reduce benchmark job (shoal.bench.collective_job) runs this same agent with an ArrayWorkload and
the plain sum. Metrics (shoal.common.metrics.PeerMetrics) are always recorded and served when
`metrics_port` is set; the data-plane server also carries gRPC health checking and reflection.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import json
import logging
import pathlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc
import numpy as np

import shoal
from shoal.common.health import PEER_SERVICE, attach
from shoal.common.identity import hold_default_key, hold_key, peer_id_of, public_bytes
from shoal.common.metrics import PeerMetrics
from shoal.common.limits import LINK_RTT_MAX_SECONDS
from shoal.common.plan import Plan
from shoal.common.pauses import RunClock, keep_reading
from shoal.common.retry import RetryPolicy
from shoal.common.security import Security, open_channel, signing_interceptors
from shoal.common.throttle import Throttle, more
from shoal.peer.testing import faults
from shoal.peer.testing.byzantine import OWNER_ATTACKS, VOTE_ATTACKS, forge_ballot, tamper
from shoal.peer.checkpoints import Checkpointer, resume
from shoal.peer.contribution import Contribution, FedAvgContribution, Forgery
from shoal.peer.control import CoordinatorClient
from shoal.peer.sparse import warm_kernels
from shoal.common.certs import PeerTLS
from shoal.peer.certificates import keep_renewed, legacy_mode, take_join_certificate
from shoal.peer.dataplane import Inbox, PeerService, StateSource, Transport, channel_options, serve_data_plane
from shoal.peer.lanes.relay import RelayLink
from shoal.peer.links import COORDINATOR, COORDINATOR_PROBE_BYTES, LinkMeter, probe_missing, probe_peer
from shoal.peer.rounds import (Aborted, CollectiveRecord, EventMailbox, Outcome, Reconnected, RoundClient,
                               RoundListener, RoundOutcome, RunFinished, SyncRecord, SyncSettings, Traffic,
                               VoteRecord, event_of)
from shoal.peer.state_sync import HELD_STATES, HeldStates, SyncError
from shoal.peer.secure_round import SecureAggregation
from shoal.peer.training import LocalUpdate, RunConfig
from shoal.peer.workloads.digits import DigitsWorkload
from shoal.peer.workloads.base import Workload, WorkloadClosed
from shoal.v1 import shoal_pb2 as pb
from shoal.v1 import shoal_pb2_grpc as pb_grpc

log = logging.getLogger("shoal.peer")
UPLOAD_GRACE_SECONDS = 60.0  # at the run's end, how long a peer waits for its last checkpoint write and upload

LINK_MEASURE_SECONDS = 30.0  # probes + report between two rounds, at most
COORDINATOR_PROBE_TRIES = 3  # before the first plan (see PeerAgent._probe_coordinator)
COMMIT_LOG_SECONDS = 1.0  # at most one INFO "round N committed" line per second (the rest at debug)
LEAVE_GRACE_SECONDS = 5.0  # a graceful leave lets the round in play end for this long, then abandons it


class SecureAggregationRequired(Exception):
    """The peer requires secure aggregation (`PeerConfig.require_secure_aggregation`) and the run
    it joined has it off: it left before sending anything (one line, the CLI's usage error)."""


@dataclass(frozen=True)
class PeerConfig:
    """Settings of `shoal peer` (see docs/configuration.md).

    rpc_timeout: per control-plane call, seconds. backoff_initial / backoff_max: retry backoff
    bounds, seconds (exponential with full jitter, shoal.common.retry). connect_timeout: how long
    a control-plane call (or a coordinator outage) is retried before the peer gives up.
    round_silence: if no round event arrives for this long while waiting, the peer re-announces
    itself (covers a coordinator that restarted and forgot the ready set). sync_donors: donors
    used in parallel for state sync. advertise: the data-plane HOST:PORT other peers dial
    (default: the bound address; set it behind NAT or in containers). metrics_port: Prometheus
    /metrics port, 0 = off. freeze_heap: once joined, with its workload built, the process's heap
    is moved out of the cyclic garbage collector's full collections (`gc.freeze`); for a process
    that is one peer (`shoal peer`, the benchmark's job), not a user's program hosting one.
    """

    coordinator: str = "127.0.0.1:7070"
    listen: str = "127.0.0.1:0"
    key_path: str | None = None  # None: the per-user default (shoal.common.identity.hold_default_key)
    name: str | None = None  # names the default key file (peer-<name>.key)
    data_shard: int = 0
    events_path: str | None = None
    ready_file: str | None = None
    rpc_timeout: float = 5.0
    backoff_initial: float = 0.05
    backoff_max: float = 2.0
    round_silence: float = 15.0
    sync_donors: int = 3
    sync_range_bytes: int = 256 << 10
    finish_linger: float = 1.0  # seconds the data plane keeps serving the final state after the run ends
    held_states: int = HELD_STATES  # committed states a donor keeps serving: the newest and those before it
    connect_timeout: float = 120.0
    security: Security = Security(insecure=True)
    join_token: str = ""
    advertise: str | None = None
    metrics_port: int = 0
    metrics_host: str = "0.0.0.0"
    shared_memory: bool = True  # the shared-memory lane to peers on this host (peer.lanes.shm)
    tcp_lane: bool = True  # the bulk lane to peers on other hosts (peer.lanes.bulk; mutual TLS when TLS is on)
    bulk_connections: int = 16  # most connections of the bulk lane's pool to one peer (peer.lanes.pool)
    outbound_only: bool = False  # take part without being dialled, as behind NAT (docs/nat.md)
    relay: str | None = None  # HOST:PORT of a relay to be reached through (peer.lanes.relay; docs/nat.md)
    attack: str = ""  # testing only: send forged updates (peer.testing.byzantine); "" = honest
    attack_scale: float | None = None
    freeze_heap: bool = False
    checkpoint_dir: str | None = None  # peer.checkpoints: a checkpoint every checkpoint_every rounds, keep the last K
    checkpoint_every: int = 10
    checkpoint_keep: int = 3
    checkpoint_url: str | None = None  # peer.checkpoint_store: the swarm's shared store (file:// or s3://)
    require_secure_aggregation: bool = False  # leave (SecureAggregationRequired) a run without secure aggregation


def freeze_heap() -> None:
    """Move every object alive now (modules, the workload's model and data, the gRPC machinery)
    into the garbage collector's permanent generation, after a full collection (`gc.freeze`, as
    Instagram's servers and this project's coordinator, `coordinator.heap`, do). They live as long
    as the process, and every full collection scanned them again: measured in a benchmark job
    (4 x 64 MB), two per run of 50-157 ms each, a peer's event loop stopped mid-round, against
    under 1.2 ms after the freeze. Objects frozen here are
    still freed by reference counting; only ones that end in a reference cycle stay."""
    gc.collect()
    gc.freeze()


class _Journal(RoundListener):
    """What the agent records of the rounds: the events file (JSON lines: "commit", "abort",
    "vote", "state_sync", "state_sync_failed"; "finished" comes from the agent), the metrics,
    and the donor's held states."""

    def __init__(self, agent: PeerAgent):
        self.agent = agent
        self.commit_lines = Throttle(COMMIT_LOG_SECONDS)
        self.collective_bytes = (0, 0)  # (sent, received) by the last collective

    def on_plan(self, plan: Plan) -> None:  # the swarm's per-attempt table (shoal.testbeds.scenario.rounds_report)
        self.agent.emit("plan", round=plan.round, attempt=plan.attempt, collective=plan.collective,
                        participants=list(plan.participants), demoted=list(plan.demoted),
                        predicted_seconds=plan.predicted_seconds, predicted_round_seconds=plan.predicted_round_seconds,
                        outbound_only=[plan.participants[i] for i in plan.outbound_only])

    def on_collective(self, rec: CollectiveRecord) -> None:
        self.agent.metrics.on_collective(rec.seconds, rec.bytes_sent, rec.bytes_received)
        self.collective_bytes = (rec.bytes_sent, rec.bytes_received)
        # The traffic of each attempt in time (the summary's peak bytes per second, bytes per round).
        secure = {} if rec.secure is None else {
            "secure_bytes_sent": rec.secure.bytes_sent, "secure_bytes_received": rec.secure.bytes_received,
            "secure_seconds": rec.secure.seconds, "secure_revealed": rec.secure.revealed}
        self.agent.emit("collective", round=rec.plan.round, attempt=rec.plan.attempt, fragment=rec.plan.fragment,
                        bytes_sent=rec.bytes_sent, bytes_received=rec.bytes_received,
                        started_at=rec.started_at, ended_at=rec.ended_at, **secure)
        # Much slower than predicted: probe these links again before the next Ready (a re-plan).
        # Peers reached through shared memory are left out: no network link held that round up.
        plan, a = rec.plan, self.agent
        local = set(a.transport.shm_peers(zip(plan.participants, plan.addresses)))
        a.links.after_collective([p for p in plan.participants if p not in local], a.peer_id, rec.seconds,
                                 plan.predicted_seconds)

    def on_vote(self, rec: VoteRecord) -> None:
        fields = {"reason": rec.reason, "suspects": list(rec.suspects), "failed_at": rec.failed_at} if not rec.ok else {}
        self.agent.emit("vote", round=rec.round, attempt=rec.attempt, ok=rec.ok, delivered=rec.delivered, **fields)

    def on_outcome(self, o: RoundOutcome) -> None:
        a = self.agent
        a.held.hold()
        if o.kind is not Outcome.COMMITTED:
            return
        acc = a.workload.evaluate()
        a.emit("commit", round=o.round, attempt=o.attempt, loss=o.loss, test_accuracy=acc,
               state_digest=o.state_digest.hex(), participants=o.participants, bytes_sent=a.traffic.bytes_sent,
               flagged=list(o.flagged), **({"epsilon": o.epsilon} if o.epsilon else {}))
        a.metrics.on_commit(o.round + 1, o.participants, o.seconds, o.loss, acc)
        held = self.commit_lines.due()  # one line per committed round, at most one a second at INFO
        sent, received = self.collective_bytes
        log.log(logging.DEBUG if held is None else logging.INFO,
                "round %d committed: loss %.4f, %.2fs, %.2f MB sent, %.2f MB received%s", o.round, o.loss,
                o.seconds, sent / 1e6, received / 1e6, more(held or 0))

    def on_abort(self, ev: Aborted) -> None:
        self.agent.metrics.on_abort(ev.will_retry)
        self.agent.emit("abort", round=ev.round, attempt=ev.attempt, reason=ev.reason, excluded=list(ev.excluded),
                        will_retry=ev.will_retry)

    def on_sync(self, rec: SyncRecord) -> None:
        a = self.agent
        a.held.hold()
        a.metrics.on_received(rec.bytes)
        a.metrics.on_sync(rec.rounds, rec.bytes)
        a.emit("state_sync", round=rec.rounds, bytes=rec.bytes, seconds=rec.seconds, donors=list(rec.donors),
               donors_failed=list(rec.donors_failed))

    def on_sync_failed(self, order: pb.SyncOrder, exc: SyncError) -> None:
        self.agent.emit("state_sync_failed", round=order.round, reason=str(exc), donors_failed=list(exc.donors_failed))


class PeerAgent(StateSource):
    """One peer of a swarm; see the module docstring.

    contribution: what this peer sends (default: FedAvg's weighted mean with the run's
    aggregator, forged when `config.attack` says so). listeners: told about every round besides
    the agent's own journal (e.g. the benchmark job's report).
    """

    def __init__(self, config: PeerConfig, workload_factory: Callable[[RunConfig], Workload] | None = None,
                 metrics: PeerMetrics | None = None, *, contribution: Contribution | None = None,
                 listeners: Sequence[RoundListener] = ()):
        self.config = config
        self.workload_factory = workload_factory or (lambda cfg: DigitsWorkload(cfg, config.data_shard))
        self.contribution = contribution or FedAvgContribution(
            lambda: self.workload.cfg.reduction_spec(), Forgery(config.attack, config.attack_scale),
            dp=lambda: self.workload.cfg.dp_settings())
        self.metrics = metrics or PeerMetrics()
        held = hold_key(config.key_path) if config.key_path else \
            hold_default_key(config.name, int(config.listen.rsplit(":", 1)[1]))  # KeyInUse: one process per key
        self.key, self.key_path = held.key, held.path
        self.public_key = public_bytes(self.key)
        self.inbox = Inbox()
        # The data-plane certificate issued at join (TLS without a legacy shared peer.key).
        self.peer_tls = PeerTLS(peer_id_of(self.public_key)) \
            if config.security.tls_dir and not legacy_mode(config.security) else None
        self.transport = Transport(config.security, self.key, shared_memory=config.shared_memory,
                                   peer_tls=self.peer_tls, tcp_lane=config.tcp_lane,
                                   bulk_connections=config.bulk_connections)
        self.relay_link: RelayLink | None = None  # set in run() with --relay
        self.ticket_join = False  # joining outbound-only for a relay ticket (before registering at the relay)
        self.links = LinkMeter()  # passive from the collectives' streams, probes when no history
        self.retry = RetryPolicy(config.backoff_initial, config.backoff_max, config.connect_timeout)
        self.events = EventMailbox()  # coalesced: the newest state of the world, never a backlog
        self.traffic = Traffic()
        self.held = HeldStates(lambda: self.workload.state, config.held_states)
        self.listeners = [_Journal(self), *listeners]
        self.workload: Workload | None = None
        self.control: CoordinatorClient | None = None
        self.rounds: RoundClient | None = None
        self.address = ""
        self.clock = RunClock()  # this process's own time (a SIGSTOP shows as a pause)
        self.unreachable = ""  # why the coordinator could not dial this peer's address back (JoinResponse)
        self.finished = False
        self.run_over = asyncio.Event()  # the coordinator said the run finished (the event may still wait in the queue)
        self.too_late: pb.Finished | None = None  # the run had finished when this peer joined (JoinResponse)
        self.leaving = False  # stop was set: no new round (run's graceful leave)
        self.playing = False  # inside RoundClient.play
        self.service: PeerService | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # run()'s: the checkpoint writer's reports go there
        self.checkpointer = Checkpointer(
            config.checkpoint_dir, config.checkpoint_every, config.checkpoint_keep, url=config.checkpoint_url,
            on_written=self._from_writer(self._checkpoint_written), on_uploaded=self._from_writer(self._uploaded),
            on_failed=self._from_writer(self.metrics.on_checkpoint_failed), helper=True) if config.checkpoint_dir else None
        self._events_file = open(config.events_path, "a", buffering=1) if config.events_path else None

    @property
    def peer_id(self) -> str:
        return self.control.peer_id if self.control is not None else ""

    @property
    def bytes_sent(self) -> int:
        return self.traffic.bytes_sent

    @property
    def bytes_received(self) -> int:
        return self.traffic.bytes_received

    @property
    def state_syncs(self) -> int:
        return self.traffic.state_syncs

    # ------------------------------------------------------------ state source (donor side)

    def committed_state(self) -> tuple[int, bytes, bytes]:
        return self.held.committed_state()

    def state_for(self, rounds: int, holder: str = "", until: float = 0.0) -> tuple[bytes, bytes] | None:
        return self.held.state_for(rounds, holder, until)

    def emit(self, event: str, **fields) -> None:
        """Append one record to the events file (if any): {"event", "peer", "t", **fields}."""
        if self._events_file is not None:
            rec = {"event": event, "peer": self.peer_id, "t": time.time(), **fields}
            self._events_file.write(json.dumps(rec) + "\n")

    # ------------------------------------------------------------ membership

    def _join_request(self) -> pb.JoinRequest:
        samples = self.workload.num_samples if self.workload else 0
        return pb.JoinRequest(public_key=self.public_key, data_address=self.address, num_samples=samples,
                              version=shoal.__version__, join_token=self.config.join_token,
                              tls_csr=self.peer_tls.csr() if self.peer_tls is not None else b"",
                              outbound_only=self.config.outbound_only or self.ticket_join,
                              relay=self.relay_link.relay if self.relay_link is not None else "",
                              relay_bytes_per_s=self.relay_link.capacity if self.relay_link is not None else 0.0)

    def _joined(self, resp: pb.JoinResponse) -> None:
        if self.relay_link is not None and resp.relay_ticket:
            self.relay_link.ticket = resp.relay_ticket
        if self.peer_tls is not None:
            take_join_certificate(self.peer_tls, resp, self.config.coordinator)
        if self.service is not None:
            self.service.coordinator_public_key = resp.coordinator_public_key
        if resp.unreachable and resp.unreachable != self.unreachable:
            # Once per cause, not per rejoin: the one line that tells the operator what is wrong.
            log.warning("the coordinator cannot reach this peer's data address %s (%s): it takes part "
                        "outbound-only (owns no shard, serves no state; docs/nat.md); fix --advertise or the "
                        "firewall/port forwarding and restart to take part fully", self.address, resp.unreachable)
        elif not resp.unreachable and self.unreachable:
            log.info("data address %s is reachable again", self.address)
        self.unreachable = resp.unreachable

    async def _renew_lease_while_starting(self) -> None:
        """Heartbeat every heartbeat interval until cancelled (between Join and the round protocol;
        the answers carry nothing the peer needs yet)."""
        while True:
            await asyncio.sleep(self.control.heartbeat_interval)
            await self.control.heartbeat()

    async def _heartbeat_loop(self) -> None:
        """Renew the lease every heartbeat interval; each answer goes to the RoundClient (the
        safety net for a lost Ready, `RoundClient.heard`)."""
        while not self.finished:
            await asyncio.sleep(self.control.heartbeat_interval)
            sent = time.monotonic()
            resp = await self.control.heartbeat()
            if resp is not None:
                self.rounds.heard(resp, sent)

    async def _deliver(self, msg: pb.RoundEvent) -> bool:
        """One event from the watch stream onto the queue; True once the run finished."""
        if msg.HasField("commit") and faults.dropped("commit-event", msg.commit.round):
            log.warning("fault injection: commit of round %d lost", msg.commit.round)
            return False
        ev = event_of(msg)
        if ev is not None:
            await self.events.put(ev)
        finished = isinstance(ev, RunFinished)
        if finished:
            self.run_over.set()
        return finished

    async def _reconnected(self) -> None:
        await self.events.put(Reconnected())

    # ------------------------------------------------------------ main

    async def run(self, stop: asyncio.Event | None = None) -> dict:
        """Join, train until the coordinator finishes the run (or `stop` is set: SIGTERM), leave.
        Returns a summary dict: peer, rounds, test_accuracy, state_digest (hex), bytes_sent,
        bytes_received, state_syncs, params_finite, left (True when it stopped before the end).

        `stop` is a graceful leave: a round this peer is playing gets LEAVE_GRACE_SECONDS to end
        (its vote arrives, the others need not abort the attempt), training or waiting is
        abandoned at once; then Leave, and everything is closed (shared-memory slabs included)."""
        self._loop = asyncio.get_running_loop()
        self.service = PeerService(self.inbox, self.held, on_bytes=self._count_received, links=self.links,
                                   shared_memory=self.config.shared_memory, key=self.key)
        health_box: list = []
        server, bound = await serve_data_plane(
            self.service, self.config.listen, self.config.security,
            before_start=lambda s: health_box.append(attach(s, (PEER_SERVICE,))), peer_tls=self.peer_tls,
            tcp_lane=self.config.tcp_lane)
        self.address = self.config.advertise or bound
        # Behind NAT with a relay: reachable through it (a reverse tunnel into `bound`).
        relay = self.relay_link = RelayLink(self.config.relay, self.key, bound, on_registered=self._advertise_relayed,
                                            on_ticket=self._relay_ticket) if self.config.relay else None
        health = health_box[0]
        await health.serving()
        self.metrics.serve(self.config.metrics_port, self.config.metrics_host)
        channel = open_channel(self.config.coordinator, self.config.security, channel_options(),
                               signing_interceptors(self.key))
        self.control = CoordinatorClient(pb_grpc.CoordinatorStub(channel), self.retry,
                                         rpc_timeout=self.config.rpc_timeout, join_request=self._join_request,
                                         on_join=self._joined, target=self.config.coordinator)
        try:
            # A signal while the relay or the coordinator does not answer yet ends the process too
            # (the retries run up to --connect-timeout; nobody should need kill -9).
            if not await _unless_stopped(self._register_and_join(relay), stop):
                log.info("stopped before it joined the swarm")
                return {"peer": peer_id_of(self.public_key), "rounds": 0, "left": True}
            if self.too_late is not None:
                log.info("the run had already finished (%d rounds committed, %s) when this peer joined; "
                         "nothing to do", self.too_late.rounds_committed, self.too_late.reason or "done")
                self.emit("too_late", rounds_committed=self.too_late.rounds_committed)
                return {"peer": self.peer_id, "rounds": 0, "left": False, "joined_after_the_run_finished": True}
            async with asyncio.TaskGroup() as tg:
                hb = tg.create_task(self._heartbeat_loop())
                pauses = tg.create_task(keep_reading(self.clock))  # notices when this process did not run
                watch = tg.create_task(self.control.watch(self._deliver, self._reconnected))
                renew = tg.create_task(keep_renewed(self.control, self.peer_tls, self.config.rpc_timeout)) \
                    if self.peer_tls is not None else None
                try:
                    left = await self._play_until(stop)
                finally:
                    self.finished = True
                    hb.cancel()
                    pauses.cancel()
                    watch.cancel()
                    if renew is not None:
                        renew.cancel()
            await self._close_checkpoints(UPLOAD_GRACE_SECONDS)  # the last write and upload, bounded
            summary = {**self._summary(), "left": left}
            self.emit("left" if left else "finished", **{k: v for k, v in summary.items() if k != "peer"})
            if not left:  # serve the final state a little longer, for a peer that fell behind at the end
                await asyncio.sleep(self.config.finish_linger)
            await self.control.leave()
            return summary
        finally:
            if self.checkpointer is not None:
                self.checkpointer.close(0)  # an error's way out: a write in flight is abandoned
            await health.shutdown()
            if relay is not None:
                await relay.close()
            await self.transport.close()
            await channel.close()
            await server.stop(grace=0.5)
            self.service.close()
            self.metrics.close()

    async def _register_and_join(self, relay: RelayLink | None) -> None:
        """With --relay: join outbound-only for a relay ticket (a relay started with the
        coordinator's key admits only its members), register at the relay (RelayRefused,
        OSError); then `_start`, which joins with the relayed address."""
        if relay is not None:
            await self._relay_ticket()
            if self.too_late is not None:
                return
            self.address = await relay.start(self.config.connect_timeout)
        await self._start()

    async def _relay_ticket(self) -> None:
        """Join outbound-only (nobody dials this peer back meanwhile): the answer carries a fresh
        relay ticket (`_joined`)."""
        self.ticket_join = True
        try:
            resp = await self.control.join()
        finally:
            self.ticket_join = False
        if resp.HasField("finished"):
            self.too_late = resp.finished

    async def _advertise_relayed(self, moved: bool) -> None:
        """Registered at a relay again. When the relayed address moved (another relay, a port the
        restarted relay could not bind again), a fresh ticket was taken, or the coordinator could
        not dial this peer meanwhile (its last join answer said so): join again with the address,
        dialled back through the relay."""
        assert self.relay_link is not None
        if self.rounds is None or not (moved or self.unreachable):  # not joined yet: `_start` joins
            return
        self.address = self.relay_link.address
        log.info("advertising the relayed address %s (relay %s)", self.address, self.relay_link.relay)
        await self.control.join()

    def _secure(self, cfg: RunConfig) -> SecureAggregation | None:
        """This peer's side of secure aggregation when the run has it on (peer.secure_round)."""
        params = cfg.secagg_params()
        if params is None:
            return None
        assert self.control is not None
        return SecureAggregation(params, self.peer_id, self.control.secagg_post, self.control.secagg_fetch,
                                 self.key.sign)

    async def _start(self) -> None:
        """Join, build the workload from the run's configuration, and the round protocol."""
        resp = await self.control.join()
        if resp.HasField("finished"):
            self.too_late = resp.finished
            return
        cfg = RunConfig.from_json(resp.run_config_json)
        if self.config.require_secure_aggregation and not cfg.secure_aggregation:
            await self.control.leave()
            raise SecureAggregationRequired(f"the run at {self.config.coordinator} has secure_aggregation off and "
                                            "this peer requires it (--require-secure-aggregation): it left")
        # Building a workload (a dataset, a model) can outlast a lease on a busy machine: the
        # lease is renewed meanwhile, or the coordinator would drop a member that did nothing wrong.
        # A sparse run's codec kernels are compiled (or loaded from numba's cache) first: their fixed
        # memory comes before the model's, and round 0 does not wait for the compiler.
        renewing = asyncio.create_task(self._renew_lease_while_starting())
        try:
            sparse = cfg.sparse_settings()
            if sparse is not None:
                log.info("preparing the %s codec's kernels (compiled on a machine's first sparse run: ~10 s, "
                         "longer with several peers on few cores; under 1 s from the cache after that)", sparse.codec.kind)
                await asyncio.to_thread(warm_kernels, sparse.codec)
            self.workload = await asyncio.to_thread(self.workload_factory, cfg)
        finally:
            renewing.cancel()
            await asyncio.gather(renewing, return_exceptions=True)
        owner_attack = functools.partial(tamper, scale=self.config.attack_scale) \
            if self.config.attack in OWNER_ATTACKS else None
        vote_attack = functools.partial(forge_ballot, self.config.attack, rng=np.random.default_rng()) \
            if self.config.attack in VOTE_ATTACKS else None
        self.rounds = RoundClient(
            self.control, self.workload, self.contribution, inbox=self.inbox, transport=self.transport,
            links=self.links, events=self.events, round_silence=self.config.round_silence,
            finish_linger=self.config.finish_linger,
            sync=SyncSettings(self.config.sync_donors, self.config.sync_range_bytes), listeners=self.listeners,
            traffic=self.traffic, tamper=owner_attack, clock=self.clock, forge_vote=vote_attack,
            sparse=cfg.sparse_settings(), secure=self._secure(cfg))
        if self.checkpointer is not None:  # a restart resumes from its newest verified checkpoint
            await asyncio.to_thread(self.checkpointer.fetch_from_store)  # a newer one from the shared store
            ckpt = await asyncio.to_thread(resume, self.workload, self.checkpointer.directory)
            if ckpt is not None:
                self.checkpointer.last_round = ckpt.round
                self.rounds.checkpoint = (ckpt.round, ckpt.digest)
                self.emit("resumed", round=ckpt.round, digest=ckpt.manifest["digest"], path=str(ckpt.path))
        self.held.hold()
        if self.config.freeze_heap:
            freeze_heap()
        log.info("joined as %s (key file %s, data %s, %d samples, %d params)", self.peer_id[:8], self.key_path,
                 self.address, self.workload.num_samples, self.workload.num_params)
        if self.config.ready_file:
            pathlib.Path(self.config.ready_file).write_text(self.address)

    def _summary(self) -> dict:
        st = self.workload.state
        return {"peer": self.peer_id, "rounds": st.rounds, "test_accuracy": self.workload.evaluate(),
                "state_digest": st.digest().hex(), "bytes_sent": self.bytes_sent,
                "bytes_received": self.bytes_received, "state_syncs": self.state_syncs,
                # chunk bytes this peer sent to relayed participants (through a relay; docs/nat.md)
                "relayed_bytes_sent": self.transport.relayed_bytes_sent,
                "params_finite": bool(np.isfinite(st.params).all())}

    def _count_received(self, n: int) -> None:
        self.traffic.bytes_received += n
        self.metrics.on_received(n)

    async def _play_until(self, stop: asyncio.Event | None) -> bool:
        """The main loop until the run ends (False) or `stop` is set (True, see `run`)."""
        main = asyncio.ensure_future(self._main_loop())
        # When run() goes down first (a fenced or revoked peer: its watch stream fails), `main` may
        # still end with an error (a call on the closed channel); that is expected, not to be logged.
        main.add_done_callback(lambda t: t.cancelled() or t.exception())
        waits = {main} if stop is None else {main, asyncio.ensure_future(stop.wait())}
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # run() itself cancelled: the loop goes with it
            main.cancel()
            raise
        finally:
            for w in waits - {main}:
                w.cancel()
        if not main.done():
            self.leaving = True  # no new round
            log.info("stopping: leaving the swarm%s", " once this round ends" if self.playing else "")
            if self.playing:
                await asyncio.wait({main}, timeout=LEAVE_GRACE_SECONDS)
            main.cancel()
            await asyncio.wait({main})
        if not main.cancelled() and main.exception() is not None:
            raise main.exception()
        return self.leaving

    async def _main_loop(self) -> None:
        """Train and play rounds until the run finishes, the workload is closed or the peer leaves."""
        while not self.finished and not self.leaving:
            order = self.control.take_sync()
            if order is not None:
                await self.rounds.try_sync(order)
            faults.hit("train", self.workload.state.rounds)
            update = await self._train()
            if update is None:
                log.info("workload closed by its owner; leaving the swarm")
                return
            self.playing = True
            try:
                outcome = await self.rounds.play(update.pseudo_grad, update.loss, num_samples=update.num_samples,
                                                 local_steps=update.steps, local_seconds=update.seconds)
            finally:
                self.playing = False
            if outcome.kind is Outcome.FINISHED:
                break
            if outcome.kind is Outcome.COMMITTED:
                self._checkpoint()

    def _checkpoint(self) -> None:
        """After a commit: a checkpoint of the committed state when one is due (peer.checkpoints).
        Only the copy of the state is taken here; the checkpointer's writer thread writes, fsyncs
        and renames it, then uploads it when this peer is elected for the commit, off the round's
        path. Never raises: a failed write is a warning and is retried at the next commit."""
        if self.checkpointer is not None:
            self.checkpointer.submit(self.workload, upload=bool(self.checkpointer.url and self.rounds.elected))

    def _from_writer(self, fn):
        """`fn` called on this agent's loop, from the checkpoint writer's thread (dropped once the
        loop is closed: the process is ending)."""
        def call(*args) -> None:
            loop = self._loop
            if loop is not None and not loop.is_closed():
                try:
                    loop.call_soon_threadsafe(fn, *args)
                except RuntimeError:  # closed meanwhile
                    pass
        return call

    def _checkpoint_written(self, ckpt) -> None:
        """A checkpoint's files are fsynced and in place: from now on this peer's Ready names it
        (the coordinator's durable round), its metrics and event say it."""
        c = self.checkpointer
        if self.rounds is not None:  # writes end in the order of their commits: the newest one
            self.rounds.checkpoint = (ckpt.round, ckpt.digest)
        self.metrics.on_checkpoint(ckpt.round, c.last_seconds, ckpt.bytes)
        self.emit("checkpoint", round=ckpt.round, seconds=c.last_seconds, bytes=ckpt.bytes,
                  path=str(ckpt.path), digest=ckpt.manifest["digest"])

    def _uploaded(self, ckpt) -> None:
        c = self.checkpointer
        self.emit("checkpoint_uploaded", round=ckpt.round, seconds=c.upload_seconds, url=c.url)

    async def _close_checkpoints(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for the checkpoint writer (the last write and upload), then
        stop it; the writer's last reports run on this loop before this returns."""
        if self.checkpointer is not None:
            await asyncio.to_thread(self.checkpointer.close, timeout)
            await asyncio.sleep(0)  # the reports it scheduled (call_soon_threadsafe) run now

    async def _train(self) -> LocalUpdate | None:
        """Local training (a worker thread) with the link probes alongside, both owned here;
        None when the workload was closed by its owner."""
        extra = faults.local_work()
        async with asyncio.TaskGroup() as tg:
            # Probes are for the next round: once the run finished there is none, and a probe of a
            # participant that no longer answers would hold this peer's leave for up to
            # LINK_MEASURE_SECONDS (seen: jobs left 10-20 s after the run's end).
            measuring = tg.create_task(_unless_stopped(self._measure_links(), self.run_over))
            try:
                if extra:
                    await self._local_work(extra)
                return await asyncio.to_thread(self.workload.local_update)
            except WorkloadClosed:
                measuring.cancel()
                return None

    async def _local_work(self, seconds: float) -> None:
        """A scenario's long local update (shoal.peer.testing.faults.local_work): busy for `seconds`
        while the process stays up and connected, then an event "local_work" (its end)."""
        log.info("local work of %.1fs asked for (scenario)", seconds)
        await asyncio.to_thread(time.sleep, seconds)
        self.emit("local_work", seconds=seconds, round=self.workload.state.rounds)

    async def _measure_links(self) -> None:
        """Measure links and report them to the coordinator, alongside local training (so before
        every Ready, the first one included: the first plan already knows the links).

        Before any plan this peer knows only the coordinator: it probes that (a first estimate of
        its own access link, docs/performance.md "Links"). Afterwards it probes the last round's
        participants without history, with an old probe, or made due by a slow collective
        (`LinkMeter.after_collective`), and drops the coordinator's estimate (peers measure
        what the plan uses). Never raises: a failed probe or report only leaves the coordinator
        with older estimates (bounded by LINK_MEASURE_SECONDS in all).
        """
        plan = self.rounds.last_plan
        try:
            async with asyncio.timeout(LINK_MEASURE_SECONDS):
                if plan is None:
                    if not await self._probe_coordinator():
                        return
                    report = self.links.report(self.peer_id)
                else:
                    # Not through a relay: a probe would spend the relay's bandwidth to measure the
                    # relay (the collectives' streams still give passive estimates; docs/nat.md).
                    # Nor an outbound-only peer: nobody can dial it (a probe of an address that
                    # drops packets waited out its timeout before this peer's Ready: a 5 s stall).
                    peers = [(p, a) for i, (p, a) in enumerate(zip(plan.participants, plan.addresses))
                             if not plan.relay_of(i) and (plan.dialable(i) or p == self.peer_id)]
                    if await probe_missing(self.links, self.transport, peers, self.peer_id):
                        self.links.forget(COORDINATOR)
                    await self.transport.probe_lanes((pid, a) for pid, a in peers if pid != self.peer_id)
                    report = self.links.report(self.peer_id)
                    report.shm_peers.extend(self.transport.shm_peers(peers))
                    report.bulk_peers.extend(self.transport.bulk_peers(peers))
                report.coordinator_rtt_seconds = min(self.control.coordinator_rtt, LINK_RTT_MAX_SECONDS)
                await self.control.report_links(report)
        except (grpc.aio.AioRpcError, TimeoutError) as exc:
            log.debug("link report not delivered: %s", exc)


    async def _probe_coordinator(self) -> bool:
        """The first estimate of this peer's own link: probe the coordinator (a few tries, a
        second apart: a lease lost while the workload was built is renewed meanwhile). True
        when there is an estimate to report."""
        for _ in range(COORDINATOR_PROBE_TRIES):
            if not self.links.needs_probe(COORDINATOR):
                return False
            if await probe_peer(self.links, self.control.stub, COORDINATOR, nbytes=COORDINATOR_PROBE_BYTES):
                return True
            await asyncio.sleep(1.0)
        return False


async def _unless_stopped(work: Awaitable[None], stop: asyncio.Event | None) -> bool:
    """Await `work`; False when `stop` is set first (`work` is then cancelled). Errors of
    `work` propagate."""
    if stop is None:
        await work
        return True
    task, stopped = asyncio.ensure_future(work), asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return False
    task.result()
    return True


async def run_peer(config: PeerConfig, workload_factory: Callable[[RunConfig], Workload] | None = None, *,
                   stop: asyncio.Event | None = None) -> dict:
    """Run one peer to completion, or until `stop` is set (a graceful leave; see PeerAgent.run)."""
    return await PeerAgent(config, workload_factory).run(stop)
