"""Peer identity: Ed25519 key pairs and the peer id derived from the public key.

A peer's id is the hex BLAKE2b-128 digest of its raw 32-byte Ed25519 public key, so an id
cannot be claimed without the matching private key. Keys are stored PEM-encoded (PKCS#8, no
passphrase) with 0600 permissions.
"""

from __future__ import annotations

import hashlib
import os
import pathlib

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

PEER_ID_BYTES = 16


def peer_id_of(public_key: bytes) -> str:
    """Peer id (32 hex chars) of a raw 32-byte Ed25519 public key.

    Raises:
        ValueError: `public_key` is not 32 bytes.
    """
    if len(public_key) != 32:
        raise ValueError(f"public_key: expected 32 bytes, got {len(public_key)}")
    return hashlib.blake2b(public_key, digest_size=PEER_ID_BYTES).hexdigest()


def public_bytes(key: Ed25519PrivateKey | Ed25519PublicKey) -> bytes:
    """Raw 32-byte public key of a private or public Ed25519 key."""
    pub = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def load_or_create_key(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    """Load the Ed25519 private key at `path`, creating it (mode 0600) when absent.

    Raises:
        ValueError: the file exists but does not hold an Ed25519 private key.
    """
    p = pathlib.Path(path)
    if p.exists():
        key = serialization.load_pem_private_key(p.read_bytes(), password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"{p}: not an Ed25519 private key")
        return key
    p.parent.mkdir(parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    return key
