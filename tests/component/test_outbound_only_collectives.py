"""Outbound-only participants (docs/nat.md): the planner never makes them shard owners and forces
the butterfly; in the data plane (real gRPC in one process) they push to the owners on streams
they open and get the reduced shards back on them, bit-identical, and nobody dials them."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from shoal.common.errors import InvalidArgument, PermissionDenied, Unauthenticated
from shoal.common.identity import RequestVerifier, sign_metadata
from shoal.common.tensors import result_digest
from shoal.common.tickets import issue_ticket

from shoal.peer.collectives import CollectiveError
from shoal.peer.dataplane import EXCHANGE_REPLY, Inbox, take_replies
from shoal.peer.reduction import OwnerReduction, ReductionSpec
from shoal.v1 import shoal_pb2 as pb
from kits.swarmlet import Swarmlet


def _inputs(p: int, n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n).astype(np.float32) for _ in range(p)]


@pytest.mark.parametrize("compression", ["none", "int8"])
async def test_outbound_only_peers_get_the_bit_identical_sum_on_their_own_streams(compression):
    p, n = 5, 301
    xs = _inputs(p, n)
    async with Swarmlet(p, shared=[False] * p) as sw:
        # Nobody can dial peers 1 and 3: their addresses lead nowhere.
        sw.addresses[1] = sw.addresses[3] = "127.0.0.1:1"
        out = await sw.run(xs, attempt=0, shard_owner=(0, 2, 4), outbound_only=(1, 3), compression=compression)
    digests = {r.digest for r in out}
    assert len(digests) == 1
    assert all(result_digest(r.values) == r.digest for r in out)
    if compression == "none":
        np.testing.assert_allclose(out[1].values, np.sum(xs, axis=0), rtol=1e-5, atol=1e-5)


async def test_outbound_only_with_a_robust_aggregator_and_audited_owners():
    p, n = 5, 160
    xs = _inputs(p, n, seed=3)
    spec = ReductionSpec("trimmed-mean", {"beta": 0.2})
    async with Swarmlet(p, shared=[False] * p) as sw:
        sw.addresses[4] = "127.0.0.1:1"
        out = await sw.run(xs, attempt=0, shard_owner=(0, 1, 2, 3), outbound_only=(4,), audit=True,
                           reducers=[OwnerReduction(spec, np.ones(p), n) for _ in range(p)])
    assert len({r.digest for r in out}) == 1


async def test_a_tampering_owner_is_still_caught_with_outbound_only_peers():
    p, n = 4, 120
    xs = _inputs(p, n, seed=5)

    def tamper(v):
        v = v.copy()
        v[0] += 1.0
        return v

    async with Swarmlet(p, shared=[False] * p) as sw:
        sw.addresses[3] = "127.0.0.1:1"
        out = await sw.run(xs, attempt=0, shard_owner=(0, 1, 2), outbound_only=(3,), audit=True,
                           tampers={1: tamper}, return_exceptions=True)
    failed = [r for r in out if isinstance(r, CollectiveError)]
    assert failed and any(sw.ids[1] in e.suspects for e in failed)


async def test_a_dialable_peer_cannot_open_an_exchange():
    p, n = 3, 60
    xs = _inputs(p, n)
    async with Swarmlet(p, shared=[False] * p) as sw:
        # The plan peer 2 runs says it is outbound-only, the owners' sessions say nobody is.
        base = sw.session

        def no_outbound(attempt, outbound_only=(), collective=""):
            return base(attempt, (), collective)

        sw.session = no_outbound
        out = await sw.run(xs, attempt=0, shard_owner=(0, 1), outbound_only=(2,), chunk_timeout=2.0,
                           return_exceptions=True)
    assert isinstance(out[2], CollectiveError)
    assert "PERMISSION_DENIED" in str(out[2])


class _Call:
    """An Exchange call as `take_replies` reads it: the owner's replies, then EOF."""

    def __init__(self, replies, metadata):
        self.replies, self.metadata = list(replies), metadata

    async def read(self):
        return self.replies.pop(0) if self.replies else grpc.aio.EOF

    async def initial_metadata(self):
        return self.metadata


async def test_an_owners_replies_are_checked_before_they_reach_the_inbox():

    sw = Swarmlet(3)
    owner, me = sw.ids[0], sw.ids[2]
    ticket = issue_ticket(sw.coordinator_key, 0, 0, sw.ids, bytes(32), 60.0)

    def reply(**kw):
        c = pb.Chunk(round=0, attempt=0, sender=owner, phase=pb.ALL_GATHER, shard=0, offset=0, dtype=pb.FLOAT32,
                     shape=[4], data=bytes(16), ticket=ticket)
        for k, v in kw.items():
            setattr(c, k, v)
        return c

    async def take(first, key=sw.keys[0], more=()):
        inbox = Inbox()
        inbox.start(sw.session(0, (2,)))
        n = await take_replies(_Call([first, *more], sign_metadata(key, EXCHANGE_REPLY, first)), inbox,
                               RequestVerifier(), owner)
        return n, inbox

    n, inbox = await take(reply(), more=[reply(offset=4)])
    assert n == 2
    got = await inbox.get((0, 0, pb.ALL_GATHER, 0, 0, 0, owner), 1.0)
    assert got.tolist() == [0.0] * 4
    with pytest.raises(Unauthenticated):  # signed by another peer's key
        await take(reply(), key=sw.keys[1])
    with pytest.raises(PermissionDenied):  # no ticket on the first reply
        await take(reply(ticket=b""))
    with pytest.raises(InvalidArgument):  # a reply that is not a reduced shard
        await take(reply(), more=[reply(phase=pb.REDUCE_SCATTER, offset=4)])
    with pytest.raises(InvalidArgument):  # another sender on the owner's stream
        await take(reply(sender=me))
