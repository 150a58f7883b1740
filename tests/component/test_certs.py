"""TLS material: files and modes, certificate contents, and real grpc.aio handshakes (TLS, mTLS,
refusals) against the standard health service. The mTLS handshakes here use a legacy directory with
the shared peer.pem (still supported for one release); certificates issued at join are in
tests/component/test_peer_certificates.py."""

from __future__ import annotations

import ipaddress
from collections.abc import AsyncIterator

import grpc
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kits.legacy_tls import legacy_certs
from shoal.common.certs import CertPaths, channel_credentials, init_certs, server_credentials

RPC_TIMEOUT_S = 5.0
pytestmark = pytest.mark.timeout(30)


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> CertPaths:
    return legacy_certs(tmp_path_factory.mktemp("tls"))


def test_init_writes_no_shared_peer_key(tmp_path):
    paths = init_certs(tmp_path / "d")
    assert sorted(p.name for p in paths.dir.iterdir()) == ["ca.key", "ca.pem", "coordinator.key", "coordinator.pem"]
    for p in (paths.ca_key, paths.coordinator_key):
        assert p.stat().st_mode & 0o777 == 0o600, p
    for p in (paths.ca_cert, paths.coordinator_cert):
        assert p.read_bytes().startswith(b"-----BEGIN CERTIFICATE-----")


def test_certificate_contents(tls):
    ca = x509.load_pem_x509_certificate(tls.ca_cert.read_bytes())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for path, usages in (
        (tls.coordinator_cert, {ExtendedKeyUsageOID.SERVER_AUTH}),
        (tls.dir / "peer.pem", {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}),
    ):
        cert = x509.load_pem_x509_certificate(path.read_bytes())
        assert cert.issuer == ca.subject
        cert.verify_directly_issued_by(ca)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
        assert san.get_values_for_type(x509.DNSName) == ["localhost"]
        assert set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == usages


def test_init_refuses_to_overwrite(tls):
    with pytest.raises(FileExistsError):
        init_certs(tls.dir)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError):
        init_certs(tmp_path, hosts=())
    with pytest.raises(ValueError):
        server_credentials(
            tmp_path, role="operator", require_client_auth=False  # type: ignore[arg-type]
        )
    with pytest.raises(FileNotFoundError, match="ca.pem"):
        channel_credentials(tmp_path, client_cert=False)


async def serve(creds: grpc.ServerCredentials) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", creds)
    await server.start()
    return server, port


@pytest.fixture
async def mtls_server(tls) -> AsyncIterator[int]:
    server, port = await serve(server_credentials(tls.dir, role="peer", require_client_auth=True))
    try:
        yield port
    finally:
        await server.stop(grace=None)


async def check(channel: grpc.aio.Channel) -> health_pb2.HealthCheckResponse:
    stub = health_pb2_grpc.HealthStub(channel)
    return await stub.Check(health_pb2.HealthCheckRequest(), timeout=RPC_TIMEOUT_S)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
async def test_tls_coordinator_answers_client_without_cert(tls, host):
    creds = server_credentials(tls.dir, role="coordinator", require_client_auth=False)
    server, port = await serve(creds)
    client = channel_credentials(tls.dir, client_cert=False)
    try:
        async with grpc.aio.secure_channel(f"{host}:{port}", client) as ch:
            resp = await check(ch)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(grace=None)


async def test_mtls_answers_client_with_cert(tls, mtls_server):
    async with grpc.aio.secure_channel(
        f"127.0.0.1:{mtls_server}", channel_credentials(tls.dir, client_cert=True)
    ) as ch:
        assert (await check(ch)).status == health_pb2.HealthCheckResponse.SERVING


async def test_mtls_refuses_client_without_cert(tls, mtls_server):
    async with grpc.aio.secure_channel(
        f"127.0.0.1:{mtls_server}", channel_credentials(tls.dir, client_cert=False)
    ) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await check(ch)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_plaintext_client_fails_against_tls_server(mtls_server):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{mtls_server}") as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await check(ch)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_client_trusting_another_ca_fails(tmp_path, mtls_server):
    other = legacy_certs(tmp_path / "other")
    async with grpc.aio.secure_channel(
        f"127.0.0.1:{mtls_server}", channel_credentials(other.dir, client_cert=True)
    ) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await check(ch)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_server_refuses_client_cert_from_another_ca(tls, tmp_path, mtls_server):
    # A client that trusts our CA but presents a certificate from a foreign CA.
    other = legacy_certs(tmp_path / "other")
    creds = grpc.ssl_channel_credentials(
        root_certificates=tls.ca_cert.read_bytes(),
        private_key=(other.dir / "peer.key").read_bytes(),
        certificate_chain=(other.dir / "peer.pem").read_bytes(),
    )
    async with grpc.aio.secure_channel(f"127.0.0.1:{mtls_server}", creds) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await check(ch)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_wrong_hostname_fails(tls, mtls_server):
    # The certificate names 127.0.0.1 and localhost only.
    async with grpc.aio.secure_channel(
        f"127.0.0.1:{mtls_server}",
        channel_credentials(tls.dir, client_cert=True),
        options=[("grpc.ssl_target_name_override", "example.com")],
    ) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await check(ch)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
