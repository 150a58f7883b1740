"""Round tickets: a valid ticket passes; forged, foreign-round, expired or malformed ones fail."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.common.errors import InvalidArgument, PermissionDenied
from shoal.common.identity import public_bytes
from shoal.common.tickets import MAX_TICKET_BYTES, issue_ticket, plan_digest, verify_ticket
from shoal.v1 import shoal_pb2

T0 = 1_700_000_000.0
ALICE, BOB, EVE = "a" * 32, "b" * 32, "e" * 32


@pytest.fixture
def coord() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def make_plan() -> shoal_pb2.Plan:
    return shoal_pb2.Plan(
        round=7, attempt=1, epoch=2, collective="ring", num_elements=100,
        shard_bounds=[0, 50, 100], shard_owner=[0, 1],
        participants=[shoal_pb2.Participant(peer_id=ALICE), shoal_pb2.Participant(peer_id=BOB)],
    )


def ticket_for(coord, round=7, attempt=1, participants=(ALICE, BOB), digest=b"d" * 32, ttl=60.0):
    return issue_ticket(coord, round, attempt, participants, digest, ttl, now=T0)


def test_valid_ticket_verifies(coord):
    t = ticket_for(coord)
    got = verify_ticket(public_bytes(coord), t, round=7, attempt=1, sender=BOB, now=T0 + 59)
    assert (got.round, got.attempt, list(got.participants)) == (7, 1, [ALICE, BOB])
    assert got.expires_unix == pytest.approx(T0 + 60)


def test_ticket_with_plan_digest_roundtrip(coord):
    plan = make_plan()
    plan.ticket = issue_ticket(coord, 7, 1, [ALICE, BOB], plan_digest(plan), 60, now=T0)
    verify_ticket(public_bytes(coord), plan.ticket, round=7, attempt=1, sender=ALICE, now=T0,
                  expected_plan_digest=plan_digest(plan))
    other = make_plan()
    other.num_elements = 101
    with pytest.raises(PermissionDenied, match="plan_digest"):
        verify_ticket(public_bytes(coord), plan.ticket, round=7, attempt=1, sender=ALICE, now=T0,
                      expected_plan_digest=plan_digest(other))


def test_plan_digest_ignores_ticket_and_is_deterministic():
    plan = make_plan()
    d = plan_digest(plan)
    assert len(d) == 32
    plan.ticket = b"anything"
    assert plan_digest(plan) == d
    assert plan.ticket == b"anything"  # not modified
    plan.deadline_seconds = 5
    assert plan_digest(plan) != d


def test_ticket_signed_by_another_key_is_refused(coord):
    forged = ticket_for(Ed25519PrivateKey.generate())
    with pytest.raises(PermissionDenied, match="signature"):
        verify_ticket(public_bytes(coord), forged, round=7, attempt=1, sender=ALICE, now=T0)


def test_tampered_ticket_body_is_refused(coord):
    t = bytearray(ticket_for(coord, participants=(ALICE, BOB)))
    i = bytes(t).index(BOB.encode())
    t[i : i + 32] = EVE.encode()  # swap a participant for the attacker
    with pytest.raises(PermissionDenied, match="signature"):
        verify_ticket(public_bytes(coord), bytes(t), round=7, attempt=1, sender=EVE, now=T0)


@pytest.mark.parametrize("round,attempt", [(8, 1), (6, 1), (7, 0), (7, 2)])
def test_ticket_for_another_round_or_attempt_is_refused(coord, round, attempt):
    with pytest.raises(PermissionDenied, match="round"):
        verify_ticket(public_bytes(coord), ticket_for(coord), round=round, attempt=attempt,
                      sender=ALICE, now=T0)


def test_non_participant_sender_is_refused(coord):
    with pytest.raises(PermissionDenied, match="sender"):
        verify_ticket(public_bytes(coord), ticket_for(coord), round=7, attempt=1, sender=EVE,
                      now=T0)


def test_expired_ticket_is_refused(coord):
    with pytest.raises(PermissionDenied, match="expired"):
        verify_ticket(public_bytes(coord), ticket_for(coord, ttl=10), round=7, attempt=1,
                      sender=ALICE, now=T0 + 10.5)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda t: b"",
        lambda t: t[:50],
        lambda t: t[:-1],
        lambda t: t + b"x",
        lambda t: (0xFFFFFFFF).to_bytes(4, "big") + t[4:],
        lambda t: (3).to_bytes(4, "big") + b"\xff\xff\xff" + b"s" * 64,
        lambda t: b"\0" * (MAX_TICKET_BYTES + 1),
    ],
)
def test_malformed_ticket_is_invalid_argument(coord, mutate):
    with pytest.raises(InvalidArgument, match="ticket"):
        verify_ticket(public_bytes(coord), mutate(ticket_for(coord)), round=7, attempt=1,
                      sender=ALICE, now=T0)


def test_issue_rejects_bad_arguments(coord):
    with pytest.raises(ValueError):
        ticket_for(coord, ttl=0)
    with pytest.raises(ValueError):
        ticket_for(coord, round=-1)
    with pytest.raises(ValueError):
        ticket_for(coord, attempt=1 << 32)
    with pytest.raises(ValueError):
        verify_ticket(b"short", ticket_for(coord), round=7, attempt=1, sender=ALICE, now=T0)
