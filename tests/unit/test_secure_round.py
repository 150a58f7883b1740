"""Secure aggregation wired to a round (peer.secure_round, coordinator.secagg_relay), without
sockets: p participants' `SecureAggregation` objects post to and fetch from one in-memory
`SecAggRelay` (what the coordinator runs behind PostSecAgg / FetchSecAgg) and a reduce that sums
the masked uint32 rows as the all-reduce does. Also the settings that refuse to combine with it."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kits.uniformity import assert_bytes_uniform
from shoal.common.errors import InvalidArgument
from shoal.common.plan import Plan
from shoal.common.tensors import result_digest
from shoal.config import ConfigError, RunSection
from shoal.coordinator.secagg_relay import SecAggRelay
from shoal.peer.collectives import CollectiveError, CollectiveResult, all_reduce
from shoal.peer.lanes.memory import MemoryNet
from shoal.peer.secagg import SecAggParams, dequantize, prg, quantize, shamir_combine
from shoal.peer.secure_round import (RoundKeys, SecureAggregation, decode_reveal, encode_reveal, seal, unseal)
from shoal.peer.training import RunConfig
from shoal.v1 import shoal_pb2 as pb

PARAMS = SecAggParams(degree=4, threshold=3, clip=4.0, frac_bits=20)


class Swarm:
    """p participants of one secure attempt around one relay; `crash` maps a participant to the
    phase it vanishes in ("before": after its shares, before sending; "after": after sending)."""

    def __init__(self, p: int, n: int, crash: dict[int, str] | None = None, seed: int = 0):
        self.ids = tuple(f"peer{i:02d}" for i in range(p))
        self.relay = SecAggRelay()
        self.crash = crash or {}
        self.identities = [Ed25519PrivateKey.generate() for _ in self.ids]
        self.secure = [SecureAggregation(PARAMS, me, self._post, self._fetch, key.sign)
                       for me, key in zip(self.ids, self.identities)]
        keys = tuple(k.public + k.signature for k in (s.keys_for(3) for s in self.secure))
        self.plan = Plan(self.ids, "butterfly", (0, n), (0,), round=3, attempt=1, num_elements=n,
                         public_keys=tuple(k.public_key().public_bytes_raw() for k in self.identities),
                         deadline_seconds=4.0, chunk_timeout_seconds=0.5, secagg_keys=keys, secagg_seed=b"s" * 32)
        rng = np.random.default_rng(seed)
        self.xs = [rng.normal(0, 1, n).astype(np.float32) for _ in range(p)]
        self.rows: dict[int, np.ndarray] = {}
        self.summed = asyncio.Event()
        self.seen: list[pb.SecAggItem] = []  # everything the coordinator relayed

    async def _post(self, req: pb.SecAggPost, deadline: float) -> None:
        self.seen.extend(req.items)
        self.relay.post(req, self.ids)

    async def _fetch(self, req: pb.SecAggFetch) -> pb.SecAggFetchResponse:
        return await self.relay.fetch(req, self.ids)

    def _reduce(self, i: int):
        async def reduce(masked: np.ndarray) -> CollectiveResult:
            if self.crash.get(i) == "before":
                raise asyncio.CancelledError  # vanished: never sends its row
            self.rows[i] = masked
            if len(self.rows) == len(self.ids):
                self.summed.set()
            try:  # an all-reduce needs every participant's row; a missing one is a chunk timeout
                await asyncio.wait_for(self.summed.wait(), 1.0)
            except TimeoutError:
                missing = [p for j, p in enumerate(self.ids) if j not in self.rows]
                raise CollectiveError("chunk timeout", missing) from None
            total = np.zeros_like(masked)
            for row in self.rows.values():
                total += row
            if self.crash.get(i) == "after":
                raise asyncio.CancelledError  # vanished after sending
            return CollectiveResult(total, result_digest(total), 0, 0.0)
        return reduce

    async def run(self) -> list:
        async def one(i: int):
            try:
                return await self.secure[i].all_reduce(self.xs[i], self.plan, self._reduce(i))
            except asyncio.CancelledError:
                return None
            except CollectiveError as exc:
                return exc
        return await asyncio.gather(*(one(i) for i in range(len(self.ids))))

    def expected(self, who) -> np.ndarray:
        total = np.zeros(self.xs[0].size, dtype=np.uint32)
        for i in who:
            total += quantize(self.xs[i], PARAMS)
        return dequantize(total, PARAMS)


def test_every_participant_unmasks_the_same_exact_fixed_point_sum():
    sw = Swarm(6, 1001)
    out = asyncio.run(sw.run())
    for res in out:
        assert isinstance(res, CollectiveResult)
        np.testing.assert_array_equal(res.values, sw.expected(range(6)))
        assert res.digest == out[0].digest
    assert abs(out[0].values - sum(sw.xs)).max() <= 6 * 2.0 ** -21  # the fixed-point error bound


def test_a_participant_vanishing_after_sending_is_unmasked_from_its_neighbours_shares():
    sw = Swarm(6, 257, crash={2: "after"})
    out = asyncio.run(sw.run())
    assert out[2] is None
    for i in (0, 1, 3, 4, 5):
        np.testing.assert_array_equal(out[i].values, sw.expected(range(6)))  # its row is in the sum
        assert sw.secure[i].cost.revealed == 5


def test_a_participant_vanishing_before_sending_fails_the_attempt_with_nothing_unmasked():
    """The all-reduce cannot complete without its row (here: the reduce times out); the attempt
    fails and no survivor reveals anything (reveals follow a completed sum only)."""
    sw = Swarm(5, 64, crash={4: "before"})
    out = asyncio.run(sw.run())
    assert out[4] is None
    for i in range(4):
        assert isinstance(out[i], CollectiveError) and out[i].suspects == (sw.ids[4],)
    assert not [it for it in sw.seen if it.to_peer == ""]  # no reveal was posted


def test_a_participant_whose_shares_never_come_is_named_and_the_attempt_fails():
    sw = Swarm(4, 16)
    silent = sw.ids[3]
    sw.plan = dataclasses.replace(sw.plan, chunk_timeout_seconds=0.2)

    async def three():  # participant 3 never runs
        return await asyncio.gather(*(sw.secure[i].all_reduce(sw.xs[i], sw.plan, sw._reduce(i))
                                      for i in range(3)), return_exceptions=True)
    for exc in asyncio.run(three()):
        assert isinstance(exc, CollectiveError) and exc.suspects == (silent,)
        assert "no shares from" in str(exc)


def test_the_coordinator_relays_only_ciphertext_bound_to_both_ends_and_the_attempt():
    sw = Swarm(4, 8)
    asyncio.run(sw.run())
    shares = [it for it in sw.seen if it.to_peer]
    assert len(shares) == 4 * 3  # complete graph of 4: every participant seals for its 3 neighbours
    a, b = RoundKeys(0), RoundKeys(0)
    ct = seal(a.box, b.public[32:], b"ctx", "a", "b", b"secret share")
    assert b"secret share" not in ct
    assert unseal(b.box, a.public[32:], b"ctx", "a", "b", ct) == b"secret share"
    for wrong in ((b"ctx2", "a", "b"), (b"ctx", "c", "b"), (b"ctx", "a", "c")):
        with pytest.raises(InvalidArgument, match="does not authenticate"):
            unseal(b.box, a.public[32:], *wrong, ct)


def test_a_key_the_coordinator_substituted_fails_the_attempt_before_any_share_leaves():
    sw = Swarm(4, 8)
    forged = RoundKeys(3)  # the coordinator's own keys in participant 2's place, unsigned by it
    keys = list(sw.plan.secagg_keys)
    keys[2] = forged.public + keys[2][64:]
    sw.plan = dataclasses.replace(sw.plan, secagg_keys=tuple(keys))
    out = asyncio.run(sw.run())
    for i in (0, 1, 3):
        assert isinstance(out[i], CollectiveError) and "not signed by its identity key" in str(out[i])
    assert not sw.seen  # nothing was sealed for the forged key


def test_reveals_round_trip_and_malformed_ones_are_refused():
    rev = {0: ("seed", 12345), 3: ("key", 2 ** 500)}
    assert decode_reveal(encode_reveal(rev), 4) == rev
    with pytest.raises(InvalidArgument, match="position 3"):
        decode_reveal(encode_reveal(rev), 3)
    with pytest.raises(InvalidArgument, match="whole records"):
        decode_reveal(b"\0" * 10, 4)


def test_the_relay_refuses_items_not_from_the_caller_or_to_strangers():
    relay = SecAggRelay()
    ids = ("a", "b")
    with pytest.raises(InvalidArgument, match="from_peer"):
        relay.post(pb.SecAggPost(peer_id="a", round=1, attempt=0, phase=pb.SECAGG_SHARES,
                                 items=[pb.SecAggItem(from_peer="b", to_peer="a", data=b"x")]), ids)
    with pytest.raises(InvalidArgument, match="to_peer"):
        relay.post(pb.SecAggPost(peer_id="a", round=1, attempt=0, phase=pb.SECAGG_SHARES,
                                 items=[pb.SecAggItem(from_peer="a", to_peer="z", data=b"x")]), ids)
    with pytest.raises(InvalidArgument, match="phase"):
        relay.post(pb.SecAggPost(peer_id="a", round=1, attempt=0), ids)


def test_plan_carries_the_keys_and_seed_on_the_wire():
    keys = (bytes(range(128)), bytes(range(1, 129)))
    plan = Plan(("a", "b"), "ring", (0, 4), (0,), secagg_keys=keys, secagg_seed=b"g" * 32)
    back = Plan.from_proto(plan.to_proto())
    assert back.secagg_keys == keys and back.secagg_seed == b"g" * 32
    assert Plan.from_proto(dataclasses.replace(plan, secagg_keys=(), secagg_seed=b"").to_proto()).secagg_keys == ()


@pytest.mark.parametrize("key,value,named", [("aggregator", "median", "run.aggregator"),
                                             ("audit_owners", True, "run.audit_owners"),
                                             ("compression", "int8", "run.compression"),
                                             ("compression", "topk", "run.compression"),
                                             ("max_norm", 1.0, "run.max_norm")])
def test_settings_that_cannot_hold_are_refused_in_one_line_naming_both(key, value, named):
    run = dataclasses.replace(RunSection(), secure_aggregation=True, **{key: value})
    with pytest.raises(ConfigError) as err:
        run.validate()
    assert err.value.setting == named
    assert named in str(err.value) and "run.secure_aggregation" in str(err.value) and "\n" not in str(err.value)
    if key != "audit_owners":  # the peers' RunConfig holds no audit setting (the plan does)
        with pytest.raises(InvalidArgument, match=f"{key}: .*secure_aggregation"):
            RunConfig(algorithm="fedavg", secure_aggregation=True, **{key: value})


def test_contributor_dp_combines_with_secure_aggregation_and_bad_parameters_are_named():
    dataclasses.replace(RunSection(), secure_aggregation=True, max_norm=1.0, dp_sigma=0.5,
                        dp_mode="distributed").validate()
    for key, value in (("secagg_degree", 3), ("secagg_threshold", 9), ("secagg_clip", 0.0),
                       ("secagg_frac_bits", 31)):
        with pytest.raises(ConfigError) as err:
            dataclasses.replace(RunSection(), secure_aggregation=True, **{key: value}).validate()
        assert err.value.setting == f"run.{key}"


def test_a_ring_too_small_for_three_participants_and_norm_rejection_under_contributor_dp_are_refused():
    """clip 4 at 28 fraction bits: 3 x 4 x 2^28 >= 2^31, no secure round could ever sum; with
    contributor DP every participant clips its own update, so on_norm = reject would do nothing."""
    with pytest.raises(ConfigError) as err:
        dataclasses.replace(RunSection(), secure_aggregation=True, secagg_frac_bits=28).validate()
    assert err.value.setting == "run.secagg_frac_bits" and "3 participants overflows the ring" in str(err.value)
    assert dataclasses.replace(RunSection(), secagg_frac_bits=20).secagg_max_participants() == 511
    dataclasses.replace(RunSection(), secure_aggregation=True, secagg_frac_bits=27).validate()  # 3 fit
    for mode in ("distributed", "local"):
        with pytest.raises(ConfigError) as err:
            dataclasses.replace(RunSection(), max_norm=1.0, dp_sigma=0.5, dp_mode=mode, on_norm="reject").validate()
        assert err.value.setting == "run.on_norm" and f"run.dp_mode = {mode!r}" in str(err.value)


def test_what_one_peer_and_the_coordinator_receive_in_a_secure_attempt_reveals_no_contribution():
    """A whole secure attempt on the real butterfly (in-memory lanes): everything participant 0
    receives on the data plane (every chunk of the all-reduce: the other participants' masked rows
    of the shard it owns, the masked sums of the other shards) and everything the coordinator
    relays (sealed shares, the reveals). With every input the same constant, each masked row
    participant 0 sees is uniform on Z_2^32 (chi-square over its bytes); the reveals hold seed
    shares only, and with every self-mask seed they give (the coordinator and participant 0
    colluding) a row is still uniform, its pairwise masks on: only the sum of all six unmasks,
    exactly. (t colluding neighbours recovering a row: tests/unit/test_secagg.py.)"""
    p, n = 6, 24_000
    sw = Swarm(p, n)
    sw.xs = [np.full(n, 0.75, dtype=np.float32) for _ in range(p)]  # the most structured input
    sw.plan = dataclasses.replace(
        sw.plan, shard_bounds=tuple(n * i // p for i in range(p + 1)), shard_owner=tuple(range(p)),
        addresses=tuple(f"mem:{i}" for i in range(p)), chunk_bytes=1 << 16, dtype=pb.UINT32)
    net = MemoryNet()
    net.start(sw.plan)
    seen_by_0: list[tuple[str, int, int, np.ndarray]] = []  # (sender, phase, offset, values) delivered to 0
    inbox0 = net.inbox(sw.ids[0])
    deliver = inbox0.deliver

    def record(key, values):
        seen_by_0.append((key[6], key[2], key[5], np.array(values, copy=True)))
        return deliver(key, values)
    inbox0.deliver = record

    mine: list[np.ndarray] = []  # participant 0's own masked row

    def reduce_for(i):
        async def reduce(masked):
            if i == 0:
                mine.append(masked.copy())
            return await all_reduce(masked, sw.plan, me=sw.ids[i], lanes=net.lanes(sw.plan, sw.ids[i]))
        return reduce

    async def attempt():
        return await asyncio.gather(*(sw.secure[i].all_reduce(sw.xs[i], sw.plan, reduce_for(i)) for i in range(p)))
    out = asyncio.run(attempt())
    for res in out:  # the attempt works: the exact fixed-point sum everywhere
        np.testing.assert_array_equal(res.values, sw.expected(range(p)))

    rows = {sw.ids.index(s): (off, v) for s, phase, off, v in seen_by_0 if phase == pb.REDUCE_SCATTER}
    assert sorted(rows) == list(range(1, p))  # participant 0 owns shard 0: one row of it from each other
    plain = quantize(sw.xs[1], PARAMS)
    for off, row in rows.values():  # a constant input, a uniform row: nothing of the value shows
        assert row.dtype == np.uint32 and not np.array_equal(row, plain[off:off + row.size])
        assert_bytes_uniform(row)
    gathered = [v for s, phase, off, v in seen_by_0 if phase == pb.ALL_GATHER]
    assert gathered  # the other shards' masked sums, which unmask only with every seed

    # The coordinator's view: sealed shares and the reveals, which hold seed shares only.
    reveals = {sw.ids.index(it.from_peer): decode_reveal(it.data, p) for it in sw.seen if not it.to_peer}
    assert len(reveals) == p and all(kind == "seed" for r in reveals.values() for kind, _ in r.values())
    params = PARAMS.for_participants(p)
    seeds = {j: shamir_combine({h + 1: r[j][1] for h, r in reveals.items() if j in r}, params.threshold)
             for j in range(p)}
    # The coordinator and participant 0 together hold every self-mask seed: with them the shard-0
    # rows of the others still carry their pairwise masks (uniform), and only their sum with
    # participant 0's own row unmasks (the seeds are right: the sum comes out exact).
    total = np.zeros(n // p, dtype=np.uint32)
    for j, (off, row) in rows.items():
        unseeded = row - prg(seeds[j], n)[off:off + row.size]
        assert_bytes_uniform(unseeded)
        total[off:off + row.size] += unseeded
    assert sw.secure[0].cost.revealed == p
    plain_sum = np.sum([quantize(x, PARAMS)[:n // p] for x in sw.xs], axis=0, dtype=np.uint32)
    five = np.sum([quantize(x, PARAMS)[:n // p] for x in sw.xs[1:]], axis=0, dtype=np.uint32)
    assert not np.array_equal(total, five)  # five rows of six: still masked
    np.testing.assert_array_equal(total + mine[0][:n // p] - prg(seeds[0], n)[:n // p], plain_sum)
