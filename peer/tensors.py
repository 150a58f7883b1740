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

