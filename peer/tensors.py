"""Tensor wire format: dtype codes, chunking and digests.

Tensors travel as flat little-endian byte strings with a dtype code (shoal.v1.DType) and a
shape; every collective result is fingerprinted with BLAKE2b-256 over its bytes, the digest
peers vote with.
"""

from __future__ import annotations

import hashlib

import numpy as np

from peer.errors import InvalidArgument
from shoal.v1 import shoal_pb2 as pb

_TO_NUMPY = {
    pb.FLOAT32: np.dtype("<f4"),
    pb.FLOAT16: np.dtype("<f2"),
    pb.FLOAT64: np.dtype("<f8"),
    pb.INT8: np.dtype("i1"),
    pb.UINT8: np.dtype("u1"),
}
_FROM_NUMPY = {v: k for k, v in _TO_NUMPY.items()}


def to_numpy_dtype(code: int) -> np.dtype:
    """numpy dtype of a shoal.v1.DType code. Raises InvalidArgument for unsupported codes."""
    try:
        return _TO_NUMPY[code]
    except KeyError:
        raise InvalidArgument(f"dtype: unsupported code {code}") from None


def dtype_code(dtype: np.dtype) -> int:
    """shoal.v1.DType code of a numpy dtype. Raises InvalidArgument for unsupported dtypes."""
    try:
        return _FROM_NUMPY[np.dtype(dtype).newbyteorder("<") if np.dtype(dtype).itemsize > 1 else np.dtype(dtype)]
    except KeyError:
        raise InvalidArgument(f"dtype: unsupported {dtype}") from None


def digest(*arrays: np.ndarray | bytes) -> bytes:
    """BLAKE2b-256 over the bytes of the given arrays (C order) or byte strings, in order."""
    h = hashlib.blake2b(digest_size=32)
    for a in arrays:
        # A memoryview of the array's buffer: hashed in place, no copy of a possibly large tensor.
        h.update(a if isinstance(a, bytes | bytearray | memoryview) else memoryview(np.ascontiguousarray(a)).cast("B"))
    return h.digest()


def decode_chunk(data: bytes, dtype: int, expected_count: int) -> np.ndarray:
    """View `data` as a 1-D array of `expected_count` elements of `dtype` (read-only, no copy).

    Raises:
        InvalidArgument: the byte length does not match `expected_count` elements.
    """
    dt = to_numpy_dtype(dtype)
    if len(data) != expected_count * dt.itemsize:
        raise InvalidArgument(f"data: {len(data)} bytes, expected {expected_count} x {dt.itemsize}")
    return np.frombuffer(data, dtype=dt)


# ------------------------------------------------------------------ chunk messages without copies
#
# A shoal.v1.Chunk carries up to several MB of tensor bytes. Going through protobuf objects costs
# four copies of them (tobytes, field assignment, serialization; parsing, field access), which on
# a fast link is the all-reduce's main cost. These helpers produce and read the same protobuf
# wire format (a message is its fields in any order, so "header fields + field 10" is a valid
# Chunk) with one copy when sending and none when receiving.

_DATA_TAG = bytes([(10 << 3) | 2])  # Chunk.data: field 10, length-delimited


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


class ChunkOut:
    """An outgoing chunk: `meta` (a shoal.v1.Chunk without `data`) and the payload array, which
    is copied only when the message is serialized (so it must not change before it is sent)."""

    __slots__ = ("meta", "payload")

    def __init__(self, meta: pb.Chunk, payload: np.ndarray):
        self.meta = meta
        self.payload = payload

    @property
    def nbytes(self) -> int:
        return int(self.payload.nbytes)


def serialize_chunk(msg: "ChunkOut | pb.Chunk") -> bytes:
    """Wire bytes of a chunk, identical in meaning to ``pb.Chunk(..., data=payload).SerializeToString()``."""
    if isinstance(msg, pb.Chunk):
        return msg.SerializeToString()
    payload = memoryview(np.ascontiguousarray(msg.payload)).cast("B")
    return b"".join((msg.meta.SerializeToString(), _DATA_TAG, _varint(payload.nbytes), payload))


class ChunkView:
    """An incoming chunk: every shoal.v1.Chunk field through `meta`, except `data`, a read-only
    memoryview into the received message (no copy)."""

    __slots__ = ("meta", "data")

    def __init__(self, meta: pb.Chunk, data: memoryview):
        self.meta = meta
        self.data = data

    def __getattr__(self, name: str):
        return getattr(self.meta, name)


def parse_chunk(buf: bytes) -> ChunkView:
    """Parse wire bytes of a shoal.v1.Chunk without copying `data`.

    Raises InvalidArgument on malformed protobuf (truncated fields, unknown wire types).
    """
    view = memoryview(buf)
    n = len(view)
    pos = 0
    rest: list[memoryview] = []
    data = view[0:0]

    def varint(pos: int) -> tuple[int, int]:
        shift = result = 0
        while True:
            if pos >= n or shift > 63:
                raise InvalidArgument("data: truncated or malformed chunk message")
            b = buf[pos]
            pos += 1
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                return result, pos
            shift += 7

    while pos < n:
        start = pos
        tag, pos = varint(pos)
        wt = tag & 7
        if wt == 0:
            _, pos = varint(pos)
        elif wt == 1:
            pos += 8
        elif wt == 5:
            pos += 4
        elif wt == 2:
            length, pos = varint(pos)
            if tag >> 3 == 10:
                if pos + length > n:
                    raise InvalidArgument("data: truncated chunk message")
                data = view[pos:pos + length]
                pos += length
                continue
            pos += length
        else:
            raise InvalidArgument(f"data: unsupported wire type {wt} in chunk message")
        if pos > n:
            raise InvalidArgument("data: truncated chunk message")
        rest.append(view[start:pos])
    try:
        meta = pb.Chunk.FromString(b"".join(rest))
    except Exception as exc:  # protobuf's DecodeError
        raise InvalidArgument(f"data: malformed chunk message: {exc}") from None
    return ChunkView(meta, data)
