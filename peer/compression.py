"""Per-hop codecs for tensor chunks, and error-feedback memory.

A chunk of a float32 vector travels as an `Encoded` payload whose `codec` is the wire id in
`shoal.v1.Chunk.codec`:

| id | name   | `data`                                   | `scale`                          | bound on |decode(encode(x)) - x| |
| -- | ------ | ---------------------------------------- | -------------------------------- | ---------------------------------- |
| 0  | "none" | float32 little-endian, 4 B/element       | empty                            | 0 (bit-exact)                      |
| 1  | "fp16" | IEEE half little-endian, 2 B/element     | empty                            | max(2^-11 |x|, 2^-25), or |x| - 65504 beyond the range |
| 2  | "bf16" | top 16 bits of float32, round-to-nearest-even, uint16 LE | empty            | max(2^-8 |x|, 2^-134)              |
| 3  | "int8" | int8 in [-127, 127], 1 B/element         | one float32 LE per 256 elements  | absmax(block)/254 (+ float32 rounding) |
| 6  | "fp4"  | e2m1 nibbles, 2 per byte (element 2i in the low nibble of byte i), ceil(n/2) B | one float32 LE scale s per 256 elements | max(s/4, |x|/4) (+ float32 rounding), s = absmax(block)/6 |

"fp4" is the 4-bit float E2M1 of the OCP Microscaling formats (sign bit, 2 exponent bits, 1
mantissa bit: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6), with one float32 scale per 256-element block
instead of MX's shared power of two per 32: `x ~ s * e2m1`, `s = absmax(block) / 6` rounded up
so that the block's largest magnitude maps to 6. Each element rounds to the nearest multiple on
the grid, ties to the even code (deterministic, IEEE float64 arithmetic). Streaming DiLoCo
(Douillard et al. 2025, arXiv 2501.18512) sends its outer gradients in 4-bit floats and
accumulates in float32: here the shard owners decode every contribution to float32 and reduce
in float32 (float64 for the robust aggregators), and quantize the reduced shard once. 4.125 bits
per element, 0.129x the bytes of float32. The relative error is up to 25 %, so the pseudo-gradient
goes through error feedback (`ErrorFeedback`) like int8's. Negative zero (nibble 8) is never
produced and refused by `decode`, as is a nonzero padding nibble for an odd count: one vector has
exactly one encoding.

`max_abs_error` returns these bounds per element. Encoding is deterministic, so an owner that
quantizes its reduced shard once gives every peer the same bytes and the same decoded values.

Non-finite values: "none", "fp16" and "bf16" carry NaN and ±inf through unchanged (NaN may
lose its payload), so the receiving owner's validation sees and rejects them; they are never
laundered into finite numbers. Finite values beyond the fp16 range (|x| > 65504) are clipped to
±65504, and the few finite float32 values that would round up to inf in bf16 are clipped to the
bf16 maximum: a finite input never decodes to inf. int8 and fp4 cannot represent non-finite
values and `encode` refuses them (the caller sends such a chunk raw, or drops out of the round).

This module does not chunk, sign or send anything; `peer.collectives` does. It does check every
received payload (`decode`) and refuses malformed ones with `InvalidArgument` naming the field.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from shoal.common.errors import InvalidArgument

__all__ = [
    "BLOCK",
    "CODECS",
    "Encoded",
    "ErrorFeedback",
    "codec_id",
    "codec_name",
    "data_bytes",
    "decode",
    "encode",
    "max_abs_error",
    "payload_bytes",
    "scale_bytes",
]

# 4 and 5 are the sparse codecs (peer.sparse.SPARSE_CODECS): one byte names any codec.
FP4 = 6
CODECS: dict[str, int] = {"none": 0, "fp16": 1, "bf16": 2, "int8": 3, "fp4": FP4}
_NAMES: dict[int, str] = {v: k for k, v in CODECS.items()}
BLOCK = 256
"""Elements per int8 and fp4 block (one float32 scale each), counted from the start of the payload."""

_ITEMSIZE = {0: 4, 1: 2, 2: 2, 3: 1}  # bytes per element; fp4: half a byte (`data_bytes`)
_SCALED = (3, FP4)  # codecs with one float32 scale per BLOCK elements
# E2M1 magnitudes by 3-bit code (OCP MX FP4), and the midpoints between neighbours.
_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_E2M1_MID = (_E2M1[1:] + _E2M1[:-1]) / 2
_E2M1_MAX = 6.0
_FP16_MAX = 65504.0
_BF16_MAX_BITS = 0x7F7F
_BF16_MAX = float(np.array([_BF16_MAX_BITS << 16], dtype=np.uint32).view(np.float32)[0])
_F32_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class Encoded:
    """One encoded chunk, as carried by `shoal.v1.Chunk` (`codec`, `data`, `scale`, `shape=[count]`).

    Attributes:
        codec: wire codec id (0 none, 1 fp16, 2 bf16, 3 int8, 6 fp4; 4 and 5 are the sparse codecs of peer.sparse).
        data: the payload bytes, little-endian.
        scale: int8 / fp4 block scales (float32 LE, one per 256 elements); empty for other codecs.
        count: number of float32 elements encoded.
    """

    codec: int
    data: bytes
    scale: bytes
    count: int


def codec_id(name: str) -> int:
    """Wire id of a codec name ("none", "fp16", "bf16", "int8", "fp4").

    Raises:
        InvalidArgument: unknown name ("codec").
    """
    try:
        return CODECS[name]
    except (KeyError, TypeError):
        raise InvalidArgument(f"codec: unknown {name!r}; expected one of {sorted(CODECS)}") from None


def codec_name(cid: int) -> str:
    """Codec name of a wire id (0..3, 6).

    Raises:
        InvalidArgument: unknown id ("codec").
    """
    try:
        return _NAMES[cid]
    except (KeyError, TypeError):
        raise InvalidArgument(f"codec: unknown id {cid!r}; expected one of {sorted(_NAMES)}") from None


def data_bytes(cid: int, count: int) -> int:
    """Length of `data` for `count` elements under wire codec `cid` (fp4: ceil(count / 2))."""
    return (count + 1) // 2 if cid == FP4 else count * _ITEMSIZE[cid]


def scale_bytes(cid: int, count: int) -> int:
    """Length of `scale` for `count` elements under wire codec `cid` (4 per block of int8 / fp4)."""
    return 4 * (-(-count // BLOCK)) if cid in _SCALED else 0


def payload_bytes(count: int, codec: str) -> int:
    """Bytes of `data` plus `scale` for `count` elements under `codec`, for sizing chunks."""
    cid = codec_id(codec)
    return data_bytes(cid, count) + scale_bytes(cid, count)


def _check_x(x: np.ndarray) -> np.ndarray:
    if not isinstance(x, np.ndarray) or x.ndim != 1 or x.dtype != np.float32:
        shape = getattr(x, "shape", None)
        dtype = getattr(x, "dtype", type(x).__name__)
        raise InvalidArgument(f"x: expected a 1-D float32 array, got shape {shape} dtype {dtype}")
    return x


def _to_bf16_bits(x: np.ndarray) -> np.ndarray:
    bits = x.view(np.uint32).astype(np.uint64)
    lsb = (bits >> 16) & 1
    rounded = ((bits + 0x7FFF + lsb) >> 16).astype(np.uint16)
    sign = ((bits >> 16) & 0x8000).astype(np.uint16)
    finite = np.isfinite(x)
    # Finite values that rounded up into the inf pattern: clip to the largest bf16.
    overflow = finite & ((rounded & 0x7FFF) == 0x7F80)
    rounded = np.where(overflow, sign | _BF16_MAX_BITS, rounded)
    # NaN: a quiet NaN of the same sign (rounding could otherwise turn a NaN into inf).
    rounded = np.where(np.isnan(x), sign | 0x7FC0, rounded)
    return rounded.astype(np.uint16)


def _int8_scales(x64: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-block (absmax, float32 scale) for a zero-padded `(blocks, 256)` float64 array."""
    absmax = np.abs(x64).max(axis=1)
    scale = (absmax / 127.0).astype(np.float32)
    # float32 rounding may leave 127 * scale below absmax (coarsely so among the subnormals: a block
    # whose maximum is 3.76e-43 got a scale 5 % short and its maximum clipped at 127 steps, 20x past
    # the error bound): round those scales up one step, so no element ever needs more than 127.
    short = scale.astype(np.float64) * 127.0 < absmax
    scale[short] = np.nextafter(scale[short], np.float32(np.inf))
    # Tiny blocks whose scale underflows to 0 use the smallest subnormal (exact for them).
    tiny = (scale == 0) & (absmax > 0)
    scale[tiny] = np.float32(np.finfo(np.float32).smallest_subnormal)
    # Keep 127 * scale inside float32 so decode never overflows (and decode can insist on it).
    big = scale.astype(np.float64) * 127.0 > _F32_MAX
    scale[big] = np.nextafter(scale[big], np.float32(0))
    return absmax, scale


