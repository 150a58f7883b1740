"""Sparse codecs for whole pseudo-gradients, their fixed-order sum, and SparseLoCo's error feedback.

The dense codecs of `peer.compression` encode a chunk per hop, and contributions sum in place on
the way. A sparse payload does not sum in place: each peer encodes its whole contribution once,
every peer decodes every contribution and sums them (`sum_contributions`) in one fixed order.
This module holds the pure part: encode, check and decode, sum, and the error-feedback
accumulator that makes the dropped mass arrive later. It does not chunk for the wire, sign, send
or plan anything.

Codecs (`SparseCodec`), after SparseLoCo (Sarfi et al., arXiv 2508.15706: chunked top-k of an
error-feedback accumulator, 2-bit values) and DeMo (Peng et al., arXiv 2411.19870: top-k of a
chunk's DCT coefficients):

| id | kind   | what is kept, per chunk of `chunk` elements                              |
| -- | ------ | ------------------------------------------------------------------------ |
| 4  | "topk" | the `k` elements of largest magnitude                                     |
| 5  | "dct"  | the `k` largest-magnitude DCT-II coefficients (`scipy.fft.dct`, norm="ortho") |

The ids continue the dense table (`compression.CODECS`, 0-3) so that one byte names any codec.
The vector of `n` elements is cut into `ceil(n / chunk)` chunks from the start; the last one
holds `n mod chunk` elements when that is not 0, keeps `min(k, its length)` and (for "dct") is
transformed at its own length. Selection is deterministic: magnitudes are compared exactly and
ties go to the lower index; no randomness anywhere.

Values: sign-magnitude codes of `bits` b in [2, 8]: the top bit is the sign, the low b-1 bits a
level m in [0, 2^(b-1)); a code decodes to `±(m + 1) * scale` (float32 product). The chunk's
float32 `scale` is `absmax / 2^(b-1)` (rounded up, so the largest kept value is a level), with
absmax the largest kept magnitude. Error of a kept value: at most `scale` (half a step for
|v| >= scale; values below the first level go to it), plus float32 rounding. A dropped value
decodes to 0 (error |v|, at most the chunk's smallest kept magnitude). For "dct" these bounds
hold for the coefficients; the transform is orthonormal, so the L2 error of a chunk equals its
coefficients' L2 error (plus float32 rounding of the transforms).

Wire format (`SparseEncoded.to_bytes`), little-endian, in this order:

    header   20 B   codec u8, bits u8, reserved u16 (0), chunk u32, k u32, count u64
    scale    4 B per chunk            float32, chunk order
    indices  ceil(K * w / 8) B         w = bit_length(chunk - 1) bits per kept element (12 for 4,096)
    values   ceil(K * b / 8) B         b bits per kept element

with K the kept count (`k` per full chunk, `min(k, n mod chunk)` for a partial last one). Kept
elements are in chunk order, ascending index within a chunk; index and value codes are
bit-packed LSB first (code i occupies stream bits [i*w, (i+1)*w), stream bit j is bit j mod 8 of
byte j // 8), and the padding bits of the last byte are 0.

Bytes: `payload_bytes(n) = 20 + 4 * ceil(n / C) + ceil(K * w / 8) + ceil(K * b / 8)`. For n a
multiple of the chunk C (K = k * n / C), per element: `(k * (w + b) / 8 + 4) / C`, plus
`(20 + at most 2 padding bytes) / n` (`SparseCodec.payload_bytes` and `bytes_per_element` give
both). C = 4,096, k = 64, b = 2: 116 / 4,096 = 0.02832 B/element, 1/141 of float32 and 1/36 of
int8 (1.0156 B/element).

Checks: `encode` refuses non-finite input (and "dct" coefficients that overflow float32) with
`InvalidArgument` naming "x", as the int8 codec does. `decode`, `SparseEncoded.from_bytes` and
`sum_contributions` refuse a malformed payload with `InvalidArgument` naming the field: codec,
bits, chunk, k, count, header, scale (wrong count for the chunks, non-finite, negative or
overflowing), indices (length, padding, out of the chunk, not strictly increasing), values
(length, padding).

Bit-identical sums: encoding and decoding are deterministic on one numpy/scipy build; the "topk"
decode and sum are IEEE float32 products and additions in a fixed order (one rounding each),
so every peer gets the same bytes. The "dct" inverse runs
pocketfft, whose rounding may differ between builds or instruction sets: peers must run the same
build, and the vote digest catches any that do not (the round aborts, nothing is corrupted).
"""

