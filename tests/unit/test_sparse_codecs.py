"""Sparse codecs: round-trip bounds, exact density, documented bytes, determinism and ties,
malformed payloads refused by field, the fixed-order sum, and the error-feedback accumulator's
exactly-once semantics and tracking."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.fft
from hypothesis import given, settings
from hypothesis import strategies as st
from shoal.peer.compression import payload_bytes as dense_payload_bytes
from shoal.peer.sparse import (
    HEADER_BYTES,
    ErrorAccumulator,
    SparseCodec,
    SparseEncoded,
    decode,
    decode_sparse,
    encode,
    sum_contributions,
)

from shoal.common.errors import FailedPrecondition, InvalidArgument

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)


@st.composite
def cases(draw, kind=None):
    """A codec and a float32 vector of a few chunks (the last one possibly partial)."""
    kind = kind or draw(st.sampled_from(["topk", "dct"]))
    chunk = draw(st.sampled_from([2, 3, 16, 100, 256, 4096]))
    k = draw(st.integers(1, chunk))
    bits = draw(st.integers(2, 8))
    n = draw(st.integers(0, 5 * chunk + 7) if chunk < 4096 else st.integers(0, 9000))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    scale = draw(st.sampled_from([1e-40, 1e-20, 1e-3, 1.0, 1e4, 1e30]))
    x = (rng.standard_normal(n) * scale).astype(np.float32)
    if draw(st.booleans()) and n:  # ties: repeated magnitudes of both signs, and zeros
        x = (rng.integers(-2, 3, size=n) * scale).astype(np.float32)
    return SparseCodec(kind, chunk, k, bits), x


def _reference_kept(a: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest |a|, ties to the lower index, ascending."""
    order = np.lexsort((np.arange(a.size), -np.abs(a.astype(np.float64))))
    return np.sort(order[:min(k, a.size)])


def _chunks(x: np.ndarray, chunk: int):
    for first in range(0, x.size, chunk):
        yield first, x[first:first + chunk]


def _scales(enc: SparseEncoded) -> np.ndarray:
    return np.frombuffer(enc.scale, dtype="<f4").astype(np.float64)


@SETTINGS
@given(case=cases(kind="topk"))
def test_topk_keeps_exactly_the_largest_and_bounds_their_error(case):
    codec, x = case
    enc = encode(x, codec)
    index, _ = decode_sparse(enc)
    y = decode(enc)
    assert y.dtype == np.float32 and y.shape == x.shape and np.isfinite(y).all()
    assert index.size == codec.kept(x.size)
    levels = 2 ** (codec.bits - 1)
    for c, (first, part) in enumerate(_chunks(x, codec.chunk)):
        kept = index[(index >= first) & (index < first + part.size)] - first
        assert kept.size == min(codec.k, part.size)  # density exact
        np.testing.assert_array_equal(kept, _reference_kept(part, codec.k))  # ties to the lower index
        s = _scales(enc)[c]
        a = np.abs(part.astype(np.float64))
        assert s * levels >= a[kept].max() * (1 - 2**-23)
        err = np.abs(y[first:first + part.size].astype(np.float64) - part)
        assert np.all(err[kept] <= s + a[kept].max() * 2**-22 + 2**-149)
        dropped = np.setdiff1d(np.arange(part.size), kept)
        assert np.all(y[first + dropped] == 0)
        if dropped.size:
            assert a[dropped].max() <= a[kept].min()


@SETTINGS
@given(case=cases(kind="dct"))
def test_dct_error_is_the_coefficients_error(case):
    codec, x = case
    enc = encode(x, codec)
    index, value = decode_sparse(enc)
    y = decode(enc)
    assert y.dtype == np.float32 and y.shape == x.shape and np.isfinite(y).all()
    assert index.size == codec.kept(x.size)
    for c, (first, part) in enumerate(_chunks(x, codec.chunk)):
        coeffs = scipy.fft.dct(part.astype(np.float64), type=2, norm="ortho")
        here = (index >= first) & (index < first + part.size)
        approx = np.zeros(part.size)
        approx[index[here] - first] = value[here]
        want = np.linalg.norm(approx - coeffs)  # orthonormal: the chunk's L2 error, up to rounding
        got = np.linalg.norm(y[first:first + part.size].astype(np.float64) - part)
        size = np.linalg.norm(part.astype(np.float64))
        assert abs(got - want) <= 1e-5 * size + 1e-6 * _scales(enc)[c] + 2**-140
        kept = np.abs(coeffs[index[here] - first])
        assert np.all(np.abs(approx[index[here] - first] - coeffs[index[here] - first])
                      <= _scales(enc)[c] + 1e-5 * size + 2**-140)
        assert index[here].size == min(codec.k, part.size)
        if kept.size < part.size:
            rest = np.delete(np.abs(coeffs), index[here] - first)
            assert rest.max() <= kept.min() + 1e-5 * size


