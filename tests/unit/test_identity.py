"""Request signing: good requests pass; forged identity, replay, staleness and tampering fail."""

from __future__ import annotations

import pathlib

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.common.errors import ResourceExhausted, Unauthenticated
from shoal.common.identity import (
    MD_NONCE,
    MD_PUBKEY,
    MD_SIG,
    MD_TS,
    RequestVerifier,
    load_or_create_key,
    peer_id_of,
    public_bytes,
    sign_metadata,
)
from shoal.v1 import shoal_pb2

JOIN = "/shoal.v1.Coordinator/Join"
HEARTBEAT = "/shoal.v1.Coordinator/Heartbeat"
T0 = 1_700_000_000.0


@pytest.fixture
def key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def heartbeat(key: Ed25519PrivateKey) -> shoal_pb2.HeartbeatRequest:
    return shoal_pb2.HeartbeatRequest(peer_id=peer_id_of(public_bytes(key)))


def replace(md, name: str, value: str):
    return tuple((k, value if k == name else v) for k, v in md)


def test_signed_request_verifies_and_returns_key(key):
    req = shoal_pb2.JoinRequest(public_key=public_bytes(key), data_address="127.0.0.1:1")
    md = sign_metadata(key, JOIN, req, now=T0)
    assert dict(md).keys() == {MD_PUBKEY, MD_TS, MD_NONCE, MD_SIG}
    assert all(k.islower() and v.isascii() for k, v in md)
    assert RequestVerifier().verify(md, JOIN, req, now=T0 + 1) == public_bytes(key)


def test_default_clock_and_bytes_metadata_values(key):
    req = heartbeat(key)
    md = tuple((k, v.encode()) for k, v in sign_metadata(key, HEARTBEAT, req))
    md += (("user-agent", "x"),)
    assert RequestVerifier().verify(md, HEARTBEAT, req) == public_bytes(key)


def test_forged_peer_id_is_refused(key):
    other = Ed25519PrivateKey.generate()
    req = heartbeat(other)  # claims another peer's id, signed with our own key
    with pytest.raises(Unauthenticated, match="peer_id"):
        RequestVerifier().verify(sign_metadata(key, HEARTBEAT, req, now=T0), HEARTBEAT, req, now=T0)


def test_join_public_key_must_be_the_signer(key):
    other = Ed25519PrivateKey.generate()
    req = shoal_pb2.JoinRequest(public_key=public_bytes(other))
    with pytest.raises(Unauthenticated, match="public_key"):
        RequestVerifier().verify(sign_metadata(key, JOIN, req, now=T0), JOIN, req, now=T0)


def test_wrong_key_in_metadata_is_refused(key):
    other = Ed25519PrivateKey.generate()
    req = heartbeat(other)
    md = replace(sign_metadata(key, HEARTBEAT, req, now=T0), MD_PUBKEY, public_bytes(other).hex())
    with pytest.raises(Unauthenticated, match=MD_SIG):
        RequestVerifier().verify(md, HEARTBEAT, req, now=T0)


def test_replayed_nonce_is_refused(key):
    req = heartbeat(key)
    md = sign_metadata(key, HEARTBEAT, req, now=T0)
    v = RequestVerifier()
    v.verify(md, HEARTBEAT, req, now=T0)
    with pytest.raises(Unauthenticated, match="replayed"):
        v.verify(md, HEARTBEAT, req, now=T0 + 5)


def test_replay_after_nonce_expiry_is_refused_as_stale(key):
    req = heartbeat(key)
    md = sign_metadata(key, HEARTBEAT, req, now=T0)
    v = RequestVerifier(window_seconds=10)
    v.verify(md, HEARTBEAT, req, now=T0)
    v.verify(sign_metadata(key, HEARTBEAT, req, now=T0 + 25), HEARTBEAT, req, now=T0 + 25)
    assert len(v) == 1  # the first nonce was pruned
    with pytest.raises(Unauthenticated, match="stale"):
        v.verify(md, HEARTBEAT, req, now=T0 + 25)


def test_stale_and_future_timestamps_are_refused(key):
    req = heartbeat(key)
    v = RequestVerifier(window_seconds=30)
    with pytest.raises(Unauthenticated, match="stale"):
        v.verify(sign_metadata(key, HEARTBEAT, req, now=T0 - 31), HEARTBEAT, req, now=T0)
    with pytest.raises(Unauthenticated, match="future"):
        v.verify(sign_metadata(key, HEARTBEAT, req, now=T0 + 31), HEARTBEAT, req, now=T0)
    v.verify(sign_metadata(key, HEARTBEAT, req, now=T0 - 29), HEARTBEAT, req, now=T0)
    v.verify(sign_metadata(key, HEARTBEAT, req, now=T0 + 29), HEARTBEAT, req, now=T0)


def test_tampered_body_is_refused(key):
    req = shoal_pb2.ReadyRequest(peer_id=peer_id_of(public_bytes(key)), round=3, num_elements=10)
    md = sign_metadata(key, "/shoal.v1.Coordinator/Ready", req, now=T0)
    req.num_elements = 11
    with pytest.raises(Unauthenticated, match="signature"):
        RequestVerifier().verify(md, "/shoal.v1.Coordinator/Ready", req, now=T0)


def test_signature_is_bound_to_method_and_timestamp(key):
    req = heartbeat(key)
    md = sign_metadata(key, HEARTBEAT, req, now=T0)
    with pytest.raises(Unauthenticated, match="signature"):
        RequestVerifier().verify(md, "/shoal.v1.Coordinator/Leave", req, now=T0)
    shifted = replace(md, MD_TS, str(int(dict(md)[MD_TS]) + 1))
    with pytest.raises(Unauthenticated, match="signature"):
        RequestVerifier().verify(shifted, HEARTBEAT, req, now=T0)


