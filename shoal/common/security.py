"""Transport security and signed calls, for both planes: channels, ports and interceptors.

`Security` says how a process talks: TLS from a directory made by `shoal certs init` (optionally
mutual), or plaintext when the operator passed `--insecure`. `open_channel` / `add_port` turn it
into gRPC channels and listening ports. On the data plane a peer uses the certificate the
coordinator issued it (`shoal.common.certs.PeerTLS`): `open_peer_channel` verifies the server by
the peer id the plan names (never by its address), and `tls_sender_check` makes sure a client's
certificate names the peer that signed the request or stream. `signing_interceptors` sign every unary and
server-streaming call made on a channel with the caller's Ed25519 key (`shoal.common.identity
.sign_metadata`); `SignedCalls` is the server side: a per-host rate limit, then the signature
check (`shoal.common.identity.RequestVerifier`), before any handler runs. `PushChunks` (a client stream)
is signed by its first chunk instead (`push_metadata`, checked in `peer.dataplane`).

This module does not decide who is admitted (`shoal.coordinator.admission`) nor who may send tensors
in a round (`shoal.common.tickets`); it only makes sure a request comes from the key it names, once.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Collection

import grpc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.common.errors import ShoalError, Unauthenticated
from shoal.common.identity import RequestVerifier, peer_id_of, sign_metadata
from shoal.common.limits import RateLimiter, host_of
from shoal.common.certs import (PeerTLS, channel_credentials, legacy_peer_key, peer_dns_name, PEER_URI_PREFIX,
                                server_credentials)

log = logging.getLogger("shoal.security")

PUSH_CHUNKS = "/shoal.v1.Peer/PushChunks"
# Metadata key carrying a round ticket or sync permit on FetchState ("-bin": raw bytes).
MD_TICKET = "x-shoal-ticket-bin"


@dataclasses.dataclass(frozen=True)
class Security:
    """How a process secures its gRPC connections.

    tls_dir: directory written by `shoal certs init` (a volunteer's holds only ca.pem; the
        coordinator's also coordinator.pem/.key and ca.key); None means plaintext, allowed only
        when `insecure` is set explicitly.
    mtls: a peer's data-plane server demands a client certificate (always so with a certificate
        issued at join). On the coordinator it demands one only with a legacy directory holding a
        shared peer.key (volunteers get their certificate at join, after the first call).
    insecure: the operator asked for plaintext (`--insecure`); a warning is logged.
    """

    tls_dir: str | None = None
    mtls: bool = False
    insecure: bool = False

    def check(self, who: str) -> None:
        """Refuse a configuration that is neither TLS nor explicitly insecure; warn on plaintext.

        Raises:
            ValueError: neither `tls_dir` nor `insecure` is set, or both are (the message does
                not name `who`; the caller prefixes it).
        """
        if self.tls_dir and self.insecure:
            raise ValueError("--tls-dir and --insecure exclude each other")
        if not self.tls_dir and not self.insecure:
            raise ValueError("pass --tls-dir DIR (made by `shoal certs init`) or --insecure for plaintext")
        if self.insecure:
            log.warning("%s: --insecure: plaintext gRPC; anyone on the path can read and alter traffic", who)

    def client_cert(self) -> bool:
        """Whether this process presents the legacy shared peer.pem (its directory holds peer.key)."""
        return legacy_peer_key(self.tls_dir)


def open_channel(target: str, security: Security, options: list, interceptors: list | None = None) -> grpc.aio.Channel:
    """A grpc.aio channel to `target`: TLS trusting only ca.pem (presenting peer.pem when the
    directory has it), or plaintext for an insecure `security`."""
    if security.tls_dir:
        creds = channel_credentials(security.tls_dir, client_cert=security.client_cert())
        name = list_tls_name(target)
        if name:
            options = [*options, ("grpc.ssl_target_name_override", name)]
        return grpc.aio.secure_channel(target, creds, options=options, interceptors=interceptors)
    return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)


def list_tls_name(target: str) -> str:
    """The name a TLS channel to a list of coordinators (`ipv4:A,B` / `ipv6:[A],[B]`, as
    shoal.config.grpc_target makes) verifies every coordinator's certificate against: the first
    address's host ("" for any other target, whose own host is checked). gRPC would check the
    whole list as one name, which no certificate holds: each coordinator of a list must hold a
    certificate (signed by ca.pem) valid for the first one's host, e.g. one certificate naming
    every coordinator address (`shoal certs init --host A --host B`)."""
    scheme, _, rest = target.partition(":")
    if scheme not in ("ipv4", "ipv6") or "," not in rest:
        return ""
    return rest.split(",", 1)[0].rsplit(":", 1)[0].strip("[]")


def open_peer_channel(address: str, peer_id: str, security: Security, peer_tls: PeerTLS | None, options: list,
                      interceptors: list | None = None) -> grpc.aio.Channel:
    """A data-plane channel to peer `peer_id` at `address`.

    With an issued certificate (`peer_tls.issued`) the server must present a certificate for
    `<peer_id>.peer.shoal` signed by the peer CA, whatever `address` is, and this peer presents
    its own; otherwise as `open_channel` (a legacy shared peer.pem: the address is verified).
    """
    if security.tls_dir and peer_tls is not None and peer_tls.issued:
        opts = [*options, ("grpc.ssl_target_name_override", peer_dns_name(peer_id))]
        return grpc.aio.secure_channel(address, peer_tls.channel_credentials(), options=opts,
                                       interceptors=interceptors)
    return open_channel(address, security, options, interceptors)


def tls_peer_id(context) -> str | None:
    """The peer id named by the client certificate of this call's connection (its URI
    `shoal://peer/<id>`); "" for a certificate that names none (a legacy shared one); None when
    the connection carries no client certificate (plaintext, or a server not asking for one)."""
    auth = context.auth_context() or {}
    if not auth.get("x509_subject") and not auth.get("peer_uri") and not auth.get("x509_pem_cert"):
        return None
    ids = [u.decode() for u in auth.get("peer_uri", ()) if u.startswith(PEER_URI_PREFIX.encode())]
    return ids[0][len(PEER_URI_PREFIX):] if len(ids) == 1 else ""


def tls_sender_check(context, signer_id: str) -> None:
    """On a server that demands issued certificates: the client's certificate must name
    `signer_id`, the peer whose key signed the request (or the stream's first chunk), so a peer
    holding another peer's certificate (or the legacy shared one) gets nothing through.

    Raises:
        Unauthenticated: no client certificate, one that names no peer, or another peer.
    """
    named = tls_peer_id(context)
    if named == signer_id:
        return
    if named is None:
        raise Unauthenticated("tls: no client certificate; the data plane needs the one issued at join")
    if not named:
        raise Unauthenticated("tls: the client certificate names no peer id (a shared legacy peer.pem?)")
    raise Unauthenticated(f"tls: the client certificate is for peer {named[:8]}, the request is signed by "
                          f"{signer_id[:8]}")


def add_port(server: grpc.aio.Server, address: str, security: Security, role: str,
             peer_tls: PeerTLS | None = None) -> int:
    """Bind `address` with TLS for `role` ("coordinator" | "peer") or plaintext; returns the port.

    A peer with `peer_tls` serves the certificate issued to it (mutual TLS, the newest
    certificate at each handshake); without, the legacy shared peer.pem of its directory. The
    coordinator demands client certificates (`mtls`) only when its directory holds a legacy
    shared peer.key: volunteers get theirs at join, so demanding one would refuse every joiner
    (every control-plane call is signed by the caller's key instead).

    Raises:
        OSError: the address cannot be bound.
    """
    if security.tls_dir:
        if role == "peer" and peer_tls is not None:
            creds = peer_tls.server_credentials()
        else:
            mtls = security.mtls
            if role == "coordinator" and mtls and not legacy_peer_key(security.tls_dir):
                log.warning("--mtls: not applied to the control plane: peers get their certificate at join, and every "
                            "call is signed by the caller's key (the data plane is always mutual TLS)")
                mtls = False
            creds = server_credentials(security.tls_dir, role=role, require_client_auth=mtls)
        port = server.add_secure_port(address, creds)
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"listen: cannot bind {address}")
    return port


def _method(details: grpc.aio.ClientCallDetails) -> str:
    m = details.method
    return m.decode() if isinstance(m, bytes) else m


def _signed(details: grpc.aio.ClientCallDetails, key: Ed25519PrivateKey, request) -> grpc.aio.ClientCallDetails:
    md = grpc.aio.Metadata(*(tuple(details.metadata) if details.metadata else ()))
    for k, v in sign_metadata(key, _method(details), request):
        md.add(k, v)
    return grpc.aio.ClientCallDetails(details.method, details.timeout, md, details.credentials,
                                      details.wait_for_ready)


class _SignUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, key: Ed25519PrivateKey):
        self.key = key

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_signed(client_call_details, self.key, request), request)


class _SignUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, key: Ed25519PrivateKey):
        self.key = key

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_signed(client_call_details, self.key, request), request)


def signing_interceptors(key: Ed25519PrivateKey) -> list:
    """Client interceptors that sign every unary and server-streaming call with `key`; each call
    gets a fresh timestamp and nonce, so retries and stream reconnects are never replays."""
    return [_SignUnaryUnary(key), _SignUnaryStream(key)]


def push_metadata(key: Ed25519PrivateKey, first_chunk) -> tuple[tuple[str, str], ...]:
    """Signature metadata for a PushChunks stream, over its first chunk (ticket included)."""
    return sign_metadata(key, PUSH_CHUNKS, first_chunk)


class SignedCalls(grpc.aio.ServerInterceptor):
    """Server interceptor: per-host rate limit, then a valid request signature, for every method
    whose path starts with `prefix`, except `unsigned` (full paths) and client or bidirectional
    streams (which sign their first message and are checked by the handler; they are still rate
    limited).

    `limits` maps a full method path to its own `RateLimiter` (e.g. a strict one for Join);
    every other method uses `default_limit`. Refusals: RESOURCE_EXHAUSTED (rate, nonce memory),
    UNAUTHENTICATED (signature missing, malformed, stale, replayed, or naming another identity;
    with `tls_identity`, a client certificate that does not name the signer).
    """

    def __init__(self, prefix: str, verifier: RequestVerifier, *, unsigned: Collection[str] = (),
                 default_limit: RateLimiter | None = None, limits: dict[str, RateLimiter] | None = None,
                 tls_identity: bool = False):
        self.tls_identity = tls_identity  # the client certificate must name the signer (tls_sender_check)
        self.prefix = prefix
        self.verifier = verifier
        self.unsigned = frozenset(unsigned)
        self.default_limit = default_limit
        self.limits = dict(limits or {})

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(self.prefix):
            return handler
        limiter = self.limits.get(method, self.default_limit)
        sign = method not in self.unsigned and not handler.request_streaming

        async def admit(request, context) -> None:
            try:
                if limiter is not None:
                    limiter.check(host_of(context.peer()))
                if sign:
                    pub = self.verifier.verify(context.invocation_metadata() or (), method, request)
                    if self.tls_identity:
                        tls_sender_check(context, peer_id_of(pub))
            except ShoalError as exc:
                await context.abort(exc.code, str(exc))

        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary_unary(request, context):
                await admit(request, context)
                return await inner(request, context)

            return handler._replace(unary_unary=unary_unary)
        if handler.unary_stream is not None:
            inner_s = handler.unary_stream

            async def unary_stream(request, context):
                await admit(request, context)
                async for item in inner_s(request, context):
                    yield item

            return handler._replace(unary_stream=unary_stream)
        if handler.stream_unary is not None:
            inner_c = handler.stream_unary

            async def stream_unary(request_iterator, context):
                await admit(None, context)
                return await inner_c(request_iterator, context)

            return handler._replace(stream_unary=stream_unary)
        if handler.stream_stream is not None:
            inner_b = handler.stream_stream
            if inspect.isasyncgenfunction(inner_b):
                async def stream_stream_gen(request_iterator, context):
                    await admit(None, context)
                    async for item in inner_b(request_iterator, context):
                        yield item

                return handler._replace(stream_stream=stream_stream_gen)

            async def stream_stream(request_iterator, context):  # a handler that writes with context.write
                await admit(None, context)
                return await inner_b(request_iterator, context)

            return handler._replace(stream_stream=stream_stream)
        return handler

