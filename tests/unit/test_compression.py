"""Codecs: round-trip error within the documented bound, bf16 round-to-nearest-even, no inf from
finite input, malformed payloads refused by field, error feedback keeps accumulated error bounded."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from shoal.peer.compression import (
    BLOCK,
    FP4,
    CODECS,
    Encoded,
    ErrorFeedback,
    codec_id,
    codec_name,
    decode,
    encode,
    max_abs_error,
    payload_bytes,
)
from shoal.common.errors import InvalidArgument

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True)

finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
vectors = arrays(np.float32, st.integers(0, 700), elements=finite_f32)


def _scaled_vectors():
    @st.composite
    def build(draw):
        n = draw(st.integers(1, 1200))
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        scale = draw(st.sampled_from([1e-40, 1e-20, 1e-3, 1.0, 1e4, 1e30]))
        x = (rng.standard_normal(n) * scale).astype(np.float32)
        if draw(st.booleans()):  # sparse outliers per block
            x[rng.integers(0, n, size=max(1, n // 100))] *= 1000
        return x

    return build()


@pytest.mark.parametrize("codec", sorted(CODECS))
@SETTINGS
@given(x=st.one_of(vectors, _scaled_vectors()))
def test_round_trip_within_bound(codec, x):
    enc = encode(x, codec)
    assert enc.codec == codec_id(codec) and enc.count == x.shape[0]
    assert len(enc.data) + len(enc.scale) == payload_bytes(x.shape[0], codec)
    y = decode(enc)
    assert y.dtype == np.float32 and y.shape == x.shape
    assert np.all(np.isfinite(y))
    err = np.abs(y.astype(np.float64) - x.astype(np.float64))
    assert np.all(err <= max_abs_error(x, codec))
    if codec == "none":
        assert y.tobytes() == x.tobytes()
    assert encode(x.copy(), codec) == enc  # deterministic


def _bf16_reference(v: float) -> float:
    """Nearest bf16 to a finite float32, ties to even, clipped to the bf16 max."""
    bits = int(np.array([v], dtype=np.float32).view(np.uint32)[0])
    lo_bits = bits & 0xFFFF0000
    hi_bits = lo_bits + 0x10000
    as_f = lambda b: float(np.array([b], dtype=np.uint32).view(np.float32)[0])  # noqa: E731
    lo, hi = as_f(lo_bits), as_f(hi_bits)
    dlo, dhi = abs(float(np.float32(v)) - lo), abs(float(np.float32(v)) - hi)
    pick = lo if dlo < dhi or (dlo == dhi and (lo_bits >> 16) % 2 == 0) else hi
    if np.isinf(pick):
        pick = np.copysign(as_f(0x7F7F0000), v)
    return pick


@SETTINGS
@given(x=arrays(np.float32, st.integers(1, 50), elements=finite_f32))
def test_bf16_is_round_to_nearest_even(x):
    y = decode(encode(x, "bf16"))
    want = np.array([_bf16_reference(float(v)) for v in x], dtype=np.float32)
    assert y.tobytes() == want.tobytes()


def test_bf16_special_values():
    specials = np.array([0x7F800001, 0xFF800001, 0x7FC00000, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x00000001],
                        dtype=np.uint32).view(np.float32)
    y = decode(encode(specials, "bf16"))
    assert np.isnan(y[0]) and np.isnan(y[1]) and np.isnan(y[2])  # NaN with low payload stays NaN
    assert y[3] == np.inf and y[4] == -np.inf
    assert np.isfinite(y[5]) and np.isfinite(y[6]) and y[5] > 3.38e38 and y[6] < -3.38e38
    assert y[7] == 0.0  # smallest float32 subnormal rounds to zero, within 2^-134


def test_fp16_clips_finite_overflow_and_keeps_non_finite():
    x = np.array([70000.0, -1e30, 65519.0, 65520.0, np.inf, -np.inf, np.nan, 1e-8, 3.4028235e38], dtype=np.float32)
    y = decode(encode(x, "fp16"))
    np.testing.assert_array_equal(y[[0, 1, 2, 3, 8]], [65504.0, -65504.0, 65504.0, 65504.0, 65504.0])
    assert y[4] == np.inf and y[5] == -np.inf and np.isnan(y[6])
    assert abs(float(y[7]) - 1e-8) <= 2.0**-25


def test_int8_layout_and_bound_per_block():
    x = np.concatenate([np.linspace(-1, 1, BLOCK), np.linspace(-100, 100, BLOCK), [0.0] * 10]).astype(np.float32)
    enc = encode(x, "int8")
    assert len(enc.data) == x.size and len(enc.scale) == 4 * 3
    scales = np.frombuffer(enc.scale, dtype="<f4")
    # the float32 scale at or just above absmax / 127 (one float32 step up where it rounded below)
    np.testing.assert_allclose(scales, [1 / 127, 100 / 127, 0.0], rtol=2.0 ** -22)
    y = decode(enc)
    assert np.all(np.abs(y[:BLOCK] - x[:BLOCK]) <= 1 / 254 + 1e-6)
    assert np.all(np.abs(y[BLOCK : 2 * BLOCK] - x[BLOCK : 2 * BLOCK]) <= 100 / 254 + 1e-4)
    assert np.all(y[2 * BLOCK :] == 0)
    top = np.array([3.4028235e38, -3.4028235e38, 1.0], dtype=np.float32)
    assert np.all(np.isfinite(decode(encode(top, "int8"))))


def test_empty_vectors():
    for codec in CODECS:
        enc = encode(np.zeros(0, dtype=np.float32), codec)
        assert enc.count == 0 and decode(enc).shape == (0,)


def test_encode_refuses_bad_input():
    with pytest.raises(InvalidArgument, match="^x"):
        encode(np.array([1.0, np.nan], dtype=np.float32), "int8")
    with pytest.raises(InvalidArgument, match="^x"):
        encode(np.zeros(3, dtype=np.float64), "fp16")
    with pytest.raises(InvalidArgument, match="^x"):
        encode(np.zeros((2, 2), dtype=np.float32), "none")
    with pytest.raises(InvalidArgument, match="^codec"):
        encode(np.zeros(3, dtype=np.float32), "int4")
    with pytest.raises(InvalidArgument, match="^x"):
        max_abs_error(np.array([np.inf], dtype=np.float32), "fp16")


def test_non_finite_travels_through_float_codecs():
    x = np.array([1.0, np.nan, np.inf, -np.inf], dtype=np.float32)
    for codec in ("none", "fp16", "bf16"):
        y = decode(encode(x, codec))
        assert y[0] == 1.0 and np.isnan(y[1]) and y[2] == np.inf and y[3] == -np.inf


def _good_int8() -> Encoded:
    return encode(np.linspace(-5, 5, 300).astype(np.float32), "int8")


@pytest.mark.parametrize(
    "enc,field",
    [
        (Encoded(7, b"", b"", 0), "codec"),
        (Encoded(0, b"\0" * 4, b"", -1), "count"),
        (Encoded(0, b"\0" * 7, b"", 2), "data"),
        (Encoded(1, b"\0" * 5, b"", 2), "data"),
        (Encoded(2, b"\0" * 4, b"\0" * 4, 2), "scale"),
        (Encoded(3, b"\0" * 299, _good_int8().scale, 300), "data"),
        (Encoded(3, _good_int8().data, _good_int8().scale[:4], 300), "scale"),
        (Encoded(3, _good_int8().data, np.array([np.nan, 1], "<f4").tobytes(), 300), "scale"),
        (Encoded(3, _good_int8().data, np.array([np.inf, 1], "<f4").tobytes(), 300), "scale"),
        (Encoded(3, _good_int8().data, np.array([-1, 1], "<f4").tobytes(), 300), "scale"),
        (Encoded(3, _good_int8().data, np.array([3e38, 1], "<f4").tobytes(), 300), "scale"),
        (Encoded(3, b"\x80" + _good_int8().data[1:], _good_int8().scale, 300), "data"),
    ],
)
def test_decode_refuses_malformed(enc, field):
    with pytest.raises(InvalidArgument, match=f"^{field}"):
        decode(enc)


def test_codec_ids_match_proto():
    assert {n: codec_id(n) for n in CODECS} == {"none": 0, "fp16": 1, "bf16": 2, "int8": 3, "fp4": 6}
    assert all(codec_name(codec_id(n)) == n for n in CODECS)
    with pytest.raises(InvalidArgument, match="^codec"):
        codec_name(9)
    with pytest.raises(InvalidArgument, match="^codec"):
        codec_id("raw")


# --------------------------------------------------------------------------------------------
# Error feedback


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 600), steps=st.integers(20, 80))
def test_int8_error_feedback_keeps_accumulated_error_bounded(seed, n, steps):
    rng = np.random.default_rng(seed)
    ef = ErrorFeedback()
    bias = rng.standard_normal(n) * 1e-3  # small persistent signal int8 would round away
    sum_x = np.zeros(n)
    sum_d = np.zeros(n)
    last_bound = None
    for _ in range(steps):
        x = (bias + rng.standard_normal(n) * 0.01).astype(np.float32)
        x[0] = 1.0  # a large element fixes the block scale, squashing the rest
        c = ef.compensate("shard-0", x)
        d = decode(encode(c, "int8"))
        ef.update("shard-0", c, d)
        sum_x += x
        sum_d += d
        last_bound = max_abs_error(c, "int8")
    # Telescoping: sum(d) - sum(x) == -residual, bounded by one step's quantization error.
    assert np.all(np.abs(sum_d - sum_x) <= last_bound + 1e-5 * steps)
    assert np.allclose(sum_d - sum_x, -ef.residual("shard-0"), atol=1e-5 * steps)


def test_without_error_feedback_error_grows():
    x = np.full(BLOCK, 1e-3, dtype=np.float32)
    x[0] = 1.0
    steps = 200
    plain = sum(decode(encode(x, "int8")).astype(np.float64) for _ in range(steps))
    ef, fed = ErrorFeedback(), np.zeros(BLOCK)
    for _ in range(steps):
        c = ef.compensate(0, x)
        d = decode(encode(c, "int8"))
        ef.update(0, c, d)
        fed += d
    want = steps * x.astype(np.float64)
    assert np.abs(plain - want).max() > 0.1  # 1e-3 always rounds to 0 without feedback
    assert np.abs(fed - want).max() < 1 / 254 + 1e-4


def test_error_feedback_bookkeeping():
    ef = ErrorFeedback()
    x = np.array([0.5, 0.25], dtype=np.float32)
    assert ef.compensate("k", x).tobytes() == x.tobytes() and "k" not in ef
    ef.update("k", x, np.array([0.5, 0.0], dtype=np.float32))
    np.testing.assert_array_equal(ef.residual("k"), [0.0, 0.25])
    # Aborted round: compensate without update leaves the residual as it was.
    np.testing.assert_array_equal(ef.compensate("k", x), [0.5, 0.5])
    np.testing.assert_array_equal(ef.residual("k"), [0.0, 0.25])
    # A residual of another shape is stale and dropped.
    np.testing.assert_array_equal(ef.compensate("k", np.ones(3, dtype=np.float32)), np.ones(3))
    assert "k" not in ef and len(ef) == 0
    ef.update("a", x, np.array([np.inf, 0.0], dtype=np.float32))
    np.testing.assert_array_equal(ef.residual("a"), [0.0, 0.25])  # non-finite residual reset
    ef.reset()
    assert len(ef) == 0 and ef.residual("a") is None
    with pytest.raises(InvalidArgument, match="^decoded"):
        ef.update("a", x, np.zeros(3, dtype=np.float32))


def test_int8_subnormal_blocks_stay_within_the_bound():
    """A block whose maximum is subnormal got a float32 scale rounded down, and its maximum
    clipped at 127 steps (x = 3.76e-43 decoded 20x past the bound; found by the property test
    above). Every magnitude from the smallest subnormal up must stay within max_abs_error."""
    rng = np.random.default_rng(0)
    xs = [np.array([3.76e-43], dtype=np.float32)]
    xs += [(rng.uniform(-2, 2, 300) * 2.0 ** e).astype(np.float32) for e in range(-149, -90, 3)]
    for x in xs:
        y = decode(encode(x, "int8"))
        assert np.all(np.abs(y.astype(np.float64) - x.astype(np.float64)) <= max_abs_error(x, "int8")), x[:4]


# ------------------------------------------------------------------------------ fp4 (E2M1)

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_fp4_layout_grid_and_packing():
    """A block whose maximum is 6 has scale 1: every E2M1 magnitude is exact, codes are OCP MX's
    (sign bit 3, magnitude bits 0-2), element 2i sits in the low nibble of byte i."""
    x = np.array(E2M1 + [-v for v in E2M1[1:]], dtype=np.float32)  # 15 elements: odd count
    enc = encode(x, "fp4")
    assert np.frombuffer(enc.scale, "<f4").tolist() == [1.0]
    assert len(enc.data) == 8
    nib = []
    for b in enc.data:
        nib += [b & 15, b >> 4]
    assert nib == list(range(8)) + [8 + k for k in range(1, 8)] + [0]
    assert decode(enc).tolist() == x.tolist()


def test_fp4_rounds_to_nearest_ties_to_even_code():
    """Scale 1 (the block holds 6): midpoints go to the neighbour with the even code."""
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]  # codes 0, 2, 2, 4, 4, 6, 6
    x = np.array([6.0] + mids + [0.3, 0.7, 2.9, 5.1, -5.1, -0.2], dtype=np.float32)
    y = decode(encode(x, "fp4"))
    assert y[1:8].tolist() == want
    assert y[8:].tolist() == [0.5, 0.5, 3.0, 6.0, -6.0, 0.0]
    assert not np.signbit(y[-1])  # -0.2 rounds to +0: no negative zero on the wire


def test_fp4_blocks_scale_independently_and_bytes_are_0_129x():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(4 * BLOCK + 7) * np.repeat([1e-6, 1.0, 1e6, 1e-30, 3.0], BLOCK)[:4 * BLOCK + 7])
    x = x.astype(np.float32)
    enc = encode(x, "fp4")
    assert len(enc.scale) == 4 * 5 and len(enc.data) == (x.size + 1) // 2
    err = np.abs(decode(enc).astype(np.float64) - x)
    assert np.all(err <= max_abs_error(x, "fp4"))
    n = 1 << 20
    assert payload_bytes(n, "fp4") / (4 * n) == pytest.approx(0.1289, abs=1e-4)


def _good_fp4() -> Encoded:
    return encode(np.linspace(-5, 5, 301).astype(np.float32), "fp4")


@pytest.mark.parametrize(
    "enc,field",
    [
        (Encoded(FP4, _good_fp4().data[:-1], _good_fp4().scale, 301), "data"),
        (Encoded(FP4, _good_fp4().data, _good_fp4().scale[:4], 301), "scale"),
        (Encoded(FP4, _good_fp4().data, np.array([np.nan, 1], "<f4").tobytes(), 301), "scale"),
        (Encoded(FP4, _good_fp4().data, np.array([-1, 1], "<f4").tobytes(), 301), "scale"),
        (Encoded(FP4, _good_fp4().data, np.array([3.3e38, 1], "<f4").tobytes(), 301), "scale"),
        (Encoded(FP4, b"\x08" + _good_fp4().data[1:], _good_fp4().scale, 301), "data"),
        (Encoded(FP4, _good_fp4().data[:-1] + b"\x11", _good_fp4().scale, 301), "data"),
    ],
    ids=["short-data", "short-scale", "nan-scale", "negative-scale", "overflowing-scale", "negative-zero",
         "padding-nibble"],
)
def test_fp4_decode_refuses_malformed(enc, field):
    with pytest.raises(InvalidArgument, match=f"^{field}:"):
        decode(enc)


def test_fp4_refuses_non_finite():
    with pytest.raises(InvalidArgument, match="^x: fp4 cannot encode"):
        encode(np.array([1.0, np.inf], dtype=np.float32), "fp4")


def test_fp4_error_feedback_keeps_accumulated_error_bounded():
    """A signal below a sixth of each block's maximum vanishes in plain fp4; with error feedback
    the decoded sum tracks the true sum within one step's bound."""
    rng = np.random.default_rng(5)
    n, steps = 2 * BLOCK, 40
    bias = rng.standard_normal(n) * 1e-2
    fb = ErrorFeedback()
    true = np.zeros(n)
    got = np.zeros(n)
    plain = np.zeros(n)
    for _ in range(steps):
        x = (bias + rng.standard_normal(n)).astype(np.float32)
        true += x
        c = fb.compensate("k", x)
        d = decode(encode(c, "fp4"))
        fb.update("k", c, d)
        got += d
        plain += decode(encode(x, "fp4"))
        last = max_abs_error(c, "fp4")
    assert np.all(np.abs(got - true) <= last + 1e-4)
    assert np.abs(plain - true).max() > 4 * np.abs(got - true).max()