def test_refused_request_does_not_burn_the_nonce(key):
    req = heartbeat(key)
    md = sign_metadata(key, HEARTBEAT, req, now=T0)
    v = RequestVerifier()
    with pytest.raises(Unauthenticated):
        v.verify(md, HEARTBEAT, shoal_pb2.HeartbeatRequest(peer_id="0" * 32), now=T0)
    v.verify(md, HEARTBEAT, req, now=T0)


@pytest.mark.parametrize("field", [MD_PUBKEY, MD_TS, MD_NONCE, MD_SIG])
def test_missing_field_is_refused(key, field):
    req = heartbeat(key)
    md = tuple(kv for kv in sign_metadata(key, HEARTBEAT, req, now=T0) if kv[0] != field)
    with pytest.raises(Unauthenticated, match=f"{field}: missing"):
        RequestVerifier().verify(md, HEARTBEAT, req, now=T0)


@pytest.mark.parametrize(
    "field,value",
    [(MD_PUBKEY, "zz" * 32), (MD_PUBKEY, "ab"), (MD_TS, "-5"), (MD_TS, "1e9"), (MD_TS, "9" * 25),
     (MD_NONCE, "00"), (MD_SIG, "g" * 128), (MD_SIG, "")],
)
def test_malformed_field_is_refused(key, field, value):
    req = heartbeat(key)
    md = replace(sign_metadata(key, HEARTBEAT, req, now=T0), field, value)
    with pytest.raises(Unauthenticated, match=field):
        RequestVerifier().verify(md, HEARTBEAT, req, now=T0)


def test_duplicated_field_is_refused(key):
    req = heartbeat(key)
    md = sign_metadata(key, HEARTBEAT, req, now=T0)
    with pytest.raises(Unauthenticated, match="more than once"):
        RequestVerifier().verify(md + ((MD_NONCE, dict(md)[MD_NONCE]),), HEARTBEAT, req, now=T0)


def test_nonce_memory_is_bounded(key):
    req = heartbeat(key)
    v = RequestVerifier(window_seconds=10, max_nonces=3)
    for i in range(3):
        v.verify(sign_metadata(key, HEARTBEAT, req, now=T0), HEARTBEAT, req, now=T0 + i)
    with pytest.raises(ResourceExhausted):
        v.verify(sign_metadata(key, HEARTBEAT, req, now=T0 + 3), HEARTBEAT, req, now=T0 + 3)
    v.verify(sign_metadata(key, HEARTBEAT, req, now=T0 + 11), HEARTBEAT, req, now=T0 + 11)
    assert len(v) == 1


@settings(max_examples=50, deadline=None, derandomize=True)
@given(position=st.integers(min_value=0), bit=st.integers(min_value=0, max_value=7))
def test_any_bit_flip_in_signature_is_refused(position, bit):
    key = Ed25519PrivateKey.generate()
    req = heartbeat(key)
    md = sign_metadata(key, HEARTBEAT, req, now=T0)
    sig = bytearray.fromhex(dict(md)[MD_SIG])
    sig[position % len(sig)] ^= 1 << bit
    with pytest.raises(Unauthenticated):
        RequestVerifier().verify(replace(md, MD_SIG, sig.hex()), HEARTBEAT, req, now=T0)


def test_key_file_is_0600_and_reloads(tmp_path):
    path = tmp_path / "keys" / "peer.key"
    key = load_or_create_key(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert public_bytes(load_or_create_key(path)) == public_bytes(key)


def test_key_created_by_another_process_meanwhile_is_loaded_not_overwritten(tmp_path, monkeypatch):
    # Two coordinators started together on one --key path: the second finds no file, then the
    # first creates it before the second writes. The second must load that key (the coordinators
    # of a prefix share their ticket key), not fail with "File exists" nor replace it.
    path = tmp_path / "coordinator.key"
    first = load_or_create_key(path)
    real_exists = pathlib.Path.exists
    monkeypatch.setattr(pathlib.Path, "exists", lambda self: False if self == path else real_exists(self))
    second = load_or_create_key(path)
    assert public_bytes(second) == public_bytes(first)
    assert [p.name for p in tmp_path.iterdir()] == ["coordinator.key"]  # no temporary file left


def test_hex_with_whitespace_is_refused(key):
    req = heartbeat(key)
    md = sign_metadata(key, HEARTBEAT, req, now=T0)
    nonce = dict(md)[MD_NONCE]
    with pytest.raises(Unauthenticated, match=f"{MD_NONCE}: not hex"):
        RequestVerifier().verify(replace(md, MD_NONCE, nonce[:-2] + " a"), HEARTBEAT, req, now=T0)


def test_first_chunk_binds_sender(key):
    push = "/shoal.v1.Peer/PushChunks"
    mine = shoal_pb2.Chunk(round=1, sender=peer_id_of(public_bytes(key)), ticket=b"t")
    assert RequestVerifier().verify(sign_metadata(key, push, mine, now=T0), push, mine, now=T0)
    spoofed = shoal_pb2.Chunk(round=1, sender="f" * 32, ticket=b"t")
    with pytest.raises(Unauthenticated, match="sender"):
        RequestVerifier().verify(sign_metadata(key, push, spoofed, now=T0), push, spoofed, now=T0)
