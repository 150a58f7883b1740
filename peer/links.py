"""Link measurement: what this peer knows of its links to the other peers.

The planner's use of them: docs/concepts.md, "Bandwidth and the lower bound".

`LinkMeter` keeps, per remote peer, estimates of the throughput this → remote ("up") and
remote → this ("down") in bytes/s and of the round-trip time, from two sources:

* **passive**: every data-plane stream of a real collective reports its bytes and duration
  (`observe_send` from the sending side, `observe_receive` from the receiving side), and every
  collective reports this peer's total bytes and time (`observe_collective`); each source keeps
  an exponential moving average (`alpha`);
* **active**: `probe_peer` times short Probe RPCs (an empty one for the RTT, then `probe_bytes`
  down and `probe_bytes` up) when a peer has no history or its probe is older than
  `probe_interval` seconds.

Estimates follow the link both ways (docs/performance.md, "Links"):

* a **probe** replaces the estimate of the link it measured (the link as it is now);
* a **saturated** passive sample (`observe_send` with ``busy_bytes``/``busy_seconds``: goodput
  while the sender had more data queued, so nothing but the path held it back) moves the
  estimate towards it, both ways; one below the estimate by LOWER_FACTOR replaces it;
* any other passive sample is a *lower bound* of the link's capacity (inside a collective a
  stream waits for reductions and for slower peers), so it can only raise the estimate:
  ``max(base, passive EWMA)``; a probe or a lowering saturated sample forgets it.

The peer's aggregate upload (download), what the planner uses, is the largest of its per-link up
(down) estimates and its passive whole-collective rate: with per-peer access links, the fastest
path out of a peer is limited by its own upload only; a link that got slower at this peer's end
shows on all its links (probed again after a slow round, `after_collective`), one that got
slower at the other end only on that link.

A collective that ran more than SLOW_FACTOR times longer than its plan predicted makes every
link of its participants due for a probe (at most once per REPROBE_SECONDS per link), so the
next report (before the next Ready) carries fresh estimates and the coordinator re-plans.

The meter is plain data plus arithmetic (the clock is injectable); `probe_peer` is the only
coroutine, and a failed probe only leaves the estimates as they were.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import grpc

from shoal.common.limits import LINK_BYTES_PER_S_BOUNDS, LINK_RTT_MAX_SECONDS
from shoal.v1 import shoal_pb2 as pb

log = logging.getLogger("shoal.peer.links")

PROBE_BYTES = 1 << 20  # each direction of a probe of a link nothing is known of (at most, known or not)
# A known link is probed with about this many seconds' worth of its estimate each way, at least
# MIN_PROBE_BYTES: a 1 MiB probe each way of 3 links took a 4 Mbit/s peer 12 s before its Ready,
# and the round went on without it (then it needed the whole state again). Not much less: a
# shaper's burst (a token bucket lets its bucket through at once: 64 KiB here, netbed) makes a
# small probe read fast; 0.5 s and 64 KiB predicted a 4 Mbit/s joiner's rounds at 2-4 s that took
# 12-16 s.
MIN_PROBE_BYTES = 256 << 10
PROBE_TARGET_SECONDS = 1.0
PROBE_INTERVAL_SECONDS = 300.0
PROBE_TIMEOUT_SECONDS = 10.0
COORDINATOR = "coordinator"  # the pseudo peer id of probes of the coordinator (a joiner's first estimate)
COORDINATOR_PROBE_BYTES = 256 << 10  # bounded by the coordinator (its PROBE_MAX_BYTES)
LOWER_FACTOR = 1.5  # a saturated sample this much below the estimate replaces it
SLOW_FACTOR = 1.5  # a collective this much slower than predicted makes its links due for a probe
REPROBE_SECONDS = 10.0  # ... at most this often per link (30 s skipped the first slow rounds after a change: the links were probed at start)
SLOW_MIN_SECONDS = 0.5  # ... and at least this much slower (a loopback round of milliseconds is noise)
# Streams shorter than this (or carrying fewer bytes) say more about scheduling than about links.
_MIN_SAMPLE_SECONDS = 0.005
_MIN_SAMPLE_BYTES = 64 * 1024


class _Ewma:
    __slots__ = ("value", "samples")

    def __init__(self) -> None:
        self.value = 0.0
        self.samples = 0

    def add(self, x: float, alpha: float) -> None:
        self.value = x if self.samples == 0 else (1 - alpha) * self.value + alpha * x
        self.samples += 1


    def reset(self) -> None:
        self.value, self.samples = 0.0, 0


@dataclass
class _Direction:
    """One direction of one link: `base` from probes and saturated samples (follows the link
    both ways), `passive` the EWMA of the other samples (lower bounds, raise only)."""

    base: _Ewma
    passive: _Ewma

    @property
    def value(self) -> float:
        return max(self.base.value, self.passive.value)

    @property
    def samples(self) -> int:
        return self.base.samples + self.passive.samples

    def probe(self, x: float) -> bool:
        """A probe's rate replaces the estimate; True when that lowered it."""
        lowered = x < self.value
        self.base.value, self.base.samples = x, self.base.samples + 1
        self.passive.reset()
        return lowered

    def saturated(self, x: float, alpha: float) -> bool:
        """Goodput while the sender had data queued; True when it lowered the estimate."""
        if self.value > 0 and x * LOWER_FACTOR < self.value:
            self.base.value, self.base.samples = x, self.base.samples + 1
            self.passive.reset()
            return True
        self.base.add(x, alpha)
        return False


