"""State sync that a slow joiner can finish (docs/fault-tolerance.md, "Slow joiners"): resumable
downloads (`Download`), donors that keep a state for its joiner (`HeldStates` pins), the joiner's
rules for orders (`RoundClient._download_for`), and a real-gRPC download cut off mid-range that
resumes at its offset from another donor holding the same digest."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.common.identity import peer_id_of, public_bytes
from shoal.common.security import Security
from shoal.common.tickets import SYNC_ATTEMPT, issue_ticket
from shoal.peer.dataplane import Inbox, PeerService, Transport, serve_data_plane
from shoal.peer.state_sync import Download, HeldStates, SyncError, download_state
from shoal.peer.workloads.base import ArrayState
from shoal.v1 import shoal_pb2 as pb


pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------- real gRPC: resume at the offset


CHUNK = 1 << 20  # peer.dataplane.STATE_CHUNK_BYTES: a range of 4 MiB arrives in 4 chunks


class CutOff(PeerService):
    """A donor that dies (UNAVAILABLE) after sending `chunks` chunks of its first answer, and
    refuses every request after that (as a crashed process would)."""

    def __init__(self, *args, chunks: int, **kw):
        super().__init__(*args, **kw)
        self.chunks = chunks

    async def FetchState(self, request, context):
        sent = 0
        async for c in super().FetchState(request, context):
            if sent == self.chunks:
                self.chunks = 0
                await context.abort(grpc.StatusCode.UNAVAILABLE, "donor went away")
            sent += 1
            yield c


class Recording(PeerService):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.requests: list[tuple[int, int]] = []

    async def FetchState(self, request, context):
        self.requests.append((request.offset, request.length))
        async for c in super().FetchState(request, context):
            yield c


@pytest.mark.integration
async def test_a_download_cut_off_mid_range_resumes_at_its_offset_from_another_donor():
    coordinator = Ed25519PrivateKey.generate()
    me_key = Ed25519PrivateKey.generate()
    me = peer_id_of(public_bytes(me_key))
    st = ArrayState(np.arange(3 << 20, dtype=np.float32), 5)  # 12 MiB: three ranges of 4 MiB
    security = Security(insecure=True)
    pub = public_bytes(coordinator)
    a = CutOff(Inbox(), HeldStates(lambda: st), coordinator_public_key=pub, chunks=2, shared_memory=False)
    b = Recording(Inbox(), HeldStates(lambda: st), coordinator_public_key=pub, shared_memory=False)
    server_a, addr_a = await serve_data_plane(a, "127.0.0.1:0", security)
    server_b, addr_b = await serve_data_plane(b, "127.0.0.1:0", security)
    transport = Transport(security, me_key, shared_memory=False)
    try:
        permit = issue_ticket(coordinator, 5, SYNC_ATTEMPT, [me], st.digest(), 60.0)
        first = pb.SyncOrder(round=5, state_digest=st.digest(), permit=permit,
                             donors=[pb.Participant(peer_id="a" * 32, address=addr_a)])
        dl = Download(5, st.digest(), range_bytes=4 * CHUNK)
        with pytest.raises(SyncError):  # a dies after 2 MiB, then refuses: no donor left
            await asyncio.wait_for(download_state(first, me=me, transport=transport, k=1,
                                                  range_bytes=4 * CHUNK, partial=dl), 30)
        assert dl.received == 2 * CHUNK and dl.missing()[0] == (2 * CHUNK, 2 * CHUNK)
        # A later order names another donor holding the same digest: it resumes at 2 MiB.
        second = pb.SyncOrder(round=5, state_digest=st.digest(), permit=permit,
                              donors=[pb.Participant(peer_id="b" * 32, address=addr_b)])
        res = await asyncio.wait_for(download_state(second, me=me, transport=transport, k=1,
                                                    range_bytes=4 * CHUNK, partial=dl), 30)
        assert res.blob == st.to_bytes() and res.resumed_bytes == 2 * CHUNK
        assert b.requests[0] == (2 * CHUNK, 2 * CHUNK)  # not byte 0
        assert sum(length for _, length in b.requests) == len(st.to_bytes()) - 2 * CHUNK
        assert dl.fetched == len(st.to_bytes())  # every byte crossed the wire once
    finally:
        await transport.close()
        await server_a.stop(None)
        await server_b.stop(None)


@pytest.mark.integration
async def test_a_revoked_members_permit_fetches_no_state_newer_than_its_sync():
    """A member revoked after its last sync holds a permit for round 5: once the swarm committed
    round 6 (one round after the revocation, when the coordinator issues it no new permit), every
    donor refuses its FetchState of the new state (PERMISSION_DENIED naming the round), although
    the permit has not expired; the state of its own sync it may still finish."""
    coordinator, me_key = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    me = peer_id_of(public_bytes(me_key))
    states = {"now": ArrayState(np.arange(1024, dtype=np.float32), 5)}
    donor = PeerService(Inbox(), HeldStates(lambda: states["now"]), coordinator_public_key=public_bytes(coordinator),
                        shared_memory=False)
    donor.state.hold()
    server, address = await serve_data_plane(donor, "127.0.0.1:0", Security(insecure=True))
    transport = Transport(Security(insecure=True), me_key, shared_memory=False)
    try:
        old = states["now"]
        permit = issue_ticket(coordinator, 5, SYNC_ATTEMPT, [me], old.digest(), 900.0)
        order = pb.SyncOrder(round=5, state_digest=old.digest(), permit=permit,
                             donors=[pb.Participant(peer_id="d" * 32, address=address)])
        res = await asyncio.wait_for(download_state(order, me=me, transport=transport, k=1), 30)
        assert res.blob == old.to_bytes()
        states["now"] = ArrayState(old.params + 1.0, 6)  # round 5 commits: the donor holds round 6
        donor.state.hold()
        stub = transport.stub(address, "d" * 32)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in stub.FetchState(pb.StateRequest(peer_id=me, round=6), timeout=10,
                                           metadata=(("x-shoal-ticket-bin", permit),)):
                pass
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "ticket is for round 5, not 6" in refused.value.details()
    finally:
        await transport.close()
        await server.stop(None)
