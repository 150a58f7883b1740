"""State sync: a joiner (or a peer whose state disagrees) downloads the committed state.

The blob (see `peer.training.CommittedState.to_bytes`) is fetched in byte ranges from up to `k`
donors in parallel; each donor worker takes the next range from a shared queue, so a fast donor
serves more. The bytes received are kept in a `Download` (one per digest) that outlives the
attempt: a range cut off mid-way resumes at its offset, from any donor whose chunks carry the
same digest, and a later order naming the same digest (or an older, half-done one the joiner
keeps: `RoundClient.sync`) resumes instead of starting at byte 0. The assembled blob must hash to
the digest the coordinator committed, or nothing is applied.

Failure semantics: `download_state` either returns a verified blob or raises `SyncError` (with
`stale` set when every donor said it no longer holds that round: the order is out of date, ask
for a new one); the caller's state is never touched by a partial download, and the bytes already
received stay in the `Download` for the next attempt.

The donor side is `HeldStates`: what a peer serves (its committed state and the few before it,
plus the states joiners are downloading, pinned for them until their permit expires or they go
quiet, at most `max_pinned` of them: bounded memory however many joiners come).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from shoal.peer.dataplane import StateSource, Transport
from shoal.peer.workloads.base import State, state_blob_digest
from shoal.common.security import MD_TICKET
from shoal.v1 import shoal_pb2 as pb

log = logging.getLogger("shoal.peer.state_sync")

RANGE_BYTES = 256 << 10
HELD_STATES = 3  # committed states a donor keeps serving (the newest and two before it)
PINNED_STATES = 2  # older states a donor keeps for joiners still downloading them (each a full copy)
PIN_IDLE_SECONDS = 30.0  # a pin lapses when its joiner asked nothing for this long (crashed, gave up)
MIN_RANGE_TIMEOUT = 3.0  # seconds a range may take before it is retried (more on a measured slow link)


@dataclass
class _Pin:
    until: float  # unix time the joiner's permit expires
    last: float  # unix time of its last request


class HeldStates(StateSource):
    """The donor side: serves `current()` (the committed state), the `keep - 1` committed states
    before it that it has seen (`hold`, or any call here), and the states joiners are fetching.

    A request for a held state pins it for the requester (`state_for(rounds, holder, until)`)
    until `until` (its permit's expiry, unix seconds) or until it asked nothing for `pin_idle`
    seconds, whichever comes first. At most `max_pinned` states beyond the `keep` newest are
    kept; past that, the pin that expires first goes. States are held as objects, so a state is
    serialized once, when a joiner first asks for it. `clock`: unix seconds (tests inject it).
    """

    def __init__(self, current: Callable[[], State], keep: int = HELD_STATES, *, max_pinned: int = PINNED_STATES,
                 pin_idle: float = PIN_IDLE_SECONDS, clock: Callable[[], float] = time.time):
        if keep < 1:
            raise ValueError(f"keep: a donor holds at least its current state, got {keep}")
        self.current = current
        self.keep = keep
        self.max_pinned = max_pinned
        self.pin_idle = pin_idle
        self.clock = clock
        self._held: dict[int, State] = {}
        self._pins: dict[int, dict[str, _Pin]] = {}  # round -> holder -> pin

    def hold(self) -> State:
        """Remember the current committed state (replacing another of the same round); returns it."""
        st = self.current()
        old = self._held.get(st.rounds)
        if old is not st and (old is None or old.digest() != st.digest()):
            self._held[st.rounds] = st
        self._evict()
        return st

    def _live_pins(self, rounds: int, now: float) -> list[_Pin]:
        pins = self._pins.get(rounds, {})
        for holder in [h for h, p in pins.items() if p.until <= now or now - p.last > self.pin_idle]:
            del pins[holder]
        if not pins:
            self._pins.pop(rounds, None)
        return list(pins.values())

    def _evict(self) -> None:
        now = self.clock()
        newest = set(sorted(self._held)[-self.keep:])
        pinned = {r: max(p.until for p in pins) for r in self._held if r not in newest
                  for pins in [self._live_pins(r, now)] if pins}
        kept = set(sorted(pinned, key=lambda r: pinned[r])[-self.max_pinned:]) if self.max_pinned else set()
        for r in [r for r in self._held if r not in newest and r not in kept]:
            del self._held[r]
            self._pins.pop(r, None)

    def pinned(self) -> dict[int, tuple[str, ...]]:
        """Rounds held only because a joiner is fetching them -> those joiners (for status, tests)."""
        self._evict()
        newest = set(sorted(self._held)[-self.keep:])
        return {r: tuple(sorted(self._pins.get(r, {}))) for r in self._held if r not in newest}

    def committed_state(self) -> tuple[int, bytes, bytes]:
        st = self.hold()
        return st.rounds, st.to_bytes(), st.digest()

    def state_for(self, rounds: int, holder: str = "", until: float = 0.0) -> tuple[bytes, bytes] | None:
        """(blob, digest) of the state after `rounds` committed rounds, if held; pins it for
        `holder` until `until` (unix seconds) when both are given."""
        self.hold()
        st = self._held.get(rounds)
        if st is None:
            return None
        if holder and until > self.clock():
            pin = self._pins.setdefault(rounds, {}).setdefault(holder, _Pin(until, 0.0))
            pin.until, pin.last = until, self.clock()
        return st.to_bytes(), st.digest()


class SyncError(Exception):
    """No verified copy of the committed state could be assembled from the donors;
    `donors_failed` lists the donors that failed during the attempt; `stale`: every donor that
    answered said it no longer holds the round (the order is out of date)."""

    def __init__(self, message: str, donors_failed: tuple[str, ...] = (), *, stale: bool = False):
        super().__init__(message)
        self.donors_failed = donors_failed
        self.stale = stale


@dataclass(frozen=True)
class SyncResult:
    blob: bytes
    seconds: float
    donors_used: tuple[str, ...]
    donors_failed: tuple[str, ...]
    resumed_bytes: int = 0  # bytes that came from earlier attempts (not fetched by this one)


@dataclass
class Download:
    """The bytes of one state received so far, across attempts and donors: the resume point.

    round / digest: the state (the digest is the committed one, every chunk must carry it).
    total: its size in bytes (-1 until a donor said). ranges: range start -> bytes received from
    there (contiguous, at most `range_bytes`). seconds / fetched: time spent and bytes fetched
    by the attempts so far (their ratio is this peer's measured download rate).
    """

    round: int
    digest: bytes
    range_bytes: int = RANGE_BYTES
    total: int = -1
    ranges: dict[int, bytearray] = field(default_factory=dict)
    seconds: float = 0.0
    fetched: int = 0

    @property
    def received(self) -> int:
        return sum(len(b) for b in self.ranges.values())

    def fraction(self) -> float:
        return self.received / self.total if self.total > 0 else 0.0

    def rate(self) -> float:
        """Measured download rate, bytes/s (0 when unknown)."""
        return self.fetched / self.seconds if self.seconds > 0 and self.fetched > 0 else 0.0

    def missing(self) -> list[tuple[int, int]]:
        """(offset, length) still to fetch, one per range, each resuming where its range stopped."""
        if self.total < 0:
            return [(0, self.range_bytes)]
        out = []
        for start in range(0, self.total, self.range_bytes):
            end = min(self.total, start + self.range_bytes)
            have = len(self.ranges.get(start, b""))
            if start + have < end:
                out.append((start + have, end - start - have))
        return out

    def add(self, offset: int, data: bytes) -> None:
        """Bytes at `offset`, which must continue its range (a chunk out of order raises SyncError)."""
        start = offset - offset % self.range_bytes
        buf = self.ranges.setdefault(start, bytearray())
        if start + len(buf) != offset:
            raise SyncError(f"chunk at offset {offset} does not continue its range (have {start}+{len(buf)})")
        buf += data

    def blob(self) -> bytes:
        return b"".join(bytes(self.ranges[o]) for o in sorted(self.ranges))


async def _fetch(transport: Transport, donor: pb.Participant, me: str, dl: Download, offset: int, length: int,
                 timeout: float, permit: bytes = b"") -> int:
    """Fetch [offset, offset + length) of `dl` from `donor` into `dl`; returns the bytes added.
    Whatever arrived before a failure stays in `dl` (the next request resumes after it)."""
    stub = transport.stub(donor.address, donor.peer_id)
    added = 0
    # The donor serves only members: the coordinator's sync permit names this peer.
    async for c in stub.FetchState(pb.StateRequest(peer_id=me, round=dl.round, offset=offset, length=length),
                                   timeout=timeout, metadata=((MD_TICKET, permit),) if permit else None):
        if dl.digest and c.state_digest and c.state_digest != dl.digest:
            raise SyncError(f"donor {donor.peer_id[:8]} holds digest {c.state_digest.hex()[:12]}, "
                            f"not {dl.digest.hex()[:12]}")
        if dl.total < 0:
            dl.total = c.total_bytes
        elif c.total_bytes != dl.total:
            raise SyncError(f"donor {donor.peer_id[:8]} says {c.total_bytes} bytes, not {dl.total}")
        if c.offset != offset + added:
            raise SyncError(f"donor {donor.peer_id[:8]} sent offset {c.offset} out of order")
        dl.add(c.offset, c.data)
        added += len(c.data)
        dl.fetched += len(c.data)
    return added


def _is_stale(exc: BaseException) -> bool:
    return (isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.FAILED_PRECONDITION
            and "holds state of round" in (exc.details() or ""))


async def download_state(order: pb.SyncOrder, *, me: str, transport: Transport, k: int = 3,
                         range_bytes: int = RANGE_BYTES, timeout: float = MIN_RANGE_TIMEOUT,
                         partial: Download | None = None) -> SyncResult:
    """Download and verify the state named by `order` (or the older `partial` it resumes, which
    must then name the state to fetch) from up to `k` of the order's donors in parallel.

    Donors are tried in the order of the order (the coordinator rotates it per joiner, so
    simultaneous joiners start at different donors). A range that fails after some bytes
    arrived is retried from where it stopped (the donor stays); a donor that fails before
    sending anything is dropped for this attempt. Each range's deadline follows the measured
    rate (at least `timeout` seconds). Raises SyncError when no donor can complete it or the
    digest does not match; the bytes received stay in `partial` (when given).
    """
    t0 = time.monotonic()
    dl = partial if partial is not None else Download(order.round, order.state_digest, range_bytes)
    resumed = dl.received
    donors = [d for d in order.donors if d.peer_id != me]
    if not donors:
        raise SyncError("no donors")
    failed: list[str] = []
    reasons: dict[str, str] = {}
    stale: set[str] = set()
    used: set[str] = set()
    alive = list(donors[:k])
    spare = list(donors[k:])
    work: asyncio.Queue[tuple[int, int]] = asyncio.Queue()

    def range_timeout() -> float:
        rate = dl.rate()
        return max(timeout, 4.0 * range_bytes * len(alive) / rate) if rate > 0 else 4.0 * timeout

    async def worker(d: pb.Participant) -> None:
        while True:
            try:
                off, length = work.get_nowait()
            except asyncio.QueueEmpty:
                return
            start = off - off % dl.range_bytes
            try:
                await _fetch(transport, d, me, dl, off, length, range_timeout(), order.permit)
                used.add(d.peer_id)
            except (grpc.aio.AioRpcError, SyncError, asyncio.TimeoutError) as exc:
                if start + len(dl.ranges.get(start, b"")) > off:  # it was sending: slow, not gone
                    used.add(d.peer_id)
                    continue  # the rest of the range is still missing: the next pass asks again
                if _is_stale(exc):
                    stale.add(d.peer_id)
                failed.append(d.peer_id)
                reasons[d.peer_id] = _why(exc)
                alive.remove(d)
                return

    try:
        while items := dl.missing():
            if not alive:
                if not spare:
                    left = f"{dl.total - dl.received} bytes" if dl.total >= 0 else "everything"
                    raise SyncError(f"every donor failed ({len(failed)}) with {left} left", tuple(failed),
                                    stale=bool(stale) and len(stale) == len(failed))
                alive.append(spare.pop(0))
            for item in items:
                work.put_nowait(item)
            t, before, n_failed = time.monotonic(), dl.received, len(failed)
            async with asyncio.TaskGroup() as tg:
                for d in list(alive):
                    tg.create_task(worker(d))
            dl.seconds += time.monotonic() - t
            if dl.received == before and len(failed) == n_failed and dl.missing():
                raise SyncError("donors answered without sending the missing bytes", tuple(failed))
            while not work.empty():
                work.get_nowait()
    finally:
        if reasons:
            _log_failures(reasons)
    blob = dl.blob()
    if len(blob) != dl.total:
        raise SyncError(f"assembled {len(blob)} bytes, expected {dl.total}", tuple(failed))
    if dl.digest and state_blob_digest(blob) != dl.digest:
        dl.ranges.clear()  # nothing of it can be trusted
        raise SyncError("assembled state does not match the committed digest", tuple(failed))
    return SyncResult(blob, time.monotonic() - t0, tuple(sorted(used)), tuple(failed), resumed)


def _log_failures(reasons: dict[str, str]) -> None:
    """One line for the donors that failed in an attempt (not one per donor and range)."""
    log.warning("state sync: %d donor(s) failed: %s", len(reasons),
                "; ".join(f"{p[:8]}: {why}" for p, why in sorted(reasons.items())))


def _why(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name} {exc.details()}"
    return str(exc) or type(exc).__name__
