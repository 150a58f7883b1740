"""The owner audit: a second shard owner recomputes a shard's aggregate and checks the owner's.

In an audited butterfly (`Plan.audit_owners`), every participant sends its part of shard k to
the shard's owner and to its auditor (`Plan.auditors`: the next owner). The auditor recomputes
the aggregate from the same rows, as the owner received them (every row encoded once by its
sender, so both decode the same values), with the same reducer, and compares it with what the
owner published; for distance-based aggregators it also compares the owner's partial distance
matrix of the shard with its own. A difference accuses the owner: one of the two lies, and
the caller (`peer.collectives`) blames both, so both sit out the retry.

`OwnerAudit` is pure (arrays in, verdicts out; tests/test_owner_audit.py): the stream loop feeds
it rows and the owner's published values. Tolerances: the same rows and code give equal bits on
one platform; the slack covers another CPU's float rounding and one quantization step of the
plan's codec. A reducer that adds random noise (differential privacy) cannot be audited.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shoal.peer.compression import codec_id, max_abs_error
from shoal.peer.partition import ChunkSpan, ShardPartition
from shoal.peer.reduction import OwnerAccumulator, OwnerReducer, final_encoding


@dataclass(frozen=True)
class AuditVerdict:
    """The outcome of one check: `ok`, or the owner (`owner`, a peer id) is accused, with the
    largest difference found (`difference`, 0.0 when equal) and a sentence for the logs."""

    ok: bool
    owner: str
    shard: int
    difference: float
    message: str = ""


class OwnerAudit:
    """The audits one participant runs: recompute each shard it audits, compare with its owner.

    Args:
        partition: the attempt's partition seen from the auditor (`partition.audited`).
        reducer: the owners' reducer (None: the plain sum).
        dtype: the tensor's dtype.
        compression: the codec the owner encodes its aggregate with ("none" when chunks travel raw).

    `rows` is the `OwnerAccumulator` of the audited shards: add every participant's row of them,
    the auditor's own as it sent it (encoded once, then decoded).
    """

    def __init__(self, partition: ShardPartition, reducer: OwnerReducer | None, dtype: np.dtype,
                 compression: str = "none"):
        self.partition = partition
        self.compression = compression
        self.dtype = np.dtype(dtype)
        self.rows = OwnerAccumulator(partition, partition.audited, reducer, dtype)

    def owner_of(self, k: int) -> str:
        return self.partition.peer_id(self.partition.owner[k])

    def check_distances(self, k: int, theirs: np.ndarray) -> AuditVerdict:
        """Compare the owner's `(p, p)` partial distance matrix of shard k with this auditor's
        (every row of shard k must be in `rows`, not yet reduced)."""
        mine = self.rows.partial_distances(k)
        owner = self.owner_of(k)
        if np.allclose(theirs, mine, rtol=1e-6, atol=1e-9 * (1.0 + float(np.abs(mine).max()))):
            return AuditVerdict(True, owner, k, 0.0)
        diff = float(np.abs(theirs - mine).max())
        return AuditVerdict(False, owner, k, diff,
                            f"owner {owner[:8]} sent distances of shard {k} that differ from the audit by {diff:.3g}")

    def expected(self, span: ChunkSpan, distances: np.ndarray | None = None) -> np.ndarray:
        """What an honest owner publishes for chunk `span`, as every peer decodes it: the
        reduction of the chunk's rows (releasing them), encoded once. `distances`: the summed
        matrix, for a reducer that needs it. Raises ValueError for an incomplete chunk."""
        values = self.rows.reduce(span, distances).astype(self.dtype, copy=False)
        return final_encoding(values, self.compression)[1]

    def check_aggregate(self, span: ChunkSpan, published: np.ndarray, expected: np.ndarray) -> AuditVerdict:
        """Compare what the owner published for `span` (as this peer decoded it) with `expected`."""
        owner = self.owner_of(span.shard)
        slack = 1e-5 * np.abs(expected) + 1e-6
        if codec_id(self.compression) != 0:
            slack = slack + 2 * max_abs_error(np.abs(expected), self.compression)
        gap = np.abs(published - expected)
        if (gap <= slack).all():
            return AuditVerdict(True, owner, span.shard, float(gap.max(initial=0.0)))
        diff = float(gap.max())
        return AuditVerdict(False, owner, span.shard, diff,
                            f"owner {owner[:8]} published an aggregate of shard {span.shard} that differs from "
                            f"the audit by {diff:.3g}")