def _blocks(x: np.ndarray) -> np.ndarray:
    """`x` `(n,)` as a zero-padded `(ceil(n / 256), 256)` float64 array."""
    n = int(x.shape[0])
    blocks = -(-n // BLOCK)
    padded = np.zeros(blocks * BLOCK, dtype=np.float64)
    padded[:n] = x
    return padded.reshape(blocks, BLOCK)


def _fp4_scales(x64: np.ndarray) -> np.ndarray:
    """Per-block float32 scale `s >= absmax / 6` for a zero-padded `(blocks, 256)` float64 array."""
    absmax = np.abs(x64).max(axis=1)
    scale = (absmax / _E2M1_MAX).astype(np.float32)
    short = scale.astype(np.float64) * _E2M1_MAX < absmax  # rounded down: one step up, nothing clips
    scale[short] = np.nextafter(scale[short], np.float32(np.inf))
    tiny = (scale == 0) & (absmax > 0)
    scale[tiny] = np.float32(np.finfo(np.float32).smallest_subnormal)
    big = scale.astype(np.float64) * _E2M1_MAX > _F32_MAX  # keep 6 * s finite in float32
    scale[big] = np.nextafter(scale[big], np.float32(0))
    return scale


def _encode_fp4(x: np.ndarray) -> Encoded:
    n = int(x.shape[0])
    padded = _blocks(x)
    scale = _fp4_scales(padded)
    s64 = scale.astype(np.float64)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.where(s64 > 0, np.abs(padded) / np.where(s64 > 0, s64, 1.0), 0.0)
    y = np.minimum(y, _E2M1_MAX)  # only the float32 rounding of a clipped scale can pass 6
    code = np.searchsorted(_E2M1_MID, y, side="left")  # at a midpoint: the lower neighbour ...
    tie = (code < len(_E2M1_MID)) & (y == _E2M1_MID[np.minimum(code, len(_E2M1_MID) - 1)])
    code = code + (tie & (code % 2 == 1))  # ... unless its code is odd: ties to the even code
    nib = code.astype(np.uint8) | np.where((padded < 0) & (code > 0), np.uint8(8), np.uint8(0))
    nib = nib.reshape(-1)[:n]
    if n % 2:
        nib = np.concatenate([nib, np.zeros(1, np.uint8)])
    packed = (nib[0::2] | (nib[1::2] << 4)).astype(np.uint8)
    return Encoded(FP4, packed.tobytes(), scale.astype("<f4").tobytes(), n)


def _decode_fp4(enc: Encoded, scale: np.ndarray) -> np.ndarray:
    n = enc.count
    packed = np.frombuffer(enc.data, dtype=np.uint8)
    nib = np.empty(2 * packed.size, dtype=np.uint8)
    nib[0::2] = packed & 0x0F
    nib[1::2] = packed >> 4
    if n % 2 and nib[n] != 0:
        raise InvalidArgument("data: the padding nibble after an odd count must be 0")
    nib = nib[:n]
    if np.any(nib == 8):
        raise InvalidArgument("data: fp4 nibble 8 (negative zero) is not a canonical encoding")
    mag = _E2M1[nib & 7]
    sign = np.where(nib & 8, -1.0, 1.0)
    per_elem = np.repeat(scale, BLOCK)[:n]
    return (sign * mag * per_elem).astype(np.float32)


def encode(x: np.ndarray, codec: str) -> Encoded:
    """Encode a 1-D float32 vector with the named codec (see the module table).

    Args:
        x: `(n,)` float32; not modified.
        codec: "none", "fp16", "bf16", "int8" or "fp4".

    Returns:
        An `Encoded` with `count == n`.

    Raises:
        InvalidArgument: `x` is not a 1-D float32 array ("x"), unknown codec ("codec"), or
            non-finite values with "int8" or "fp4" ("x").
    """
    x = _check_x(x)
    cid = codec_id(codec)
    n = int(x.shape[0])
    if cid == 0:
        return Encoded(0, x.astype("<f4").tobytes(), b"", n)
    if cid == 1:
        finite = np.isfinite(x)
        clipped = np.where(finite, np.clip(x, -_FP16_MAX, _FP16_MAX), x)
        with np.errstate(over="ignore", invalid="ignore"):
            half = clipped.astype("<f2")
        return Encoded(1, half.tobytes(), b"", n)
    if cid == 2:
        return Encoded(2, _to_bf16_bits(x).astype("<u2").tobytes(), b"", n)
    if not np.all(np.isfinite(x)):
        raise InvalidArgument(f"x: {codec} cannot encode NaN or inf; send the chunk raw or drop it")
    if cid == FP4:
        return _encode_fp4(x)
    padded = _blocks(x)
    _, scale = _int8_scales(padded)
    s64 = scale.astype(np.float64)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(s64 > 0, np.rint(padded / np.where(s64 > 0, s64, 1.0)), 0.0)
    q = np.clip(q, -127, 127).astype(np.int8).reshape(-1)[:n]
    return Encoded(3, q.tobytes(), scale.astype("<f4").tobytes(), n)


def decode(enc: Encoded) -> np.ndarray:
    """Decode a payload into a new `(count,)` float32 array.

    Checks the payload's structure, not its values: NaN/inf carried by codecs 0-2 come out as
    such (the aggregator's validation deals with them). For int8 and fp4 the result is always finite.

    Raises:
        InvalidArgument: unknown codec ("codec"), negative count ("count"), `data` of the wrong
            length, an int8 value of -128, an fp4 negative zero or nonzero padding nibble
            ("data"), `scale` of the wrong length or holding a negative, non-finite or
            overflowing (127 * scale, or 6 * scale for fp4, > float32 max) value ("scale").
    """
    if not isinstance(enc, Encoded):
        raise InvalidArgument(f"enc: expected Encoded, got {type(enc).__name__}")
    cid = enc.codec
    if cid not in _NAMES:
        raise InvalidArgument(f"codec: unknown id {cid!r}; expected one of {sorted(_NAMES)}")
    if isinstance(enc.count, bool) or not isinstance(enc.count, int) or enc.count < 0:
        raise InvalidArgument(f"count: expected an integer >= 0, got {enc.count!r}")
    n = enc.count
    want = data_bytes(cid, n)
    if len(enc.data) != want:
        raise InvalidArgument(f"data: expected {want} bytes for {n} elements of {_NAMES[cid]}, got {len(enc.data)}")
    if cid not in _SCALED:
        if len(enc.scale) != 0:
            raise InvalidArgument(f"scale: must be empty for codec {_NAMES[cid]}, got {len(enc.scale)} bytes")
        if cid == 0:
            return np.frombuffer(enc.data, dtype="<f4").astype(np.float32)
        if cid == 1:
            return np.frombuffer(enc.data, dtype="<f2").astype(np.float32)
        bits = np.frombuffer(enc.data, dtype="<u2").astype(np.uint32) << 16
        return bits.view(np.float32).copy()
    blocks = -(-n // BLOCK)
    if len(enc.scale) != 4 * blocks:
        raise InvalidArgument(f"scale: expected {4 * blocks} bytes for {blocks} blocks, got {len(enc.scale)}")
    scale = np.frombuffer(enc.scale, dtype="<f4").astype(np.float64)
    if not np.all(np.isfinite(scale)):
        raise InvalidArgument("scale: non-finite block scale")
    top = _E2M1_MAX if cid == FP4 else 127.0
    if np.any(scale < 0) or np.any(scale * top > _F32_MAX):
        raise InvalidArgument(f"scale: block scale negative or too large ({top:g} * scale > float32 max)")
    if cid == FP4:
        return _decode_fp4(enc, scale)
    q = np.frombuffer(enc.data, dtype=np.int8)
    if np.any(q == -128):
        raise InvalidArgument("data: int8 value -128 is outside the codec's range [-127, 127]")
    per_elem = np.repeat(scale, BLOCK)[:n]
    return (q.astype(np.float64) * per_elem).astype(np.float32)


def max_abs_error(x: np.ndarray, codec: str) -> np.ndarray:
    """Per-element bound on `|decode(encode(x, codec)) - x|`, as documented in the module table.

    fp16: `max(|x| 2^-11, 2^-25)` inside the range (relative half-ulp; absolute half-ulp of the
    subnormals), `|x| - 65504` beyond it (clipping). bf16: `max(|x| 2^-8, 2^-134, |x| - bf16max)`.
    int8: `absmax/254 + absmax 2^-22 + 2^-149` with `absmax` the element's 256-block maximum (the
    rounding half-step, plus float32 rounding of the scale and the product). fp4:
    `max(s/4, |x|/4) + 6 s 2^-24 + 2^-149` with `s` the block's float32 scale (about absmax/6):
    half the E2M1 grid's gap at the element (0.5 s below 2 s, 1 s up to 4 s, 2 s up to 6 s,
    each at most a quarter of |x| past 2 s), plus the float32 rounding of the product.

    Args:
        x: `(n,)` float32, finite.
        codec: codec name.

    Returns:
        `(n,)` float64 bounds.

    Raises:
        InvalidArgument: `x` not 1-D float32 or not finite ("x"), unknown codec ("codec").
    """
    x = _check_x(x)
    cid = codec_id(codec)
    if not np.all(np.isfinite(x)):
        raise InvalidArgument("x: the bounds are stated for finite values")
    a = np.abs(x.astype(np.float64))
    if cid == 0:
        return np.zeros_like(a)
    if cid == 1:
        return np.maximum(np.maximum(a * 2.0**-11, 2.0**-25), a - _FP16_MAX)
    if cid == 2:
        return np.maximum(np.maximum(a * 2.0**-8, 2.0**-134), a - _BF16_MAX)
    n = a.shape[0]
    if cid == FP4:
        s = np.repeat(_fp4_scales(_blocks(a)).astype(np.float64), BLOCK)[:n]
        return np.maximum(s / 4, a / 4) + 6 * s * 2.0**-24 + 2.0**-149
    absmax = _blocks(a).max(axis=1)
    per_block = absmax / 254.0 + absmax * 2.0**-22 + 2.0**-149
    return np.repeat(per_block, BLOCK)[:n]


class ErrorFeedback:
    """Residual memory for biased compressors (Seide et al. 2014, "1-bit SGD";
    Karimireddy et al. 2019, "Error Feedback Fixes SignSGD and other Gradient Compression
    Schemes").

    Per key (e.g. `(shard, offset)`, anything hashable and stable across rounds):

        c = x + e                       # compensate(key, x)
        send encode(c); d = decode(...)
        e = c - d                       # update(key, c, d)

    so what was lost to quantization is re-sent later and the sum of the decoded vectors over T
    steps differs from the sum of the inputs by only the last residual (bounded by one step's
    quantization error), instead of growing with T.

    Call `update` only once the transmission counted (the round committed). After an abort,
    skip it: the residual is unchanged and the retry compensates the same way. Residuals are
    float32; non-finite residual entries are reset to 0 so a bad step cannot poison later ones.
    A stored residual whose shape differs from `x` is stale (the plan's shard bounds moved) and
    is discarded by `compensate`.
    """

    def __init__(self) -> None:
        self._residual: dict[Hashable, np.ndarray] = {}

    def compensate(self, key: Hashable, x: np.ndarray) -> np.ndarray:
        """`x + residual[key]` as a new `(n,)` float32 array (`x` copied when there is none).

        Raises:
            InvalidArgument: `x` is not a 1-D float32 array ("x").
        """
        x = _check_x(x)
        e = self._residual.get(key)
        if e is None or e.shape != x.shape:
            self._residual.pop(key, None)
            return x.copy()
        return x + e

    def update(self, key: Hashable, x_compensated: np.ndarray, decoded: np.ndarray) -> None:
        """Store `x_compensated - decoded` as the residual of `key`.

        Raises:
            InvalidArgument: either argument not 1-D float32, or shapes differ ("decoded").
        """
        c = _check_x(x_compensated)
        d = decoded
        if not isinstance(d, np.ndarray) or d.ndim != 1 or d.dtype != np.float32:
            raise InvalidArgument("decoded: expected a 1-D float32 array")
        if d.shape != c.shape:
            raise InvalidArgument(f"decoded: shape {d.shape} != x_compensated shape {c.shape}")
        with np.errstate(invalid="ignore", over="ignore"):
            e = c - d
        self._residual[key] = np.where(np.isfinite(e), e, np.float32(0)).astype(np.float32)

    def residual(self, key: Hashable) -> np.ndarray | None:
        """A copy of the residual of `key`, or None."""
        e = self._residual.get(key)
        return None if e is None else e.copy()

    def reset(self, key: Hashable | None = None) -> None:
        """Forget the residual of `key`, or every residual when `key` is None."""
        if key is None:
            self._residual.clear()
        else:
            self._residual.pop(key, None)

    def __len__(self) -> int:
        return len(self._residual)

    def __contains__(self, key: object) -> bool:
        return key in self._residual
