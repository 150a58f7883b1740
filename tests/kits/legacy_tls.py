"""A TLS directory as `shoal certs init` made it before certificates were issued at join: the CA
and coordinator certificate plus one shared peer.pem/peer.key, valid for fixed host names.
Such directories keep working for one release (with a warning); tests make them with this."""

from __future__ import annotations

import datetime
import ipaddress
import os
import pathlib

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from shoal.common.certs import CertPaths, init_certs, load_ca


def add_legacy_peer_cert(tls_dir: pathlib.Path, hosts=("127.0.0.1", "localhost")) -> tuple[pathlib.Path, pathlib.Path]:
    """Write the shared peer.pem/peer.key (serverAuth + clientAuth for `hosts`) signed by the
    directory's CA; returns (peer.pem, peer.key)."""
    ca_key, ca_cert = load_ca(tls_dir)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    names = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "shoal-peer")]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem, keyp = tls_dir / "peer.pem", tls_dir / "peer.key"
    pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    fd = os.open(keyp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    return pem, keyp


def legacy_certs(out_dir: pathlib.Path) -> CertPaths:
    """`init_certs` plus the shared peer certificate: an old directory."""
    paths = init_certs(out_dir)
    add_legacy_peer_cert(paths.dir)
    return paths
