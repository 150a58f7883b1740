"""A process's own time: a clock that stops while the process does not run.

A coordinator that stalls (a long GC pause, a suspended VM, SIGSTOP, a blocked event loop)
must not judge the peers by time it did not live through: on waking, every lease would look
expired although the peers kept heartbeating into a coordinator that did not answer. The
leases, deadlines and windows of `coordinator.rounds.RoundEngine` therefore run on `RunClock`:
monotonic time minus the pauses it detected.

Detection: the coordinator reads the clock at least every `TICK_SECONDS` while it runs (its
ticker); a gap between two readings longer than `threshold` can only be a stretch in which
the process did not run (or its loop did not turn, also the coordinator's own fault), and is
taken out of its time. Readings are anchored to the wall clock at start, so records stamped
with this time stay close to wall time (they lag it by the pauses).

Not responsible for what to do after a pause: the coordinator's server asks `take_pause` and
tells the engine (`RoundEngine.resumed`, which gives every member a grace period to renew its
lease); a peer reads `paused_seconds` around a collective attempt and, when it did not run for a
chunk deadline itself, names itself in its failed vote (`shoal.peer.rounds`), since the others'
deadlines expired waiting for it.
"""

from __future__ import annotations

import time
import asyncio
from collections.abc import Callable


class RunClock:
    """Callable clock (seconds, float): wall time at start + monotonic time since, minus the
    detected pauses.

    threshold: a gap between consecutive readings above this (seconds) is a pause; it must be
    well above the reading interval (the coordinator's ticker reads every 0.05 s) and below any
    lease. monotonic / wall: the time sources (tests pass fakes).
    """

    def __init__(self, threshold: float = 1.0, *, monotonic: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time):
        self.threshold = threshold
        self._monotonic = monotonic
        self._last = monotonic()
        self._offset = wall() - self._last
        self.paused_seconds = 0.0  # total time taken out
        self.pauses = 0  # pauses detected
        self._pending = 0.0  # pause seconds not yet taken by `take_pause`

    def __call__(self) -> float:
        t = self._monotonic()
        gap = t - self._last
        if gap > self.threshold:
            self.paused_seconds += gap
            self._pending += gap
            self.pauses += 1
        self._last = max(self._last, t)
        return t + self._offset - self.paused_seconds

    def take_pause(self) -> float:
        """Seconds of pause detected since the last call (0.0 when none), and forget them."""
        pending, self._pending = self._pending, 0.0
        return pending


async def keep_reading(clock: RunClock, interval: float = 0.05) -> None:
    """Read `clock` every `interval` seconds until cancelled, so that any pause of this process
    (its event loop did not turn) shows as a gap between two readings."""
    while True:
        clock()
        await asyncio.sleep(interval)
