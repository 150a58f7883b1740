"""Segmented sparse contributions (peer.sparse): a contribution encoded in segments of whole
chunks is the whole payload's chunks, reassembled from any split of its byte stream, summed to
the same bytes; malformed streams are refused by field; the bit packing matches its
definition for every width."""

from __future__ import annotations

import numpy as np
import pytest

from shoal.common.errors import InvalidArgument
from shoal.peer import sparse
from shoal.peer.sparse import (ErrorAccumulator, SegmentReader, SparseCodec, decode_segment, encode, segment_bounds,
                               sum_contributions, sum_range, sum_segments)


def _reference_pack(codes, width: int) -> bytes:
    """The wire definition, bit by bit: code i occupies stream bits [i*w, (i+1)*w), LSB first."""
    bits = [(int(c) >> b) & 1 for c in codes for b in range(width)]
    bits += [0] * (-len(bits) % 8)
    return bytes(sum(bits[i + j] << j for j in range(8)) for i in range(0, len(bits), 8))


def _unpack(packed: bytes, count: int, width: int) -> tuple[bool, np.ndarray]:
    """The decode kernel's unpacking: (padding bits all 0, the codes)."""
    from shoal.peer import sparse_kernels

    out = np.empty(count, np.int64)
    return bool(sparse_kernels._unpack_into(np.frombuffer(packed, np.uint8), count, width, out)), out


@pytest.mark.parametrize("width", range(2, 17))
def test_packing_matches_the_definition_and_round_trips(width):
    rng = np.random.default_rng(width)
    for k in (0, 1, 7, 8, 9, 63, 100):
        codes = rng.integers(0, 1 << width, k).astype(np.uint16)
        packed = sparse._pack(codes, width)
        assert packed == _reference_pack(codes, width)
        ok, unpacked = _unpack(packed, k, width)
        assert ok and (unpacked == codes).all()


def test_unpacking_refuses_nonzero_padding_for_every_width():
    for width in range(2, 17):
        k = 5  # 5 * width bits: padding in the last byte unless 8 | 5 * width
        packed = bytearray(sparse._pack(np.ones(k, np.uint16), width))
        if (k * width) % 8:
            packed[-1] |= 0x80
            assert not _unpack(bytes(packed), k, width)[0]


def test_segment_bounds_are_whole_chunks():
    assert segment_bounds(10, 4, 8) == [(0, 8), (8, 10)]
    assert segment_bounds(10, 4, 5) == [(0, 4), (4, 8), (8, 10)]  # rounded down to whole chunks
    assert segment_bounds(3, 4, 1) == [(0, 3)]  # at least one chunk
    assert segment_bounds(0, 4) == [(0, 0)]


def _segmented(acc: ErrorAccumulator, delta: np.ndarray, segment: int, attempt=None):
    segs = [(lo, acc.propose_segment(delta, lo, hi)) for lo, hi in segment_bounds(delta.size, acc.codec.chunk, segment)]
    acc.proposed(delta, segs, attempt)
    return segs