def _direction() -> _Direction:
    return _Direction(_Ewma(), _Ewma())


@dataclass
class _Link:
    up_: _Direction
    down_: _Direction
    rtt: _Ewma
    loss: _Ewma = field(default_factory=lambda: _Ewma())
    probed_at: float = float("-inf")
    updated_at: float = float("-inf")  # last sample of any kind
    due: bool = False  # a slow collective asked for a probe (`LinkMeter.after_collective`)

    @property
    def up(self) -> float:
        return self.up_.value

    @property
    def down(self) -> float:
        return self.down_.value

    @property
    def samples(self) -> int:
        return self.up_.samples + self.down_.samples


@dataclass(frozen=True)
class LinkView:
    """One remote link as reported: bytes/s both ways, RTT seconds, number of samples."""

    peer_id: str
    up_bytes_per_s: float
    down_bytes_per_s: float
    rtt_seconds: float
    samples: int
    age_seconds: float = 0.0  # since its last sample


class LinkMeter:
    """Per-remote-peer link estimates; see the module docstring. Not thread-safe (one event loop)."""

    def __init__(self, *, alpha: float = 0.3, probe_interval: float = PROBE_INTERVAL_SECONDS,
                 clock: Callable[[], float] = time.monotonic):
        self.alpha = alpha
        self.probe_interval = probe_interval
        self.clock = clock
        self._links: dict[str, _Link] = {}
        self._up_total = _Ewma()
        self._down_total = _Ewma()

    def _link(self, peer_id: str) -> _Link:
        link = self._links.get(peer_id)
        if link is None:
            link = self._links[peer_id] = _Link(_direction(), _direction(), _Ewma())
        link.updated_at = self.clock()
        return link

    def _lowered(self) -> None:
        """A link got slower: the whole-collective rates (lower bounds from before) no longer
        hold the aggregate up; later collectives rebuild them."""
        self._up_total.reset()
        self._down_total.reset()

    @staticmethod
    def _usable(nbytes: int, seconds: float) -> bool:
        return nbytes >= _MIN_SAMPLE_BYTES and seconds >= _MIN_SAMPLE_SECONDS

    # --- passive ----------------------------------------------------------------------------

    def observe_send(self, peer_id: str, nbytes: int, seconds: float, *, busy_bytes: int = 0,
                     busy_seconds: float = 0.0) -> None:
        """A stream to `peer_id` carried `nbytes` in `seconds` (first write to last ack), of
        which `busy_bytes` in `busy_seconds` while more data was queued behind them (the sender
        was not waiting on anyone: a saturated sample, which may lower the estimate). Give busy
        figures only where this stream is the sender's only one (else it shares the upload)."""
        if self._usable(nbytes, seconds):
            self._link(peer_id).up_.passive.add(nbytes / seconds, self.alpha)
        if self._usable(busy_bytes, busy_seconds) and busy_bytes * 2 >= nbytes:
            if self._link(peer_id).up_.saturated(busy_bytes / busy_seconds, self.alpha):
                log.info("link to %s slower: %.1f Mbit/s while sending with data queued", peer_id[:8],
                         busy_bytes / busy_seconds * 8e-6)
                self._lowered()

    def observe_receive(self, peer_id: str, nbytes: int, seconds: float) -> None:
        """A stream from `peer_id` delivered `nbytes` in `seconds` (first to last chunk)."""
        if self._usable(nbytes, seconds):
            self._link(peer_id).down_.passive.add(nbytes / seconds, self.alpha)

    def observe_path(self, peer_id: str, rtt: float, loss: float) -> None:
        """What the kernel measured on the bulk lane's connections to `peer_id` (peer.lanes.pool):
        `rtt` the smallest round trip seen (seconds; the path's propagation delay, so the planner's
        α does not count the queues a busy stream builds) and `loss` the retransmitted share of
        its data segments. The RTT joins the probes' estimate; the loss is kept per link."""
        link = self._link(peer_id)
        if rtt > 0:
            link.rtt.add(rtt, self.alpha)
        if 0 <= loss <= 1:
            link.loss.add(loss, self.alpha)

    def loss(self, peer_id: str) -> float:
        """The link's loss estimate (share of data segments retransmitted; 0 when unknown)."""
        link = self._links.get(peer_id)
        return link.loss.value if link is not None and link.loss.samples else 0.0

    def observe_collective(self, sent: int, received: int, seconds: float) -> None:
        """This peer sent and received these totals during one collective of `seconds`."""
        if self._usable(sent, seconds):
            self._up_total.add(sent / seconds, self.alpha)
        if self._usable(received, seconds):
            self._down_total.add(received / seconds, self.alpha)

    # --- active -----------------------------------------------------------------------------

    def observe_probe(self, peer_id: str, *, rtt: float | None = None, up: float | None = None,
                      down: float | None = None) -> None:
        """Record one probe's results (bytes/s; RTT in seconds); None = not measured."""
        link = self._link(peer_id)
        if rtt is not None and rtt >= 0:
            link.rtt.add(rtt, self.alpha)
        lowered = False
        if up is not None and up > 0:
            lowered |= link.up_.probe(up)
        if down is not None and down > 0:
            lowered |= link.down_.probe(down)
        if lowered:
            self._lowered()
        link.probed_at = link.updated_at = self.clock()
        link.due = False

    def probe_bytes(self, peer_id: str, most: int = PROBE_BYTES) -> int:
        """Bytes for each direction of a probe of the link to `peer_id`: PROBE_TARGET_SECONDS at
        the slower of its estimates (or of this peer's own, when that link is unknown), between
        MIN_PROBE_BYTES and `most`; `most` when nothing is known. A probe then takes about a
        second each way and link however slow the link (down to MIN_PROBE_BYTES' worth)."""
        link = self._links.get(peer_id)
        rates = [r for r in ((link.up, link.down) if link is not None else ()) if r > 0]
        if not rates:
            up, down, _ = self.aggregate()
            rates = [r for r in (up, down) if r > 0]
        if not rates:
            return most
        return int(min(most, max(MIN_PROBE_BYTES, min(rates) * PROBE_TARGET_SECONDS)))

    def needs_probe(self, peer_id: str) -> bool:
        """No throughput history for this peer, its last probe is older than probe_interval, or
        a slow collective made it due (`after_collective`)."""
        link = self._links.get(peer_id)
        if link is None or (link.up <= 0 and link.down <= 0):
            return True
        return link.due or self.clock() - link.probed_at > self.probe_interval

    def forget(self, peer_id: str) -> None:
        """Drop what is known of the link to `peer_id` (e.g. the coordinator's first estimate
        once the real peers are measured)."""
        if self._links.pop(peer_id, None) is not None:
            self._lowered()

    def after_collective(self, participants: Iterable[str], me: str, seconds: float, predicted: float) -> list[str]:
        """A collective over `participants` took `seconds` where its plan predicted `predicted`:
        more than SLOW_FACTOR times (and SLOW_MIN_SECONDS) longer makes the links to them due for
        a probe (those not probed within REPROBE_SECONDS). Returns the peers made due (empty when
        it was not slow)."""
        if not predicted > 0 or seconds <= SLOW_FACTOR * predicted or seconds - predicted < SLOW_MIN_SECONDS:
            return []
        now = self.clock()
        due = []
        for p in participants:
            link = self._links.get(p)
            if p == me or link is None or link.due or now - link.probed_at < REPROBE_SECONDS:
                continue
            link.due = True
            due.append(p)
        if due:
            log.info("collective took %.2fs, %.1fx the predicted %.2fs: probing %d links again before the next round",
                     seconds, seconds / predicted, predicted, len(due))
        return due

    # --- views ------------------------------------------------------------------------------

    def links(self) -> list[LinkView]:
        """Per-remote estimates, sorted by peer id."""
        now = self.clock()
        return [LinkView(p, l.up, l.down, l.rtt.value, l.samples, max(0.0, now - l.updated_at))
                for p, l in sorted(self._links.items())]

    def aggregate(self) -> tuple[float, float, float]:
        """(upload bytes/s, download bytes/s, mean RTT seconds) of this peer; 0 where unknown."""
        ups = [l.up for l in self._links.values()] + [self._up_total.value]
        downs = [l.down for l in self._links.values()] + [self._down_total.value]
        rtts = [l.rtt.value for l in self._links.values() if l.rtt.samples]
        return max(ups), max(downs), (sum(rtts) / len(rtts) if rtts else 0.0)

    def report(self, peer_id: str) -> pb.LinkReport:
        """The shoal.v1.LinkReport for the coordinator, each estimate clamped into the physical
        bounds the coordinator accepts (shoal.common.limits; 0 stays "not measured")."""
        up, down, _ = self.aggregate()
        return pb.LinkReport(
            peer_id=peer_id, up_bytes_per_s=_rate(up), down_bytes_per_s=_rate(down),
            links=[pb.LinkEstimate(peer_id=v.peer_id, up_bytes_per_s=_rate(v.up_bytes_per_s),
                                   down_bytes_per_s=_rate(v.down_bytes_per_s),
                                   rtt_seconds=min(v.rtt_seconds, LINK_RTT_MAX_SECONDS) if v.rtt_seconds > 0 else 0.0,
                                   samples=v.samples)
                   for v in self.links()],
        )


