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

Segments: the sparse all-gather streams a contribution as consecutive segment payloads, each the
wire form above of a range of whole chunks (`segment_bounds`: SEGMENT_ELEMENTS elements from the
start, the last range shorter), so a peer sends the first segment while it encodes the next and a
receiver decodes segments as they arrive. Chunks are cut from the start of the vector either way,
so a segment holds exactly the chunks the whole payload holds for its elements, and
`sum_segments` of the segments gives the bytes `sum_contributions` gives for the whole payloads;
each segment adds a 20-byte header (and up to 2 bytes of padding): 24 segments for 10^8
elements.

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
    "SEGMENT_ELEMENTS",
    "SPARSE_CODECS",
    "DecodedSegment",
    "ErrorAccumulator",
    "SegmentReader",
    "SparseCodec",
    "SparseEncoded",
    "SparseSettings",
    "decode",
    "decode_segment",
    "decode_sparse",
    "encode",
    "is_sparse",
    "payload_length",
    "segment_bounds",
    "range_end",
    "sum_contributions",
    "sum_range",
    "sum_segments",
    "warm_kernels",
    "weights_of",
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


def warm_kernels(codec: SparseCodec) -> None:
    """Compile the codec's kernels (peer.sparse_kernels), or load them from numba's cache, now:
    a peer of a sparse run calls it at start, so its first round does not wait for the compiler
    (8-9 s in one process the first time on a machine, ~25 s for four processes at once on 2
    cores; 0.6-0.8 s from numba's cache after that) and the
    compiler's and the compiled code's memory (~150 MB, fixed: it does not grow with the model)
    is taken before the model's buffers. Runs every path a round runs, on a vector of a few
    chunks."""
    n = 2 * codec.chunk + 3
    delta = np.linspace(-1.0, 1.0, n, dtype=np.float32)
    acc = ErrorAccumulator(n, codec, 0.5)
    segs = [(lo, acc.propose_segment(delta, lo, hi)) for lo, hi in segment_bounds(n, codec.chunk, codec.chunk)]
    acc.proposed(delta, segs, attempt=0)
    acc.commit(attempt=0)
    parts = [[decode_segment(lo, enc) for lo, enc in segs]] * 2
    out = np.empty(n, np.float32)
    sum_range(parts, 0, n, codec, None, out)
    sum_range(parts, 0, n, codec, weights_of((0.5, 0.5), 2), out)
    decode(encode(delta, codec))


def is_sparse(compression: str) -> bool:
    """Whether a [run] compression names a sparse codec ("topk", "dct")."""
    return compression in SPARSE_CODECS


def _codec_of(cid: object, chunk: object, k: object, bits: object) -> SparseCodec:
    if not _is_int(cid) or int(cid) not in _KINDS:
        raise InvalidArgument(f"codec: unknown id {cid!r}; expected one of {sorted(_KINDS)}")
    return SparseCodec(_KINDS[int(cid)], chunk, k, bits)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Selection and quantization (peer.sparse_kernels, compiled), bit packing


def _kernels():
    """peer.sparse_kernels, imported on first use (numba costs every process that imports this
    module ~0.4 s otherwise; its compiled code is cached on disk after the first process)."""
    from shoal.peer import sparse_kernels

    return sparse_kernels