@pytest.mark.parametrize("kind", ["topk", "dct"])
def test_segments_hold_the_whole_payloads_chunks_and_sum_to_the_same_bytes(kind):
    n, codec = 10_007, SparseCodec(kind, 256, 9, 3)
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(3)]
    whole = [encode(x, codec) for x in xs]
    segmented = [_segmented(ErrorAccumulator(n, codec, 0.9), x, 1000) for x in xs]
    assert len(segmented[0]) == 14  # 768-element segments (3 chunks), the last one partial
    decoded = [[decode_segment(lo, enc) for lo, enc in segs] for segs in segmented]
    weights = (0.5, 0.25, 0.25)
    expected = sum_contributions(whole, weights)
    assert sum_segments(decoded, n, codec, weights).tobytes() == expected.tobytes()
    out = np.full(n, 7.0, np.float32)  # a reused buffer: zeroed first
    assert sum_segments(decoded, n, codec, weights, out=out) is out
    assert out.tobytes() == expected.tobytes()
    # Summed range by range (the all-gather sums a range once every segment covering it is in),
    # cut anywhere on chunk boundaries and in any order: the same bytes.
    for w in (weights, None):
        whole_sum = sum_contributions(whole, w)
        cuts = sorted({0, n, *(int(c) * 256 for c in rng.choice(n // 256 + 1, 6, replace=False))})
        ranges = list(zip(cuts, cuts[1:]))
        rng.shuffle(ranges)
        out = np.full(n, -3.0, np.float32)
        for lo, hi in ranges:
            sum_range(decoded, lo, hi, codec, sparse.weights_of(w, 3), out)
        assert out.tobytes() == whole_sum.tobytes()
    # Every segment is the whole payload's chunks: the kept entries are the same.
    idx, val = sparse.decode_sparse(whole[0])
    seg_idx = np.concatenate([d.parsed.index + d.first for d in decoded[0]])
    seg_val = np.concatenate([d.parsed.value for d in decoded[0]])
    assert (idx == seg_idx).all() and val.tobytes() == seg_val.tobytes()


def test_a_segmented_proposal_commits_the_same_accumulator_as_a_whole_one():
    n, codec = 5_000, SparseCodec("topk", 128, 4, 2)
    rng = np.random.default_rng(4)
    whole, seg = ErrorAccumulator(n, codec, 0.8), ErrorAccumulator(n, codec, 0.8)
    for r in range(3):
        delta = rng.standard_normal(n).astype(np.float32)
        whole.propose(delta, attempt=r)
        _segmented(seg, delta, 640, attempt=r)
        whole.commit(attempt=r)
        seg.commit(attempt=r)
        assert whole.accumulator.tobytes() == seg.accumulator.tobytes()


def test_a_segment_must_start_on_a_chunk_boundary_and_proposals_must_cover_the_vector():
    n, codec = 1000, SparseCodec("topk", 100, 4, 2)
    acc, delta = ErrorAccumulator(n, codec, 0.9), np.ones(n, np.float32)
    with pytest.raises(InvalidArgument, match="delta: segment \\[50, 150\\)"):
        acc.propose_segment(delta, 50, 150)
    with pytest.raises(InvalidArgument, match="delta: segment"):
        acc.propose_segment(delta, 0, 1001)
    first = acc.propose_segment(delta, 0, 500)
    with pytest.raises(InvalidArgument, match="segments: cover \\[0, 500\\)"):
        acc.proposed(delta, [(0, first)])
    with pytest.raises(InvalidArgument, match="segments: expected a payload starting at element 500"):
        acc.proposed(delta, [(0, first), (600, first)])
    assert not acc.pending
    bad = np.ones(n, np.float32)
    bad[777] = np.nan
    with pytest.raises(InvalidArgument, match=r"delta: x: NaN or inf among elements \[700, 800\)"):
        acc.propose_segment(bad, 500, 1000)  # the message names the chunk, in elements of the whole vector


def _stream(codec: SparseCodec, n: int, segment: int, seed: int = 0) -> bytes:
    x = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    acc = ErrorAccumulator(n, codec, 0.9)
    return b"".join(enc.to_bytes() for _, enc in _segmented(acc, x, segment))


def test_the_reader_reassembles_any_split_of_the_stream():
    n, codec = 3_000, SparseCodec("topk", 100, 5, 2)
    data = _stream(codec, n, 700)
    rng = np.random.default_rng(5)
    for _ in range(5):
        cuts = np.sort(rng.choice(np.arange(1, len(data)), size=20, replace=False))
        reader, got = SegmentReader(codec, n), []
        for piece in np.split(np.frombuffer(data, np.uint8), cuts):
            assert not reader.done
            got += reader.feed(piece.tobytes())
        assert reader.done and reader.nbytes == len(data)
        assert [lo for lo, _ in got] == [0, 700, 1400, 2100, 2800]
        assert b"".join(enc.to_bytes() for _, enc in got) == data


def test_the_reader_refuses_malformed_streams_by_field():
    n, codec = 1_000, SparseCodec("topk", 100, 5, 2)
    data = _stream(codec, n, 400)
    with pytest.raises(InvalidArgument, match="header: codec topk, chunk 100; this round needs topk, chunk 50"):
        SegmentReader(SparseCodec("topk", 50, 5, 2), n).feed(data)
    with pytest.raises(InvalidArgument, match="count: a segment of 1000 elements at element 0"):
        SegmentReader(codec, 999).feed(encode(np.ones(1000, np.float32), codec).to_bytes())
    odd = encode(np.ones(150, np.float32), codec).to_bytes()  # not whole chunks, not the last
    with pytest.raises(InvalidArgument, match="count: a segment of 150 elements"):
        SegmentReader(codec, n).feed(odd)
    with pytest.raises(InvalidArgument, match="values: 3 bytes past"):
        SegmentReader(codec, n).feed(data + b"abc")
    reader = SegmentReader(codec, n)
    reader.feed(data)
    with pytest.raises(InvalidArgument, match="values: 1 bytes past"):
        reader.feed(b"x")
    empty = encode(np.ones(0, np.float32), codec).to_bytes()
    with pytest.raises(InvalidArgument, match="count: a segment of 0 elements"):
        SegmentReader(codec, n).feed(empty)
    assert SegmentReader(codec, 0).feed(empty)[0][1].count == 0  # an empty vector: one empty segment
    corrupt = bytearray(data)
    corrupt[-1] |= 0x80  # padding bits of the last segment's values
    with pytest.raises(InvalidArgument, match="values: nonzero padding"):
        for first, enc in SegmentReader(codec, n).feed(bytes(corrupt)):
            decode_segment(first, enc)


def test_sum_segments_refuses_gaps_and_other_codecs():
    n, codec = 1_000, SparseCodec("topk", 100, 5, 2)
    x = np.ones(n, np.float32)
    acc = ErrorAccumulator(n, codec, 0.9)
    parts = [decode_segment(lo, enc) for lo, enc in _segmented(acc, x, 400)]
    with pytest.raises(InvalidArgument, match="contributions: \\[0\\] has a segment at element 800"):
        sum_segments([[parts[0], parts[2]]], n, codec)
    with pytest.raises(InvalidArgument, match="contributions: \\[0\\] covers \\[0, 800\\)"):
        sum_segments([parts[:2]], n, codec)
    with pytest.raises(InvalidArgument, match="expected dct of chunk 100"):
        sum_segments([parts], n, SparseCodec("dct", 100, 5, 2))
    with pytest.raises(InvalidArgument, match="out: expected a \\(1000,\\) float32"):
        sum_segments([parts], n, codec, out=np.zeros(n, np.float64))


def test_a_dct_range_sum_ends_on_the_inverse_transforms_blocks():
    """Ranges of a "dct" sum end on multiples of 256 chunks (or the vector's end), so every peer
    inverts the same blocks whatever its arrivals cut; "topk" ranges end anywhere."""
    dct, topk = SparseCodec("dct", 64, 4, 3), SparseCodec("topk", 64, 4, 3)
    block = 256 * 64
    assert sparse.range_end(block + 640, 10 * block, topk) == block + 640
    assert sparse.range_end(block + 640, 10 * block, dct) == block
    assert sparse.range_end(640, 10 * block, dct) == 0
    assert sparse.range_end(10 * block, 10 * block, dct) == 10 * block
