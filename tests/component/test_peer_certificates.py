"""Certificates issued at join, in process: what the coordinator's CA signs, what a peer installs,
and real grpc.aio data-plane handshakes: a server is verified by its peer id whatever address is
dialled, and a client presenting another peer's certificate (or the legacy shared one, or none) is
refused."""

from __future__ import annotations


import grpc
import pytest

from kits.legacy_tls import add_legacy_peer_cert
from shoal.common.certs import (PeerTLS, peer_dns_name)
from shoal.common.security import Security, push_metadata, signing_interceptors
from shoal.coordinator.ca import CertificateAuthority
from shoal.peer.dataplane import Inbox, PeerService, Transport, channel_options, serve_data_plane
from shoal.v1 import shoal_pb2 as pb
from shoal.v1 import shoal_pb2_grpc as pb_grpc

from kits.certs import ca, identity as _identity, tls_dir  # noqa: F401 (fixtures)

pytestmark = pytest.mark.timeout(60)


def _issued(ca: CertificateAuthority, peer_id: str) -> PeerTLS:
    tls = PeerTLS(peer_id)
    issued = ca.issue(peer_id, tls.csr())
    tls.install(issued.certificate, issued.ca)
    return tls


# ------------------------------------------------------------------ the data plane, real handshakes


@pytest.fixture
async def server_a(ca, tmp_path):
    """Peer A's data-plane server with its issued certificate (mutual TLS, ids checked)."""
    key, pid = _identity(tmp_path, "a")
    tls = _issued(ca, pid)
    service = PeerService(Inbox(), coordinator_public_key=b"\1" * 32)
    server, bound = await serve_data_plane(service, "127.0.0.1:0", Security(tls_dir=str(ca_dir(ca, tmp_path))),
                                           peer_tls=tls)
    try:
        yield pid, int(bound.rsplit(":", 1)[1])
    finally:
        await server.stop(grace=None)


def ca_dir(ca: CertificateAuthority, tmp_path) -> str:
    # The server needs a TLS directory to be in TLS mode; a peer's holds ca.pem only.
    d = tmp_path / "volunteer"
    d.mkdir(exist_ok=True)
    (d / "ca.pem").write_bytes(ca.ca_pem)
    return str(d)


async def _probe(transport: Transport, address: str, peer_id: str) -> grpc.StatusCode:
    try:
        await transport.stub(address, peer_id).Probe(pb.ProbeRequest(), timeout=5)
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as exc:
        return exc.code()


async def _push(transport: Transport, key, address: str, peer_id: str, sender: str) -> tuple[grpc.StatusCode, str]:
    chunk = pb.Chunk(round=0, attempt=0, sender=sender, phase=pb.REDUCE_SCATTER, dtype=pb.FLOAT32, shape=[1],
                     data=bytes(4))
    try:
        await transport.stub(address, peer_id).PushChunks(iter([chunk]), metadata=push_metadata(key, chunk), timeout=5)
        return grpc.StatusCode.OK, ""
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details()


async def test_server_verified_by_peer_id_at_any_address(ca, server_a, tmp_path):
    a_id, port = server_a
    key_b, b_id = _identity(tmp_path, "b")
    t = Transport(Security(tls_dir=ca_dir(ca, tmp_path)), key_b, shared_memory=False, peer_tls=_issued(ca, b_id))
    try:
        for host in ("127.0.0.1", "localhost"):  # no address is in any certificate: both work
            assert await _probe(t, f"{host}:{port}", a_id) == grpc.StatusCode.OK
        # The plan says another peer lives at this address: A's certificate does not name it.
        assert await _probe(t, f"127.0.0.1:{port}", "cc" * 16) == grpc.StatusCode.UNAVAILABLE
        # The honest sender gets past TLS and the signature to the ticket check.
        code, details = await _push(t, key_b, f"127.0.0.1:{port}", a_id, b_id)
        assert code == grpc.StatusCode.PERMISSION_DENIED and "ticket" in details, details
    finally:
        await t.close()


async def test_a_peer_presenting_another_peers_certificate_is_refused(ca, server_a, tmp_path):
    a_id, port = server_a
    _, b_id = _identity(tmp_path, "b")
    key_c, c_id = _identity(tmp_path, "c")
    stolen = _issued(ca, b_id)  # B's TLS key and certificate, in C's hands; C signs with its own key
    t = Transport(Security(tls_dir=ca_dir(ca, tmp_path)), key_c, shared_memory=False, peer_tls=stolen)
    try:
        code, details = await _push(t, key_c, f"127.0.0.1:{port}", a_id, c_id)
        assert code == grpc.StatusCode.UNAUTHENTICATED, details
        assert f"certificate is for peer {b_id[:8]}" in details
        assert await _probe(t, f"127.0.0.1:{port}", a_id) == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await t.close()


async def test_legacy_shared_certificate_and_no_certificate_are_refused(ca, tls_dir, server_a, tmp_path):
    a_id, port = server_a
    key_c, c_id = _identity(tmp_path, "c")
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    for f in ("ca.pem", "ca.key"):
        (legacy / f).write_bytes((tls_dir / f).read_bytes())
    pem, keyp = add_legacy_peer_cert(legacy)  # signed by the same CA, names hosts, no peer id
    chunk = pb.Chunk(round=0, attempt=0, sender=c_id, phase=pb.REDUCE_SCATTER, dtype=pb.FLOAT32, shape=[1],
                     data=bytes(4))
    opts = [*channel_options(), ("grpc.ssl_target_name_override", peer_dns_name(a_id))]
    creds = grpc.ssl_channel_credentials(ca.ca_pem, keyp.read_bytes(), pem.read_bytes())
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", creds, options=opts,
                                       interceptors=signing_interceptors(key_c)) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pb_grpc.PeerStub(ch).PushChunks(iter([chunk]), metadata=push_metadata(key_c, chunk), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and "names no peer" in err.value.details()
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(ca.ca_pem),
                                       options=opts, interceptors=signing_interceptors(key_c)) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:  # no client certificate: the handshake fails
            await pb_grpc.PeerStub(ch).Probe(pb.ProbeRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_renewed_certificate_serves_new_connections(ca, tmp_path):
    key_a, a_id = _identity(tmp_path, "a")
    key_b, b_id = _identity(tmp_path, "b")
    tls_a = _issued(ca, a_id)
    server, bound = await serve_data_plane(PeerService(Inbox()), "127.0.0.1:0",
                                           Security(tls_dir=ca_dir(ca, tmp_path)), peer_tls=tls_a)
    tls_b = _issued(ca, b_id)
    t = Transport(Security(tls_dir=ca_dir(ca, tmp_path)), key_b, shared_memory=False, peer_tls=tls_b)
    try:
        assert await _probe(t, bound, a_id) == grpc.StatusCode.OK
        before = t._channels[bound]
        again = ca.issue(b_id, tls_b.csr())
        tls_b.install(again.certificate, again.ca)  # B renewed: its next channel presents the new one
        t.stub(bound, a_id)
        assert t._channels[bound] is not before
        renewed_a = ca.issue(a_id, tls_a.csr())
        tls_a.install(renewed_a.certificate, renewed_a.ca)  # the server picks it up at the next handshake
        assert await _probe(t, bound, a_id) == grpc.StatusCode.OK
    finally:
        await t.close()
        await server.stop(grace=None)
