"""The coordinator's garbage-collector policy: long-lived objects out of the full collections.

A coordinator with thousands of members holds a large, long-lived heap: every member's record
and round-event stream (gRPC call, async generators, queue) is ~20-30 objects that the cyclic
garbage collector scans in every full (generation 2) collection. With 10,000 members a full
collection takes ~0.3 s, during which no call is answered, and the churn of a busy server
(each call's objects, each Ready's record) triggers one every few seconds: heartbeat latencies
of hundreds of milliseconds (measured: docs/performance.md, "One coordinator, many members").

`HeapPolicy` therefore moves the surviving heap into the permanent generation (`gc.freeze()`)
every `freeze_seconds`, right after a collection of every generation but the permanent one (it
scans only what was allocated since the last freeze, so it is short); the automatic full
collections then scan only what was allocated since, too. That collection matters: cyclic
garbage already in the old generation when it is frozen would be kept until the next unfreeze
(measured: ~9 KB per round at 300-1,000 members, when only the young generations were
collected before each freeze, the "growth per round" of docs/performance.md). Frozen objects are
still freed by reference counting when they die; only objects alive at a freeze that later die
in a reference cycle stay, so every `full_seconds` the heap is unfrozen and fully collected once
(one pause, then frozen again).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time

log = logging.getLogger("shoal.coordinator")


class HeapPolicy:
    """Freeze the long-lived heap every `freeze_seconds`; unfreeze and collect it fully every
    `full_seconds`. `run()` does it until cancelled."""

    def __init__(self, freeze_seconds: float = 10.0, full_seconds: float = 600.0):
        self.freeze_seconds = freeze_seconds
        self.full_seconds = full_seconds
        self._next_full = time.monotonic() + full_seconds

    def step(self) -> None:
        """One freeze (and, when due, the full collection before it)."""
        t0 = time.monotonic()
        if t0 >= self._next_full:
            gc.unfreeze()
            freed = gc.collect()
            self._next_full = t0 + self.full_seconds
            log.debug("full collection: %d objects freed in %.0f ms", freed, 1e3 * (time.monotonic() - t0))
        else:
            gc.collect(2)  # the permanent generation is not scanned: only the heap since the last freeze
        gc.freeze()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.freeze_seconds)
            self.step()
