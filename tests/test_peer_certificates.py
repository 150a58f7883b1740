"""Certificates issued at join: what the coordinator's CA signs, what a peer installs, and real
grpc.aio data-plane handshakes: a server is verified by its peer id whatever address is dialled,
and a client presenting another peer's certificate (or the legacy shared one, or none) is refused.
"""

from __future__ import annotations

import datetime
import subprocess
import sys

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from legacy_tls import add_legacy_peer_cert
from shoal.common.certs import (PeerTLS, certificate_peer_id, init_certs, issue_peer_certificate, load_ca,
                                make_csr, peer_dns_name, peer_uri)
from shoal.common.errors import InvalidArgument
from shoal.common.identity import load_or_create_key, peer_id_of, public_bytes
from shoal.common.security import Security, open_channel, push_metadata, signing_interceptors
from shoal.coordinator.ca import CertificateAuthority
from shoal.peer.certificates import renew_delay, retry_delay
from shoal.peer.dataplane import Inbox, PeerService, Transport, channel_options, serve_data_plane
from shoal.v1 import shoal_pb2 as pb
from shoal.v1 import shoal_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(60)
UTC = datetime.timezone.utc


@pytest.fixture(scope="module")
def tls_dir(tmp_path_factory):
    return init_certs(tmp_path_factory.mktemp("tls")).dir


@pytest.fixture(scope="module")
def ca(tls_dir) -> CertificateAuthority:
    return CertificateAuthority.from_dir(tls_dir, lifetime_s=3600)


def _identity(tmp_path, name: str):
    key = load_or_create_key(tmp_path / f"{name}.key")
    return key, peer_id_of(public_bytes(key))


def _issued(ca: CertificateAuthority, peer_id: str) -> PeerTLS:
    tls = PeerTLS(peer_id)
    issued = ca.issue(peer_id, tls.csr())
    tls.install(issued.certificate, issued.ca)
    return tls


# ------------------------------------------------------------------ issuing (pure)


def test_issued_certificate_names_the_authenticated_peer_id_only(ca):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime(2026, 1, 1, tzinfo=UTC)
    # The request asks for another name: the certificate names the id the coordinator authenticated.
    cert = issue_peer_certificate(ca.key, ca.cert, make_csr(key, "someone-else"), "ab" * 16,
                                  datetime.timedelta(hours=2), now)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == [peer_dns_name("ab" * 16)] == ["ab" * 16 + ".peer.shoal"]
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [peer_uri("ab" * 16)]
    assert san.get_values_for_type(x509.IPAddress) == []  # never an address
    assert certificate_peer_id(cert) == "ab" * 16
    assert set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == {
        ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert cert.not_valid_after_utc == now + datetime.timedelta(hours=2)
    assert cert.not_valid_before_utc < now
    cert.verify_directly_issued_by(ca.cert)
    assert cert.public_key().public_numbers() == key.public_key().public_numbers()


def test_bad_requests_are_refused(ca):
    with pytest.raises(InvalidArgument, match="tls_csr"):
        ca.issue("ab" * 16, b"not a csr")
    # A request signed by another key than the one it carries: no proof of possession.
    key, other = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    csr = x509.load_der_x509_csr(make_csr(key, "x"))
    forged = (x509.CertificateSigningRequestBuilder().subject_name(csr.subject).sign(other, hashes.SHA256()))
    der = bytearray(forged.public_bytes(serialization.Encoding.DER))
    der[-5] ^= 0xFF  # break the signature
    with pytest.raises(InvalidArgument, match="tls_csr"):
        ca.issue("ab" * 16, bytes(der))
    # Not P-256.
    p384 = ec.generate_private_key(ec.SECP384R1())
    csr384 = x509.CertificateSigningRequestBuilder().subject_name(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "x")])).sign(p384, hashes.SHA256())
    with pytest.raises(InvalidArgument, match="P-256"):
        ca.issue("ab" * 16, csr384.public_bytes(serialization.Encoding.DER))


def test_a_peer_installs_only_its_own_certificate(ca, tmp_path):
    mine, theirs = PeerTLS("aa" * 16), PeerTLS("bb" * 16)
    assert not mine.issued
    with pytest.raises(RuntimeError):
        mine.channel_credentials()  # nobody dials before the first certificate
    other_key = ca.issue("aa" * 16, theirs.csr())  # right id, another key
    with pytest.raises(ValueError, match="key"):
        mine.install(other_key.certificate, other_key.ca)
    other_id = ca.issue("bb" * 16, mine.csr())  # this key, another id
    with pytest.raises(ValueError, match="names"):
        mine.install(other_id.certificate, other_id.ca)
    foreign = CertificateAuthority.from_dir(init_certs(tmp_path / "foreign").dir)
    good = ca.issue("aa" * 16, mine.csr())
    with pytest.raises(ValueError, match="CA"):
        mine.install(good.certificate, foreign.ca_pem)
    assert not mine.issued
    mine.install(good.certificate, good.ca)
    assert mine.issued and mine.generation == 1 and mine.not_after.timestamp() == pytest.approx(good.not_after)


def test_renewal_schedule():
    t0 = datetime.datetime(2026, 1, 1, tzinfo=UTC)
    t1 = t0 + datetime.timedelta(hours=3)
    assert renew_delay(t0, t1, t0) == pytest.approx(2 * 3600)  # two thirds of the life it arrived with
    assert renew_delay(t0, t1, t0 + datetime.timedelta(hours=2, minutes=30)) == 0.0
    assert retry_delay(t1, t0) == 60.0  # at most a minute
    assert retry_delay(t1, t1 - datetime.timedelta(seconds=20)) == 5.0  # at least 5 s