from __future__ import annotations

import struct
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from shoal.common.errors import FailedPrecondition, InvalidArgument

def _fft():
    """scipy.fft, imported by the "dct" codec on first use (scipy costs every process that
    imports this module ~0.3 s otherwise)."""
    import scipy.fft

    return scipy.fft


__all__ = [
    "DEFAULT_CHUNK",
    "HEADER_BYTES",
    "SPARSE_CODECS",
    "ErrorAccumulator",
    "SparseCodec",
    "SparseEncoded",
    "SparseSettings",
    "decode",
    "decode_sparse",
    "encode",
    "is_sparse",
    "payload_length",
    "sum_contributions",
]

SPARSE_CODECS: dict[str, int] = {"topk": 4, "dct": 5}
_KINDS: dict[int, str] = {v: k for k, v in SPARSE_CODECS.items()}
DEFAULT_CHUNK = 4096
MAX_CHUNK = 1 << 16
"""Largest chunk: indices stay within 16 bits."""
_HEADER = struct.Struct("<BBHIIQ")
HEADER_BYTES = _HEADER.size
_ROWS = 256
"""Chunks per block of work: temporaries stay near `_ROWS * chunk` elements, whatever n is."""
_F32_MAX = float(np.finfo(np.float32).max)
_TINY = np.float32(np.finfo(np.float32).smallest_subnormal)


def _is_int(v: object) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


