"""The vote digest of a collective's result, hashed while the result is still being written.

A collective fills its result buffer chunk by chunk and out of order (shard owners publish and
the all-gather delivers concurrently); the vote needs `shoal.common.tensors.digest` of the whole
buffer. Hashing it only once the last chunk has landed puts a full pass over the tensor (BLAKE3
of 64 MB: 10-25 ms on a busy 2-core host) on the collective's critical path after the last byte.
`ResultDigest` instead feeds BLAKE3 the buffer's bytes in order as soon as they are final: each
filled range is recorded, and every time the contiguous prefix from element 0 grows, the new part
is handed to one worker thread shared by the process (BLAKE3 releases the GIL, and one worker
keeps the updates in order), so the event loop never blocks on a hash and what is left when the
last chunk lands is only the part that completed the prefix last. The digest is the same bytes
as `digest(buffer)`: BLAKE3 is a streaming hash, and every byte is fed exactly once, in order.

Pure bookkeeping plus hashing; no I/O. Tested alone (tests/test_result_digest.py).
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures

import blake3
import numpy as np

from shoal.common.tensors import DIGEST_BYTES

__all__ = ["ResultDigest", "off_loop"]

# One thread for every digest of the process: updates of one digest run in submission order, and
# peers sharing a host do not each take a core for hashing.
_HASHER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="shoal-digest")


async def off_loop(fn, *args):
    """`fn(*args)` (a hash of a whole tensor, e.g. a state's digest) on the worker thread that
    hashes results, awaited: the event loop keeps serving streams meanwhile (BLAKE3 releases
    the GIL), and the process still hashes on one core at a time."""
    return await asyncio.wrap_future(_HASHER.submit(fn, *args))


class ResultDigest:
    """BLAKE3-256 of a 1-D C-contiguous array `buf`, fed as its element ranges become final.

    `filled(lo, hi)`: elements [lo, hi) hold their final values and will not be written again
    (ranges may come in any order; none may overlap another). `finish()` (async): the digest,
    equal to `shoal.common.tensors.digest(buf)`; call it once every element is filled.

    Failure semantics: `filled` raises ValueError for a range outside the buffer or overlapping
    one already filled (a collective that writes a chunk twice would otherwise vote a digest of
    bytes that changed after they were hashed); `finish` raises ValueError when elements are
    still missing. Writes to a range after `filled` reported it are not detected: the caller
    promises finality.
    """

    def __init__(self, buf: np.ndarray):
        if buf.ndim != 1 or not buf.flags.c_contiguous:
            raise ValueError("ResultDigest needs a 1-D C-contiguous array")
        self.buf = buf
        self._bytes = memoryview(buf).cast("B")
        self._item = buf.itemsize
        self._hash = blake3.blake3(max_threads=1)  # one core: peers sharing a host must not oversubscribe it
        self.frontier = 0  # elements [0, frontier) are filled and queued for hashing
        self._last: concurrent.futures.Future | None = None  # the last queued update
        self._pending: dict[int, int] = {}  # filled ranges beyond the frontier: lo -> hi
        self._starts: list[int] = []  # their starts, sorted

    def filled(self, lo: int, hi: int) -> None:
        """Record [lo, hi) as final; queue the hash of the prefix it completes (never blocks)."""
        if not 0 <= lo < hi <= self.buf.size:
            raise ValueError(f"range [{lo}, {hi}) outside 0..{self.buf.size}")
        i = bisect.bisect(self._starts, lo)
        if lo < self.frontier or (i and self._pending[self._starts[i - 1]] > lo) or \
                (i < len(self._starts) and self._starts[i] < hi):
            raise ValueError(f"range [{lo}, {hi}) filled twice")
        self._starts.insert(i, lo)
        self._pending[lo] = hi
        end = self.frontier
        while end in self._pending:
            end = self._pending.pop(end)
            del self._starts[0]  # the prefix grows from the smallest start
        if end > self.frontier:
            view = self._bytes[self.frontier * self._item:end * self._item]
            self._last = _HASHER.submit(self._hash.update, view)
            self.frontier = end

    def missing(self) -> int:
        """Elements not filled yet (0 when the buffer is complete)."""
        return self.buf.size - self.frontier - sum(hi - lo for lo, hi in self._pending.items())

    async def finish(self) -> bytes:
        """The digest (32 bytes), once the queued hashing is done. Raises ValueError when some
        element was never filled (nothing is hashed past the gap)."""
        if self.frontier != self.buf.size:
            raise ValueError(f"{self.missing()} elements of the result were never filled")
        if self._last is not None:
            await asyncio.wrap_future(self._last)
        return self._hash.digest(length=DIGEST_BYTES)
