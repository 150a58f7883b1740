"""What relays and peers share (docs/nat.md, "Relays"): the relay's wire protocol and the
end-to-end chunk signatures that keep a relay from changing tensors unnoticed.

The relay protocol is plain TCP with one ASCII header line per connection, then raw bytes:

- control (a NATed peer -> the relay, kept open): ``SHOAL-RELAY 1 REGISTER <pub> <ts_ns> <nonce>
  <sig> <relay> <port> <ticket>``. `sig` is the peer's Ed25519 signature of `register_message`
  (so nobody registers under another peer's id); it covers `relay`, the relay's address as the
  peer dials it, so a registration line replays at no other relay (the relay refuses a name that
  is not its own), and `port`, the relayed port the peer held before (0: none; the relay binds it
  again when it is free, so that a restarted relay hands out the same address). `ts_ns` lies
  within `REGISTER_SKEW_SECONDS` of the relay's clock and nonces are single-use. `ticket` (hex;
  ``-`` for none) is the coordinator's relay ticket (`issue_relay_ticket`): a relay started with
  the coordinator's public key admits only the keys the coordinator admitted, until the ticket
  expires. The relay answers ``OK <relayed HOST:PORT> <token> <capacity>`` or ``ERR <reason>``,
  then writes ``OPEN <conn id>`` each time someone dials the relayed address; the peer writes
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
import math
import os
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from shoal.common.identity import peer_id_of, public_bytes
from shoal.v1 import shoal_pb2 as pb

MAGIC = "SHOAL-RELAY 1"
REGISTER_SKEW_SECONDS = 30.0
RELAY_TICKET_DOMAIN = b"shoal-relay-ticket\x00"
RELAY_TICKET_BYTES = 32 + 8 + 64  # peer public key, expiry (unix ns, u64be), the coordinator's signature
# A refusal of the ticket (none, expired, not the coordinator's) starts with this: the peer joins
# again for a fresh one.
TICKET_REFUSED = "relay ticket"
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


def register_message(public_key: bytes, ts_ns: int, nonce: bytes, relay: str = "", port: int = 0) -> bytes:
    """The bytes a peer signs to register: domain, raw public key (32), unix ns (u64be), nonce
    (16), the port it held (u16be), the relay's address as dialled (ASCII)."""
    return SIG_DOMAIN + public_key + struct.pack(">QH", ts_ns, port) + nonce + relay.encode("ascii")


def register_line(key: Ed25519PrivateKey, relay: str, port: int = 0, ticket: bytes = b"",
                  now: float | None = None) -> bytes:
    """The control connection's first line for `key` at `relay` (HOST:PORT as dialled; port: the
    relayed port held before, 0 = none; ticket: the coordinator's relay ticket, b"" = none),
    newline-terminated."""
    pub = public_bytes(key)
    ts_ns = int((time.time() if now is None else now) * 1e9)
    nonce = os.urandom(16)
    sig = key.sign(register_message(pub, ts_ns, nonce, relay, port))
    return (f"{MAGIC} REGISTER {pub.hex()} {ts_ns} {nonce.hex()} {sig.hex()} {relay} {port} "
            f"{ticket.hex() or '-'}\n").encode()


@dataclass(frozen=True)
class Registration:
    """A REGISTER line that passed `check_register`."""

    peer_id: str
    public_key: bytes
    nonce: bytes
    port: int  # the relayed port the peer held before (0: none)
    ticket: bytes  # the coordinator's relay ticket (b"": none given)


def check_register(words: list[str], names: frozenset[str] | set[str], now: float | None = None) -> Registration:
    """Check a REGISTER line's words after the magic (``REGISTER pub ts nonce sig relay port
    ticket``) at a relay known as `names` (HOST:PORT each). Raises ValueError with the reason (bad
    form, stale time, another relay's name, bad signature); the caller refuses a replayed nonce and
    checks the ticket (`check_relay_ticket`)."""
    if len(words) != 8 or words[0] != "REGISTER":
        raise ValueError("expected REGISTER <pub> <ts_ns> <nonce> <sig> <relay> <port> <ticket>")
    if not (words[2].isdigit() and len(words[2]) <= 20 and words[6].isdigit() and len(words[6]) <= 5):
        raise ValueError("ts_ns and port: must be unsigned integers (ns since the epoch; 0..65535)")
    pub, nonce, sig = bytes.fromhex(words[1]), bytes.fromhex(words[3]), bytes.fromhex(words[4])
    ticket = b"" if words[7] == "-" else bytes.fromhex(words[7])
    ts_ns, port, relay = int(words[2]), int(words[6]), words[5]
    if len(pub) != 32 or len(nonce) != 16 or len(sig) != 64 or ts_ns >= 1 << 64 or port > 65535:
        raise ValueError("bad field lengths")
    t = time.time() if now is None else now
    if abs(ts_ns / 1e9 - t) > REGISTER_SKEW_SECONDS:
        raise ValueError(f"timestamp more than {REGISTER_SKEW_SECONDS:.0f}s off the relay's clock")
    if relay not in names:
        raise ValueError(f"registration is for relay {relay[:64]}, this relay is {', '.join(sorted(names))}")
    try:
        Ed25519PublicKey.from_public_bytes(pub).verify(sig, register_message(pub, ts_ns, nonce, relay, port))
    except InvalidSignature:
        raise ValueError("signature does not verify for that key") from None
    return Registration(peer_id_of(pub), pub, nonce, port, ticket)


def issue_relay_ticket(coordinator_key: Ed25519PrivateKey, peer_public_key: bytes, ttl_seconds: float,
                       now: float | None = None) -> bytes:
    """The coordinator's relay ticket for an admitted member's key (32 raw bytes), valid
    `ttl_seconds` from `now` (unix s): public key (32) | expiry ns (u64be) | Ed25519 signature (64)
    over `RELAY_TICKET_DOMAIN` and the first 40 bytes. Raises ValueError for a bad key length or ttl."""
    if len(peer_public_key) != 32 or not (ttl_seconds > 0 and math.isfinite(ttl_seconds)):
        raise ValueError("a 32-byte public key and a positive, finite ttl_seconds")
    body = peer_public_key + struct.pack(">Q", int(((time.time() if now is None else now) + ttl_seconds) * 1e9))
    return body + coordinator_key.sign(RELAY_TICKET_DOMAIN + body)


def check_relay_ticket(ticket: bytes, coordinator_keys: Iterable[bytes], peer_public_key: bytes,
                       now: float | None = None) -> float:
    """Check that `ticket` is a coordinator's (one of `coordinator_keys`, raw 32 bytes each) for
    `peer_public_key` and unexpired; returns its expiry (unix s). Raises ValueError starting with
    `TICKET_REFUSED` and the reason."""
    if not ticket:
        raise ValueError(f"{TICKET_REFUSED} required: this relay admits only the coordinator's members "
                         f"(the peer gets one when it joins)")
    if len(ticket) != RELAY_TICKET_BYTES or ticket[:32] != peer_public_key:
        raise ValueError(f"{TICKET_REFUSED} is not for this key")
    body, sig = ticket[:40], ticket[40:]
    for k in coordinator_keys:
        try:
            Ed25519PublicKey.from_public_bytes(k).verify(sig, RELAY_TICKET_DOMAIN + body)
            break
        except InvalidSignature:
            continue
    else:
        raise ValueError(f"{TICKET_REFUSED} is not signed by this relay's coordinator")
    expires = struct.unpack(">Q", body[32:])[0] / 1e9
    if expires <= (time.time() if now is None else now):
        raise ValueError(f"{TICKET_REFUSED} expired")
    return expires


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
