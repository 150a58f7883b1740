"""Link measurement against a real peer: probes over gRPC on loopback fill the link report."""

from __future__ import annotations

from shoal.peer.dataplane import Inbox, PeerService, Transport, serve_data_plane
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from shoal.peer.links import LinkMeter, probe_missing
from shoal.common.security import Security


async def test_probes_measure_a_real_peer_and_fill_the_report():
    security = Security(insecure=True)
    server, address = await serve_data_plane(PeerService(Inbox()), "127.0.0.1:0", security)
    transport = Transport(security, Ed25519PrivateKey.generate())
    try:
        m = LinkMeter()
        peers = [("me", "127.0.0.1:1"), ("other", address)]
        assert await probe_missing(m, transport, peers, "me", nbytes=256 * 1024) == 1
        (v,) = m.links()
        assert v.peer_id == "other" and v.up_bytes_per_s > 0 and v.down_bytes_per_s > 0 and v.rtt_seconds > 0
        assert await probe_missing(m, transport, peers, "me") == 0  # history now: no probe
    finally:
        await transport.close()
        await server.stop(None)
