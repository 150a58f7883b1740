"""Prometheus metrics of the coordinator and of a peer, in one place (docs/observability.md).

Each process owns one `CollectorRegistry` (never the global one, so tests and libraries that
host several agents in one process do not collide) and serves it with
`prometheus_client.start_http_server` when a metrics port is configured (0 = off). Metrics are
always recorded, served or not; recording is a few dict operations and never blocks.

Not responsible for deciding anything: the coordinator's server and the peer agent call the
`on_*` hooks after the fact. This module imports neither `coordinator` nor `peer`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

log = logging.getLogger("shoal.metrics")

ROUND_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass(frozen=True)
class MetricSpec:
    name: str  # as exposed (counters get the _total suffix from prometheus_client)
    kind: str
    labels: tuple[str, ...]
    help: str


COORDINATOR_METRICS = (
    MetricSpec("shoal_coordinator_members", "gauge", ("state",), "Peers holding a live lease, by state (pending, syncing, member)"),
    MetricSpec("shoal_coordinator_epoch", "gauge", (), "Membership epoch (changes only between rounds)"),
    MetricSpec("shoal_coordinator_round", "gauge", (), "Committed rounds so far (= the round being played)"),
    MetricSpec("shoal_coordinator_rounds_committed_total", "counter", (), "Rounds committed"),
    MetricSpec("shoal_coordinator_rounds_aborted_total", "counter", (), "Round attempts aborted"),
    MetricSpec("shoal_coordinator_rounds_retried_total", "counter", (), "Aborted attempts that were retried with the survivors"),
    MetricSpec("shoal_coordinator_round_duration_seconds", "histogram", (), "Plan-to-commit time of committed rounds"),
    MetricSpec("shoal_coordinator_round_bytes_sent_total", "counter", (), "Data-plane bytes sent by participants of committed rounds, as voted"),
    MetricSpec("shoal_coordinator_dp_epsilon", "gauge", (), "Differential privacy: epsilon (at the run's dp_delta) spent by the committed rounds, from the accountant (0 without DP)"),
    MetricSpec("shoal_coordinator_state_syncs_total", "counter", (), "State-sync orders sent to joiners or stale peers"),
    MetricSpec("shoal_coordinator_rounds_rewound_total", "counter", (), "Committed rounds lost to rewinds: the run went back to the newest checkpoint a restarted peer held"),
    MetricSpec("shoal_coordinator_round_waiting", "gauge", ("reason",), "Why the next round is not open: 1 for the current reason, 0 for the others (`shoal status` says it in words)"),
    MetricSpec("shoal_coordinator_link_up_bytes_per_second", "gauge", ("peer",), "Upload estimate reported by each member"),
    MetricSpec("shoal_coordinator_link_down_bytes_per_second", "gauge", ("peer",), "Download estimate reported by each member"),
    MetricSpec("shoal_coordinator_link_rtt_seconds", "gauge", ("peer",), "Round-trip estimate reported by each member"),
    MetricSpec("shoal_coordinator_store_reachable", "gauge", (), "0 while the etcd state store (--state etcd://) is unreachable, else 1"),
    MetricSpec("shoal_coordinator_store_unreachable_total", "counter", (), "Times the etcd state store stopped answering"),
    MetricSpec("shoal_coordinator_leader", "gauge", (), "1 while this coordinator serves (with --state etcd://: while it leads its prefix), 0 while it stands by"),
)

PEER_METRICS = (
    MetricSpec("shoal_peer_round", "gauge", (), "Committed rounds reflected in this peer's state"),
    MetricSpec("shoal_peer_members", "gauge", (), "Participants of the last round this peer committed"),
    MetricSpec("shoal_peer_rounds_committed_total", "counter", (), "Rounds this peer took part in and committed"),
    MetricSpec("shoal_peer_rounds_aborted_total", "counter", (), "Round attempts this peer saw aborted"),
    MetricSpec("shoal_peer_rounds_retried_total", "counter", (), "Aborted attempts that were retried"),
    MetricSpec("shoal_peer_round_duration_seconds", "histogram", (), "Ready-to-commit time of the rounds this peer committed"),
    MetricSpec("shoal_peer_collective_seconds", "histogram", (), "Time of this peer's successful collectives"),
    MetricSpec("shoal_peer_bytes_sent_total", "counter", (), "Data-plane bytes sent (tensor chunks)"),
    MetricSpec("shoal_peer_bytes_received_total", "counter", (), "Data-plane bytes received (tensor chunks and state sync)"),
    MetricSpec("shoal_peer_link_up_bytes_per_second", "gauge", (), "Passive upload estimate from the last collective (EWMA)"),
    MetricSpec("shoal_peer_link_down_bytes_per_second", "gauge", (), "Passive download estimate from the last collective (EWMA)"),
    MetricSpec("shoal_peer_state_syncs_total", "counter", (), "State downloads completed and verified"),
    MetricSpec("shoal_peer_state_sync_bytes_total", "counter", (), "Bytes of state downloaded"),
    MetricSpec("shoal_peer_train_loss", "gauge", (), "Mean inner training loss of the last committed round"),
    MetricSpec("shoal_peer_test_accuracy", "gauge", (), "Held-out accuracy of the committed state (NaN when the workload has none)"),
    MetricSpec("shoal_peer_last_checkpoint_round", "gauge", (), "Committed rounds of the newest checkpoint this peer wrote (--checkpoint-dir)"),
    MetricSpec("shoal_peer_checkpoint_seconds", "gauge", (), "Seconds the newest checkpoint took to write (fsync included)"),
    MetricSpec("shoal_peer_checkpoint_bytes", "gauge", (), "Bytes of the newest checkpoint"),
    MetricSpec("shoal_peer_checkpoint_failures_total", "counter", (), "Checkpoints that failed to write (full disk, unwritable directory); retried at the next commit"),
)

RELAY_METRICS = (
    MetricSpec("shoal_relay_relayed_bytes_total", "counter", (), "Bytes the relay forwarded between peers, both directions (relayed_bytes)"),
    MetricSpec("shoal_relay_connections_total", "counter", (), "Dials of relayed addresses spliced to their peer"),
    MetricSpec("shoal_relay_registered_peers", "gauge", (), "Peers holding a control connection to the relay"),
)


def _build(specs: tuple[MetricSpec, ...], registry: CollectorRegistry) -> dict[str, object]:
    out: dict[str, object] = {}
    for s in specs:
        if s.kind == "counter":
            out[s.name] = Counter(s.name.removesuffix("_total"), s.help, s.labels, registry=registry)
        elif s.kind == "gauge":
            out[s.name] = Gauge(s.name, s.help, s.labels, registry=registry)
        else:
            out[s.name] = Histogram(s.name, s.help, s.labels, buckets=ROUND_BUCKETS, registry=registry)
    return out


class _Metrics:
    specs: tuple[MetricSpec, ...] = ()

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.m = _build(self.specs, self.registry)
        self.port = 0
        self._server = None

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Serve /metrics on `port` (0 = do nothing). Raises OSError when the port is taken."""
        if port <= 0:
            return 0
        started = start_http_server(port, addr=host, registry=self.registry)
        self._server = started[0] if isinstance(started, tuple) else None
        self.port = port
        log.info("metrics on http://%s:%d/metrics", host, port)
        return port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class CoordinatorMetrics(_Metrics):
    """Metrics of `shoal coordinator`; see COORDINATOR_METRICS."""

    specs = COORDINATOR_METRICS

    def __init__(self) -> None:
        super().__init__()
        self._link_labels: set[str] = set()  # peers with link series now
        self._store_reachable = True
        self.m["shoal_coordinator_store_reachable"].set(1)

    def on_commit(self, seconds: float, bytes_sent: int = 0, *, rounds_committed: int | None = None,
                  epsilon: float = 0.0) -> None:
        """A round committed; `rounds_committed` (the engine's count) moves the round gauge at once
        instead of at the next `observe_members`; `epsilon`: DP spent so far (0 without DP)."""
        if epsilon:
            self.m["shoal_coordinator_dp_epsilon"].set(epsilon)
        self.m["shoal_coordinator_rounds_committed_total"].inc()
        if rounds_committed is not None:
            self.m["shoal_coordinator_round"].set(rounds_committed)
        self.m["shoal_coordinator_round_duration_seconds"].observe(max(0.0, seconds))
        if bytes_sent:
            self.m["shoal_coordinator_round_bytes_sent_total"].inc(bytes_sent)

    def on_abort(self, will_retry: bool) -> None:
        self.m["shoal_coordinator_rounds_aborted_total"].inc()
        if will_retry:
            self.m["shoal_coordinator_rounds_retried_total"].inc()

    def on_sync(self) -> None:
        self.m["shoal_coordinator_state_syncs_total"].inc()

    def on_rewind(self, lost: int, *, rounds_committed: int) -> None:
        """The run went back `lost` committed rounds, to `rounds_committed`."""
        self.m["shoal_coordinator_rounds_rewound_total"].inc(lost)
        self.m["shoal_coordinator_round"].set(rounds_committed)

    def on_store(self, reachable: bool) -> None:
        """The etcd store answered (True) or stopped answering (False)."""
        if not reachable and self._store_reachable:
            self.m["shoal_coordinator_store_unreachable_total"].inc()
        self._store_reachable = reachable
        self.m["shoal_coordinator_store_reachable"].set(1 if reachable else 0)

    def on_leading(self, leading: bool) -> None:
        self.m["shoal_coordinator_leader"].set(1 if leading else 0)

    def observe_members(self, epoch: int, round_: int, counts: dict[str, int]) -> None:
        """counts: live members per state label ("pending", "syncing", "member")."""
        self.m["shoal_coordinator_epoch"].set(epoch)
        self.m["shoal_coordinator_round"].set(round_)
        for state in {"pending", "syncing", "member", *counts}:
            self.m["shoal_coordinator_members"].labels(state).set(counts.get(state, 0))

    def observe_link(self, peer_id: str, up: float, down: float, rtt: float) -> None:
        """A member's reported link estimates (bytes/s, seconds); set when it reports them, not
        re-created periodically (thousands of members: thousands of series)."""
        self.m["shoal_coordinator_link_up_bytes_per_second"].labels(peer_id[:16]).set(up)
        self.m["shoal_coordinator_link_down_bytes_per_second"].labels(peer_id[:16]).set(down)
        self.m["shoal_coordinator_link_rtt_seconds"].labels(peer_id[:16]).set(rtt)
        self._link_labels.add(peer_id[:16])

    def forget_link(self, peer_id: str) -> None:
        """The member left: its link series go."""
        if peer_id[:16] in self._link_labels:
            self._link_labels.discard(peer_id[:16])
            for name in ("shoal_coordinator_link_up_bytes_per_second", "shoal_coordinator_link_down_bytes_per_second",
                         "shoal_coordinator_link_rtt_seconds"):
                self.m[name].remove(peer_id[:16])

    def observe_waiting(self, reason: str, reasons: list[str]) -> None:
        """Set the wait-reason gauge: 1 for `reason`, 0 for every other one of `reasons`."""
        for r in {*reasons, reason}:
            self.m["shoal_coordinator_round_waiting"].labels(r).set(1.0 if r == reason else 0.0)


