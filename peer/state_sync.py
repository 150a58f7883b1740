"""State sync: a joiner (or a peer whose state disagrees) downloads the committed state.

The blob (see `peer.training.CommittedState.to_bytes`) is fetched in byte ranges from up to `k`
donors in parallel; each donor worker takes the next range from a shared queue, so a fast donor
serves more. A donor that fails mid-transfer is dropped and its range goes back to the queue for
the others. The assembled blob must hash to the digest the coordinator committed, or nothing is
applied.

Failure semantics: `download_state` either returns a verified blob or raises `SyncError`; the
caller's state is never touched by a partial download.

The donor side is `HeldStates`: what a peer serves (its committed state, and the few before it,
so that a download in flight survives the swarm committing another round).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from shoal.peer.dataplane import StateSource, Transport
from shoal.peer.workload import State
from shoal.common.security import MD_TICKET
from shoal.common.tensors import digest
from shoal.v1 import shoal_pb2 as pb

log = logging.getLogger("shoal.peer.state_sync")

RANGE_BYTES = 256 << 10
HELD_STATES = 3  # committed states a donor keeps serving (the newest and two before it)


class HeldStates(StateSource):
    """The donor side: serves `current()` (the committed state) and the `keep - 1` committed
    states before it that it has seen (`hold`, or any call here). States are held as objects, so
    a state is serialized only when a joiner asks for it."""

    def __init__(self, current: Callable[[], State], keep: int = HELD_STATES):
        if keep < 1:
            raise ValueError(f"keep: a donor holds at least its current state, got {keep}")
        self.current = current
        self.keep = keep
        self._held: dict[int, State] = {}

    def hold(self) -> State:
        """Remember the current committed state (replacing another of the same round); returns it."""
        st = self.current()
        old = self._held.get(st.rounds)
        if old is not st and (old is None or old.digest() != st.digest()):
            self._held[st.rounds] = st
            for r in sorted(self._held)[:-self.keep]:
                del self._held[r]
        return st

    def committed_state(self) -> tuple[int, bytes, bytes]:
        st = self.hold()
        return st.rounds, st.to_bytes(), st.digest()

    def state_for(self, rounds: int) -> tuple[bytes, bytes] | None:
        self.hold()
        st = self._held.get(rounds)
        return (st.to_bytes(), st.digest()) if st is not None else None


class SyncError(Exception):
    """No verified copy of the committed state could be assembled from the donors;
    `donors_failed` lists the donors that failed during the attempt."""

    def __init__(self, message: str, donors_failed: tuple[str, ...] = ()):
        super().__init__(message)
        self.donors_failed = donors_failed


@dataclass(frozen=True)
class SyncResult:
    blob: bytes
    seconds: float
    donors_used: tuple[str, ...]
    donors_failed: tuple[str, ...]


async def _fetch(transport: Transport, donor: pb.Participant, me: str, round_: int, offset: int, length: int,
                 timeout: float, permit: bytes = b"") -> tuple[bytes, int, bytes]:
    stub = transport.stub(donor.address, donor.peer_id)
    parts: list[bytes] = []
    total, dig = 0, b""
    # The donor serves only members: the coordinator's sync permit names this peer.
    async for c in stub.FetchState(pb.StateRequest(peer_id=me, round=round_, offset=offset, length=length),
                                   timeout=timeout, metadata=((MD_TICKET, permit),) if permit else None):
        if c.offset != offset + sum(len(p) for p in parts):
            raise SyncError(f"donor {donor.peer_id[:8]} sent offset {c.offset} out of order")
        parts.append(c.data)
        total, dig = c.total_bytes, c.state_digest
    return b"".join(parts), total, dig


async def download_state(order: pb.SyncOrder, *, me: str, transport: Transport, k: int = 3,
                         range_bytes: int = RANGE_BYTES, timeout: float = 3.0) -> SyncResult:
    """Download and verify the state named by `order` from up to `k` of its donors in parallel.

    Donors are tried in the order of the order (the coordinator rotates it per joiner, so
    simultaneous joiners start at different donors). Raises SyncError when no donor can complete it or the digest does not match.
    """
    t0 = time.monotonic()
    donors = [d for d in order.donors if d.peer_id != me]
    if not donors:
        raise SyncError("no donors")
    failed: list[str] = []
    # Learn the size from the first donor that answers.
    first_blob = b""
    total = -1
    for d in list(donors):
        try:
            first_blob, total, dig = await _fetch(transport, d, me, order.round, 0, range_bytes, timeout,
                                                      order.permit)
            if order.state_digest and dig and dig != order.state_digest:
                raise SyncError(f"donor {d.peer_id[:8]} holds digest {dig.hex()[:12]}, not the committed one")
            first_donor = d.peer_id
            break
        except (grpc.aio.AioRpcError, SyncError, asyncio.TimeoutError) as exc:
            log.warning("state sync: donor %s failed: %s", d.peer_id[:8], _why(exc))
            failed.append(d.peer_id)
            donors.remove(d)
    if total < 0:
        raise SyncError(f"every donor failed ({len(failed)})", tuple(failed))
    ranges: asyncio.Queue[int] = asyncio.Queue()
    for off in range(len(first_blob), total, range_bytes):
        ranges.put_nowait(off)
    pieces: dict[int, bytes] = {0: first_blob}
    used: set[str] = {first_donor}
    alive = list(donors[:k])

    async def worker(d: pb.Participant) -> None:
        while True:
            try:
                off = ranges.get_nowait()
            except asyncio.QueueEmpty:
                return
            try:
                data, _, _ = await _fetch(transport, d, me, order.round, off, range_bytes, timeout, order.permit)
            except (grpc.aio.AioRpcError, SyncError, asyncio.TimeoutError) as exc:
                log.warning("state sync: donor %s failed mid-transfer: %s; switching donor", d.peer_id[:8], _why(exc))
                failed.append(d.peer_id)
                alive.remove(d)
                ranges.put_nowait(off)
                return
            pieces[off] = data
            used.add(d.peer_id)

    while not ranges.empty():
        if not alive:
            spare = [d for d in donors if d.peer_id not in failed]
            if not spare:
                raise SyncError(f"every donor failed ({len(failed)}) with {ranges.qsize()} ranges left", tuple(failed))
            alive.append(spare[0])
        async with asyncio.TaskGroup() as tg:
            for d in list(alive):
                tg.create_task(worker(d))
    blob = b"".join(pieces[o] for o in sorted(pieces))
    if len(blob) != total:
        raise SyncError(f"assembled {len(blob)} bytes, expected {total}", tuple(failed))
    if order.state_digest and digest(blob) != order.state_digest:
        raise SyncError("assembled state does not match the committed digest", tuple(failed))
    return SyncResult(blob, time.monotonic() - t0, tuple(sorted(used)), tuple(failed))


def _why(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name} {exc.details()}"
    return str(exc) or type(exc).__name__
