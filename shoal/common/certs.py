"""TLS material for both planes: a private CA, a coordinator certificate and a peer certificate.

`init_certs` writes a self-contained directory (the layout below) for a test cluster or a
small deployment; `server_credentials` and `channel_credentials` turn such a directory into
gRPC credentials. Keys are ECDSA P-256 (the safest choice across gRPC/BoringSSL builds) and
private keys are written with mode 0600.

Layout of a TLS directory (all PEM):

    ca.pem           CA certificate: the trust root every client and mTLS server loads
    ca.key           CA private key (keep offline in production; needed only to issue certs)
    coordinator.pem  coordinator server certificate (serverAuth)
    coordinator.key
    peer.pem         peer certificate, usable as server and as client (serverAuth, clientAuth)
    peer.key

This module does not authenticate *who* a peer is beyond "holds a certificate from this CA";
peer identity is the Ed25519 key (`shoal.common.identity`), admission is `shoal.coordinator.admission`.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import os
import pathlib
from collections.abc import Sequence
from typing import Literal

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_CERT = "ca.pem"
CA_KEY = "ca.key"


@dataclasses.dataclass(frozen=True)
class CertPaths:
    """Paths of the files written by `init_certs`."""

    dir: pathlib.Path
    ca_cert: pathlib.Path
    ca_key: pathlib.Path
    coordinator_cert: pathlib.Path
    coordinator_key: pathlib.Path
    peer_cert: pathlib.Path
    peer_key: pathlib.Path


def _write_private(path: pathlib.Path, data: bytes) -> None:
    # Created 0600 from the start so the key is never readable by others, even briefly.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)  # O_CREAT does not change the mode of an existing file


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _san(hosts: Sequence[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return x509.SubjectAlternativeName(names)


def _leaf(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    common_name: str,
    hosts: Sequence[str],
    usages: list[x509.ObjectIdentifier],
    not_before: datetime.datetime,
    not_after: datetime.datetime,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=True, key_cert_sign=False,
                crl_sign=False, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(_san(hosts), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def init_certs(
    out_dir: str | os.PathLike[str],
    *,
    hosts: Sequence[str] = ("127.0.0.1", "localhost"),
    days: int = 365,
    overwrite: bool = False,
) -> CertPaths:
    """Create a CA and the coordinator and peer certificates in `out_dir` (created if needed).

    `hosts` become subjectAltName entries of both leaf certificates (IP literals as IP entries,
    anything else as DNS names); clients must dial one of them (or set the
    `grpc.ssl_target_name_override` channel option). Certificates are valid from one hour ago
    (tolerating clock skew) for `days` days.

    Raises:
        FileExistsError: `out_dir` already holds a CA key and `overwrite` is false (re-running
            would silently invalidate certificates already handed out).
        ValueError: `hosts` is empty or `days` < 1.
    """
    if not hosts:
        raise ValueError("hosts: at least one host is required")
    if days < 1:
        raise ValueError("days: must be >= 1")
    d = pathlib.Path(out_dir)
    paths = CertPaths(
        dir=d,
        ca_cert=d / CA_CERT,
        ca_key=d / CA_KEY,
        coordinator_cert=d / "coordinator.pem",
        coordinator_key=d / "coordinator.key",
        peer_cert=d / "peer.pem",
        peer_key=d / "peer.key",
    )
    if paths.ca_key.exists() and not overwrite:
        raise FileExistsError(f"{paths.ca_key}: TLS material already exists (pass overwrite=True)")
    d.mkdir(parents=True, exist_ok=True)

    now = datetime.datetime.now(datetime.timezone.utc)
    not_before = now - datetime.timedelta(hours=1)
    not_after = now + datetime.timedelta(days=days)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Shoal CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True,
                crl_sign=True, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    coord_key, coord_cert = _leaf(
        ca_key, ca_cert, "shoal-coordinator", hosts,
        [ExtendedKeyUsageOID.SERVER_AUTH], not_before, not_after,
    )
    peer_key, peer_cert = _leaf(
        ca_key, ca_cert, "shoal-peer", hosts,
        [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH], not_before, not_after,
    )

    _write_private(paths.ca_key, _key_pem(ca_key))
    _write_private(paths.coordinator_key, _key_pem(coord_key))
    _write_private(paths.peer_key, _key_pem(peer_key))
    paths.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    paths.coordinator_cert.write_bytes(coord_cert.public_bytes(serialization.Encoding.PEM))
    paths.peer_cert.write_bytes(peer_cert.public_bytes(serialization.Encoding.PEM))
    return paths


def _read(tls_dir: pathlib.Path, name: str) -> bytes:
    p = tls_dir / name
    try:
        return p.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"{p}: missing TLS file (create the directory with `shoal certs init`)") from None


def server_credentials(
    tls_dir: str | os.PathLike[str],
    *,
    role: Literal["coordinator", "peer"],
    require_client_auth: bool,
) -> grpc.ServerCredentials:
    """Server credentials for `role` from the TLS directory `tls_dir`.

    With `require_client_auth` the server demands a client certificate signed by `ca.pem`
    (mutual TLS) and the handshake fails for clients without one; otherwise any TLS client
    may connect. Use with `server.add_secure_port(address, creds)`.

    Raises:
        FileNotFoundError: a needed file (`<role>.pem`, `<role>.key`, `ca.pem`) is missing.
        ValueError: `role` is not "coordinator" or "peer".
    """
    if role not in ("coordinator", "peer"):
        raise ValueError(f"role: expected 'coordinator' or 'peer', got {role!r}")
    d = pathlib.Path(tls_dir)
    pair = (_read(d, f"{role}.key"), _read(d, f"{role}.pem"))
    root = _read(d, CA_CERT) if require_client_auth else None
    return grpc.ssl_server_credentials(
        [pair], root_certificates=root, require_client_auth=require_client_auth
    )


def channel_credentials(
    tls_dir: str | os.PathLike[str], *, client_cert: bool
) -> grpc.ChannelCredentials:
    """Channel credentials trusting only `ca.pem` in `tls_dir`; with `client_cert`, also
    presenting `peer.pem` / `peer.key` (needed against a server that requires client auth).

    Use with `grpc.aio.secure_channel(target, creds)`; `target`'s host must be one of the
    certificate's subjectAltNames.

    Raises:
        FileNotFoundError: `ca.pem`, or with `client_cert` `peer.pem` / `peer.key`, is missing.
    """
    d = pathlib.Path(tls_dir)
    root = _read(d, CA_CERT)
    if not client_cert:
        return grpc.ssl_channel_credentials(root_certificates=root)
    return grpc.ssl_channel_credentials(
        root_certificates=root,
        private_key=_read(d, "peer.key"),
        certificate_chain=_read(d, "peer.pem"),
    )
