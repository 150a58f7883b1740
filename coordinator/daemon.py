"""The coordinator daemon's start-up and serve loop: open the durable state, bind, serve, stop.

Responsible for everything `shoal coordinator` does around the gRPC service
(`shoal.coordinator.server.CoordinatorService`): the daemon's settings (`CoordinatorConfig`), opening
the store (a SQLite file, or etcd with leader election: `coordinator.leadership`) and rebuilding
the engine from it, loading admission and the admitted keys, binding the accept loops and their
health service, running the ticker, the heap policy and the loop trace under one task group, and
shutting down in order (health NOT_SERVING, drain, close the store) when told to stop, when the
run is over or when the leadership is lost. Not responsible for the command line or for signals
(`shoal.cli` turns flags into a `CoordinatorConfig` and SIGTERM/SIGINT into the `stop` event), nor
for answering calls (the service).
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import functools
import json
import logging
import pathlib
import socket
import time
from collections.abc import Callable

import grpc

from shoal.common.attempts import ATTEMPT_STRIDE
from shoal.common.errors import DecodeErrors
from shoal.common.health import COORDINATOR_SERVICE, attach
from shoal.common.metrics import CoordinatorMetrics
from shoal.common.identity import RequestVerifier, load_or_create_key, public_bytes
from shoal.common.limits import (CONTROL_MAX_RECEIVE_BYTES, CONTROL_MAX_SEND_BYTES, COORDINATOR_MAX_CONCURRENT_RPCS,
                                 RateLimiter)
from shoal.common.pauses import RunClock
from shoal.common.reach import dial_back
from shoal.common.security import Security, SignedCalls, add_port
from shoal.coordinator import planner
from shoal.coordinator.admission import Admission, AllowList, load_secret
from shoal.coordinator.ca import DEFAULT_LIFETIME_S, CertificateAuthority
from shoal.coordinator.etcd_store import EtcdAccess, EtcdStore, EtcdTarget, NotLeader, is_etcd
from shoal.coordinator.heap import HeapPolicy, limit_arenas
from shoal.coordinator.leadership import Leadership
from shoal.coordinator.loopwatch import CallTimer, LoopWatch
from shoal.coordinator.admitted_keys import Memberships
from shoal.coordinator.rounds import CommitRecord, EngineConfig, RoundEngine
from shoal.coordinator.server import (HEARTBEAT, JOIN, MEMBER_RETENTION_SECONDS, SERVICE_PREFIX, UNSIGNED_METHODS,
                                      CoordinatorService, MemberCalls)
from shoal.coordinator.store import SQLiteStore, StateFileError, Store, recorded_durable
from shoal.v1 import shoal_pb2_grpc as pb_grpc

log = logging.getLogger("shoal.coordinator")

HEARTBEAT_TIMEOUT_SECONDS = 10.0  # the benchmark's members' heartbeat timeout: --trace-dir's core wait (loopwatch)
# Request nonces remembered for the signature window (30 s): above the calls of 10,000 members in
# that window (heartbeats every lease/4, Readys), ~200 bytes each; past it, RESOURCE_EXHAUSTED.
NONCE_MEMORY = 1_000_000


@dataclasses.dataclass(frozen=True)
class CoordinatorConfig:
    """Settings of `shoal coordinator` (see docs/configuration.md)."""

    listen: str = "127.0.0.1:7070"
    state_path: str = "shoal-coordinator.db"
    engine: EngineConfig = EngineConfig()
    run_config: dict = dataclasses.field(default_factory=dict)
    # The engine's settings for a run configuration the state already holds (a restart, a standby's
    # term, --resume-from): the flags' [rounds] with the stored run's codec, aggregator, fragments
    # and seed. None: `engine` as it is (callers that build the engine for one run only).
    engine_for_run: Callable[[dict], EngineConfig] | None = None
    ready_file: str | None = None
    key_path: str | None = None
    security: Security = Security(insecure=True)
    join_token_secret: str | None = None  # path of the HMAC secret (`shoal token create`)
    allow_list: str | None = None         # path of the allow-list (hex Ed25519 public keys)
    join_rate: float = 5.0                # joins per second per host (token bucket)
    join_burst: int = 50
    request_rate: float = 500.0           # any call, per second per host
    request_burst: int = 1000
    metrics_port: int = 0
    metrics_host: str = "0.0.0.0"
    finish_linger: float = 10.0  # after the run finished and every member left: answer status this long, then exit
    reach_timeout: float = 2.0  # dial-back of a joiner's data address (shoal.common.reach); 0 = not checked
    cert_lifetime: float = DEFAULT_LIFETIME_S  # issued data-plane certificates, seconds (coordinator.ca)
    member_retention: float = MEMBER_RETENTION_SECONDS  # an admitted key unused this long needs admission again
    trace_dir: str | None = None  # write loop.csv (coordinator.loopwatch) here; None: no trace
    accept_loops: int = 1  # gRPC servers on the listen port, each taking calls from gRPC core (_bind_servers)
    store_unreachable_limit: float = 600.0  # etcd unanswering this long ends the process (StoreUnreachable); 0 never
    etcd_access: EtcdAccess = EtcdAccess()  # TLS and authentication to etcd (coordinator.etcd_store)
    resume: ResumePoint | None = None  # --resume-from: where a new state file starts the run


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """Where `--resume-from` starts a run on a new state file: a verified checkpoint's committed
    rounds, its state digest, its run configuration (a dict: the RunConfig fields) and where it
    was read (for the log)."""

    rounds: int
    state_digest: bytes
    run_config: dict
    source: str


def seed_from_checkpoint(store: Store, point: ResumePoint) -> bool:
    """Make a new store start at `point`: the checkpoint's run configuration and one commit record
    for its last round (state digest only: the history before it is not known), so that peers
    holding that state are up to date. False (nothing written) when the store already holds a run."""
    if store.get_meta("run_config") is not None or store.count_commits() or point.rounds <= 0:
        return False
    with store.batch():
        store.set_meta("run_config", json.dumps(point.run_config, sort_keys=True))
        store.save_commit(CommitRecord(point.rounds - 1, 0, b"", point.state_digest, (), 0.0, 0.0))
        store.set_meta("resumed_from", json.dumps({"rounds": point.rounds, "digest": point.state_digest.hex(),
                                                   "source": point.source}))
    log.info("new run state resumed from checkpoint %s: %d committed rounds, digest %s", point.source, point.rounds,
             point.state_digest.hex()[:16])
    return True


def grpc_options(reuseport: bool = False) -> list[tuple[str, int]]:
    """The coordinator's server options; `reuseport`: SO_REUSEPORT on its listening socket (the
    accept loops of `_bind_servers` share one port)."""
    return [
        ("grpc.max_receive_message_length", CONTROL_MAX_RECEIVE_BYTES),
        ("grpc.max_send_message_length", CONTROL_MAX_SEND_BYTES),
        ("grpc.so_reuseport", int(reuseport)),
        # Peers ping every 10 s (peer.dataplane.channel_options) while their WatchRounds stream is
        # quiet; a round longer than a minute on a slow link must not end with "too_many_pings".
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        # No bandwidth-delay-product probes: control-plane messages are small, so a larger flow
        # control window buys nothing, and each probe is a ping that the member must answer
        # within the server's ping timeout (1 min, as the server's keepalive is on) or the server
        # ends the connection with GOAWAY "ping_timeout": seen by 10,000 simulated members on a
        # host at load 60 (docs/performance.md, "Coordinator scale"); none since.
        ("grpc.http2.bdp_probe", 0),
        # No HPACK dynamic tables on members' connections (SETTINGS_HEADER_TABLE_SIZE 0 for the
        # headers members send, none for ours): a table lives per connection (up to 4 KiB), and
        # at 1,000 members the C heap in use was 1.3 MiB smaller without them (59.1-59.2 against
        # 60.4-60.7 MiB, three runs each; docs/performance.md, "Coordinator scale").
        # Headers then go literal: ~0.2 KB more per call, no change in the coordinator's CPU.
        ("grpc.http2.hpack_table_size.decoder", 0),
        ("grpc.http2.hpack_table_size.encoder", 0),
    ]


def _port_free(address: str) -> bool:
    """Whether a listener without SO_REUSEPORT can bind `address` (HOST:PORT) now: nobody listens
    there, not even with SO_REUSEPORT (a listener that shares its port would take a share of the
    connections). True for port 0 and for addresses it cannot resolve (the bind then says why)."""
    host, _, port = address.rpartition(":")
    if int(port) == 0:
        return True
    try:
        infos = socket.getaddrinfo(host.strip("[]") or None, int(port), type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return True
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return False
    return True


def _bind_servers(config: CoordinatorConfig, service: CoordinatorService,
                  interceptors: list) -> tuple[list[grpc.aio.Server], list, int]:
    """`config.accept_loops` gRPC servers of `service` on one port (SO_REUSEPORT when more than
    one: the kernel spreads the connections over their listening sockets); returns (servers,
    their health reporters, the port).

    Why several: a grpc.aio server asks gRPC core for the next call only once the last one was
    handed to the event loop (one request outstanding), so it takes one call per turn of the
    loop; when a burst of calls arrives (a member process that stalled 50-100 ms sends its
    heartbeats at once) they wait in gRPC core, one loop turn each, while the loop itself is on
    time. Each server has its own outstanding request: k servers take up to k calls per turn.
    All of them run in this process and its one event loop, with the same service and engine.

    Raises:
        OSError: the address cannot be bound, or (with several loops) another process already
            listens on the port.
    """
    loops = max(1, config.accept_loops)
    if loops > 1 and not _port_free(config.listen):
        # A plain bind would fail here; with SO_REUSEPORT it would share the port with that listener.
        raise OSError(f"listen: cannot bind {config.listen}: address already in use")
    servers, healths = [], []
    address, port = config.listen, 0
    for _ in range(loops):
        # The concurrency bound is each server's: a server holds the streams of the connections the
        # kernel gave it (about 1/loops of them), so each keeps the whole swarm's bound.
        server = grpc.aio.server(options=grpc_options(reuseport=loops > 1), interceptors=interceptors,
                                 maximum_concurrent_rpcs=COORDINATOR_MAX_CONCURRENT_RPCS)
        pb_grpc.add_CoordinatorServicer_to_server(service, server)
        healths.append(attach(server, (COORDINATOR_SERVICE,)))
        bound = add_port(server, address, config.security, "coordinator")
        if port == 0:
            port = bound  # the first server's (port 0: the one the system picked): the others share it
            address = f"{config.listen.rsplit(':', 1)[0]}:{port}"
        servers.append(server)
    return servers, healths, port


def open_state(config: CoordinatorConfig, now: float, store: Store | None = None) -> tuple[RoundEngine, Store, str]:
    """Open (or create) the durable state (`store`, default the SQLite file `config.state_path`)
    and rebuild the engine from it.

    The run configuration stored on first start wins over the one passed on a restart, so a
    restarted coordinator (or a standby taking over) resumes the same run: the peers are handed
    the stored one at join and the engine plans by it (`config.engine_for_run`), so the plans'
    codec, aggregator and collective are the run's, whatever the flags of the restart say.
    """
    store = store if store is not None else SQLiteStore(config.state_path)
    if config.resume is not None and not seed_from_checkpoint(store, config.resume):
        log.warning("--resume-from %s ignored: the state %s already holds a run (it resumes from its own state)",
                    config.resume.source, config.state_path)
    stored = store.get_meta("run_config")
    if stored is None:
        stored = json.dumps(config.run_config, sort_keys=True)
        store.set_meta("run_config", stored)
    run = json.loads(stored)
    engine_config = config.engine
    if run != config.run_config:
        if config.run_config:
            differ = [f"{k} {run.get(k)!r} (flags {config.run_config.get(k)!r})"
                      for k in sorted(set(run) | set(config.run_config)) if run.get(k) != config.run_config.get(k)]
            log.warning("state file %s holds a run configuration that differs from the flags; keeping the stored "
                        "one: %s", config.state_path, ", ".join(differ))
        if config.engine_for_run is not None:
            engine_config = config.engine_for_run(run)
    commits = store.recent_commits(engine_config.history_window)
    # Each start is a new incarnation; its attempt ids start at ATTEMPT_STRIDE x incarnation, so a plan of
    # this incarnation never shares an id with one a crashed predecessor had sent.
    incarnation = int(store.get_meta("incarnation") or -1) + 1
    store.set_meta("incarnation", str(incarnation))
    engine = RoundEngine(engine_config, committed=commits, members=store.load_members(),
                         epoch=store.load_epoch(), aborted=store.count_aborts(), now=now,
                         attempt_base=(incarnation % 4000) * ATTEMPT_STRIDE,
                         untrusted=tuple(json.loads(store.get_meta("untrusted") or "[]")),
                         durable=recorded_durable(store))
    if commits:
        log.info("resumed from %s: %d committed rounds, %d members, epoch %d", config.state_path,
                 engine.committed_rounds, len(engine.members), engine.epoch)
    return engine, store, stored


def load_admission(config: CoordinatorConfig) -> Admission:
    """The admission policy from the configured secret / allow-list files; warns when open.

    Raises:
        FileNotFoundError, ValueError: a configured file is missing or malformed (or the secret
            file is readable by others).
    """
    secret = load_secret(config.join_token_secret) if config.join_token_secret else None
    allow = AllowList.from_file(config.allow_list) if config.allow_list else None
    admission = Admission(secret, allow)
    if admission.open:
        log.warning("open admission: any key may join (pass --join-token-secret and/or --allow-list)")
    else:
        log.info("admission: %s", " and ".join(
            x for x in ("join token" if secret else "", f"allow-list of {len(allow)} keys" if allow else "") if x))
    return admission


def load_memberships(config: CoordinatorConfig, store: Store, engine: RoundEngine) -> Memberships:
    """The admitted keys from the store; those unused beyond `member_retention` are forgotten."""
    ms = Memberships(store.load_memberships(), retention=config.member_retention,
                     live_seconds=engine.config.lease_seconds / 2)
    gone = ms.prune(time.time())
    if gone:
        with store.batch():
            for p in gone:
                store.forget_membership(p)
        log.info("forgot %d members unused for more than %.0f s (member_retention)", len(gone),
                 config.member_retention)
    if ms.records:
        log.info("%d admitted members (%d revoked)", len(ms.records), sum(r.revoked for r in ms.records.values()))
    return ms


class LostLeadership(Exception):
    """This coordinator's term as leader ended (its etcd lease expired, or a store write failed):
    another may lead now. `serve` steps down and stands by again."""


def _key_path(config: CoordinatorConfig) -> str:
    if config.key_path:
        return config.key_path
    if is_etcd(config.state_path):
        return "shoal-coordinator.key"  # every coordinator of a prefix must sign with the same key
    return str(pathlib.Path(config.state_path).with_suffix(".key"))


async def serve(config: CoordinatorConfig, *, stop: asyncio.Event | None = None) -> None:
    """Run the coordinator until `stop` is set, the task is cancelled, or the run is over (it
    finished, every member was told and left, `finish_linger` passed: CoordinatorService
    .run_over); shuts down in order.

    With `state_path` an etcd:// URL (coordinator.etcd_store) it first stands by until elected
    (coordinator.leadership). A standby binds no port: peers given every coordinator's address
    (or a DNS name with one record per coordinator) reach only the leader and move to the next
    one when its connection breaks. A leader whose lease expires, or whose store write fails,
    stops serving, steps down and stands by again (etcd unreachable: retried with backoff).

    Raises:
        StateFileError: the state file is damaged, foreign or newer (nothing was served), or the
            etcd state was signed by another ticket key (coordinators of a prefix share `--key`).
        StoreUnreachable: etcd did not answer for `config.store_unreachable_limit` seconds.
    """
    stop = stop or asyncio.Event()
    limit_arenas()  # before gRPC's threads (the server's, etcd's client) start allocating: coordinator.heap
    planner.load_solver()  # scipy's import (~0.5 s) before the first round, not inside its planning
    key = load_or_create_key(_key_path(config))
    log.info("ticket key %s (public: `shoal relay --coordinator-key` admits this coordinator's members)",
             public_bytes(key).hex())
    clock = RunClock()
    if not is_etcd(config.state_path):
        engine, store, run_config_json = open_state(config, clock())
        await _serve(config, engine, store, run_config_json, key, stop, clock=clock)
        return
    await _serve_replicated(config, key, stop, clock)


async def _serve_replicated(config: CoordinatorConfig, key, stop: asyncio.Event, clock: RunClock) -> None:
    """Stand by, lead while elected, step down when the term ends, stand by again: until `stop`
    or the run is over. A term ends when the lease could not be renewed or a store write failed
    (etcd unreachable, fenced); the engine of the next term is rebuilt from the store, so nothing
    a term did not persist was told to a peer. /metrics answers across terms.

    Raises:
        StoreUnreachable: etcd did not answer for `config.store_unreachable_limit` seconds.
        StateFileError: the prefix is led with another ticket key.
    """
    target = dataclasses.replace(EtcdTarget.parse(config.state_path), access=config.etcd_access)
    if not config.etcd_access.secured:
        log.warning("etcd %s: plaintext and no authentication: whoever reaches etcd reads and changes the run's "
                    "state (pass --etcd-ca and --etcd-user; docs/security.md)", ",".join(target.endpoints))
    metrics = CoordinatorMetrics()
    metrics.serve(config.metrics_port, config.metrics_host)
    leadership = Leadership(target, config.listen, unreachable_limit=config.store_unreachable_limit,
                            metrics=metrics)
    try:
        while not stop.is_set():
            if not await _until_first(leadership.campaign(), stop.wait()) or stop.is_set():
                return
            try:
                await _lead(config, target, leadership, key, stop, clock, metrics)
                return  # stopped, or the run is over
            except (LostLeadership, NotLeader, grpc.RpcError) as exc:
                why = exc.code().name if isinstance(exc, grpc.RpcError) else str(exc)
                log.warning("leadership of %s ended (%s); standing by again", config.state_path, why)
                leadership.step_down()
                if config.ready_file:  # it says where the leader listens: this one no longer does
                    pathlib.Path(config.ready_file).unlink(missing_ok=True)
    finally:
        await leadership.resign()
        await leadership.close()
        metrics.close()


async def _lead(config: CoordinatorConfig, target: EtcdTarget, leadership: Leadership, key, stop: asyncio.Event,
                clock: RunClock, metrics: CoordinatorMetrics) -> None:
    """One term as leader: open the state under this term's fence and serve it."""
    store = EtcdStore(target, fence=leadership.fence)
    try:
        _check_ticket_key(store, key, config.state_path)
        engine, store, run_config_json = open_state(config, clock(), store=store)
    except BaseException:
        store.close()
        raise
    try:
        await _serve(config, engine, store, run_config_json, key, stop, lost=leadership.keep, clock=clock,
                     metrics=metrics)
    finally:
        metrics.on_leading(False)


