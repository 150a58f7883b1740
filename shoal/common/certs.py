"""TLS material for both planes: the operator's CA and coordinator certificate, and the
data-plane certificates the coordinator issues to peers at join.

Who holds what (docs/security.md, "Trust model"):

    ca.pem           CA certificate. Volunteers receive it (with a join token): it authenticates
                     the coordinator. The coordinator also sends it in JoinResponse.tls_ca, and it
                     is the data plane's trust root.
    ca.key           CA private key: the coordinator's alone (it signs peer certificates at join);
                     never handed to a volunteer.
    coordinator.pem  coordinator server certificate (serverAuth) for the names peers dial, or one
    coordinator.key  from a public CA (then ca.pem given to volunteers is that CA's root).

A peer makes a fresh P-256 key at start (`PeerTLS`, in memory only, never written), sends a
certificate signing request for it inside its signed Join, and gets back a short-lived
certificate whose subjectAltNames are its peer id only: DNS `<id>.peer.shoal` and URI
`shoal://peer/<id>` (`issue_peer_certificate`). Data-plane clients verify a server by the peer
id the plan names (`grpc.ssl_target_name_override`), never by its address; data-plane servers
demand a client certificate and check it names the sender of the stream.

Older directories also hold `peer.pem`/`peer.key`, one key shared by every peer and valid for
a fixed list of host names (`legacy_peer_key`): they keep working for this release with a
warning, when the coordinator issues no certificate.

Keys are ECDSA P-256 (the safest choice across gRPC/BoringSSL builds); private keys written to
disk get mode 0600. Peer identity itself is the Ed25519 key (`shoal.common.identity`);
admission is `shoal.coordinator.admission`.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import logging
import os
import pathlib
import ssl
import threading
from collections.abc import Sequence
from typing import Literal

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

log = logging.getLogger("shoal.certs")

CA_CERT = "ca.pem"
CA_KEY = "ca.key"
COORDINATOR_CERT = "coordinator.pem"
COORDINATOR_KEY = "coordinator.key"
LEGACY_PEER_CERT = "peer.pem"  # the shared peer key of directories made before issued certificates
LEGACY_PEER_KEY = "peer.key"
PEER_DNS_SUFFIX = "peer.shoal"
PEER_URI_PREFIX = "shoal://peer/"
# Issued certificates start this long before the moment they are issued: clocks of peers and
# coordinator may disagree (signed calls tolerate 30 s; this is looser, it harms nothing).
ISSUE_BACKDATE = datetime.timedelta(minutes=5)


def peer_dns_name(peer_id: str) -> str:
    """The DNS subjectAltName of `peer_id`'s certificate (`<id>.peer.shoal`): the name a data-plane
    client expects from a server (`grpc.ssl_target_name_override`)."""
    return f"{peer_id}.{PEER_DNS_SUFFIX}"


def peer_uri(peer_id: str) -> str:
    """The URI subjectAltName of `peer_id`'s certificate (`shoal://peer/<id>`)."""
    return PEER_URI_PREFIX + peer_id