@dataclass(frozen=True)
class SparseCodec:
    """Settings of a sparse codec; constructing one checks them.

    Attributes:
        kind: "topk" or "dct".
        chunk: elements per chunk C, in [2, 65536].
        k: elements (or coefficients) kept per full chunk, in [1, chunk]; density k / C.
        bits: bits per kept value b, in [2, 8].

    Raises:
        InvalidArgument: a setting out of range, named ("kind", "chunk", "k", "bits").
    """

    kind: str = "topk"
    chunk: int = DEFAULT_CHUNK
    k: int = 64
    bits: int = 2

    def __post_init__(self) -> None:
        if self.kind not in SPARSE_CODECS:
            raise InvalidArgument(f"kind: unknown {self.kind!r}; expected one of {sorted(SPARSE_CODECS)}")
        if not _is_int(self.chunk) or not 2 <= self.chunk <= MAX_CHUNK:
            raise InvalidArgument(f"chunk: expected an integer in [2, {MAX_CHUNK}], got {self.chunk!r}")
        if not _is_int(self.k) or not 1 <= self.k <= self.chunk:
            raise InvalidArgument(f"k: expected an integer in [1, chunk={self.chunk}], got {self.k!r}")
        if not _is_int(self.bits) or not 2 <= self.bits <= 8:
            raise InvalidArgument(f"bits: expected an integer in [2, 8], got {self.bits!r}")

    @property
    def codec_id(self) -> int:
        """Wire id (4 "topk", 5 "dct")."""
        return SPARSE_CODECS[self.kind]

    @property
    def index_bits(self) -> int:
        """w = bit_length(chunk - 1): 12 for a chunk of 4,096."""
        return int(self.chunk - 1).bit_length()

    def chunks(self, count: int) -> int:
        """Chunks of a `count`-element vector: ceil(count / chunk)."""
        return -(-count // self.chunk)

    def kept(self, count: int) -> int:
        """K: elements kept of a `count`-element vector (k per full chunk, min(k, rest) for the last)."""
        full, rest = divmod(count, self.chunk)
        return full * self.k + min(self.k, rest)

    def payload_bytes(self, count: int) -> int:
        """Exact `len(SparseEncoded.to_bytes())` for `count` elements (see the module's wire format)."""
        kept = self.kept(count)
        return (HEADER_BYTES + 4 * self.chunks(count) + -(-kept * self.index_bits // 8)
                + -(-kept * self.bits // 8))

    def bytes_per_element(self, count: int | None = None) -> float:
        """Bytes per element: `payload_bytes(count) / count`, or the limit for large n without a
        count: `(k * (w + b) / 8 + 4) / chunk` (0.02832 for C=4,096, k=64, b=2)."""
        if count is None:
            return (self.k * (self.index_bits + self.bits) / 8 + 4) / self.chunk
        return self.payload_bytes(count) / max(count, 1)


@dataclass(frozen=True)
class SparseEncoded:
    """One encoded contribution (module docstring: wire format). Built by `encode`; checked by `decode`.

    Attributes:
        codec: wire id (4 "topk", 5 "dct").
        count: elements n of the encoded vector.
        chunk, k, bits: the codec's settings (`SparseCodec`).
        scale: float32 LE, one per chunk.
        indices: packed within-chunk indices, w bits each.
        values: packed value codes, `bits` each.
    """

    codec: int
    count: int
    chunk: int
    k: int
    bits: int
    scale: bytes
    indices: bytes
    values: bytes

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: `len(self.to_bytes())`."""
        return HEADER_BYTES + len(self.scale) + len(self.indices) + len(self.values)

    def to_bytes(self) -> bytes:
        """The wire form: header, scale, indices, values."""
        head = _HEADER.pack(self.codec, self.bits, 0, self.chunk, self.k, self.count)
        return b"".join((head, self.scale, self.indices, self.values))

    @classmethod
    def from_bytes(cls, data: bytes) -> SparseEncoded:
        """Split a wire form into its fields, checking the header and every field's length
        (not the contents: `decode` checks those).

        Raises:
            InvalidArgument: shorter than a header or a nonzero reserved field ("header"), a bad
                setting ("codec", "bits", "chunk", "k"), or a field cut short or followed by
                trailing bytes ("scale", "indices", "values").
        """
        data = bytes(data)
        if len(data) < HEADER_BYTES:
            raise InvalidArgument(f"header: expected {HEADER_BYTES} bytes, got {len(data)} (payload truncated)")
        cid, bits, reserved, chunk, k, count = _HEADER.unpack_from(data)
        if reserved != 0:
            raise InvalidArgument(f"header: reserved field must be 0, got {reserved}")
        codec = _codec_of(cid, chunk, k, bits)
        sizes = {"scale": 4 * codec.chunks(count), "indices": -(-codec.kept(count) * codec.index_bits // 8),
                 "values": -(-codec.kept(count) * bits // 8)}
        fields, at = {}, HEADER_BYTES
        for name, size in sizes.items():
            if at + size > len(data):
                raise InvalidArgument(f"{name}: expected {size} bytes, got {len(data) - at} (payload truncated)")
            fields[name] = data[at:at + size]
            at += size
        if at != len(data):
            raise InvalidArgument(f"values: {len(data) - at} trailing bytes after the payload")
        return cls(cid, count, chunk, k, bits, **fields)


def payload_length(head: bytes) -> tuple[SparseCodec, int, int]:
    """From the first `HEADER_BYTES` of a wire form: its codec, element count and the exact
    length of the whole payload (what a receiver must collect before `SparseEncoded.from_bytes`).

    Raises:
        InvalidArgument: fewer than `HEADER_BYTES` bytes or a nonzero reserved field ("header"),
            a bad setting ("codec", "bits", "chunk", "k").
    """
    if len(head) < HEADER_BYTES:
        raise InvalidArgument(f"header: expected {HEADER_BYTES} bytes, got {len(head)} (payload truncated)")
    cid, bits, reserved, chunk, k, count = _HEADER.unpack_from(bytes(head[:HEADER_BYTES]))
    if reserved != 0:
        raise InvalidArgument(f"header: reserved field must be 0, got {reserved}")
    codec = _codec_of(cid, chunk, k, bits)
    return codec, int(count), codec.payload_bytes(int(count))


@dataclass(frozen=True)
class SparseSettings:
    """A run's sparse compression ([run] compression = "topk" | "dct"; docs/configuration.md):
    the codec every peer encodes its error-fed pseudo-gradient with and the accumulator's decay β.

    Raises:
        InvalidArgument: a codec setting out of range (`SparseCodec`), beta not in [0, 1] ("beta").
    """

    codec: SparseCodec
    beta: float = 0.95

    def __post_init__(self) -> None:
        if not isinstance(self.codec, SparseCodec):
            raise InvalidArgument(f"codec: expected a SparseCodec, got {type(self.codec).__name__}")
        if isinstance(self.beta, bool) or not isinstance(self.beta, (int, float)) or not 0.0 <= self.beta <= 1.0:
            raise InvalidArgument(f"beta: expected a number in [0, 1], got {self.beta!r}")

    def accumulator(self, size: int) -> ErrorAccumulator:
        """A fresh accumulator (e = 0) for a `(size,)` float32 pseudo-gradient."""
        return ErrorAccumulator(size, self.codec, self.beta)


def is_sparse(compression: str) -> bool:
    """Whether a [run] compression names a sparse codec ("topk", "dct")."""
    return compression in SPARSE_CODECS


def _codec_of(cid: object, chunk: object, k: object, bits: object) -> SparseCodec:
    if not _is_int(cid) or int(cid) not in _KINDS:
        raise InvalidArgument(f"codec: unknown id {cid!r}; expected one of {sorted(_KINDS)}")
    return SparseCodec(_KINDS[int(cid)], chunk, k, bits)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Selection, quantization, bit packing (vectorised over a block of chunks)


def _select(rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k magnitudes of each row of `(r, L)` float32: `(r, k)` column indices, ascending
    (int64), and their values (float32). Ties at the threshold go to the lower index."""
    length = rows.shape[1]
    a = np.abs(rows)
    t = np.partition(a, length - k, axis=1)[:, length - k:length - k + 1]  # k-th largest, (r, 1)
    keep = a >= t
    over = np.flatnonzero(keep.sum(axis=1) > k)
    if over.size:  # more than k at or above the threshold: the threshold ties, lowest indices win
        sub, st = a[over], t[over]
        gt, eq = sub > st, sub == st
        need = k - gt.sum(axis=1, keepdims=True)
        keep[over] = gt | (eq & (np.cumsum(eq, axis=1) <= need))
    flat = np.flatnonzero(keep)  # row-major: chunk order, ascending index within a chunk
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


def _pack(codes: np.ndarray, width: int) -> bytes:
    """`(K,)` unsigned codes < 2^width -> LSB-first bitstream of K * width bits, zero-padded."""
    as_bytes = codes.astype("<u2").view(np.uint8).reshape(-1, 2)
    bitstream = np.unpackbits(as_bytes, axis=1, bitorder="little")[:, :width]
    return np.packbits(bitstream.reshape(-1), bitorder="little").tobytes()


def _unpack(data: bytes, count: int, width: int, field: str) -> np.ndarray:
    """Inverse of `_pack`: `(count,)` uint16. Refuses nonzero padding bits (naming `field`)."""
    bitstream = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little")
    if bitstream[count * width:].any():
        raise InvalidArgument(f"{field}: nonzero padding bits after the last code")
    padded = np.zeros((count, 16), dtype=np.uint8)
    padded[:, :width] = bitstream[:count * width].reshape(count, width)
    return np.packbits(padded, axis=1, bitorder="little").view("<u2").reshape(count)


def _blocks(count: int, chunk: int):
    """(first element, chunks, chunk length) of each block of work: full chunks by `_ROWS`, then the
    partial last chunk alone."""
    full, rest = divmod(count, chunk)
    for first in range(0, full, _ROWS):
        yield first * chunk, min(_ROWS, full - first), chunk
    if rest:
        yield full * chunk, 1, rest


# ---------------------------------------------------------------------------------------------
# Encode / decode


def encode(x: np.ndarray, codec: SparseCodec) -> SparseEncoded:
    """Encode a whole `(n,)` float32 vector (module docstring: selection, values, wire format).

    Deterministic: the same bytes in give the same payload. `x` is not modified. Work goes by
    blocks of 256 chunks: beyond the input, memory is a few tens of bytes per kept element plus
    temporaries of one block, whatever n is.

    Raises:
        InvalidArgument: `x` not a 1-D float32 array, or holding NaN/inf, or (for "dct")
            coefficients that overflow float32 ("x"); `codec` not a SparseCodec ("codec").
    """
    x = _check_x(x, "x")
    if not isinstance(codec, SparseCodec):
        raise InvalidArgument(f"codec: expected a SparseCodec, got {type(codec).__name__}")
    return _encode_blocks(int(x.shape[0]), lambda lo, hi: x[lo:hi], codec)


def _encode_blocks(n: int, rows_of, codec: SparseCodec) -> SparseEncoded:
    """`encode` of the `(n,)` vector whose elements [lo, hi) are `rows_of(lo, hi)` (float32),
    asked block by block in order: the vector itself need not exist as a whole."""
    cols, codes, scales = [], [], []
    for first, nrows, length in _blocks(n, codec.chunk):
        rows = np.asarray(rows_of(first, first + nrows * length), dtype=np.float32).reshape(nrows, length)
        if not np.isfinite(rows).all():
            raise InvalidArgument(f"x: NaN or inf among elements [{first}, {first + nrows * length}); "
                                  "sparse codecs encode finite values only")
        if codec.kind == "dct":
            rows = _fft().dct(rows, type=2, norm="ortho", axis=1)
            if not np.isfinite(rows).all():
                raise InvalidArgument(f"x: DCT coefficients of elements [{first}, {first + nrows * length}) "
                                      "overflow float32")
        c, v = _select(rows, min(codec.k, length))
        q, s = _quantize(v, codec.bits)
        cols.append(c.reshape(-1))
        codes.append(q.reshape(-1))
        scales.append(s)
    return SparseEncoded(
        codec.codec_id, n, codec.chunk, codec.k, codec.bits,
        scale=_concat(scales, np.float32).astype("<f4").tobytes(),
        indices=_pack(_concat(cols, np.int64), codec.index_bits),
        values=_pack(_concat(codes, np.uint8), codec.bits),
    )


def _concat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


@dataclass(frozen=True)
class _Parsed:
    codec: SparseCodec
    count: int
    index: np.ndarray  # (K,) int64 global element (or coefficient) index, strictly increasing
    value: np.ndarray  # (K,) float32 decoded value (or coefficient)


def _parse(enc: SparseEncoded) -> _Parsed:
    """Check every field of a payload and decode it to global indices and values."""
    if not isinstance(enc, SparseEncoded):
        raise InvalidArgument(f"enc: expected SparseEncoded, got {type(enc).__name__}")
    codec = _codec_of(enc.codec, enc.chunk, enc.k, enc.bits)
    if not _is_int(enc.count) or enc.count < 0:
        raise InvalidArgument(f"count: expected an integer >= 0, got {enc.count!r}")
    n, chunks, kept = int(enc.count), codec.chunks(int(enc.count)), codec.kept(int(enc.count))
    if len(enc.scale) != 4 * chunks:
        raise InvalidArgument(f"scale: expected {4 * chunks} bytes for {chunks} chunks of {n} elements, "
                              f"got {len(enc.scale)}")
    for field, raw, width in (("indices", enc.indices, codec.index_bits), ("values", enc.values, codec.bits)):
        want = -(-kept * width // 8)
        if len(raw) != want:
            raise InvalidArgument(f"{field}: expected {want} bytes for {kept} kept elements, got {len(raw)}")
    scale = np.frombuffer(enc.scale, dtype="<f4").astype(np.float32)
    if not np.isfinite(scale).all():
        raise InvalidArgument("scale: non-finite chunk scale")
    if (scale < 0).any() or (scale.astype(np.float64) * (1 << (codec.bits - 1)) > _F32_MAX).any():
        raise InvalidArgument("scale: chunk scale negative or too large (2^(bits-1) * scale > float32 max)")
    cols = _unpack(enc.indices, kept, codec.index_bits, "indices").astype(np.int64)
    codes = _unpack(enc.values, kept, codec.bits, "values")
    rest = n % codec.chunk
    per_chunk = np.full(chunks, codec.k, dtype=np.int64)
    length = np.full(chunks, codec.chunk, dtype=np.int64)
    if rest:
        per_chunk[-1], length[-1] = min(codec.k, rest), rest
    chunk_of = np.repeat(np.arange(chunks, dtype=np.int64), per_chunk)
    bad = np.flatnonzero(cols >= length[chunk_of])
    if bad.size:
        i = int(bad[0])
        raise InvalidArgument(f"indices: index {int(cols[i])} out of range for chunk {int(chunk_of[i])} "
                              f"of {int(length[chunk_of[i]])} elements")
    index = chunk_of * codec.chunk + cols
    step = np.flatnonzero(np.diff(index) <= 0)
    if step.size:
        raise InvalidArgument(f"indices: not strictly increasing within chunk {int(chunk_of[step[0] + 1])}")
    value = _dequantize(codes, np.repeat(scale, per_chunk), codec.bits)
    return _Parsed(codec, n, index, value)


def _inverse_dct_inplace(coeffs: np.ndarray, chunk: int) -> None:
    """Replace a `(n,)` float32 vector of per-chunk DCT-II coefficients by the chunks themselves."""
    for first, nrows, length in _blocks(coeffs.shape[0], chunk):
        view = coeffs[first:first + nrows * length].reshape(nrows, length)
        view[...] = _fft().idct(view, type=2, norm="ortho", axis=1)


def decode_sparse(enc: SparseEncoded) -> tuple[np.ndarray, np.ndarray]:
    """The kept entries of a payload: `(K,)` int64 indices into the `(count,)` vector (for "dct",
    into its per-chunk coefficients), strictly increasing, and their `(K,)` float32 values.

    Raises:
        InvalidArgument: a malformed payload, naming the field (module docstring: checks).
    """
    p = _parse(enc)
    return p.index, p.value


def decode(enc: SparseEncoded) -> np.ndarray:
    """Decode a payload into a new dense `(count,)` float32 array (dropped elements are 0).

    Raises:
        InvalidArgument: a malformed payload, naming the field (module docstring: checks).
    """
    if not isinstance(enc, SparseEncoded):
        raise InvalidArgument(f"enc: expected SparseEncoded, got {type(enc).__name__}")
    return sum_contributions([enc])


def sum_contributions(contributions: Sequence[SparseEncoded | np.ndarray],
                      weights: Sequence[float] | None = None) -> np.ndarray:
    """Sum p contributions into a new `(n,)` float32 vector, in the order given.

    The caller passes them in participant-index order, so every peer adds the same float32
    numbers in the same order and holds the same bytes. Either every contribution is a payload
    (same kind, chunk and count; k and bits may differ) or every one is an already decoded
    `(n,)` float32 array; a peer uses one form for a round, since the two differ in rounding.
    Payloads: "topk" adds each contribution's kept values into the output in turn; "dct" adds
    the coefficients in turn and inverts once at the end (the transform is linear; one inverse
    instead of p). Dense arrays: `out += a` in turn.

    `weights` (one finite number per contribution, same order; None = all 1) makes it the
    weighted sum `Σ_i w_i · decode(c_i)`, e.g. FedAvg's sample-weighted mean with
    `w_i = n_i / Σ n`: each decoded value is multiplied by `float32(w_i)` (one rounding) before
    it is added, so the result is as deterministic as the plain sum.

    Raises:
        InvalidArgument: no contributions, a mixture of forms, kinds, chunks or counts, a
            dense array not 1-D float32 or not finite ("contributions"); weights of another
            length or not finite ("weights"); a malformed payload, naming its field.
    """
    if not isinstance(contributions, Sequence) or len(contributions) == 0:
        raise InvalidArgument("contributions: expected a non-empty sequence in participant-index order")
    w = _weights(weights, len(contributions))
    if all(isinstance(c, np.ndarray) for c in contributions):
        return _sum_dense(contributions, w)
    if not all(isinstance(c, SparseEncoded) for c in contributions):
        raise InvalidArgument("contributions: mixes decoded arrays and payloads, or holds neither")
    first = contributions[0]
    for i, enc in enumerate(contributions):
        if (enc.codec, enc.chunk, enc.count) != (first.codec, first.chunk, first.count):
            raise InvalidArgument(f"contributions: [{i}] has codec/chunk/count {(enc.codec, enc.chunk, enc.count)}, "
                                  f"[0] has {(first.codec, first.chunk, first.count)}")
    parsed = [_parse(enc) for enc in contributions]
    out = np.zeros(parsed[0].count, dtype=np.float32)
    for i, p in enumerate(parsed):
        out[p.index] += p.value if w is None else w[i] * p.value  # indices are unique within one contribution
    if parsed[0].codec.kind == "dct":
        _inverse_dct_inplace(out, parsed[0].codec.chunk)
    return out


def _weights(weights: Sequence[float] | None, p: int) -> np.ndarray | None:
    if weights is None:
        return None
    try:
        w = np.asarray([float(v) for v in weights], dtype=np.float64)
    except (TypeError, ValueError):
        raise InvalidArgument("weights: expected one number per contribution") from None
    if w.shape != (p,) or not np.isfinite(w).all():
        raise InvalidArgument(f"weights: expected {p} finite numbers, got {len(w)}")
    return w.astype(np.float32)


def _sum_dense(arrays: Sequence[np.ndarray], w: np.ndarray | None = None) -> np.ndarray:
    shape = arrays[0].shape
    for i, a in enumerate(arrays):
        if a.ndim != 1 or a.dtype != np.float32 or a.shape != shape:
            raise InvalidArgument(f"contributions: [{i}] has shape {a.shape} dtype {a.dtype}; "
                                  f"expected ({shape[0] if shape else '?'},) float32")
        if not np.isfinite(a).all():
            raise InvalidArgument(f"contributions: [{i}] holds NaN or inf")
    out = arrays[0].copy() if w is None else w[0] * arrays[0]
    for i, a in enumerate(arrays[1:], 1):
        out += a if w is None else w[i] * a
    return out


def _check_x(x: object, field: str) -> np.ndarray:
    if not isinstance(x, np.ndarray) or x.ndim != 1 or x.dtype != np.float32:
        shape = getattr(x, "shape", None)
        dtype = getattr(x, "dtype", type(x).__name__)
        raise InvalidArgument(f"{field}: expected a 1-D float32 array, got shape {shape} dtype {dtype}")
    return x


def _subtract_decoded(enc: SparseEncoded, target: np.ndarray) -> None:
    """`target -= decode(enc)` in place, without a dense temporary of the model's size."""
    p = _parse(enc)
    if p.codec.kind == "topk":
        target[p.index] -= p.value
        return
    chunk = p.codec.chunk
    lo = 0
    for first, nrows, length in _blocks(p.count, chunk):
        hi = np.searchsorted(p.index, first + nrows * length, side="left")
        coeffs = np.zeros(nrows * length, dtype=np.float32)
        coeffs[p.index[lo:hi] - first] = p.value[lo:hi]
        view = target[first:first + nrows * length].reshape(nrows, length)
        view -= _fft().idct(coeffs.reshape(nrows, length), type=2, norm="ortho", axis=1)
        lo = hi


# ---------------------------------------------------------------------------------------------
# Error feedback


class ErrorAccumulator:
    """SparseLoCo's error-feedback accumulator (Sarfi et al., arXiv 2508.15706), one per peer.

    With pseudo-gradient Δ of the round and decay β:

        e <- β·e + Δ              # propose(Δ): the candidate, e itself untouched
        send C(e)                 # the payload propose returns
        e <- e - decode(C(e))     # commit(): what was not sent stays for later rounds

    so mass the compressor drops now is sent in a later round, and the sum of what a peer sends
    tracks the sum of its pseudo-gradients (with β = 1 they differ by the current e only).

    Exactly once per committed round: `propose` computes the candidate into a new buffer and
    never mutates e; `commit` makes the candidate minus the sent part the new e; `abort` drops
    the candidate, so a retried round proposes again from the same e. A new `propose` replaces
    an uncommitted one (only the latest payload can commit); `commit(attempt)` refuses a payload
    other than the one proposed for `attempt`, and a second commit of the same proposal.

    A peer that syncs state (a joiner, or one whose digest disagreed) starts with e = 0
    (`reset`): the accumulator is the peer's own unsent mass, never copied from a donor.

    Memory: e is one `(size,)` float32 vector and nothing else of the model's size: `propose`
    computes β·e + Δ block by block while it encodes, and keeps a reference to Δ (which the
    caller must not change until the proposal commits or aborts) and the payload; `commit`
    recomputes β·e + Δ into e in place, block by block.
    """

    def __init__(self, size: int, codec: SparseCodec, beta: float) -> None:
        """Raises InvalidArgument: size not an integer >= 0 ("size"), codec not a SparseCodec
        ("codec"), beta not in [0, 1] ("beta")."""
        if not _is_int(size) or size < 0:
            raise InvalidArgument(f"size: expected an integer >= 0, got {size!r}")
        if not isinstance(codec, SparseCodec):
            raise InvalidArgument(f"codec: expected a SparseCodec, got {type(codec).__name__}")
        if isinstance(beta, bool) or not isinstance(beta, (int, float, np.floating)) or not 0.0 <= beta <= 1.0:
            raise InvalidArgument(f"beta: expected a number in [0, 1], got {beta!r}")
        self.codec = codec
        self.beta = float(beta)
        self._e = np.zeros(int(size), dtype=np.float32)
        self._pending: tuple[Hashable, np.ndarray, SparseEncoded] | None = None

    @property
    def accumulator(self) -> np.ndarray:
        """e, as a read-only `(size,)` float32 view."""
        view = self._e.view()
        view.flags.writeable = False
        return view

    @property
    def pending(self) -> bool:
        """Whether a proposal awaits commit or abort."""
        return self._pending is not None

    def propose(self, delta: np.ndarray, attempt: Hashable = None) -> SparseEncoded:
        """Encode `C(β·e + Δ)` for the round attempt `attempt`; e is not changed.

        Raises:
            InvalidArgument: `delta` not a `(size,)` float32 array or not finite, or β·e + Δ
                overflowing ("delta"). The earlier pending proposal, if any, is then kept.
        """
        delta = _check_x(delta, "delta")
        if delta.shape != self._e.shape:
            raise InvalidArgument(f"delta: expected shape {self._e.shape}, got {delta.shape}")
        beta, e = np.float32(self.beta), self._e

        def rows(lo: int, hi: int) -> np.ndarray:
            block = np.multiply(e[lo:hi], beta)
            block += delta[lo:hi]
            return block

        try:
            payload = _encode_blocks(int(delta.shape[0]), rows, self.codec)
        except InvalidArgument as exc:
            raise InvalidArgument(f"delta: {exc}") from None
        self._pending = (attempt, delta, payload)
        return payload

    def propose_dense(self, delta: np.ndarray, attempt: Hashable = None) -> np.ndarray:
        """For a round the planner gave the dense all-reduce (C = identity: nothing is dropped):
        the whole candidate β·e + Δ as a new `(size,)` float32 array; its `commit` sets e <- 0.

        Raises:
            InvalidArgument: `delta` not a `(size,)` float32 array ("delta").
        """
        delta = _check_x(delta, "delta")
        if delta.shape != self._e.shape:
            raise InvalidArgument(f"delta: expected shape {self._e.shape}, got {delta.shape}")
        candidate = np.multiply(self._e, np.float32(self.beta))
        candidate += delta
        self._pending = (attempt, None, None)
        return candidate

    def commit(self, attempt: Hashable = None) -> None:
        """Apply the pending proposal: e <- (β·e + Δ) - decode(payload), in place and with the
        same float32 operations as the proposal's candidate (so e is what `propose` encoded,
        minus what was sent).

        Raises:
            FailedPrecondition: nothing pending (never proposed, aborted, or already committed),
                or the pending proposal is for another attempt; e is then unchanged.
        """
        if self._pending is None:
            raise FailedPrecondition("commit: no pending proposal (aborted, or already committed)")
        owner, delta, payload = self._pending
        if owner != attempt:
            raise FailedPrecondition(f"commit: the pending proposal is for attempt {owner!r}, not {attempt!r}")
        e, beta = self._e, np.float32(self.beta)
        self._pending = None
        if payload is None:  # a dense round (propose_dense): everything was sent
            e[...] = 0
            return
        np.multiply(e, beta, out=e)  # in place: no temporary of the model's size
        e += delta
        _subtract_decoded(payload, e)
        self._pending = None

    def abort(self) -> None:
        """Drop the pending proposal, if any; e is unchanged."""
        self._pending = None

    def reset(self) -> None:
        """e <- 0 and drop any pending proposal (a peer that synced state starts here)."""
        self._e = np.zeros_like(self._e)
        self._pending = None
