"""ResultDigest: the vote digest hashed while the result is written equals `result_digest` of the whole tensor."""

import asyncio

import numpy as np
import pytest

from shoal.common.tensors import RESULT_BLOCK_BYTES, digest, result_digest
from shoal.peer.result_digest import ResultDigest


def _ranges(n: int, step: int) -> list[tuple[int, int]]:
    return [(lo, min(n, lo + step)) for lo in range(0, n, step)]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("order", ["in_order", "reversed", "shuffled", "shards_interleaved"])
def test_incremental_digest_equals_whole_tensor_digest(dtype, order):
    rng = np.random.default_rng(7)
    buf = rng.standard_normal(10_007).astype(dtype)
    spans = _ranges(buf.size, 333)
    if order == "reversed":
        spans.reverse()
    elif order == "shuffled":
        spans = [spans[i] for i in rng.permutation(len(spans))]
    elif order == "shards_interleaved":  # four owners' chunks arriving round-robin, as in the butterfly
        quarters = [spans[i::4] for i in range(4)]
        spans = [s for group in zip(*quarters) for s in group] + [s for q in quarters for s in q[len(quarters[-1]):]]
    rd = ResultDigest(buf)
    for lo, hi in spans:
        rd.filled(lo, hi)
    assert rd.missing() == 0
    assert asyncio.run(rd.finish()) == result_digest(buf)


def test_digest_sees_values_written_before_each_range_is_filled():
    buf = np.zeros(1000, dtype=np.float32)
    rd = ResultDigest(buf)
    for lo, hi in reversed(_ranges(1000, 100)):
        buf[lo:hi] = np.arange(lo, hi)
        rd.filled(lo, hi)
    assert asyncio.run(rd.finish()) == result_digest(np.arange(1000, dtype=np.float32))


def test_missing_elements_and_double_fills_are_refused():
    buf = np.ones(100, dtype=np.float32)
    rd = ResultDigest(buf)
    rd.filled(0, 50)
    rd.filled(60, 100)
    assert rd.missing() == 10
    with pytest.raises(ValueError, match="never filled"):
        asyncio.run(rd.finish())
    with pytest.raises(ValueError, match="twice"):
        rd.filled(10, 20)
    with pytest.raises(ValueError, match="twice"):
        rd.filled(60, 70)
    with pytest.raises(ValueError, match="twice"):
        rd.filled(55, 65)  # overlaps [60, 100)
    with pytest.raises(ValueError, match="outside"):
        rd.filled(90, 101)
    rd.filled(50, 60)
    assert asyncio.run(rd.finish()) == result_digest(buf)


def test_non_contiguous_buffer_is_refused():
    with pytest.raises(ValueError):
        ResultDigest(np.ones((4, 4), dtype=np.float32)[:, 0])


@pytest.mark.parametrize("size", [1, RESULT_BLOCK_BYTES // 4 - 1, RESULT_BLOCK_BYTES // 4, RESULT_BLOCK_BYTES // 4 + 1,
                                  3 * RESULT_BLOCK_BYTES // 4 + 12_345])
def test_blocks_across_chunk_boundaries_in_any_order(size):
    """Chunks that straddle 1 MiB blocks, filled in a random order, give the whole-buffer digest,
    and it is not the one-level digest of the same bytes (no silent fallback)."""
    rng = np.random.default_rng(size)
    buf = rng.standard_normal(size).astype(np.float32)
    spans = _ranges(size, 100_003)
    rd = ResultDigest(buf)
    for i in rng.permutation(len(spans)):
        rd.filled(*spans[i])
    got = asyncio.run(rd.finish())
    assert got == result_digest(buf) and got != digest(buf)


def test_result_digest_binds_length_and_content():
    a = np.zeros(RESULT_BLOCK_BYTES // 4, dtype=np.float32)
    b = np.zeros(RESULT_BLOCK_BYTES // 4 + 1, dtype=np.float32)
    c = a.copy()
    c[-1] = 1.0
    assert len({result_digest(a), result_digest(b), result_digest(c), result_digest(a[:-1])}) == 4


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_one_range_over_many_blocks_and_ranges_inside_one_block(dtype):
    """A range covering 3+ whole and partial blocks, then small ranges inside one block: the
    whole-buffer digest, whatever the itemsize."""
    item = np.dtype(dtype).itemsize
    per_block = RESULT_BLOCK_BYTES // item
    buf = np.random.default_rng(3).standard_normal(4 * per_block + 7).astype(dtype)
    rd = ResultDigest(buf)
    rd.filled(per_block // 2, per_block // 2 + 3 * per_block)  # 3 blocks' worth over 4 blocks
    for lo in range(0, per_block // 2, per_block // 8):
        rd.filled(lo, min(per_block // 2, lo + per_block // 8))
    rd.filled(per_block // 2 + 3 * per_block, buf.size)
    assert asyncio.run(rd.finish()) == result_digest(buf)


def test_an_empty_result_has_a_digest_and_blocks_must_fit_the_length():
    from shoal.common.tensors import combine_result_blocks

    empty = np.zeros(0, dtype=np.float32)
    assert asyncio.run(ResultDigest(empty).finish()) == result_digest(empty) == combine_result_blocks(0, [])
    with pytest.raises(ValueError, match="block digests"):
        combine_result_blocks(RESULT_BLOCK_BYTES + 1, [bytes(32)])
    with pytest.raises(ValueError, match="block digests"):
        combine_result_blocks(10, [bytes(31)])
