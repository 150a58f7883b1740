"""The vote digest of a collective's result, hashed while the result is still being written.

A collective fills its result buffer chunk by chunk and out of order (shard owners publish and
the all-gather delivers concurrently); the vote needs `shoal.common.tensors.result_digest` of the
whole buffer: BLAKE3-256 over the BLAKE3-256 digests of its 1 MiB blocks. Hashing it only once the
last chunk has landed puts a full pass over the tensor (BLAKE3 of 64 MB: 10-25 ms on a busy 2-core
host) on the collective's critical path after the last byte. `ResultDigest` instead hashes each
block as soon as every byte of it is final, on one worker thread shared by the process (BLAKE3
releases the GIL), so the event loop never blocks on a hash, and what is left when the last chunk
lands is the blocks it completed (one or two for a chunk of up to 1 MiB) and the outer hash of
the block digests.

Hashing the whole buffer in order from element 0 instead would leave the ring's peer whose
all-gather brings shard 0 last hashing 3/4 of the tensor after its last chunk: 10-35 ms of a
0.83 s all-reduce at 1 Gbit/s.

Pure bookkeeping plus hashing; no I/O. Tested alone (tests/test_result_digest.py).
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures

import numpy as np

from shoal.common.tensors import RESULT_BLOCK_BYTES, combine_result_blocks, result_block_digest, result_digest

__all__ = ["ResultDigest", "off_loop", "result_digest"]

# One thread for every digest of the process: peers sharing a host do not each take a core for
# hashing.
_HASHER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="shoal-digest")


async def off_loop(fn, *args):
    """`fn(*args)` (a hash of a whole tensor, e.g. a state's digest) on the worker thread that
    hashes results, awaited: the event loop keeps serving streams meanwhile (BLAKE3 releases
    the GIL), and the process still hashes on one core at a time."""
    return await asyncio.wrap_future(_HASHER.submit(fn, *args))


class ResultDigest:
    """`shoal.common.tensors.result_digest` of a 1-D C-contiguous array `buf`, fed as its element
    ranges become final.

    `filled(lo, hi)`: elements [lo, hi) hold their final values and will not be written again
    (ranges may come in any order; none may overlap another). `finish()` (async): the digest,
    equal to `result_digest(buf)`; call it once every element is filled.

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
        n = len(self._bytes)
        blocks = -(-n // RESULT_BLOCK_BYTES)
        # Per block: bytes not final yet, then its digest (a future on the hashing thread).
        self._left = [min(RESULT_BLOCK_BYTES, n - b * RESULT_BLOCK_BYTES) for b in range(blocks)]
        self._digests: list[concurrent.futures.Future | None] = [None] * blocks
        self._unfilled = buf.size  # elements
        self._starts: list[int] = []  # filled ranges, sorted by start, disjoint: start -> end
        self._ends: dict[int, int] = {}

    def filled(self, lo: int, hi: int) -> None:
        """Record [lo, hi) as final; queue the hash of every block it completes (never blocks)."""
        if not 0 <= lo < hi <= self.buf.size:
            raise ValueError(f"range [{lo}, {hi}) outside 0..{self.buf.size}")
        i = bisect.bisect(self._starts, lo)
        if (i and self._ends[self._starts[i - 1]] > lo) or (i < len(self._starts) and self._starts[i] < hi):
            raise ValueError(f"range [{lo}, {hi}) filled twice")
        self._starts.insert(i, lo)
        self._ends[lo] = hi
        self._unfilled -= hi - lo
        a, z = lo * self._item, hi * self._item
        for b in range(a // RESULT_BLOCK_BYTES, (z - 1) // RESULT_BLOCK_BYTES + 1):
            b0 = b * RESULT_BLOCK_BYTES
            self._left[b] -= min(z, b0 + RESULT_BLOCK_BYTES) - max(a, b0)
            if self._left[b] == 0:
                self._digests[b] = _HASHER.submit(result_block_digest, self._bytes[b0:b0 + RESULT_BLOCK_BYTES])

    def missing(self) -> int:
        """Elements not filled yet (0 when the buffer is complete)."""
        return self._unfilled

    async def finish(self) -> bytes:
        """The digest (32 bytes), once the queued block hashes are done. Raises ValueError when
        some element was never filled."""
        if self._unfilled:
            raise ValueError(f"{self._unfilled} elements of the result were never filled")
        assert all(f is not None for f in self._digests), "a block was filled but never hashed"
        blocks = [await asyncio.wrap_future(f) for f in self._digests]
        return combine_result_blocks(len(self._bytes), blocks)
