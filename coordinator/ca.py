"""The coordinator's certificate authority: data-plane certificates for peers, issued at join and
renewed over the signed control plane.

The CA key (`ca.key` in the coordinator's `--tls-dir`, made by `shoal certs init`) never leaves
the coordinator. A peer sends a certificate signing request for a TLS key it made itself inside a
Join or RenewCertificate call that is signed by its Ed25519 identity; the coordinator answers
with a certificate that names the peer id it authenticated (the signer), valid for `lifetime`
(short: a leaked TLS key is worth little after it, and a member that stopped being one gets no
new certificate). Without a CA key (a coordinator certificate from a public CA and no `ca.key`)
`CertificateAuthority.from_dir` returns None and peers fall back to a legacy shared peer key.

Not here: who may join (coordinator.admission), the TLS of the coordinator's own port
(shoal.common.security), the certificate formats (shoal.common.certs).
"""

from __future__ import annotations

import dataclasses
import datetime
import os

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from shoal.common.certs import issue_peer_certificate, load_ca
from shoal.common.errors import InvalidArgument

DEFAULT_LIFETIME_S = 24 * 3600.0


@dataclasses.dataclass(frozen=True)
class Issued:
    """An issued certificate (PEM), the CA certificate that signed it (PEM), its expiry (unix s)."""

    certificate: bytes
    ca: bytes
    not_after: float


class CertificateAuthority:
    """Signs peers' data-plane certificates; `lifetime_s` (seconds) bounds each one."""

    def __init__(self, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate,
                 lifetime_s: float = DEFAULT_LIFETIME_S):
        if lifetime_s <= 0:
            raise ValueError("lifetime_s: must be > 0")
        self.key, self.cert, self.lifetime_s = key, cert, lifetime_s
        self.ca_pem = cert.public_bytes(serialization.Encoding.PEM)

    @classmethod
    def from_dir(cls, tls_dir: str | os.PathLike[str] | None,
                 lifetime_s: float = DEFAULT_LIFETIME_S) -> CertificateAuthority | None:
        """The CA of `tls_dir`, or None without a TLS directory or a `ca.key` in it.

        Raises:
            FileNotFoundError, ValueError: `ca.key` is there but unusable (see certs.load_ca).
        """
        if not tls_dir:
            return None
        pair = load_ca(tls_dir)
        return None if pair is None else cls(*pair, lifetime_s=lifetime_s)

    def issue(self, peer_id: str, csr_der: bytes, now: datetime.datetime | None = None) -> Issued:
        """A certificate for `peer_id` (the authenticated signer of the call) over the key of
        `csr_der`.

        Raises:
            InvalidArgument: the CSR is malformed, not self-signed by its key, or not P-256
                (field `tls_csr`); nothing is issued.
        """
        try:
            cert = issue_peer_certificate(self.key, self.cert, csr_der, peer_id,
                                          datetime.timedelta(seconds=self.lifetime_s), now)
        except ValueError as exc:
            raise InvalidArgument(f"tls_csr: {exc}") from None
        return Issued(cert.public_bytes(serialization.Encoding.PEM), self.ca_pem,
                      cert.not_valid_after_utc.timestamp())