def _pack(codes: np.ndarray, width: int) -> bytes:
    """`(K,)` unsigned codes < 2^width (width <= 16) -> LSB-first bitstream of K * width bits,
    zero-padded. Eight codes make `width` bytes exactly: each group of eight is composed as a
    little-endian integer of 8 * width bits (two uint64 words: low, high) and its first `width`
    bytes are kept."""
    k = int(codes.shape[0])
    groups = -(-k // 8)
    c = np.zeros(groups * 8, dtype=np.uint64)
    c[:k] = codes
    c = c.reshape(groups, 8)
    words = np.zeros((groups, 2), dtype="<u8")  # little-endian words: the stream's byte order on any host
    lo, hi = words[:, 0], words[:, 1]
    for i in range(8):
        s = i * width
        if s + width <= 64:
            lo |= c[:, i] << np.uint64(s)
        elif s >= 64:
            hi |= c[:, i] << np.uint64(s - 64)
        else:  # straddles the two words
            lo |= c[:, i] << np.uint64(s)
            hi |= c[:, i] >> np.uint64(64 - s)
    return words.view(np.uint8).reshape(groups, 16)[:, :width].tobytes()[:-(-k * width // 8)]


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

    Deterministic: the same bytes in give the same payload. `x` is not modified. Beyond the
    input, memory is a few tens of bytes per kept element ("dct": plus the transform of one block
    of 256 chunks), whatever n is.

    Raises:
        InvalidArgument: `x` not a 1-D float32 array, or holding NaN/inf, or (for "dct")
            coefficients that overflow float32 ("x"); `codec` not a SparseCodec ("codec").
    """
    x = _check_x(x, "x")
    if not isinstance(codec, SparseCodec):
        raise InvalidArgument(f"codec: expected a SparseCodec, got {type(codec).__name__}")
    n = int(x.shape[0])
    if codec.kind == "topk":
        # The kernel views x as int32, which needs x contiguous.
        fields = _kernels().encode_values(np.ascontiguousarray(x), codec.chunk, codec.k, codec.bits)
        return _payload(codec, n, *fields, end=n)
    return _encode_dct(n, lambda lo, hi: x[lo:hi], codec)


def _payload(codec: SparseCodec, n: int, cols: np.ndarray, codes: np.ndarray, scales: np.ndarray, bad: int,
             end: int) -> SparseEncoded:
    """The payload of `n` elements from a kernel's fields (peer.sparse_kernels `encode_*`);
    `bad` >= 0: the first element of a chunk holding NaN or inf (the encoded range ends at `end`:
    both in the whole vector's indices, for the message)."""
    if bad >= 0:
        raise InvalidArgument(f"x: NaN or inf among elements [{bad}, {min(bad + codec.chunk, end)}); "
                              "sparse codecs encode finite values only")
    return SparseEncoded(codec.codec_id, n, codec.chunk, codec.k, codec.bits,
                         scale=scales.astype("<f4", copy=False).tobytes(),
                         indices=_pack(cols, codec.index_bits), values=_pack(codes, codec.bits))


def _encode_dct(n: int, rows_of, codec: SparseCodec, base: int = 0) -> SparseEncoded:
    """The "dct" payload of the `(n,)` vector whose elements [lo, hi) are `rows_of(lo, hi)`
    (float32), asked block by block in order: the vector itself need not exist as a whole.
    `base`: the first element's index in the whole vector (for the error messages of a segment)."""
    cols, codes, scales = [], [], []
    for first, nrows, length in _blocks(n, codec.chunk):
        rows = np.asarray(rows_of(first, first + nrows * length), dtype=np.float32).reshape(nrows, length)
        lo, hi = base + first, base + first + nrows * length
        if not np.isfinite(rows).all():
            raise InvalidArgument(f"x: NaN or inf among elements [{lo}, {hi}); sparse codecs encode finite values only")
        coeffs = _fft().dct(rows, type=2, norm="ortho", axis=1).astype(np.float32, copy=False)
        c, q, s, bad = _kernels().encode_values(np.ascontiguousarray(coeffs).reshape(-1), length, codec.k,
                                                codec.bits)
        if bad >= 0:
            raise InvalidArgument(f"x: DCT coefficients of elements [{lo}, {hi}) overflow float32")
        cols.append(c)
        codes.append(q)
        scales.append(s)
    return _payload(codec, n, _concat(cols, np.int64), _concat(codes, np.uint8), _concat(scales, np.float32), -1,
                    base + n)


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
    status, a, b, index, value = _kernels().decode_fields(
        np.frombuffer(enc.indices, dtype=np.uint8), np.frombuffer(enc.values, dtype=np.uint8), scale, n,
        codec.chunk, codec.k, codec.bits, codec.index_bits)
    if status in (1, 2):
        field = "indices" if status == 1 else "values"
        raise InvalidArgument(f"{field}: nonzero padding bits after the last code")
    if status == 3:
        length = codec.chunk if (b + 1) * codec.chunk <= n else n - b * codec.chunk
        raise InvalidArgument(f"indices: index {a} out of range for chunk {b} of {length} elements")
    if status == 4:
        raise InvalidArgument(f"indices: not strictly increasing within chunk {a}")
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
    w = weights_of(weights, len(contributions))
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
    return _sum_parsed([[(0, p)] for p in parsed], parsed[0].count, parsed[0].codec, w, None)


def _sum_parsed(contributions: Sequence[Sequence[tuple[int, _Parsed]]], count: int, codec: SparseCodec,
                w: np.ndarray | None, out: np.ndarray | None) -> np.ndarray:
    """The fixed-order sum of parsed contributions, each a list of (first element, segment)."""
    if out is None:
        out = np.zeros(count, dtype=np.float32)
    else:
        out[...] = 0
    for i, parts in enumerate(contributions):
        at = 0
        for first, p in parts:
            if first != at:
                raise InvalidArgument(f"contributions: [{i}] has a segment at element {first}, expected {at}")
            view = out[first:first + p.count]
            if w is None:  # indices unique within one contribution: out[i] + v, one rounding each
                _kernels().scatter_add(view, p.index, p.value)
            else:
                _kernels().scatter_add_weighted(view, p.index, p.value, w[i])
            at += p.count
        if at != count:
            raise InvalidArgument(f"contributions: [{i}] covers [0, {at}), expected [0, {count})")
    if codec.kind == "dct":
        _inverse_dct_inplace(out, codec.chunk)
    return out


# ---------------------------------------------------------------------------------------------
# Segmented contributions (the sparse all-gather's stream)

SEGMENT_ELEMENTS = 1 << 22
"""Elements per segment of a streamed contribution (rounded down to whole chunks, `segment_bounds`): 16 MB of
float32 input, ~75 KB of payload at 1 % density and 2 bits; 24 segments for a 100M-element
vector."""


def segment_bounds(count: int, chunk: int, segment: int | None = None) -> list[tuple[int, int]]:
    """[lo, hi) of each segment of a `count`-element vector: `segment` elements (default
    SEGMENT_ELEMENTS) rounded down to a multiple of `chunk` (at least one chunk) from the start,
    the last one shorter; one empty segment for an empty vector."""
    segment = SEGMENT_ELEMENTS if segment is None else segment
    step = max(chunk, segment // chunk * chunk)
    return [(lo, min(count, lo + step)) for lo in range(0, count, step)] or [(0, 0)]


@dataclass(frozen=True)
class DecodedSegment:
    """One checked and decoded segment of a contribution: its first element in the whole vector
    and its kept entries (`decode_sparse` of the segment's payload, indices within the segment)."""

    first: int
    parsed: _Parsed


def decode_segment(first: int, enc: SparseEncoded) -> DecodedSegment:
    """Check and decode a segment payload that starts at element `first` (any thread).

    Raises:
        InvalidArgument: a malformed payload, naming the field (module docstring: checks).
    """
    return DecodedSegment(int(first), _parse(enc))


def sum_segments(contributions: Sequence[Sequence[DecodedSegment]], count: int, codec: SparseCodec,
                 weights: Sequence[float] | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """`sum_contributions` of segmented contributions: each contribution (participant-index
    order) is its decoded segments in element order, covering [0, count). The sum is the same
    float32 operations in the same order as `sum_contributions` of the whole payloads, so a
    segmented and a whole contribution give the same bytes. `out`: a `(count,)` float32 array
    to sum into (zeroed first; e.g. a pooled result buffer: a fresh one costs a page fault per
    page the scatter touches, ~1 s for 400 MB), else a new one.

    Raises:
        InvalidArgument: no contributions, segments that do not cover [0, count) in order, a
            segment of another kind or chunk ("contributions"); weights of another length or
            not finite ("weights"); `out` of another shape or dtype ("out").
    """
    if not isinstance(contributions, Sequence) or len(contributions) == 0:
        raise InvalidArgument("contributions: expected a non-empty sequence in participant-index order")
    w = weights_of(weights, len(contributions))
    if out is not None and (not isinstance(out, np.ndarray) or out.shape != (count,) or out.dtype != np.float32):
        raise InvalidArgument(f"out: expected a ({count},) float32 array")
    for i, parts in enumerate(contributions):
        for d in parts:
            if (d.parsed.codec.kind, d.parsed.codec.chunk) != (codec.kind, codec.chunk):
                raise InvalidArgument(f"contributions: [{i}] holds a {d.parsed.codec.kind} segment of chunk "
                                      f"{d.parsed.codec.chunk}, expected {codec.kind} of chunk {codec.chunk}")
    return _sum_parsed([[(d.first, d.parsed) for d in parts] for parts in contributions], count, codec, w, out)


def range_end(hi: int, count: int, codec: SparseCodec) -> int:
    """Where a range sum (`sum_range`) covering elements up to `hi` of a `count`-element vector
    may end: `hi` itself for "topk"; for "dct" the largest multiple of 256 chunks (the inverse
    transform's blocks, counted from element 0) not past it, or `count`, so that every peer
    inverts the same blocks whatever ranges its arrivals cut (a transform's rounding may depend
    on how many rows it runs at once on some builds)."""
    if codec.kind != "dct" or hi >= count:
        return hi
    return hi // (_ROWS * codec.chunk) * (_ROWS * codec.chunk)


def sum_range(contributions: Sequence[Sequence[DecodedSegment]], lo: int, hi: int, codec: SparseCodec,
              weights: np.ndarray | None, out: np.ndarray) -> None:
    """Elements [lo, hi) of `sum_segments(contributions, ...)` into `out[lo:hi]`, the rest of
    `out` untouched: a sum that runs range by range as the segments arrive (the sparse
    all-gather sums a range once every participant's segments cover it). The same float32
    additions in the same participant order per element as the whole sum, so any cut into
    ranges gives the same bytes. `contributions`: per participant (order), its decoded segments
    in element order, covering at least [0, hi); `weights`: `(p,)` float32 or None (checked by
    the caller, as `sum_segments` does); `lo` and `hi` on chunk boundaries (or `hi` the end),
    which "dct" needs to invert whole chunks. Pure: no checks beyond what `sum_segments` made of
    the same segments; call it for disjoint ranges only (any thread)."""
    view = out[lo:hi]
    view[...] = 0
    k = _kernels()
    for i, parts in enumerate(contributions):
        for d in parts:
            first, count = d.first, d.parsed.count
            if first >= hi or first + count <= lo:
                continue
            index, value = d.parsed.index, d.parsed.value
            a = int(np.searchsorted(index, lo - first)) if lo > first else 0
            b = int(np.searchsorted(index, hi - first)) if hi < first + count else index.shape[0]
            dest = out[first:first + count]
            if weights is None:
                k.scatter_add(dest, index[a:b], value[a:b])
            else:
                k.scatter_add_weighted(dest, index[a:b], value[a:b], weights[i])
    if codec.kind == "dct":
        _inverse_dct_inplace(view, codec.chunk)


class SegmentReader:
    """Reassembles one sender's segmented contribution from its byte stream: consecutive segment
    payloads (each a whole wire form, module docstring) covering elements [0, count) in order;
    one segment is the plain whole payload. `feed(data)` takes the next bytes, in stream order,
    and returns the segments they completed as (first element, payload); `done` once the
    segments cover [0, count).

    Checks, each an InvalidArgument naming the field: a segment header of another kind or chunk
    than `codec`, or a malformed one ("header", "codec", "bits", "chunk", "k"); a segment not
    starting on a chunk boundary, past `count`, empty or shorter than a chunk before the last
    ("count"); bytes after the last segment ("values"). Segment contents are checked by
    `decode_segment`.
    """

    def __init__(self, codec: SparseCodec, count: int):
        self.codec, self.count = codec, int(count)
        self.at = 0  # elements covered by the segments returned so far
        self.nbytes = 0  # bytes fed
        self.done = False
        self._buf = bytearray()
        self._need: int | None = None  # the current segment's whole length, once its header is in

    def feed(self, data: bytes) -> list[tuple[int, SparseEncoded]]:
        if self.done and data:
            raise InvalidArgument(f"values: {len(data)} bytes past the contribution's last segment")
        self._buf += data
        self.nbytes += len(data)
        out = []
        while not self.done:
            if self._need is None:
                if len(self._buf) < HEADER_BYTES:
                    break
                codec, n, self._need = payload_length(self._buf)
                if (codec.kind, codec.chunk) != (self.codec.kind, self.codec.chunk):
                    raise InvalidArgument(f"header: codec {codec.kind}, chunk {codec.chunk}; this round needs "
                                          f"{self.codec.kind}, chunk {self.codec.chunk}")
                last = self.at + n == self.count
                if self.at + n > self.count or (n == 0 and self.count) or (not last and n % codec.chunk):
                    raise InvalidArgument(f"count: a segment of {n} elements at element {self.at} does not fit "
                                          f"whole chunks of {codec.chunk} within {self.count} elements")
            if len(self._buf) < self._need:
                break
            enc = SparseEncoded.from_bytes(bytes(self._buf[:self._need]))
            del self._buf[:self._need]
            out.append((self.at, enc))
            self.at += enc.count
            self._need = None
            self.done = self.at == self.count
        if self.done and self._buf:
            raise InvalidArgument(f"values: {len(self._buf)} bytes past the contribution's last segment")
        return out


def weights_of(weights: Sequence[float] | None, p: int) -> np.ndarray | None:
    """`weights` as the `(p,)` float32 multipliers of the sums, or None (all 1).

    Raises:
        InvalidArgument: not p finite numbers ("weights").
    """
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
        _kernels().scatter_sub(target, p.index, p.value)
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
        # (attempt, Δ, the payload's segments: (first element, payload) in order)
        self._pending: tuple[Hashable, np.ndarray | None, tuple[tuple[int, SparseEncoded], ...] | None] | None = None

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
        """Encode `C(β·e + Δ)` for the round attempt `attempt`, as one payload; e is not changed.

        Raises:
            InvalidArgument: `delta` not a `(size,)` float32 array or not finite, or β·e + Δ
                overflowing ("delta"). The earlier pending proposal, if any, is then kept.
        """
        payload = self.propose_segment(delta, 0, self._e.shape[0])
        self.proposed(delta, [(0, payload)], attempt)
        return payload

    def propose_segment(self, delta: np.ndarray, lo: int, hi: int) -> SparseEncoded:
        """`C(β·e + Δ)` of elements [lo, hi) alone: one segment of a segmented proposal
        (`segment_bounds`; the sparse all-gather sends each as soon as it is encoded). Pure: e
        is not changed and nothing is recorded, so segments may be encoded on several threads
        at once; `proposed` records the whole. Encoding by chunks from the start, a segment that
        starts on a chunk boundary holds exactly the chunks the whole vector's payload holds for
        those elements.

        Raises:
            InvalidArgument: `delta` not a `(size,)` float32 array, [lo, hi) not a range of it
                starting on a chunk boundary, or not finite / overflowing ("delta").
        """
        delta = _check_x(delta, "delta")
        if delta.shape != self._e.shape:
            raise InvalidArgument(f"delta: expected shape {self._e.shape}, got {delta.shape}")
        n, chunk = delta.shape[0], self.codec.chunk
        if not (_is_int(lo) and _is_int(hi) and 0 <= lo <= hi <= n and lo % chunk == 0
                and (hi % chunk == 0 or hi == n)):
            raise InvalidArgument(f"delta: segment [{lo}, {hi}) is not a range of whole chunks of {n} elements "
                                  f"(chunk {chunk}; the last may end at {n})")
        beta, e, lo, hi = np.float32(self.beta), self._e, int(lo), int(hi)
        try:
            if self.codec.kind == "topk":  # β·e + Δ a chunk at a time, in the kernel
                fields = _kernels().encode_error_fed(e, delta, beta, lo, hi, chunk, self.codec.k, self.codec.bits)
                return _payload(self.codec, hi - lo, *fields, end=hi)

            def rows(a: int, b: int) -> np.ndarray:
                block = np.multiply(e[lo + a:lo + b], beta)
                block += delta[lo + a:lo + b]
                return block

            return _encode_dct(hi - lo, rows, self.codec, base=lo)
        except InvalidArgument as exc:
            raise InvalidArgument(f"delta: {exc}") from None

    def proposed(self, delta: np.ndarray, segments: Sequence[tuple[int, SparseEncoded]],
                 attempt: Hashable = None) -> None:
        """Record `segments` ((first element, payload) in order, from `propose_segment` with this
        `delta`) as the pending proposal of `attempt`, replacing any uncommitted one.

        Raises:
            InvalidArgument: the segments do not cover [0, size) in order, one after another
                ("segments"); the earlier pending proposal is then kept.
        """
        at = 0
        for first, enc in segments:
            if first != at or not isinstance(enc, SparseEncoded):
                raise InvalidArgument(f"segments: expected a payload starting at element {at}, got {first}")
            at += enc.count
        if at != self._e.shape[0]:
            raise InvalidArgument(f"segments: cover [0, {at}), expected [0, {self._e.shape[0]})")
        self._pending = (attempt, delta, tuple(segments))

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
        for first, enc in payload:
            _subtract_decoded(enc, e[first:first + enc.count])

    def abort(self) -> None:
        """Drop the pending proposal, if any; e is unchanged."""
        self._pending = None

    def reset(self) -> None:
        """e <- 0 and drop any pending proposal (a peer that synced state starts here)."""
        self._e = np.zeros_like(self._e)
        self._pending = None
