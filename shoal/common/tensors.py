"""Tensor wire format: dtype codes, chunking and digests.

Tensors travel as flat little-endian byte strings with a dtype code (shoal.v1.DType) and a
shape. Every collective result and every committed state is fingerprinted with BLAKE3-256
(O'Connor, Aumasson, Neves, Wilcox-O'Hearn 2020; the `blake3` package): the digest peers vote
with and joiners verify downloads against.

Why not BLAKE2b (DESIGN.md §3 names it): every participant must hash all of its result (a peer
attests only bytes it read), so the digest costs p x n bytes of hashing per round. BLAKE2b runs
at 0.93 GB/s on this project's reference machine (69 ms per 64 MB, per peer), more than the
whole shared-memory all-reduce of 64 MB; BLAKE3, the same family's successor with the same
128-bit collision security, runs at 4.4 GB/s on one core (15 ms). Measured in docs/performance.md.
"""

from __future__ import annotations

import blake3
import numpy as np

from shoal.common.errors import InvalidArgument
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


DIGEST_BYTES = 32


def digest(*arrays: np.ndarray | bytes) -> bytes:
    """BLAKE3-256 (32 bytes) over the bytes of the given arrays (C order) or byte strings, in order."""
    h = blake3.blake3(max_threads=1)  # one core: peers sharing a host must not oversubscribe it
    for a in arrays:
        # A memoryview of the array's buffer: hashed in place, no copy of a possibly large tensor.
        h.update(a if isinstance(a, bytes | bytearray | memoryview) else memoryview(np.ascontiguousarray(a)).cast("B"))
    return h.digest(length=DIGEST_BYTES)


def decode_chunk(data: bytes, dtype: int, expected_count: int) -> np.ndarray:
    """View `data` as a 1-D array of `expected_count` elements of `dtype` (read-only, no copy).

    Raises:
        InvalidArgument: the byte length does not match `expected_count` elements.
    """
    dt = to_numpy_dtype(dtype)
    if len(data) != expected_count * dt.itemsize:
        raise InvalidArgument(f"data: {len(data)} bytes, expected {expected_count} x {dt.itemsize}")
    return np.frombuffer(data, dtype=dt)


