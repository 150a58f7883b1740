"""`shoal swarm --tls`: the coordinator's certificate names every address the peers dial it by,
the bed's root address included when the swarm runs in network namespaces (it named only
127.0.0.1 and localhost, so every peer of a TLS swarm in namespaces failed the handshake)."""

from __future__ import annotations

import ipaddress
import types

from cryptography import x509

from shoal.common.certs import COORDINATOR_CERT
from shoal.testbeds.swarm import Swarm, SwarmOptions


def _sans(path) -> set[str]:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return {str(v) for v in ext.get_values_for_type(x509.IPAddress)} | set(ext.get_values_for_type(x509.DNSName))


def test_the_coordinator_certificate_names_the_bed_address(tmp_path):
    swarm = Swarm(SwarmOptions(peers=2, tls=True), tmp_path)
    swarm.bed = types.SimpleNamespace(root_ip="10.213.0.254")  # what NetBed exposes; no namespace needed here
    swarm.secure()
    sans = _sans(tmp_path / "tls" / COORDINATOR_CERT)
    assert {"127.0.0.1", "localhost", str(ipaddress.ip_address("10.213.0.254"))} <= sans


def test_without_a_bed_the_certificate_names_loopback(tmp_path):
    swarm = Swarm(SwarmOptions(peers=2, tls=True), tmp_path)
    swarm.secure()
    assert _sans(tmp_path / "tls" / COORDINATOR_CERT) == {"127.0.0.1", "localhost"}
