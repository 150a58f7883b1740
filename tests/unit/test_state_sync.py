"""State sync that a slow joiner can finish (docs/fault-tolerance.md, "Slow joiners"): resumable
downloads (`Download`), donors that keep a state for its joiner (`HeldStates` pins), the joiner's
rules for orders (`RoundClient._download_for`), and a real-gRPC download cut off mid-range that
resumes at its offset from another donor holding the same digest."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from shoal.peer.state_sync import Download, HeldStates, SyncError
from shoal.peer.workloads.base import ArrayState
from shoal.v1 import shoal_pb2 as pb

from test_round_client import make_client  # the RoundClient test double

pytestmark = pytest.mark.timeout(60)


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def state(rounds: int, n: int = 64) -> ArrayState:
    return ArrayState(np.full(n, float(rounds), np.float32), rounds)


# ---------------------------------------------------------------- Download: the resume point


def test_download_missing_ranges_resume_where_each_range_stopped():
    dl = Download(3, b"d", range_bytes=10)
    assert dl.missing() == [(0, 10)]  # size unknown: the first range learns it
    dl.total = 25
    dl.add(0, b"x" * 10)
    dl.add(10, b"y" * 4)  # cut off after 4 bytes of the second range
    assert dl.missing() == [(14, 6), (20, 5)]
    assert dl.received == 14 and dl.fraction() == pytest.approx(14 / 25)
    with pytest.raises(SyncError):
        dl.add(16, b"z")  # a gap inside a range is refused, never stored
    dl.add(14, b"y" * 6)
    dl.add(20, b"w" * 5)
    assert dl.missing() == [] and dl.blob() == b"x" * 10 + b"y" * 10 + b"w" * 5


def test_download_rate_is_fetched_bytes_over_time():
    dl = Download(1, b"d")
    assert dl.rate() == 0.0
    dl.fetched, dl.seconds = 1_000_000, 2.0
    assert dl.rate() == 500_000.0


# ---------------------------------------------------------------- HeldStates: what donors keep


def test_a_state_being_fetched_is_kept_until_the_permit_expires():
    clock = Clock()
    current = [state(1)]
    held = HeldStates(lambda: current[0], keep=2, clock=clock)
    held.hold()
    assert held.state_for(1, "joiner", clock.t + 60) is not None  # pinned for the joiner
    for r in range(2, 8):  # the swarm commits on; the joiner keeps asking
        current[0] = state(r)
        held.hold()
        clock.t += 5
        assert held.state_for(1, "joiner", clock.t + 30) is not None
    assert held.pinned() == {1: ("joiner",)}
    assert held.state_for(5) is None  # unpinned older states go as before
    clock.t += 31  # the permit expired
    assert held.state_for(1) is None and held.pinned() == {}


def test_a_pin_lapses_when_its_joiner_goes_quiet():
    clock = Clock()
    current = [state(1)]
    held = HeldStates(lambda: current[0], keep=1, pin_idle=30.0, clock=clock)
    assert held.state_for(1, "joiner", clock.t + 300) is not None
    current[0] = state(2)
    clock.t += 20
    assert held.state_for(1) is not None  # quiet for 20 s: still kept
    clock.t += 11
    assert held.state_for(1) is None  # quiet for 31 s: gone, though the permit lasts


def test_pinned_states_are_bounded_the_pin_ending_first_goes():
    clock = Clock()
    current = [state(0)]
    held = HeldStates(lambda: current[0], keep=1, max_pinned=2, clock=clock)
    for r, until in ((0, 100), (1, 300), (2, 200)):
        current[0] = state(r)
        assert held.state_for(r, f"j{r}", clock.t + until) is not None
    current[0] = state(3)
    held.hold()
    assert set(held.pinned()) == {1, 2}  # round 0's pin ends first: dropped to stay within 2
    assert held.state_for(0) is None and held.state_for(1) is not None


def test_an_expired_permit_pins_nothing():
    clock = Clock()
    current = [state(1)]
    held = HeldStates(lambda: current[0], keep=1, clock=clock)
    assert held.state_for(1, "joiner", clock.t - 1) is not None
    current[0] = state(2)
    assert held.state_for(1) is None


# ---------------------------------------------------------------- the joiner's orders


def order(rounds: int, dig: bytes) -> pb.SyncOrder:
    return pb.SyncOrder(round=rounds, state_digest=dig, donors=[pb.Participant(peer_id="b" * 32, address="x:1")])


def test_an_order_for_the_same_digest_resumes_the_download():
    client, *_ = make_client()
    dl = client._download_for(order(3, b"d3"))
    dl.total = 100
    dl.add(0, b"x" * 40)
    assert client._download_for(order(3, b"d3")) is dl


def test_a_newer_order_finishes_a_mostly_done_older_download_first():
    client, *_ = make_client()
    dl = client._download_for(order(3, b"d3"))
    dl.total = 100
    dl.add(0, b"x" * 60)
    assert client._download_for(order(7, b"d7")) is dl  # 60 % done: finish it, catch up after


def test_a_newer_order_replaces_a_barely_started_download():
    client, *_ = make_client()
    dl = client._download_for(order(3, b"d3"))
    dl.total = 100
    dl.add(0, b"x" * 10)
    new = client._download_for(order(7, b"d7"))
    assert new is not dl and new.round == 7 and new.received == 0


def test_a_stale_or_duplicate_order_is_dropped():
    client, _, wl, *_ = make_client()
    wl.apply(ArrayState(wl.state.params.copy(), 3))
    held = wl.state
    assert client.already_holds(order(3, held.digest()))  # a duplicate
    assert client.already_holds(order(2, b"older"))  # stale: a peer never moves back
    assert not client.already_holds(order(4, b"newer"))


# ---------------------------------------------------------------- real gRPC: resume at the offset


async def test_a_stale_order_is_asked_again_at_once_and_logged_once(monkeypatch, caplog):
    from shoal.peer import rounds
    from shoal.peer.rounds import RunFinished, SyncOrdered
    from test_round_client import until, update

    client, control, *_ = make_client()
    asked: list[int] = []

    async def download(order, *, me, transport, k, range_bytes, partial=None):
        asked.append(order.round)
        raise SyncError("every donor failed (1) with everything left", ("b" * 32,), stale=True)

    monkeypatch.setattr(rounds, "download_state", download)
    caplog.set_level("DEBUG", logger="shoal.peer.rounds")
    task = asyncio.create_task(client.play(update(), 0.0))
    await until(lambda: len(control.readies) == 1)
    for r in range(1, 6):  # five orders the donors have all moved past
        control.readies.clear()
        client.events.put_nowait(SyncOrdered(order(r, b"d%d" % r)))
        await until(lambda: len(control.readies) == 1)  # asked for a new one, at once
    client.events.put_nowait(RunFinished(0))
    await asyncio.wait_for(task, 10)
    assert asked == [1, 2, 3, 4, 5]
    lines = [r for r in caplog.records if "state sync failed" in r.getMessage()]
    assert len(lines) == 5 and sum(r.levelname == "WARNING" for r in lines) == 1  # the rest at debug
    assert "out of date" in lines[0].getMessage()