class PeerMetrics(_Metrics):
    """Metrics of a peer agent; see PEER_METRICS."""

    specs = PEER_METRICS
    EWMA = 0.3

    def __init__(self) -> None:
        super().__init__()
        self.up_estimate = 0.0
        self.down_estimate = 0.0

    def on_commit(self, round_: int, participants: int, seconds: float, loss: float, accuracy: float) -> None:
        self.m["shoal_peer_rounds_committed_total"].inc()
        self.m["shoal_peer_round"].set(round_)
        self.m["shoal_peer_members"].set(participants)
        self.m["shoal_peer_round_duration_seconds"].observe(max(0.0, seconds))
        self.m["shoal_peer_train_loss"].set(loss)
        self.m["shoal_peer_test_accuracy"].set(accuracy)

    def on_abort(self, will_retry: bool) -> None:
        self.m["shoal_peer_rounds_aborted_total"].inc()
        if will_retry:
            self.m["shoal_peer_rounds_retried_total"].inc()

    def on_collective(self, seconds: float, bytes_sent: int, bytes_received: int) -> tuple[float, float]:
        """Record a successful collective; returns the updated (up, down) estimates in bytes/s."""
        self.m["shoal_peer_collective_seconds"].observe(max(0.0, seconds))
        self.m["shoal_peer_bytes_sent_total"].inc(bytes_sent)
        if seconds > 0:
            self.up_estimate = self._ewma(self.up_estimate, bytes_sent / seconds)
            self.down_estimate = self._ewma(self.down_estimate, bytes_received / seconds)
            self.m["shoal_peer_link_up_bytes_per_second"].set(self.up_estimate)
            self.m["shoal_peer_link_down_bytes_per_second"].set(self.down_estimate)
        return self.up_estimate, self.down_estimate

    def on_received(self, n: int) -> None:
        self.m["shoal_peer_bytes_received_total"].inc(n)

    def on_sync(self, round_: int, nbytes: int) -> None:
        self.m["shoal_peer_state_syncs_total"].inc()
        self.m["shoal_peer_state_sync_bytes_total"].inc(nbytes)
        self.m["shoal_peer_round"].set(round_)

    def on_checkpoint(self, round_: int, seconds: float, nbytes: int) -> None:
        """A checkpoint of `round_` written in `seconds`, `nbytes` bytes."""
        self.m["shoal_peer_last_checkpoint_round"].set(round_)
        self.m["shoal_peer_checkpoint_seconds"].set(seconds)
        self.m["shoal_peer_checkpoint_bytes"].set(nbytes)

    def on_checkpoint_failed(self) -> None:
        self.m["shoal_peer_checkpoint_failures_total"].inc()

    def _ewma(self, old: float, new: float) -> float:
        return new if old == 0.0 or not math.isfinite(old) else (1 - self.EWMA) * old + self.EWMA * new


class RelayMetrics(_Metrics):
    """Metrics of `shoal relay`; see RELAY_METRICS."""

    specs = RELAY_METRICS

    def on_relayed(self, nbytes: int) -> None:
        self.m["shoal_relay_relayed_bytes_total"].inc(nbytes)

    def on_connection(self) -> None:
        self.m["shoal_relay_connections_total"].inc()

    def observe_registered(self, peers: int) -> None:
        self.m["shoal_relay_registered_peers"].set(peers)


def render_markdown_table() -> str:
    """The metric tables of docs/observability.md."""
    lines: list[str] = []
    for title, specs in (("Coordinator", COORDINATOR_METRICS), ("Peer", PEER_METRICS), ("Relay", RELAY_METRICS)):
        lines += [f"### {title}", "", "| metric | type | labels | meaning |", "| --- | --- | --- | --- |"]
        for s in specs:
            lines.append(f"| `{s.name}` | {s.kind} | {', '.join(s.labels) or '—'} | {s.help} |")
        lines.append("")
    return "\n".join(lines)
