"""The peer's data-plane certificate: asked for at join, renewed before it expires.

At start a peer with a TLS directory makes a fresh TLS key (`shoal.common.certs.PeerTLS`, in memory
only) and puts a signing request for it in every JoinRequest; the coordinator answers with a
short-lived certificate for the peer id (`take_join_certificate`). `keep_renewed` asks for a new
one over the signed control plane (RenewCertificate) once two thirds of the current one's life
have passed; a rejoin (lease lost, coordinator restarted) brings a new one too.

A directory that still holds the shared legacy `peer.key` uses it as before, with a warning
(`legacy_mode`): no request is sent, nothing is renewed.

Failure semantics: a renewal that fails is retried (every tenth of the time left, at least every
5 s, at most every minute) and logged; the old certificate serves until it expires, after which
handshakes with other peers fail and rounds abort until a renewal or a rejoin succeeds. The loop
never raises (it runs beside the round protocol).
"""

from __future__ import annotations

import asyncio
import datetime
import logging

import grpc

from shoal.common.certs import PeerTLS, legacy_peer_key
from shoal.common.security import Security
from shoal.peer.control import CoordinatorClient
from shoal.v1 import shoal_pb2 as pb

log = logging.getLogger("shoal.peer.certificates")

RENEW_AT = 2 / 3  # of the certificate's life
RETRY_MIN_S, RETRY_MAX_S = 5.0, 60.0


def legacy_mode(security: Security) -> bool:
    """Whether this peer uses a shared legacy peer.key (warns once per call)."""
    if not legacy_peer_key(security.tls_dir):
        return False
    log.warning("--tls-dir %s holds a shared peer.key: deprecated, every holder of it can pose as any peer on "
                "the data plane, and it will stop working in the next release; remove peer.key and peer.pem "
                "(the coordinator issues each peer its own certificate at join)", security.tls_dir)
    return True


def take_join_certificate(tls: PeerTLS, resp: pb.JoinResponse, coordinator: str) -> None:
    """Install the certificate of a JoinResponse.

    Raises:
        RuntimeError: the coordinator issued none (its --tls-dir has no ca.key, or it predates
            issued certificates): this peer cannot take part in the data plane.
        ValueError: the certificate is not for this key or peer id (see PeerTLS.install).
    """
    if not resp.tls_certificate:
        raise RuntimeError(f"coordinator {coordinator} issued no data-plane certificate (its --tls-dir has no "
                           f"ca.key); ask the operator, or use a directory with the legacy shared peer.key")
    first = not tls.issued
    tls.install(resp.tls_certificate, resp.tls_ca)
    if first:
        log.info("data-plane certificate issued for %s.peer.shoal, valid until %s", tls.peer_id[:8],
                 tls.not_after.isoformat(timespec="seconds"))


def renew_delay(received: datetime.datetime, not_after: datetime.datetime, now: datetime.datetime) -> float:
    """Seconds from `now` until a certificate received at `received` and valid until `not_after`
    should be renewed (at RENEW_AT of the life it had when it arrived; 0 when that passed)."""
    due = received + (not_after - received) * RENEW_AT
    return max(0.0, (due - now).total_seconds())


def retry_delay(not_after: datetime.datetime, now: datetime.datetime) -> float:
    """Seconds before another renewal try: a tenth of the time left, within RETRY_MIN_S..RETRY_MAX_S."""
    return min(RETRY_MAX_S, max(RETRY_MIN_S, (not_after - now).total_seconds() / 10))


async def keep_renewed(control: CoordinatorClient, tls: PeerTLS, rpc_timeout: float) -> None:
    """Renew `tls`'s certificate before it expires, forever (cancel to stop); see the module
    docstring for failures."""
    while True:
        now = datetime.datetime.now(datetime.timezone.utc)
        delay = renew_delay(tls.installed_at, tls.not_after, now) if tls.issued else RETRY_MIN_S
        await asyncio.sleep(delay)
        if not tls.issued:
            continue
        generation = tls.generation
        req = pb.RenewCertificateRequest(peer_id=control.peer_id, tls_csr=tls.csr())
        try:
            resp = await control.stub.RenewCertificate(req, timeout=rpc_timeout)
            if tls.generation == generation:  # a rejoin meanwhile brought a newer one
                tls.install(resp.tls_certificate, resp.tls_ca)
            log.info("data-plane certificate renewed, valid until %s", tls.not_after.isoformat(timespec="seconds"))
        except (grpc.aio.AioRpcError, ValueError) as exc:
            why = f"{exc.code().name} {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            wait = retry_delay(tls.not_after, datetime.datetime.now(datetime.timezone.utc))
            log.warning("data-plane certificate not renewed (%s); the current one expires at %s; trying again in "
                        "%.0fs", why, tls.not_after.isoformat(timespec="seconds"), wait)
            await asyncio.sleep(wait)
