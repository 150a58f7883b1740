"""Reusable large buffers: one is handed out again once nothing refers to the array on it.

A fresh large buffer costs a page fault and the kernel's zeroing of every page the first time it
is written (with transparent huge pages, per 2 MiB); rewriting touched pages costs neither. The
data plane writes the same sizes every round (results, chunk payloads), so it keeps the buffers
and reuses them: `take_pooled` hands out an array on an idle entry of the exact size, and an entry
is idle once the array it last handed out, and every view of it, is gone (a weak reference: no
explicit release, no reuse while anything can still read the bytes). Measured in
docs/performance.md: page zeroing was 18-25 % of the CPU of a 10 Gbit/s all-reduce before the
result buffers were pooled, and ~9 % (faults in `recv` into fresh payload buffers) before the
bulk lane's payloads were.
"""

from __future__ import annotations

import itertools
import mmap
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(eq=False)
class Pooled:
    """A reusable buffer: its mapping, its shared-memory segment's name ("" for the process's own
    memory), a weak reference to the array last handed out on it and when that was (`take_pooled`'s
    count: the least recently used idle entries are dropped first)."""

    mm: mmap.mmap
    name: str = ""
    ref: Callable[[], object] = lambda: None
    used: int = 0


_takes = itertools.count(1)
# One lock for every pool: agents on threads of their own (peer.torch_optimizer runs each on its
# own event loop) share a process's payload pool (peer.lanes.bulk), and two takes of one idle entry
# would put two live arrays on one mapping.
_lock = threading.Lock()


def anonymous(nbytes: int) -> Pooled:
    """A `Pooled` in this process's own memory: a private anonymous `mmap` with transparent huge
    pages asked for (as numpy does for its large arrays: one fault per 2 MiB instead of per
    4 KiB). Private, not Python's default MAP_SHARED: a shared anonymous mapping is shmem, which
    gets no huge pages (shmem_enabled is "never" by default) and takes a page-cache fault per
    4 KiB page. Unmapped by the garbage collector once dropped and unreferenced."""
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    mm = mmap.mmap(-1, nbytes, flags=flags) if flags else mmap.mmap(-1, nbytes)
    if hasattr(mm, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        mm.madvise(mmap.MADV_HUGEPAGE)
    return Pooled(mm)


def take_pooled(pool: list[Pooled], n: int, dtype, keep: int, make: Callable[[int], Pooled],
                drop: Callable[[Pooled], None]) -> tuple[Pooled, np.ndarray]:
    """A writable `(n,)` array of `dtype` on an idle entry of `pool` of exactly its size (the most
    recently used one), or on a new one from `make(nbytes)` (appended). Either way the least
    recently used of the other idle entries are dropped (`drop`, which removes them from `pool`)
    down to `keep - 1`, so that at most `keep` stay idle once the array handed out is gone: the
    idle memory is bounded on every take, not only on a miss. (Least recently used: chunks of a
    size no longer planned, e.g. the first round's, must not outstay those of the current size.)
    Thread-safe."""
    dtype = np.dtype(dtype)
    nbytes = max(1, n * dtype.itemsize)
    with _lock:
        idle = sorted((e for e in pool if e.ref() is None), key=lambda e: e.used, reverse=True)
        entry = next((e for e in idle if len(e.mm) == nbytes), None)
        others = [e for e in idle if e is not entry]
        for e in others[max(0, keep - 1):]:
            drop(e)
        if entry is None:
            entry = make(nbytes)
            pool.append(entry)
        arr = np.frombuffer(entry.mm, dtype=dtype, count=n)
        entry.ref = weakref.ref(arr)
        entry.used = next(_takes)
    return entry, arr
