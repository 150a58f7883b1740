"""peer.pooled: buffers reused only once nothing refers to them, least recently used dropped first."""

from __future__ import annotations

import numpy as np

from shoal.peer.pooled import anonymous, take_pooled


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_an_idle_buffer_of_the_size_is_reused_and_a_held_one_never():
    pool: list = []
    entry, a = take_pooled(pool, 1000, np.float32, 4, anonymous, pool.remove)
    view = a[3:7]  # a consumer still reads it
    del a
    _, b = take_pooled(pool, 1000, np.float32, 4, anonymous, pool.remove)
    assert _addr(b) != _addr(view) - 12 and len(pool) == 2
    b[:] = 1.0
    del view
    _, c = take_pooled(pool, 1000, np.float32, 4, anonymous, pool.remove)
    assert _addr(c) == np.frombuffer(entry.mm, np.float32).__array_interface__["data"][0] and len(pool) == 2


def test_a_miss_drops_the_least_recently_used_idle_buffers_not_the_newest():
    """Buffers of a size no longer asked for (the first round's chunks) go before those of the
    size in use: a pool that kept its oldest idle entries made a new buffer for most chunks."""
    pool: list = []
    old = [take_pooled(pool, 100, np.uint8, 3, anonymous, pool.remove) for _ in range(2)]  # the first round's size
    del old
    new = [take_pooled(pool, 200, np.uint8, 3, anonymous, pool.remove) for _ in range(2)]
    new_entries = [e for e, _ in new]
    del new
    again = [take_pooled(pool, 200, np.uint8, 3, anonymous, pool.remove)[0] for _ in range(2)]
    assert {id(e) for e in again} <= {id(e) for e in new_entries}  # reused, nothing made
    assert sorted(len(e.mm) for e in pool) == [100, 200, 200]  # the older 100 went at the first hit
    take_pooled(pool, 300, np.uint8, 3, anonymous, pool.remove)  # a miss: two idle may stay, the newest
    assert sorted(len(e.mm) for e in pool) == [200, 200, 300]


def test_idle_memory_is_bounded_on_every_take_not_only_on_a_miss():
    """A burst of buffers in flight (a round's payloads) leaves at most `keep` idle once the next
    take comes, even when that take finds one of its size."""
    pool: list = []
    burst = [take_pooled(pool, 4096, np.uint8, 4, anonymous, pool.remove)[1] for _ in range(12)]
    assert len(pool) == 12
    del burst
    _, a = take_pooled(pool, 4096, np.uint8, 4, anonymous, pool.remove)  # a hit
    assert len(pool) == 4  # the one handed out and 3 idle: 4 once it is gone


def test_anonymous_buffers_are_private_memory():
    """Private, not Python's default MAP_SHARED (shmem: no huge pages, a fault per 4 KiB page)."""
    entry = anonymous(4 << 20)
    a = np.frombuffer(entry.mm, np.uint8)
    a[:] = 7
    start = _addr(a)
    with open("/proc/self/smaps") as f:
        text = f.read()
    block = next(b for b in text.split("\n") if b.startswith(f"{start:x}-"))
    assert block.split()[1].endswith("p"), block  # rw-p: private