async def _until_first(work, stopping) -> bool:
    """Run both; True when `work` finished first (the other is cancelled)."""
    tasks = [asyncio.ensure_future(work), asyncio.ensure_future(stopping)]
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for t in done:
        t.result()  # an error of either surfaces
    return tasks[0] in done


def _check_ticket_key(store: Store, key, where: str) -> None:
    """Peers verify round tickets with the key they got at join: every coordinator of one etcd
    prefix must sign with the same one. The first leader records it; a later one with another
    key refuses to lead."""
    mine = public_bytes(key).hex()
    stored = store.get_meta("coordinator_public_key")
    if stored is None:
        store.set_meta("coordinator_public_key", mine)
    elif stored != mine:
        raise StateFileError(where, f"is led with another ticket key (public key {stored[:16]}..., this "
                                    f"coordinator's is {mine[:16]}...)",
                             "give every coordinator of the prefix the same --key file")


async def _serve(config: CoordinatorConfig, engine: RoundEngine, store: Store, run_config_json: str, key,
                 stop: asyncio.Event, lost=None, clock: RunClock | None = None,
                 metrics: CoordinatorMetrics | None = None) -> None:
    """Bind, serve until `stop` (or until `lost()` returns or a store write fails: LostLeadership),
    shut down in order. `metrics`: served by the caller (kept across terms); None: served here."""
    admission = load_admission(config)
    reach = (functools.partial(dial_back, security=config.security, timeout=config.reach_timeout)
             if config.reach_timeout > 0 else None)
    service = CoordinatorService(engine, store, run_config_json, key, admission=admission,
                                 clock=clock or RunClock(), wall=time.time, reach=reach,
                                 ca=CertificateAuthority.from_dir(config.security.tls_dir, config.cert_lifetime),
                                 memberships=load_memberships(config, store, engine), metrics=metrics)
    interceptors = [
        DecodeErrors(),
        SignedCalls(SERVICE_PREFIX, RequestVerifier(max_nonces=NONCE_MEMORY), unsigned=UNSIGNED_METHODS,
                    default_limit=RateLimiter(config.request_rate, config.request_burst),
                    limits={JOIN: RateLimiter(config.join_rate, config.join_burst)}),
        MemberCalls(service),
    ]
    watch = LoopWatch(config.trace_dir) if config.trace_dir else None
    if watch is not None:
        interceptors.insert(0, CallTimer(watch, HEARTBEAT, {HEARTBEAT: HEARTBEAT_TIMEOUT_SECONDS}))
    servers, healths, port = _bind_servers(config, service, interceptors)
    host = config.listen.rsplit(":", 1)[0]
    for server in servers:
        await server.start()
    for health in healths:
        await health.serving()
    service.observe()
    service.metrics.on_leading(True)
    if metrics is None:
        service.metrics.serve(config.metrics_port, config.metrics_host)
    address = f"{host}:{port}"
    sec = config.security
    log.info("coordinator listening on %s (%s; state %s)", address,
             ("mutual TLS" if sec.mtls else "TLS") if sec.tls_dir else "PLAINTEXT", config.state_path)
    rc = json.loads(run_config_json) if run_config_json else {}
    if rc.get("secure_aggregation"):
        log.info("secure aggregation (SecAgg+) on: neighbour graph degree %s, threshold %s, clip %s, %s fraction "
                 "bits; a round needs 3 participants", rc.get("secagg_degree"), rc.get("secagg_threshold"),
                 rc.get("secagg_clip"), rc.get("secagg_frac_bits"))
    if config.ready_file:
        tmp = pathlib.Path(config.ready_file + ".tmp")
        tmp.write_text(address)
        tmp.rename(config.ready_file)
    deposed = False
    try:
        async with asyncio.TaskGroup() as tg:
            ticker = tg.create_task(service.ticker())
            heap = tg.create_task(HeapPolicy(size=lambda: len(engine.members)).run())
            watching = tg.create_task(watch.run()) if watch is not None else None
            over = tg.create_task(service.until_run_over(config.finish_linger))
            stopped = tg.create_task(stop.wait())
            waits = {over, stopped}
            deposing = {tg.create_task(service.store_lost.wait())}  # a write failed: LostLeadership below
            if lost is not None:
                deposing.add(tg.create_task(lost()))  # the lease went first: LostLeadership below
            waits |= deposing
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            deposed = bool(deposing & done) and not stopped.done()
            for task in (ticker, heap, watching, *waits):
                if task is not None:
                    task.cancel()
    finally:
        for health in healths:
            await health.shutdown()
        await asyncio.gather(*(server.stop(grace=0.0 if deposed else 1.0) for server in servers))
        if metrics is None:
            service.metrics.close()
        store.close()
    if deposed:
        why = service.store_lost_why or "its lease could not be renewed"
        raise LostLeadership(f"lost the leadership of {config.state_path} ({why}): another coordinator may lead now")
