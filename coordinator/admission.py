"""Admission control for the coordinator: join tokens, the allow-list, and per-caller rate limits.

A peer is admitted by a join token (an HMAC-signed, expiring bearer token the operator hands
out), by its Ed25519 public key being on the allow-list, or by both when both are configured
(`Admission`). `RateLimiter` throttles callers before any expensive work. Everything here is
pure and synchronous; the coordinator servicer maps the raised `ShoalError`s to gRPC status
codes (`shoal.common.errors.grpc_errors`).

This module does not verify request signatures (`shoal.common.identity.RequestVerifier` does) nor
transport security (`shoal.common.certs`).

Join token format: `base64url_nopad(payload | tag)`, where `payload` is compact UTF-8 JSON
`{"v": 1, "label": str, "exp": unix seconds (float), "id": 32 hex chars}` and `tag` is the
32-byte HMAC-SHA256 under the coordinator's secret of `b"shoal.v1.join_token\\x00" | payload`.
A token is reusable until it expires (several peers may join with the same one).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import hmac
import json
import math
import os
import pathlib
import secrets
import time

from shoal.common.errors import PermissionDenied, Unauthenticated
from shoal.common.limits import RateLimiter, host_of  # noqa: F401  (re-exported: admission's rate limits)

TOKEN_DOMAIN = b"shoal.v1.join_token\x00"
TAG_BYTES = 32
SECRET_BYTES = 32
MIN_SECRET_BYTES = 16
MAX_TOKEN_CHARS = 4096


@dataclasses.dataclass(frozen=True)
class TokenClaims:
    """What a verified join token says: operator `label`, `expires_unix` (unix seconds), and
    `token_id` (32 hex chars, random, for logs and revocation lists)."""

    label: str
    expires_unix: float
    token_id: str


def _b64encode(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64decode(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _tag(secret: bytes, payload: bytes) -> bytes:
    return hmac.new(secret, TOKEN_DOMAIN + payload, hashlib.sha256).digest()


def _check_secret(secret: bytes) -> None:
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"secret: expected at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")


def create_token(
    secret: bytes, ttl_seconds: float, label: str = "", now: float | None = None
) -> str:
    """A join token valid for `ttl_seconds` from `now` (unix seconds, default time.time()).

    `label` names who the token is for (it shows up in the coordinator's logs on join).

    Raises:
        ValueError: `secret` shorter than 16 bytes, or `ttl_seconds` not positive and finite.
    """
    _check_secret(secret)
    if not (ttl_seconds > 0 and math.isfinite(ttl_seconds)):
        raise ValueError("ttl_seconds: must be positive and finite")
    t = time.time() if now is None else now
    payload = json.dumps(
        {"v": 1, "label": label, "exp": t + ttl_seconds, "id": secrets.token_hex(16)},
        separators=(",", ":"),
        ensure_ascii=False,
    ).encode("utf-8")
    return _b64encode(payload + _tag(secret, payload))


def verify_token(secret: bytes, token: str, now: float | None = None) -> TokenClaims:
    """Check `token` against `secret` and the clock; return its claims.

    The tag is checked (in constant time) before the payload is parsed, so nothing from an
    unauthenticated token is interpreted. `now` is unix seconds (default time.time()).

    Raises:
        Unauthenticated: the token is empty, too long, not base64url, has a bad tag or an
            unreadable payload, or has expired. The message names `join_token`.
        ValueError: `secret` is shorter than 16 bytes (configuration error).
    """
    _check_secret(secret)
    if not token:
        raise Unauthenticated("join_token: missing")
    if len(token) > MAX_TOKEN_CHARS:
        raise Unauthenticated(f"join_token: longer than {MAX_TOKEN_CHARS} chars")
    try:
        raw = _b64decode(token)
    except (binascii.Error, ValueError):
        raise Unauthenticated("join_token: not base64url") from None
    if len(raw) <= TAG_BYTES:
        raise Unauthenticated("join_token: truncated")
    payload, tag = raw[:-TAG_BYTES], raw[-TAG_BYTES:]
    if not hmac.compare_digest(tag, _tag(secret, payload)):
        raise Unauthenticated("join_token: bad signature (wrong coordinator or tampered)")
    try:
        doc = json.loads(payload.decode("utf-8"))
        if doc.get("v") != 1:
            raise ValueError("version")
        claims = TokenClaims(
            label=str(doc["label"]), expires_unix=float(doc["exp"]), token_id=str(doc["id"])
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        raise Unauthenticated("join_token: unreadable payload") from None
    t = time.time() if now is None else now
    if not t <= claims.expires_unix:
        raise Unauthenticated(f"join_token: expired {t - claims.expires_unix:.0f} s ago")
    return claims


def create_secret(path: str | os.PathLike[str]) -> bytes:
    """Create a new 32-byte random secret at `path` (hex text, mode 0600) and return it.

    Raises:
        FileExistsError: `path` already exists (never overwrite: it would invalidate every
            token handed out).
    """
    p = pathlib.Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    secret = secrets.token_bytes(SECRET_BYTES)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret.hex() + "\n")
    return secret


def load_secret(path: str | os.PathLike[str]) -> bytes:
    """Read the hex secret written by `create_secret`.

    Raises:
        FileNotFoundError: `path` does not exist.
        ValueError: the file is not hex, holds fewer than 16 bytes, or is readable or writable
            by group/others (a leaked secret lets anyone mint tokens).
    """
    p = pathlib.Path(path)
    mode = p.stat().st_mode & 0o777
    if mode & 0o077:
        raise ValueError(f"{p}: secret file mode is {mode:o}, expected 600 (chmod 600 {p})")
    try:
        secret = bytes.fromhex(p.read_text().strip())
    except ValueError:
        raise ValueError(f"{p}: secret is not hex") from None
    _check_secret(secret)
    return secret


@dataclasses.dataclass(frozen=True)
class AllowList:
    """Set of raw 32-byte Ed25519 public keys allowed to join."""

    keys: frozenset[bytes]

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> AllowList:
        """Parse one hex public key (64 chars) per line; `#` starts a comment, blank lines are
        skipped, so `<hex>  # alice` works.

        Raises:
            FileNotFoundError: `path` does not exist.
            ValueError: a line is not a 64-char hex key (the message names the line number).
        """
        p = pathlib.Path(path)
        keys: set[bytes] = set()
        for n, line in enumerate(p.read_text().splitlines(), start=1):
            entry = line.split("#", 1)[0].strip()
            if not entry:
                continue
            try:
                key = bytes.fromhex(entry)
            except ValueError:
                key = b""
            if len(key) != 32:
                raise ValueError(f"{p}:{n}: expected a 64-char hex Ed25519 public key")
            keys.add(key)
        return cls(frozenset(keys))

    def __contains__(self, public_key: object) -> bool:
        return public_key in self.keys

    def __len__(self) -> int:
        return len(self.keys)

    def check(self, public_key: bytes) -> None:
        """Raises PermissionDenied("public_key: not on the allow-list") unless listed."""
        if public_key not in self.keys:
            raise PermissionDenied("public_key: not on the allow-list")


class Admission:
    """Admission policy: the join token when a secret is configured, the allow-list when one is
    configured, both when both are. With neither, every peer is admitted (open mode, for local
    experiments; the coordinator should log a warning at start-up when `open` is true)."""

    def __init__(self, secret: bytes | None, allow_list: AllowList | None) -> None:
        if secret is not None:
            _check_secret(secret)
        self.secret = secret
        self.allow_list = allow_list

    @property
    def open(self) -> bool:
        """True when no admission check is configured."""
        return self.secret is None and self.allow_list is None

    def admit(
        self, public_key: bytes, join_token: str, now: float | None = None
    ) -> TokenClaims | None:
        """Admit the peer holding `public_key` (raw 32 bytes) presenting `join_token`.

        Returns the token's claims when a token was checked, else None. The token is checked
        first, so a caller without a valid token learns nothing about the allow-list.
        `public_key` must already be authenticated (signed request), or the allow-list only
        proves the caller knows a public key.

        Raises:
            Unauthenticated: a secret is configured and the token is missing, invalid or
                expired.
            PermissionDenied: an allow-list is configured and `public_key` is not on it.
        """
        claims = None
        if self.secret is not None:
            claims = verify_token(self.secret, join_token, now)
        if self.allow_list is not None:
            self.allow_list.check(public_key)
        return claims