def test_certs_init_writes_no_shared_peer_key(tmp_path):
    out = subprocess.run([sys.executable, "-m", "shoal.cli", "certs", "init", "--out", str(tmp_path / "d")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["ca.key", "ca.pem", "coordinator.key",
                                                                 "coordinator.pem"]
    assert "peer.key" not in out.stdout


def test_coordinator_without_ca_key_issues_nothing(tmp_path):
    d = init_certs(tmp_path / "d").dir
    (d / "ca.key").unlink()
    assert CertificateAuthority.from_dir(d) is None
    assert load_ca(d) is None


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


# ------------------------------------------------------------------ over the control plane, a real coordinator


@pytest.mark.integration
@pytest.mark.timeout(300)
async def test_join_issues_and_renew_reissues_for_members_only(procs, tls_dir, tmp_path):
    _, addr = procs.coordinator("--tls-dir", str(tls_dir), "--cert-lifetime", "600", "--rounds", "1")
    sec = Security(tls_dir=ca_dir(CertificateAuthority.from_dir(tls_dir), tmp_path))
    key, pid = _identity(tmp_path, "m")
    stranger, stranger_id = _identity(tmp_path, "s")
    tls = PeerTLS(pid)
    async with open_channel(addr, sec, channel_options(), signing_interceptors(key)) as ch, \
            open_channel(addr, sec, channel_options(), signing_interceptors(stranger)) as sch:
        stub = pb_grpc.CoordinatorStub(ch)
        resp = await stub.Join(pb.JoinRequest(public_key=public_bytes(key), data_address="127.0.0.1:9",
                                              num_samples=1, tls_csr=tls.csr()), timeout=10)
        tls.install(resp.tls_certificate, resp.tls_ca)
        first = x509.load_pem_x509_certificate(resp.tls_certificate)
        assert certificate_peer_id(first) == pid
        assert 590 <= resp.tls_not_after - first.not_valid_before_utc.timestamp() - 300 <= 610
        renewed = await stub.RenewCertificate(pb.RenewCertificateRequest(peer_id=pid, tls_csr=tls.csr()), timeout=10)
        second = x509.load_pem_x509_certificate(renewed.tls_certificate)
        assert certificate_peer_id(second) == pid and second.serial_number != first.serial_number
        tls.install(renewed.tls_certificate, renewed.tls_ca)
        with pytest.raises(grpc.aio.AioRpcError) as err:  # a bad request
            await stub.RenewCertificate(pb.RenewCertificateRequest(peer_id=pid, tls_csr=b"junk"), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as err:  # a Join with a bad CSR is refused before it counts
            await pb_grpc.CoordinatorStub(sch).Join(pb.JoinRequest(
                public_key=public_bytes(stranger), data_address="127.0.0.1:9", num_samples=1, tls_csr=b"junk"),
                timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as err:  # not a member (that join did not count): no certificate
            await pb_grpc.CoordinatorStub(sch).RenewCertificate(
                pb.RenewCertificateRequest(peer_id=stranger_id, tls_csr=PeerTLS(stranger_id).csr()), timeout=10)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as err:  # nor for a member's id, signed by another key
            await pb_grpc.CoordinatorStub(sch).RenewCertificate(
                pb.RenewCertificateRequest(peer_id=pid, tls_csr=tls.csr()), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


class _Ctx:
    def __init__(self, peer: str):
        self._peer = peer

    def peer(self) -> str:
        return self._peer


def test_a_wildcard_address_becomes_the_address_the_coordinator_sees():
    from shoal.coordinator.server import advertised_address
    assert advertised_address("0.0.0.0:7071", _Ctx("ipv4:192.0.2.9:40000")) == "192.0.2.9:7071"
    assert advertised_address("[::]:7071", _Ctx("ipv6:[2001:db8::1]:40000")) == "[2001:db8::1]:7071"
    assert advertised_address("my.host:7071", _Ctx("ipv4:192.0.2.9:40000")) == "my.host:7071"  # as advertised
    assert advertised_address("0.0.0.0:7071", _Ctx("unix:/tmp/s")) == "0.0.0.0:7071"


@pytest.mark.integration
@pytest.mark.soak  # default-run budget (10 min): a minutes-class process run; the outbound-only TLS swarm keeps issued certificates in the default run
@pytest.mark.timeout(660)
def test_swarm_tls_with_certificates_issued_and_renewed_at_join(tmp_path):
    """`shoal swarm --tls`: the volunteers' directory holds ca.pem only, every peer gets its
    certificate at join; with 10 s certificates they are renewed while the rounds go on."""
    import json
    import os
    summary, wd = tmp_path / "s.json", tmp_path / "wd"
    env = {**os.environ, "SHOAL_COORDINATOR_CERT_LIFETIME": "10"}
    proc = subprocess.run(
        [sys.executable, "-m", "shoal.cli", "swarm", "--tls", "--peers", "3", "--rounds", "150", "--summary",
         str(summary), "--no-progress", "--workdir", str(wd)], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads(summary.read_text())
    assert s["rounds_committed"] == 150 and s["digest_mismatches"] == 0 and s["peers"] == 3
    assert sorted(p.name for p in (wd / "tls-peer").iterdir()) == ["ca.pem"]
    assert not (wd / "tls" / "peer.key").exists()
    for i in range(3):
        log = (wd / f"peer-{i}.log").read_text()
        assert "data-plane certificate issued for" in log, log[-2000:]
        assert "data-plane certificate renewed" in log, log[-2000:]
