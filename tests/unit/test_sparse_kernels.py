"""The compiled sparse kernels (peer.sparse_kernels) against a numpy reference of the same
definitions (peer.sparse's module docstring): selection with ties to the lower index, the
scale's rounding rules, sign-magnitude codes, the error-feedback candidate β·e + Δ, and the
checked decode; byte for byte, on random data, ties, zeros, subnormals and non-finite values."""

from __future__ import annotations

import numpy as np
import pytest

from shoal.common.errors import InvalidArgument
from shoal.peer import sparse, sparse_kernels
from shoal.peer.sparse import ErrorAccumulator, SparseCodec, SparseEncoded, decode_sparse, encode

_F32_MAX = float(np.finfo(np.float32).max)
_TINY = np.float32(np.finfo(np.float32).smallest_subnormal)
_MAGNITUDE = np.int32(0x7FFFFFFF)  # the bits of a float32 without its sign
_INF_BITS = 0x7F800000  # float32 inf; NaN's magnitude bits are above it, every finite value's below


def _select(rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Top-k magnitudes of each row of `(r, L)` float32: `(r, k)` column indices, ascending
    (int64), and their values (float32); None when a row holds NaN or inf. Ties at the threshold
    go to the lower index.

    Magnitudes are compared as the int32 bits of |x| (sign bit cleared): IEEE 754 orders the bit
    patterns of non-negative floats as their values, so the order and the ties are exactly the
    float order's, and numpy partitions int32 several times faster than float32. NaN and inf have
    the largest patterns, so a row holding any has one among its k largest: checking those k is
    the finiteness check."""
    length = rows.shape[1]
    a = np.ascontiguousarray(rows).view(np.int32) & _MAGNITUDE
    part = np.partition(a, length - k, axis=1)
    if (part[:, length - k:] >= _INF_BITS).any():
        return None
    t = part[:, length - k:length - k + 1]  # k-th largest, (r, 1)
    keep = a >= t
    flat = np.flatnonzero(keep)  # row-major: chunk order, ascending index within a chunk
    if flat.size != rows.shape[0] * k:  # every row keeps >= k; more: its threshold ties
        over = np.flatnonzero(keep.sum(axis=1) > k)
        sub, st = a[over], t[over]
        gt, eq = sub > st, sub == st
        need = k - gt.sum(axis=1, keepdims=True)
        keep[over] = gt | (eq & (np.cumsum(eq, axis=1) <= need))  # lowest indices win the tie
        flat = np.flatnonzero(keep)
    return (flat % length).reshape(-1, k), rows.reshape(-1)[flat].reshape(-1, k)


def _quantize(vals: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """`(r, k)` float32 values -> `(r, k)` uint8 sign-magnitude codes and `(r,)` float32 scales."""
    levels = 1 << (bits - 1)
    mag = np.abs(vals).astype(np.float64)
    absmax = mag.max(axis=1)
    scale = (absmax / levels).astype(np.float32)
    short = scale.astype(np.float64) * levels < absmax  # float32 rounding left the top below a level
    scale[short] = np.nextafter(scale[short], np.float32(np.inf))
    scale[(scale == 0) & (absmax > 0)] = _TINY
    big = scale.astype(np.float64) * levels > _F32_MAX  # keep every level finite
    scale[big] = np.nextafter(scale[big], np.float32(0))
    s64 = scale.astype(np.float64)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        m = np.where(s64 > 0, np.rint(mag / np.where(s64 > 0, s64, 1.0)), 1.0)
    m = (np.clip(m, 1, levels) - 1).astype(np.uint8)
    sign = (vals < 0).astype(np.uint8) << np.uint8(bits - 1)
    return sign | m, scale


def _dequantize(codes: np.ndarray, scale: np.ndarray, bits: int) -> np.ndarray:
    """Codes and their scales (same shape) -> float32 `±(m + 1) * scale`, one rounding each."""
    m = (codes & np.uint8((1 << (bits - 1)) - 1)).astype(np.float32) + np.float32(1)
    v = m * scale.astype(np.float32)
    return np.where(codes >> np.uint8(bits - 1), -v, v)


def _unpack(data: bytes, count: int, width: int, field: str) -> np.ndarray:
    """Inverse of `_pack`: `(count,)` uint16. Refuses nonzero padding bits (naming `field`)."""
    groups = -(-count // 8)
    raw = np.zeros((groups, 16), dtype=np.uint8)
    flat = np.zeros(groups * width, dtype=np.uint8)
    flat[:len(data)] = np.frombuffer(data, dtype=np.uint8)
    raw[:, :width] = flat.reshape(groups, width)
    words = raw.view("<u8").astype(np.uint64)
    lo, hi = words[:, 0], words[:, 1]
    mask = np.uint64((1 << width) - 1)
    out = np.empty((groups, 8), dtype=np.uint64)
    for i in range(8):
        s = i * width
        if s + width <= 64:
            out[:, i] = (lo >> np.uint64(s)) & mask
        elif s >= 64:
            out[:, i] = (hi >> np.uint64(s - 64)) & mask
        else:
            out[:, i] = ((lo >> np.uint64(s)) | (hi << np.uint64(64 - s))) & mask
    out = out.reshape(-1)
    if out[count:].any():  # the padding bits of the last byte decode as codes past the last
        raise InvalidArgument(f"{field}: nonzero padding bits after the last code")
    return out[:count].astype("<u2")


def _reference_fields(v: np.ndarray, chunk: int, k: int, bits: int):
    """(cols, codes, scales) of the float32 vector `v` by the numpy reference, or None when a
    chunk holds NaN or inf."""
    cols, codes, scales = [], [], []
    for a in range(0, v.size, chunk):
        row = v[a:a + chunk].reshape(1, -1)
        selected = _select(row, min(k, row.shape[1]))
        if selected is None:
            return None
        c, vals = selected
        q, s = _quantize(vals, bits)
        cols.append(c.reshape(-1))
        codes.append(q.reshape(-1))
        scales.append(s)
    cat = lambda parts, dt: np.concatenate(parts) if parts else np.zeros(0, dt)  # noqa: E731
    return cat(cols, np.int64), cat(codes, np.uint8), cat(scales, np.float32)


def _cases(seed: int, count: int):
    rng = np.random.default_rng(seed)
    for trial in range(count):
        n = int(rng.integers(1, 6000))
        chunk = int(rng.choice([1, 2, 31, 32, 64, 100, 256, 1024, 4100]))
        k = int(rng.integers(1, min(chunk, 70) + 1)) if trial % 3 else int(rng.integers(1, chunk + 1))
        bits = int(rng.integers(2, 9))
        x = (rng.standard_normal(n) * 10.0 ** float(rng.integers(-44, 37))).astype(np.float32)
        kind = trial % 5
        if kind == 1:
            x = np.round(x * 3).astype(np.float32)  # many ties
        elif kind == 2:
            x[:] = 0
            x[rng.integers(0, n, 3)] = -2.5  # mostly zeros
        elif kind == 3:
            x[rng.integers(0, n)] = rng.choice([np.inf, -np.inf, np.nan])
        yield trial, x, chunk, k, bits


@pytest.mark.parametrize("seed", range(4))
def test_encode_matches_the_numpy_reference(seed):
    for trial, x, chunk, k, bits in _cases(seed, 60):
        ref = _reference_fields(x, chunk, k, bits)
        cols, codes, scales, bad = sparse_kernels.encode_values(x, chunk, k, bits)
        if ref is None:
            first = int(np.flatnonzero(~np.isfinite(x))[0]) // chunk * chunk
            assert bad == first, (trial, bad, first)
            continue
        assert bad == -1, trial
        assert (cols == ref[0]).all() and (codes == ref[1]).all(), trial
        assert scales.tobytes() == ref[2].tobytes(), trial


@pytest.mark.parametrize("seed", range(3))
def test_the_error_fed_candidate_is_the_float32_expression(seed):
    """β·e + Δ in the kernel is np.multiply(e, β) then + Δ: two float32 roundings, no fused
    multiply-add; the payload of a segment is then the reference's of that candidate."""
    for trial, x, chunk, k, bits in _cases(100 + seed, 40):
        if not np.isfinite(x).all():
            continue
        rng = np.random.default_rng(trial)
        e = (rng.standard_normal(x.size) * float(np.abs(x).max() or 1.0)).astype(np.float32)
        beta = np.float32(rng.choice([0.0, 0.3, 0.8, 0.999, 1.0]))
        lo = int(rng.integers(0, x.size // chunk + 1)) * chunk
        hi = x.size if rng.random() < 0.5 else min(x.size, lo + chunk * int(rng.integers(0, 5)))
        candidate = np.multiply(e[lo:hi], beta)
        candidate += x[lo:hi]
        ref = _reference_fields(candidate, chunk, k, bits)
        cols, codes, scales, bad = sparse_kernels.encode_error_fed(e, x, beta, lo, hi, chunk, k, bits)
        if ref is None:
            assert bad >= lo
            continue
        assert bad == -1 and (cols == ref[0]).all() and (codes == ref[1]).all(), trial
        assert scales.tobytes() == ref[2].tobytes(), trial


def test_an_accumulator_proposal_is_the_encoding_of_its_candidate():
    rng = np.random.default_rng(7)
    n, codec = 10_000, SparseCodec("topk", 1024, 10, 2)
    acc = ErrorAccumulator(n, codec, 0.8)
    delta = rng.standard_normal(n).astype(np.float32)
    acc.propose(delta, attempt=0)
    acc.commit(attempt=0)  # e != 0 from here
    delta2 = rng.standard_normal(n).astype(np.float32)
    candidate = np.multiply(acc.accumulator, np.float32(0.8))
    candidate += delta2
    assert acc.propose(delta2, attempt=1) == encode(candidate, codec)


@pytest.mark.parametrize("seed", range(3))
def test_decode_matches_the_numpy_reference(seed):
    for trial, x, chunk, k, bits in _cases(200 + seed, 40):
        if not np.isfinite(x).all():
            continue
        enc = encode(x, SparseCodec("topk", max(chunk, 2), min(k, max(chunk, 2)), bits))
        codec = SparseCodec("topk", enc.chunk, enc.k, enc.bits)
        index, value = decode_sparse(enc)
        kept = codec.kept(enc.count)
        cols = _unpack(enc.indices, kept, codec.index_bits, "indices").astype(np.int64)
        codes = _unpack(enc.values, kept, codec.bits, "values")
        per_chunk = [min(codec.k, enc.count - a) for a in range(0, enc.count, codec.chunk)]
        chunk_of = np.repeat(np.arange(len(per_chunk)), per_chunk)
        scale = np.frombuffer(enc.scale, "<f4").astype(np.float32)
        assert (index == chunk_of * codec.chunk + cols).all(), trial
        assert value.tobytes() == _dequantize(codes, np.repeat(scale, per_chunk), codec.bits).tobytes(), trial


def test_decode_refuses_bad_indices_and_padding_naming_the_field():
    enc = encode(np.arange(1, 33, dtype=np.float32), SparseCodec("topk", 16, 3, 2))  # columns 13, 14, 15
    swapped = sparse._pack(np.array([14, 13, 15, 13, 14, 15]), 4)
    with pytest.raises(InvalidArgument, match="^indices: not strictly increasing within chunk 0"):
        decode_sparse(SparseEncoded(enc.codec, 32, 16, 3, 2, enc.scale, swapped, enc.values))
    padded = bytearray(enc.values)
    padded[-1] |= 0x80  # 6 codes of 2 bits: 4 padding bits in the last byte
    with pytest.raises(InvalidArgument, match="^values: nonzero padding bits"):
        decode_sparse(SparseEncoded(enc.codec, 32, 16, 3, 2, enc.scale, enc.indices, bytes(padded)))
    short = encode(np.arange(1, 21, dtype=np.float32), SparseCodec("topk", 16, 3, 2))  # last chunk: 4 elements
    wide = sparse._pack(np.array([13, 14, 15, 0, 1, 9]), 4)
    with pytest.raises(InvalidArgument, match="^indices: index 9 out of range for chunk 1 of 4 elements"):
        decode_sparse(SparseEncoded(short.codec, 20, 16, 3, 2, short.scale, wide, short.values))


def test_scatter_add_is_the_float32_sum_in_order():
    rng = np.random.default_rng(3)
    out = rng.standard_normal(1000).astype(np.float32)
    ref = out.copy()
    index = np.sort(rng.choice(1000, 300, replace=False)).astype(np.int64)
    value = rng.standard_normal(300).astype(np.float32)
    w = np.float32(0.37)
    sparse_kernels.scatter_add_weighted(out, index, value, w)
    ref[index] += w * value
    assert out.tobytes() == ref.tobytes()
    sparse_kernels.scatter_sub(out, index, value)
    ref[index] -= value
    assert out.tobytes() == ref.tobytes()