def _rate(bytes_per_s: float) -> float:
    """A rate estimate within LINK_BYTES_PER_S_BOUNDS (0 or less, or not finite: 0, not measured)."""
    if not bytes_per_s > 0 or bytes_per_s == float("inf"):
        return 0.0
    lo, hi = LINK_BYTES_PER_S_BOUNDS
    return min(hi, max(lo, bytes_per_s))


async def probe_peer(meter: LinkMeter, stub, peer_id: str, *, nbytes: int = PROBE_BYTES,
                     timeout: float = PROBE_TIMEOUT_SECONDS) -> bool:
    """Measure the link to one peer with Probe RPCs through `stub` (a shoal.v1.Peer stub).

    RTT: the fastest of three empty probes. Down: a probe asking for `nbytes`; up: a probe
    carrying `nbytes`; each rate is ``nbytes / (elapsed - rtt)``. Returns False (estimates left
    as they were, error logged at debug) if any probe fails or takes longer than `timeout`.
    """
    try:
        async with asyncio.timeout(timeout):
            rtt = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                await stub.Probe(pb.ProbeRequest(reply_bytes=0))
                rtt = min(rtt, time.perf_counter() - t0)
            t0 = time.perf_counter()
            await stub.Probe(pb.ProbeRequest(reply_bytes=nbytes))
            t = time.perf_counter() - t0
            down = nbytes / max(t - rtt, t / 2, 1e-6)  # an RTT close to t must not make the rate absurd
            payload = bytes(nbytes)
            t0 = time.perf_counter()
            await stub.Probe(pb.ProbeRequest(payload=payload, reply_bytes=0))
            t = time.perf_counter() - t0
            up = nbytes / max(t - rtt, t / 2, 1e-6)
    except (grpc.aio.AioRpcError, TimeoutError) as exc:
        log.debug("probe of %s failed: %s", peer_id[:8], exc)
        return False
    meter.observe_probe(peer_id, rtt=rtt, up=up, down=down)
    return True


async def probe_missing(meter: LinkMeter, transport, peers: Iterable[tuple[str, str]], me: str, *,
                        nbytes: int = PROBE_BYTES) -> int:
    """Probe, one after the other, every (peer id, address) that `meter.needs_probe`, each with
    `meter.probe_bytes(peer, nbytes)` each way; returns how many were probed. The order starts
    after `me` in the given list (peer i probes i+1, i+2, …) so that peers probing at the same
    time mostly probe different targets."""
    peers = list(peers)
    ids = [p for p, _ in peers]
    start = ids.index(me) + 1 if me in ids else 0
    done = 0
    for k in range(len(peers)):
        pid, addr = peers[(start + k) % len(peers)]
        if pid == me or not meter.needs_probe(pid):
            continue
        if await probe_peer(meter, transport.stub(addr, pid), pid, nbytes=meter.probe_bytes(pid, nbytes)):
            done += 1
    return done
