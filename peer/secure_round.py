"""Secure aggregation in a real round: SecAgg+ (Bell et al. 2020, CCS; the core is peer.secagg)
wired to the plan, the coordinator's relay and the all-reduce.

Responsible for: this peer's keys of a round (`RoundKeys`: an X25519 *mask key* for the pairwise
masks and an X25519 *box key* for the shares, both announced in its Ready), the end-to-end
encryption of the Shamir shares it hands its neighbours (`seal` / `unseal`: X25519 + HKDF-SHA256 +
ChaCha20-Poly1305, bound to the attempt and to both ends), and one secure attempt
(`SecureAggregation.all_reduce`). Not responsible for moving tensors (the caller's all-reduce sums
the masked uint32 rows: an exact sum mod 2^32, order-independent, so every participant holds the
same bits) nor for the vote (the caller digests the unmasked result as for any round).

One attempt, for a float32 contribution x `(n,)` (already weighted so that the plain sum is the
result the round wants: FedAvg's n_i / sum n, or 1/p with DP noise):

1. The plan carries every participant's public keys, signed by its identity key (checked here
   against the plan's identity keys: the coordinator cannot substitute one), and the attempt's
   graph seed. This peer
   builds the neighbour graph, splits its fresh self-mask seed and its mask key into t-of-k
   shares, seals each neighbour's pair for that neighbour's box key and posts them to the
   coordinator (PostSecAgg, phase SHARES), which relays ciphertext only.
2. It fetches the shares sealed for it (FetchSecAgg waits for every participant, at most
   `wait_seconds`). A neighbour whose shares did not come (or do not open) fails the attempt,
   naming it: the retry goes on without it (it never sent a masked row).
3. It quantizes x to fixed point in Z_2^32 (clip, frac_bits), adds its self mask and pairwise
   masks and all-reduces the uint32 row with the caller's collective.
4. Having the sum, it reveals to the coordinator (phase REVEAL) the seed share of every neighbour
   (every participant sent: the all-reduce completes only with every row), never a key share,
   fetches the survivors' reveals (waiting past the relay's wait while those in cannot unmask the
   sum yet, up to the attempt's deadline) and unmasks: the self masks come off with t shares of
   each seed. A participant that vanished after sending is unmasked by its neighbours' shares, so
   the survivors still agree on the sum, and the coordinator commits the attempt without the lost
   participant's vote (coordinator.attempt: `Attempt.lose`), its contribution in the sum. Fewer
   than t revealed shares of someone's seed by the deadline fail the attempt.

Failure semantics of `all_reduce`: raises CollectiveError (naming suspects where there are any)
on every failure, including the collective's own; x is never modified. Keys are per round, masks
per attempt: the context of every pairwise seed and seal names the round, the attempt and its
graph seed, and the self-mask seed is drawn afresh for every attempt, so a retry never reuses a
mask. A peer's mask key is never revealed (no attempt unmasks a non-sender), so one key serves
every attempt of a round.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
import numpy as np
from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from shoal.common.errors import InvalidArgument
from shoal.common.plan import Plan
from shoal.common.tensors import result_digest
from shoal.peer.collectives import CollectiveError, CollectiveResult
from shoal.peer.result_digest import off_loop
from shoal.peer.secagg import (SHARE_BYTES, SecAggAbort, SecAggParams, SecAggParticipant, Share, dequantize,
                               neighbour_graph, quantize, unmask, unmaskable)
from shoal.peer.testing import faults
from shoal.v1 import shoal_pb2 as pb

log = logging.getLogger("shoal.peer.secure_round")

KEY_BYTES = 32
_KINDS = {"seed": 0, "key": 1}


def signed_keys(round_: int, keys: bytes) -> bytes:
    """What a participant's identity key signs: its round's public keys `keys` (mask + box, 64
    bytes) bound to the round."""
    return b"shoal-secagg-keys|" + round_.to_bytes(8, "big") + keys


class RoundKeys:
    """One round's key pairs: `mask` (X25519, the pairwise masks) and `box` (X25519, the sealed
    shares), fresh per round. `public`: mask public key + box public key (64 bytes, the Ready's);
    `signature`: `sign(signed_keys(round, public))` (64 bytes; b"" without a signer)."""

    def __init__(self, round_: int, sign: Callable[[bytes], bytes] | None = None):
        self.round = round_
        self.mask = X25519PrivateKey.generate()
        self.box = X25519PrivateKey.generate()
        self.public = self.mask.public_key().public_bytes_raw() + self.box.public_key().public_bytes_raw()
        self.signature = sign(signed_keys(round_, self.public)) if sign is not None else b""


def _seal_key(mine: X25519PrivateKey, theirs: bytes, context: bytes, sender: str, receiver: str) -> bytes:
    shared = mine.exchange(X25519PublicKey.from_public_bytes(theirs))
    info = b"shoal-secagg-seal|" + context + b"|" + sender.encode() + b"|" + receiver.encode()
    return HKDF(hashes.SHA256(), 32, salt=None, info=info).derive(shared)


def seal(mine: X25519PrivateKey, theirs: bytes, context: bytes, sender: str, receiver: str, data: bytes) -> bytes:
    """`data` encrypted and authenticated for `receiver` (its box public key `theirs`): ChaCha20-
    Poly1305 under HKDF(X25519(mine, theirs), context, sender, receiver). The key is used for one
    message only (one per ordered pair and attempt), so the nonce is fixed."""
    return ChaCha20Poly1305(_seal_key(mine, theirs, context, sender, receiver)).encrypt(bytes(12), data, context)


def unseal(mine: X25519PrivateKey, theirs: bytes, context: bytes, sender: str, receiver: str, data: bytes) -> bytes:
    """The plaintext of `seal`; raises InvalidArgument when it does not authenticate (altered,
    replayed from another attempt, or sealed by someone else)."""
    try:
        return ChaCha20Poly1305(_seal_key(mine, theirs, context, sender, receiver)).decrypt(bytes(12), data, context)
    except InvalidTag:
        raise InvalidArgument(f"share from {sender[:8]}: does not authenticate") from None


def encode_share(share: Share) -> bytes:
    return share.seed_share.to_bytes(SHARE_BYTES, "big") + share.key_share.to_bytes(SHARE_BYTES, "big")


def decode_share(data: bytes, owner: int, holder: int) -> Share:
    if len(data) != 2 * SHARE_BYTES:
        raise InvalidArgument(f"share: {len(data)} bytes, expected {2 * SHARE_BYTES}")
    return Share(owner, holder, int.from_bytes(data[:SHARE_BYTES], "big"), int.from_bytes(data[SHARE_BYTES:], "big"))


def encode_reveal(revealed: dict[int, tuple[str, int]]) -> bytes:
    """{owner position: (kind, share)} as records of position (4 bytes) + kind (1) + share (66)."""
    return b"".join(j.to_bytes(4, "big") + bytes([_KINDS[k]]) + y.to_bytes(SHARE_BYTES, "big")
                    for j, (k, y) in sorted(revealed.items()))


def decode_reveal(data: bytes, participants: int) -> dict[int, tuple[str, int]]:
    """Raises InvalidArgument for a malformed record (size, position or kind)."""
    step = 5 + SHARE_BYTES
    if len(data) % step:
        raise InvalidArgument(f"reveal: {len(data)} bytes, not whole records of {step}")
    out = {}
    for off in range(0, len(data), step):
        j, kind = int.from_bytes(data[off:off + 4], "big"), data[off + 4]
        if j >= participants or kind not in (0, 1):
            raise InvalidArgument(f"reveal: record for position {j} of kind {kind}")
        out[j] = ("seed" if kind == 0 else "key", int.from_bytes(data[off + 5:off + step], "big"))
    return out


@dataclass
class SecureCost:
    """What secure aggregation added to the last attempt: control-plane bytes this peer sent and
    received (shares and reveals) and seconds outside the collective (keys, shares, masks,
    relay waits, unmasking); `SecureAggregation.all_reduce` makes a new one per attempt."""

    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    revealed: int = 0  # participants whose reveals this peer unmasked with (fewer than p: someone vanished)


def _box_key(plan: Plan, position: int) -> bytes:
    return plan.secagg_keys[position][KEY_BYTES:2 * KEY_BYTES]


class SecureAggregation:
    """This peer's side of secure rounds (module docstring).

    params: the run's SecAggParams. me: this peer's id. post / fetch: the coordinator client's
    `secagg_post(req, deadline)` and `secagg_fetch(req)` (peer.control). sign: this peer's
    identity key's Ed25519 signature (it signs each round's public keys; every participant checks
    the others' against the identity keys of the plan, so the coordinator cannot substitute one).
    """

    def __init__(self, params: SecAggParams, me: str, post: Callable[[pb.SecAggPost, float], Awaitable[None]],
                 fetch: Callable[[pb.SecAggFetch], Awaitable[pb.SecAggFetchResponse]],
                 sign: Callable[[bytes], bytes]):
        self.params, self.me, self.post, self.fetch, self.sign = params, me, post, fetch, sign
        self.keys: RoundKeys | None = None
        self.cost = SecureCost()

    def keys_for(self, round_: int) -> RoundKeys:
        """This peer's keys of `round_` (made at its first Ready for that round)."""
        if self.keys is None or self.keys.round != round_:
            self.keys = RoundKeys(round_, self.sign)
        return self.keys

    async def all_reduce(self, x: np.ndarray, plan: Plan,
                         reduce: Callable[[np.ndarray], Awaitable[CollectiveResult]]) -> CollectiveResult:
        """The sum over the plan's participants of their contributions `x` `(n,)` float32, in
        fixed point (error <= p * 2^-(frac_bits+1) per element), as float32; `reduce` all-reduces
        the masked `(n,)` uint32 rows. Raises CollectiveError (module docstring)."""
        t0 = time.monotonic()
        self.cost = SecureCost()
        keys = self._check(plan)
        pos = plan.position(self.me)
        params = self.params.for_participants(plan.size)
        if plan.size == 1:  # alone: nothing to hide from anyone; the same fixed-point numbers
            total = dequantize(quantize(x, params), params)
            return CollectiveResult(total, result_digest(total), 0, time.monotonic() - t0)
        try:
            graph = neighbour_graph(plan.size, params, plan.secagg_seed)
            context = b"shoal-secagg|%d|%d|" % (plan.round, plan.attempt) + plan.secagg_seed
            part = SecAggParticipant(pos, graph, params, context, key=keys.mask)
        except InvalidArgument as exc:
            raise CollectiveError(f"secure aggregation: {exc}", []) from None
        mask_keys = {j: k[:KEY_BYTES] for j, k in enumerate(plan.secagg_keys)}
        # A share or a reveal is smaller than one chunk: the others' come within a chunk deadline.
        wait = max(1.0, min(plan.chunk_timeout_seconds, plan.deadline_seconds / 4))
        await self._share(part, plan, keys, context, wait)
        faults.hit("secagg-shared", plan.round)
        masked = await off_loop(part.mask, x, mask_keys)
        setup = time.monotonic() - t0
        res = await reduce(masked)
        faults.hit("secagg-sent", plan.round)
        t1 = time.monotonic()
        revealed = await self._reveal(part, plan, graph, params, wait, until=t0 + plan.deadline_seconds)
        try:
            total = await off_loop(unmask, res.values, range(plan.size), revealed, mask_keys, graph, params, context)
        except SecAggAbort as exc:
            silent = [p for i, p in enumerate(plan.participants) if i not in revealed]
            raise CollectiveError(f"secure aggregation cannot unmask the sum: {exc}", silent) from None
        except InvalidArgument as exc:
            raise CollectiveError(f"secure aggregation: {exc}", []) from None
        self.cost.seconds = setup + time.monotonic() - t1
        return CollectiveResult(total, result_digest(total), res.bytes_sent, time.monotonic() - t0, res.flagged)

    def _check(self, plan: Plan) -> RoundKeys:
        keys = self.keys
        if not plan.secagg_seed or len(plan.secagg_keys) != plan.size:
            raise CollectiveError("plan: not a secure attempt (this run has secure_aggregation on; a participant's "
                                  "Ready carried no keys)", [])
        if keys is None or keys.round != plan.round or plan.secagg_keys[plan.position(self.me)][:64] != keys.public:
            raise CollectiveError("plan: it carries other secure-aggregation keys for this peer than its Ready "
                                  "of this round", [])
        for i, (peer, k) in enumerate(zip(plan.participants, plan.secagg_keys)):
            try:
                Ed25519PublicKey.from_public_bytes(plan.public_keys[i]).verify(k[64:], signed_keys(plan.round, k[:64]))
            except (InvalidSignature, ValueError, IndexError):
                raise CollectiveError(f"plan: the secure-aggregation keys of {peer[:8]} are not signed by its "
                                      "identity key (altered by the coordinator or on the way)", []) from None
        return keys

    async def _share(self, part: SecAggParticipant, plan: Plan, keys: RoundKeys, context: bytes,
                     wait: float) -> None:
        """Phase SHARES: post this peer's sealed shares, take its neighbours'."""
        ids = plan.participants
        items = [pb.SecAggItem(from_peer=self.me, to_peer=ids[j],
                               data=seal(keys.box, _box_key(plan, j), context, self.me, ids[j],
                                         encode_share(share)))
                 for j, share in (await off_loop(part.shares)).items()]
        req = pb.SecAggPost(peer_id=self.me, round=plan.round, attempt=plan.attempt, phase=pb.SECAGG_SHARES,
                            items=items)
        resp = await self._relay(req, wait)
        got = {it.from_peer: it.data for it in resp.items}
        missing = [ids[j] for j in part.neighbours if ids[j] not in got]
        if missing:
            raise CollectiveError(f"secure aggregation: no shares from {', '.join(m[:8] for m in missing)} "
                                  f"within {wait:.1f}s", missing)
        for j in part.neighbours:
            try:
                data = unseal(keys.box, _box_key(plan, j), context, ids[j], self.me, got[ids[j]])
                part.receive(decode_share(data, j, part.position))
            except InvalidArgument as exc:
                raise CollectiveError(f"secure aggregation: {exc}", [ids[j]]) from None

    async def _reveal(self, part: SecAggParticipant, plan: Plan, graph: tuple[tuple[int, ...], ...],
                      params: SecAggParams, wait: float, until: float) -> dict[int, dict[int, tuple[str, int]]]:
        """Phase REVEAL: post this peer's seed shares of its neighbours; the survivors' reveals.

        Waits for every participant's reveal for `wait` seconds; past that, for as long as the
        reveals in cannot unmask the sum yet (`secagg.unmaskable`: survivors still finishing their
        all-reduce reveal later), until `until` (monotonic seconds: the attempt's deadline)."""
        req = pb.SecAggPost(peer_id=self.me, round=plan.round, attempt=plan.attempt, phase=pb.SECAGG_REVEAL,
                            items=[pb.SecAggItem(from_peer=self.me, data=encode_reveal(part.reveal(range(plan.size))))])
        await self._post(req, wait)
        out: dict[int, dict[int, tuple[str, int]]] = {}
        left = wait
        while True:
            resp = await self._fetch(req, left)
            for it in resp.items:
                if it.from_peer not in plan.participants or plan.position(it.from_peer) in out:
                    continue
                try:
                    out[plan.position(it.from_peer)] = decode_reveal(it.data, plan.size)
                except InvalidArgument as exc:
                    raise CollectiveError(f"secure aggregation: {exc}", [it.from_peer]) from None
            left = min(wait, until - time.monotonic())
            if len(out) == plan.size or left <= 0 or unmaskable(range(plan.size), out, graph, params):
                break
        self.cost.revealed = len(out)
        if len(out) < plan.size:
            log.info("round %d.%d: %d of %d participants revealed their shares; unmasking from theirs", plan.round,
                     plan.attempt, len(out), plan.size)
        return out

    async def _relay(self, req: pb.SecAggPost, wait: float) -> pb.SecAggFetchResponse:
        """Post `req`, then fetch what the others posted in its phase (within `wait` seconds)."""
        await self._post(req, wait)
        return await self._fetch(req, wait)

    async def _post(self, req: pb.SecAggPost, wait: float) -> None:
        self.cost.bytes_sent += req.ByteSize()
        try:
            await self.post(req, wait)
        except grpc.aio.AioRpcError as exc:
            raise CollectiveError(f"secure aggregation relay: {exc.code().name} {exc.details()}", []) from None

    async def _fetch(self, req: pb.SecAggPost, wait: float) -> pb.SecAggFetchResponse:
        """What the participants posted in `req`'s phase, once all did or `wait` seconds passed."""
        try:
            resp = await self.fetch(pb.SecAggFetch(peer_id=self.me, round=req.round, attempt=req.attempt,
                                                   phase=req.phase, wait_seconds=wait))
        except grpc.aio.AioRpcError as exc:
            raise CollectiveError(f"secure aggregation relay: {exc.code().name} {exc.details()}", []) from None
        self.cost.bytes_received += resp.ByteSize()
        return resp
