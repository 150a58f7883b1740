"""Chunk headers for the data-plane tests (the bulk lane's frames, PushChunks' admission)."""

from __future__ import annotations

from shoal.v1 import shoal_pb2 as pb

ALICE = "a1" * 16  # a peer id: 32 hex digits


def chunk_header(sender: str = ALICE, count: int = 4, **kw) -> pb.Chunk:
    """A chunk header of round 0, attempt 0, shard 0 for `count` float32 elements (reduce-scatter
    unless `phase` is given); any other Chunk field by keyword."""
    return pb.Chunk(round=0, attempt=0, sender=sender, phase=kw.pop("phase", pb.REDUCE_SCATTER), shard=0,
                    offset=kw.pop("offset", 0), dtype=kw.pop("dtype", pb.FLOAT32), shape=[count], **kw)
