"""What relays and peers share (docs/nat.md, "Relays"): the relay's wire protocol and the
end-to-end chunk signatures that keep a relay from changing tensors unnoticed.

The relay protocol is plain TCP with one ASCII header line per connection, then raw bytes:

- control (a NATed peer -> the relay, kept open): ``SHOAL-RELAY 1 REGISTER <pub> <ts_ns> <nonce>
  <sig>`` where `sig` is the peer's Ed25519 signature of `register_message` (so nobody registers
  under another peer's id; `ts_ns` within `REGISTER_SKEW_SECONDS` of the relay's clock, nonces
  single-use). The relay answers ``OK <relayed HOST:PORT> <token>`` or ``ERR <reason>``, then
  writes ``OPEN <conn id>`` each time someone dials the relayed address; the peer writes
  ``PING`` every `PING_SECONDS` (keeps its NAT mapping and tells the relay it is alive).
- accept (the peer -> the relay, one per OPEN): ``SHOAL-RELAY 1 ACCEPT <conn id> <token>``; from
  then on the relay splices this connection with the dialler's, byte for byte.

A relay forwards TLS records between the peers when TLS is on (it holds no key: it reads
nothing). With TLS off it could change bytes: every chunk sent to a relayed participant carries
`Chunk.chunk_signature`, the sender's Ed25519 signature over `chunk_digest` (every field but the
signature itself), checked by the receiver before anything else; a failed check
is the relay's fault (`RELAY_ALTERED` in the refusal, docs/nat.md) and the round aborts without
excluding a peer. Imports neither side.
"""

from __future__ import annotations

import hashlib
import os
import struct
import time

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from shoal.common.identity import peer_id_of, public_bytes
from shoal.v1 import shoal_pb2 as pb

MAGIC = "SHOAL-RELAY 1"
REGISTER_SKEW_SECONDS = 30.0
PING_SECONDS = 5.0  # the peer's keepalive on its control connection
MAX_LINE = 1024  # bytes of one header line
SIG_DOMAIN = b"shoal-relay-register\x00"
CHUNK_DOMAIN = b"shoal-chunk\x00"
# In a refusal's details: the chunk changed between its sender and this peer (through a relay).
RELAY_ALTERED = "altered in transit"


class RelayRefused(Exception):
    """The relay refused a registration (`ERR <reason>`), or spoke no relay protocol."""


class RelayUnreachable(OSError):
    """No relay answered at the address for the whole registration timeout (the message names
    the relay and the last connection error)."""


def register_message(public_key: bytes, ts_ns: int, nonce: bytes) -> bytes:
    """The bytes a peer signs to register: domain, raw public key (32), unix ns, nonce."""
    return SIG_DOMAIN + public_key + struct.pack(">Q", ts_ns) + nonce


def register_line(key: Ed25519PrivateKey, now: float | None = None) -> bytes:
    """The control connection's first line for `key` (newline-terminated)."""
    pub = public_bytes(key)
    ts_ns = int((time.time() if now is None else now) * 1e9)
    nonce = os.urandom(16)
    sig = key.sign(register_message(pub, ts_ns, nonce))
    return f"{MAGIC} REGISTER {pub.hex()} {ts_ns} {nonce.hex()} {sig.hex()}\n".encode()


def check_register(words: list[str], now: float | None = None) -> tuple[str, bytes]:
    """Check a REGISTER line's words after the magic (``REGISTER pub ts nonce sig``); returns
    (peer id, nonce). Raises ValueError with the reason (bad form, stale time, bad signature);
    the caller refuses a replayed nonce."""
    if len(words) != 5 or words[0] != "REGISTER":
        raise ValueError("expected REGISTER <pub> <ts_ns> <nonce> <sig>")
    pub, nonce, sig = bytes.fromhex(words[1]), bytes.fromhex(words[3]), bytes.fromhex(words[4])
    ts_ns = int(words[2])
    if len(pub) != 32 or len(nonce) != 16 or len(sig) != 64:
        raise ValueError("bad field lengths")
    t = time.time() if now is None else now
    if abs(ts_ns / 1e9 - t) > REGISTER_SKEW_SECONDS:
        raise ValueError(f"timestamp more than {REGISTER_SKEW_SECONDS:.0f}s off the relay's clock")
    try:
        Ed25519PublicKey.from_public_bytes(pub).verify(sig, register_message(pub, ts_ns, nonce))
    except InvalidSignature:
        raise ValueError("signature does not verify for that key") from None
    return peer_id_of(pub), nonce


def chunk_digest(c: pb.Chunk) -> bytes:
    """BLAKE2b-256 over every field of `c` but `chunk_signature`, in a fixed framing."""
    h = hashlib.blake2b(digest_size=32)
    h.update(CHUNK_DOMAIN)
    h.update(struct.pack(">QIIIIQIIQ", c.round, c.attempt, c.phase, c.step, c.shard, c.offset, c.dtype, c.codec,
                         c.shm_offset))
    for field in (c.sender.encode(), c.shm_name.encode(), b"".join(struct.pack(">Q", s) for s in c.shape),
                  c.scale, c.ticket, c.data):
        h.update(struct.pack(">Q", len(field)))
        h.update(field)
    return h.digest()


def sign_chunk(key: Ed25519PrivateKey, c: pb.Chunk) -> None:
    """Set `c.chunk_signature` (the sender's signature over `chunk_digest`)."""
    c.chunk_signature = key.sign(chunk_digest(c))


def chunk_signature_ok(public_key: bytes, c: pb.Chunk) -> bool:
    """Whether `c.chunk_signature` is `public_key`'s signature over the chunk as received."""
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(c.chunk_signature, chunk_digest(c))
        return True
    except (InvalidSignature, ValueError):
        return False
