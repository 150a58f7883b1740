"""Admission: join tokens, secret files, the allow-list, the policy and the rate limiter."""

from __future__ import annotations

import base64

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.coordinator.admission import (
    Admission,
    AllowList,
    RateLimiter,
    create_secret,
    create_token,
    host_of,
    load_secret,
    verify_token,
)
from shoal.common.errors import PermissionDenied, ResourceExhausted, Unauthenticated
from shoal.common.identity import public_bytes

T0 = 1_700_000_000.0
SECRET = b"s" * 32


def test_token_roundtrip():
    tok = create_token(SECRET, 60, label="alice", now=T0)
    assert tok.isascii() and "=" not in tok and "+" not in tok and "/" not in tok
    claims = verify_token(SECRET, tok, now=T0 + 59)
    assert claims.label == "alice"
    assert claims.expires_unix == pytest.approx(T0 + 60)
    assert len(claims.token_id) == 32
    assert create_token(SECRET, 60, now=T0) != create_token(SECRET, 60, now=T0)


def test_expired_token_is_refused():
    tok = create_token(SECRET, 60, now=T0)
    with pytest.raises(Unauthenticated, match="join_token: expired"):
        verify_token(SECRET, tok, now=T0 + 61)


def test_token_from_another_secret_is_refused():
    tok = create_token(b"x" * 32, 60, now=T0)
    with pytest.raises(Unauthenticated, match="join_token: bad signature"):
        verify_token(SECRET, tok, now=T0)


def test_forged_payload_is_refused():
    raw = base64.urlsafe_b64decode(create_token(SECRET, 60, now=T0) + "==")
    payload = raw[:-32].replace(b'"exp":', b'"exp":9')  # extend the expiry
    forged = base64.urlsafe_b64encode(payload + raw[-32:]).rstrip(b"=").decode()
    with pytest.raises(Unauthenticated, match="join_token: bad signature"):
        verify_token(SECRET, forged, now=T0)


@pytest.mark.parametrize("token", ["", "!!!!", "abc", "a" * 5000, "YWJj"])
def test_malformed_token_is_refused(token):
    with pytest.raises(Unauthenticated, match="join_token"):
        verify_token(SECRET, token, now=T0)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.text(max_size=200))
def test_arbitrary_text_never_verifies(token):
    with pytest.raises(Unauthenticated, match="join_token"):
        verify_token(SECRET, token, now=T0)


@settings(max_examples=50, deadline=None, derandomize=True)
@given(position=st.integers(min_value=0), bit=st.integers(min_value=0, max_value=7))
def test_any_bit_flip_is_refused(position, bit):
    raw = bytearray(base64.urlsafe_b64decode(create_token(SECRET, 60, now=T0) + "=="))
    raw[position % len(raw)] ^= 1 << bit
    with pytest.raises(Unauthenticated, match="join_token"):
        verify_token(SECRET, base64.urlsafe_b64encode(bytes(raw)).decode(), now=T0)


def test_short_secret_is_a_configuration_error():
    with pytest.raises(ValueError, match="secret"):
        create_token(b"short", 60)
    with pytest.raises(ValueError, match="secret"):
        Admission(b"short", None)


def test_secret_file_is_0600_and_loads(tmp_path):
    path = tmp_path / "conf" / "join.secret"
    secret = create_secret(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert load_secret(path) == secret and len(secret) == 32
    with pytest.raises(FileExistsError):
        create_secret(path)
    path.chmod(0o644)
    with pytest.raises(ValueError, match="600"):
        load_secret(path)


def test_load_secret_rejects_garbage(tmp_path):
    path = tmp_path / "bad"
    path.write_text("not hex\n")
    path.chmod(0o600)
    with pytest.raises(ValueError, match="hex"):
        load_secret(path)


def write_allow_list(tmp_path, *keys: bytes):
    path = tmp_path / "allow.txt"
    lines = ["# operators' peers", ""] + [f"{k.hex()}  # peer {i}" for i, k in enumerate(keys)]
    path.write_text("\n".join(lines) + "\n")
    return AllowList.from_file(path)


def test_allow_list(tmp_path):
    alice, eve = (public_bytes(Ed25519PrivateKey.generate()) for _ in range(2))
    allow = write_allow_list(tmp_path, alice)
    assert len(allow) == 1 and alice in allow
    allow.check(alice)
    with pytest.raises(PermissionDenied, match="allow-list"):
        allow.check(eve)


def test_allow_list_rejects_bad_line(tmp_path):
    path = tmp_path / "allow.txt"
    path.write_text("# ok\n" + "ab" * 32 + "\nnot-a-key\n")
    with pytest.raises(ValueError, match=":3:"):
        AllowList.from_file(path)


def test_admission_policies(tmp_path):
    alice, eve = (public_bytes(Ed25519PrivateKey.generate()) for _ in range(2))
    allow = write_allow_list(tmp_path, alice)
    tok = create_token(SECRET, 60, label="x", now=T0)

    open_ = Admission(None, None)
    assert open_.open and open_.admit(eve, "", now=T0) is None

    by_token = Admission(SECRET, None)
    assert by_token.admit(eve, tok, now=T0).label == "x"
    with pytest.raises(Unauthenticated, match="join_token"):
        by_token.admit(alice, "", now=T0)
    with pytest.raises(Unauthenticated, match="join_token"):
        by_token.admit(alice, tok, now=T0 + 61)

    by_list = Admission(None, allow)
    assert by_list.admit(alice, "", now=T0) is None
    with pytest.raises(PermissionDenied):
        by_list.admit(eve, tok, now=T0)

    both = Admission(SECRET, allow)
    assert both.admit(alice, tok, now=T0).label == "x"
    with pytest.raises(Unauthenticated):
        both.admit(alice, "", now=T0)
    with pytest.raises(PermissionDenied):
        both.admit(eve, tok, now=T0)


def test_rate_limiter_bucket():
    rl = RateLimiter(rate_per_s=2, burst=3)
    for _ in range(3):
        rl.check("1.2.3.4", now=0.0)
    with pytest.raises(ResourceExhausted, match="retry in 0.50 s"):
        rl.check("1.2.3.4", now=0.0)
    rl.check("5.6.7.8", now=0.0)  # buckets are per key
    rl.check("1.2.3.4", now=0.5)  # refilled one token
    with pytest.raises(ResourceExhausted):
        rl.check("1.2.3.4", now=0.5)
    for _ in range(3):
        rl.check("1.2.3.4", now=100.0)  # refill is capped at burst
    with pytest.raises(ResourceExhausted):
        rl.check("1.2.3.4", now=100.0)


def test_rate_limiter_memory_is_bounded():
    rl = RateLimiter(rate_per_s=1, burst=1, max_keys=100)
    for i in range(10_000):
        rl.check(f"10.0.{i // 256}.{i % 256}", now=0.0)
    assert len(rl) == 100


def test_rate_limiter_rejects_bad_arguments():
    with pytest.raises(ValueError):
        RateLimiter(0, 1)
    with pytest.raises(ValueError):
        RateLimiter(1, 0)


@pytest.mark.parametrize(
    "peer,host",
    [
        ("ipv4:127.0.0.1:5555", "127.0.0.1"),
        ("ipv6:[::1]:5555", "::1"),
        ("unix:/tmp/s", "unix:/tmp/s"),
    ],
)
def test_host_of(peer, host):
    assert host_of(peer) == host
