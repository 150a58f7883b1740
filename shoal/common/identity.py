"""Peer identity: Ed25519 key pairs and the peer id derived from the public key.

A peer's id is the hex BLAKE2b-128 digest of its raw 32-byte Ed25519 public key, so an id
cannot be claimed without the matching private key. Keys are stored PEM-encoded (PKCS#8, no
passphrase) with 0600 permissions.

Control-plane requests are signed with that key (`sign_metadata`) and checked by the
coordinator (`RequestVerifier`): the signature covers the method, a timestamp, a single-use
nonce and the serialized request, so it can be neither replayed nor moved to another call, and
the request's `peer_id` / `public_key` must name the signer. This module does not do transport
security (see `shoal.common.certs`) nor admission (see `shoal.coordinator.admission`).

One process per key: a peer holds its key file with `hold_key` (an exclusive `fcntl.flock` for
the life of the process), so a second local process with the same file is refused at start with
`KeyInUse`. Without `--key` a peer's key lives in the per-user data directory
(`$XDG_DATA_HOME/shoal`, default `~/.local/share/shoal`): `peer-<name>.key` (`peer_key_path`).
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import hashlib
import heapq
import os
import pathlib
import re
import time
from collections.abc import Sequence

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from google.protobuf.message import Message

from shoal.common.errors import ResourceExhausted, Unauthenticated

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


def load_key(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    """Load the Ed25519 private key at `path` (never creates one).

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file does not hold an unencrypted PEM Ed25519 private key.
    """
    p = pathlib.Path(path)
    try:
        key = serialization.load_pem_private_key(p.read_bytes(), password=None)
    except (ValueError, TypeError):  # not PEM, or encrypted
        raise ValueError(f"{p}: not a PEM Ed25519 private key without passphrase") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{p}: not an Ed25519 private key")
    return key


def load_or_create_key(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    """Load the Ed25519 private key at `path`, creating it (mode 0600) when absent.

    Processes that start together on one path (standby coordinators sharing a ticket key) all
    end up with the same key: a new key is written to a temporary file and linked into place,
    which fails when another process got there first; its key, complete by then, is loaded.

    Raises:
        ValueError: the file exists but does not hold an unencrypted PEM Ed25519 private key.
        OSError: the file cannot be read or created (e.g. its directory cannot be created).
    """
    p = pathlib.Path(path)
    if p.exists():
        return load_key(p)
    p.parent.mkdir(parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    tmp = p.with_name(f".{p.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, p)  # atomic, and never replaces a key another process created meanwhile
        except FileExistsError:
            raise
        except OSError as exc:  # a file system without hard links: create in place, exclusively
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
                raise
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(pem)
    except FileExistsError:
        return load_key(p)
    finally:
        tmp.unlink(missing_ok=True)
    return key


# ---------------------------------------------------------------- one process per key


class KeyInUse(Exception):
    """Another process on this machine holds the key file (`hold_key`). `str()` is one line naming
    the file, the peer id and the fix."""


@dataclasses.dataclass(frozen=True)
class HeldKey:
    """A key this process holds: the key, its file, and the open descriptor carrying the lock
    (released when the process exits)."""

    key: Ed25519PrivateKey
    path: pathlib.Path
    fd: int

    @property
    def peer_id(self) -> str:
        return peer_id_of(public_bytes(self.key))


_held: dict[pathlib.Path, HeldKey] = {}  # the keys this process holds, by resolved path


def hold_key(path: str | os.PathLike[str]) -> HeldKey:
    """Load (or create, mode 0600) the key at `path` and lock its file for this process.

    The lock is an exclusive, non-blocking `fcntl.flock` on the file, held until the process
    exits (the kernel drops it even on SIGKILL). Holding the same file twice in one process
    returns the same `HeldKey`.

    Raises:
        KeyInUse: another process holds the file.
        ValueError, OSError: as `load_or_create_key`.
    """
    key = load_or_create_key(path)
    real = pathlib.Path(path).resolve()
    if real in _held:
        return _held[real]
    fd = os.open(real, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise KeyInUse(f"key file {path} (peer {peer_id_of(public_bytes(key))}) is in use by another process on "
                       f"this machine: one process per identity; stop it, or give this one its own key "
                       f"(--key FILE or --name NAME)") from None
    held = _held[real] = HeldKey(key, pathlib.Path(path), fd)
    return held


def data_dir() -> pathlib.Path:
    """The per-user data directory of shoal: `$XDG_DATA_HOME/shoal`, default `~/.local/share/shoal`."""
    base = os.environ.get("XDG_DATA_HOME") or str(pathlib.Path.home() / ".local" / "share")
    return pathlib.Path(base) / "shoal"


def peer_key_path(name: str) -> pathlib.Path:
    """The default key file of the peer called `name`: `data_dir()/peer-<name>.key`.

    Raises:
        ValueError: `name` is empty or holds characters other than letters, digits, `.`, `_`, `-`.
    """
    if not name or not all(c.isalnum() or c in "._-" for c in name) or name.startswith("."):
        raise ValueError(f"--name {name!r}: use letters, digits, '.', '_' and '-'")
    return data_dir() / f"peer-{name}.key"


def hold_default_key(name: str | None, listen_port: int, *, slots: int = 1000) -> HeldKey:
    """The key of a peer started without `--key`: `peer-<name>.key` with a name, else
    `peer-<listen port>.key` for a fixed port, else the first of `peer-1.key`, `peer-2.key`, ...
    that no other process holds (so peers started side by side get distinct identities, and a
    peer restarted alone gets its old one back).

    Raises:
        KeyInUse: the named (or port's) key is held by another process, or `slots` are all held.
        ValueError: a bad name; OSError: the data directory cannot be created.
    """
    if name is not None or listen_port:
        return hold_key(peer_key_path(name if name is not None else str(listen_port)))
    for n in range(1, slots + 1):
        try:
            return hold_key(peer_key_path(str(n)))
        except KeyInUse:
            continue
    raise KeyInUse(f"{data_dir()}: the {slots} default peer keys are all in use; pass --key or --name")


# ---------------------------------------------------------------- request signing
#
# A control-plane request is signed over a domain-separated message so a signature for one
# method, moment or body cannot be replayed as another:
#
#   b"shoal.v1\x00" | u16be(len(method)) | method (UTF-8) | u64be(ts_ns) | nonce (16 bytes)
#   | request.SerializeToString(deterministic=True)
#
# The fixed-width fields after the length-prefixed method make the encoding unambiguous.

SIG_DOMAIN = b"shoal.v1\x00"
MD_PUBKEY = "x-shoal-pubkey"
# A peer process's random instance id (hex), on every control-plane call: one process per identity
# (coordinator.admitted_keys). Not signed: it guards against accidents, not against the key's holder.
MD_INSTANCE = "x-shoal-instance"
MD_TS = "x-shoal-ts"
MD_NONCE = "x-shoal-nonce"
MD_SIG = "x-shoal-sig"
NONCE_BYTES = 16
_MD_KEYS = (MD_PUBKEY, MD_TS, MD_NONCE, MD_SIG)
_HEX = re.compile(r"[0-9a-fA-F]*")  # exactly hex digits (bytes.fromhex would also skip whitespace)
# Request fields that carry the caller's peer id and must therefore name the signer.
_PEER_ID_FIELDS = ("peer_id", "sender")


def _signed_message(method: str, ts_ns: int, nonce: bytes, body: bytes) -> bytes:
    m = method.encode("utf-8")
    if len(m) > 0xFFFF:
        raise ValueError("method: longer than 65535 bytes")
    return b"".join(
        (SIG_DOMAIN, len(m).to_bytes(2, "big"), m, ts_ns.to_bytes(8, "big"), nonce, body)
    )


def sign_metadata(
    key: Ed25519PrivateKey, method: str, request: Message, now: float | None = None
) -> tuple[tuple[str, str], ...]:
    """gRPC metadata that signs `request` for `method` with `key`.

    `method` is the full gRPC method path, e.g. "/shoal.v1.Coordinator/Join"; the server must
    verify with the same string. `now` is unix seconds (default: `time.time()`).

    Returns four (key, value) pairs, all lowercase keys and ASCII values:
    `x-shoal-pubkey` (64 hex chars, raw public key), `x-shoal-ts` (decimal unix nanoseconds),
    `x-shoal-nonce` (32 hex chars, 16 random bytes), `x-shoal-sig` (128 hex chars, Ed25519).
    Pass them as `metadata=` on the call; each call needs fresh metadata (the nonce is single use).
    """
    ts_ns = time.time_ns() if now is None else int(round(now * 1e9))
    nonce = os.urandom(NONCE_BYTES)
    body = request.SerializeToString(deterministic=True)
    sig = key.sign(_signed_message(method, ts_ns, nonce, body))
    return (
        (MD_PUBKEY, public_bytes(key).hex()),
        (MD_TS, str(ts_ns)),
        (MD_NONCE, nonce.hex()),
        (MD_SIG, sig.hex()),
    )


def _hex_field(values: dict[str, str], name: str, nbytes: int) -> bytes:
    raw = values[name]
    if len(raw) != 2 * nbytes:
        raise Unauthenticated(f"{name}: expected {2 * nbytes} hex chars, got {len(raw)}")
    # bytes.fromhex skips whitespace; insist on exactly 2*nbytes hex digits. One compiled match:
    # a per-character check cost 34 us a call, a third of the signature check (10,000 members).
    if _HEX.fullmatch(raw) is None:
        raise Unauthenticated(f"{name}: not hex")
    return bytes.fromhex(raw)


class RequestVerifier:
    """Checks signed control-plane requests: signature, freshness, single use, identity.

    A request is accepted when its timestamp is within `window_seconds` of the verifier's clock
    (either side, so peer clocks may drift by up to the window), its nonce has not been seen
    from the same key within the window, and the signature verifies. A nonce is remembered
    until its timestamp is `window_seconds` old, after which the timestamp check alone refuses
    a replay; at most `max_nonces` are held at a time.

    The signature is bound to the caller's identity: when the request has a non-empty
    `peer_id` or `sender` field it must equal `peer_id_of(public key)`, and when it has a
    non-empty `public_key` field it must equal the signing key. For a client stream
    (`Peer/PushChunks`) sign and verify the first message (the chunk carrying the ticket):
    that authenticates `Chunk.sender`, and the receiver must then refuse any later chunk whose
    sender, round or attempt differ from the first.

    Put a per-host `RateLimiter` in front: anyone can make keys, so without one a flood of
    validly signed requests fills the nonce memory and `verify` answers RESOURCE_EXHAUSTED
    to everyone until the window passes.

    Not thread-safe; use one instance per event loop (servicers on one grpc.aio server share it).
    """

    def __init__(self, window_seconds: float = 30.0, max_nonces: int = 100_000) -> None:
        if window_seconds <= 0:
            raise ValueError("window_seconds: must be > 0")
        if max_nonces < 1:
            raise ValueError("max_nonces: must be >= 1")
        self.window_seconds = float(window_seconds)
        self.max_nonces = int(max_nonces)
        self._seen: set[bytes] = set()
        self._expiry: list[tuple[int, bytes]] = []  # min-heap of (expiry ns, pubkey|nonce)

    def __len__(self) -> int:
        """Nonces currently remembered."""
        return len(self._seen)

    def verify(
        self,
        metadata: Sequence[tuple[str, str | bytes]],
        method: str,
        request: Message,
        now: float | None = None,
    ) -> bytes:
        """Verify the signature metadata of `request` for `method`; return the raw public key.

        `metadata` is the call's invocation metadata (`context.invocation_metadata()`), `method`
        the full gRPC method path the client signed, `now` unix seconds (default: time.time()).
        The nonce is recorded only when every check passes, so a refused request does not
        burn the nonce of a genuine one.

        Raises:
            Unauthenticated: a signature field is missing, duplicated or malformed; the
                timestamp is more than `window_seconds` from `now`; the nonce was already
                used; the signature does not verify; or the request's `peer_id` /
                `public_key` field names another identity. One-line message naming the field.
            ResourceExhausted: `max_nonces` unexpired nonces are already held (the server
                is being flooded); the caller should retry later.
        """
        now_ns = time.time_ns() if now is None else int(round(now * 1e9))
        values: dict[str, str] = {}
        for k, v in metadata:
            k = k.lower()
            if k not in _MD_KEYS:
                continue
            if k in values:
                raise Unauthenticated(f"{k}: given more than once")
            if isinstance(v, bytes):
                try:
                    v = v.decode("ascii")
                except UnicodeDecodeError:
                    raise Unauthenticated(f"{k}: not ASCII") from None
            values[k] = v
        for k in _MD_KEYS:
            if k not in values:
                raise Unauthenticated(f"{k}: missing request signature metadata")

        pub = _hex_field(values, MD_PUBKEY, 32)
        nonce = _hex_field(values, MD_NONCE, NONCE_BYTES)
        sig = _hex_field(values, MD_SIG, 64)
        ts_raw = values[MD_TS]
        if not (ts_raw.isascii() and ts_raw.isdigit()) or len(ts_raw) > 20:
            raise Unauthenticated(f"{MD_TS}: expected decimal unix nanoseconds")
        ts_ns = int(ts_raw)
        if ts_ns >= 1 << 64:
            raise Unauthenticated(f"{MD_TS}: out of range")
        window_ns = int(self.window_seconds * 1e9)
        skew_s = (ts_ns - now_ns) / 1e9
        if ts_ns < now_ns - window_ns:
            raise Unauthenticated(
                f"{MD_TS}: stale by {-skew_s:.1f} s (window {self.window_seconds:g} s)"
            )
        if ts_ns > now_ns + window_ns:
            raise Unauthenticated(
                f"{MD_TS}: {skew_s:.1f} s in the future (window {self.window_seconds:g} s)"
            )

        try:
            body = request.SerializeToString(deterministic=True)
            Ed25519PublicKey.from_public_bytes(pub).verify(
                sig, _signed_message(method, ts_ns, nonce, body)
            )
        except (InvalidSignature, ValueError):
            raise Unauthenticated(f"{MD_SIG}: signature does not verify for {method}") from None

        fields = request.DESCRIPTOR.fields_by_name
        for name in _PEER_ID_FIELDS:
            if name in fields:
                claimed = getattr(request, name)
                if claimed and claimed != peer_id_of(pub):
                    raise Unauthenticated(f"{name}: does not match the signing key")
        if "public_key" in fields:
            claimed_key = getattr(request, "public_key")
            if claimed_key and claimed_key != pub:
                raise Unauthenticated("public_key: does not match the signing key")

        self._prune(now_ns)
        entry = pub + nonce
        if entry in self._seen:
            raise Unauthenticated(f"{MD_NONCE}: replayed")
        if len(self._seen) >= self.max_nonces:
            raise ResourceExhausted(
                f"{MD_NONCE}: {self.max_nonces} requests already seen in the last "
                f"{self.window_seconds:g} s; retry later"
            )
        self._seen.add(entry)
        heapq.heappush(self._expiry, (ts_ns + window_ns, entry))
        return pub

    def _prune(self, now_ns: int) -> None:
        while self._expiry and self._expiry[0][0] < now_ns:
            _, entry = heapq.heappop(self._expiry)
            self._seen.discard(entry)
