"""Tensor wire format: dtype codes, chunking and digests.

Tensors travel as flat little-endian byte strings with a dtype code (shoal.v1.DType) and a
shape. Every collective result and every committed state is fingerprinted with BLAKE3-256
(O'Connor, Aumasson, Neves, Wilcox-O'Hearn 2020; the `blake3` package): the digest peers vote
with and joiners verify downloads against.

Why not BLAKE2b (the peer id's hash): every participant must hash all of its result (a peer
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
    pb.UINT32: np.dtype("<u4"),
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


RESULT_BLOCK_BYTES = 1 << 20
_RESULT_DOMAIN = b"shoal.v1 result digest: BLAKE3-256 of 1 MiB block digests\0"


def result_digest(a: np.ndarray) -> bytes:
    """The vote digest of a collective's result (32 bytes): BLAKE3-256 over a domain prefix, the
    byte length (8 bytes, little-endian) and the BLAKE3-256 digest of each consecutive
    RESULT_BLOCK_BYTES (1 MiB) block of the array's bytes (C order; the last block may be
    shorter), in order (`result_block_digest`, `combine_result_blocks`).

    A two-level hash rather than `digest` of the whole buffer so that a collective, whose result
    becomes final out of order (the ring's all-gather delivers the first element's shard last to
    one peer), hashes each block as soon as it is final and only the last block(s) after the last
    chunk (`peer.result_digest.ResultDigest`): a one-level Merkle tree (BLAKE3's own tree is not
    exposed by its Python binding). Result digests are compared only with one another (votes,
    commits); a training state's digest is `digest` of its serialization, the all-reduce job's
    state's is derived from its tensor's result digest (`shoal.peer.workloads.base.array_state_digest`)."""
    data = memoryview(np.ascontiguousarray(a)).cast("B")
    return combine_result_blocks(len(data), (result_block_digest(data[lo:lo + RESULT_BLOCK_BYTES])
                                             for lo in range(0, len(data), RESULT_BLOCK_BYTES)))


def result_block_digest(block: memoryview | bytes) -> bytes:
    """BLAKE3-256 (32 bytes) of one block of a result (`result_digest`); one core."""
    return blake3.blake3(block, max_threads=1).digest(length=DIGEST_BYTES)


def combine_result_blocks(nbytes: int, block_digests) -> bytes:
    """`result_digest` (32 bytes) of a result of `nbytes` bytes from its blocks' digests (an
    iterable of 32-byte strings, in order). Raises ValueError when their number or sizes do not
    fit `nbytes` (ceil(nbytes / RESULT_BLOCK_BYTES) digests of DIGEST_BYTES each)."""
    digests = list(block_digests)
    if nbytes < 0 or len(digests) != -(-nbytes // RESULT_BLOCK_BYTES) or any(len(d) != DIGEST_BYTES for d in digests):
        raise ValueError(f"block digests: {len(digests)} for {nbytes} bytes")
    outer = blake3.blake3(_RESULT_DOMAIN, max_threads=1)
    outer.update(nbytes.to_bytes(8, "little"))
    for d in digests:
        outer.update(d)
    return outer.digest(length=DIGEST_BYTES)


def decode_chunk(data: bytes, dtype: int, expected_count: int) -> np.ndarray:
    """View `data` as a 1-D array of `expected_count` elements of `dtype` (read-only, no copy).

    Raises:
        InvalidArgument: the byte length does not match `expected_count` elements.
    """
    dt = to_numpy_dtype(dtype)
    if len(data) != expected_count * dt.itemsize:
        raise InvalidArgument(f"data: {len(data)} bytes, expected {expected_count} x {dt.itemsize}")
    return np.frombuffer(data, dtype=dt)


