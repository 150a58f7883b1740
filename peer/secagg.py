"""Secure aggregation with dropouts: SecAgg+ (Bell, Bonawitz, Gascón, Lepoint, Raykova 2020,
"Secure Single-Server Aggregation with (Poly)Logarithmic Overhead", CCS), as a pure core.

Responsible for: what one participant of a secure round computes (`SecAggParticipant`: its keys,
the Shamir shares it hands its neighbours, its masked contribution, the shares it reveals for
unmasking), the neighbour graph (`neighbour_graph`), the fixed-point ring (`quantize`,
`dequantize`) and the unmasking of the exact integer sum of the masked rows with dropouts
(`unmask`). Not responsible for moving anything: keys, shares and masked rows travel however the
caller's round protocol moves them (no sockets here, no clocks); nor for who may see what (the
threat model, docs/security.md).

The protocol for one round of p participants, each with a vector x_i `(n,)` float32:

1. Graph: participant i's neighbours are its k nearest on a ring of the participants shuffled by
   a public seed (the Harary graph H(k, p) on a random order: k-regular, k even), as in SecAgg+.
2. Keys: i draws an X25519 key pair (the *mask key*) and a 32-byte *self-mask seed* b_i, and
   publishes the public key. It splits b_i and its mask key's private bytes into Shamir t-of-k
   shares (x-coordinates = neighbour position + 1) and gives neighbour j one share of each.
3. Mask: y_i = q(x_i) + PRG(b_i) + Σ_{j ∈ N(i)} sign(j - i) · PRG(s_ij)  (mod 2^32), where q is
   fixed-point quantization into Z_2^32 (two's complement, `frac_bits` fractional bits, values
   clipped to ±`clip`), s_ij = HKDF-SHA256(X25519(i, j), context) and PRG is ChaCha20's key
   stream read as little-endian uint32. The masked row y_i is uniform on Z_2^32 for anyone who
   knows neither b_i nor both pairwise seeds of one of i's pairs.
4. Sum: whoever reduces adds the masked rows of the participants that sent (`sent`) as uint32
   (numpy wraps: an exact sum mod 2^32, the same bits on every machine). Pairwise masks cancel
   between two senders.
5. Unmask: every surviving neighbour reveals, for each of its neighbours j, the share of b_j when
   j sent (its self mask must come off) or the share of j's mask key when j did not (the masks
   j's neighbours added towards it must come off), never both for one j. With t shares of each,
   `unmask` reconstructs the seeds, subtracts the self masks of the senders and the dangling
   pairwise masks of the non-senders, and decodes the sum. A participant that dropped *after*
   sending is therefore unmasked by its neighbours' shares; one that dropped *before* sending is
   removed by reconstructing its mask key. Fewer than t revealed shares for anyone raises
   `SecAggAbort` (the round aborts and is retried).

Sizes: exact while |Σ x_i| · 2^frac_bits < 2^31; `SecAggParams.check` refuses parameters where
p · clip · 2^frac_bits can reach it. Quantization error ≤ 2^-(frac_bits+1) per element per
participant (round half to even).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from shoal.common.errors import InvalidArgument

# Shamir's field: the Mersenne prime 2^521 - 1 holds any 32-byte secret.
PRIME = (1 << 521) - 1
SHARE_BYTES = 66  # one field element, big-endian
MODULUS_BITS = 32


class SecAggAbort(Exception):
    """The round cannot be unmasked (fewer than t shares for some participant, or fewer than t
    survivors): the attempt aborts; the caller retries without the dropped participants."""


@dataclass(frozen=True)
class SecAggParams:
    """degree k (even; neighbours per participant; k >= p - 1 makes the graph complete, degree
    p - 1), threshold t (shares needed to reconstruct; 2 <= t <= k),
    clip (elements clipped to [-clip, clip] before quantization), frac_bits (fixed-point
    fractional bits)."""

    degree: int = 4
    threshold: int = 3
    clip: float = 8.0
    frac_bits: int = 16

    def check(self, participants: int) -> None:
        """Raises InvalidArgument naming the first unusable parameter for `participants`."""
        if participants < 2:
            raise InvalidArgument(f"secure aggregation needs at least 2 participants, got {participants}")
        k = self.degree_for(participants)
        if not 2 <= self.threshold <= k:
            raise InvalidArgument(f"threshold: must be in 2..{k} (the degree: shares go to the neighbours), "
                                  f"got {self.threshold}")
        if not 0 <= self.frac_bits <= 30:
            raise InvalidArgument(f"frac_bits: must be in 0..30, got {self.frac_bits}")
        if not self.clip > 0 or participants > self.max_participants():
            raise InvalidArgument(f"clip: {participants} x clip {self.clip} x 2^{self.frac_bits} must stay below "
                                  f"2^31 (the sum must fit the ring Z_2^32)")

    def max_participants(self) -> int:
        """The most participants whose fixed-point sum fits the ring: p · clip · 2^frac_bits < 2^31
        (0 for a clip <= 0)."""
        unit = self.clip * 2 ** self.frac_bits
        return max(0, math.ceil(2 ** 31 / unit) - 1) if unit > 0 else 0

    def check_settings(self) -> None:
        """Raises InvalidArgument naming the first parameter unusable for any participant count."""
        if self.degree < 2 or self.degree % 2:
            raise InvalidArgument(f"degree: must be even and >= 2, got {self.degree}")
        if not 2 <= self.threshold <= self.degree:
            raise InvalidArgument(f"threshold: must be in 2..{self.degree} (the degree), got {self.threshold}")
        if not 0 <= self.frac_bits <= 30:
            raise InvalidArgument(f"frac_bits: must be in 0..30, got {self.frac_bits}")
        if not self.clip > 0 or not np.isfinite(self.clip):
            raise InvalidArgument(f"clip: must be > 0, got {self.clip}")

    def for_participants(self, participants: int) -> SecAggParams:
        """These parameters for a round of `participants`: the threshold capped at the graph's
        degree (a round of p <= k participants has a complete graph of degree p - 1)."""
        k = self.degree_for(participants) if participants >= 2 else 1
        return dataclasses.replace(self, threshold=max(2, min(self.threshold, k)))

    def degree_for(self, participants: int) -> int:
        """The graph's degree for `participants`: complete (p - 1) when k reaches it, else k."""
        if self.degree >= participants - 1:
            return participants - 1
        if self.degree < 2 or self.degree % 2:
            raise InvalidArgument(f"degree: must be even and >= 2, got {self.degree}")
        return self.degree


