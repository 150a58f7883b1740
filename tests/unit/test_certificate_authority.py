"""Certificates issued at join: what the coordinator's CA signs, what a peer installs, and real
grpc.aio data-plane handshakes: a server is verified by its peer id whatever address is dialled,
and a client presenting another peer's certificate (or the legacy shared one, or none) is refused.
"""

from __future__ import annotations

import datetime

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from shoal.common.certs import (PeerTLS, certificate_peer_id, init_certs, issue_peer_certificate, load_ca,
                                make_csr, peer_dns_name, peer_uri)
from shoal.common.errors import InvalidArgument
from shoal.coordinator.ca import CertificateAuthority
from shoal.peer.certificates import renew_delay, retry_delay

pytestmark = pytest.mark.timeout(60)
UTC = datetime.timezone.utc


@pytest.fixture(scope="module")
def tls_dir(tmp_path_factory):
    return init_certs(tmp_path_factory.mktemp("tls")).dir


@pytest.fixture(scope="module")
def ca(tls_dir) -> CertificateAuthority:
    return CertificateAuthority.from_dir(tls_dir, lifetime_s=3600)


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


def test_coordinator_without_ca_key_issues_nothing(tmp_path):
    d = init_certs(tmp_path / "d").dir
    (d / "ca.key").unlink()
    assert CertificateAuthority.from_dir(d) is None
    assert load_ca(d) is None


# ------------------------------------------------------------------ over the control plane, a real coordinator


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
