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
(one pause, then frozen again). That pause grows with the heap (0.66-0.95 s at 10,000 members,
~1 M tracked objects) while what it finds need not: 288 unreachable objects after 10 minutes at
10,000 members (docs/performance.md, "Coordinator scale"). So the period doubles after a full
collection that found fewer than `quiet_objects` (up to `full_max_seconds`) and is back at
`full_seconds` after one that found more (members leaving, whose stream objects a freeze can
keep): the frozen garbage stays bounded by what accumulates in one period.

After each freeze it also hands the C heap's free pages back to the system (glibc's
`malloc_trim`, ~15 ms for a 300 MB fragmented heap): gRPC's threads and protobuf allocate and
free through malloc, whose arenas keep freed pages resident. Measured at 1,000 members: ~2 MB
less resident throughout a run; it does not stop the creep of ~4-5 KB per round seen over the
first ten minutes (docs/performance.md, "Coordinator scale"), which is the allocators' warm-up
while members take part in a round for the first time.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
import time
from collections.abc import Callable

log = logging.getLogger("shoal.coordinator")


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim(pad)` (returns 1 when memory went back to the system), or None
    elsewhere (musl, macOS: nothing to trim there)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None


MALLOC_TRIM = _malloc_trim()
M_ARENA_MAX = -8  # glibc's mallopt parameter: the most malloc arenas the process creates
ARENAS = 2  # the coordinator's: its event loop's thread, and one for gRPC core's threads


def limit_arenas(arenas: int = ARENAS) -> bool:
    """Cap glibc's malloc arenas at `arenas` (glibc's own cap: 8 per core); True when set (False
    elsewhere: not glibc). Call it before threads start (gRPC's): a thread's first malloc picks
    its arena.

    Every thread that allocates gets an arena of its own up to the cap, and each keeps its own
    free pages and its own fragmentation: gRPC core's threads, which allocate and free every
    call's and message's buffers in varying sizes, made the coordinator's resident size creep by
    ~5 KB per round at 1,000 members; with 2 arenas 1.3-3.1 KB (~2.5 typical), with the same
    latency (docs/performance.md, "Coordinator scale")."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        return bool(ctypes.CDLL(name).mallopt(M_ARENA_MAX, arenas))
    except (OSError, AttributeError):
        return False


class _MallInfo2(ctypes.Structure):
    # glibc's struct mallinfo2 (glibc >= 2.33), every field a size_t
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mallinfo2() -> Callable[[], _MallInfo2] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        f = ctypes.CDLL(name).mallinfo2
    except (OSError, AttributeError):
        return None
    f.restype = _MallInfo2
    f.argtypes = []
    return f


MALLINFO2 = _mallinfo2()


def malloc_stats() -> dict[str, int] | None:
    """The C heap as glibc's malloc sees it (bytes, every arena together): `in_use` (allocated
    from the arenas' heaps, `uordblks`), `free` (free chunks the arenas keep, `fordblks`: what
    fragmentation or not-yet-reused memory holds resident or mapped), `mmapped` (large blocks
    mapped one by one, `hblkhd`, in use). None where there is no `mallinfo2` (not glibc >= 2.33).

    It walks each arena's free lists under the arena's lock: ~0.1-1 ms for a heap of a few
    hundred MB; call it every few seconds, not per call. Tells retention (in_use grows) from
    fragmentation (free grows, in_use flat) in the resident size's growth
    (docs/performance.md, "Coordinator scale")."""
    if MALLINFO2 is None:
        return None
    mi = MALLINFO2()
    return {"in_use": mi.uordblks, "free": mi.fordblks, "mmapped": mi.hblkhd}


SLOW_STEP_SECONDS = 0.1  # a step longer than this is logged (the heartbeat bar is 100 ms)


class HeapPolicy:
    """Freeze the long-lived heap every `freeze_seconds`, and sooner while it grows (below);
    unfreeze and collect it fully every `full_seconds`. `run()` does it until cancelled.

    A step's pause grows with what was allocated since the last freeze. While members join (a
    join storm: thousands a minute) that is a lot: one step 10 s into a burst of 3,000 joins
    took 0.25-0.74 s, 2.8 s at 10,000 (docs/performance.md, "Coordinator scale"). So `size`
    (e.g. the member count) is read every `check_seconds`, and a step runs as soon as it moved
    by `grow_step` since the last one: many short pauses instead of one long one."""

    def __init__(self, freeze_seconds: float = 10.0, full_seconds: float = 600.0,
                 trim: Callable[[int], int] | None = MALLOC_TRIM, *, size: Callable[[], int] | None = None,
                 grow_step: int = 200, check_seconds: float = 0.5, full_max_seconds: float = 6 * 3600.0,
                 quiet_objects: int = 10_000):
        self.freeze_seconds = freeze_seconds
        self.full_seconds = full_seconds
        self.full_max_seconds = max(full_seconds, full_max_seconds)
        self.quiet_objects = quiet_objects
        self.full_period = full_seconds  # the current one: full_seconds .. full_max_seconds
        self.trim = trim  # the C heap's trim (None: not trimmed)
        self.size = size
        self.grow_step = grow_step
        self.check_seconds = check_seconds
        self._next_full = time.monotonic() + full_seconds
        self._last_step = time.monotonic()
        self._last_size = size() if size is not None else 0

    def due(self, now: float) -> bool:
        """Whether a step is due at `now` (monotonic seconds): `freeze_seconds` since the last
        one, or `size()` moved by `grow_step` or more since then."""
        if now >= self._last_step + self.freeze_seconds:
            return True
        return self.size is not None and abs(self.size() - self._last_size) >= self.grow_step

    def step(self) -> None:
        """One freeze (and, when due, the full collection before it), then a trim of the C heap."""
        t0 = time.monotonic()
        self._last_step = t0
        if self.size is not None:
            self._last_size = self.size()
        full = ""
        if t0 >= self._next_full:
            gc.unfreeze()
            freed = gc.collect()
            # Little found: the next one later (its pause is the same whatever it finds); much: soon.
            self.full_period = (min(2 * self.full_period, self.full_max_seconds) if freed < self.quiet_objects
                                else self.full_seconds)
            self._next_full = t0 + self.full_period
            # What it found is what the freezes had kept: the measure of whether it is worth its pause.
            full = f"; full collection: {freed} unreachable objects freed, the next in {self.full_period:.0f} s"
            log.debug("full collection: %d objects freed in %.0f ms", freed, 1e3 * (time.monotonic() - t0))
        else:
            gc.collect(2)  # the permanent generation is not scanned: only the heap since the last freeze
        gc.freeze()
        t1 = time.monotonic()
        if self.trim is not None:
            self.trim(0)
        took = time.monotonic() - t0
        if took > SLOW_STEP_SECONDS:
            # Every call waits meanwhile: worth an operator's look (docs/performance.md).
            log.warning("heap policy: collection, freeze and trim stopped the coordinator for %.0f ms (trim: %.0f ms%s)",
                        1e3 * took, 1e3 * (time.monotonic() - t1), full)

    async def run(self) -> None:
        """Step once now (the heap of the start-up: imports, the state loaded), then whenever `due`."""
        self.step()
        while True:
            await asyncio.sleep(self.check_seconds if self.size is not None else self.freeze_seconds)
            if self.due(time.monotonic()):
                self.step()