# ------------------------------------------------------------------ fixed point


def quantize(x: np.ndarray, params: SecAggParams) -> np.ndarray:
    """`x` `(n,)` float -> `(n,)` uint32: clipped to ±clip, times 2^frac_bits, rounded half to
    even, two's complement. Raises InvalidArgument for non-finite values."""
    x = np.asarray(x, dtype=np.float64)
    if not np.isfinite(x).all():
        raise InvalidArgument("secure aggregation: the contribution holds non-finite values")
    q = np.rint(np.clip(x, -params.clip, params.clip) * 2.0 ** params.frac_bits).astype(np.int64)
    return (q & 0xFFFFFFFF).astype(np.uint32)


def dequantize(total: np.ndarray, params: SecAggParams) -> np.ndarray:
    """The unmasked sum `(n,)` uint32 -> `(n,)` float32 (two's complement, / 2^frac_bits)."""
    return (np.asarray(total, dtype=np.uint32).view(np.int32).astype(np.float64) / 2.0 ** params.frac_bits).astype(
        np.float32)


def prg(seed: bytes, n: int) -> np.ndarray:
    """`(n,)` uint32: ChaCha20's key stream under the 32-byte `seed` (zero nonce: each seed is
    used for one stream only), little-endian."""
    enc = Cipher(algorithms.ChaCha20(seed, bytes(16)), mode=None).encryptor()
    return np.frombuffer(enc.update(bytes(4 * n)), dtype="<u4").astype(np.uint32)


# ------------------------------------------------------------------ graph