@dataclasses.dataclass(frozen=True)
class CertPaths:
    """Paths of the files written by `init_certs`."""

    dir: pathlib.Path
    ca_cert: pathlib.Path
    ca_key: pathlib.Path
    coordinator_cert: pathlib.Path
    coordinator_key: pathlib.Path


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


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _san(hosts: Sequence[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return x509.SubjectAlternativeName(names)


def _leaf_builder(
    issuer: x509.Name, ca_key: ec.EllipticCurvePrivateKey, public_key, common_name: str,
    san: x509.SubjectAlternativeName, usages: list[x509.ObjectIdentifier],
    not_before: datetime.datetime, not_after: datetime.datetime,
) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(issuer)
        .public_key(public_key)
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
        .add_extension(san, critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )


def init_certs(
    out_dir: str | os.PathLike[str],
    *,
    hosts: Sequence[str] = ("127.0.0.1", "localhost"),
    days: int = 365,
    overwrite: bool = False,
) -> CertPaths:
    """Create the CA and the coordinator's certificate in `out_dir` (created if needed).

    No peer certificate is made: the coordinator issues one to each peer at join (module
    docstring). `hosts` become subjectAltName entries of the coordinator certificate (IP
    literals as IP entries, anything else as DNS names): the names peers dial the coordinator
    by. Certificates are valid from one hour ago (tolerating clock skew) for `days` days.

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
    paths = CertPaths(dir=d, ca_cert=d / CA_CERT, ca_key=d / CA_KEY,
                      coordinator_cert=d / COORDINATOR_CERT, coordinator_key=d / COORDINATOR_KEY)
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
    coord_key = ec.generate_private_key(ec.SECP256R1())
    coord_cert = _leaf_builder(
        ca_name, ca_key, coord_key.public_key(), "shoal-coordinator", _san(hosts),
        [ExtendedKeyUsageOID.SERVER_AUTH], not_before, not_after,
    ).sign(ca_key, hashes.SHA256())

    _write_private(paths.ca_key, _key_pem(ca_key))
    _write_private(paths.coordinator_key, _key_pem(coord_key))
    paths.ca_cert.write_bytes(_pem(ca_cert))
    paths.coordinator_cert.write_bytes(_pem(coord_cert))
    return paths


# ------------------------------------------------------------------ issuing peer certificates


def make_csr(key: ec.EllipticCurvePrivateKey, peer_id: str) -> bytes:
    """A DER certificate signing request for `key`, naming `peer_id` (the coordinator ignores the
    names asked for and writes the id it authenticated; the request proves possession of `key`)."""
    return (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, peer_id)]))
        .sign(key, hashes.SHA256())
        .public_bytes(serialization.Encoding.DER)
    )


def issue_peer_certificate(
    ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, csr_der: bytes, peer_id: str,
    lifetime: datetime.timedelta, now: datetime.datetime | None = None,
) -> x509.Certificate:
    """Sign a data-plane certificate for `peer_id` over the key of `csr_der`.

    The certificate names `peer_id` only (CN, DNS `<id>.peer.shoal`, URI `shoal://peer/<id>`),
    serves as server and client (serverAuth, clientAuth), and is valid from `now` minus
    ISSUE_BACKDATE to `now + lifetime`, capped at the CA's own expiry. `peer_id` must be the
    identity the caller authenticated (the signer of the Join or renewal), never a name read
    from the request.

    Raises:
        ValueError: `csr_der` is not a DER CSR, its signature does not verify (no proof of
            possession), or its key is not an elliptic-curve P-256 key.
    """
    try:
        csr = x509.load_der_x509_csr(csr_der)
    except ValueError as exc:
        raise ValueError(f"not a DER certificate signing request ({exc})") from None
    try:
        ok = csr.is_signature_valid
    except (InvalidSignature, ValueError):
        ok = False
    if not ok:
        raise ValueError("its signature does not verify")
    key = csr.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != "secp256r1":
        raise ValueError("the key must be ECDSA P-256")
    now = now or datetime.datetime.now(datetime.timezone.utc)
    not_after = min(now + lifetime, ca_cert.not_valid_after_utc)
    san = x509.SubjectAlternativeName([x509.DNSName(peer_dns_name(peer_id)),
                                       x509.UniformResourceIdentifier(peer_uri(peer_id))])
    return _leaf_builder(
        ca_cert.subject, ca_key, key, peer_id, san,
        [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH], now - ISSUE_BACKDATE, not_after,
    ).sign(ca_key, hashes.SHA256())


def certificate_peer_id(cert: x509.Certificate) -> str:
    """The peer id an issued certificate names (its `shoal://peer/<id>` URI), "" if none."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return ""
    ids = [u[len(PEER_URI_PREFIX):] for u in san.get_values_for_type(x509.UniformResourceIdentifier)
           if u.startswith(PEER_URI_PREFIX)]
    return ids[0] if len(ids) == 1 else ""


def load_ca(tls_dir: str | os.PathLike[str]) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate] | None:
    """The CA key and certificate of `tls_dir`, or None when it holds no `ca.key` (a coordinator
    whose certificate comes from elsewhere issues no peer certificates).

    Raises:
        FileNotFoundError: `ca.key` exists but `ca.pem` does not.
        ValueError: a file does not parse, the key is not an EC key, or it does not match the
            certificate.
    """
    d = pathlib.Path(tls_dir)
    if not (d / CA_KEY).exists():
        return None
    key = serialization.load_pem_private_key(_read(d, CA_KEY), password=None)
    cert = x509.load_pem_x509_certificate(_read(d, CA_CERT))
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{d / CA_KEY}: not an EC private key")
    if key.public_key().public_numbers() != cert.public_key().public_numbers():
        raise ValueError(f"{d / CA_KEY} does not match {d / CA_CERT}")
    return key, cert


# ------------------------------------------------------------------ a peer's own TLS material


class PeerTLS:
    """One peer process's data-plane TLS material: a P-256 key made at start (never written to
    disk), the certificate the coordinator issued for it, and the CA that signs peer certificates.

    Before the first certificate is installed the server presents a self-signed placeholder that
    no peer trusts, and trusts only it (so nothing is accepted: nobody dials a peer before a plan
    names it anyway). `install` swaps in an issued certificate; the data-plane server picks it up
    at its next handshake (`server_credentials`), new client channels use it
    (`channel_credentials`, `generation` says when to replace cached channels). Thread-safe:
    gRPC's certificate fetcher runs on its own threads.
    """

    def __init__(self, peer_id: str):
        self.peer_id = peer_id
        self.key = ec.generate_private_key(ec.SECP256R1())
        self._lock = threading.Lock()
        now = datetime.datetime.now(datetime.timezone.utc)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{peer_id} (not yet issued)")])
        placeholder = _leaf_builder(
            name, self.key, self.key.public_key(), peer_id, x509.SubjectAlternativeName([x509.DNSName("unissued.invalid")]),
            [ExtendedKeyUsageOID.SERVER_AUTH], now - ISSUE_BACKDATE, now + datetime.timedelta(days=1),
        ).sign(self.key, hashes.SHA256())
        self._key_pem = _key_pem(self.key)
        self._cert_pem = _pem(placeholder)
        self._ca_pem = self._cert_pem
        self.installed_at: datetime.datetime | None = None  # when the issued certificate arrived
        self.not_after: datetime.datetime | None = None  # and when it expires
        self.generation = 0  # bumped by every install
        self._config = grpc.ssl_server_certificate_configuration([(self._key_pem, self._cert_pem)], self._ca_pem)
        self._fetched = -1
        self._ssl: dict[bool, tuple[int, ssl.SSLContext]] = {}  # server side? -> (generation, context)

    @property
    def issued(self) -> bool:
        return self.generation > 0

    def csr(self) -> bytes:
        """A DER signing request for this process's key (sent in Join and RenewCertificate)."""
        return make_csr(self.key, self.peer_id)

    def install(self, cert_pem: bytes, ca_pem: bytes) -> None:
        """Use `cert_pem` (issued for this key and this peer id, signed by `ca_pem`) from now on.

        Raises:
            ValueError: the certificate does not parse, is not for this key, names another peer
                id, or does not verify against `ca_pem` (a coordinator bug or a mix-up; the
                previous certificate stays in use).
        """
        cert = x509.load_pem_x509_certificate(cert_pem)
        if cert.public_key().public_numbers() != self.key.public_key().public_numbers():
            raise ValueError("issued certificate: not for this process's TLS key")
        if certificate_peer_id(cert) != self.peer_id:
            raise ValueError(f"issued certificate: names {certificate_peer_id(cert)[:8]!r}, not {self.peer_id[:8]}")
        cas = x509.load_pem_x509_certificates(ca_pem)
        if not any(_issued_by(cert, ca) for ca in cas):
            raise ValueError("issued certificate: not signed by the CA the coordinator named")
        with self._lock:
            self._cert_pem, self._ca_pem = cert_pem, ca_pem
            # Its life here counts from now (not_before is backdated for clock skew).
            self.installed_at = datetime.datetime.now(datetime.timezone.utc)
            self.not_after = cert.not_valid_after_utc
            self.generation += 1
            self._config = grpc.ssl_server_certificate_configuration([(self._key_pem, cert_pem)], ca_pem)

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        with self._lock:
            if self._fetched == self.generation:
                return None  # unchanged
            self._fetched = self.generation
            return self._config

    def server_credentials(self) -> grpc.ServerCredentials:
        """Data-plane server credentials that always present the newest installed certificate
        and demand a client certificate signed by the peer CA (mutual TLS)."""
        with self._lock:
            initial = self._config
        return grpc.dynamic_ssl_server_credentials(initial, self._fetch, require_client_authentication=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Client credentials presenting the current certificate and trusting the peer CA only.

        Raises:
            RuntimeError: no certificate was installed yet (a peer dials others only once it joined).
        """
        with self._lock:
            if not self.issued:
                raise RuntimeError("data plane: no certificate issued yet (join first)")
            return grpc.ssl_channel_credentials(root_certificates=self._ca_pem, private_key=self._key_pem,
                                                certificate_chain=self._cert_pem)

    def ssl_context(self, *, server: bool) -> ssl.SSLContext:
        """An `ssl` context for the bulk lane (peer.lanes.bulk) with the current certificate: mutual
        TLS 1.3 trusting the peer CA only. The server side demands a client certificate; the
        client side checks the server's name, which the caller sets to `peer_dns_name(id)` of
        the peer the plan names (`server_hostname`). The same trust as `server_credentials` /
        `channel_credentials`; one context per certificate generation, cached.

        The key is handed to OpenSSL through an anonymous in-memory file (`memfd`), never a path
        on disk (`ssl` loads certificate chains from paths only).

        Raises:
            RuntimeError: no certificate was installed yet.
            OSError: no memfd on this platform (callers then keep tensor bytes on TLS gRPC).
        """
        with self._lock:
            if not self.issued:
                raise RuntimeError("data plane: no certificate issued yet (join first)")
            cached = self._ssl.get(server)
            if cached is not None and cached[0] == self.generation:
                return cached[1]
            generation, key_pem, cert_pem, ca_pem = self.generation, self._key_pem, self._cert_pem, self._ca_pem
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cadata=ca_pem.decode())
        if server:
            ctx.num_tickets = 0  # no resumption; and nothing arrives unasked between streams (peer.lanes.bulk `alive`)
        fd = os.memfd_create("shoal-peer-tls", os.MFD_CLOEXEC)
        try:
            os.write(fd, key_pem + cert_pem)
            ctx.load_cert_chain(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)
        with self._lock:
            self._ssl[server] = (generation, ctx)
        return ctx


def _issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
        return True
    except (ValueError, TypeError, InvalidSignature):
        return False


# ------------------------------------------------------------------ credentials from a directory


def _read(tls_dir: pathlib.Path, name: str) -> bytes:
    p = tls_dir / name
    try:
        return p.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"{p}: missing TLS file (create the directory with `shoal certs init`)") from None


def legacy_peer_key(tls_dir: str | os.PathLike[str] | None) -> bool:
    """Whether `tls_dir` holds the shared `peer.key` of directories made before certificates were
    issued at join (deprecated: every holder can impersonate every other peer)."""
    d = pathlib.Path(tls_dir) if tls_dir else None
    return d is not None and (d / LEGACY_PEER_KEY).exists() and (d / LEGACY_PEER_CERT).exists()


def server_credentials(
    tls_dir: str | os.PathLike[str],
    *,
    role: Literal["coordinator", "peer"],
    require_client_auth: bool,
) -> grpc.ServerCredentials:
    """Server credentials for `role` from the TLS directory `tls_dir` (role "peer": the shared
    legacy `peer.pem`; issued certificates come from `PeerTLS.server_credentials`).

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
    presenting the legacy shared `peer.pem` / `peer.key` (against a server that requires client
    auth and predates issued certificates).

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
        private_key=_read(d, LEGACY_PEER_KEY),
        certificate_chain=_read(d, LEGACY_PEER_CERT),
    )
