"""Round tickets: the coordinator's signed statement of who takes part in a round attempt.

The coordinator issues one ticket per plan (`issue_ticket`, carried in `Plan.ticket`); every
peer sends it on the first chunk of each data-plane stream, and the receiver accepts tensors
only when `verify_ticket` passes: the coordinator signed it, it names the receiver's current
round and attempt, the sender is a participant, and it has not expired. The ticket also binds
the plan (`plan_digest`), so a peer can check that the plan it holds is the one signed.

Wire format (bytes):

    u32be(len(body)) | body | signature (64 bytes)

where `body` is a deterministically serialized `shoal.v1.RoundTicket` and the Ed25519
signature covers `b"shoal.v1.ticket\\x00" | body`, so a ticket signature can never be confused
with a request signature made by the same key.

This module is pure (no I/O, no clock except the `now` default); it does not check sizes or
dtypes of chunks, nor keep track of which round is current.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Sequence

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from google.protobuf.message import DecodeError

from shoal.common.errors import InvalidArgument, PermissionDenied
from shoal.v1 import shoal_pb2

TICKET_DOMAIN = b"shoal.v1.ticket\x00"
SIGNATURE_BYTES = 64
MAX_TICKET_BYTES = 1 << 20
PLAN_DIGEST_BYTES = 32


def plan_digest(plan: shoal_pb2.Plan) -> bytes:
    """BLAKE2b-256 (32 bytes) of `plan` serialized deterministically with `ticket` cleared.

    The ticket field is excluded so the digest can go inside the ticket that is then stored in
    the same plan. `plan` is not modified.
    """
    copy = shoal_pb2.Plan()
    copy.CopyFrom(plan)
    copy.ClearField("ticket")
    body = copy.SerializeToString(deterministic=True)
    return hashlib.blake2b(body, digest_size=PLAN_DIGEST_BYTES).digest()


def issue_ticket(
    key: Ed25519PrivateKey,
    round: int,
    attempt: int,
    participants: Sequence[str],
    plan_digest: bytes,
    ttl_seconds: float,
    now: float | None = None,
) -> bytes:
    """Sign a ticket for `round`/`attempt` naming `participants` (peer ids), valid `ttl_seconds`.

    `now` is unix seconds (default: time.time()); the ticket expires at `now + ttl_seconds`.
    Size the TTL to cover the plan's deadline plus clock skew between peers.

    Raises:
        ValueError: `round`/`attempt` out of the uint64/uint32 range, `ttl_seconds` not
            positive and finite, or the encoded ticket would exceed MAX_TICKET_BYTES.
    """
    if not 0 <= round < 1 << 64:
        raise ValueError("round: out of uint64 range")
    if not 0 <= attempt < 1 << 32:
        raise ValueError("attempt: out of uint32 range")
    if not (ttl_seconds > 0 and math.isfinite(ttl_seconds)):
        raise ValueError("ttl_seconds: must be positive and finite")
    t = time.time() if now is None else now
    msg = shoal_pb2.RoundTicket(
        round=round,
        attempt=attempt,
        participants=list(participants),
        plan_digest=plan_digest,
        expires_unix=t + ttl_seconds,
    )
    body = msg.SerializeToString(deterministic=True)
    if 4 + len(body) + SIGNATURE_BYTES > MAX_TICKET_BYTES:
        raise ValueError(f"participants: ticket would exceed {MAX_TICKET_BYTES} bytes")
    sig = key.sign(TICKET_DOMAIN + body)
    return len(body).to_bytes(4, "big") + body + sig


def verify_ticket(
    coordinator_public_key: bytes,
    ticket: bytes,
    *,
    round: int,
    attempt: int,
    sender: str,
    now: float | None = None,
    expected_plan_digest: bytes | None = None,
) -> shoal_pb2.RoundTicket:
    """Check `ticket` as presented by `sender` for the receiver's current `round`/`attempt`.

    `coordinator_public_key` is the raw 32-byte key from `JoinResponse.coordinator_public_key`;
    `now` is unix seconds (default: time.time()). When `expected_plan_digest` is given the
    ticket must carry it (pass `plan_digest(plan)` of the plan the receiver holds).
    Returns the decoded ticket. Checks run in the order: format, signature, round/attempt,
    plan digest, expiry, sender, so an unsigned ticket never reveals anything else.

    Raises:
        InvalidArgument: the ticket is empty, too large, truncated or does not decode.
        PermissionDenied: the signature does not verify with the coordinator's key, the
            ticket is for another round or attempt or another plan, it has expired, or
            `sender` is not among its participants.
        ValueError: `coordinator_public_key` is not a 32-byte Ed25519 key (a local
            configuration error, not the sender's fault).
    """
    if len(coordinator_public_key) != 32:
        raise ValueError(
            f"coordinator_public_key: expected 32 bytes, got {len(coordinator_public_key)}"
        )
    coordinator = Ed25519PublicKey.from_public_bytes(coordinator_public_key)
    if not ticket:
        raise InvalidArgument("ticket: missing")
    if len(ticket) > MAX_TICKET_BYTES:
        raise InvalidArgument(f"ticket: {len(ticket)} bytes exceeds {MAX_TICKET_BYTES}")
    if len(ticket) < 4 + SIGNATURE_BYTES:
        raise InvalidArgument(f"ticket: truncated ({len(ticket)} bytes)")
    n = int.from_bytes(ticket[:4], "big")
    if 4 + n + SIGNATURE_BYTES != len(ticket):
        raise InvalidArgument(f"ticket: length prefix {n} does not match {len(ticket)} bytes")
    body, sig = ticket[4 : 4 + n], ticket[4 + n :]
    decoded = shoal_pb2.RoundTicket()
    try:
        decoded.ParseFromString(body)
    except DecodeError:
        raise InvalidArgument("ticket: body is not a RoundTicket") from None

    try:
        coordinator.verify(sig, TICKET_DOMAIN + body)
    except InvalidSignature:
        raise PermissionDenied(
            "ticket: signature does not verify with the coordinator key"
        ) from None

    if decoded.round != round or decoded.attempt != attempt:
        raise PermissionDenied(
            f"ticket: for round {decoded.round} attempt {decoded.attempt}, "
            f"expected round {round} attempt {attempt}"
        )
    if expected_plan_digest is not None and decoded.plan_digest != expected_plan_digest:
        raise PermissionDenied("ticket: plan_digest does not match the plan held")
    t = time.time() if now is None else now
    if not t <= decoded.expires_unix:
        raise PermissionDenied(f"ticket: expired {t - decoded.expires_unix:.1f} s ago")
    if sender not in decoded.participants:
        raise PermissionDenied(f"sender: {sender!r} is not a participant of round {round}")
    return decoded


# A sync permit is a ticket for attempt SYNC_ATTEMPT (never a real attempt) naming one peer, with
# the committed state digest as its plan digest: it lets that peer fetch committed state from
# donors (`FetchState`). A round ticket proves membership as well (its participants are members).
SYNC_ATTEMPT = (1 << 32) - 1


def ticket_round(ticket: bytes) -> tuple[int, int]:
    """(round, attempt) a ticket claims, read WITHOUT checking its signature (use it only to pick
    the arguments of `verify_ticket`, which checks everything).

    Raises:
        InvalidArgument: the ticket is malformed (as in `verify_ticket`).
    """
    if not ticket:
        raise InvalidArgument("ticket: missing")
    if len(ticket) > MAX_TICKET_BYTES or len(ticket) < 4 + SIGNATURE_BYTES:
        raise InvalidArgument(f"ticket: {len(ticket)} bytes is not a ticket")
    n = int.from_bytes(ticket[:4], "big")
    if 4 + n + SIGNATURE_BYTES != len(ticket):
        raise InvalidArgument(f"ticket: length prefix {n} does not match {len(ticket)} bytes")
    decoded = shoal_pb2.RoundTicket()
    try:
        decoded.ParseFromString(ticket[4 : 4 + n])
    except DecodeError:
        raise InvalidArgument("ticket: body is not a RoundTicket") from None
    return decoded.round, decoded.attempt


def verify_membership(
    coordinator_public_key: bytes, ticket: bytes, *, peer_id: str, now: float | None = None
) -> shoal_pb2.RoundTicket:
    """Check that `ticket` (a round ticket or a sync permit) is coordinator-signed, unexpired, and
    names `peer_id`: proof that the coordinator admitted `peer_id` recently.

    Raises:
        InvalidArgument: the ticket is malformed.
        PermissionDenied: bad signature, expired, or `peer_id` is not named.
    """
    round_, attempt = ticket_round(ticket)
    return verify_ticket(coordinator_public_key, ticket, round=round_, attempt=attempt, sender=peer_id, now=now)