def neighbour_graph(participants: int, params: SecAggParams, seed: bytes) -> tuple[tuple[int, ...], ...]:
    """Per position 0..p-1, its neighbours' positions (sorted): the Harary graph H(k, p) on the
    order of a permutation drawn from the public `seed` (SecAgg+'s random k-regular graph).
    Symmetric; every position has exactly `params.degree_for(p)` neighbours."""
    p = participants
    k = params.degree_for(p)
    order = np.random.default_rng(np.frombuffer(hashlib.sha256(seed).digest(), dtype=np.uint32)).permutation(p)
    where = {int(v): i for i, v in enumerate(order)}
    out = []
    for v in range(p):
        i = where[v]
        if k == p - 1:
            near = [u for u in range(p) if u != v]
        else:
            near = [int(order[(i + d) % p]) for d in range(1, k // 2 + 1)]
            near += [int(order[(i - d) % p]) for d in range(1, k // 2 + 1)]
        out.append(tuple(sorted(set(near))))
    return tuple(out)


# ------------------------------------------------------------------ Shamir


def shamir_split(secret: bytes, xs: Iterable[int], threshold: int) -> dict[int, int]:
    """Shamir (1979) t-of-m sharing of `secret` (<= 64 bytes) over GF(2^521 - 1): the value at
    each x in `xs` (distinct, 1..PRIME-1) of a random polynomial of degree t - 1 whose constant
    term is the secret. Any t shares give the secret; t - 1 give no information about it."""
    s = int.from_bytes(secret, "big")
    coeffs = [s] + [secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    out = {}
    for x in xs:
        y = 0
        for c in reversed(coeffs):
            y = (y * x + c) % PRIME
        out[x] = y
    return out


def shamir_combine(shares: Mapping[int, int], threshold: int, length: int = 32) -> bytes:
    """The secret of `length` bytes from at least `threshold` shares {x: y} (Lagrange at 0).
    Raises SecAggAbort with fewer shares. With wrong or too few shares the result is garbage,
    not an error (Shamir has no integrity: the caller checks what it reconstructs)."""
    if len(shares) < threshold:
        raise SecAggAbort(f"{len(shares)} shares, {threshold} needed")
    pts = sorted(shares.items())[:threshold]
    s = 0
    for i, (xi, yi) in enumerate(pts):
        num, den = 1, 1
        for j, (xj, _) in enumerate(pts):
            if i != j:
                num = num * (-xj) % PRIME
                den = den * (xi - xj) % PRIME
        s = (s + yi * num * pow(den, -1, PRIME)) % PRIME
    if s >= 1 << (8 * length):
        return (s % (1 << (8 * length))).to_bytes(length, "big")  # wrong shares: garbage of the right size
    return s.to_bytes(length, "big")


# ------------------------------------------------------------------ the participant


@dataclass(frozen=True)
class Share:
    """What participant `owner` gives neighbour position `holder`: the Shamir shares (x = holder + 1)
    of its self-mask seed and of its mask key's private bytes."""

    owner: int
    holder: int
    seed_share: int
    key_share: int


def pairwise_seed(mine: X25519PrivateKey, theirs: bytes, context: bytes) -> bytes:
    """s_ij: HKDF-SHA256 of the X25519 shared secret, bound to `context` (run, round, attempt)."""
    shared = mine.exchange(X25519PublicKey.from_public_bytes(theirs))
    return HKDF(hashes.SHA256(), 32, salt=None, info=b"shoal-secagg-pairwise|" + context).derive(shared)


def pairwise_mask(i: int, j: int, seed: bytes, n: int) -> np.ndarray:
    """What i adds towards j: +PRG(s_ij) when i < j, -PRG(s_ij) when i > j (mod 2^32)."""
    m = prg(seed, n)
    return m if i < j else (np.uint32(0) - m).astype(np.uint32)


class SecAggParticipant:
    """One participant's side of a secure round (module docstring).

    Args:
        position: its position in the round's participants (0..p-1).
        graph: `neighbour_graph(p, params, seed)`.
        params: the round's SecAggParams.
        context: bytes binding every pairwise seed to this run, round and attempt (fresh keys and
            a fresh context for every attempt: a retry never reuses a mask).
        key: the mask key to use (default: a fresh one). The self-mask seed is always fresh.
    """

    def __init__(self, position: int, graph: tuple[tuple[int, ...], ...], params: SecAggParams, context: bytes,
                 key: X25519PrivateKey | None = None):
        params.check(len(graph))
        self.position = position
        self.graph = graph
        self.neighbours = graph[position]
        self.params = params
        self.context = context
        self._key = key or X25519PrivateKey.generate()
        self._seed = secrets.token_bytes(32)
        self.public_key = self._key.public_key().public_bytes_raw()
        self.held: dict[int, Share] = {}  # owner position -> the share it gave this participant

    def shares(self) -> dict[int, Share]:
        """The share for each neighbour position (to be delivered to it, confidentially)."""
        xs = [j + 1 for j in self.neighbours]
        t = self.params.threshold
        seed_shares = shamir_split(self._seed, xs, t)
        key_shares = shamir_split(self._key.private_bytes_raw(), xs, t)
        return {j: Share(self.position, j, seed_shares[j + 1], key_shares[j + 1]) for j in self.neighbours}

    def receive(self, share: Share) -> None:
        """Keep a neighbour's share. Raises InvalidArgument for a share not meant for this
        participant, or from a non-neighbour."""
        if share.holder != self.position or share.owner not in self.neighbours:
            raise InvalidArgument(f"share from {share.owner} for {share.holder}: not a neighbour's share for "
                                  f"{self.position}")
        self.held[share.owner] = share

    def mask(self, x: np.ndarray, public_keys: Mapping[int, bytes]) -> np.ndarray:
        """The masked contribution `(n,)` uint32 of `x` `(n,)` (module docstring, step 3).
        `public_keys`: each neighbour's public mask key. Raises InvalidArgument when one is
        missing or x is not finite."""
        n = x.shape[0]
        y = quantize(x, self.params) + prg(self._seed, n)
        for j in self.neighbours:
            if j not in public_keys:
                raise InvalidArgument(f"no public key for neighbour {j}")
            y += pairwise_mask(self.position, j, pairwise_seed(self._key, public_keys[j], self.context), n)
        return y

    def reveal(self, sent: Iterable[int]) -> dict[int, tuple[str, int]]:
        """For each neighbour whose share this participant holds: ("seed", share) when it sent
        its masked row, ("key", share) when it did not. Never both for one neighbour."""
        sent = set(sent)
        return {j: ("seed", s.seed_share) if j in sent else ("key", s.key_share) for j, s in self.held.items()}


def _secrets_to_remove(sent: set[int], graph: tuple[tuple[int, ...], ...],
                       revealed: Mapping[int, Mapping[int, tuple[str, int]]]):
    """(participant j, "seed" or "key", the revealed shares {x: y} of it) for each secret the
    unmasking needs: every sender's self-mask seed, and the mask key of every non-sender some
    sender masked towards."""
    for j in range(len(graph)):
        if j not in sent and not sent.intersection(graph[j]):
            continue  # nobody added a mask towards j: nothing of j's to remove
        kind = "seed" if j in sent else "key"
        yield j, kind, {h + 1: r[j][1] for h, r in revealed.items() if j in r and r[j][0] == kind}


def unmaskable(sent: Iterable[int], revealed: Mapping[int, Mapping[int, tuple[str, int]]],
               graph: tuple[tuple[int, ...], ...], params: SecAggParams) -> bool:
    """Whether `unmask` has what it needs from `revealed`: at least t survivors, and t shares of
    every sender's seed and of every non-sender's key that some sender masked towards."""
    t = params.threshold
    return len(revealed) >= t and all(len(shares) >= t for _, _, shares in
                                      _secrets_to_remove(set(sent), graph, revealed))


def unmask(total: np.ndarray, sent: Iterable[int], revealed: Mapping[int, Mapping[int, tuple[str, int]]],
           public_keys: Mapping[int, bytes], graph: tuple[tuple[int, ...], ...], params: SecAggParams,
           context: bytes) -> np.ndarray:
    """The sum of the senders' quantized contributions `(n,)` float32, from `total` `(n,)` uint32
    (the mod-2^32 sum of the masked rows of `sent`) and the survivors' `revealed` shares
    ({survivor position: its `reveal(sent)`}).

    Raises SecAggAbort when fewer than t shares of some sender's seed or some non-sender's key
    arrived (or fewer than t survivors revealed anything), and InvalidArgument when a
    reconstructed key does not match its published public key (a lying survivor)."""
    sent = set(sent)
    t = params.threshold
    if len(revealed) < t:
        raise SecAggAbort(f"{len(revealed)} survivors revealed shares, {t} needed")
    y = np.array(total, dtype=np.uint32, copy=True)
    n = y.shape[0]
    for j, kind, shares in _secrets_to_remove(sent, graph, revealed):
        if len(shares) < t:
            raise SecAggAbort(f"participant {j}: {len(shares)} shares of its {kind} revealed, {t} needed")
        secret = shamir_combine(shares, t)
        if j in sent:
            y -= prg(secret, n)
            continue
        key = X25519PrivateKey.from_private_bytes(secret)
        if key.public_key().public_bytes_raw() != public_keys[j]:
            raise InvalidArgument(f"participant {j}: the revealed key shares do not match its public key")
        for i in graph[j]:
            if i in sent:  # i added its mask towards j, which j never cancelled
                y -= pairwise_mask(i, j, pairwise_seed(key, public_keys[i], context), n)
    return dequantize(y, params)


def refused_with(*, aggregator: str, audit_owners: bool, compression: str, max_norm: float, dp_sigma: float,
                 dp_mode: str) -> tuple[str, str] | None:
    """The first run setting that cannot hold with secure aggregation, as (setting, why), or None.

    The shard owners see only masked rows, so they can only sum them: no robust aggregator, no
    owner audit (it recomputes an aggregator), no owner-side norm bound or noise (a bound needs the
    contribution in the clear: clip at the contributor, dp_mode distributed or local), and no
    compression (a lossy codec of uniform ring elements destroys the sum; sparse payloads are
    summed by every peer in the clear)."""
    if aggregator not in ("mean", "fedavg"):
        return "aggregator", f"{aggregator!r}: shard owners see only masked rows and can only sum them"
    if audit_owners:
        return "audit_owners", "true: an owner audit recomputes an aggregator of rows only the owners see masked"
    if compression != "none":
        return "compression", f"{compression!r}: masked rows are uniform ring elements, summed exactly"
    if max_norm > 0 and not (dp_sigma > 0 and dp_mode in ("distributed", "local")):
        return "max_norm", (f"{max_norm}: applied by the shard owners, who see only masked rows (with dp_sigma > 0 "
                            "and dp_mode distributed or local every participant clips its own contribution)")
    return None
