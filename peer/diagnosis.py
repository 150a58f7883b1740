"""Why the coordinator cannot be reached, in one line a volunteer can act on.

`diagnose(exc)` turns a failed control-plane call into a `Diagnosis`: its kind (DNS failure,
connection refused, timeout, TLS handshake failure with the reason — unknown CA, a name the
certificate does not hold, an expired certificate — or admission refused), a one-line message and
the fix. gRPC reports all of these as UNAVAILABLE with a free-text detail, so the kind is read
from that text (the strings of grpcio's core and BoringSSL; anything unrecognised is kind
"other" with gRPC's own text). For a name mismatch, `certificate_names` fetches the server's
certificate (without trusting it, only to read it) so the message can list the names it holds.

`OutageLog` is what a peer logs while it cannot reach the coordinator: the first failure at
once, then one line every `every` seconds with the last error, and at the end a "gave up" line
repeating the most useful diagnosis seen (`CoordinatorUnreachable`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import ssl
import time
from collections.abc import Callable

import grpc
from cryptography import x509

from shoal.common.retry import REFUSED

log = logging.getLogger("shoal.peer.control")

REPORT_EVERY_SECONDS = 10.0
PROBE_SECONDS = 3.0

# Kinds, most useful first: a refusal or a TLS reason says exactly what to fix; a timeout says least.
RANKS = {"admission": 6, "tls": 5, "dns": 4, "refused": 3, "timeout": 2, "other": 1}

_FIXES = {
    "dns": "check the coordinator's host name (--coordinator) and this machine's DNS",
    "refused": "check the coordinator's address and port (--coordinator) and that the coordinator is running",
    "timeout": "check that the address is reachable from here (firewall, NAT, VPN) and the coordinator is running",
    "unknown-ca": "use the ca.pem of this coordinator's operator in --tls-dir",
    "name": "dial one of the names the certificate holds (--coordinator), or have the operator issue the "
            "coordinator's certificate for the name you dial (`shoal certs init --host NAME`)",
    "expired": "the operator must renew the coordinator's certificate (`shoal certs init`), or this machine's "
               "clock is wrong",
    "tls": "check --tls-dir (ca.pem of this coordinator) and that the coordinator runs with TLS",
    "plaintext": "the coordinator speaks plaintext: pass --insecure to the peer too (loopback only), or run the "
                 "coordinator with --tls-dir",
    "token": "ask the operator for a new join token (SHOAL_JOIN_TOKEN); a key admitted before rejoins without one "
             "unless its membership was revoked or unused for member_retention",
    "revoked": "the operator revoked this key; ask them, or join with a new key",
    "allow-list": "send the operator this peer's public key for the allow-list",
    "live": "stop the other process, or give this one its own key (--key FILE or --name NAME)",
    "fenced": "another process with this key took over while this one was silent; run one process per key",
    "other": "check the coordinator's address and --tls-dir/--insecure",
}


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """kind: admission | tls | dns | refused | timeout | other; reason: what went wrong (one
    line, without the coordinator's address); fix: what to do."""

    kind: str
    reason: str
    fix: str

    @property
    def rank(self) -> int:
        return RANKS[self.kind]

    def line(self) -> str:
        return f"{self.reason}; fix: {self.fix}"


class CoordinatorUnreachable(Exception):
    """The coordinator stayed unreachable for the whole bound. `str()` is the "gave up" line;
    `diagnosis` the most useful failure seen; the last gRPC error is `__cause__`."""

    def __init__(self, line: str, diagnosis: Diagnosis):
        super().__init__(line)
        self.diagnosis = diagnosis


def _split(target: str) -> tuple[str, int] | None:
    """(host, port) of a gRPC target: HOST:PORT, [V6]:PORT, ipv4:A:P,B:P (the first), dns:///H:P."""
    t = target
    for scheme in ("dns:///", "ipv4:", "ipv6:"):
        if t.startswith(scheme):
            t = t[len(scheme):]
    t = t.split(",", 1)[0]
    host, _, port = t.rpartition(":")
    if not port.isdigit() or not host:
        return None
    return host.strip("[]"), int(port)


def certificate_names(target: str, timeout: float = PROBE_SECONDS) -> list[str]:
    """The DNS names and addresses in the subject alternative names of the certificate the
    server at `target` presents (read, not trusted); [] when it cannot be fetched. Blocking."""
    hp = _split(target)
    if hp is None:
        return []
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    try:
        with socket.create_connection(hp, timeout=timeout) as sock, ctx.wrap_socket(sock) as tls:
            der = tls.getpeercert(binary_form=True)
        san = x509.load_der_x509_certificate(der).extensions.get_extension_for_class(
            x509.SubjectAlternativeName).value
    except (OSError, ValueError, x509.ExtensionNotFound):
        return []
    return [*san.get_values_for_type(x509.DNSName), *(str(a) for a in san.get_values_for_type(x509.IPAddress))]


def _dialled(target: str) -> str:
    hp = _split(target)
    return hp[0] if hp else target


def diagnose(exc: grpc.aio.AioRpcError, target: str, *,
             names: Callable[[str], list[str]] = certificate_names) -> Diagnosis:
    """What `exc` (a failed call to the coordinator at `target`) means, with the fix. `names`
    fetches the certificate's names for a name mismatch (blocking; pass a stub in tests)."""
    code, text = exc.code(), exc.details() or ""
    low = text.lower()
    if code in REFUSED:
        fix = ("live" if code == grpc.StatusCode.ALREADY_EXISTS else "fenced" if "took over" in low else
               "revoked" if "revoked" in low else "allow-list" if "allow-list" in low else "token")
        return Diagnosis("admission", f"refused this peer: {text}", _FIXES[fix])
    if code == grpc.StatusCode.DEADLINE_EXCEEDED or "timeout" in low or "timed out" in low:
        return Diagnosis("timeout", "timed out (no answer)", _FIXES["timeout"])
    if "resolv" in low or "dns" in low or "domain name not found" in low or "name or service not known" in low:
        return Diagnosis("dns", f"DNS lookup of {_dialled(target)!r} failed", _FIXES["dns"])
    if "connection refused" in low:
        return Diagnosis("refused", "connection refused (nothing listens there)",
                         _FIXES["refused"])
    if "hostname verification" in low or "peer name" in low or "mismatch" in low:
        held = names(target)
        holds = f"it holds {', '.join(held)}" if held else "its names could not be read"
        return Diagnosis("tls", f"TLS handshake failed: the certificate is not valid for "
                                f"{_dialled(target)!r} ({holds})", _FIXES["name"])
    if "expired" in low:
        return Diagnosis("tls", "TLS handshake failed: the coordinator's certificate has "
                                "expired", _FIXES["expired"])
    if "local issuer" in low or "self signed" in low or "self-signed" in low or "unknown ca" in low or \
            "certificate_verify_failed" in low:
        return Diagnosis("tls", "TLS handshake failed: certificate signed by an unknown CA "
                                "(not by --tls-dir's ca.pem)", _FIXES["unknown-ca"])
    if "wrong_version_number" in low or "wrong version number" in low or "http_request" in low or \
            "packet_length_too_long" in low:
        return Diagnosis("tls", "TLS handshake failed: the server does not speak TLS",
                         _FIXES["plaintext"])
    if "handshake" in low or "ssl" in low or "tls" in low:
        return Diagnosis("tls", f"TLS handshake failed: {text}", _FIXES["tls"])
    return Diagnosis("other", f"{code.name}: {text}", _FIXES["other"])


class OutageLog:
    """One line at the first failure, then at most one every `every` seconds (the last error),
    while the coordinator cannot be reached; `gave_up()` is the final line. Name-mismatch
    certificate fetches run in a thread, once per distinct error text."""

    def __init__(self, target: str, *, every: float = REPORT_EVERY_SECONDS, clock=time.monotonic):
        self.target, self.every, self.clock = target, every, clock
        self.started: float | None = None
        self.last_line: float | None = None
        self.best: Diagnosis | None = None
        self.last: Diagnosis | None = None
        self._cache: dict[str, Diagnosis] = {}

    async def failed(self, exc: grpc.aio.AioRpcError) -> Diagnosis:
        """Note a failed call; log its line when one is due. Returns its diagnosis."""
        key = f"{exc.code().name}:{exc.details()}"
        d = self._cache.get(key)
        if d is None:
            d = await asyncio.to_thread(diagnose, exc, self.target)
            self._cache[key] = d
        now = self.clock()
        if self.started is None:
            self.started = now
        self.last = d
        if self.best is None or d.rank >= self.best.rank:
            self.best = d
        if self.last_line is None or now - self.last_line >= self.every:
            self.last_line = now
            log.warning("cannot reach coordinator %s (for %.0f s): %s", self.target, now - self.started, d.line())
        return d

    def recovered(self) -> None:
        """A call went through: the outage (if any) is over."""
        if self.started is not None:
            log.info("coordinator %s reachable again after %.0f s", self.target, self.clock() - self.started)
        self.started = self.last_line = None
        self.best = self.last = None

    def gave_up(self, seconds: float) -> CoordinatorUnreachable:
        """The final error: a one-line "gave up" repeating the most useful diagnosis and its fix."""
        d = self.best or Diagnosis("other", "no answer", _FIXES["other"])
        return CoordinatorUnreachable(f"coordinator {self.target} unreachable (gave up after --connect-timeout "
                                      f"{seconds:g}s): {d.line()}", d)
