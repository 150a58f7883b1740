"""Reachability: proof that an advertised data address reaches a given identity.

Before anyone must dial a peer, the coordinator dials its advertised data address back (as
libp2p's AutoNAT does) with a fresh nonce (shoal.v1.Peer/Reach); the peer signs
`REACH_CONTEXT + nonce` with its identity key. An answer with a valid signature from the
member's key proves the address reaches that peer; no answer within the timeout, a refused
connection or a wrong signature means others cannot reach it there.

With TLS on the data plane the peer's server demands a client certificate the coordinator does
not hold, and before its first Join it has no certificate issued for its id yet: there the
dial-back is a TCP connection to the address within the timeout (the address is reachable, the
identity behind it unproven). Plaintext proves the identity too.

`answer` is the peer's side, `dial_back` the coordinator's. Both sides import this module
(shoal.common), neither side imports the other.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

import grpc
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from shoal.common.identity import public_bytes
from shoal.common.security import Security, open_channel
from shoal.v1 import shoal_pb2 as pb
from shoal.v1 import shoal_pb2_grpc as pb_grpc

REACH_CONTEXT = b"shoal.reach.v1"  # domain separation: a Reach signature is good for nothing else
NONCE_BYTES = 32
MAX_NONCE_BYTES = 64


def answer(key: Ed25519PrivateKey, nonce: bytes) -> pb.ReachResponse:
    """The peer's answer to a dial-back. Raises ValueError for a nonce outside 16..64 bytes."""
    if not 16 <= len(nonce) <= MAX_NONCE_BYTES:
        raise ValueError(f"nonce: {len(nonce)} bytes, expected 16..{MAX_NONCE_BYTES}")
    return pb.ReachResponse(public_key=public_bytes(key), signature=key.sign(REACH_CONTEXT + nonce))


@dataclass(frozen=True)
class Reachability:
    """The outcome of one dial-back. reachable: the address answered with the expected key's
    signature. reason: why not, one sentence (empty when reachable). timed_out: nothing
    answered within the timeout (a NATed address, or a peer too busy to answer in time), as
    opposed to a refusal or a wrong answer."""

    reachable: bool
    reason: str = ""
    timed_out: bool = False


def verify(public_key: bytes, nonce: bytes, resp: pb.ReachResponse) -> Reachability:
    """Whether `resp` is `public_key`'s signature over REACH_CONTEXT + `nonce`."""
    if resp.public_key != public_key:
        return Reachability(False, "another peer answers at that address")
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(resp.signature, REACH_CONTEXT + nonce)
    except (InvalidSignature, ValueError):
        return Reachability(False, "the answer at that address carries no valid signature of this peer's key")
    return Reachability(True)


async def dial_back(address: str, public_key: bytes, security: Security, timeout: float) -> Reachability:
    """Dial `address` (a peer's advertised data-plane HOST:PORT) and check that `public_key`'s
    peer answers there, within `timeout` seconds (connection included). Never raises for a
    network failure: it is the answer (reachable False, with the gRPC status in `reason`)."""
    if security.tls_dir:
        return await _connects(address, timeout)
    nonce = os.urandom(NONCE_BYTES)
    channel = open_channel(address, security, [("grpc.initial_reconnect_backoff_ms", 100)])
    try:
        resp = await pb_grpc.PeerStub(channel).Reach(pb.ReachRequest(nonce=nonce), timeout=timeout)
    except grpc.aio.AioRpcError as exc:
        code, details = exc.code(), exc.details() or ""
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return Reachability(False, f"no answer from {address} within {timeout:g} s", timed_out=True)
        if code == grpc.StatusCode.UNAVAILABLE and not any(w in details.lower() for w in _TLS_WORDS):
            return Reachability(False, f"{address} cannot be dialled ({details.splitlines()[0] if details else code.name})")
        # Something answered there (an older peer without Reach, a TLS handshake this
        # coordinator cannot complete): the address is reachable, the identity unproven.
        return Reachability(True, f"{address} answered {code.name}; identity not proven")
    finally:
        await channel.close()
    return verify(public_key, nonce, resp)


_TLS_WORDS = ("ssl", "tls", "handshake", "certificate")


async def _connects(address: str, timeout: float) -> Reachability:
    """Whether a TCP connection to HOST:PORT `address` opens within `timeout` seconds."""
    host, _, port = address.rpartition(":")
    try:
        async with asyncio.timeout(timeout):
            _, writer = await asyncio.open_connection(host.strip("[]"), int(port))
    except TimeoutError:
        return Reachability(False, f"no answer from {address} within {timeout:g} s", timed_out=True)
    except (OSError, ValueError) as exc:
        return Reachability(False, f"{address} cannot be dialled ({exc.strerror or exc})"
                            if isinstance(exc, OSError) else f"{address} is not HOST:PORT")
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass
    return Reachability(True)