def test_dct_recovers_a_chunk_made_of_few_cosines():
    basis = scipy.fft.idct(np.eye(256)[[3, 40]], type=2, norm="ortho").sum(axis=0)
    x = np.tile(basis, 4).astype(np.float32)
    y = decode(encode(x, SparseCodec("dct", 256, 2, 8)))
    np.testing.assert_allclose(y, x, atol=1e-6)
    # The same signal in the value domain needs many more elements.
    assert np.linalg.norm(decode(encode(x, SparseCodec("topk", 256, 2, 8))) - x) > 0.5 * np.linalg.norm(x)


@pytest.mark.parametrize("kind", ["topk", "dct"])
@pytest.mark.parametrize("n", [0, 1, 4095, 4096, 4097, 3 * 4096, 3 * 4096 + 5])
def test_bytes_are_as_documented(kind, n):
    codec = SparseCodec(kind)  # C = 4096, k = 64, b = 2
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    enc = encode(x, codec)
    wire = enc.to_bytes()
    kept = (n // 4096) * 64 + min(64, n % 4096)
    chunks = -(-n // 4096)
    assert len(wire) == enc.nbytes == codec.payload_bytes(n)
    assert len(wire) == 20 + 4 * chunks + -(-kept * 12 // 8) + -(-kept * 2 // 8)
    assert len(enc.scale) == 4 * chunks
    assert len(enc.indices) == -(-kept * 12 // 8) and len(enc.values) == -(-kept * 2 // 8)
    if n and n % 4096 == 0:
        assert len(wire) == HEADER_BYTES + (n // 4096) * 116  # 116 B per chunk: 4 + 64 * 14 / 8
    assert SparseEncoded.from_bytes(wire) == enc


def test_bytes_per_element_formula():
    codec = SparseCodec("topk", 4096, 64, 2)
    assert codec.index_bits == 12
    assert codec.bytes_per_element() == (64 * (12 + 2) / 8 + 4) / 4096 == 116 / 4096
    n = 4096 * 1000
    assert codec.bytes_per_element(n) == (20 + 116 * 1000) / n
    assert 4 / codec.bytes_per_element() > 140  # vs float32
    assert dense_payload_bytes(n, "int8") / codec.payload_bytes(n) > 35  # vs int8
    assert SparseCodec("topk", 1000, 10, 5).index_bits == 10
    assert SparseCodec("topk", 1024, 10, 5).index_bits == 10
    assert SparseCodec("topk", 1025, 10, 5).index_bits == 11


@SETTINGS
@given(case=cases())
def test_encoding_is_deterministic(case):
    codec, x = case
    enc = encode(x, codec)
    assert encode(x.copy(), codec) == enc
    assert SparseEncoded.from_bytes(enc.to_bytes()) == enc
    assert decode(enc).tobytes() == decode(SparseEncoded.from_bytes(enc.to_bytes())).tobytes()


def test_ties_go_to_the_lower_index():
    x = np.array([1, -1, 1, -1, 0.5, -2, 1, 1], dtype=np.float32)
    index, _ = decode_sparse(encode(x, SparseCodec("topk", 8, 3, 8)))
    assert index.tolist() == [0, 1, 5]
    zeros = np.zeros(20, dtype=np.float32)
    index, value = decode_sparse(encode(zeros, SparseCodec("topk", 8, 2, 2)))
    assert index.tolist() == [0, 1, 8, 9, 16, 17] and not value.any()
    assert not decode(encode(zeros, SparseCodec("dct", 8, 2, 2))).any()


def test_non_finite_input_is_refused():
    for bad in (np.nan, np.inf, -np.inf):
        x = np.ones(10000, dtype=np.float32)
        x[9000] = bad
        for kind in ("topk", "dct"):
            with pytest.raises(InvalidArgument, match=r"^x: NaN or inf among elements \[8192, 10000\)"):
                encode(x, SparseCodec(kind))
    with pytest.raises(InvalidArgument, match="^x: DCT coefficients"):
        encode(np.full(4096, 3e38, dtype=np.float32), SparseCodec("dct"))
    assert np.isfinite(decode(encode(np.full(4096, 3e38, dtype=np.float32), SparseCodec("topk")))).all()
    with pytest.raises(InvalidArgument, match="^x: expected a 1-D float32"):
        encode(np.ones(4), SparseCodec())
    with pytest.raises(InvalidArgument, match="^codec: expected a SparseCodec"):
        encode(np.ones(4, dtype=np.float32), "topk")


@pytest.mark.parametrize("kwargs, field", [
    ({"kind": "randk"}, "kind"), ({"chunk": 1}, "chunk"), ({"chunk": 65537}, "chunk"),
    ({"chunk": 4096.0}, "chunk"), ({"k": 0}, "k"), ({"k": 4097}, "k"), ({"k": True}, "k"),
    ({"bits": 1}, "bits"), ({"bits": 9}, "bits"),
])
def test_codec_settings_are_checked(kwargs, field):
    with pytest.raises(InvalidArgument, match=f"^{field}: "):
        SparseCodec(**kwargs)


def _payload(kind="topk", n=3 * 4096 + 100, **codec) -> SparseEncoded:
    x = np.random.default_rng(7).standard_normal(n).astype(np.float32)
    return encode(x, SparseCodec(kind, **codec))


def _replace(enc: SparseEncoded, **fields) -> SparseEncoded:
    return SparseEncoded(**{**enc.__dict__, **fields})


@pytest.mark.parametrize("kind", ["topk", "dct"])
def test_truncated_and_padded_wire_forms_are_refused(kind):
    wire = _payload(kind).to_bytes()
    scale_end = HEADER_BYTES + 4 * 4
    index_end = scale_end + -(-(3 * 64 + 64) * 12 // 8)
    for cut, field in [(0, "header"), (19, "header"), (20, "scale"), (scale_end - 1, "scale"),
                       (scale_end, "indices"), (index_end - 1, "indices"), (index_end, "values"),
                       (len(wire) - 1, "values")]:
        with pytest.raises(InvalidArgument, match=f"^{field}: .*truncated"):
            SparseEncoded.from_bytes(wire[:cut])
    with pytest.raises(InvalidArgument, match="^values: 1 trailing bytes"):
        SparseEncoded.from_bytes(wire + b"\0")
    with pytest.raises(InvalidArgument, match="^header: reserved"):
        SparseEncoded.from_bytes(wire[:2] + b"\1\0" + wire[4:])


def test_header_fields_are_checked():
    wire = _payload().to_bytes()
    for offset, byte, field in [(0, 9, "codec"), (0, 3, "codec"), (1, 1, "bits"), (1, 9, "bits")]:
        bad = bytearray(wire)
        bad[offset] = byte
        with pytest.raises(InvalidArgument, match=f"^{field}: "):
            SparseEncoded.from_bytes(bytes(bad))
    for offset, value, field in [(4, 1, "chunk"), (4, 65537, "chunk"), (8, 0, "k"), (8, 4097, "k")]:
        bad = bytearray(wire)
        bad[offset:offset + 4] = value.to_bytes(4, "little")
        with pytest.raises(InvalidArgument, match=f"^{field}: "):
            SparseEncoded.from_bytes(bytes(bad))


def test_malformed_payloads_are_refused_by_field():
    enc = _payload()  # 4 chunks, the last of 100 elements
    cases = [
        (_replace(enc, scale=enc.scale[:-4]), "scale", "expected 16 bytes for 4 chunks"),  # wrong chunk count
        (_replace(enc, count=enc.count + 4096), "scale", "for 5 chunks"),
        (_replace(enc, scale=enc.scale[:4] + np.float32(np.nan).tobytes() + enc.scale[8:]), "scale", "non-finite"),
        (_replace(enc, scale=np.float32(np.inf).tobytes() + enc.scale[4:]), "scale", "non-finite"),
        (_replace(enc, scale=np.float32(-1).tobytes() + enc.scale[4:]), "scale", "negative"),
        (_replace(enc, scale=np.float32(3e38).tobytes() + enc.scale[4:]), "scale", "too large"),
        (_replace(enc, indices=enc.indices[:-1]), "indices", "expected"),
        (_replace(enc, values=enc.values + b"\0"), "values", "expected"),
        (_replace(enc, count=-1), "count", ""),
        (_replace(enc, count=1.5), "count", ""),
        (_replace(enc, chunk=1), "chunk", ""),
        (_replace(enc, k=0), "k", ""),
        (_replace(enc, bits=9), "bits", ""),
        (_replace(enc, codec=0), "codec", ""),
        ("not a payload", "enc", ""),
    ]
    for bad, field, text in cases:
        with pytest.raises(InvalidArgument, match=f"^{field}: .*{text}"):
            decode(bad)


def _repack(enc: SparseEncoded, cols: np.ndarray) -> SparseEncoded:
    from shoal.peer.sparse import _pack

    return _replace(enc, indices=_pack(cols, int(enc.chunk - 1).bit_length()))


def test_indices_out_of_range_or_out_of_order_are_refused():
    enc = _payload(n=4096 + 100, chunk=4096, k=4)  # chunks of 4096 and 100 elements
    index, _ = decode_sparse(enc)
    cols = index - np.repeat([0, 4096], 4)
    out_of_tail = cols.copy()
    out_of_tail[-1] = 100  # < 4096 fits in 12 bits, but the last chunk has 100 elements
    with pytest.raises(InvalidArgument, match="^indices: index 100 out of range for chunk 1 of 100 elements"):
        decode(_repack(enc, out_of_tail))
    repeated = cols.copy()
    repeated[1] = repeated[0]
    with pytest.raises(InvalidArgument, match="^indices: not strictly increasing within chunk 0"):
        decode(_repack(enc, repeated))
    swapped = cols.copy()
    swapped[[4, 5]] = swapped[[5, 4]]
    with pytest.raises(InvalidArgument, match="^indices: not strictly increasing within chunk 1"):
        decode(_repack(enc, swapped))
    odd = _payload(n=6000, chunk=3000, k=2)  # 12 index bits can say 4095 >= 3000
    cols = decode_sparse(odd)[0] - np.repeat([0, 3000], 2)
    cols[1] = 3500
    with pytest.raises(InvalidArgument, match="^indices: index 3500 out of range for chunk 0 of 3000"):
        decode(_repack(odd, cols))


def test_padding_bits_must_be_zero():
    enc = _payload(n=4096 + 1, chunk=4096, k=3, bits=3)  # 4 kept: 48 index bits, 12 value bits
    values = bytearray(enc.values)
    values[-1] |= 0x80
    with pytest.raises(InvalidArgument, match="^values: nonzero padding bits"):
        decode(_replace(enc, values=bytes(values)))
    odd = _payload(n=4096 + 1, chunk=4096, k=2, bits=3)  # 3 kept: 36 index bits
    indices = bytearray(odd.indices)
    indices[-1] |= 0x80
    with pytest.raises(InvalidArgument, match="^indices: nonzero padding bits"):
        decode(_replace(odd, indices=bytes(indices)))


# ---------------------------------------------------------------------------------------------
# The fixed-order sum


@pytest.mark.parametrize("kind", ["topk", "dct"])
def test_sum_is_the_sum_of_decodes_and_the_same_bytes_every_time(kind):
    rng = np.random.default_rng(3)
    n = 5 * 1024 + 17
    encs = [encode(rng.standard_normal(n).astype(np.float32), SparseCodec(kind, 1024, 32, b))
            for b in (2, 4, 8, 3)]
    total = sum_contributions(encs)
    assert total.dtype == np.float32 and total.shape == (n,)
    decoded = [decode(e) for e in encs]
    if kind == "topk":  # exact float32 additions in participant order
        assert total.tobytes() == sum_contributions(decoded).tobytes()
        expect = ((decoded[0] + decoded[1]) + decoded[2]) + decoded[3]
        assert total.tobytes() == expect.tobytes()
    else:  # one inverse of the summed coefficients: equal up to rounding
        np.testing.assert_allclose(total, sum(d.astype(np.float64) for d in decoded), atol=1e-5)
    wire = [SparseEncoded.from_bytes(e.to_bytes()) for e in encs]
    assert sum_contributions(wire).tobytes() == total.tobytes()
    assert sum_contributions(encs[:1]).tobytes() == decode(encs[0]).tobytes()


def test_sum_refuses_mixed_or_malformed_contributions():
    a = _payload(n=5000)
    b = _payload(n=5001)
    d = _payload("dct", n=5000)
    for bad in ([], [a, decode(a)], [a, b], [a, d], [a, "x"], None):
        with pytest.raises(InvalidArgument, match="^contributions: "):
            sum_contributions(bad)
    with pytest.raises(InvalidArgument, match="^scale: "):
        sum_contributions([a, _replace(a, scale=a.scale[:-4])])
    nan = decode(a)
    nan[3] = np.nan
    with pytest.raises(InvalidArgument, match=r"^contributions: \[1\] holds NaN"):
        sum_contributions([decode(a), nan])
    with pytest.raises(InvalidArgument, match=r"^contributions: \[1\] has shape"):
        sum_contributions([decode(a), decode(b)])


# ---------------------------------------------------------------------------------------------
# Error feedback


def test_error_feedback_applies_exactly_once_per_committed_round():
    rng = np.random.default_rng(11)
    n, codec, beta = 3 * 512 + 9, SparseCodec("topk", 512, 8, 2), 0.9
    acc = ErrorAccumulator(n, codec, beta)
    assert not acc.accumulator.any() and not acc.pending
    delta = rng.standard_normal(n).astype(np.float32)

    first = acc.propose(delta, attempt=1)
    assert acc.pending and not acc.accumulator.any()  # propose never mutates e
    acc.abort()
    assert not acc.pending
    again = acc.propose(delta, attempt=2)  # the retry proposes from the same e: same bytes
    assert again == first
    with pytest.raises(FailedPrecondition, match="attempt 2, not 1"):
        acc.commit(attempt=1)
    acc.commit(attempt=2)
    e1 = acc.accumulator.copy()
    np.testing.assert_array_equal(e1, delta - decode(first))
    with pytest.raises(FailedPrecondition, match="no pending proposal"):
        acc.commit(attempt=2)  # a second commit of the same round changes nothing
    np.testing.assert_array_equal(acc.accumulator, e1)

    delta2 = rng.standard_normal(n).astype(np.float32)
    p = acc.propose(delta2)
    candidate = np.float32(beta) * e1 + delta2
    assert p == encode(candidate, codec)
    acc.propose(delta2 * 2)  # a new proposal replaces the uncommitted one
    acc.commit()
    np.testing.assert_array_equal(acc.accumulator, (np.float32(beta) * e1 + delta2 * 2)
                                  - decode(encode(np.float32(beta) * e1 + delta2 * 2, codec)))
    with pytest.raises(ValueError):
        acc.accumulator[0] = 1  # read-only view

    acc.propose(delta)
    acc.reset()  # a peer that synced state starts from e = 0
    assert not acc.pending and not acc.accumulator.any()
    with pytest.raises(FailedPrecondition):
        acc.commit()


def test_error_feedback_refusals_leave_it_unchanged():
    acc = ErrorAccumulator(100, SparseCodec("dct", 64, 4, 4), 1.0)
    ok = acc.propose(np.ones(100, dtype=np.float32), attempt="a")
    bad = np.ones(100, dtype=np.float32)
    bad[5] = np.inf
    with pytest.raises(InvalidArgument, match="^delta: x: NaN or inf"):
        acc.propose(bad, attempt="b")
    with pytest.raises(InvalidArgument, match="^delta: expected shape"):
        acc.propose(np.ones(99, dtype=np.float32))
    with pytest.raises(InvalidArgument, match="^delta: expected a 1-D float32"):
        acc.propose(np.ones(100))
    acc.commit(attempt="a")  # the earlier proposal is still the pending one
    ones = np.ones(100, dtype=np.float32)
    np.testing.assert_allclose(acc.accumulator, ones - decode(ok), atol=1e-6)
    for kwargs, field in [({"size": -1}, "size"), ({"beta": 1.5}, "beta"), ({"beta": float("nan")}, "beta"),
                          ({"codec": "topk"}, "codec")]:
        args = {"size": 10, "codec": SparseCodec(), "beta": 0.5, **kwargs}
        with pytest.raises(InvalidArgument, match=f"^{field}: "):
            ErrorAccumulator(**args)


@pytest.mark.parametrize("kind", ["topk", "dct"])
def test_with_error_feedback_the_sent_sum_tracks_the_delta_sum(kind):
    rng = np.random.default_rng(5)
    n, rounds = 16 * 256, 150
    codec = SparseCodec(kind, 256, 8, 2)  # density 1/32, 2-bit values
    signal = rng.standard_normal(n).astype(np.float32) * 0.1
    acc = ErrorAccumulator(n, codec, beta=1.0)
    sent, plain, deltas = np.zeros(n), np.zeros(n), np.zeros(n)
    for r in range(rounds):
        delta = (signal + rng.standard_normal(n).astype(np.float32) * 0.05).astype(np.float32)
        payload = acc.propose(delta, attempt=r)
        if r % 7 == 3:  # an aborted attempt, retried: counted once
            acc.abort()
            payload = acc.propose(delta, attempt=(r, "retry"))
            acc.commit(attempt=(r, "retry"))
        else:
            acc.commit(attempt=r)
        sent += decode(payload)
        plain += decode(encode(delta, codec))
        deltas += delta
    # With beta = 1, what was sent plus what is left is what came in.
    np.testing.assert_allclose(sent + acc.accumulator, deltas, atol=1e-3 * np.abs(deltas).max())
    tracked = np.linalg.norm(sent - deltas) / np.linalg.norm(deltas)
    untracked = np.linalg.norm(plain - deltas) / np.linalg.norm(deltas)
    assert tracked < 0.15
    assert untracked > 0.5
